"""Where a validation's time goes: each part of train.py's validation (nmt/evaluation.py) timed
on a trained model and its corpus's validation split, with the references of the fast parts
timed in the same run: the loss and the nll with one projection each (two passes) against
`loss_and_nll`'s one, and CER and WER by the edit distance's table against the bit-vector
algorithm (nmt/metrics.py). A validation runs at every epoch's end (and every --eval_every
steps), so under --time_budget what it costs is training the budget does not buy.

    python -m dev.bench_validation --preset multi30k_modern --init_from weights/multi30k_modern \
        --data_dir data/multi30k --threads 2

Takes train.py's flags (the model: --init_from's folder or checkpoint; the data and the batches:
--data_dir or --dataset and the preset, as trained); sets a run up as train.py does, in a
throw-away folder. Prints each part's median over --calls calls (one call before them, untimed:
first-call costs such as matplotlib's fonts), the references beside their parts, and the whole
against its reference.
"""

import dataclasses
import statistics
import tempfile
import time
import types
from unittest import mock

import torch

import train
from config import add_config_arguments, config_from_args
from kernels import BlockwiseLabelSmoothedCrossEntropy
from nmt import metrics
from nmt.cli import ArgumentParser, run_main
from nmt.evaluation import (log_attention, validated_sentences, validation_loss,
                            validation_translations)
from tokenizer import detokenize


def two_passes(loss_fn, x, projection, label):
    """The reference of loss_and_nll: the loss, then the nll, each with its own projection."""
    nll_fn = BlockwiseLabelSmoothedCrossEntropy(0.0, loss_fn.ignore_index, loss_fn.block_rows)
    return loss_fn(x, projection, label), nll_fn(x, projection, label)


def error_rates(predictions, references):
    return [metrics.error_rate(predictions, references, words) for words in (False, True)]


def parts(run, progress, n: int):
    """One validation's parts as train.py runs them, each a (name, seconds, reference
    seconds or None) row; the loss and the error rates also with their references."""
    val, rows = run.data.validation, []

    def timed(call):
        started = time.perf_counter()
        out = call()
        return out, time.perf_counter() - started
    with torch.no_grad():
        run.model.eval()
        _, fast = timed(lambda: validation_loss(run))
        with mock.patch.object(run.loss_fn, "loss_and_nll",
                               types.MethodType(two_passes, run.loss_fn), create=True):
            _, slow = timed(lambda: validation_loss(run))
        rows.append(("loss and nll", fast, slow))
        outputs, seconds = timed(lambda: validation_translations(run, progress, n))
        rows.append(("greedy decoding", seconds, None))
        predictions = [detokenize(run.data.tokenizer_tgt, ids) for ids in outputs]
        references = val.tgt_texts[:n]
        _, seconds = timed(lambda: metrics.score(predictions, references, error_rates=False,
                                                 n_bootstrap=1))
        rows.append(("BLEU, chrF, lowercased BLEU", seconds, None))
        _, fast = timed(lambda: error_rates(predictions, references))
        with mock.patch.object(metrics, "edit_distance", metrics.table_edit_distance):
            _, slow = timed(lambda: error_rates(predictions, references))
        rows.append(("CER and WER", fast, slow))
        _, seconds = timed(lambda: log_attention(run, val.src_ids[0], outputs[0], progress.step))
        rows.append(("the attention picture", seconds, None))
    run.model.train()
    return rows


def main(argv=None):
    parser = ArgumentParser(prog="python -m dev.bench_validation",
                            description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=3)
    add_config_arguments(parser)
    args = parser.parse_args(argv)
    config, given = config_from_args(args)
    with tempfile.TemporaryDirectory() as tmp:
        config = dataclasses.replace(config, model_folder=tmp, experiment_name=f"{tmp}/runs",
                                     preload="none")
        run, progress = train.set_up(config, given | {"model_folder", "experiment_name"})
        try:
            n = validated_sentences(run)
            parts(run, progress, n)  # untimed: first calls
            calls = [parts(run, progress, n) for _ in range(args.calls)]
        finally:
            run.writer.close()
            run.lock.release()
    print(f"a validation of {n} sentences ({torch.get_num_threads()} thread(s)), the median of "
          f"{args.calls} calls, in seconds:")
    print(f"  {'part':<30}{'this repo':>10}{'reference':>11}  reference / this repo")
    median = {}
    for i, (name, _, _) in enumerate(calls[0]):
        this = statistics.median(call[i][1] for call in calls)
        ref = None if calls[0][i][2] is None else statistics.median(call[i][2] for call in calls)
        median[name] = this, ref
        print(f"  {name:<30}{this:>10.3f}" + (f"{ref:>11.3f}  {ref / this:.2f}x" if ref else ""))
    this = sum(t for t, _ in median.values())
    ref = sum(r if r is not None else t for t, r in median.values())
    print(f"  {'in all':<30}{this:>10.3f}{ref:>11.3f}  {ref / this:.2f}x")
    print("references: the loss and the nll with one projection each; CER and WER by the edit "
          "distance's table (nmt.metrics.table_edit_distance)")


if __name__ == "__main__":
    run_main("python -m dev.bench_validation", main)
