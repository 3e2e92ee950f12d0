"""Shared fixtures. Every test runs offline: the Hugging Face hub is never contacted."""

import atexit
import contextlib
import importlib
import io
import os
import random
import signal
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

# --precision auto picks bf16 on a CPU that computes it: the suite, and the scripts it starts,
# run as on a CPU without (fp32), whatever CPU runs them (nmt.runtime.cpu_features); a test of
# the rule injects each kind over this.
os.environ["NMT_CPU_FEATURES"] = "avx2"
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"
# A private, empty Hugging Face cache: nothing cached on this machine can leak into a test.
os.environ["HF_HOME"] = tempfile.mkdtemp(prefix="hf_home_")
atexit.register(shutil.rmtree, os.environ["HF_HOME"], ignore_errors=True)
# A private cache for the C decoder step's build (nmt/decoder_step.py), made by the run's first
# process and shared by its pytest-xdist workers and the scripts they start: built at its start,
# and nothing cached on this machine is read (a worker given none makes its own).
if "PYTEST_XDIST_WORKER" not in os.environ or "NMT_CACHE_DIR" not in os.environ:
    os.environ["NMT_CACHE_DIR"] = tempfile.mkdtemp(prefix="nmt_cache_")
    atexit.register(shutil.rmtree, os.environ["NMT_CACHE_DIR"], ignore_errors=True)

# Under pytest-xdist (the README's `-n auto`), the workers share the cores: each worker's torch
# threads, and those of the scripts it starts, get an equal share (thread pools that oversubscribe
# the cores slow each other several times over).
_workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _workers > 1:
    _cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    _share = max(1, _cores // _workers)
    os.environ["OMP_NUM_THREADS"] = str(_share)
    torch.set_num_threads(_share)


def pytest_configure(config):
    """Under pytest-xdist (-n N) with no --dist given: --dist loadfile, each test file whole on
    one worker, in its order (a file's tests share module fixtures and files). Set here, not in
    pytest.ini's addopts, where a run without the plugin (an IDE's runner, -p no:xdist) failed
    on the unknown option."""
    given = any(a == "--dist" or a.startswith(("--dist=", "-d"))
                for a in config.invocation_params.args)
    if getattr(config.option, "numprocesses", None) and not given:
        config.option.dist = "loadfile"


ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from config import Config  # noqa: E402
from model import build_transformer  # noqa: E402
from nmt.cli import run_main  # noqa: E402

EN = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]
IT = ["zero", "uno", "due", "tre", "quattro", "cinque", "sei", "sette", "otto", "nove"]


def number_pairs(n: int, seed: int = 0, min_len: int = 2, max_len: int = 6):
    """n (English, Italian) pairs: number words translated one by one; easy to learn."""
    rng = random.Random(seed)
    pairs = []
    for _ in range(n):
        digits = [rng.randrange(10) for _ in range(rng.randint(min_len, max_len))]
        pairs.append((" ".join(EN[d] for d in digits) + ".", " ".join(IT[d] for d in digits) + "."))
    return pairs


def write_aligned(folder: Path, split: str, pairs, src="en", tgt="it"):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{split}.{src}").write_text("".join(p[0] + "\n" for p in pairs), encoding="utf-8")
    (folder / f"{split}.{tgt}").write_text("".join(p[1] + "\n" for p in pairs), encoding="utf-8")


def make_corpus(folder: Path, n: int = 64, seed: int = 1, val: int = 8) -> Path:
    """A tiny Multi30k-style folder of number words: train.en/train.it (n pairs) and
    val.en/val.it (val pairs, another seed)."""
    write_aligned(folder, "train", number_pairs(n, seed=seed))
    write_aligned(folder, "val", number_pairs(val, seed=seed + 1))
    return folder


@pytest.fixture
def corpus(tmp_path):
    """make_corpus in tmp_path/corpus."""
    return make_corpus(tmp_path / "corpus")


def children(pid: int):
    """The pids of a process's children (Linux /proc; none where it cannot be read)."""
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


# Flags of a tiny, fast model for the scripts.
TINY = ["--d_model", "32", "--N", "1", "--h", "2", "--d_ff", "64", "--seq_len", "24",
        "--vocab_size", "300", "--max_tokens", "200", "--lr", "3e-3", "--val_examples", "1"]


def run_script(script: str, *args, cwd: Path, input: bytes = None, timeout: int = 120):
    """Runs train.py / translate.py in a subprocess; returns the CompletedProcess. For what
    only a process shows (signals, a fresh interpreter, its exit); run_here otherwise."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONIOENCODING="utf-8")
    return subprocess.run([sys.executable, str(ROOT / script), *map(str, args)], cwd=cwd,
                          input=input, capture_output=True, timeout=timeout, env=env)


OLD_CHECKPOINT = ROOT / "tests" / "data" / "checkpoint_2026_11"


def old_checkpoint_state() -> dict:
    """The checkpoint train.py wrote in 2026-11, before the machinery moved into nmt/ (a tiny
    model on number words), as it was: its keys and values, the weights kept in state.json as
    raw bytes (the repo ships no .pt file)."""
    import base64
    import json
    state = json.loads((OLD_CHECKPOINT / "state.json").read_text(encoding="utf-8"))
    state["model_state_dict"] = {
        name: torch.frombuffer(bytearray(base64.b64decode(t["data"])),
                               dtype=getattr(torch, t["dtype"])).reshape(t["shape"])
        for name, t in state["model_state_dict"].items()}
    return state


def old_checkpoint(folder: Path) -> Path:
    """That checkpoint as train.py left it: folder/tmodel_best.pt and its tokenizers."""
    import shutil
    shutil.copytree(OLD_CHECKPOINT, folder, ignore=shutil.ignore_patterns("state.json"))
    torch.save(old_checkpoint_state(), folder / "tmodel_best.pt")
    return folder / "tmodel_best.pt"


def run_here(script: str, *args, cwd: Path, input: bytes = None):
    """What run_script returns, with the script's main run in this process, as its
    `__main__` block would (run_main: a user's error is one line and exit 2): no interpreter
    start-up (3-5 s of imports a run). Working folder, argv, stdin, the signal handlers, torch's
    thread count (`--threads`) and random state are put back after it, as a process's end
    would."""
    module = importlib.import_module(str(Path(script).with_suffix("")).replace("/", "."))
    argv = [str(a) for a in args]
    out, err, code = io.StringIO(), io.StringIO(), 0
    saved = (os.getcwd(), sys.argv, sys.stdin,
             {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)},
             torch.get_num_threads(), torch.get_rng_state())
    os.chdir(cwd)
    sys.argv = [str(ROOT / script), *argv]
    if input is not None:
        sys.stdin = io.TextIOWrapper(io.BytesIO(input), encoding="utf-8")
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            run_main(script, lambda: module.main(argv))
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else int(e.code is not None)
    finally:
        os.chdir(saved[0])
        sys.argv, sys.stdin = saved[1], saved[2]
        for s, handler in saved[3].items():
            signal.signal(s, handler)
        torch.set_num_threads(saved[4])
        torch.set_rng_state(saved[5])
    return subprocess.CompletedProcess([script, *argv], code, out.getvalue().encode(),
                                       err.getvalue().encode())


@pytest.fixture(scope="session")
def trained(tmp_path_factory):
    """train.py for 2 epochs on a tiny local corpus; the folder it ran in."""
    home = tmp_path_factory.mktemp("run")
    make_corpus(home / "corpus")
    result = run_here("train.py", "--data_dir", "corpus", *TINY, "--num_epochs", "2",
                      cwd=home)
    assert result.returncode == 0, result.stderr.decode()[-2000:]
    return home, result


# Small models built in the tests.

def tiny_model(vocab=20, seq_len=32, seed=0, **kw):
    torch.manual_seed(seed)
    kw = {"d_model": 32, "N": 2, "h": 4, "d_ff": 64, "dropout": 0.0, **kw}
    return build_transformer(vocab, vocab, seq_len, seq_len, **kw).eval()


def small(seed=0, vocab=24, **options):
    torch.manual_seed(seed)
    return build_transformer(vocab, vocab, 40, 40, **{"d_model": 16, "N": 2, "h": 4, "d_ff": 32,
                                                      "dropout": 0.0, **options}).eval()


def tiny_state(epoch=0, step=None, **extra):
    """A checkpoint's dict of a tiny model: per-epoch (the end of `epoch`), or with `step`
    mid-epoch (3 batches into `epoch`); `extra` adds or overrides keys."""
    model = build_transformer(20, 20, 16, 16, d_model=8, N=1, h=2, d_ff=16)
    return {"model_state_dict": model.state_dict(), "config": Config().to_dict(),
            "epoch": epoch, "global_step": step or epoch * 10 + 10,
            "next_epoch": epoch if step else epoch + 1, "next_batch": 3 if step else 0,
            **extra}


def swap_two_tokens(source: Path, target: Path):
    """A copy of the tokenizer file `source` at `target` with the ids of two tokens swapped:
    the same size and the same tokens, another tokenizer."""
    import json
    spec = json.loads(source.read_text(encoding="utf-8"))
    vocab = spec["model"]["vocab"]
    a, b = [token for token, i in vocab.items() if i in (10, 11)]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    target.write_text(json.dumps(spec), encoding="utf-8")
