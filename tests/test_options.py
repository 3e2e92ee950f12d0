"""The architecture options and presets (issue 10): each changes the model the way it claims,
and every combination decodes, caches, saves and loads like the default."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from checkpoint import build_model, load_checkpoint, save_checkpoint
from config import PRESETS, Config, parse_config
from dataset import EOS, PAD, SOS, BilingualDataset, Collator
from model import (MultiHeadAttentionBlock, ResidualConnection, RMSNormalization,
                   RotaryPositionalEmbedding, SwiGLUFeedForwardBlock, beam_search,
                   build_transformer, greedy_decode, swiglu_width)
from train import make_loss, make_optimizer, train_step

OPTIONS = {
    "default": {},
    "paper": dict(norm_first=False, shared_vocab=True, tie_embeddings="all"),
    "modern": dict(norm="rms", ffn="swiglu", pos="rope", n_kv_heads=2, tie_embeddings="decoder"),
    "rope_post_gqa1": dict(pos="rope", norm_first=False, n_kv_heads=1),
}


def small(seed=0, vocab=24, **options):
    torch.manual_seed(seed)
    return build_transformer(vocab, vocab, 40, 40, d_model=16, N=2, h=4, d_ff=32, dropout=0.0,
                             **options).eval()


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


@pytest.mark.parametrize("name", OPTIONS)
def test_cached_decoding_and_batched_beam_hold_for_every_option(name):
    model = small(**OPTIONS[name])
    src = torch.randint(4, 24, (3, 7))
    src[1, 5:] = PAD
    src_mask = (src != PAD)[:, None, None, :]
    cached = greedy_decode(model, src, src_mask, SOS, EOS, 12)
    full = greedy_decode(model, src, src_mask, SOS, EOS, 12, use_cache=False)
    assert cached == full
    batched = beam_search(model, src, src_mask, SOS, EOS, 10, beam=3, nbest=2)
    for i in range(3):
        n = int(src_mask[i].sum())
        alone = beam_search(model, src[i:i + 1, :n], src_mask[i:i + 1, ..., :n], SOS, EOS, 10,
                            beam=3, nbest=2)
        assert [h for h, _ in alone[0]] == [h for h, _ in batched[i]], (name, i)
        for (_, a), (_, b) in zip(alone[0], batched[i]):
            assert a == pytest.approx(b, abs=1e-4)


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_every_preset_trains_and_translates_after_a_save_load_round_trip(preset, tmp_path):
    config, given = parse_config(["--preset", preset, "--d_model", "32", "--N", "1",
                                  "--d_ff", "64", "--dropout", "0", "--seq_len", "24"])
    assert {k for k, v in PRESETS[preset].items()
            if k not in ("d_model", "N", "d_ff", "dropout", "seq_len")} <= given
    vocab = 30
    model = build_model(config, vocab, vocab)
    torch.manual_seed(0)
    ds = BilingualDataset([torch.randint(4, vocab, (6,)).tolist() for _ in range(4)],
                          [torch.randint(4, vocab, (5,)).tolist() for _ in range(4)],
                          [""] * 4, [""] * 4)
    batch = Collator()([ds[i] for i in range(4)])
    optimizer = make_optimizer(model, 3e-3)
    loss_fn = make_loss(config)
    losses = []
    for _ in range(15):
        losses.append(float(train_step(model, [batch], loss_fn, PAD, "cpu")[0]))
        optimizer.step()
        optimizer.zero_grad()
    assert losses[-1] < 0.7 * losses[0], (preset, losses)
    save_checkpoint({"model_state_dict": model.state_dict(), "config": config.to_dict(),
                     "epoch": 0, "global_step": 15}, tmp_path / "p.pt")
    state = load_checkpoint(tmp_path / "p.pt")
    loaded = build_model(Config.from_dict(state["config"]), vocab, vocab)
    loaded.load_state_dict(state["model_state_dict"])
    model.eval(), loaded.eval()
    src = batch["encoder_input"]
    args = (src, batch["encoder_mask"], SOS, EOS, 8)
    assert greedy_decode(model, *args) == greedy_decode(loaded, *args)


def test_old_true_false_tie_embeddings_still_load():
    old = dataclasses.asdict(Config())
    for value, expected in ((True, "decoder"), (False, "none")):
        old["tie_embeddings"] = value
        assert Config.from_dict(old).tie_embeddings == expected
    legacy = {k: v for k, v in old.items() if k not in ("norm", "ffn", "pos", "n_kv_heads")}
    assert Config.from_dict(legacy).pos == "sinusoidal"  # options saved before they existed


@pytest.mark.parametrize("rates, random", [
    ((0.0, 0.0, 0.0), False), ((0.0, 0.5, 0.0), True), ((0.0, 0.0, 0.5), True),
    ((0.5, 0.0, 0.0), True)])
def test_each_dropout_rate_reaches_its_place(rates, random):
    """Issue 18: --dropout is the paper's residual (and embedding) dropout; the attention
    weights and the feed-forward activations have rates of their own (fairseq's recipe sets
    them apart)."""
    dropout, attention, activation = rates
    torch.manual_seed(0)
    model = build_transformer(24, 24, 16, 16, d_model=16, N=1, h=2, d_ff=32, dropout=dropout,
                              attention_dropout=attention, activation_dropout=activation)
    src, tgt = torch.randint(4, 24, (2, 7)), torch.randint(4, 24, (2, 6))
    mask = torch.ones(2, 1, 1, 7, dtype=torch.bool)
    model.train()
    assert (not torch.equal(model(src, tgt, mask), model(src, tgt, mask))) == random
    # checkpoints of earlier versions had one rate for all three
    old = Config.from_dict({"dropout": 0.3})
    assert (old.attention_dropout, old.activation_dropout) == (0.3, 0.3)


def test_a_scaled_embedding_has_unit_size_beside_the_positions():
    """Issue 18: embeddings were Xavier-initialised, then scaled by sqrt(d_model): about 0.16
    per feature for a 10k vocabulary at 128 wide, beside positional encodings of about 0.7.
    N(0, 1/d_model) gives unit size, as fairseq's."""
    for tie in ("none", "all"):
        model = build_transformer(10000, 10000, 16, 16, d_model=128, N=1, h=4, d_ff=64,
                                  tie_embeddings=tie, shared_vocab=tie == "all")
        x = model.src_embed(torch.arange(10000))  # (vocab, d_model)
        assert x.pow(2).mean().sqrt().item() == pytest.approx(1.0, abs=0.02)
