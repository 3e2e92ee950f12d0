"""Decoding speed and quality of a trained checkpoint, side by side with CTranslate2.

    python -m dev.bench_decode --model_folder weights --threads 2     # Multi30k test_2016_flickr

One run, one trained model, the same sentences, the same thread count, the same length rules
(the checkpoint's --max_len_a/--max_len_b/--min_len):
  this repo: batched greedy and beam search with the key/value cache (fp32), beam search
             with its early stop (OpenNMT's, the default) and with fairseq's (k finished
             hypotheses: exact, and slower), and, with --variants, the same greedy in bf16 and
             with dynamic int8 linear layers;
  with --ensemble_with MODEL [MODEL ...]: the model and those as one ensemble (the mean of
             their log-probabilities, translate.py --ensemble), greedy and beam;
  CTranslate2 (if installed): the model exported by export.py (into a temporary folder) in
             float32, greedy and beam; and in int8, greedy (as translate.py --ctranslate2
             calls it: greedy one call per batch, beam one call per output-length limit).
For each: seconds (the median of --repeats passes; greedy decoders take turns batch by batch),
target tokens/s (tokens output, [EOS] counted), sacreBLEU BLEU and chrF,
and how many outputs are identical to this repo's greedy ones. Then the ratio the decoder is
held to: this repo's greedy tokens/s over CTranslate2 float32 greedy's, taken in each pass
(the two decode each batch one right after the other) and the median of the passes printed,
with every pass's.
"""

import copy
import statistics
import tempfile
import time
import warnings
from pathlib import Path

import torch

from config import add_locating_arguments, checkpoint_config
from corpus import read_lines
from nmt.cli import ArgumentParser, run_main
from nmt.decoding import decoding_model, translate_ids
from nmt.metrics import score
from nmt.trained_model import load_ensemble, load_translator
from tokenizer import EOS, PAD, SOS, UNK, detokenize


def engines(model, config, tok_src, tok_tgt, folder: Path, threads: int):
    """CTranslate2 exports of `model` in float32 and int8, loaded on the model's device (CPU or
    CUDA); {} without ctranslate2, or where it cannot load on that device (one line says why)."""
    try:
        import ctranslate2  # noqa: F401
    except ImportError:
        print("ctranslate2 is not installed: its rows are left out (pip install ctranslate2)")
        return {}
    from nmt.engine import Engine, ExportError, export
    device = next(model.parameters()).device.type
    out = {}
    for quantization in ("float32", "int8"):
        path = export(model, config, tok_src, tok_tgt, folder / quantization, quantization)
        try:
            engine = Engine(path, tok_src, tok_tgt, device, threads)
            # a CUDA build finds its CUDA libraries at the first translation, not at loading
            engine.translator.translate_batch([[engine.tokens[4]]], max_decoding_length=2)
        except (ExportError, RuntimeError) as e:  # e.g. built for another CUDA release
            print(f"CTranslate2 {quantization} on {device} cannot run: "
                  f"{str(e).splitlines()[0]}; its rows are left out")
            continue
        out[quantization] = engine
    return out


def decode_in_turn(runs, ids, batch: int, repeats: int):
    """Times every decoder on the same sentences, `repeats` passes. Within a pass the greedy
    decoders take turns batch by batch (the sentences sorted by length, as the decoders batch
    them), so that a slow moment of this machine falls on all of them alike, this repo's first
    and the engine's float32 right after it; then each beam search decodes all its sentences
    in one call (the engine groups them by output-length limit across the whole set, as
    translate.py --ctranslate2 does). Before the timed passes, one untimed batch each (the
    longest: allocations, thread pools). Returns per decoder {sentence: output ids} and the
    seconds of each pass."""
    order = sorted(range(len(ids)), key=lambda i: len(ids[i]))
    batches = [order[i:i + batch] for i in range(0, len(order), batch)]
    turns = sorted(runs, key=lambda r: (r[0] != "this repo, greedy",
                                        r[0] != "CTranslate2 float32, greedy"))
    greedy = [r for r in turns if "beam" not in r[0]]
    outputs = {name: {} for name, _, _ in runs}
    times = {name: [0.0] * repeats for name, _, _ in runs}

    def decode(name, run, sentences, r):
        started = time.perf_counter()
        outputs[name].update(zip(sentences, run([ids[i] for i in sentences])))
        times[name][r] += time.perf_counter() - started

    for _, run, sentences in turns:
        run([ids[i] for i in batches[-1] if i in sentences] or [ids[0]])  # untimed
    for r in range(repeats):
        for part in batches:
            for name, run, sentences in greedy:
                here = [i for i in part if i in sentences]
                if here:
                    decode(name, run, here, r)
        for name, run, sentences in turns:
            if "beam" in name:
                decode(name, run, list(sentences), r)
    return outputs, times


def variants(model):
    """This repo's model in bf16, and with dynamic int8 linear layers (torch.ao: weights int8,
    activations quantized on the fly). The fused Q/K/V projection stays fp32: cross-attention
    slices its weight (the W_Q rows, then the W_K and W_V ones)."""
    from torch.ao.quantization import default_dynamic_qconfig, quantize_dynamic
    bf16 = copy.deepcopy(model).to(torch.bfloat16)
    linears = {name: default_dynamic_qconfig for name, m in model.named_modules()
               if isinstance(m, torch.nn.Linear) and not name.endswith("w_qkv")}
    with warnings.catch_warnings():  # torch.ao's deprecation notices
        warnings.simplefilter("ignore")
        int8 = quantize_dynamic(copy.deepcopy(model), linears, dtype=torch.qint8)
    return {"bf16": bf16, "dynamic int8": int8}


def parse_args(argv):
    parser = ArgumentParser(prog="python -m dev.bench_decode", description=__doc__.split("\n\n")[0])
    parser.add_argument("--data_dir_test", metavar="DIR", default="data/multi30k",
                        help="folder of the test files (default: data/multi30k)")
    parser.add_argument("--split", default="test_2016_flickr",
                        help="files DIR/{split}.{lang} to translate and score")
    parser.add_argument("--sentences", type=int, default=0, metavar="N",
                        help="only the first N sentences of the split (0: all)")
    parser.add_argument("--beam", type=int, default=4)
    parser.add_argument("--alpha", type=float, default=0.6)
    parser.add_argument("--variants", action="store_true", help="also this repo's greedy in "
                        "bf16 and with dynamic int8 linear layers")
    parser.add_argument("--repeats", type=int, default=3, help="timed passes of each decoder, "
                        "interleaved; the median is reported")
    parser.add_argument("--single", type=int, default=0, metavar="N", help="also the "
                        "write-ups' decoder on the first N sentences: one at a time, the whole "
                        "prefix re-decoded for every token (no cache)")
    parser.add_argument("--ensemble_with", nargs="+", metavar="MODEL", default=[],
                        help="also decode with the model and these (model folders or "
                        "checkpoint files) as one ensemble")
    add_locating_arguments(parser)
    args = parser.parse_args(argv)
    return args, *checkpoint_config(parser, args)


def ensemble_decoders(args, config, given, sources, ids, common: dict):
    """The ensemble of the model and --ensemble_with's, greedy and beam, as this_repos_decoders
    gives its decoders (each model reads the sentences with its own source tokenizer)."""
    if not args.ensemble_with:
        return []
    ensemble, _, tokenizers, _ = load_ensemble(
        config, given, [args.checkpoint or config.model_folder, *args.ensemble_with],
        args.average)
    encoded = [[e.ids for e in tok.encode_batch(sources)] for tok in tokenizers]
    per_model = {tuple(ids[i]): [e[i] for e in encoded] for i in range(len(ids))}
    packed = decoding_model(ensemble, common["batch_size"])
    packed_beam = decoding_model(ensemble, common["batch_size"] * args.beam)
    name = f"this repo, ensemble of {len(ensemble.members)}"
    return [(f"{name}, greedy", lambda part: translate_ids(
                packed, [per_model[tuple(i)] for i in part], **common), range(len(ids))),
            (f"{name}, beam {args.beam}", lambda part: translate_ids(
                packed_beam, [per_model[tuple(i)] for i in part], **common, beam=args.beam,
                alpha=args.alpha), range(len(ids)))]


def this_repos_decoders(args, model, n: int, common: dict):
    """(name, function of a list of source ids, the sentences it decodes) of this repo's
    decoders. They get their prepacked copies once, as the engine packs its weights when it
    loads (translate_ids makes one per call: once per file for translate.py)."""
    packed = decoding_model(model, common["batch_size"])
    packed_beam = decoding_model(model, common["batch_size"] * args.beam)
    everything = range(n)
    runs = [("this repo, greedy", lambda part: translate_ids(packed, part, **common),
             everything),
            (f"this repo, beam {args.beam}", lambda part: translate_ids(
                packed_beam, part, **common, beam=args.beam, alpha=args.alpha), everything),
            (f"this repo, beam {args.beam}, k finished", lambda part: translate_ids(
                packed_beam, part, **common, beam=args.beam, alpha=args.alpha,
                early_stop=False), everything)]
    if args.single:
        runs.append((f"one at a time, no cache (first {args.single})",
                     lambda part: [translate_ids(packed, [i], **{**common, "batch_size": 1},
                                                 use_cache=False)[0] for i in part],
                     range(min(args.single, n))))
    if args.variants:
        for name, variant in variants(model).items():
            runs.append((f"this repo {name}, greedy",
                         lambda part, m=variant: translate_ids(m, part, **common), everything))
    return runs


def engine_decoders(args, engines_by_name: dict, n: int, common: dict):
    """The CTranslate2 decoders, as this_repos_decoders."""
    runs = []
    for name, engine in engines_by_name.items():
        runs.append((f"CTranslate2 {name}, greedy",
                     lambda part, e=engine: e.translate_ids(part, **common), range(n)))
        if name == "float32":
            runs.append((f"CTranslate2 {name}, beam {args.beam}",
                         lambda part, e=engine: e.translate_ids(
                             part, **common, beam=args.beam, alpha=args.alpha), range(n)))
    return runs


def report(runs, outputs, times, references, tok_tgt):
    """The table (seconds, tokens/s, BLEU, chrF, agreement with this repo's greedy), and the
    ratio of this repo's greedy to the engine's float32 greedy."""
    rows = [(name, [outputs[name][i] for i in sentences], statistics.median(times[name]))
            for name, _, sentences in runs]
    greedy = rows[0][1]
    print(f"\n{'':40} {'seconds':>8} {'tokens/s':>9} {'BLEU':>6} {'chrF':>6} "
          f"{'= greedy':>9}")
    for name, outs, seconds in rows:
        tokens = sum(len(o) + 1 for o in outs)  # with the [EOS]
        same = sum(a == b for a, b in zip(outs, greedy))
        scores = score([detokenize(tok_tgt, o) for o in outs], references[:len(outs)],
                       error_rates=False, n_bootstrap=1)
        print(f"{name:40} {seconds:8.2f} {tokens / seconds:9,.0f} {scores['bleu']:6.2f} "
              f"{scores['chrf']:6.2f} {same:5d}/{len(outs)}")
    engine = "CTranslate2 float32, greedy"
    if engine in times:
        # The two greedy decoders take turns on every batch: their ratio drifts least.
        ratios = sorted(b / a for a, b in zip(times["this repo, greedy"], times[engine]))
        print(f"\nthis repo's greedy / CTranslate2 float32 greedy, tokens/s: "
              f"{statistics.median(ratios):.2f}x, the median of the {len(ratios)} passes' "
              f"ratios ({', '.join(f'{r:.2f}' for r in ratios)}); target >= 0.8")
    signature = score(["x"], ["x"], n_bootstrap=1)["report"].splitlines()[0]
    print(f"sacreBLEU: {signature.split('(')[-1][:-1]}")


def main(argv=None):
    args, config, given = parse_args(argv)
    model, config, tok_src, tok_tgt = load_translator(config, given, args.checkpoint,
                                                      args.average)
    threads = torch.get_num_threads()  # --threads (load_translator applies it), for every decoder
    folder = Path(args.data_dir_test)
    sources = read_lines(folder / f"{args.split}.{config.lang_src}")
    references = read_lines(folder / f"{args.split}.{config.lang_tgt}")
    if args.sentences:
        sources, references = sources[:args.sentences], references[:args.sentences]
    ids = [e.ids for e in tok_src.encode_batch(sources)]
    batch = args.batch_size or 100
    common = dict(sos_id=SOS, eos_id=EOS, pad_id=PAD, seq_len=config.seq_len, unk_id=UNK,
                  batch_size=batch, max_len_a=config.max_len_a, max_len_b=config.max_len_b,
                  min_len=config.min_len)
    print(f"{len(sources)} sentences of {folder / args.split}.{config.lang_src}; "
          f"{sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters (d_model "
          f"{config.d_model}, N {config.depth()}); {threads} thread"
          f"{'s' * (threads != 1)}; batches of {batch}; "
          f"output at most {config.max_len_a:g} x source + {config.max_len_b} tokens")
    runs = this_repos_decoders(args, model, len(ids), common)
    runs += ensemble_decoders(args, config, given, sources, ids, common)
    with tempfile.TemporaryDirectory() as tmp:
        exported = engines(model, config, tok_src, tok_tgt, Path(tmp), threads)
        runs += engine_decoders(args, exported, len(ids), common)
        outputs, times = decode_in_turn(runs, ids, batch, args.repeats)
    report(runs, outputs, times, references, tok_tgt)
    if next(model.parameters()).is_cuda:
        report_attention_kernels(runs[:2], ids, batch)


def report_attention_kernels(runs, ids, batch: int):
    """The attention kernels of one batch (the longest sentences) of greedy and beam decoding
    with the key/value cache, read from the profiler."""
    from dev.bench import attention_kernels
    longest = sorted(ids, key=len)[-batch:]
    for name, run, _ in runs:
        print(f"attention kernels of one batch of {len(longest)} sentences, {name}:")
        for kernel, count in sorted(attention_kernels(lambda run=run: run(longest)).items()):
            print(f"  {count:5d} x {kernel}")


if __name__ == "__main__":
    run_main("python -m dev.bench_decode", main)
