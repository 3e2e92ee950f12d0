"""The training loss alone: the projection and label-smoothed cross-entropy of kernels.py, a block
of positions at a time, against torch's fused cross_entropy on the whole logits, forward and
backward, interleaved call by call so that the machine's state is the same for both.

    python -m dev.bench_loss                                  # the recipe's and the paper's shapes
    python -m dev.bench_loss --shapes 512x37000 --rows 0 1024 2048 --precision bf16
    python -m dev.bench_loss --device cuda --shapes 512x37000 --positions 12500 --rows 0 12500

Prints each one's median time and its ratio to torch's (below 1: faster than torch).
"""

import statistics
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

from config import UserError
from dev.timing import sync
from kernels import BlockwiseLabelSmoothedCrossEntropy, block_rows
from nmt.cli import ArgumentParser, run_main
from nmt.runtime import setup_device


class Projection(nn.Module):
    """What the loss takes: a module with the projection's nn.Linear as `proj`."""

    def __init__(self, d_model: int, vocab: int):
        super().__init__()
        self.proj = nn.Linear(d_model, vocab)


def torch_loss(x, projection, label, smoothing: float):
    logits = projection.proj(x).float()  # (positions, vocab)
    return F.cross_entropy(logits, label, ignore_index=1, label_smoothing=smoothing,
                           reduction="sum")


def measure(d_model: int, vocab: int, positions: int, rows: list, precision: str, calls: int,
            device: torch.device):
    torch.manual_seed(0)
    projection = Projection(d_model, vocab).to(device)
    x = torch.randn(positions, d_model, requires_grad=True, device=device)
    label = torch.randint(4, vocab, (positions,), device=device)
    label[::9] = 1  # padding
    losses = {"torch cross_entropy, whole logits": lambda: torch_loss(x, projection, label, 0.1)}
    for r in rows:
        loss = BlockwiseLabelSmoothedCrossEntropy(0.1, ignore_index=1, block_rows=r)
        name = f"blockwise, {r or block_rows(vocab, d_model, x.device)} rows" \
            + ("" if r else " (default)")
        losses[name] = lambda loss=loss: loss(x, projection, label)
    times = {name: [] for name in losses}
    for call in range(calls + 1):  # the first call of each is not timed
        for name, f in losses.items():
            sync(device)
            started = time.perf_counter()
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision == "bf16"):
                value = f()
            value.backward()
            sync(device)
            if call:
                times[name].append(time.perf_counter() - started)
            x.grad = None
            projection.zero_grad()
    reference = statistics.median(next(iter(times.values())))
    print(f"d_model {d_model}, vocabulary {vocab}, {positions} positions, {precision}, {device}, "
          f"forward and backward, median of {calls}:")
    for name, t in times.items():
        print(f"  {name:<40} {statistics.median(t) * 1000:8.1f} ms  "
              f"{statistics.median(t) / reference:5.2f}x torch's time")


def main(argv=None):
    parser = ArgumentParser(prog="python -m dev.bench_loss", description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="+", default=["128x10000", "512x37000"],
                        help="d_model x vocabulary (default: the recipe's and the paper's base)")
    parser.add_argument("--positions", type=int, default=4000, help="target tokens")
    parser.add_argument("--rows", type=int, nargs="+", default=[0, 1024],
                        help="block sizes to time (0: the default)")
    parser.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    parser.add_argument("--calls", type=int, default=5, help="timed calls of each")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    args = parser.parse_args(argv)

    def run():
        for shape in args.shapes:
            try:
                d_model, vocab = (int(n) for n in shape.split("x"))
            except ValueError:
                raise UserError(f"--shapes {shape}: give d_model x vocabulary, as "
                                f"512x37000") from None
            measure(d_model, vocab, args.positions, args.rows, args.precision, args.calls,
                    setup_device(args.device))
    run_main("python -m dev.bench_loss", run)


if __name__ == "__main__":
    main()
