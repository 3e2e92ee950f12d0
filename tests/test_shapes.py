"""nmt/shapes.py: fixed batch shapes (issue 62): the lengths that pad the least, and a batch in
its shape with the loss and gradients of its pairs."""

import torch


def test_best_lengths_pad_the_least_of_every_choice():
    """nmt.shapes.best_lengths against every choice of k lengths (the longest always among them):
    no other pads these pairs less."""
    import itertools

    import numpy as np

    from nmt.shapes import best_lengths
    rng = np.random.default_rng(3)
    lengths = rng.integers(2, 30, 300)
    values = sorted(set(lengths.tolist()))

    def padding(bounds):
        bounds = np.array(bounds)
        return int((bounds[np.searchsorted(bounds, lengths)] - lengths).sum())
    for k in (1, 2, 3, 4):
        found = best_lengths(lengths, k)
        assert len(found) == k and found[-1] == max(values)
        least = min(padding(list(c) + [max(values)])
                    for c in itertools.combinations(values[:-1], k - 1))
        assert padding(found) == least
    assert best_lengths([5, 5, 7], 9) == (5, 7)  # no more lengths than there are


def test_a_fixed_shape_batch_has_the_loss_and_gradients_of_its_pairs():
    """Issue 62: a batch padded to its fixed (rows, length) shape, filler rows and all, gives
    the summed loss and the gradients of the same pairs batched as before; the sampler never
    puts more pairs in a batch than its shape has rows, and an epoch uses few shapes."""
    import numpy as np

    from conftest import tiny_model
    from dataset import BilingualDataset, Collator, real_tokens
    from nmt.batching import TokenBatchSampler
    from nmt.shapes import FixedShapes, best_lengths
    from kernels import BlockwiseLabelSmoothedCrossEntropy
    from tokenizer import PAD
    rng = np.random.default_rng(0)
    src = [rng.integers(4, 20, rng.integers(1, 14)).tolist() for _ in range(200)]
    tgt = [rng.integers(4, 20, rng.integers(1, 14)).tolist() for _ in range(200)]
    data = BilingualDataset(src, tgt)
    shapes = FixedShapes(best_lengths(data.lengths(), 4), 120, 0)
    sampler = TokenBatchSampler(data.lengths(), 120, shapes=shapes, seed=2)
    batches = sampler.batches(0)
    plain, fixed = Collator(PAD), Collator(PAD, shapes)
    seen = set()
    for b in batches:
        batch = fixed([data[i] for i in b])
        rows, length = batch["encoder_input"].shape
        assert (rows, length) == shapes.shape(max(data.lengths()[i] for i in b))
        assert len(b) <= rows and batch["label"].shape == (rows, length)
        seen.add((rows, length))
    assert len(seen) <= 4
    model = tiny_model(vocab=20, seq_len=32)  # dropout 0
    loss_fn = BlockwiseLabelSmoothedCrossEntropy(0.1, ignore_index=PAD)
    lengths = data.lengths()
    short = next(b for b in batches  # a batch with filler rows and a longer length than its own
                 if len(b) < shapes.shape(max(lengths[i] for i in b))[0]
                 and shapes.length(max(lengths[i] for i in b)) > max(lengths[i] for i in b))
    grads = []
    for collate in (plain, fixed):
        batch = collate([data[i] for i in short])
        model.zero_grad()
        loss = model(batch["encoder_input"], batch["decoder_input"], batch["encoder_mask"],
                     label=batch["label"], loss=loss_fn)
        loss.backward()
        grads.append((loss.detach(), [p.grad.clone() for p in model.parameters()],
                      real_tokens(batch), int((batch["label"] != PAD).sum())))
    (loss_a, grad_a, real_a, n_a), (loss_b, grad_b, real_b, n_b) = grads
    torch.testing.assert_close(loss_a, loss_b, rtol=1e-5, atol=1e-5)
    for a, b in zip(grad_a, grad_b):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    assert (real_a, n_a) == (real_b, n_b)  # filler rows count as no tokens


def test_a_batch_with_more_pairs_than_its_shapes_rows_is_refused():
    """FixedShapes.pad fills a batch to its shape's rows: one with more pairs than those rows
    (cut by other lengths than the shapes') is refused, never cut; as many pairs fit."""
    import pytest

    from nmt.shapes import FixedShapes
    shapes = FixedShapes((8, 16), 32, 0)  # length 8: 4 rows

    def batch(pairs):
        ids = torch.full((pairs, 6), 7)
        return {"encoder_input": ids, "decoder_input": ids.clone(), "label": ids.clone()}
    assert shapes.pad(batch(4))["encoder_input"].shape == (4, 8)
    with pytest.raises(ValueError, match=r"a batch of 5 pairs does not fit its shape \(4, 8\)"):
        shapes.pad(batch(5))


# ---- behaviours a mutation audit found unguarded -------------------------------------------------

def test_a_shapes_rows_never_hold_more_than_max_tokens():
    """R(L) = max_tokens // L, rounded down: a fixed shape is never more tokens than
    --max_tokens (batch_size rows for sentence batches)."""
    from nmt.shapes import FixedShapes
    shapes = FixedShapes((8, 16), 30, 0)
    assert shapes.shape(5) == (3, 8) and shapes.shape(9) == (1, 16)
    assert FixedShapes((8, 16), 0, 12).shape(9) == (12, 16)


def test_a_pair_is_cut_by_the_first_length_at_least_as_long():
    """FixedShapes.padded_lengths and .length: a pair exactly as long as a shape's length goes
    in that shape, not the next."""
    from nmt.shapes import FixedShapes
    shapes = FixedShapes((8, 16), 64, 0)
    assert shapes.padded_lengths([1, 8, 9, 16]).tolist() == [8, 8, 16, 16]
    assert [shapes.length(n) for n in (1, 8, 9, 16)] == [8, 8, 16, 16]


def test_a_batch_whose_target_is_its_longest_side_gets_the_shape_of_its_target():
    """FixedShapes.pad picks the shape by the longer of source and label: a short source with a
    long target is padded to the target's length, its tokens all kept."""
    from nmt.shapes import FixedShapes
    from tokenizer import EOS, PAD, SOS
    enc = torch.tensor([[SOS, 7, EOS]])
    label = torch.tensor([[7] * 9 + [EOS]])
    dec = torch.tensor([[SOS] + [7] * 9])
    out = FixedShapes((4, 12), 24, 0).pad({"encoder_input": enc, "decoder_input": dec,
                                           "label": label})
    assert out["label"].shape == (2, 12) and out["encoder_input"].shape == (2, 12)
    assert out["label"][0, :10].tolist() == label[0].tolist()
    assert (out["label"][1] == PAD).all()  # the filler row: no loss


def test_the_shapes_report_counts_padding_on_both_sides():
    """FixedShapes.report: a batch exactly filling its shape on both sides is no padding, and
    each side of a batch padded to its own longest counts once."""
    from nmt.shapes import FixedShapes
    report = FixedShapes((4, 8), 8, 0).report([8], [8], [[0]], [[0]])
    assert report["fixed_padding"] == 0 and report["plain_padding"] == 0 and report["added"] == 0
    assert report["shapes"] == 1 and report["steps"] == report["plain_steps"] == 1
