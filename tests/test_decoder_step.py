"""nmt/decoder_step.py: the decoder's one-token step laid out for CPU decoding, held to
model.py's decoder (greedy tokens identical, beam hypotheses identical and scores within 1e-4)
for every design, and the blockwise argmax and top-k held to torch's; the C step's build kept
for later processes."""

import os
import re
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from conftest import small

from model import build_transformer
import nmt.decoder_step
from nmt.decoder_step import (FastDecoder, FastState, NativeLayers, fast_decoder, row_argmax,
                              row_topk, top_logits)
from nmt.decoding import (Ensemble, ModelState, beam_search, decoding_model, greedy_decode,
                          sample, top_log_probs, translate_ids, Sampling)
from tokenizer import EOS, PAD, SOS

needs_onednn = pytest.mark.skipif(not torch.backends.mkldnn.is_available(),
                                  reason="no oneDNN in this torch")

DESIGNS = {
    "pre-norm": {},
    "paper": dict(norm_first=False, shared_vocab=True, tie_embeddings="all"),
    "modern": dict(norm="rms", ffn="swiglu", pos="rope", n_kv_heads=2, tie_embeddings="decoder"),
    "rope, post-norm, one key/value head": dict(pos="rope", norm_first=False, n_kv_heads=1),
    "sinusoidal with grouped-query attention": dict(n_kv_heads=2, ffn="swiglu"),
    "a shallow decoder": dict(N_dec=1, norm="rms"),
    "modern, the operators' step": dict(norm="rms", ffn="swiglu", pos="rope", n_kv_heads=2,
                                        tie_embeddings="decoder"),
    "modern, SwiGLU wider than Q, K and V": dict(norm="rms", ffn="swiglu", pos="rope",
                                                 n_kv_heads=2, d_ff=64),
}
C_STEP = ["modern", "modern, SwiGLU wider than Q, K and V"]  # the designs the C step computes


def laid_out_as(design, monkeypatch):
    """For "the operators' step", FastDecoder without its C step (nmt/decoder_step.c)."""
    if design == "modern, the operators' step":
        monkeypatch.setattr(NativeLayers, "applies", staticmethod(lambda model: False))


def batch(seed=0, rows=5, vocab=24):
    """Sources of several lengths (padded), and their mask."""
    torch.manual_seed(seed)
    src = torch.randint(4, vocab, (rows, 8))
    for i in range(1, rows, 2):
        src[i, 8 - 2 * i % 7:] = PAD
    return src, (src != PAD)[:, None, None, :]


@needs_onednn
@pytest.mark.parametrize("design", DESIGNS)
def test_the_step_gives_model_pys_logits_at_every_position(design, monkeypatch):
    """Teacher-forced through the cache, one token at a time, for beams that reorder and rows
    that leave: the FastState's logits are the ModelState's to 1e-5 at every step."""
    laid_out_as(design, monkeypatch)
    model = small(seed=1, **DESIGNS[design])
    src, src_mask = batch(1)
    fast = fast_decoder(model, rows=8)
    assert isinstance(fast, FastDecoder)
    plain = ModelState(model, src, src_mask, capacity=12)
    quick = FastState(fast, src, src_mask, capacity=12)
    banned = torch.tensor([PAD, SOS])
    ys = torch.full((5, 1), SOS)
    generator = torch.Generator().manual_seed(0)
    for step in range(9):
        a, b = plain.scores(ys, banned), quick.scores(ys, banned)
        assert torch.allclose(a, b, atol=1e-5, rtol=1e-5), (design, step)
        ys = torch.cat([ys, torch.randint(4, 24, (ys.size(0), 1), generator=generator)], 1)
        if step == 2:  # beams follow other rows' prefixes
            rows = torch.tensor([1, 1, 0, 4, 2])
            ys = ys[rows]
            plain.follow(rows)
            quick.follow(rows)
        if step == 5:  # rows leave the batch
            rows = torch.tensor([0, 3, 4])
            ys = ys[rows]
            plain.keep(rows)
            quick.keep(rows)


@needs_onednn
@pytest.mark.parametrize("lanes", [None, 4, 8])
@pytest.mark.parametrize("d_k", [6, 24, 32, 64, 80])
def test_the_c_steps_attention_holds_at_every_head_and_vector_width(d_k, lanes, monkeypatch):
    """The C step's attention adds a vector register's numbers at a time (heads and keys;
    compiled apart for heads of 32 and 64, the output in registers up to 64), built for this
    CPU and for vectors of 4 and 8 floats (SSE's and AVX's width, which an AVX-512 machine
    never builds by itself): heads of 6, 24, 32, 64 and 80, over up to 20 source tokens and 20
    positions; logits model.py's to 1e-5 at every step as beams follow each other and rows
    leave."""
    if lanes:
        compiler = nmt.decoder_step.shutil.which("cc") or nmt.decoder_step.shutil.which("gcc")
        monkeypatch.setenv("CC", f"{compiler} -DLANES={lanes}")
        monkeypatch.setattr(nmt.decoder_step, "_COMPILED", None)  # built afresh, so
    if nmt.decoder_step._compiled_layers() is None:
        pytest.skip("no C compiler here")
    model = small(seed=7, vocab=40, **{**DESIGNS["modern"], "d_model": 4 * d_k, "d_ff": 64})
    torch.manual_seed(7)
    src = torch.randint(4, 40, (4, 20))
    src[1, 13:], src[3, 17:] = PAD, PAD
    src_mask = (src != PAD)[:, None, None, :]
    fast = fast_decoder(model, rows=8)
    assert fast.native is not None and fast.d_k == d_k
    plain = ModelState(model, src, src_mask, capacity=24)
    quick = FastState(fast, src, src_mask, capacity=24)
    banned, ys = torch.tensor([PAD, SOS]), torch.full((4, 1), SOS)
    for step in range(20):
        a, b = plain.scores(ys, banned), quick.scores(ys, banned)
        assert torch.allclose(a, b, atol=1e-5, rtol=1e-5), (d_k, lanes, step)
        ys = torch.cat([ys, torch.randint(4, 40, (ys.size(0), 1))], 1)
        for when, how, rows in ((5, "follow", [1, 1, 0, 3]), (12, "keep", [0, 2, 3])):
            if step == when:
                ys = ys[rows]
                getattr(plain, how)(torch.tensor(rows))
                getattr(quick, how)(torch.tensor(rows))


def c_state(steps: int):
    """The C step and its FastState over 5 sentences after `steps` steps (room for 6)."""
    fast = fast_decoder(small(seed=5, **DESIGNS["modern"]), rows=8)
    src, src_mask = batch(5)
    state = FastState(fast, src, src_mask, capacity=6)
    for _ in range(steps):
        state.scores(torch.full((5, 1), SOS), torch.tensor([PAD]))
    return fast, state


@needs_onednn
def test_the_c_step_refuses_a_row_of_where_outside_the_cache_and_writes_nothing():
    """An earlier position's row of `where` below 0 or past the cache's rows (the last row,
    the last earlier position, the first of each): the call raises, and x, the cache and
    `where` are as they were; this position's and later ones' rows are never read."""
    if nmt.decoder_step._compiled_layers() is None:
        pytest.skip("no C compiler here")
    fast, state = c_state(3)
    slots = state.cache.size(3) // fast.kv
    bias = state.bias.view(-1, state.bias.size(-1))
    for r, t, row in ((4, 2, slots), (4, 2, -1), (0, 0, -1), (2, 1, slots)):
        where = state.where.clone()
        where[r, t] = row
        x, cache, before = torch.randn(5, fast.d), state.cache.clone(), where.clone()
        with pytest.raises(RuntimeError, match="do not match"):
            fast.native(x, 3, cache, state.cross, bias, 1, where)
        # bit for bit: the cache's unwritten slots are whatever memory held (NaNs too)
        assert torch.equal(cache.view(torch.uint8), state.cache.view(torch.uint8))
        assert torch.equal(where, before)
    where = state.where.clone()
    where[:, 3:] = -7  # this position's and the later ones' rows: not read
    fast.native(torch.randn(5, fast.d), 3, state.cache.clone(), state.cross, bias, 1, where)
    assert where[:, 3].tolist() == list(range(5)) and (where[:, 4:] == -7).all()


@needs_onednn
@pytest.mark.parametrize("design", ["modern", "paper", "rope, post-norm, one key/value head"])
def test_a_sentences_beams_share_its_keys_and_values(design):
    """After repeat(k) a sentence's k rows attend its one copy of the cross-attention's keys
    and values (one product per sentence): the logits are model.py's to 1e-5 as beams follow
    each other within their sentences and whole sentences leave or swap places, and the copy
    stays one per sentence; rows chosen otherwise (samples of two sentences) get their own
    copies, logits still model.py's; a repeat after a first step repeats the cache too."""
    model = small(seed=6, **DESIGNS[design])
    src, src_mask = batch(6)
    kv = model.decoder.layers[0].self_attention_block.n_kv_heads
    plain = ModelState(model, src, src_mask, capacity=12)
    quick = FastState(fast_decoder(model, rows=8), src, src_mask, capacity=12)
    banned = torch.tensor([PAD, SOS])
    generator = torch.Generator().manual_seed(1)
    ys = torch.full((5, 1), SOS)

    def step(ys):
        a, b = plain.scores(ys, banned), quick.scores(ys, banned)
        assert torch.allclose(a, b, atol=1e-5, rtol=1e-5)
        return torch.cat([ys, torch.randint(4, 24, (ys.size(0), 1), generator=generator)], 1)

    def move(how, rows, ys):
        getattr(plain, how)(rows)
        getattr(quick, how)(rows)
        return ys[rows]
    late = FastState(quick.decoder, src, src_mask, capacity=12)  # repeats after a step
    late.scores(ys, banned)
    late.repeat(3)
    plain.repeat(3)
    quick.repeat(3)
    ys = step(ys.repeat_interleave(3, dim=0))  # (15 rows: 5 sentences x 3)
    assert torch.allclose(late.scores(ys, banned), quick.scores(ys, banned), atol=1e-5)
    plain.scores(ys, banned)
    ys = torch.cat([ys, torch.randint(4, 24, (15, 1), generator=generator)], 1)
    assert quick.cross.size(2) == 5 * kv and quick.per == 3
    ys = step(move("follow", torch.tensor([2, 2, 0, 3, 5, 4, 6, 6, 6, 11, 9, 10, 12, 14, 13]),
                   ys))
    ys = step(move("keep", torch.tensor([3, 4, 5, 9, 10, 11]), ys))  # sentences 1 and 3 stay
    assert quick.cross.size(2) == 2 * kv and quick.per == 3
    assert torch.equal(quick.bias, FastState(quick.decoder, src, src_mask, 1).bias.view(
        5, kv, 1, -1)[[1, 3]].reshape(2 * kv, 1, -1))  # each sentence's own source mask
    ys = step(move("keep", torch.tensor([5, 3, 4, 0, 0, 2]), ys))  # sentences swap places
    assert quick.cross.size(2) == 2 * kv and quick.per == 3
    ys = step(move("keep", torch.tensor([1, 2, 3]), ys))  # rows of two sentences in a group
    assert quick.cross.size(2) == 3 * kv and quick.per == 1
    step(move("follow", torch.tensor([2, 1, 0]), ys))


@needs_onednn
@pytest.mark.parametrize("design", DESIGNS)
def test_greedy_and_beam_search_decode_as_model_py(design, monkeypatch):
    """The searches over the FastDecoder and over the model: the same greedy tokens, the same
    beam hypotheses (nbest 3) and their scores within 1e-4, the same samples."""
    laid_out_as(design, monkeypatch)
    for seed in (2, 3):
        model = small(seed=seed, **DESIGNS[design])
        fast = decoding_model(model, rows=8)
        assert isinstance(fast, FastDecoder)
        src, src_mask = batch(seed)
        limit = torch.tensor([3, 9, 12, 5, 7])
        assert greedy_decode(fast, src, src_mask, SOS, EOS, limit, min_len=2) == \
            greedy_decode(model, src, src_mask, SOS, EOS, limit, min_len=2)
        for early_stop in (True, False):
            ours = beam_search(fast, src, src_mask, SOS, EOS, limit, beam=4, nbest=3,
                               early_stop=early_stop)
            theirs = beam_search(model, src, src_mask, SOS, EOS, limit, beam=4, nbest=3,
                                 early_stop=early_stop)
            assert [[h for h, _ in hyps] for hyps in ours] == \
                [[h for h, _ in hyps] for hyps in theirs], (design, seed)
            assert [s for hyps in ours for _, s in hyps] == pytest.approx(
                [s for hyps in theirs for _, s in hyps], abs=1e-4)
        sampling = Sampling(n=3, top_k=5)
        generators = [[sampling.generator([i], j, "cpu") for i in range(5) for j in range(3)]
                      for _ in range(2)]
        ours = sample(fast, src, src_mask, SOS, EOS, limit, generators[0], sampling)
        theirs = sample(model, src, src_mask, SOS, EOS, limit, generators[1], sampling)
        assert [[ids for ids, _ in s] for s in ours] == [[ids for ids, _ in s] for s in theirs]
        assert [p for s in ours for _, p in s] == pytest.approx(
            [p for s in theirs for _, p in s], abs=1e-4)


@needs_onednn
@pytest.mark.parametrize("capacity", [0, 2])
def test_a_cache_shorter_than_the_output_grows(capacity):
    """A capacity below the output's length (the searches give enough) still decodes right,
    beams reordered after it grew."""
    model = small(seed=4, **DESIGNS["modern"])
    src, src_mask = batch(4)
    plain = ModelState(model, src, src_mask, capacity=capacity)
    quick = FastState(decoding_model(model, rows=8), src, src_mask, capacity=capacity)
    ys = torch.full((5, 1), SOS)
    banned = torch.tensor([PAD])
    for step in range(7):
        a, b = plain.scores(ys, banned), quick.scores(ys, banned)
        assert torch.allclose(a, b, atol=1e-5), step
        ys = torch.cat([ys, a.argmax(-1, keepdim=True)], 1)
        if step in (3, 4):
            rows = torch.tensor([4, 0, 0, 2, 1])
            ys = ys[rows]
            plain.follow(rows)
            quick.follow(rows)


@needs_onednn  # (torch deprecates the quantization a user's model may still have: refused)
@pytest.mark.filterwarnings("ignore:torch.ao.quantization is deprecated")
@pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor")
def test_every_decoder_takes_the_step_where_it_applies(monkeypatch):
    """translate_ids (translate.py, the Translator, validation, the teachers' translation) and
    ensembles decode through the FastDecoder on CPU in float32; in training mode, in bf16 and
    with quantized layers the model's own decoder runs."""
    model = small(seed=5, **DESIGNS["modern"])
    steps = []
    original = FastDecoder.step
    monkeypatch.setattr(FastDecoder, "step", lambda self, *a: steps.append(1) or
                        original(self, *a))
    sources = [[5, 6, 7], [8, 9]]
    for decode in (lambda: translate_ids(model, sources, SOS, EOS, PAD, seq_len=40),
                   lambda: translate_ids(model, sources, SOS, EOS, PAD, seq_len=40, beam=3),
                   lambda: translate_ids(model, sources, SOS, EOS, PAD, seq_len=40,
                                         sampling=Sampling(n=2)),
                   lambda: translate_ids(Ensemble([model, model]), [[s, s] for s in sources],
                                         SOS, EOS, PAD, seq_len=40)):
        before = len(steps)
        decode()
        assert len(steps) > before
    before = len(steps)
    translate_ids(model, sources, SOS, EOS, PAD, seq_len=40, fast_step=False)
    assert len(steps) == before  # the reference: model.py's step
    assert fast_decoder(model.train(), rows=8) is None
    model.eval()
    model.decoder.layers[0].train()  # one module in training: dropout on
    assert fast_decoder(model, rows=8) is None
    model.eval()
    assert fast_decoder(build_transformer(24, 24, 40, 40, d_model=16, N=1, h=2,
                                          d_ff=32).eval().to(torch.bfloat16), rows=8) is None
    half = small(seed=5)
    half.decoder.to(torch.bfloat16)  # the projection stays float32
    assert fast_decoder(half, rows=8) is None
    other_norm = small(seed=5)
    other_norm.decoder.norm = torch.nn.LayerNorm(16)  # a norm the step does not know
    assert fast_decoder(other_norm, rows=8) is None

    class Subclass(type(model)):
        pass
    subclassed = small(seed=5)
    subclassed.__class__ = Subclass  # it may compute otherwise
    assert fast_decoder(subclassed, rows=8) is None
    from torch.ao.quantization import quantize_dynamic
    quantized = quantize_dynamic(small(seed=5), {torch.nn.Linear}, dtype=torch.qint8)
    assert fast_decoder(quantized, rows=8) is None
    assert decoding_model(quantized) is quantized
    fast = decoding_model(model)
    assert decoding_model(fast) is fast


@needs_onednn
def test_the_step_shares_the_models_weights():
    """The FastDecoder's products read the model's own tensors (transposed views), so the
    laying out costs no copy of the layers (only the scaled embedding table, SwiGLU's joined
    matrices and the cross-attention's stacked keys and values)."""
    model = small(seed=6)
    fast = decoding_model(model, rows=8)
    layer, block = fast.layers[0], model.decoder.layers[0]
    assert layer.w_qkv.data_ptr() == block.self_attention_block.w_qkv.weight.data_ptr()
    assert layer.w_2.data_ptr() == block.feed_forward_block.linear_2.weight.data_ptr()
    assert fast.model is model


@needs_onednn
def test_the_modern_design_steps_in_one_c_call_where_a_compiler_is(monkeypatch):
    """nmt/decoder_step.c computes the modern design's encoder layers once a batch and decoder
    layers every step where this machine compiles it (the tests above then hold it to
    model.py); the other designs step through the operators."""
    if nmt.decoder_step._compiled_layers() is None:
        pytest.skip("no C compiler here")
    for design in DESIGNS:
        fast = fast_decoder(small(seed=4, **DESIGNS[design]), rows=8)
        native = design in C_STEP or design == "modern, the operators' step"  # not laid out
        assert (fast.native is not None) == native, design
    calls = []
    for name in ("__call__", "encode"):
        original = getattr(NativeLayers, name)
        monkeypatch.setattr(NativeLayers, name, lambda self, *args, original=original,
                            name=name: calls.append(name) or original(self, *args))
    model = small(seed=4, **DESIGNS[C_STEP[1]])
    src, src_mask = batch(4)
    limit = torch.tensor([3, 9, 12, 5, 7])
    fast = fast_decoder(model, rows=8)
    def tokens(out):  # greedy's outputs, or beam search's hypotheses without their scores
        return [[h for h, _ in o] if o and isinstance(o[0], tuple) else o for o in out]
    for search in (greedy_decode, beam_search):
        calls.clear()
        assert tokens(search(fast, src, src_mask, SOS, EOS, limit)) == \
            tokens(search(model, src, src_mask, SOS, EOS, limit))
        assert calls[0] == "encode" and calls.count("encode") == 1 and \
            calls.count("__call__") >= 5, (search, calls)  # a step each


@needs_onednn
def test_the_c_step_takes_only_what_it_computes(monkeypatch):
    """NativeLayers.applies() refuses a modern model with a LayerNorm in its encoder, norms of
    two eps, an attention layer with a bias, or an encoder's linear layer of another class (the
    C code computes none of them: it reads the weights alone), and the searches decode as
    model.py; the C call refuses tensors that do not match its rows; CC may carry arguments."""
    if nmt.decoder_step._compiled_layers() is None:
        pytest.skip("no C compiler here")
    from model import LayerNormalization
    src, src_mask = batch(5)
    limit = torch.tensor([3, 9, 12, 5, 7])

    def variant(change):
        model = small(seed=5, **DESIGNS[C_STEP[1]])
        with torch.no_grad():
            change(model)
        return model.eval()
    layer_norm = variant(lambda m: setattr(m.encoder.layers[1].residual_connections[0], "norm",
                                           LayerNormalization(16)))
    two_eps = variant(lambda m: setattr(m.encoder.layers[0].residual_connections[1].norm,
                                        "eps", 0.5))

    def biased_w_o(m):
        old = m.encoder.layers[0].self_attention_block.w_o
        new = torch.nn.Linear(old.in_features, old.out_features)
        new.weight.copy_(old.weight)
        m.encoder.layers[0].self_attention_block.w_o = new

    class Shifted(torch.nn.Linear):
        def forward(self, x):
            return super().forward(x) + 1.0

    def shifted(m):  # a subclass of nn.Linear in the encoder, which only the C code runs
        old = m.encoder.layers[0].feed_forward_block.linear_2
        new = Shifted(old.in_features, old.out_features, bias=False)
        new.weight.copy_(old.weight)
        m.encoder.layers[0].feed_forward_block.linear_2 = new
    def subclassed(where):  # a block of a subclass (its forward may compute otherwise)
        def change(m):
            module = where(m)
            module.__class__ = type("Sub" + type(module).__name__, (type(module),), {})
        return variant(change)
    blocks = [subclassed(lambda m: m.encoder.layers[1]),
              subclassed(lambda m: m.decoder.layers[0]),
              subclassed(lambda m: m.encoder.layers[0].self_attention_block),
              subclassed(lambda m: m.decoder.layers[1].cross_attention_block),
              subclassed(lambda m: m.encoder.layers[0].residual_connections[1]),
              subclassed(lambda m: m.encoder.layers[1].feed_forward_block)]
    assert fast_decoder(small(seed=5, **DESIGNS[C_STEP[1]]), rows=8).native is not None
    for model in (layer_norm, two_eps, variant(biased_w_o), variant(shifted), *blocks):
        fast = fast_decoder(model, rows=8)
        assert fast.native is None
        assert greedy_decode(fast, src, src_mask, SOS, EOS, limit) == \
            greedy_decode(model, src, src_mask, SOS, EOS, limit)
    fast = fast_decoder(small(seed=5, **DESIGNS[C_STEP[1]]), rows=8)
    state = FastState(fast, src, src_mask, capacity=4)
    state.scores(torch.full((5, 1), SOS), torch.tensor([PAD]))
    x = torch.zeros(5, 16)
    good = dict(position=1, cache=state.cache, cross=state.cross, bias=state.bias.view(5 * 2, -1),
                per=1, where=state.where)
    for wrong in (dict(position=4), dict(cache=state.cache[:, :, :, :8].contiguous()),
                  dict(cross=state.cross[:, :, :8].contiguous()),
                  dict(bias=good["bias"][:8]), dict(per=2), dict(where=state.where[:4]),
                  dict(where=state.where[:, :3].contiguous()), dict(where=state.where.long())):
        with pytest.raises(RuntimeError, match="do not match"):
            fast.native(x.clone(), **{**good, **wrong})
    odd = torch.zeros(*state.cache.shape[:3], state.cache.size(3) + 1, state.cache.size(4))
    for wrong in (dict(cache=state.cache[..., :2].contiguous()), dict(cache=odd),
                  dict(cache=state.cache[:1].contiguous()), dict(cache=state.cache.double()),
                  dict(cross=state.cross[:1].clone()), dict(cross=state.cross.double()),
                  dict(cross=state.cross[..., :2].contiguous()), dict(bias=good["bias"].double()),
                  dict(position=-1), dict(where=state.where.clone().index_fill_(
                      1, torch.tensor([0]), 10))):
        with pytest.raises(RuntimeError, match="do not match"):
            fast.native(x.clone(), **{**good, **wrong})
    for wrong_x in (x.double(), x[:, :8].contiguous()):
        with pytest.raises(RuntimeError, match="do not match"):
            fast.native(wrong_x, **good)
    with pytest.raises(RuntimeError, match="contiguous"):
        fast.native(x.clone(), **{**good, "where": state.where.t().contiguous().t()})
    fast.native(x.clone(), **good)  # the right ones pass
    compiler = nmt.decoder_step.shutil.which("cc") or nmt.decoder_step.shutil.which("gcc")
    monkeypatch.setenv("CC", f"{compiler} -DAN_ARGUMENT=1")
    monkeypatch.setattr(nmt.decoder_step, "_COMPILED", None)  # built afresh, with it
    assert fast_decoder(small(seed=5, **DESIGNS[C_STEP[1]]), rows=8).native is not None


@needs_onednn
@pytest.mark.parametrize("broken", ["no such compiler", "a failing compiler", "no sgemm_",
                                    "an unbalanced quote in CC"])
def test_without_a_c_build_the_operators_step_runs_silently(broken, monkeypatch, capfd):
    """No compiler, a compiler that fails, or a torch without sgemm_: the modern design steps
    through the operators, to the same tokens, and nothing is printed."""
    import ctypes.util
    model = small(seed=4, **DESIGNS["modern"])
    src, src_mask = batch(4)
    limit = torch.tensor([3, 9, 12, 5, 7])
    expected = greedy_decode(model, src, src_mask, SOS, EOS, limit)
    if broken == "no such compiler":
        monkeypatch.setenv("CC", "/no/such/compiler")
    elif broken == "a failing compiler":
        monkeypatch.setenv("CC", "sh -c 'echo failed; echo failed >&2; exit 1'")
    elif broken == "an unbalanced quote in CC":
        monkeypatch.setenv("CC", "gcc '-O2")
    else:
        monkeypatch.setattr(nmt.decoder_step, "TORCH_CPU", ctypes.util.find_library("m"))
    monkeypatch.setattr(nmt.decoder_step, "_COMPILED", None)  # tried afresh
    capfd.readouterr()
    fast = fast_decoder(model, rows=8)
    assert fast.native is None and nmt.decoder_step._COMPILED is False
    assert greedy_decode(fast, src, src_mask, SOS, EOS, limit) == expected
    assert capfd.readouterr() == ("", "")


def c_compiler():
    compiler = nmt.decoder_step.shutil.which("cc") or nmt.decoder_step.shutil.which("gcc")
    if compiler is None:
        pytest.skip("no C compiler here")
    return compiler


@pytest.fixture
def one_line_builds(tmp_path, monkeypatch):
    """A source of one line standing for decoder_step.c (`int answer(void)`), a compiler that
    counts its builds (calls with -o; each `tmp_path/pause` seconds long, where it is written),
    the build cache in tmp_path/home/cache (its parent missing). Returns build(answer): the
    library of -DANSWER=answer built or loaded as a new process would, checked to answer it;
    then (builds so far, the cache's library files)."""
    compiler = c_compiler()
    calls, cache = tmp_path / "calls", tmp_path / "home" / "cache"
    counting = tmp_path / "cc"
    counting.write_text(f'#!/bin/sh\ncase " $* " in *" -o "*) echo >> "{calls}"; sleep '
                        f'"$(cat "{tmp_path / "pause"}" 2>/dev/null || echo 0)";; esac\n'
                        f'exec "{compiler}" "$@"\n')
    counting.chmod(0o755)
    source = tmp_path / "decoder_step.c"
    source.write_text("int answer(void) { return ANSWER; }\n")
    monkeypatch.setattr(nmt.decoder_step, "SOURCE", source)
    monkeypatch.setenv("NMT_CACHE_DIR", str(cache))

    def build(answer=42):
        library = nmt.decoder_step._built([str(counting), f"-DANSWER={answer}", "-shared",
                                           "-fPIC", str(nmt.decoder_step.SOURCE)])
        assert library.answer() == answer
        built = len(calls.read_text().splitlines()) if calls.exists() else 0
        return built, sorted(p.name for p in cache.glob("decoder_step-*")) if cache.exists() \
            else []
    return build


def test_a_c_build_is_kept_for_later_processes_one_per_source_command_compiler_and_cpu(
        one_line_builds, monkeypatch):
    """A library is built once and kept in the build cache (a folder for this user alone),
    where a later process loads it without compiling; another CPU or compiler (what the
    compiler says it builds for), source or command builds its own beside it, another checkout
    of the same source does not; a damaged file is built again; a killed copy's leftovers go."""
    build = one_line_builds
    says = b"-march=this CPU"  # what the compiler says (its own words: the next test)
    monkeypatch.setattr(nmt.decoder_step, "_compiler_says", lambda flags: says)
    built, files = build()
    assert built == 1 and len(files) == 1, files
    cache = nmt.decoder_step.build_cache()
    assert cache.stat().st_mode & 0o777 == 0o700
    # damaged before this process opens it by its name (a process opens a name once)
    damaged = cache / "damaged"  # a new file: the one this process maps stays whole
    damaged.write_bytes(b"half a library")
    damaged.replace(cache / files[0])
    assert build() == (2, files)  # built again, in its place
    assert build() == (2, files)  # loaded, not built
    assert build(answer=7)[0] == 3  # another command
    says = b"-march=another CPU"
    assert build()[0] == 4
    source = nmt.decoder_step.SOURCE
    source.write_text("int answer(void) { return ANSWER + 0; }\n")
    built, files = build()
    assert built == 5 and len(files) == 4, files
    moved = source.parent / "elsewhere" / source.name  # another checkout of the same source
    moved.parent.mkdir()
    moved.write_bytes(source.read_bytes())
    monkeypatch.setattr(nmt.decoder_step, "SOURCE", moved)
    assert build() == (5, files)
    # a copy killed 11 minutes ago goes at the next build; one 8 minutes old may be writing
    killed, copying = cache / f".{files[0]}.killed", cache / f".{files[0]}.copying"
    for partial, age in ((killed, 660), (copying, 480)):
        partial.write_bytes(b"half")
        os.utime(partial, (time.time() - age,) * 2)
    assert build(answer=8)[0] == 6
    assert not killed.exists() and copying.exists()
    copying.unlink()
    assert sorted(p.name for p in cache.iterdir()) == sorted(build()[1])  # nothing else


def test_the_cache_key_has_the_cpu_that_march_native_resolves_to(monkeypatch, tmp_path):
    """gcc and clang say which CPU -march=native builds for (its name: -march=znver3,
    "-target-cpu" "skylake"...), the same from any folder; a compiler that says nothing
    (no -###) gives no key, and the cache is passed over."""
    said = nmt.decoder_step._compiler_says([c_compiler(), "-O3", "-march=native"])
    assert said is not None
    assert re.search(rb"-march=(?!native)\w|\"-target-cpu\" \"(?!native)", said), said
    monkeypatch.chdir(tmp_path)
    assert nmt.decoder_step._compiler_says([c_compiler(), "-O3", "-march=native"]) == said
    for silent in (["sh", "-c", "exit 1"], ["/no/such/compiler"]):
        assert nmt.decoder_step._compiler_says(silent) is None
    keys = []
    for checkout in ("one", "another"):  # the same source elsewhere: the same key
        source = tmp_path / checkout / "decoder_step.c"
        source.parent.mkdir()
        source.write_text("int answer(void) { return 42; }\n")
        monkeypatch.setattr(nmt.decoder_step, "SOURCE", source)
        keys.append(nmt.decoder_step._build_key([c_compiler(), "-march=native", str(source)]))
    assert keys[0] is not None and keys[0] == keys[1]


@pytest.mark.parametrize("refused", ["writable by others", "writable by its group",
                                     "another user's", "no account", "cannot be made",
                                     "a full disk"])
def test_where_the_cache_cannot_serve_the_library_is_built_apart(one_line_builds, refused,
                                                                 monkeypatch, tmp_path):
    """A cache folder that others can write or that another user owns (what it holds would run
    in this process), a compiler that does not say what it builds for, a folder that cannot
    be made or take the file: each process builds its library, once, nothing is kept."""
    build = one_line_builds
    cache = tmp_path / "home" / "cache"
    if refused.startswith("writable by"):
        cache.mkdir(parents=True)
        cache.chmod(0o702 if refused == "writable by others" else 0o720)
    elif refused == "another user's":
        uid = os.getuid()
        monkeypatch.setattr(nmt.decoder_step.os, "getuid", lambda: uid + 1)
    elif refused == "no account":
        monkeypatch.setattr(nmt.decoder_step, "_compiler_says", lambda flags: None)
    elif refused == "cannot be made":
        monkeypatch.setenv("NMT_CACHE_DIR", str(tmp_path / "cc" / "cache"))  # under a file
    else:
        def full(*args, **kwargs):
            raise OSError(28, "No space left on device")
        monkeypatch.setattr(nmt.decoder_step.tempfile, "mkstemp", full)
    assert build() == (1, [])
    assert build() == (2, [])
    assert not cache.exists() or not list(cache.iterdir())


def test_a_failing_build_compiles_once_says_nothing_and_leaves_nothing(one_line_builds,
                                                                       tmp_path, capfd):
    """A compiler that fails (the C step is then off, silently) is not asked twice, and its
    words go nowhere; the cache keeps nothing of it."""
    with pytest.raises(subprocess.CalledProcessError):
        one_line_builds(answer="(")  # `return (;`: not C
    assert len((tmp_path / "calls").read_text().splitlines()) == 1
    assert capfd.readouterr() == ("", "")
    assert list((tmp_path / "home" / "cache").iterdir()) == []


def test_processes_that_build_at_once_keep_one_whole_library(one_line_builds, tmp_path):
    """torchrun's ranks validate at once: each builds (none waits on another), one library is
    kept, linked into place whole, never over one another process may have mapped."""
    (tmp_path / "pause").write_text("0.3")  # each build takes that longer
    with ThreadPoolExecutor(3) as pool:  # a thread stands for a process
        results = list(pool.map(lambda _: one_line_builds(), range(3)))
    assert sorted(built for built, _ in results)[-1] == 3
    files = results[-1][1]
    kept = sorted(p.name for p in (tmp_path / "home" / "cache").iterdir())
    assert len(files) == 1 and kept == files  # no copy left
    assert one_line_builds()[0] == 3  # loaded


def test_a_kept_library_is_never_written_over_but_where_damaged(tmp_path):
    """A process may have mapped the library in place: a second build of it is not linked
    over it (on a network file system, the first's pages would go); a damaged one is."""
    library, built = tmp_path / "decoder_step-key.so", tmp_path / "built.so"
    library.write_bytes(b"the first")
    built.write_bytes(b"the second")
    nmt.decoder_step._keep(built, library, damaged=False)
    assert library.read_bytes() == b"the first"
    nmt.decoder_step._keep(built, library, damaged=True)
    assert library.read_bytes() == b"the second"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["built.so", "decoder_step-key.so"]


@pytest.mark.parametrize("environment, expected", [
    ({"NMT_CACHE_DIR": "."}, "{cwd}"), ({"NMT_CACHE_DIR": "~/c"}, "{home}/c"),
    ({"XDG_CACHE_HOME": "/x"}, "/x/nmt"), ({}, "{home}/.cache/nmt")])
def test_the_build_cache_lies_where_the_environment_says(environment, expected, monkeypatch,
                                                         tmp_path):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    for name in ("NMT_CACHE_DIR", "XDG_CACHE_HOME"):
        monkeypatch.delenv(name, raising=False)
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    assert nmt.decoder_step.build_cache() == \
        Path(expected.format(cwd=tmp_path, home=tmp_path / "home"))


@pytest.mark.parametrize("width", [1000, 1024, 10007])
def test_row_argmax_is_torchs_argmax(width):
    """The first of equal maxima, rows all -inf, widths not a multiple of the block."""
    torch.manual_seed(width)
    x = torch.randn(37, width)
    assert torch.equal(row_argmax(x), x.argmax(-1))
    ties = torch.randint(0, 3, (37, width)).float()  # many equal maxima per row
    ties[5] = float("-inf")
    ties[6, -1] = 9.0  # the maximum in the last, shorter block
    assert torch.equal(row_argmax(ties), ties.argmax(-1))


@pytest.mark.parametrize("width, k", [(1000, 1), (4100, 1), (4100, 8), (10007, 8)])
def test_row_topk_is_torchs_topk(width, k):
    """The same values, largest first, and the same columns where values differ; with ties,
    columns that hold those values, none twice; a row of -inf but one value."""
    torch.manual_seed(width + k)
    x = torch.randn(29, width)
    values, columns = row_topk(x, k)
    expected = x.topk(k, dim=-1)
    assert torch.equal(values, expected.values) and torch.equal(columns, expected.indices)
    ties = torch.randint(0, 4, (29, width)).float()
    ties[3] = float("-inf")
    ties[3, width // 2] = 1.0
    ties[4, -1] = 9.0  # the largest value past the last whole block
    ties[5] = float("-inf")
    ties[5, -1] = 2.0  # and the only finite one
    values, columns = row_topk(ties, k)
    assert torch.equal(values, ties.topk(k, dim=-1).values)
    assert torch.equal(ties.gather(1, columns), values)
    finite = [set(c[torch.isfinite(v)].tolist()) for v, c in zip(values, columns)]
    assert all(len(f) == int(torch.isfinite(v).sum()) for f, v in zip(finite, values))
    assert columns.max() < width
    assert columns[4, 0] == width - 1 and columns[5, 0] == width - 1


@pytest.mark.parametrize("width, k", [(5, 5), (37, 1), (37, 8), (10007, 8)])
def test_top_logits_are_log_softmax_and_topk_in_one_pass(width, k):
    """nmt/decoder_step.c's top_logits: each row's log-sum-exp to 1e-5, its k largest values
    as torch's topk's, their columns, the first of equal values first, -inf columns (banned
    tokens) counted as torch counts them, and the column `skip` taken as -inf."""
    if nmt.decoder_step._compiled_layers() is None:
        pytest.skip("no C compiler here")
    torch.manual_seed(width + k)
    x = torch.randn(10, width) * 4  # widths not a multiple of the C code's blocks of 16
    x[:, 2] = float("-inf")  # a banned token
    x[4] = 1.5  # every value equal: the first columns
    x[4, 2] = float("-inf")
    x[5, -1] = 30.0  # the largest in the last, shorter block
    x[6, -1], x[7, 0] = 120.0, 120.0  # far above the first block's, the last block's maximum
    x[8, :min(16, width - 1)] = float("-inf")  # the first block (nearly) all barred
    x[9] = float("-inf")  # every column barred
    distinct = [0, 1, 2, 3, 5, 6, 7, 8]  # the rows without equal values
    for skip in (-1, 0, width - 1):
        lse, values, columns = top_logits(x, k, skip)
        assert torch.allclose(lse, x.logsumexp(-1), atol=1e-5, rtol=1e-6)
        y = x.clone()
        if skip >= 0:
            y[:, skip] = float("-inf")
        expected = y.topk(k, dim=-1)
        assert torch.equal(values, expected.values)
        assert torch.equal(y.gather(1, columns), values)
        finite = torch.isfinite(values)[distinct]
        assert torch.equal(columns[distinct][finite], expected.indices[distinct][finite])
        firsts = [c for c in range(width) if c != 2 and c != skip][:k]
        assert columns[4, :len(firsts)].tolist() == firsts
        assert all(len(set(row)) == k for row in columns.tolist())  # no column twice
    assert top_logits(x.double(), k) is None and top_logits(x[:, :k - 1], k) is None
    assert top_logits(x.t(), min(k, 10)) is None  # not contiguous


@pytest.mark.parametrize("step, min_len", [(1, 3), (4, 0), (6, 1), (4, 4)])
def test_beam_searchs_candidates_in_one_pass_are_log_softmaxs_under_the_rules(step, min_len):
    """top_log_probs from top_logits (beam search over the fast step) gives what the
    log-softmax, the length rules (restrict) and topk give: [EOS] barred before min_len, and
    the only choice of a row past its limit (-inf where it is barred too); scores already
    log-probabilities (an ensemble's mean) are not normalized again."""
    if nmt.decoder_step._compiled_layers() is None:
        pytest.skip("no C compiler here")
    torch.manual_seed(step)
    scores = torch.randn(6, 50) * 3
    scores[:, 1] = float("-inf")  # a banned token
    scores[2, EOS] = 20.0  # [EOS] the most likely
    limit = torch.tensor([9, 9, 9, 3, 5, 2])  # rows 3 to 5 past it from step 4 or 6 on
    reference = top_log_probs(scores.clone(), False, 4, step, limit, min_len, EOS)
    fused = top_log_probs(scores.clone(), False, 4, step, limit, min_len, EOS, fused=True)
    assert torch.allclose(fused[0], reference[0], atol=1e-5)
    finite = torch.isfinite(reference[0])
    assert torch.equal(fused[1][finite], reference[1][finite])
    forced = limit < step
    assert bool((fused[1][forced, 0] == EOS).all()) and \
        not torch.isfinite(fused[0][forced, 1:]).any()
    assert bool((fused[1] == EOS).any()) == (step > min_len or bool(forced.any()))
    if forced.any():
        assert torch.isfinite(fused[0][forced, 0]).all() == (step > min_len)
    means = (scores.log_softmax(-1) + scores.mul(0.5).log_softmax(-1)) / 2  # sum below 1
    assert torch.allclose(top_log_probs(means.clone(), True, 4, step, limit, min_len, EOS,
                                        fused=True)[0],
                          top_log_probs(means.clone(), True, 4, step, limit, min_len, EOS)[0])


@needs_onednn
def test_beam_search_takes_its_candidates_from_top_logits_over_the_fast_step(monkeypatch):
    """Beam search over a FastDecoder takes each step's candidates from top_logits; over
    model.py's step (the reference), from the log-softmax and row_topk."""
    if nmt.decoder_step._compiled_layers() is None:
        pytest.skip("no C compiler here")
    calls = []

    def counted(*args):
        calls.append(args[0].size(0))
        return top_logits(*args)
    monkeypatch.setattr(nmt.decoding, "top_logits", counted)
    model = small(seed=4, **DESIGNS["paper"])
    src, src_mask = batch(4)
    beam_search(model, src, src_mask, SOS, EOS, 6, beam=3)
    assert calls == []
    beam_search(decoding_model(model, rows=8), src, src_mask, SOS, EOS, 6, beam=3)
    assert len(calls) >= 2 and calls[0] == 5 * 3


@needs_onednn
def test_the_c_step_repeats_the_rows_left_after_others_finish():
    """keep() then repeat() in the C step's cache (fewer rows than it has, then more): the
    logits are model.py's, re-decoded from the whole prefix, to 1e-5."""
    if nmt.decoder_step._compiled_layers() is None:
        pytest.skip("no C compiler here")
    model = small(seed=6, **DESIGNS["modern"])
    src, src_mask = batch(6, rows=4)
    plain = ModelState(model, src, src_mask, 0, use_cache=False)
    quick = FastState(fast_decoder(model, rows=8), src, src_mask, capacity=12)
    assert quick.decoder.native is not None
    banned, ys = torch.tensor([PAD, SOS]), torch.full((4, 1), SOS)
    generator = torch.Generator().manual_seed(6)
    moves = [("keep", torch.tensor([2, 0])), ("repeat", 3),
             ("follow", torch.tensor([1, 0, 2, 5, 5, 3]))]  # within each sentence's 3 rows
    for how, rows in moves:
        assert torch.allclose(quick.scores(ys, banned), plain.scores(ys, banned), atol=1e-5)
        ys = torch.cat([ys, torch.randint(4, 24, (ys.size(0), 1), generator=generator)], 1)
        getattr(quick, how)(rows)
        if how != "follow":  # without a cache, model.py's step reads the prefixes in ys
            getattr(plain, how)(rows)
        ys = ys.repeat_interleave(rows, dim=0) if how == "repeat" else ys[rows]
    assert torch.allclose(quick.scores(ys, banned), plain.scores(ys, banned), atol=1e-5)


@needs_onednn
def test_greedy_batches_decode_at_once_on_the_threads(monkeypatch):
    """With two threads, greedy decoding, sampling and beam search decode two batches at the
    same time, each on a thread of its own: the same outputs as one batch after the other, the
    caller's thread count untouched, progress reported batch by batch in order; a stop asked
    at the first batch starts no other."""
    import threading
    import time

    from nmt import decoding
    model = small(seed=7, **DESIGNS["modern"])
    sources = [[4 + (i * 7 + j) % 20 for j in range(1 + i % 6)] for i in range(23)]
    threads, calls, slow = set(), [], []
    original = FastDecoder.step

    def step(self, *args):
        threads.add(threading.get_ident())
        calls.append(1)
        if slow:  # a batch outlasts the caller's reading of the one before, by a wide margin
            time.sleep(0.01)
        return original(self, *args)
    monkeypatch.setattr(FastDecoder, "step", step)
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        done = []
        at_once = translate_ids(model, sources, SOS, EOS, PAD, seq_len=40, batch_size=4,
                                progress=done.append)
        assert len(threads) == 2 and threading.get_ident() not in threads
        assert done == [4, 4, 4, 4, 4, 3] and torch.get_num_threads() == 2
        threads.clear()
        sampled = translate_ids(model, sources, SOS, EOS, PAD, seq_len=40, batch_size=4,
                                sampling=Sampling(n=2, seed=3))
        sampling_threads = len(threads)
        threads.clear()
        beams = translate_ids(model, sources, SOS, EOS, PAD, seq_len=40, batch_size=4, beam=3,
                              nbest=2)
        beam_threads = len(threads)

        class Stop(Exception):
            pass

        def stop(n):
            raise Stop()
        calls.clear()
        slow.append(True)
        with pytest.raises(Stop):
            translate_ids(model, sources, SOS, EOS, PAD, seq_len=40, batch_size=4,
                          progress=stop)
        slow.clear()
        stopped_steps = len(calls)
        calls.clear()
        translate_ids(model, sources, SOS, EOS, PAD, seq_len=40, batch_size=4)
        assert stopped_steps < len(calls)  # the batches not yet started were not decoded
        monkeypatch.setattr(decoding, "batches_at_once", lambda *args, **kwargs: 1)
        threads.clear()
        assert translate_ids(model, sources, SOS, EOS, PAD, seq_len=40, batch_size=4) == \
            at_once
        assert threads == {threading.get_ident()}
        one_by_one = translate_ids(model, sources, SOS, EOS, PAD, seq_len=40, batch_size=4,
                                   sampling=Sampling(n=2, seed=3))
        assert [[ids for ids, _ in s] for s in one_by_one] == \
            [[ids for ids, _ in s] for s in sampled]  # log P: another thread count's sums
        assert [p for s in one_by_one for _, p in s] == pytest.approx(
            [p for s in sampled for _, p in s], abs=1e-4)
        one_by_one = translate_ids(model, sources, SOS, EOS, PAD, seq_len=40, batch_size=4,
                                   beam=3, nbest=2)
        assert [[ids for ids, _ in s] for s in one_by_one] == [[ids for ids, _ in s]
                                                               for s in beams]
        assert [p for s in one_by_one for _, p in s] == pytest.approx(
            [p for s in beams for _, p in s], abs=1e-4)
        assert threads == {threading.get_ident()}
    finally:
        torch.set_num_threads(previous)
    assert sampling_threads == 2 and beam_threads == 2  # sampling's and beam's batches too


def teacher_forced_logits(state, steps=5, rows=5):
    """The logits of `steps` teacher-forced steps of a state (the same tokens for any state)."""
    generator = torch.Generator().manual_seed(0)
    ys, banned, out = torch.full((rows, 1), SOS), torch.tensor([PAD, SOS]), []
    for _ in range(steps):
        out.append(state.scores(ys, banned))
        ys = torch.cat([ys, torch.randint(4, 24, (rows, 1), generator=generator)], 1)
    return out


@needs_onednn
@pytest.mark.parametrize("design", ["pre-norm", "paper", "modern"])
def test_the_step_computes_each_norm_with_its_gain_bias_and_eps(design):
    """A trained model's norms are not the initial ones (gain 1, bias 0): gains, biases and an
    eps that matters (0.1), in layer norm and RMSNorm, pre- and post-norm, the final norm too:
    the FastState's logits are still the ModelState's."""
    model = small(seed=8, **DESIGNS[design])
    with torch.no_grad():  # the encoder's too (the C step computes the modern one's)
        for module in model.modules():
            if hasattr(module, "eps") and hasattr(module, "alpha"):
                module.alpha.uniform_(0.5, 1.5)
                if getattr(module, "bias", None) is not None:
                    module.bias.normal_(0.0, 0.5)
                module.eps = 0.1
    src, src_mask = batch(8)
    fast = fast_decoder(model, rows=8)
    assert isinstance(fast, FastDecoder)
    plain = teacher_forced_logits(ModelState(model, src, src_mask, capacity=8))
    quick = teacher_forced_logits(FastState(fast, src, src_mask, capacity=8))
    for step, (a, b) in enumerate(zip(plain, quick)):
        assert torch.allclose(a, b, atol=1e-5, rtol=1e-5), (design, step)


@needs_onednn
def test_a_layer_the_step_cannot_read_leaves_the_model_to_its_own_decoder(monkeypatch):
    """The step reads nn.Linear weights, model.py's norms, and a packed projection that
    matches the unpacked one. A linear layer of another class (it may compute otherwise), an
    attention layer with a bias (model.py makes none; the step adds none), a residual
    connection without a norm, or a packed product that does not match: no FastDecoder, and
    the searches decode with the model's own decoder."""
    class Shifted(torch.nn.Linear):
        def forward(self, x):
            return super().forward(x) + 1.0
    sources = [[5, 6, 7], [8, 9, 10, 11]]
    shifted = small(seed=9)
    old = shifted.decoder.layers[0].feed_forward_block.linear_2
    new = Shifted(old.in_features, old.out_features)
    new.load_state_dict(old.state_dict())
    shifted.decoder.layers[0].feed_forward_block.linear_2 = new
    shifted.eval()
    assert fast_decoder(shifted, rows=8) is None
    expected = translate_ids(shifted, sources, SOS, EOS, PAD, seq_len=40, fast_step=False)
    assert translate_ids(shifted, sources, SOS, EOS, PAD, seq_len=40) == expected
    biased = small(seed=9)
    old = biased.decoder.layers[0].cross_attention_block.w_o
    biased.decoder.layers[0].cross_attention_block.w_o = torch.nn.Linear(
        old.in_features, old.out_features).eval()
    assert fast_decoder(biased, rows=8) is None
    expected = translate_ids(biased, sources, SOS, EOS, PAD, seq_len=40, fast_step=False)
    assert translate_ids(biased, sources, SOS, EOS, PAD, seq_len=40) == expected
    no_norm = small(seed=9)
    no_norm.decoder.layers[1].residual_connections[2].norm = torch.nn.Identity()
    no_norm.eval()
    assert fast_decoder(no_norm, rows=8) is None
    expected = translate_ids(no_norm, sources, SOS, EOS, PAD, seq_len=40, fast_step=False)
    assert translate_ids(no_norm, sources, SOS, EOS, PAD, seq_len=40) == expected
    reorder = torch.ops.mkldnn._reorder_linear_weight
    monkeypatch.setattr(torch.ops.mkldnn, "_reorder_linear_weight",
                        lambda weight, rows: reorder(weight * 2, rows))  # packs a wrong copy
    assert fast_decoder(small(seed=9), rows=8) is None


@needs_onednn
def test_without_the_cache_the_searches_re_decode_with_model_py(monkeypatch):
    """use_cache=False (the write-ups' decoder, bench_decode.py --single): model.py's decoder
    re-reads the whole prefix every step, also when given the FastDecoder; the same tokens."""
    model = small(seed=10, **DESIGNS["modern"])
    fast = decoding_model(model, rows=8)
    steps = []
    original = FastDecoder.step
    monkeypatch.setattr(FastDecoder, "step", lambda self, *a: steps.append(1) or
                        original(self, *a))
    src, src_mask = batch(10)
    limit = torch.tensor([3, 9, 12, 5, 7])
    expected = greedy_decode(model, src, src_mask, SOS, EOS, limit)
    assert greedy_decode(fast, src, src_mask, SOS, EOS, limit, use_cache=False) == expected
    sources = [[5, 6, 7], [8, 9]]
    assert translate_ids(fast, sources, SOS, EOS, PAD, seq_len=40, use_cache=False) == \
        translate_ids(model, sources, SOS, EOS, PAD, seq_len=40, fast_step=False)
    assert steps == []


@needs_onednn
def test_fast_step_false_is_model_pys_step_for_a_laid_out_model_and_an_ensemble(monkeypatch):
    """fast_step=False (the reference bench_decode.py times) runs model.py's step whatever it
    is given: a model already laid out (its FastDecoder), and an ensemble's every member."""
    model = small(seed=11)
    fast = decoding_model(model, rows=8)
    assert decoding_model(fast, fast_step=False) is model
    members = decoding_model(Ensemble([model, fast]), rows=8, fast_step=False).members
    assert list(members) == [model, model]
    steps = []
    original = FastDecoder.step
    monkeypatch.setattr(FastDecoder, "step", lambda self, *a: steps.append(1) or
                        original(self, *a))
    sources = [[5, 6, 7], [8, 9]]
    translate_ids(fast, sources, SOS, EOS, PAD, seq_len=40, fast_step=False)
    translate_ids(Ensemble([model, model]), [[s, s] for s in sources], SOS, EOS, PAD,
                  seq_len=40, fast_step=False)
    assert steps == []


@needs_onednn
def test_beams_reorder_between_two_caches(monkeypatch):
    """The operators' step: follow() moves the decoded positions into the spare cache and swaps
    the two, so beam search's steps allocate no cache after the first reordering."""
    laid_out_as("modern, the operators' step", monkeypatch)
    caches = following_beams(FastState)
    assert len({cache.data_ptr() for cache in caches}) == 2


@needs_onednn
def test_beams_follow_in_the_c_steps_cache_without_moving_it():
    """The C step: follow() takes the rows of `where` the beams follow; the cache is one
    tensor, written once at each position, never moved (its earlier positions unchanged)."""
    if nmt.decoder_step._compiled_layers() is None:
        pytest.skip("no C compiler here")
    snapshots = []

    class Watched(FastState):  # the cache as each step leaves it
        def follow(self, rows):
            snapshots.append((self.length, self.cache.clone()))
            super().follow(rows)
    caches = following_beams(Watched)
    assert len({cache.data_ptr() for cache in caches}) == 1
    final = caches[-1]
    for length, cache in snapshots:
        assert torch.equal(final[:, :, :length], cache[:, :, :length])


def following_beams(state_class):
    """Six steps of rows that follow each other (checked against model.py's step each time);
    the state's cache after each."""
    model = small(seed=12, **DESIGNS["modern"])
    src, src_mask = batch(12)
    state = state_class(decoding_model(model, rows=8), src, src_mask, capacity=10)
    plain = ModelState(model, src, src_mask, capacity=10)
    banned, ys, caches = torch.tensor([PAD, SOS]), torch.full((5, 1), SOS), []
    rows = torch.tensor([1, 0, 3, 2, 4])
    for _ in range(6):
        logits = state.scores(ys, banned)
        assert torch.allclose(logits, plain.scores(ys, banned), atol=1e-5, rtol=1e-5)
        ys = torch.cat([ys[rows], logits.argmax(-1, keepdim=True)[rows]], 1)
        state.follow(rows)
        plain.follow(rows)
        caches.append(state.cache)  # held: a freed cache's memory is not handed out again
    return caches


@needs_onednn
def test_only_the_fast_steps_searches_decode_batches_at_once(monkeypatch):
    """With two threads: each worker decoding a batch has one intra-op thread, whatever the
    search (sampling ignores beam and nbest); a single batch, model.py's step, and an
    ensemble with a member the step does not apply to, decode one batch at a time on the
    caller's thread."""
    import threading

    from nmt import decoding
    model = small(seed=13)
    sources = [[4 + (i * 5 + j) % 20 for j in range(1 + i % 4)] for i in range(12)]
    seen = []  # (thread, its intra-op threads) of every step
    fast_step, model_step = FastDecoder.step, decoding.ModelState.scores
    monkeypatch.setattr(FastDecoder, "step", lambda self, *a: seen.append(
        (threading.get_ident(), torch.get_num_threads())) or fast_step(self, *a))
    monkeypatch.setattr(decoding.ModelState, "scores", lambda self, *a: seen.append(
        (threading.get_ident(), torch.get_num_threads())) or model_step(self, *a))

    class Subclass(type(model)):  # no fast step for it
        pass
    other = small(seed=14)
    other.__class__ = Subclass
    caller = threading.get_ident()
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        translate_ids(model, sources, SOS, EOS, PAD, seq_len=40, batch_size=3)
        assert len({t for t, _ in seen}) == 2 and caller not in {t for t, _ in seen}
        assert {n for _, n in seen} == {1}
        seen.clear()
        translate_ids(model, sources, SOS, EOS, PAD, seq_len=40, batch_size=6, beam=3,
                      nbest=2, sampling=Sampling(n=2))
        assert len({t for t, _ in seen}) == 2 and caller not in {t for t, _ in seen}
        seen.clear()  # one batch: on the caller's thread, with both threads
        translate_ids(model, sources[:3], SOS, EOS, PAD, seq_len=40, batch_size=3, beam=3)
        assert seen and set(seen) == {(caller, 2)}
        for decode in (lambda: translate_ids(model, sources, SOS, EOS, PAD, seq_len=40,
                                             batch_size=3, fast_step=False),
                       lambda: translate_ids(Ensemble([model, other]),
                                             [[s, s] for s in sources], SOS, EOS, PAD,
                                             seq_len=40, batch_size=3)):
            seen.clear()
            decode()
            assert seen and {t for t, _ in seen} == {caller}
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(previous)
