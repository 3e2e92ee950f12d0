"""Training throughput: this repo's Transformer against torch.nn.Transformer of the same shape.

    python -m dev.bench                               # base shape (512/6/8/2048), Multi30k en-de
    python -m dev.bench --d_model 128 --N 2 --h 4 --d_ff 512 --steps 20
    python -m dev.bench --preset paper_base --wmt_pairs 200000 --max_tokens 12500   # WMT lengths

Both models train (forward, loss, backward, Adam) on the same length-bucketed batches of about
--max_tokens tokens, interleaved step by step, so the machine's state is the same for both.
Then, as the baseline, this repo's model on the write-ups' pipeline (8 sentences padded to
seq_len 350), and finally the whole train.py loop (data, loss, logging) for --train_steps steps.
Last, --profile_steps more steps of this repo's model (the last timed batches again) under
torch.profiler give the split of its step: matrix products, attention, the loss, the optimizer,
elementwise and other, and the time outside them (on a GPU: the time it sits idle). Throughput
counts real (non-padding) source + target tokens. On CUDA it also prints the model FLOPs
utilization (MFU) of the bf16 step. With --precision bf16 (or fp16) or --compile, this repo's model
is also timed as it runs by default, in fp32 and eager (the same weights, interleaved step by
step), and the ratio printed; with --compile, so is the compile time.

--wmt_pairs N trains on a synthetic corpus of N pairs shaped like WMT14 en-de after its joint
BPE instead (see wmt_like_corpus: the sentence lengths, a 37,000-token vocabulary), with the
padding share of each side under the token batches, and under an order by both sides' lengths.
"""

import collections
import contextlib
import dataclasses
import io
import math
import statistics
import tempfile
import time
import warnings
from contextlib import contextmanager, nullcontext
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.profiler import record_function

import model
from config import Config, UserError, add_config_arguments, config_from_args
from dataset import Collator, get_ds, real_tokens
from nmt.batching import TokenBatchSampler
from dev.timing import counted_shape, model_flops, peak_bf16, sync
from kernels import ProjectedCrossEntropy
from model import PositionalEncoding
from nmt.cli import ArgumentParser, run_main
from nmt.compiling import check_cuda_graphs, choose_shapes, compiled
from nmt.runtime import autocast, autocast_dtype, setup_device, use_threads
from nmt.trained_model import build_model
from tokenizer import PAD, tokenizer_keys, tokenizer_path
import train
from train import make_loss, make_optimizer, train_step

class TorchTransformer(nn.Module):
    """torch.nn.Transformer with the same embeddings, positional encoding, pre-norm layers and
    projection as this repo's model: the reference for speed."""

    def __init__(self, src_vocab, tgt_vocab, seq_len, d_model, N, N_dec, h, d_ff, dropout):
        super().__init__()
        self.d_model = d_model
        self.src_embed = nn.Embedding(src_vocab, d_model)
        self.tgt_embed = nn.Embedding(tgt_vocab, d_model)
        self.pos = PositionalEncoding(d_model, seq_len, dropout)
        with warnings.catch_warnings():  # "enable_nested_tensor is True, but ..." (inference only)
            warnings.simplefilter("ignore", UserWarning)
            self.transformer = nn.Transformer(d_model, h, N, N_dec, d_ff, dropout,
                                              batch_first=True, norm_first=True)
        self.proj = nn.Linear(d_model, tgt_vocab)

    def forward(self, src, tgt, src_mask, tgt_mask=None, label=None, loss=None):
        """Logits, or with `label` and `loss` (train.py's) the summed loss as a textbook model
        computes it: all the logits, then nn.functional.cross_entropy."""
        src_pad = ~src_mask[:, 0, 0, :]  # (batch, src_len), True at padding
        # Like this repo's model: the decoder is causal only (right padding needs no mask).
        causal = nn.Transformer.generate_square_subsequent_mask(tgt.size(1), device=tgt.device,
                                                                dtype=torch.bool)
        out = self.transformer(self.pos(self.src_embed(src) * math.sqrt(self.d_model)),
                               self.pos(self.tgt_embed(tgt) * math.sqrt(self.d_model)),
                               tgt_mask=causal, src_key_padding_mask=src_pad,
                               memory_key_padding_mask=src_pad, tgt_is_causal=True)
        logits = self.proj(out)  # (batch, tgt_len, tgt_vocab)
        if loss is None:
            return logits
        return F.cross_entropy(logits.float().view(-1, logits.size(-1)), label.view(-1),
                               ignore_index=loss.ignore_index,
                               label_smoothing=loss.label_smoothing, reduction="sum")


def wmt_like_corpus(folder: Path, pairs: int, vocab_size: int, seed: int) -> Path:
    """Writes (once) `pairs` aligned pairs whose lengths follow WMT14 en-de after a joint BPE of
    37,000 tokens, as far as this repo knows it: source lengths log-normal with mean 28 tokens
    and sigma 0.6 (0.8% of sentences past 100, capped at 250), each target its source's length
    times a log-normal ratio (median 1, sigma 0.2). The mean of 28 and the tail past 100 are
    the figures the WMT issue gives (the corpus cannot be measured here, offline); the spread
    is a choice. Each token is a word `w<k>` drawn uniformly from vocab_size - 10 types, so a
    word-level tokenizer gives exactly these lengths and a vocabulary of about vocab_size."""
    done = folder / f"DONE_{pairs}_{vocab_size}_{seed}"
    if done.exists():
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    src = np.clip(np.rint(rng.lognormal(math.log(28) - 0.18, 0.6, pairs)), 1, 250)
    tgt = np.clip(np.rint(src * rng.lognormal(0.0, 0.2, pairs)), 1, 250)
    words = np.array([f"w{k}" for k in range(vocab_size - 10)])
    for split, n in (("train", pairs), ("val", min(500, pairs))):
        for lang, lengths in (("en", src[:n]), ("de", tgt[:n])):
            ids = rng.integers(0, len(words), int(lengths.sum()))
            cuts = np.cumsum(lengths.astype(np.int64))[:-1]
            lines = (" ".join(sentence) for sentence in np.split(words[ids], cuts))
            (folder / f"{split}.{lang}").write_text("\n".join(lines) + "\n", encoding="utf-8")
    done.touch()
    return folder


def padding_shares(lengths_src, lengths_tgt, batches) -> tuple:
    """The share of padding in the source and in the target positions of `batches`."""
    real_src = real_tgt = padded_src = padded_tgt = 0
    for b in batches:
        real_src, real_tgt = real_src + lengths_src[b].sum(), real_tgt + lengths_tgt[b].sum()
        padded_src += len(b) * lengths_src[b].max()
        padded_tgt += len(b) * lengths_tgt[b].max()
    return 1 - real_src / padded_src, 1 - real_tgt / padded_tgt


def batches_by_both_sides(lengths_src, lengths_tgt, max_tokens: int) -> list:
    """The alternative order measured against TokenBatchSampler's: pairs sorted by target, then
    source length, each batch as large as its padded source plus target positions stay within
    2 x max_tokens (the sampler sorts by the longer side and bounds size x the longer side)."""
    order = np.lexsort((lengths_src, lengths_tgt))
    batches, start, longest_src, longest_tgt = [], 0, 0, 0
    for i, j in enumerate(order):
        a, b = max(longest_src, lengths_src[j]), max(longest_tgt, lengths_tgt[j])
        if (i - start + 1) * (a + b) > 2 * max_tokens:
            batches.append(order[start:i])
            start, a, b = i, lengths_src[j], lengths_tgt[j]
        longest_src, longest_tgt = a, b
    return batches + [order[start:]]


def report_padding(data, max_tokens: int):
    """The epoch's padding share per side: the training batches, and the order by both sides."""
    def lengths(ids):  # prepared (memory-mapped) data knows them; lists of ids are counted
        return np.asarray(ids.lengths() if hasattr(ids, "lengths") else [len(x) for x in ids])
    src = lengths(data.train.src_ids) + 2  # [SOS] ... [EOS]
    tgt = lengths(data.train.tgt_ids) + 1  # the labels: ... [EOS]
    ours = TokenBatchSampler(np.maximum(src, tgt), max_tokens, shuffle=False).batches()
    both = batches_by_both_sides(src, tgt, max_tokens)
    print(f"pairs: {len(src):,}; tokens a side with [SOS]/[EOS]: mean {src.mean():.1f} / "
          f"{tgt.mean():.1f}, {100 * (src > 100).mean():.1f}% of sources past 100")
    for name, batches in (("token batches (train.py)", ours), ("by both sides' lengths", both)):
        shares = padding_shares(src, tgt, batches)
        print(f"padding, {name}: source {100 * shares[0]:.1f}%, target "
              f"{100 * shares[1]:.1f}% ({len(batches):,} batches of <= {max_tokens} tokens)")


class Step:
    """One timed training step of a model: train.py's forward and backward, then Adam."""

    def __init__(self, model, config, device):
        self.model, self.device = model, device
        self.optimizer = make_optimizer(model, 1e-4)  # the same optimizer for every model
        self.loss_fn = make_loss(config)
        self.amp = autocast(device, autocast_dtype(config, device))
        self.times, self.tokens, self.padded, self.counted = [], [], [], []
        self.peak_memory = 0

    def __call__(self, batch, record=True):
        d = self.device
        sync(d)
        if d.type == "cuda":
            torch.cuda.reset_peak_memory_stats(d)
            before = torch.cuda.memory_allocated(d)
        started = time.perf_counter()
        train_step(self.model, [batch], self.loss_fn, PAD, d, self.amp)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        sync(d)
        if record:
            self.times.append(time.perf_counter() - started)
            self.tokens.append(real_tokens(batch))
            self.padded.append(batch["encoder_input"].numel() + batch["label"].numel())
            b, src, tgt = counted_shape(batch)  # the positions model_flops counts
            self.counted.append(b * (src + tgt))
        if d.type == "cuda":  # activations, gradients and temporaries of this model's step
            self.peak_memory = max(self.peak_memory, torch.cuda.max_memory_allocated(d) - before)

    def tokens_per_s(self, padded=False):
        return sum(self.padded if padded else self.tokens) / sum(self.times)


def time_train_loop(config: Config, data, steps: int, host_only: bool = False, batches=None,
                    untimed: int = 1) -> float:
    """Real tokens/s of train.py's own loop (train.train_epoch: data loading, step, optimizer,
    learning rate, logging) over `steps` optimizer steps after `untimed` ones, in a throw-away
    folder; with `host_only`, the mean seconds a step of that loop takes with the device's work
    (train_step's model and optimizer_step's Adam) replaced by the batches' copy to the device:
    what the host adds to each step. The loop is timed as train.py runs it: the device is waited
    for after the untimed steps and after the last, never between (a wait each step would add the
    host's work to the device's instead of overlapping it). `batches` (lists of pair indices):
    the epoch the loop trains on, in place of its sampler's (the model step's own batches, so
    that a compiled loop compiles the shapes the step did and no other)."""
    with tempfile.TemporaryDirectory() as tmp:
        loop_config = dataclasses.replace(config, preload="none", model_folder=tmp,
                                          experiment_name=f"{tmp}/runs",
                                          max_steps=steps + untimed, eval_every=0, save_every=0)
        for key, tok in zip(tokenizer_keys(config), (data.tokenizer_src, data.tokenizer_tgt)):
            tok.save(str(tokenizer_path(loop_config, key)))  # reuse the tokenizers
        run, progress = train.set_up(loop_config, set())
        if batches is not None:  # its sampler's epoch replaced (set_epoch and iter read it)
            run.sampler.batches = lambda epoch=None: [np.asarray(b) for b in batches]
            run = dataclasses.replace(run, batches_per_epoch=len(batches))
        stamps, tokens = [(time.perf_counter(), 0)], []
        step, update = train.train_step, train.optimizer_step

        def timed_step(model, group, *args, **kwargs):
            tokens.append(sum(real_tokens(b) for b in group))
            if not host_only:
                return step(model, group, *args, **kwargs)
            for b in group:  # the batch still goes to the device
                [b[k].to(run.device, non_blocking=True) for k in b]
            return torch.zeros((), device=run.device), 0

        def mark():  # (the time, the steps done) once the device has done them
            sync(run.device)
            stamps.append((time.perf_counter(), len(tokens)))

        def timed_update(*args):
            if not host_only:
                update(*args)
            if host_only or len(tokens) in (untimed, steps + untimed):  # the untimed, the last
                mark()
        train.train_step, train.optimizer_step = timed_step, timed_update
        try:
            with contextlib.redirect_stdout(io.StringIO()), \
                    contextlib.redirect_stderr(io.StringIO()):  # its bar and its stop line
                train.train_epoch(run, progress)
            if stamps[-1][1] < len(tokens):  # the epoch ended first
                mark()
        finally:
            train.train_step, train.optimizer_step = step, update
            run.writer.close()
            run.lock.release()
    if len(tokens) <= untimed:  # (a division by zero below)
        raise UserError(f"train.py's loop: the epoch has {len(tokens)} step"
                        f"{'s' * (len(tokens) != 1)}, none to time after {untimed} untimed (a "
                        f"larger corpus or a smaller --max_tokens)")
    # from the end of the untimed steps (host_only marks after every step)
    (start, first), (end, last) = stamps[untimed if host_only else 1], stamps[-1]
    if last - first < steps:  # (the figure is over fewer steps than asked: say so)
        print(f"train.py's loop: its epoch ended after {last} steps: {last - first} timed, "
              f"not {steps}")
    if host_only:
        return (end - start) / (last - first)
    return sum(tokens[first:last]) / (end - start)


# Words in the names of torch's fused attention: its operators (scaled_dot_product_*, *_flash_*,
# *_efficient_attention_*, *_cudnn_attention_*) and their GPU kernels (flash, fmha, cuDNN's sdpa)
ATTENTION_WORDS = ("scaled_dot_product", "flash", "fmha", "efficient_attention", "sdpa", "cudnn")


def attention_kernels(run) -> dict:
    """On CUDA: the attention kernels that `run()` (a training step, a batch of decoding)
    launches, by name and count, read from the profiler (flash, memory-efficient or cuDNN
    attention; none of them means the unfused math path)."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    found = {}
    for event in prof.key_averages():
        name = event.key.lower()
        if any(k in name for k in ATTENTION_WORDS):
            found[event.key[:80]] = event.count
    return found


# ---- the profiler's split of a step --------------------------------------------------------------

LOSS = "loss (its projection included)"
SPLIT = ["matrix products", "attention", LOSS, "optimizer", "elementwise and other"]
MATMULS = {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::addbmm", "aten::mv",
           "aten::addmv", "aten::_addmm_activation", "aten::_scaled_mm"}
ATTENTION = "attention (model.py, written out)"  # the profiler range around model.attention


def scope_of(name: str):
    """The split's part a range or operator of this name opens, if it opens one: everything
    under it counts there (the loss's and attention's own products included)."""
    if name.startswith("Optimizer."):  # Optimizer.step#Adam.step, Optimizer.zero_grad#...
        return "optimizer"
    if ProjectedCrossEntropy.__name__ in name:  # the loss's forward (which makes its gradients)
        return LOSS
    if name == ATTENTION or any(k in name.lower() for k in ATTENTION_WORDS):
        return "attention"
    return None


def split_events(events, cuda: bool) -> dict:
    """Microseconds of each (part of the split, operator): each operator's own time (its kernels'
    time on CUDA), in the part of the nearest range above it that opens one (scope_of), or of
    the forward operation a backward one differentiates (the profiler's sequence numbers link
    the two), else matrix products or elementwise and other by the operator's name (on CUDA by
    its kernels' names: GEMMs, attention kernels)."""
    def scoped(event):
        while event is not None:
            part = scope_of(event.name) or forward_part.get(backward_key(event))
            if part:
                return part
            event = event.cpu_parent
        return None

    def backward_key(event):  # the forward operation's (thread, sequence number)
        return (event.fwd_thread, event.sequence_nr) if event.name.startswith(
            "autograd::engine::evaluate_function") and event.sequence_nr >= 0 else None

    cpu_events = [e for e in events if not e.is_async]  # (a GPU's own events have no kernels)
    forward_part = {}  # (thread, sequence number) of a forward operation -> its part
    for event in cpu_events:
        if event.sequence_nr >= 0 and not event.fwd_thread:  # forward (not backward) operations
            part = scoped(event)
            if part:
                forward_part[(event.thread, event.sequence_nr)] = part
    split = {}
    for event in cpu_events:
        part = scoped(event)
        timings = [(k.name, k.duration) for k in event.kernels] if cuda else \
            [(event.name, event.self_cpu_time_total)]
        for name, microseconds in timings:
            by_name = "matrix products" if event.name in MATMULS or any(
                k in name.lower() for k in ("gemm", "xmma", "cutlass", "nvjet")) else \
                "attention" if any(k in name.lower() for k in ATTENTION_WORDS) else \
                "elementwise and other"
            key = (part or by_name, event.name)
            split[key] = split.get(key, 0.0) + microseconds
    return split


@contextmanager
def attention_in_a_range():
    """model.py's written-out `attention` (the CPU's path) inside a profiler range, so that the
    split finds its products and softmax; the fused kernels (GPUs) are found by their names."""
    written_out = model.attention

    def in_a_range(*args, **kwargs):
        with record_function(ATTENTION):
            return written_out(*args, **kwargs)
    model.attention = in_a_range
    try:
        yield
    finally:
        model.attention = written_out


def profile_split(step: "Step", batches, compiled: bool = False) -> tuple:
    """(the parts' shares of the wall time of these steps of this repo's model, in percent;
    the wall time not covered: on CUDA the GPU's idle time, on CPU the time outside any
    operator), from torch.profiler. The profiler slows a step; the shares are what to read.
    A compiled model keeps model.attention as it was traced (a new one would recompile it)."""
    from torch.profiler import ProfilerActivity, profile
    cuda = step.device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with attention_in_a_range() if not compiled else nullcontext(), \
            profile(activities=activities) as prof:
        sync(step.device)
        started = time.perf_counter()
        for batch in batches:
            step(batch, record=False)
        sync(step.device)
        wall = (time.perf_counter() - started) * 1e6
    parts = {part: 0.0 for part in SPLIT}
    for (part, _), microseconds in split_events(prof.events(), cuda).items():
        parts[part] += microseconds
    shares = {part: 100 * t / wall for part, t in parts.items()}
    return shares, max(0.0, 100 - sum(shares.values()))


def report_split(shares: dict, uncovered: float, steps: int, device):
    where = ", on the GPU" if device.type == "cuda" else ""
    print(f"\nwhere this repo's step spends its time ({steps} more steps under torch.profiler, "
          f"which slows them; shares of their wall time{where}):")
    for part, share in shares.items():
        print(f"  {part:40} {share:5.1f}%")
    idle = "GPU idle (no kernel running)" if device.type == "cuda" else \
        "outside any operator (Python, the host)"
    print(f"  {idle:40} {uncovered:5.1f}%")


def peak_rss_mb():
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def parse(argv=None):
    """(args, config) of the command line: the benchmark's own defaults (Multi30k en-de in
    data/multi30k, 4,000-token batches, seq_len 128, dropout 0.1) under a --preset's values,
    under the flags given."""
    parser = ArgumentParser(prog="python -m dev.bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=6, help="timed steps per model (0: the "
                        "batches' padding and fixed shapes only, nothing timed)")
    parser.add_argument("--warmup_steps", type=int, default=2, help="untimed steps first")
    parser.add_argument("--baseline_steps", type=int, default=3,
                        help="timed steps of the pad-to-seq_len baseline (0 = skip)")
    parser.add_argument("--baseline_seq_len", type=int, default=350)
    parser.add_argument("--baseline_batch_size", type=int, default=8)
    parser.add_argument("--train_steps", type=int, default=6,
                        help="timed steps of the whole train.py loop after an untimed one "
                        "(under --compile: on the model step's own batches, after its warm-up; "
                        "0 = skip)")
    parser.add_argument("--profile_steps", type=int, default=2,
                        help="steps of this repo's model profiled at the end (the last timed "
                        "batches), for the split of a step (matrix products, attention, loss...; "
                        "0 = skip)")
    parser.add_argument("--loss_block_rows", type=int, default=0,
                        help="positions per block of this repo's loss (0: kernels.block_rows)")
    parser.add_argument("--host_steps", type=int, default=0,
                        help="steps of train.py's loop timed with the device work removed (the "
                        "model's step and Adam's): the host time a step adds to the model's, "
                        "which predicts the loop against the step on a GPU (0 = skip)")
    parser.add_argument("--shapes_timed", type=int, default=0,
                        help="with fixed shapes (--compile): time batches of the N shapes most "
                        "frequent in an epoch only, so that N compilations are paid, not every "
                        "shape's (0: the epoch's first batches, whatever their shapes)")
    parser.add_argument("--dry_run", action="store_true",
                        help="check the command line and print the settings, then stop (the "
                        "GPU script's rehearsal)")
    parser.add_argument("--wmt_pairs", type=int, default=0,
                        help="train on a synthetic corpus of this many pairs with WMT14 en-de's "
                        "sentence lengths and a 37,000-token joint vocabulary (0: --data_dir)")
    add_config_arguments(parser)
    args = parser.parse_args(argv)
    config, _ = config_from_args(args, base=Config(data_dir="data/multi30k", lang_src="en",
                                                   lang_tgt="de", max_tokens=4000, seq_len=128,
                                                   dropout=0.1))
    if args.wmt_pairs:  # the synthetic corpus's own settings, over a preset's (not over flags)
        config.vocab_size, config.seq_len = args.vocab_size or 37000, args.seq_len or 256
        n = f"{args.wmt_pairs}_{config.vocab_size}"
        config.data_dir = args.data_dir or f"weights/bench_wmt/corpus_{n}"
        config.model_folder = args.model_folder or f"weights/bench_wmt/{n}"
        # the synthetic words are the subword tokens: one id each
        config.tokenizer_type, config.shared_vocab, config.lang_src, config.lang_tgt = \
            "word", True, "en", "de"
    if args.model_folder is None and not args.wmt_pairs:  # its tokenizers apart, not a run's:
        c = config  # a folder for each recipe of tokenizers
        c.model_folder = (f"weights/bench_{c.lang_src}_{c.lang_tgt}_{c.tokenizer_type}"
                          f"{c.vocab_size}{'_joint' if c.shared_vocab else ''}")
    problem = config.validate()
    if problem:
        parser.error(problem)
    if config.bpe_dropout:  # its models would be timed on plain batches, its loop on the flag's
        parser.error("--bpe_dropout: dev.bench times plain batches; the flag's cost is "
                     "dev.bench_bpe_dropout's")
    return args, config


def main(argv=None):
    args, config = parse(argv)
    if args.dry_run:
        print(f"dry run: d_model {config.d_model}, N {config.depth()}, max_tokens "
              f"{config.max_tokens}, precision {config.precision}, compile {config.compile}, "
              f"device {config.device}, cuda_graphs "
              f"{config.cuda_graphs}, fixed shapes {config.shape_count()}, steps {args.steps}, "
              f"train_steps {args.train_steps}, host_steps {args.host_steps}")
        return
    device = setup_device(config.device)
    check_cuda_graphs(config, device)  # before any file is written
    if args.wmt_pairs:
        wmt_like_corpus(Path(config.data_dir), args.wmt_pairs, config.vocab_size, config.seed)
    data = get_ds(config)
    use_threads(config.threads)
    shape = f"d_model {config.d_model}, N {config.depth()}, h {config.h}, d_ff {config.d_ff}"
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else \
        f"{torch.get_num_threads()} threads"
    print(f"device: {device} ({where}), torch {torch.__version__}, "
          f"precision: {autocast_dtype(config, device) or 'fp32'}")
    print(f"shape: {shape}; batches of <= {config.max_tokens} tokens; "
          f"{args.warmup_steps} warm-up + {args.steps} timed steps each")
    if config.max_tokens:
        report_padding(data, config.max_tokens)
    choose_shapes(config, data, say=True)  # (prints what they cost, where there are some)
    if not args.steps:  # (--steps 0: the data's figures only)
        return

    step_ours, step_theirs, step_fp32, flops, batches = compare(config, data, device, args)
    rows = [("this repo (token batches)", step_ours),
            ("torch.nn.Transformer (same batches)", step_theirs)]
    if step_fp32:
        rows.append(("this repo, fp32 eager (same batches)", step_fp32))
    baseline = time_baseline(config, data, device, args) if args.baseline_steps else None
    if baseline:
        rows.append((f"baseline: {args.baseline_batch_size} sentences padded to "
                     f"{args.baseline_seq_len}", baseline))
    loop = None
    if args.train_steps and config.compile:  # the step's shapes and warm-up (its compilations)
        chosen = timed_batches(data, config, choose_shapes(config, data), args.shapes_timed)
        untimed = max(1, args.warmup_steps)
        wanted = (untimed + args.train_steps) * config.accum_steps  # batches: k an update
        loop = time_train_loop(config, data, args.train_steps, batches=(chosen * wanted)[:wanted],
                               untimed=untimed)
    elif args.train_steps:
        loop = time_train_loop(config, data, args.train_steps)
    report(rows, loop, flops, device, args)
    if args.host_steps:
        host = time_train_loop(config, data, args.host_steps, host_only=True)
        step = statistics.mean(step_ours.times)
        print(f"host time of train.py's loop a step, the device's work removed: "
              f"{1000 * host:.1f} ms, against the model's step {1000 * step:.1f} ms: where the "
              f"host waits for nothing else, the loop runs at {step / (step + host):.2f}x the "
              f"step")
    if args.profile_steps:  # last, so that a failure here loses none of the figures above
        profiled = batches[-args.profile_steps:]  # the last timed batches again
        report_split(*profile_split(step_ours, profiled, config.compile), len(profiled), device)


def timed_batches(data, config: Config, shapes, shapes_timed: int = 0) -> list:
    """The epoch's batches (lists of pair indices) in its order; with fixed shapes and
    `shapes_timed`, only those of its `shapes_timed` most frequent shapes: fewer compilations."""
    sampler = TokenBatchSampler(data.train.lengths(), config.max_tokens, config.batch_size,
                                shuffle=True, seed=config.seed, shapes=shapes)
    chosen = sampler.batches(0)
    if shapes and shapes_timed:
        lengths = shapes.padded_lengths(data.train.lengths())
        count = collections.Counter(int(lengths[b].max()) for b in chosen)
        frequent = {n for n, _ in count.most_common(shapes_timed)}
        chosen = [b for b in chosen if int(lengths[b].max()) in frequent]
    return chosen


def compare(config: Config, data, device, args):
    """This repo's model and nn.Transformer, step by step on the same batches."""
    src_vocab, tgt_vocab = data.tokenizer_src.get_vocab_size(), data.tokenizer_tgt.get_vocab_size()
    torch.manual_seed(config.seed)
    ours = build_model(config, src_vocab, tgt_vocab).to(device).train()
    torch.manual_seed(config.seed)
    theirs = TorchTransformer(src_vocab, tgt_vocab, config.seq_len, config.d_model, config.N,
                              config.decoder_layers(), config.h, config.d_ff,
                              config.dropout).to(device).train()
    plain = None  # the same weights, as train.py runs them by default: fp32, eager
    if autocast_dtype(config, device) is not None or config.compile:
        plain = build_model(config, src_vocab, tgt_vocab).to(device).train()
        plain.load_state_dict(ours.state_dict())
    shapes = choose_shapes(config, data)  # under --compile: static shapes, compiled once each
    if config.compile:
        ours = compiled(ours, config, device, shapes)
        theirs = torch.compile(theirs, dynamic=shapes is None,
                               mode="reduce-overhead" if config.cuda_graphs else None)
    step_ours, step_theirs = Step(ours, config, device), Step(theirs, config, device)
    step_ours.loss_fn.block_rows = args.loss_block_rows
    step_fp32 = None if plain is None else \
        Step(plain, dataclasses.replace(config, precision="fp32", compile=False), device)
    wanted = args.warmup_steps + args.steps
    chosen = timed_batches(data, config, shapes, args.shapes_timed)
    if len(chosen) < wanted:  # a small corpus's few batches of one shape: time them again
        print(f"only {len(chosen)} batches to time: each is timed again in turn")
        chosen = (chosen * wanted)[:wanted]
    batches = [Collator(PAD, shapes)([data.train[i] for i in b]) for b in chosen[:wanted]]
    if shapes:
        print(f"fixed shapes: {len({tuple(b['encoder_input'].shape) for b in batches})} among "
              f"the {len(batches)} batches timed ({len(shapes.lengths)} lengths in all)")
    flops, seen = [], {}
    for n, batch in enumerate(batches):
        timed = n >= args.warmup_steps
        # alternate which model goes first, so neither always runs on a warmer cache
        pair = (step_ours, step_theirs) if n % 2 == 0 else (step_theirs, step_ours)
        for step in pair + ((step_fp32,) if step_fp32 else ()):
            started = time.perf_counter()
            step(batch, record=timed)
            new = tuple(batch["encoder_input"].shape) not in seen.setdefault(id(step), set())
            seen[id(step)].add(tuple(batch["encoder_input"].shape))
            if new and config.compile and step is not step_fp32:
                print(f"  first step of {'ours' if step is step_ours else 'nn.Transformer'} at "
                      f"{tuple(batch['encoder_input'].shape)}, compiling: "
                      f"{time.perf_counter() - started:.1f}s", flush=True)
        if timed:
            flops.append(model_flops(config, batch, tgt_vocab))
        times = f"ours {step_ours.times[-1]:.2f}s, nn.Transformer {step_theirs.times[-1]:.2f}s" \
            if timed else "warm-up"
        print(f"  step {n}: {times} ({real_tokens(batch)} real tokens)", flush=True)
    if device.type == "cuda":
        print("attention kernels of one training step of this repo's model:")
        for name, count in sorted(attention_kernels(
                lambda: step_ours(batches[-1], record=False)).items()):
            print(f"  {count:4d} x {name}")
    return step_ours, step_theirs, step_fp32, flops, batches


def time_baseline(config: Config, data, device, args):
    """The write-ups' pipeline: fixed batches of 8 sentences, every one padded to seq_len."""
    base_config = dataclasses.replace(config, seq_len=args.baseline_seq_len)
    torch.manual_seed(config.seed)
    model = build_model(base_config, data.tokenizer_src.get_vocab_size(),
                        data.tokenizer_tgt.get_vocab_size()).to(device).train()
    baseline = Step(model, config, device)
    g = torch.Generator().manual_seed(config.seed)
    order = torch.randperm(len(data.train), generator=g).tolist()
    size, pad_to = args.baseline_batch_size, args.baseline_seq_len
    for n in range(1 + args.baseline_steps):
        items = [data.train[i] for i in order[n * size:(n + 1) * size]]
        for item in items:
            for key in ("encoder_input", "decoder_input", "label"):
                item[key] = torch.cat([item[key], torch.full(
                    (pad_to - len(item[key]),), PAD, dtype=torch.long)])
        baseline(Collator()(items), record=n > 0)
    return baseline


def report(rows, loop, flops, device, args):
    step_ours, step_theirs = rows[0][1], rows[1][1]
    named = dict(rows)
    baseline = next((step for name, step in rows if name.startswith("baseline")), None)
    fp32 = named.get("this repo, fp32 eager (same batches)")
    print()
    print(f"{'':40} {'real tokens/s':>14} {'padded':>12} {'s/step':>8}")
    for name, step in rows:
        print(f"{name:40} {step.tokens_per_s():14,.0f} {step.tokens_per_s(padded=True):12,.0f} "
              f"{statistics.mean(step.times):8.2f}")
    if loop is not None:
        print(f"{'whole train.py loop':40} {loop:14,.0f}")
    print()
    print(f"ours / nn.Transformer:              "
          f"{step_ours.tokens_per_s() / step_theirs.tokens_per_s():.2f}x   (target >= 1.0)")
    if fp32 is not None:
        print(f"ours as configured / fp32 eager:    "
              f"{step_ours.tokens_per_s() / fp32.tokens_per_s():.2f}x")
    if baseline is not None:
        print(f"ours / pad-to-{args.baseline_seq_len} baseline:        "
              f"{step_ours.tokens_per_s() / baseline.tokens_per_s():.1f}x")
    if loop is not None and baseline is not None:
        print(f"train.py loop / baseline:           {loop / baseline.tokens_per_s():.1f}x   "
              f"(target >= 25)")
    if loop is not None:
        print(f"train.py loop / model step:         {loop / step_ours.tokens_per_s():.2f}x   "
              f"(target >= 0.95)")
    total = sum(flops)  # padded positions counted (not a fixed shape's filler); `real`: the
    # real tokens' share of those positions
    achieved, real = total / sum(step_ours.times), sum(step_ours.tokens) / sum(step_ours.counted)
    print(f"model FLOP/s, ours: {achieved / 1e12:.2f} TFLOP/s; nn.Transformer: "
          f"{total / sum(step_theirs.times) / 1e12:.2f} TFLOP/s (same FLOPs per step, padded "
          f"positions counted; {100 * real:.0f}% of them are real tokens)")
    if device.type == "cuda":
        for name, step in rows[:2]:
            print(f"peak GPU memory of a step above the weights, {name}: "
                  f"{step.peak_memory / 2**30:.2f} GiB")
        gpu = torch.cuda.get_device_name(device)
        peak = peak_bf16(gpu)
        if peak:
            print(f"MFU (ours): {100 * achieved / peak:.1f}% of {gpu}'s {peak / 1e12:.0f} "
                  f"TFLOP/s dense bf16 ({100 * achieved * real / peak:.1f}% counting the real "
                  f"tokens' share only)")
    else:
        print(f"peak resident memory of this process: {peak_rss_mb():,.0f} MiB")


if __name__ == "__main__":
    run_main("python -m dev.bench", main)
