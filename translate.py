"""Translate with a trained checkpoint; the model is rebuilt from the config stored in it.

    python translate.py "I am not a very good student."      # greedy, best checkpoint
    python translate.py --beam 4 "I am not a very good student."
    python translate.py --example 42                           # validation example + reference
    python translate.py --input test.en --output test.hyp --reference test.de   # + sacreBLEU
    python translate.py --input test.en --reference test.de --tokenized_bleu   # + the paper's BLEU
    cat sentences.txt | python translate.py                    # one output line per input line
    python translate.py --ensemble weights/a,weights/b --beam 4 "..."   # models as one
    python translate.py --sample 5 --top_p 0.9 --input mono.de      # 5 samples a line
    python translate.py --attention map.png --attention_view encoder "..."   # what it attends to

From Python (a model loaded once, then as many calls as you like), nmt.translator's Translator,
the library this is the command line of:

    from nmt.translator import Translator
    translator = Translator("weights/multi30k_modern", average=5)
    translator.translate(["A dog runs.", "Two men talk."], beam=5)   # ["Ein Hund ...", ...]
"""

import argparse
import gzip
import os
import stat
import sys
from pathlib import Path


from config import (LENGTH_PENALTY, Config, UserError, add_locating_arguments, averaging,
                    checkpoint_config, fields_where)
from corpus import (DataError, LanguageMissing, column, corpus_source, decode_lines, load_corpus,
                    own_corpus, pairs_digest, text_file_name)
from corpus import read_lines as read_file_lines
from dataset import to_bilingual
from nmt.attention_map import VIEWS, picture_problem, save_attention_map
from nmt.cli import ArgumentParser, run_main
from nmt.decoding import Sampling, clean
from nmt.engine import EARLY_STOP_ONLY, load_engine
from nmt.metrics import moses_fallback, papers_bleu, score, tokenized_bleu
from nmt.trained_model import load_ensemble, load_translator
from nmt.translator import InputError, Translator, check_attention, check_sentence, check_settings


EOF_KEYS = "Ctrl-Z then Enter" if os.name == "nt" else "Ctrl-D"  # what ends a terminal's input


def read_lines(path_or_stdin):
    """Lines of a UTF-8 file ('-' or None: stdin); invalid UTF-8 names its line."""
    if path_or_stdin in (None, "-"):
        return decode_lines(sys.stdin.buffer.read(), "stdin")
    return read_file_lines(path_or_stdin)


def validation_example(config: Config, tokenizer_src, tokenizer_tgt, index: int):
    """(source, reference, what identifies the split) of example `index` of the validation split
    training validated on: the corpus's own, or the one held out of train with the checkpoint's
    --seed and --val_fraction, less the pairs longer than seq_len (as training dropped them).
    Never the teachers' translations of a distilled run, nor extra pairs: validation is the
    corpus's."""
    val = load_corpus(own_corpus(config), wanted=("train", "validation"))["validation"]
    src, tgt = column(val, "src"), column(val, "tgt")
    pairs = to_bilingual(src, tgt, tokenizer_src, tokenizer_tgt, config.seq_len, "validation")
    if not 0 <= index < len(pairs):
        raise InputError(f"validation example {index} does not exist (0 to {len(pairs) - 1})")
    return pairs.src_texts[index], pairs.tgt_texts[index], pairs_digest(src, tgt)


def trained_on(model):
    """The corpus record ({"source", "validation", ...}: nmt/checkpoint.py) of the checkpoint
    `model` was loaded from (an ensemble's: its first model's; an exported model's: its
    export's), or None where none was recorded."""
    first = model.members[0] if hasattr(model, "members") else model
    return getattr(first, "trained_on", None)


def check_example_corpus(config: Config, recorded, split: str, index: int):
    """A warning where the validation split --example read (`split`: its digest) is not the one
    the model's checkpoint recorded: the example is then not of the split training validated
    on (another corpus, or its files edited since). Silent where the checkpoint recorded none
    (an earlier version's)."""
    if not recorded or recorded.get("validation", split) == split:
        return
    where = f"--data_dir {config.data_dir}" if config.data_dir else \
        f"--datasource {config.datasource}"
    since = "has changed since training validated on it" \
        if recorded["source"] == corpus_source(config) else \
        f"is not the one training validated on (of {recorded['source']})"
    print(f"warning: the validation split of {where} {since}: example {index} is of another "
          f"split", file=sys.stderr)


def parse_args(argv):
    """The command line: (args, config of the flags given, names of the flags given)."""
    parser = ArgumentParser(
        description="Translate sentences with a trained checkpoint.",
        formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__,
        leftover=leftover)
    parser.add_argument("sentence", nargs="?", help="a sentence (none: --input or stdin)")
    add_input_arguments(parser)
    add_search_arguments(parser)
    add_attention_arguments(parser)
    add_locating_arguments(parser, own={"seed"})
    args = parser.parse_args(argv)
    config, given = checkpoint_config(parser, args)
    try:
        check_settings(args.beam, args.nbest)
    except UserError as e:
        parser.error(str(e))
    check_sampling(parser, args)
    check_models(parser, args, given)
    check_inputs(parser, args)
    check_model_files(parser, args, config)
    return args, config, given


def add_input_arguments(parser):
    parser.add_argument("--example", type=int, metavar="N", help="translate example N of the "
                        "validation split the model was trained with, beside its reference "
                        "(--data_dir: that corpus's place, where it has moved)")
    parser.add_argument("--input", help="file of sentences, one a line ('-': stdin)")
    parser.add_argument("--output", help="write translations here instead of stdout (-: stdout)")
    parser.add_argument("--reference", help="reference translations of --input: print corpus "
                        "sacreBLEU and chrF")
    parser.add_argument("--papers_reference", metavar="TOK", help="tokenized references of "
                        "--input, as Multi30k's tok/*.lc.norm.tok.* files: also print BLEU as "
                        "the papers on that corpus compute it (lowercased, Moses-tokenized; not "
                        "sacreBLEU's)")
    parser.add_argument("--tokenized_bleu", action="store_true", help="with --reference: also "
                        "print BLEU as the paper reports it on WMT14 (cased, both sides "
                        "Moses-tokenized; multi-bleu.perl's figure; not sacreBLEU's)")
    parser.add_argument("--compound_split", action="store_true", help="--tokenized_bleu with "
                        "hyphenated compounds split (##AT##-##AT##), as the paper's "
                        "English->German figures (tensor2tensor's get_ende_bleu.sh)")


def add_search_arguments(parser):
    """Beam search, sampling, and the models searched with (an ensemble, an exported one)."""
    parser.add_argument("--beam", type=int, default=1, help="beam size (1: greedy)")
    parser.add_argument("--alpha", type=float, help="beam search's length penalty (default "
                        f"{LENGTH_PENALTY}; CTranslate2 applies its own rule, length^alpha)")
    parser.add_argument("--early_stop", choices=["true", "false"], help="beam search's stop: "
                        "true (the default; OpenNMT's rule) ends a sentence's search once its "
                        "best candidate ends and --nbest have, false (fairseq's) once `beam` "
                        "hypotheses have "
                        "ended: a tenth of a BLEU point higher on Multi30k's validation (p = "
                        "0.09 at beam 4), 8-30%% slower")
    parser.add_argument("--nbest", type=int, default=1, help="print this many hypotheses each "
                        "(index, score and translation, tab-separated; without --beam, a beam "
                        "of this size)")
    parser.add_argument("--ctranslate2", metavar="DIR", help="translate with a model exported "
                        "by export.py, on the CTranslate2 engine")
    parser.add_argument("--ensemble", type=model_list, action=ModelList, metavar="A,B,...",
                        help="translate with two or more models as one (the mean of their "
                        "log-probabilities at each step), named in one comma-separated list "
                        "(the flag repeated adds to it): model folders (each at --preload) or "
                        "checkpoint files, of the same languages and target tokenizer; e.g. "
                        "--ensemble weights/a,weights/b")
    parser.add_argument("--sample", type=int, default=0, metavar="N", help="draw N samples of "
                        "each translation instead of searching (N lines an input; with "
                        "--nbest N, index, log-probability and text)")
    parser.add_argument("--temperature", type=float, help="--sample: divide the "
                        "log-probabilities by this (default 1; below 1, closer to greedy)")
    parser.add_argument("--top_k", type=int, help="--sample: draw from the K most likely "
                        "tokens only (default 0: all)")
    parser.add_argument("--top_p", type=float, help="--sample: draw from the nucleus, the "
                        "fewest most likely tokens whose probability reaches P (default 1: all)")
    parser.add_argument("--seed", type=int, dest="sample_seed", help="--sample: the draws' "
                        "seed (default 0); a sentence's samples depend on it, the sentence and "
                        "nothing else")


def add_attention_arguments(parser):
    parser.add_argument("--attention", metavar="PNG", help="draw what the (single) sentence's "
                        "translation attends to into this PNG file: every layer x head of "
                        "--attention_view")
    parser.add_argument("--attention_view", choices=sorted(VIEWS), default="cross",
                        help="--attention's view: cross (the decoder's attention to the "
                        "source), encoder or decoder (their self-attention) (default: cross)")
    parser.add_argument("--attention_layer", type=int, default=0, metavar="N",
                        help="--attention: layer N alone, from 1 (default 0: every layer)")
    parser.add_argument("--attention_head", default="all", metavar="N",
                        help="--attention: head N alone (from 1), mean (their mean) or all "
                        "(default)")


def check_inputs(parser, args):
    """One input, the references with a file's, --attention's flags with it and one sentence,
    an --output that overwrites none of the files read (one line, exit 2)."""
    if sum(x is not None for x in (args.sentence, args.input, args.example)) > 1:
        parser.error("give one of a sentence, --input and --example")
    for flag in ("reference", "papers_reference"):
        if getattr(args, flag) and (args.sentence is not None or args.example is not None):
            parser.error(f"--{flag} goes with --input or stdin")
        if getattr(args, flag) == "-" and args.input in (None, "-"):
            parser.error(f"--{flag} - reads stdin, where the sentences are read too: give the "
                         f"sentences as --input FILE, or the references as a file")
    if args.compound_split and not args.tokenized_bleu:
        parser.error("--compound_split goes with --tokenized_bleu")
    if args.tokenized_bleu and not args.reference:
        parser.error("--tokenized_bleu scores the translations against --reference: give it")
    drawn = {"attention_view": args.attention_view != "cross", "attention_layer":
             args.attention_layer != 0, "attention_head": args.attention_head != "all"}
    if not args.attention and any(drawn.values()):
        parser.error(f"--{min(k for k, v in drawn.items() if v)} goes with --attention PNG")
    if args.output and args.example is not None:
        parser.error("--output writes the translations of --input or stdin; --example prints "
                     "its one beside its source and reference")
    for flag in ("data_dir", "datasource"):
        if getattr(args, flag) is not None and args.example is None:
            parser.error(f"--{flag} goes with --example N (the place of the corpus the model was "
                         f"trained on, for its validation split)")
    if args.attention and args.sentence is None and args.example is None:
        parser.error("--attention maps one sentence: give it as the sentence argument or with "
                     "--example N, not --input or stdin")
    for flag in ("input", "reference", "papers_reference"):
        named = getattr(args, flag)
        if args.output and named not in (None, "-") and same_file(args.output, named):
            parser.error(f"--output {args.output} is the --{flag} file, which the translations "
                         f"would overwrite: give another --output")
    for flag in ("output", "attention"):  # found before the decoding, not after it
        path = getattr(args, flag)
        if path in (None, "-"):  # (--output -: stdout)
            continue
        if not os.path.isdir(os.path.dirname(path) or "."):
            parser.error(f"--{flag} {path}: no folder {os.path.dirname(path)} to write it in")
        if os.path.isdir(path):
            parser.error(f"--{flag} {path} is a folder: give a file in it")
        why = unwritable(path)
        if why:
            parser.error(f"--{flag} {path}: cannot write it ({why})")
    problem = args.attention and picture_problem(args.attention)  # (matplotlib adds .png)
    if problem:
        parser.error(problem)


def unwritable(path: str) -> str:
    """Why the file `path` cannot be written (the system's words), or "": tried before the
    decoding, not found after it. A file there is opened to append, not changed; one made to
    try (through a link too) is removed again; a pipe or a device is left to the writing (a
    reader of a pipe opened and closed would see its end)."""
    existed = os.path.exists(path)  # (through a link)
    if existed and not os.path.isfile(path):
        return ""
    try:
        open(path, "ab").close()
    except OSError as e:
        return e.strerror or str(e)
    if not existed:
        os.unlink(os.path.realpath(path))
    return ""


MODEL_FILES = ("*.pt", "*.json", "*.bin", "*.md", "*.png")  # checkpoints, tokenizers, records


def check_model_files(parser, args, config: Config):
    """An --output or --attention that would overwrite a file of the model's folders (a
    checkpoint, a tokenizer, an exported model's, the run's records): one line, exit 2 (the
    translations had replaced the checkpoint, and the model was gone)."""
    named = args.ensemble or [args.ctranslate2 or args.checkpoint or config.model_folder]
    folders = {path if path.is_dir() else path.parent for path in map(Path, named)}
    for flag in ("output", "attention"):
        path = getattr(args, flag)
        if path in (None, "-") or not os.path.isfile(path):
            continue
        for folder in folders:
            if any(same_file(path, file) for pattern in MODEL_FILES for file in folder.glob(
                    pattern)):
                parser.error(f"--{flag} {path} is a file of the model in {folder}, which it "
                             f"would overwrite: give another --{flag}")


def same_file(a: str, b: str) -> bool:
    """Whether two paths name one regular file (by another path or link too): a device such
    as /dev/null or a terminal is not overwritten."""
    try:
        return os.path.samefile(a, b) and stat.S_ISREG(os.stat(a).st_mode)
    except OSError:  # one of them not there (yet): nothing to overwrite
        return False


class ModelList(argparse.Action):
    """--ensemble given twice adds its models to the first's (argparse would keep the last)."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, (getattr(namespace, self.dest) or []) + values)


def model_list(text: str) -> list:
    """--ensemble's value: model folders or checkpoint files, comma-separated (one argument,
    so that it cannot take the sentence that follows it for a model)."""
    models = [m for m in text.split(",") if m]
    if not models:
        raise argparse.ArgumentTypeError("name the models, comma-separated: A,B")
    return models


def check_models(parser, args, given):
    """--ctranslate2 and --ensemble name their models: the flags that locate or change one
    model are refused beside them (one line, exit 2)."""
    if args.ctranslate2:
        if args.attention or args.sample:
            parser.error(f"--{'attention' if args.attention else 'sample'} needs the PyTorch "
                         f"model (--model_folder or --checkpoint), not --ctranslate2's")
        if args.early_stop == "false":  # (here: the engine's call came after a typed line)
            parser.error(EARLY_STOP_ONLY)
        located = given & ({"checkpoint", "preload", "model_folder", "model_basename"}
                           | fields_where(group="model")) | \
            ({"checkpoint"} if args.checkpoint else set()) | \
            ({"average"} if args.average > 1 else set()) | \
            ({"average_saves"} if args.average_saves is not None else set())
        if located:
            parser.error(f"--ctranslate2 takes the exported model as it is: not with "
                         f"--{sorted(located)[0]} (export another model with export.py)")
    if args.ensemble:
        if len(args.ensemble) < 2:
            parser.error(f"--ensemble {args.ensemble[0]}: an ensemble has two or more models, "
                         f"in one comma-separated argument (--ensemble A,B); for one model, "
                         f"--model_folder or --checkpoint")
        if args.sentence is not None and looks_like_a_model(args.sentence):
            parser.error(a_model_not_a_sentence(args.sentence))
        located = given & {"model_folder", "model_basename"} | \
            ({"checkpoint"} if args.checkpoint else set()) | \
            ({"ctranslate2"} if args.ctranslate2 else set()) | \
            ({"attention"} if args.attention else set())
        if located:
            parser.error(f"--ensemble names its models: not with --{sorted(located)[0]}")


def leftover(args) -> str:
    """What to say of words left over: one sentence an argument; after `--ensemble A B`,
    where B took the sentence's place, that B is a model."""
    if args.ensemble and args.sentence is not None and looks_like_a_model(args.sentence):
        return a_model_not_a_sentence(args.sentence)
    return "one sentence is one argument (quote it); several go in a file, --input FILE, or on " \
        "stdin, one a line"


def a_model_not_a_sentence(text: str) -> str:
    return f"'{text}' is a model, not a sentence: name every model of the ensemble in one " \
        f"comma-separated argument (--ensemble A,B)"


def looks_like_a_model(text: str) -> bool:
    """A model folder (it holds checkpoints) or a checkpoint file: not a sentence to
    translate (the former `--ensemble A B` form would take B for the sentence)."""
    path = Path(text)
    try:
        return (path.is_file() and path.suffix == ".pt") or \
            (path.is_dir() and any(path.glob("*.pt")))
    except OSError:  # a long sentence is no file name
        return False


def check_sampling(parser, args):
    """--sample's settings in their ranges, and only with --sample; --alpha and --early_stop
    only with a beam search (one line, exit 2)."""
    options = {"temperature": args.temperature, "top_k": args.top_k, "top_p": args.top_p,
               "seed": args.sample_seed}
    searching = args.sample <= 0 and max(args.beam, args.nbest) > 1
    if args.alpha is not None and not searching:
        parser.error("--alpha is beam search's length penalty: it goes with --beam N (N >= 2)")
    if args.early_stop is not None and not searching:
        parser.error("--early_stop is beam search's stopping rule: it goes with --beam N (N >= 2)")
    args.alpha = LENGTH_PENALTY if args.alpha is None else args.alpha
    if args.sample < 0:
        parser.error(f"--sample must be positive (got {args.sample})")
    if args.sample == 0:
        given = [f"--{name}" for name, value in options.items() if value is not None]
        if given:
            parser.error(f"{' '.join(given)}: "
                         f"{'goes' if len(given) < 2 else 'go'} with --sample N (N >= 1)")
        return
    if args.beam > 1:
        parser.error("--sample draws translations and --beam searches for one: not both")
    if args.nbest > 1 and args.nbest != args.sample:
        parser.error(f"--nbest {args.nbest} with --sample {args.sample}: the n-best format "
                     f"lists every sample (--nbest {args.sample}), or leave --nbest out")
    if args.temperature is not None and not args.temperature > 0:
        parser.error(f"--temperature must be above 0 (got {args.temperature}); near 0 is greedy")
    if args.top_k is not None and args.top_k < 0:
        parser.error(f"--top_k must not be negative (got {args.top_k}; 0: all tokens)")
    if args.top_p is not None and not 0 < args.top_p <= 1:
        parser.error(f"--top_p must lie in (0, 1] (got {args.top_p}; 1: all tokens)")
    if (args.reference or args.papers_reference) and args.sample > 1:
        parser.error(f"--{'reference' if args.reference else 'papers_reference'} scores one "
                     f"translation a sentence: --sample 1")


def search(args) -> dict:
    """Translator.translate's search settings from the command line (the same for a file, stdin
    and a terminal's lines)."""
    return dict(beam=args.beam, alpha=args.alpha, nbest=args.nbest, batch_size=args.batch_size,
                sampling=sampling(args), early_stop=args.early_stop != "false")


def sampling(args):
    """The Sampling that --sample and its settings describe, or None."""
    if not args.sample:
        return None
    given = {"temperature": args.temperature, "top_k": args.top_k, "top_p": args.top_p,
             "seed": args.sample_seed}
    return Sampling(n=args.sample, **{k: v for k, v in given.items() if v is not None})


def read_sources(args, config: Config, tokenizer_src, tokenizer_tgt, recorded=None):
    """(sentences, reference of the one sentence or None, references of --input or None,
    tokenized references of --input or None): the sentence argument, a validation example
    (--example) with its reference, or the lines of --input / stdin (with --reference and
    --papers_reference, their lines, checked to match before any decoding). `recorded`: the
    corpus the model was trained on (trained_on), which --example's is checked against."""
    if args.example is not None:
        if args.data_dir is None and config.data_dir and not Path(config.data_dir).is_dir():
            raise DataError(f"the corpus the model was trained on, --data_dir {config.data_dir}"
                            f", is not there (moved?): give its place with --data_dir")
        try:
            sentence, reference, split = validation_example(
                config, tokenizer_src, tokenizer_tgt, args.example)
        except LanguageMissing as e:  # (the languages are the model's, not flags to check)
            raise LanguageMissing(e.what, f"the model translates {config.lang_src}->"
                                  f"{config.lang_tgt}: give --data_dir the corpus it was trained "
                                  f"on") from None
        check_example_corpus(config, recorded, split, args.example)
        return [sentence], reference, None, None
    if args.sentence is not None:
        return [check_sentence(args.sentence)], None, None, None
    if reading_a_terminal(args):  # (it waited for the end of the input without a word)
        print(f"reading the sentences to translate from the terminal, one a line; {EOF_KEYS} "
              f"ends", file=sys.stderr)
    sentences = read_lines(args.input)
    name = "stdin" if args.input in (None, "-") else args.input
    # (`cat missing.en | translate.py > out.hyp` ended with an empty file and not a word)
    if not sentences and not (args.reference or args.papers_reference):
        print(f"warning: {name} is empty: nothing to translate", file=sys.stderr)
    for flag, language, side in (("input", config.lang_src, "from"), ("reference", config.lang_tgt,
                                 "into"), ("papers_reference", config.lang_tgt, "into")):
        named = other_language(getattr(args, flag), language)
        if named:  # (a scoring command copied from another language pair's: BLEU 0.00)
            print(f"warning: --{flag} {getattr(args, flag)} is named as {named} text; the model "
                  f"translates {side} {language}", file=sys.stderr)
    found = []
    for path in (args.reference, args.papers_reference):
        refs = read_lines(path) if path else None
        if refs is not None and not sentences:
            raise InputError(f"{name} is empty: nothing to score against {path}")
        if refs is not None and len(refs) != len(sentences):
            raise InputError(f"{path} has {len(refs)} lines but the input has "
                             f"{len(sentences)}")
        found.append(refs)
    return sentences, None, *found


# ISO 639-1's two-letter language codes (the alpha-2 column of ISO 639-2): a file named val.de
# is German; notes.md, test.in or run.sh name no language
ISO_639_1 = frozenset("""aa ab ae af ak am an ar as av ay az ba be bg bh bi bm bn bo br bs ca ce
ch co cr cs cu cv cy da de dv dz ee el en eo es et eu fa ff fi fj fo fr fy ga gd gl gn gu gv ha he
hi ho hr ht hu hy hz ia id ie ig ii ik io is it iu ja jv ka kg ki kj kk kl km kn ko kr ks ku kv kw
ky la lb lg li ln lo lt lu lv mg mh mi mk ml mn mr ms mt my na nb nd ne ng nl nn no nr nv ny oc oj
om or os pa pi pl ps pt qu rm rn ro ru rw sa sc sd se sg si sk sl sm sn so sq sr ss st su sv sw ta
te tg th ti tk tl tn to tr ts tt tw ty ug uk ur uz ve vi vo wa wo xh yi yo za zh zu""".split())


def other_language(path, language: str):
    """The language a file's name gives it (val.de, val.de.gz: "de") where that is another
    ISO 639-1 code than `language`'s, else None (no code, a longer one, two letters that are
    no language: not guessed)."""
    named = text_file_name(Path(path))[1] if path not in (None, "-") else ""
    return named if named in ISO_639_1 and language in ISO_639_1 and named != language else None


def reading_a_terminal(args) -> bool:
    """No sentence, no --example, and the lines to translate come from a terminal."""
    return args.sentence is None and args.example is None and args.input in (None, "-") \
        and sys.stdin.isatty()


def translate_as_typed(args, translator):
    """A terminal on stdin and nothing to score or write to a file: each line is translated
    as it is typed (Enter), until the end of the input (EOF_KEYS)."""
    print(f"type a sentence and press Enter to translate it; {EOF_KEYS} ends", file=sys.stderr)
    for n, line in enumerate(sys.stdin.buffer, 1):
        try:
            sentences = decode_lines(line, "stdin", first_line=n)
        except DataError as e:  # a terminal set to another encoding: this line is lost only
            print(f"warning: {e}: not translated (is the terminal's encoding UTF-8?)",
                  file=sys.stderr)
            sentences = []
        if sentences:
            outputs = translator.translate(sentences, **search(args), numbers=[n])
            write_outputs(args, sentences, outputs, None, first=n - 1)
            sys.stdout.flush()
        # a last line ended by Ctrl-D, not Enter: the end's own Ctrl-D was taken by reading
        # it (read on, the end needed a third)
        if not line.endswith(b"\n"):
            return


def write_outputs(args, sentences, outputs, reference, first: int = 0):
    """Translations to --output or stdout (n-best: index from `first`, score, text a line); a
    validation example is printed with its source and reference."""
    if reference is not None:
        predicted = [text for text, _ in outputs[0]] if isinstance(outputs[0], list) \
            else [outputs[0]]  # n-best or samples: each
        print(f"{'SOURCE:':>12} {sentences[0]}\n{'TARGET:':>12} {reference}")
        print("\n".join(f"{'PREDICTED:':>12} {text}" for text in predicted))
        return
    if args.nbest > 1:
        lines = [f"{n}\t{s:.4f}\t{text}" for n, hyps in enumerate(outputs, first)
                 for text, s in hyps]
    elif args.sample:  # n samples an input, one a line
        lines = [text for samples in outputs for text, _ in samples]
    else:
        lines = outputs
    text = "".join(line + "\n" for line in lines)
    if args.output in (None, "-"):
        sys.stdout.write(text)
        return
    data = text.encode("utf-8")  # (a *.gz name packed, as every script here reads one)
    try:
        Path(args.output).write_bytes(gzip.compress(data) if args.output.endswith(".gz") else data)
    except OSError as e:
        raise InputError(f"cannot write {args.output}: {e.strerror}") from None


def load(args, config: Config, given: set) -> Translator:
    """The model the flags name: an exported one on its engine (--ctranslate2), an ensemble,
    or one checkpoint (--checkpoint, or --preload in --model_folder), --average or
    --average_saves applied."""
    if args.ctranslate2:  # (load_translator applies --threads to this repo's decoder)
        loaded = load_engine(args.ctranslate2, config, given, config.threads)
    elif args.ensemble:
        loaded = load_ensemble(config, given, args.ensemble, **averaging(args))
    else:
        loaded = load_translator(config, given, args.checkpoint, **averaging(args))
    return Translator.of(*loaded)


def main(argv=None):
    args, config, given = parse_args(argv)
    translator = load(args, config, given)
    if args.attention:  # before anything is decoded or written
        check_attention(translator.model, args.attention_view, args.attention_layer,
                        args.attention_head)
    if reading_a_terminal(args) and not (args.reference or args.papers_reference
                                         or args.output not in (None, "-")):
        return translate_as_typed(args, translator)
    tokenizer_src, tokenizer_tgt = translator.tokenizer_src, translator.tokenizer_tgt
    first_src = tokenizer_src[0] if args.ensemble else tokenizer_src  # for --example
    sentences, reference, refs, tokenized = read_sources(
        args, translator.config, first_src, tokenizer_tgt, trained_on(translator.model))
    outputs = translator.translate(sentences, **search(args))
    write_outputs(args, sentences, outputs, reference)
    listed = args.nbest > 1 or args.sample  # (translation, score) lists: the first of each
    best = [hyps[0][0] for hyps in outputs] if listed else outputs
    if args.attention:
        save_attention_map(translator.model, tokenizer_src, tokenizer_tgt, clean(sentences[0]),
                           best[0], args.attention, args.attention_view, args.attention_layer,
                           args.attention_head)
        print(f"wrote the {VIEWS[args.attention_view]} to {args.attention}", file=sys.stderr)
    if refs is not None:
        print(score(best, refs, error_rates=False)["report"], file=sys.stderr)
    if tokenized is not None or args.tokenized_bleu:  # (a BLEU on tokenized text)
        fallback = moses_fallback(translator.config.lang_tgt)
        if fallback:
            print(fallback, file=sys.stderr)
    if tokenized is not None:
        print(papers_bleu(best, tokenized, translator.config.lang_tgt)["report"],
              file=sys.stderr)
    if args.tokenized_bleu:
        print(tokenized_bleu(best, refs, translator.config.lang_tgt, args.compound_split)[
            "report"], file=sys.stderr)


if __name__ == "__main__":
    run_main("translate.py", main)
