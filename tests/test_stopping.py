"""Stopping a training run: the resume command it prints, and an abort's aftermath. (The
signals themselves are tested on whole runs: test_train.py, test_distributed.py.)"""

import pytest

from config import Config
from nmt import stopping
from nmt.stopping import resume_command


def test_the_resume_command_names_where_the_run_works():
    """6. The resume command printed after Ctrl-C omitted --experiment_name: the resumed run
    wrote into runs/tmodel."""
    config = Config(model_folder="w", experiment_name="runs/mine", num_workers=2)
    command = resume_command(config, 1)
    assert command == ("python train.py --model_folder w --experiment_name runs/mine "
                       "--num_workers 2")
    assert "--device" not in command  # defaults are left out


def test_the_resume_command_under_torchrun_can_be_pasted(monkeypatch):
    """Issue 24: after a stop under torchrun the hint read "torchrun <the same torchrun flags,
    2 processes> train.py ...": now the launcher's real flags, from torchrun's environment."""
    config = Config(model_folder="w")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("GROUP_WORLD_SIZE", "1")
    assert resume_command(config, 2) == ("torchrun --standalone --nproc_per_node=2 train.py "
                                        "--model_folder w")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    monkeypatch.setenv("GROUP_WORLD_SIZE", "2")
    monkeypatch.setenv("MASTER_ADDR", "node1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    assert resume_command(config, 8).startswith(  # two machines of 4 GPUs
        "torchrun --nnodes=2 --nproc_per_node=4 --rdzv_backend=c10d --rdzv_endpoint=node1:29500 "
        "train.py")


def test_an_error_after_a_lost_abort_is_reported_as_the_abort(monkeypatch, tmp_path):
    """Issue 41 (a torchrun test that failed now and then): Python drops a KeyboardInterrupt
    raised in an import lock's callback ("Exception ignored in ..."); the process went on into
    DDP's set-up, failed there once the other rank had left, and printed a traceback. After an
    abort, that failure is the abort (one line, exit 130); without one, it is what it is."""
    import signal

    import train

    def set_up(*args, **kwargs):
        if state["abort"]:
            try:
                stopping.abort()
            except KeyboardInterrupt:
                pass  # what Python does to it in a finalizer
        raise RuntimeError("Connection closed by peer")
    state = {}
    monkeypatch.setattr(train, "set_up", set_up)
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        for abort, expected in ((False, RuntimeError), (True, KeyboardInterrupt)):
            state["abort"] = abort
            monkeypatch.setattr(stopping, "_aborting", None)
            with pytest.raises(expected):
                train.train_model(Config(model_folder=str(tmp_path / "w")))
    finally:
        for s, handler in handlers.items():
            signal.signal(s, handler)


def test_the_exit_code_exchange_ignores_a_late_signal_and_a_process_gone(monkeypatch):
    """Under torchrun the other processes wait in exit_code's exchange for rank 0's save: a
    second signal there aborted outside run_main (a traceback, and rank 0 ended by SIGABRT);
    it is ignored now. A process gone (Gloo's RuntimeError) leaves this one its own code."""
    import os
    import signal
    import types
    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        stopping.catch_stop_signals(types.SimpleNamespace(signal="SIGTERM"))  # stopped once

        def exchange(code):  # a second SIGTERM lands while the others wait
            os.kill(os.getpid(), signal.SIGTERM)
            return code
        monkeypatch.setattr(stopping, "max_over_ranks", exchange)
        assert stopping.exit_code("SIGTERM") == 143 and not stopping.aborting()
        assert stopping.exit_code(None) == 0
        monkeypatch.setattr(stopping, "max_over_ranks", lambda code: {}[code])  # not that error
        with pytest.raises(KeyError):
            stopping.exit_code("SIGINT")

        def gone(code):
            raise RuntimeError("Connection closed by peer")
        monkeypatch.setattr(stopping, "max_over_ranks", gone)
        assert stopping.exit_code("SIGINT") == 130
        monkeypatch.setenv("RANK", "1")  # the other processes: 0, torchrun hears rank 0
        assert stopping.exit_code("SIGINT") == 0
    finally:
        stopping._aborting = None
        for s, handler in saved.items():
            signal.signal(s, handler)


def test_the_resume_command_keeps_the_threads_and_every_run_flag():
    """Issue 56, 7: the command printed on Ctrl-C/SIGTERM dropped --threads, so a run started on
    part of the cores resumed on all of them. Every flag of the run group (which a resume
    never takes from the checkpoint) is in it where it is not the default, but --preload (a
    resume continues from the newest checkpoint); a path with a space is quoted."""
    from config import fields_where
    assert set(stopping.RESUMED_AS_GIVEN) == fields_where(group="run") - {"preload"}
    config = Config(model_folder="my runs/w", threads=1, preload="03")
    assert resume_command(config, 1) == "python train.py --model_folder 'my runs/w' --threads 1"


@pytest.mark.parametrize("sig, code", [("SIGTERM", 143), ("SIGINT", 130)])
def test_a_signal_while_setting_up_aborts_with_its_own_exit_code(sig, code, capsys):
    """Issue 56 (suspected by the review, confirmed): before any step a signal aborts at once,
    and a SIGTERM then exited 130, Ctrl-C's code, where a stopped run exits 143."""
    import os
    import signal

    from nmt.cli import run_main
    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}

    def setting_up():
        stopping.catch_stop_signals()  # as train.py does before set_up
        os.kill(os.getpid(), getattr(signal, sig))
        raise AssertionError("not aborted")
    try:
        with pytest.raises(SystemExit) as e:
            run_main("train.py", setting_up)
    finally:
        for s, handler in saved.items():
            signal.signal(s, handler)
        stopping._aborting = None
    # no bar open, not a terminal: the line alone, no blank line above it
    assert e.value.code == code and capsys.readouterr().err == "train.py: aborted\n"


def test_the_abort_line_starts_below_an_open_progress_bar(capsys):
    """In a log redirected to a file, the abort line was written on the open bar's line
    (`...tok_s=14,597]train.py: aborted`): the newline was written on a terminal only."""
    import os
    import signal

    from tqdm import tqdm

    from nmt.cli import run_main
    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    bars = []

    def training():
        stopping.catch_stop_signals()
        bars.append(tqdm(total=10, desc="epoch 00"))  # to capsys's stderr: not a terminal
        bars[0].update(1)
        os.kill(os.getpid(), signal.SIGINT)
    try:
        with pytest.raises(SystemExit):
            run_main("train.py", training)
    finally:
        for s, handler in saved.items():
            signal.signal(s, handler)
        stopping._aborting = None
        for bar in bars:
            bar.close()
    err = capsys.readouterr().err
    assert "epoch 00" in err and "train.py: aborted" in err.splitlines()


def test_a_second_ctrl_c_aborts_at_once():
    """Issue 56 (an untested promise): while training, the first Ctrl-C asks for a stop after
    the step (the run goes on to save), the second aborts at once (KeyboardInterrupt)."""
    import os
    import signal
    import types
    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    progress = types.SimpleNamespace(signal=None)
    try:
        stopping.catch_stop_signals(progress)
        os.kill(os.getpid(), signal.SIGINT)
        assert progress.signal == "SIGINT"  # noted, not raised: the step finishes
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
        assert stopping.aborting()
        # nothing cuts the way out short: a SIGTERM (torchrun's) is ignored from now on too
        assert signal.getsignal(signal.SIGINT) is signal.getsignal(signal.SIGTERM) is \
            signal.SIG_IGN
    finally:
        for s, handler in saved.items():
            signal.signal(s, handler)
        stopping._aborting = None


LOST_ABORT = '''
import os, signal, sys, time, types
sys.path.insert(0, {root!r})
from tqdm import tqdm
from nmt import stopping
from nmt.cli import run_main


class Dropped:
    def __del__(self):  # the second Ctrl-C lands here: Python drops its KeyboardInterrupt
        os.kill(os.getpid(), signal.SIGINT)


def main():
    progress = types.SimpleNamespace(signal=None)
    stopping.catch_stop_signals(progress)
    bar = tqdm(total=10, desc="epoch 00")  # open, on a pipe: its line has no newline yet
    bar.update(1)
    with stopping.abort_watch("train.py: aborted; the checkpoints already saved are intact",
                              grace=0.5):
        os.kill(os.getpid(), signal.SIGINT)  # the first: stop after this step
        print("first:", progress.signal, flush=True)
        Dropped()
        bar.refresh()  # the bar's line last on stderr, with no newline (Python's note is above)
        time.sleep(60)  # the step goes on (as one long native call would hold the handler)
        print("not aborted", flush=True)


run_main("train.py", main)
'''


def test_a_second_ctrl_c_aborts_within_seconds_even_where_its_interrupt_is_lost(tmp_path):
    """A second Ctrl-C ran 93 s more (then saved and exited 130) in one of three tries: its
    KeyboardInterrupt lost in a finalizer, or held back by a long native call. The watch ends
    the process `grace` seconds after the second signal, with the abort's line and 130."""
    import subprocess
    import sys

    from conftest import ROOT
    script = tmp_path / "lost_abort.py"
    script.write_text(LOST_ABORT.format(root=str(ROOT)))
    result = subprocess.run([sys.executable, str(script)], capture_output=True, timeout=30)
    out, err = result.stdout.decode(), result.stderr.decode()
    assert "first: SIGINT" in out and "not aborted" not in out
    assert result.returncode == 130
    assert err.count("train.py: aborted; the checkpoints already saved are intact") == 1
    assert "train.py: aborted; the checkpoints already saved are intact" in err.splitlines()


def test_the_abort_watch_ends_with_its_block_and_leaves_the_signals_as_they_were():
    """Without a second signal the watch's thread ends with the block (the run returns as it
    would), and the wakeup socket is handed back: a test or a resumed run in the same process
    starts afresh."""
    import signal
    import threading
    import socket
    before = signal.set_wakeup_fd(-1)
    signal.set_wakeup_fd(before)
    with stopping.abort_watch("x", grace=0.1):
        assert any(t.name == "abort_watch" for t in threading.enumerate())
    assert not any(t.name == "abort_watch" for t in threading.enumerate())
    assert signal.set_wakeup_fd(before) == before
    reader, writer = socket.socketpair()  # another's wakeup socket (asyncio's) is given back
    writer.setblocking(False)
    try:
        signal.set_wakeup_fd(writer.fileno())
        with stopping.abort_watch("x", grace=0.1):
            pass
        assert signal.set_wakeup_fd(before) == writer.fileno()
    finally:
        signal.set_wakeup_fd(before)
        reader.close()
        writer.close()


HANGING_EXIT = '''
import atexit, os, signal, sys, time, types
sys.path.insert(0, {root!r})
from nmt import stopping
from nmt.cli import run_main


def hang():  # the way out after the abort hangs (a clean-up that never returns)
    time.sleep(20)
    print("not ended", flush=True)


def main():
    stopping.catch_stop_signals(types.SimpleNamespace(signal=None))
    with stopping.abort_watch("train.py: aborted", grace=0.3):
        os.kill(os.getpid(), signal.SIGTERM)  # the first: stop after this step
        try:
            os.kill(os.getpid(), signal.SIGTERM)  # the second: the abort
        except KeyboardInterrupt:
            while stopping._signals_seen < 2:  # (the watch's thread has counted it)
                time.sleep(0.01)
            raise


atexit.register(hang)
run_main("train.py", main)
'''


def test_an_abort_whose_way_out_hangs_is_ended_by_its_watch_with_its_own_code(tmp_path):
    """The abort's KeyboardInterrupt leaves the watched block and run_main says the line; the
    exit can still hang (a clean-up that never returns): the watch of that second signal
    stays on after the block, ends the process `grace` seconds after it with the signal's own
    code (143 for SIGTERM), and does not say the line again."""
    import subprocess
    import sys

    from conftest import ROOT
    script = tmp_path / "hanging_exit.py"
    script.write_text(HANGING_EXIT.format(root=str(ROOT)))
    result = subprocess.run([sys.executable, str(script)], capture_output=True, timeout=30)
    assert "not ended" not in result.stdout.decode() and result.returncode == 143
    assert result.stderr.decode().splitlines().count("train.py: aborted") == 1


def test_a_stop_at_max_steps_under_a_time_budget_names_the_step_limit(tmp_path):
    """--max_steps reached exactly in a --time_budget run: the step limit stopped it (resume
    without it); the schedule's end, which has nothing to resume, says no resume command."""
    from types import SimpleNamespace

    from nmt.stopping import Stop, stop_message
    budget = SimpleNamespace(spent=lambda: 20.0, seconds=600)
    run = SimpleNamespace(budget=budget, world_size=1, batches_per_epoch=10,
                          config=Config(model_folder=str(tmp_path), max_steps=30))
    progress = SimpleNamespace(step=30, epoch=2, batch=10, signal=None)
    assert stop_message(run, progress, Stop.MAX_STEPS).startswith(
        "reached --max_steps 30 in epoch 2 after batch 10 of 10 (step 30)")
    run.config = Config(model_folder=str(tmp_path))
    said = stop_message(run, progress, Stop.MAX_STEPS)
    assert said.startswith("the --time_budget's schedule is complete (0.33 of 10 minutes spent)")
    assert "Resume" not in said


def test_a_stop_before_an_epochs_first_batch_names_the_epoch_that_ended(tmp_path):
    """A stop at an epoch's first exchange, no batch of it trained (a --time_budget plan that
    ended at the epoch before's end, a Ctrl-C there): at the end of that epoch; at step 0 (a
    Ctrl-C before the run's first step) in epoch 0 after batch 0, not the end of an epoch -1."""
    from types import SimpleNamespace

    from nmt.stopping import Stop, stop_message
    run = SimpleNamespace(budget=None, world_size=1, batches_per_epoch=10,
                          config=Config(model_folder=str(tmp_path)))
    progress = SimpleNamespace(step=20, epoch=2, batch=0, signal="SIGINT")
    assert stop_message(run, progress, Stop.SIGNAL).startswith(
        "stopped by SIGINT at the end of epoch 1 (step 20); saved ")
    progress.step, progress.epoch = 0, 0
    assert stop_message(run, progress, Stop.SIGNAL).startswith(
        "stopped by SIGINT in epoch 0 after batch 0 of 10 (step 0); saved ")


def test_dataloader_workers_leave_ctrl_c_to_the_main_process():
    import signal
    saved = signal.getsignal(signal.SIGINT)
    try:
        stopping.ignore_sigint(0)
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, saved)
