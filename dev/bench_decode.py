"""Decoding speed and quality of a trained checkpoint, side by side with CTranslate2.

    python -m dev.bench_decode --model_folder weights --threads 2     # Multi30k test_2016_flickr

One run, one trained model, the same sentences, the same thread count, the same length rules
(the checkpoint's --max_len_a/--max_len_b/--min_len), the same batches (translate.py's:
--batch_size, else each search's default):
  this repo: batched greedy and beam search with the key/value cache (fp32) over the fast
             step (nmt/decoder_step.py, as translate.py decodes) and over model.py's decoder
             (the reference), beam search with its early stop (OpenNMT's, the default) and
             with fairseq's (k finished hypotheses: exact, and slower), and, with --variants,
             the same greedy in bf16 and with dynamic int8 linear layers;
  with --ensemble_with MODEL [MODEL ...]: the model and those as one ensemble (the mean of
             their log-probabilities, translate.py --ensemble), greedy and beam;
  CTranslate2 (if installed): the model exported by export.py (into a temporary folder) in
             float32, greedy and beam; and in int8, greedy (as translate.py --ctranslate2
             calls it: greedy one call per batch, beam one call per output-length limit);
             each engine in a process of its own, as a user runs it (torch's OpenMP threads
             and the engine's slow each other down in one process; the ids and the outputs
             go through a pipe, within the engine's times);
             with several threads, float32 greedy also as that many replicas decoding as many
             batches at once, one thread each (the engine's inter_threads), as this repo's
             greedy decodes them.
For each: seconds (the median of --repeats passes; greedy decoders take turns batch by batch),
target tokens/s (tokens output, [EOS] counted), sacreBLEU BLEU and chrF,
and how many outputs are identical to this repo's greedy ones. Then the ratios the decoders are
held to (the targets: greedy at least 1.0, beam search at least 1.3): this repo's greedy
sentences/s over CTranslate2 float32 greedy's, taken in each pass (the two decode each batch one
right after the other), and this repo's beam search over the engine's, each pass's pair run one
right after the other; the median of the passes printed, with every pass's.

    python -m dev.bench_decode --model_folder weights --threads 2 --profile

--profile: instead, where the time of one greedy batch and of one beam batch goes (the
--batch_size, else 100, sentences of middle length), with the fast step and with model.py's,
per decoding step: the C layers (nmt/decoder_step.c, where the model's design has them),
matrix products, attention, the cache and the beams' reordering, choosing tokens (the C
candidates among them), norms and other operators (each operator's own time in the profiler,
less the profiler's own cost shared evenly among them), the encoder (once a batch, the C one
too), and Python and dispatch around them (the unprofiled time less the operators').
"""

import contextlib
import copy
import multiprocessing
import signal
import statistics
import tempfile
import time
import warnings
from pathlib import Path

import torch

from config import (LENGTH_PENALTY, add_locating_arguments, checkpoint_config,
                    decode_batch_size)
from corpus import read_lines
from nmt.cli import ArgumentParser, run_main
import nmt.decoding
from nmt.decoder_step import NativeLayers
from nmt.decoding import decoding_model, translate_ids
from nmt.metrics import score
from nmt.trained_model import load_ensemble, load_translator
from tokenizer import EOS, PAD, SOS, UNK, detokenize


def engines(model, config, tok_src, tok_tgt, folder: Path, threads: int):
    """CTranslate2 exports of `model` in float32 and int8, each loaded in a process of its own
    (EngineProcess) on the model's device (CPU or CUDA) with `threads` threads a batch; with
    several threads, the float32 one also as `threads` replicas decoding as many batches at
    once, one thread each (the engine's inter_threads); {} without ctranslate2, or where it
    cannot load on that device (one line says why)."""
    try:
        import ctranslate2  # noqa: F401
    except ImportError:
        print("ctranslate2 is not installed: its rows are left out (pip install ctranslate2)")
        return {}
    from nmt.engine import export
    device = next(model.parameters()).device.type
    out = {}
    kinds = [("float32", threads, 1), ("int8", threads, 1)]
    if threads > 1:
        kinds.insert(1, (f"float32, {threads} batches at once", 1, threads))
    started = {}  # each engine's process, loading while the next one starts
    try:
        for name, intra, at_once in kinds:
            quantization = name.split(",")[0]
            path = folder / quantization
            if not path.exists():
                export(model, config, tok_src, tok_tgt, path, quantization)
            started[name] = EngineProcess(path, tok_src, tok_tgt, device, intra, at_once,
                                          wait=False)
        for name, engine in started.items():
            try:
                engine.ready()
                out[name] = engine
            except RuntimeError as e:  # e.g. built for another CUDA release
                print(f"CTranslate2 {name} on {device} cannot run: {e}; its rows are left out")
    except BaseException:  # an export failed, or Ctrl-C: end the processes started
        for engine in started.values():
            engine.close()
        raise
    return out


class EngineProcess:
    """A CTranslate2 engine (nmt.engine.Engine) in a process of its own, decoding the sentences
    this process sends it, as a user runs the engine. Not in this process: CTranslate2 and
    torch each bring an OpenMP runtime of their own, and once both have run parallel regions in
    one process, each runtime's threads stop spinning between regions and every region waits
    for its threads to wake (on 2 cores of an AMD EPYC with AVX512-BF16, the engine's greedy on
    two threads a batch took 2.85 s there against 1.14 s alone, and this repo's beam search 1.45
    times as long after one call of the engine; dev/LOG.md). Raises RuntimeError (its first
    line) where the engine cannot load or run on `device`."""

    def __init__(self, path: Path, tok_src, tok_tgt, device: str, threads: int, at_once: int,
                 wait: bool = True):
        context = multiprocessing.get_context("spawn")
        self.connection, child = context.Pipe()
        self.process = context.Process(target=serve_engine, daemon=True, args=(
            child, str(path), tok_src.to_str(), tok_tgt.to_str(), device, threads, at_once))
        self.process.start()
        child.close()
        if wait:
            self.ready()

    def ready(self):
        """Waits until the engine has loaded and run once (a CUDA build finds its libraries
        only then): several processes started with wait=False load side by side."""
        try:
            self.answer()
        except BaseException:
            self.close()
            raise

    def translate_ids(self, src_ids, **options):
        """As nmt.engine.Engine.translate_ids (no progress callback)."""
        try:
            self.connection.send((src_ids, options))
        except OSError:  # the process has ended
            raise RuntimeError("the engine's process ended") from None
        return self.answer()

    def answer(self):
        try:
            kind, value = self.connection.recv()
        except (EOFError, OSError):
            raise RuntimeError("the engine's process ended") from None
        if kind == "error":
            raise RuntimeError(value)
        return value

    def close(self):
        """Ends the process (asked to; stopped after 30 s if it does not)."""
        with contextlib.suppress(OSError):  # it may have ended already
            self.connection.send(None)
        self.process.join(timeout=30)
        if self.process.is_alive():
            self.process.terminate()
            self.process.join()
        self.connection.close()


def serve_engine(connection, path: str, src: str, tgt: str, device: str, threads: int,
                 at_once: int):
    """An EngineProcess's own loop: loads the engine ("ready", or "error" and the end), then
    answers each (ids, options) with ("done", its translations) or ("error", the first line of
    what went wrong), until None or the other end closes. Ctrl-C is the parent's to handle
    (the whole process group gets it): ignored here."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    from tokenizers import Tokenizer

    from nmt.engine import Engine
    torch.set_num_threads(1)  # no parallel region of torch's beside the engine's

    def attempt(work, *args, **options):
        try:
            return "done", work(*args, **options)
        except Exception as e:  # noqa: BLE001 (said in the parent, one line)
            return "error", (str(e) or type(e).__name__).splitlines()[0]

    def load():
        engine = Engine(Path(path), Tokenizer.from_str(src), Tokenizer.from_str(tgt), device,
                        threads, at_once)
        engine.translator.translate_batch([[engine.tokens[4]]], max_decoding_length=2)
        return engine
    with contextlib.suppress(EOFError, OSError):  # the parent went away
        kind, engine = attempt(load)
        connection.send((kind, None if kind == "done" else engine))
        while kind == "done" and (request := connection.recv()) is not None:
            ids, options = request
            connection.send(attempt(engine.translate_ids, ids, **options))


def decode_in_turn(runs, ids, batch: int, repeats: int, at_once: int = 1):
    """Times every decoder on the same sentences, `repeats` passes. Within a pass the greedy
    decoders take turns every `at_once` batches (the sentences sorted by length, longest
    first, as the decoders batch them: the decoders that decode several batches at once get
    that many), so that a slow moment of this machine falls on all of them alike, this repo's
    first and the engine's float32 right after it; then each beam search decodes all its
    sentences in one call (the engine groups them by output-length limit across the whole set, as
    translate.py --ctranslate2 does). Before the timed passes, one untimed batch each (the
    longest: allocations, thread pools). Returns per decoder {sentence: output ids} and the
    seconds of each pass."""
    order = sorted(range(len(ids)), key=lambda i: len(ids[i]), reverse=True)
    batches = [order[i:i + batch * at_once] for i in range(0, len(order), batch * at_once)]
    pairs = ["this repo, greedy", "CTranslate2 float32, greedy", *beam_pair(runs)]
    turns = sorted(runs, key=lambda r: pairs.index(r[0]) if r[0] in pairs else len(pairs))
    greedy = [r for r in turns if "beam" not in r[0]]
    outputs = {name: {} for name, _, _ in runs}
    times = {name: [0.0] * repeats for name, _, _ in runs}

    def decode(name, run, sentences, r):
        started = time.perf_counter()
        outputs[name].update(zip(sentences, run([ids[i] for i in sentences])))
        times[name][r] += time.perf_counter() - started

    for _, run, sentences in turns:
        run([ids[i] for i in batches[0] if i in sentences] or [ids[0]])  # untimed
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


def beam_pair(runs):
    """The names of this repo's beam search and the engine's float32 one, timed one right
    after the other in each pass."""
    ours = next((name for name, _, _ in runs if name.startswith("this repo, beam")), "")
    return [ours, ours.replace("this repo", "CTranslate2 float32")]


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


# ---- --profile: where a batch's time goes -------------------------------------------------------

C_LAYERS, C_CANDIDATES = "decoder_step.c: layers", "decoder_step.c: top_logits"  # ranges
C_ENCODER = "decoder_step.c: encoder_layers"  # inside the encoder's range
PROFILE_PARTS = {  # the operators of each part (their own time); the rest: norms and other
    "the C layers": {C_LAYERS},
    "matrix products": {"aten::mm", "aten::addmm", "aten::linear", "mkldnn::_linear_pointwise"},
    "attention": {"aten::bmm", "aten::baddbmm", "aten::_softmax", "aten::softmax",
                  "aten::_scaled_dot_product_flash_attention_for_cpu"},
    "cache and reordering": {"aten::index_select", "aten::copy_", "aten::index", "aten::cat",
                             "aten::repeat_interleave", "aten::clone", "aten::empty"},
    "choosing tokens": {"aten::argmax", "aten::amax", "aten::max", "aten::topk", "aten::sort",
                        "aten::argsort", "aten::gather", "aten::_log_softmax", "aten::eq",
                        "aten::nonzero", "aten::any", "aten::isfinite", "aten::index_fill_",
                        "aten::masked_fill_", "aten::lt", "aten::ge", "aten::bitwise_and",
                        "aten::item", "aten::_local_scalar_dense", C_CANDIDATES},
}
ENCODER = "encoder (once a batch)"


def profile_split(events, wall_us: float, profiled_us: float):
    """(steps, {part: microseconds}) of a profiled batch: each operator's own time in its part
    (under the encoder's range: the encoder's), less the profiler's own cost (profiled_us, the
    batch's time under the profiler, less wall_us, its time without, shared evenly among the
    operators), and Python and dispatch as wall_us less the operators' time so counted. Steps:
    the decoder's embedding lookups."""
    def in_encoder(event):
        while event is not None:
            if event.name == ENCODER:
                return True
            event = event.cpu_parent
        return False
    operators = [e for e in events if e.name != ENCODER]
    cost = max(0.0, profiled_us - wall_us) / max(len(operators), 1)  # the profiler's, each
    split, steps = {}, 0
    for event in operators:
        encoder = in_encoder(event)
        steps += event.name == "aten::embedding" and not encoder
        part = ENCODER if encoder else next(
            (p for p, names in PROFILE_PARTS.items() if event.name in names), "norms and other")
        split[part] = split.get(part, 0.0) + max(0.0, event.self_cpu_time_total - cost)
    split["Python and dispatch"] = max(0.0, wall_us - sum(split.values()))
    return steps, split


def profile(model, ids, common: dict, beam: int):
    """Prints where one greedy batch's and one beam batch's time goes (profile_split): the
    batch of middle-length sentences, decoded as translate.py does (the FastDecoder where it
    applies), timed unprofiled (the median of 5, after 3 untimed) and profiled once."""
    from torch.profiler import profile as profiler
    from torch.profiler import record_function
    batch = common["batch_size"]
    middle = sorted(ids, key=len)[max(0, len(ids) // 2 - batch // 2):][:batch]

    def in_ranges(function, *names):  # function's calls inside the profiler's ranges
        def call(*args):
            with contextlib.ExitStack() as ranges:
                for name in names:
                    ranges.enter_context(record_function(name))
                return function(*args)
        return call
    # The FastDecoder encodes with the model's own encoder, or with the C step's; a C call's
    # time shows as its range's own.
    model.encode = in_ranges(model.encode, ENCODER)
    patches = {(NativeLayers, "encode"): (ENCODER, C_ENCODER), (NativeLayers, "__call__"):
               (C_LAYERS,), (nmt.decoding, "top_logits"): (C_CANDIDATES,)}
    originals = {(owner, name): getattr(owner, name) for owner, name in patches}
    for (owner, name), names in patches.items():
        setattr(owner, name, in_ranges(originals[owner, name], *names))
    try:
        profile_searches(model, middle, common, beam, batch, profiler)
    finally:
        del model.encode  # the class's method again
        for (owner, name), original in originals.items():
            setattr(owner, name, original)


def profile_searches(model, middle, common: dict, beam: int, batch: int, profiler):
    """profile()'s four searches, each timed unprofiled and profiled once."""
    for name, width, fast in (("greedy", 1, True), (f"greedy, {MODEL_STEP}", 1, False),
                              (f"beam {beam}", beam, True),
                              (f"beam {beam}, {MODEL_STEP}", beam, False)):
        decoder = decoding_model(model, batch * width, fast)

        def run(decoder=decoder, width=width, fast=fast):
            translate_ids(decoder, middle, **common, beam=width, fast_step=fast)
        for _ in range(3):
            run()
        seconds = []
        for _ in range(5):
            started = time.perf_counter()
            run()
            seconds.append(time.perf_counter() - started)
        wall = statistics.median(seconds) * 1e6
        with profiler() as prof:
            started = time.perf_counter()
            run()
            profiled = (time.perf_counter() - started) * 1e6
        steps, split = profile_split(prof.events(), wall, profiled)
        print(f"\n{name}, {len(middle)} sentences ({type(decoder).__name__}): "
              f"{wall / 1e3:.1f} ms unprofiled, {steps} decoding steps, "
              f"{wall / max(steps, 1):.0f} us a step")
        for part, us in sorted(split.items(), key=lambda kv: -kv[1]):
            print(f"  {part:28} {us / 1e3:8.1f} ms {us / max(steps, 1):8.0f} us a step "
                  f"{100 * us / sum(split.values()):5.1f}%")


def parse_args(argv):
    parser = ArgumentParser(prog="python -m dev.bench_decode", description=__doc__.split("\n\n")[0])
    parser.add_argument("--data_dir_test", metavar="DIR", default="data/multi30k",
                        help="folder of the test files (default: data/multi30k)")
    parser.add_argument("--split", default="test_2016_flickr",
                        help="files DIR/{split}.{lang} to translate and score")
    parser.add_argument("--sentences", type=int, default=0, metavar="N",
                        help="only the first N sentences of the split (0: all)")
    parser.add_argument("--beam", type=int, default=4)
    parser.add_argument("--alpha", type=float, default=LENGTH_PENALTY)
    parser.add_argument("--variants", action="store_true", help="also this repo's greedy in "
                        "bf16 and with dynamic int8 linear layers")
    parser.add_argument("--repeats", type=int, default=3, help="timed passes of each decoder, "
                        "interleaved; the median is reported")
    parser.add_argument("--single", type=int, default=0, metavar="N", help="also the "
                        "write-ups' decoder on the first N sentences: one at a time, the whole "
                        "prefix re-decoded for every token (no cache)")
    parser.add_argument("--profile", action="store_true", help="instead: where one greedy "
                        "and one beam batch's time goes, per decoding step")
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
    packed = decoding_model(ensemble, common["batch_size"] or decode_batch_size())
    packed_beam = decoding_model(
        ensemble, (common["batch_size"] or decode_batch_size(args.beam)) * args.beam)
    name = f"this repo, ensemble of {len(ensemble.members)}"
    return [(f"{name}, greedy", lambda part: translate_ids(
                packed, [per_model[tuple(i)] for i in part], **common), range(len(ids))),
            (f"{name}, beam {args.beam}", lambda part: translate_ids(
                packed_beam, [per_model[tuple(i)] for i in part], **common, beam=args.beam,
                alpha=args.alpha), range(len(ids)))]


MODEL_STEP = "model.py's step"  # the searches over model.py's decoder: the reference


def this_repos_decoders(args, model, n: int, common: dict):
    """(name, function of a list of source ids, the sentences it decodes) of this repo's
    decoders: the fast step's (laid out once, as the engine lays out its weights when it
    loads; translate_ids lays it out once a call: once a file for translate.py), and the same
    searches over model.py's decoder step."""
    packed = decoding_model(model, common["batch_size"] or decode_batch_size())
    packed_beam = decoding_model(
        model, (common["batch_size"] or decode_batch_size(args.beam)) * args.beam)
    everything = range(n)
    runs = [("this repo, greedy", lambda part: translate_ids(packed, part, **common),
             everything),
            (f"this repo, beam {args.beam}", lambda part: translate_ids(
                packed_beam, part, **common, beam=args.beam, alpha=args.alpha), everything),
            (f"this repo, beam {args.beam}, k finished", lambda part: translate_ids(
                packed_beam, part, **common, beam=args.beam, alpha=args.alpha,
                early_stop=False), everything),
            (f"this repo, greedy, {MODEL_STEP}", lambda part: translate_ids(
                model, part, **common, fast_step=False), everything),
            (f"this repo, beam {args.beam}, {MODEL_STEP}", lambda part: translate_ids(
                model, part, **common, beam=args.beam, alpha=args.alpha, fast_step=False),
             everything)]
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

        if name.startswith("float32"):
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
    print(f"\n{'':48} {'seconds':>8} {'tokens/s':>9} {'BLEU':>6} {'chrF':>6} "
          f"{'= greedy':>9}")
    for name, outs, seconds in rows:
        tokens = sum(len(o) + 1 for o in outs)  # with the [EOS]
        same = sum(a == b for a, b in zip(outs, greedy))
        scores = score([detokenize(tok_tgt, o) for o in outs], references[:len(outs)],
                       error_rates=False, n_bootstrap=1)
        print(f"{name:48} {seconds:8.2f} {tokens / seconds:9,.0f} {scores['bleu']:6.2f} "
              f"{scores['chrf']:6.2f} {same:5d}/{len(outs)}")
    print()
    ours_beam, engine_beam = beam_pair(runs)
    pairs = [("this repo, greedy", "CTranslate2 float32, greedy", 1.0),
             (ours_beam, engine_beam, 1.3)]
    for name in times:  # the engine's replicas decoding batches at once, if timed
        if name.startswith("CTranslate2 float32, ") and "batches at once" in name:
            pairs.append((ours_beam if "beam" in name else "this repo, greedy", name,
                          1.3 if "beam" in name else 1.0))
    for ours, engine, target in pairs:
        if engine in times:  # each pass: the two one right after the other
            ratios = sorted(b / a for a, b in zip(times[ours], times[engine]))
            each = ", ".join(f"{r:.2f}" for r in ratios)
            print(f"{ours} / {engine}, sentences/s: {statistics.median(ratios):.2f}x, the "
                  f"median of the {len(ratios)} passes' ratios ({each}); target >= {target}")
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
    # translate.py's batches: --batch_size, else each search's default (greedy's, beam's);
    # --profile: one batch of --batch_size, else 100, sentences for both
    batch, beam_batch = (args.batch_size or (100 if args.profile else decode_batch_size(b))
                         for b in (1, args.beam))
    common = dict(sos_id=SOS, eos_id=EOS, pad_id=PAD, seq_len=config.seq_len, unk_id=UNK,
                  batch_size=args.batch_size, max_len_a=config.max_len_a,
                  max_len_b=config.max_len_b, min_len=config.min_len)
    print(f"{len(sources)} sentences of {folder / args.split}.{config.lang_src}; "
          f"{sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters (d_model "
          f"{config.d_model}, N {config.depth()}); {threads} thread"
          f"{'s' * (threads != 1)}; batches of {batch} (greedy), {beam_batch} (beam); "
          f"output at most {config.max_len_a:g} x source + {config.max_len_b} tokens")
    if args.profile:
        return profile(model, ids, {**common, "batch_size": batch}, args.beam)
    runs = this_repos_decoders(args, model, len(ids), common)
    runs += ensemble_decoders(args, config, given, sources, ids, common)
    with tempfile.TemporaryDirectory() as tmp:
        exported = engines(model, config, tok_src, tok_tgt, Path(tmp), threads)
        try:
            runs += engine_decoders(args, exported, len(ids), common)
            outputs, times = decode_in_turn(runs, ids, batch, args.repeats, threads)
        finally:
            for engine in exported.values():
                engine.close()
    report(runs, outputs, times, references, tok_tgt)
    if next(model.parameters()).is_cuda:
        report_attention_kernels(runs[:2], ids, (batch, beam_batch))


def report_attention_kernels(runs, ids, batches):
    """The attention kernels of one batch (the longest sentences) of greedy and beam decoding
    with the key/value cache (runs: those two; batches: their sizes), read from the profiler."""
    from dev.bench import attention_kernels
    for (name, run, _), batch in zip(runs, batches):
        longest = sorted(ids, key=len)[-batch:]
        print(f"attention kernels of one batch of {len(longest)} sentences, {name}:")
        kernels = attention_kernels(lambda run=run, longest=longest: run(longest))
        for kernel, count in sorted(kernels.items()):
            print(f"  {count:5d} x {kernel}")


if __name__ == "__main__":
    run_main("python -m dev.bench_decode", main)
