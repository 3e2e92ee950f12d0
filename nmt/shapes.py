"""Fixed batch shapes (train.py --fixed_shapes, and --compile's): token batches padded to a few
(rows, length) shapes, so that a compiled step compiles once per shape and, on CUDA, can be
captured as a graph. `best_lengths` chooses the lengths from the training pairs'; `FixedShapes`
pads a collated batch (dataset.Collator) to its shape and tells the sampler
(nmt.batching.TokenBatchSampler) the length to cut each pair by. nmt/compiling.py chooses a
run's shapes and compiles the step."""

import bisect
from dataclasses import dataclass

import numpy as np
import torch

from dataset import encoder_mask
from tokenizer import EOS, PAD, SOS


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
