"""nmt/compiling.py: fixed batch shapes in a run and the step compiled once per shape (issue 62)."""

import torch
from conftest import TINY, make_corpus, run_here

from config import Config
from nmt.compiling import check_cuda_graphs, compiled
from tokenizer import EOS, PAD, SOS
from train import make_loss, train_step


def shaped_batches(count: int = 3, max_tokens: int = 120):
    """Batches of random pairs in `count` fixed shapes (nmt.shapes.FixedShapes), and the shapes."""
    import numpy as np

    from dataset import BilingualDataset, Collator
    from nmt.batching import TokenBatchSampler
    from nmt.shapes import FixedShapes, best_lengths
    rng = np.random.default_rng(0)
    data = BilingualDataset([rng.integers(4, 20, rng.integers(1, 14)).tolist()
                             for _ in range(120)],
                            [rng.integers(4, 20, rng.integers(1, 14)).tolist()
                             for _ in range(120)])
    shapes = FixedShapes(best_lengths(data.lengths(), count), max_tokens, 0)
    sampler = TokenBatchSampler(data.lengths(), max_tokens, shapes=shapes, seed=1)
    collate = Collator(PAD, shapes)
    return [collate([data[i] for i in b]) for b in sampler.batches(0)], shapes


def test_the_compiled_step_breaks_no_graph_and_compiles_once_per_shape(monkeypatch):
    """Issue 62: under fixed shapes, the compiled step (nmt.compiling.compiled: dynamic=False)
    traces one graph per shape, with no graph break (the loss included: kernels.py gives the
    compiler the whole-logits formula), and a shape seen again compiles nothing. Dynamo's own
    counters, with an eager backend (the tracing is the same; no code generation)."""
    import torch._dynamo as dynamo
    from torch._dynamo.utils import counters

    from conftest import tiny_model
    batches, shapes = shaped_batches()
    distinct = {tuple(b["encoder_input"].shape): b for b in batches}
    assert len(distinct) == 3
    dynamo.reset()
    counters.clear()
    real, calls = torch.compile, []

    def eager(graph, inputs):  # dynamo's eager backend, keeping the functions each graph calls
        calls.extend(node.target for node in graph.graph.nodes if node.op == "call_function")
        return graph.forward
    monkeypatch.setattr(torch, "compile", lambda model, **kw: real(model, backend=eager, **kw))
    config = Config(compile=True, max_tokens=120, d_model=32)
    step_model = compiled(tiny_model(vocab=20, seq_len=32).train(), config,
                                torch.device("cpu"), shapes)
    loss_fn = make_loss(config)
    for batch in [*distinct.values(), *distinct.values()]:  # each shape twice
        train_step(step_model, [batch], loss_fn, PAD, torch.device("cpu"))
    assert dict(counters["graph_break"]) == {}
    assert counters["stats"]["unique_graphs"] == 3
    # issue 70: the loss as the whole-logits formula under the compiler (kernels.py: it compiles
    # faster than the blocks'); disabling that branch passed
    assert torch.nn.functional.cross_entropy in calls
    dynamo.reset()


def test_the_compiled_step_equals_the_eager_one():
    """Issue 62: the compiled step (AOT autograd, what inductor compiles from; the default
    backend generates C++ too, minutes on CPU) gives the eager step's loss and gradients on a
    fixed-shape batch with filler rows, in fp32."""
    import torch._dynamo as dynamo

    from conftest import tiny_model
    batches, _ = shaped_batches(count=2)
    batch = {k: batches[0][k].clone() for k in ("encoder_input", "decoder_input", "label")}
    for v in batch.values():  # the last two rows made filler, as FixedShapes fills them
        v[-2:] = PAD
    batch["encoder_input"][-2:, :2] = torch.tensor([SOS, EOS])
    batch["decoder_input"][-2:, 0] = SOS
    batch["encoder_mask"] = (batch["encoder_input"] != PAD)[:, None, None, :]
    loss_fn = make_loss(Config())
    results = []
    for compiling in (False, True):
        model = tiny_model(vocab=20, seq_len=32).train()
        step = torch.compile(model, dynamic=False, backend="aot_eager") if compiling else model
        loss, _ = train_step(step, [batch], loss_fn, PAD, torch.device("cpu"))
        results.append((loss, [p.grad for p in model.parameters()]))
    torch.testing.assert_close(results[0][0], results[1][0], rtol=1e-5, atol=1e-6)
    for a, b in zip(results[0][1], results[1][1]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    dynamo.reset()


def test_a_run_with_fixed_shapes_says_what_they_cost_and_trains_in_them(tmp_path, monkeypatch):
    """Issue 62: --fixed_shapes prints its lengths, the shapes of the first epoch and the
    padding they add, and the run trains. Issue 70: in those shapes (a run that printed them
    and trained without them passed): every step's batch has one of the lengths printed and
    max_tokens // length rows."""
    import train
    make_corpus(tmp_path / "c", n=120, val=4)
    seen, real = [], train.train_step
    monkeypatch.setattr(train, "train_step", lambda model, group, *a, **k: (
        seen.extend(tuple(b[key].shape) for b in group for key in ("encoder_input", "label")),
        real(model, group, *a, **k))[1])
    t = run_here("train.py", "--data_dir", "c", *TINY, "--num_epochs", "1", "--fixed_shapes",
                 "3", cwd=tmp_path)
    out, err = t.stdout.decode(), t.stderr.decode()
    assert t.returncode == 0, err
    line = next(x for x in out.splitlines() if x.startswith("fixed shapes: 3 lengths ("))
    assert "shapes in epoch 0;" in line and "% tokens)" in line
    lengths = [int(n) for n in line.split("(")[1].split(")")[0].split(", ")]
    assert seen and {shape for shape in seen} <= {(200 // n, n) for n in lengths}, (seen, line)


def test_cuda_graphs_without_a_gpu_is_refused_before_any_file_is_written(tmp_path):
    """Issue 62: --cuda_graphs on a CPU is one line. Issue 70, 2: refused at the start, before
    the tokenizers and the prepared data are written; beside --bpe_dropout (no fixed shapes, so
    no reduce-overhead mode: it was accepted and ignored), refused with the flags."""
    make_corpus(tmp_path / "c", n=40, val=4)
    t = run_here("train.py", "--data_dir", "c", *TINY, "--compile", "--cuda_graphs",
                 "--model_folder", "g", cwd=tmp_path)
    assert t.returncode == 2 and t.stderr.decode().strip().splitlines()[-1] == \
        "train.py: error: --cuda_graphs needs a CUDA device (this run is on cpu): drop " \
        "--cuda_graphs or run on CUDA"
    assert not [p for p in tmp_path.rglob("*") if "c" not in p.relative_to(tmp_path).parts]
    t = run_here("train.py", "--data_dir", "c", *TINY, "--compile", "--cuda_graphs",
                 "--bpe_dropout", "0.1", "--device", "cuda", cwd=tmp_path)
    assert t.returncode == 2 and "--cuda_graphs captures fixed batch shapes, which " \
        "--bpe_dropout does not have" in t.stderr.decode()
    assert ": drop --cuda_graphs or --bpe_dropout (see --help)\n" in t.stderr.decode()
    check_cuda_graphs(Config(compile=True, cuda_graphs=True), torch.device("cuda"))


def test_a_cuda_graphs_checkpoint_resumed_on_a_cpu_is_refused_before_any_file_is_written(
        tmp_path):
    """The flag checked on the command line only: a checkpoint saved with --compile and
    --cuda_graphs, resumed with --device cpu, kept cuda_graphs and went on (the check had left
    `compiled`). Checked again on the config the resume merged: one line, exit 2, nothing
    written (no lock, no tokenizers, no prepared data)."""
    from conftest import tiny_state

    from nmt.checkpoint import save_checkpoint
    make_corpus(tmp_path / "c", n=40, val=4)
    saved = Config(data_dir="c", model_folder="g", compile=True, cuda_graphs=True, device="cuda")
    (tmp_path / "g").mkdir()
    save_checkpoint(tiny_state(0, optimizer_state_dict={}, config=saved.to_dict()),
                    tmp_path / "g" / "tmodel_00.pt")
    before = sorted(tmp_path.rglob("*"))
    t = run_here("train.py", "--model_folder", "g", "--device", "cpu", cwd=tmp_path)
    assert (t.returncode, t.stderr.decode()) == (2, "train.py: error: --cuda_graphs needs a "
                                                    "CUDA device (this run is on cpu): drop "
                                                    "--cuda_graphs or run on CUDA\n")
    assert sorted(tmp_path.rglob("*")) == before


def test_bench_refuses_cuda_graphs_on_a_cpu_before_any_file_is_written(tmp_path):
    """dev/bench.py compiled the step with --cuda_graphs on a CPU, unchecked: one line, before
    its corpus or data are written."""
    t = run_here("dev/bench.py", "--compile", "true", "--cuda_graphs", "true", "--device", "cpu",
                 "--wmt_pairs", "50", "--data_dir", "w", "--steps", "0", cwd=tmp_path)
    assert t.returncode == 2 and t.stderr.decode().endswith(
        "--cuda_graphs needs a CUDA device (this run is on cpu): drop --cuda_graphs or run on "
        "CUDA\n"), t.stderr.decode()
    assert list(tmp_path.iterdir()) == []


def test_fixed_shapes_are_16_under_compile_and_off_without_it():
    """docs/scaling.md's promise (issue 70): --fixed_shapes 0 means 16 lengths under --compile
    and none without it; a number given is taken; BPE-dropout has none."""
    assert Config().shape_count() == 0 and Config(compile=True).shape_count() == 16
    assert Config(fixed_shapes=3).shape_count() == 3
    assert Config(compile=True, fixed_shapes=5).shape_count() == 5
    assert Config(compile=True, bpe_dropout=0.1).shape_count() == 0


def test_the_compiled_step_has_room_for_every_shape_and_cuda_graphs(monkeypatch):
    """Issue 70: the recompile limit raised to a run's shapes (16 under --compile, in train and
    eval modes: over dynamo's default 8; 3 shapes stayed under it, so removing the raise
    passed), and --cuda_graphs as torch.compile's reduce-overhead mode."""
    import torch._dynamo as dynamo

    from nmt.shapes import FixedShapes
    calls = []
    monkeypatch.setattr(torch, "compile", lambda model, **kw: calls.append(kw) or model)
    name = next(n for n in ("recompile_limit", "cache_size_limit") if hasattr(dynamo.config, n))
    monkeypatch.setattr(dynamo.config, name, 8)
    shapes = FixedShapes(tuple(range(8, 24)), 400, 0)
    for graphs in (False, True):
        compiled(torch.nn.Linear(2, 2), Config(compile=True, cuda_graphs=graphs),
                 torch.device("cuda"), shapes)
    assert getattr(dynamo.config, name) >= 2 * 16
    assert calls == [{"dynamic": False, "mode": None},
                     {"dynamic": False, "mode": "reduce-overhead"}]


def test_the_shapes_note_weighs_the_fixed_shapes_against_the_plain_batches():
    """shapes_note's numbers the right way round: the fixed shapes (lengths rounded up) make at
    least the plain batches' steps and pad more, and the tokens they add are the two
    paddings' ratio. No fixed shapes, no note: choose_shapes gives None."""
    import re
    from types import SimpleNamespace

    import numpy as np
    import pytest

    from nmt.compiling import choose_shapes, shapes_note
    rng = np.random.default_rng(0)
    src, tgt = rng.integers(1, 40, 300), rng.integers(1, 40, 300)
    train = SimpleNamespace(src_ids=SimpleNamespace(lengths=lambda: src),
                            tgt_ids=SimpleNamespace(lengths=lambda: tgt),
                            lengths=lambda: np.maximum(src + 2, tgt + 1))
    data = SimpleNamespace(train=train)
    config = Config(max_tokens=200, fixed_shapes=3)
    assert choose_shapes(Config(max_tokens=200), data) is None
    note = shapes_note(choose_shapes(config, data), data, config)
    found = re.fullmatch(r"fixed shapes: 3 lengths \([\d, ]+\), (\d+) shapes in epoch 0; (\d+) "
                         r"steps padded ([\d.]+)%, against (\d+) padded ([\d.]+)% without them "
                         r"\(\+([\d.]+)% tokens\)", note)
    assert found, note
    kinds, steps, fixed, plain_steps, plain, added = map(float, found.groups())
    assert 1 <= kinds <= 3 and steps >= plain_steps and fixed > plain
    assert added == pytest.approx(100 * ((100 - plain) / (100 - fixed) - 1), abs=0.3)


def test_free_shapes_compile_dynamic_and_a_higher_recompile_limit_is_kept(monkeypatch):
    """Without fixed shapes (BPE-dropout) the step is compiled with dynamic shapes; with them,
    a recompile limit already above the shapes' need is not lowered."""
    import torch._dynamo as dynamo

    from nmt.shapes import FixedShapes
    calls = []
    monkeypatch.setattr(torch, "compile", lambda model, **kw: calls.append(kw) or model)
    compiled(torch.nn.Linear(2, 2), Config(compile=True, bpe_dropout=0.1), torch.device("cpu"),
             None)
    assert calls == [{"dynamic": True}]
    name = next(n for n in ("recompile_limit", "cache_size_limit") if hasattr(dynamo.config, n))
    monkeypatch.setattr(dynamo.config, name, 1000)
    compiled(torch.nn.Linear(2, 2), Config(compile=True), torch.device("cpu"),
             FixedShapes((8, 16), 400, 0))
    assert getattr(dynamo.config, name) == 1000
