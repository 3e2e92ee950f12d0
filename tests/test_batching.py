"""nmt/batching.py: token batches (their size, every pair once an epoch, a seeded order a resume
skips into) and the even cuts of BPE-dropout's pools."""

import numpy as np
import pytest
import torch

from corpus import DataError
from nmt.batching import TokenBatchSampler, even_cuts, split_for_ranks, token_cuts


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


def test_a_pair_of_exactly_max_tokens_fits_and_a_longer_one_is_refused():
    """A batch of one pair as long as max_tokens is within the limit; a longer pair fits no
    batch: refused at once (token_cuts would find no room for it)."""
    assert [b.tolist() for b in TokenBatchSampler([3, 10, 4], max_tokens=10,
                                                  shuffle=False).batches()] == [[0, 2], [1]]
    with pytest.raises(ValueError, match="a pair of 11 tokens does not fit max_tokens 10"):
        TokenBatchSampler([3, 11, 4], max_tokens=10)


def test_pairs_of_equal_length_are_batched_in_a_seeded_random_order():
    """Ties in length are broken by a seeded shuffle: which pairs share a batch changes from
    epoch to epoch (not only the order of the batches), and is the same again for an epoch."""
    sampler = TokenBatchSampler([5] * 40, max_tokens=20, seed=3)
    def grouped(epoch):
        return {frozenset(b.tolist()) for b in sampler.batches(epoch)}
    assert grouped(0) == grouped(0) and grouped(0) != grouped(1)
    assert {frozenset(range(a, a + 4)) for a in range(0, 40, 4)} != grouped(0)


def test_token_batches_are_greedy_each_as_full_as_max_tokens_allows():
    """A batch is cut only where the next pair would not fit (fewest steps an epoch)."""
    lengths = np.sort(np.random.default_rng(0).integers(3, 40, size=500))
    cuts = token_cuts(lengths, 200)
    assert cuts[0] == 0 and cuts[-1] == len(lengths)
    for a, b in zip(cuts, cuts[1:]):
        assert (b - a) * int(lengths[b - 1]) <= 200
        if b < len(lengths):
            assert (b - a + 1) * int(lengths[b]) > 200, (a, b)
    assert token_cuts(np.array([], dtype=np.int64), 200) == [0]
    assert TokenBatchSampler([], max_tokens=200).batches() == []


@pytest.mark.parametrize("world_size", [2, 3])
def test_the_ranks_share_out_every_pair_once_in_equal_numbers_of_batches(world_size):
    """torchrun: each rank takes every world_size-th batch of the same order; together they
    hold every pair once, and each makes the same number of steps."""
    lengths = np.random.default_rng(1).integers(3, 30, size=301).tolist()
    per_rank = [TokenBatchSampler(lengths, max_tokens=100, seed=2, rank=r,
                                  world_size=world_size).batches(1) for r in range(world_size)]
    assert len({len(batches) for batches in per_rank}) == 1
    assert sorted(i for batches in per_rank for b in batches for i in b.tolist()) == \
        list(range(len(lengths)))
    alone = TokenBatchSampler(lengths, max_tokens=100, seed=2).batches(1)
    assert len(per_rank[0]) < len(alone)  # a share, not the whole epoch


def test_the_largest_batch_is_halved_until_the_count_divides_and_too_few_pairs_refused():
    batches = [np.array([0, 1, 2, 3]), np.array([4]), np.array([5, 6])]
    assert [b.tolist() for b in split_for_ranks(batches, 2)] == [[0, 1], [2, 3], [4], [5, 6]]
    with pytest.raises(DataError, match="too little training data for 2 processes"):
        split_for_ranks([np.array([0])], 2)


def test_even_cuts_take_the_smallest_budget_then_halve_the_largest_batch():
    """Equal lengths: the smallest budget of at most k batches cuts them evenly; where it
    gives fewer than k, the batch of the most pairs is halved."""
    assert even_cuts(np.full(12, 5), 3) == [0, 4, 8, 12]
    lengths = np.array([1] * 7 + [8] * 2)  # no budget under 8: 3 batches, the first halved
    assert even_cuts(lengths, 4) == [0, 3, 7, 8, 9]
