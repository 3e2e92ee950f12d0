"""The searches: cached == full re-decoding, batched == one by one, beam 1 == greedy, the length
rules, and text in, text out (the CPU's fast step: test_decoder_step.py)."""

import pytest
import torch
import torch.nn.functional as F
from conftest import small, tiny_model

from model import build_transformer, causal_mask
from nmt.decoding import (Sampling, beam_search, clean, decoded, greedy_decode,
                          output_limits, translate_ids)
from tokenizer import EOS, PAD, SOS, UNK


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
def memorized():
    return memorized_model()


def test_a_tiny_model_memorizes_a_tiny_corpus(memorized):
    model, pairs, src, src_mask = memorized
    out = greedy_decode(model, src, src_mask, SOS, EOS, max_len=10)
    assert out == [t for _, t in pairs]


def test_cached_greedy_equals_full_redecode(memorized):
    model, _, src, src_mask = memorized
    untrained = tiny_model(vocab=20, seed=3)  # long, EOS-free outputs exercise the cache more
    for m in (model, untrained):
        cached = greedy_decode(m, src, src_mask, SOS, EOS, max_len=15, use_cache=True)
        full = greedy_decode(m, src, src_mask, SOS, EOS, max_len=15, use_cache=False)
        assert cached == full


def test_batched_decoding_equals_one_by_one(memorized):
    model, pairs, _, _ = memorized
    srcs = [s for s, _ in pairs]
    batched = translate_ids(model, srcs, SOS, EOS, PAD, seq_len=32, batch_size=6)
    single = [translate_ids(model, [s], SOS, EOS, PAD, seq_len=32)[0] for s in srcs]
    assert batched == single == [t for _, t in pairs]
    beam_batched = translate_ids(model, srcs, SOS, EOS, PAD, seq_len=32, beam=3, batch_size=6)
    beam_single = [translate_ids(model, [s], SOS, EOS, PAD, seq_len=32, beam=3)[0] for s in srcs]
    assert beam_batched == beam_single


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


def test_a_limit_below_min_len_is_raised_to_it():
    """An empty source with max_len_a · 0 + max_len_b below min_len: the limit is min_len, so
    [EOS] is not both required and barred (beam search crashed, greedy emitted a token from a
    row of -inf); every decoder outputs exactly min_len tokens there."""
    assert output_limits(torch.tensor([0, 3]), 2.0, 0, seq_len=32, min_len=2).tolist() == [2, 6]
    with pytest.raises(ValueError, match="min_len 5 is more than a translation can hold"):
        output_limits(torch.tensor([0]), 2.0, 0, seq_len=4, min_len=5)  # (no limit fits it)
    model = tiny_model(vocab=20, seed=0)
    with torch.no_grad():  # [EOS] is the model's first choice: only the rules lengthen
        model.projection_layer.proj.bias[EOS] = 100.0
    for beam in (1, 3):
        out = translate_ids(model, [[], [5]], SOS, EOS, PAD, 32, beam=beam, max_len_a=2,
                            max_len_b=0, min_len=2)
        assert [len(o) for o in out] == [2, 2], (beam, out)


def test_a_min_len_no_translation_can_hold_is_refused():
    """A min_len above seq_len - 2 both required and barred [EOS] at the last step (greedy
    raised TypeError, beam search IndexError): refused as Config.validate refuses it on the
    command line, while seq_len - 2 output tokens still decode."""
    model = tiny_model(vocab=20, seq_len=6)
    for beam in (1, 3):
        with pytest.raises(ValueError, match="min_len 5 is more than a translation can hold"):
            translate_ids(model, [[5, 6]], SOS, EOS, PAD, 6, beam=beam, min_len=5)
        out = translate_ids(model, [[5, 6]], SOS, EOS, PAD, 6, beam=beam, min_len=4)
        assert [len(o) for o in out] == [4], (beam, out)


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


def test_each_search_decodes_its_default_batches():
    """Without batch_size, greedy decoding takes config.GREEDY_BATCH_SIZE sentences at once and
    beam search and sampling config.DECODE_BATCH_SIZE (sampling's divided among its samples):
    the batches progress reports."""
    from config import DECODE_BATCH_SIZE, GREEDY_BATCH_SIZE
    from nmt.decoding import Sampling
    model = tiny_model(vocab=20, seed=0)
    n = GREEDY_BATCH_SIZE + DECODE_BATCH_SIZE + 3
    sources = [[5 + i % 10] * (1 + i % 3) for i in range(n)]

    def batches(**options):
        done = []
        translate_ids(model, sources, SOS, EOS, PAD, 32, max_len_b=2, progress=done.append,
                      **options)
        return done
    def sizes(size):  # n sentences in batches of `size`, the one left over last
        return [min(size, n - start) for start in range(0, n, size)]
    assert batches() == sizes(GREEDY_BATCH_SIZE)
    assert batches(beam=2) == batches(nbest=2) == sizes(DECODE_BATCH_SIZE)
    assert batches(sampling=Sampling(n=2, seed=1)) == sizes(DECODE_BATCH_SIZE // 2)


def test_the_longest_batch_is_decoded_first_and_the_one_left_over_is_the_shortest(
        monkeypatch):
    """Batches of similar lengths, the longest first and the one left over (fewer sentences)
    of the shortest: decoded several at once, the threads then end together (the longest last
    and the left-over one of the longest kept one thread busy alone at the end)."""
    import nmt.decoding
    model = tiny_model(vocab=20, seed=0)
    sources = [[5] * (1 + i) for i in range(10)]  # lengths 1 to 10, in order
    real, seen = nmt.decoding.source_batches, []

    def recording(model, sentences, *args):
        seen.append(sorted(len(s) for s in sentences))
        return real(model, sentences, *args)
    monkeypatch.setattr(nmt.decoding, "source_batches", recording)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one batch at a time: the calls in the batches' order
    try:
        out = translate_ids(model, sources, SOS, EOS, PAD, 32, batch_size=4)
    finally:
        torch.set_num_threads(threads)
    assert seen == [[7, 8, 9, 10], [3, 4, 5, 6], [1, 2]]
    assert out == translate_ids(model, sources[::-1], SOS, EOS, PAD, 32, batch_size=3)[::-1]


def test_batches_decoded_at_once_come_back_in_order():
    """decoded(): batches decoded two at a time come back in the order given (progress goes
    batch by batch), even when a later one is done first."""
    import time

    def decode(idx):
        if idx == [0]:
            time.sleep(0.2)  # the first batch ends last
        return [10 * i for i in idx]
    batches = [[0], [1, 2], [3], [4]]
    assert list(decoded(decode, batches, 2)) == [([0], [0]), ([1, 2], [10, 20]), ([3], [30]),
                                                 ([4], [40])]


def test_batches_decoded_at_once_leave_torchs_thread_count_to_threads_started_later():
    """Each worker decodes with one intra-op thread, but torch.set_num_threads also sets the
    count a thread takes at its first parallel operator: threads started after the batches,
    and a caller that had not run one yet, have the caller's count, not the workers' 1."""
    import threading

    def in_a_new_thread(work):
        seen = []
        thread = threading.Thread(target=lambda: seen.append(work()))
        thread.start()
        thread.join()
        return seen[0]

    def caller():  # a thread whose first parallel operator comes after the batches
        torch.set_num_threads(2)
        workers = [n for _, out in decoded(lambda idx: [torch.get_num_threads()],
                                           [[0], [1], [2]], 2) for n in out]
        return workers, torch.get_num_threads()
    previous = torch.get_num_threads()
    try:
        assert in_a_new_thread(caller) == ([1, 1, 1], 2)
        assert in_a_new_thread(torch.get_num_threads) == 2
    finally:
        torch.set_num_threads(previous)


OPTIONS = {
    "default": {},
    "paper": dict(norm_first=False, shared_vocab=True, tie_embeddings="all"),
    "modern": dict(norm="rms", ffn="swiglu", pos="rope", n_kv_heads=2, tie_embeddings="decoder"),
    "rope_post_gqa1": dict(pos="rope", norm_first=False, n_kv_heads=1),
    "shallow_decoder": dict(N_dec=1),
}


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


def test_decoders_never_emit_pad_sos_or_unk():
    """12. Even a model that prefers them."""
    torch.manual_seed(0)
    model = build_transformer(20, 20, 32, 32, d_model=16, N=1, h=2, d_ff=32).eval()
    with torch.no_grad():
        model.projection_layer.proj.bias[[PAD, SOS, UNK]] = 100.0  # always the top logits
        model.projection_layer.proj.bias[EOS] = -100.0
    sources = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
    for beam in (1, 3):
        outputs = translate_ids(model, sources, SOS, EOS, PAD, 32, beam=beam, max_len_a=1,
                                max_len_b=5, unk_id=UNK)
        assert all(out and not {PAD, SOS, UNK} & set(out) for out in outputs), (beam, outputs)
    emitted = translate_ids(model, sources, SOS, EOS, PAD, 32, max_len_a=1,
                            max_len_b=5)  # no unk_id
    assert all(set(out) == {UNK} for out in emitted)  # the bias works: UNK unless banned


def test_inference_input_keeps_text_characters():
    """8. Zero-width (non-)joiners, no-break and thin spaces, soft hyphens are text."""
    text = "l\u2019\u00e9t\u00e9\u00a0: \u0645\u06cc\u200c\u062e\u0648\u0627\u0647\u0645 " \
           "\U0001F469\u200d\U0001F4BB co\u00adoperate\u2009!"
    assert clean(text) == text
    assert clean(" a\tb\x07c\r\n") == "a b c"


def exhaustive_best(model, src, src_mask, tokens, limit: int, alpha: float, min_len: int):
    """Every output of at most `limit` tokens from `tokens`, then [EOS], scored as beam search
    scores a finished hypothesis (log P over the allowed tokens / length penalty): the best."""
    from itertools import product

    from nmt.decoding import length_penalty
    allowed = torch.tensor(list(tokens) + [EOS])
    best = (None, float("-inf"))
    for length in range(min_len, limit + 1):
        for out in product(tokens, repeat=length):
            tgt = torch.tensor([[SOS, *out]])  # (1, length + 1)
            x = model.decode(model.encode(src, src_mask), src_mask, tgt)  # (1, length + 1, d)
            logits = model.project(x)[0].float()  # (length + 1, vocab)
            masked = torch.full_like(logits, float("-inf"))
            masked[:, allowed] = logits[:, allowed]
            logp = masked.log_softmax(dim=-1)  # (length + 1, vocab); [EOS] barred after it
            total = sum(logp[i, t].item() for i, t in enumerate([*out, EOS]))
            score = total / length_penalty(length + 1, alpha)
            if score > best[1]:
                best = (list(out), score)
    return best


@pytest.mark.parametrize("min_len", [0, 2])
def test_beam_search_without_the_early_stop_finds_the_exhaustive_searchs_best(min_len):
    """Issue 41: beam search was never held to an exhaustive search. Three tokens, at most
    three of them, a beam of 27 (every prefix fits): fairseq's stop (k finished) finds the
    best length-normalised output of all 40. The early stop (OpenNMT's) ranks by log P before
    the length penalty, which favours length: here it stops at [6] while [6, 5] scores better
    once normalised (alpha 1 and 2, without min_len)."""
    torch.manual_seed(25)
    model = build_transformer(7, 7, 16, 16, d_model=16, N=1, h=2, d_ff=32, dropout=0.0).eval()
    with torch.no_grad():
        model.projection_layer.proj.weight.mul_(4)  # peakier distributions: lengths differ
    src = torch.tensor([[SOS, 4, 5, 6, EOS]])
    src_mask = torch.ones(1, 1, 1, 5, dtype=torch.bool)
    tokens, banned = (4, 5, 6), (UNK, PAD, SOS)
    for alpha in (0.0, 0.6, 1.0, 2.0):
        with torch.no_grad():
            expected = exhaustive_best(model, src, src_mask, tokens, 3, alpha, min_len)
        [[(out, score)]] = beam_search(model, src, src_mask, SOS, EOS, 3, beam=27, alpha=alpha,
                                       banned=banned, min_len=min_len, early_stop=False)
        assert out == expected[0] and score == pytest.approx(expected[1], abs=1e-4), alpha
        [[(out, score)]] = beam_search(model, src, src_mask, SOS, EOS, 3, beam=27, alpha=alpha,
                                       banned=banned, min_len=min_len)
        assert min_len <= len(out) <= 3 and score <= expected[1] + 1e-4
        if min_len == 0 and alpha >= 1:
            assert out == [6] and score < expected[1] - 0.02  # the early stop's miss


def test_a_beam_wider_than_the_live_tokens_returns_only_real_hypotheses():
    """Four tokens may follow (4, 5, 6, [EOS]) and the beam holds 6: the candidates past the
    live ones score -inf, some of them [EOS]; none is a finished hypothesis: the 6 best are 6
    distinct outputs, each with a finite score."""
    torch.manual_seed(25)
    model = build_transformer(7, 7, 16, 16, d_model=16, N=1, h=2, d_ff=32, dropout=0.0).eval()
    src = torch.tensor([[SOS, 4, 5, 6, EOS]])
    src_mask = torch.ones(1, 1, 1, 5, dtype=torch.bool)
    [hyps] = beam_search(model, src, src_mask, SOS, EOS, 3, beam=6, nbest=6, alpha=0.0,
                         banned=(UNK, PAD, SOS), early_stop=False)
    outs = [out for out, _ in hyps]
    assert len(set(map(tuple, outs))) == 6 and all(s > float("-inf") for _, s in hyps), hyps


@torch.no_grad()
def reference_beam(model, ids, k, limit, alpha, nbest, min_len, early_stop):
    """beam_search's docstring, one sentence, every prefix re-decoded: the 2k best candidates
    each step; an [EOS] among the k best finishes a hypothesis, scored log P / length penalty;
    the k best others go on. Stops past the limit, with k finished, or (early_stop) when the
    best candidate is [EOS] and nbest are finished."""
    from nmt.decoding import length_penalty
    beams, finished = [([], 0.0)], []
    for step in range(1, limit + 2):
        candidates = []
        for prefix, score in beams:
            logp = step_log_probs([model], [ids], prefix)
            if step <= min_len:
                logp[EOS] = float("-inf")
            if step > limit:  # [EOS] the only choice
                logp[torch.arange(logp.numel()) != EOS] = float("-inf")
            candidates += [(score + v, prefix, t) for t, v in enumerate(logp.tolist())
                           if v > float("-inf")]
        top = sorted(candidates, key=lambda c: -c[0])[:2 * k]
        finished += [(p, s / length_penalty(step, alpha)) for rank, (s, p, t) in enumerate(top)
                     if t == EOS and rank < k]
        beams = [(p + [t], s) for s, p, t in top if t != EOS][:k]
        if step > limit or len(finished) >= k or (
                early_stop and top[0][2] == EOS and len(finished) >= nbest):
            break
    return sorted(finished, key=lambda h: -h[1])[:nbest]


def test_beam_search_stops_by_its_rules_as_a_reference_search_does():
    """A beam of 3 short of every prefix, outputs of several lengths: each sentence's n-best
    (tokens and scores) are those of the search its docstring tells, re-decoding every prefix:
    without the early stop it ends once k hypotheses are finished (fairseq's rule; a search
    that went on to the limit found other, longer ones at alpha 2)."""
    model = tiny_model(vocab=20, seed=0)
    with torch.no_grad():
        model.projection_layer.proj.weight.mul_(3)  # peakier: the outputs' lengths differ
    for alpha, early_stop in ((0.6, True), (2.0, False)):
        out = translate_ids(model, SOURCES, SOS, EOS, PAD, 32, beam=3, nbest=2, alpha=alpha,
                            max_len_a=0, max_len_b=5, early_stop=early_stop)
        for src, hyps in zip(SOURCES, out):
            expected = reference_beam(model, src, 3, 5, alpha, 2, 1, early_stop)
            assert [h for h, _ in hyps] == [h for h, _ in expected], (alpha, src)
            assert [s for _, s in hyps] == pytest.approx([s for _, s in expected], abs=1e-4)


# ---- ensembles and sampling (issue 42) ----------------------------------------------------------

@torch.no_grad()
def step_log_probs(models, sources, prefix, banned=(PAD, SOS)):
    """The reference: each model re-decodes the whole prefix (no cache) from its own source
    (ids without [SOS]/[EOS]); the mean of their log-probabilities of the next token, (vocab,),
    each model normalized without the banned tokens."""
    rows = []
    for model, ids in zip(models, sources):
        src = torch.tensor([[SOS] + ids + [EOS]])
        ys = torch.tensor([[SOS] + prefix])
        mask = causal_mask(ys.size(1))
        out = model.decode(model.encode(src, None), None, ys, mask)
        logits = model.project(out[:, -1]).float()[0]
        logits[list(banned)] = float("-inf")
        rows.append(logits.log_softmax(dim=-1))
    return torch.stack(rows).mean(dim=0)


def test_an_ensemble_of_one_model_decodes_as_that_model(memorized):
    """Issue 42: the ensemble's path (its state, caches, the mean of log-probabilities) with
    one model, or with one model twice, gives that model's translations and beam scores."""
    from nmt.decoding import Ensemble
    model, pairs, _, _ = memorized
    untrained = tiny_model(vocab=20, seed=3)
    srcs = [s for s, _ in pairs] + [[4, 9, 13, 5, 6]]
    for m in (model, untrained):
        for beam, nbest in ((1, 1), (3, 1), (3, 3)):
            alone = translate_ids(m, srcs, SOS, EOS, PAD, seq_len=32, beam=beam, nbest=nbest)
            for members in ([m], [m, m]):
                together = translate_ids(Ensemble(members), [[s] * len(members) for s in srcs],
                                         SOS, EOS, PAD, seq_len=32, beam=beam, nbest=nbest)
                if nbest == 1:
                    assert together == alone
                else:
                    assert [[h for h, _ in hyps] for hyps in together] == \
                        [[h for h, _ in hyps] for hyps in alone]
                    assert [s for hyps in together for _, s in hyps] == pytest.approx(
                        [s for hyps in alone for _, s in hyps], abs=1e-5)


def test_an_ensemble_averages_its_models_log_probabilities_at_each_step():
    """Issue 42: two models of other sizes and designs and their own source vocabularies
    (other ids for the same sentence): greedy picks the best mean log-probability at each step
    and beam's scores are the mean log-probabilities summed, as the models re-decoding every
    prefix give them: each model's cache follows the beams' reordering."""
    from nmt.decoding import Ensemble, length_penalty
    a = tiny_model(vocab=20, seed=5)
    torch.manual_seed(6)
    b = build_transformer(30, 20, 32, 32, d_model=16, N=1, h=2, d_ff=32, dropout=0.0,
                          norm="rms", ffn="swiglu", pos="rope").eval()
    ensemble = Ensemble([a, b])
    sources = [([4, 5, 6, 7], [21, 22, 23]), ([9, 9, 12], [25, 4, 28, 29, 8]), ([15], [16])]
    greedy = translate_ids(ensemble, [list(s) for s in sources], SOS, EOS, PAD, seq_len=32,
                           max_len_a=0, max_len_b=6)
    for (src_a, src_b), out in zip(sources, greedy):
        prefix = []
        for _ in range(len(out) + 1):
            logp = step_log_probs([a, b], [src_a, src_b], prefix)
            if len(prefix) < 1:
                logp[EOS] = float("-inf")  # min_len 1
            prefix.append(int(logp.argmax()))
            if prefix[-1] == EOS or len(prefix) == 6:
                break
        assert out == [t for t in prefix if t != EOS]
    beams = translate_ids(ensemble, [list(s) for s in sources], SOS, EOS, PAD, seq_len=32,
                          beam=3, nbest=3, max_len_a=0, max_len_b=6)
    for (src_a, src_b), hyps in zip(sources, beams):
        for tokens, score in hyps:
            total = sum(step_log_probs([a, b], [src_a, src_b], tokens[:i])[t]
                        for i, t in enumerate(tokens + [EOS]))
            assert score == pytest.approx(float(total) / length_penalty(len(tokens) + 1, 0.6),
                                          abs=1e-4)


def sampled(model, srcs, batch_size=64, **options):
    from nmt.decoding import Sampling
    return translate_ids(model, srcs, SOS, EOS, PAD, seq_len=32, batch_size=batch_size,
                         sampling=Sampling(**options))


SOURCES = [[4, 5, 6], [5, 9], [6, 6, 4, 13], [13, 4], [9, 10, 11], [7], [8, 12, 14, 15, 16]]


def test_sampling_with_top_k_1_or_a_temperature_near_0_is_greedy():
    """Issue 42: a sample that may only take the most likely token is the greedy translation,
    whatever its random draws."""
    model = tiny_model(vocab=20, seed=2)
    greedy = translate_ids(model, SOURCES, SOS, EOS, PAD, seq_len=32)
    for options in ({"top_k": 1}, {"temperature": 1e-4}, {"top_p": 1e-6}):
        for seed in (0, 1):
            out = sampled(model, SOURCES, n=3, seed=seed, **options)
            assert [[ids for ids, _ in samples] for samples in out] == [[g] * 3 for g in greedy]
    diverse = sampled(model, SOURCES, n=3)  # and without a cut, the draws differ
    assert sum(len({tuple(ids) for ids, _ in samples}) > 1 for samples in diverse) >= 5


@pytest.mark.parametrize("options", [{"top_k": 3}, {"top_p": 0.3}, {"top_p": 0.6,
                                                                      "temperature": 1.5}])
def test_no_sampled_token_lies_outside_the_top_k_or_the_nucleus(options):
    """Issue 42: every token of every sample, checked against the model's own distribution
    after its prefix (re-decoded without the cache): within the k most likely, or within the
    fewest most likely tokens whose probability (after the temperature) reaches top_p. Each
    sample's score is its log-probability under the model."""
    model = tiny_model(vocab=20, seed=4)
    outside = 0
    for src, samples in zip(SOURCES, sampled(model, SOURCES, n=6, seed=3, **options)):
        for tokens, score in samples:
            total = 0.0
            for i, token in enumerate(tokens + [EOS]):
                logp = step_log_probs([model], [src], tokens[:i])
                if i < 1:
                    logp[EOS] = float("-inf")  # min_len 1
                if i == int(1.2 * len(src) + 10):  # the length limit: [EOS] is the only choice
                    logp = torch.full_like(logp, float("-inf")).index_fill_(0, torch.tensor(
                        [EOS]), float(logp[EOS]))
                total += float(logp[token])
                ranked = (logp / options.get("temperature", 1.0)).softmax(-1).sort(
                    descending=True)
                position = ranked.indices.tolist().index(token)
                if "top_k" in options:
                    outside += position >= options["top_k"]
                else:
                    before = float(ranked.values[:position].sum())
                    outside += before >= options["top_p"] + 1e-6
            assert score == pytest.approx(total, abs=1e-4)
    assert outside == 0


def test_a_seed_gives_the_same_samples_in_a_batch_and_one_by_one():
    """Issue 42: a sentence's samples depend on the seed, the sentence and the sample's number,
    never on the sentences decoded beside it, nor on the batch size; another seed draws
    others."""
    model = tiny_model(vocab=20, seed=2)
    batched = sampled(model, SOURCES, n=4, seed=7, top_p=0.9)
    alone = [sampled(model, [s], n=4, seed=7, top_p=0.9)[0] for s in SOURCES]
    small_batches = sampled(model, SOURCES, batch_size=4, n=4, seed=7, top_p=0.9)
    assert [[t for t, _ in s] for s in batched] == [[t for t, _ in s] for s in alone] == \
        [[t for t, _ in s] for s in small_batches]
    other = sampled(model, SOURCES, n=4, seed=8, top_p=0.9)
    assert [[t for t, _ in s] for s in other] != [[t for t, _ in s] for s in batched]


def test_nbest_alone_gives_scored_hypotheses():
    """translate_ids with nbest > 1 lists (ids, score) per sentence whatever the beam, not
    greedy's bare ids; nbest given alone (beam 1) searches with a beam of that width, as
    translate.py --nbest does (it gave one hypothesis a sentence, a beam of 1's)."""
    model = tiny_model(vocab=20, seed=2)
    wide = translate_ids(model, SOURCES, SOS, EOS, PAD, seq_len=32, beam=3, nbest=3)
    listed = translate_ids(model, SOURCES, SOS, EOS, PAD, seq_len=32, nbest=3)
    assert listed == wide and all(len(hyps) == 3 for hyps in listed)
    for hyps in listed:
        assert all(isinstance(ids, list) and s < 0 for ids, s in hyps), hyps


def fixed_distribution_model(probs):
    """A model whose next token, after any source and prefix, is 4, 5, 6... with these
    probabilities (every other token, [EOS] too, 1e-43 times less likely)."""
    model = tiny_model(vocab=20, seed=0)
    with torch.no_grad():
        model.projection_layer.proj.weight.zero_()
        model.projection_layer.proj.bias.fill_(-100.0)
        model.projection_layer.proj.bias[4:4 + len(probs)] = torch.tensor(probs).log()
    return model


def test_samples_are_drawn_from_the_models_distribution():
    """Issue 42: ancestral sampling draws each token with the model's probability (after the
    temperature): 2000 one-token samples of a distribution of 0.4 and six of 0.1 come out that
    often (a Gumbel noise of the wrong sign drew the first 57% of the time), and at
    temperature 2 as the square roots of those, normalized."""
    model = fixed_distribution_model([0.4] + [0.1] * 6)
    for temperature, expected in ((1.0, [0.4] + [0.1] * 6), (2.0, [0.25] + [0.125] * 6)):
        [samples] = translate_ids(model, [[5, 6]], SOS, EOS, PAD, seq_len=32, max_len_a=0,
                                  max_len_b=1, sampling=Sampling(n=2000, seed=1,
                                                                 temperature=temperature))
        counts = torch.bincount(torch.tensor([ids[0] for ids, _ in samples]), minlength=11)
        assert (counts[4:11] / 2000).tolist() == pytest.approx(expected, abs=0.04), counts


def test_each_sentence_draws_its_own_samples():
    """Two sentences the model treats alike (its distribution ignores the source) are sampled
    with draws of their own, not the same draws twice: their samples differ."""
    model = fixed_distribution_model([0.4, 0.3, 0.3])
    first, second = sampled(model, [[4, 5], [6, 7]], n=4, seed=0)
    assert [ids for ids, _ in first] != [ids for ids, _ in second]


def test_a_top_k_of_the_vocabulary_or_more_cuts_nothing():
    """top_k at or above the vocabulary's size keeps every token: the samples of no cut (a
    top_k above it raised from torch.topk)."""
    model = tiny_model(vocab=20, seed=2)
    uncut = sampled(model, SOURCES, n=3, seed=4)
    for top_k in (20, 50):
        assert sampled(model, SOURCES, n=3, seed=4, top_k=top_k) == uncut


def test_the_nucleus_is_the_fewest_tokens_that_reach_top_p():
    """Four equally likely tokens and top_p 0.5: two of them reach it, so the third is cut
    (its more likely tokens' mass, exactly 0.5, already reaches top_p)."""
    from nmt.decoding import filter_logits
    kept = filter_logits(torch.zeros(1, 4), 0, 0.5).isfinite()
    assert kept.sum().item() == 2


def test_an_ensemble_of_one_model_samples_as_that_model():
    """Issue 42: an ensemble of a model with itself draws the model's samples for the same seed
    (each sentence's draws keyed by its first model's tokens)."""
    from nmt.decoding import Ensemble
    model = tiny_model(vocab=20, seed=2)
    alone = sampled(model, SOURCES, n=3, seed=5, top_p=0.9)
    together = sampled(Ensemble([model, model]), [[s, s] for s in SOURCES], n=3, seed=5,
                       top_p=0.9)
    assert [[ids for ids, _ in s] for s in together] == [[ids for ids, _ in s] for s in alone]
    assert [p for s in together for _, p in s] == pytest.approx([p for s in alone for _, p in s],
                                                                abs=1e-4)


def test_a_sentence_longer_than_seq_len_is_named_by_its_number_in_the_file(capsys):
    """The warning about a sentence cut to seq_len names it by its number in the file: under
    torchrun a rank translating every world_size-th test sentence named them by their place in
    its share."""
    from config import Config
    from nmt.decoding import translate
    from tokenizer import build_tokenizer
    long = "one two three four five six seven eight nine ten"
    tok = build_tokenizer("word", 30, [long])
    model = tiny_model(vocab=tok.get_vocab_size(), seq_len=8)
    translate(model, Config(seq_len=8), tok, tok, ["one two", long], numbers=range(4, 8, 2))
    err = capsys.readouterr().err
    assert "warning: sentence 6 has 10 tokens" in err and "sentence 4" not in err, err
    translate(model, Config(seq_len=8), tok, tok, ["one two", long])
    assert "warning: sentence 2 has 10 tokens" in capsys.readouterr().err
    import re
    import sys

    from tqdm import tqdm
    with tqdm(total=3, file=sys.stderr, desc="testing"):  # (test scoring's bar, open): the
        translate(model, Config(seq_len=8), tok, tok, [long])  # warning is not on its line
    lines = re.split(r"[\r\n]", capsys.readouterr().err)
    assert any(line.startswith("warning: sentence 1 has 10 tokens") for line in lines), lines


def test_a_sentence_that_fills_seq_len_is_not_warned_of(capsys):
    """seq_len 8 holds [SOS], [EOS] and 6 tokens: a sentence of 6 is translated whole, without
    the warning; an ensemble warns where any model's tokenizer cuts a sentence into more (its
    models each take their own tokens), though its first model's holds it."""
    from config import Config
    from nmt.decoding import Ensemble, translate
    from tokenizer import build_tokenizer
    text = "one two three four five six"
    words = build_tokenizer("word", 30, [text] * 2)  # 6 tokens
    chars = build_tokenizer("bpe", 270, [text])  # bytes: more than 6
    model = tiny_model(vocab=words.get_vocab_size(), seq_len=8)
    translate(model, Config(seq_len=8), words, words, [text])
    assert "warning" not in capsys.readouterr().err
    torch.manual_seed(1)
    other = build_transformer(chars.get_vocab_size(), words.get_vocab_size(), 8, 8, d_model=16,
                              N=1, h=2, d_ff=32).eval()
    translate(Ensemble([model, other]), Config(seq_len=8), [words, chars], words, [text])
    assert f"warning: sentence 1 has {len(chars.encode(text).ids)} tokens" in \
        capsys.readouterr().err


class Echo:
    """A stand-in for an exported engine (anything with translate_ids): each sentence's output
    is its own source ids; it records what it was asked."""

    def __init__(self):
        self.asked = []

    def translate_ids(self, src_ids, *args, **options):
        self.asked.append((src_ids, options))
        return [list(ids) for ids in src_ids]


def test_translate_hands_an_engine_the_cleaned_sentences_and_the_configs_rules():
    """translate() decodes with a model's own translate_ids where it has one (translate.py
    --ctranslate2's engine), given the sentences as training text is (a tab or a bell between
    words is a space, not part of a word: [UNK]), the config's length rules, and [UNK] to bar;
    an empty sentence is not sent, and comes back empty."""
    from config import Config
    from nmt.decoding import translate
    from tokenizer import build_tokenizer
    tok = build_tokenizer("word", 30, ["one two three"] * 2)
    engine = Echo()
    config = Config(seq_len=16, max_len_a=0.5, max_len_b=3, min_len=2)
    assert translate(engine, config, tok, tok, ["one\ttwo\x07three ", "", "two"]) == \
        ["one two three", "", "two"]
    [(ids, options)] = engine.asked
    assert ids == [tok.encode("one two three").ids, tok.encode("two").ids]
    assert (options["max_len_a"], options["max_len_b"], options["min_len"]) == (0.5, 3, 2)
    assert options["unk_id"] == UNK


def test_translate_stops_early_unless_told_otherwise():
    """decoding.translate hands the search its early_stop, and the early stop by default (the
    end-of-run test scores, nmt/evaluation.py, and distill.py's teachers give none); an engine
    is asked as a model is (it refuses False: tests/test_export.py)."""
    from config import Config
    from nmt.decoding import translate
    from tokenizer import build_tokenizer
    tok = build_tokenizer("word", 30, ["one two three"] * 2)
    engine = Echo()
    for options in ({}, {"early_stop": False}, {"early_stop": True}):
        translate(engine, Config(seq_len=16), tok, tok, ["one two"], beam=2, **options)
    assert [options["early_stop"] for _, options in engine.asked] == [True, False, True]


def test_an_empty_sentence_has_as_many_empty_samples_as_the_others():
    """With n samples a sentence, an empty sentence has n empty ones (score 0), so that
    translate.py's n lines an input line stay in step with the input."""
    from config import Config
    from nmt.decoding import translate
    from tokenizer import build_tokenizer
    tok = build_tokenizer("word", 30, ["one two three"] * 2)
    model = tiny_model(vocab=tok.get_vocab_size(), seq_len=16)
    out = translate(model, Config(seq_len=16), tok, tok, ["one two", ""],
                    sampling=Sampling(n=3, seed=1))
    assert len(out[0]) == 3 and out[1] == [("", 0.0)] * 3


def test_every_beam_search_takes_config_length_penalty_by_default():
    """config.LENGTH_PENALTY is the one default of beam search's alpha: the decoders, the test
    sets' beam (decoding.translate's default), the Python API and the exported engine."""
    import inspect

    from config import LENGTH_PENALTY
    from nmt import decoding
    from nmt.engine import Engine
    from nmt.translator import Translator
    for f in (decoding.beam_search, decoding.translate_ids, decoding.translate,
              Translator.translate, Engine.translate_ids):
        assert inspect.signature(f).parameters["alpha"].default == LENGTH_PENALTY, f.__qualname__
