"""Data at WMT scale: preparation time, memory, and how fast a second start trains.

    python -m dev.bench_data                         # 4.5M pairs made from data/multi30k
    python -m dev.bench_data --pairs 300000          # a quicker look

Builds a synthetic corpus of WMT14 en-de's size and shape (--pairs pairs of about 30 words a side,
each made by joining --join random aligned Multi30k sentence pairs) in --out (kept for the next run
with the same --source, --pairs and --join), then runs train.py on it three times with a tiny model
(batches of 1,024 tokens, so that memory is the data's, not activations'), each run a separate
process, its memory sampled from /proc: PSS for the main process (pages shared with other processes
split between them), USS for a DataLoader worker (the pages only it holds: what it adds):

1. the first start: tokenizer training on a sample, encoding, writing the prepared data, and
   one training step;
2. a second start (resume) and one training step: loads the prepared data (both starts end
   with a short validation: 10 sentences);
3. --train_steps more steps with --num_workers DataLoader workers: memory while training.
"""

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent  # the checkout (train.py)


def make_corpus(source: Path, out: Path, pairs: int, join: int, seed: int = 0):
    """train.en/train.de of `pairs` lines, each `join` random source pairs joined; val.* of
    3,000 such pairs (newstest-sized)."""
    src = (source / "train.en").read_text(encoding="utf-8").splitlines()
    tgt = (source / "train.de").read_text(encoding="utf-8").splitlines()
    rng = random.Random(seed)
    out.mkdir(parents=True, exist_ok=True)
    for split, n in (("train", pairs), ("val", 3000)):
        with open(out / f"{split}.en", "w", encoding="utf-8") as fe, \
                open(out / f"{split}.de", "w", encoding="utf-8") as fd:
            for start in range(0, n, 100_000):
                picks = [[rng.randrange(len(src)) for _ in range(join)]
                         for _ in range(min(100_000, n - start))]
                fe.write("".join(" ".join(src[i] for i in p) + "\n" for p in picks))
                fd.write("".join(" ".join(tgt[i] for i in p) + "\n" for p in picks))


def memory_mb(pid: int, private: bool = False) -> float:
    """A process's proportional set size in MiB (PSS: pages shared with other processes are
    split between them), or with `private` its unique set size (USS: the pages only it holds,
    what it adds). From /proc/PID/smaps_rollup (Linux 4.14+); 0 where it cannot be read."""
    fields = ("Private_Clean:", "Private_Dirty:") if private else ("Pss:",)
    try:
        lines = Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()
    except OSError:
        return 0.0
    return sum(int(line.split()[1]) for line in lines if line.startswith(fields)) / 1024


def children(pid: int):
    """The pids of a process's children (Linux /proc; none where it cannot be read)."""
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def run_train(args, flags, label):
    """Runs train.py; returns (seconds, peak PSS of the main process, peak USS of its largest
    child process (a DataLoader worker), stdout+stderr)."""
    started = time.time()
    proc = subprocess.Popen([sys.executable, str(ROOT / "train.py"), *flags],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    peak = {"main": 0.0, "worker": 0.0}

    def sample():
        while proc.poll() is None:
            peak["main"] = max(peak["main"], memory_mb(proc.pid))
            for child in children(proc.pid):
                peak["worker"] = max(peak["worker"], memory_mb(child, private=True))
            time.sleep(0.2)
    watcher = threading.Thread(target=sample, daemon=True)
    watcher.start()
    out = proc.communicate()[0]
    watcher.join()
    seconds = time.time() - started
    if proc.returncode != 0:
        sys.exit(f"python -m dev.bench_data: {label} failed (exit {proc.returncode}):\n"
                 f"{out[-3000:]}")
    return seconds, peak["main"], peak["worker"], out


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m dev.bench_data",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--source", default="data/multi30k", help="Multi30k-style folder "
                        "(train.en, train.de) the synthetic pairs are made from")
    parser.add_argument("--out", default="data/synthetic_wmt", help="where the corpus is written")
    parser.add_argument("--pairs", type=int, default=4_500_000)
    parser.add_argument("--join", type=int, default=3, help="source pairs joined into one")
    parser.add_argument("--model_folder", default="weights/bench_data")
    parser.add_argument("--train_steps", type=int, default=30)
    parser.add_argument("--num_workers", type=int, default=2)
    args = parser.parse_args(argv)
    source, out = Path(args.source), Path(args.out)
    if not (source / "train.en").exists():
        parser.error(f"--source {source}: no train.en there (the README's quick start says where "
                     f"Multi30k comes from)")
    recipe = json.dumps({"source": str(source.resolve()), "pairs": args.pairs, "join": args.join})
    made = out / "made_by_bench_data"  # its recipe, JSON (written once the corpus is whole;
    # no suffix, so that no reader of corpora takes it for a split)
    if not made.exists() or made.read_text() != recipe:  # (as written: one cut short by a
        # stop as it was written is another, not a JSON error)
        made.unlink(missing_ok=True)
        started = time.time()
        make_corpus(source, out, args.pairs, args.join)
        made.write_text(recipe)
        print(f"made {args.pairs:,} pairs in {out} ({time.time() - started:.0f}s)")
    size = sum(f.stat().st_size for f in out.glob("train.*")) / 2**30
    with open(out / "train.en", encoding="utf-8") as f:
        counts = [len(line.split()) for _, line in zip(range(10_000), f)]  # the first 10,000
    print(f"corpus: {args.pairs:,} pairs, {size:.2f} GiB of text, about "
          f"{sum(counts) / max(len(counts), 1):.0f} words per English sentence")
    shutil.rmtree(args.model_folder, ignore_errors=True)
    flags = ["--data_dir", str(out), "--lang_src", "en", "--lang_tgt", "de",
             "--model_folder", args.model_folder, "--experiment_name",
             f"{args.model_folder}/runs", "--d_model", "64", "--N", "1", "--h", "2",
             "--d_ff", "128", "--seq_len", "128", "--vocab_size", "32000", "--log_every", "1",
             "--max_tokens", "1024", "--val_max_sentences", "10", "--val_examples", "0"]
    rows = []
    seconds, main_mb, _, log = run_train(args, flags + ["--max_steps", "1"], "first start")
    rows.append(("first start: tokenizers, preparation, 1 step", seconds, main_mb, None))
    print(log[-1500:])
    seconds, main_mb, _, log = run_train(args, flags + ["--max_steps", "2"], "second start")
    rows.append(("second start, to its first step", seconds, main_mb, None))
    seconds, main_mb, worker_mb, log = run_train(
        args, flags + ["--max_steps", str(2 + args.train_steps),
                       "--num_workers", str(args.num_workers)], "training")
    rows.append((f"{args.train_steps} steps, {args.num_workers} workers", seconds, main_mb,
                 worker_mb))
    print(f"\n{'run (each a new process)':46} {'seconds':>8} {'peak PSS':>10} "
          f"{'worker USS':>11}")
    for name, s, m, w in rows:
        print(f"{name:46} {s:8.1f} {m:8,.0f} MB {'' if w is None else f'{w:8,.0f} MB':>11}")
    prepared = Path(args.model_folder) / "prepared"
    size = sum(f.stat().st_size for f in prepared.iterdir()) / 2**20
    print(f"prepared data: {size:,.0f} MiB in {prepared} ({os.cpu_count()} CPU cores)")


if __name__ == "__main__":
    main()
