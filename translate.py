"""Translate with a trained checkpoint; the model is rebuilt from the config stored in it.

    python translate.py "I am not a very good student."      # greedy, newest checkpoint
    python translate.py --beam 4 "I am not a very good student."
    python translate.py --example 42                           # validation example + reference
    python translate.py --input test.en --output test.hyp --reference test.de   # + sacreBLEU
    cat sentences.txt | python translate.py                    # one output line per input line
"""

import argparse
import json
import sys
import unicodedata
from functools import partial
from pathlib import Path

import torch

from checkpoint import (CheckpointError, build_model, check_vocab, load_averaged,
                        load_model_weights, merge_config, resolve_preload, tokenizer_path)
from config import (ArgumentParser, Config, UserError, add_config_arguments, config_from_args,
                    fields_where, run_main)
from dataset import (EOS, PAD, SOS, SPECIAL_TOKENS, UNK, decode_lines, detokenize, load_corpus,
                     load_tokenizer, tokenizer_keys, tokenizer_recipe)
from dataset import read_lines as dataset_read_lines
from model import causal_mask, translate_ids
from runtime import setup_device

# Config fields translate.py takes from the command line; the rest describe training.
TRANSLATE_FIELDS = fields_where(translate=True)


class InputError(UserError):
    """A bad sentence, input or output file."""


def with_tokenizers(config: Config):
    """(config, tokenizer_src, tokenizer_tgt): a translate-time config, checked, with the
    tokenizer files it names (in its model folder)."""
    problem = config.validate()
    if problem:
        raise CheckpointError(problem)
    tokenizer_src, tokenizer_tgt = (
        load_tokenizer(tokenizer_path(config, key), config.tokenizer_type,
                       tokenizer_recipe(config, key)) for key in tokenizer_keys(config))
    return config, tokenizer_src, tokenizer_tgt


def load_translator(config: Config, given=frozenset(), checkpoint=None, average: int = 1):
    """(model, config, tokenizer_src, tokenizer_tgt): the checkpoint file `checkpoint`, or the
    one --preload names in --model_folder (the newest by default), rebuilt from its own config.
    `config` holds the command line's values; `given` names the flags the user set."""
    if checkpoint:
        path = Path(checkpoint)
        if "model_folder" not in given:  # the tokenizers live beside the checkpoint
            config.model_folder = str(path.parent)
    else:
        path = resolve_preload(config)
        if path is None:
            raise CheckpointError(f"no checkpoint in {config.model_folder}/ (train one with "
                                  f"python train.py, or pass --checkpoint PATH)")
    state, paths = load_averaged(config, path, average)
    if len(paths) > 1:
        loaded = f"the average of {', '.join(str(p) for p in paths)}"
        print(f"averaged {len(paths)} checkpoints: {', '.join(p.name for p in paths)}",
              file=sys.stderr)
    else:
        loaded = f"{path} (epoch {state['epoch']}, step {state['global_step']})"
        print(f"loaded {loaded}", file=sys.stderr)
    config, tokenizer_src, tokenizer_tgt = with_tokenizers(
        merge_config(Config.from_dict(state["config"]), config, given, path, TRANSLATE_FIELDS))
    check_vocab(state, path, tokenizer_src.get_vocab_size(), tokenizer_tgt.get_vocab_size())
    device = setup_device(config.device)
    model = build_model(config, tokenizer_src.get_vocab_size(), tokenizer_tgt.get_vocab_size())
    load_model_weights(model, state, path)
    model.loaded_from = loaded  # said by export.py
    return model.to(device).eval(), config, tokenizer_src, tokenizer_tgt


# ---- the CTranslate2 engine (export.py) ----------------------------------------------------------

class Engine:
    """A model exported by export.py, on CTranslate2: `translate_ids` decodes as model.py's
    translate_ids does (the same length rules, the same tokens never generated)."""

    def __init__(self, folder: Path, tokenizer_src, tokenizer_tgt, device: str = "auto",
                 threads: int = 0):
        from export import import_ctranslate2
        ctranslate2 = import_ctranslate2()
        kind, _, index = device.partition(":")
        if kind not in ("auto", "cpu", "cuda"):
            raise InputError(f"--device {device}: CTranslate2 runs on cpu or cuda")
        try:
            self.translator = ctranslate2.Translator(
                str(folder), device=kind, device_index=int(index or 0),
                intra_threads=threads, inter_threads=1)
        except (RuntimeError, ValueError) as e:
            raise InputError(f"--ctranslate2 {folder}: cannot load it "
                             f"({str(e).splitlines()[0]})") from None
        self.tokens = [tokenizer_src.id_to_token(i) for i in range(tokenizer_src.get_vocab_size())]
        self.ids = tokenizer_tgt.get_vocab()  # token -> id

    def translate_ids(self, src_ids, sos_id, eos_id, pad_id, seq_len, beam=1, alpha=0.6,
                      batch_size=64, nbest=1, max_len_a=1.2, max_len_b=10, min_len=1,
                      unk_id=None, progress=None):
        """As model.translate_ids. The engine takes one maximum length a call. Greedy: one call
        per batch of similar lengths (as model.translate_ids makes them) under the batch's
        longest limit, each output then cut to its own limit (greedy outputs are prefixes of
        longer ones: the same tokens; one call for all sentences would decode every one that
        never ends to the longest limit of all). Beam search is not prefix-consistent:
        sentences go in groups of equal limits."""
        from model import output_limits
        sources = [[self.tokens[i] for i in ids[:seq_len - 2]] for ids in src_ids]
        limits = output_limits(torch.tensor([len(s) for s in sources]), max_len_a, max_len_b,
                               seq_len).tolist()
        banned = [[SPECIAL_TOKENS[i]] for i in (pad_id, sos_id)]
        results = [None] * len(sources)
        greedy = beam == 1 and nbest == 1
        if greedy:
            order = sorted(range(len(limits)), key=lambda n: limits[n])  # by source length
            groups = [order[i:i + batch_size] for i in range(0, len(order), batch_size)]
            groups = [(max(limits[n] for n in group), group) for group in groups]
        else:
            groups = [(limit, [n for n, x in enumerate(limits) if x == limit])
                      for limit in sorted(set(limits))]
        for limit, group in groups:
            out = self.translator.translate_batch(
                [sources[n] for n in group], beam_size=beam, length_penalty=alpha,
                num_hypotheses=nbest, max_batch_size=batch_size, max_input_length=0,
                max_decoding_length=limit, min_decoding_length=min_len,
                disable_unk=unk_id is not None, suppress_sequences=banned,
                return_scores=nbest > 1)
            for n, r in zip(group, out):
                hyps = [[self.ids[t] for t in h[:limits[n]]] for h in r.hypotheses]
                results[n] = list(zip(hyps, r.scores)) if nbest > 1 else hyps[0]
            if progress is not None:
                progress(len(group))
        return results


def load_engine(folder, config: Config, given=frozenset(), threads: int = 0):
    """(engine, config, tokenizer_src, tokenizer_tgt) of a folder written by export.py: the
    training config from its export.json, with the translate-time flags given on top."""
    from export import EXPORT_NOTE
    folder = Path(folder)
    try:
        note = json.loads((folder / EXPORT_NOTE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        raise InputError(f"--ctranslate2 {folder}: no {EXPORT_NOTE} there; export a "
                         f"checkpoint with export.py --output {folder}") from None
    config = merge_config(Config.from_dict(note["config"]), config, given,
                          folder / EXPORT_NOTE, TRANSLATE_FIELDS)
    config.model_folder = str(folder)
    config, tokenizer_src, tokenizer_tgt = with_tokenizers(config)
    engine = Engine(folder, tokenizer_src, tokenizer_tgt, config.device, threads)
    print(f"loaded the CTranslate2 model {folder} ({note['quantization']}, from "
          f"{note.get('source')})", file=sys.stderr)
    return engine, config, tokenizer_src, tokenizer_tgt


# ---- scores -------------------------------------------------------------------------------------

def edit_distance(a, b) -> int:
    """Levenshtein distance between two sequences (characters or words)."""
    if len(a) < len(b):
        a, b = b, a
    previous = list(range(len(b) + 1))
    for i, x in enumerate(a, 1):
        current = [i]
        for j, y in enumerate(b, 1):
            current.append(min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (x != y)))
        previous = current
    return previous[-1]


def error_rate(predictions, references, words: bool) -> float:
    """Corpus WER (words=True) or CER: total edits / total reference length."""
    edits = total = 0
    for p, r in zip(predictions, references):
        p, r = (p.split(), r.split()) if words else (p, r)
        edits += edit_distance(p, r)
        total += len(r)
    return edits / max(total, 1)


def score(hypotheses, references, error_rates: bool = True) -> dict:
    """Corpus sacreBLEU BLEU and chrF (and CER/WER) of translations against one reference each:
    {"bleu", "chrf", "bleu_lc", "cer", "wer"} as numbers (bleu_lc: lowercased), and "report":
    sacreBLEU's lines, each with its signature (what a paper should quote)."""
    import sacrebleu
    bleu, chrf = sacrebleu.metrics.BLEU(), sacrebleu.metrics.CHRF()
    lower = sacrebleu.metrics.BLEU(lowercase=True)  # what tokenized, lowercased papers compare
    b, c = bleu.corpus_score(hypotheses, [references]), chrf.corpus_score(hypotheses, [references])
    lc = lower.corpus_score(hypotheses, [references])
    scores = {"bleu": b.score, "chrf": c.score, "bleu_lc": lc.score,
              "report": f"{b}  ({bleu.get_signature()})\n{c}  ({chrf.get_signature()})\n"
                        f"{lc}  ({lower.get_signature()})"}
    if error_rates:
        scores["cer"] = error_rate(hypotheses, references, words=False)
        scores["wer"] = error_rate(hypotheses, references, words=True)
    return scores


@torch.no_grad()
def cross_attention(model, tokenizer_src, tokenizer_tgt, sentence: str, translation: str):
    """Teacher-forces `translation` and returns the decoder's cross-attention weights,
    (layers, heads, target tokens, source tokens), with the token strings of both axes."""
    device = next(model.parameters()).device
    src_ids = tokenizer_src.encode(sentence).ids[:model.seq_len - 2]
    tgt_ids = tokenizer_tgt.encode(translation).ids[:model.seq_len - 1]
    src = torch.tensor([[SOS] + src_ids + [EOS]], device=device)  # (1, src_len)
    tgt = torch.tensor([[SOS] + tgt_ids], device=device)  # (1, tgt_len)
    blocks = [layer.cross_attention_block for layer in model.decoder.layers]
    for block in blocks:
        block.need_weights = True
    try:
        src_mask = torch.ones(1, 1, 1, src.size(1), dtype=torch.bool, device=device)
        model.decode(model.encode(src, src_mask), src_mask, tgt,
                     causal_mask(tgt.size(1), device))
        weights = torch.stack([b.attention_scores[0] for b in blocks])  # (N, h, tgt, src)
    finally:
        for block in blocks:
            block.need_weights, block.attention_scores = False, None
    label = (lambda tok, i: tok.decode([i]) or tok.id_to_token(i))
    src_tokens = ["[SOS]"] + [label(tokenizer_src, i) for i in src_ids] + ["[EOS]"]
    tgt_tokens = [label(tokenizer_tgt, i) for i in tgt_ids] + ["[EOS]"]
    return weights.float().cpu(), src_tokens, tgt_tokens


def save_attention_map(model, tokenizer_src, tokenizer_tgt, sentence, translation, path):
    """A PNG: one heatmap per decoder layer (averaged over heads), target rows x source
    columns, so you can see which source words each output word looked at."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise InputError("--attention needs matplotlib (pip install matplotlib)") from None
    weights, src_tokens, tgt_tokens = cross_attention(model, tokenizer_src, tokenizer_tgt,
                                                      sentence, translation)
    layers = weights.size(0)
    width = max(4.0, 0.35 * len(src_tokens) + 1.5)
    height = max(3.0, 0.3 * len(tgt_tokens) + 1.2)
    fig, axes = plt.subplots(1, layers, figsize=(width * layers, height), squeeze=False)
    for n, ax in enumerate(axes[0]):
        ax.imshow(weights[n].mean(0).numpy(), cmap="viridis", vmin=0.0, aspect="auto")
        ax.set_xticks(range(len(src_tokens)), src_tokens, rotation=90, fontsize=8)
        ax.set_yticks(range(len(tgt_tokens)), tgt_tokens, fontsize=8)
        ax.set_title(f"decoder layer {n + 1}", fontsize=9)
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=120)
    except OSError as e:
        raise InputError(f"cannot write {path}: {e.strerror}") from None
    finally:
        plt.close(fig)


def read_lines(path_or_stdin):
    """Lines of a UTF-8 file ('-' or None: stdin); invalid UTF-8 names its line."""
    if path_or_stdin in (None, "-"):
        return decode_lines(sys.stdin.buffer.read(), "stdin")
    return dataset_read_lines(path_or_stdin)


def clean(sentence: str) -> str:
    """The sentence as training text is: control characters (tab, line breaks, bell...) become
    spaces and the ends are stripped. Format characters (zero-width joiner and non-joiner, soft
    hyphen) and other spaces (no-break, thin) are text and stay."""
    return "".join(" " if unicodedata.category(c) == "Cc" else c for c in sentence).strip()


def decoding_limits(config: Config) -> dict:
    """The output-length rules of a config, as translate_ids takes them."""
    return {"max_len_a": config.max_len_a, "max_len_b": config.max_len_b,
            "min_len": config.min_len}


def translate(model, config, tokenizer_src, tokenizer_tgt, sentences, beam=1, alpha=0.6,
              nbest=1, batch_size=None, progress=None):
    """Translations of `sentences` (an empty sentence gives an empty translation); with
    nbest > 1 a list of (translation, score) per sentence. `progress`: see translate_ids."""
    sentences = [clean(s) for s in sentences]
    ids = [e.ids for e in tokenizer_src.encode_batch(sentences)]
    for n, i in enumerate(ids, 1):
        if len(i) + 2 > config.seq_len:
            print(f"warning: sentence {n} has {len(i)} tokens; only the first "
                  f"{config.seq_len - 2} (seq_len {config.seq_len}) are translated",
                  file=sys.stderr)
    todo = [n for n, s in enumerate(sentences) if s]
    decode = model.translate_ids if isinstance(model, Engine) else partial(translate_ids, model)
    outputs = decode([ids[n] for n in todo], SOS, EOS, PAD, config.seq_len, beam=beam,
                     alpha=alpha, nbest=nbest, batch_size=batch_size or 64, unk_id=UNK,
                     **decoding_limits(config), progress=progress)
    results = [[("", 0.0)] if nbest > 1 else "" for _ in sentences]
    for n, out in zip(todo, outputs):
        if nbest > 1:
            results[n] = [(detokenize(tokenizer_tgt, h), s) for h, s in out]
        else:
            results[n] = detokenize(tokenizer_tgt, out)
    return results


def validation_example(config: Config, index: int):
    """(source, reference) of example `index` of the validation split used in training."""
    val = load_corpus(config)["validation"]
    if not 0 <= index < len(val):
        raise InputError(f"validation example {index} does not exist (0 to {len(val) - 1})")
    return val[index]["src"], val[index]["tgt"]


def add_locating_arguments(parser):
    """The flags that find a trained model (--model_folder, --preload, --checkpoint,
    --average) and the translate-time settings (decoding limits, device, batch size), with
    the architecture flags (checked against the checkpoint) hidden from --help."""
    parser.add_argument("--checkpoint", help="checkpoint file (default: --preload in "
                        "--model_folder, i.e. the newest)")
    parser.add_argument("--average", type=int, default=1, help="average the weights of the "
                        "newest N per-epoch checkpoints")
    model_fields = fields_where(group="model")
    from_checkpoint = {name: f"{Config.__dataclass_fields__[name].metadata['help']} (default: "
                       f"the checkpoint's{'' if name in TRANSLATE_FIELDS else '; must match'})"
                       for name in (TRANSLATE_FIELDS | model_fields) - fields_where(group="run")
                       - {"batch_size"}}
    add_config_arguments(parser, visible=TRANSLATE_FIELDS | model_fields, helps={
        **from_checkpoint,
        "batch_size": "sentences translated at once (default: 64)",
        "seq_len": "longest source and output in tokens (default: the checkpoint's)",
        "preload": "checkpoint in --model_folder: latest, best or an epoch (default: latest)"})


def checkpoint_config(parser, args):
    """(config of the flags given, names of the flags given); training-only flags refused."""
    config, given = config_from_args(args)
    for name in sorted(given - TRANSLATE_FIELDS - fields_where(group="model")):
        parser.error(f"--{name} is a training setting; translate.py takes its model from the "
                     f"checkpoint")
    if args.average < 1 or (args.batch_size is not None and args.batch_size < 1):
        parser.error("--average and --batch_size must be positive")
    return config, given


def parse_args(argv):
    """The command line: (args, config of the flags given, names of the flags given)."""
    parser = ArgumentParser(
        description="Translate sentences with a trained checkpoint.",
        formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("sentence", nargs="?", help="a sentence (none: --input or stdin)")
    parser.add_argument("--example", type=int, metavar="N", help="translate example N of the "
                        "validation split the model was trained with, beside its reference")
    parser.add_argument("--input", help="file of sentences, one a line ('-': stdin)")
    parser.add_argument("--output", help="write translations here instead of stdout")
    parser.add_argument("--reference", help="reference translations of --input: print corpus "
                        "sacreBLEU and chrF")
    parser.add_argument("--beam", type=int, default=1, help="beam size (1: greedy)")
    parser.add_argument("--alpha", type=float, default=0.6, help="beam length penalty")
    parser.add_argument("--nbest", type=int, default=1, help="print this many hypotheses each "
                        "(score, then translation, tab-separated)")
    parser.add_argument("--attention", metavar="PNG", help="write the cross-attention map of "
                        "the (single) sentence to this PNG file")
    parser.add_argument("--ctranslate2", metavar="DIR", help="translate with a model exported "
                        "by export.py, on the CTranslate2 engine")
    parser.add_argument("--threads", type=int, default=0, help="CPU threads of the decoder "
                        "(this repo's or the engine's; 0: the library's default)")
    add_locating_arguments(parser)
    args = parser.parse_args(argv)
    config, given = checkpoint_config(parser, args)
    if args.beam < 1 or args.nbest < 1 or args.nbest > args.beam and args.beam > 1 or \
            args.threads < 0:
        parser.error("--beam and --nbest must be positive, with --nbest at most --beam; "
                     "--threads must not be negative")
    if sum(x is not None for x in (args.sentence, args.input, args.example)) > 1:
        parser.error("give one of a sentence, --input and --example")
    if args.reference and (args.sentence is not None or args.example is not None):
        parser.error("--reference goes with --input or stdin")
    if args.ctranslate2:
        located = given & ({"checkpoint", "preload", "model_folder", "model_basename"}
                           | fields_where(group="model")) | \
            ({"checkpoint"} if args.checkpoint else set()) | \
            ({"average"} if args.average > 1 else set()) | \
            ({"attention"} if args.attention else set())
        if located:
            parser.error(f"--ctranslate2 takes the exported model as it is: not with "
                         f"--{sorted(located)[0]} (export another model with export.py)")
    return args, config, given


def read_sources(args, config: Config):
    """(sentences, reference of the one sentence or None, references of --input or None):
    the sentence argument, a validation example (--example) with its reference, or the lines
    of --input / stdin (with --reference, its lines, checked to match before any decoding)."""
    if args.example is not None:
        sentence, reference = validation_example(config, args.example)
        return [sentence], reference, None
    if args.sentence is not None:
        if not clean(args.sentence):
            raise InputError("the sentence is empty")
        return [args.sentence], None, None
    sentences = read_lines(args.input)
    refs = read_lines(args.reference) if args.reference else None
    if refs is not None and len(refs) != len(sentences):
        raise InputError(f"{args.reference} has {len(refs)} lines but the input has "
                         f"{len(sentences)}")
    return sentences, None, refs


def write_outputs(args, sentences, outputs, reference):
    """Translations to --output or stdout (n-best: index, score, text a line); a validation
    example is printed with its source and reference."""
    if reference is not None:
        print(f"{'SOURCE:':>12} {sentences[0]}\n{'TARGET:':>12} {reference}\n"
              f"{'PREDICTED:':>12} {outputs[0]}")
        return
    if args.nbest > 1:
        lines = [f"{n}\t{s:.4f}\t{text}" for n, hyps in enumerate(outputs) for text, s in hyps]
    else:
        lines = outputs
    text = "".join(line + "\n" for line in lines)
    if not args.output:
        sys.stdout.write(text)
        return
    try:
        Path(args.output).write_text(text, encoding="utf-8")
    except OSError as e:
        raise InputError(f"cannot write {args.output}: {e.strerror}") from None


def main(argv=None):
    args, config, given = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.ctranslate2:
        model, config, tokenizer_src, tokenizer_tgt = load_engine(args.ctranslate2, config,
                                                                  given, args.threads)
    else:
        model, config, tokenizer_src, tokenizer_tgt = load_translator(
            config, given, args.checkpoint, args.average)
    sentences, reference, refs = read_sources(args, config)
    outputs = translate(model, config, tokenizer_src, tokenizer_tgt, sentences,
                        max(args.beam, args.nbest), args.alpha, args.nbest, args.batch_size)
    write_outputs(args, sentences, outputs, reference)
    best = outputs if args.nbest == 1 else [hyps[0][0] for hyps in outputs]
    if args.attention:
        save_attention_map(model, tokenizer_src, tokenizer_tgt, clean(sentences[0]), best[0],
                           args.attention)
        print(f"wrote the cross-attention map to {args.attention}", file=sys.stderr)
    if refs is not None:
        print(score(best, refs, error_rates=False)["report"], file=sys.stderr)


if __name__ == "__main__":
    run_main("translate.py", main)
