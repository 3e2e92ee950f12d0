"""Translate with a trained checkpoint; the model is rebuilt from the config stored in it.

    python translate.py "I am not a very good student."      # greedy, newest checkpoint
    python translate.py --beam 4 "I am not a very good student."
    python translate.py 42                                     # validation example 42 + reference
    python translate.py --input test.en --output test.hyp --reference test.de   # + sacreBLEU
    cat sentences.txt | python translate.py                    # one output line per input line
"""

import argparse
import sys
from pathlib import Path

import torch

from config import (MODEL_FIELDS, ArgumentParser, CheckpointError, Config, UserError,
                    add_config_arguments, build_model, check_vocab, config_from_args,
                    epoch_checkpoints, load_checkpoint, load_model_weights, resolve_preload,
                    tokenizer_path)
from dataset import decode_lines, load_tokenizer
from dataset import read_lines as dataset_read_lines
from model import causal_mask, translate_ids

# Config fields translate.py takes from the command line; the rest describe training.
TRANSLATE_FIELDS = {"model_folder", "model_basename", "preload", "tokenizer_file", "data_dir",
                    "datasource", "val_fraction", "seed", "seq_len", "device", "batch_size"}


class InputError(UserError):
    """A bad sentence, input or output file."""


def average_checkpoints(paths):
    """The element-wise mean of the model weights of several checkpoints (the paper averages
    the last 5). Returns the newest checkpoint's state with averaged weights."""
    states = [load_checkpoint(p) for p in paths]
    newest = states[-1]
    keys = newest["model_state_dict"].keys()
    for p, s in zip(paths, states):
        if s["model_state_dict"].keys() != keys or any(
                s["model_state_dict"][k].shape != newest["model_state_dict"][k].shape
                for k in keys):
            raise CheckpointError(f"cannot average {p} with {paths[-1]}: different architectures")
    averaged = {}
    for k in keys:
        tensors = [s["model_state_dict"][k] for s in states]
        if tensors[0].is_floating_point():
            averaged[k] = torch.stack([t.double() for t in tensors]).mean(0).to(tensors[0].dtype)
        else:
            averaged[k] = tensors[-1]
    return {**newest, "model_state_dict": averaged}


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
    if average > 1:
        paths = [p for p in epoch_checkpoints(config) if p.resolve() != path.resolve()]
        paths = [p for p in paths if p.stat().st_mtime <= path.stat().st_mtime]
        paths = (paths + [path])[-average:]
        if len(paths) < average:
            raise CheckpointError(f"--average {average}: only {len(paths)} per-epoch "
                                  f"checkpoint(s) up to {path.name} in {path.parent}")
        state = average_checkpoints(paths)
        print(f"averaged {len(paths)} checkpoints: {', '.join(p.name for p in paths)}",
              file=sys.stderr)
    else:
        state = load_checkpoint(path)
    saved = Config.from_dict(state["config"])
    for name in MODEL_FIELDS:
        if name in given and name not in TRANSLATE_FIELDS and \
                getattr(config, name) != getattr(saved, name):
            raise CheckpointError(f"--{name} {getattr(config, name)} does not match {path} "
                                  f"({getattr(saved, name)}); the architecture comes from the "
                                  f"checkpoint, drop the flag")
    for name in TRANSLATE_FIELDS:
        if name in given:
            setattr(saved, name, getattr(config, name))
        elif name in ("model_folder", "model_basename", "preload", "device"):
            setattr(saved, name, getattr(config, name))  # where to look, what to run on
    problem = saved.validate()
    if problem:
        raise CheckpointError(problem)
    config = saved
    tokenizer_src = load_tokenizer(tokenizer_path(config, config.lang_src), config.tokenizer_type)
    tokenizer_tgt = load_tokenizer(tokenizer_path(config, config.lang_tgt), config.tokenizer_type)
    check_vocab(state, path, tokenizer_src.get_vocab_size(), tokenizer_tgt.get_vocab_size())
    from train import get_device, tune_cpu_allocator
    device = get_device(config.device)
    if device.type == "cpu":
        tune_cpu_allocator()
    model = build_model(config, tokenizer_src.get_vocab_size(), tokenizer_tgt.get_vocab_size())
    load_model_weights(model, state, path)
    return model.to(device).eval(), config, tokenizer_src, tokenizer_tgt


@torch.no_grad()
def cross_attention(model, tokenizer_src, tokenizer_tgt, sentence: str, translation: str):
    """Teacher-forces `translation` and returns the decoder's cross-attention weights,
    (layers, heads, target tokens, source tokens), with the token strings of both axes."""
    device = next(model.parameters()).device
    sos, eos = tokenizer_tgt.token_to_id("[SOS]"), tokenizer_tgt.token_to_id("[EOS]")
    src_ids = tokenizer_src.encode(sentence).ids[:model.src_pos.pe.size(1) - 2]
    tgt_ids = tokenizer_tgt.encode(translation).ids[:model.tgt_pos.pe.size(1) - 1]
    src = torch.tensor([[sos] + src_ids + [eos]], device=device)  # (1, src_len)
    tgt = torch.tensor([[sos] + tgt_ids], device=device)  # (1, tgt_len)
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
    """Control characters (other than tab) become spaces; whitespace is collapsed."""
    return " ".join("".join(c if c.isprintable() or c == "\t" else " " for c in sentence).split())


def translate(model, config, tokenizer_src, tokenizer_tgt, sentences, beam=1, alpha=0.6,
              nbest=1, batch_size=None):
    """Translations of `sentences` (an empty sentence gives an empty translation); with
    nbest > 1 a list of (translation, score) per sentence."""
    sentences = [clean(s) for s in sentences]
    ids = [e.ids for e in tokenizer_src.encode_batch(sentences)]
    for n, i in enumerate(ids, 1):
        if len(i) + 2 > config.seq_len:
            print(f"warning: sentence {n} has {len(i)} tokens; only the first "
                  f"{config.seq_len - 2} (seq_len {config.seq_len}) are translated",
                  file=sys.stderr)
    todo = [n for n, s in enumerate(sentences) if s]
    outputs = translate_ids(model, [ids[n] for n in todo], tokenizer_tgt.token_to_id("[SOS]"),
                            tokenizer_tgt.token_to_id("[EOS]"), tokenizer_tgt.token_to_id("[PAD]"),
                            config.seq_len, beam=beam, alpha=alpha, nbest=nbest,
                            batch_size=batch_size or 64)
    results = [[("", 0.0)] if nbest > 1 else "" for _ in sentences]
    for n, out in zip(todo, outputs):
        if nbest > 1:
            results[n] = [(tokenizer_tgt.decode(h).strip(), s) for h, s in out]
        else:
            results[n] = tokenizer_tgt.decode(out).strip()
    return results


def validation_example(config: Config, index: int):
    """(source, reference) of example `index` of the validation split used in training."""
    from dataset import load_corpus
    val = load_corpus(config)["validation"]
    if not 0 <= index < len(val):
        raise InputError(f"validation example {index} does not exist (0 to {len(val) - 1})")
    return val[index]["src"], val[index]["tgt"]


def main(argv=None):
    parser = ArgumentParser(
        description="Translate sentences with a trained checkpoint.",
        formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("sentence", nargs="?", help="a sentence, or an integer: that example of "
                        "the validation split, with its reference; none: --input or stdin")
    parser.add_argument("--checkpoint", help="checkpoint file (default: --preload in "
                        "--model_folder, i.e. the newest)")
    parser.add_argument("--input", help="file of sentences, one a line ('-': stdin)")
    parser.add_argument("--output", help="write translations here instead of stdout")
    parser.add_argument("--reference", help="reference translations of --input: print corpus "
                        "sacreBLEU and chrF")
    parser.add_argument("--beam", type=int, default=1, help="beam size (1: greedy)")
    parser.add_argument("--alpha", type=float, default=0.6, help="beam length penalty")
    parser.add_argument("--nbest", type=int, default=1, help="print this many hypotheses each "
                        "(score, then translation, tab-separated)")
    parser.add_argument("--average", type=int, default=1, help="average the weights of the "
                        "newest N per-epoch checkpoints")
    parser.add_argument("--attention", metavar="PNG", help="write the cross-attention map of "
                        "the (single) sentence to this PNG file")
    from_checkpoint = {name: f"{Config.__dataclass_fields__[name].metadata['help']} (default: "
                       f"the checkpoint's{'' if name in TRANSLATE_FIELDS else '; must match'})"
                       for name in (TRANSLATE_FIELDS | set(MODEL_FIELDS)) - {
                           "model_folder", "model_basename", "preload", "device", "batch_size"}}
    add_config_arguments(parser, visible=TRANSLATE_FIELDS | set(MODEL_FIELDS), helps={
        **from_checkpoint,
        "batch_size": "sentences translated at once (default: 64)",
        "seq_len": "longest source and output in tokens (default: the checkpoint's)",
        "preload": "checkpoint in --model_folder: latest or an epoch (default: latest)"})
    args = parser.parse_args(argv)
    _, given = config_from_args(args)
    for name in given - TRANSLATE_FIELDS - set(MODEL_FIELDS):
        parser.error(f"--{name} is a training setting; translate.py takes its model from the "
                     f"checkpoint")
    if args.beam < 1 or args.nbest < 1 or args.nbest > args.beam and args.beam > 1 or \
            args.average < 1 or (args.batch_size is not None and args.batch_size < 1):
        parser.error("--beam, --nbest, --average and --batch_size must be positive, with "
                     "--nbest at most --beam")
    if args.sentence is not None and args.input:
        parser.error("give a sentence or --input, not both")
    if args.reference and args.sentence is not None:
        parser.error("--reference goes with --input or stdin")
    beam = max(args.beam, args.nbest)
    try:
        config, _ = config_from_args(args)
        model, config, tokenizer_src, tokenizer_tgt = load_translator(config, given,
                                                                      args.checkpoint,
                                                                      args.average)
        reference = None
        if args.sentence is not None:
            sentence = args.sentence
            if sentence.strip().isdigit():
                sentence, reference = validation_example(config, int(sentence))
            elif not clean(sentence):
                raise InputError("the sentence is empty")
            sentences = [sentence]
        else:
            sentences = read_lines(args.input)
        outputs = translate(model, config, tokenizer_src, tokenizer_tgt, sentences, beam,
                            args.alpha, args.nbest, args.batch_size)
        if args.nbest > 1:
            lines = [f"{n}\t{score:.4f}\t{text}" for n, hyps in enumerate(outputs)
                     for text, score in hyps]
        else:
            lines = outputs
        if reference is not None:
            print(f"{'SOURCE:':>12} {sentences[0]}\n{'TARGET:':>12} {reference}\n"
                  f"{'PREDICTED:':>12} {outputs[0]}")
        elif args.output:
            try:
                Path(args.output).write_text("".join(line + "\n" for line in lines),
                                             encoding="utf-8")
            except OSError as e:
                raise InputError(f"cannot write {args.output}: {e.strerror}") from None
        else:
            sys.stdout.write("".join(line + "\n" for line in lines))
        if args.attention:
            save_attention_map(model, tokenizer_src, tokenizer_tgt, clean(sentences[0]),
                               outputs[0] if args.nbest == 1 else outputs[0][0][0],
                               args.attention)
            print(f"wrote the cross-attention map to {args.attention}", file=sys.stderr)
        if args.reference:
            import sacrebleu
            refs = read_lines(args.reference)
            if len(refs) != len(sentences):
                raise InputError(f"{args.reference} has {len(refs)} lines but the input has "
                                 f"{len(sentences)}")
            hyps = outputs if args.nbest == 1 else [h[0][0] for h in outputs]
            bleu = sacrebleu.metrics.BLEU()
            chrf = sacrebleu.metrics.CHRF()
            bleu_score = bleu.corpus_score(hyps, [refs])
            print(f"{bleu_score}  ({bleu.get_signature()})", file=sys.stderr)
            print(f"{chrf.corpus_score(hyps, [refs])}  ({chrf.get_signature()})",
                  file=sys.stderr)
    except UserError as e:
        print(f"translate.py: error: {e}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        sys.exit(130)


if __name__ == "__main__":
    main()
