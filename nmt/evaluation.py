"""How a training run is scored: on the validation split, the teacher-forced loss (label-smoothed,
and the plain negative log-likelihood and perplexity, which compare across smoothings, as
fairseq reports them) and greedy decoding scored with sacreBLEU; at the end, every test set
translated with the best checkpoint, greedy and with beam search. train.py calls these with its
Run (config, model, data, device, writer) and Progress (the step, a stop signal)."""

import json
import math
import time
from contextlib import contextmanager
from pathlib import Path

import torch
from torch.utils.data import DataLoader
from tqdm import tqdm

from dataset import Collator
from nmt.batching import TokenBatchSampler
from nmt.attention_map import attention_of_ids, picture
from nmt.checkpoint import best_checkpoint_path, load_checkpoint
from nmt.decoding import decoding_limits, translate, translate_ids
from nmt.files import write_text_atomic
from nmt.metrics import score
from nmt.runtime import gather_to_all, sum_over_ranks
from nmt.stopping import StopRequested
from nmt.trained_model import build_model, load_model_weights
from tokenizer import EOS, PAD, SOS, UNK, detokenize


@contextmanager
def decoding_bar(run, progress, total: int, what: str):
    """A progress bar over the sentences decoded, yielding translate_ids's `progress`: it
    raises StopRequested at the next batch once a stop signal came."""
    bar = tqdm(total=total, desc=what, unit=" sentences", leave=False, dynamic_ncols=True,
               mininterval=1.0, disable=run.rank != 0)

    def advance(done: int):
        bar.update(done)
        if progress.signal:
            raise StopRequested()
    try:
        yield advance
    finally:
        bar.close()


@torch.no_grad()
def validation_loss(run) -> dict:
    """Per target token over the validation split, teacher-forced: the training loss (label-
    smoothed) as `loss`, the negative log-likelihood of the labels as `nll` (nats), and the
    perplexity exp(nll) as `ppl`. Under torchrun each rank takes its share of the batches and
    the sums are added up over the ranks (on every rank)."""
    config, val, device = run.config, run.data.validation, run.device
    batches = TokenBatchSampler(val.lengths(), config.max_tokens, config.batch_size or 32,
                                shuffle=False).batches()[run.rank::run.world_size]
    # the sums stay on the device and the batches go to it from pinned memory without waiting
    # (as in training): a GPU is not waited for at every batch, only once at the end
    sums = torch.zeros(3, device=device)  # loss, nll, target tokens
    for batch in DataLoader(val, batch_sampler=batches, collate_fn=Collator(),
                            pin_memory=device.type == "cuda"):
        src, mask, tgt, label = (batch[k].to(device, non_blocking=True) for k in (
            "encoder_input", "encoder_mask", "decoder_input", "label"))  # label (batch, tgt_len)
        with run.amp():
            x = run.model.decode(run.model.encode(src, mask), mask, tgt)  # (batch, tgt_len, d)
            loss, nll = run.loss_fn.loss_and_nll(x, run.model.projection_layer, label)
        sums += torch.stack([loss, nll, (label != PAD).sum().float()])
    loss_sum, nll_sum, tokens = sum_over_ranks(*sums.tolist())
    nll = nll_sum / max(tokens, 1)
    return {"loss": loss_sum / max(tokens, 1), "nll": nll, "ppl": math.exp(min(nll, 700))}


def shared_out(run, progress, n: int, what: str, decode):
    """The n outputs of `decode(share, advance)` (share: a slice of the n inputs; advance:
    decoding_bar's) with the work shared out over the ranks: each rank decodes every
    world_size-th input from its rank on, and every rank gets all n outputs, in order. A stop
    signal on any rank stops its share at the next batch; every rank then raises
    StopRequested, once every rank has reported."""
    rank, world = run.rank, run.world_size
    try:
        with decoding_bar(run, progress, len(range(rank, n, world)), what) as advance:
            mine = decode(slice(rank, n, world), advance)
    except StopRequested:
        mine = None
    shares = gather_to_all(mine)
    if any(share is None for share in shares):
        raise StopRequested()
    outputs = [None] * n
    for r, share in enumerate(shares):
        outputs[r:n:world] = share
    return outputs


def validation_translations(run, progress, n: int):
    """Greedy translations (token ids) of the first n validation sentences, shared out over the
    ranks (shared_out): all n on every rank."""
    config, val = run.config, run.data.validation
    return shared_out(run, progress, n, "validating", lambda share, advance: translate_ids(
        run.model, val.src_ids[share], SOS, EOS, PAD, config.seq_len, unk_id=UNK,
        **decoding_limits(config), progress=advance,
        batch_size=max(config.max_tokens // 40, config.batch_size, 1)))


def validated_sentences(run) -> int:
    """How many validation sentences are decoded: all, or the first --val_max_sentences."""
    val, most = run.data.validation, run.config.val_max_sentences
    return len(val) if most == 0 else min(most, len(val))


@torch.no_grad()
def run_validation(run, progress) -> dict:
    """Validation loss, then greedy decoding of the validation set (or its first
    val_max_sentences) scored with BLEU, chrF, CER and WER; prints a few examples. Under
    torchrun every rank computes its share and rank 0 scores the whole: the metrics on rank 0,
    with the decoding's seconds (`seconds_decoding`, a --time_budget's), None on the others."""
    config, val = run.config, run.data.validation
    run.model.eval()
    losses = validation_loss(run)
    n = validated_sentences(run)
    started = time.time()
    outputs = validation_translations(run, progress, n)
    decoded = time.time() - started  # (the decoding alone: not the scoring, not the picture)
    if run.rank:
        run.model.train()
        return None
    predictions = [detokenize(run.data.tokenizer_tgt, ids) for ids in outputs]
    metrics = {**losses, **score(predictions, val.tgt_texts[:n], n_bootstrap=1)}
    for name, value in metrics.items():
        if name != "report":
            run.writer.add_scalar(f"validation/{name}", value, progress.step)
    examples = [f"{'SOURCE:':>12} {val.src_texts[i]}\n{'TARGET:':>12} {val.tgt_texts[i]}\n"
                f"{'PREDICTED:':>12} {predictions[i]}" for i in range(min(config.val_examples, n))]
    if examples:
        tqdm.write("-" * 80 + "\n" + ("\n" + "-" * 80 + "\n").join(examples) + "\n" + "-" * 80)
        run.writer.add_text("validation/examples",
                            "\n\n".join("    " + e.replace("\n", "\n    ") for e in examples),
                            progress.step)
    if n and predictions[0].strip():  # (every validation: a picture of its first sentence)
        log_attention(run, val.src_ids[0], outputs[0], progress.step)
    tqdm.write(f"validation: loss {metrics['loss']:.3f} (nll {metrics['nll']:.3f}, ppl "
               f"{metrics['ppl']:.2f})  BLEU {metrics['bleu']:.2f}  chrF {metrics['chrf']:.2f}  "
               f"CER {metrics['cer']:.3f}  WER {metrics['wer']:.3f}  ({n} sentences decoded in "
               f"{decoded:.1f}s)")
    run.model.train()
    return {**metrics, "seconds_decoding": decoded}


def log_attention(run, src_ids, tgt_ids, step: int):
    """The cross-attention of the first validation sentence with the tokens its greedy
    translation generated, as a picture in TensorBoard (IMAGES, validation/cross_attention):
    translate.py --attention's picture (nmt.attention_map.draw), the decoder's layers side by
    side, each titled and the mean of its heads, a generated token a row and a source token a
    column, each labelled, bright where attended; scrubbing through the validations shows the
    alignment form. One teacher-forced forward pass of one sentence and one matplotlib figure:
    its cost a validation is in docs/training.md."""
    weights = attention_of_ids(run.model, run.data.tokenizer_src, run.data.tokenizer_tgt,
                               src_ids, tgt_ids)
    run.writer.add_image("validation/cross_attention", picture(weights, "cross", head="mean"),
                         step, dataformats="HWC")


@torch.no_grad()
def score_test_sets(run, progress):
    """Translates every test set of the corpus (each `test*` file, or each test split of a hub
    dataset) with the best checkpoint (loaded into a model of its own: the run's weights are
    left as they are), greedy and beam 4, and prints, logs and writes (results.json in the model
    folder, each set by name) sacreBLEU BLEU and chrF with their 95% confidence intervals.
    Under torchrun every rank translates its share (shared_out) and rank 0 scores the whole.
    Returns the results and a few (source, reference, greedy translation) samples of the first
    set (on rank 0); (None, []) without a test set, on other ranks, or when a stop signal
    interrupts."""
    config, data = run.config, run.data
    path = best_checkpoint_path(config)
    if not data.test or not path.exists():
        if data.test and run.rank == 0:  # (a validation cut short before any was recorded)
            tqdm.write(f"no best checkpoint {path}: the test sets are not scored (translate.py "
                       f"--model_folder {config.model_folder} --preload latest --input ... "
                       f"--reference ... scores one)")
        return None, []
    best = build_model(config, data.tokenizer_src.get_vocab_size(),
                       data.tokenizer_tgt.get_vocab_size())
    load_model_weights(best, load_checkpoint(path), path)
    best = best.to(run.device).eval()
    results, samples = {"checkpoint": str(path), "step": progress.step, "tests": {}}, []
    for test_name, (sources, references) in data.test.items():
        scored = {"sentences": len(sources), "scores": {}}
        for beam in (1, 4):
            name = "greedy" if beam == 1 else f"beam{beam}"
            try:
                hyps = shared_out(run, progress, len(sources), f"{test_name}, {name}",
                                  lambda share, advance, sources=sources, beam=beam: translate(
                                      best, config, data.tokenizer_src, data.tokenizer_tgt,
                                      sources[share], beam=beam, progress=advance,
                                      numbers=range(1, len(sources) + 1)[share]))
            except StopRequested:
                tqdm.write(f"test scoring stopped by {progress.signal or 'a signal'}: no "
                           f"results.json written; the same train.py command started again "
                           f"scores the test sets, training nothing")
                return None, []
            if run.rank:
                continue
            samples = samples or list(zip(sources[:3], references[:3], hyps[:3]))
            scored["scores"][name] = scores = score(hyps, references, error_rates=False)
            for metric in ("bleu", "chrf"):
                run.writer.add_scalar(f"test/{test_name}/{metric}_{name}", scores[metric],
                                      progress.step)
            tqdm.write(f"test {test_name} ({len(hyps)} sentences, best checkpoint, {name}):\n"
                       f"{scores['report']}")
        results["tests"][test_name] = scored
    if run.rank:
        return None, []
    out = Path(config.model_folder) / "results.json"  # (with the time spent at its end, which
    made = progress.provenance()  # a --time_budget raised counts)
    results.update(seconds=made["seconds"], setup_seconds=made["setup_seconds"])
    write_text_atomic(out, json.dumps(results, indent=1))
    tqdm.write(f"wrote {out}")
    return results, samples
