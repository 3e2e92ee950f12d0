"""nmt/training_log.py, in process, with a recording writer and bar: what a skipped update says
and logs, and what each log writes (the mean loss of the window, summed over ranks, at the
step logged)."""

import types

import pytest
import torch

from config import Config, UserError
from nmt.training_log import check_updates, log_progress


class Writer:
    def __init__(self):
        self.scalars = []

    def add_scalar(self, tag, value, step):
        self.scalars.append((tag, value, step))


def fake_run(tmp_path, world_size=1):
    return types.SimpleNamespace(writer=Writer(), world_size=world_size, precision="fp32",
                                 config=Config(model_folder=str(tmp_path), max_bad_steps=3))


def test_a_skipped_update_is_logged_and_said_with_its_count_in_a_row(tmp_path, capsys):
    run = fake_run(tmp_path)
    check_updates(run, types.SimpleNamespace(bad_steps=torch.tensor(0), step=6))
    assert run.writer.scalars == [] and capsys.readouterr().out == ""  # none skipped: silent
    check_updates(run, types.SimpleNamespace(bad_steps=torch.tensor(2), step=7))
    assert run.writer.scalars == [("train/skipped_nonfinite", 2, 7)]
    assert "step 7: non-finite loss or gradient, update skipped (2 in a row)" in \
        capsys.readouterr().out
    with pytest.raises(UserError, match="^3 non-finite updates in a row"):  # the limit
        check_updates(run, types.SimpleNamespace(bad_steps=torch.tensor(3), step=8))


@pytest.mark.parametrize("world_size", [1, 2])
def test_each_log_writes_the_windows_mean_loss_over_ranks_at_its_step(tmp_path, monkeypatch,
                                                                      world_size):
    run = fake_run(tmp_path, world_size)
    # the other rank's share the same as this one's: the sum is twice it
    monkeypatch.setattr(torch.distributed, "all_reduce", lambda t: t.mul_(2))
    shown = []
    bar = types.SimpleNamespace(set_postfix=lambda **kw: shown.append(kw))
    progress = types.SimpleNamespace(loss_window=[torch.tensor(1.0), torch.tensor(3.0)],
                                     smoothed_loss=None, step=9)
    log_progress(run, progress, bar, 0.5, 1000.0)
    loss = 2.0 * world_size
    assert run.writer.scalars == [("train/loss", loss, 9), ("train/lr", 0.5, 9),
                                  ("train/tok_s", 1000.0, 9)]
    assert progress.loss_window == [] and progress.smoothed_loss == loss
    assert shown[0]["loss"] == f"{loss:6.3f}" and shown[0]["tok_s"] == "1,000"
