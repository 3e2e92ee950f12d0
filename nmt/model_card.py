"""The model card a finished training run leaves in its --model_folder (MODEL_CARD.md, with
its validation curve as validation_curve.png beside it): what the model is, what made it, on
what data, how long, how good (sacreBLEU with signatures), a few translations, and how to use
it, so that a model handed to someone else says what it is."""

import platform
from pathlib import Path

import torch

from config import Config
from nmt.checkpoint import CARD_NAME, CURVE_NAME
from nmt.files import write_text_atomic
from nmt.plotting import pyplot
from nmt.resume import best_validation


def design(config: Config) -> str:
    """The architecture in words."""
    parts = ["pre-norm" if config.norm_first else "post-norm (the paper's)",
             "RMSNorm" if config.norm == "rms" else "LayerNorm",
             "SwiGLU" if config.ffn == "swiglu" else "ReLU feed-forward",
             "rotary positions" if config.pos == "rope" else "sinusoidal positions"]
    if config.n_kv_heads and config.n_kv_heads != config.h:
        parts.append(f"{config.h} query heads sharing {config.n_kv_heads} key/value heads")
    return ", ".join(parts)


def plot_curve(history: list, path: Path) -> bool:
    """Validation BLEU (and loss) against optimizer steps, as a PNG; False without
    matplotlib or without validations."""
    plt = pyplot()
    if plt is None or not history:
        return False
    steps = [h["step"] for h in history]
    fig, bleu_axis = plt.subplots(figsize=(6, 3.5))
    bleu_axis.plot(steps, [h["bleu"] for h in history], "o-", color="tab:blue")
    bleu_axis.set_xlabel("optimizer step")
    bleu_axis.set_ylabel("validation BLEU (greedy)", color="tab:blue")
    loss_axis = bleu_axis.twinx()
    loss_axis.plot(steps, [h["loss"] for h in history], "s--", color="tab:orange")
    loss_axis.set_ylabel("validation loss", color="tab:orange")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def scores_section(results: dict, test_sets=()) -> list:
    if not results and test_sets:  # (no best checkpoint: its validations were cut short)
        return [f"The test sets ({', '.join(test_sets)}) were not scored: the run has no best "
                f"checkpoint. Score one with", "`python translate.py --preload latest --input "
                "SRC --reference REF`.", ""]
    if not results:
        return ["The corpus has no test split: no test score. Score a test set with",
                "`python translate.py --preload best --input SRC --reference REF`.", ""]
    lines = ["The best checkpoint by validation BLEU, on each test set of the corpus (± the "
             "half-width of the 95% confidence interval, by bootstrap resampling):", "",
             "| test set | sentences | decoding | BLEU | chrF | BLEU lowercased |",
             "|---|---|---|---|---|---|"]
    for test_name, scored in results["tests"].items():
        for name, s in scored["scores"].items():
            cells = [f"{s[m]:.2f}" + (f" ± {s[m + '_ci']:.2f}" if m + "_ci" in s else "")
                     for m in ("bleu", "chrf", "bleu_lc")]  # (results of earlier versions: none)
            lines.append(f"| {test_name} | {scored['sentences']} | {name} | "
                         f"{' | '.join(cells)} |")
    first = next(iter(results["tests"].values()))["scores"]
    signatures = first[next(iter(first))]["report"].splitlines()
    lines += ["", "sacreBLEU signatures:", "", "```"]
    lines += [f"{line.split(' =')[0]}: {line[line.rindex('(') + 1:-1]}"
              for line in signatures] + ["```", ""]
    return lines


def training_section(card: dict) -> list:
    config, history = card["config"], card["history"]
    best = best_validation(history) if history else None
    lines = [f"- {card['steps']} optimizer steps in {card['epochs']:g} epoch(s), "  # card_step
             f"{card['seconds'] / 60:.1f} minutes of training (validations included)",
             f"- device: {card['device']}, precision {card['precision']}; torch "
             f"{torch.__version__}, Python {platform.python_version()}",
             f"- Adam (0.9, 0.98, 1e-9), {config.lr_schedule} schedule, peak learning rate "
             f"{config.peak_lr():.2g}, label smoothing {config.label_smoothing}, batches of "
             + (f"{config.max_tokens} padded tokens" if config.max_tokens else
                f"{config.batch_size} sentences")]
    if config.time_budget and config.max_steps and card["steps"] >= config.max_steps:
        lines.append(f"- --time_budget {config.time_budget:g} minutes, cut at --max_steps "
                     f"{config.max_steps}: {card['steps']} optimizer steps")
    elif config.time_budget and config.patience and card.get("schedule", 0) > card["steps"]:
        lines.append(f"- --time_budget {config.time_budget:g} minutes, ended by --patience "
                     f"{config.patience}: {card['steps']} optimizer steps of the "
                     f"{card['schedule']} its schedule was laid out for")
    elif config.time_budget:
        lines.append(f"- --time_budget {config.time_budget:g} minutes bought {card['steps']} "
                     f"optimizer steps (the schedule laid out for them by the speed the run "
                     f"measured); {(card['seconds'] + card.get('setup', 0)) / 60:.1f} minutes "
                     f"spent in all, set-up and test scoring included")
    if best:
        lines.append(f"- best validation: BLEU {best['bleu']:.2f}, loss {best['loss']:.3f} at "
                     f"step {best['step']} (epoch {best['epoch']})")
    return lines + [""]


def distilled_text(config: Config, distilled: dict) -> str:
    """The Data section's sentence on sequence-level knowledge distillation, or nothing."""
    if not distilled:
        return ""

    def weights(t):  # the teacher as named, and the checkpoint(s) it translated with
        files = t.get("averaged") or [Path(t["checkpoint"]).name]
        what = files[0] if len(files) == 1 else f"the average of {', '.join(files)}"
        return f"`{t['teacher']}`" + ("" if Path(t["teacher"]).name == what else f" ({what})")
    teachers = ", ".join(weights(t) for t in distilled["teachers"])
    return (f" Sequence-level knowledge distillation: the training targets are the "
            f"translations of {distilled['sentences']:,} training sources by "
            f"{'the ensemble of ' if len(distilled['teachers']) > 1 else ''}{teachers} (beam "
            f"{distilled['beam']}), " + ("in place of the references." if config.distill_data ==
                                         "distilled" else "beside the corpus's own references."))


def card_text(card: dict) -> str:
    """The Markdown of the card. `card`: config, commands, corpus, sizes, parameters, steps,
    epochs, seconds, device, precision, history, results (or None), samples, curve."""
    config, folder = card["config"], card["folder"]
    vocab = (f"one joint BPE vocabulary of {card['vocab'][0]:,}" if config.shared_vocab else
             f"{config.tokenizer_type} vocabularies of {card['vocab'][0]:,} "
             f"({config.lang_src}) and {card['vocab'][1]:,} ({config.lang_tgt})")
    lines = [f"# {folder}: a Transformer for {config.lang_src}→{config.lang_tgt} translation",
             "", f"Trained with this repository's `train.py`. {card['parameters'] / 1e6:.1f}M "
             f"parameters: {config.d_model}/{config.depth()} layers/{config.h} heads/"
             f"feed-forward {config.d_ff}, {design(config)}; {vocab}; embeddings tied: "
             f"{config.tie_embeddings}; dropout {config.dropout} (attention "
             f"{config.attention_dropout}, activation {config.activation_dropout}).", "",
             "## Made by", "", "```"] + card["commands"] + ["```", "", "## Data", "",
             f"{card['corpus']}: {card['sizes']}. Pairs longer than {config.seq_len} tokens"
             + (f", or with a side over {config.max_len_ratio:g} times the other's tokens,"
                if config.max_len_ratio else "") + " were left out of training."
             + distilled_text(config, card.get("distilled")), "",
             "## Training", ""]
    lines += training_section(card)
    if card["curve"]:
        lines += [f"![validation BLEU and loss]({CURVE_NAME})", ""]
    lines += ["## Scores", ""] + scores_section(card["results"], card.get("test_sets", ()))
    if card["samples"]:
        lines += ["## Sample translations (the first test set, greedy)", ""]
        for source, reference, output in card["samples"]:
            lines += [f"- source: {source}", f"  - reference: {reference}",
                      f"  - this model: {output}"]
        lines.append("")
    lines += ["## Use", "", "```bash",
              f"python translate.py --model_folder {folder} --preload best \"A sentence.\"",
              f"python translate.py --model_folder {folder} --preload best --beam 4 "
              f"--input test.{config.lang_src}",
              f"python export.py --model_folder {folder} --preload best --output "
              f"exported/{Path(folder).name}   # CTranslate2", "```", ""]
    return "\n".join(lines)


def write_card(card: dict) -> Path:
    """Writes MODEL_CARD.md (atomically) and its curve into the model folder; returns the
    card's path."""
    folder = Path(card["folder"])
    card["curve"] = plot_curve(card["history"], folder / CURVE_NAME)
    path = folder / CARD_NAME
    write_text_atomic(path, card_text(card))
    return path


def write_run_card(run, progress, results: dict, samples: list) -> Path:
    """The card of a finished training run (train.py's Run and Progress), with its test results
    and a few test translations."""
    data, config = run.data, run.config
    sizes = (f"{len(data.train):,} training pairs, {len(data.validation):,} validation pairs"
             + "".join(f", {len(src):,} test pairs ({name})"
                       for name, (src, _) in (data.test or {}).items())
             + (" (validation held out of the training split)" if data.held_out else ""))
    n = torch.get_num_threads()
    threads = f", {n} thread{'s' * (n != 1)}" if run.device.type == "cpu" else ""
    made = progress.provenance()  # (one reading of the clock for both figures)
    return write_card({
        "folder": config.model_folder, "config": config, "commands": progress.commands,
        "corpus": data.corpus["source"], "sizes": sizes, "distilled": data.corpus.get("distilled"),
        "vocab": (data.tokenizer_src.get_vocab_size(), data.tokenizer_tgt.get_vocab_size()),
        "parameters": sum(p.numel() for p in run.model.parameters()),
        "steps": progress.step,  # epochs: a schedule ended mid-epoch counts its part (44.4)
        "schedule": run.steps(),  # the steps the schedule was laid out for
        "epochs": round(progress.epoch + progress.batch / run.batches_per_epoch, 1),
        "seconds": made["seconds"], "precision": run.precision,
        "setup": made.get("setup_seconds", 0.0),
        "device": f"{run.device}{threads} ({platform.processor() or platform.machine()})",
        "history": progress.history, "results": results, "samples": samples,
        "test_sets": list(data.test or {})})
