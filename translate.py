"""Translate with a trained checkpoint; the model is rebuilt from the config stored in it.

    python translate.py "I am not a very good student."      # greedy, newest checkpoint
    python translate.py --beam 4 "I am not a very good student."
    python translate.py --example 42                           # validation example + reference
    python translate.py --input test.en --output test.hyp --reference test.de   # + sacreBLEU
    cat sentences.txt | python translate.py                    # one output line per input line
"""

import argparse
import sys
from pathlib import Path


from attention_map import save_attention_map
from config import (ArgumentParser, Config, UserError, add_locating_arguments, checkpoint_config,
                    fields_where, run_main)
from corpus import column, decode_lines, load_corpus
from corpus import read_lines as read_file_lines
from dataset import to_bilingual
from decoding import clean, translate
from engine import load_engine
from metrics import score
from trained_model import load_translator


class InputError(UserError):
    """A bad sentence, input or output file."""


def read_lines(path_or_stdin):
    """Lines of a UTF-8 file ('-' or None: stdin); invalid UTF-8 names its line."""
    if path_or_stdin in (None, "-"):
        return decode_lines(sys.stdin.buffer.read(), "stdin")
    return read_file_lines(path_or_stdin)


def validation_example(config: Config, tokenizer_src, tokenizer_tgt, index: int):
    """(source, reference) of example `index` of the validation split training validated on:
    the corpus's own, or the one held out of train with the checkpoint's --seed and
    --val_fraction, less the pairs longer than seq_len (as training dropped them)."""
    val = load_corpus(config)["validation"]
    val = to_bilingual(column(val, "src"), column(val, "tgt"), tokenizer_src, tokenizer_tgt,
                       config.seq_len, "validation")
    if not 0 <= index < len(val):
        raise InputError(f"validation example {index} does not exist (0 to {len(val) - 1})")
    return val.src_texts[index], val.tgt_texts[index]


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
    add_locating_arguments(parser)
    args = parser.parse_args(argv)
    config, given = checkpoint_config(parser, args)
    if args.beam < 1 or args.nbest < 1 or args.nbest > args.beam and args.beam > 1:
        parser.error("--beam and --nbest must be positive, with --nbest at most --beam")
    if sum(x is not None for x in (args.sentence, args.input, args.example)) > 1:
        parser.error("give one of a sentence, --input and --example")
    if args.reference and (args.sentence is not None or args.example is not None):
        parser.error("--reference goes with --input or stdin")
    if args.attention and args.sentence is None and args.example is None:
        parser.error("--attention maps one sentence: give it as the sentence argument or with "
                     "--example N, not --input or stdin")
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


def read_sources(args, config: Config, tokenizer_src, tokenizer_tgt):
    """(sentences, reference of the one sentence or None, references of --input or None):
    the sentence argument, a validation example (--example) with its reference, or the lines
    of --input / stdin (with --reference, its lines, checked to match before any decoding)."""
    if args.example is not None:
        sentence, reference = validation_example(config, tokenizer_src, tokenizer_tgt,
                                                 args.example)
        return [sentence], reference, None
    if args.sentence is not None:
        if not clean(args.sentence):
            raise InputError("the sentence is empty")
        return [args.sentence], None, None
    sentences = read_lines(args.input)
    refs = read_lines(args.reference) if args.reference else None
    if refs is not None and not sentences:
        raise InputError(f"{args.input or 'stdin'} is empty: nothing to score against "
                         f"{args.reference}")
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
    if args.ctranslate2:  # (load_translator applies --threads to this repo's decoder)
        model, config, tokenizer_src, tokenizer_tgt = load_engine(args.ctranslate2, config,
                                                                  given, config.threads)
    else:
        model, config, tokenizer_src, tokenizer_tgt = load_translator(
            config, given, args.checkpoint, args.average)
    sentences, reference, refs = read_sources(args, config, tokenizer_src, tokenizer_tgt)
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
