"""What the benchmarks in dev/ share without a training loop: waiting for the GPU (`sync`), the
FLOPs of a training step (`model_flops`) and the peak bf16 FLOP/s of common GPUs, for MFU.
Importing it loads torch and the model's helpers only (not train.py, datasets or TensorBoard)."""

import re

import torch

from config import Config
from model import swiglu_width
from tokenizer import PAD

# Dense bf16 peak FLOP/s of common GPUs, for MFU, by the words of their names (peak_bf16)
PEAK_BF16 = {"H100 PCIe": 756e12, "H100": 989e12, "H200": 989e12, "A100": 312e12,
             "L40S": 362e12, "L4": 121e12, "A10": 125e12, "4090": 165e12, "3090": 71e12}


def peak_bf16(gpu: str):
    """The dense bf16 peak of the GPU named `gpu` (torch.cuda.get_device_name), or None: the
    entry whose every word is a word of the name, the most words first (an L40S is no L4, an
    A100-SXM4 no A10, an H100 PCIe no SXM H100)."""
    words = set(re.split(r"[\s-]+", gpu))
    for key in sorted(PEAK_BF16, key=lambda k: -len(k.split())):
        if set(key.split()) <= words:
            return PEAK_BF16[key]
    return None


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def longest(ids: torch.Tensor) -> int:
    """The columns of a (batch, len) right-padded tensor up to its last non-PAD one."""
    used = (ids != PAD).any(dim=0).nonzero()  # (columns used, 1)
    return int(used.max()) + 1 if len(used) else 0


def counted_shape(batch) -> tuple:
    """(rows, source length, target length) of a batch as `model_flops` counts it: the rows with
    a target token, each side to its longest pair (a fixed shape's filler left out); its
    positions, rows x (source + target), are those MFU's FLOPs are of."""
    b = int((batch["label"] != PAD).any(dim=1).sum()) if "label" in batch else \
        batch["encoder_input"].size(0)
    return b, longest(batch["encoder_input"]), \
        longest(batch["label"] if "label" in batch else batch["decoder_input"])


def model_flops(config: Config, batch, tgt_vocab: int) -> float:
    """Training FLOPs of one step (3x forward: forward + backward), counting the padding of the
    batch's pairs to their longest but not what a fixed shape adds (nmt.shapes.FixedShapes: its
    filler rows, without a target token, and its columns past the longest pair: work that trains
    nothing): every matmul of the layers and projection, and attention's QK^T and AV. Keys and
    values are n_kv_heads wide (grouped-query attention); SwiGLU has three matrices of its
    width."""
    b, s, t = counted_shape(batch)
    d = config.d_model
    kv = d // config.h * (config.n_kv_heads or config.h)  # width of the keys (and values)
    ffn = 3 * d * swiglu_width(config.d_ff) if config.ffn == "swiglu" else 2 * d * config.d_ff
    attn = 2 * d * d + 2 * d * kv  # W_Q, W_O; W_K, W_V
    enc = s * (attn + ffn) + 2 * s * s * d  # projections, FFN, attention scores
    dec = t * (attn + ffn) + 2 * t * t * d + t * 2 * d * d + s * 2 * d * kv \
        + 2 * t * s * d  # self-attention, FFN, cross-attention (K/V of the memory)
    forward = 2 * b * (config.N * enc + config.decoder_layers() * dec + t * d * tgt_vocab)
    return 3 * forward
