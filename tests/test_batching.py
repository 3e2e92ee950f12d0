"""nmt/batching.py: token batches (their size, every pair once an epoch, a seeded order a resume
skips into) and the even cuts of BPE-dropout's pools."""

import numpy as np
import pytest
import torch

from nmt.batching import TokenBatchSampler, even_cuts


def test_token_batches_never_exceed_max_tokens_and_cover_every_pair_once():
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(3, 60, (1000,), generator=g).tolist()
    sampler = TokenBatchSampler(lengths, max_tokens=500, shuffle=True, seed=1)
    for epoch in (0, 1):
        batches = sampler.batches(epoch)
        assert all(len(b) * max(lengths[i] for i in b) <= 500 for b in batches)
        assert sorted(i for b in batches for i in b) == list(range(1000))
        assert sum(len(b) * max(lengths[i] for i in b) for b in batches) < 1.15 * sum(lengths)
    def as_lists(batches):  # batches are arrays of indices
        return [b.tolist() for b in batches]
    assert as_lists(sampler.batches(0)) == as_lists(TokenBatchSampler(lengths, 500,
                                                                      seed=1).batches(0))
    assert as_lists(sampler.batches(0)) != as_lists(sampler.batches(1))  # reshuffled each epoch
    sampler.set_epoch(1, start=5)
    assert list(sampler) == as_lists(sampler.batches(1)[5:])
    assert len(sampler) == len(sampler.batches(1)) - 5
    by_count = TokenBatchSampler(lengths, batch_size=32, shuffle=False).batches()
    assert max(len(b) for b in by_count) == 32
    assert sorted(i for b in by_count for i in b) == list(range(1000))

def test_the_batches_come_in_a_shuffled_order_not_by_length():
    """Pairs are bucketed by length, but the batches are not trained on shortest first: their
    order is shuffled (seeded by the epoch), so an epoch is no curriculum from short to long.
    Without shuffle they come sorted."""
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(3, 60, (1000,), generator=g).tolist()
    for epoch in (0, 1):
        batches = TokenBatchSampler(lengths, max_tokens=500, shuffle=True, seed=1).batches(epoch)
        longest = [max(lengths[i] for i in b) for b in batches]
        assert longest != sorted(longest) and longest != sorted(longest, reverse=True)
        ups = sum(a < b for a, b in zip(longest, longest[1:]))
        assert 0.25 < ups / (len(longest) - 1) < 0.75  # about as many rises as falls
    batches = TokenBatchSampler(lengths, max_tokens=500, shuffle=False).batches()
    longest = [max(lengths[i] for i in b) for b in batches]
    assert longest == sorted(longest)


@pytest.mark.parametrize("k", [1, 2, 5, 13])
def test_even_cuts_make_exactly_k_batches_of_about_equal_tokens(k):
    """BPE-dropout's pools are cut into exactly as many batches as came in, each a run of the
    pairs sorted by length, none over the pool's padded tokens shared out k ways (and one pair)."""
    lengths = np.sort(np.random.default_rng(k).integers(3, 40, size=13 * 17))
    cuts = even_cuts(lengths, k)
    assert len(cuts) == k + 1 and cuts[0] == 0 and cuts[-1] == len(lengths)
    assert all(a < b for a, b in zip(cuts, cuts[1:]))
    padded = [(b - a) * int(lengths[b - 1]) for a, b in zip(cuts, cuts[1:])]
    assert max(padded) <= len(lengths) * int(lengths[-1]) / k + int(lengths[-1])
