"""Section by section: each piece of the architecture does what the paper (or, for an addition, its
own paper) says."""

import math

import pytest
import torch
import torch.nn.functional as F
from conftest import small, tiny_model

from config import Config
from kernels import Dropout
from model import (FeedForwardBlock, LabelSmoothedCrossEntropy, LayerNormalization,
                   MultiHeadAttentionBlock, PositionalEncoding, ResidualConnection,
                   RMSNormalization, RotaryPositionalEmbedding, SwiGLUFeedForwardBlock, attention,
                   build_transformer, causal_mask, swiglu_width)
from tokenizer import PAD


def test_changing_a_later_target_token_never_changes_earlier_outputs():
    model = tiny_model()
    src = torch.randint(4, 20, (2, 7))
    src_mask = torch.ones(2, 1, 1, 7, dtype=torch.bool)
    tgt = torch.randint(4, 20, (2, 9))
    changed = tgt.clone()
    changed[:, 5:] = (changed[:, 5:] + 3) % 16 + 4  # every token from position 5 on differs
    mask = causal_mask(9)
    out = model(src, tgt, src_mask, mask)
    out_changed = model(src, changed, src_mask, mask)
    torch.testing.assert_close(out[:, :5], out_changed[:, :5])
    assert not torch.allclose(out[:, 5:], out_changed[:, 5:])
    # Without the causal mask, the future does leak: the mask is what hides it.
    full = torch.ones(1, 9, 9, dtype=torch.bool)
    assert not torch.allclose(model(src, tgt, src_mask, full)[:, :5],
                              model(src, changed, src_mask, full)[:, :5])


def test_padding_never_changes_the_outputs_of_real_tokens():
    model = tiny_model()
    src = torch.randint(4, 20, (1, 6))
    tgt = torch.randint(4, 20, (1, 5))
    out = model(src, tgt, torch.ones(1, 1, 1, 6, dtype=torch.bool), causal_mask(5))
    src_padded = torch.cat([src, torch.full((1, 4), PAD)], dim=1)  # (1, 10)
    tgt_padded = torch.cat([tgt, torch.full((1, 3), PAD)], dim=1)  # (1, 8)
    src_mask = (src_padded != PAD)[:, None, None, :]
    tgt_mask = (tgt_padded != PAD)[:, None, None, :] & causal_mask(8)
    out_padded = model(src_padded, tgt_padded, src_mask, tgt_mask)
    torch.testing.assert_close(out_padded[:, :5], out, atol=1e-5, rtol=1e-5)
    # ... and the encoder mask is what makes it so.
    unmasked = model(src_padded, tgt_padded, torch.ones_like(src_mask), tgt_mask)
    assert not torch.allclose(unmasked[:, :5], out, atol=1e-4)


def test_without_a_target_mask_the_decoder_is_causal_and_ignores_right_padding():
    """Training passes no decoder mask (so SDPA may use flash attention): the outputs at real
    positions equal those under the write-ups' causal-and-padding mask, and a later token
    never changes an earlier output, on the fused and the written-out attention paths."""
    model = tiny_model()
    src = torch.randint(4, 20, (2, 6))
    tgt = torch.randint(4, 20, (2, 8))
    tgt[0, 5:] = PAD  # a right-padded target
    src_mask = torch.ones(2, 1, 1, 6, dtype=torch.bool)
    full_mask = (tgt != PAD)[:, None, None, :] & causal_mask(8)
    for reference in (False, True):
        for m in model.modules():
            if isinstance(m, MultiHeadAttentionBlock):
                m.use_reference = reference
        expected = model(src, tgt, src_mask, full_mask)
        out = model(src, tgt, src_mask)  # no tgt_mask: causal
        torch.testing.assert_close(out[0, :5], expected[0, :5], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(out[1], expected[1], atol=1e-5, rtol=1e-5)
        changed = tgt.clone()
        changed[1, 6] = (changed[1, 6] + 1 - 4) % 16 + 4
        torch.testing.assert_close(model(src, changed, src_mask)[1, :6], out[1, :6])


def test_positional_encoding_equals_the_formula():
    d_model, seq_len = 16, 50
    pe = PositionalEncoding(d_model, seq_len, dropout=0.0).pe[0]
    for pos in (0, 1, 7, 49):
        for i in range(d_model // 2):
            angle = pos / 10000 ** (2 * i / d_model)
            assert pe[pos, 2 * i].item() == pytest.approx(math.sin(angle), abs=1e-5)
            assert pe[pos, 2 * i + 1].item() == pytest.approx(math.cos(angle), abs=1e-5)
    x = torch.zeros(2, 5, d_model)
    enc = PositionalEncoding(d_model, seq_len, dropout=0.0)
    torch.testing.assert_close(enc(x, start=3), pe[3:8].expand(2, 5, d_model))


def test_layer_norm_equals_the_written_out_formula_and_torch():
    torch.manual_seed(0)
    norm = LayerNormalization(24)
    with torch.no_grad():
        norm.alpha.uniform_(0.5, 1.5)
        norm.bias.uniform_(-0.5, 0.5)
    x = torch.randn(3, 7, 24) * 4 + 2
    expected = F.layer_norm(x, (24,), norm.alpha, norm.bias, eps=1e-6)
    torch.testing.assert_close(norm(x), expected)
    torch.testing.assert_close(norm.reference(x), expected, atol=1e-5, rtol=1e-5)
    out = norm.reference(x)
    assert out.shape == x.shape


@pytest.mark.parametrize("cross", [False, True])
@pytest.mark.parametrize("masked", [False, True])
def test_fused_attention_equals_the_reference_math(cross, masked):
    torch.manual_seed(0)
    block = MultiHeadAttentionBlock(32, 4, dropout=0.0).eval()
    x = torch.randn(3, 6, 32)
    memory = torch.randn(3, 9, 32) if cross else None
    mask = None
    if masked:
        lengths = torch.tensor([9, 5, 2]) if cross else torch.tensor([6, 4, 1])
        keys = 9 if cross else 6
        mask = (torch.arange(keys)[None, :] < lengths[:, None])[:, None, None, :]
        if not cross:
            mask = mask & causal_mask(6)
    fused = block(x, memory, mask)
    block.use_reference = True
    reference = block(x, memory, mask)
    torch.testing.assert_close(fused, reference, atol=1e-5, rtol=1e-5)
    # ... and the written-out attention is exactly the paper's formula
    q, k, v = (torch.randn(2, 4, 5, 8) for _ in range(3))
    out, weights = attention(q, k, v, None)
    manual = torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(8), dim=-1)
    torch.testing.assert_close(weights, manual)
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v), atol=1e-5,
                               rtol=1e-5)


def test_tied_embeddings_share_one_tensor():
    model = tiny_model(tie_embeddings=True)
    assert model.projection_layer.proj.weight is model.tgt_embed.embedding.weight
    names = [n for n, _ in model.named_parameters()]
    assert "projection_layer.proj.weight" not in names  # counted (and optimized) once
    with torch.no_grad():
        model.tgt_embed.embedding.weight[5].fill_(0.25)
    assert torch.all(model.projection_layer.proj.weight[5] == 0.25)
    untied = tiny_model(tie_embeddings=False)
    assert untied.projection_layer.proj.weight is not untied.tgt_embed.embedding.weight


def test_rmsnorm_output_has_unit_root_mean_square():
    norm = RMSNormalization(32)
    x = torch.randn(3, 5, 32) * 7 + 2
    rms = norm(x).pow(2).mean(-1).sqrt()
    torch.testing.assert_close(rms, torch.ones(3, 5), atol=1e-4, rtol=1e-4)
    assert not torch.allclose(norm(x).mean(-1), torch.zeros(3, 5), atol=1e-2)  # no centring


def test_rope_scores_depend_only_on_relative_position():
    rope = RotaryPositionalEmbedding(8, 64)
    q, k = torch.randn(1, 1, 1, 8), torch.randn(1, 1, 1, 8)
    def score(m, n):
        return (rope(q, m) * rope(k, n)).sum()
    for m, n, shift in ((3, 1, 5), (0, 7, 20), (10, 10, 33)):
        torch.testing.assert_close(score(m, n), score(m + shift, n + shift))
    assert not torch.allclose(score(3, 1), score(3, 2))  # but they do depend on m - n
    torch.testing.assert_close(rope(q, 0), q)  # position 0: no rotation
    torch.testing.assert_close(rope(q, 9).norm(), q.norm())  # a rotation keeps the length


def test_gqa_is_multi_head_attention_with_shared_key_value_heads():
    torch.manual_seed(0)
    x = torch.randn(2, 5, 16)
    gqa = MultiHeadAttentionBlock(16, 4, 0.0, n_kv_heads=2).eval()
    mha = MultiHeadAttentionBlock(16, 4, 0.0).eval()
    assert sum(p.numel() for p in gqa.parameters()) < sum(p.numel() for p in mha.parameters())
    # MHA whose heads 0,1 use GQA's key/value head 0 and heads 2,3 its head 1: same output
    w = gqa.w_qkv.weight.detach()  # (16 + 2·8, 16)
    q, k, v = w[:16], w[16:24], w[24:32]
    def repeat(m):
        return m.view(2, 4, 16).repeat_interleave(2, dim=0).reshape(16, 16)
    with torch.no_grad():
        mha.w_qkv.weight.copy_(torch.cat([q, repeat(k), repeat(v)]))
        mha.w_o.weight.copy_(gqa.w_o.weight)
    torch.testing.assert_close(gqa(x), mha(x), atol=1e-6, rtol=1e-5)
    # and with n_kv_heads == h it is plain multi-head attention, written out
    full = MultiHeadAttentionBlock(16, 4, 0.0, n_kv_heads=4).eval()
    qf, kf, vf = (t.view(2, 5, 4, 4).transpose(1, 2)
                  for t in (x @ full.w_qkv.weight.T).split(16, -1))
    expected = F.softmax(qf @ kf.transpose(-2, -1) / 2.0, -1) @ vf  # sqrt(d_k) = 2
    torch.testing.assert_close(full(x), full.w_o(expected.transpose(1, 2).reshape(2, 5, 16)),
                               atol=1e-6, rtol=1e-5)


def test_written_out_attention_shares_grouped_key_value_heads_as_copies_would():
    """Issue 25: `attention` takes fewer key/value heads than query heads and lays each one's
    query heads side by side against it instead of copying it (repeat_interleave, whose
    backward is a sum): the outputs, weights and gradients of the copies, masked or causal."""
    torch.manual_seed(0)
    q = torch.randn(2, 6, 5, 8, requires_grad=True)
    k, v = (torch.randn(2, 3, 7, 8, requires_grad=True) for _ in range(2))
    padding = (torch.arange(7) < torch.tensor([[7], [4]]))[:, None, None, :]  # (2, 1, 1, 7)
    for mask in (padding, causal_mask(7)[:, 2:]):  # the last 5 of 7 positions, causal
        shared = attention(q, k, v, mask)
        shared_grads = torch.autograd.grad(shared[0].square().sum(), (q, k, v))
        copied = attention(q, k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1), mask)
        copied_grads = torch.autograd.grad(copied[0].square().sum(), (q, k, v))
        for a, b in zip(shared + shared_grads, copied + copied_grads):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_cpu_bf16_attention_runs_written_out_not_torchs_fused_kernel(monkeypatch):
    """Issue 25: on CPU torch's fused attention is 3 to 10 times slower in bf16 than the
    written-out products at sentence lengths (docs/performance.md), so under bf16 autocast the
    model runs `attention` itself, in training and in evaluation, and gives fp32's outputs
    within bf16's rounding."""
    from nmt.trained_model import build_model
    model = build_model(Config(d_model=32, N=1, h=4, d_ff=64, seq_len=16, n_kv_heads=2,
                               attention_dropout=0.0), 30, 30).eval()
    src, tgt = torch.randint(4, 30, (2, 9)), torch.randint(4, 30, (2, 6))
    mask = torch.ones(2, 1, 1, 9, dtype=torch.bool)
    with torch.no_grad():
        expected = model(src, tgt, mask)  # fp32: the fused kernel
        monkeypatch.setattr(F, "scaled_dot_product_attention",
                            lambda *a, **k: pytest.fail("the fused kernel ran in bf16 on CPU"))
        for training in (False, True):
            model.train(training)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = model(src, tgt, mask)
            if not training:
                torch.testing.assert_close(out.float(), expected, atol=0.1, rtol=0.05)


def test_grouped_query_attention_shares_key_value_heads_without_copying_them(monkeypatch):
    """19. Grouped-query attention copied its keys and values with repeat_interleave; the
    fused kernel shares them (enable_gqa). Same outputs as the written-out math."""
    from nmt.trained_model import build_model
    model = build_model(Config(d_model=32, N=1, h=4, d_ff=64, seq_len=16, n_kv_heads=2),
                        30, 30).eval()
    src, tgt = torch.randint(4, 30, (2, 9)), torch.randint(4, 30, (2, 6))
    mask = torch.ones(2, 1, 1, 9, dtype=torch.bool)
    with torch.no_grad():
        for module in model.modules():
            if hasattr(module, "use_reference"):
                module.use_reference = True
        expected = model(src, tgt, mask)
        for module in model.modules():
            if hasattr(module, "use_reference"):
                module.use_reference = False
        monkeypatch.setattr(torch.Tensor, "repeat_interleave",
                            lambda *a, **k: pytest.fail("keys and values copied"))
        torch.testing.assert_close(model(src, tgt, mask), expected)


def test_n_dec_sets_the_decoders_depth_alone_and_the_checkpoint_config_rebuilds_it():
    """Kasai et al. (2021), a deep encoder with a shallow decoder: --N_dec layers in the
    decoder, --N in the encoder; 0 (the default) means --N, as in the paper. A checkpoint's
    config rebuilds the same depths (translate.py takes them from there)."""
    from nmt.trained_model import build_model
    model = build_transformer(20, 20, 16, 16, d_model=16, N=3, N_dec=1, h=2, d_ff=32)
    assert (len(model.encoder.layers), len(model.decoder.layers)) == (3, 1)
    paper = build_transformer(20, 20, 16, 16, d_model=16, N=3, h=2, d_ff=32)
    assert (len(paper.encoder.layers), len(paper.decoder.layers)) == (3, 3)
    config = Config(d_model=16, N=3, N_dec=1, h=2, d_ff=32, seq_len=16)
    rebuilt = build_model(Config.from_dict(config.to_dict()), 20, 20)
    rebuilt.load_state_dict(model.state_dict())  # strict: the same modules, the same shapes
    assert Config(N=4).decoder_layers() == 4 and Config(N=4, N_dec=2).decoder_layers() == 2
    assert Config(N=4).depth() == "4" and Config(N=4, N_dec=2).depth() == "4+2"
    assert Config.from_dict({"N": 5}).decoder_layers() == 5  # a checkpoint from before N_dec


def test_a_configs_dropout_rates_each_reach_their_place_in_the_model_it_rebuilds():
    """build_model (train.py's model, and a checkpoint's rebuilt): --dropout, --attention_dropout
    and --activation_dropout each reach their own Dropouts, as build_transformer places them."""
    from nmt.trained_model import build_model
    model = build_model(Config(d_model=16, N=1, h=2, d_ff=32, seq_len=16, dropout=0.1,
                               attention_dropout=0.2, activation_dropout=0.3), 24, 24)
    rates = {}
    for name, module in model.named_modules():
        if isinstance(module, Dropout):
            owner = type(model.get_submodule(name.rpartition(".")[0]))
            rates.setdefault(owner, set()).add(module.p)
    assert rates.pop(MultiHeadAttentionBlock) == {0.2} and rates.pop(FeedForwardBlock) == {0.3}
    assert set.union(*rates.values()) == {0.1}


def test_tie_all_shares_one_tensor_among_three_modules():
    model = small(shared_vocab=True, tie_embeddings="all")
    tensors = {model.src_embed.embedding.weight.data_ptr(),
               model.tgt_embed.embedding.weight.data_ptr(),
               model.projection_layer.proj.weight.data_ptr()}
    assert len(tensors) == 1
    decoder_only = small(tie_embeddings="decoder")
    assert decoder_only.src_embed.embedding.weight.data_ptr() != \
        decoder_only.tgt_embed.embedding.weight.data_ptr()
    assert decoder_only.tgt_embed.embedding.weight.data_ptr() == \
        decoder_only.projection_layer.proj.weight.data_ptr()
    with pytest.raises(ValueError, match="needs shared_vocab"):
        small(tie_embeddings="all")


def test_post_norm_normalises_after_the_residual_add_and_pre_norm_before():
    torch.manual_seed(0)
    x = torch.randn(2, 3, 8) * 4 + 1
    sublayer = torch.nn.Linear(8, 8)
    post = ResidualConnection(8, 0.0, norm_first=False)
    pre = ResidualConnection(8, 0.0, norm_first=True)
    torch.testing.assert_close(post(x, sublayer), F.layer_norm(x + sublayer(x), (8,), eps=1e-6))
    torch.testing.assert_close(pre(x, sublayer), x + sublayer(F.layer_norm(x, (8,), eps=1e-6)))
    assert isinstance(small(norm_first=False).encoder.norm, torch.nn.Identity)


def test_swiglu_matches_its_formula_and_keeps_the_parameter_count():
    torch.manual_seed(0)
    block = SwiGLUFeedForwardBlock(16, 48, 0.0)
    x = torch.randn(2, 3, 16)
    w1, w3, w2 = block.linear_1.weight, block.linear_3.weight, block.linear_2.weight
    torch.testing.assert_close(block(x), (F.silu(x @ w1.T) * (x @ w3.T)) @ w2.T)
    assert swiglu_width(2048) == 1368 and swiglu_width(48) == 32
    relu = sum(p.numel() for p in small().parameters())
    swiglu = sum(p.numel() for p in small(ffn="swiglu").parameters())
    assert abs(swiglu - relu) / relu < 0.05


def test_each_dropout_rate_reaches_its_place():
    """Issue 18: --dropout is the paper's residual (and embedding) dropout; the attention
    weights and the feed-forward activations have rates of their own (fairseq's recipe sets
    them apart). Each Dropout holds its rate, and each rate at 1 (all dropped) in training
    does what its place implies."""
    def build(dropout=0.0, attention=0.0, activation=0.0, pos="sinusoidal"):
        torch.manual_seed(0)
        return build_transformer(24, 24, 16, 16, d_model=16, N=1, h=2, d_ff=32, dropout=dropout,
                                 attention_dropout=attention, activation_dropout=activation,
                                 pos=pos).train()
    model = build(0.1, 0.2, 0.3)
    for name, module in model.named_modules():
        if isinstance(module, Dropout):
            owner = type(model.get_submodule(name.rpartition(".")[0]))
            assert module.p == {MultiHeadAttentionBlock: 0.2, FeedForwardBlock: 0.3}.get(owner, 0.1)
    src, other, tgt = torch.randint(4, 24, (2, 7)), torch.randint(4, 24, (2, 7)), \
        torch.randint(4, 24, (2, 6))
    mask = torch.ones(2, 1, 1, 7, dtype=torch.bool)
    for pos in ("sinusoidal", "rope"):  # embeddings (and positions) dropped, and each sublayer's
        model = build(dropout=1.0, pos=pos)  # output: every position's logits are those of 0
        logits = model(src, tgt, mask)
        torch.testing.assert_close(logits, model.project(torch.zeros(16)).expand_as(logits))
    model = build(attention=1.0)  # no attention weights: the source is never seen
    assert torch.equal(model(src, tgt, mask), model(other, tgt, mask))
    model = build(activation=1.0)  # no hidden activations: the first layers have no effect
    logits = model(src, tgt, mask)
    with torch.no_grad():
        for block in model.modules():
            if isinstance(block, FeedForwardBlock):
                block.linear_1.weight.normal_()
    assert torch.equal(model(src, tgt, mask), logits)
    for ffn in ("relu", "swiglu"):  # what each Dropout is given: the attention weights
        model = build_transformer(24, 24, 16, 16, d_model=16, N=1, h=2, d_ff=32, ffn=ffn,
                                  dropout=0.1, attention_dropout=0.2,
                                  activation_dropout=0.3).train()  # (batch, h, q, k), the
        seen = {}  # hidden activations (batch, len, hidden), the rest (batch, len, d_model)
        for name, module in model.named_modules():
            if isinstance(module, Dropout):
                module.register_forward_pre_hook(
                    lambda m, args, name=name, seen=seen: seen.setdefault(name, set()).add(
                        (m.p, tuple(args[0].shape[1:]))))
        model(src, tgt, mask)
        hidden = model.encoder.layers[0].feed_forward_block.linear_1.out_features
        for name, module in model.named_modules():
            if isinstance(module, Dropout):
                owner = type(model.get_submodule(name.rpartition(".")[0]))
                places = {p for p, shape in seen.get(name, ())}, {
                    "attention" if len(shape) == 3 and shape[-1] in (7, 6) else  # keys
                    "hidden" if shape[-1] == hidden and
                    hidden != 16 else "model" for p, shape in seen.get(name, ())}
                expected = ({0.2}, {"attention"}) if owner is MultiHeadAttentionBlock else \
                    ({0.3}, {"hidden"}) if owner in (FeedForwardBlock, SwiGLUFeedForwardBlock) \
                    else ({0.1}, {"model"})
                assert places == expected, (ffn, name, seen.get(name))
    x = torch.randn(2, 3, 16)  # the sublayer's output dropped, before post-norm's norm
    for norm_first in (True, False):
        connection = ResidualConnection(16, 1.0, norm_first=norm_first).train()
        expected = x if norm_first else connection.norm(x)
        torch.testing.assert_close(connection(x, torch.sin), expected)
    # checkpoints of earlier versions had one rate for all three
    old = Config.from_dict({"dropout": 0.3})
    assert (old.attention_dropout, old.activation_dropout) == (0.3, 0.3)


def test_label_smoothed_loss_is_torchs_cross_entropy_on_the_logits():
    """Section 5.4's formula as written: (1 - ε) · -log p(label) + ε · mean_j -log p(j), summed
    over the real positions, equals nn.CrossEntropyLoss(label_smoothing=ε, reduction="sum"),
    with padding ignored, for the default ignore_index (-100) too."""
    torch.manual_seed(0)
    x = torch.randn(2, 7, 16)
    projection = build_transformer(40, 40, 8, 8, d_model=16, N=1, h=2, d_ff=32).projection_layer
    for smoothing in (0.0, 0.1, 0.3):
        for ignore in (PAD, -100):
            label = torch.randint(4, 40, (2, 7))
            label[1, 4:] = ignore
            expected = torch.nn.CrossEntropyLoss(ignore_index=ignore, label_smoothing=smoothing,
                                                 reduction="sum")(projection(x).view(-1, 40),
                                                                  label.view(-1))
            loss = LabelSmoothedCrossEntropy(smoothing, ignore)(x, projection, label)
            torch.testing.assert_close(loss, expected)


def test_a_scaled_embedding_has_unit_size_beside_the_positions():
    """Issue 18: embeddings were Xavier-initialised, then scaled by sqrt(d_model): about 0.16
    per feature for a 10k vocabulary at 128 wide, beside positional encodings of about 0.7.
    N(0, 1/d_model) gives unit size, as fairseq's."""
    for tie in ("none", "all"):
        model = build_transformer(10000, 10000, 16, 16, d_model=128, N=1, h=4, d_ff=64,
                                  tie_embeddings=tie, shared_vocab=tie == "all")
        for embed in (model.src_embed, model.tgt_embed):
            x = embed(torch.arange(10000))  # (vocab, d_model)
            assert x.pow(2).mean().sqrt().item() == pytest.approx(1.0, abs=0.02)


def test_rope_rotates_each_feature_pair_by_its_positions_angle():
    """RoPE's angles themselves: at position m, the pair of features (i, i + d_k/2) is rotated
    by m · 10000^(-2i/d_k), x1 cos - x2 sin and x1 sin + x2 cos. The relative-position test
    above holds for any frequencies and either direction; this one pins them."""
    torch.manual_seed(0)
    d_k, half = 8, 4
    rope = RotaryPositionalEmbedding(d_k, 64)
    x = torch.randn(1, 1, 1, d_k, dtype=torch.float64)
    for m in (1, 5, 63):
        out = rope(x.float(), m)[0, 0, 0]
        for i in range(half):
            angle = m * 10000 ** (-2 * i / d_k)
            x1, x2 = x[0, 0, 0, i].item(), x[0, 0, 0, i + half].item()
            assert out[i].item() == pytest.approx(x1 * math.cos(angle) - x2 * math.sin(angle),
                                                  abs=1e-4)
            assert out[i + half].item() == pytest.approx(
                x1 * math.sin(angle) + x2 * math.cos(angle), abs=1e-4)


def test_pre_norm_stacks_end_with_a_norm_and_post_norm_stacks_do_not():
    """A pre-norm stack's output is the sum of unnormalised sublayer outputs, so the encoder and
    the decoder each end with a norm of the kind asked for; a post-norm stack already ends
    normalised and has none (no extra parameters: a post-norm checkpoint has no
    encoder.norm/decoder.norm keys). Held for the decoder too, not only the encoder."""
    for norm, kind in (("layer", LayerNormalization), ("rms", RMSNormalization)):
        pre, post = small(norm=norm), small(norm=norm, norm_first=False)
        for stack in (pre.encoder, pre.decoder):
            assert type(stack.norm) is kind
        for stack in (post.encoder, post.decoder):
            assert isinstance(stack.norm, torch.nn.Identity)
        assert not [k for k in post.state_dict() if k.startswith(("encoder.norm", "decoder.norm"))]
    # and the pre-norm decoder's output is normalised (gain 1, bias 0 at initialisation)
    model = small()
    src = torch.randint(4, 24, (2, 5))
    mask = torch.ones(2, 1, 1, 5, dtype=torch.bool)
    out = model.decode(model.encode(src, mask), mask, torch.randint(4, 24, (2, 6)))
    torch.testing.assert_close(out.mean(-1), torch.zeros(2, 6), atol=1e-5, rtol=0)
    torch.testing.assert_close(out.var(-1, unbiased=False), torch.ones(2, 6), atol=1e-3, rtol=0)


@pytest.mark.parametrize("pos", ["sinusoidal", "rope"])
def test_a_sequence_of_exactly_seq_len_positions_fits_and_one_more_is_refused(pos):
    """seq_len is the longest sequence: one of exactly seq_len positions encodes and decodes
    (also as the last position of cached decoding), one of seq_len + 1 is refused, for the
    sinusoids' table and for rotary positions' check alike (no off-by-one at the boundary)."""
    model = build_transformer(20, 20, 8, 8, d_model=16, N=1, h=2, d_ff=32, dropout=0.0,
                              pos=pos).eval()
    src, mask = torch.randint(4, 20, (1, 8)), torch.ones(1, 1, 1, 8, dtype=torch.bool)
    assert model(src, src, mask).shape == (1, 8, 20)
    assert model.tgt_pos(torch.zeros(1, 1, 16), start=7).shape == (1, 1, 16)
    for call in (lambda: model.encode(torch.randint(4, 20, (1, 9)),
                                      torch.ones(1, 1, 1, 9, dtype=torch.bool)),
                 lambda: model.tgt_pos(torch.zeros(1, 1, 16), start=8)):
        with pytest.raises(ValueError, match="longer than seq_len"):
            call()


@pytest.mark.parametrize("lengths", [(6, 12), (12, 6)])
def test_rotary_positions_cover_the_longer_of_source_and_target(lengths):
    """One rotary table serves the encoder and the decoder: it holds max(src_seq_len,
    tgt_seq_len) positions, so a target longer than the longest source (or the reverse)
    still gets its rotations."""
    src_len, tgt_len = lengths
    model = build_transformer(20, 20, src_len, tgt_len, d_model=16, N=1, h=2, d_ff=32,
                              dropout=0.0, pos="rope").eval()
    assert model.rotary.cos.size(0) == max(lengths)
    src, tgt = torch.randint(4, 20, (1, src_len)), torch.randint(4, 20, (1, tgt_len))
    assert model(src, tgt, torch.ones(1, 1, 1, src_len, dtype=torch.bool)).shape == \
        (1, tgt_len, 20)


def test_attention_and_activation_dropout_default_to_the_dropout_rate():
    """build_transformer's attention_dropout and activation_dropout left out (None) take
    --dropout's rate, as the paper's one rate for all: every Dropout of the model holds it."""
    model = build_transformer(24, 24, 16, 16, d_model=16, N=1, h=2, d_ff=32, dropout=0.3)
    rates = {m.p for m in model.modules() if isinstance(m, Dropout)}
    assert rates == {0.3}


def test_the_fused_attention_kernel_drops_attention_weights_in_training(monkeypatch):
    """Where the fused kernel runs in training (a GPU: kernels.written_out_attention_is_faster
    is False), attention dropout reaches it as dropout_p: at rate 1 no attention weight is left,
    so the source is never seen. Forced here on CPU, where training runs the written-out path."""
    import model as model_module
    monkeypatch.setattr(model_module, "written_out_attention_is_faster", lambda q, dropout: False)
    calls = []
    real = F.scaled_dot_product_attention
    monkeypatch.setattr(F, "scaled_dot_product_attention",
                        lambda *a, **k: calls.append(k["dropout_p"]) or real(*a, **k))
    torch.manual_seed(0)
    model = build_transformer(24, 24, 16, 16, d_model=16, N=1, h=2, d_ff=32, dropout=0.0,
                              attention_dropout=1.0).train()
    src, other, tgt = (torch.randint(4, 24, (2, n)) for n in (7, 7, 6))
    mask = torch.ones(2, 1, 1, 7, dtype=torch.bool)
    assert torch.equal(model(src, tgt, mask), model(other, tgt, mask))
    assert calls and set(calls) == {1.0}
    model.eval()
    assert not torch.equal(model(src, tgt, mask), model(other, tgt, mask))
    assert set(calls[-3:]) == {0.0}  # no dropout in evaluation


@pytest.mark.parametrize("pos", ["sinusoidal", "rope"])
def test_decoding_several_new_positions_after_cached_ones_equals_decoding_them_at_once(pos):
    """The cache hook of model.decode: the target decoded in chunks (3 positions, then 2 with
    their explicit mask, then 1) through one cache gives the outputs of the whole target
    decoded at once; the cache's length advances by each chunk's positions, which place the
    next chunk's positions (sinusoids, rotations) and its keys."""
    from nmt.decoding import new_cache
    model = tiny_model(pos=pos)
    src, tgt = torch.randint(4, 20, (2, 7)), torch.randint(4, 20, (2, 6))
    src_mask = torch.ones(2, 1, 1, 7, dtype=torch.bool)
    memory = model.encode(src, src_mask)
    whole = model.decode(memory, src_mask, tgt)
    cache = new_cache(model, capacity=6)
    chunks = [model.decode(memory, src_mask, tgt[:, :3], cache=cache),
              model.decode(memory, src_mask, tgt[:, 3:5], causal_mask(5)[:, 3:], cache=cache),
              model.decode(memory, src_mask, tgt[:, 5:], cache=cache)]
    assert cache.length == 6
    torch.testing.assert_close(torch.cat(chunks, dim=1), whole, atol=1e-5, rtol=1e-5)


def test_rmsnorm_is_computed_in_float32_and_rounded_once_to_bf16():
    """RMSNorm's docstring: computed in float32 for stability under bf16. A bf16 input's output
    is the exact (float64) RMSNorm rounded once to bf16, not a bf16 mean of squares and a bf16
    rsqrt rounded again (which misses the exact rounding in about a third of the elements)."""
    torch.manual_seed(0)
    norm = RMSNormalization(64)
    x = (torch.randn(32, 64) * 3 + 1).bfloat16()
    exact = x.double() * torch.rsqrt(x.double().pow(2).mean(-1, keepdim=True) + norm.eps)
    out = norm(x)
    assert (out.bfloat16() != exact.bfloat16()).float().mean() < 0.01


def test_layer_norm_reference_takes_eps_inside_the_square_root():
    """The written-out LayerNorm is (x - mean) / sqrt(var + eps) · gain + bias, as torch's: with
    an eps that matters (0.5, unit-scale inputs) the reference still equals F.layer_norm, so
    eps cannot move outside the square root unseen (at 1e-6 the two places agree to 1e-5)."""
    torch.manual_seed(0)
    norm = LayerNormalization(16, eps=0.5)
    x = torch.randn(4, 16) * 0.5
    expected = F.layer_norm(x, (16,), eps=0.5)
    torch.testing.assert_close(norm(x), expected)
    torch.testing.assert_close(norm.reference(x), expected, atol=1e-5, rtol=1e-5)
