"""Speed paths beside the paper: each computes what a piece of model.py computes, faster on some
device, and is held equal to its reference by tests/test_kernels.py. model.py stays the paper.

- `Dropout`: nn.Dropout, with a cheaper random mask on CPU (16 random bits an element).
- `written_out_attention_is_faster`: where model.py's `attention`, written out, beats torch's
  fused kernel (CPU, in bf16 or fp16, or training with attention dropout).
- `BlockwiseLabelSmoothedCrossEntropy`: the projection (section 3.4) and the label-smoothed loss
  (section 5.4, model.LabelSmoothedCrossEntropy) a block of positions at a time, the gradients
  computed in the forward pass: faster on CPU than torch's fused loss on the whole logits at
  the recipe's and the paper's shapes, and never holding the logits whole (docs/performance.md).

This file imports nothing of the project's: model.py imports it.
"""

import torch
import torch.nn as nn
import torch.nn.functional as F

# ---- dropout ------------------------------------------------------------------------------------


class Dropout(nn.Module):
    """nn.Dropout (section 5.4: zero each element with probability p, scale the rest by
    1/(1 - p)), with its mask drawn more cheaply on CPU: torch's generator costs about 12 ns an
    element there, one draw an element for nn.Dropout, so each 64-bit draw is split into four
    16-bit numbers and an element is kept where its number is at least p · 65536 (p rounded to
    a multiple of 1/65536). About 2.6 times faster; the training step at the modern recipe's
    shape gained about 1.15x (docs/performance.md). On other devices: torch's own dropout."""

    def __init__(self, p: float):
        super().__init__()
        self.p = p

    def forward(self, x):
        if not self.training or self.p == 0:
            return x
        threshold = round(self.p * 65536)  # 65536 where p rounds to 1: no 16-bit number kept
        if x.device.type != "cpu" or threshold >= 65536:
            return F.dropout(x, self.p, training=True)
        return SixteenBitDropout.apply(x, threshold)

    def extra_repr(self):
        return f"p={self.p}"


class SixteenBitDropout(torch.autograd.Function):
    """Dropout's mask from 16 random bits an element; the backward pass reuses the mask. The
    mask is kept as 0/1 in x's dtype, and x · mask · 1/(1 - p) is one fused multiply-add with the
    scale at full precision (a bf16 mask of 1/(1 - p) would round the scale): fewer passes than
    where(keep, x · scale, 0), forward and backward."""

    @staticmethod
    def forward(ctx, x, threshold: int):
        draws = torch.randint(-2 ** 63, 2 ** 63 - 1, ((x.numel() + 3) // 4,), dtype=torch.int64)
        bits = draws.view(torch.int16)[:x.numel()].view(x.shape)  # (*x.shape), in [-2^15, 2^15)
        # 1 with probability 1 - threshold / 65536, else 0, written straight in x's dtype
        keep = torch.ge(bits, threshold - 32768, out=x.new_empty(x.shape))  # (*x.shape)
        ctx.scale = 65536 / (65536 - threshold)
        ctx.save_for_backward(keep)
        return torch.addcmul(x.new_zeros(()), x, keep, value=ctx.scale)

    @staticmethod
    def backward(ctx, grad):
        keep, = ctx.saved_tensors
        return torch.addcmul(grad.new_zeros(()), grad, keep, value=ctx.scale), None


# ---- attention ----------------------------------------------------------------------------------

def written_out_attention_is_faster(q: torch.Tensor, dropout: bool) -> bool:
    """Whether model.py's `attention`, written out, runs faster than torch's fused
    scaled_dot_product_attention for queries `q` (dropout: attention dropout is on). Measured
    with torch 2.13 (docs/performance.md): on CPU in training with attention dropout, the fused
    kernel runs its math path, drawing the mask an element at a time (the written-out path uses
    `Dropout` above); on CPU in bf16 or fp16 it is 3 to 10 times slower than the written-out
    products at sentence lengths. Elsewhere (GPUs: flash attention) the fused kernel."""
    return q.device.type == "cpu" and (q.dtype in (torch.bfloat16, torch.float16) or dropout)


# ---- the projection and the label-smoothed loss, a block of positions at a time -----------------

class BlockwiseLabelSmoothedCrossEntropy(nn.Module):
    """model.LabelSmoothedCrossEntropy's value (and gradients), with the projection: called as
    loss(x, projection, label) with the decoder's output x, the ProjectionLayer and the labels.

    Projection and loss are computed together, a block of positions at a time, so the logits
    (positions × vocabulary: 22M numbers for 2,200 target tokens over 10k) are never held whole.
    The loss is the graph's last step, so each block's gradients, softmax minus target
    distribution, go through the projection's matmuls in the same pass, while the block is in
    cache (CPU: 1.7x the separate projection and loss at the recipe's shape,
    docs/performance.md), and backward only scales them. On a GPU the gain is memory: no logits
    and no logits' gradient. No host-device wait: nothing in it reads a value from the device."""

    def __init__(self, label_smoothing: float = 0.0, ignore_index: int = -100,
                 block_rows: int = 0):
        super().__init__()
        self.label_smoothing, self.ignore_index = label_smoothing, ignore_index
        self.block_rows = block_rows  # 0: `block_rows` below

    def forward(self, x, projection, label):
        """x: (batch, tgt_len, d_model), the decoder's output; label: (batch, tgt_len)."""
        if torch.compiler.is_compiling():
            # Under torch.compile: the whole logits and torch's own loss (the same formula), which
            # the compiler fuses. (On torch 2.13 the blocks' autograd function traces without a
            # graph break too, but inductor compiled the test suite's tiny compiled step from a
            # cold cache in 70 s with it against 53 s with this, on 2 cores of an AMD EPYC with
            # AVX512-BF16 shared with other work.) Each fixed batch shape is one static graph.
            logits = projection(x)  # (batch, tgt_len, vocab)
            return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(),
                                   label.reshape(-1), ignore_index=self.ignore_index,
                                   label_smoothing=self.label_smoothing, reduction="sum")
        return self.blockwise(x, projection, label)

    def blockwise(self, x, projection, label):
        linear = projection.proj
        x = x.reshape(-1, x.size(-1))  # (positions, d_model)
        rows = self.block_rows or block_rows(*linear.weight.shape, x.device)
        gradients = torch.is_grad_enabled() and (x.requires_grad or linear.weight.requires_grad)
        return ProjectedCrossEntropy.apply(x, linear.weight, linear.bias, label.reshape(-1),
                                           self.label_smoothing, self.ignore_index, rows,
                                           gradients)

    @torch.no_grad()
    def loss_and_nll(self, x, projection, label):
        """(loss, nll): this loss's value and, from the same logits, the labels' negative
        log-likelihood summed over the non-padding positions (the loss with no smoothing),
        for the price of one projection: what validation reports (without gradients)."""
        linear = projection.proj
        x = x.reshape(-1, x.size(-1))  # (positions, d_model)
        rows = self.block_rows or block_rows(*linear.weight.shape, x.device)
        sums = block_sums(x, linear.weight, linear.bias, label.reshape(-1), self.label_smoothing,
                          self.ignore_index, rows, gradients=False, nll=True)
        return sums.total, sums.nll


def block_rows(vocab: int, d_model: int, device: torch.device) -> int:
    """Positions per block. On CPU: as many as keep the block's float32 logits within 16 MB, but
    at least d_model. The weight's gradient is a product (vocabulary × rows) @ (rows × d_model)
    whose inner size is the block's rows: at the paper's base shape (512 wide, 37,000 words) the
    113 rows of 16 MB made it slow, and the loss took 1.27 times torch's whole-logits time on
    CPU; 512 rows take 0.82 times (dev/bench_loss.py, docs/performance.md). On a GPU: the largest
    power of two of rows whose float32 logits fit in 1.25 GiB (8,192 at 37,000 words): each is
    a dozen kernel launches, and an H100 at the base shape waits on them (the loss alone on 12,500
    positions: 12.0 ms in the former 256 MB blocks, 10.6 in 4,096 rows, 9.6 in one block; the
    base step at 8,192 rows 1.08x the former's, docs/scaling.md)."""
    if device.type == "cpu":
        return max(d_model, (1 << 22) // vocab)
    fits = (5 << 28) // (4 * vocab)  # rows of float32 logits in 1.25 GiB
    return max(d_model, 1 << max(fits.bit_length() - 1, 0))


class ProjectedCrossEntropy(torch.autograd.Function):
    """The computation of BlockwiseLabelSmoothedCrossEntropy. With z the logits of a position, y
    its label, ε the smoothing and V the vocabulary: loss = logsumexp(z) - (1 - ε) z_y - ε/V Σ_j
    z_j, and its gradient dloss/dz = softmax(z) - (1 - ε) one-hot(y) - ε/V."""

    @staticmethod
    def forward(ctx, x, weight, bias, label, eps: float, ignore_index: int, rows: int,
                gradients: bool):
        ctx.dtypes = x.dtype, weight.dtype
        sums = block_sums(x, weight, bias, label, eps, ignore_index, rows, gradients)
        ctx.save_for_backward(sums.grad_x, sums.grad_w, sums.grad_b)
        return sums.total

    @staticmethod
    def backward(ctx, grad_total):
        grad_x, grad_w, grad_b = ctx.saved_tensors
        return ((grad_x * grad_total).to(ctx.dtypes[0]), (grad_w * grad_total).to(ctx.dtypes[1]),
                None if grad_b is None else grad_b * grad_total, None, None, None, None, None)


def block_sums(x, weight, bias, label, eps: float, ignore_index: int, rows: int,
               gradients: bool, nll: bool = False):
    """ProjectedCrossEntropy's BlockSums over every block of `rows` positions of x (positions,
    d_model); `nll`: the negative log-likelihood summed beside the loss. Under autocast the
    matmuls run in its dtype (bf16): x, the weight and the bias are cast once here, each
    block's gradient once, and autocast is off inside (it would cast them again for each
    product). The softmax and the loss are float32 in any case."""
    kind = x.device.type  # (torch >= 2.4: autocast's state by device type)
    dtype = torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else x.dtype
    x, weight = x.to(dtype), weight.to(dtype)
    bias = None if bias is None else bias.to(dtype)
    sums = BlockSums(x, weight, bias, gradients, nll)
    with torch.autocast(kind, enabled=False):
        for start in range(0, x.size(0), rows):
            sums.add_block(start, label[start:start + rows], eps, ignore_index)
    return sums


class BlockSums:
    """The running sums of ProjectedCrossEntropy over its blocks: the loss, with `gradients` the
    loss's gradients with respect to x (row by row), the weight and the bias, and with `nll` the
    labels' negative log-likelihood (the loss at ε = 0)."""

    def __init__(self, x, weight, bias, gradients: bool, nll: bool = False):
        self.x, self.weight, self.bias = x, weight, bias
        device, f32 = x.device, torch.float32
        # Σ_j z_j of every position, without a pass over the logits: x · Σ_j w_j + Σ_j b_j
        self.w_sum = weight.float().sum(dim=0)  # (d_model,)
        self.b_sum = 0.0 if bias is None else bias.float().sum()
        self.total = torch.zeros((), dtype=f32, device=device)
        self.nll = torch.zeros((), dtype=f32, device=device) if nll else None
        self.grad_x = torch.empty(x.shape, dtype=f32, device=device) if gradients else None
        self.grad_w = torch.zeros_like(weight, dtype=f32) if gradients else None
        self.grad_b = torch.zeros(weight.size(0), dtype=f32, device=device) \
            if gradients and bias is not None else None

    def add_block(self, start: int, label, eps: float, ignore_index: int):
        xb = self.x[start:start + label.size(0)]  # (n, d_model)
        vocab, dtype = self.weight.size(0), self.x.dtype
        real = label != ignore_index  # (n,), False at padding
        label = label.masked_fill(~real, 0).unsqueeze(1)  # (n, 1): any index where ignored
        z = F.linear(xb, self.weight, self.bias)  # (n, vocab), in dtype
        p = torch.softmax(z, dim=1, dtype=torch.float32)  # (n, vocab)
        z_label = z.gather(1, label).squeeze(1).float()  # (n,)
        # logsumexp(z) = max(z) - log max(p): the largest probability is at least 1/V, so no
        # underflow, whatever the loss (two reductions without indices: max() with its
        # indices costs as much as the softmax on CPU)
        logsumexp = z.amax(dim=1).float() - p.amax(dim=1).log()  # (n,)
        z_sum = xb.float() @ self.w_sum + self.b_sum  # (n,)
        loss = logsumexp - (1 - eps) * z_label - eps / vocab * z_sum  # (n,)
        self.total += loss.masked_fill(~real, 0.0).sum()
        if self.nll is not None:
            self.nll += (logsumexp - z_label).masked_fill(~real, 0.0).sum()
        if self.grad_x is None:
            return
        # dloss/dz = softmax(z) - (1 - ε) one-hot(y) - ε/V at real positions, 0 at padding: the
        # first two terms here; the constant's share of the three products is added to them
        # after (a rank-one term each), and padded positions are taken out of the products
        # through their (small) inputs and outputs, not the block.
        realf = real.float()  # (n,), 0 at padding
        p.scatter_add_(1, label, torch.full_like(z_label, -(1 - eps)).unsqueeze(1))
        g = p.to(dtype)  # (n, vocab)
        x_real = xb * real.unsqueeze(1).to(dtype)  # (n, d_model), 0 at padding
        self.grad_x[start:start + xb.size(0)] = ((g @ self.weight).float()
                                                 - eps / vocab * self.w_sum) * realf.unsqueeze(1)
        self.grad_w += g.t() @ x_real  # (vocab, d_model)
        self.grad_w -= eps / vocab * x_real.float().sum(dim=0)  # the same in every row
        if self.grad_b is not None:
            self.grad_b += realf @ p - eps / vocab * realf.sum()  # (vocab,)
