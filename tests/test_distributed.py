"""Data-parallel training (torchrun + DistributedDataParallel), run for real with two Gloo
processes on the CPU."""

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import ROOT, TINY, children, make_corpus, number_pairs, run_here, write_aligned

from dataset import Collator
from nmt.batching import TokenBatchSampler, split_for_ranks
from tokenizer import PAD

# torchrun is launched as `python -m torch.distributed.run`: no script on PATH needed
pytestmark = pytest.mark.skipif(
    not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
    reason="needs torch.distributed with Gloo")


def torchrun(*args, cwd, nproc=2, timeout=180):
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           f"--nproc_per_node={nproc}", *map(str, args)], cwd=cwd, env=env,
                          capture_output=True, timeout=timeout)


@pytest.mark.parametrize("world_size", [2, 3])
def test_ranks_get_disjoint_equal_shares_that_cover_the_epoch(world_size):
    lengths = [3, 9, 4, 4, 12, 7, 5, 6, 8, 3, 10, 11, 2]
    for epoch in range(3):
        shares = [TokenBatchSampler(lengths, max_tokens=24, seed=5, rank=r,
                                    world_size=world_size).batches(epoch)
                  for r in range(world_size)]
        assert len({len(s) for s in shares}) == 1  # every rank makes the same number of steps
        seen = [i for s in shares for b in s for i in b]
        assert sorted(seen) == list(range(len(lengths)))  # each pair exactly once
        whole = TokenBatchSampler(lengths, max_tokens=24, seed=5).batches(epoch)
        assert [sorted(b) for b in split_for_ranks(whole, world_size)] == \
            [sorted(b) for r in range(len(shares[0])) for s in shares for b in [s[r]]]


def test_two_ranks_train_as_one_process_on_both_batches(tmp_path, monkeypatch):
    make_corpus(tmp_path / "corpus", n=120, seed=3, val=9)  # shares of 5 and 4
    write_aligned(tmp_path / "corpus", "test", number_pairs(7, seed=5))
    flags = ["--data_dir", "corpus", *TINY, "--max_tokens", "120", "--dropout", "0",
             "--attention_dropout", "0", "--activation_dropout", "0",
             "--model_folder", "w", "--experiment_name", "runs/w", "--val_examples", "0"]
    spied = teardown_spy(tmp_path, monkeypatch)
    t = torchrun(ROOT / "tests" / "ddp_worker.py", tmp_path / "out.pt", *flags,
                 "--accum_steps", "2", cwd=tmp_path)  # DDP's no_sync on every other batch
    assert t.returncode == 0 and spied not in t.stderr, t.stderr.decode()[-3000:]
    report = torch.load(tmp_path / "out.pt")
    assert report["world_size"] == 2
    # the same starting weights, and the same weights after an epoch of different batches
    torch.testing.assert_close(report["start"][0], report["start"][1], rtol=0, atol=0)
    torch.testing.assert_close(report["end"][0], report["end"][1], rtol=0, atol=0)
    assert not torch.equal(report["start"][0], report["end"][0])
    # disjoint batches that together cover the epoch, as many on each rank
    a, b = report["batches"]
    assert len(a) == len(b) > 1
    seen = [i for batch in a + b for i in batch]
    assert len(seen) == len(set(seen)) == 120

    # one process, one update over both ranks' first batches: the same gradient
    from nmt.trained_model import build_model
    from config import Config
    from dataset import get_ds
    from train import make_loss, train_step
    monkeypatch.chdir(tmp_path)
    config = Config(data_dir="corpus", d_model=32, N=1, h=2, d_ff=64, seq_len=24,
                    vocab_size=300, dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
                    model_folder="w")
    data = get_ds(config)
    torch.manual_seed(config.seed)
    model = build_model(config, data.tokenizer_src.get_vocab_size(),
                        data.tokenizer_tgt.get_vocab_size())
    group = [Collator()([data.train[i] for i in batches[0]]) for batches in (a, b)]
    train_step(model, group, make_loss(config), PAD, "cpu")
    for name, p in model.named_parameters():
        for rank in (0, 1):
            torch.testing.assert_close(report["grads"][rank][name], p.grad, rtol=1e-4,
                                       atol=1e-6)

    # issue 44: DDP sends no buffers and keeps gradients in its buckets, and the ranks' hosts
    # exchange once a step (the update's tokens and a stop): after an epoch of updates of two
    # batches a rank, the weights of one process accumulating their four (--accum_steps 4)
    alone = run_here("tests/ddp_worker.py", tmp_path / "alone.pt", *flags, "--accum_steps", "4",
                     "--model_folder", "w1", "--experiment_name", "runs/w1", cwd=tmp_path)
    assert alone.returncode == 0, alone.stderr.decode()[-3000:]
    single = torch.load(tmp_path / "alone.pt")
    assert [batch for pair in zip(a, b) for batch in pair] == single["batches"][0]
    torch.testing.assert_close(single["end"][0], report["end"][0], rtol=1e-4, atol=1e-6)

    # issue 44: validation shared out over the ranks: the loss and the translations (so every
    # score) of one process with the same weights
    from types import SimpleNamespace
    from contextlib import nullcontext
    from nmt.evaluation import validation_loss, validation_translations
    from train import Progress
    torch.nn.utils.vector_to_parameters(report["end"][0], model.parameters())
    config.max_tokens = 120
    one = SimpleNamespace(config=config, data=data, model=model.eval(), device=torch.device("cpu"),
                          amp=nullcontext, loss_fn=make_loss(config), rank=0, world_size=1)
    losses, outputs = report["validation"]
    assert len(outputs) == 9 and any(outputs)
    assert outputs == validation_translations(one, Progress(), 9)
    for name, value in validation_loss(one).items():
        assert losses[name] == pytest.approx(value, rel=1e-6), name
    # and the test sets, each rank translating its share with the best checkpoint: the scores
    # of one process translating them all
    from nmt.evaluation import score_test_sets
    from nmt.runtime import NoWriter
    one.writer = NoWriter()
    (results, samples), (expected, expected_samples) = report["test"], score_test_sets(
        one, Progress())
    assert results["tests"]["test"]["sentences"] == 7 and len(set(s[2] for s in samples)) > 1
    assert results["tests"] == expected["tests"] and samples == expected_samples


def test_torchrun_train_writes_one_run_and_resumes(tmp_path):
    make_corpus(tmp_path / "corpus", n=160, seed=5, val=4)
    write_aligned(tmp_path / "corpus", "test", number_pairs(4, seed=7))
    flags = ["--data_dir", "corpus", *TINY, "--max_tokens", "120", "--model_folder", "w",
             "--experiment_name", "runs/w", "--num_epochs", "2"]
    # stopped mid-epoch 1 by --max_steps, then resumed under torchrun to the end
    first = torchrun(ROOT / "train.py", *flags, "--max_steps", "6", "--num_workers", "1",
                     cwd=tmp_path)
    assert first.returncode == 0, first.stderr.decode()[-3000:]
    out = first.stdout.decode()
    assert "2 processes (torchrun)" in out
    assert out.count("reached --max_steps 6") == 1  # one voice: rank 0's
    names = sorted(p.name for p in (tmp_path / "w").glob("*.pt"))
    assert names == ["tmodel_00.pt", "tmodel_01_s0000006.pt", "tmodel_best.pt"], names
    state = torch.load(tmp_path / "w" / "tmodel_01_s0000006.pt", weights_only=False)
    assert len(state["rank_rng_states"]) == 2

    # issue 16, 2: one process cannot go on with the rest of an epoch shared out by two
    alone = run_here("train.py", *flags, "--max_steps", "0", cwd=tmp_path)
    assert alone.returncode == 2 and "saved mid-epoch by 2 process(es) and this run has 1" \
        in alone.stderr.decode(), alone.stderr.decode()[-3000:]
    second = torchrun(ROOT / "train.py", *flags, "--max_steps", "0", cwd=tmp_path)
    assert second.returncode == 0, second.stderr.decode()[-3000:]
    out = second.stdout.decode()
    assert f"resumed from w/tmodel_01_s0000006.pt: epoch 1, batch {state['next_batch']}, " \
           f"step 6" in out
    assert out.count("validation: loss") == 1 and (tmp_path / "w" / "results.json").exists()
    assert (tmp_path / "w" / "tmodel_01.pt").exists()
    assert len(list((tmp_path / "runs" / "w").glob("events.out.tfevents.*"))) == 2  # one a run
    # the resumed run against its uninterrupted two-rank twin: the same weights at the end
    # (messages and file names alone would also pass a silent fresh start)
    twin_flags = [f.replace("w", "twin") if f in ("w", "runs/w") else f for f in flags]
    twin = torchrun(ROOT / "train.py", *twin_flags, cwd=tmp_path)
    assert twin.returncode == 0, twin.stderr.decode()[-3000:]
    a = torch.load(tmp_path / "twin" / "tmodel_01.pt", weights_only=False)
    b = torch.load(tmp_path / "w" / "tmodel_01.pt", weights_only=False)
    assert a["global_step"] == b["global_step"]
    for k, v in a["model_state_dict"].items():
        assert torch.equal(v, b["model_state_dict"][k]), k


def test_ctrl_c_while_the_processes_start_is_one_line(tmp_path, delay=0.2):
    """Issue 24: Ctrl-C while torchrun's processes were still starting (after "resumed from",
    while DDP was being set up) printed a [rank0] traceback of a Gloo "Connection closed by
    peer" and a KeyboardInterrupt after the one-line "aborted". The signal lands in the set-up
    almost always; on a busy machine it can land after it, in the first steps, and then the run
    stops there as after any Ctrl-C: one clean line either way. The run is long enough that the
    signal never comes after its end."""
    make_corpus(tmp_path / "corpus", n=160, seed=5, val=4)
    flags = ["--data_dir", "corpus", *TINY, "--max_tokens", "60", "--model_folder", "w",
             "--experiment_name", "runs/w", "--val_examples", "0"]
    # epoch 0 in one process (here), to resume from: the signal comes after "resumed from"
    first = run_here("train.py", *flags, "--num_epochs", "1", cwd=tmp_path)
    assert first.returncode == 0, first.stderr.decode()[-3000:]
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone",
                             "--nproc_per_node=2", str(ROOT / "train.py"), *flags,
                             "--num_epochs", "100"], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)  # Ctrl-C reaches the whole group
    out = b""
    for line in proc.stdout:
        out += line
        if b"resumed from" in line:
            time.sleep(delay)
            os.killpg(proc.pid, signal.SIGINT)
            break
    out = (out + proc.communicate(timeout=60)[0]).decode()
    ours = [line for line in out.splitlines() if line.startswith("train.py:")]
    stopped = [line for line in out.splitlines() if line.startswith("stopped by SIGINT")]
    assert (ours == ["train.py: aborted; the checkpoints already saved are intact"]
            and not stopped) or (ours == [] and len(stopped) == 1), out
    assert "[rank" not in out and "KeyboardInterrupt" not in out, out
    lock = tmp_path / "w" / ".train.lock"
    assert not lock.exists(), (lock.read_text(), out)


def test_a_bad_flag_under_torchrun_is_reported_by_rank_0_alone(monkeypatch, capsys):
    from config import parse_config
    from nmt.cli import ArgumentParser
    monkeypatch.setattr("time.sleep", lambda s: None)  # the pause that lets rank 0 speak first
    for rank, says in (("0", True), ("1", False)):
        monkeypatch.setenv("WORLD_SIZE", "2")
        monkeypatch.setenv("RANK", rank)
        with pytest.raises(SystemExit) as e:
            parse_config(["--max_tokens", "5"], ArgumentParser(prog="train.py"))
        assert e.value.code == 2
        assert ("--max_tokens (5) must be at least" in capsys.readouterr().err) == says


def test_a_users_error_under_torchrun_is_one_line(tmp_path):
    # met by rank 0 while the others wait for it to prepare the data
    t = torchrun(ROOT / "train.py", "--data_dir", "nowhere", "--model_folder", "w", cwd=tmp_path)
    assert t.returncode != 0
    err = t.stderr.decode()
    ours = [line for line in err.splitlines() if line.startswith("train.py: error:")]
    assert len(ours) == 1, err[-3000:]
    assert "[rank1]" not in err, err[-3000:]
    # rank 0 exited 2 (the others, told so, exit 2 once rank 0 has gone)
    assert re.search(r"rank +: 0 .*\n +exitcode +: 2 ", err), err[-3000:]


def rank_pid(launcher: int, rank: int, deadline: float):
    """The pid of torchrun's worker process of `rank` (its RANK environment variable)."""
    while time.time() < deadline:
        for kid in children(launcher):
            try:
                env = Path(f"/proc/{kid}/environ").read_bytes().split(b"\0")
            except OSError:
                continue
            if f"RANK={rank}".encode() in env:
                return int(kid)
        time.sleep(0.05)
    raise AssertionError(f"no process of rank {rank} under torchrun")


@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="reads /proc")
def test_a_rank_told_of_rank_0s_error_exits_2_at_once_without_a_word():
    """A rank whose rank 0 met a user's error (ReportedElsewhere) exits 2 straight away,
    writing nothing more and skipping the interpreter's teardown: with rank 0 gone its Gloo
    group is broken, and tearing it down at exit aborted the process (std::terminate, -6)
    once in a loaded test run, so torchrun reported that rank's -6 instead of rank 0's 2."""
    import subprocess
    import sys

    from conftest import ROOT
    code = """
import atexit, sys
from nmt.cli import ReportedElsewhere, run_main
atexit.register(lambda: sys.stderr.write("teardown ran"))
def main():
    print("before", flush=True)
    raise ReportedElsewhere()
run_main("train.py", main)
"""
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          timeout=60)
    assert proc.returncode == 2 and proc.stdout.decode() == "before\n"
    assert proc.stderr.decode() == "", proc.stderr.decode()


def test_a_torchrun_process_ends_with_its_code_when_a_gloo_thread_frees_a_tensor_late(tmp_path):
    """A Gloo worker thread that frees a tensor Python made takes the GIL; where it needs the
    GIL once the interpreter's teardown has begun, the process aborted (std::terminate, -6)
    after a run that had saved everything: the tensor of exit_code's last exchange, once in
    about twenty loaded test runs. Here the thread is inside the tensor's weakref callback when
    the main thread ends, and needs the GIL back a second later, every time;
    nmt.runtime.exit_distributed ends the process without the teardown, with the code Python
    would give (1 and the message for sys.exit("...")), its exit handlers run."""
    (tmp_path / "worker.py").write_text(f"""
import atexit, sys, threading, time, weakref
sys.path.insert(0, {str(ROOT)!r})
import torch
import torch.distributed as dist
from nmt.runtime import exit_distributed, start_distributed

freed = threading.Event()
def release(_, sleep=time.sleep):  # run by the Gloo thread as it frees the tensor
    freed.set()
    sleep(2)  # (the GIL let go, to be taken back): the main thread ends meanwhile

atexit.register(print, "exit handlers ran")  # (as logging's, which flushes the logs)
with exit_distributed():
    rank, world = start_distributed()
    tensor = torch.ones(1)
    if rank == 0:
        watch = weakref.ref(tensor, release)
        dist.all_reduce(tensor, async_op=True)  # waits for rank 1, its work holding the tensor
        del tensor  # the work's reference is the last
        freed.wait()
        time.sleep(0.5)  # (rank 1 has ended: torchrun stops the others at a failure)
        sys.exit("rank 0 leaves with a message")
    else:
        time.sleep(1)
        dist.all_reduce(tensor)
""")
    t = torchrun(tmp_path / "worker.py", cwd=tmp_path, timeout=120)
    err = t.stderr.decode()
    assert re.search(r"Root Cause.*rank +: 0 .*\n +exitcode +: 1 ", err, re.S), err[-3000:]
    assert "rank 0 leaves with a message" in err
    assert t.stdout.decode().count("exit handlers ran") == 2


def teardown_spy(folder, monkeypatch) -> bytes:
    """A sitecustomize for torchrun's workers (RANK set) whose finalizer writes, to stderr,
    what it returns when the interpreter's teardown runs (nmt.runtime.exit_distributed skips
    it)."""
    (folder / "spy").mkdir()
    (folder / "spy" / "sitecustomize.py").write_text(
        "import os\nclass Spy:\n    def __del__(self, write=os.write):\n"
        "        write(2, b'teardown ran\\n')\nif 'RANK' in os.environ:\n    spy = Spy()\n")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        [str(folder / "spy"), *filter(None, [os.environ.get("PYTHONPATH")])]))
    return b"teardown ran"


def test_sigterm_to_one_rank_stops_every_rank_after_the_same_step_and_saves_once(tmp_path):
    with long_two_rank_run(tmp_path) as proc:
        stop_one_rank(proc, tmp_path)


@contextlib.contextmanager
def long_two_rank_run(tmp_path):
    """A two-rank torchrun training of many short epochs in tmp_path/w, started; after the
    block (or its failure) no process is left behind, torchrun's workers included."""
    write_aligned(tmp_path / "corpus", "train", number_pairs(1000, seed=5))  # epochs of seconds
    write_aligned(tmp_path / "corpus", "val", number_pairs(4, seed=6))
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone",
                             "--nproc_per_node=2", str(ROOT / "train.py"), "--data_dir", "corpus",
                             *TINY, "--max_tokens", "60", "--num_epochs", "100",
                             "--val_examples", "0", "--model_folder", "w",
                             "--experiment_name", "runs/w"],
                            cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            for pid in children(proc.pid) + [proc.pid]:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            proc.communicate()


def stop_one_rank(proc, tmp_path):
    deadline = time.time() + 120
    # after epoch 0's validation (a signal during one stops it there: the epoch's checkpoint
    # is the one saved, and rank 0 says so), while epoch 1 trains
    while not (tmp_path / "w" / "tmodel_validation.json").exists() and time.time() < deadline:
        time.sleep(0.01)
    time.sleep(0.3)
    # as a scheduler preempting one machine would: only rank 1 is told; rank 0 must stop too,
    # after the same step, or it would wait forever in the next gradient all-reduce
    os.kill(rank_pid(proc.pid, 1, deadline), signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    # a stopped run, not a finished one: rank 0, once its save is done, exits with the signal's
    # code (143), which torchrun reports as the job's failure (exit 1); the others exit 0
    assert proc.returncode == 1, err.decode()[-3000:]
    assert re.search(r"<NO_OTHER_FAILURES>.*Root Cause.*rank +: 0 .*\n +exitcode +: 143 ",
                     err.decode(), re.S), err.decode()[-3000:]
    out = out.decode()
    assert out.count("stopped by a signal") == 1  # rank 0 speaks, once
    assert "Resume with: torchrun" in out
    saved = sorted((tmp_path / "w").glob("tmodel_*_s*.pt"))
    assert len(saved) == 1
    state = torch.load(saved[0], weights_only=False)
    assert len(state["rank_rng_states"]) == 2 and state["next_batch"] > 0


@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="reads /proc")
def test_a_rank_that_dies_stops_the_others_and_leaves_the_saved_files_whole(tmp_path):
    """Issue 63 (a promise of docs/resuming.md with no test): a torchrun process killed outright
    (SIGKILL: no handler, no save) does not leave the others waiting for it for ever: the whole
    run ends, non-zero, no process left; the checkpoint saved before loads, and the folder's
    lock is free for the resume."""
    from nmt.files import FolderLock
    with long_two_rank_run(tmp_path) as proc:
        deadline = time.time() + 120
        while not (tmp_path / "w" / "tmodel_validation.json").exists() and \
                time.time() < deadline:
            time.sleep(0.01)
        time.sleep(0.3)  # into epoch 1
        workers = children(proc.pid)
        os.kill(rank_pid(proc.pid, 1, deadline), signal.SIGKILL)
        proc.communicate(timeout=90)  # ends: no rank waits for ever
        assert proc.returncode != 0
        assert not [pid for pid in workers if Path(f"/proc/{pid}").exists()
                    and "zombie" not in Path(f"/proc/{pid}/status").read_text().lower()]
        state = torch.load(tmp_path / "w" / "tmodel_00.pt", weights_only=False)
        assert state["epoch"] == 0 and len(state["rank_rng_states"]) == 2
        FolderLock(tmp_path / "w").acquire().release()  # free: a resume may start


def test_a_time_budget_under_torchrun_ends_on_every_rank_at_rank_0s_plan(tmp_path, monkeypatch):
    """--time_budget under torchrun: each rank's clock differs, so the ranks take rank 0's plan
    at each step's exchange and stop after the same step (no rank left waiting), the schedule
    complete, the test set scored once; each process ends without the interpreter's teardown
    (nmt.runtime.exit_distributed), which a Gloo thread could abort."""
    make_corpus(tmp_path / "corpus", n=160, seed=5, val=4)
    write_aligned(tmp_path / "corpus", "test", number_pairs(4, seed=7))
    spied = teardown_spy(tmp_path, monkeypatch)
    t = torchrun(ROOT / "train.py", "--data_dir", "corpus", *TINY, "--max_tokens", "120",
                 "--model_folder", "w", "--experiment_name", "runs/w", "--time_budget", "0.2",
                 cwd=tmp_path)
    assert t.returncode == 0, t.stderr.decode()[-3000:]
    assert spied not in t.stderr
    out = t.stdout.decode()
    assert out.count("the --time_budget's schedule is complete") == 1, out[-3000:]
    from config import Config
    from nmt.checkpoint import latest_checkpoint_path
    state = torch.load(latest_checkpoint_path(Config(model_folder=str(tmp_path / "w"))),
                       weights_only=False)
    assert state["schedule_steps"] == state["global_step"] > 0
    history = json.loads((tmp_path / "w" / "tmodel_validation.json").read_text())
    assert history[-1]["step"] == state["global_step"]  # validated at the end, once
    assert len({h["step"] for h in history}) == len(history)
    assert (tmp_path / "w" / "results.json").exists()
