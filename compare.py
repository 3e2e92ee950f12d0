r"""Is one system's score really higher than another's? Paired significance tests of translation
files against a baseline, on the same references: sacreBLEU's BLEU and chrF, each with its 95%
confidence interval, and the p-value of each system's difference from the first by paired
bootstrap resampling (Koehn 2004) and by paired approximate randomization (Riezler and Maxwell
2005).

    python translate.py $A --input test.en --output a.hyp          # decode each system
    python translate.py $B --input test.en --output b.hyp
    python compare.py a.hyp b.hyp --reference test.de              # a: the baseline

p < 0.05: a difference this large would be rare if the two systems were equally good on
sentences like these. Test once, on the split the systems were not chosen on.

    python compare.py a.hyp b.hyp --reference tok/test_2016_flickr.lc.norm.tok.de \
        --papers_bleu de

tests the papers' BLEU instead (as the Multi30k papers report it: lowercased, Moses-tokenized,
against the dataset's tokenized references; nmt/metrics.papers_bleu), never mixed with sacreBLEU's.
`--tokenized_bleu de --compound_split` tests the paper's WMT14 English->German BLEU instead
(cased, both sides Moses-tokenized, compounds split; nmt/metrics.tokenized_bleu).
"""

import argparse
import sys
from pathlib import Path

from config import UserError
from corpus import read_lines
from nmt.cli import ArgumentParser, run_main
from nmt.metrics import (BOOTSTRAP_SAMPLES, PAPERS_BLEU, RANDOMIZATION_SAMPLES, compare,
                         moses_fallback, tokenized_bleu_name)


def read_systems(paths, reference):
    """(references, [(name, hypotheses)]): each file's lines, every file as long as the
    reference (one line, else)."""
    references = read_lines(reference)
    if not references:
        raise UserError(f"{reference} is empty: nothing to score against")
    names = [Path(p).name for p in paths]
    if len(set(names)) < len(names):  # two files of one name in different folders
        names = [str(p) for p in paths]
    systems = []
    for path, name in zip(paths, names):
        lines = read_lines(path)
        if len(lines) != len(references):
            raise UserError(f"{path} has {len(lines)} lines but the reference {reference} has "
                            f"{len(references)}: the systems must translate the same sentences")
        systems.append((name, lines))
    return references, systems


def table(found: dict) -> str:
    """The systems a row each: BLEU and chrF (or the papers' BLEU alone) with their 95%
    confidence intervals, and the p-values of each difference from the baseline (the first
    row)."""
    width = max(len(name) for name in found["systems"]) + 2
    shown = [m for m in ("bleu", "chrf") if m in found]
    names = {"bleu": "BLEU ± 95% CI", "chrf": "chrF ± 95% CI"}
    head = f"{'system':<{width}}" + "".join(
        f"{names[metric]:>16}{'p (bs)':>9}{'p (ar)':>9}" for metric in shown)
    lines = [head]
    for n, name in enumerate(found["systems"]):
        cells = f"{name:<{width}}"
        for metric in shown:
            row = found[metric][n]
            cells += f"{row['score']:>9.2f} ± {row['ci']:<4.2f}"
            cells += "".join(f"{'baseline' if n == 0 else format(row[p], '.4f'):>9}"
                             for p in ("p_bs", "p_ar"))
        lines.append(cells)
    return "\n".join(lines)


def main(argv=None):
    description, epilog = __doc__.split("\n\n", 1)
    parser = ArgumentParser(description=description, epilog=epilog,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("hypotheses", nargs="+", metavar="HYP",
                        help="translation files, one sentence a line; the first is the baseline")
    parser.add_argument("--reference", required=True, help="the reference translations")
    parser.add_argument("--papers_bleu", metavar="LANG", help="test the papers' BLEU instead: "
                        "--reference is tokenized as Moses does (Multi30k's tok/*.lc.norm.tok.*), "
                        "the translations are lowercased and Moses-tokenized for LANG")
    parser.add_argument("--tokenized_bleu", metavar="LANG", help="test the paper's tokenized "
                        "BLEU instead: translations and --reference (raw) Moses-tokenized for "
                        "LANG, cased, as the paper's WMT14 figures")
    parser.add_argument("--compound_split", action="store_true", help="--tokenized_bleu with "
                        "hyphenated compounds split (##AT##-##AT##), as the paper's "
                        "English->German figures")
    args = parser.parse_args(argv)
    if len(args.hypotheses) < 2:
        parser.error("give two or more translation files: the baseline first, then the "
                     "systems to test against it")
    for flag in ("papers_bleu", "tokenized_bleu"):  # ("": not given, sacreBLEU's table)
        if getattr(args, flag) is not None and not getattr(args, flag).strip():
            parser.error(f"--{flag} takes the language of the translations (de, en...)")
    if args.papers_bleu and args.tokenized_bleu:
        parser.error("give one of --papers_bleu (Multi30k's papers) and --tokenized_bleu (the "
                     "paper's WMT14 figure)")
    if args.compound_split and not args.tokenized_bleu:
        parser.error("--compound_split goes with --tokenized_bleu LANG")
    references, systems = read_systems(args.hypotheses, args.reference)
    tokenized_lang = args.papers_bleu or args.tokenized_bleu  # (a BLEU on tokenized text)
    fallback = moses_fallback(tokenized_lang) if tokenized_lang else None
    if fallback:
        print(fallback, file=sys.stderr)
    found = compare(systems, references, papers_lang=args.papers_bleu,
                    tokenized_lang=args.tokenized_bleu, compound_split=args.compound_split)
    if args.papers_bleu:
        print(f"{PAPERS_BLEU}; not sacreBLEU's BLEU")
    if args.tokenized_bleu:
        print(tokenized_bleu_name(args.compound_split))
    print(table(found))
    print(f"\n{len(references)} sentences; paired bootstrap resampling ({BOOTSTRAP_SAMPLES} "
          f"resamples) and approximate randomization ({RANDOMIZATION_SAMPLES} trials) against "
          f"{found['systems'][0]}; sacreBLEU signatures:")
    for metric, signatures in found["signatures"].items():
        print(f"  {metric}: {' / '.join(signatures)}")


if __name__ == "__main__":
    run_main("compare.py", main)
