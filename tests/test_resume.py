"""Issue 16: trust on resume and at the edges. Each test names the defect it guards; each
failed on the code before the fix."""

import contextlib
import io
import json
import signal
import types

import pytest
import torch
from conftest import TINY, number_pairs, write_aligned

import train
from checkpoint import (CheckpointError, best_checkpoint_path, history_path, load_checkpoint,
                        resume_state, save_checkpoint)
from config import Config, parse_config
from model import build_transformer


@pytest.fixture
def train_here(tmp_path, monkeypatch):
    """Runs train.py's main in this process, in tmp_path (no interpreter start-up per run):
    returns (exit code, stdout, stderr). The signal handlers it sets are put back."""
    monkeypatch.chdir(tmp_path)
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}

    def run(*args):
        out, err, code = io.StringIO(), io.StringIO(), 0
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                train.main([str(a) for a in args])
            except SystemExit as e:
                code = e.code
            finally:
                for s, h in handlers.items():
                    signal.signal(s, h)
        return code, out.getvalue(), err.getvalue()
    return run


def corpus(folder, seed=1, n=40):
    write_aligned(folder, "train", number_pairs(n, seed=seed))
    write_aligned(folder, "val", number_pairs(4, seed=seed + 100))
    return folder


def history(folder):
    return json.loads(history_path(Config(model_folder=str(folder))).read_text())


def lr_scalars(folder):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(str(folder))
    acc.Reload()
    return {e.step: e.value for e in acc.Scalars("train/lr")}


def test_a_lengthened_cosine_run_keeps_learning(tmp_path, train_here):
    """1. A finished cosine run lengthened on resume trained at learning rate 0."""
    corpus(tmp_path / "c", n=120)
    flags = ["--data_dir", "c", *TINY, "--lr_schedule", "cosine", "--log_every", "1",
             "--val_examples", "0"]
    code, out, err = train_here(*flags, "--num_epochs", "1")
    assert code == 0, err
    steps = load_checkpoint(tmp_path / "weights" / "tmodel_00.pt")["global_step"]
    assert lr_scalars(tmp_path / "runs" / "tmodel")[steps] > 0  # the last step learns
    code, out, err = train_here("--num_epochs", "3")
    assert code == 0, err
    assert "laid out again over its new length" in out
    lrs = lr_scalars(tmp_path / "runs" / "tmodel")
    new = [lrs[s] for s in range(steps + 1, 3 * steps + 1)]
    assert min(new) > 0 and max(new) > 0.5 * 3e-3, new  # 3e-3: TINY's peak
    losses = [h["loss"] for h in history(tmp_path / "weights")]
    assert losses[-1] < losses[0] - 0.05, losses  # the lengthened run learned


def test_max_steps_on_an_epochs_last_batch_validates_those_weights_once(tmp_path, train_here):
    """4. Stopped by --max_steps on an epoch's last batch, then resumed: the same weights were
    validated twice, and the duplicate counted against --patience."""
    corpus(tmp_path / "c")
    flags = ["--data_dir", "c", *TINY, "--val_examples", "0", "--num_epochs", "2"]
    code, out, err = train_here(*flags, "--model_folder", "one", "--num_epochs", "1")
    steps = load_checkpoint(tmp_path / "one" / "tmodel_00.pt")["global_step"]
    code, out, err = train_here(*flags, "--max_steps", steps)
    assert code == 0, err
    assert f"reached --max_steps {steps} in epoch 0 after batch" in out
    assert sorted(p.name for p in (tmp_path / "weights").glob("*.pt")) == [
        "tmodel_00.pt", "tmodel_best.pt"]  # the epoch's own checkpoint, no mid-epoch one
    code, out, err = train_here("--max_steps", "0")
    assert code == 0, err
    assert "resumed from weights/tmodel_00.pt: epoch 1, batch 0" in out
    assert [h["step"] for h in history(tmp_path / "weights")] == [steps, 2 * steps]


def test_resuming_on_another_corpus_is_refused_before_anything_is_prepared(tmp_path,
                                                                          train_here):
    """3. A checkpoint trained on one corpus resumed on another, mid-epoch, and compared its
    new best against another validation set."""
    corpus(tmp_path / "a", n=120)
    corpus(tmp_path / "b", seed=2, n=60)
    code, out, err = train_here("--data_dir", "a", *TINY, "--max_steps", "2")
    assert code == 0, err
    prepared = (tmp_path / "weights" / "prepared" / "meta.json").read_text()
    code, out, err = train_here("--data_dir", "b")
    assert code == 2 and err.count("\n") == 1, err
    assert f"was trained on the corpus {tmp_path / 'a'}, not {tmp_path / 'b'}" in err
    assert (tmp_path / "weights" / "prepared" / "meta.json").read_text() == prepared
    # the same corpus from another working directory: its path was stored absolute (15)
    assert load_checkpoint(tmp_path / "weights" / "tmodel_00_s0000002.pt")["config"][
        "data_dir"] == str(tmp_path / "a")


def test_a_resume_with_nothing_to_do_writes_no_event_file_and_says_so(tmp_path, train_here):
    """6. A resume with nothing left to train still added a TensorBoard event file (and
    scored the test split again)."""
    corpus(tmp_path / "c")
    code, out, err = train_here("--data_dir", "c", *TINY, "--num_epochs", "1",
                                "--val_examples", "0")
    assert code == 0, err
    events = set((tmp_path / "runs" / "tmodel").iterdir())
    code, out, err = train_here("--num_epochs", "1")
    assert code == 0 and "all 1 epochs are trained" in out, out + err
    assert set((tmp_path / "runs" / "tmodel").iterdir()) == events


def test_the_resume_command_names_where_the_run_works():
    """6. The resume command printed after Ctrl-C omitted --experiment_name: the resumed run
    wrote into runs/tmodel."""
    config = Config(model_folder="w", experiment_name="runs/mine", num_workers=2)
    run = types.SimpleNamespace(config=config, world_size=1)
    command = train.resume_command(run)
    assert command == ("python train.py --model_folder w --experiment_name runs/mine "
                       "--num_workers 2")
    assert "--device" not in command  # defaults are left out


def tiny_state(epoch=0, **extra):
    model = build_transformer(20, 20, 16, 16, d_model=8, N=1, h=2, d_ff=16)
    return {"model_state_dict": model.state_dict(), "config": Config().to_dict(),
            "epoch": epoch, "global_step": 10, **extra}


@pytest.mark.parametrize("name", ["best", "history", "results"])
def test_preload_none_never_overwrites_a_best_checkpoint_or_history(tmp_path, name):
    """7. --preload none refused to overwrite tmodel_*.pt but overwrote tmodel_best.pt and the
    validation history."""
    config = Config(model_folder=str(tmp_path), preload="none")
    path = {"best": best_checkpoint_path(config), "history": history_path(config),
            "results": tmp_path / "results.json"}[name]
    if name == "best":
        save_checkpoint(tiny_state(), path)
    else:
        path.write_text("[]")
    with pytest.raises(CheckpointError, match=f"holds a run \\({path.name}\\); --preload none"):
        resume_state(config, {"preload"})


def test_a_mid_epoch_checkpoint_refuses_another_number_of_processes(tmp_path):
    """2. A mid-epoch checkpoint resumed with another number of torchrun processes repeated or
    skipped pairs: the world size was neither saved nor checked."""
    config = Config(model_folder=str(tmp_path))
    save_checkpoint(tiny_state(next_epoch=0, next_batch=3, world_size=2),
                    tmp_path / "tmodel_00_s0000010.pt")
    for world in (1, 4):
        with pytest.raises(CheckpointError, match="saved mid-epoch by 2 process\\(es\\) and "
                                                  f"this run has {world}"):
            resume_state(config, set(), world_size=world)
    resume_state(config, set(), world_size=2)
    save_checkpoint(tiny_state(next_epoch=1, next_batch=0, world_size=2),
                    tmp_path / "tmodel_00.pt")
    resume_state(config, set(), world_size=1)  # between epochs: any number


def fake_run(tmp_path, patience=0):
    model = build_transformer(20, 20, 16, 16, d_model=8, N=1, h=2, d_ff=16)
    return types.SimpleNamespace(config=Config(model_folder=str(tmp_path), patience=patience),
                                 history=[], global_step=0, model=model,
                                 data=types.SimpleNamespace(corpus=None))


def test_patience_breaks_bleu_ties_with_the_validation_loss(tmp_path, capsys):
    """8. Patience counted BLEU only: a young model at BLEU 0.00 twice was stopped while its
    validation loss still fell."""
    run = fake_run(tmp_path, patience=2)
    for step, loss in ((1, 5.0), (2, 4.5), (3, 4.0)):
        run.global_step = step
        assert not train.keep_best(run, 0, {"bleu": 0.0, "loss": loss})
    assert load_checkpoint(best_checkpoint_path(run.config))["global_step"] == 3
    for step in (4, 5):  # no better BLEU, no lower loss: patience runs out
        run.global_step = step
        out = train.keep_best(run, 0, {"bleu": 0.0, "loss": 4.2})
    assert out


def test_flags_beside_a_preset_win_over_its_token_batches():
    """9. --preset paper_base --batch_size 32 kept the preset's 25,000-token batches."""
    config, given = parse_config(["--preset", "paper_base", "--batch_size", "32"])
    assert (config.batch_size, config.max_tokens) == (32, 0) and "max_tokens" in given
    config, _ = parse_config(["--preset", "paper_base", "--batch_size", "32",
                              "--max_tokens", "8000"])
    assert config.max_tokens == 8000


@pytest.mark.parametrize("argv, message", [
    (["--d_model", "63", "--h", "7"], "--pos sinusoidal needs an even --d_model"),
    (["--d_model", "72", "--h", "8", "--pos", "rope"], "--pos rope needs an even head width"),
    (["--keep_last", "0"], "--keep_last must be at least 1"),
    (["--lr_schedule", "linear"], "invalid choice: 'linear'"),
])
def test_shapes_and_values_the_model_cannot_use_are_one_line(argv, message, capsys):
    """10, 11. An odd width ended in a traceback; --keep_last 0 kept every checkpoint."""
    with pytest.raises(SystemExit) as e:
        parse_config(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and message in err and err.count("\n") == 1, err


def test_help_lists_the_values_and_a_switch_needs_no_value(capsys):
    """14. --help did not list the values of --lr_schedule, --precision, --device; --compile
    alone was an error."""
    assert parse_config(["--compile"])[0].compile is True
    assert parse_config(["--compile", "false"])[0].compile is False
    with pytest.raises(SystemExit):
        parse_config(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    for values in ("{constant,inverse_sqrt,cosine}", "{auto,fp32,bf16,fp16}",
                   "auto, cpu, cuda, cuda:N or mps"):
        assert values in text


def test_under_torchrun_one_gpu_for_every_rank_is_refused(monkeypatch):
    """19. --device cuda:N under torchrun put every rank on GPU N."""
    import runtime
    from config import UserError
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    with pytest.raises(UserError, match="would put every process on one GPU"):
        runtime.get_device("cuda:0")
    assert runtime.get_device("cuda") == torch.device("cuda", 1)
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert runtime.get_device("cuda:0") == torch.device("cuda", 0)


def test_the_host_side_group_waits_as_long_as_the_gpu_group(monkeypatch):
    """17. The Gloo group (flags, rank 0's data preparation and validation) had torch's
    30-minute default timeout, not the NCCL group's hour."""
    import datetime

    import runtime
    calls = {}
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(runtime, "get_device", lambda name: torch.device("cuda", 0))
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: None)
    monkeypatch.setattr(runtime.dist, "is_initialized", lambda: False)
    monkeypatch.setattr(runtime.dist, "init_process_group",
                        lambda backend, **kw: calls.setdefault(backend, kw))
    monkeypatch.setattr(runtime.dist, "new_group", lambda backend, **kw: calls.setdefault(
        backend, kw))
    monkeypatch.setattr(runtime.dist, "get_rank", lambda: 0)
    monkeypatch.setattr(runtime.dist, "get_world_size", lambda: 2)
    monkeypatch.setattr(runtime, "_flags_group", None)
    runtime.start_distributed("cuda")
    assert calls["gloo"]["timeout"] == calls["nccl"]["timeout"] >= datetime.timedelta(hours=1)


def test_under_fp16_every_rank_skips_an_update_any_rank_found_non_finite(monkeypatch):
    """18. Under fp16 with DDP each rank judged its own loss share: ranks could disagree, and
    only some stop at --max_bad_steps while the others hang."""
    model = torch.nn.Linear(4, 4)
    run = types.SimpleNamespace(config=Config(clip_grad=1.0), model=model,
                                optimizer=train.make_optimizer(model, 1e-3),
                                scaler=torch.amp.GradScaler("cpu", enabled=True),
                                bad_steps=torch.zeros(()), world_size=2)
    # the other rank's share of the loss is NaN: the all-reduce brings it here
    monkeypatch.setattr(torch.distributed, "all_reduce",
                        lambda t, *a, **k: t.add_(float("nan")))
    run.scaler.scale(model(torch.ones(2, 4)).sum()).backward()
    train.optimizer_step(run, torch.tensor(0.5), 1e-3)  # this rank's own share is finite
    assert int(run.bad_steps) == 1


@pytest.mark.parametrize("options", [{}, {"n_kv_heads": 2}, {"n_kv_heads": 1, "ffn": "swiglu"}])
def test_the_benchmarks_flop_count_is_the_models(options):
    """19. bench.py's FLOP count ignored n_kv_heads (MFU overstated for grouped-query
    attention). Counted here against torch's FLOP counter over the written-out attention."""
    from torch.utils.flop_counter import FlopCounterMode

    from bench import model_flops
    from checkpoint import build_model
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


def test_grouped_query_attention_shares_key_value_heads_without_copying_them(monkeypatch):
    """19. Grouped-query attention copied its keys and values with repeat_interleave; the
    fused kernel shares them (enable_gqa). Same outputs as the written-out math."""
    from checkpoint import build_model
    from model import SDPA_GQA
    if not SDPA_GQA:
        pytest.skip("torch < 2.5 has no enable_gqa")
    model = build_model(Config(d_model=32, N=1, h=4, d_ff=64, seq_len=16, n_kv_heads=2),
                        30, 30).eval()
    src, tgt = torch.randint(4, 30, (2, 9)), torch.randint(4, 30, (2, 6))
    mask = torch.ones(2, 1, 1, 9, dtype=torch.bool)
    with torch.no_grad():
        for module in model.modules():
            if hasattr(module, "use_reference"):
                module.use_reference = True
        expected = model(src, tgt, mask)
        for module in model.modules():
            if hasattr(module, "use_reference"):
                module.use_reference = False
        monkeypatch.setattr(torch.Tensor, "repeat_interleave",
                            lambda *a, **k: pytest.fail("keys and values copied"))
        torch.testing.assert_close(model(src, tgt, mask), expected)


def test_ctrl_c_during_validation_stops_at_the_next_decoding_batch(tmp_path, train_here,
                                                                   monkeypatch):
    """Issue 17: validation decoding ignored the first Ctrl-C (and showed no progress)."""
    import os
    corpus(tmp_path / "c")
    real = train.translate_ids

    def interrupted(*args, **kwargs):  # Ctrl-C arrives while the validation set decodes
        os.kill(os.getpid(), signal.SIGINT)
        return real(*args, **kwargs)
    monkeypatch.setattr(train, "translate_ids", interrupted)
    code, out, err = train_here("--data_dir", "c", *TINY, "--num_epochs", "2")
    assert code == 0, err
    assert "stopped by SIGINT while validating epoch 0 (not recorded); saved " \
           "weights/tmodel_00.pt. Resume with: python train.py --model_folder weights" in out
    assert not history_path(Config(model_folder=str(tmp_path / "weights"))).exists()
    monkeypatch.setattr(train, "translate_ids", real)
    code, out, err = train_here()
    assert code == 0 and "resumed from weights/tmodel_00.pt: epoch 1, batch 0" in out, err


def test_the_picture_counts_training_minutes_without_the_pause_before_a_resume(tmp_path):
    """Issue 18: plot_runs.py puts validation BLEU against training minutes from the logs."""
    from torch.utils.tensorboard import SummaryWriter

    from plot_runs import curve
    writer = SummaryWriter(str(tmp_path))
    t0 = 1_000_000.0
    for step, (tag, value, minute) in enumerate([
            ("train/loss", 5.0, 0), ("train/loss", 4.0, 1), ("validation/bleu", 10.0, 2),
            ("train/loss", 3.0, 62), ("validation/bleu", 20.0, 63)]):  # an hour's pause
        writer.add_scalar(tag, value, step, walltime=t0 + 60 * minute)
    writer.close()
    assert curve(tmp_path, gap_minutes=10) == [(2.0, 10.0), (3.0, 20.0)]
