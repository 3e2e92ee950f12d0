"""What the TensorBoard attention picture costs a validation: nmt.evaluation.log_attention (one
teacher-forced forward pass of one sentence, translate.py --attention's figure drawn and
rendered to pixels, and TensorBoard's PNG of it written) on a model of a preset's shape,
untrained (the cost does not depend on the weights), for a sentence of --src_tokens source and
--tgt_tokens generated tokens (the first Multi30k validation sentence: 14 and 15).

    OMP_NUM_THREADS=1 python -m dev.bench_attention --preset multi30k_modern --threads 1

Prints the median of --calls calls (the first, which loads matplotlib's fonts, apart).
"""

import statistics
import tempfile
import time
import types

import torch
from torch.utils.tensorboard import SummaryWriter

from config import add_config_arguments, config_from_args
from nmt.cli import ArgumentParser, run_main
from nmt.evaluation import log_attention
from nmt.runtime import use_threads
from nmt.trained_model import build_model
from tokenizer import build_tokenizer

WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]


def main(argv=None):
    parser = ArgumentParser(prog="python -m dev.bench_attention",
                            description=__doc__.split("\n\n")[0])
    parser.add_argument("--src_tokens", type=int, default=14)
    parser.add_argument("--tgt_tokens", type=int, default=15)
    parser.add_argument("--calls", type=int, default=5)
    add_config_arguments(parser)
    args = parser.parse_args(argv)
    config, _ = config_from_args(args)
    use_threads(config.threads)
    tokenizer = build_tokenizer("bpe", 300, [" ".join(WORDS)] * 10)
    torch.manual_seed(0)
    model = build_model(config, tokenizer.get_vocab_size(), tokenizer.get_vocab_size()).eval()
    words = tokenizer.encode(" ".join(WORDS * 10)).ids
    src, tgt = words[:args.src_tokens], words[:args.tgt_tokens]
    with tempfile.TemporaryDirectory() as folder:
        writer = SummaryWriter(folder)
        run = types.SimpleNamespace(model=model, writer=writer, data=types.SimpleNamespace(
            tokenizer_src=tokenizer, tokenizer_tgt=tokenizer))
        seconds = []
        for step in range(args.calls + 1):
            started = time.perf_counter()
            log_attention(run, src, tgt, step)
            writer.flush()
            seconds.append(time.perf_counter() - started)
        writer.close()
    print(f"the attention picture a validation ({config.decoder_layers()} decoder layers, "
          f"d_model {config.d_model}, {len(src)} source and {len(tgt)} generated tokens, "
          f"{torch.get_num_threads()} thread(s)): median {statistics.median(seconds[1:]):.3f} s "
          f"of {args.calls} calls (first call {seconds[0]:.3f} s)")


if __name__ == "__main__":
    run_main("python -m dev.bench_attention", main)
