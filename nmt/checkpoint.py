"""Checkpoint files: what they hold, their names, saving (atomic), loading (safe) and its
checks, what --preload names, pruning, averaging, and the config a checkpoint is continued or
loaded with (`merge_config`). What a resume must match is resume.py's; rebuilding a model from a
checkpoint's config, trained_model.py's.

The format, defined here alone (`training_checkpoint`, `best_checkpoint`), checked on loading
here (`load_checkpoint`) and on resuming in resume.py. A checkpoint is a dict of tensors and
plain values (loaded with weights_only=True):

  format                2 (absent in files of earlier versions, which still load)
  model_state_dict      the weights
  config                the Config it was trained with, as a dict: rebuilds the model
  epoch                 the epoch it was saved in (counting from 0)
  global_step           optimizer steps taken
  corpus                {"source": --data_dir (absolute) or --datasource, "fingerprint": the
                        corpus files' names and contents (version 2; their names, sizes and
                        times before), or the hub dataset's fingerprints, with the teachers' and
                        extra pairs' where there are; "text": the corpus's alone; "validation": a
                        digest of the validation split's pairs (translate.py --example checks
                        by it); "version"}
  tokenizers            [source, target]: the tokenizers' fingerprints (their vocabulary and
                        merges; absent in earlier versions): checked wherever the checkpoint
                        meets tokenizer files
  coverage              {"source", "target"}: what the tokenizers made of the validation texts
                        (tokenizer.coverage; absent in earlier versions): --init_from compares
                        a new corpus with it

A training checkpoint (tmodel_05.pt after epoch 5, tmodel_05_s0001234.pt mid-epoch) adds what
an exact resume needs:

  optimizer_state_dict, scaler_state_dict (Adam's moments: twice the weights' size; kept
                        in the run's newest checkpoint and the newest --keep_optimizer
                        per-epoch ones, stripped from the others by prune_checkpoints)
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
import hashlib
import os
import pickle
import re
import shutil
from pathlib import Path

import torch

from config import Config, UserError, drop_flag, fields_where
from tokenizer import tokenizer_fingerprints


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


CARD_NAME, CURVE_NAME = "MODEL_CARD.md", "validation_curve.png"  # a finished run's (model_card)


def card_step(folder):
    """The optimizer step a run's model card was written at (its end), or None without one:
    a card of an earlier end (a run lengthened since) does not say this end is done."""
    try:  # (a card saved again in another encoding: its line is ASCII)
        text = (Path(folder) / CARD_NAME).read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None
    found = re.search(r"^- (\d+) optimizer steps in ", text, re.MULTILINE)
    return int(found.group(1)) if found else None


def run_files(config: Config) -> list:
    """The names of the files a run's validations and test scoring left in its folder (the
    best checkpoint, the history, results.json): a fresh start there would overwrite them."""
    return [p.name for p in (best_checkpoint_path(config), history_path(config),
                             Path(config.model_folder) / "results.json") if p.exists()]


def start_again(config: Config, fix: str = "it") -> str:
    """How a run stopped before it saved a checkpoint goes on with `fix` (the end of the
    divergence and out-of-memory lines): the same command again, or, where a validation
    already left its files, into another folder."""
    found = run_files(config)
    if found:
        return (f"nothing to resume from in {config.model_folder}, whose {', '.join(found)} a "
                f"fresh start would overwrite: run the same command again with {fix} and "
                f"another --model_folder")
    return (f"run the same command again with {fix} (nothing was saved in "
            f"{config.model_folder} yet)")


def resolve_preload(config: Config, training: bool = False):
    """The checkpoint `--preload` names, or None for a fresh start or an empty folder.
    `training`: train.py's (best is translate.py's; the advice is a run's). A value that is no
    epoch number is a ValueError (Config.validate says it in words)."""
    if config.preload == "none":
        return None
    if config.preload == "latest":
        return latest_checkpoint_path(config)
    if config.preload == "best" and training:
        raise CheckpointError("--preload best is for translate.py (the best checkpoint holds "
                              "the weights only); resume training with latest or an epoch")
    if config.preload != "best" and not config.preload.isdecimal():
        raise ValueError(f"--preload {config.preload}: not an epoch number")
    if config.preload == "best":
        path = best_checkpoint_path(config)
        if not path.exists():
            raise CheckpointError(f"--preload best: no checkpoint {path}" + (
                " (it is written after the first validation)" if list_checkpoints(config)
                else not_named(config)))
        return path
    path = epoch_checkpoint_path(config, int(config.preload))
    if not path.exists():
        found = list_checkpoints(config)
        raise CheckpointError(f"--preload {config.preload}: no checkpoint {path}" + (
            f" ({saved_there(found)}; --preload latest for the newest checkpoint)" if found
            else not_named(config, training)))
    return path


def saved_there(found) -> str:
    """What a folder holds (list_checkpoints' `found`, not empty), for a --preload N that
    names none of its checkpoints."""
    epochs = [f"{epoch:02d}" for _, epoch, step in found if step is None]
    if not epochs:
        return f"only mid-epoch checkpoints there, the newest {found[-1][0].name}"
    shown = epochs if len(epochs) <= 8 else epochs[:3] + ["..."] + epochs[-3:]
    return f"the epochs saved there: {', '.join(shown)}"


def translation_checkpoint(config: Config, given: set, average: int = 1, saves: bool = False):
    """(path, why) of the checkpoint translate.py and export.py load from --model_folder: the one
    --preload names where it is given, or with --average N (`saves`: --average_saves) the newest
    (the newest N checkpoints up to it are averaged: load_averaged); else the best by validation
    BLEU where there is one, the newest where there is none yet. `why`: the choice said in words
    (None for a --preload given). A folder that does not exist, or holds no checkpoint, is one
    line."""
    folder = Path(config.model_folder)
    if folder.is_file():
        raise CheckpointError(f"--model_folder {config.model_folder} is a file, not a folder: "
                              f"give it as --checkpoint {config.model_folder}")
    if not folder.is_dir():
        beside = folders_with_checkpoints(folder.parent) if folder.parent.is_dir() else []
        raise CheckpointError(
            f"--model_folder {config.model_folder}: no such folder" + (
                f" (model folders beside it: {', '.join(beside[:6])})" if beside else
                f" (train a model into it with python train.py --model_folder "
                f"{config.model_folder} ..., or pass --checkpoint PATH)"))
    if "preload" in given and config.preload == "none":
        raise CheckpointError("--preload none loads no checkpoint, and a trained model "
                              "comes from one: leave --preload out, or give best, latest or an "
                              "epoch number")
    if "preload" in given or average > 1 or saves:
        path, why = resolve_preload(config), None
    elif best_checkpoint_path(config).exists():
        path, why = best_checkpoint_path(config), ("the best by validation BLEU; --preload "
                                                   "latest for the newest")
    else:
        path, why = latest_checkpoint_path(config), ("the newest: no best checkpoint yet (it "
                                                     "is written at the first validation)")
    if path is None:  # (--preload latest or --average where the best alone is there: said)
        what = "per-epoch checkpoint" if best_checkpoint_path(config).exists() else "checkpoint"
        raise CheckpointError(f"no {what} in {config.model_folder}/" + not_named(config))
    return path, why


def folders_with_checkpoints(folder) -> list:
    """The folders below `folder` that hold checkpoints, by name."""
    return sorted(str(sub) for sub in Path(folder).iterdir()
                  if sub.is_dir() and any(sub.glob("*.pt")))


def basenames(folder, known=()) -> list:
    """The --model_basename of each run's checkpoints in `folder` (tmodel_ of tmodel_03.pt,
    tmodel_03_s0000120.pt and tmodel_best.pt), sorted. A file is a `known` basename's, or a
    best checkpoint's run's, where it fits their names (run2's run200.pt is its epoch 0, not
    run's epoch 200); the others are read with the shortest basename."""
    files = [p.name for p in Path(folder).glob("*.pt")]
    known = {*known, *(f[:-len("best.pt")] for f in files if f.endswith("best.pt"))} - {""}
    names = set()
    for f in files:
        owner = next((n for n in known if re.fullmatch(
            re.escape(n) + r"(?:\d+(?:_s\d+)?|best)\.pt", f)), None)
        match = owner is None and re.fullmatch(r"(.+?)(?:\d+(?:_s\d+)?|best)\.pt", f)
        names.add(owner or (match.group(1) if match else None))
    return sorted(names - {None})


def not_named(config: Config, training: bool = False) -> str:
    """What to say where --model_folder holds no checkpoint named with --model_basename: the
    basenames of the checkpoints it does hold, or that it holds the best alone (a folder copied
    to translate with), else elsewhere's advice (`training`: that a run starts there)."""
    names = sorted(set(basenames(config.model_folder, [config.model_basename]))
                   - {config.model_basename})
    if not names and best_checkpoint_path(config).exists():
        return (f" (only the best checkpoint is there, {best_checkpoint_path(config).name}, "
                f"which translate.py and export.py take without --preload and --average)")
    if not names and training and not (Path(config.model_folder).is_dir() and
                                       folders_with_checkpoints(config.model_folder)):
        return "" if run_files(config) else \
            " (it holds no checkpoint: without --preload a run starts there)"
    if not names and not training and (Path(config.model_folder) / "model.bin").is_file():
        return (f" (it holds a model exported for CTranslate2: give it as --ctranslate2 "
                f"{config.model_folder})")
    if not names:
        return elsewhere(config.model_folder)
    return (f" (no file there is named {config.model_basename}*.pt; its checkpoints are named "
            f"{', '.join(n + '*.pt' for n in names)}: give --model_basename {names[0]})")


def elsewhere(folder, flag: str = "--model_folder") -> str:
    """What to say when `folder` holds no checkpoint: the folders below it that do (a preset
    trains into weights/<preset>), to give as `flag`, or how to make one."""
    found = folders_with_checkpoints(folder) if Path(folder).is_dir() else []
    if not found:
        return (f" (train a model into it with python train.py --model_folder {folder} ..., or "
                f"pass --checkpoint PATH)"
                if flag == "--model_folder" else " (give a trained model's folder or file)")
    return (f"; these folders below it hold checkpoints: {', '.join(found[:6])}"
            f"{' ...' if len(found) > 6 else ''} (give one as {flag})")


def prune_checkpoints(config: Config):
    """Keeps the newest keep_last mid-epoch checkpoints --save_every wrote (those at its
    multiples), a stop's mid-epoch checkpoint only while it is the run's newest, and the newest
    keep_epochs per-epoch ones (0 = all); a pruned file's temporary copy (a save or strip cut
    short by a kill) goes with it. The run's newest checkpoint (what
    --preload latest resumes from) and the newest keep_optimizer per-epoch ones keep their
    optimizer state; the others, which only translation and averaging read, keep the weights
    (keep_optimizer 0: all keep it)."""
    found = list_checkpoints(config)
    epochs = [c for c in found if c[2] is None]
    steps = [c for c in found if c[2] is not None]
    every = config.save_every  # (this start's: a save off its multiples counts as a stop)
    saves = [c for c in steps if every and c[2] % every == 0]  # (not the stops)
    newest = [c for c in found[-1:] if c[2] is not None]  # (a stop's: what a resume needs)
    kept = (saves[-config.keep_last:] if config.keep_last else saves) + newest
    stale = [c for c in steps if c not in kept]
    if config.keep_epochs:
        stale += epochs[:-config.keep_epochs]
    for path, _, _ in stale:
        path.unlink(missing_ok=True)
        path.with_name(f".{path.name}.tmp").unlink(missing_ok=True)  # (a save or strip cut)
    if config.keep_optimizer:
        for path, _, _ in epochs[:-config.keep_optimizer] + steps:  # (the stale ones: gone)
            if path != found[-1][0] and path.exists():
                strip_optimizer(path)


RESUME_ONLY = ("optimizer_state_dict", "scaler_state_dict")


def strip_optimizer(path: Path):
    """Rewrites a training checkpoint without the optimizer's moments (two floats per weight):
    the weights, config and position stay, which translation and averaging need; resuming from
    it is refused (resume.py). Atomic, like every save."""
    state = load_checkpoint(path, mmap=True)
    if any(key in state for key in RESUME_ONLY):
        save_checkpoint({k: v for k, v in state.items() if k not in RESUME_ONLY}, path)


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
    except (OSError, RuntimeError) as e:
        if not isinstance(e, OSError) and "inline_container" not in str(e):
            raise  # (torch's zip writer reports a write cut short, a full disk, as this)
        tmp.unlink(missing_ok=True)
        why = getattr(e, "strerror", None) or (
            f"the write stopped short ({shutil.disk_usage(path.parent).free / 2**20:,.0f} MiB "
            f"free on its disk)" if not isinstance(e, OSError) else e)
        raise CheckpointError(f"could not write checkpoint {path}: {why}; the checkpoints "
                              f"already saved are untouched") from None


FORMAT = 2
CHECKPOINT_KEYS = ("model_state_dict", "config", "epoch", "global_step")
BEST_KEYS = (*CHECKPOINT_KEYS, "corpus", "tokenizers", "coverage")  # (+ "validation")


def training_checkpoint(run, step: int, epoch: int, next_epoch: int, next_batch: int,
                        rng: list, provenance: dict = None) -> dict:
    """The checkpoint of a training run (train.Run) at optimizer step `step` in `epoch`, that
    continues at (next_epoch, next_batch); `rng`: every rank's random state, in rank order;
    `provenance`: the commands that made the run and its training time (the model card)."""
    return {
        "format": FORMAT, "model_state_dict": run.model.state_dict(),
        "config": run.config.to_dict(), "epoch": epoch, "global_step": step,
        "corpus": run.data.corpus, "tokenizers": run.data.tokenizers,
        "coverage": run.data.coverage, "optimizer_state_dict": run.optimizer.state_dict(),
        "scaler_state_dict": run.scaler.state_dict() if run.scaler.is_enabled() else {},
        "next_epoch": next_epoch, "next_batch": next_batch, "world_size": run.world_size,
        **rng[0], "rank_rng_states": rng if run.world_size > 1 else None,
        "schedule_steps": run.steps(), "provenance": provenance or {},
    }


def best_checkpoint(run, step: int, epoch: int, validation: dict) -> dict:
    """The weights and config of a training run at `step`, with the validation scores that
    made them the best."""
    return {"format": FORMAT, "model_state_dict": run.model.state_dict(),
            "config": run.config.to_dict(), "epoch": epoch, "global_step": step,
            "corpus": run.data.corpus, "tokenizers": run.data.tokenizers,
            "coverage": run.data.coverage, "validation": validation}


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
    except (RuntimeError, EOFError, OSError, ValueError, IndexError, KeyError):  # (the last
        raise CheckpointError(unreadable(path, head)) from None  # two: the unpickler's on text)
    if not isinstance(state, dict) or any(k not in state for k in CHECKPOINT_KEYS):
        raise CheckpointError(f"{path} is not a checkpoint of this project (it lacks "
                              f"{', '.join(CHECKPOINT_KEYS)})")
    if not isinstance(state["config"], dict):
        raise CheckpointError(f"checkpoint {path} has no config dict")
    return state


def unreadable(path: Path, head: bytes) -> str:
    """What to say of a file torch cannot load: a damaged checkpoint, or no checkpoint."""
    instead = "use another: --preload NN, or a new run from one's weights (--init_from FILE " \
        "--model_folder NEW)"
    if head.startswith(b"PK"):  # a zip archive, torch's format: cut short or damaged
        return f"checkpoint {path} is truncated or damaged (an interrupted copy?); {instead}"
    if Path(path).name.startswith("tmodel_"):  # one of a run's, its bytes not a checkpoint's
        return f"checkpoint {path} is damaged (its bytes are not a PyTorch checkpoint); {instead}"
    kind = "a JSON file, not a checkpoint" if head[:1] in (b"{", b"[") else \
        "not a PyTorch checkpoint"
    return f"{path} is {kind}: give a tmodel_*.pt file"


def check_tokenizers(state: dict, path: Path, tokenizer_src, tokenizer_tgt):
    """Refuses a checkpoint that meets tokenizers other than those it was trained with: another
    vocabulary size (the embeddings' rows), or, for checkpoints that record them, another
    fingerprint (a file swapped for another of the same size; either form of
    tokenizer.tokenizer_fingerprints: checkpoints written under tokenizers < 0.20 before
    2026-11 record the second)."""
    weights = state["model_state_dict"]
    saved = state.get("tokenizers") or [None, None]  # absent in checkpoints of earlier versions
    for name, prefix, tok, was in zip(("source", "target"), ("src", "tgt"),
                                      (tokenizer_src, tokenizer_tgt), saved):
        key = f"{prefix}_embed.embedding.weight"
        if key not in weights:
            raise CheckpointError(f"checkpoint {path} has no {key}: not a model of this project")
        size, known = tok.get_vocab_size(), tokenizer_fingerprints(tok)
        now = known[0]
        if weights[key].shape[0] != size or was not in (None, *known):
            found = (f"a vocabulary of {size}, not {weights[key].shape[0]}"
                     if weights[key].shape[0] != size else f"the same size, but other tokens or "
                     f"merges: fingerprint {now}, not {was}")
            raise CheckpointError(f"checkpoint {path} was trained with another {name} tokenizer "
                                  f"than the file here ({found}); give the folder it was trained "
                                  f"in (its tokenizer files lie there) as --model_folder")


# ---- a checkpoint's config and model ------------------------------------------------------------

def merge_config(saved: Config, current: Config, given: set, path, overrides: set,
                 translating: bool = False) -> Config:
    """The config to continue a checkpoint with. The checkpoint's values, except: the run
    fields (where the run works: model folder, device) come from `current` always, and the
    `overrides` the user gave win. A model field given with another value than the
    checkpoint's is refused: the architecture is fixed once trained. `translating`: the
    refusal says what to do with a trained model (translate.py, export.py), not a run."""
    for name in sorted(given & fields_where(group="model") - overrides):
        if getattr(current, name) != getattr(saved, name):
            new, old = getattr(current, name), getattr(saved, name)
            mismatch = (f"--{name} {new} does not match {path}: it was trained with --{name} "
                        f"{old}, not {new}")
            if not translating:
                raise CheckpointError(f"{mismatch}; the architecture is fixed once trained: "
                                      f"{drop_flag(given, name)}, or train into another "
                                      f"--model_folder")
            if name in ("lang_src", "lang_tgt"):  # (a side not given: the model's)
                wanted = [getattr(current if side in given else saved, side)
                          for side in ("lang_src", "lang_tgt")]
                raise CheckpointError(
                    f"{mismatch}: this model translates {saved.lang_src} to {saved.lang_tgt}; "
                    f"drop the flag, or give a model trained for {wanted[0]} to {wanted[1]} "
                    f"with --model_folder or --checkpoint")
            raise CheckpointError(f"{mismatch}: a trained model keeps its architecture; drop "
                                  f"the flag (the checkpoint's value is taken)")
    merged = dataclasses.replace(saved)
    for name in fields_where(group="run") | (given & overrides):
        setattr(merged, name, getattr(current, name))
    return merged



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
    keep = {k: v for k, v in state.items() if k in ("format", "config", "epoch", "global_step",
                                                     "corpus", "tokenizers", "next_epoch")}
    return {**keep, "model_state_dict": averaged}


def run_end(config: Config, found: list):
    """The run's newest checkpoint (list_checkpoints' `found`) where training ended there (the
    model card was written at its step: the schedule completed, --max_steps, --patience or the
    --time_budget), which averaging counts as an end; None while the run trains on, or where it
    was stopped. (A checkpoint's schedule_steps does not say it: an inverse square root's
    schedule keeps its length when --max_steps is raised.)"""
    ended = card_step(config.model_folder) if found else None
    if ended is None:
        return None
    last, _, step = found[-1]  # (a mid-epoch file's name gives its step)
    step = load_checkpoint(last, mmap=True)["global_step"] if step is None else step
    return last if step == ended else None


def load_averaged(config: Config, path: Path, average: int, flag: str = "--average",
                  saves: bool = False):
    """(state, paths): the state of `path`, or with average > 1 the mean of the newest
    `average` checkpoints up to the step `path` holds: per-epoch ones (epoch_ends), or with
    `saves` (--average_saves; 1 too: the newest save, not a stop) those --save_every wrote
    (saved_every)."""
    if average <= 1 and not saves:
        return load_checkpoint(path), [path]
    state, found = load_checkpoint(path, mmap=True), list_checkpoints(config)
    paths = saved_every(state, path, flag, found, run_end(config, found)) if saves else \
        epoch_ends(config, state, path, found)
    paths = paths[-average:]
    if len(paths) < average:
        kept = state["config"].get("keep_last", 0)
        raise CheckpointError(
            f"{flag} {average}: only {len(paths)} " + (
                f"checkpoint(s) saved every {state['config']['save_every']} steps" if saves
                else "per-epoch checkpoint(s)") + f" up to {path.name} in {path.parent}" + (
                f" (the run keeps the newest --keep_last {kept} saves: train with "
                f"--keep_last {average} to average {average})" if saves and kept < average
                else ""))
    return average_checkpoints(paths), paths


def epoch_ends(config: Config, state: dict, path: Path, found: list):
    """The per-epoch checkpoints among `found` (list_checkpoints') up to `state` (that of
    `path`), oldest first. Mid-epoch files take no part: they are not the end of an epoch, and
    they overlap the per-epoch ones; but the run's end (run_end), where training ended
    mid-epoch (--time_budget, --max_steps), counts as an epoch's end, once: not beside the
    epoch's end of its own step. A best checkpoint from a mid-epoch validation (--eval_every)
    is followed by its epoch's end: that epoch's file, later than it, is left out."""
    last = state.get("next_epoch", state["epoch"] + 1) - 1  # the last epoch `path` finished
    paths = [p for p, epoch, step in found if step is None and epoch <= last]
    if paths and paths[-1] != path and \
            load_checkpoint(paths[-1], mmap=True)["global_step"] > state["global_step"]:
        paths.pop()  # the end of the best's epoch: trained past it
    end = run_end(config, found)
    if end is not None and found[-1][2] is not None and found[-1][2] <= state["global_step"]:
        same = paths and load_checkpoint(paths[-1], mmap=True)["global_step"] == \
            found[-1][2]  # (a plan shortened at an epoch's end ends at the next's start)
        if not same:
            paths.append(end)  # the run's end, saved mid-epoch
    return paths


def saved_every(state: dict, path: Path, flag: str, found: list, end: Path = None):
    """The checkpoints among `found` (list_checkpoints') that the run's --save_every N wrote up
    to `state`, oldest first, one a step: evenly spaced, as the paper's last 5, written 10
    minutes apart. Those at a multiple of N, mid-epoch or an epoch's end (a save due at an
    epoch's last step is the epoch's checkpoint), and the run's `end` (run_end) between them;
    stops (Ctrl-C) between saves, and the end of a run lengthened since, take no part."""
    every = state["config"].get("save_every", 0)
    if not every:
        raise CheckpointError(f"{flag}: {path} comes from a run trained without --save_every, "
                              f"which writes the checkpoints it averages; --average N averages "
                              f"per-epoch checkpoints")
    chosen = {}
    for p, _, step in found:  # (a mid-epoch file's name gives its step)
        step = load_checkpoint(p, mmap=True)["global_step"] if step is None else step
        if step <= state["global_step"] and (step % every == 0 or p == end):
            chosen[step] = p
    return [chosen[step] for step in sorted(chosen)]


def weights_digest(state: dict) -> str:
    """What identifies a checkpoint's weights: the SHA-256 of its tensors' names, types,
    shapes and bytes (not of its file, which other keys, an optimizer state dropped or
    another save format change)."""
    sha = hashlib.sha256()
    for name, tensor in sorted(state["model_state_dict"].items()):
        tensor = tensor.detach().cpu().contiguous()
        sha.update(f"{name} {tensor.dtype} {tuple(tensor.shape)};".encode())
        sha.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())  # (numel·size,)
    return sha.hexdigest()[:32]
