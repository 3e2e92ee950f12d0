"""How a training run stops before its end: why (`Stop`), on Ctrl-C or SIGTERM (the current step
finishes, a checkpoint is saved, the run exits; a second signal aborts within seconds, whatever
the step is doing: `abort_watch`), and the command that resumes it."""

import enum
import os
import shlex
import signal
import socket
import sys
import threading
from contextlib import contextmanager

from tqdm import tqdm

from config import Config, is_main
from nmt.runtime import max_over_ranks
from nmt.budget import minutes
from nmt.checkpoint import latest_checkpoint_path
from nmt.cli import ABORT_SAID, below_a_bar


class Stop(enum.IntEnum):
    """Why training stops before its last epoch ends. Ranks agree on the largest."""
    NONE = 0
    MAX_STEPS = 1  # --max_steps reached
    PATIENCE = 2  # --patience validations without a better one
    SIGNAL = 3  # Ctrl-C or SIGTERM


class StopRequested(Exception):
    """Ctrl-C or SIGTERM while decoding (validation, test scoring): stop at the next batch."""


_aborting = None  # set by `abort` to its signal: an exception after it is the abort's aftermath
_signals_seen = None  # stop signals since training began, counted by abort_watch's thread
ABORT_GRACE = 2.0  # seconds the abort's KeyboardInterrupt has to end the process before the watch


def abort(signum=None, frame=None):
    """Stops at once (KeyboardInterrupt), and lets no later signal cut short the clean-up on
    the way out (releasing the folder, closing the process group): under torchrun a Ctrl-C
    reaches each process twice, from the terminal and from torchrun."""
    global _aborting
    _aborting = signum or signal.SIGINT
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise aborted()


def aborted() -> KeyboardInterrupt:
    """The interrupt of the abort: its `signum` the signal that aborted (run_main exits 128 +
    it: 130 for Ctrl-C, 143 for SIGTERM), also when re-raised for the abort's aftermath."""
    interrupt = KeyboardInterrupt()
    interrupt.signum = _aborting or signal.SIGINT
    return interrupt


def aborting() -> bool:
    """Whether a signal aborted this process. Python drops an exception raised in a finalizer or
    an import lock's callback ("Exception ignored in ..."): a KeyboardInterrupt landing there is
    lost, and the process goes on until another rank's absence fails it. That failure is then
    the abort, and train.py reports it as one (`aborted()`, with the abort's signal)."""
    return _aborting is not None


def catch_stop_signals(progress=None):
    """Ctrl-C / SIGTERM while training: finish the current step, save, exit; a second one
    aborts (the checkpoints already written stay intact: saves are atomic). Without
    `progress` (while setting up, before any step): abort at once."""
    global _signals_seen
    _signals_seen = 0 if progress is not None else None  # abort_watch counts from here

    def handle(signum, frame):
        if progress is None or progress.signal:
            abort(signum)
        progress.signal = signal.Signals(signum).name
        tqdm.write(f"{progress.signal}: stopping after this step or decoding batch (press "
                   f"Ctrl-C again to abort)")
    signal.signal(signal.SIGINT, handle)
    signal.signal(signal.SIGTERM, handle)


@contextmanager
def abort_watch(line: str, grace: float = ABORT_GRACE):
    """While training: a second stop signal ends the process within `grace` seconds, whatever
    it is doing. Python runs a signal's handler in the main thread between two bytecodes: a
    step inside one long native call (a backward pass of many seconds) holds the abort's
    KeyboardInterrupt back until the call returns, and one raised inside a finalizer is dropped
    ("Exception ignored in ..."), so the run went on to save and exit. The signal also reaches a
    socket (signal.set_wakeup_fd) that a thread of ours reads: `grace` seconds after the second
    signal since catch_stop_signals(progress), if the process still runs, it prints `line`
    (unless run_main has said it) and exits at once with 128 + the signal (130, 143).
    Checkpoints are written atomically and the folder's lock dies with the process: nothing
    saved is lost."""
    if threading.current_thread() is not threading.main_thread():
        yield  # (set_wakeup_fd works in the main thread only)
        return
    reader, writer = socket.socketpair()
    writer.setblocking(False)
    previous = signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
    over = threading.Event()  # set when the watch ends without an abort under way
    thread = threading.Thread(target=_watch, args=(reader, line, grace, over), daemon=True,
                              name="abort_watch")
    thread.start()
    try:
        yield
    finally:
        signal.set_wakeup_fd(previous)
        if (_signals_seen or 0) < 2:  # an abort under way keeps its watch to the process's end
            over.set()
            writer.close()  # the thread's recv returns b"": it ends
            thread.join(timeout=1.0)


def _watch(reader, line: str, grace: float, over: threading.Event):
    """abort_watch's thread: counts the stop signals; at the second, waits `grace` seconds for
    the process to end by itself, then ends it."""
    global _signals_seen
    with reader:
        while data := reader.recv(64):
            for signum in data:
                if signum not in (signal.SIGINT, signal.SIGTERM) or _signals_seen is None:
                    continue
                _signals_seen += 1
                if _signals_seen >= 2 and not over.wait(grace):
                    if is_main() and not ABORT_SAID.is_set():  # (run_main's, if said)
                        sys.stderr.write(f"{below_a_bar()}{line}\n")
                        sys.stderr.flush()
                    os._exit(128 + signum)


def ignore_sigint(_worker_id):
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # DataLoader workers: the main process decides


def exit_code(stopped_by) -> int:
    """The exit code of a run that `stopped_by` a signal (its name, or None: finished), so that
    a script or a scheduler tells a stopped run from a finished one: 130 after SIGINT, 143
    after SIGTERM, 0 at the end. Under torchrun every process calls it (the exchange is also
    the wait for rank 0's save): rank 0 exits with the signal that any process got, the
    others with 0, and torchrun reports rank 0's code as a failure once the save is done (a
    scheduler stopping one machine's process stops every process). The run is over and saved
    (or saving, on rank 0, while the others wait here): a signal from now on is ignored, not
    an abort raised outside run_main; a process gone leaves this one its own code."""
    code = 128 + signal.Signals[stopped_by] if stopped_by else 0
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        code = max_over_ranks(code)
    except RuntimeError:  # (Gloo's error for a peer that has gone: torchrun ending the job)
        pass
    return code if is_main() else 0


def launcher(world_size: int) -> str:
    """python, or the torchrun command line of this run (from torchrun's environment)."""
    if world_size == 1:
        return "python"
    per_node = os.environ.get("LOCAL_WORLD_SIZE", world_size)
    nodes = int(os.environ.get("GROUP_WORLD_SIZE", 1))
    if nodes == 1:
        return f"torchrun --standalone --nproc_per_node={per_node}"
    return (f"torchrun --nnodes={nodes} --nproc_per_node={per_node} --rdzv_backend=c10d "
            f"--rdzv_endpoint={os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}")


# The run group of flags (where the run works) but --preload: a resume takes the newest
# checkpoint, wherever the stopped run started from.
RESUMED_AS_GIVEN = ("model_folder", "model_basename", "experiment_name", "device", "num_workers",
                    "threads")


def resume_command(config: Config, world_size: int) -> str:
    """The command that continues this run: where it works (the run group of flags, which a
    resume never takes from the checkpoint) as given, under the launcher it ran under; the
    rest comes from the checkpoint."""
    default = Config()
    flags = [f"--{name} {shlex.quote(str(getattr(config, name)))}" for name in RESUMED_AS_GIVEN
             if name == "model_folder" or getattr(config, name) != getattr(default, name)]
    return f"{launcher(world_size)} train.py {' '.join(flags)}"


def stop_message(run, progress, stop: Stop) -> str:
    """What a run stopped within an epoch says: why, where, what it saved, how to resume (a
    --time_budget run whose schedule is complete has nothing to resume)."""
    budget = getattr(run, "budget", None)
    ended = stop is Stop.MAX_STEPS and budget is not None and not (
        run.config.max_steps and progress.step >= run.config.max_steps)
    why = (f"stopped by {progress.signal or 'a signal'}" if stop is Stop.SIGNAL else
           f"the --time_budget's schedule is complete ({minutes(budget.spent())} of "
           f"{budget.seconds / 60:g} minutes spent)" if ended else
           f"reached --max_steps {run.config.max_steps}")
    resume = "" if ended else f". Resume with: {resume_command(run.config, run.world_size)}"
    if stop is Stop.MAX_STEPS and not ended:  # (the step limit kept would stop it at once)
        resume = (f". Resume with no step limit (or a larger --max_steps): "
                  f"{resume_command(run.config, run.world_size)} --max_steps 0")
    where = (f"at the end of epoch {progress.epoch - 1}" if progress.batch == 0 and progress.step
             else f"in epoch {progress.epoch} after batch {progress.batch} of "
                  f"{run.batches_per_epoch}")
    return (f"{why} {where} (step {progress.step}); saved {latest_checkpoint_path(run.config)}"
            f"{resume}")


def validation_stop_message(run, progress, epoch_end: bool) -> str:
    """What a stop while validating says (that validation is not recorded): at an epoch's end,
    whose checkpoint was just saved; or in a start's first validation: the resumed
    checkpoint's, again, or --init_from's model before any step (nothing to resume)."""
    why, config = f"stopped by {progress.signal or 'a signal'} while validating", run.config
    resume = f"Resume with: {resume_command(config, run.world_size)}"
    if epoch_end:
        return (f"{why} epoch {progress.epoch} (not recorded); saved "
                f"{latest_checkpoint_path(config)}. {resume}")
    if progress.step:
        return f"{why} step {progress.step} again (not recorded). {resume}"
    return f"{why} the model of --init_from, before any step: start the same command again"
