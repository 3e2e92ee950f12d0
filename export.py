"""Export a trained checkpoint to CTranslate2, the fastest inference engine for this model family.

    pip install 'ctranslate2>=4.7'                            # optional: serving only
    python export.py --output exported/ct2                    # best checkpoint, float32
    python export.py --output exported/ct2_int8 --quantization int8 --preload latest
    python export.py --output exported/ct2_avg --average 5    # the last 5 epochs averaged
    python export.py --output exported/ct2_avg --average_saves 5   # the last 5 --save_every saves
    python translate.py --ctranslate2 exported/ct2 "A dog runs."   # translate.py, on the engine

How the weights map to the engine's specification: nmt/engine.py.
"""

import sys

from config import add_locating_arguments, averaging, checkpoint_config
from nmt.cli import ArgumentParser, run_main
from nmt.engine import QUANTIZATIONS, check_output, export, import_ctranslate2
from nmt.trained_model import load_translator


def parse_args(argv):
    parser = ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", required=True, help="new folder for the CTranslate2 model")
    parser.add_argument("--quantization", choices=QUANTIZATIONS, default="float32",
                        help="weight type of the exported model (default: float32); int8 is "
                             "the fastest on CPU")
    add_locating_arguments(parser)
    args = parser.parse_args(argv)
    for name in ("batch_size", "threads"):  # (the export decodes nothing)
        if getattr(args, name) is not None:
            parser.error(f"--{name} is the translating command's: give it to translate.py "
                         f"--ctranslate2 {args.output}")
    return args, *checkpoint_config(parser, args)


def main(argv=None):
    args, config, given = parse_args(argv)
    import_ctranslate2()  # before any loading: one line if it is missing
    check_output(args.output)
    model, config, tokenizer_src, tokenizer_tgt = load_translator(
        config, given, args.checkpoint, **averaging(args))
    model.float()
    output = export(model, config, tokenizer_src, tokenizer_tgt, args.output, args.quantization,
                    source=getattr(model, "loaded_from", None),
                    corpus=getattr(model, "trained_on", None))
    print(f"wrote the CTranslate2 model ({args.quantization}) to {output}; translate with: "
          f"python translate.py --ctranslate2 {output} \"...\"", file=sys.stderr)


if __name__ == "__main__":
    run_main("export.py", main)
