"""What the benchmarks in dev/ share without a training loop: waiting for the GPU (`sync`), the
FLOPs of a training step (`model_flops`) and the peak bf16 FLOP/s of common GPUs, for MFU.
Importing it loads torch and the model's helpers only (not train.py, datasets or TensorBoard)."""

import torch

from config import Config
from model import swiglu_width
from tokenizer import PAD

# Dense bf16 peak FLOP/s of common GPUs, for MFU.
PEAK_BF16 = {"H100": 989e12, "H200": 989e12, "A100": 312e12, "L4": 121e12, "A10": 125e12,
             "4090": 165e12, "3090": 71e12}


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def longest(ids: torch.Tensor) -> int:
    """The columns of a (batch, len) right-padded tensor up to its last non-PAD one."""
    used = (ids != PAD).any(dim=0).nonzero()  # (columns used, 1)
    return int(used.max()) + 1 if len(used) else 0


def model_flops(config: Config, batch, tgt_vocab: int) -> float:
    """Training FLOPs of one step (3x forward: forward + backward), counting the padding of the
    batch's pairs to their longest but not what a fixed shape adds (nmt.shapes.FixedShapes: its
    filler rows, without a target token, and its columns past the longest pair: work that trains
    nothing): every matmul of the layers and projection, and attention's QK^T and AV. Keys and
    values are n_kv_heads wide (grouped-query attention); SwiGLU has three matrices of its
    width."""
    s = longest(batch["encoder_input"])
    b = int((batch["label"] != PAD).any(dim=1).sum()) if "label" in batch else \
        batch["encoder_input"].size(0)
    t = longest(batch["label"] if "label" in batch else batch["decoder_input"])
    d = config.d_model
    kv = d // config.h * (config.n_kv_heads or config.h)  # width of the keys (and values)
    ffn = 3 * d * swiglu_width(config.d_ff) if config.ffn == "swiglu" else 2 * d * config.d_ff
    attn = 2 * d * d + 2 * d * kv  # W_Q, W_O; W_K, W_V
    enc = s * (attn + ffn) + 2 * s * s * d  # projections, FFN, attention scores
    dec = t * (attn + ffn) + 2 * t * t * d + t * 2 * d * d + s * 2 * d * kv \
        + 2 * t * s * d  # self-attention, FFN, cross-attention (K/V of the memory)
    forward = 2 * b * (config.N * enc + config.decoder_layers() * dec + t * d * tgt_vocab)
    return 3 * forward
