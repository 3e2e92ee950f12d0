"""Everything about checkpoint files: what they hold, their names, atomic saving, safe loading
and its checks, what a resume must match, choosing what --preload means, pruning, averaging,
rebuilding a model from the config a checkpoint carries, and loading a trained model with its
tokenizers for inference (`load_translator`).

The format, defined here alone (`training_checkpoint`, `best_checkpoint`), checked here alone
(`load_checkpoint`, `resume_state`, `check_corpus`, `check_resume_data`). A checkpoint is a dict
of tensors and plain values (loaded with weights_only=True):

  format                2 (absent in files of earlier versions, which still load)
  model_state_dict      the weights
  config                the Config it was trained with, as a dict: rebuilds the model
  epoch                 the epoch it was saved in (counting from 0)
  global_step           optimizer steps taken
  corpus                {"source": --data_dir (absolute) or --datasource, "fingerprint": the
                        corpus files' names, sizes and times, or the hub dataset's fingerprints}

A training checkpoint (tmodel_05.pt after epoch 5, tmodel_05_s0001234.pt mid-epoch) adds what
an exact resume needs:

  optimizer_state_dict, scaler_state_dict
  next_epoch, next_batch  where training goes on (next_batch > 0: mid-epoch, so the resume
                        needs the same batch order: BATCH_ORDER_FIELDS and world_size)
  world_size            the processes (torchrun) that trained it
  rng_state             this process's random state (+ cuda_rng_state on a GPU), and under
  rank_rng_states       torchrun every rank's, in rank order
  schedule_steps        the run length the learning-rate schedule was laid out for

The best checkpoint (tmodel_best.pt) holds the weights only, and `validation`: the scores
that made it the best.
"""

import dataclasses
import json
import os
import pickle
import re
import shutil
import socket
import sys
import time
from pathlib import Path

import torch

from config import TRANSLATE_FIELDS, Config, UserError, fields_where
from model import build_transformer
from runtime import setup_device
from tokenizer import load_tokenizer, tokenizer_keys, tokenizer_path, tokenizer_recipe


class CheckpointError(UserError):
    """A checkpoint that cannot be found, saved or used."""


# ---- names --------------------------------------------------------------------------------------

def epoch_checkpoint_path(config: Config, epoch: int) -> Path:
    """weights/tmodel_05.pt: the state after epoch 5 (epochs count from 0)."""
    return Path(config.model_folder) / f"{config.model_basename}{epoch:02d}.pt"


def step_checkpoint_path(config: Config, epoch: int, global_step: int) -> Path:
    """weights/tmodel_05_s0012345.pt: a mid-epoch save during epoch 5 at that optimizer step."""
    return Path(config.model_folder) / f"{config.model_basename}{epoch:02d}_s{global_step:07d}.pt"


def best_checkpoint_path(config: Config) -> Path:
    """weights/tmodel_best.pt: the weights with the best validation BLEU (never pruned)."""
    return Path(config.model_folder) / f"{config.model_basename}best.pt"


def history_path(config: Config) -> Path:
    """weights/tmodel_validation.json: every validation's step, epoch and scores."""
    return Path(config.model_folder) / f"{config.model_basename}validation.json"


def list_checkpoints(config: Config):
    """All checkpoints of this run, oldest first, as (path, epoch, global_step or None).

    A per-epoch file sorts after every mid-epoch file of the same epoch."""
    folder = Path(config.model_folder)
    if not folder.is_dir():
        return []
    pattern = re.compile(re.escape(config.model_basename) + r"(\d+)(?:_s(\d+))?\.pt$")
    found = []
    for p in folder.iterdir():
        m = pattern.fullmatch(p.name)
        if m:
            step = int(m.group(2)) if m.group(2) else None
            found.append((p, int(m.group(1)), step))
    found.sort(key=lambda t: (t[1], t[2] is None, t[2] or 0))
    return found


def latest_checkpoint_path(config: Config):
    found = list_checkpoints(config)
    return found[-1][0] if found else None


def resolve_preload(config: Config):
    """The checkpoint `--preload` names, or None for a fresh start or an empty folder."""
    if config.preload == "none":
        return None
    if config.preload == "latest":
        return latest_checkpoint_path(config)
    if config.preload == "best":
        path = best_checkpoint_path(config)
        if not path.exists():
            raise CheckpointError(f"--preload best: no checkpoint {path} (it is written after "
                                  f"the first validation)")
        return path
    path = epoch_checkpoint_path(config, int(config.preload))
    if not path.exists():
        raise CheckpointError(f"--preload {config.preload}: no checkpoint {path}")
    return path


def prune_checkpoints(config: Config):
    """Keeps the newest keep_last mid-epoch checkpoints (none older than the newest per-epoch
    one, which supersedes them) and the newest keep_epochs per-epoch ones (0 = all)."""
    found = list_checkpoints(config)
    epochs = [c for c in found if c[2] is None]
    steps = [c for c in found if c[2] is not None]
    last_epoch = epochs[-1][1] if epochs else -1
    stale = [c for c in steps if c[1] <= last_epoch]
    fresh = [c for c in steps if c[1] > last_epoch]
    if config.keep_last:
        stale += fresh[:-config.keep_last]
    if config.keep_epochs:
        stale += epochs[:-config.keep_epochs]
    for path, _, _ in stale:
        path.unlink(missing_ok=True)


def check_writable(folder):
    """Creates `folder` and refuses, before any training, one that cannot be written."""
    folder = Path(folder)
    probe = folder / ".write-test"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise CheckpointError(f"--model_folder {folder} is not writable: {e.strerror}") from None


# ---- one writer per folder ----------------------------------------------------------------------

LOCK_NAME = ".train.lock"


class FolderLock:
    """The one training run that writes into a model folder: an exclusive advisory lock
    (flock) on `.train.lock` in it, taken by rank 0 for the life of the run. The kernel drops
    the lock when its process ends, however it ends (SIGKILL included), so a dead run's lock is
    free again; the file says who holds it, for the refusal. translate.py and export.py only
    read, and take no lock. Where flock does not exist (Windows), there is no lock."""

    def __init__(self, folder):
        self.path = Path(folder) / LOCK_NAME
        self.file = None

    def acquire(self):
        try:
            import fcntl
        except ImportError:
            return self
        while self.file is None:
            f = open(self.path, "a+", encoding="utf-8")
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                f.seek(0)
                holder = f.read().strip() or "another process"
                f.close()
                raise CheckpointError(f"{self.path.parent} is in use by another training run "
                                      f"({holder}); let it finish or stop it, or train into "
                                      f"another --model_folder") from None
            try:  # the holder may have released (removed) the file between our open and lock
                if os.fstat(f.fileno()).st_ino == os.stat(self.path).st_ino:
                    self.file = f
                    break
            except FileNotFoundError:
                pass
            f.close()
        self.file.seek(0)
        self.file.truncate()
        self.file.write(f"pid {os.getpid()} on {socket.gethostname()}, started "
                        f"{time.strftime('%Y-%m-%d %H:%M')}: {' '.join(sys.argv)}")
        self.file.flush()
        return self

    def release(self):
        if self.file is not None:
            self.path.unlink(missing_ok=True)  # still held: a process waiting opens a new file
            self.file.close()  # and this drops the lock
            self.file = None


# ---- saving and loading -------------------------------------------------------------------------

def save_checkpoint(state: dict, path: Path):
    """Atomic save: a temporary file in the same folder, flushed to disk, then renamed over
    `path`. A crash at any instant leaves either the old file or the new one, never half."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with open(tmp, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise CheckpointError(f"could not write checkpoint {path}: {e.strerror or e}; the "
                              f"checkpoints already saved are untouched") from None


FORMAT = 2
CHECKPOINT_KEYS = ("model_state_dict", "config", "epoch", "global_step")


def training_checkpoint(run, step: int, epoch: int, next_epoch: int, next_batch: int,
                        rng: list, provenance: dict = None) -> dict:
    """The checkpoint of a training run (train.Run) at optimizer step `step` in `epoch`, that
    continues at (next_epoch, next_batch); `rng`: every rank's random state, in rank order;
    `provenance`: the commands that made the run and its training time (the model card)."""
    return {
        "format": FORMAT, "model_state_dict": run.model.state_dict(),
        "config": run.config.to_dict(), "epoch": epoch, "global_step": step,
        "corpus": run.data.corpus,
        "optimizer_state_dict": run.optimizer.state_dict(),
        "scaler_state_dict": run.scaler.state_dict() if run.scaler.is_enabled() else {},
        "next_epoch": next_epoch, "next_batch": next_batch, "world_size": run.world_size,
        **rng[0], "rank_rng_states": rng if run.world_size > 1 else None,
        "schedule_steps": run.schedule_steps, "provenance": provenance or {},
    }


def best_checkpoint(run, step: int, epoch: int, validation: dict) -> dict:
    """The weights and config of a training run at `step`, with the validation scores that
    made them the best."""
    return {"format": FORMAT, "model_state_dict": run.model.state_dict(),
            "config": run.config.to_dict(), "epoch": epoch, "global_step": step,
            "corpus": run.data.corpus, "validation": validation}


def load_checkpoint(path: Path, mmap: bool = False) -> dict:
    """Loads with weights_only=True: only tensors and plain values, so a crafted file cannot run
    code. `mmap`: the tensors stay in the file, read only when used (averaging reads the
    weights and never the optimizer's moments). Raises CheckpointError with one short line
    naming the file for anything unusable."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint {path} not found")
    try:
        with open(path, "rb") as f:
            head = f.read(4)
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except PermissionError as e:
        raise CheckpointError(f"cannot read checkpoint {path}: {e.strerror}") from None
    except pickle.UnpicklingError as e:
        unsafe = re.search(r"GLOBAL ([\w.]+)", str(e))
        if unsafe or "global" in str(e).lower():  # a class or function: code that would run
            what = f" ({unsafe.group(1)})" if unsafe else ""
            raise CheckpointError(f"checkpoint {path} refused: it holds a pickled object{what}, "
                                  f"which could run code when loaded; a checkpoint of this "
                                  f"project holds tensors and plain values only") from None
        raise CheckpointError(unreadable(path, head)) from None
    except (RuntimeError, EOFError, OSError, ValueError):
        raise CheckpointError(unreadable(path, head)) from None
    if not isinstance(state, dict) or any(k not in state for k in CHECKPOINT_KEYS):
        raise CheckpointError(f"{path} is not a checkpoint of this project (it lacks "
                              f"{', '.join(CHECKPOINT_KEYS)})")
    if not isinstance(state["config"], dict):
        raise CheckpointError(f"checkpoint {path} has no config dict")
    return state


def unreadable(path: Path, head: bytes) -> str:
    """What to say of a file torch cannot load: a damaged checkpoint, or no checkpoint."""
    if head.startswith(b"PK"):  # a zip archive, torch's format: cut short or damaged
        return (f"checkpoint {path} is truncated or damaged (an interrupted copy?); use "
                f"another, such as an earlier epoch with --preload NN")
    kind = "a JSON file" if head[:1] in (b"{", b"[") else "not a PyTorch checkpoint"
    return f"{path} is {kind}, not a checkpoint: give a tmodel_*.pt file"


def check_vocab(state: dict, path: Path, src_vocab_size: int, tgt_vocab_size: int):
    """Refuses a checkpoint whose embedding sizes differ from the tokenizer files'."""
    weights = state["model_state_dict"]
    for name, key, size in (("source", "src_embed.embedding.weight", src_vocab_size),
                            ("target", "tgt_embed.embedding.weight", tgt_vocab_size)):
        if key not in weights:
            raise CheckpointError(f"checkpoint {path} has no {key}: not a model of this project")
        if weights[key].shape[0] != size:
            raise CheckpointError(f"checkpoint {path} has a {name} vocabulary of "
                                  f"{weights[key].shape[0]} but the tokenizer file has {size}: "
                                  f"it was trained with other tokenizers; give the folder it was "
                                  f"trained in (its tokenizer files lie there) as --model_folder")


# ---- a checkpoint's config and model ------------------------------------------------------------

def merge_config(saved: Config, current: Config, given: set, path, overrides: set) -> Config:
    """The config to continue a checkpoint with. The checkpoint's values, except: the run
    fields (where the run works: model folder, device) come from `current` always, and the
    `overrides` the user gave win. A model field given with another value than the
    checkpoint's is refused: the architecture is fixed once trained."""
    for name in sorted(given & fields_where(group="model") - overrides):
        if getattr(current, name) != getattr(saved, name):
            new, old = getattr(current, name), getattr(saved, name)
            raise CheckpointError(
                f"--{name} {new} does not match {path}: it was trained with --{name} {old}, "
                f"not {new}; the architecture is fixed once trained: drop the flag, or train "
                f"into another --model_folder")
    merged = dataclasses.replace(saved)
    for name in fields_where(group="run") | (given & overrides):
        setattr(merged, name, getattr(current, name))
    return merged


def build_model(config: Config, src_vocab_size: int, tgt_vocab_size: int):
    """The Transformer that `config` describes (what a checkpoint's config rebuilds)."""
    return build_transformer(src_vocab_size, tgt_vocab_size, config.seq_len, config.seq_len,
                             d_model=config.d_model, N=config.N,
                             N_dec=config.decoder_layers(), h=config.h,
                             dropout=config.dropout, d_ff=config.d_ff,
                             attention_dropout=config.attention_dropout,
                             activation_dropout=config.activation_dropout,
                             tie_embeddings=config.tie_embeddings, norm_first=config.norm_first,
                             norm=config.norm, ffn=config.ffn, pos=config.pos,
                             n_kv_heads=config.n_kv_heads or None,
                             shared_vocab=config.shared_vocab)


def load_model_weights(model, state: dict, path: Path):
    """load_state_dict, with an architecture mismatch as one CheckpointError line."""
    try:
        model.load_state_dict(state["model_state_dict"])
    except RuntimeError as e:
        lines = [line.strip() for line in str(e).splitlines() if line.strip()]
        detail = lines[1] if len(lines) > 1 else lines[0]
        raise CheckpointError(f"checkpoint {path} does not fit this architecture: "
                              f"{detail[:300]}") from None


def average_checkpoints(paths):
    """The element-wise mean of the model weights of several checkpoints (the paper averages
    the last 5), as a running sum in float64: one checkpoint is read at a time, memory-mapped,
    so the peak is the sum (twice the float32 weights) and one checkpoint's weights; the
    optimizer's moments are never read. Returns the newest checkpoint's config and position
    with the averaged weights."""
    total, first = None, None
    for path in paths:
        state = load_checkpoint(path, mmap=True)
        weights = state["model_state_dict"]
        if total is None:
            total, first = {k: v.double() if v.is_floating_point() else v.clone()
                            for k, v in weights.items()}, path
        elif weights.keys() != total.keys() or any(
                weights[k].shape != total[k].shape for k in total):
            raise CheckpointError(f"cannot average {path} with {first}: different architectures")
        else:
            for k, v in weights.items():
                total[k] = total[k].add_(v) if v.is_floating_point() else v.clone()
        if path != paths[-1]:
            del state, weights  # before the next file is read
    dtypes = {k: v.dtype for k, v in weights.items()}
    averaged = {k: (v / len(paths)).to(dtypes[k]) if v.is_floating_point() else v
                for k, v in total.items()}
    keep = {k: v for k, v in state.items() if k in ("format", "config", "epoch",
                                                     "global_step", "corpus", "next_epoch")}
    return {**keep, "model_state_dict": averaged}


def load_averaged(config: Config, path: Path, average: int):
    """(state, paths): the state of `path`, or with average > 1 the mean of the newest
    `average` per-epoch checkpoints up to the epoch `path` holds (mid-epoch files never take
    part: they are not the end of an epoch, and they overlap the per-epoch ones)."""
    if average <= 1:
        return load_checkpoint(path), [path]
    state = load_checkpoint(path, mmap=True)
    last = state.get("next_epoch", state["epoch"] + 1) - 1  # the last epoch `path` finished
    paths = [p for p, epoch, step in list_checkpoints(config) if step is None and epoch <= last]
    paths = paths[-average:]
    if len(paths) < average:
        raise CheckpointError(f"--average {average}: only {len(paths)} per-epoch "
                              f"checkpoint(s) up to {path.name} in {path.parent}")
    return average_checkpoints(paths), paths


def read_history(config: Config, up_to_step: int = None) -> list:
    """The validations recorded in this run folder (those after `up_to_step` belong to a
    line of training abandoned by --preload, and are left out)."""
    path = history_path(config)
    if not path.exists():
        return []
    try:
        history = json.loads(path.read_text(encoding="utf-8"))
        return [h for h in history if up_to_step is None or h["step"] <= up_to_step]
    except (OSError, ValueError, TypeError, KeyError) as e:
        raise CheckpointError(f"{path} is unreadable ({type(e).__name__}); it is the validation "
                              f"history the best checkpoint is chosen by: mend it or move it "
                              f"away, then resume") from None


def write_text_atomic(path: Path, text: str):
    """A temporary file beside `path`, then renamed over it: never a half-written file. A
    full disk is one line, and `path` keeps what it held."""
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise CheckpointError(f"could not write {path}: {e.strerror or e}; the files already "
                              f"saved are untouched") from None


def write_history(config: Config, history: list):
    write_text_atomic(history_path(config), json.dumps(history, indent=1))


# ---- random state -------------------------------------------------------------------------------

def rng_states(device) -> dict:
    """The random state that dropout draws from: the CPU generator's, and on CUDA the
    device's own (without it a resumed GPU run restarts its dropout stream)."""
    states = {"rng_state": torch.get_rng_state()}
    if device.type == "cuda":
        states["cuda_rng_state"] = torch.cuda.get_rng_state(device)
    return states


def set_rng_states(state: dict, device):
    if "rng_state" in state:
        torch.set_rng_state(state["rng_state"])
    if device.type == "cuda" and "cuda_rng_state" in state:
        torch.cuda.set_rng_state(state["cuda_rng_state"], device)


# ---- what train.py resumes from, and what a resume must match ----------------------------------

# The settings that fix the order of an epoch's batches: a mid-epoch checkpoint needs them.
BATCH_ORDER_FIELDS = ("max_tokens", "batch_size", "seed", "accum_steps")


def refuse_to_overwrite(config: Config):
    """A fresh start writes a new best checkpoint, validation history and test results: refused
    in a folder that holds a run's files (--preload none there, or --preload latest where the
    checkpoints were deleted but the best checkpoint or the history remain)."""
    found = [p.name for p, _, _ in list_checkpoints(config)[-1:]]
    found += [p.name for p in (best_checkpoint_path(config), history_path(config),
                               Path(config.model_folder) / "results.json") if p.exists()]
    if not found:
        return
    if config.preload == "none":
        raise CheckpointError(
            f"{config.model_folder} already holds a run ({', '.join(found)}); --preload none "
            f"would overwrite it: resume with --preload latest or train into another "
            f"--model_folder")
    raise CheckpointError(
        f"{config.model_folder} holds a run's files ({', '.join(found)}) but no checkpoint to "
        f"resume from; a fresh start would overwrite them: train into another --model_folder, "
        f"or move them away")


def resume_state(config: Config, given: set, world_size: int = 1):
    """The checkpoint --preload names (None for a fresh start) as (path, state), and the config
    to train with: flags given on the command line win; the rest comes from the checkpoint.
    Refuses what cannot continue the saved run exactly (see the module docstring)."""
    if config.preload == "best":
        raise CheckpointError("--preload best is for translate.py (the best checkpoint holds "
                              "the weights only); resume training with latest or an epoch")
    path = resolve_preload(config)
    if path is None:
        refuse_to_overwrite(config)
        return None, config
    state = load_checkpoint(path)
    saved = Config.from_dict(state["config"])
    overrides = {f.name for f in dataclasses.fields(Config)} - fields_where(group="model")
    merged = merge_config(saved, config, given, path, overrides)
    if state.get("next_batch"):  # mid-epoch: the rest of the epoch needs the same batches
        for name in BATCH_ORDER_FIELDS:
            if getattr(saved, name) != getattr(merged, name):
                raise CheckpointError(
                    f"{path} was saved mid-epoch with --{name} {getattr(saved, name)}; resume "
                    f"it with the same value (the epoch's batch order depends on it), or from a "
                    f"per-epoch checkpoint with --preload N")
        saved_world = state.get("world_size", 1)
        if saved_world != world_size:
            raise CheckpointError(
                f"{path} was saved mid-epoch by {saved_world} process(es) and this run has "
                f"{world_size}: the rest of that epoch's batches are shared out by the number "
                f"of processes; resume it with {saved_world}, or from a per-epoch checkpoint "
                f"with --preload N")
    problem = merged.validate()
    if problem:
        raise CheckpointError(f"with the resumed checkpoint's settings: {problem}")
    return (path, state), merged


def check_corpus(state: dict, path: Path, corpus: dict):
    """Refuses to resume on another corpus than the checkpoint was trained on (another epoch
    length, another validation set for the best checkpoint): called before any data is
    prepared. Checkpoints of earlier versions do not record their corpus."""
    saved = state.get("corpus")
    if saved and saved["fingerprint"] != corpus["fingerprint"]:
        same = saved["source"] == corpus["source"]
        raise CheckpointError(
            f"{path} was trained on {'another version of ' if same else ''}the corpus "
            f"{saved['source']}" + ("" if same else f", not {corpus['source']}")
            + (" (its files changed since: names, sizes or modification times)" if same else "")
            + "; resume with that corpus, or train on this one into another --model_folder")


def check_resume_data(state: dict, path: Path, config: Config, data):
    """The checks a resume makes once the data is loaded: the vocabulary sizes of the
    tokenizers, and a validation split held out of train by the same seed."""
    check_vocab(state, path, data.tokenizer_src.get_vocab_size(),
                data.tokenizer_tgt.get_vocab_size())
    check_split(state, path, config, data.held_out)


def check_split(state: dict, path: Path, config: Config, held_out: bool):
    """A corpus without a validation split of its own has one drawn from train with --seed and
    --val_fraction: resuming with other values would move training pairs into validation."""
    if not held_out:
        return
    for name in ("seed", "val_fraction"):
        saved = state["config"].get(name)
        if saved != getattr(config, name):
            raise CheckpointError(
                f"{path} was trained with --{name} {saved}, which drew its validation pairs "
                f"from the training split (the corpus has none of its own); resume with "
                f"--{name} {saved}, or train into another --model_folder")


def restore_training(state: dict, path: Path, model, optimizer, scaler):
    """Loads a training checkpoint's weights, optimizer and gradient-scaler state."""
    load_model_weights(model, state, path)
    optimizer.load_state_dict(state["optimizer_state_dict"])
    if state.get("scaler_state_dict"):
        scaler.load_state_dict(state["scaler_state_dict"])


def restore_rng(state: dict, rank: int, world_size: int, device, seed: int):
    """This rank's saved random state (dropout goes on exactly); with another number of
    processes than saved (allowed between epochs only), a fresh dropout stream per rank."""
    ranks = state.get("rank_rng_states")
    if world_size == 1 and not ranks:
        set_rng_states(state, device)
    elif ranks and len(ranks) == world_size:
        set_rng_states(ranks[rank], device)
    else:
        torch.manual_seed(seed + rank + state["global_step"])


def set_aside_later(config: Config, path: Path):
    """Training on from an earlier epoch (--preload N) starts a new line of training: the
    checkpoints saved after `path`, a best checkpoint and test results from after it belong to
    the abandoned line. They are moved, never deleted, into a subfolder (with a copy of the
    validation history, whose later entries the new line drops), so that pruning and
    --preload latest see the new line only."""
    found = [p for p, _, _ in list_checkpoints(config)]
    later = found[found.index(path) + 1:] if path in found else []
    best = best_checkpoint_path(config)
    if best.exists() and load_checkpoint(best, mmap=True)["epoch"] > int(config.preload):
        later.append(best)
    if not later:
        return
    folder = Path(config.model_folder) / f"superseded_{time.strftime('%Y%m%d-%H%M%S')}"
    folder.mkdir()
    results = Path(config.model_folder) / "results.json"
    for p in later + ([results] if results.exists() else []):
        os.replace(p, folder / p.name)
    if history_path(config).exists():
        shutil.copy2(history_path(config), folder / history_path(config).name)
    print(f"--preload {config.preload}: moved {len(later)} later checkpoint(s) "
          f"({', '.join(p.name for p in later)}) to {folder}; training goes on from {path.name}")


# ---- a trained model for inference (translate.py, export.py, the benchmarks) --------------------

def with_tokenizers(config: Config):
    """(config, tokenizer_src, tokenizer_tgt): a translate-time config, checked, with the
    tokenizer files it names (in its model folder)."""
    problem = config.validate()
    if problem:
        raise CheckpointError(problem)
    tokenizer_src, tokenizer_tgt = (
        load_tokenizer(tokenizer_path(config, key), config.tokenizer_type,
                       tokenizer_recipe(config, key)) for key in tokenizer_keys(config))
    return config, tokenizer_src, tokenizer_tgt


def load_translator(config: Config, given=frozenset(), checkpoint=None, average: int = 1):
    """(model, config, tokenizer_src, tokenizer_tgt): the checkpoint file `checkpoint`, or the
    one --preload names in --model_folder (the newest by default), rebuilt from its own config.
    `config` holds the command line's values; `given` names the flags the user set."""
    if checkpoint:
        path = Path(checkpoint)
        if "model_folder" not in given:  # the tokenizers live beside the checkpoint
            config.model_folder = str(path.parent)
    else:
        path = resolve_preload(config)
        if path is None:
            raise CheckpointError(f"no checkpoint in {config.model_folder}/ (train one with "
                                  f"python train.py, or pass --checkpoint PATH)")
    state, paths = load_averaged(config, path, average)
    if len(paths) > 1:
        loaded = f"the average of {', '.join(str(p) for p in paths)}"
        print(f"averaged {len(paths)} checkpoints: {', '.join(p.name for p in paths)}",
              file=sys.stderr)
    else:
        loaded = f"{path} (epoch {state['epoch']}, step {state['global_step']})"
        print(f"loaded {loaded}", file=sys.stderr)
    config, tokenizer_src, tokenizer_tgt = with_tokenizers(
        merge_config(Config.from_dict(state["config"]), config, given, path, TRANSLATE_FIELDS))
    check_vocab(state, path, tokenizer_src.get_vocab_size(), tokenizer_tgt.get_vocab_size())
    device = setup_device(config.device)
    model = build_model(config, tokenizer_src.get_vocab_size(), tokenizer_tgt.get_vocab_size())
    load_model_weights(model, state, path)
    model.loaded_from = loaded  # said by export.py
    return model.to(device).eval(), config, tokenizer_src, tokenizer_tgt
