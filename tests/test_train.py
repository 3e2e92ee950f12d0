"""train.py: the schedule, the step, resuming exactly, stopping (signals, max_steps, patience),
validation and test scoring, end to end."""

import dataclasses
import json
import math
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
import types

import pytest
import torch
from conftest import (ROOT, TINY, make_corpus, number_pairs, run_here, run_script,
                      swap_two_tokens, write_aligned)

import train
from config import PRESETS, Config, parse_config
from dataset import BilingualDataset, Collator
from model import LabelSmoothedCrossEntropy, build_transformer
from nmt.checkpoint import best_checkpoint_path, history_path, load_checkpoint, save_checkpoint
from nmt.decoding import greedy_decode
from nmt.trained_model import build_model
from tokenizer import EOS, PAD, SOS
from train import learning_rate, make_loss, make_optimizer, total_steps, train_step, warmup_steps


def test_inverse_sqrt_schedule_matches_the_paper_formula():
    paper_lr = (512 * 4000) ** -0.5  # --lr for the paper's exact values
    config = Config(lr_schedule="inverse_sqrt", d_model=512, warmup=4000, lr=paper_lr)
    for step in (1, 100, 3999, 4000, 4001, 20000, 100000):
        expected = 512 ** -0.5 * min(step ** -0.5, step * 4000 ** -1.5)
        assert learning_rate(config, step, 0) == pytest.approx(expected, rel=1e-9)
    assert learning_rate(config, 4000, 0) == pytest.approx(7.0e-4, rel=0.01)
    config.lr = 1e-3  # --lr sets the peak
    assert learning_rate(config, 4000, 0) == pytest.approx(1e-3)
    assert learning_rate(config, 16000, 0) == pytest.approx(0.5e-3)


def test_cosine_and_constant_schedules():
    config = Config(lr_schedule="cosine", lr=1e-3, warmup=10)
    assert learning_rate(config, 5, 109) == pytest.approx(0.5e-3)
    assert learning_rate(config, 10, 109) == pytest.approx(1e-3)
    assert learning_rate(config, 60, 109) == pytest.approx(0.5e-3)
    # the cosine reaches 0 one step after the run: its last step still learns
    assert 0 < learning_rate(config, 109, 109) < 1e-6
    assert learning_rate(config, 110, 109) == pytest.approx(0.0, abs=1e-12)
    assert learning_rate(Config(lr=3e-4, lr_schedule="constant"), 12345, 0) == 3e-4


def test_the_run_length_counts_max_steps_and_a_given_warmup_is_used_as_given():
    """7. The run length includes --max_steps. Issue 18: only the default warm-up is capped
    at a tenth of the run; a --warmup the user gives is used as given."""
    config = Config(num_epochs=10, accum_steps=1)
    assert total_steps(config, 100) == 1000
    config.max_steps = 300
    assert total_steps(config, 100) == 300
    assert warmup_steps(Config(), 500) == 50 and warmup_steps(Config(), 10 ** 6) == 4000
    assert warmup_steps(Config(warmup=2000), 6000) == 2000
    assert learning_rate(Config(lr_schedule="inverse_sqrt", lr=1e-3), 50, 500) == \
        pytest.approx(1e-3)
    assert learning_rate(Config(lr_schedule="inverse_sqrt", lr=1e-3, warmup=2000), 600, 6000) \
        == pytest.approx(0.3e-3)


def test_accumulating_k_batches_gives_the_gradients_of_one_k_times_batch():
    torch.manual_seed(0)
    src = [torch.randint(4, 30, (n,)).tolist() for n in (3, 7, 2, 5, 6, 4)]
    tgt = [torch.randint(4, 30, (n,)).tolist() for n in (4, 2, 6, 3, 5, 7)]
    ds = BilingualDataset(src, tgt, [""] * 6, [""] * 6)
    collate = Collator(pad_id=1)
    loss_fn = LabelSmoothedCrossEntropy(0.1, ignore_index=1)

    def grads(groups):
        torch.manual_seed(1)
        model = build_transformer(30, 30, 32, 32, d_model=16, N=1, h=2, d_ff=32, dropout=0.0)
        losses = [float(train_step(model, g, loss_fn, 1, "cpu")[0]) for g in groups]
        return losses, {n: p.grad.clone() for n, p in model.named_parameters()}

    # three micro-batches of different sizes and paddings, accumulated in one step ...
    micro = [collate([ds[0], ds[1]]), collate([ds[2]]), collate([ds[3], ds[4], ds[5]])]
    (loss_k,), grads_k = grads([micro])
    # ... equal one batch of all six
    (loss_1,), grads_1 = grads([[collate([ds[i] for i in range(6)])]])
    assert loss_k == pytest.approx(loss_1, rel=1e-5)
    for name in grads_1:
        torch.testing.assert_close(grads_k[name], grads_1[name], atol=1e-6, rtol=1e-4)


def test_bf16_autocast_step_matches_fp32_closely():
    from contextlib import nullcontext
    torch.manual_seed(0)
    ds = BilingualDataset([[5, 6, 7], [8, 9]], [[10, 11], [12, 13, 14]], ["", ""], ["", ""])
    batch = Collator(pad_id=1)([ds[0], ds[1]])
    loss_fn = LabelSmoothedCrossEntropy(0.0, ignore_index=1)
    losses, grads = [], []
    for amp in (nullcontext, lambda: torch.autocast("cpu", dtype=torch.bfloat16)):
        torch.manual_seed(1)
        model = build_transformer(30, 30, 16, 16, d_model=16, N=1, h=2, d_ff=32, dropout=0.0)
        losses.append(float(train_step(model, [batch], loss_fn, 1, "cpu", amp)[0]))
        assert all(torch.isfinite(p.grad).all() for p in model.parameters())
        assert all(p.dtype == torch.float32 for p in model.parameters())  # fp32 master weights
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))  # (n_params,)
    assert losses[1] != losses[0]  # bf16 did run: its rounding shows
    assert losses[1] == pytest.approx(losses[0], rel=0.05)
    # the same update direction, to bf16's precision (8 bits of mantissa)
    assert torch.nn.functional.cosine_similarity(grads[0], grads[1], dim=0) > 0.99
    assert (grads[1].norm() / grads[0].norm()).item() == pytest.approx(1.0, abs=0.05)


def test_under_fp16_every_rank_skips_an_update_any_rank_found_non_finite(monkeypatch):
    """18. Under fp16 with DDP each rank judged its own loss share: ranks could disagree, and
    only some stop at --max_bad_steps while the others hang."""
    model = torch.nn.Linear(4, 4)
    run = types.SimpleNamespace(config=Config(clip_grad=1.0), model=model,
                                optimizer=train.make_optimizer(model, 1e-3),
                                scaler=torch.amp.GradScaler("cpu", enabled=True), world_size=2)
    progress = train.Progress(bad_steps=torch.zeros(()))
    # the other rank's share of the loss is NaN: the all-reduce brings it here
    monkeypatch.setattr(torch.distributed, "all_reduce",
                        lambda t, *a, **k: t.add_(float("nan")))
    run.scaler.scale(model(torch.ones(2, 4)).sum()).backward()
    train.optimizer_step(run, progress, torch.tensor(0.5), 1e-3)  # this rank's share is finite
    assert int(progress.bad_steps) == 1


def test_the_cosine_schedule_stays_at_zero_past_the_end_of_its_run():
    """The cosine's progress is clamped at 1: a step past the run's laid-out length (a
    --time_budget plan going on as saved, a resume) learns at 0, never on a cosine that climbs
    back towards the peak."""
    config = Config(lr_schedule="cosine", lr=1e-3, warmup=10)
    for step in (110, 150, 209, 300):
        assert learning_rate(config, step, 109) == pytest.approx(0.0, abs=1e-12), step


def test_the_run_length_counts_optimizer_steps_not_batches_under_accumulation():
    """--accum_steps k: an optimizer step takes k batches, the epoch's last group may be
    shorter; the schedule is laid out over the optimizer steps (ceil(batches / k) an epoch)."""
    assert total_steps(Config(num_epochs=3, accum_steps=4), 10) == 9
    assert total_steps(Config(num_epochs=3, accum_steps=4, max_steps=5), 10) == 5
    assert total_steps(Config(num_epochs=2, accum_steps=5), 10) == 4


@pytest.mark.parametrize("smoothing", [0.0, 0.1, 0.3])
def test_the_training_loss_takes_the_configured_smoothing_and_ignores_padding(smoothing):
    """make_loss (what every training step uses) is section 5.4's formula with
    --label_smoothing as configured, summed over the non-[PAD] labels only."""
    torch.manual_seed(0)
    model = build_transformer(30, 30, 8, 8, d_model=16, N=1, h=2, d_ff=32, dropout=0.0)
    x = torch.randn(2, 6, 16)
    label = torch.randint(4, 30, (2, 6))
    label[0, 3:] = PAD
    loss = make_loss(Config(label_smoothing=smoothing))(x, model.projection_layer, label)
    expected = LabelSmoothedCrossEntropy(smoothing, ignore_index=PAD)(
        x, model.projection_layer, label)
    torch.testing.assert_close(loss, expected, atol=1e-5, rtol=1e-5)


def adam(model, lr, fused, monkeypatch):
    """make_optimizer's Adam; fused=False: its fallback, as on a device without the fused
    kernel (torch.optim.Adam refusing fused=True)."""
    if not fused:
        real = torch.optim.Adam

        def no_fused_kernel(*args, fused=None, **kwargs):
            if fused:
                raise RuntimeError("no fused kernel here")
            return real(*args, **kwargs)
        monkeypatch.setattr(torch.optim, "Adam", no_fused_kernel)
    optimizer = make_optimizer(model, lr)
    assert bool(optimizer.defaults.get("fused")) == fused
    return optimizer


def one_update(monkeypatch, grad, clip_grad=1.0, lr=0.01, fused=True):
    """A weight of two numbers after one optimizer_step with gradient `grad` at rate `lr`:
    (weight before, weight after, Adam's state of it, the run's progress)."""
    model = torch.nn.Linear(2, 1, bias=False)
    optimizer = adam(model, 1.0, fused, monkeypatch)
    run = types.SimpleNamespace(config=Config(clip_grad=clip_grad, lr=3e-4), model=model,
                                optimizer=optimizer, world_size=1,
                                scaler=torch.amp.GradScaler("cpu", enabled=False))
    progress = train.Progress(bad_steps=torch.zeros(()))
    before = model.weight.detach().clone()
    model.weight.grad = torch.tensor([grad])
    train.optimizer_step(run, progress, torch.tensor(1.0), lr)
    return before, model.weight.detach().clone(), optimizer.state[model.weight], progress


@pytest.mark.parametrize("fused", [True, False])
def test_an_update_clips_the_gradient_and_takes_adams_betas_at_the_scheduled_rate(
        fused, monkeypatch):
    """optimizer_step: the gradient norm clipped to --clip_grad before Adam sees it (a gradient
    (3, 4) of norm 5 becomes (0.6, 0.8)); Adam's moments with the paper's betas (0.9, 0.98);
    the step at the schedule's rate `lr`, not the optimizer's initial or the config's peak.
    Fused Adam and make_optimizer's fallback alike."""
    before, after, state, _ = one_update(monkeypatch, [3.0, 4.0], clip_grad=1.0, lr=0.01,
                                         fused=fused)
    clipped = torch.tensor([[0.6, 0.8]])
    torch.testing.assert_close(state["exp_avg"], (1 - 0.9) * clipped)
    torch.testing.assert_close(state["exp_avg_sq"], (1 - 0.98) * clipped ** 2)
    # Adam's first step: lr · m̂ / (sqrt(v̂) + eps) = lr · sign(g)
    torch.testing.assert_close(after - before, torch.tensor([[-0.01, -0.01]]))
    _, _, state, _ = one_update(monkeypatch, [3.0, 4.0], clip_grad=0.0, fused=fused)  # off
    torch.testing.assert_close(state["exp_avg"], (1 - 0.9) * torch.tensor([[3.0, 4.0]]))


@pytest.mark.parametrize("fused", [True, False])
def test_adams_epsilon_is_the_papers(fused, monkeypatch):
    """Adam's eps is 1e-9 (section 5.3): on a gradient of 1e-8 the first step is
    lr · g / (|g| + eps) = lr / 1.1, not lr / 2 as torch's default 1e-8 would give."""
    before, after, _, _ = one_update(monkeypatch, [1e-8, -1e-8], lr=0.01, fused=fused)
    torch.testing.assert_close(after - before, torch.tensor([[-0.01, 0.01]]) / 1.1)


@pytest.mark.parametrize("fused", [True, False])
def test_a_non_finite_update_is_skipped_and_a_finite_one_ends_the_streak(fused, monkeypatch):
    """A NaN or infinite gradient leaves the weights and Adam's state as they were and counts
    one more skipped update in a row (progress.bad_steps, which --max_bad_steps reads); a
    finite update sets the count back to 0: the limit is on updates in a row. With fused
    Adam the skip is its found_inf; without (a device with no fused kernel), on the host."""
    model = torch.nn.Linear(2, 1, bias=False)
    optimizer = adam(model, 0.01, fused, monkeypatch)
    run = types.SimpleNamespace(config=Config(clip_grad=1.0), model=model, optimizer=optimizer,
                                world_size=1, scaler=torch.amp.GradScaler("cpu", enabled=False))
    progress = train.Progress(bad_steps=torch.zeros(()))
    for grad, bad in (([float("nan"), 1.0], 1), ([float("inf"), 1.0], 2), ([1.0, 1.0], 0),
                      ([float("nan"), 0.0], 1)):
        before = model.weight.detach().clone()
        model.weight.grad = torch.tensor([grad])
        train.optimizer_step(run, progress, torch.tensor(1.0), 0.01)
        assert int(progress.bad_steps) == bad, grad
        assert torch.isfinite(model.weight).all()
        assert torch.equal(model.weight, before) == (bad > 0), grad
    assert int(optimizer.state[model.weight]["step"]) == 1  # the one finite update


@pytest.fixture
def train_here(tmp_path):
    """Runs train.py's main in this process, in tmp_path or `cwd` (conftest.run_here): returns
    (exit code, stdout, stderr)."""
    def run(*args, cwd=tmp_path):
        t = run_here("train.py", *map(str, args), cwd=cwd)
        return t.returncode, t.stdout.decode(), t.stderr.decode()
    return run


def history(folder):
    return json.loads(history_path(Config(model_folder=str(folder))).read_text())


def lr_scalars(folder, tag="train/lr"):
    """{step: value} of a TensorBoard scalar of the run logged in `folder`."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(str(folder))
    acc.Reload()
    return {e.step: e.value for e in acc.Scalars(tag)}


def test_each_step_trains_at_its_own_rate_on_every_pair_once_an_epoch_in_a_new_order(
        tmp_path, train_here, monkeypatch):
    """The loop, under --accum_steps 2: optimizer step n (from 1) is given the schedule's rate
    of step n (warm-up not off by one); the run makes the ceil(batches / 2) steps an epoch its
    schedule is laid out for; each epoch trains on every pair once, in another order than
    the epoch before."""
    make_corpus(tmp_path / "c", n=60, val=2)
    steps, batches = [], []
    real_step, real_train_step = train.optimizer_step, train.train_step

    def optimizer_step(run, progress, loss, lr):
        steps.append((progress.step + 1, lr, run.config, run.steps(), run.batches_per_epoch))
        return real_step(run, progress, loss, lr)

    def train_step(model, group, *args, **kwargs):
        batches.extend(b["label"] for b in group)
        return real_train_step(model, group, *args, **kwargs)
    monkeypatch.setattr(train, "optimizer_step", optimizer_step)
    monkeypatch.setattr(train, "train_step", train_step)
    code, out, err = train_here("--data_dir", "c", *TINY, "--lr_schedule", "cosine",
                                "--warmup", "3", "--accum_steps", "2", "--num_epochs", "2",
                                "--max_tokens", "80", "--val_examples", "0")
    assert code == 0, err
    config, schedule, per_epoch = steps[0][2:]
    assert per_epoch >= 5 and [n for n, *_ in steps] == list(range(1, len(steps) + 1))
    assert len(steps) == schedule == 2 * math.ceil(per_epoch / 2)
    for n, lr, *_ in steps:
        assert lr == pytest.approx(learning_rate(config, n, schedule), rel=1e-12), n
    assert steps[0][1] < steps[1][1] < steps[2][1]  # the warm-up rises from the first step

    def rows(labels):  # each pair's label, in the order trained
        return [tuple(t for t in row if t != PAD) for label in labels for row in label.tolist()]
    first, second = rows(batches[:per_epoch]), rows(batches[per_epoch:])
    assert len(batches) == 2 * per_epoch and len(first) == 60
    assert sorted(first) == sorted(second) and first != second


def test_a_lengthened_cosine_run_keeps_learning(tmp_path, train_here):
    """1. A finished cosine run lengthened on resume trained at learning rate 0."""
    make_corpus(tmp_path / "c", n=120, val=4)
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
    code, out, err = train_here("--num_epochs", "2")  # shorter than trained: nothing to do,
    assert code == 0 and "all 2 epochs are trained" in out, err  # no rate laid out (it said 0)
    assert "laid out again" not in out


def test_max_steps_on_an_epochs_last_batch_validates_those_weights_once(tmp_path, train_here):
    """4. Stopped by --max_steps on an epoch's last batch, then resumed: the same weights were
    validated twice, and the duplicate counted against --patience."""
    make_corpus(tmp_path / "c", n=40, val=4)
    flags = ["--data_dir", "c", *TINY, "--val_examples", "0", "--num_epochs", "2"]
    code, out, err = train_here(*flags, "--model_folder", "one", "--num_epochs", "1")
    steps = load_checkpoint(tmp_path / "one" / "tmodel_00.pt")["global_step"]
    code, out, err = train_here(*flags, "--max_steps", steps)
    assert code == 0, err
    assert f"reached --max_steps {steps} in epoch 0 after batch" in out
    assert sorted(p.name for p in (tmp_path / "weights").glob("*.pt")) == [
        "tmodel_00.pt", "tmodel_best.pt"]  # the epoch's own checkpoint, no mid-epoch one
    # the command it prints trains on (the step limit kept would stop it before a step)
    command = re.search(r"Resume with no step limit \(or a larger --max_steps\): (.*)$", out,
                        re.M).group(1)  # (the line's end: pasted, nothing after it)
    assert command == "python train.py --model_folder weights --max_steps 0", out
    code, out, err = train_here(*shlex.split(command)[2:])
    assert code == 0, err
    assert "resumed from weights/tmodel_00.pt: epoch 1, batch 0" in out
    assert [h["step"] for h in history(tmp_path / "weights")] == [steps, 2 * steps]


def test_resuming_on_another_corpus_is_refused_before_anything_is_prepared(tmp_path,
                                                                          train_here):
    """3. A checkpoint trained on one corpus resumed on another, mid-epoch, and compared its
    new best against another validation set."""
    make_corpus(tmp_path / "a", n=120, val=4)
    make_corpus(tmp_path / "b", seed=2, n=60, val=4)
    code, out, err = train_here("--data_dir", "a", *TINY, "--max_steps", "2")
    assert code == 0, err
    # the model card counts the part of the epoch run (not a whole epoch)
    batch, of = map(int, out.split("in epoch 0 after batch ")[1].split(" (step")[0].split(" of "))
    card = (tmp_path / "weights" / "MODEL_CARD.md").read_text(encoding="utf-8")
    assert 0 < batch < of and f"- 2 optimizer steps in {round(batch / of, 1):g} epoch(s)" in card
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
    make_corpus(tmp_path / "c", n=40, val=4)
    code, out, err = train_here("--data_dir", "c", *TINY, "--num_epochs", "1",
                                "--val_examples", "0")
    assert code == 0, err
    events = set((tmp_path / "runs" / "tmodel").iterdir())
    code, out, err = train_here("--num_epochs", "1")
    assert code == 0 and "its 1 epoch is trained" in out, out + err
    assert set((tmp_path / "runs" / "tmodel").iterdir()) == events


def test_a_resumes_flags_are_checked_with_the_runs_own_settings(tmp_path, train_here):
    """A resume's flags were checked against the defaults, not the run's: --max_tokens 32 on
    a run of --seq_len 24 was refused as shorter than the default --seq_len (350), and so was
    the out-of-memory advice (halve --max_tokens, then resume). A new run from --init_from is
    checked with its source's architecture; a combination wrong with the run's own settings
    is still refused in one line."""
    make_corpus(tmp_path / "c", n=40, val=4)
    code, out, err = train_here("--data_dir", "c", *TINY, "--num_epochs", "1",
                                "--val_examples", "0")
    assert code == 0, err
    code, out, err = train_here("--max_tokens", "32", "--num_epochs", "1")
    assert code == 0 and "its 1 epoch is trained" in out, out + err
    code, out, err = train_here("--max_tokens", "10")
    assert code == 2 and err.strip().splitlines()[-1] == \
        "train.py: error: --max_tokens (10) must be at least --seq_len (24) (see --help)", err
    # a checkpoint the start refuses: its own line, not a check against the defaults
    (tmp_path / "weights" / "tmodel_01.pt").write_bytes(
        (tmp_path / "weights" / "tmodel_00.pt").read_bytes()[:1000])
    code, out, err = train_here("--max_tokens", "32")
    assert code == 2 and err.strip().splitlines()[-1].startswith(
        "train.py: error: checkpoint weights/tmodel_01.pt is truncated or damaged"), err
    (tmp_path / "weights" / "tmodel_01.pt").unlink()
    code, out, err = train_here("--preload", "bad")  # no checkpoint to go by: its own line
    assert code == 2 and "--preload must be latest, none or an epoch" in err, err
    for fresh in (["--model_folder", "new"], ["--preload", "none"]):  # a fresh run's defaults
        code, out, err = train_here(*fresh, "--max_tokens", "32")
        assert code == 2 and "--max_tokens (32) must be at least --seq_len (350)" in err, err
    from nmt.resume import settings_to_check
    config = Config(init_from=str(tmp_path / "weights"), model_folder=str(tmp_path / "new"),
                    max_tokens=32)
    assert settings_to_check(config, {"init_from", "model_folder", "max_tokens"}) == \
        dataclasses.replace(config, seq_len=24, d_model=32, N=1, h=2, d_ff=64, vocab_size=300)


def test_a_run_stopped_on_another_process_while_scoring_writes_no_model_card(monkeypatch):
    """Under torchrun a signal to one process stops every process's test scoring, but only
    that process knew it: rank 0 wrote the model card of a finished run (a restart then said
    "all epochs are trained" and never scored the tests) while its exit code said stopped.
    The processes agree first."""
    written, run = [], types.SimpleNamespace(rank=0, writer=types.SimpleNamespace(
        close=lambda: None))
    monkeypatch.setattr(train, "score_test_sets", lambda run, progress: (None, []))
    monkeypatch.setattr(train, "write_run_card", lambda *a: written.append(a) or "card")
    progress = types.SimpleNamespace(signal=None)
    monkeypatch.setattr(train, "max_over_ranks", lambda flag: 1)  # another process's signal
    assert train.finish_run(run, progress) is None and written == []
    monkeypatch.setattr(train, "max_over_ranks", lambda flag: int(flag))  # none anywhere
    train.finish_run(run, progress)
    assert len(written) == 1


def fake_run(tmp_path, patience=0):
    model = build_transformer(20, 20, 16, 16, d_model=8, N=1, h=2, d_ff=16)
    data = types.SimpleNamespace(corpus=None, tokenizers=None, coverage=None)
    return types.SimpleNamespace(config=Config(model_folder=str(tmp_path), patience=patience),
                                 model=model, data=data, rank=0, budget=None,
                                 steps=lambda: 0, device=torch.device("cpu"))


def test_patience_breaks_bleu_ties_with_the_validation_loss(tmp_path, monkeypatch):
    """8. Patience counted BLEU only: a young model at BLEU 0.00 twice was stopped while its
    validation loss still fell."""
    run, progress = fake_run(tmp_path, patience=2), train.Progress()

    def validate(step, loss):
        progress.step = step
        monkeypatch.setattr(train, "run_validation", lambda run, progress: {"bleu": 0.0,
                                                                            "loss": loss})
        return train.validate(run, progress)
    for step, loss in ((1, 5.0), (2, 4.5), (3, 4.0)):
        assert validate(step, loss) is train.Stop.NONE
    assert load_checkpoint(best_checkpoint_path(run.config))["global_step"] == 3
    # no better BLEU, no lower loss: once is within patience, twice is not
    assert validate(4, 4.2) is train.Stop.NONE
    assert validate(5, 4.2) is train.Stop.PATIENCE


def test_a_validation_no_better_than_the_best_leaves_the_best_checkpoint_as_it_was(
        tmp_path, monkeypatch):
    """Only a new best validation rewrites tmodel_best.pt: a worse one after it leaves the best
    checkpoint's weights and step those of the best (translate.py and the test scores use it)."""
    run, progress = fake_run(tmp_path), train.Progress()
    for step, bleu in ((1, 5.0), (2, 3.0)):
        progress.step = step
        monkeypatch.setattr(train, "run_validation",
                            lambda run, progress, bleu=bleu: {"bleu": bleu, "loss": 2.0})
        assert train.validate(run, progress) is train.Stop.NONE
    best = load_checkpoint(best_checkpoint_path(run.config))
    assert best["global_step"] == 1 and best["validation"]["bleu"] == 5.0
    assert [h["step"] for h in history(tmp_path)] == [1, 2]


def test_a_stop_right_after_a_validation_does_not_validate_those_weights_again(tmp_path,
                                                                               monkeypatch):
    """end_epoch after a stop mid-epoch (--max_steps, a --time_budget plan that shrank) at a
    step a validation has just scored (--eval_every's) validates no more: a second one recorded
    the same step twice in the history, and counted it against --patience."""
    from nmt.runtime import NoWriter
    run = types.SimpleNamespace(**vars(fake_run(tmp_path)), batches_per_epoch=10,
                                writer=NoWriter())
    progress, validated = train.Progress(), []
    monkeypatch.setattr(train, "run_validation", lambda run, progress: validated.append(
        progress.step) or {"bleu": 1.0, "loss": 2.0})
    progress.step, progress.batch = 5, 5  # mid-epoch
    assert train.validate(run, progress) is train.Stop.NONE
    assert train.end_epoch(run, progress, train.Stop.MAX_STEPS) is train.Stop.MAX_STEPS
    assert validated == [5] and [h["step"] for h in history(tmp_path)] == [5]
    progress.step, progress.batch = 6, 6  # weights not validated yet: validated
    train.end_epoch(run, progress, train.Stop.MAX_STEPS)
    assert validated == [5, 6]


def test_the_ranks_hosts_exchange_once_a_step(tmp_path, monkeypatch):
    """Issue 44: two exchanges between the ranks' hosts a step (the update's token count, then
    the stop decision); now one, carrying both, and none else in an epoch without saves or
    validations. The token count is the whole update's (the target tokens of its batches)."""
    make_corpus(tmp_path / "c", n=60, seed=1, val=4)
    monkeypatch.chdir(tmp_path)
    config, given = parse_config(["--data_dir", "c", *TINY, "--max_tokens", "100",
                                  "--accum_steps", "2"])
    run, progress = train.set_up(config, given)
    run.lock.release()
    exchanged, groups = [], []
    monkeypatch.setattr(train, "sum_over_ranks", lambda *v: exchanged.append(v) or v)
    monkeypatch.setattr(train, "max_over_ranks", lambda v: exchanged.append(("max", v)) or v)
    steps = train.accumulation_groups
    monkeypatch.setattr(train, "accumulation_groups", lambda *a: (
        groups.append(g) or (g, done) for g, done in steps(*a)))
    assert train.train_epoch(run, progress) is train.Stop.NONE
    run.writer.close()
    assert progress.step == len(groups) == len(exchanged) > 2
    assert exchanged == [(train.target_tokens(g), False) for g in groups]
    assert any(len(g) == 2 for g in groups)


class Scalars:
    """A TensorBoard writer that keeps the (tag, step) of each scalar it is given."""

    def __init__(self):
        self.logged = []

    def add_scalar(self, tag, value, step):
        self.logged.append((tag, step))

    def flush(self):
        pass

    def close(self):
        pass


def epoch_run(tmp_path, monkeypatch, *flags):
    """train.py's run, set up on 60 pairs of number words in tmp_path (8 batches an epoch at
    --max_tokens 60) with `flags`, for train_epoch called directly: its lock released, its
    writer a Scalars."""
    make_corpus(tmp_path / "c", n=60, val=4)
    monkeypatch.chdir(tmp_path)
    config, given = parse_config(["--data_dir", "c", *TINY, "--max_tokens", "60",
                                  "--val_examples", "0", *flags])
    run, progress = train.set_up(config, given)
    run.lock.release()
    run.writer.close()
    return dataclasses.replace(run, writer=Scalars()), progress


def test_the_loss_is_logged_every_log_every_steps_and_at_the_epochs_end(tmp_path, monkeypatch):
    """--log_every N logs the loss (and rate) at the first step, every N steps and at the
    epoch's last step, whatever N (--help's "and at each epoch's end"); the epoch's throughput
    once, at its end."""
    run, progress = epoch_run(tmp_path, monkeypatch, "--log_every", "3")
    assert train.train_epoch(run, progress) is train.Stop.NONE
    end = run.batches_per_epoch
    assert end > 3 and end % 3 and progress.step == end  # (the epoch's end: no multiple of 3)
    logged = [step for tag, step in run.writer.logged if tag == "train/loss"]
    assert logged == sorted({1, *range(3, end, 3), end})
    assert [step for tag, step in run.writer.logged if tag == "train/epoch_tokens_per_s"] == [end]


def test_save_every_saves_at_its_steps_within_the_epoch_and_not_at_its_end(tmp_path,
                                                                          monkeypatch):
    """--save_every N saves mid-epoch at every N-th step, each named by its step; at the
    epoch's last step the epoch's own checkpoint (end_epoch's) is the one saved."""
    run, progress = epoch_run(tmp_path, monkeypatch, "--save_every", "2")
    saved = []
    monkeypatch.setattr(train, "save", lambda run, progress, epoch, batch, path: saved.append(
        (epoch, batch, path.name)))
    assert train.train_epoch(run, progress) is train.Stop.NONE
    end = run.batches_per_epoch
    assert end % 2 == 0  # the epoch ends on a multiple of 2
    assert saved == [(0, s, f"tmodel_00_s{s:07d}.pt") for s in range(2, end, 2)]


def test_eval_every_validates_within_the_epoch_and_leaves_its_end_to_end_epoch(tmp_path,
                                                                              monkeypatch):
    """--eval_every N validates at every N-th step within the epoch; at its last step it is
    end_epoch's validation, after the epoch's checkpoint is saved (a crash while decoding loses
    nothing)."""
    run, progress = epoch_run(tmp_path, monkeypatch, "--eval_every", "2")
    validated = []
    monkeypatch.setattr(train, "validate", lambda run, progress: validated.append(
        progress.step) or train.Stop.NONE)
    assert train.train_epoch(run, progress) is train.Stop.NONE
    end = run.batches_per_epoch
    assert end % 2 == 0 and validated == list(range(2, end, 2))


def test_patience_running_out_mid_epoch_stops_at_that_step_and_saves_it(tmp_path, monkeypatch):
    """An --eval_every validation that runs out --patience stops the epoch there, with a
    mid-epoch checkpoint of that step (it trained on to the epoch's end)."""
    run, progress = epoch_run(tmp_path, monkeypatch, "--eval_every", "2", "--patience", "1")
    validated = []

    def validate(run, progress):
        validated.append(progress.step)
        return train.Stop.PATIENCE if progress.step == 4 else train.Stop.NONE
    monkeypatch.setattr(train, "validate", validate)
    assert train.train_epoch(run, progress) is train.Stop.PATIENCE
    assert validated == [2, 4] and (progress.step, progress.batch) == (4, 4)
    assert load_checkpoint(tmp_path / "weights" / "tmodel_00_s0000004.pt")["next_batch"] == 4


def test_a_stop_signal_mid_epoch_saves_there_and_says_it_was_the_signal(tmp_path, monkeypatch,
                                                                        capsys):
    """A Ctrl-C during a step: the epoch stops before the next one, saves a mid-epoch checkpoint
    there and says the signal stopped it, with the command that resumes (not the --max_steps
    line, whose advice is another flag)."""
    run, progress = epoch_run(tmp_path, monkeypatch)
    real = train.optimizer_step

    def signalled(run, progress, loss, lr):
        real(run, progress, loss, lr)
        if progress.step == 1:  # the second step (counted after this call)
            progress.signal = "SIGINT"
    monkeypatch.setattr(train, "optimizer_step", signalled)
    assert train.train_epoch(run, progress) is train.Stop.SIGNAL
    assert (progress.step, progress.batch) == (2, 2)
    out = capsys.readouterr().out
    assert (f"stopped by SIGINT in epoch 0 after batch 2 of {run.batches_per_epoch} (step 2); "
            "saved weights/tmodel_00_s0000002.pt. Resume with: python train.py") in out, out
    assert load_checkpoint(tmp_path / "weights" / "tmodel_00_s0000002.pt")["next_batch"] == 2


def test_a_failed_set_up_releases_the_model_folder(tmp_path, monkeypatch):
    """set_up called from code (a notebook, dev/bench.py) that fails after it locked the model
    folder (here: no corpus) releases it: a retry in the same process, the error still held
    (a notebook keeps the last traceback), was refused as "in use by another training run"."""
    from config import UserError
    from nmt.files import FolderLock
    monkeypatch.chdir(tmp_path)
    config, given = parse_config(["--data_dir", "nowhere", *TINY, "--model_folder", "w"])
    with pytest.raises(UserError, match="nowhere") as failed:
        train.set_up(config, given)
    assert not FolderLock(tmp_path / "w").held()
    make_corpus(tmp_path / "nowhere", n=40, val=4)
    run, _ = train.set_up(config, given)  # the first failure's traceback still held
    run.lock.release()
    run.writer.close()
    assert failed.value.__traceback__ is not None


def test_a_run_from_a_trained_model_says_what_it_starts_from(trained, tmp_path, capsys):
    """--init_from's start names the checkpoint it starts from and what the source's
    vocabulary makes of the new corpus."""
    home, _ = trained
    config, given = parse_config(["--init_from", str(home / "weights"), "--data_dir",
                                  str(home / "corpus"), "--model_folder", str(tmp_path / "w"),
                                  "--experiment_name", str(tmp_path / "runs")])
    run, _ = train.set_up(config, given)
    run.lock.release()
    run.writer.close()
    out = capsys.readouterr().out
    assert (f"a new run from {home / 'weights' / 'tmodel_best.pt'}: vocabulary on the new "
            "corpus: ") in out and "tokens a word" in out, out


@pytest.mark.parametrize("signum, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_ctrl_c_during_validation_stops_at_the_next_decoding_batch(tmp_path, train_here,
                                                                   monkeypatch, signum, code):
    """Issue 17: validation decoding ignored the first Ctrl-C (and showed no progress). Issue
    45: a saved stop exited 0, as a finished run does; now 128 + the signal's number."""
    import os

    from nmt import evaluation
    make_corpus(tmp_path / "c", n=40, val=4)
    real = evaluation.translate_ids

    def interrupted(*args, **kwargs):  # the signal arrives while the validation set decodes
        os.kill(os.getpid(), signum)
        return real(*args, **kwargs)
    monkeypatch.setattr(evaluation, "translate_ids", interrupted)
    status, out, err = train_here("--data_dir", "c", *TINY, "--num_epochs", "2")
    assert status == code, err
    name = signal.Signals(signum).name
    assert f"stopped by {name} while validating epoch 0 (not recorded); saved " \
           "weights/tmodel_00.pt. Resume with: python train.py --model_folder weights" in out
    assert not history_path(Config(model_folder=str(tmp_path / "weights"))).exists()
    monkeypatch.setattr(evaluation, "translate_ids", real)
    status, out, err = train_here()
    assert status == 0 and "resumed from weights/tmodel_00.pt: epoch 1, batch 0" in out, err


def test_a_validation_a_stop_cut_short_is_done_first_when_the_run_resumes(tmp_path, train_here,
                                                                          monkeypatch):
    """A stop while validating the last epoch left no validation of it, so no best checkpoint
    (the epoch's checkpoint is saved first), and its restart scored no test set. A resume now
    validates such a checkpoint first (a stop during that one says so), and the run ends as
    one never stopped: the same validations, best checkpoint and test scores."""
    make_corpus(tmp_path / "c", n=40, val=4)
    write_aligned(tmp_path / "c", "test", number_pairs(4, seed=9))
    flags = ["--data_dir", "c", *TINY, "--num_epochs", "2", "--val_examples", "0"]
    code, _, err = train_here(*flags, "--model_folder", "whole", "--experiment_name", "r0")
    assert code == 0, err
    real, calls = train.validate, []

    def cut_short(at):  # validate, but a signal stops validation number `at` of the start
        def validate(run, progress):
            calls.append(progress.step)
            if len(calls) < at:
                return real(run, progress)
            progress.signal = "SIGINT"
            return train.Stop.SIGNAL
        calls.clear()
        monkeypatch.setattr(train, "validate", validate)
    cut_short(2)
    code, out, err = train_here(*flags)
    last = calls[-1]
    assert code == 130 and "stopped by SIGINT while validating epoch 1 (not recorded)" in out, err
    assert [h["step"] for h in history(tmp_path / "weights")] == calls[:1]
    cut_short(1)
    code, out, err = train_here(*flags)
    assert code == 130 and calls == [last], err
    assert (f"stopped by SIGINT while validating step {last} again (not recorded). Resume "
            "with: python train.py --model_folder weights") in out
    monkeypatch.setattr(train, "validate", real)
    code, out, err = train_here(*flags)
    assert code == 0, err
    assert (f"all 2 epochs are trained (step {last}); raise --num_epochs to train on; its last "
            "validation and the test sets are not scored yet (the run stopped at its end): "
            "scoring them") in out
    assert history(tmp_path / "weights") == history(tmp_path / "whole")
    timed = ("checkpoint", "seconds", "setup_seconds")  # (where and when, not what)
    scores = ({k: v for k, v in json.loads((tmp_path / f / "results.json").read_text()).items()
               if k not in timed} for f in ("weights", "whole"))
    assert next(scores) == next(scores)
    a, b = (torch.load(tmp_path / f / "tmodel_best.pt", weights_only=True)
            for f in ("weights", "whole"))
    assert [a[k] for k in ("epoch", "global_step", "validation")] == \
        [b[k] for k in ("epoch", "global_step", "validation")]
    assert all(torch.equal(v, b["model_state_dict"][k]) for k, v in a["model_state_dict"].items())


@pytest.mark.parametrize("aftermath", [False, True])
@pytest.mark.parametrize("signum, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_signal_while_setting_up_exits_with_its_own_code_through_train_py(
        tmp_path, train_here, monkeypatch, signum, code, aftermath):
    """Issue 63, 6: a signal while train.py sets up aborts at once, exit 128 + its number, also
    when the abort surfaces as another exception (its aftermath: a KeyboardInterrupt lost in a
    finalizer, a collective failing after it), which train.py re-raised as a bare
    KeyboardInterrupt, and a SIGTERM exited 130. Driven through train.py's main: moving its
    catch_stop_signals() call fails this test."""
    import os

    from nmt import stopping
    make_corpus(tmp_path / "c", n=40, val=4)

    def signalled(*args, **kwargs):  # the signal arrives while the data is prepared
        try:
            os.kill(os.getpid(), signum)
        except KeyboardInterrupt:
            if aftermath:
                raise RuntimeError("a failure after the abort") from None
            raise
        raise AssertionError("the signal did not abort")
    monkeypatch.setattr(train, "get_ds", signalled)
    try:
        status, out, err = train_here("--data_dir", "c", *TINY, "--num_epochs", "1")
    finally:
        stopping._aborting = None
    assert status == code, err
    assert err.strip().splitlines()[-1] == ("train.py: aborted; the checkpoints already saved "
                                            "are intact")


def test_out_of_memory_in_a_step_is_one_line_that_says_what_to_lower(tmp_path, train_here,
                                                                    monkeypatch):
    """Issue 64: a step that does not fit the device (torch.OutOfMemoryError on a GPU; a
    RuntimeError "... out of memory" on MPS) is one line naming the step's size and what to
    lower (docs/troubleshooting.md quotes it), exit 2; the epochs saved before stay."""
    make_corpus(tmp_path / "c", n=40, val=4)
    status, _, err = train_here("--data_dir", "c", *TINY, "--num_epochs", "1")
    assert status == 0, err
    step = train.train_step
    for error in (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
                  RuntimeError("MPS backend out of memory (MPS allocated: 8 GB)")):
        def failing(*args, error=error, **kwargs):
            raise error
        monkeypatch.setattr(train, "train_step", failing)
        status, _, err = train_here("--num_epochs", "2")
        lines = err.strip().splitlines()
        assert status == 2 and lines[-1].startswith("train.py: error: out of memory on cpu in "
                                                     "a step of "), err
        assert "(--max_tokens 200, --accum_steps 1): lower --max_tokens" in lines[-1]
        assert (tmp_path / "weights" / "tmodel_00.pt").exists()
    steps = []

    def later(*args, **kwargs):  # issue 70, 3: the newest checkpoint mid-epoch (--save_every)
        if steps:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        steps.append(1)
        return step(*args, **kwargs)
    monkeypatch.setattr(train, "train_step", later)
    status, _, err = train_here("--num_epochs", "2", "--save_every", "1")
    assert status == 2 and sorted(p.name for p in (tmp_path / "weights").glob("tmodel_0*")) == \
        ["tmodel_00.pt", "tmodel_01_s0000%03d.pt" % (1 + int(torch.load(
            tmp_path / "weights" / "tmodel_00.pt", weights_only=False)["global_step"]))], err
    assert err.strip().splitlines()[-1].endswith(
        "resume from the last per-epoch checkpoint with --preload 0 and the smaller batches (the "
        "steps after it are trained again)"), err
    cause = ValueError("the cause")

    def other(*args, **kwargs):
        raise RuntimeError("shape mismatch") from cause
    monkeypatch.setattr(train, "train_step", other)
    with pytest.raises(RuntimeError, match="shape mismatch") as raised:  # any other error: as
        train_here("--num_epochs", "2")  # it was, its cause kept (issue 70, 6: `from None`)
    assert raised.value.__cause__ is cause


@pytest.mark.parametrize("failing", ["run_validation", "score_test_sets"])
def test_a_scoring_that_raises_finds_the_epochs_checkpoint_already_saved(tmp_path, train_here,
                                                                         monkeypatch, failing):
    """Issue 63 (a promise of docs/resuming.md with no test): the epoch's checkpoint is saved
    before validation decodes, and every epoch's before the test sets are scored, so a crash
    while scoring loses no training: the next start resumes after it."""
    make_corpus(tmp_path / "c", n=40, val=4)
    write_aligned(tmp_path / "c", "test", number_pairs(4, seed=8))

    def crash(*args, **kwargs):
        raise RuntimeError("a crash while scoring")
    monkeypatch.setattr(train, failing, crash)
    with pytest.raises(RuntimeError, match="a crash while scoring"):
        train_here("--data_dir", "c", *TINY, "--num_epochs", "2")
    saved = sorted(p.name for p in (tmp_path / "weights").glob("tmodel_0*.pt"))
    assert saved == (["tmodel_00.pt"] if failing == "run_validation"
                     else ["tmodel_00.pt", "tmodel_01.pt"])
    monkeypatch.undo()
    status, out, err = train_here()
    assert status == 0, err
    if failing == "run_validation":
        assert "resumed from weights/tmodel_00.pt: epoch 1, batch 0" in out


@pytest.mark.parametrize("problem, message", [
    ("no_dir", "--data_dir nowhere: no such folder"),
    ("new_folder", "--data_dir nowhere: no such folder"),
    ("line_counts", "train.it has 2"),
    ("overwrite", "--preload none would overwrite it"),
    ("arch", "was trained with --d_model 32, not 64"),
    ("hub", "is not in the Hugging Face cache and HF_HUB_OFFLINE is set"),
])
def test_train_bad_input_is_one_line_and_exit_2(trained, tmp_path, problem, message):
    home, _ = trained
    args = {"no_dir": ["--data_dir", "nowhere"],
            "new_folder": ["--data_dir", "nowhere", "--model_folder", "never/made"],
            "line_counts": ["--data_dir", "bad", "--model_folder", "fresh"],
            "overwrite": ["--preload", "none"],
            "arch": ["--d_model", "64"],
            "hub": ["--model_folder", "fresh2"]}[problem]
    if problem == "line_counts":
        (home / "bad").mkdir(exist_ok=True)
        (home / "bad" / "train.en").write_text("a\nb\nc\n")
        (home / "bad" / "train.it").write_text("a\nb\n")
    before = {p: p.stat().st_mtime_ns for p in (home / "weights").iterdir()}
    # in this process but one: a fresh interpreter's start (its imports, the hub's settings)
    t = (run_script if problem == "hub" else run_here)("train.py", *args, cwd=home)
    err = t.stderr.decode()
    if problem == "hub":  # what is loaded from where, before the half minute a hub can take
        said, err = err.split("\n", 1)
        assert said == "loading 'Helsinki-NLP/opus_books' from the Hugging Face cache " \
                       "(HF_HUB_OFFLINE is set)"
    assert t.returncode == 2 and message in err and err.strip().count("\n") == 0, err
    assert {p: p.stat().st_mtime_ns for p in (home / "weights").iterdir()} == before
    assert not (home / "never" / "made").exists()  # a failed start leaves no empty folder


def test_resuming_with_a_swapped_tokenizer_of_the_same_size_is_refused(trained, tmp_path):
    """Issue 45: a tokenizer file replaced by another of the same size made train.py say the
    prepared data "was prepared for other tokenizers: preparing again", and train on. The
    checkpoint's fingerprint refuses it before anything is prepared, and the folder is left
    as it was."""
    import shutil
    home, _ = trained
    folder = tmp_path / "copy"
    shutil.copytree(home / "weights", folder)
    swap_two_tokens(folder / "tokenizer_it.json", folder / "tokenizer_it.json")
    before = {p: p.stat().st_mtime_ns for p in folder.rglob("*")}
    t = run_here("train.py", "--model_folder", folder, "--num_epochs", "3", cwd=home)
    err = t.stderr.decode()
    assert t.returncode == 2 and "the same size, but other tokens or merges" in err, err
    assert "preparing again" not in err
    assert {p: p.stat().st_mtime_ns for p in folder.rglob("*")} == before


def train_args(folder):
    return ["--data_dir", "corpus", *TINY, "--max_tokens", "60", "--d_model", "64", "--N", "2",
            "--num_epochs", "2", "--save_every", "2", "--keep_last", "2",
            "--model_folder", folder, "--experiment_name", f"runs/{folder}"]


@pytest.fixture(scope="module")
def kill_corpus(tmp_path_factory):
    home = tmp_path_factory.mktemp("kill")
    make_corpus(home / "corpus", n=400, seed=5, val=4)
    return home


def popen_train(home, args, merged=False):
    """train.py in the background; `merged`: stderr (the progress bar) into stdout's pipe,
    in the order written."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return subprocess.Popen([sys.executable, str(ROOT / "train.py"), *map(str, args)], cwd=home,
                            stdout=subprocess.PIPE, env=env,
                            stderr=subprocess.STDOUT if merged else subprocess.PIPE)


def step_checkpoints(folder):
    return sorted(p for p in folder.glob("tmodel_*_s*.pt"))


@pytest.fixture(scope="module")
def straight(kill_corpus):
    """The uninterrupted run the killed ones are held to: its last checkpoint."""
    reference = run_here("train.py", *train_args("straight"), cwd=kill_corpus)
    assert reference.returncode == 0, reference.stderr.decode()[-2000:]
    return load_checkpoint(kill_corpus / "straight" / "tmodel_01.pt")


def same_weights(a, b):
    assert a["global_step"] == b["global_step"]  # no batch trained twice, none skipped
    for k, v in a["model_state_dict"].items():
        assert torch.equal(v, b["model_state_dict"][k]), k


# train.py, killed (SIGKILL) inside its first checkpoint save: between the write and the rename
DIES_SAVING = ("import os, signal, sys; sys.path.insert(0, sys.argv[1]); real = os.replace\n"
               "def dying(a, b):\n"
               "    if str(b).endswith('.pt'): os.kill(os.getpid(), signal.SIGKILL)\n"
               "    real(a, b)\n"
               "os.replace = dying; import train; train.main(sys.argv[2:])")


def test_sigkill_at_any_point_then_resume_gives_the_uninterrupted_weights(kill_corpus, straight):
    """Killed three times: first between a checkpoint's write and its rename (the one instant a
    save can be cut: the checkpoint is not there, its complete temporary file is, and the next
    start, having nothing to resume, trains afresh and its save of that name replaces the
    file), then twice after a few mid-epoch saves, each later start resuming from a mid-epoch
    checkpoint (a silent fresh start with the same seed would also end with equal weights:
    the messages tell them apart). The run ends with the uninterrupted run's weights."""
    home = kill_corpus
    folder = home / "killed"
    cut = subprocess.run([sys.executable, "-c", DIES_SAVING, str(ROOT), *train_args("killed")],
                         cwd=home, capture_output=True, timeout=120)
    assert cut.returncode == -signal.SIGKILL, cut.stderr.decode()[-1500:]
    left = list(folder.glob(".tmodel_*.pt.tmp"))
    assert len(left) == 1 and not list(folder.glob("tmodel_*.pt"))
    load_checkpoint(left[0])  # complete, only not renamed
    kills, outputs = 1, []
    for wait_for in (3, 6):  # kill after this many mid-epoch saves have appeared, then resume
        proc = popen_train(home, train_args("killed"))
        seen = set()
        deadline = time.time() + 120
        while proc.poll() is None and time.time() < deadline:
            seen |= {p.name for p in step_checkpoints(folder)}
            if len(seen) >= wait_for:
                proc.send_signal(signal.SIGKILL)
                kills += 1
                break
            time.sleep(0.005)
        outputs.append(proc.communicate()[0].decode())
        for p in folder.glob("*.pt"):  # whatever instant it died at, every file loads
            load_checkpoint(p)
    assert kills == 3, outputs
    final = run_here("train.py", *train_args("killed"), cwd=home)
    assert final.returncode == 0, final.stderr.decode()[-2000:]
    assert "resumed from" not in outputs[0]  # nothing was saved before the first kill
    for out in outputs[1:] + [final.stdout.decode()]:  # every later start: from a mid-epoch save
        assert re.search(r"resumed from killed/tmodel_0\d_s\d+\.pt", out), out[-1500:]
    assert not list(folder.glob(".*.tmp"))
    same_weights(straight, load_checkpoint(folder / "tmodel_01.pt"))
    assert len(step_checkpoints(folder)) <= 2  # keep_last


def test_a_run_keeps_its_saves_for_average_saves_with_the_weights_only(kill_corpus, straight):
    """--save_every 2 --keep_last 2: the newest 2 saves stay past the last epoch's end, which is
    the run's newest checkpoint and alone keeps the optimizer state; translate.py
    --average_saves 3 averages them with that end (its step a save's: no save beside it)."""
    folder = kill_corpus / "straight"
    saves = step_checkpoints(folder)
    assert len(saves) == 2 and straight["global_step"] % 2 == 0
    assert [load_checkpoint(p)["global_step"] for p in saves] == [
        straight["global_step"] - 4, straight["global_step"] - 2]
    assert "optimizer_state_dict" in straight
    assert not any("optimizer_state_dict" in load_checkpoint(p) for p in saves)
    t = run_here("translate.py", "--model_folder", "straight", "--average_saves", "3",
                 "one two", cwd=kill_corpus)
    assert t.returncode == 0, t.stderr.decode()
    assert (f"averaged 3 checkpoints of straight: {saves[0].name}, {saves[1].name}, "
            f"tmodel_01.pt") in t.stderr.decode()


def test_sigint_saves_mid_epoch_exits_130_and_resumes_there(tmp_path):
    """Issue 45: after a saved stop the exit code was 0, as for a finished run: a script or a
    scheduler could not tell them apart. 130 after SIGINT (128 + 2), as a shell reports. (Its
    epochs of 500 steps: a fast CPU ran kill_corpus's 50 in less than the 0.3 s below.)"""
    home = tmp_path
    make_corpus(home / "corpus", n=4000, seed=5, val=4)
    args = train_args("interrupted")
    args[args.index("--num_epochs") + 1] = "50"
    args[args.index("--save_every") + 1] = "0"
    proc = popen_train(home, args, merged=True)
    deadline = time.time() + 120  # after epoch 0's validation, while epoch 1 trains
    while not (home / "interrupted" / "tmodel_validation.json").exists() \
            and time.time() < deadline:
        time.sleep(0.01)
    time.sleep(0.3)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, out.decode()[-2000:]
    assert "stopped by SIGINT" in out.decode() and "Resume with" in out.decode()
    assert not (home / "interrupted" / "MODEL_CARD.md").exists()  # not a finished run
    # stdout and stderr share one pipe: after the stop message, no progress bar is redrawn
    tail = out.decode().split("stopped by SIGINT")[1]
    assert "%|" not in tail, tail
    saved = step_checkpoints(home / "interrupted")
    assert len(saved) == 1
    state = load_checkpoint(saved[0])
    args[args.index("--num_epochs") + 1] = str(state["epoch"] + 1)
    other = run_here("train.py", *args, "--max_tokens", "80", cwd=home)
    assert other.returncode == 2 and "saved mid-epoch with --max_tokens 60" in \
        other.stderr.decode()
    resumed = run_here("train.py", *args, cwd=home)
    assert resumed.returncode == 0, resumed.stderr.decode()[-2000:]
    assert (f"epoch {state['next_epoch']}, batch {state['next_batch']}, step "
            f"{state['global_step']}") in resumed.stdout.decode()


def test_a_resume_from_an_epochs_checkpoint_trains_as_the_run_that_was_not_stopped(tmp_path,
                                                                                 train_here):
    """A run killed while it validated resumes from the epoch's checkpoint, saved before the
    validation; the validation drew from the random generator (its DataLoader's seed), so the
    uninterrupted run's next epoch had other dropout masks than the resumed one's: the weights
    parted. Validation now leaves the generator as it found it."""
    make_corpus(tmp_path / "c", n=60, val=4)
    flags = ["--data_dir", "c", *TINY, "--num_epochs", "2", "--keep_optimizer", "0",
             "--val_examples", "0", "--max_tokens", "120"]
    code, out, err = train_here(*flags, "--model_folder", "straight")
    assert code == 0, err
    killed = tmp_path / "killed"  # as a kill during epoch 0's validation leaves the folder
    shutil.copytree(tmp_path / "straight", killed,
                    ignore=lambda folder, names: [n for n in names if n.startswith("tmodel_")
                                                  and n != "tmodel_00.pt" or n.endswith(".md")])
    code, out, err = train_here(*flags, "--model_folder", "killed")
    assert code == 0 and "resumed from killed/tmodel_00.pt: epoch 1, batch 0" in out, out + err
    same_weights(load_checkpoint(tmp_path / "straight" / "tmodel_01.pt"),
                 load_checkpoint(killed / "tmodel_01.pt"))


def test_non_finite_updates_are_skipped_then_training_stops_without_saving_them(kill_corpus):
    home = kill_corpus
    args = train_args("diverged") + ["--lr", "1e30", "--clip_grad", "0", "--max_bad_steps", "3"]
    t = run_here("train.py", *args, cwd=home)
    err = t.stderr.decode()
    assert t.returncode == 2, err[-2000:]
    assert "update skipped (1 in a row)" in err + t.stdout.decode()
    assert "3 non-finite updates in a row: training stopped" in err
    # the error ends the output on a line of its own, after the bar's (a log's grep finds it)
    assert err.splitlines()[-1] == "train.py: error: 3 non-finite updates in a row: training " \
        "stopped without saving the diverged weights; lower --lr, then resume from the last " \
        "checkpoint in diverged", err[-2000:]
    for p in (home / "diverged").glob("*.pt"):
        state = load_checkpoint(p)
        assert all(torch.isfinite(v).all() for v in state["model_state_dict"].values())
    # diverged before any checkpoint, in bf16: nothing to resume, and fp32 is a fix to try
    t = run_here("train.py", *args, "--save_every", "0", "--model_folder", "fresh",
                 "--precision", "bf16", cwd=home)
    assert t.returncode == 2 and t.stderr.decode().splitlines()[-1].endswith(
        "lower --lr or use --precision fp32, then run the same command again with it (nothing "
        "was saved in fresh yet)"), t.stderr.decode()[-2000:]
    assert not list((home / "fresh").glob("*.pt"))
    # validated before it diverged, still no checkpoint: the same folder would refuse the same
    # command (its validation's files), so another one
    t = run_here("train.py", *args, "--save_every", "0", "--eval_every", "1", "--model_folder",
                 "validated", cwd=home)
    assert t.returncode == 2 and t.stderr.decode().splitlines()[-1].endswith(
        "a fresh start would overwrite: run the same command again with it and another "
        "--model_folder"), t.stderr.decode()[-2000:]


def test_training_on_from_an_earlier_epoch_sets_the_abandoned_line_aside(trained, tmp_path):
    """Issue 9, defect 3: after --preload 00 in a folder that holds epoch 01, the new line's
    mid-epoch checkpoints used to be pruned as soon as written, and latest resumed epoch 01."""
    home, _ = trained
    import shutil
    shutil.copytree(home / "weights", tmp_path / "w")
    # issue 45: epoch 00 holds the weights only (the default --keep_optimizer 1): refused in one
    # line, nothing moved
    refused = run_here("train.py", "--model_folder", tmp_path / "w", "--preload", "00",
                       "--experiment_name", tmp_path / "runs", cwd=home)
    assert refused.returncode == 2 and "tmodel_00.pt holds the weights only" in \
        refused.stderr.decode().strip().splitlines()[-1]
    assert not list((tmp_path / "w").glob("superseded_*"))
    # the optimizer state put back, as a run with --keep_optimizer 2 would have kept it (its
    # values do not matter here: the files' moves are what is tested)
    state = load_checkpoint(tmp_path / "w" / "tmodel_00.pt")
    latest = load_checkpoint(tmp_path / "w" / "tmodel_01.pt")
    save_checkpoint({**state, "optimizer_state_dict": latest["optimizer_state_dict"]},
                    tmp_path / "w" / "tmodel_00.pt")
    step = state["global_step"]
    old_history = (tmp_path / "w" / "tmodel_validation.json").read_text()
    (tmp_path / "w" / "results.json").write_text("{}")  # the abandoned line's test scores
    t = run_here("train.py", "--model_folder", tmp_path / "w", "--preload", "00",
                 "--save_every", "1", "--max_steps", step + 2,
                   "--experiment_name", tmp_path / "runs", cwd=home)
    assert t.returncode == 0, t.stderr.decode()[-2000:]
    names = {p.name for p in (tmp_path / "w").glob("tmodel_0*.pt")}
    assert names == {"tmodel_00.pt", f"tmodel_01_s{step + 1:07d}.pt",
                     f"tmodel_01_s{step + 2:07d}.pt"}  # kept: nothing later supersedes them
    assert len(list((tmp_path / "w").glob("superseded_*/tmodel_01.pt"))) == 1  # moved, kept
    # issue 24: its test scores moved with it, and its whole validation history copied
    aside = next((tmp_path / "w").glob("superseded_*"))
    assert (aside / "results.json").read_text() == "{}"
    assert (aside / "tmodel_validation.json").read_text() == old_history
    assert "--preload 00: moved tmodel_01.pt, results.json, MODEL_CARD.md, validation_curve.png " \
        "to " in t.stdout.decode()  # (the trained fixture's best: epoch 00, kept)
    history = json.loads((tmp_path / "w" / "tmodel_validation.json").read_text())
    assert [h["step"] for h in history] == [step, step + 2]  # epoch 01's validation left out
    from nmt.checkpoint import latest_checkpoint_path
    from config import Config
    assert latest_checkpoint_path(Config(model_folder=str(tmp_path / "w"))).name == \
        f"tmodel_01_s{step + 2:07d}.pt"


def test_default_optimizer_learns_keeps_the_best_checkpoint_and_scores_the_test_split(
        tmp_path):
    """A short run with the default optimizer settings learns; the best checkpoint is the
    one with the highest validation BLEU; every test set is scored at the end."""
    make_corpus(tmp_path / "corpus", n=200, seed=1, val=20)
    write_aligned(tmp_path / "corpus", "test", number_pairs(10, seed=3))
    write_aligned(tmp_path / "corpus", "test_b", number_pairs(6, seed=4))
    t = run_here("train.py", "--data_dir", "corpus", "--d_model", "64", "--N", "1", "--h", "2",
                 "--d_ff", "128", "--seq_len", "24", "--tokenizer_type", "word",
                 "--max_tokens", "300", "--num_epochs", "2", "--val_examples", "0",
                 cwd=tmp_path)
    assert t.returncode == 0, t.stderr.decode()[-2000:]
    history = json.loads((tmp_path / "weights" / "tmodel_validation.json").read_text())
    assert len(history) == 2
    uniform = math.log(len(json.loads(
        (tmp_path / "weights" / "tokenizer_it.json").read_text())["model"]["vocab"]))
    # The write-ups' optimizer (Adam at a constant 1e-4) is still at loss 2.97 after 3 epochs,
    # above uniform (2.71 for these 15 words), at BLEU 0; the defaults reach about 1.9 and 8
    # after these 2.
    assert history[-1]["loss"] < 0.8 * uniform and history[-1]["bleu"] > 2, history
    best = load_checkpoint(tmp_path / "weights" / "tmodel_best.pt")
    top = max(history, key=lambda h: h["bleu"])
    assert best["global_step"] == top["step"] and best["validation"]["bleu"] == top["bleu"]
    assert "optimizer_state_dict" not in best  # weights and config only
    results = json.loads((tmp_path / "weights" / "results.json").read_text())
    out = t.stdout.decode()
    assert "test test (10 sentences, best checkpoint, greedy)" in out and "BLEU = " in out
    # issue 45: only the first test file was scored, silently; every one is, by name
    assert "test test_b (6 sentences, best checkpoint, beam4)" in out
    assert {n: r["sentences"] for n, r in results["tests"].items()} == {"test": 10, "test_b": 6}
    # issue 42: every test score with its 95% confidence interval, the signature saying so
    scores = results["tests"]["test"]["scores"]["beam4"]
    assert all(scores[f"{m}_ci"] >= 0 for m in ("bleu", "chrf", "bleu_lc"))
    assert "|bs:1000|" in scores["report"] and "±" in scores["report"]
    assert "10 test pairs (test), 6 test pairs (test_b)" in t.stderr.decode()
    # the test scores are the best checkpoint's: translate.py with it gives the same, greedy
    # and beam 4, cased and lowercased (the literature's Multi30k figures are lowercased)
    for name, beam in (("greedy", "1"), ("beam4", "4")):
        hyp = run_here("translate.py", "--preload", "best", "--beam", beam, "--input",
                       "corpus/test.en", "--reference", "corpus/test.it", cwd=tmp_path)
        report = results["tests"]["test"]["scores"][name]["report"]
        assert hyp.returncode == 0 and "case:lc" in report, hyp.stderr.decode()
        assert all(line in hyp.stderr.decode() for line in report.splitlines()), report


def test_patience_stops_training_and_says_so(tmp_path, train_here):
    make_corpus(tmp_path / "corpus", n=40, seed=1, val=4)
    args = ["--data_dir", "corpus", *TINY, "--num_epochs", "6", "--patience", "2"]
    args[args.index("--lr") + 1] = "1e-12"  # nothing changes: no validation is ever better
    code, out, err = train_here(*args)
    assert code == 0, err[-2000:]
    assert "(--patience 2): training stops" in out
    assert sorted(p.name for p in (tmp_path / "weights").glob("tmodel_0*.pt")) == [
        "tmodel_00.pt", "tmodel_01.pt", "tmodel_02.pt"]
    assert load_checkpoint(tmp_path / "weights" / "tmodel_best.pt")["epoch"] == 0
    # the same command again: stopped there, so nothing to train (it trained on, scored the
    # tests again and rewrote the card, every time)
    card = (tmp_path / "weights" / "MODEL_CARD.md").read_text(encoding="utf-8")
    code, out, err = train_here(*args)
    assert code == 0 and "no better validation in the last 2 validations (--patience 2): " \
        "training ends here; raise --patience to train on" in out, out + err
    assert sorted(p.name for p in (tmp_path / "weights").glob("tmodel_0*.pt")) == [
        "tmodel_00.pt", "tmodel_01.pt", "tmodel_02.pt"]
    assert (tmp_path / "weights" / "MODEL_CARD.md").read_text(encoding="utf-8") == card
    code, out, err = train_here(*args[:-1], "3")  # patience raised: it trains on
    assert code == 0 and "resumed from" in out and "tmodel_03.pt" in os.listdir(
        tmp_path / "weights"), out + err


def test_eval_every_validates_at_its_steps_and_at_the_end_of_each_epoch(tmp_path, train_here):
    make_corpus(tmp_path / "corpus", n=40, seed=1, val=4)
    code, _, err = train_here("--data_dir", "corpus", *TINY, "--num_epochs", "2",
                              "--eval_every", "2", "--val_examples", "0")
    assert code == 0, err[-2000:]
    per_epoch = load_checkpoint(tmp_path / "weights" / "tmodel_00.pt")["global_step"]
    history = json.loads((tmp_path / "weights" / "tmodel_validation.json").read_text())
    expected = sorted({s for s in range(2, 2 * per_epoch, 2) if s != per_epoch}
                      | {per_epoch, 2 * per_epoch})
    assert [h["step"] for h in history] == expected
    assert [h["epoch"] for h in history] == [0 if s <= per_epoch else 1 for s in expected]


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_every_preset_trains_and_translates_after_a_save_load_round_trip(preset, tmp_path):
    config, given = parse_config(["--preset", preset, "--d_model", "32", "--N", "1",
                                  "--d_ff", "64", "--dropout", "0", "--seq_len", "24"])
    assert {k for k, v in PRESETS[preset].items()
            if k not in ("d_model", "N", "d_ff", "dropout", "seq_len")} <= given
    vocab = 30
    model = build_model(config, vocab, vocab)
    torch.manual_seed(0)
    ds = BilingualDataset([torch.randint(4, vocab, (6,)).tolist() for _ in range(4)],
                          [torch.randint(4, vocab, (5,)).tolist() for _ in range(4)],
                          [""] * 4, [""] * 4)
    batch = Collator()([ds[i] for i in range(4)])
    optimizer = make_optimizer(model, 3e-3)
    loss_fn = make_loss(config)
    losses = []
    for _ in range(15):
        losses.append(float(train_step(model, [batch], loss_fn, PAD, "cpu")[0]))
        optimizer.step()
        optimizer.zero_grad()
    assert losses[-1] < 0.7 * losses[0], (preset, losses)
    save_checkpoint({"model_state_dict": model.state_dict(), "config": config.to_dict(),
                     "epoch": 0, "global_step": 15}, tmp_path / "p.pt")
    state = load_checkpoint(tmp_path / "p.pt")
    loaded = build_model(Config.from_dict(state["config"]), vocab, vocab)
    loaded.load_state_dict(state["model_state_dict"])
    model.eval(), loaded.eval()
    src = batch["encoder_input"]
    args = (src, batch["encoder_mask"], SOS, EOS, 8)
    assert greedy_decode(model, *args) == greedy_decode(loaded, *args)


def test_a_preset_with_a_joint_vocabulary_trains_and_translates_with_every_feature(tmp_path):
    """Issue 10: the modern options with one joint vocabulary shared by all three weight
    matrices, through train.py and translate.py (beam, averaging, attention map)."""
    make_corpus(tmp_path / "corpus", n=64, seed=1, val=8)
    t = run_here("train.py", "--preset", "modern_small", "--data_dir", "corpus", *TINY,
                 "--n_kv_heads", "1", "--shared_vocab", "true", "--tie_embeddings", "all",
                   "--num_epochs", "2", cwd=tmp_path)
    assert t.returncode == 0, t.stderr.decode()[-2000:]
    weights = tmp_path / "weights"
    assert (weights / "tokenizer_en_it.json").exists()
    assert not (weights / "tokenizer_en.json").exists()
    config = load_checkpoint(weights / "tmodel_01.pt")["config"]
    assert (config["pos"], config["norm"], config["ffn"], config["tie_embeddings"]) == (
        "rope", "rms", "swiglu", "all")
    t = run_here("translate.py", "--beam", "2", "--average", "2", "--attention",
                 tmp_path / "att.png", "one two.", cwd=tmp_path)
    assert t.returncode == 0 and len(t.stdout.decode().split("\n")) == 2, t.stderr.decode()
    assert (tmp_path / "att.png").exists()


def test_a_mid_epoch_resume_with_accumulation_trains_the_same_updates(tmp_path, train_here):
    """A run stopped mid-epoch at --max_steps with --accum_steps 2, then resumed, ends with the
    weights of one never stopped: the resume starts at the group the stop left off at."""
    home = make_corpus(tmp_path, seed=5, n=120, val=4)
    args = ["--data_dir", ".", *TINY, "--max_tokens", "60", "--num_epochs", "1",
            "--accum_steps", "2", "--val_max_sentences", "1",
            "--warmup", "4"]  # given: the schedule does not depend on the run's length
    code, _, err = train_here(*args, "--model_folder", "acc_straight",
                              "--experiment_name", "runs/acc_straight")
    assert code == 0, err[-2000:]
    folder = ["--model_folder", "acc_stopped", "--experiment_name", "runs/acc_stopped"]
    _, out, _ = train_here(*args, *folder, "--max_steps", "5")
    assert "reached --max_steps 5 in epoch 0 after batch 10 of" in out, out[-2000:]
    _, out, err = train_here(*folder, "--max_steps", "0")
    assert "resumed from acc_stopped/tmodel_00_s0000005.pt: epoch 0, batch 10, step 5" in out, \
        out[-2000:] + err
    a = load_checkpoint(home / "acc_straight" / "tmodel_00.pt")
    b = load_checkpoint(home / "acc_stopped" / "tmodel_00.pt")
    assert a["global_step"] == b["global_step"] > 5
    for k, v in a["model_state_dict"].items():
        assert torch.equal(v, b["model_state_dict"][k]), k


def test_a_missing_gpu_is_refused_before_any_data_is_read(tmp_path, train_here):
    """Issue 45: --device cuda on a machine without CUDA failed only after the data was
    prepared (minutes on a large corpus); the data folder here does not even exist."""
    if torch.cuda.is_available():
        pytest.skip("needs a machine without CUDA")
    code, out, err = train_here("--data_dir", "nowhere", "--device", "cuda")
    assert code == 2 and "--device cuda: CUDA is not available" in err, err
    assert "nowhere" not in err and not (tmp_path / "weights").exists()


def test_threads_sets_the_training_processs_cpu_threads(tmp_path, train_here, monkeypatch):
    """Issue 45: training had no thread control (translate.py had --threads): two trainings on
    one 2-core machine with torch's default threads each ran five times slower. --threads N
    sets torch's threads (the model card records them); 0, the default, leaves torch's."""
    make_corpus(tmp_path / "c", n=40, val=4)
    seen = []
    real = torch.set_num_threads
    monkeypatch.setattr(torch, "set_num_threads", lambda n: (seen.append(n), real(n)))
    code, _, err = train_here("--data_dir", "c", *TINY, "--num_epochs", "1", "--threads", "1")
    assert code == 0 and seen[0] == 1, err
    card = (tmp_path / "weights" / "MODEL_CARD.md").read_text(encoding="utf-8")
    assert "- device: cpu, 1 thread (" in card
    code, _, err = train_here("--num_epochs", "1", "--threads", "-1")
    assert code == 2 and "--threads must not be negative" in err, err


def test_fp16_trains_with_the_gradient_scaler_and_resumes_its_scale(tmp_path, train_here):
    """--precision fp16: autocast to float16 and the gradient scaler, end to end; its scale is
    saved with the checkpoint and restored on resume."""
    make_corpus(tmp_path / "c", n=120, val=4)
    code, out, err = train_here("--data_dir", "c", *TINY, "--num_epochs", "1",
                                "--precision", "fp16", "--log_every", "1")
    assert code == 0 and "torch.float16 autocast" in out, err
    assert "note: --precision fp16 on a CPU" in err  # issue 45: it said nothing
    state = load_checkpoint(tmp_path / "weights" / "tmodel_00.pt")
    scale = state["scaler_state_dict"]["scale"]
    assert scale > 0 and math.isfinite(scale)
    assert all(torch.isfinite(v).all() for v in state["model_state_dict"].values())
    losses = lr_scalars(tmp_path / "runs" / "tmodel", "train/loss")  # every step's
    steps = sorted(losses)
    assert len(steps) >= 4 and all(math.isfinite(v) for v in losses.values())
    first, last = losses[steps[0]], sum(losses[s] for s in steps[-3:]) / 3
    assert last < first - 0.25, losses  # it learned (5.97 to 5.50 when written): by its own start
    restored = {}
    real = train.restore_training

    def spy(state, path, model, optimizer, scaler):
        real(state, path, model, optimizer, scaler)
        restored["scale"] = scaler.get_scale()
    train.restore_training = spy
    try:
        code, out, err = train_here("--num_epochs", "2")
    finally:
        train.restore_training = real
    assert code == 0 and restored["scale"] == scale, err


def test_compile_trains_the_same_step_as_eager(tmp_path, monkeypatch):
    """--compile: the compiled step (torch.compile, once per fixed shape) gives the eager step's
    loss and gradients on a tiny model. With AOT autograd's eager backend, what inductor
    compiles from (its C++ code generation took most of a minute of the suite on 2 cores)."""
    import torch._dynamo as dynamo
    real = torch.compile
    monkeypatch.setattr(torch, "compile", lambda model, **kw: real(model, backend="aot_eager",
                                                                   **kw))
    dynamo.reset()
    make_corpus(tmp_path / "c", n=40, val=4)
    losses, grads = [], []
    for compile_ in (False, True):
        config, given = parse_config(["--data_dir", str(tmp_path / "c"), *TINY,
                                      "--model_folder", str(tmp_path / "w"), "--dropout", "0",
                                      "--attention_dropout", "0", "--activation_dropout", "0",
                                      "--compile", str(compile_)])
        run, _ = train.set_up(config, given)
        run.lock.release()
        run.writer.close()
        assert (run.step_model is not run.model) == compile_
        batch = next(iter(run.loader))
        loss, _ = train_step(run.step_model, [batch], run.loss_fn, PAD, run.device, run.amp)
        losses.append(float(loss))
        grads.append(torch.cat([p.grad.flatten() for p in run.model.parameters()]))
    assert losses[1] == pytest.approx(losses[0], rel=1e-4)
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-3, atol=1e-5)
    dynamo.reset()


def test_a_second_training_in_a_folder_in_use_is_refused_and_a_killed_runs_lock_is_not(
        kill_corpus):
    """Issue 24: nothing stopped a second train.py from writing the same checkpoints, best
    model and history as one already running. The folder is locked for the life of a run;
    readers (translate.py) still work; a run killed with SIGKILL leaves no lock behind."""
    home = kill_corpus
    args = ["--data_dir", "corpus", *TINY, "--max_tokens", "60", "--num_epochs", "50",
            "--model_folder", "busy", "--experiment_name", "runs/busy"]
    first = popen_train(home, args)
    try:
        deadline = time.time() + 120
        while not (home / "busy" / "tmodel_00.pt").exists() and time.time() < deadline:
            time.sleep(0.02)
        second = run_here("train.py", *args, cwd=home)
        err = second.stderr.decode()
        assert second.returncode == 2 and err.count("\n") == 1, err
        assert f"busy is in use by another training run (pid {first.pid} on " in err, err
        assert "let it finish or stop it, or train into another --model_folder" in err
        read = run_here("translate.py", "--model_folder", "busy", "one two.", cwd=home)
        assert read.returncode == 0 and read.stdout.strip(), read.stderr.decode()
    finally:
        first.kill()  # SIGKILL: no handler runs, no file is cleaned up
        first.communicate()
    assert (home / "busy" / ".train.lock").exists()  # left behind, its lock dropped
    resumed = run_here("train.py", *args, "--num_epochs", "1", cwd=home)
    assert resumed.returncode == 0, resumed.stderr.decode()
    assert "its 1 epoch is trained" in resumed.stdout.decode()
    assert not (home / "busy" / ".train.lock").exists()  # released when the run ended


def test_a_start_never_overwrites_a_best_checkpoint_whose_epochs_were_deleted(tmp_path,
                                                                             train_here):
    """Issue 24: with tmodel_NN.pt deleted, --preload latest started afresh and replaced
    tmodel_best.pt and the validation history with a new epoch 0."""
    make_corpus(tmp_path / "c", n=40, val=4)
    code, _, err = train_here("--data_dir", "c", *TINY, "--num_epochs", "2")
    assert code == 0, err
    folder = tmp_path / "weights"
    kept = {p.name: p.read_bytes() for p in
            (folder / "tmodel_best.pt", folder / "tmodel_validation.json")}
    for p in folder.glob("tmodel_0*.pt"):
        p.unlink()
    code, _, err = train_here("--data_dir", "c", *TINY, "--num_epochs", "2")
    assert code == 2 and "holds a run's files (tmodel_best.pt, tmodel_validation.json) but no " \
        "checkpoint to resume from" in err, err
    assert {name: (folder / name).read_bytes() for name in kept} == kept


def test_a_finished_run_leaves_a_model_card_of_what_made_it(tmp_path, train_here):
    """Issue 25: every finished run writes MODEL_CARD.md and its validation curve: the
    commands of every start, the data and its sizes, steps and time, device and precision, the
    test scores with sacreBLEU's signatures (those of results.json), samples, how to use it."""
    make_corpus(tmp_path / "c", n=40, val=4)
    write_aligned(tmp_path / "c", "test", number_pairs(4, seed=9))
    first = ["--data_dir", "c", *TINY, "--N", "2", "--N_dec", "1", "--num_epochs", "1",
             "--experiment_name", "runs/a <b>"]  # (a value a shell must have quoted)
    code, _, err = train_here(*first)
    assert code == 0, err
    code, _, err = train_here("--num_epochs", "2")  # resumed: the depths from the checkpoint
    assert code == 0, err
    folder = tmp_path / "weights"
    card = (folder / "MODEL_CARD.md").read_text(encoding="utf-8")
    results = json.loads((folder / "results.json").read_text())
    commands = card.split("## Made by")[1].split("```")[1].strip().splitlines()
    # each as a shell reads it back: pasted, it runs the same command
    assert [shlex.split(c.split("train.py ", 1)[1]) for c in commands] == [
        first, ["--num_epochs", "2"]]
    assert "parameters: 32/2+1 layers/2 heads/feed-forward 64" in card
    assert "40 training pairs, 4 validation pairs, 4 test pairs (test)" in card
    steps = load_checkpoint(folder / "tmodel_01.pt")["global_step"]
    assert f"- {steps} optimizer steps in 2 epoch(s)" in card and "precision fp32" in card
    n = torch.get_num_threads()  # issue 45: "1 threads"
    assert f"- device: cpu, {n} thread{'s' if n > 1 else ''} (" in card
    for name, s in results["tests"]["test"]["scores"].items():  # issue 42: each with its CI
        assert (f"| test | 4 | {name} | {s['bleu']:.2f} ± {s['bleu_ci']:.2f} | {s['chrf']:.2f} "
                f"± {s['chrf_ci']:.2f} | {s['bleu_lc']:.2f} ± {s['bleu_lc_ci']:.2f} |") in card
    assert "BLEU: nrefs:1|bs:1000|seed:12345|case:mixed" in card and "chrF2: nrefs:1|bs:1000" \
        in card
    test_sources = [src for src, _ in number_pairs(4, seed=9)]
    assert card.count("- source: ") == 3 and f"- source: {test_sources[0]}" in card
    assert "python translate.py --model_folder weights --preload best" in card
    assert (folder / "validation_curve.png").read_bytes()[:4] == b"\x89PNG"


def test_tokens_per_second_counts_training_time_only(tmp_path, train_here, monkeypatch):
    """Issue 24: the tok_s of the progress bar and train/tok_s counted the time of the
    --eval_every validations within the epoch. Here each validation takes 1,000 s of a clock
    moved forward: the throughput logged after it must not fall."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    make_corpus(tmp_path / "c", n=40, val=4)
    offset, real_time, real_validate = [0.0], train.time.time, train.validate

    def slow_validate(run, progress):
        offset[0] += 1000.0
        return real_validate(run, progress)
    monkeypatch.setattr(train.time, "time", lambda: real_time() + offset[0])
    monkeypatch.setattr(train, "validate", slow_validate)
    code, _, err = train_here("--data_dir", "c", *TINY, "--num_epochs", "1", "--eval_every", "1",
                              "--log_every", "1", "--val_max_sentences", "1")
    assert code == 0 and offset[0] >= 2000, err
    acc = EventAccumulator(str(tmp_path / "runs" / "tmodel"))
    acc.Reload()
    rates = [e.value for e in acc.Scalars("train/tok_s")]
    assert len(rates) >= 2 and min(rates) > 100, rates  # with the pause counted: about 0.2


# ---- a new run from a trained model (issue 43: --init_from) ------------------------------------

def test_a_run_from_a_trained_model_starts_where_the_model_stands(trained, tmp_path):
    """Its first validation, before any step (train.py makes it, at step 0), is the source
    model's own on the same data; its tokenizers are the source's (copied, never retrained);
    its optimizer, step count and history start afresh; the source folder is only read."""
    home, _ = trained
    source = home / "weights"
    before = {p.name: p.stat().st_mtime_ns for p in source.iterdir()}
    best = load_checkpoint(source / "tmodel_best.pt")
    args = ["--init_from", str(source), "--data_dir", str(home / "corpus"),
            "--model_folder", str(tmp_path / "w"), "--experiment_name", str(tmp_path / "runs")]
    config, given = parse_config(args)
    run, progress = train.set_up(config, given)
    run.lock.release()
    run.writer.close()
    assert progress.step == 0 and progress.history == [] and not run.optimizer.state
    assert run.config.init_from == str(source / "tmodel_best.pt")
    assert run.config.d_model == Config.from_dict(best["config"]).d_model == 32
    args[args.index(str(tmp_path / "w"))] = str(tmp_path / "w2")  # the same, by train.py
    t = run_here("train.py", *args, "--max_steps", "1", cwd=home)
    assert t.returncode == 0, t.stderr.decode()[-2000:]
    first = json.loads((tmp_path / "w2" / "tmodel_validation.json").read_text())[0]
    assert first["step"] == 0
    assert first["loss"] == pytest.approx(best["validation"]["loss"], abs=1e-6)
    assert first["bleu"] == best["validation"]["bleu"]
    for name in ("tokenizer_en.json", "tokenizer_it.json"):
        assert (tmp_path / "w" / name).read_bytes() == (source / name).read_bytes()
    assert {p.name: p.stat().st_mtime_ns for p in source.iterdir()} == before


def test_a_stop_while_validating_the_source_model_says_so_and_the_command_starts_again(
        trained, tmp_path, train_here, monkeypatch):
    """A signal during --init_from's step-0 validation: nothing was trained, so nothing is saved
    and there is nothing to resume; one line says so, the exit is 130, and the same command
    then starts the run."""
    home, _ = trained
    real_validate = train.validate

    def interrupted(run, progress):
        monkeypatch.setattr(train, "validate", real_validate)  # once
        progress.signal = "SIGINT"
        return train.Stop.SIGNAL
    monkeypatch.setattr(train, "validate", interrupted)
    args = ("--init_from", str(home / "weights"), "--data_dir", str(home / "corpus"),
            "--max_steps", "1")
    code, out, _ = train_here(*args)
    assert code == 130 and "stopped by SIGINT while validating the model of --init_from" in out
    assert not list((tmp_path / "weights").glob("tmodel_*.pt"))
    code, _, err = train_here(*args)
    assert code == 0, err
    assert [h["step"] for h in history(tmp_path / "weights")][:2] == [0, 1]


def test_init_from_refuses_what_would_change_the_model_in_one_line(trained, tmp_path,
                                                                  train_here):
    """A missing or foreign source, an architecture or vocabulary flag beside it, the source
    folder as the new one: one line and exit 2, nothing written."""
    home, _ = trained
    source = home / "weights"
    (tmp_path / "empty").mkdir()
    (tmp_path / "notes.pt").write_text("{}")
    (tmp_path / "parent" / "run").mkdir(parents=True)  # a trained run one folder down
    (tmp_path / "parent" / "run" / "tmodel_best.pt").write_bytes(
        (source / "tmodel_best.pt").read_bytes())
    for args, said in (
            (["--init_from", tmp_path / "nowhere"], "no such model folder or checkpoint file"),
            (["--init_from", tmp_path / "empty"], "no checkpoint in it (give a trained model's "
                                                  "folder or file)"),  # (not translate's flags)
            (["--init_from", tmp_path / "parent"], f"below it hold checkpoints: "
                                                   f"{tmp_path / 'parent' / 'run'} (give one as "
                                                   f"--init_from)"),
            (["--init_from", tmp_path / "notes.pt"], "is a JSON file, not a checkpoint"),
            (["--init_from", source, "--d_model", "64"], "--d_model 64: the model of --init_from"),
            (["--init_from", source, "--vocab_size", "500"], "keeps its architecture and vocab"),
            (["--init_from", source, "--lang_tgt", "fr"], "--lang_tgt fr: the model of"),
            (["--init_from", source, "--tokenizer_sample", "5"],  # (its tokenizers are copied:
             "--tokenizer_sample 5: the model of"),  # the value was recorded, never used)
            (["--init_from", source, "--preset", "multi30k_modern"],
             "keeps its architecture and vocabulary; drop --preset multi30k_modern (it sets --"),
            (["--init_from", source / "tmodel_01.pt", "--model_folder", source],
             "is in --model_folder: a new run trains into a folder of its own")):
        code, _, err = train_here(*map(str, args), "--data_dir", str(home / "corpus"),
                                  *(["--model_folder", "new"] if "--model_folder" not in args
                                    else []))
        assert code == 2 and said in err and len(err.strip().splitlines()) == 1, err
        assert not (tmp_path / "new").exists()


def test_init_from_a_folder_finds_its_checkpoints_whatever_the_new_runs_basename(
        trained, tmp_path, train_here):
    """`--init_from W --model_basename x_` looked for x_*.pt in W ("no checkpoint in it"):
    --model_basename names the new run's files, the source's are found by their own name."""
    home, _ = trained
    code, _, err = train_here("--init_from", home / "weights", "--data_dir", home / "corpus",
                              "--model_folder", "ft", "--model_basename", "x_", "--max_steps", "1")
    assert code == 0, err
    assert list((tmp_path / "ft").glob("x_*.pt")) and not list((tmp_path / "ft").glob("tmodel*"))


def test_init_from_into_a_folder_that_holds_another_run_is_refused(trained, tmp_path,
                                                                    train_here):
    """--init_from where the folder holds a run to resume: the same fine-tuning command again
    resumes it; another run's folder was resumed with the flag dropped without a word, and is
    refused now."""
    home, _ = trained
    source = home / "weights"
    flags = ["--init_from", str(source), "--data_dir", str(home / "corpus"), "--val_examples",
             "0"]
    code, out, err = train_here(*flags, "--model_folder", "ft", "--num_epochs", "1")
    assert code == 0, err
    code, out, err = train_here(*flags, "--model_folder", "ft", "--num_epochs", "2")
    assert code == 0 and "resumed from ft/tmodel_00.pt" in out, out + err
    # the source given as its checkpoint file, from another working folder: the same source
    (tmp_path / "sub").mkdir()
    code, out, err = train_here(*flags[:1], source / "tmodel_best.pt", *flags[2:],
                                "--model_folder", "../ft", "--num_epochs", "3",
                                cwd=tmp_path / "sub")
    assert code == 0 and "resumed from ../ft/tmodel_01.pt" in out, out + err
    shutil.copytree(source, tmp_path / "other")  # a run trained from scratch
    # another source than the run's: refused, naming the one it started from
    code, out, err = train_here(*flags[:1], str(tmp_path / "other"), *flags[2:],
                                "--model_folder", "ft", "--num_epochs", "4")
    assert code == 2 and f"started from {source / 'tmodel_best.pt'})" in err, err
    code, out, err = train_here(*flags, "--model_folder", "other", "--num_epochs", "3")
    assert code == 2 and err.strip().splitlines()[-1].startswith(
        f"train.py: error: --init_from {source}: other holds a run to resume "), err
    assert err.strip().endswith("(other/tmodel_01.pt, trained from scratch); train the new "
                                "run into another --model_folder, or resume this one without "
                                "--init_from"), err


def source_with(home, folder, **settings):
    """A copy of the trained fixture's best checkpoint and tokenizers in `folder`, its config
    changed by `settings` (as if that run had been trained with them)."""
    import shutil
    folder.mkdir(parents=True)
    state = load_checkpoint(home / "weights" / "tmodel_best.pt")
    state["config"].update(settings)
    torch.save(state, folder / "tmodel_best.pt")
    for name in ("tokenizer_en.json", "tokenizer_it.json"):
        shutil.copyfile(home / "weights" / name, folder / name)
    return folder


def test_a_run_from_a_trained_model_inherits_its_model_and_nothing_of_its_data(trained, tmp_path):
    """Issue 56, 5: a model trained with back-translations (--extra_data_dir, --extra_tag,
    --upsample) and BPE-dropout, fine-tuned on a new corpus: the new run trains on the new
    corpus alone, without BPE-dropout (the source run's data and training settings are not
    inherited; before, --extra_data_dir "" was even refused for the inherited --extra_tag).
    The new corpus has words the source never saw: the tokenizers are still the source's,
    copied, never retrained."""
    home, _ = trained
    bt = tmp_path / "bt"
    write_aligned(bt, "train", number_pairs(8, seed=9))
    source = source_with(home, tmp_path / "x1", extra_data_dir=str(bt), extra_tag="<BT>",
                         upsample=2, bpe_dropout=0.1, lr=7e-3)
    new = tmp_path / "new"
    write_aligned(new, "train", [("zebra one two", "zebra uno due")] * 12)
    write_aligned(new, "val", [("zebra three", "zebra tre")] * 2)
    for extra in ([], ["--extra_data_dir", ""]):
        folder = tmp_path / f"ft{len(extra)}"
        config, given = parse_config(["--init_from", str(source), "--data_dir", str(new),
                                      "--model_folder", str(folder), *extra])
        run, _ = train.set_up(config, given)
        run.lock.release()
        run.writer.close()
        c = run.config
        assert (c.extra_data_dir, c.extra_tag, c.upsample, c.bpe_dropout) == ("", "", 1, 0.0)
        assert c.lr == Config().lr and c.d_model == 32
        assert len(run.data.train) == 12  # the new corpus once, no back-translations
        for name in ("tokenizer_en.json", "tokenizer_it.json"):
            assert (folder / name).read_bytes() == (source / name).read_bytes()


@pytest.mark.parametrize("layout, copied", [("tok_{0}.json", "tok_{0}.json"),
                                            ("{0}/tokenizer.json", "tokenizer_{0}.json")])
def test_init_from_a_run_whose_tokenizers_lay_elsewhere(trained, tmp_path, train_here, layout,
                                                        copied):
    """Issue 56, 3: the source run used an absolute --tokenizer_file: the new run copies those
    tokenizers into its own folder (a SameFileError traceback before) and trains. Issue 63, 8:
    a layout with {0} in a folder's name (/tok/{0}/tokenizer.json) lost {0} in the copy's name,
    and the new run was refused ("must contain {0}")."""
    import shutil
    home, _ = trained
    shared = tmp_path / "tokenizers"
    for lang in ("en", "it"):
        at = shared / layout.format(lang)
        at.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(home / "weights" / f"tokenizer_{lang}.json", at)
    source = source_with(home, tmp_path / "x1", tokenizer_file=str(shared / layout))
    for lang in ("en", "it"):
        (source / f"tokenizer_{lang}.json").unlink()
    code, _, err = train_here("--init_from", str(source), "--data_dir", str(home / "corpus"),
                              "--model_folder", "ft", "--max_steps", "1")
    assert code == 0, err
    for lang in ("en", "it"):
        assert (tmp_path / "ft" / copied.format(lang)).read_bytes() == \
            (shared / layout.format(lang)).read_bytes()
    assert load_checkpoint(next((tmp_path / "ft").glob("tmodel_0*.pt")))["config"][
        "tokenizer_file"] == copied  # the new folder holds its own


def test_init_from_with_the_preset_trains_as_the_source_recipe(trained, tmp_path):
    """Issue 63, 7: docs/training.md's fine-tuning table was measured when --init_from took the
    source run's training settings; its command now gives --preset multi30k_modern, which
    must reproduce them: every setting of the merged config equals the source recipe's, but
    those the command gives (data, epochs, lr, folders) and the run fields."""
    from nmt.resume import init_state
    home, _ = trained
    recipe, _ = parse_config(["--preset", "multi30k_modern"])
    source = source_with(home, tmp_path / "half_a", **recipe.to_dict())
    flags = ["--init_from", str(source), "--preset", "multi30k_modern", "--data_dir", "b",
             "--num_epochs", "3", "--lr", "2e-3", "--model_folder", "ft",
             "--experiment_name", "runs/ft"]
    _, merged = init_state(*parse_config(flags))
    given = {"data_dir", "num_epochs", "lr", "init_from", "model_folder", "experiment_name",
             "preload"}
    different = {name for name, value in merged.to_dict().items()
                 if name not in given and value != getattr(recipe, name)}
    assert different == set(), different
    _, plain = init_state(*parse_config([f for f in flags if f not in ("--preset",
                                                                       "multi30k_modern")]))
    assert (plain.lr_schedule, plain.dropout) == ("inverse_sqrt", 0.1)  # the defaults'


def test_a_failed_start_from_a_trained_model_leaves_no_file(trained, tmp_path, train_here):
    """Issue 56, 4: --init_from with a corpus that is not there: one line, exit 2, and no file
    left in the new folder (the copied tokenizers went with it), so a start from another model
    into the same folder is not refused as "another tokenizer"."""
    home, _ = trained
    code, _, err = train_here("--init_from", str(home / "weights"), "--data_dir", "nope",
                              "--model_folder", "ft")
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "ft").exists()
    other = tmp_path / "other"
    code, _, err = train_here("--data_dir", str(home / "corpus"), *TINY, "--vocab_size", "280",
                              "--num_epochs", "1", "--model_folder", str(other))
    assert code == 0, err
    code, _, err = train_here("--init_from", str(other), "--data_dir", str(home / "corpus"),
                              "--model_folder", "ft", "--max_steps", "1")
    assert code == 0, err


def test_an_unwritable_model_folder_is_refused_before_training(tmp_path, train_here):
    """Issue 56 (an untested promise): a --model_folder that cannot be written (here a path
    under a plain file: this suite runs as root, for whom permissions do not refuse) is one
    line and exit 2 before any data is prepared or step trained."""
    make_corpus(tmp_path / "c", n=40, val=4)
    (tmp_path / "plain").write_text("not a folder")
    code, out, err = train_here("--data_dir", "c", *TINY, "--model_folder", "plain/w")
    assert code == 2 and "--model_folder plain/w is not writable" in err, err
    assert len(err.strip().splitlines()) == 1 and "epoch" not in out and "prepar" not in out
    code, out, err = train_here("--data_dir", "c", *TINY, "--model_folder", "plain")
    assert code == 2 and err.endswith("--model_folder plain is a file: give a folder (a new "
                                      "one, or a run's to resume)\n"), err  # ("File exists")
    assert (tmp_path / "plain").read_text() == "not a folder"


def recorded_bars(monkeypatch):
    """train.py's progress bars, recording each loss set ((bar, step or None while the bar is
    made, the loss's text)) and each line drawn ((bar, line))."""
    postfixes, drawn = [], []

    class Bar(train.tqdm):
        def set_postfix(self, *args, **kwargs):
            postfixes.append((self.desc, getattr(self, "n", None), kwargs["loss"]))
            return super().set_postfix(*args, **kwargs)

        def display(self, *args, **kwargs):
            drawn.append((self.desc, str(self)))
            return super().display(*args, **kwargs)
    monkeypatch.setattr(train, "tqdm", Bar)
    return postfixes, drawn


def test_the_progress_bar_shows_a_smoothed_loss_from_the_first_step(tmp_path, train_here,
                                                                     monkeypatch):
    """The bar showed no loss for the first --log_every steps, then the last window's raw
    mean: now from step 1, a moving average (SMOOTHING a step) of the means logged."""
    from nmt.training_log import SMOOTHING
    postfixes, _ = recorded_bars(monkeypatch)
    make_corpus(tmp_path / "c", n=150, val=2)
    code, _, err = train_here("--data_dir", "c", *TINY, "--num_epochs", "1", "--log_every", "3",
                              "--val_examples", "0")
    assert code == 0, err
    shown = [(n, float(loss)) for _, n, loss in postfixes]
    logged = sorted(lr_scalars(tmp_path / "runs" / "tmodel", "train/loss").items())
    assert shown[0][0] == 1 and logged[0][0] == 1  # at the first step
    expected, before = [], 0
    for step, mean in logged:
        kept = SMOOTHING ** (step - before) if expected else 0.0
        expected.append(kept * (expected[-1] if expected else 0) + (1 - kept) * mean)
        before = step
    assert len(shown) == len(logged) >= 3
    assert [v for _, v in shown] == pytest.approx(expected, abs=1e-3)
    assert [v for _, v in shown][1:] != pytest.approx([m for _, m in logged][1:], abs=1e-3)


def test_every_epochs_bar_shows_the_loss_it_carries_from_its_first_step(tmp_path, train_here,
                                                                        monkeypatch):
    """A newcomer's walk-through: from the second epoch on, each bar showed no loss for its
    first --log_every steps."""
    postfixes, drawn = recorded_bars(monkeypatch)
    make_corpus(tmp_path / "c", n=150, val=2)
    code, _, err = train_here("--data_dir", "c", *TINY, "--num_epochs", "3", "--log_every", "50",
                              "--val_examples", "0")
    assert code == 0, err
    shown = [(desc, loss) for desc, _, loss in postfixes]
    for epoch in (1, 2):
        before = [loss for desc, loss in shown if desc == f"epoch {epoch - 1:02d}"]
        first = next(line for desc, line in drawn if desc == f"epoch {epoch:02d}")
        assert "| 0/" in first and first.endswith(f"loss={before[-1].strip()}]")  # before step 1


def test_a_corpus_mismatch_names_the_folders_as_typed_not_their_link_targets(tmp_path,
                                                                            train_here):
    """data/multi30k is a link in a shared checkout: the refusal named the folder it points to,
    which the user never typed."""
    make_corpus(tmp_path / "a", n=60, val=4)
    make_corpus(tmp_path / "b", seed=2, n=60, val=4)
    (tmp_path / "link_a").symlink_to(tmp_path / "a")
    (tmp_path / "link_b").symlink_to(tmp_path / "b")
    code, _, err = train_here("--data_dir", "link_a", *TINY, "--max_steps", "1")
    assert code == 0, err
    code, _, err = train_here("--data_dir", "link_b")
    assert code == 2 and err.count("\n") == 1, err
    assert f"the corpus {tmp_path / 'link_a'}, not {tmp_path / 'link_b'};" in err


def test_a_resume_whose_corpus_moved_says_so_and_goes_on_from_its_new_place(tmp_path,
                                                                           train_here):
    """A resume that typed no --data_dir reads the checkpoint's: where that folder is gone, the
    line said `--data_dir X: no such folder`, a flag the user never gave. It names the corpus
    the run was trained on and how to give its new place, which resumes."""
    make_corpus(tmp_path / "c", n=60, val=4)
    code, _, err = train_here("--data_dir", str(tmp_path / "c"), *TINY, "--max_steps", "1")
    assert code == 0, err
    (tmp_path / "c").rename(tmp_path / "moved")
    code, _, err = train_here("--max_steps", "2")
    assert code == 2 and err.count("\n") == 1, err
    assert f"trained on, --data_dir {tmp_path / 'c'}, is not there (moved?): give its place " \
        f"with --data_dir\n" in err
    code, _, err = train_here("--max_steps", "2", "--data_dir", "mov")  # typed wrong: as it
    assert code == 2 and err.endswith("--data_dir mov: no such folder\n"), err  # was
    code, _, err = train_here("--max_steps", "2", "--data_dir", str(tmp_path / "moved"))
    assert code == 0, err


def test_preload_into_a_folder_without_checkpoints_says_what_train_py_can_do(tmp_path,
                                                                           train_here):
    """train.py --preload 3 (or best) into a new folder gave translate.py's advice ("or pass
    --checkpoint PATH", a flag train.py has not); --preload -1 looked for tmodel_-1.pt."""
    make_corpus(tmp_path / "c", n=40, val=4)
    for preload, said in (
            ("3", "--preload 3: no checkpoint w/tmodel_03.pt (it holds no "
                  "checkpoint: without --preload a run starts there)"),
            ("best", "--preload best is for translate.py (the best checkpoint holds the weights "
                     "only); resume training with latest or an epoch"),
            ("-1", "--preload must be latest, none or an epoch number (translate.py also takes "
                   "best), got '-1'")):
        code, _, err = train_here("--data_dir", "c", *TINY, "--model_folder", "w", "--preload",
                                  preload)
        assert code == 2 and err.startswith("train.py: error: " + said) and \
            err.count("\n") == 1, err
        assert not (tmp_path / "w").exists()


def test_a_resume_under_another_model_basename_names_the_checkpoints_there(trained, tmp_path,
                                                                           train_here):
    """train.py --model_basename foo_ in a folder of tmodel_*.pt said "holds a run's files
    (results.json) but no checkpoint to resume from ... move them away", or, without a
    results.json there, trained a new run beside the other's."""
    home, _ = trained
    shutil.copytree(home / "weights", tmp_path / "w", ignore=shutil.ignore_patterns("prepared"))
    code, _, err = train_here("--data_dir", home / "corpus", *TINY, "--model_folder", "w",
                              "--model_basename", "foo_")
    assert code == 2 and err == "train.py: error: w holds another run's checkpoints (no file " \
        "there is named foo_*.pt; its checkpoints are named tmodel_*.pt: give --model_basename " \
        "tmodel_); a new run goes into another --model_folder\n", err
    assert not list((tmp_path / "w").glob("foo_*"))  # (it trained beside them, when the folder
    # held no results.json, and would have written its card and results over theirs)


def test_a_flag_typo_names_the_nearest_flag(tmp_path, train_here):
    """`train.py --data-dir` said only "unrecognized arguments"."""
    code, _, err = train_here("--data-dir", "data/multi30k")
    assert code == 2 and err == ("train.py: error: unrecognized argument --data-dir: did you "
                                 "mean --data_dir? (see --help)\n")


def test_the_start_line_says_which_precision_auto_chose_and_why(tmp_path, train_here,
                                                              monkeypatch):
    """The start line said `device cpu, torch.bfloat16 autocast` while each bf16 step took 15
    times fp32's (an AVX2 CPU): now auto picks by the CPU (injected) and says so; bf16 asked
    for where it is slower prints the probe's ratio and trains on."""
    from nmt import runtime
    make_corpus(tmp_path / "c", n=40, val=2)
    flags = ["--data_dir", "c", *TINY, "--max_steps", "1", "--val_examples", "0"]
    monkeypatch.setattr(runtime, "cpu_features", lambda: frozenset({"avx2", "avx512",
                                                                    "avx512_bf16"}))
    code, out, err = train_here(*flags, "--model_folder", "w1", "--experiment_name", "r1")
    assert code == 0, err
    assert ("device cpu, torch.bfloat16 autocast (--precision auto: this CPU computes bf16 "
            "itself, AVX512-BF16)\n") in out
    monkeypatch.setattr(runtime, "cpu_features", lambda: frozenset({"avx2"}))
    code, out, err = train_here(*flags, "--model_folder", "w2", "--experiment_name", "r2")
    assert code == 0, err
    assert ("device cpu, fp32 (--precision auto: this CPU, AVX2, has no bf16 instructions, "
            "where bf16 trains many times slower)\n") in out
    monkeypatch.setattr(runtime, "bf16_slowdown", lambda config: 15.2)
    code, out, err = train_here(*flags, "--model_folder", "w3", "--experiment_name", "r3",
                                "--precision", "bf16")
    assert code == 0 and "device cpu, torch.bfloat16 autocast\n" in out, err
    assert ("warning: --precision bf16 on a CPU without bf16 instructions (AVX2): a bf16 matrix "
            "product at this model's shapes took 15.2x fp32's time; training goes on in bf16, "
            "that much slower (--precision auto: fp32 here)\n") in err


def test_a_stop_while_scoring_the_test_sets_says_what_scores_them(tmp_path, train_here,
                                                                   monkeypatch):
    """A signal during the test sets' scoring: no card, exit 143, and a line whose advice
    works (it named translate.py without the model's folder, which failed pasted); the same
    command started again scores them."""
    import nmt.evaluation
    from nmt.stopping import StopRequested
    make_corpus(tmp_path / "c", n=40, val=4)
    write_aligned(tmp_path / "c", "test", number_pairs(4, seed=9))
    real = nmt.evaluation.shared_out

    def stopped(run, progress, n, desc, *args):  # (validation's decoding goes on)
        if not desc.startswith("test, "):
            return real(run, progress, n, desc, *args)
        progress.signal = "SIGTERM"
        raise StopRequested()
    monkeypatch.setattr(nmt.evaluation, "shared_out", stopped)
    flags = ["--data_dir", "c", *TINY, "--num_epochs", "1", "--val_examples", "0"]
    code, out, err = train_here(*flags)
    assert code == 143 and not (tmp_path / "weights" / "MODEL_CARD.md").exists(), out + err
    assert "test scoring stopped by SIGTERM: no results.json written; the same train.py " \
        "command started again scores the test sets, training nothing" in out, out
    monkeypatch.setattr(nmt.evaluation, "shared_out", real)
    code, out, err = train_here(*flags)
    assert code == 0 and (tmp_path / "weights" / "results.json").exists(), out + err


def test_patience_running_out_in_a_resumes_first_validation_is_no_signal(tmp_path, train_here,
                                                                         monkeypatch):
    """The validation a resume does first (one a stop cut short) can end the run by
    --patience: the run then ends as patience ends it, with no line of a signal."""
    make_corpus(tmp_path / "c", n=40, val=4)
    flags = ["--data_dir", "c", *TINY, "--val_examples", "0", "--num_epochs", "3"]
    real = train.validate

    def stopped(run, progress):  # epoch 0's end validated; epoch 1's cut short
        if progress.epoch == 0:
            return real(run, progress)
        progress.signal = "SIGINT"
        return train.Stop.SIGNAL
    monkeypatch.setattr(train, "validate", stopped)
    code, _, err = train_here(*flags)
    assert code == 130, err
    monkeypatch.setattr(train, "validate", lambda run, progress: train.Stop.PATIENCE)
    code, out, err = train_here(*flags)
    assert code == 0 and "stopped by" not in out and "resumed from weights/tmodel_01.pt" in out


def test_a_kill_between_the_best_checkpoint_and_the_history_leaves_no_best_without_its_file(
        tmp_path, train_here, monkeypatch):
    """A validation saves its best checkpoint before the history that names it: a process
    killed between the two left a history whose best had no file (the history went first);
    now the step is missing from the history, and the resume validates it again."""
    make_corpus(tmp_path / "c", n=40, val=4)
    flags = ["--data_dir", "c", *TINY, "--val_examples", "0", "--num_epochs", "1"]

    def killed(*args):
        raise SystemExit(137)
    monkeypatch.setattr(train, "write_history", killed)
    code, _, _ = train_here(*flags)
    assert code == 137 and (tmp_path / "weights" / "tmodel_best.pt").exists()
    monkeypatch.undo()
    code, out, err = train_here(*flags)
    assert code == 0 and "its last validation and the test sets" in out, err
    best = load_checkpoint(tmp_path / "weights" / "tmodel_best.pt")
    assert [h["step"] for h in history(tmp_path / "weights")] == [best["global_step"]]


def test_a_lengthened_run_cut_short_at_its_new_end_finishes_it_and_an_ended_one_trains_nothing(
        tmp_path, train_here, monkeypatch):
    """A finished run lengthened (--num_epochs 3), then stopped in its last validation: the
    card of its earlier end made the next start say there was nothing to do, the last epoch
    never validated nor the card rewritten. A run at its end (--max_steps reached) whose end
    was not done validates or scores, and trains no step past it."""
    make_corpus(tmp_path / "c", n=40, val=4)
    write_aligned(tmp_path / "c", "test", number_pairs(4, seed=9))
    flags = ["--data_dir", "c", *TINY, "--val_examples", "0"]
    code, out, err = train_here(*flags, "--num_epochs", "2")
    assert code == 0 and "optimizer steps in 2 epoch(s)" in (
        tmp_path / "weights" / "MODEL_CARD.md").read_text(), err
    real = train.validate

    def cut_short(run, progress):
        if progress.epoch < 2:
            return real(run, progress)
        progress.signal = "SIGINT"
        return train.Stop.SIGNAL
    monkeypatch.setattr(train, "validate", cut_short)
    code, out, err = train_here(*flags, "--num_epochs", "3")
    assert code == 130 and "while validating epoch 2" in out, err
    monkeypatch.setattr(train, "validate", real)
    code, out, err = train_here(*flags, "--num_epochs", "3")
    assert code == 0 and "its last validation and the test sets are not scored yet" in out, err
    assert [h["epoch"] for h in history(tmp_path / "weights")] == [0, 1, 2]
    card = (tmp_path / "weights" / "MODEL_CARD.md").read_text()
    assert "optimizer steps in 3 epoch(s)" in card
    step = history(tmp_path / "weights")[-1]["step"]
    (tmp_path / "weights" / "MODEL_CARD.md").unlink()  # its end cut short in the scoring
    code, out, err = train_here(*flags, "--num_epochs", "3", "--preload", "02")
    assert code == 2 and err.strip().endswith(
        "(nothing was moved); the same command without --preload finishes the run there (its "
        "test scores and model card)"), err
    code, out, err = train_here(*flags, "--num_epochs", "5", "--max_steps", str(step))
    assert code == 0 and f"already at step {step} of --max_steps {step}" in out, err
    assert f"- {step} optimizer steps in 3 epoch(s)" in \
        (tmp_path / "weights" / "MODEL_CARD.md").read_text()
    assert max(load_checkpoint(p)["global_step"]
               for p in (tmp_path / "weights").glob("tmodel_0*.pt")) == step


def test_a_run_stopped_while_scoring_its_test_sets_scores_them_when_started_again(trained,
                                                                                  tmp_path):
    """A run whose epochs are all trained but whose end (the test sets' scores, the model
    card) was cut short scores them when the same command starts again, training nothing;
    once the card is there, a start says there is nothing to do."""
    import shutil
    home, _ = trained
    shutil.copytree(home / "corpus", tmp_path / "corpus")
    shutil.copytree(home / "weights", tmp_path / "weights")
    (tmp_path / "weights/MODEL_CARD.md").unlink()  # (the tiny corpus has no test set)
    before = sorted(p.name for p in (tmp_path / "weights").glob("tmodel_*.pt"))
    again = run_here("train.py", "--data_dir", "corpus", *TINY, "--num_epochs", "2",
                     cwd=tmp_path)
    assert again.returncode == 0, again.stderr.decode()[-2000:]
    assert "all 2 epochs are trained (step" in again.stdout.decode()
    assert "raise --num_epochs to train on; the test sets are not scored yet (the run stopped at " \
        "its end): scoring them" in again.stdout.decode()
    assert (tmp_path / "weights/MODEL_CARD.md").exists()
    assert sorted(p.name for p in (tmp_path / "weights").glob("tmodel_*.pt")) == before
    idle = run_here("train.py", "--data_dir", "corpus", *TINY, "--num_epochs", "2",
                    cwd=tmp_path)
    assert idle.returncode == 0 and "scoring them" not in idle.stdout.decode()
    assert "all 2 epochs are trained" in idle.stdout.decode()
