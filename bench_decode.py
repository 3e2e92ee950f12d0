"""Decoding speed and quality of a trained checkpoint on a test set.

    python bench_decode.py --model_folder weights        # Multi30k test_2016_flickr by default

Times three decoders on the same sentences and checks they agree:
  1. the write-ups' way: one sentence at a time, the whole decoder re-run over the whole prefix
     for every new token (on the first --single sentences; all 1,000 take about a minute);
  2. batched greedy with the key/value cache (every sentence);
  3. batched beam search (--beam, --alpha) with the cache (every sentence);
and prints sentences/s, the speed-ups, and sacreBLEU / chrF of greedy and beam.
"""

import time
from pathlib import Path

import torch

from config import ArgumentParser, add_config_arguments, config_from_args, run_main
from dataset import EOS, PAD, SOS, UNK, detokenize
from model import translate_ids
from translate import TRANSLATE_FIELDS, load_translator, read_lines, score


def timed(fn):
    started = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - started


def main(argv=None):
    parser = ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", help="checkpoint file (default: newest in "
                        "--model_folder)")
    parser.add_argument("--split", default="test_2016_flickr",
                        help="files {data_dir}/{split}.{lang} to translate and score")
    parser.add_argument("--single", type=int, default=1000, help="sentences decoded the "
                        "write-ups' way (one at a time, no cache); 0 = skip")
    parser.add_argument("--beam", type=int, default=4)
    parser.add_argument("--alpha", type=float, default=0.6)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0 = default)")
    add_config_arguments(parser, visible=TRANSLATE_FIELDS)
    parser.set_defaults(data_dir="data/multi30k")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    config, given = config_from_args(args)
    model, config, tok_src, tok_tgt = load_translator(config, given, args.checkpoint)
    data_dir = Path(args.data_dir)
    sources = read_lines(data_dir / f"{args.split}.{config.lang_src}")
    references = read_lines(data_dir / f"{args.split}.{config.lang_tgt}")
    ids = [e.ids for e in tok_src.encode_batch(sources)]
    special = dict(sos_id=SOS, eos_id=EOS, pad_id=PAD, seq_len=config.seq_len, unk_id=UNK)
    batch = args.batch_size or 100
    device = next(model.parameters()).device
    print(f"{len(sources)} sentences of {data_dir / args.split}.{config.lang_src}; model "
          f"d_model {config.d_model}, N {config.N}; device {device} "
          f"({torch.get_num_threads()} threads); batches of {batch}")

    def decode(texts):
        return [detokenize(tok_tgt, o) for o in texts]

    for beam in (1, args.beam):  # warm-up: one batch of each
        translate_ids(model, ids[:batch], **special, beam=beam, batch_size=batch)
    greedy, t_greedy = timed(lambda: translate_ids(model, ids, **special, batch_size=batch))
    beam, t_beam = timed(lambda: translate_ids(model, ids, **special, beam=args.beam,
                                               alpha=args.alpha, batch_size=batch))
    rows = [("batched greedy, cached", len(ids), t_greedy),
            (f"batched beam {args.beam}, cached", len(ids), t_beam)]
    if args.single:
        n = min(args.single, len(ids))
        single, t_single = timed(lambda: [translate_ids(model, [i], **special, batch_size=1,
                                                        use_cache=False)[0] for i in ids[:n]])
        rows.insert(0, ("one at a time, full re-decode", n, t_single))
        same = sum(a == b for a, b in zip(single, greedy[:n]))
    print(f"\n{'':34} {'sentences':>9} {'seconds':>8} {'sent/s':>8}")
    for name, count, seconds in rows:
        print(f"{name:34} {count:9d} {seconds:8.2f} {count / seconds:8.1f}")
    print()
    if args.single:
        speedup = (len(ids) / t_greedy) / (n / t_single)
        print(f"batched cached greedy / one-at-a-time full re-decode: {speedup:.1f}x "
              f"(target >= 20); identical outputs: {same} of {n}")
    print(f"beam {args.beam} time / greedy time: {t_beam / t_greedy:.2f}x (target <= 3)")
    for name, outputs in (("greedy", greedy), (f"beam {args.beam}", beam)):
        print(f"{name}:\n{score(decode(outputs), references, error_rates=False)['report']}")


if __name__ == "__main__":
    run_main("bench_decode.py", main)
