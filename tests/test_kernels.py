"""The speed paths of kernels.py, each held equal to what it replaces: torch's dropout, the
attention formula, the label-smoothed loss on the whole logits (model.LabelSmoothedCrossEntropy)."""

from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from conftest import tiny_model

import kernels

from kernels import (BlockwiseLabelSmoothedCrossEntropy, Dropout, block_rows,
                     written_out_attention_is_faster)
from model import LabelSmoothedCrossEntropy, build_transformer
from tokenizer import PAD


def test_dropout_drops_p_of_every_lane_scales_the_rest_and_reuses_its_mask_backward():
    """Issue 25: the CPU mask takes four 16-bit numbers from each 64-bit draw; each of the four
    lanes must drop p of its elements (a draw without its sign bit would keep every fourth
    element), the kept ones scaled by 1/(1 - p), and the gradient must pass the same mask."""
    torch.manual_seed(0)
    dropout = Dropout(0.1).train()
    x = torch.ones(1000, 1000, requires_grad=True)
    y = dropout(x)
    dropped = (y == 0).float().view(-1, 4).mean(dim=0)  # the fraction dropped in each lane
    torch.testing.assert_close(dropped, torch.full((4,), 0.1), atol=0.002, rtol=0)
    kept = y[y != 0]
    torch.testing.assert_close(kept, torch.full_like(kept, 65536 / (65536 - 6554)))
    y.sum().backward()
    assert torch.equal(x.grad, y.detach())
    assert not torch.equal(dropout(x), y)  # a new mask each call
    torch.manual_seed(0)
    assert torch.equal(dropout(x), y)  # drawn from torch's generator: seeded runs repeat
    # bf16: the kept elements scaled at full precision, then rounded once
    xb = torch.randn(100, 100).bfloat16()
    yb = dropout(xb)
    assert yb.dtype == torch.bfloat16
    kept = yb != 0
    assert torch.equal(yb[kept], (xb[kept].float() * 65536 / (65536 - 6554)).bfloat16())
    assert torch.equal(dropout.eval()(x), x)


@pytest.mark.parametrize("p", [0.1, 0.5, 1 / 65536, 1 - 1 / 65536])
def test_the_16_bit_mask_drops_exactly_round_p_65536_of_the_16_bit_numbers(p, monkeypatch):
    """The threshold's boundary: given each of the 65,536 16-bit numbers once, the mask drops
    exactly round(p · 65536) of them (the numbers below the threshold; the threshold itself is
    kept), so with the kept ones scaled by 65536 / (65536 - threshold) the expectation is
    exact. A comparison off by one (> for >=) drops one number more: a bias of 1/65536 that no
    sampled fraction shows."""
    lanes = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16)  # each number once
    monkeypatch.setattr(torch, "randint", lambda *args, **kwargs: lanes.view(torch.int64).clone())
    x = torch.ones(65536)
    y = Dropout(p).train()(x)
    threshold = round(p * 65536)
    assert int((y == 0).sum()) == threshold
    assert y.double().sum().item() == pytest.approx(65536, rel=1e-6)  # E[y] = x


@pytest.mark.parametrize("p", [1 - 1 / 131072, 0.999995, 1.0])
def test_a_rate_that_rounds_to_one_in_16_bits_drops_as_torch_does(p):
    """p from 1 - 1/131072 up rounds to 65536/65536, which keeps no 16-bit number, and the
    kept ones' scale 65536/(65536 - 65536) divided by zero: such p take torch's own dropout,
    as p = 1 does (a million elements: about 5 kept at p = 0.999995)."""
    x = torch.ones(1000, 1000)
    torch.manual_seed(0)
    y = Dropout(p).train()(x)
    torch.manual_seed(0)
    assert torch.equal(y, F.dropout(x, p, training=True))


def test_the_attention_dispatch_writes_attention_out_only_where_it_was_measured_faster():
    q = torch.zeros(1, 2, 3, 4)
    assert not written_out_attention_is_faster(q, dropout=False)  # CPU fp32, no dropout: fused
    assert written_out_attention_is_faster(q, dropout=True)
    assert written_out_attention_is_faster(q.bfloat16(), dropout=False)
    assert written_out_attention_is_faster(q.half(), dropout=False)
    assert not written_out_attention_is_faster(q.to("meta"), dropout=True)  # not a CPU


@pytest.mark.parametrize("smoothing, autocast, scale, ignore", [
    (0.1, False, 1.0, PAD), (0.0, False, 1.0, PAD), (0.1, True, 1.0, PAD),
    (0.1, False, 100.0, PAD), (0.1, False, 1.0, -100)])
def test_blockwise_loss_and_gradients_equal_the_formula_on_the_whole_logits(smoothing, autocast,
                                                                            scale, ignore):
    """Issue 25: the projection and the label-smoothed loss computed a few positions at a time,
    gradients in the forward pass, give the loss and gradients of section 5.4's formula on the
    whole logits (model.LabelSmoothedCrossEntropy): padding ignored, blocks of 3 rows over 14
    positions (the last one short), bias included; under bf16 autocast within bf16's rounding.
    Scale 100: logits so far apart that most labels' probabilities underflow float32. Issue 41:
    the default ignore_index (-100) raised in gather."""
    torch.manual_seed(0)
    x = (torch.randn(2, 7, 16) * scale).requires_grad_()
    projection = build_transformer(40, 40, 8, 8, d_model=16, N=1, h=2, d_ff=32).projection_layer
    label = torch.randint(1, 40, (2, 7))
    label[1, 4:] = ignore
    amp = torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast)
    results = []
    kwargs = {} if ignore == -100 else {"ignore_index": ignore}
    for loss_fn in (LabelSmoothedCrossEntropy(smoothing, **kwargs),
                    BlockwiseLabelSmoothedCrossEntropy(smoothing, block_rows=3, **kwargs)):
        with amp:
            loss = loss_fn(x, projection, label)
        (loss * 0.5).backward()  # an upstream gradient other than 1
        params = [x, projection.proj.weight, projection.proj.bias]
        results.append([loss.detach()] + [p.grad.clone() for p in params])
        for p in params:
            p.grad = None
    tolerance = dict(atol=2e-2, rtol=2e-2) if autocast else dict(atol=1e-5 * scale, rtol=1e-5)
    for formula_value, blockwise_value in zip(*results):
        torch.testing.assert_close(blockwise_value, formula_value, **tolerance)
    with torch.no_grad():  # no gradients to compute: the loss alone
        loss = BlockwiseLabelSmoothedCrossEntropy(smoothing, block_rows=3, **kwargs)(
            x, projection, label)
    torch.testing.assert_close(loss, results[0][0], **tolerance)
    # validation's one pass: the loss and, from the same logits, the unsmoothed loss (the nll),
    # without gradients, its products in autocast's dtype
    summed, products, real_sums, real_linear = [], [], kernels.block_sums, F.linear

    def block_sums(*args, **kwargs):
        summed.append(real_sums(*args, **kwargs))
        return summed[-1]

    def linear(x, weight, bias=None):
        products.append((x.dtype, weight.dtype))
        return real_linear(x, weight, bias)
    with amp:
        nll = LabelSmoothedCrossEntropy(0.0, **kwargs)(x, projection, label).detach()
        with mock.patch.object(kernels, "block_sums", block_sums), \
                mock.patch.object(kernels.F, "linear", linear):
            both = BlockwiseLabelSmoothedCrossEntropy(smoothing, block_rows=3, **kwargs) \
                .loss_and_nll(x, projection, label)
    torch.testing.assert_close(both[0], results[0][0], **tolerance)
    torch.testing.assert_close(both[1], nll, **tolerance)
    if smoothing:
        assert abs(both[1] - both[0]) > 1e-3  # two sums, not one twice
    assert not both[0].requires_grad and not both[1].requires_grad
    assert len(summed) == 1 and summed[0].grad_x is None and summed[0].grad_w is None
    dtype = torch.bfloat16 if autocast else torch.float32
    assert products == [(dtype, dtype)] * 5  # 14 positions in blocks of 3


def test_the_blockwise_loss_never_waits_for_the_device(monkeypatch):
    """Issue 41: each block found its underflowing rows with nonzero() and asked their number,
    which makes the host wait for a GPU at every block. Every way a tensor's value reaches the
    host is made to fail here: the loss and its gradients must not need one."""
    torch.manual_seed(0)
    model = tiny_model()
    x = (torch.randn(3, 9, model.projection_layer.proj.in_features) * 50).requires_grad_()
    label = torch.randint(4, 20, (3, 9))
    label[2, 5:] = PAD

    def waits(*args, **kwargs):
        raise AssertionError("a value read from the device")
    for name in ("item", "tolist", "nonzero", "__bool__", "__int__", "__float__", "numpy"):
        monkeypatch.setattr(torch.Tensor, name, waits)
    monkeypatch.setattr(torch, "nonzero", waits)
    loss_fn = BlockwiseLabelSmoothedCrossEntropy(0.1, PAD, block_rows=4)
    loss = loss_fn(x, model.projection_layer, label)
    loss.backward()
    loss_fn.loss_and_nll(x, model.projection_layer, label)  # validation's sums
    monkeypatch.undo()
    assert torch.isfinite(loss).item() and torch.isfinite(x.grad).all().item()


def test_block_rows_per_device():
    """CPU blocks stay cache-sized (16 MB of float32 logits, at least d_model rows); GPU blocks
    are large (the H100 measured in docs/scaling.md waited on each block's launches): a power
    of two of rows, 8,192 at the paper's 37,000 words, the largest within 1.25 GiB of logits."""
    cpu, gpu = torch.device("cpu"), torch.device("cuda")  # a device name: no GPU needed
    assert block_rows(37000, 512, cpu) == 512 and block_rows(10000, 128, cpu) == 419
    assert block_rows(37000, 512, gpu) == 8192
    for vocab in (1000, 10000, 37000, 250000):
        rows = block_rows(vocab, 512, gpu)
        assert rows & (rows - 1) == 0 and rows * vocab * 4 <= 1.25 * 2 ** 30 < 2 * rows * vocab * 4
