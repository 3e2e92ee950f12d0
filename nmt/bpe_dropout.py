"""Subword regularization (train.py --bpe_dropout): the training pairs segmented afresh each time
they are drawn (`BPEDropout`), in pools of the sampler's batches (`PooledBatches`) cut again into
as many batches; and the training DataLoader's dataset, batch sampler and collate_fn, with or
without it (`training_batches`)."""

from functools import partial

import numpy as np
import torch
from torch.utils.data import Dataset as TorchDataset

from dataset import BilingualDataset, Collator
from nmt.batching import even_cuts
from nmt.shapes import FixedShapes
from tokenizer import EOS, PAD, SOS


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
    other segmentations of the same sentences; a side whose new segmentation outgrows seq_len
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
