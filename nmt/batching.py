"""Token batching (fairseq's --max-tokens): the training pairs sorted by length and cut into
batches of at most max_tokens padded tokens (or of batch_size sentences), in a seeded order a
resume can skip into, shared out evenly between torchrun's ranks (`TokenBatchSampler`), and the
cuts themselves (`token_cuts`, `even_cuts`)."""

import numpy as np
import torch

from corpus import DataError
from nmt.shapes import FixedShapes


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
