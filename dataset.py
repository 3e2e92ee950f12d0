"""Masked batches for training and validation, and the prepared training data.

get_ds -> the tokenizers and the training split prepared once (token ids in memory-mapped files,
          long pairs dropped) and reloaded in seconds; validation encoded; wrapped for a DataLoader
TokenBatchSampler + Collator -> length-bucketed batches padded to their longest sequence
"""

import bisect
import itertools
import json
import os
import shutil
import time
import zlib
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset as TorchDataset
from tqdm import tqdm

from config import Config, is_main
from corpus import (CORPUS_FINGERPRINT, DataError, column, corpus_source, digest, load_corpus, note,
                    quiet_datasets)
from tokenizer import (EOS, PAD, SOS, coverage, get_tokenizers, recipe_path, tokenizer_fingerprint,
                       tokenizer_keys, tokenizer_path)

# ---- the dataset and its batches ----------------------------------------------------------------

class BilingualDataset(TorchDataset):
    """Items: encoder_input [SOS] src [EOS], decoder_input [SOS] tgt, label tgt [EOS]. The ids
    are lists, or TokenArrays of prepared data; the texts are kept for validation's scores and
    examples (training keeps none)."""

    def __init__(self, src_ids, tgt_ids, src_texts=None, tgt_texts=None):
        self.src_ids, self.tgt_ids = src_ids, tgt_ids
        self.src_texts, self.tgt_texts = src_texts, tgt_texts

    def __len__(self):
        return len(self.src_ids)

    def lengths(self):
        """Padded length of each pair in a batch: the longer of encoder input and label."""
        if isinstance(self.src_ids, TokenArray):
            return np.maximum(self.src_ids.lengths() + 2, self.tgt_ids.lengths() + 1)
        return [max(len(s) + 2, len(t) + 1) for s, t in zip(self.src_ids, self.tgt_ids)]

    def __getitems__(self, indices):
        """A batch at once (the DataLoader calls this in place of __getitem__ for each index):
        from prepared data, the batch's three id tensors, padded in a few array operations (item
        by item it took 70 ms for 25,000 tokens, as long as an H100's training step of the base
        model; the collator adds the mask); from lists, the items."""
        if not isinstance(self.src_ids, TokenArray):
            return [self[i] for i in indices]
        indices = np.asarray(indices, dtype=np.int64)
        src, src_len = self.src_ids.padded(indices)  # (batch, max_src), (batch,)
        tgt, tgt_len = self.tgt_ids.padded(indices)  # (batch, max_tgt), (batch,)
        rows = np.arange(len(indices))
        sos = np.full((len(indices), 1), SOS, dtype=np.int64)  # (batch, 1)
        pad = np.full((len(indices), 1), PAD, dtype=np.int64)  # (batch, 1)
        enc = np.concatenate([sos, src, pad], axis=1)  # (batch, max_src + 2)
        enc[rows, src_len + 1] = EOS
        label = np.concatenate([tgt, pad], axis=1)  # (batch, max_tgt + 1)
        label[rows, tgt_len] = EOS
        return {"encoder_input": torch.from_numpy(enc),
                "decoder_input": torch.from_numpy(np.concatenate([sos, tgt], axis=1)),
                "label": torch.from_numpy(label)}

    def __getitem__(self, i):
        tgt = torch.as_tensor(np.asarray(self.tgt_ids[i], dtype=np.int64))  # (tgt_len - 1,)
        sos, eos = torch.tensor([SOS]), torch.tensor([EOS])
        return {
            "encoder_input": framed_source(self.src_ids[i]),  # (src_len,)
            "decoder_input": torch.cat([sos, tgt]),  # (tgt_len,)
            "label": torch.cat([tgt, eos]),  # (tgt_len,)
        }


class TokenArray:
    """Token-id sequences stored flat: `ids`, every sequence one after another, and `offsets`,
    where each starts (one more than there are sequences). Memory-mapped from the prepared
    data, so that ranks and DataLoader workers share the same pages instead of copies."""

    def __init__(self, ids, offsets):
        self.ids, self.offsets = ids, offsets

    def __getstate__(self):  # to a spawned DataLoader worker: the file's name, not its ids
        if isinstance(self.ids, np.memmap):
            return {"file": self.ids.filename, "dtype": self.ids.dtype.name,
                    "offsets": self.offsets}
        return self.__dict__

    def __setstate__(self, state):
        if "file" in state:
            state = {"ids": np.memmap(state["file"], dtype=state["dtype"], mode="r"),
                     "offsets": state["offsets"]}
        self.__dict__.update(state)

    def __len__(self):
        return len(self.offsets) - 1

    def __getitem__(self, i):
        return self.ids[self.offsets[i]:self.offsets[i + 1]]

    def lengths(self):
        return np.diff(self.offsets)

    def padded(self, indices: np.ndarray):
        """The sequences `indices`, right-padded with PAD into one int64 array, and their
        lengths: one gather from the flat ids, no loop over the sequences."""
        starts = self.offsets[indices]  # (batch,)
        lengths = self.offsets[indices + 1] - starts  # (batch,)
        columns = np.arange(lengths.max(initial=0))  # (max_len,)
        real = columns < lengths[:, None]  # (batch, max_len)
        at = np.where(real, starts[:, None] + columns, 0)  # (batch, max_len)
        return np.where(real, self.ids[at], PAD).astype(np.int64), lengths


def real_tokens(batch) -> int:
    """Non-padding source and target tokens of a batch: what throughput counts (the rows that
    fill a fixed shape, weightless, not counted)."""
    real = batch["label"] != PAD  # (batch, tgt_len)
    filler = int((~real.any(dim=1)).sum())  # rows with no target: each holds [SOS] [EOS]
    return int((batch["encoder_input"] != PAD).sum() + real.sum()) - 2 * filler


@dataclass(frozen=True)
class FixedShapes:
    """Token batches in a few fixed (rows, length) shapes, so that a compiled step compiles
    once per shape (no dynamic shapes) and, on CUDA, can be captured as a graph. `lengths`: the
    few lengths a batch may have (ascending; `best_lengths` chooses them from the training
    pairs); a batch whose longest pair needs n tokens is padded to the first of them >= n, on
    both sides, and to R(L) = max_tokens // L rows (batch_size rows for sentence batches).
    The sampler cuts batches by those lengths, so a batch never holds more than R(L) pairs; the
    rows it lacks are filler: [SOS] [EOS] as the source (an all-padding source leaves its
    attention no key, which some attention kernels turn into NaN), [SOS] and padding as the
    target, whose labels are all padding, weightless in the loss (the loss and gradients equal
    the batch's unpadded ones)."""
    lengths: tuple
    max_tokens: int
    batch_size: int

    def length(self, n: int) -> int:
        return self.lengths[bisect.bisect_left(self.lengths, n)]

    def rows(self, length: int) -> int:
        return self.max_tokens // length if self.max_tokens else self.batch_size

    def shape(self, n: int) -> tuple:
        """(rows, length) of a batch whose longest pair needs n tokens."""
        length = self.length(n)
        return self.rows(length), length

    def padded_lengths(self, lengths):
        """Each pair's length as the sampler cuts by it: its shape's."""
        bounds = np.asarray(self.lengths, dtype=np.int64)
        return bounds[np.searchsorted(bounds, np.asarray(lengths, dtype=np.int64))]

    def pad(self, batch: dict) -> dict:
        """A collated batch (right-padded to its longest) padded to its fixed shape."""
        enc, dec, label = batch["encoder_input"], batch["decoder_input"], batch["label"]
        longest = max(int((enc != PAD).sum(1).max()), int((label != PAD).sum(1).max()))
        rows, length = self.shape(longest)
        if rows < enc.size(0):
            raise ValueError(f"a batch of {enc.size(0)} pairs does not fit its shape "
                             f"({rows}, {length}): cut by other lengths than FixedShapes'")

        def filled(t, first):  # (batch, len) -> (rows, length), filler rows start `first`
            out = torch.full((rows, length), PAD, dtype=t.dtype)
            out[:t.size(0), :t.size(1)] = t
            out[t.size(0):, :len(first)] = torch.tensor(first, dtype=t.dtype)
            return out
        enc = filled(enc, [SOS, EOS])  # (rows, length)
        return {"encoder_input": enc, "decoder_input": filled(dec, [SOS]),
                "label": filled(label, []), "encoder_mask": encoder_mask(enc)}

    def report(self, lengths_src, lengths_tgt, batches, plain_batches) -> dict:
        """What the shapes cost an epoch: the distinct shapes of `batches` (index arrays, cut
        with these shapes), their padding (both sides, in the fixed shapes), and that of
        `plain_batches` (cut without them, each side padded to its longest), and the tokens
        the fixed shapes add to an epoch's steps."""
        src, tgt = np.asarray(lengths_src), np.asarray(lengths_tgt)  # with [SOS]/[EOS]: +2, +1
        real = int(src.sum() + tgt.sum())
        shapes, fixed = set(), 0
        for b in batches:
            rows, length = self.shape(int(max(src[b].max(), tgt[b].max())))
            shapes.add((rows, length))
            fixed += 2 * rows * length
        plain = sum(len(b) * (int(src[b].max()) + int(tgt[b].max())) for b in plain_batches)
        return {"shapes": len(shapes), "steps": len(batches), "plain_steps": len(plain_batches),
                "fixed_padding": 1 - real / max(fixed, 1),
                "plain_padding": 1 - real / max(plain, 1), "added": fixed / max(plain, 1) - 1}


class Collator:
    """Pads a list of items to the longest sequence of the batch and builds the source mask.

    The decoder needs no mask tensor: its self-attention is causal (the model applies it
    inside attention, so the flash kernel can run), and for right-padded targets that is
    enough, since a real position never sees a later padded one and the loss ignores padding."""

    def __init__(self, pad_id: int = PAD, shapes: FixedShapes = None):
        self.pad_id, self.shapes = pad_id, shapes

    def __call__(self, items):
        if isinstance(items, dict):  # ids BilingualDataset.__getitems__ has padded
            enc, dec, label = items["encoder_input"], items["decoder_input"], items["label"]
        else:
            pad = torch.nn.utils.rnn.pad_sequence
            enc = pad([it["encoder_input"] for it in items], batch_first=True,
                      padding_value=self.pad_id)  # (batch, src_len)
            dec = pad([it["decoder_input"] for it in items], batch_first=True,
                      padding_value=self.pad_id)  # (batch, tgt_len)
            label = pad([it["label"] for it in items], batch_first=True,
                        padding_value=self.pad_id)  # (batch, tgt_len)
        batch = {"encoder_input": enc, "decoder_input": dec, "label": label,
                 "encoder_mask": encoder_mask(enc, self.pad_id)}  # (batch, 1, 1, src_len)
        return self.shapes.pad(batch) if self.shapes else batch


# BPE-dropout segments afresh, then cuts into batches again, this many of the sampler's batches
# at a time: enough pairs that each new batch holds pairs of about one length.
POOL_BATCHES = 16


class PooledBatches:
    """The sampler's batches, `size` consecutive ones at a time (a list of index lists: one
    DataLoader item), for BPEDropout. Epoch, resume point and count are the sampler's."""

    def __init__(self, sampler, size: int = POOL_BATCHES):
        self.sampler, self.size = sampler, size

    def __iter__(self):
        pool = []
        for batch in self.sampler:
            pool.append(batch)
            if len(pool) == self.size:
                yield pool
                pool = []
        if pool:
            yield pool

    def __len__(self):
        return -(-len(self.sampler) // self.size)


class BPEDropout(TorchDataset):
    """Subword regularization (BPE-dropout, Provilkov et al. 2020): the training loader's
    dataset under --bpe_dropout. Each pair is segmented afresh whenever it is drawn, every merge
    skipped with probability p (the tokenizers library's own dropout), so that each epoch sees
    other segmentations of the same sentences; a pair whose new segmentation outgrows seq_len
    keeps its plain one. It works on the prepared ids (decoded to their text, byte-level BPE
    being lossless, and encoded again), and is given pools of the sampler's batches
    (`PooledBatches`): segmented afresh, a pool is sorted by the new lengths and cut into as many
    batches as it came in, so that every pair is still trained on once an epoch and the steps
    of an epoch stay the same. (Padded as the sampler had batched them, by plain lengths, a
    Multi30k batch was a third padding, since dropout lengthens a few pairs a lot; re-cut,
    about an eighth, against a twentieth without dropout.) Draws are not seeded (the library's
    random source is its own). A run resumed within a pool starts its first pool at the
    sampler's batch it stopped at: of the pool it stopped in, some pairs may be trained on
    twice that epoch and others not."""

    def __init__(self, data: BilingualDataset, tokenizer_src, tokenizer_tgt, p: float,
                 seq_len: int, pad_id: int = PAD):
        from tokenizers import Tokenizer
        self.data, self.seq_len, self.pad_id = data, seq_len, pad_id
        self.plain = (tokenizer_src, tokenizer_tgt)
        copies = {}
        for tok in self.plain:  # a joint vocabulary: one copy for both sides
            if id(tok) not in copies:
                copies[id(tok)] = Tokenizer.from_str(tok.to_str())
                copies[id(tok)].model.dropout = p
                # not in to_str(): without it "[EOS]" in a text would become the control token
                copies[id(tok)].encode_special_tokens = tok.encode_special_tokens
        self.dropped = tuple(copies[id(tok)] for tok in self.plain)

    def __getstate__(self):  # to a DataLoader worker started by spawn or forkserver
        return {**self.__dict__, "special_as_text": [t.encode_special_tokens
                                                     for t in self.plain + self.dropped]}

    def __setstate__(self, state):
        """Unpickled (a spawned worker), a tokenizers.Tokenizer loses encode_special_tokens,
        not in its serialized form: set again, or "[EOS]" in a text becomes the control token
        there."""
        flags = state.pop("special_as_text")
        self.__dict__.update(state)
        for tok, flag in zip(self.plain + self.dropped, flags):
            tok.encode_special_tokens = flag

    def __len__(self):
        return len(self.data)

    def segment(self, side: int, rows):
        """Lists of ids segmented afresh (those that outgrow seq_len left as they were)."""
        texts = self.plain[side].decode_batch(rows)
        new = [e.ids for e in self.dropped[side].encode_batch(texts)]
        return [n if len(n) + 2 <= self.seq_len else old for n, old in zip(new, rows)]

    def __getitems__(self, pool):
        """A pool of batches (lists of indices) as the same number of padded batches, each a
        dict as the Collator makes, of the pool's pairs segmented afresh and sorted by length."""
        indices = np.concatenate([np.asarray(b, dtype=np.int64) for b in pool])
        src = self.segment(0, [np.asarray(self.data.src_ids[i]).tolist() for i in indices])
        tgt = self.segment(1, [np.asarray(self.data.tgt_ids[i]).tolist() for i in indices])
        lengths = np.array([max(len(s) + 2, len(t) + 1) for s, t in zip(src, tgt)])
        order = np.argsort(lengths, kind="stable")
        cuts = even_cuts(lengths[order], len(pool))
        as_tensor = partial(torch.tensor, dtype=torch.int64)
        collate = Collator(self.pad_id)
        return [collate([{"encoder_input": as_tensor([SOS, *src[i], EOS]),  # (src_len,)
                          "decoder_input": as_tensor([SOS, *tgt[i]]),  # (tgt_len,)
                          "label": as_tensor([*tgt[i], EOS])}  # (tgt_len,)
                         for i in order[a:b]])
                for a, b in zip(cuts, cuts[1:])]


def best_lengths(lengths, k: int) -> tuple:
    """The k batch lengths (or fewer, where there are fewer distinct lengths) that pad pairs of
    these `lengths` the least, each pair to the first of them at least as long: an optimal
    partition of the sorted distinct lengths into k runs (dynamic programming over the length
    histogram, a few hundred values), the last the longest pair's. On WMT14-like lengths 16 of
    them pad an epoch's token batches 7.7-7.9% more than batches padded to their own longest
    (docs/scaling.md)."""
    values, counts = np.unique(np.asarray(lengths, dtype=np.int64), return_counts=True)
    m, k = len(values), max(1, min(k, len(values)))
    pairs = np.concatenate([[0], np.cumsum(counts)])  # pairs[j]: pairs shorter than values[j]
    tokens = np.concatenate([[0], np.cumsum(counts * values)])
    i, j = np.arange(m)[:, None], np.arange(m)[None, :]  # (m, 1), (1, m)
    # run[i, j]: the padding of the pairs of values[i+1..j] padded to values[j] (i < j)
    run = np.where(i < j, values[j] * (pairs[j + 1] - pairs[np.minimum(i + 1, m)])
                   - (tokens[j + 1] - tokens[np.minimum(i + 1, m)]), np.inf)  # (m, m)
    cost = (values * pairs[1:] - tokens[1:]).astype(np.float64)  # one run: values[0..j]
    backs = []
    for _ in range(k - 1):  # one more run, its last ending at each j
        total = cost[:, None] + run  # (m, m): the previous runs end at i, the last at j
        backs.append(total.argmin(axis=0))  # (m,)
        cost = total.min(axis=0)
    ends, j = [m - 1], m - 1
    for back in reversed(backs):
        j = int(back[j])
        ends.append(j)
    return tuple(int(values[e]) for e in reversed(ends))


def training_batches(data, sampler, bpe_dropout: float = 0.0, seq_len: int = 0,
                     shapes: FixedShapes = None):
    """The training DataLoader's dataset, batch sampler and collate_fn: the prepared data
    batched as the sampler says (each batch padded to its fixed shape, with `shapes`); under
    BPE-dropout, pools of the sampler's batches segmented afresh (`BPEDropout`), each loader
    item a list of batches."""
    if not bpe_dropout:
        return data.train, sampler, Collator(PAD, shapes)
    return (BPEDropout(data.train, data.tokenizer_src, data.tokenizer_tgt, bpe_dropout, seq_len),
            PooledBatches(sampler), list)  # list: the pool's batches as they come


def token_cuts(lengths, max_tokens: int):
    """Where the batches of pairs sorted by length (ascending) begin, and the end: greedy,
    each batch as long as (its size) x (its longest) stays within max_tokens. Computed a run of
    equal lengths at a time (a few hundred runs, not millions of pairs)."""
    n = len(lengths)
    if n == 0:
        return [0]
    values, firsts = np.unique(lengths, return_index=True)
    cuts, start = [0], 0  # the open batch is [start, i)
    for length, i, run_end in zip(values.tolist(), firsts.tolist(), firsts[1:].tolist() + [n]):
        cap = max_tokens // length  # pairs in a batch whose longest has this length
        if i - start >= cap:  # the open batch is full
            cuts.append(i)
            start = i
        i = min(i + cap - (i - start), run_end)
        while i < run_end:
            cuts.append(i)
            start, i = i, min(i + cap, run_end)
    return cuts + [n]


def even_cuts(lengths, k: int):
    """Cuts of pairs sorted by length (ascending) into exactly k batches (k <= pairs): those of
    the smallest token budget that needs no more than k (`token_cuts`), the largest then halved
    until there are k."""
    low, high = int(lengths[-1]), int(lengths[-1]) * len(lengths)  # n batches .. one batch
    while low < high:
        mid = (low + high) // 2
        low, high = (low, mid) if len(token_cuts(lengths, mid)) - 1 <= k else (mid + 1, high)
    cuts = token_cuts(lengths, low)
    while len(cuts) - 1 < k:
        i = max(range(len(cuts) - 1), key=lambda j: cuts[j + 1] - cuts[j])
        cuts.insert(i + 1, (cuts[i] + cuts[i + 1]) // 2)
    return cuts


def framed_source(ids, seq_len: int = None, sos_id: int = SOS, eos_id: int = EOS):
    """The encoder's input for one sentence of source ids (no special tokens): [SOS] ids [EOS],
    the ids cut to seq_len - 2 if seq_len is given. (BilingualDataset.__getitems__ frames a
    batch of prepared data the same way in array operations.)"""
    ids = list(ids) if seq_len is None else list(ids)[:seq_len - 2]
    return torch.tensor([sos_id, *ids, eos_id], dtype=torch.int64)  # (len(ids) + 2,)


def encoder_mask(src, pad_id: int = PAD):
    """(batch, 1, 1, src_len), True at real tokens: the source mask of a padded batch."""
    return (src != pad_id)[:, None, None, :]


def source_batch(sources, seq_len: int, sos_id: int = SOS, eos_id: int = EOS,
                 pad_id: int = PAD):
    """Sentences of source ids, framed (`framed_source`) and right-padded for the encoder:
    (src (batch, src_len), src_mask (batch, 1, 1, src_len))."""
    src = torch.nn.utils.rnn.pad_sequence([framed_source(ids, seq_len, sos_id, eos_id)
                                           for ids in sources],
                                          batch_first=True, padding_value=pad_id)
    return src, encoder_mask(src, pad_id)


class TokenBatchSampler:
    """Length-bucketed batches (fairseq's --max-tokens): pairs sorted by length (ties in a
    seeded random order), cut into batches of at most `max_tokens` padded tokens, or of
    `batch_size` sentences when max_tokens is 0; batch order shuffled each epoch. Every pair
    lands in exactly one batch per epoch. The order depends only on (seed, epoch), so a resumed
    run can skip the batches it already trained on (`set_epoch(epoch, start=k)`).

    With `shapes` (FixedShapes), pairs are cut by their lengths rounded up to the shape's:
    no batch holds more pairs than its fixed shape has rows.

    Data-parallel (world_size > 1): every rank builds the same order and takes every
    world_size-th batch from its rank on. So that all ranks make the same number of steps
    without dropping or repeating a pair, the largest batches are first halved until the count
    divides by world_size."""

    def __init__(self, lengths, max_tokens: int = 0, batch_size: int = 0,
                 shuffle: bool = True, seed: int = 0, rank: int = 0, world_size: int = 1,
                 shapes: FixedShapes = None):
        if shapes is not None:  # cut by each pair's fixed-shape length (FixedShapes)
            lengths = shapes.padded_lengths(lengths)
        self.lengths = torch.as_tensor(np.asarray(lengths, dtype=np.int64))
        longest = int(self.lengths.max()) if len(self.lengths) else 0
        if max_tokens and longest > max_tokens:
            raise ValueError(f"a pair of {longest} tokens does not fit max_tokens {max_tokens}")
        self.max_tokens, self.batch_size = max_tokens, batch_size
        self.shuffle, self.seed = shuffle, seed
        self.rank, self.world_size = rank, world_size
        self.epoch, self.start = 0, 0

    def set_epoch(self, epoch: int, start: int = 0):
        self.epoch, self.start = epoch, start

    def batches(self, epoch: int = None):
        epoch = self.epoch if epoch is None else epoch
        g = torch.Generator().manual_seed(self.seed * 1000003 + epoch)
        n, lengths = len(self.lengths), self.lengths
        if self.shuffle:
            perm = torch.randperm(n, generator=g)
            order = perm[torch.sort(lengths[perm], stable=True).indices]
        else:
            order = torch.sort(lengths, stable=True).indices
        order = order.numpy()
        lengths = lengths[order].numpy()
        cuts = (token_cuts(lengths, self.max_tokens) if self.max_tokens
                else list(range(0, n, self.batch_size)) + [n])
        batches = [order[a:b] for a, b in zip(cuts, cuts[1:])]  # index arrays, views of order
        if self.shuffle:
            batches = [batches[j] for j in torch.randperm(len(batches), generator=g).tolist()]
        if self.world_size > 1:
            batches = split_for_ranks(batches, self.world_size)[self.rank::self.world_size]
        return batches

    def __iter__(self):
        for batch in self.batches()[self.start:]:
            yield batch.tolist()

    def __len__(self):
        return len(self.batches()) - self.start


def split_for_ranks(batches, world_size: int):
    """The batches, with the largest halved (in place in the order) until their count divides
    by world_size; refuses when there are too few pairs."""
    batches = list(batches)
    while len(batches) % world_size:
        i = max(range(len(batches)), key=lambda j: len(batches[j]))
        if len(batches[i]) < 2:
            raise DataError(f"too little training data for {world_size} processes: "
                            f"{len(batches)} pairs cannot be shared out evenly")
        half = len(batches[i]) // 2
        batches[i:i + 1] = [batches[i][:half], batches[i][half:]]
    return batches


@dataclass
class Data:
    tokenizer_src: object
    tokenizer_tgt: object
    train: BilingualDataset
    validation: BilingualDataset
    held_out: bool  # the validation pairs were drawn from the training split
    test: dict = None  # each test set's name: (source texts, reference texts); None if none
    key: str = None  # what the prepared data was made from (see prepared_key)
    corpus: dict = None  # {"source", "fingerprint"}: the corpus (recorded in checkpoints)
    tokenizers: list = None  # the tokenizers' fingerprints, [source, target] (the same)
    coverage: dict = None  # per side, tokenizer.coverage of the validation texts


def encode_pairs(src_texts, tgt_texts, tokenizer_src, tokenizer_tgt, seq_len: int):
    """Token ids of pairs, and the indices of those that fit seq_len ([SOS], [EOS] included)."""
    src = [e.ids for e in tokenizer_src.encode_batch(src_texts)]
    tgt = [e.ids for e in tokenizer_tgt.encode_batch(tgt_texts)]
    keep = [i for i in range(len(src)) if len(src[i]) + 2 <= seq_len and len(tgt[i]) + 2 <= seq_len]
    return src, tgt, keep


def dropped_note(name: str, dropped: int, total: int, seq_len: int):
    if dropped:
        note(f"{name}: dropped {dropped} of {total} pairs longer than seq_len {seq_len}")
    if dropped == total:
        raise DataError(f"{name}: no pair fits --seq_len {seq_len}")


def to_bilingual(src_texts, tgt_texts, tokenizer_src, tokenizer_tgt, seq_len: int, name: str):
    """A BilingualDataset of the pairs that fit seq_len, texts kept (validation)."""
    src, tgt, keep = encode_pairs(src_texts, tgt_texts, tokenizer_src, tokenizer_tgt, seq_len)
    dropped_note(name, len(src) - len(keep), len(src), seq_len)
    return BilingualDataset([src[i] for i in keep], [tgt[i] for i in keep],
                            [src_texts[i] for i in keep], [tgt_texts[i] for i in keep])


# ---- prepared data: the training split as token ids on disk, memory-mapped ----------------------

PREPARED_FORMAT = 1
CHUNK = 50_000  # pairs encoded at a time (tokenizers spreads each chunk over all cores)


def prepared_parts(config: Config, fingerprint: str, tokenizer_src, tokenizer_tgt,
                   held_out: bool) -> dict:
    """What prepared data depends on: the corpus, the tokenizers, seq_len, and (only for a
    validation split held out of train) seed and val_fraction."""
    return {"format": PREPARED_FORMAT, "corpus": fingerprint,
            "languages": [config.lang_src, config.lang_tgt], "seq_len": config.seq_len,
            "tokenizers": [tokenizer_fingerprint(t) for t in (tokenizer_src, tokenizer_tgt)],
            "split": [config.seed, config.val_fraction] if held_out else None}


def prepared_key(parts: dict) -> str:
    return digest(parts)


PART_NAMES = {"format": "an earlier version of this code", "corpus": "another corpus",
              "languages": "other languages", "seq_len": "another --seq_len",
              "tokenizers": "other tokenizers",
              "split": "another --seed or --val_fraction (held-out validation split)"}


def prepared_folder(config: Config) -> Path:
    return Path(config.model_folder) / "prepared"


def _crc32(path: Path) -> int:
    crc = 0
    with open(path, "rb") as f:
        while block := f.read(1 << 24):
            crc = zlib.crc32(block, crc)
    return crc


def prepare(folder: Path, parts: dict, splits, tokenizer_src, tokenizer_tgt, seq_len: int):
    """Encodes the training split chunk by chunk into flat id files (uint16 when the vocabulary
    allows) with their offsets, and keeps the validation texts; written to a temporary folder
    that replaces `folder` only when complete, its checksums last."""
    started = time.time()
    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    vocab = max(tokenizer_src.get_vocab_size(), tokenizer_tgt.get_vocab_size())
    dtype = np.uint16 if vocab <= 1 << 16 else np.int32
    lengths, total, shortest = {"src": [], "tgt": []}, 0, None
    bar = tqdm(total=len(splits["train"]), desc="encoding", unit=" pairs", unit_scale=True,
               disable=None)  # shown on a terminal only
    with open(tmp / "train.src.bin", "wb") as fs, open(tmp / "train.tgt.bin", "wb") as ft:
        for batch in splits["train"].iter(batch_size=CHUNK):
            bar.update(len(batch["src"]))
            src, tgt, keep = encode_pairs(batch["src"], batch["tgt"], tokenizer_src,
                                          tokenizer_tgt, seq_len)
            total += len(src)
            needs = [max(len(a), len(b)) + 2 for a, b in zip(src, tgt)]  # with [SOS], [EOS]
            shortest = min(needs + ([shortest] if shortest else [])) if needs else shortest
            for side, ids, f in (("src", src, fs), ("tgt", tgt, ft)):
                kept = [ids[i] for i in keep]
                n = np.fromiter(map(len, kept), np.int64, len(kept))
                f.write(np.fromiter(itertools.chain.from_iterable(kept), dtype,
                                    int(n.sum())).tobytes())
                lengths[side].append(n)
    bar.close()
    if total and not sum(len(n) for n in lengths["src"]):  # refused before anything is kept
        shutil.rmtree(tmp, ignore_errors=True)
        raise DataError(f"no training pair fits --seq_len {seq_len}: the shortest needs "
                        f"{shortest} tokens with [SOS] and [EOS]")
    for side in ("src", "tgt"):
        n = np.concatenate(lengths[side])
        np.save(tmp / f"train.{side}.offsets.npy", np.concatenate([[0], np.cumsum(n)]))
    validation = splits["validation"]
    (tmp / "validation.json").write_text(json.dumps(
        {"src": column(validation, "src"), "tgt": column(validation, "tgt")}), encoding="utf-8")
    meta = {"format": PREPARED_FORMAT, "key": prepared_key(parts), "parts": parts,
            "dtype": np.dtype(dtype).name,
            "pairs": total, "kept": int(sum(len(n) for n in lengths["src"])),
            "seq_len": seq_len, "held_out": bool(splits.get("held_out")),
            "checksums": {f.name: _crc32(f) for f in sorted(tmp.iterdir())}}
    (tmp / "meta.json").write_text(json.dumps(meta), encoding="utf-8")
    shutil.rmtree(folder, ignore_errors=True)
    os.replace(tmp, folder)
    note(f"prepared {meta['kept']} training pairs in {folder} ({time.time() - started:.0f}s)")


def load_prepared(folder: Path, key: str, verify: bool = True, parts: dict = None):
    """(train BilingualDataset over memory-mapped ids, validation texts, meta), or None when
    there is no prepared data, or it was made from something else (stale) or, with `verify`,
    does not match its checksums (damaged): then it is prepared again, saying why."""
    try:
        meta = json.loads((folder / "meta.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if meta.get("key") != key:
        changed = [PART_NAMES[k] for k in PART_NAMES if "parts" in meta and parts
                   and parts.get(k) != meta["parts"].get(k)]
        note(f"{folder} was prepared for {' and '.join(changed) or 'other data'}: preparing "
             f"again")
        return None
    for name, crc in meta["checksums"].items() if verify else ():
        if not (folder / name).is_file() or _crc32(folder / name) != crc:
            note(f"{folder}/{name} is damaged or missing: preparing again")
            return None
    sides = []
    for side in ("src", "tgt"):
        offsets = np.load(folder / f"train.{side}.offsets.npy")
        path = folder / f"train.{side}.bin"
        ids = (np.memmap(path, dtype=meta["dtype"], mode="r") if path.stat().st_size else
               np.zeros(0, dtype=meta["dtype"]))
        sides.append(TokenArray(ids, offsets))
    validation = json.loads((folder / "validation.json").read_text(encoding="utf-8"))
    return BilingualDataset(*sides), validation, meta


def prepare_once(config: Config, folder: Path):
    """Trains the tokenizers (where their files do not exist) and prepares the training split:
    (tokenizer_src, tokenizer_tgt, what the prepared data depends on). A failure removes the
    tokenizer files it made: a refused start leaves the folder as it found it."""
    full = load_corpus(config)
    note(f"preparing the data in {folder} (once: later starts load it)")
    made = [p for key in dict.fromkeys(tokenizer_keys(config))
            for p in (tokenizer_path(config, key), recipe_path(tokenizer_path(config, key)))
            if not p.exists()]
    try:
        tokenizer_src, tokenizer_tgt = get_tokenizers(config, full.get("real", full["train"]))
        parts = prepared_parts(config, full["fingerprint"], tokenizer_src, tokenizer_tgt,
                               bool(full.get("held_out")))
        prepare(folder, parts, full, tokenizer_src, tokenizer_tgt, config.seq_len)
    except BaseException as e:
        for p in made:
            p.unlink(missing_ok=True)
        shutil.rmtree(folder.with_name(folder.name + ".tmp"), ignore_errors=True)
        if isinstance(e, OSError):  # a full disk, a folder that became unwritable
            raise DataError(f"could not write {e.filename or folder}: {e.strerror or e}; the "
                            f"files already there are untouched") from None
        raise
    return tokenizer_src, tokenizer_tgt, parts


def get_ds(config: Config, key: str = None, check_corpus=None, check_tokenizers=None) -> Data:
    """The tokenizers and the prepared training data: made once (tokenizers trained on a sample
    of train, the training split encoded to memory-mapped arrays), then loaded in seconds by
    every later start, resume and torchrun rank, as long as corpus, tokenizers and seq_len are
    the same. Validation and test texts are kept in memory; training texts are not. `key`:
    under torchrun, the key of the data rank 0 has just prepared or checked, which the other
    ranks load (without reading their own copy of the corpus to check it again).
    `check_corpus`: called with the corpus ({"source", "fingerprint"}) before anything is
    prepared (a resume refuses another corpus there); `check_tokenizers`: called with the
    tokenizers found in the model folder, before their data is looked for or prepared."""
    quiet_datasets()
    folder = prepared_folder(config)
    # the fingerprint, the test texts, and whether validation must be held out of train
    splits = load_corpus(config, wanted=("validation", "test"))
    held_out = "validation" not in splits
    corpus = {"source": corpus_source(config), "fingerprint": splits["fingerprint"],
              "version": CORPUS_FINGERPRINT,
              **({"distilled": splits["distilled"]} if "distilled" in splits else {})}
    if check_corpus is not None:
        check_corpus(corpus)
    prepared = None
    if all(tokenizer_path(config, k).exists() for k in tokenizer_keys(config)):
        tokenizer_src, tokenizer_tgt = get_tokenizers(config, None)
        if check_tokenizers is not None:
            check_tokenizers(tokenizer_src, tokenizer_tgt)
        verify = key is None  # a rank other than 0 is given the key of data rank 0 just checked
        parts = prepared_parts(config, splits["fingerprint"], tokenizer_src, tokenizer_tgt,
                               held_out)
        key = key or prepared_key(parts)
        prepared = load_prepared(folder, key, verify, parts)
    if prepared is None and not is_main():  # rank 0 has just made them: this process must see them
        raise DataError(f"{folder}: no tokenizers and prepared data matching this corpus, after "
                        f"rank 0 made them. Under torchrun on several machines, --model_folder "
                        f"must be one folder all of them see (a shared filesystem)")
    if prepared is None:
        tokenizer_src, tokenizer_tgt, parts = prepare_once(config, folder)
        # its checksums were just taken
        prepared = load_prepared(folder, prepared_key(parts), verify=False)
    train, val_texts, meta = prepared
    dropped_note("train", meta["pairs"] - meta["kept"], meta["pairs"], config.seq_len)
    validation = to_bilingual(val_texts["src"], val_texts["tgt"], tokenizer_src, tokenizer_tgt,
                              config.seq_len, "validation")
    test = {name: (column(ds, "src"), column(ds, "tgt"))
            for name, ds in sorted(splits.get("test", {}).items())} or None
    if config.extra_tag and tokenizer_src.token_to_id(config.extra_tag) is None:
        note(f"the source tokenizer has no token for --extra_tag {config.extra_tag} (made "
             f"without the flag, or before tags became tokens): the tag is encoded as text, "
             f"{len(tokenizer_src.encode(config.extra_tag).ids)} tokens")
    vocabulary = (f"{tokenizer_src.get_vocab_size()} (joint)" if config.shared_vocab else
                  f"{tokenizer_src.get_vocab_size()} ({config.lang_src}) / "
                  f"{tokenizer_tgt.get_vocab_size()} ({config.lang_tgt})")
    note(f"data: {len(train)} training pairs, {len(validation)} validation pairs"
         + "".join(f", {len(src)} test pairs ({name})" for name, (src, _) in (test or {}).items())
         + f"; vocabulary {vocabulary}")
    cover = {"source": coverage(tokenizer_src, validation.src_texts, validation.src_ids),
             "target": coverage(tokenizer_tgt, validation.tgt_texts, validation.tgt_ids)}
    return Data(tokenizer_src, tokenizer_tgt, train, validation, held_out=meta["held_out"],
                test=test, key=meta["key"], corpus=corpus, tokenizers=parts["tokenizers"],
                coverage=cover)
