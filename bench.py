"""Training throughput: this repo's Transformer against torch.nn.Transformer of the same shape.

    python bench.py                                   # base shape (512/6/8/2048), Multi30k en-de
    python bench.py --d_model 128 --N 2 --h 4 --d_ff 512 --steps 20

Both models train (forward, loss, backward, Adam) on the same length-bucketed batches of about
--max_tokens tokens, interleaved step by step, so the machine's state is the same for both.
Then, as the baseline, this repo's model on the write-ups' pipeline (8 sentences padded to
seq_len 350), and finally the whole train.py loop (data, loss, logging) for --train_steps steps.
Throughput counts real (non-padding) source + target tokens. On CUDA it also prints the model
FLOPs utilization (MFU) of the bf16 step. With --precision bf16 (or fp16) or --compile, this
repo's model is also timed as it runs by default, in fp32 and eager (the same weights,
interleaved step by step), and the ratio printed; with --compile, so is the compile time.
"""

import dataclasses
import math
import statistics
import tempfile
import time
import warnings

import torch
import torch.nn as nn
import torch.nn.functional as F

from config import ArgumentParser, Config, add_config_arguments, config_from_args, run_main
from dataset import Collator, TokenBatchSampler, get_ds, real_tokens
from model import PositionalEncoding, swiglu_width
from runtime import autocast, autocast_dtype, setup_device, use_threads
from tokenizer import PAD
from train import (accumulation_groups, learning_rate, make_loss, make_optimizer, optimizer_step,
                   set_up, train_step)
from trained_model import build_model

# Dense bf16 peak FLOP/s of common GPUs, for MFU.
PEAK_BF16 = {"H100": 989e12, "H200": 989e12, "A100": 312e12, "L4": 121e12, "A10": 125e12,
             "4090": 165e12, "3090": 71e12}


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


def model_flops(config: Config, batch, tgt_vocab: int) -> float:
    """Training FLOPs of one step (3x forward: forward + backward), counting padded positions:
    every matmul of the layers and projection, and attention's QK^T and AV. Keys and values
    are n_kv_heads wide (grouped-query attention); SwiGLU has three matrices of its width."""
    b, s = batch["encoder_input"].shape
    t = batch["decoder_input"].size(1)
    d = config.d_model
    kv = d // config.h * (config.n_kv_heads or config.h)  # width of the keys (and values)
    ffn = 3 * d * swiglu_width(config.d_ff) if config.ffn == "swiglu" else 2 * d * config.d_ff
    attn = 2 * d * d + 2 * d * kv  # W_Q, W_O; W_K, W_V
    enc = s * (attn + ffn) + 2 * s * s * d  # projections, FFN, attention scores
    dec = t * (attn + ffn) + 2 * t * t * d + t * 2 * d * d + s * 2 * d * kv \
        + 2 * t * s * d  # self-attention, FFN, cross-attention (K/V of the memory)
    forward = 2 * b * (config.N * enc + config.decoder_layers() * dec + t * d * tgt_vocab)
    return 3 * forward


class Step:
    """One timed training step of a model: train.py's forward and backward, then Adam."""

    def __init__(self, model, config, device):
        self.model, self.device = model, device
        self.optimizer = make_optimizer(model, 1e-4)  # the same optimizer for every model
        self.loss_fn = make_loss(config)
        self.amp = autocast(device, autocast_dtype(config, device))
        self.times, self.tokens = [], []
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
        if d.type == "cuda":  # activations, gradients and temporaries of this model's step
            self.peak_memory = max(self.peak_memory, torch.cuda.max_memory_allocated(d) - before)

    def tokens_per_s(self):
        return sum(self.tokens) / sum(self.times)


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_train_loop(config: Config, data, steps: int) -> float:
    """Real tokens/s of train.py's own loop pieces (data loading, step, optimizer, learning
    rate) over `steps` optimizer steps after one untimed step, in a throw-away folder."""
    with tempfile.TemporaryDirectory() as tmp:
        loop_config = dataclasses.replace(config, preload="none", model_folder=tmp,
                                          experiment_name=f"{tmp}/runs")
        for lang, tok in ((config.lang_src, data.tokenizer_src),
                          (config.lang_tgt, data.tokenizer_tgt)):  # reuse the tokenizers
            tok.save(f"{tmp}/{config.tokenizer_file.format(lang)}")
        run, progress = set_up(loop_config, set())
        seconds, tokens, started = [], [], time.perf_counter()
        for group, _ in accumulation_groups(run, 0):
            loss, _ = train_step(run.step_model, group, run.loss_fn, PAD, run.device, run.amp,
                                 run.scaler)
            optimizer_step(run, progress, loss, learning_rate(config, progress.step + 1, 0))
            progress.step += 1
            sync(run.device)
            seconds.append(time.perf_counter() - started)
            tokens.append(sum(real_tokens(b) for b in group))
            started = time.perf_counter()
            if len(seconds) > steps:
                break
        run.writer.close()
        run.lock.release()
    return sum(tokens[1:]) / sum(seconds[1:])


def attention_kernels(step: "Step", batch) -> dict:
    """On CUDA: the attention kernels one training step launches, by name and count, read
    from the profiler (flash, memory-efficient or cuDNN attention; none of them means the
    unfused math path)."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step(batch, record=False)
    found = {}
    for event in prof.key_averages():
        name = event.key.lower()
        if any(k in name for k in ("flash", "fmha", "efficient_attention", "sdpa", "cudnn")):
            found[event.key[:80]] = event.count
    return found


def peak_rss_mb():
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def parse(argv=None):
    """(args, config) of the command line: the benchmark's own defaults (Multi30k en-de in
    data/multi30k, 4,000-token batches, seq_len 128, dropout 0.1) under a --preset's values,
    under the flags given."""
    parser = ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=6, help="timed steps per model")
    parser.add_argument("--warmup_steps", type=int, default=2, help="untimed steps first")
    parser.add_argument("--baseline_steps", type=int, default=3,
                        help="timed steps of the pad-to-seq_len baseline (0 = skip)")
    parser.add_argument("--baseline_seq_len", type=int, default=350)
    parser.add_argument("--baseline_batch_size", type=int, default=8)
    parser.add_argument("--train_steps", type=int, default=6,
                        help="timed steps of the whole train.py loop after an untimed one "
                        "(0 = skip)")
    add_config_arguments(parser)
    args = parser.parse_args(argv)
    config, _ = config_from_args(args, base=Config(data_dir="data/multi30k", lang_src="en",
                                                   lang_tgt="de", max_tokens=4000, seq_len=128,
                                                   dropout=0.1))
    if config.model_folder == "weights":  # tokenizers of the benchmark corpus, kept apart
        config.model_folder = f"weights/bench_{config.lang_src}_{config.lang_tgt}"
    problem = config.validate()
    if problem:
        parser.error(problem)
    return args, config


def main(argv=None):
    args, config = parse(argv)
    data = get_ds(config)
    device = setup_device(config.device)
    use_threads(config.threads)
    shape = f"d_model {config.d_model}, N {config.depth()}, h {config.h}, d_ff {config.d_ff}"
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else \
        f"{torch.get_num_threads()} threads"
    print(f"device: {device} ({where}), torch {torch.__version__}, "
          f"precision: {autocast_dtype(config, device) or 'fp32'}")
    print(f"shape: {shape}; batches of <= {config.max_tokens} tokens; "
          f"{args.warmup_steps} warm-up + {args.steps} timed steps each")

    step_ours, step_theirs, step_fp32, flops = compare(config, data, device, args)
    rows = [("this repo (token batches)", step_ours),
            ("torch.nn.Transformer (same batches)", step_theirs)]
    if step_fp32:
        rows.append(("this repo, fp32 eager (same batches)", step_fp32))
    baseline = time_baseline(config, data, device, args) if args.baseline_steps else None
    if baseline:
        rows.append((f"baseline: {args.baseline_batch_size} sentences padded to "
                     f"{args.baseline_seq_len}", baseline))
    loop = time_train_loop(config, data, args.train_steps) if args.train_steps else None
    report(rows, loop, flops, device, args)


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
    if config.compile:
        ours, theirs = torch.compile(ours, dynamic=True), torch.compile(theirs, dynamic=True)
    step_ours, step_theirs = Step(ours, config, device), Step(theirs, config, device)
    step_fp32 = None if plain is None else \
        Step(plain, dataclasses.replace(config, precision="fp32", compile=False), device)
    sampler = TokenBatchSampler(data.train.lengths(), config.max_tokens, shuffle=True,
                                seed=config.seed)
    batches = [Collator()([data.train[i] for i in b])
               for b in sampler.batches(0)[:args.warmup_steps + args.steps]]
    flops = []
    for n, batch in enumerate(batches):
        timed = n >= args.warmup_steps
        # alternate which model goes first, so neither always runs on a warmer cache
        pair = (step_ours, step_theirs) if n % 2 == 0 else (step_theirs, step_ours)
        for step in pair + ((step_fp32,) if step_fp32 else ()):
            started = time.perf_counter()
            step(batch, record=timed)
            if n == 0 and config.compile and step is not step_fp32:
                print(f"  first step of {'ours' if step is step_ours else 'nn.Transformer'}, "
                      f"compiling: {time.perf_counter() - started:.1f}s", flush=True)
        if timed:
            flops.append(model_flops(config, batch, tgt_vocab))
        times = f"ours {step_ours.times[-1]:.2f}s, nn.Transformer {step_theirs.times[-1]:.2f}s" \
            if timed else "warm-up"
        print(f"  step {n}: {times} ({real_tokens(batch)} real tokens)", flush=True)
    if device.type == "cuda":
        print("attention kernels of one training step of this repo's model:")
        for name, count in sorted(attention_kernels(step_ours, batches[-1]).items()):
            print(f"  {count:4d} x {name}")
    return step_ours, step_theirs, step_fp32, flops


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
    print(f"{'':40} {'real tokens/s':>14} {'s/step':>8}")
    for name, step in rows:
        print(f"{name:40} {step.tokens_per_s():14,.0f} {statistics.mean(step.times):8.2f}")
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
              f"(target >= 0.9)")
    achieved = sum(flops) / sum(step_ours.times)
    print(f"model FLOP/s, ours: {achieved / 1e12:.2f} TFLOP/s; nn.Transformer: "
          f"{sum(flops) / sum(step_theirs.times) / 1e12:.2f} TFLOP/s (same FLOPs per step)")
    if device.type == "cuda":
        for name, step in rows[:2]:
            print(f"peak GPU memory of a step above the weights, {name}: "
                  f"{step.peak_memory / 2**30:.2f} GiB")
        gpu = torch.cuda.get_device_name(device)
        peak = next((v for k, v in PEAK_BF16.items() if k in gpu), None)
        if peak:
            print(f"MFU (ours): {100 * achieved / peak:.1f}% of {gpu}'s {peak / 1e12:.0f} "
                  f"TFLOP/s dense bf16")
    else:
        print(f"peak resident memory of this process: {peak_rss_mb():,.0f} MiB")


if __name__ == "__main__":
    run_main("bench.py", main)
