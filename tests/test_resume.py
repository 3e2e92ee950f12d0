"""Resuming: what a resume takes from a checkpoint and what it must match, the random state,
the validation history."""

import argparse
import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import number_pairs, tiny_state, write_aligned

from config import Config, config_from_args
from corpus import load_corpus
from nmt.checkpoint import (CheckpointError, best_checkpoint_path, history_path, load_checkpoint,
                            save_checkpoint)
from nmt.files import FolderError
from nmt.resume import (check_split, read_history, resume_state, rng_states, set_rng_states,
                        write_history)


def test_the_cuda_random_state_is_saved_and_restored(monkeypatch):
    """4. On CUDA the device's own generator (dropout) is part of the saved state."""
    saved = torch.tensor([7, 8, 9], dtype=torch.uint8)
    restored = []
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda device=None: saved)
    monkeypatch.setattr(torch.cuda, "set_rng_state",
                        lambda state, device=None: restored.append(state))
    states = rng_states(torch.device("cuda"))
    assert torch.equal(states["cuda_rng_state"], saved) and "rng_state" in states
    set_rng_states(states, torch.device("cuda"))
    assert restored and torch.equal(restored[0], saved)
    assert "cuda_rng_state" not in rng_states(torch.device("cpu"))


def test_resume_never_takes_where_the_run_works_from_the_checkpoint(tmp_path):
    """5. A run saved on cuda:3, with workers and its own log folder, resumes here."""
    saved = Config(model_folder=str(tmp_path), device="cuda:3", num_workers=8,
                   experiment_name="runs/elsewhere", lr=5e-4)
    state = {**tiny_state(0), "config": saved.to_dict(), "optimizer_state_dict": {}}
    save_checkpoint(state, tmp_path / "tmodel_00.pt")
    (_, _), config = resume_state(Config(model_folder=str(tmp_path)), set())
    assert (config.device, config.num_workers, config.experiment_name) == ("auto", 0,
                                                                           "runs/tmodel")
    assert config.lr == 5e-4  # a training setting still comes from the checkpoint


def test_a_resume_that_changes_the_extra_pairs_names_the_flag(tmp_path):
    """Adding --extra_data_dir on resume, or another --extra_tag or --upsample, was refused as
    "another version of the corpus (the text of its files changed since)", though no file had
    changed: the flag is named. The extra pairs' folder given at a new place is the
    fingerprint's to check, not refused here."""
    plain = Config(model_folder=str(tmp_path / "p"), data_dir=str(tmp_path))
    tagged = Config(model_folder=str(tmp_path / "t"), data_dir=str(tmp_path), extra_data_dir="bt",
                    extra_tag="<BT>", upsample=2)
    for saved in (plain, tagged):
        Path(saved.model_folder).mkdir()
        save_checkpoint({**tiny_state(0), "config": saved.to_dict(), "optimizer_state_dict": {}},
                        Path(saved.model_folder) / "tmodel_00.pt")
    for saved, flag, value, said in ((plain, "extra_data_dir", "bt", "none"),
                                     (tagged, "extra_tag", "<XX>", "<BT>"),
                                     (tagged, "upsample", "3", "2"),
                                     (plain, "max_len_ratio", "1.5", "0")):
        config, given = config_from_args(argparse.Namespace(**{
            "model_folder": saved.model_folder, flag: type(getattr(saved, flag))(value)}))
        with pytest.raises(CheckpointError, match=f"was trained with --{flag} {said} \\(a run's "
                                                  f"training pairs are fixed when it starts\\): "
                                                  f"resume without --{flag}"):
            resume_state(config, given)
    config, given = config_from_args(argparse.Namespace(model_folder=tagged.model_folder,
                                                        extra_data_dir="moved/bt"))
    assert resume_state(config, given)[1].extra_data_dir == "moved/bt"


def test_num_epochs_typed_on_resuming_a_time_budget_run_is_refused(tmp_path):
    """The run's own settings are checked, not the command line's alone: --num_epochs typed to
    resume a --time_budget run would do nothing (the budget sets the length)."""
    from config import UserError, parse_config
    from nmt.resume import settings_to_check
    saved = Config(model_folder=str(tmp_path), time_budget=60.0)
    save_checkpoint({**tiny_state(0), "config": saved.to_dict(), "optimizer_state_dict": {}},
                    tmp_path / "tmodel_00.pt")
    with pytest.raises(UserError, match="--num_epochs with --time_budget"):
        parse_config(["--model_folder", str(tmp_path), "--num_epochs", "30"],
                     settings=settings_to_check)
    assert parse_config(["--model_folder", str(tmp_path)], settings=settings_to_check)


def test_resuming_with_another_seed_cannot_redraw_a_held_out_validation_split(tmp_path):
    """6. Without a validation split, --seed and --val_fraction choose the validation pairs."""
    write_aligned(tmp_path / "c", "train", number_pairs(50, seed=1))
    config = Config(data_dir=str(tmp_path / "c"), model_folder=str(tmp_path / "w"))
    assert load_corpus(config)["held_out"] is True
    state = {"config": config.to_dict()}
    for change in ({"seed": 7}, {"val_fraction": 0.2}):
        other = Config(**{**config.to_dict(), **change})
        with pytest.raises(CheckpointError, match=f"--{next(iter(change))} "):
            check_split(state, "tmodel_00.pt", other, held_out=True)
        check_split(state, "tmodel_00.pt", other, held_out=False)  # its own split: harmless
    check_split(state, "tmodel_00.pt", config, held_out=True)


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
    # Issue 24: with the numbered checkpoints deleted, --preload latest started afresh and
    # overwrote the best checkpoint and the history: refused too
    latest = Config(model_folder=str(tmp_path))
    with pytest.raises(CheckpointError, match=f"holds a run's files \\({path.name}\\) but no "
                                              f"checkpoint to resume from"):
        resume_state(latest, set())
    assert resume_state(Config(model_folder=str(tmp_path / "new")), set())[0] is None


def test_a_mid_epoch_checkpoint_refuses_another_number_of_processes(tmp_path):
    """2. A mid-epoch checkpoint resumed with another number of torchrun processes repeated or
    skipped pairs: the world size was neither saved nor checked."""
    config = Config(model_folder=str(tmp_path))
    save_checkpoint(tiny_state(next_epoch=0, next_batch=3, world_size=2, optimizer_state_dict={}),
                    tmp_path / "tmodel_00_s0000010.pt")
    for world in (1, 4):
        with pytest.raises(CheckpointError, match="saved mid-epoch by 2 process\\(es\\) and "
                                                  f"this run has {world}"):
            resume_state(config, set(), world_size=world)
    resume_state(config, set(), world_size=2)
    save_checkpoint(tiny_state(next_epoch=1, next_batch=0, world_size=2, optimizer_state_dict={}),
                    tmp_path / "tmodel_00.pt")
    resume_state(config, set(), world_size=1)  # between epochs: any number


def test_a_damaged_history_or_a_full_disk_is_one_line_and_loses_nothing(tmp_path, monkeypatch):
    """Issue 24, the rest of its kind: the validation history was read and written without a
    guard (a traceback on a damaged file or a full disk)."""
    config = Config(model_folder=str(tmp_path))
    write_history(config, [{"step": 1, "bleu": 2.0, "loss": 3.0}])
    before = history_path(config).read_text()

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(type(tmp_path), "write_text", disk_full)
    with pytest.raises(FolderError, match="could not write .*tmodel_validation.json: No "
                                              "space left on device; the files already saved"):
        write_history(config, [])
    monkeypatch.undo()
    assert history_path(config).read_text() == before and not list(tmp_path.glob(".*tmp"))
    history_path(config).write_text('[{"step": 1, "bl')
    with pytest.raises(CheckpointError, match="tmodel_validation.json is unreadable "
                                              r"\(JSONDecodeError\); it is the validation"):
        read_history(config)


def test_a_checkpoint_without_its_optimizer_state_is_not_resumed(tmp_path):
    """Issue 45: per-epoch checkpoints older than the newest --keep_optimizer hold the weights
    only; resuming one would start Adam afresh, not continue the run: one line."""
    save_checkpoint(tiny_state(0), tmp_path / "tmodel_00.pt")
    with pytest.raises(CheckpointError, match=r"tmodel_00.pt holds the weights only: .* resume "
                                              r"from one that keeps it \(the newest a run saved, "
                                              r"or --preload N of a newer epoch\)"):
        resume_state(Config(model_folder=str(tmp_path), preload="00"), {"preload"})


def test_another_corpus_is_refused_but_a_fingerprint_by_times_is_not_checked(tmp_path, capsys):
    """A checkpoint resumed on a corpus whose text changed: one line. One of an earlier version
    recorded its folder by the files' times, which no longer says anything: it resumes with a
    note rather than being refused for a copy of the same corpus."""
    from nmt.resume import check_corpus
    source = str(tmp_path / "corpus")
    now = {"source": source, "fingerprint": "new", "version": 2}
    check_corpus({"corpus": dict(now)}, tmp_path / "t.pt", now)  # the same: nothing said
    with pytest.raises(CheckpointError, match="t.pt was trained on another version of the "
                                              "corpus .*corpus \\(the text of its files"):
        check_corpus({"corpus": {**now, "fingerprint": "old"}}, tmp_path / "t.pt", now)
    with pytest.raises(CheckpointError, match="corpus .*/a, not .*corpus"):
        check_corpus({"corpus": {**now, "source": str(tmp_path / "a"), "fingerprint": "a"}},
                     tmp_path / "t.pt", now)
    assert capsys.readouterr().err == ""
    check_corpus({"corpus": {"source": source, "fingerprint": "by times"}}, tmp_path / "t.pt", now)
    assert "by the files' times (an earlier version): not checked" in capsys.readouterr().err
    with pytest.raises(CheckpointError):  # a hub dataset's fingerprint did not change its kind
        check_corpus({"corpus": {"source": "org/set", "fingerprint": "old"}}, tmp_path / "t.pt",
                     {**now, "source": "org/set"})


@pytest.mark.parametrize("name, value", [("seed", 7), ("batch_size", 16), ("accum_steps", 2),
                                         ("max_tokens", 1000)])
def test_a_mid_epoch_checkpoint_refuses_another_batch_order(tmp_path, name, value):
    """Issue 56 (an untested promise): the rest of an epoch needs its batch order, which
    --seed, --batch_size, --accum_steps and --max_tokens fix: a mid-epoch checkpoint resumed
    with another value of any is refused in one line; a per-epoch one takes it."""
    config = Config(model_folder=str(tmp_path))
    save_checkpoint(tiny_state(0, step=13, optimizer_state_dict={}),
                    tmp_path / "tmodel_00_s0000013.pt")
    changed = dataclasses.replace(config, **{name: value})
    with pytest.raises(CheckpointError, match=f"saved mid-epoch with --{name} "):
        resume_state(changed, {name})
    resume_state(config, set())  # the same values: resumed
    save_checkpoint(tiny_state(1, optimizer_state_dict={}), tmp_path / "tmodel_01.pt")
    resume_state(changed, {name})  # between epochs: any batch order


@pytest.mark.parametrize("saved", [5, 0])
@pytest.mark.parametrize("change", [{"fixed_shapes": 3}, {"compile": True},
                                    {"compile": True, "fixed_shapes": 5}])
def test_a_mid_epoch_checkpoint_refuses_other_fixed_shapes(tmp_path, change, saved):
    """Issue 70, 1: fixed shapes cut an epoch into other batches (1,500 pairs: 287 plain, 298
    fixed), yet a mid-epoch resume with --fixed_shapes or --compile changed went on, training
    some pairs twice and others never: refused in one line; the same shapes (--compile beside
    the --fixed_shapes saved) and a per-epoch checkpoint take it. Saved without fixed shapes
    (--fixed_shapes 0), --compile (16 lengths) is refused too. The line names the values that
    resume it."""
    config = Config(model_folder=str(tmp_path), fixed_shapes=saved)
    save_checkpoint(tiny_state(0, step=13, optimizer_state_dict={}, config=config.to_dict()),
                    tmp_path / "tmodel_00_s0000013.pt")
    changed = dataclasses.replace(config, **{"fixed_shapes": 0, **change})
    given = set(change) | {"fixed_shapes"}
    if changed.shape_count() == config.shape_count():
        resume_state(changed, given)
        return
    words = "5 fixed batch lengths" if saved else "no fixed batch shapes"
    with pytest.raises(CheckpointError, match=f"saved mid-epoch with {words} and this run would "
                                              f"have .*resume it with --fixed_shapes {saved} "
                                              f"--compile false, or from"):
        resume_state(changed, given)
    save_checkpoint(tiny_state(1, optimizer_state_dict={}, config=config.to_dict()),
                    tmp_path / "tmodel_01.pt")
    resume_state(changed, given)  # between epochs: any shapes


def test_the_out_of_memory_advice_names_a_resume_that_is_taken(tmp_path):
    """Issue 70, 3: the out-of-memory line said "lower --max_tokens, raise --accum_steps,
    resume", which a mid-epoch newest checkpoint (Ctrl-C, --save_every) refuses. The advice
    follows the folder: resume where the newest checkpoint is per-epoch; else the newest
    per-epoch one by number (taken with the smaller batches); else another folder."""
    from nmt.resume import after_smaller_batches
    config = Config(model_folder=str(tmp_path), max_tokens=4000)
    smaller = dataclasses.replace(config, max_tokens=2000, accum_steps=2)
    assert after_smaller_batches(config) == (  # nothing saved: nothing to resume
        f"run the same command again with them (nothing was saved in {tmp_path} yet)")
    # a validation's files but no checkpoint (--eval_every, --init_from's first validation):
    # the same command in the same folder would be refused as overwriting them
    history_path(config).write_text("[]")
    assert after_smaller_batches(config).endswith(
        "tmodel_validation.json a fresh start would overwrite: run the same command again with "
        "them and another --model_folder")
    with pytest.raises(CheckpointError, match="a fresh start would overwrite them"):
        resume_state(config, set())
    history_path(config).unlink()
    save_checkpoint(tiny_state(0, step=13, optimizer_state_dict={}, config=config.to_dict()),
                    tmp_path / "tmodel_00_s0000013.pt")
    assert "start again with them in another --model_folder" in after_smaller_batches(config)
    with pytest.raises(CheckpointError, match="saved mid-epoch with --max_tokens"):
        resume_state(smaller, {"max_tokens", "accum_steps"})
    save_checkpoint(tiny_state(0, optimizer_state_dict={}, config=config.to_dict()),
                    tmp_path / "tmodel_00.pt")
    assert after_smaller_batches(config).endswith("intact, resume from them")
    resume_state(smaller, {"max_tokens", "accum_steps"})  # the advice taken
    save_checkpoint(tiny_state(1, step=25, optimizer_state_dict={}, config=config.to_dict()),
                    tmp_path / "tmodel_01_s0000025.pt")
    advice = after_smaller_batches(config)
    assert advice.endswith("from the last per-epoch checkpoint with --preload 0 and the smaller "
                           "batches (the steps after it are trained again)"), advice
    (path, _), _ = resume_state(dataclasses.replace(smaller, preload="0"),
                                {"max_tokens", "accum_steps", "preload"})  # the advice taken
    assert path.name == "tmodel_00.pt"
    for name in ("tmodel_01_s0000025.pt",):  # epochs 0 and 1 saved, then epoch 2 mid-way
        (tmp_path / name).unlink()
    save_checkpoint(tiny_state(1, optimizer_state_dict={}, config=config.to_dict()),
                    tmp_path / "tmodel_01.pt")
    save_checkpoint(tiny_state(2, step=37, optimizer_state_dict={}, config=config.to_dict()),
                    tmp_path / "tmodel_02_s0000037.pt")
    assert "with --preload 1 and the smaller batches" in after_smaller_batches(config)
    (path, _), _ = resume_state(dataclasses.replace(smaller, preload="1"),
                                {"max_tokens", "accum_steps", "preload"})
    assert path.name == "tmodel_01.pt"


def test_a_finished_runs_line_names_the_limit_to_raise():
    """A run whose epochs are all trained and whose patience has also run out: raising
    --patience alone would not train on, so the epochs are named; before its last epoch, the
    patience; within it, nothing stops the run."""
    import types

    from nmt.resume import nothing_to_do
    history = [{"step": s, "bleu": b, "loss": 1.0} for s, b in ((1, 5.0), (2, 4.0), (3, 4.0))]
    progress = types.SimpleNamespace(step=3, epoch=3, history=history, complete=False)
    assert nothing_to_do(Config(patience=2, num_epochs=3), progress).startswith(
        "all 3 epochs are trained (step 3); raise --num_epochs")
    assert nothing_to_do(Config(patience=2, num_epochs=5), progress) == (
        "no better validation in the last 2 validations (--patience 2): training ends here; "
        "raise --patience to train on")
    assert nothing_to_do(Config(patience=3, num_epochs=5), progress) is None


def test_a_checkpoint_whose_validation_a_stop_cut_short_is_validated_on_resume():
    """A checkpoint is saved before the validation that follows it (an epoch's end, every
    --eval_every steps, the run's end): one with no validation at its step in the history
    is validated first on resume; one mid-epoch between validations, or already validated,
    is not."""
    from nmt.resume import Progress, validation_cut_short
    done = [{"step": 10, "bleu": 1.0, "loss": 1.0}]

    def cut_short(step, batch, history=(), epoch=1, **flags):
        progress = Progress(step=step, epoch=epoch, batch=batch, history=list(history))
        return validation_cut_short(Config(num_epochs=3, **flags), progress)
    assert cut_short(20, 0)  # an epoch's checkpoint, its validation missing
    assert not cut_short(20, 0, done + [{"step": 20, "bleu": 2.0, "loss": 1.0}])
    assert not cut_short(0, 0, epoch=0)  # a fresh start
    assert not cut_short(13, 3, done)  # mid-epoch, no validation due at step 13
    assert cut_short(15, 5, done, eval_every=5)  # an --eval_every validation cut short
    assert not cut_short(14, 4, done, eval_every=5)
    assert cut_short(13, 3, done, max_steps=13)  # the run's end, mid-epoch
    assert cut_short(13, 3, done, epoch=3)  # (all epochs trained)
    # the epoch a validation is recorded under: at an epoch's start, the one just ended
    assert [Progress(step=s, epoch=e, batch=b).validated_epoch()
            for s, e, b in ((20, 2, 0), (15, 1, 5), (0, 0, 0))] == [1, 1, 0]


def test_training_on_from_an_earlier_epoch_puts_that_lines_best_checkpoint_back(tmp_path,
                                                                                 capsys):
    """--preload 02 where epoch 03 was the best: its best checkpoint is set aside with it, and
    the best of the validations kept gets its best checkpoint back from its own checkpoint
    (without one, a new line that never beat it ended with no best checkpoint, its test sets
    unscored); never from another step's. The history file keeps the new line's validations
    only (a step validated in the abandoned line was not validated again when cut short). The
    abandoned line's card and results go aside too, also with no later checkpoint (a stale
    card made a later start skip the scoring)."""
    from nmt.resume import set_aside_later
    config = Config(model_folder=str(tmp_path), preload="02")
    best_keys = {"format", "model_state_dict", "config", "epoch", "global_step", "corpus",
                 "tokenizers", "coverage", "validation"}  # (train.py's best checkpoint)

    def line(bleus, kept=range(4), old=False):  # 4 epochs, their validations and the best
        for p in tmp_path.iterdir():
            shutil.rmtree(p) if p.is_dir() else p.unlink()
        history = [{"step": 10 * (e + 1), "epoch": e, "bleu": b, "loss": 1.0}
                   for e, b in enumerate(bleus)]
        write_history(config, history)
        made = {} if old else {"corpus": {"source": "c"}, "tokenizers": {}, "coverage": {}}
        states = [tiny_state(e, **made) for e in range(4)]
        for e in kept:
            save_checkpoint(states[e], tmp_path / f"tmodel_{e:02d}.pt")
        top = max(range(4), key=lambda e: bleus[e])
        save_checkpoint({**states[top], "validation": history[top]}, best_checkpoint_path(config))
        return history, states

    def moved():
        return sorted(p.name for p in next(tmp_path.glob("superseded_*")).iterdir())
    history, states = line((4.0, 6.0, 5.0, 7.0))  # the kept best: epoch 01, before --preload's
    for name in ("results.json", "MODEL_CARD.md", "validation_curve.png"):
        (tmp_path / name).write_text("the abandoned line's")
    set_aside_later(config, tmp_path / "tmodel_02.pt")
    assert moved() == sorted(["MODEL_CARD.md", "results.json", "tmodel_03.pt", "tmodel_best.pt",
                              "tmodel_validation.json", "validation_curve.png"])
    assert read_history(config) == history[:3]  # (the whole copied aside)
    best = load_checkpoint(best_checkpoint_path(config))
    assert best["validation"] == history[1] and set(best) == best_keys
    assert all(torch.equal(best["model_state_dict"][k], v)
               for k, v in states[1]["model_state_dict"].items())
    out = capsys.readouterr().out
    assert "moved tmodel_03.pt, tmodel_best.pt, results.json, MODEL_CARD.md, validation_curve" \
        ".png to " in out and "the best validation up to it (BLEU 6.00, step 20): " in out
    # the kept best is --preload's own checkpoint; checkpoints of earlier versions lack keys
    line((4.0, 5.0, 6.0, 7.0), old=True)
    set_aside_later(config, tmp_path / "tmodel_02.pt")
    assert load_checkpoint(best_checkpoint_path(config))["global_step"] == 30
    # its checkpoint pruned (--keep_epochs): said, and an older one is not taken for it
    line((4.0, 6.0, 5.0, 7.0), kept=(0, 2, 3))
    set_aside_later(config, tmp_path / "tmodel_02.pt")
    assert not best_checkpoint_path(config).exists()
    assert "(BLEU 6.00, step 20) has no checkpoint left: a best checkpoint is saved when a " \
        "validation beats it" in capsys.readouterr().out
    # no history: nothing to restore; no later checkpoint, but the card and results go aside
    line((4.0, 6.0, 5.0, 7.0))
    history_path(config).unlink()
    set_aside_later(config, tmp_path / "tmodel_02.pt")
    assert not best_checkpoint_path(config).exists()
    line((4.0, 6.0, 7.0, 5.0), kept=range(3))
    (tmp_path / "MODEL_CARD.md").write_text("the abandoned line's")
    set_aside_later(config, tmp_path / "tmodel_02.pt")
    assert moved() == ["MODEL_CARD.md", "tmodel_validation.json"]
    assert best_checkpoint_path(config).exists()  # (its best is the kept line's)
    # nothing later but validations (a crash after an --eval_every one): the history is cut
    history, _ = line((4.0, 6.0, 7.0, 5.0), kept=range(3))
    set_aside_later(config, tmp_path / "tmodel_02.pt")
    assert moved() == ["tmodel_validation.json"] and read_history(config) == history[:3]
    # a checkpoint the restore reads is damaged: refused before anything moves; mended, the
    # same start sets the files aside and restores the best
    line((6.0, 4.0, 5.0, 7.0))
    intact = (tmp_path / "tmodel_00.pt").read_bytes()
    (tmp_path / "tmodel_00.pt").write_bytes(intact[:100])
    with pytest.raises(CheckpointError, match="tmodel_00.pt"):
        set_aside_later(config, tmp_path / "tmodel_02.pt")
    assert not list(tmp_path.glob("superseded_*")) and (tmp_path / "tmodel_03.pt").exists()
    (tmp_path / "tmodel_00.pt").write_bytes(intact)
    set_aside_later(config, tmp_path / "tmodel_02.pt")
    assert load_checkpoint(best_checkpoint_path(config))["global_step"] == 10
    # a start stopped after the moves, before the restore: the same start restores it
    best_checkpoint_path(config).unlink()
    set_aside_later(config, tmp_path / "tmodel_02.pt")
    assert load_checkpoint(best_checkpoint_path(config))["global_step"] == 10


def test_training_on_from_an_epoch_with_nothing_left_to_train_is_refused(tmp_path):
    """--preload NN where nothing is left to train from it (every epoch, its patience, its
    --time_budget's schedule): refused, nothing moved (the later files were set aside, and the
    run then said it had nothing to do)."""
    def run(folder, **settings):  # 3 epochs of 10 steps, validated
        config = Config(model_folder=str(folder), num_epochs=3, **settings)
        for e in range(3):
            save_checkpoint(tiny_state(e, config=config.to_dict(), optimizer_state_dict={},
                                       schedule_steps=30), folder / f"tmodel_{e:02d}.pt")
        write_history(config, [{"step": 10 * (e + 1), "epoch": e, "bleu": b, "loss": 1.0}
                               for e, b in enumerate((5.0, 4.0, 3.0))])
        return config

    def refused(config, **flags):
        with pytest.raises(CheckpointError) as e:
            resume_state(dataclasses.replace(config, **flags), {"preload", *flags})
        assert not list(Path(config.model_folder).glob("superseded_*"))
        return str(e.value)
    config = run(tmp_path)
    finish = "; the same command without --preload finishes the run there (its test scores " \
        "and model card)"
    assert refused(config, preload="02") == (  # the newest, its end not done (no model card)
        "--preload 02: all 3 epochs are trained (step 30); raise --num_epochs to train on from "
        "it (nothing was moved)" + finish)
    card = tmp_path / "MODEL_CARD.md"
    card.write_text("- 20 optimizer steps in 2 epoch(s), 1.0 minutes\n")  # an earlier end's
    assert refused(config, preload="02").endswith(finish)
    from nmt.files import FolderLock
    lock = FolderLock(tmp_path).acquire()  # a run there now, its end under way: no advice
    try:
        assert refused(config, preload="02").endswith("(nothing was moved)")
    finally:
        lock.release()
    card.write_text("- 30 optimizer steps in 3 epoch(s), 1.0 minutes\n")
    assert refused(config, preload="02") == (  # its end done
        "--preload 02: all 3 epochs are trained (step 30); raise --num_epochs to train on from "
        "it (nothing was moved)")
    patience = refused(config, preload="01", patience=1)  # (not the newest: no advice)
    assert patience.startswith(
        "--preload 01: no better validation in the last 1 validations (--patience 1)")
    assert patience.endswith("(nothing was moved)")
    (tmp_path / "b").mkdir()
    assert refused(run(tmp_path / "b", time_budget=5.0), preload="02").startswith(
        "--preload 02: the --time_budget 5 minutes' schedule is complete (step 30)")
    (path, _), _ = resume_state(dataclasses.replace(config, preload="01"), {"preload"})
    assert path.name == "tmodel_01.pt" and not list(tmp_path.glob("superseded_*"))


def test_each_rank_resumes_its_own_random_state_or_a_fresh_one_of_its_own():
    """The saved dropout streams go on where the number of processes is the one saved (one
    process: the checkpoint's own state); with another number (between epochs), every rank
    draws a fresh stream of its own, from the seed, its rank and the step: never a saved
    rank's, never the same as another rank's."""
    from nmt.resume import restore_rng
    cpu = torch.device("cpu")
    with torch.random.fork_rng():
        saved = []
        for rank in range(2):
            torch.manual_seed(100 + rank)
            saved.append({"rng_state": torch.get_rng_state()})
        state = {**saved[0], "rank_rng_states": saved, "global_step": 7}

        def drawn(state, rank, world_size, seed=None):
            if seed is None:
                restore_rng(state, rank, world_size, cpu, seed=1)
            else:
                torch.manual_seed(seed)
            return torch.rand(4)
        assert torch.equal(drawn(state, 1, 2), drawn(None, 0, 0, seed=101))
        single = {**saved[1], "rank_rng_states": None, "global_step": 7}
        assert torch.equal(drawn(single, 0, 1), drawn(None, 0, 0, seed=101))
        assert torch.equal(drawn(state, 0, 1), drawn(None, 0, 0, seed=1 + 0 + 7))  # 2 saved
        fresh = [drawn(state, rank, 4) for rank in range(4)]
        assert torch.equal(fresh[3], drawn(None, 0, 0, seed=1 + 3 + 7))
        assert len({tuple(f.tolist()) for f in fresh}) == 4


def test_two_set_asides_in_one_second_go_into_two_folders(tmp_path, monkeypatch):
    """The abandoned line's folder is named by the second: a second --preload in the same
    second gets a folder of its own (superseded_...+), not an error or a mix of two lines."""
    import nmt.resume
    from nmt.resume import set_aside_later
    monkeypatch.setattr(nmt.resume.time, "strftime", lambda form: "20260101-000000")
    config = Config(model_folder=str(tmp_path), preload="00")
    for _ in range(2):
        for e in range(2):
            save_checkpoint(tiny_state(e), tmp_path / f"tmodel_{e:02d}.pt")
        set_aside_later(config, tmp_path / "tmodel_00.pt")
    assert sorted(p.name for p in tmp_path.glob("superseded_*/*")) == ["tmodel_01.pt"] * 2
    assert {p.name for p in tmp_path.glob("superseded_*")} == {
        "superseded_20260101-000000", "superseded_20260101-000000+"}


def test_init_from_copies_its_tokenizers_and_names_only_the_files_it_created(tmp_path):
    """--init_from copies the source's tokenizers and recipes into the new folder; a failed
    start takes back what copy_tokenizers returns, so a file that was there before (the same
    tokenizer) is never in it; another tokenizer there of that name is refused."""
    from nmt.resume import copy_tokenizers
    from tokenizer import recipe_path, tokenizer_keys, tokenizer_path
    source = Config(model_folder=str(tmp_path / "src"))
    new = Config(model_folder=str(tmp_path / "new"))
    src_key, tgt_key = tokenizer_keys(new)
    for key in (src_key, tgt_key):
        tokenizer_path(source, key).parent.mkdir(exist_ok=True)
        tokenizer_path(source, key).write_text(f"tokenizer {key}")
        recipe_path(tokenizer_path(source, key)).write_text(f"recipe {key}")
    tokenizer_path(new, src_key).parent.mkdir()
    tokenizer_path(new, src_key).write_text(f"tokenizer {src_key}")  # the same: kept, not made
    created = copy_tokenizers(tmp_path / "src" / "tmodel_best.pt",
                              {"config": source.to_dict()}, new)
    assert sorted(p.name for p in created) == sorted(
        [recipe_path(tokenizer_path(new, src_key)).name, tokenizer_path(new, tgt_key).name,
         recipe_path(tokenizer_path(new, tgt_key)).name])
    assert tokenizer_path(new, tgt_key).read_text() == f"tokenizer {tgt_key}"
    tokenizer_path(new, tgt_key).write_text("another tokenizer")
    with pytest.raises(CheckpointError, match=f"{tokenizer_path(new, tgt_key).name} is another "
                                              f"tokenizer than .*: give a new --model_folder"):
        copy_tokenizers(tmp_path / "src" / "tmodel_best.pt", {"config": source.to_dict()}, new)


def test_preload_none_never_overwrites_a_runs_checkpoints(tmp_path):
    """--preload none where the run has checkpoints but no validation's files yet (none is
    written before the first validation): refused as well, naming the newest checkpoint."""
    save_checkpoint(tiny_state(0, optimizer_state_dict={}), tmp_path / "tmodel_00.pt")
    save_checkpoint(tiny_state(1, step=15, optimizer_state_dict={}),
                    tmp_path / "tmodel_01_s0000015.pt")
    with pytest.raises(CheckpointError, match=r"already holds a run \(tmodel_01_s0000015\.pt\); "
                                              r"--preload none would overwrite it"):
        resume_state(Config(model_folder=str(tmp_path), preload="none"), {"preload"})


def test_a_resume_given_its_init_from_again_keeps_the_source_as_recorded(tmp_path):
    """The fine-tuning command again (--init_from the source's folder, or a relative path)
    resumes the run; the source it started from stays as recorded (its resolved checkpoint),
    not as this command names it."""
    source = tmp_path / "src" / "tmodel_best.pt"
    saved = Config(model_folder=str(tmp_path / "ft"), init_from=str(source))
    (tmp_path / "ft").mkdir()
    save_checkpoint({**tiny_state(0), "config": saved.to_dict(), "optimizer_state_dict": {}},
                    tmp_path / "ft" / "tmodel_00.pt")
    config = Config(model_folder=str(tmp_path / "ft"), init_from=str(tmp_path / "src"))
    assert resume_state(config, {"init_from"})[1].init_from == str(source)


def test_a_resume_may_name_the_teachers_in_another_order():
    """The teachers are a set: the same ones in another order (or spelled otherwise) resume;
    another teacher is refused, naming the flag."""
    from nmt.resume import check_training_pairs
    saved = Config(distill_from="t/b,t/a")
    for again in ("t/b,t/a", "./t/a, t/b/"):
        check_training_pairs(saved, Config(distill_from=again), "tmodel_00.pt")
    with pytest.raises(CheckpointError, match=r"trained with --distill_from t/b,t/a \(a run's"):
        check_training_pairs(saved, Config(distill_from="t/a,t/c"), "tmodel_00.pt")


def test_a_resume_takes_its_position_history_and_training_time_from_the_checkpoint(tmp_path):
    """restore_progress: the batch within the epoch (mid-epoch), the validations up to the
    checkpoint's step only (a later one, recorded before a crash, is of steps trained again;
    the last, at step 10, is the step last validated: a stop at once validates no step twice),
    the commands and training time of the earlier starts (the model card's), and, apart, their
    set-up and validations (a --time_budget's)."""
    from nmt.resume import Progress, restore_progress
    config = Config(model_folder=str(tmp_path))
    write_history(config, [{"step": s, "bleu": 1.0, "loss": 1.0} for s in (10, 15)])
    state = tiny_state(1, step=13, schedule_steps=100, provenance={
        "commands": ["train.py"], "seconds": 12.5, "setup_seconds": 3.0,
        "validation_seconds": 4.0, "last_validation": [1.5, 1.0]})
    progress = Progress()
    assert restore_progress(config, progress, tmp_path / "t.pt", state, 100, None) == 100
    assert (progress.epoch, progress.batch, progress.step) == (1, 3, 13)
    assert [h["step"] for h in progress.history] == [10] and progress.validated_at == 10
    assert (progress.commands, progress.seconds_before) == (["train.py"], 12.5)
    assert (progress.setup_before, progress.validation_seconds, progress.last_validation) == \
        (3.0, 4.0, (1.5, 1.0))
    assert progress.provenance()["last_validation"] == (1.5, 1.0)


def test_a_checkpoint_keeps_every_validations_time_and_the_latests_decoding_apart():
    """Progress.validated: the validations' seconds add up (the earlier starts' for a
    --time_budget resume), the latest's are kept with its decoding's apart (the end's reserve
    scales the decoding by the test sentences, the rest once), and its step is the one last
    validated."""
    from nmt.resume import Progress
    progress = Progress()
    progress.step = 10
    progress.validated(10.0, 4.0)
    progress.step = 20
    progress.validated(6.0, 2.0)
    made = progress.provenance()
    assert (made["validation_seconds"], made["last_validation"]) == (16.0, (6.0, 2.0))
    assert progress.validated_at == 20


def test_a_resume_at_a_finished_runs_step_counts_its_end_apart_from_training(tmp_path):
    """results.json of a run that ended at the checkpoint's step: its last validation and test
    scoring came after the checkpoint (146 s of training, 172 s at the end), and the set-up of
    the start that scored (10 s): spent, but not training, so a --time_budget's first plan
    does not take them for steps' time. results.json of another step is another end's."""
    from nmt.resume import Progress, restore_progress
    config = Config(model_folder=str(tmp_path))
    state = tiny_state(1, step=46, schedule_steps=46, provenance={
        "commands": ["train.py"], "seconds": 146.0, "setup_seconds": 5.0})
    (tmp_path / "results.json").write_text(json.dumps(
        {"step": 46, "seconds": 172.0, "setup_seconds": 15.0, "tests": {}}))
    progress = Progress()
    restore_progress(config, progress, tmp_path / "t.pt", state, 46, None)
    assert (progress.seconds_before, progress.setup_before) == (146.0, 15.0 + 26.0)
    (tmp_path / "results.json").write_text(json.dumps({"step": 40, "seconds": 130.0}))
    restore_progress(config, progress := Progress(), tmp_path / "t.pt", state, 46, None)
    assert (progress.seconds_before, progress.setup_before) == (146.0, 5.0)


def test_a_resume_restores_the_gradient_scalers_scale(tmp_path):
    """fp16: the gradient scaler's scale, grown or backed off over the run, goes on as saved
    (a CPU run's scale never moves off its start: train.py's fp16 test cannot tell)."""
    from model import build_transformer
    from nmt.resume import restore_training
    state = tiny_state(0)
    model = build_transformer(20, 20, 16, 16, d_model=8, N=1, h=2, d_ff=16)
    optimizer = torch.optim.Adam(model.parameters())
    saved = torch.amp.GradScaler("cpu", init_scale=1024.0)
    saved.scale(torch.ones(1))  # (its state is made lazily)
    state.update(optimizer_state_dict=optimizer.state_dict(),
                 scaler_state_dict=saved.state_dict())
    scaler = torch.amp.GradScaler("cpu")
    restore_training(state, tmp_path / "t.pt", model, optimizer, scaler)
    assert scaler.get_scale() == 1024.0


def test_init_from_a_folder_of_two_runs_names_them(tmp_path):
    """--init_from a folder holding two runs' checkpoints (neither of --model_basename) said
    "no checkpoint in it (give a trained model's folder or file)": it names the runs and a
    file to give; the run of --model_basename, where it is one of them, is taken."""
    from nmt.resume import init_source
    (tmp_path / "src").mkdir()
    for name in ("a_00.pt", "a_01.pt", "b_00.pt", "b_best.pt"):
        save_checkpoint(tiny_state(0), tmp_path / "src" / name)
    with pytest.raises(CheckpointError) as e:
        init_source(Config(model_folder="new", init_from=str(tmp_path / "src")))
    assert str(e.value) == (f"--init_from {tmp_path / 'src'} holds the checkpoints of 2 runs "
                            f"(a_, b_): give one checkpoint file, such as "
                            f"{tmp_path / 'src' / 'a_01.pt'}")
    for basename, taken in (("a_", "a_01.pt"), ("b_", "b_best.pt")):
        assert init_source(Config(model_folder="new", init_from=str(tmp_path / "src"),
                                  model_basename=basename)) == tmp_path / "src" / taken


def test_init_from_a_folder_of_one_run_of_another_basename_takes_its_checkpoints(tmp_path):
    """--init_from a folder holding one run's checkpoints under another basename than the new
    run's --model_basename takes that run's (its best, else its newest), not "holds the
    checkpoints of 1 runs" nor "no checkpoint in it"."""
    from nmt.resume import init_source
    (tmp_path / "src").mkdir()
    for name in ("run_00.pt", "run_01.pt"):
        save_checkpoint(tiny_state(0), tmp_path / "src" / name)
    config = Config(model_folder="new", init_from=str(tmp_path / "src"))
    assert init_source(config) == tmp_path / "src" / "run_01.pt"
    save_checkpoint(tiny_state(0), tmp_path / "src" / "run_best.pt")
    assert init_source(config) == tmp_path / "src" / "run_best.pt"


def test_init_from_a_folder_starts_from_its_best_recorded_wherever_the_run_is_resumed(
        tmp_path, monkeypatch):
    """--init_from a run's folder takes its best checkpoint, not its newest, and records it
    resolved: a resume from another working folder finds the same source."""
    from nmt.resume import init_state
    (tmp_path / "src").mkdir()
    for name in ("tmodel_00.pt", "tmodel_best.pt"):
        save_checkpoint(tiny_state(0), tmp_path / "src" / name)
    monkeypatch.chdir(tmp_path)
    (path, _), config = init_state(Config(model_folder="new", init_from="src"), {"init_from"})
    assert path.name == "tmodel_best.pt"
    assert config.init_from == str((tmp_path / "src" / "tmodel_best.pt").resolve())
