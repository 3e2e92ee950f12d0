"""Decoding a trained model: greedy and beam search with a key/value cache, the output-length
rules, and the text-in, text-out `translate` that validation, test scoring, translate.py, the
teachers' translation and the benchmarks call. On CPU in float32 the searches run the decoder's
fast one-token step (nmt/decoder_step.py), held equal to model.py's by its tests.

    translate(model, config, tokenizer_src, tokenizer_tgt, ["A dog runs."], beam=4)
    translate_ids(model, [[17, 402, 9]], SOS, EOS, PAD, seq_len)     # ids in, ids out

`model` may also be a CTranslate2 engine (nmt.engine.Engine): anything with a translate_ids method.
"""

import hashlib
import sys
import unicodedata
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn as nn
from tqdm import tqdm

from config import DECODE_BATCH_SIZE, LENGTH_PENALTY, Config, decode_batch_size
from dataset import source_batch
from model import Transformer, causal_mask
from nmt.decoder_step import (FastDecoder, FastState, fast_decoder, row_argmax, row_topk,
                               top_logits)
from tokenizer import EOS, PAD, SOS, UNK, detokenize


# ---- the key/value cache (an addition: incremental decoding) ------------------------------------

class LayerCache:
    """One attention block's keys and values for incremental decoding, (batch, kv_heads,
    positions, d_k). Self-attention: buffers of `capacity` positions, written in place one
    step at a time (`append`: no copy of the past each step). Cross-attention: the encoder
    output's, projected once (`k`, `v`)."""

    def __init__(self, capacity: int = 0):
        self.k = self.v = None
        self.length, self.capacity = 0, capacity

    def append(self, k, v):
        """Writes the new positions' keys and values; returns all of them so far."""
        end = self.length + k.size(2)
        if self.k is None or end > self.k.size(2):  # the first step (or past the capacity)
            size = max(self.capacity, end, 2 * self.length)
            old_k, old_v = self.k, self.v
            self.k = k.new_empty(k.size(0), k.size(1), size, k.size(3))
            self.v = v.new_empty(v.size(0), v.size(1), size, v.size(3))
            if old_k is not None:
                self.k[:, :, :self.length], self.v[:, :, :self.length] = \
                    old_k[:, :, :self.length], old_v[:, :, :self.length]
        self.k[:, :, self.length:end] = k
        self.v[:, :, self.length:end] = v
        self.length = end
        return self.k[:, :, :end], self.v[:, :, :end]  # (batch, kv_heads, end, d_k)

    def reorder(self, index):
        if self.k is not None:
            self.k, self.v = self.k.index_select(0, index), self.v.index_select(0, index)


class KVCache:
    """An addition: keys and values of every decoder layer for incremental decoding: the
    self-attention's grow by one position a step (room for `capacity` made once), the
    cross-attention's are computed once per sentence."""

    def __init__(self, n_layers: int, capacity: int = 0):
        self.layers = [{"self": LayerCache(capacity), "cross": LayerCache()}
                       for _ in range(n_layers)]
        self.length = 0  # target positions already decoded

    def reorder(self, index, self_only: bool = False):
        """Keep and reorder batch rows (dropping finished sentences; beam search). Beams of one
        sentence share its cross-attention keys/values: shuffling beams needs `self_only`."""
        for layer in self.layers:
            for part in (layer["self"],) if self_only else layer.values():
                part.reorder(index)



def new_cache(model: Transformer, capacity: int = 0) -> KVCache:
    """An empty cache for `model` with room for `capacity` target positions."""
    return KVCache(len(model.decoder.layers), capacity)


# ---- what a search carries: one model's state, or an ensemble's (an addition) -------------------

class Ensemble(nn.Module):
    """Several trained models decoding as one: at each step the mean of their log-probabilities
    (Marian's rule; fairseq averages probabilities instead). Each model keeps its own encoder
    output and key/value cache, and may have its own design, size and source tokenizer; they
    share the target vocabulary. The searches take one source batch per model."""

    def __init__(self, models):
        super().__init__()
        self.members = nn.ModuleList(models)


class ModelState:
    """One model's part of a search over a batch: its encoder output, source mask and
    key/value cache, kept row for row with the search's hypotheses."""
    normalized = False  # scores() gives logits

    def __init__(self, model: Transformer, src, src_mask, capacity: int, use_cache: bool = True):
        self.model, self.src_mask = model, src_mask
        self.memory = model.encode(src, src_mask)  # (batch, src_len, d_model)
        self.cache = new_cache(model, capacity) if use_cache else None

    def scores(self, ys, banned):
        """The next token's logits after each row's prefix ys (rows, step), `banned` tokens at
        -inf: (rows, vocab). Without the cache the decoder re-reads the whole prefix (the
        write-ups' way; the reference)."""
        if self.cache is not None:
            out = self.model.decode(self.memory, self.src_mask, ys[:, -1:], None, self.cache)
        else:
            mask = causal_mask(ys.size(1), ys.device)
            out = self.model.decode(self.memory, self.src_mask, ys, mask)  # (rows, step, d)
        logits = self.model.project(out[:, -1]).float()  # (rows, vocab)
        return logits.index_fill_(1, banned, float("-inf"))

    def repeat(self, k: int):
        """Each row k times in a row (beam search's beams, sampling's samples)."""
        self.memory = self.memory.repeat_interleave(k, dim=0)  # (rows*k, src_len, d_model)
        self.src_mask = self.src_mask.repeat_interleave(k, dim=0)  # (rows*k, 1, 1, src_len)

    def keep(self, rows):
        """Only these rows, in this order (finished sentences leave the batch)."""
        self.memory, self.src_mask = self.memory[rows], self.src_mask[rows]
        if self.cache is not None:
            self.cache.reorder(rows)

    def follow(self, rows):
        """Row i continues the prefix of row rows[i], of its own sentence (beam search)."""
        self.cache.reorder(rows, self_only=True)


class EnsembleState:
    """An ensemble's part of a search: each model's ModelState; scores() the mean of their
    log-probabilities (each model's normalized without the banned tokens)."""
    normalized = True  # scores() gives log-probabilities

    def __init__(self, states):
        self.states = states

    def scores(self, ys, banned):
        return torch.stack([state.scores(ys, banned).log_softmax(dim=-1)
                            for state in self.states]).mean(dim=0)  # (rows, vocab)

    def repeat(self, k: int):
        for state in self.states:
            state.repeat(k)

    def keep(self, rows):
        for state in self.states:
            state.keep(rows)

    def follow(self, rows):
        for state in self.states:
            state.follow(rows)


def start(model, src, src_mask, capacity: int, use_cache: bool = True):
    """The search state of `model` over a source batch: a FastDecoder's FastState (with the
    cache), else ModelState; for an Ensemble, src and src_mask are lists of one batch per model
    (each model's own source tokens)."""
    if isinstance(model, Ensemble):
        return EnsembleState([start(m, s, mask, capacity, use_cache)
                              for m, s, mask in zip(model.members, src, src_mask)])
    if isinstance(model, FastDecoder):
        if use_cache:
            return FastState(model, src, src_mask, capacity)
        model = model.model
    return ModelState(model, src, src_mask, capacity, use_cache)


# ---- the searches -------------------------------------------------------------------------------

def output_limits(src_lengths, max_len_a: float, max_len_b: int, seq_len: int,
                  min_len: int = 1):
    """The most output tokens ([EOS] not counted) of each sentence: fairseq's
    max_len_a · source length + max_len_b, never fewer than min_len (the fewest a translation
    has: a shorter limit would both require and bar [EOS]), never more than seq_len allows
    ([SOS] and [EOS] included, as in training). src_lengths: (batch,) real source tokens.
    A min_len seq_len cannot hold is a ValueError (as Config.validate: the command lines')."""
    if min_len > seq_len - 2:  # [EOS] would be both required and barred
        raise ValueError(f"min_len {min_len} is more than a translation can hold: seq_len "
                         f"{seq_len} leaves {seq_len - 2} output tokens ([SOS] and [EOS] take two)")
    limit = (max_len_a * src_lengths.double() + max_len_b).floor().long()  # (batch,)
    return limit.clamp(min=min(max(min_len, 1), seq_len - 2), max=seq_len - 2)


def restrict(logp, step: int, limit, min_len: int, eos_id: int):
    """Length rules applied to log-probabilities (batch, vocab) of output token `step`
    (counting from 1): [EOS] is barred until min_len tokens are out (no empty translation),
    and is the only choice once a sentence has its `limit` (batch,) tokens. In place."""
    if step <= min_len:
        logp[:, eos_id] = float("-inf")
    force = limit < step  # (batch,)
    if force.any():
        eos = logp[force, eos_id].clone()
        logp[force] = float("-inf")
        logp[force, eos_id] = eos
    return logp


def decoding_model(model, rows: int = DECODE_BATCH_SIZE, fast_step: bool = True):
    """The model as the searches run it: on CPU in float32 its FastDecoder (the decoder's
    one-token step laid out once, nmt/decoder_step.py); elsewhere (a GPU, bf16 weights,
    quantized layers, training mode), or without `fast_step`, the model itself (model.py's
    decoder: the reference the fast step is held to). `rows`: the batch the output
    projection's packing is tuned for. An Ensemble: each of its models so."""
    if isinstance(model, Ensemble):
        return Ensemble([decoding_model(member, rows, fast_step) for member in model.members])
    if isinstance(model, FastDecoder):
        return model if fast_step else model.model
    return (fast_step and fast_decoder(model, rows)) or model


@torch.no_grad()
def greedy_decode(model: Transformer, src, src_mask, sos_id: int, eos_id: int, max_len,
                  use_cache: bool = True, banned=(), min_len: int = 0):
    """Greedy decoding of a batch. src (batch, src_len), src_mask (batch, 1, 1, src_len) (for
    an Ensemble, one of each per model); max_len: most tokens to output per sentence before its
    [EOS] (an int or a (batch,) tensor); min_len: fewest.

    Returns one list of token ids per sentence, without [SOS] and [EOS]. Finished sentences
    leave the batch, so they stop costing work. use_cache=False re-runs the decoder over the
    whole prefix every step (the write-ups' way; kept as the reference)."""
    batch, device = first(src).size(0), first(src).device
    limit = torch.as_tensor(max_len, device=device).expand(batch).clone()  # (batch,)
    state = start(model, src, src_mask, int(limit.max()) + 1, use_cache)

    def most_likely(scores, step, alive):  # scores: (alive, vocab) logits
        return row_argmax(restrict(scores, step, limit[alive], min_len, eos_id)), None
    return [tokens for tokens, _ in token_by_token(state, batch, sos_id, eos_id, limit, banned,
                                                   most_likely)]


def token_by_token(state, rows: int, sos_id: int, eos_id: int, limit, banned, pick):
    """The loop of greedy decoding and of sampling over `rows` rows: each step, every row still
    decoding takes the token pick(scores, step, alive) gives it ((alive,) tokens, and their
    log-probabilities or None), from the scores (alive, vocab) of `state` with the `banned`
    tokens at -inf; a row that takes [EOS] leaves the batch, so it stops costing work. Returns
    per row (tokens without [SOS] and [EOS], their summed log-probabilities: 0 without)."""
    device = limit.device
    ys = torch.full((rows, 1), sos_id, dtype=torch.long, device=device)  # (rows, 1)
    total = torch.zeros(rows, device=device)  # (rows,) summed log-probabilities
    alive = torch.arange(rows, device=device)  # original row of each row still decoding
    banned = torch.tensor(list(banned), dtype=torch.long, device=device)
    results, scored = [None] * rows, False
    for step in range(1, int(limit.max()) + 2):
        next_token, logp = pick(state.scores(ys, banned), step, alive)  # (alive,) each
        if logp is not None:
            total[alive] += logp
            scored = True
        ys = torch.cat([ys, next_token.unsqueeze(1)], dim=1)  # (alive, step + 1)
        done = next_token == eos_id  # (alive,)
        if done.any():
            ended = done.nonzero().flatten()  # (ended,)
            sums = total[alive[ended]].tolist() if scored else [0.0] * ended.numel()
            for row, logp_sum in zip(ended.tolist(), sums):
                results[alive[row]] = (ys[row, 1:-1].tolist(), logp_sum)
            keep = (~done).nonzero().flatten()  # (still alive,)
            if keep.numel() == 0:
                break
            ys, alive = ys[keep], alive[keep]
            state.keep(keep)
    return results


def first(src):
    """The source batch of a model, or of an ensemble's first model."""
    return src[0] if isinstance(src, (list, tuple)) else src


def length_penalty(length, alpha: float):
    """Wu et al. (2016), used by the paper with alpha = 0.6: ((5 + |Y|) / 6) ^ alpha, |Y|
    counting the [EOS]. (CTranslate2 divides by |Y| ^ alpha instead.)"""
    return ((5.0 + length) / 6.0) ** alpha


def top_log_probs(scores, normalized: bool, k: int, step: int, limit, min_len: int,
                  eos_id: int, fused: bool = False):
    """The k most likely next tokens of each row under the length rules, most likely first:
    their log-probabilities and tokens, (rows, k) each, as row_topk(restrict(log-softmax of
    the logits `scores` (rows, vocab), or of log-probabilities where `normalized`)). `fused`:
    from the logits by nmt/decoder_step.c's top_logits where it is compiled (one visit of each
    row: the log-softmax's normalizer and the k largest logits; the rules then applied to those
    k; among equal values, the first columns)."""
    banned = eos_id if step <= min_len else -1  # [EOS] too early
    found = top_logits(scores, k, banned) if fused and not normalized else None
    if found is None:
        logp = restrict(scores if normalized else scores.log_softmax(dim=-1), step, limit,
                        min_len, eos_id)
        return row_topk(logp, k)
    lse, values, tokens = found  # (rows,), (rows, k), (rows, k)
    logp = values - lse.unsqueeze(1)  # (rows, k)
    force = limit < step  # (rows,): [EOS] is the only choice, as restrict leaves it
    if force.any():  # (forced,) [EOS]'s log-probability, or -inf while it is barred
        eos = scores[force, eos_id] - lse[force] if banned < 0 else float("-inf")
        logp[force] = float("-inf")
        logp[force, 0], tokens[force, 0] = eos, eos_id
    return logp, tokens


def best_continuations(scores, top_logp, top_tokens):
    """The 2k best continuations of each sentence's k beams, best first: their summed scores,
    the beam each extends and its token, each (n, 2k). scores: (n, k); top_logp, top_tokens:
    (n*k, width) each beam's best `width` next tokens (2k, or the whole vocabulary where it is
    smaller): the best 2k overall lie among them."""
    n, k = scores.shape
    width = top_logp.size(1)
    cand = (scores.unsqueeze(-1) + top_logp.view(n, k, width)).view(n, k * width)
    top_scores, top_idx = cand.topk(min(2 * k, k * width), dim=-1)  # (n, 2k)
    return top_scores, top_idx // width, top_tokens.view(n, k * width).gather(1, top_idx)


@torch.no_grad()
def beam_search(model: Transformer, src, src_mask, sos_id: int, eos_id: int, max_len,
                beam: int = 4, alpha: float = LENGTH_PENALTY, nbest: int = 1, banned=(),
                min_len: int = 0, early_stop: bool = True):
    """Batched beam search with a key/value cache. Keeps `beam` live hypotheses per sentence;
    one that emits [EOS] is finished, scored log P / length_penalty (length with the [EOS]);
    max_len and min_len bound the tokens before it, as in greedy_decode. A sentence stops at
    its limit, with `beam` finished (fairseq's rule), or with early_stop (OpenNMT's and
    CTranslate2's; the default, which every figure in the docs used) once its best candidate is
    [EOS] and `nbest` are finished. That stop ranks by log P before the length penalty, which
    favours length: a live hypothesis could still have ended better. Without it the search is
    exact once the beam holds every prefix (tests/test_decoding.py), and it scored 0.1 higher on
    validation for 8% more time (docs/performance.md). Returns per sentence the `nbest` best
    (tokens without [SOS]/[EOS], score), best first."""
    batch, k, device = first(src).size(0), beam, first(src).device
    limit = torch.as_tensor(max_len, device=device).expand(batch).clone()  # (batch,)
    state = start(model, src, src_mask, int(limit.max()) + 1)
    state.repeat(k)  # each sentence's k beams: rows (batch*k)
    tokens = torch.full((batch * k, 1), sos_id, dtype=torch.long, device=device)
    scores = torch.zeros(batch, k, device=device)  # (batch, k) summed log-probabilities
    scores[:, 1:] = float("-inf")  # at first all beams are the same [SOS]: keep one
    alive = torch.arange(batch, device=device)  # original sentence of each live sentence
    finished = [[] for _ in range(batch)]  # per sentence: (tokens, normalised score)
    banned = torch.tensor(list(banned), dtype=torch.long, device=device)
    for step in range(1, int(limit.max()) + 2):
        n = alive.numel()
        scores_now = state.scores(tokens, banned)  # (n*k, vocab): [PAD], [SOS]... never
        top_logp, top_tokens = top_log_probs(  # (n*k, width) each
            scores_now, state.normalized, min(2 * k, scores_now.size(1)), step,
            limit[alive].repeat_interleave(k), min_len, eos_id, isinstance(state, FastState))
        top_scores, beam_idx, token = best_continuations(scores, top_logp, top_tokens)
        # A candidate [EOS] ends its hypothesis; only those ranked in the top k are kept.
        ends = token == eos_id  # (n, 2k)
        rank = torch.arange(token.size(1), device=device)
        final = ends & (rank < k) & torch.isfinite(top_scores)
        if final.any():  # finished: scored log P / length penalty
            i, j = final.nonzero().unbind(1)  # (f,) each: sentence, candidate
            ended = tokens[i * k + beam_idx[i, j], 1:].tolist()  # (f, step - 1)
            penalty = length_penalty(step, alpha)
            for s, hyp, logp_sum in zip(alive[i].tolist(), ended, top_scores[i, j].tolist()):
                finished[s].append((hyp, logp_sum / penalty))
        # The next live beams: the k best candidates that did not end.
        order = (ends.long() * token.size(1) + rank).argsort(dim=-1)[:, :k]  # (n, k)
        scores = top_scores.gather(1, order)  # (n, k)
        rows = (torch.arange(n, device=device).unsqueeze(1) * k
                + beam_idx.gather(1, order)).flatten()  # (n*k,)
        tokens = torch.cat([tokens[rows], token.gather(1, order).reshape(-1, 1)], dim=1)
        state.follow(rows)  # rows stay within their sentence
        # Done: past its limit, k finished, or (early_stop) its best candidate ended, nbest in.
        counts = torch.tensor([len(finished[s]) for s in alive.tolist()], device=device)  # (n,)
        best_ended = (token[:, 0] == eos_id) & torch.isfinite(top_scores[:, 0])  # (n,)
        early = best_ended & (counts >= nbest) & early_stop  # (n,), all False without it
        done = (limit[alive] < step) | (counts >= k) | early  # (n,)
        if done.any():
            keep = (~done).nonzero().flatten()  # (still live,)
            if keep.numel() == 0:
                break
            keep_rows = (keep.unsqueeze(1) * k + torch.arange(k, device=device)).flatten()
            tokens, scores, alive = tokens[keep_rows], scores[keep], alive[keep]
            state.keep(keep_rows)
    return [sorted(hyps, key=lambda t: -t[1])[:nbest] for hyps in finished]


@dataclass(frozen=True)
class Sampling:
    """Ancestral sampling: `n` samples of each sentence, each token drawn from the model's
    distribution with its log-probabilities divided by `temperature`, cut to the `top_k` most
    likely tokens (0: no cut) and to the nucleus, the fewest most likely tokens whose
    probability reaches `top_p` (1: no cut; Holtzman et al. 2020). `seed`: with the sentence's
    tokens and the sample's number, it fixes each sample's draws, so that a sentence's samples
    do not depend on the sentences decoded beside it."""
    n: int = 1
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0

    def generator(self, ids, j: int, device) -> torch.Generator:
        """The random stream of sample j of the sentence of source tokens `ids`."""
        digest = hashlib.sha256(f"{self.seed} {j} {list(ids)}".encode()).digest()
        return torch.Generator(device).manual_seed(int.from_bytes(digest[:8], "little") >> 1)


def filter_logits(logits, top_k: int, top_p: float):
    """Logits (rows, vocab) with -inf outside each row's top_k tokens (0: none cut) and
    outside its nucleus of probability top_p (1: none cut; the most likely token always in)."""
    if 0 < top_k < logits.size(-1):
        kth = logits.topk(top_k, dim=-1).values[:, -1:]  # (rows, 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1:
        ranked, order = logits.sort(dim=-1, descending=True)  # (rows, vocab) each
        probs = ranked.softmax(dim=-1)
        before = probs.cumsum(dim=-1) - probs  # the mass of the more likely tokens
        logits = logits.scatter(1, order, ranked.masked_fill(before >= top_p, float("-inf")))
    return logits


@torch.no_grad()
def sample(model, src, src_mask, sos_id: int, eos_id: int, max_len, generators,
           sampling: Sampling, banned=(), min_len: int = 0):
    """`sampling.n` samples of each sentence of a batch (src, src_mask and max_len as in
    greedy_decode), drawn token by token; the length rules and banned tokens as in the other
    searches. The draw is the Gumbel-max trick on the filtered log-probabilities, with the
    noise of row r (sample j of sentence i is row i*n + j) from generators[r] alone. Returns
    per sentence its n samples as (tokens without [SOS]/[EOS], log P under the model)."""
    batch, n, device = first(src).size(0), sampling.n, first(src).device
    limit = torch.as_tensor(max_len, device=device).expand(batch).repeat_interleave(n)
    state = start(model, src, src_mask, int(limit.max()) + 1)
    state.repeat(n)  # (batch*n rows)

    def draw(scores, step, alive):  # scores: (alive, vocab), logits or log-probabilities
        logp = restrict(scores if state.normalized else scores.log_softmax(dim=-1), step,
                        limit[alive], min_len, eos_id)  # (alive, vocab)
        logits = filter_logits(logp / sampling.temperature, sampling.top_k, sampling.top_p)
        noise = torch.stack([torch.rand(logits.size(-1), generator=generators[r],
                                        device=device) for r in alive.tolist()])
        token = (logits - (-noise.log()).log()).argmax(dim=-1)  # (alive,) Gumbel-max
        return token, logp.gather(1, token.unsqueeze(1)).squeeze(1)
    results = token_by_token(state, batch * n, sos_id, eos_id, limit, banned, draw)
    return [results[i * n:(i + 1) * n] for i in range(batch)]


def source_batches(model, ids, seq_len: int, sos_id: int, eos_id: int, pad_id: int, device):
    """(src, src_mask) of sentences' ids on `device`; for an Ensemble, ids[i] holds sentence
    i's ids for each model, and each is a list of one batch per model."""
    if not isinstance(model, Ensemble):
        src, src_mask = source_batch(ids, seq_len, sos_id, eos_id, pad_id)
        return src.to(device), src_mask.to(device)  # (batch, src_len), (batch, 1, 1, src_len)
    batches = [source_batch([sentence[m] for sentence in ids], seq_len, sos_id, eos_id, pad_id)
               for m in range(len(model.members))]
    return [src.to(device) for src, _ in batches], [mask.to(device) for _, mask in batches]


@torch.no_grad()
def translate_ids(model: Transformer, src_ids, sos_id: int, eos_id: int, pad_id: int,
                  seq_len: int, beam: int = 1, alpha: float = LENGTH_PENALTY,
                  batch_size: int = None,
                  nbest: int = 1, max_len_a: float = 1.2, max_len_b: int = 10, min_len: int = 1,
                  use_cache: bool = True, unk_id: int = None, progress=None,
                  early_stop: bool = True, sampling: Sampling = None, fast_step: bool = True):
    """Translates lists of source token ids (no special tokens) in batches of similar length;
    for an Ensemble, each sentence's ids for each of its models.

    Each sentence outputs at most max_len_a · its length + max_len_b tokens (capped by
    seq_len; an ensemble counts its first model's source tokens) and at least min_len (1:
    never an empty translation). [PAD], [SOS] and `unk_id` are never generated. Sources longer
    than seq_len allows are cut (translate.py warns first). `batch_size`: sentences decoded at
    once (None: config.decode_batch_size's default for the search). `progress`: called with the
    number of sentences of each batch done (a progress bar; it may raise to stop). Returns per
    sentence the output ids (beam 1: greedy), or with nbest > 1 a list of (ids, score) (beam
    search, its beam at least nbest wide), or with `sampling` its n samples as (ids, log P).
    fast_step=False: model.py's decoder step instead of the FastDecoder's (the reference;
    dev/bench_decode.py times both)."""
    if not sampling:
        beam = max(beam, nbest)  # (nbest alone: a beam of that width, as translate.py --nbest)
    device = next(model.parameters()).device
    banned = [pad_id, sos_id] + ([unk_id] if unk_id is not None else [])
    ensemble = isinstance(model, Ensemble)
    batch_size = batch_size or decode_batch_size(beam, nbest, sampling)
    if sampling:
        batch_size = max(1, batch_size // sampling.n)  # rows: sentences x samples
    model = decoding_model(model, batch_size * (sampling.n if sampling else beam), fast_step)
    key = [ids[0] if ensemble else ids for ids in src_ids]  # the first model's tokens
    # similar lengths, the longest batch first and the one left over the shortest, so that
    # batches decoded at once (decoded()) end together
    order = sorted(range(len(src_ids)), key=lambda i: len(key[i]), reverse=True)
    batches = [order[start:start + batch_size] for start in range(0, len(order), batch_size)]

    def decode(idx):  # the outputs of the sentences idx, one batch
        src, src_mask = source_batches(model, [src_ids[i] for i in idx], seq_len, sos_id,
                                       eos_id, pad_id, device)
        lengths = (first(src) != pad_id).sum(dim=1) - 2  # (batch,) real source tokens
        max_len = output_limits(lengths, max_len_a, max_len_b, seq_len, min_len)  # (batch,)
        if sampling:
            generators = [sampling.generator(key[i], j, device) for i in idx
                          for j in range(sampling.n)]
            return sample(model, src, src_mask, sos_id, eos_id, max_len, generators,
                          sampling, banned, min_len)
        if beam == 1 and nbest == 1:
            return greedy_decode(model, src, src_mask, sos_id, eos_id, max_len, use_cache,
                                 banned, min_len)
        outputs = beam_search(model, src, src_mask, sos_id, eos_id, max_len, beam, alpha,
                              nbest, banned, min_len, early_stop)
        return [hyps[0][0] for hyps in outputs] if nbest == 1 else outputs

    results = [None] * len(src_ids)
    at_once = batches_at_once(model, len(batches))
    for idx, outputs in decoded(decode, batches, at_once):
        for i, out in zip(idx, outputs):
            results[i] = out
        if progress is not None:
            progress(len(idx))
    return results


def batches_at_once(model, batches: int) -> int:
    """How many batches to decode at once, each on one thread: as many as torch's threads
    (--threads) with the fast step on CPU (its products are too small to share between threads
    well: on 2 cores of an AMD EPYC with AVX512-BF16, two batches at once on one thread each
    decoded 1.2 times as many sentences a second as one batch on two threads with greedy
    decoding, 1.14 times with beam search; docs/performance.md), else 1."""
    members = model.members if isinstance(model, Ensemble) else [model]
    if not all(isinstance(m, FastDecoder) for m in members):
        return 1
    return max(1, min(torch.get_num_threads(), batches))


def decoded(decode, batches, at_once: int):
    """(batch, decode(batch)) for each batch, in order. With at_once > 1, that many batches
    are decoded at the same time, each on a thread of its own with one intra-op thread (the
    step's operators release the GIL); the caller's threads are untouched, and so are those
    of threads started later. A stop (an exception where the caller takes a batch) lets the
    batches under way end and starts no other."""
    if at_once <= 1:
        for idx in batches:
            yield idx, decode(idx)
        return

    def on_one_thread(idx):
        torch.set_num_threads(1)  # this worker thread's own setting
        with torch.no_grad():  # autograd's mode is each thread's own
            return decode(idx)
    threads = torch.get_num_threads()  # the caller's
    try:
        with ThreadPoolExecutor(at_once) as pool:
            futures = [pool.submit(on_one_thread, idx) for idx in batches]
            try:
                for idx, future in zip(batches, futures):
                    yield idx, future.result()
            finally:
                for future in futures:
                    future.cancel()
    finally:  # set_num_threads also sets the count a thread takes at its first operator
        torch.set_num_threads(threads)


# ---- text in, text out -------------------------------------------------------------------------

def clean(sentence: str) -> str:
    """The sentence as training text is: control characters (tab, line breaks, bell...) become
    spaces and the ends are stripped. Format characters (zero-width joiner and non-joiner, soft
    hyphen) and other spaces (no-break, thin) are text and stay."""
    return "".join(" " if unicodedata.category(c) == "Cc" else c for c in sentence).strip()


def decoding_limits(config: Config) -> dict:
    """The output-length rules of a config, as translate_ids takes them."""
    return {"max_len_a": config.max_len_a, "max_len_b": config.max_len_b,
            "min_len": config.min_len}


def translate(model, config, tokenizer_src, tokenizer_tgt, sentences, beam=1, alpha=LENGTH_PENALTY,
              nbest=1, batch_size=None, progress=None, sampling: Sampling = None, numbers=None,
              early_stop: bool = True):
    """Translations of `sentences`, each one line (control characters a model may output, line
    breaks among them, become spaces; an empty sentence gives an empty translation); with
    nbest > 1 a list of (translation, score) per sentence, and with `sampling` its samples
    likewise. For an Ensemble, tokenizer_src is a list: each model's source tokenizer.
    `progress`: see translate_ids. `numbers`: each sentence's number in its file, which a
    warning about a sentence longer than seq_len names (1, 2, ... by default). `early_stop`:
    beam search's stop (beam_search), which an exported model's engine has its own of."""
    sentences = [clean(s) for s in sentences]
    numbers = numbers or range(1, len(sentences) + 1)
    ensemble = isinstance(model, Ensemble)
    encoded = [[e.ids for e in tok.encode_batch(sentences)]
               for tok in (tokenizer_src if ensemble else [tokenizer_src])]  # per model
    ids = [list(per_model) if ensemble else per_model[0] for per_model in zip(*encoded)]
    for n in range(len(sentences)):
        longest = max(len(per_model[n]) for per_model in encoded)
        if longest + 2 > config.seq_len:
            tqdm.write(f"warning: sentence {numbers[n]} has {longest} tokens; only the first "
                       f"{config.seq_len - 2} (seq_len {config.seq_len}) are translated",
                       file=sys.stderr)  # (below an open progress bar, not on its line)
    todo = [n for n, s in enumerate(sentences) if s]
    decode = getattr(model, "translate_ids", None) or partial(translate_ids, model,
                                                              sampling=sampling)
    outputs = decode([ids[n] for n in todo], SOS, EOS, PAD, config.seq_len, beam=beam,
                     alpha=alpha, nbest=nbest, batch_size=batch_size, unk_id=UNK,
                     **decoding_limits(config), progress=progress, early_stop=early_stop)
    listed = nbest > 1 or sampling is not None  # (translation, score) lists
    results = [[("", 0.0)] * (sampling.n if sampling else nbest) if listed else ""
               for _ in sentences]
    for n, out in zip(todo, outputs):
        if listed:
            results[n] = [(clean(detokenize(tokenizer_tgt, h)), s) for h, s in out]
        else:
            results[n] = clean(detokenize(tokenizer_tgt, out))
    return results
