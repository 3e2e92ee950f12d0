"""What subword regularization (--bpe_dropout) costs an epoch of training, and what its pools save.

    python -m dev.bench_bpe_dropout --preset multi30k_modern --data_dir data/multi30k
    python -m dev.bench_bpe_dropout --preset multi30k_modern --data_dir data/multi30k \\
        --bpe_dropout 0.2 --steps 20

One epoch of the sampler's batches (epoch 1 of the config's seed), made three ways: plain (the
prepared ids, as train.py trains without the flag); segmented afresh as train.py does with it
(pools of 16 batches, each cut again by the new lengths into as many batches); and, for
reference, each batch segmented afresh alone (a pool of one batch: padded as the sampler
batched the plain lengths). For each: the real tokens and the padding share of each side over
the whole epoch, and the time to make a batch. Then the config's model trains on the first
--steps batches of each kind, interleaved step by step after --warmup_steps untimed ones (the
same optimizer, loss and step as bench.py's), which gives each kind's seconds per padded
token; an epoch's time is estimated as its making plus its padded tokens at that rate, and
printed as a ratio to the plain epoch's. (--bpe_dropout 0, the default of a preset, is taken
as 0.1.)
"""

import statistics
import time

import torch

from config import Config, add_config_arguments, config_from_args
from dataset import Collator, get_ds, real_tokens
from dev.bench import Step
from dev.timing import sync
from nmt.batching import TokenBatchSampler
from nmt.bpe_dropout import POOL_BATCHES, BPEDropout, PooledBatches
from nmt.cli import ArgumentParser, run_main
from nmt.runtime import setup_device, use_threads
from nmt.trained_model import build_model
from tokenizer import PAD


def parse(argv=None):
    parser = ArgumentParser(prog="python -m dev.bench_bpe_dropout",
                            description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=10, help="timed steps per kind of batch")
    parser.add_argument("--warmup_steps", type=int, default=2, help="untimed steps first")
    add_config_arguments(parser)
    args = parser.parse_args(argv)
    config, _ = config_from_args(args, base=Config(data_dir="data/multi30k", lang_src="en",
                                                   lang_tgt="de"))
    config.bpe_dropout = config.bpe_dropout or 0.1
    problem = config.validate()
    if problem:
        parser.error(problem)
    return args, config


def epoch_batches(data, sampler, dropout, pool: int):
    """The epoch's batches (pool 0: plain) and the seconds each took to make."""
    batches, seconds = [], []
    if not pool:
        collate = Collator(PAD)
        for indices in sampler:
            started = time.perf_counter()
            batches.append(collate(data.train.__getitems__(indices)))
            seconds.append(time.perf_counter() - started)
        return batches, seconds
    for indices in PooledBatches(sampler, pool):
        started = time.perf_counter()
        made = dropout.__getitems__(indices)
        seconds += [(time.perf_counter() - started) / len(made)] * len(made)
        batches += made
    return batches, seconds


def main(argv=None):
    args, config = parse(argv)
    data = get_ds(config)
    device = setup_device(config.device)
    use_threads(config.threads)
    print(f"device: {device} ({torch.get_num_threads()} threads), torch {torch.__version__}; "
          f"--bpe_dropout {config.bpe_dropout}, batches of <= {config.max_tokens} tokens")
    sampler = TokenBatchSampler(data.train.lengths(), config.max_tokens, config.batch_size,
                                shuffle=True, seed=config.seed)
    sampler.set_epoch(1)
    dropout = BPEDropout(data.train, data.tokenizer_src, data.tokenizer_tgt, config.bpe_dropout,
                         config.seq_len)
    kinds = {"plain (no dropout)": 0, f"dropout, pools of {POOL_BATCHES} (train.py)": POOL_BATCHES,
             "dropout, each batch alone": 1}
    made = {name: epoch_batches(data, sampler, dropout, pool) for name, pool in kinds.items()}
    torch.manual_seed(config.seed)
    model = build_model(config, data.tokenizer_src.get_vocab_size(),
                        data.tokenizer_tgt.get_vocab_size()).to(device).train()
    steps = {name: Step(model, config, device) for name in kinds}  # one model, three records
    for n in range(args.warmup_steps + args.steps):
        for name in (list(kinds) if n % 2 == 0 else list(kinds)[::-1]):
            step, batches = steps[name], made[name][0]
            step(batches[n % len(batches)], record=n >= args.warmup_steps)
    sync(device)

    print(f"\n{'':34} {'batches':>7} {'real tokens':>12} {'padding src/tgt':>16} "
          f"{'make ms':>8} {'s/step':>7} {'epoch s':>8}")
    epochs = {}
    for name in kinds:
        batches, seconds = made[name]
        real = sum(real_tokens(b) for b in batches)
        padded = [sum(b[k].numel() for b in batches) for k in ("encoder_input", "label")]
        share = [1 - sum(int((b[k] != PAD).sum()) for b in batches) / p
                 for k, p in zip(("encoder_input", "label"), padded)]
        step = steps[name]
        per_padded = sum(step.times) / sum(step.padded)
        epochs[name] = sum(seconds) + sum(padded) * per_padded
        print(f"{name:34} {len(batches):7d} {real:12,d} {100 * share[0]:7.1f}% /"
              f"{100 * share[1]:5.1f}% {1000 * statistics.mean(seconds):8.1f} "
              f"{statistics.mean(step.times):7.2f} {epochs[name]:8.0f}")
    plain, pooled, alone = (epochs[name] for name in kinds)
    print(f"\nepoch with --bpe_dropout {config.bpe_dropout} / without: {pooled / plain:.2f}x "
          f"(each batch segmented alone: {alone / plain:.2f}x)")


if __name__ == "__main__":
    run_main("python -m dev.bench_bpe_dropout", main)
