"""The benchmark scripts: their FLOP count, the decoding comparison, the picture."""

import dataclasses
from unittest import mock

import pytest
import torch
from conftest import ROOT, run_here

from config import Config


@pytest.mark.parametrize("options", [{}, {"n_kv_heads": 2}, {"n_kv_heads": 1, "ffn": "swiglu"},
                                     {"N_dec": 1}, {"N_dec": 3}])
def test_the_benchmarks_flop_count_is_the_models(options):
    """19. bench.py's FLOP count ignored n_kv_heads (MFU overstated for grouped-query
    attention). Counted here against torch's FLOP counter over the written-out attention."""
    from torch.utils.flop_counter import FlopCounterMode

    from dev.timing import model_flops
    from nmt.trained_model import build_model
    config = Config(d_model=64, N=2, h=4, d_ff=128, seq_len=32, **options)
    model = build_model(config, 50, 60).eval()
    for module in model.modules():
        if hasattr(module, "use_reference"):
            module.use_reference = True
    src, tgt = torch.randint(4, 50, (3, 10)), torch.randint(4, 60, (3, 7))
    with FlopCounterMode(display=False) as counter:
        model(src, tgt, torch.ones(3, 1, 1, 10, dtype=torch.bool))
    batch = {"encoder_input": src, "decoder_input": tgt}
    assert model_flops(config, batch, 60) == 3 * counter.get_total_flops()
    # issue 70, 7: a fixed shape's filler rows (no target token) are no useful work
    from tokenizer import EOS, PAD
    label = torch.cat([tgt[:, 1:], torch.full((3, 1), EOS)], dim=1)  # (3, 7)
    filler = {"encoder_input": torch.cat([src, torch.full((2, 10), PAD)]),
              "decoder_input": torch.cat([tgt, torch.full((2, 7), PAD)]),
              "label": torch.cat([label, torch.full((2, 7), PAD)])}
    assert model_flops(config, filler, 60) == model_flops(config, batch, 60)
    # and the columns a fixed shape adds past the longest pair (PAD on both sides)
    wider = {key: torch.cat([value, torch.full((5, 4), PAD)], dim=1)
             for key, value in filler.items()}  # (5, 14) and (5, 11)
    assert model_flops(config, wider, 60) == model_flops(config, batch, 60)
    shorter = {key: torch.cat([value[:, :-2], torch.full((3, 2), PAD)], dim=1)
               for key, value in {**batch, "label": label}.items()}  # a pair 2 shorter a side
    assert model_flops(config, shorter, 60) < model_flops(config, batch, 60)


@pytest.mark.parametrize("attention_dropout", [0.1, 0.0])  # on CPU: written out, or torch's
def test_the_split_of_a_step_puts_each_operation_in_its_part(attention_dropout):
    """Issue 44: bench.py's profiler split of a training step. Attention's products (forward and
    backward, written out on CPU with attention dropout, torch's fused kernel without) count as
    attention, the projection's as the loss, fused Adam as the optimizer, and the layers'
    products as matrix products."""
    from dev.bench import SPLIT, Step, profile_split, split_events
    from dataset import Collator
    from nmt.trained_model import build_model
    config = Config(d_model=32, N=2, h=4, d_ff=64, seq_len=32, attention_dropout=attention_dropout)
    torch.manual_seed(0)
    step = Step(build_model(config, 60, 60).train(), config, torch.device("cpu"))
    items = [{key: torch.randint(4, 60, (n,)) for key in ("encoder_input", "decoder_input",
                                                           "label")} for n in (9, 7, 12)]
    batch = Collator()(items)
    step(batch, record=False)
    shares, uncovered = profile_split(step, [batch])
    assert list(shares) == SPLIT and all(share > 0 for share in shares.values()), shares
    assert 0 <= uncovered < 100 and sum(shares.values()) <= 100 + 1e-6

    from torch.profiler import ProfilerActivity, profile

    from dev.bench import attention_in_a_range
    with attention_in_a_range(), profile(activities=[ProfilerActivity.CPU]) as prof:
        step(batch, record=False)
    ops = {}
    for part, op in split_events(prof.events(), cuda=False):
        ops.setdefault(part, set()).add(op)
    attention = {"aten::bmm"} if attention_dropout else \
        {"aten::_scaled_dot_product_flash_attention_for_cpu_backward"}
    assert attention <= ops["attention"], ops["attention"]
    assert "aten::bmm" not in ops["matrix products"]  # the backward products are found too
    assert {"aten::mm", "aten::addmm"} & ops["loss (its projection included)"]
    assert "aten::_fused_adam_" in ops["optimizer"] and "aten::mm" in ops["matrix products"]


def test_the_split_on_a_gpu_counts_each_kernel_where_its_operation_belongs():
    """The same split on CUDA reads the kernels' times under each operation: a GEMM under a
    matrix product, attention's kernels forward and backward under attention, the
    projection's GEMM under the loss, Adam's kernel under the optimizer. Events made by hand,
    as torch.profiler gives them (no GPU here)."""
    from types import SimpleNamespace

    from torch.autograd.profiler_util import Kernel

    from dev.bench import split_events

    def event(name, parent=None, kernels=(), seq=-1, fwd_thread=0):
        return SimpleNamespace(name=name, cpu_parent=parent, is_async=False, sequence_nr=seq,
                               fwd_thread=fwd_thread, thread=1, self_cpu_time_total=1.0,
                               kernels=[Kernel(k, 0, t) for k, t in kernels])
    sdpa = event("aten::scaled_dot_product_attention", seq=7)
    loss = event("ProjectedCrossEntropy")
    step = event("Optimizer.step#Adam.step")
    backward = event("autograd::engine::evaluate_function: FlashAttentionBackward0", seq=7,
                     fwd_thread=1)
    events = [
        event("aten::mm", kernels=[("sm90_xmma_gemm_bf16bf16_bf16f32", 30.0)]),
        sdpa, event("aten::_flash_attention_forward", sdpa, [("flash_fwd_kernel", 10.0)]),
        backward, event("aten::_efficient_attention_backward_x", backward,
                        [("fmha_cutlassB_bf16_aligned", 20.0)]),
        loss, event("aten::addmm", loss, [("nvjet_tst_128x64", 40.0)]),
        step, event("aten::_fused_adam_", step, [("multi_tensor_apply_kernel", 5.0)]),
        event("aten::mul", kernels=[("vectorized_elementwise_kernel", 3.0)]),
        event("flash_fwd_kernel"),  # the GPU's own event: its time is its operation's kernel's
    ]
    parts = {}
    for (part, _), microseconds in split_events(events, cuda=True).items():
        parts[part] = parts.get(part, 0.0) + microseconds
    assert parts == {"matrix products": 30.0, "attention": 30.0,
                     "loss (its projection included)": 40.0, "optimizer": 5.0,
                     "elementwise and other": 3.0}


def test_bench_validation_times_each_part_and_the_references_in_the_same_run(trained):
    """dev/bench_validation.py, the command docs/training.md gives for a validation's cost: each
    part timed on the trained model, the two fast parts beside their references (which are
    timed: the table's edit distance and a second projection are called)."""
    import dev.bench_validation as bench
    from nmt import metrics
    home, _ = trained
    called, before = {"table": 0, "passes": 0}, sorted((home / "weights").iterdir())
    table, passes = metrics.table_edit_distance, bench.two_passes

    def counted_table(a, b):
        called["table"] += 1
        return table(a, b)

    def counted_passes(*args):
        called["passes"] += 1
        return passes(*args)
    with mock.patch.object(metrics, "table_edit_distance", counted_table), \
            mock.patch.object(bench, "two_passes", counted_passes):
        t = run_here("dev/bench_validation.py", "--init_from", "weights", "--data_dir", "corpus",
                     "--calls", "2", cwd=home)
    assert t.returncode == 0, t.stderr.decode()[-2000:]
    out = t.stdout.decode()
    lines = out[out.index("a validation of 8 sentences ("):].splitlines()  # (after set_up's)
    assert "median of 2 calls" in lines[0], out
    rows = {line[:32].strip(): line[32:].split() for line in lines[2:-1]}
    assert list(rows) == ["loss and nll", "greedy decoding", "BLEU, chrF, lowercased BLEU",
                          "CER and WER", "the attention picture", "in all"], out
    assert len(rows["loss and nll"]) == len(rows["CER and WER"]) == len(rows["in all"]) == 3
    assert len(rows["greedy decoding"]) == 1 and rows["in all"][2].endswith("x")
    # 3 calls (one untimed), each over the 8 sentences twice (CER and WER)
    assert called == {"table": 3 * 2 * 8, "passes": 3 * 1}, called
    assert sorted((home / "weights").iterdir()) == before  # the model's folder untouched


def test_bench_decode_side_by_side_on_a_subset(trained):
    """dev/bench_decode.py as the README runs it: each decoder on the same N sentences, the engine's
    float32 greedy equal to ours, and the ratio taken pass by pass."""
    pytest.importorskip("ctranslate2")
    home, _ = trained
    t = run_here("dev/bench_decode.py", "--preload", "01", "--data_dir_test", "corpus",
                 "--split", "val", "--sentences", "5", "--repeats", "2", "--threads", "1",
                 "--beam", "3", "--ensemble_with", "weights/tmodel_01.pt", cwd=home)
    out = t.stdout.decode()
    assert t.returncode == 0, t.stderr.decode()[-2000:]
    rows = {line[:48].strip(): line.split() for line in out.splitlines() if "/5" in line}
    assert set(rows) == {"this repo, greedy", "this repo, beam 3", "this repo, beam 3, k finished",
                         "this repo, greedy, model.py's step",
                         "this repo, beam 3, model.py's step",
                         "this repo, ensemble of 2, greedy", "this repo, ensemble of 2, beam 3",
                         "CTranslate2 float32, greedy", "CTranslate2 float32, beam 3",
                         "CTranslate2 int8, greedy"}, out
    assert rows["this repo, greedy"][-1] == "5/5" and rows["CTranslate2 float32, greedy"][-1] \
        in ("4/5", "5/5"), out
    # issue 42: the model with itself as an ensemble is the model (and costs about twice)
    assert rows["this repo, ensemble of 2, greedy"][-1] == "5/5", out
    # issue 69: the fast step decodes as model.py's decoder does
    assert rows["this repo, greedy, model.py's step"][-1] == "5/5", out
    assert rows["this repo, beam 3, model.py's step"][-3:] == rows["this repo, beam 3"][-3:]
    assert rows["this repo, ensemble of 2, beam 3"][-3:-1] == rows["this repo, beam 3"][-3:-1]
    assert "5 sentences of corpus/val.en" in out and "the median of the 2 passes' ratios" in out
    # issue 69: both searches against the engine's, each with its target
    assert "this repo, greedy / CTranslate2 float32, greedy, sentences/s: " in out
    assert "this repo, beam 3 / CTranslate2 float32, beam 3, sentences/s: " in out
    assert "target >= 1.0" in out and "target >= 1.3" in out


def test_bench_decode_with_two_threads_times_the_engine_decoding_batches_at_once(trained,
                                                                                monkeypatch):
    """With two threads this repo's greedy decodes two batches at once (one thread each), the
    greedy decoders take turns every two batches, and the engine is timed both ways: two
    threads a batch, and two replicas one batch each (greedy and beam search); the ratios are
    printed against each."""
    pytest.importorskip("ctranslate2")
    import multiprocessing

    import dev.bench_decode as bench
    home, _ = trained
    before = set(multiprocessing.active_children())
    real, taken = bench.decode_in_turn, []
    monkeypatch.setattr(bench, "decode_in_turn", lambda runs, ids, batch, repeats, at_once=1:
                        taken.append(at_once) or real(runs, ids, batch, repeats, at_once))
    t = run_here("dev/bench_decode.py", "--preload", "01", "--data_dir_test", "corpus",
                 "--split", "val", "--sentences", "5", "--repeats", "1", "--threads", "2",
                 "--batch_size", "2", cwd=home)
    out = t.stdout.decode()
    assert t.returncode == 0, t.stderr.decode()[-2000:]
    assert taken == [2]
    assert set(multiprocessing.active_children()) <= before  # its 3 engines' processes ended
    rows = {line[:48].strip(): line.split() for line in out.splitlines() if "/5" in line}
    assert rows["CTranslate2 float32, 2 batches at once, greedy"][-1] == \
        rows["CTranslate2 float32, greedy"][-1], out
    for engine in ("CTranslate2 float32, greedy", "CTranslate2 float32, 2 batches at once, "
                                                  "greedy"):
        assert f"this repo, greedy / {engine}, sentences/s: " in out, out
    # beam search too: the replicas decode two output-length groups at once
    assert rows["CTranslate2 float32, 2 batches at once, beam 4"][-3:] == \
        rows["CTranslate2 float32, beam 4"][-3:], out
    assert "this repo, beam 4 / CTranslate2 float32, 2 batches at once, beam 4, sentences/s: " \
        in out, out


def test_bench_decode_profiles_a_greedy_and_a_beam_batch(trained):
    """dev/bench_decode.py --profile: where one batch's time goes, per decoding step, for the
    fast step (FastDecoder) as translate.py runs it; the parts add up to the unprofiled time."""
    home, _ = trained
    t = run_here("dev/bench_decode.py", "--preload", "01", "--data_dir_test", "corpus",
                 "--split", "val", "--sentences", "6", "--threads", "1", "--beam", "3",
                 "--profile", cwd=home)
    out = t.stdout.decode()
    assert t.returncode == 0, t.stderr.decode()[-2000:]
    for search, decoder in (("greedy", "FastDecoder"),
                            ("greedy, model.py's step", "Transformer"),
                            ("beam 3", "FastDecoder"),
                            ("beam 3, model.py's step", "Transformer")):
        head = next(line for line in out.splitlines() if line.startswith(f"{search}, 6 "))
        assert f"({decoder})" in head and "decoding steps" in head, out
        steps = int(head.split(" decoding steps")[0].split()[-1])
        assert steps > 2, out
    parts = [line.split()[0] for line in out.splitlines() if line.endswith("%")]
    for part in ("matrix", "attention", "cache", "choosing", "encoder", "Python"):
        assert parts.count(part) == 4, out


def test_the_picture_counts_training_minutes_without_the_pause_before_a_resume(tmp_path):
    """Issue 18: plot_runs.py puts validation BLEU against training minutes from the logs."""
    from torch.utils.tensorboard import SummaryWriter

    from dev.plot_runs import curve
    writer = SummaryWriter(str(tmp_path))
    t0 = 1_000_000.0
    for step, (tag, value, minute) in enumerate([
            ("train/loss", 5.0, 0), ("train/loss", 4.0, 1), ("validation/bleu", 10.0, 2),
            ("train/loss", 3.0, 62), ("validation/bleu", 20.0, 63)]):  # an hour's pause
        writer.add_scalar(tag, value, step, walltime=t0 + 60 * minute)
    writer.close()
    assert curve(tmp_path, gap_minutes=10) == [(2.0, 10.0), (3.0, 20.0)]


def test_the_picture_puts_validation_loss_against_steps(tmp_path):
    """Issue 25: two runs compared at equal steps (bf16 against fp32), whatever their speed."""
    from torch.utils.tensorboard import SummaryWriter

    from dev.plot_runs import curve
    writer = SummaryWriter(str(tmp_path))
    for step, tag, value in [(1, "train/loss", 5.0), (120, "validation/loss", 4.5),
                             (120, "validation/bleu", 9.0), (240, "validation/loss", 3.5)]:
        writer.add_scalar(tag, value, step, walltime=1_000_000.0 + step)
    writer.close()
    assert curve(tmp_path, 10, metric="loss", x="steps") == [(120, 4.5), (240, 3.5)]
    assert curve(tmp_path, 10, metric="bleu", x="steps") == [(120, 9.0)]


def test_bench_times_mixed_precision_against_fp32_in_the_same_run(trained):
    """Issue 25: `python -m dev.bench --precision bf16` prints its ratio to fp32, measured in the
    same run on the same batches (this repo's model in both, the same weights)."""
    home, _ = trained
    t = run_here("dev/bench.py", "--data_dir", "corpus", "--lang_tgt", "it", "--d_model", "32",
                 "--N", "1", "--h", "2", "--d_ff", "64", "--vocab_size", "300",
                   "--max_tokens", "200", "--seq_len", "24", "--steps", "2",
                   "--warmup_steps", "1", "--baseline_steps", "0", "--train_steps", "0",
                   "--precision", "bf16", cwd=home)
    out = t.stdout.decode()
    assert t.returncode == 0, t.stderr.decode()[-2000:]
    assert "precision: torch.bfloat16" in out and "this repo, fp32 eager (same batches)" in out
    ratio = out.split("ours as configured / fp32 eager:")[1].split("x")[0]
    assert float(ratio) > 0, out


def test_bench_takes_a_presets_values_and_the_flags_given_over_them():
    """dev/bench.py's own defaults (4,000-token batches, dropout 0.1) overrode a --preset's, so
    `bench.py --preset multi30k_modern` timed another model than the preset trains."""
    from dev.bench import parse
    from config import PRESETS
    preset = PRESETS["multi30k_modern"]
    _, config = parse(["--preset", "multi30k_modern"])
    for name in ("max_tokens", "dropout", "d_model", "N", "seq_len"):
        assert getattr(config, name) == preset[name], name
    assert config.data_dir == "data/multi30k"  # the benchmark's default, which no preset sets
    assert config.model_folder == "weights/bench_en_de_bpe10000_joint"  # not the preset's run
    _, config = parse(["--preset", "multi30k_modern", "--max_tokens", "1000"])
    assert config.max_tokens == 1000
    _, config = parse([])
    assert (config.max_tokens, config.dropout, config.seq_len) == (4000, 0.1, 128)


def test_bench_refuses_bpe_dropout_in_one_line(tmp_path):
    """dev/bench.py --bpe_dropout timed both models on plain batches while its train.py-loop figure
    ran with the flag, so its loop/step ratio mixed the two: refused, pointing to the flag's own
    benchmark."""
    t = run_here("dev/bench.py", "--bpe_dropout", "0.1", "--data_dir", "nowhere", cwd=tmp_path)
    err = t.stderr.decode()
    assert t.returncode == 2, t.stdout
    assert err.count("\n") == 1 and "dev.bench_bpe_dropout" in err, err


def test_the_wmt_like_corpus_has_wmt_lengths_and_one_token_a_word(tmp_path):
    """Issue 44: the synthetic corpus bench.py --wmt_pairs times: lengths of WMT14 en-de after
    BPE (mean 28 a side, a tail past 100), aligned files, words from vocab_size - 10 types."""
    import numpy as np
    from dev.bench import wmt_like_corpus
    folder = wmt_like_corpus(tmp_path / "wmt", 20000, 37000, seed=1)
    src = [len(line.split()) for line in (folder / "train.en").read_text().splitlines()]
    tgt = [len(line.split()) for line in (folder / "train.de").read_text().splitlines()]
    assert len(src) == len(tgt) == 20000 and min(src + tgt) >= 1 and max(src + tgt) <= 250
    assert 27 < np.mean(src) < 29 and 27 < np.mean(tgt) < 30
    assert 0.003 < np.mean(np.array(src) > 100) < 0.02
    assert 0.4 < np.corrcoef(src, tgt)[0, 1] < 1  # a pair's sides are alike, not equal
    words = set((folder / "train.en").read_text().split())
    assert len(words) > 30000 and all(w[0] == "w" and int(w[1:]) < 36990 for w in words)
    assert len((folder / "val.en").read_text().splitlines()) == 500


def test_padding_shares_and_the_order_by_both_sides():
    import numpy as np
    from dev.bench import batches_by_both_sides, padding_shares
    src, tgt = np.array([4, 2, 4, 2]), np.array([1, 3, 1, 3])
    assert padding_shares(src, tgt, [np.array([0, 1]), np.array([2, 3])]) == \
        pytest.approx((0.25, 1 / 3))
    assert padding_shares(src, tgt, [np.array([0, 2]), np.array([1, 3])]) == (0.0, 0.0)
    rng = np.random.default_rng(0)
    src, tgt = rng.integers(1, 60, 500), rng.integers(1, 60, 500)
    batches = batches_by_both_sides(src, tgt, 300)
    assert sorted(np.concatenate(batches).tolist()) == list(range(500))  # each pair once
    assert all(len(b) * (src[b].max() + tgt[b].max()) <= 600 for b in batches)


def test_bench_runs_at_wmt_lengths_with_padding_and_the_loop(tmp_path):
    """dev/bench.py --wmt_pairs on this CPU at a tiny shape: both models on the same batches, the
    padding share of each side both ways, and the whole loop against the step."""
    t = run_here("dev/bench.py", "--wmt_pairs", "400", "--vocab_size", "2000", "--d_model", "32",
                 "--N", "1", "--h", "2", "--d_ff", "64", "--max_tokens", "1200", "--steps", "2",
                 "--warmup_steps", "1", "--baseline_steps", "0", "--train_steps", "2",
                 cwd=tmp_path)
    out = t.stdout.decode()
    assert t.returncode == 0, t.stderr.decode()[-2000:]
    assert "pairs: 400; tokens a side" in out
    for name in ("token batches (train.py)", "by both sides' lengths"):
        assert f"padding, {name}: source " in out
    assert "torch.nn.Transformer (same batches)" in out and "train.py loop / model step" in out
    assert "where this repo's step spends its time (2 more steps" in out
    assert "loss (its projection included)" in out and "outside any operator" in out
    assert (tmp_path / "weights" / "bench_wmt" / "corpus_400_2000" / "train.de").exists()
    from dev.bench import parse  # a preset's folder, vocabulary and seq_len never apply to it
    _, config = parse(["--preset", "multi30k_modern", "--wmt_pairs", "400"])
    assert (config.model_folder, config.vocab_size, config.seq_len, config.d_model) == \
        ("weights/bench_wmt/400_37000", 37000, 256, 128)


def test_bench_times_a_few_batches_each_in_turn(tmp_path):
    """A corpus of fewer batches than warm-up and timed steps (dev/gpu_wmt.sh's TINY=1 rehearsal
    of one compiled shape) timed none and divided by zero: three batches for a warm-up and six
    timed steps are the first, second and third in turn (not the first again and again)."""
    t = run_here("dev/bench.py", "--wmt_pairs", "200", "--vocab_size", "2000", "--d_model", "32",
                 "--N", "1", "--h", "2", "--d_ff", "64", "--max_tokens", "5000", "--steps",
                 "6", "--warmup_steps", "1", "--baseline_steps", "0", "--train_steps", "0",
                 "--profile_steps", "0", cwd=tmp_path)
    out = t.stdout.decode()
    assert t.returncode == 0, t.stderr.decode()[-2000:]
    assert "only 3 batches to time: each is timed again in turn" in out
    real = [int(line.rsplit("(", 1)[1].split()[0]) for line in out.splitlines()
            if line.startswith("  step ")]
    assert len(real) == 7 and len(set(real)) == 3 and real == (real[:3] * 3)[:7], real


def test_bench_data_prepares_resumes_and_trains_its_synthetic_corpus(tmp_path):
    """dev/bench_data.py looked for train.py beside itself (in dev/) once the benchmarks moved
    there, and failed at its first start: its three runs, end to end, on a tiny corpus."""
    import random
    rng = random.Random(2)
    source = tmp_path / "source"
    source.mkdir()
    for language in ("en", "de"):
        words = [f"{language}{i}" for i in range(50)]
        lines = [" ".join(rng.choices(words, k=rng.randint(2, 8))) for _ in range(100)]
        (source / f"train.{language}").write_text("".join(line + "\n" for line in lines))
    t = run_here("dev/bench_data.py", "--source", source, "--out", tmp_path / "out", "--pairs",
                 "400", "--model_folder", tmp_path / "m", "--train_steps", "1",
                 "--num_workers", "0", cwd=tmp_path)
    out = t.stdout.decode()
    assert t.returncode == 0, (out + t.stderr.decode())[-2000:]
    made = (tmp_path / "out" / "train.en").read_text().splitlines()
    counts = [len(line.split()) for line in made]
    mean = sum(counts) / len(counts)  # (of every line: sentences of 2 to 8 words, 3 joined)
    assert "corpus: 400 pairs" in out and f"about {mean:.0f} words per English sentence" in out
    assert counts[0] != round(mean), counts[0]  # (a mean of the first line alone: another)
    rows = [line for line in out.splitlines() if line.startswith(("first start", "second start",
                                                                  "1 steps, 0 workers"))]
    assert len(rows) == 3 and all(" MB" in row for row in rows), out[-1500:]
    assert "prepared data: " in out


# dev/bench_bpe_dropout.py on the `trained` fixture's corpus, a tiny model on one thread
BPE_DROPOUT_TINY = ["--data_dir", "corpus", "--lang_tgt", "it", "--d_model", "32", "--N", "1",
                    "--h", "2", "--d_ff", "64", "--vocab_size", "300", "--max_tokens", "24",
                    "--seq_len", "24", "--model_folder", "bench_w", "--threads", "1"]


def test_bench_bpe_dropout_prices_an_epoch_three_ways(trained):
    """Issue 43: bench_bpe_dropout.py makes one epoch plain, in train.py's pools and batch by
    batch, as many batches each, and prints the epoch's cost with the flag as a ratio to the
    plain epoch's, measured in the same run."""
    home, _ = trained
    t = run_here("dev/bench_bpe_dropout.py", *BPE_DROPOUT_TINY, "--steps", "2",
                 "--warmup_steps", "1", cwd=home)
    out = t.stdout.decode()
    assert t.returncode == 0, t.stderr.decode()[-2000:]
    rows = {line[:34].strip(): line[34:].split() for line in out.splitlines()
            if line.startswith(("plain", "dropout"))}
    assert set(rows) == {"plain (no dropout)", "dropout, pools of 16 (train.py)",
                         "dropout, each batch alone"}, out
    counts = {int(row[0]) for row in rows.values()}  # the same number of batches, over a pool
    assert len(counts) == 1 and counts.pop() > 16, out
    assert int(rows["dropout, each batch alone"][1].replace(",", "")) > \
        int(rows["plain (no dropout)"][1].replace(",", ""))  # longer segmentations
    ratio = out.split("epoch with --bpe_dropout 0.1 / without:")[1].split("x")[0]
    assert float(ratio) > 0, out


def test_the_shared_timing_helpers_load_no_training_loop():
    """Issue 63: dev/bench.py was both a benchmark and the other tools' library: importing it
    for `sync` loaded train.py, datasets and TensorBoard. dev/timing.py holds what they share."""
    import subprocess
    import sys

    from conftest import ROOT
    code = ("import sys, dev.timing; print(sorted(m for m in ('train', 'datasets', "
            "'torch.utils.tensorboard', 'dev.bench') if m in sys.modules))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          timeout=120)
    assert proc.returncode == 0 and proc.stdout.decode().strip() == "[]", proc.stderr.decode()


def test_the_gpu_scripts_call_is_rehearsed_command_by_command(tmp_path):
    """Issue 62: dev/gpu_wmt.sh's call (part 3) checked on the CPU before a GPU is lent: with
    DRY=1 every dev.bench command line of it is parsed and validated (a typo in a flag fails
    here, not in the GPU's minutes), every step within its time limit."""
    import os
    import subprocess

    from conftest import ROOT
    log = tmp_path / "gpu.log"
    proc = subprocess.run(["bash", str(ROOT / "dev" / "gpu_wmt.sh"), str(log), "600", "3"],
                          cwd=ROOT, env=dict(os.environ, DRY="1"), capture_output=True,
                          timeout=300)
    out = log.read_text()
    assert proc.returncode == 0, proc.stderr.decode()[-2000:]
    steps = [line for line in out.splitlines() if line.startswith("=== ") and ": exit " in line]
    assert len(steps) == 6 and all(": exit 0," in line for line in steps), out[-3000:]
    assert out.count("dry run: ") == 5 and "compile True" in out and "cuda_graphs True" in out
    assert "=== done at" in out


def test_the_gpu_scripts_call_stops_before_any_step_where_a_package_is_missing(tmp_path):
    """A lent GPU's image without `datasets` failed every step of the call, one by one, each
    with a traceback: the script now says what is missing in one line before any step."""
    import os
    import subprocess

    from conftest import ROOT
    (tmp_path / "datasets.py").write_text(  # an image without it
        "raise ModuleNotFoundError(\"No module named 'datasets'\")\n")
    log = tmp_path / "gpu.log"
    proc = subprocess.run(["bash", str(ROOT / "dev" / "gpu_wmt.sh"), str(log), "600", "3"],
                          cwd=ROOT, env=dict(os.environ, DRY="1", PYTHONPATH=str(tmp_path)),
                          capture_output=True, timeout=120)
    assert proc.returncode == 1
    assert log.read_text() == ("=== stopped before any step: ModuleNotFoundError: No module "
                               "named 'datasets' (pip install -r requirements.txt)\n")


def test_wmt_lengths_fall_into_16_shapes_with_little_added_padding(tmp_path):
    """Issue 62's target on the CPU: an epoch of token batches at WMT14-like lengths (the
    synthetic corpus dev.bench times) in at most 16 fixed shapes, with at most 10% more tokens
    than batches padded to their own longest; lengths in plain steps of 16 pad far more."""
    import numpy as np

    from nmt.batching import TokenBatchSampler
    from nmt.shapes import FixedShapes, best_lengths
    from dev.bench import wmt_like_corpus
    folder = wmt_like_corpus(tmp_path / "wmt", 20000, 37000, seed=1)
    src = np.array([len(x.split()) for x in (folder / "train.en").read_text().splitlines()]) + 2
    tgt = np.array([len(x.split()) for x in (folder / "train.de").read_text().splitlines()]) + 1
    lengths = np.maximum(src, tgt)
    plain = TokenBatchSampler(lengths, 25000, seed=1).batches(0)
    shapes = FixedShapes(best_lengths(lengths, 16), 25000, 0)
    found = shapes.report(src, tgt, TokenBatchSampler(lengths, 25000, seed=1,
                                                      shapes=shapes).batches(0), plain)
    assert found["shapes"] <= 16 and found["added"] <= 0.10, found
    steps16 = FixedShapes(tuple(range(16, 257, 16)), 25000, 0)
    coarse = steps16.report(src, tgt, TokenBatchSampler(lengths, 25000, seed=1,
                                                        shapes=steps16).batches(0), plain)
    assert coarse["added"] > 2 * found["added"]


def test_the_readmes_badge_and_the_notebook_name_one_repository(tmp_path):
    """What this can check without the network: the badge and the notebook's REPO setting name
    one repository (whether the address exists, it cannot tell). While they hold the
    placeholder OWNER/REPO the README says so and how to set it; dev/set_repo.py writes the
    address into both (issue 63, 13)."""
    import shutil

    import nbformat

    from conftest import ROOT
    from dev.set_repo import repositories, set_repository
    NOTEBOOKS = ROOT / "notebooks"
    badge, setting = repositories()
    assert badge == setting
    if badge == "OWNER/REPO":
        readme = (ROOT / "README.md").read_text(encoding="utf-8")
        assert "`OWNER/REPO` is a placeholder" in readme and "python -m dev.set_repo" in readme
    (tmp_path / "notebooks").mkdir()
    shutil.copy(ROOT / "README.md", tmp_path / "README.md")
    shutil.copy(NOTEBOOKS / "colab.ipynb", tmp_path / "notebooks" / "colab.ipynb")
    set_repository("someone/transformer", tmp_path)
    assert repositories(tmp_path) == ("someone/transformer", "someone/transformer")
    nbformat.read(tmp_path / "notebooks" / "colab.ipynb", as_version=4)  # still a notebook


def test_the_loops_timing_runs_train_py_s_own_epoch(tmp_path, monkeypatch):
    """Issue 70, 7: `dev.bench --host_steps` (and --train_steps) timed the benchmark's own copy
    of the loop, not train.train_epoch: both now run train_epoch itself, the host-only timing
    with the device's work replaced by the batches' copy. The whole loop is timed as train.py runs
    it, with no wait for the device between its steps (a wait each step cost it 0.93x against
    1.07x on an H100)."""
    import train
    from conftest import TINY, make_corpus

    from config import parse_config
    from dataset import get_ds
    from dev.bench import time_train_loop
    make_corpus(tmp_path / "c", n=120, val=4)
    config, _ = parse_config(["--data_dir", str(tmp_path / "c"), *TINY,
                              "--model_folder", str(tmp_path / "w")])
    data = get_ds(config)
    epochs, real, steps = [], train.train_epoch, []
    monkeypatch.setattr(train, "train_epoch", lambda run, progress: (
        epochs.append(run.config.max_steps), real(run, progress))[1])
    real_step = train.train_step
    monkeypatch.setattr(train, "train_step", lambda *a, **k: (steps.append(1),
                                                              real_step(*a, **k))[1])
    import dev.bench
    waits = []  # the loop waits for the device after its untimed step and its last, never between
    monkeypatch.setattr(dev.bench, "sync", lambda device: waits.append(device))
    seconds = time_train_loop(config, data, 2, host_only=True)
    assert epochs == [3] and steps == [] and seconds > 0 and len(waits) == 3
    waits.clear()
    assert time_train_loop(config, data, 2) > 0 and epochs == [3, 3] and len(steps) == 3
    assert len(waits) == 2


def fake_clock(monkeypatch):
    """dev.bench's clock faked: the k-th batch whose real tokens it counts takes k seconds.
    Returns (the counts, ended(k): the clock at the end of batch k)."""
    import types

    import dev.bench
    clock, counts, real = [0.0], [], dev.bench.real_tokens

    def counted(batch):
        counts.append(real(batch))
        clock[0] += len(counts)
        return counts[-1]
    monkeypatch.setattr(dev.bench, "real_tokens", counted)
    monkeypatch.setattr(dev.bench, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    return counts, lambda k: k * (k + 1) / 2


def test_the_loops_figure_is_the_timed_steps_tokens_over_their_time(tmp_path, monkeypatch,
                                                                     capsys):
    """The loop's figure on a fake clock on which step k takes k seconds: the real tokens of the
    timed steps (2 to steps + 1) over the time from the end of step 1 to the end of the last;
    with host_only, those steps' mean seconds; when the epoch ends first, up to its end."""

    from conftest import TINY, make_corpus

    from config import UserError, parse_config
    from dataset import get_ds
    from dev.bench import time_train_loop
    make_corpus(tmp_path / "c", n=120, val=4)
    config, _ = parse_config(["--data_dir", str(tmp_path / "c"), *TINY,
                              "--model_folder", str(tmp_path / "w")])
    data = get_ds(config)
    counts, ended = fake_clock(monkeypatch)  # one batch a step: step k takes k seconds
    for host_only in (False, True):
        counts.clear()
        figure = time_train_loop(config, data, 3, host_only=host_only)
        assert len(counts) == 4  # the untimed step and 3 timed
        timed = ended(4) - ended(1)
        assert figure == pytest.approx(timed / 3 if host_only else sum(counts[1:]) / timed)
    assert "epoch ended" not in capsys.readouterr().out
    counts.clear()  # more steps than the epoch has: timed to the epoch's end, and said
    figure = time_train_loop(config, data, 1000)
    assert 2 < len(counts) < 1001
    assert figure == pytest.approx(sum(counts[1:]) / (ended(len(counts)) - ended(1)))
    assert (f"its epoch ended after {len(counts)} steps: {len(counts) - 1} timed, not 1000"
            in capsys.readouterr().out)
    make_corpus(tmp_path / "one", n=4, val=4)  # an epoch of one step: nothing to time
    config, _ = parse_config(["--data_dir", str(tmp_path / "one"), *TINY, "--max_tokens", "2000",
                              "--model_folder", str(tmp_path / "w1")])
    with pytest.raises(UserError, match="the epoch has 1 step, none to time"):
        time_train_loop(config, get_ds(config), 3)


def test_the_loop_trains_the_batches_it_is_given_after_its_untimed_steps(tmp_path, monkeypatch):
    """Under --compile, the loop trains the model step's own batches (so that it compiles the
    shapes the step did and no other) after as many untimed steps as the step's warm-up: it
    trains exactly the batches given, in their order, and times from the end of the untimed
    ones (step k takes k seconds on a fake clock), host_only too."""

    from conftest import TINY, make_corpus

    from config import parse_config
    from dataset import Collator, get_ds, real_tokens
    from dev.bench import time_train_loop, timed_batches
    from tokenizer import PAD
    make_corpus(tmp_path / "c", n=120, val=4)
    config, _ = parse_config(["--data_dir", str(tmp_path / "c"), *TINY,
                              "--model_folder", str(tmp_path / "w")])
    data = get_ds(config)
    epoch = timed_batches(data, config, None)
    given = [epoch[2], epoch[0], epoch[2], epoch[1]]
    expected = [real_tokens(Collator(PAD)([data.train[i] for i in b])) for b in given]
    assert len(set(expected)) > 1  # (the order is seen)
    counts, ended = fake_clock(monkeypatch)
    import train
    logged, log = [], train.log_progress  # the given batches are the epoch: its end logs
    monkeypatch.setattr(train, "log_progress", lambda run, progress, *a: (
        logged.append(progress.step), log(run, progress, *a)))
    assert len(epoch) > len(given) and config.log_every > len(given)
    for host_only in (False, True):
        counts.clear(), logged.clear()
        figure = time_train_loop(config, data, 2, host_only=host_only, batches=given, untimed=2)
        assert counts == expected and logged == [1, 4]
        timed = ended(4) - ended(2)  # from the end of step 2 to the end of step 4
        assert figure == pytest.approx(timed / 2 if host_only else sum(expected[2:]) / timed)


def recorded_loop(monkeypatch) -> list:
    """dev.bench.main with no model run: its comparison and report faked, and each call of
    time_train_loop recorded in the list returned, as (steps, keyword arguments)."""
    import dev.bench
    calls = []
    monkeypatch.setattr(dev.bench, "compare", lambda *a: (mock.Mock(), mock.Mock(), None, [], []))
    monkeypatch.setattr(dev.bench, "report", lambda *a: None)
    monkeypatch.setattr(dev.bench, "time_train_loop",
                        lambda config, data, steps, **kw: calls.append((steps, kw)) or 1.0)
    return calls


def test_bench_times_the_compiled_loop_on_the_steps_batches(tmp_path, monkeypatch):
    """dev.bench --compile --train_steps: the loop is given the step's batches (with
    --shapes_timed, those of the most frequent shapes only, going round) and the step's warm-up;
    eager, its own epoch after one untimed step."""
    import dev.bench
    from conftest import TINY, make_corpus

    from dataset import get_ds
    from nmt.compiling import choose_shapes
    make_corpus(tmp_path / "c", n=400, val=4)
    calls = recorded_loop(monkeypatch)
    common = ["--data_dir", str(tmp_path / "c"), "--lang_tgt", "it", *TINY,
              "--model_folder", str(tmp_path / "w"), "--baseline_steps", "0",
              "--profile_steps", "0", "--train_steps", "7", "--warmup_steps", "3", "--steps", "2"]
    dev.bench.main(common)
    assert calls == [(7, {})]
    calls.clear()
    dev.bench.main(common + ["--compile", "true", "--fixed_shapes", "4", "--shapes_timed", "1"])
    (steps, kw), = calls
    _, config = dev.bench.parse(common + ["--compile", "true", "--fixed_shapes", "4"])
    data = get_ds(config)
    shapes = choose_shapes(config, data)
    lengths = shapes.padded_lengths(data.train.lengths())
    epoch = dev.bench.timed_batches(data, config, shapes)
    longest = [int(lengths[b].max()) for b in epoch]
    frequent = max(set(longest), key=longest.count)
    counts = sorted(longest.count(n) for n in set(longest))
    assert counts[-1] > counts[-2] and counts[-1] < 10  # (one most frequent shape, gone round)
    chosen = [b for b, n in zip(epoch, longest) if n == frequent]
    assert steps == 7 and kw["untimed"] == 3 and len(kw["batches"]) == 10
    assert [list(b) for b in kw["batches"]] == [list(b) for b in (chosen * 10)[:10]]


def test_the_loop_waits_after_its_untimed_steps_and_its_last_and_refuses_too_few(tmp_path,
                                                                                monkeypatch):
    """Under --compile's warm-up of several untimed steps, the loop still waits for the device
    twice only (after the untimed steps, after the last), and an epoch of no more steps than the
    untimed ones is a one-line error, not a division by zero; timed_batches is the epoch train.py
    trains first (its sampler's epoch 0), and --shapes_timed without fixed shapes (eager) is no
    filter."""
    import dev.bench
    from conftest import TINY, make_corpus

    from config import UserError, parse_config
    from dataset import get_ds
    from dev.bench import time_train_loop, timed_batches
    from nmt.batching import TokenBatchSampler
    from nmt.compiling import choose_shapes
    make_corpus(tmp_path / "c", n=120, val=4)
    config, _ = parse_config(["--data_dir", str(tmp_path / "c"), *TINY,
                              "--model_folder", str(tmp_path / "w")])
    data = get_ds(config)
    epoch = timed_batches(data, config, None)
    trained = TokenBatchSampler(data.train.lengths(), config.max_tokens, config.batch_size,
                                shuffle=True, seed=config.seed).batches(0)
    assert [list(b) for b in epoch] == [list(b) for b in trained]
    assert [list(b) for b in timed_batches(data, config, None, 1)] == [list(b) for b in epoch]
    shaped = dataclasses.replace(config, fixed_shapes=4)
    shapes = choose_shapes(shaped, data)
    assert [list(b) for b in timed_batches(data, shaped, shapes)] == [list(b) for b in
        TokenBatchSampler(data.train.lengths(), shaped.max_tokens, shaped.batch_size,
                          shuffle=True, seed=shaped.seed, shapes=shapes).batches(0)]
    steps_done, waits = [], []
    real = dev.bench.real_tokens
    monkeypatch.setattr(dev.bench, "real_tokens", lambda b: steps_done.append(1) or real(b))
    monkeypatch.setattr(dev.bench, "sync", lambda device: waits.append(len(steps_done)))
    given = [epoch[0], epoch[1], epoch[2], epoch[0], epoch[1], epoch[2]]
    assert time_train_loop(config, data, 3, batches=given, untimed=3) > 0
    assert waits == [3, 6]
    with pytest.raises(UserError, match="the epoch has 2 steps, none to time after 2 untimed"):
        time_train_loop(config, data, 3, batches=given[:2], untimed=2)


def test_bench_without_warm_up_still_gives_the_compiled_loop_an_untimed_step(tmp_path,
                                                                             monkeypatch):
    """dev.bench --compile --warmup_steps 0: the loop's first step (its compilation) is still
    untimed, and it has a batch for each step, untimed and timed (it timed one step too few); k
    for each under --accum_steps k (it ran out of batches); its batches are train.py's, sentence
    batches too (--max_tokens 0 --batch_size N)."""
    import dev.bench
    from conftest import TINY, make_corpus
    make_corpus(tmp_path / "c", n=120, val=4)
    calls = recorded_loop(monkeypatch)
    dev.bench.main(["--data_dir", str(tmp_path / "c"), "--lang_tgt", "it", *TINY,
                    "--model_folder", str(tmp_path / "w"), "--baseline_steps", "0",
                    "--profile_steps", "0", "--train_steps", "4", "--warmup_steps", "0",
                    "--steps", "2", "--compile", "true"])
    (steps, kw), = calls
    assert steps == 4 and kw["untimed"] == 1 and len(kw["batches"]) == 5
    calls.clear()
    dev.bench.main(["--data_dir", str(tmp_path / "c"), "--lang_tgt", "it", *TINY,
                    "--model_folder", str(tmp_path / "w"), "--baseline_steps", "0",
                    "--profile_steps", "0", "--train_steps", "4", "--warmup_steps", "2",
                    "--steps", "2", "--compile", "true", "--accum_steps", "3",
                    "--max_tokens", "0", "--batch_size", "7"])
    (steps, kw), = calls
    assert steps == 4 and kw["untimed"] == 2 and len(kw["batches"]) == 18
    assert all(len(b) <= 7 for b in kw["batches"]) and len(kw["batches"][0]) == 7


def test_bench_attention_times_the_validations_picture():
    """dev/bench_attention.py, the command docs/training.md gives for the TensorBoard picture's
    cost: it runs log_attention itself and prints its median."""
    import dev.bench_attention as bench
    from nmt import evaluation
    calls = []
    real = bench.log_attention

    def counted(*args):
        calls.append(args[1:3])
        return real(*args)
    bench.log_attention = counted
    try:
        t = run_here("dev/bench_attention.py", "--d_model", "32", "--N", "2", "--h", "2",
                     "--d_ff", "64", "--seq_len", "40", "--calls", "2", "--src_tokens", "5",
                     "--tgt_tokens", "6", cwd=ROOT)
    finally:
        bench.log_attention = real
    assert t.returncode == 0, t.stderr.decode()
    assert real is evaluation.log_attention and len(calls) == 3
    assert [(len(s), len(g)) for s, g in calls] == [(5, 6)] * 3
    out = t.stdout.decode()
    assert out.startswith("the attention picture a validation (2 decoder layers, d_model 32, 5 "
                          "source and 6 generated tokens") and "median" in out
    assert f"tokens, {torch.get_num_threads()} thread(s)): " in out  # (torch's, not --threads 0)


def test_the_decoding_profile_takes_the_profilers_cost_out_of_each_operator():
    """dev/bench_decode.py's split: operators by part, those under the encoder's range counted
    there, the profiler's own cost (profiled less unprofiled time) shared evenly among them,
    steps counted by the decoder's embedding lookups, Python the rest of the unprofiled time."""
    from types import SimpleNamespace

    from dev.bench_decode import (C_CANDIDATES, C_ENCODER, C_LAYERS, ENCODER,
                                  profile_split)

    def event(name, us, parent=None):
        return SimpleNamespace(name=name, self_cpu_time_total=us, cpu_parent=parent)
    encoder = event(ENCODER, 1.0)
    c_encoder = event(C_ENCODER, 28.0, encoder)  # the C step's encoder, in the encoder's range
    events = [encoder, event("aten::mm", 30.0, encoder), event("aten::mm", 50.0),
              event("aten::embedding", 10.0), event("aten::embedding", 10.0, c_encoder),
              event("aten::embedding", 10.0), event("aten::topk", 20.0),
              event("aten::bmm", 15.0), event("aten::index_select", 12.0), c_encoder,
              event(C_LAYERS, 48.0), event(C_CANDIDATES, 18.0)]
    # 11 operators (the encoder's range is not one), 8 us of the profiler's each: 88 of 288
    steps, split = profile_split(events, wall_us=200.0, profiled_us=288.0)
    assert steps == 2
    assert split == {ENCODER: 22.0 + 2.0 + 20.0, "matrix products": 42.0,
                     "norms and other": 4.0, "choosing tokens": 12.0 + 10.0, "attention": 7.0,
                     "cache and reordering": 4.0, "the C layers": 40.0,
                     "Python and dispatch": 200.0 - 163.0}


def test_the_decoding_profile_puts_each_c_call_in_its_range_and_restores_the_functions(
        monkeypatch):
    """dev.bench_decode's profile over the C step: the C layers, the candidates (beam) and the
    C encoder (inside the encoder's range) each in a range of its own; the functions it wraps
    restored after, also when a search fails."""
    import nmt.decoder_step
    import nmt.decoding
    from conftest import small
    from nmt.decoder_step import NativeLayers
    from tokenizer import EOS, PAD, SOS, UNK
    if nmt.decoder_step._compiled_layers() is None:
        pytest.skip("no C compiler here")
    import dev.bench_decode as bench
    model = small(seed=3, vocab=40, norm="rms", ffn="swiglu", pos="rope", n_kv_heads=2,
                  tie_embeddings="decoder")
    ids = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16], [7, 7, 8]]
    common = dict(sos_id=SOS, eos_id=EOS, pad_id=PAD, seq_len=30, unk_id=UNK, batch_size=2)
    originals = (NativeLayers.__call__, NativeLayers.encode, nmt.decoding.top_logits)
    seen = []

    def split(events, wall, profiled):
        inside = all(e.cpu_parent is not None and e.cpu_parent.name == bench.ENCODER
                     for e in events if e.name == bench.C_ENCODER)
        seen.append(({e.name for e in events}, inside))
        return 1, {}
    monkeypatch.setattr(bench, "profile_split", split)
    bench.profile(model, ids, common, 2)
    assert (NativeLayers.__call__, NativeLayers.encode, nmt.decoding.top_logits) == originals
    assert "encode" not in vars(model)
    (greedy, greedy_inside), _, (beam, beam_inside), _ = seen
    assert {bench.C_LAYERS, bench.C_ENCODER, bench.ENCODER} <= greedy and greedy_inside
    assert {bench.C_LAYERS, bench.C_CANDIDATES, bench.C_ENCODER} <= beam and beam_inside

    def fails(*args):
        raise KeyboardInterrupt
    monkeypatch.setattr(bench, "profile_searches", fails)
    with pytest.raises(KeyboardInterrupt):
        bench.profile(model, ids, common, 2)
    assert (NativeLayers.__call__, NativeLayers.encode, nmt.decoding.top_logits) == originals
    assert "encode" not in vars(model)


def test_the_decoding_profile_never_counts_a_negative_time():
    """profile_split: a profiled run faster than the unprofiled one (noise) takes no cost out
    and adds none; an operator cheaper than its share of the profiler's cost counts 0."""
    from types import SimpleNamespace

    from dev.bench_decode import profile_split
    events = [SimpleNamespace(name=name, self_cpu_time_total=us, cpu_parent=None)
              for name, us in (("aten::mm", 30.0), ("aten::topk", 2.0))]
    assert profile_split(events, wall_us=100.0, profiled_us=90.0)[1] == {
        "matrix products": 30.0, "choosing tokens": 2.0, "Python and dispatch": 68.0}
    assert profile_split(events, wall_us=100.0, profiled_us=120.0)[1] == {  # 10 us each
        "matrix products": 20.0, "choosing tokens": 0.0, "Python and dispatch": 80.0}


def test_the_decoders_take_turns_every_at_once_batches_each_pair_one_after_the_other():
    """decode_in_turn: one untimed call each, then the greedy decoders take turns on every
    `at_once` batches (this repo's greedy decodes that many at once), this repo's first and the
    engine's float32 right after it; then each beam search on all its sentences, this repo's
    and the engine's float32 one right after the other."""
    from dev.bench_decode import MODEL_STEP, decode_in_turn
    calls = []

    def run(name):
        return lambda part: calls.append((name, len(part))) or [[4]] * len(part)
    names = ["CTranslate2 int8, greedy", "this repo, beam 3", f"this repo, greedy, {MODEL_STEP}",
             "this repo, beam 3, k finished", "CTranslate2 float32, beam 3",
             "CTranslate2 float32, greedy", "this repo, greedy"]  # ours as this_repos_decoders
    ids = [[5] * (1 + i % 7) for i in range(10)]
    outputs, times = decode_in_turn([(name, run(name), range(10)) for name in names], ids,
                                    batch=2, repeats=1, at_once=2)
    assert sorted(name for name, _ in calls[:len(names)]) == sorted(names)  # untimed
    greedy = ["this repo, greedy", "CTranslate2 float32, greedy", "CTranslate2 int8, greedy",
              f"this repo, greedy, {MODEL_STEP}"]
    assert calls[len(names):] == [(name, n) for n in (4, 4, 2) for name in greedy] + [
        ("this repo, beam 3", 10), ("CTranslate2 float32, beam 3", 10),
        ("this repo, beam 3, k finished", 10)]
    assert all(len(outputs[name]) == 10 and len(times[name]) == 1 for name in names)


def test_bench_decode_also_times_the_engine_as_replicas_decoding_batches_at_once(tmp_path,
                                                                              monkeypatch,
                                                                              capsys):
    """engines(): float32 and int8 with `threads` threads a batch; with several threads also
    float32 as that many replicas, one thread each (the same export loaded again); each in an
    EngineProcess, and one that cannot load is left out with one line."""
    import sys
    from types import SimpleNamespace

    import dev.bench_decode as bench
    import nmt.engine
    monkeypatch.setitem(sys.modules, "ctranslate2", SimpleNamespace())  # installed
    exported, loaded = [], {}

    def export(model, config, tok_src, tok_tgt, path, quantization):
        exported.append(quantization)
        path.mkdir(parents=True)

    class EngineProcess:
        def __init__(self, path, tok_src, tok_tgt, device, threads, at_once, wait):
            assert not wait  # each loads while the next one starts
            loaded[path.name, threads, at_once] = device
            self.failed = path.name == "int8" and threads == 1

        def ready(self):
            if self.failed:
                raise RuntimeError("no int8 here")
    monkeypatch.setattr(nmt.engine, "export", export)
    monkeypatch.setattr(bench, "EngineProcess", EngineProcess)
    model = torch.nn.Linear(2, 2)
    assert list(bench.engines(model, None, None, None, tmp_path / "a", threads=2)) == [
        "float32", "float32, 2 batches at once", "int8"]
    assert exported == ["float32", "int8"]
    assert loaded == {("float32", 2, 1): "cpu", ("float32", 1, 2): "cpu", ("int8", 2, 1): "cpu"}
    assert list(bench.engines(model, None, None, None, tmp_path / "b", threads=1)) == [
        "float32"]
    assert capsys.readouterr().out == \
        "CTranslate2 int8 on cpu cannot run: no int8 here; its rows are left out\n"


def test_the_benchmarks_engine_decodes_in_a_process_of_its_own(trained, tmp_path):
    """EngineProcess: the engine loaded and run in another process (torch's OpenMP threads and
    the engine's slow each other in one), its outputs those of the engine in this process, a
    Ctrl-C there ignored (the benchmark's own process says it, in one line);
    an engine that cannot load raises one line, and the process ends."""
    pytest.importorskip("ctranslate2")
    import multiprocessing
    import os
    import signal
    import time

    from dev.bench_decode import EngineProcess
    from nmt.engine import Engine, export
    from nmt.trained_model import load_translator
    from tokenizer import EOS, PAD, SOS, UNK
    home, _ = trained
    config = Config(model_folder=str(home / "weights"))
    model, config, tok_src, tok_tgt = load_translator(config, {"model_folder"})
    export(model, config, tok_src, tok_tgt, tmp_path / "ct2", "float32")
    ids = [e.ids for e in tok_src.encode_batch(["a b c", "d e", "a", "b c d e f"])]
    options = dict(sos_id=SOS, eos_id=EOS, pad_id=PAD, seq_len=config.seq_len, unk_id=UNK,
                   batch_size=2)
    here = Engine(tmp_path / "ct2", tok_src, tok_tgt, "cpu", 1, 1)
    there = EngineProcess(tmp_path / "ct2", tok_src, tok_tgt, "cpu", 1, 1)
    try:
        assert there.process.pid != os.getpid() and there.process.is_alive()
        os.kill(there.process.pid, signal.SIGINT)  # Ctrl-C is the benchmark's to handle
        for beam in (1, 2):
            assert there.translate_ids(ids, **options, beam=beam) == \
                here.translate_ids(ids, **options, beam=beam)
        with pytest.raises(RuntimeError, match="takes no argument|unexpected keyword"):
            there.translate_ids(ids, **options, no_such_option=1)  # an error there: one line
        assert there.translate_ids(ids[:1], **options) == here.translate_ids(ids[:1], **options)
    finally:
        there.close()
    assert not there.process.is_alive() and there.process.exitcode == 0  # ended as asked
    before = set(multiprocessing.active_children())
    with pytest.raises(RuntimeError, match="cannot load") as error:
        EngineProcess(tmp_path / "missing", tok_src, tok_tgt, "cpu", 1, 1)
    assert "\n" not in str(error.value)
    deadline = time.monotonic() + 30  # its process ends by itself, the error still held here
    while set(multiprocessing.active_children()) - before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not set(multiprocessing.active_children()) - before


def test_the_benchmarks_engine_process_that_dies_is_said_and_never_waited_for(trained, tmp_path,
                                                                            monkeypatch):
    """An EngineProcess whose process dies (killed, a crash) while loading raises one line
    instead of waiting for an answer that never comes; one that dies after loading closes
    without an error; and one never closed (the benchmark stopped by an error while the engines
    load) does not keep Python from exiting."""
    pytest.importorskip("ctranslate2")
    import subprocess
    import sys
    import threading
    from multiprocessing.context import SpawnProcess

    from dev.bench_decode import EngineProcess
    from nmt.engine import export
    from nmt.trained_model import load_translator
    home, _ = trained
    config = Config(model_folder=str(home / "weights"))
    model, config, tok_src, tok_tgt = load_translator(config, {"model_folder"})
    export(model, config, tok_src, tok_tgt, tmp_path / "ct2", "float32")
    there = EngineProcess(tmp_path / "ct2", tok_src, tok_tgt, "cpu", 1, 1)
    there.process.kill()
    there.process.join()
    with pytest.raises(RuntimeError, match="^the engine's process ended$"):
        there.translate_ids([[5]], sos_id=1, eos_id=2, pad_id=0, seq_len=20)
    there.close()  # nothing to say to a process that has ended

    start = SpawnProcess.start
    monkeypatch.setattr(SpawnProcess, "start", lambda self: start(self) or self.kill())
    raised = []

    def load():
        try:
            EngineProcess(tmp_path / "ct2", tok_src, tok_tgt, "cpu", 1, 1)
        except Exception as e:  # noqa: BLE001 (looked at below)
            raised.append(e)
    waiting = threading.Thread(target=load, daemon=True)
    waiting.start()
    waiting.join(timeout=60)
    assert not waiting.is_alive(), "waited for a dead engine's process"
    assert [type(e) for e in raised] == [RuntimeError] and \
        str(raised[0]) == "the engine's process ended"
    monkeypatch.undo()

    left_open = ("import sys; from pathlib import Path; from tokenizers import Tokenizer; "
                 "from dev.bench_decode import EngineProcess; "
                 f"tokens = Tokenizer.from_file({str(home / 'weights' / 'tokenizer_en.json')!r}); "
                 f"engine = EngineProcess(Path({str(tmp_path / 'ct2')!r}), tokens, tokens, "
                 "'cpu', 1, 1); sys.exit(2)")
    ended = subprocess.run([sys.executable, "-c", left_open], cwd=ROOT, timeout=120,
                           capture_output=True)
    assert ended.returncode == 2, ended.stderr.decode()[-2000:]


# ---- from a mutation audit of the benchmarks' printed figures -----------------------------------

def test_the_peak_rates_are_dense_bf16_and_each_gpu_finds_its_own():
    """MFU's denominator: the dense bf16 rate (not the sparse one, twice it) of the GPU whose
    name holds the key's words; an A100's name also holds "A10", an L40S's "L4" (it read the
    L4's 121 TFLOP/s: MFU three times too high), and an H100 PCIe is slower than the SXM one."""
    from dev.timing import peak_bf16 as peak
    assert peak("NVIDIA H100 80GB HBM3") == peak("NVIDIA H200") == 989e12
    assert peak("NVIDIA A100-SXM4-80GB") == 312e12 and peak("NVIDIA A10") == 125e12
    assert peak("NVIDIA GeForce RTX 4090") == 165e12 and peak("Tesla T4") is None
    assert peak("NVIDIA L40S") == 362e12 and peak("NVIDIA L4") == 121e12
    assert peak("NVIDIA H100 PCIe") == 756e12 and peak("NVIDIA L40") is None


def test_sync_waits_for_a_gpu_and_never_for_the_cpu(monkeypatch):
    """dev.timing.sync: every figure timed on a GPU stops its clock after the GPU's work, so
    sync must wait there (a GPU's calls return before their work is done); on the CPU it is
    nothing. torch.cuda.synchronize faked: no GPU here."""
    from dev.timing import sync
    waited = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: waited.append(device))
    sync(torch.device("cpu"))
    assert waited == []
    sync(torch.device("cuda", 0))
    assert waited == [torch.device("cuda", 0)]


def test_the_padding_report_counts_each_side_with_its_special_tokens(capsys):
    """report_padding's lines: the mean tokens a side with [SOS]/[EOS] (source + 2, labels + 1),
    the share of sources past 100 in percent, and each side's padding share on its own row,
    under train.py's batches (by the longer side) and under the order by both sides (target,
    then source length; batches of up to 2 x max_tokens padded positions)."""
    from types import SimpleNamespace

    from dev.bench import report_padding
    src = [[5] * n for n in (2, 2, 2, 2, 6, 6, 99, 2, 30, 1)]  # 4, 4, 4, 4, 8, 8, 101, 4, 32, 3
    tgt = [[5] * n for n in (1, 1, 7, 7, 1, 1, 7, 7, 25, 40)]  # 2, 2, 8, 8, 2, 2, 8, 8, 26, 41
    report_padding(SimpleNamespace(train=SimpleNamespace(src_ids=src, tgt_ids=tgt)), 128)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "pairs: 10; tokens a side with [SOS]/[EOS]: mean 17.2 / 10.7, 10.0% of " \
        "sources past 100"
    # by the longer side: {0, 1, 2, 3, 4, 5, 7} (8 long), {8, 9} (41), {6} (101): source 172
    # real of 56 + 64 + 101 positions, target 107 of 56 + 82 + 8
    assert lines[1] == "padding, token batches (train.py): source 22.2%, target 26.7% (3 " \
        "batches of <= 128 tokens)", lines
    # by target, then source: {0, 1, 4, 5, 2, 3, 7}, {6, 8} (2 x (101 + 26) <= 256), {9}:
    # source 172 of 56 + 202 + 3, target 107 of 56 + 52 + 41
    assert lines[2] == "padding, by both sides' lengths: source 34.1%, target 28.2% (3 " \
        "batches of <= 128 tokens)", lines


def test_the_order_by_both_sides_is_by_target_then_source_and_each_batch_as_large_as_fits():
    """batches_by_both_sides, the alternative order whose padding dev.bench prints: pairs in
    the order of their target, then source length, each batch cut only where the next pair
    would take its padded positions past 2 x max_tokens (not sooner)."""
    import numpy as np

    from dev.bench import batches_by_both_sides
    rng = np.random.default_rng(1)
    src, tgt = rng.integers(1, 60, 300), rng.integers(1, 60, 300)
    batches = batches_by_both_sides(src, tgt, 300)
    order = np.concatenate(batches)
    assert [(tgt[i], src[i]) for i in order] == sorted(zip(tgt, src))
    for b, after in zip(batches, batches[1:]):
        grown = np.append(b, after[0])
        assert len(grown) * (src[grown].max() + tgt[grown].max()) > 600


def test_a_step_counts_real_and_padded_tokens_its_wait_and_its_peak_memory_above_the_weights(
        monkeypatch):
    """dev.bench.Step on a fake GPU and clock: a timed step's time runs to the end of the
    device's work (the wait after the step is timed), its tokens are the batch's real ones and,
    apart, its padded positions (source and target shapes); throughput is their sum over the
    steps' summed time; the peak memory is the largest a step takes above what it started with
    (the weights)."""
    import types

    import dev.bench
    from dataset import Collator
    from dev.bench import Step
    clock, work, peaks, reset = [0.0], iter([5, 10, 20, 40]), iter([250, 300, 450, 350]), []
    monkeypatch.setattr(dev.bench, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    monkeypatch.setattr(dev.bench, "sync", lambda device: clock.__setitem__(0, clock[0] + 1))
    monkeypatch.setattr(dev.bench, "train_step",
                        lambda *a: clock.__setitem__(0, clock[0] + next(work)))
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda d: reset.append(d))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda d: 100)  # the weights
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda d: next(peaks))
    step = Step(torch.nn.Linear(2, 2), Config(precision="fp32"), torch.device("cuda"))
    items = [{"encoder_input": torch.arange(5, 5 + n), "decoder_input": torch.arange(5, 5 + m),
              "label": torch.arange(5, 5 + m)} for n, m in ((5, 2), (3, 4))]
    batch = Collator()(items)  # (2, 5) and (2, 4): 8 of 10 source, 6 of 8 target tokens real
    for record in (False, True, True, True):
        step(batch, record=record)
    assert step.times == [11.0, 21.0, 41.0] and len(reset) == 4  # the work and 1 s of wait
    assert step.tokens == [14] * 3 and step.padded == [18] * 3
    assert step.tokens_per_s() == 42 / 73 and step.tokens_per_s(padded=True) == 54 / 73
    assert step.peak_memory == 350  # 450 - 100


def _step(times, tokens, padded, peak_memory=0, counted=None):
    """A dev.bench.Step's figures, without a model (`counted`: padded's, without filler)."""
    from dev.bench import Step
    step = Step.__new__(Step)
    step.times, step.tokens, step.padded, step.peak_memory = times, tokens, padded, peak_memory
    step.counted = padded if counted is None else counted
    return step


def test_the_real_share_is_of_the_positions_the_flops_count(capsys):
    """With fixed shapes, model_flops leaves out a shape's filler (rows without a target token,
    columns past the longest pair); the real tokens' share (and the MFU on real tokens) divided
    by the whole tensor, filler too, so counted the filler out twice. It is now of the positions
    the FLOPs count: rows with a target x (longest source + longest target)."""
    from types import SimpleNamespace

    from dev.bench import report
    from dev.timing import counted_shape
    from tokenizer import PAD
    src = torch.full((5, 16), PAD)
    src[:3, :6] = 7  # 3 pairs of 6 source tokens
    label = torch.full((5, 16), PAD)
    label[:3, :4] = 9  # and 4 target tokens; rows 3-4 and columns past them: filler
    assert counted_shape({"encoder_input": src, "label": label}) == (3, 6, 4)
    ours = _step([1.0], [30], [160], counted=[3 * (6 + 4)])
    theirs = _step([1.0], [30], [160])
    report([("this repo (token batches)", ours), ("torch.nn.Transformer (same batches)", theirs)],
           None, [1e12], torch.device("cpu"), SimpleNamespace(baseline_seq_len=350))
    assert "100% of them are real tokens" in capsys.readouterr().out


@pytest.mark.parametrize("gpu", ["NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-80GB", None])
def test_the_report_prints_each_figure_of_its_own_model_on_its_own_row(gpu, monkeypatch, capsys):
    """dev.bench's report on figures made by hand: each row's real and padded tokens/s and
    mean s/step; each ratio ours over the other (the loop over the step and the baseline); the
    FLOP/s of each model on its own time, the real tokens' share in percent; on a GPU (faked)
    each model's peak memory in GiB and the MFU of ours against that GPU's dense bf16 rate."""
    from types import SimpleNamespace

    from dev.bench import report
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: gpu)
    ours = _step([1.0, 1.0, 4.0], [600] * 3, [1000] * 3, 3 * 2**30)
    theirs = _step([4.0] * 3, [600] * 3, [1000] * 3, 2**30)
    fp32 = _step([6.0, 6.0, 12.0], [600] * 3, [1000] * 3)
    baseline = _step([1.0] * 3, [100] * 3, [500] * 3)
    rows = [("this repo (token batches)", ours), ("torch.nn.Transformer (same batches)", theirs),
            ("this repo, fp32 eager (same batches)", fp32),
            ("baseline: 8 sentences padded to 350", baseline)]
    report(rows, 270.0, [989e12] * 3, torch.device("cuda" if gpu else "cpu"),
           SimpleNamespace(baseline_seq_len=350))
    lines = capsys.readouterr().out.splitlines()
    table = {line[:40].strip(): line[40:].split() for line in lines[2:7]}
    assert table == {"this repo (token batches)": ["300", "500", "2.00"],
                     "torch.nn.Transformer (same batches)": ["150", "250", "4.00"],
                     "this repo, fp32 eager (same batches)": ["75", "125", "8.00"],
                     "baseline: 8 sentences padded to 350": ["100", "500", "1.00"],
                     "whole train.py loop": ["270"]}, lines
    ratios = [line.split(":")[1].split()[0] for line in lines[8:13]]
    assert ratios == ["2.00x", "4.00x", "3.0x", "2.7x", "0.90x"], lines
    assert lines[8].startswith("ours / nn.Transformer:") and lines[9].startswith(
        "ours as configured / fp32 eager:") and lines[10].startswith("ours / pad-to-350 baseline")
    assert lines[11].startswith("train.py loop / baseline:") and lines[12].startswith(
        "train.py loop / model step:")
    assert lines[13] == ("model FLOP/s, ours: 494.50 TFLOP/s; nn.Transformer: 247.25 TFLOP/s "
                         "(same FLOPs per step, padded positions counted; 60% of them are real "
                         "tokens)")
    if gpu is None:
        assert lines[14].startswith("peak resident memory of this process: ") and len(lines) == 15
        return
    assert lines[14:16] == [
        "peak GPU memory of a step above the weights, this repo (token batches): 3.00 GiB",
        "peak GPU memory of a step above the weights, torch.nn.Transformer (same batches): "
        "1.00 GiB"], lines
    if gpu.startswith("NVIDIA H100"):  # 494.5 of 989 TFLOP/s, 60% of it on real tokens
        assert lines[16] == ("MFU (ours): 50.0% of NVIDIA H100 80GB HBM3's 989 TFLOP/s dense "
                             "bf16 (30.0% counting the real tokens' share only)")
    else:
        assert lines[16].startswith("MFU (ours): 158.5% of NVIDIA A100-SXM4-80GB's 312 TFLOP/s")


def _bench_main_on_fake_steps(tmp_path, monkeypatch, *flags):
    """dev.bench.main on a tiny corpus with every Step a recording fake (no model runs; ours
    takes 1 s a step, nn.Transformer 2 s, the fp32 one 3 s, the baseline 4 s), the loop and the
    profiler faked: (the Steps made, in order; the steps' calls, in order; compare's arguments
    and return; the batches profiled; report's arguments)."""
    import types

    import dev.bench
    from conftest import TINY, make_corpus
    make_corpus(tmp_path / "c", n=120, val=4)
    made, calls, seen = [], [], {}

    class FakeStep:
        def __init__(self, model, config, device):
            self.model, self.seconds = model, float(len(made) + 1)
            self.loss_fn = types.SimpleNamespace(block_rows=None)
            self.times, self.tokens, self.padded, self.peak_memory = [], [], [], 0
            self.records = []
            made.append(self)

        def __call__(self, batch, record=True):
            calls.append((self, batch))
            self.records.append(record)
            if record:
                self.times.append(self.seconds)
    compare = dev.bench.compare
    monkeypatch.setattr(dev.bench, "Step", FakeStep)
    monkeypatch.setattr(dev.bench, "compare", lambda *a: seen.setdefault(
        "compare", (a, compare(*a)))[1])
    monkeypatch.setattr(dev.bench, "report", lambda *a: seen.setdefault("report", a))
    monkeypatch.setattr(dev.bench, "time_train_loop",
                        lambda config, data, steps, host_only=False, **kw: 0.25)
    monkeypatch.setattr(dev.bench, "profile_split", lambda step, batches, compiled=False: (
        seen.setdefault("profiled", (step, batches)), ({}, 0.0))[1])
    dev.bench.main(["--data_dir", str(tmp_path / "c"), "--lang_tgt", "it", *TINY,
                    "--model_folder", str(tmp_path / "w"), *flags])
    return made, calls, seen


def test_bench_times_each_model_after_the_warm_up_on_the_same_batches_in_turn(tmp_path,
                                                                            monkeypatch,
                                                                            capsys):
    """dev.bench's compare: ours, nn.Transformer and (with --precision bf16) the fp32 model
    with ours' weights step through the same batches, the first two taking turns at going
    first; the warm-up steps are untimed and count no FLOPs (the target vocabulary's
    projection counted); each step's line has each model's time under its own name; the
    --loss_block_rows setting is ours' loss's."""
    from dev.timing import model_flops
    made, calls, seen = _bench_main_on_fake_steps(
        tmp_path, monkeypatch, "--steps", "3", "--warmup_steps", "2", "--baseline_steps", "0",
        "--train_steps", "0", "--profile_steps", "0", "--precision", "bf16",
        "--loss_block_rows", "64")
    (config, data, _, _), (ours, theirs, fp32, flops, batches) = seen["compare"]
    assert made == [ours, theirs, fp32] and len(batches) == 5
    assert [(step, batch) for step, batch in calls] == [
        (step, batch) for n, batch in enumerate(batches)
        for step in ((ours, theirs) if n % 2 == 0 else (theirs, ours)) + (fp32,)]
    for step in made:
        assert step.records == [False, False, True, True, True] and len(step.times) == 3
    tgt_vocab = data.tokenizer_tgt.get_vocab_size()
    assert tgt_vocab != data.tokenizer_src.get_vocab_size()
    assert flops == [model_flops(config, b, tgt_vocab) for b in batches[2:]]
    out = capsys.readouterr().out
    assert "  step 1: warm-up (" in out and "  step 2: ours 1.00s, nn.Transformer 2.00s (" in out
    assert (ours.loss_fn.block_rows, theirs.loss_fn.block_rows) == (64, None)
    weights, plain = ours.model.state_dict(), fp32.model.state_dict()
    assert plain.keys() == weights.keys() and all(torch.equal(plain[k], weights[k])
                                                  for k in weights)


def test_the_baseline_pads_every_side_to_seq_len_and_times_its_steps_after_the_first(
        tmp_path, monkeypatch):
    """dev.bench's pad-to-seq_len baseline: batches of --baseline_batch_size sentences, each
    side (labels too) padded to --baseline_seq_len, a new batch each step, the first one
    untimed; it is the report's last row."""
    made, calls, seen = _bench_main_on_fake_steps(
        tmp_path, monkeypatch, "--steps", "1", "--warmup_steps", "0", "--baseline_steps", "2",
        "--baseline_seq_len", "30", "--baseline_batch_size", "3", "--train_steps", "0",
        "--profile_steps", "0", "--precision", "fp32")
    baseline = made[2]
    batches = [batch for step, batch in calls if step is baseline]
    assert baseline.records == [False, True, True] and len(batches) == 3
    for batch in batches:
        assert {key: tuple(batch[key].shape) for key in ("encoder_input", "decoder_input",
                                                         "label")} == dict.fromkeys(
            ("encoder_input", "decoder_input", "label"), (3, 30))
    assert not torch.equal(batches[1]["encoder_input"], batches[2]["encoder_input"])
    rows = seen["report"][0]
    assert rows[-1] == ("baseline: 3 sentences padded to 30", baseline)


def test_bench_profiles_the_last_timed_batches_and_sets_the_host_time_against_ours(
        tmp_path, monkeypatch, capsys):
    """dev.bench --profile_steps N profiles ours on the last N timed batches (not the warm-up's);
    --host_steps sets the loop's host time a step against ours' mean step (1 s here, the
    loop's 0.25 s: 0.80x the step where the host waits for nothing else)."""
    made, _, seen = _bench_main_on_fake_steps(
        tmp_path, monkeypatch, "--steps", "3", "--warmup_steps", "2", "--baseline_steps", "0",
        "--train_steps", "0", "--profile_steps", "2", "--host_steps", "2", "--precision", "fp32")
    _, (ours, _, _, _, batches) = seen["compare"]
    step, profiled = seen["profiled"]
    assert step is ours and [id(b) for b in profiled] == [id(b) for b in batches[-2:]]
    assert ("host time of train.py's loop a step, the device's work removed: 250.0 ms, against "
            "the model's step 1000.0 ms: where the host waits for nothing else, the loop runs at "
            "0.80x the step") in capsys.readouterr().out


def test_the_loop_counts_every_batch_of_an_update_and_its_host_time_the_steps_done(
        tmp_path, monkeypatch, capsys):
    """time_train_loop on a fake clock (batch k takes k seconds): under --accum_steps 2 an update's
    tokens are both its batches'; with host_only, when the epoch ends before the steps asked,
    the mean is over the steps done; and host_only still copies each batch to the device (what
    the host pays for it on a GPU)."""

    from conftest import TINY, make_corpus

    from config import parse_config
    from dataset import get_ds
    from dev.bench import time_train_loop
    make_corpus(tmp_path / "c", n=120, val=4)
    config, _ = parse_config(["--data_dir", str(tmp_path / "c"), *TINY, "--accum_steps", "2",
                              "--model_folder", str(tmp_path / "w")])
    data = get_ds(config)
    counts, ended = fake_clock(monkeypatch)
    figure = time_train_loop(config, data, 1)
    assert len(counts) == 4  # an untimed update and a timed one, of 2 batches each
    assert figure == pytest.approx(sum(counts[2:]) / (ended(4) - ended(2)))
    counts.clear()
    config = dataclasses.replace(config, accum_steps=1)
    copied, to = [], torch.Tensor.to

    def copy(tensor, *args, **kwargs):
        copied.append(kwargs.get("non_blocking"))
        return to(tensor, *args, **kwargs)
    monkeypatch.setattr(torch.Tensor, "to", copy)
    figure = time_train_loop(config, data, 1000, host_only=True)
    n = len(counts)
    assert 2 < n < 1001 and figure == pytest.approx((ended(n) - ended(1)) / (n - 1))
    assert copied.count(True) >= 4 * n  # each batch's four tensors
    assert f"its epoch ended after {n} steps" in capsys.readouterr().out


def test_the_decoding_report_prints_medians_tokens_with_eos_and_each_ratio_ours_over_theirs(
        monkeypatch, capsys):
    """dev.bench_decode's report on outputs and times made by hand: each row's seconds the
    median of its passes, its tokens/s counting each output's [EOS], its agreement with this
    repo's greedy; each ratio the median of the passes' ratios of the engine's time over ours
    (ours' sentences/s over the engine's), greedy held to 1.0 and beam search to 1.3."""
    import dev.bench_decode as bench
    monkeypatch.setattr(bench, "detokenize", lambda tok, ids: " ".join(map(str, ids)))
    monkeypatch.setattr(bench, "score", lambda hypotheses, references, **kw: {
        "bleu": 1.0, "chrf": 2.0, "report": "BLEU = 1.0 (nrefs:1|version:2)"})
    greedy = {0: [5, 6], 1: [5], 2: [7, 7, 7]}  # 6 tokens, 9 with the [EOS]
    outputs = {"this repo, greedy": greedy, "this repo, beam 4": {**greedy, 2: [7]},
               "CTranslate2 float32, greedy": {**greedy, 1: [6]},
               "CTranslate2 float32, beam 4": {**greedy, 2: [7]}}
    times = {"this repo, greedy": [0.010, 0.015, 0.035], "this repo, beam 4": [0.1] * 3,
             "CTranslate2 float32, greedy": [0.02] * 3, "CTranslate2 float32, beam 4": [0.13] * 3}
    runs = [(name, None, range(3)) for name in outputs]
    bench.report(runs, outputs, times, ["r0", "r1", "r2"], None)
    lines = capsys.readouterr().out.splitlines()
    rows = {line[:48].strip(): line[48:].split() for line in lines if "/3" in line}
    assert rows["this repo, greedy"] == ["0.01", "600", "1.00", "2.00", "3/3"], lines
    assert rows["this repo, beam 4"][1:] == ["70", "1.00", "2.00", "2/3"]
    assert rows["CTranslate2 float32, greedy"][1:] == ["450", "1.00", "2.00", "2/3"]
    assert ("this repo, greedy / CTranslate2 float32, greedy, sentences/s: 1.33x, the median of "
            "the 3 passes' ratios (0.57, 1.33, 2.00); target >= 1.0") in lines
    assert ("this repo, beam 4 / CTranslate2 float32, beam 4, sentences/s: 1.30x, the median of "
            "the 3 passes' ratios (1.30, 1.30, 1.30); target >= 1.3") in lines


def test_the_decoders_pass_time_is_every_batch_of_it_and_the_longest_go_first(monkeypatch):
    """decode_in_turn on a fake clock (a call takes a second a sentence): a decoder's time in a
    pass is the sum of all its batches' (not the last one's); the untimed call and the first
    timed batch are the longest sentences (as the decoders batch them)."""
    import types

    import dev.bench_decode as bench
    clock, parts = [0.0], []
    monkeypatch.setattr(bench, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))

    def run(part):
        parts.append(sorted(len(i) for i in part))
        clock[0] += len(part)
        return [[4]] * len(part)
    ids = [[5] * n for n in (4, 1, 8, 6, 2, 10, 3, 9, 5, 7)]
    _, times = bench.decode_in_turn([("this repo, greedy", run, range(10))], ids, batch=3,
                                    repeats=2)
    assert times == {"this repo, greedy": [10.0, 10.0]}
    assert parts[:3] == [[8, 9, 10], [8, 9, 10], [5, 6, 7]] and parts[4] == [1]


def test_the_decoding_profile_times_each_search_after_its_warm_up_and_prints_its_shares(
        monkeypatch, capsys):
    """profile_searches on a fake clock: each search run 3 times untimed, then its unprofiled
    time the median of 5 runs, a step's time that over the decoding steps, each part's share
    of the split in percent; profile() takes the batch of middle-length sentences."""
    import itertools
    import types
    from contextlib import nullcontext

    import dev.bench_decode as bench
    clock, given = [0.0], []
    seconds = itertools.cycle([9, 9, 9, 1, 2, 3, 4, 50, 7])  # 3 untimed, 5 timed, profiled
    monkeypatch.setattr(bench, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    monkeypatch.setattr(bench, "decoding_model", lambda model, rows, fast=True: object())
    monkeypatch.setattr(bench, "translate_ids", lambda *a, **k: clock.__setitem__(
        0, clock[0] + next(seconds)))

    def split(events, wall, profiled):
        given.append((wall, profiled))
        return 100, {"matrix products": 2e6, "Python and dispatch": 1e6}
    monkeypatch.setattr(bench, "profile_split", split)

    def profiler():
        return nullcontext(types.SimpleNamespace(events=lambda: []))
    bench.profile_searches(None, [[5]] * 4, {}, 3, 4, profiler)
    assert given == [(3e6, 7e6)] * 4
    out = capsys.readouterr().out
    assert "greedy, 4 sentences (object): 3000.0 ms unprofiled, 100 decoding steps, 30000 us a " \
        "step" in out
    assert out.count(f"  {'matrix products':28} {2000.0:8.1f} ms {20000:8.0f} us a step "
                     f"{66.7:5.1f}%") == 4
    middle = []
    monkeypatch.setattr(bench, "profile_searches", lambda model, m, *a: middle.extend(m))
    bench.profile(types.SimpleNamespace(encode=None), [[5] * n for n in range(1, 11)],
                  {"batch_size": 4}, 3)
    assert [len(i) for i in middle] == [4, 5, 6, 7]


def test_bench_loss_prints_each_median_after_an_untimed_call_and_its_ratio_to_torchs(
        monkeypatch, capsys):
    """dev/bench_loss.py's measure on a fake clock: each loss's first call untimed, its median
    over the calls in ms, and its ratio to torch's median (below 1: faster); bf16 autocast only
    under --precision bf16."""
    import types

    import dev.bench_loss as bench
    clock, autocast = [0.0], []
    seconds = {None: iter([0.1, 0.002, 0.004, 0.009]), 0: iter([0.1, 0.001, 0.002, 0.006]),
               8: iter([0.1, 0.008, 0.012, 0.030])}  # torch's, blockwise default and 8 rows

    def called(key, x):
        autocast.append(torch.is_autocast_enabled("cpu"))
        clock[0] += next(seconds[key])
        return x.sum()

    class Blockwise:
        def __init__(self, smoothing, ignore_index, block_rows):
            self.rows = block_rows

        def __call__(self, x, projection, label):
            return called(self.rows, x)
    monkeypatch.setattr(bench, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    monkeypatch.setattr(bench, "torch_loss", lambda x, *a: called(None, x))
    monkeypatch.setattr(bench, "BlockwiseLabelSmoothedCrossEntropy", Blockwise)
    bench.measure(4, 10, 6, [0, 8], "fp32", 3, torch.device("cpu"))
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[-6:] for line in lines[1:]] == [
        ["logits", "4.0", "ms", "1.00x", "torch's", "time"],
        ["(default)", "2.0", "ms", "0.50x", "torch's", "time"],
        ["rows", "12.0", "ms", "3.00x", "torch's", "time"]], lines
    assert autocast == [False] * 12
    seconds = {key: iter([0.001] * 2) for key in seconds}
    autocast.clear()
    bench.measure(4, 10, 6, [0, 8], "bf16", 1, torch.device("cpu"))
    assert autocast == [True] * 6


def test_bench_validation_times_each_part_beside_its_reference_and_prints_medians(
        monkeypatch, capsys):
    """dev/bench_validation.py on a fake clock: parts() puts the fast loss and error rates in
    the first column, their references (two projections, the edit distance's table) in the
    second; main prints each part's median over the calls, the reference over this repo's
    time, and the whole with the parts without a reference counted on both sides."""
    import types

    import dev.bench_validation as bench
    import train
    from nmt import metrics
    clock = [0.0]

    def takes(seconds, value=None):
        clock[0] += seconds
        return value
    monkeypatch.setattr(bench, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    monkeypatch.setattr(bench, "validation_loss", lambda run: takes(
        1.0 if run.loss_fn.loss_and_nll == "one pass" else 5.0))
    monkeypatch.setattr(bench, "validation_translations", lambda run, progress, n: takes(
        10.0, [[5, 6]]))
    monkeypatch.setattr(bench, "detokenize", lambda tok, ids: "a b")
    monkeypatch.setattr(metrics, "score", lambda *a, **k: takes(3.0))
    table = metrics.table_edit_distance
    monkeypatch.setattr(bench, "error_rates", lambda p, r: takes(
        7.0 if metrics.edit_distance is table else 2.0))
    monkeypatch.setattr(bench, "log_attention", lambda *a: takes(0.5))
    run = types.SimpleNamespace(
        data=types.SimpleNamespace(validation=types.SimpleNamespace(tgt_texts=["a b"],
                                                                    src_ids=[[5]]),
                                   tokenizer_tgt=None),
        model=torch.nn.Linear(1, 1), loss_fn=types.SimpleNamespace(loss_and_nll="one pass"))
    assert bench.parts(run, types.SimpleNamespace(step=3), 1) == [
        ("loss and nll", 1.0, 5.0), ("greedy decoding", 10.0, None),
        ("BLEU, chrF, lowercased BLEU", 3.0, None), ("CER and WER", 2.0, 7.0),
        ("the attention picture", 0.5, None)]
    calls = iter([[("loss and nll", this, ref), ("greedy decoding", greedy, None),
                   ("CER and WER", 0.5, cer)] for this, ref, greedy, cer in
                  ((9.0, 9.0, 9.0, 9.0), (1.0, 3.0, 10.0, 2.0), (2.0, 4.0, 11.0, 2.5),
                   (6.0, 5.0, 30.0, 1.5))])  # the first untimed
    closed = types.SimpleNamespace(close=lambda: None, release=lambda: None)
    monkeypatch.setattr(train, "set_up", lambda config, given: (
        types.SimpleNamespace(writer=closed, lock=closed), None))
    monkeypatch.setattr(bench, "validated_sentences", lambda run: 8)
    monkeypatch.setattr(bench, "parts", lambda run, progress, n: next(calls))
    bench.main(["--calls", "3"])
    lines = capsys.readouterr().out.splitlines()
    rows = {line[:32].strip(): line[32:].split() for line in lines[2:6]}
    assert rows == {"loss and nll": ["2.000", "4.000", "2.00x"], "greedy decoding": ["11.000"],
                    "CER and WER": ["0.500", "2.000", "4.00x"],
                    "in all": ["13.500", "17.000", "1.26x"]}, lines


def test_the_split_of_a_step_is_in_percent_of_its_wall_time_and_never_below_zero(monkeypatch):
    """profile_split on a fake clock (a step takes 100 us) and a split made by hand: each part's
    share in percent of the steps' wall time, the wall time not covered the rest; where the
    parts add up to more than the wall time (the profiler's own cost), none is uncovered."""
    import types

    import dev.bench
    from dev.bench import LOSS, profile_split
    clock, split = [0.0], {}
    monkeypatch.setattr(dev.bench, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    monkeypatch.setattr(dev.bench, "split_events", lambda events, cuda: split)

    class Step:
        device = torch.device("cpu")

        def __call__(self, batch, record=True):
            clock[0] += 1e-4
    split.update({("matrix products", "aten::mm"): 60.0, ("attention", "aten::bmm"): 50.0,
                  (LOSS, "aten::addmm"): 30.0, ("matrix products", "aten::addmm"): 20.0})
    shares, uncovered = profile_split(Step(), [None, None])  # 200 us
    assert shares == pytest.approx({"matrix products": 40.0, "attention": 25.0, LOSS: 15.0,
                                    "optimizer": 0.0, "elementwise and other": 0.0})
    assert uncovered == pytest.approx(20.0)
    split[("optimizer", "aten::_fused_adam_")] = 100.0
    assert profile_split(Step(), [None, None])[1] == 0.0


def test_bench_data_makes_aligned_pairs_and_prints_each_runs_figures(tmp_path, monkeypatch):
    """dev/bench_data.py's corpus and table, its three train.py runs stood in for: each line
    joins --join source pairs, the same on both sides; a corpus of another size is made again;
    the runs' steps and workers as documented, and each run's seconds and memory printed in
    their columns (the worker's USS in the training row only)."""
    from dev import bench_data
    source = tmp_path / "source"
    source.mkdir()
    for language in ("en", "de"):  # sentence i: 10 words that name it
        (source / f"train.{language}").write_text("".join(
            " ".join(f"{language}{i}w{k}" for k in range(10)) + "\n" for i in range(20)))
    figures = {"first start": (12.5, 300.0, 0.0), "second start": (3.5, 410.0, 0.0),
               "training": (20.0, 520.0, 64.0)}
    flags = {}

    def run_train(args, given, label):
        flags[label] = given
        prepared = tmp_path / "m" / "prepared"
        prepared.mkdir(parents=True, exist_ok=True)
        with open(prepared / "data.bin", "wb") as f:
            f.truncate(3 * 2**20)
        return (*figures[label], "log")
    monkeypatch.setattr(bench_data, "run_train", run_train)
    common = ["--source", source, "--out", tmp_path / "out", "--model_folder", tmp_path / "m",
              "--train_steps", "5", "--num_workers", "3"]
    t = run_here("dev/bench_data.py", *common, "--pairs", "30", cwd=tmp_path)
    assert t.returncode == 0, t.stderr.decode()
    en, de = ((tmp_path / "out" / f"train.{lang}").read_text().splitlines()
              for lang in ("en", "de"))
    assert len(en) == len(de) == 30
    assert len((tmp_path / "out/val.en").read_text().splitlines()) == 3000
    for english, german in zip(en, de):
        picks = [w.split("w")[0][2:] for w in english.split()[::10]]
        assert len(picks) == 3 and [w.split("w")[0][2:] for w in german.split()[::10]] == picks
    out = t.stdout.decode()
    size = sum(f.stat().st_size for f in (tmp_path / "out").glob("train.*")) / 2**30
    assert f"corpus: 30 pairs, {size:.2f} GiB of text, about 30 words per English" in out
    rows = {line[:46].strip(): line[46:].split() for line in out.splitlines()
            if line.startswith(("first start", "second start", "5 steps, 3 workers"))}
    assert rows == {"first start: tokenizers, preparation, 1 step": ["12.5", "300", "MB"],
                    "second start, to its first step": ["3.5", "410", "MB"],
                    "5 steps, 3 workers": ["20.0", "520", "MB", "64", "MB"]}, out
    steps = {label: (f[f.index("--max_steps") + 1], "--num_workers" in f and
                     f[f.index("--num_workers") + 1]) for label, f in flags.items()}
    assert steps == {"first start": ("1", False), "second start": ("2", False),
                     "training": ("7", "3")}
    assert "prepared data: 3 MiB in" in out
    t = run_here("dev/bench_data.py", *common, "--pairs", "30", cwd=tmp_path)
    assert "made 30 pairs" not in t.stdout.decode()  # the corpus there has the size asked
    t = run_here("dev/bench_data.py", *common, "--pairs", "4", cwd=tmp_path)
    assert "made 4 pairs" in t.stdout.decode()
    assert len((tmp_path / "out/train.de").read_text().splitlines()) == 4
    # nor is a corpus of the same size made with another --join (it was kept), or half-made
    t = run_here("dev/bench_data.py", *common, "--pairs", "4", "--join", "1", cwd=tmp_path)
    assert "made 4 pairs" in t.stdout.decode()
    assert [len(line.split()) for line in (tmp_path / "out/train.en").read_text().splitlines()] \
        == [10] * 4
    (tmp_path / "out/made_by_bench_data").unlink()  # (stopped while it was written)
    t = run_here("dev/bench_data.py", *common, "--pairs", "4", "--join", "1", cwd=tmp_path)
    assert "made 4 pairs" in t.stdout.decode()


def test_bench_data_makes_its_corpus_again_for_another_source_or_after_a_failed_make(
        tmp_path, monkeypatch):
    """bench_data's corpus is kept only for the same --source folder (another folder, or the
    same relative name from another directory, is made again), and a make that fails leaves no
    recipe behind: the recipe of the corpus it was overwriting would keep a half-made one; a
    recipe cut short is another's, not a JSON error."""
    from dev import bench_data
    made, failing = [], [False]

    def make_corpus(source, out, pairs, join):
        made.append(source.resolve())
        if failing[0]:
            (out / "train.en").write_text("half\n")
            raise KeyboardInterrupt
        out.mkdir(parents=True, exist_ok=True)
        for name in ("train.en", "train.de"):
            (out / name).write_text("a b\n" * pairs)

    class Stop(Exception):
        pass

    def run_train(args, flags, label):
        raise Stop
    monkeypatch.setattr(bench_data, "make_corpus", make_corpus)
    monkeypatch.setattr(bench_data, "run_train", run_train)
    for folder in ("one/src", "two/src"):
        (tmp_path / folder).mkdir(parents=True)
        (tmp_path / folder / "train.en").write_text("x\n")

    def bench(cwd, source, pairs="4"):
        monkeypatch.chdir(tmp_path / cwd)
        with pytest.raises(Stop):
            bench_data.main(["--source", str(source), "--out", str(tmp_path / "out"),
                             "--pairs", pairs, "--model_folder", str(tmp_path / "m")])
    bench(".", tmp_path / "one/src")
    bench(".", tmp_path / "one/src")
    bench(".", tmp_path / "two/src")
    bench("one", "src")
    bench("two", "src")
    assert made == [tmp_path / f for f in ("one/src", "two/src", "one/src", "two/src")]
    failing[0] = True
    with pytest.raises(KeyboardInterrupt):
        bench("two", "src", "5")
    assert not (tmp_path / "out/made_by_bench_data").exists()
    failing[0] = False
    bench("two", "src")
    assert len(made) == 6 and (tmp_path / "out/train.en").read_text() == "a b\n" * 4
    (tmp_path / "out/made_by_bench_data").write_text('{"sou')  # (a stop as it was written)
    bench("two", "src")  # (review fix: it was a JSONDecodeError)
    assert len(made) == 7


def test_bench_data_reads_a_processes_memory_from_proc(tmp_path, monkeypatch):
    """memory_mb: PSS in MiB from smaps_rollup, or USS (private clean and dirty pages) for a
    worker; 0 where the file cannot be read. children: the pids /proc lists."""
    from dev import bench_data
    (tmp_path / "smaps_rollup").write_text(
        "55d0-7ffd ---p 00000000 00:00 0 [rollup]\nRss: 5120 kB\nPss: 3072 kB\n"
        "Pss_Anon: 1024 kB\nShared_Clean: 512 kB\nPrivate_Clean: 1024 kB\n"
        "Private_Dirty: 512 kB\n")
    (tmp_path / "children").write_text("7 12 ")
    monkeypatch.setattr(bench_data, "Path", lambda path: tmp_path / path.split("/")[-1]
                        if path.startswith("/proc/5/") else tmp_path / "missing")
    assert bench_data.memory_mb(5) == 3.0 and bench_data.memory_mb(5, private=True) == 1.5
    assert bench_data.memory_mb(6) == 0.0
    assert bench_data.children(5) == [7, 12] and bench_data.children(6) == []


def test_bench_data_keeps_the_peak_of_a_runs_memory(monkeypatch):
    """run_train samples the main process's PSS and each child's USS while train.py runs and
    keeps the highest of each, not the last sample; a failed run stops with its exit status."""
    import threading
    import time
    from types import SimpleNamespace

    from dev import bench_data
    samples = {(1, False): [100.0, 300.0, 200.0], (7, True): [50.0, 80.0, 60.0]}
    done = threading.Event()

    class Proc:
        pid, returncode, polls = 1, 0, 0

        def __init__(self, command, **kw):
            self.command = command

        def poll(self):
            self.polls += 1
            if self.polls > 3:
                done.set()
                return self.returncode
            return None

        def communicate(self):
            done.wait(10)
            return "the log", None
    monkeypatch.setattr(bench_data.subprocess, "Popen", Proc)
    monkeypatch.setattr(bench_data, "memory_mb",
                        lambda pid, private=False: samples.get((pid, private), [999.0]).pop(0))
    monkeypatch.setattr(bench_data, "children", lambda pid: [7])
    monkeypatch.setattr(bench_data, "time", SimpleNamespace(time=time.time,
                                                           sleep=lambda s: None))
    seconds, main, worker, log = bench_data.run_train(None, ["--max_steps", "1"], "training")
    assert (main, worker, log) == (300.0, 80.0, "the log") and seconds >= 0
    Proc.returncode, Proc.polls = 3, 0
    done.clear()
    samples.update({(1, False): [1.0] * 3, (7, True): [1.0] * 3})
    with pytest.raises(SystemExit) as stop:
        bench_data.run_train(None, [], "first start")
    assert str(stop.value.code).startswith("python -m dev.bench_data: first start failed (exit 3)")


def test_bench_attention_prints_the_median_of_the_calls_after_the_first(monkeypatch):
    """dev/bench_attention.py on a stood-in clock: each call's time includes the picture's
    writing (the writer flushed inside the timing); the median leaves the first call out, which
    is printed apart; the decoder's depth and the threads are those of the run."""
    from types import SimpleNamespace

    import dev.bench_attention as bench
    events, durations = [], iter([9.0, 1.0, 5.0, 2.0])
    clock = [0.0]

    def perf_counter():
        events.append("clock")
        if events.count("clock") % 2 == 0:
            clock[0] += next(durations)
        return clock[0]

    class Writer:
        def __init__(self, folder):
            pass

        def flush(self):
            events.append("flush")

        def close(self):
            events.append("close")
    monkeypatch.setattr(bench, "time", SimpleNamespace(perf_counter=perf_counter))
    monkeypatch.setattr(bench, "SummaryWriter", Writer)
    monkeypatch.setattr(bench, "log_attention", lambda run, src, tgt, step: events.append("draw"))
    t = run_here("dev/bench_attention.py", "--d_model", "32", "--N", "3", "--N_dec", "1", "--h",
                 "2", "--d_ff", "64", "--seq_len", "40", "--calls", "3", "--threads", "2",
                 cwd=ROOT)
    assert t.returncode == 0, t.stderr.decode()
    assert events == ["clock", "draw", "flush", "clock"] * 4 + ["close"]
    assert t.stdout.decode().strip() == (
        "the attention picture a validation (1 decoder layers, d_model 32, 14 source and 15 "
        "generated tokens, 2 thread(s)): median 2.000 s of 3 calls (first call 9.000 s)")


def test_bench_bpe_dropout_refuses_a_config_train_py_would_refuse():
    """bench_bpe_dropout's parse: the config's own checks refuse in one line (exit 2); the flag
    given is kept, and with none (0) 0.1 is timed."""
    from dev.bench_bpe_dropout import parse
    with pytest.raises(SystemExit) as stop:
        parse(["--d_model", "30", "--h", "4"])
    assert stop.value.code == 2
    assert parse(["--bpe_dropout", "0.3"])[1].bpe_dropout == 0.3
    assert parse(["--bpe_dropout", "0"])[1].bpe_dropout == 0.1


def test_bench_bpe_dropout_prices_each_epoch_from_its_own_making_and_steps(trained,
                                                                          monkeypatch):
    """bench_bpe_dropout's table and ratios on a stood-in clock (each batch made in 1 s, or a
    pool in 1 s shared by its batches) and steps of no time: each kind's make time, padding
    shares and epoch time, and the ratios with and without the flag the right way up (the
    pooled epoch over the plain one; each batch alone over the plain one); warm-up steps
    untimed."""
    import re
    from types import SimpleNamespace

    import dev.bench_bpe_dropout as bench
    from tokenizer import PAD
    home, _ = trained
    clock, made, steps = [0.0], {}, []

    def perf_counter():
        clock[0] += 1.0  # (two reads a making: 1 s)
        return clock[0]

    class Step:
        def __init__(self, model, config, device):
            self.times, self.padded, self.records = [], [], []
            steps.append(self)

        def __call__(self, batch, record=True):
            self.records.append(record)
            if record:
                self.times.append(0.0)
                self.padded.append(batch["encoder_input"].numel() + batch["label"].numel())
    real_epoch = bench.epoch_batches

    def epoch_batches(data, sampler, dropout, pool):
        made[pool] = real_epoch(data, sampler, dropout, pool)
        return made[pool]
    monkeypatch.setattr(bench, "time", SimpleNamespace(perf_counter=perf_counter))
    monkeypatch.setattr(bench, "Step", Step)
    monkeypatch.setattr(bench, "epoch_batches", epoch_batches)
    t = run_here("dev/bench_bpe_dropout.py", *BPE_DROPOUT_TINY, "--steps", "3",
                 "--warmup_steps", "2", cwd=home)
    out = t.stdout.decode()
    assert t.returncode == 0, t.stderr.decode()[-2000:]
    assert [s.records for s in steps] == [[False] * 2 + [True] * 3] * 3
    rows = {line[:34].strip(): line[34:] for line in out.splitlines()
            if line.startswith(("plain", "dropout"))}
    for (name, row), pool in zip(rows.items(), (0, 16, 1)):
        batches = made[pool][0]
        n, pools = len(batches), -(-len(batches) // max(pool, 1))
        padding = [100 * (1 - sum(int((b[k] != PAD).sum()) for b in batches) /
                          sum(b[k].numel() for b in batches)) for k in ("encoder_input", "label")]
        share = re.search(r"([\d.]+)% /\s*([\d.]+)%", row).groups()
        assert share == tuple(f"{p:.1f}" for p in padding), (name, row)
        make_ms, _, epoch = row.split()[-3:]  # a pool's second shared by its batches
        assert (make_ms, epoch) == (f"{1000 * pools / n:.1f}", f"{pools:.0f}"), (name, row)
    plain, pooled = len(made[0][0]), -(-len(made[16][0]) // 16)
    ratio = f"epoch with --bpe_dropout 0.1 / without: {pooled / plain:.2f}x (each batch " \
            f"segmented alone: {len(made[1][0]) / plain:.2f}x)"
    assert ratio in out and pooled < plain, out


def test_the_picture_counts_a_pause_of_exactly_gap_minutes(tmp_path):
    """plot_runs.curve: a pause of exactly --gap minutes is counted (only one of more is left
    out), and a validation's time counts from the event before it, a validation or not."""
    from torch.utils.tensorboard import SummaryWriter

    from dev.plot_runs import curve
    writer = SummaryWriter(str(tmp_path))
    for step, (tag, value, minute) in enumerate([
            ("train/loss", 5.0, 0), ("validation/bleu", 10.0, 4), ("validation/bleu", 12.0, 14),
            ("train/loss", 3.0, 40), ("validation/bleu", 20.0, 41)]):
        writer.add_scalar(tag, value, step, walltime=1_000_000.0 + 60 * minute)
    writer.close()
    assert curve(tmp_path, gap_minutes=10) == [(4.0, 10.0), (14.0, 12.0), (15.0, 20.0)]


def test_plot_runs_draws_each_run_with_its_label_and_axes(tmp_path):
    """`python -m dev.plot_runs`: one curve a run with its label, the axes of --metric and --x,
    the picture written where --output says (its folder made); a label count that is not the
    runs' and a metric the logs lack are refused in one line."""
    from torch.utils.tensorboard import SummaryWriter

    from nmt.plotting import pyplot
    for run, loss in (("a", 4.0), ("b", 3.0)):
        writer = SummaryWriter(str(tmp_path / run))
        for i, (step, minute) in enumerate(((1, 0), (100, 30), (200, 31))):
            writer.add_scalar("train/loss", 9.0, step, walltime=1_000_000.0 + 60 * minute)
            writer.add_scalar("validation/loss", loss + i / 2, step,
                              walltime=1_000_000.0 + 60 * minute + 1)
        writer.close()
    plt = pyplot()
    runs = [tmp_path / "a", tmp_path / "b"]
    try:
        t = run_here("dev/plot_runs.py", *runs, "--labels", "fp32", "bf16", "--metric", "loss",
                     "--x", "steps", "--output", tmp_path / "new/loss.png", cwd=tmp_path)
        assert t.returncode == 0, t.stderr.decode()
        assert (tmp_path / "new/loss.png").stat().st_size > 0
        ax = plt.gcf().axes[0]
        assert (ax.get_xlabel(), ax.get_ylabel()) == ("optimizer steps", "validation loss")
        assert [(line.get_label(), line.get_xydata().tolist()) for line in ax.lines] == [
            ("fp32", [[1, 4.0], [100, 4.5], [200, 5.0]]),
            ("bf16", [[1, 3.0], [100, 3.5], [200, 4.0]])]
        t = run_here("dev/plot_runs.py", *runs, "--metric", "loss", "--output",
                     tmp_path / "minutes.png", cwd=tmp_path)  # an hour's pause left out
        assert plt.gcf().axes[0].get_xlabel() == "training minutes (validation included)"
        assert plt.gcf().axes[0].lines[0].get_xydata().ravel().tolist() == pytest.approx([
            1 / 60, 4.0, 2 / 60, 4.5, 62 / 60, 5.0])  # (each validation 1 s after)
        t = run_here("dev/plot_runs.py", *runs, "--output", tmp_path / "bleu.png", cwd=tmp_path)
        assert t.returncode == 2 and "no validation/bleu" in t.stderr.decode()
        t = run_here("dev/plot_runs.py", *runs, "--labels", "fp32", "--output",
                     tmp_path / "x.png", cwd=tmp_path)
        assert t.returncode == 2 and "give one label a run" in t.stderr.decode()
        assert not (tmp_path / "x.png").exists()
    finally:
        plt.close("all")


def test_set_repo_refuses_a_name_or_files_it_cannot_set(tmp_path):
    """dev/set_repo.py: repositories() reads (the badge's, the notebook's) in that order; a name
    that is not owner/name is refused, and so is a notebook without its REPO setting, before
    either file is written."""
    from config import UserError
    from dev.set_repo import repositories, set_repository
    readme = ("[![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)]"
              "(https://colab.research.google.com/github/one/badge/blob/main/notebooks/"
              "colab.ipynb)\n")
    (tmp_path / "notebooks").mkdir()
    (tmp_path / "README.md").write_text(readme)
    notebook = tmp_path / "notebooks/colab.ipynb"
    notebook.write_text('{"cells": [{"source": ["REPO = \\"https://github.com/two/setting\\"\\n"]}]}')
    assert repositories(tmp_path) == ("one/badge", "two/setting")
    for name in ("someone", "someone/transformer/extra", "some one/transformer"):
        with pytest.raises(UserError):
            set_repository(name, tmp_path)
    notebook.write_text('{"cells": [{"source": ["REPO = None\\n"]}]}')
    with pytest.raises(UserError, match="is not where this tool looks"):
        set_repository("someone/transformer", tmp_path)
    assert (tmp_path / "README.md").read_text() == readme
