"""The architecture: masks, the paper's formulas, the fused paths against the written-out math,
and the decoders (cached == full, beam 1 == greedy, batched == one by one)."""

import math

import pytest
import torch
import torch.nn.functional as F

from model import (LayerNormalization, MultiHeadAttentionBlock, PackedLinear, PositionalEncoding,
                   beam_search, build_transformer, causal_mask, decoding_model, greedy_decode,
                   output_limits, translate_ids)

PAD, SOS, EOS = 1, 2, 3


def tiny_model(vocab=20, seq_len=32, seed=0, **kw):
    torch.manual_seed(seed)
    kw = {"d_model": 32, "N": 2, "h": 4, "d_ff": 64, "dropout": 0.0, **kw}
    return build_transformer(vocab, vocab, seq_len, seq_len, **kw).eval()


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
    out, weights = MultiHeadAttentionBlock.attention(q, k, v, None)
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


def memorized_model():
    """A tiny model trained on 6 pairs until it reproduces them (shared by the decoder tests)."""
    torch.manual_seed(0)
    pairs = [([4, 5, 6], [7, 8]), ([5, 9], [10, 11, 12]), ([6, 6, 4, 13], [14, 7]),
             ([13, 4], [15, 16, 8, 9]), ([9, 10, 11], [12]), ([7], [17, 18, 19])]
    model = tiny_model(vocab=20, seed=0)
    model.train()
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    src = torch.nn.utils.rnn.pad_sequence([torch.tensor([SOS] + s + [EOS]) for s, _ in pairs],
                                          batch_first=True, padding_value=PAD)
    dec = torch.nn.utils.rnn.pad_sequence([torch.tensor([SOS] + t) for _, t in pairs],
                                          batch_first=True, padding_value=PAD)
    label = torch.nn.utils.rnn.pad_sequence([torch.tensor(t + [EOS]) for _, t in pairs],
                                            batch_first=True, padding_value=PAD)
    src_mask = (src != PAD)[:, None, None, :]
    tgt_mask = (dec != PAD)[:, None, None, :] & causal_mask(dec.size(1))
    for _ in range(400):
        logits = model(src, dec, src_mask, tgt_mask)
        loss = F.cross_entropy(logits.view(-1, 20), label.view(-1), ignore_index=PAD)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if loss.item() < 0.01:
            break
    return model.eval(), pairs, src, src_mask


@pytest.fixture(scope="module")
def trained():
    return memorized_model()


def test_a_tiny_model_memorizes_a_tiny_corpus(trained):
    model, pairs, src, src_mask = trained
    out = greedy_decode(model, src, src_mask, SOS, EOS, max_len=10)
    assert out == [t for _, t in pairs]


def test_cached_greedy_equals_full_redecode(trained):
    model, _, src, src_mask = trained
    untrained = tiny_model(vocab=20, seed=3)  # long, EOS-free outputs exercise the cache more
    for m in (model, untrained):
        cached = greedy_decode(m, src, src_mask, SOS, EOS, max_len=15, use_cache=True)
        full = greedy_decode(m, src, src_mask, SOS, EOS, max_len=15, use_cache=False)
        assert cached == full


def test_batched_decoding_equals_one_by_one(trained):
    model, pairs, _, _ = trained
    srcs = [s for s, _ in pairs]
    batched = translate_ids(model, srcs, SOS, EOS, PAD, seq_len=32, batch_size=6)
    single = [translate_ids(model, [s], SOS, EOS, PAD, seq_len=32)[0] for s in srcs]
    assert batched == single == [t for _, t in pairs]
    beam_batched = translate_ids(model, srcs, SOS, EOS, PAD, seq_len=32, beam=3, batch_size=6)
    beam_single = [translate_ids(model, [s], SOS, EOS, PAD, seq_len=32, beam=3)[0] for s in srcs]
    assert beam_batched == beam_single


@pytest.mark.parametrize("design", [{}, {"norm_first": False, "tie_embeddings": "all",
                                         "shared_vocab": True},
                                    {"norm": "rms", "ffn": "swiglu", "pos": "rope",
                                     "n_kv_heads": 2}])
def test_the_prepacked_decoding_copy_shares_the_weights_and_decodes_the_same(design):
    """On CPU, translate_ids decodes with a copy whose decoder linear layers are prepacked for
    oneDNN: every one of them packed (none silently left out), no weight copied, the model
    itself untouched, and the same logits and outputs as the model's own layers."""
    if not torch.backends.mkldnn.is_available():
        pytest.skip("no oneDNN in this torch")
    model = tiny_model(vocab=20, seed=1, **design)
    packed = decoding_model(model, rows=8)
    linears = [m for m in [*model.projection_layer.modules(), *model.decoder.modules()]
               if isinstance(m, torch.nn.Linear)]
    assert sum(isinstance(m, PackedLinear) for m in packed.modules()) == len(linears) > 10
    assert not any(isinstance(m, PackedLinear) for m in model.modules())
    assert {p.data_ptr() for p in packed.parameters()} <= {p.data_ptr() for p in
                                                            model.parameters()}
    src = torch.randint(4, 20, (5, 7))
    src_mask = torch.ones(5, 1, 1, 7, dtype=torch.bool)
    tgt = torch.randint(4, 20, (5, 6))
    assert torch.allclose(packed(src, tgt, src_mask), model(src, tgt, src_mask), atol=1e-5)
    whole = torch.cat([torch.full((5, 1), SOS), src, torch.full((5, 1), EOS)], dim=1)
    assert translate_ids(model, src.tolist(), SOS, EOS, PAD, seq_len=32, min_len=3) == \
        greedy_decode(model, whole, torch.ones(5, 1, 1, 9, dtype=torch.bool), SOS, EOS,
                      max_len=18, banned=(PAD, SOS), min_len=3)  # unpacked; 18 = 1.2 · 7 + 10


def test_beam_1_equals_greedy():
    for seed in range(3):
        model = tiny_model(vocab=20, seed=seed)
        src = torch.randint(4, 20, (4, 6))
        src_mask = torch.ones(4, 1, 1, 6, dtype=torch.bool)
        limit = torch.tensor([3, 8, 12, 5])
        greedy = greedy_decode(model, src, src_mask, SOS, EOS, limit)
        beam = beam_search(model, src, src_mask, SOS, EOS, limit, beam=1)
        assert [hyps[0][0] for hyps in beam] == greedy


def test_beam_hypotheses_are_sorted_by_length_penalized_score():
    model = tiny_model(vocab=12, seed=1)
    src = torch.randint(4, 12, (3, 5))
    src_mask = torch.ones(3, 1, 1, 5, dtype=torch.bool)
    results = beam_search(model, src, src_mask, SOS, EOS, 8, beam=4, alpha=0.6, nbest=4)
    for i, hyps in enumerate(results):
        assert len(hyps) == 4
        scores = [s for _, s in hyps]
        assert scores == sorted(scores, reverse=True)
        # Each score is the hypothesis' log-probability under the model / length penalty.
        for tokens, score in hyps:
            full = torch.tensor([[SOS] + tokens])
            logits = model(src[i:i + 1], full, torch.ones(1, 1, 1, 5, dtype=torch.bool),
                           causal_mask(full.size(1)))
            logp = logits.log_softmax(-1)[0]
            targets = tokens + [EOS]  # every hypothesis ends with [EOS] (forced at the limit)
            total = sum(logp[i, t].item() for i, t in enumerate(targets))
            length = len(targets)
            assert score == pytest.approx(total / ((5 + length) / 6) ** 0.6, abs=1e-3)


def test_decoding_stops_at_eos_and_at_the_maximum_length():
    model = tiny_model(vocab=20, seed=0)
    src = torch.randint(4, 20, (2, 5))
    src_mask = torch.ones(2, 1, 1, 5, dtype=torch.bool)
    with torch.no_grad():  # make [EOS] the only thing the model ever says
        model.projection_layer.proj.bias.fill_(-100.0)
        model.projection_layer.proj.bias[EOS] = 100.0
    assert greedy_decode(model, src, src_mask, SOS, EOS, 10) == [[], []]
    assert [h[0][0] for h in beam_search(model, src, src_mask, SOS, EOS, 10, beam=3)] == [[], []]
    with torch.no_grad():  # now it never says [EOS]
        model.projection_layer.proj.bias.fill_(0.0)
        model.projection_layer.proj.bias[EOS] = -100.0
    limit = torch.tensor([4, 7])
    out = greedy_decode(model, src, src_mask, SOS, EOS, limit)
    assert [len(o) for o in out] == [4, 7]
    beams = beam_search(model, src, src_mask, SOS, EOS, limit, beam=3)
    assert [len(h[0][0]) for h in beams] == [4, 7]


def test_output_length_limits_and_no_empty_translation():
    """Issue 17: fairseq's max_len_a · src_len + max_len_b bounds every output (capped by
    seq_len); min_len bars [EOS] until that many tokens are out, so beam search never returns
    an empty translation (it used to rank the empty hypothesis first)."""
    lengths = torch.tensor([1, 5, 20, 200])
    assert output_limits(lengths, 1.2, 10, seq_len=64).tolist() == [11, 16, 34, 62]
    model = tiny_model(vocab=20, seed=0)
    sources = [[5, 6], [7, 8, 9, 10, 11]]
    with torch.no_grad():  # [EOS] is always the model's first choice
        model.projection_layer.proj.bias.fill_(-100.0)
        model.projection_layer.proj.bias[EOS] = 100.0
    assert translate_ids(model, sources, SOS, EOS, PAD, 32, min_len=0) == [[], []]
    for beam in (1, 4):
        out = translate_ids(model, sources, SOS, EOS, PAD, 32, beam=beam, min_len=1)
        assert [len(o) for o in out] == [1, 1], out
        out = translate_ids(model, sources, SOS, EOS, PAD, 32, beam=beam, min_len=3)
        assert [len(o) for o in out] == [3, 3], out
    with torch.no_grad():  # now it never says [EOS]: every output runs to its limit
        model.projection_layer.proj.bias.fill_(0.0)
        model.projection_layer.proj.bias[EOS] = -100.0
    for beam in (1, 4):
        out = translate_ids(model, sources, SOS, EOS, PAD, 32, beam=beam, max_len_a=1.5,
                            max_len_b=2)
        assert [len(o) for o in out] == [5, 9], out  # floor(1.5 · 2 + 2), floor(1.5 · 5 + 2)


def test_decoding_reports_progress_and_stops_at_the_next_batch_when_asked():
    """Issue 17: validation decoding showed no progress and ignored the first Ctrl-C."""
    model = tiny_model(vocab=20, seed=0)
    sources = [[5 + i % 10] * (1 + i % 4) for i in range(10)]
    done = []
    translate_ids(model, sources, SOS, EOS, PAD, 32, batch_size=4, progress=done.append)
    assert done == [4, 4, 2]

    class Stop(Exception):
        pass

    def stop(n):
        done.append(n)
        raise Stop()
    done.clear()
    with pytest.raises(Stop):
        translate_ids(model, sources, SOS, EOS, PAD, 32, batch_size=4, progress=stop)
    assert done == [4]  # one batch, then it stopped
