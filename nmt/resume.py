"""What train.py resumes from, and what a resume must match: the checkpoint --preload names,
the config merged from it and the command line (refusing what cannot continue the saved run
exactly: another corpus, another batch order mid-epoch, another number of processes mid-epoch,
another held-out validation split), the random state, the validation history, and the later
checkpoints that training on from an earlier epoch sets aside. And what a new run takes from a
trained model it starts from (--init_from: its weights, architecture and tokenizers)."""

import dataclasses
from dataclasses import dataclass, field
import json
import os
import shutil
import sys
import time
from pathlib import Path

import torch

from config import Config, drop_flag, fields_where
import nmt.budget
from nmt.budget import completed
from nmt.checkpoint import (BEST_KEYS, CARD_NAME, CURVE_NAME, FORMAT, CheckpointError,
                            basenames, best_checkpoint_path, card_step, check_tokenizers,
                            elsewhere, history_path, latest_checkpoint_path, list_checkpoints,
                            load_checkpoint, merge_config, not_named, resolve_preload,
                            run_files, save_checkpoint, start_again)
from nmt.files import FolderLock, write_text_atomic
from nmt.trained_model import load_model_weights
from tokenizer import recipe_path, tokenizer_keys, tokenizer_path


# ---- what train.py resumes from, and what a resume must match ----------------------------------

# The settings that fix the order of an epoch's batches: a mid-epoch checkpoint needs them.
BATCH_ORDER_FIELDS = ("max_tokens", "batch_size", "seed", "accum_steps")
# The settings of sequence-level distillation: what a run trains on, fixed when it starts.
DISTILL_FIELDS = ("distill_from", "distill_data", "distill_beam", "distill_average")
# What a flag given on the command line may change in a checkpoint's config: all but the model.
NOT_THE_MODEL = frozenset(f.name for f in dataclasses.fields(Config)) - fields_where(group="model")


def refuse_to_overwrite(config: Config):
    """A fresh start writes a new best checkpoint, validation history and test results: refused
    in a folder that holds a run's files (--preload none there, or --preload latest where the
    checkpoints were deleted but the best checkpoint or the history remain), or that holds
    another --model_basename's checkpoints (a typo, or a second run that would overwrite the
    first's card and results)."""
    found = [p.name for p, _, _ in list_checkpoints(config)[-1:]] + run_files(config)
    named = not_named(config)  # another --model_basename's run: its card and results are here
    if "--model_basename" in named:
        raise CheckpointError(f"{config.model_folder} holds another run's checkpoints{named}; "
                              f"a new run goes into another --model_folder")
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
    source = Path(config.init_from)
    if config.init_from and (source if source.is_dir() else source.parent).resolve() == \
            Path(config.model_folder).resolve():
        raise CheckpointError(f"--init_from {source} is in --model_folder: a new run trains into "
                              f"a folder of its own (the source is never written)")
    path = resolve_preload(config, training=True)
    if path is None:
        refuse_to_overwrite(config)
        return None, config
    state = load_checkpoint(path)
    if "optimizer_state_dict" not in state:
        raise CheckpointError(
            f"{path} holds the weights only: checkpoints other than the run's newest and its "
            f"newest --keep_optimizer per-epoch ones drop the optimizer state an exact resume "
            f"needs; resume from one that keeps it (the newest a run saved, or --preload N of a "
            f"newer epoch), or translate with this one")
    saved = Config.from_dict(state["config"])
    merged = merge_config(saved, config, given, path, NOT_THE_MODEL)
    if "data_dir" not in given and merged.data_dir and not Path(merged.data_dir).is_dir():
        raise CheckpointError(f"the corpus {path} was trained on, --data_dir {merged.data_dir}, "
                              f"is not there (moved?): give its place with --data_dir")
    check_training_pairs(saved, merged, path)
    check_init_from(saved, config, path)
    merged.init_from = saved.init_from  # (where the run started from stays as recorded)
    if state.get("next_batch"):  # mid-epoch: the rest of the epoch needs the same batches
        for name in BATCH_ORDER_FIELDS:
            if getattr(saved, name) != getattr(merged, name):
                raise CheckpointError(
                    f"{path} was saved mid-epoch with --{name} {getattr(saved, name)}; resume "
                    f"it with the same value (the epoch's batch order depends on it), or from a "
                    f"per-epoch checkpoint with --preload N")
        if saved.shape_count() != merged.shape_count():
            raise CheckpointError(
                f"{path} was saved mid-epoch with {shapes_in_words(saved)} and this run would "
                f"have {shapes_in_words(merged)}: the epoch's batches are cut by them; resume it "
                f"with --fixed_shapes {saved.fixed_shapes} --compile "
                f"{str(saved.compile).lower()}, or from a per-epoch checkpoint with --preload N")
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
    if config.preload not in ("latest", "none"):  # a new line, which moves the later files
        at = Progress(step=state["global_step"], epoch=state["next_epoch"],
                      history=read_history(merged, up_to_step=state["global_step"]),
                      complete=completed(merged, state))
        idle = nothing_to_do(merged, at)
        if idle:
            unfinished = path == latest_checkpoint_path(merged) and card_step(
                merged.model_folder) != at.step and not FolderLock(merged.model_folder).held()
            raise CheckpointError(
                f"--preload {config.preload}: {idle} from it (nothing was moved)" +
                ("; the same command without --preload finishes the run there (its test scores "
                 "and model card)" if unfinished else ""))
    return (path, state), merged


@dataclass
class Progress:
    """Where the run is: all that changes while it trains (and what a checkpoint saves). Its
    clock is the budget's, read where it is (a test's fake one too)."""
    step: int = 0  # optimizer steps taken
    epoch: int = 0  # the epoch being trained (counting from 0)
    batch: int = 0  # batches of that epoch done
    history: list = field(default_factory=list)  # every validation: step, epoch, scores
    bad_steps: torch.Tensor = None  # non-finite updates in a row, counted on the device
    loss_window: list = field(default_factory=list)  # losses (tensors) since the last log
    smoothed_loss: float = None  # the bar's: a moving average of the loss, from the first step
    signal: str = None  # the name of a SIGINT/SIGTERM received
    commands: list = field(default_factory=list)  # the command of every start of the run
    seconds_before: float = 0.0  # training time of the earlier starts (validations included)
    setup_before: float = 0.0  # the earlier starts' set-up (data, model) and ends after their
    # last checkpoint (a validation, the test scoring): not training, but a budget's time
    validation_seconds: float = 0.0  # every start's validations, all together
    last_validation: tuple = None  # the latest validation's seconds and its decoding's
    complete: bool = False  # a --time_budget run resumed after its schedule completed
    longer: str = ""  # why a --time_budget resume lays out more than the saved schedule
    validated_at: int = -1  # the step of the last validation (on every rank)
    started: float = field(default_factory=lambda: nmt.budget.clock())  # this start's training
    began: float = None  # this start's beginning, before its set-up (None: not timed)

    def validated_epoch(self) -> int:
        """The epoch a validation now belongs to: the one being trained, or, at an epoch's
        start, the one just ended (a resume validating the checkpoint at its end again)."""
        return self.epoch - 1 if self.batch == 0 and self.step else self.epoch

    def provenance(self) -> dict:
        """What a checkpoint keeps of how the run was made: its commands and training time, for
        its model card, and apart the starts' set-up time, which a --time_budget also spends."""
        setup = self.started - self.began if self.began is not None else 0.0
        return {"commands": self.commands,
                "seconds": self.seconds_before + nmt.budget.clock() - self.started,
                "setup_seconds": self.setup_before + max(setup, 0.0),
                "validation_seconds": self.validation_seconds,
                "last_validation": self.last_validation}

    def validated(self, seconds: float, decoding: float):
        """A validation of `seconds` done, `decoding` of them its decoding (its time is in the
        checkpoint, for a budget's resume: what the end keeps back)."""
        self.validated_at = self.step
        self.validation_seconds += seconds
        self.last_validation = seconds, decoding


def check_init_from(saved: Config, config: Config, path: Path):
    """--init_from given where there is a run to resume: the same command again (a run started
    from that model) resumes it; any other run in the folder is refused, where the flag would
    have been dropped without a word."""
    if not config.init_from:
        return

    def source_folder(name):  # a checkpoint file stands for its folder: the same source run
        path = Path(name).resolve()
        return path.parent if path.suffix == ".pt" else path
    if saved.init_from and source_folder(config.init_from) == source_folder(saved.init_from):
        return
    raise CheckpointError(
        f"--init_from {config.init_from}: {config.model_folder} holds a run to resume ({path}, "
        f"{f'started from {saved.init_from}' if saved.init_from else 'trained from scratch'}); "
        f"train the new run into another --model_folder, or resume this one without --init_from")


def check_training_pairs(saved: Config, merged: Config, path: Path):
    """A run's training pairs are fixed when it starts: a resume that adds, drops or changes the
    teachers (in any order) or their settings, the extra pairs (added, dropped, their tag, the
    corpus's upsampling), or the length-ratio filter, would train on other pairs than the
    checkpoint's, and record flags that did not make the model. Refused before any work, naming the
    flag (the corpus's fingerprint said "another version of the corpus"). The extra pairs' folder
    may move: its text is the fingerprint's to check."""
    for name in (*DISTILL_FIELDS, "extra_data_dir", "extra_tag", "upsample", "max_len_ratio"):
        before, after = getattr(saved, name), getattr(merged, name)
        if name == "distill_from":
            before, after = ",".join(saved.teachers()) or "none", sorted(merged.teachers())
            if sorted(saved.teachers()) == after:
                continue
        elif name == "extra_data_dir":
            before = before or "none"
            if bool(saved.extra_data_dir) == bool(after):
                continue
        elif before == after:
            continue
        before = f"{before:g}" if isinstance(before, float) else before  # (0, not 0.0)
        raise CheckpointError(
            f"{path} was trained with --{name} {before} (a run's training pairs are fixed when "
            f"it starts): resume without --{name}, or train a new run into another "
            f"--model_folder")


def shapes_in_words(config: Config) -> str:
    count = config.shape_count()
    return f"{count} fixed batch lengths" if count else "no fixed batch shapes"


def after_smaller_batches(config: Config) -> str:
    """How a run stopped by a step too large for the device goes on with smaller batches
    (the end of nmt.runtime.out_of_memory's line): a mid-epoch checkpoint resumes with the
    batches it was saved with only, so the advice names the newest per-epoch checkpoint, or,
    with none, a start in another folder."""
    found = list_checkpoints(config)
    if not found:
        return start_again(config, "them")
    if found[-1][2] is None:
        return "the checkpoints already saved are intact, resume from them"
    epochs = [epoch for _, epoch, step in found if step is None]
    if epochs:
        return (f"the newest checkpoint is mid-epoch, where the batches cannot change: resume "
                f"from the last per-epoch checkpoint with --preload {epochs[-1]} and the smaller "
                f"batches (the steps after it are trained again)")
    return (f"the checkpoints saved are mid-epoch, where the batches cannot change (and no "
            f"epoch has ended): start again with them in another --model_folder, or resume "
            f"{config.model_folder} with the same batches on a device with more memory")


def check_corpus(state: dict, path: Path, corpus: dict):
    """Refuses to resume on another corpus than the checkpoint was trained on (another epoch
    length, another validation set for the best checkpoint): called before any data is
    prepared. Checkpoints of earlier versions do not record their corpus."""
    saved = state.get("corpus")
    if not saved or saved["fingerprint"] == corpus["fingerprint"]:
        return
    same = saved["source"] == corpus["source"]
    if same and saved.get("version", 1) < corpus["version"] and Path(saved["source"]).is_absolute():
        # earlier versions fingerprinted a folder by its files' times, which a copy changes
        print(f"{path} records its corpus folder by the files' times (an earlier version): "
              f"not checked", file=sys.stderr)
        return
    raise CheckpointError(
        f"{path} was trained on {'another version of ' if same else ''}the corpus "
        f"{saved['source']}" + ("" if same else f", not {corpus['source']}")
        + (" (the text of its files changed since)" if same else "")
        + "; resume with that corpus, or train on this one into another --model_folder")


def check_resume_data(state: dict, path: Path, config: Config, data):
    """The checks a resume makes once the data is loaded: the tokenizers (their sizes and
    fingerprints; freshly trained ones too), and a validation split held out of train by the
    same seed."""
    check_tokenizers(state, path, data.tokenizer_src, data.tokenizer_tgt)
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


def restore_progress(config: Config, progress, path: Path, state: dict, steps: int,
                     learning_rate) -> int:
    """Puts `progress` (train.Progress) where the run saved in `state` was (position,
    validation history, the commands that made it) and returns the run length to lay the
    learning-rate schedule out for: as saved (the warm-up and decay go on as laid out), but a
    cosine over the run's new length `steps` if it changed (`learning_rate`: train.py's, for
    the rates it says)."""
    progress.epoch, progress.batch = state["next_epoch"], state["next_batch"]
    progress.step = state["global_step"]
    progress.history = read_history(config, up_to_step=progress.step)
    made = state.get("provenance") or {}
    progress.commands, progress.seconds_before = list(made.get("commands", [])), \
        made.get("seconds", 0.0)
    progress.setup_before = made.get("setup_seconds", 0.0)
    try:  # a run ended at this step: its last validation and test scoring came after the
        ended = json.loads((Path(config.model_folder) / "results.json").read_text())
    except (OSError, ValueError):  # checkpoint; spent, not training (a step's time), they are
        ended = {}  # counted with the set-ups
    if ended.get("step") == progress.step:
        progress.setup_before = max(progress.setup_before, ended.get("setup_seconds", 0.0)) + \
            max(ended.get("seconds", 0.0) - progress.seconds_before, 0.0)
    progress.validation_seconds = made.get("validation_seconds", 0.0)
    progress.last_validation = tuple(made["last_validation"]) if made.get(
        "last_validation") else None
    progress.validated_at = max((h["step"] for h in progress.history), default=-1)  # (not twice)
    saved = state.get("schedule_steps", steps)
    progress.complete = completed(config, state)
    patience_out = config.patience and validations_since_best(progress.history) >= config.patience
    progress.longer = "" if patience_out else nmt.budget.longer(config, state)  # (it says why)
    # (a --time_budget's schedule is laid out again by nmt.budget.budget_for)
    if config.lr_schedule == "cosine" and saved != steps and not config.time_budget and \
            progress.step < steps:  # (a run with nothing left to train has no rate to say)
        old, new = (learning_rate(config, progress.step + 1, n) for n in (saved, steps))
        print(f"the run is now {steps} steps long (was {saved}): the cosine schedule is laid "
              f"out again over its new length; the learning rate goes on at {new:.2e} (it was "
              f"to be {old:.2e})")
        saved = steps
    print(f"resumed from {path}: epoch {progress.epoch}, batch {progress.batch}, "
          f"step {progress.step}")
    return saved


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
    checkpoints saved after `path`, a best checkpoint, test results and model card from after
    it belong to the abandoned line. They are moved, never deleted, into a subfolder (with a
    copy of the validation history, whose later entries the new line drops), so that pruning
    and --preload latest see the new line only. The best of the validations kept gets its best
    checkpoint back from its own step's checkpoint, where one is left (also when a stopped
    start left it missing). What can fail is read first: a failure moves nothing."""
    found = [p for p, _, _ in list_checkpoints(config)]
    kept_files = found[:found.index(path) + 1] if path in found else [path]
    later = found[len(kept_files):] if path in found else []
    best, folder = best_checkpoint_path(config), Path(config.model_folder)
    if best.exists() and load_checkpoint(best, mmap=True)["epoch"] > int(config.preload):
        later.append(best)
    ended = [p for p in (folder / "results.json", folder / CARD_NAME, folder / CURVE_NAME)
             if p.exists()]
    history, step = read_history(config), load_checkpoint(path, mmap=True)["global_step"]
    kept = [h for h in history if h["step"] <= step]
    restoring = best_of(kept, kept_files) if kept and (best in later or not best.exists()) \
        else None
    if later or ended or len(kept) < len(history):
        aside = folder / f"superseded_{time.strftime('%Y%m%d-%H%M%S')}"
        while aside.exists():  # (two in a second)
            aside = aside.with_name(aside.name + "+")
        aside.mkdir()
        for p in later + ended:
            os.replace(p, aside / p.name)
        if history_path(config).exists():  # the whole aside, kept here up to `path`
            shutil.copy2(history_path(config), aside / history_path(config).name)
            write_history(config, kept)
        moved = ", ".join(p.name for p in later + ended) or "no file"
        print(f"--preload {config.preload}: moved {moved} to {aside} (with a copy of the "
              f"history, kept here up to it); training goes on from {path.name}")
    if restoring:
        validation, state = restoring
        said = (f"the best validation up to it (BLEU {validation['bleu']:.2f}, step "
                f"{validation['step']})")
        if state is None:
            print(f"{said} has no checkpoint left: a best checkpoint is saved when a validation "
                  f"beats it")
        else:
            save_checkpoint(state, best)
            print(f"{said}: {best} written again from its checkpoint")


def best_of(history: list, files: list):
    """The best of the validations `history` and its best checkpoint, made from the
    checkpoint of its step among `files` (None where none is left: pruned)."""
    validation = best_validation(history)
    for p in reversed(files):
        state = load_checkpoint(p, mmap=True)
        if state["global_step"] == validation["step"]:  # (earlier versions': fewer keys)
            return validation, {"format": FORMAT, "validation": validation,
                                **{k: state[k] for k in BEST_KEYS if k in state}}
    return validation, None


# ---- a new run from a trained model's weights (--init_from) ------------------------------------

def init_state(config: Config, given: set):
    """--init_from for a run with nothing to resume: ((path, state) of the trained model it
    starts from, the config to train with), or (None, config) without the flag. A model folder
    gives its best checkpoint (or, before any validation, its newest). The model fields
    (architecture, languages, vocabulary, seq_len) are the checkpoint's, and a flag given with
    another value is refused; every other setting is this command's or the default, as for a
    fresh run: nothing of the source run's data (its corpus, back-translations, upsampling,
    BPE-dropout) or training settings is inherited. The optimizer, schedule, step count and
    history start afresh; the source folder is only read."""
    if not config.init_from:
        return None, config
    path = init_source(config)
    state = load_checkpoint(path)
    saved = Config.from_dict(state["config"])
    for name in sorted(given & fields_where(group="model")):
        if getattr(config, name) != getattr(saved, name):
            raise CheckpointError(
                f"--{name} {getattr(config, name)}: the model of --init_from {path} has --{name} "
                f"{getattr(saved, name)}, and a run started from it keeps its architecture and "
                f"vocabulary; {drop_flag(given, name)}")
    merged = with_architecture(config, saved)
    if Path(saved.tokenizer_file).is_absolute():  # the source's tokenizers lay elsewhere: the
        merged.tokenizer_file = own_tokenizer_file(saved.tokenizer_file)  # new run keeps copies
    merged.preload, merged.init_from = "latest", str(Path(path).resolve())  # (from any folder)
    problem = merged.validate()
    if problem:
        raise CheckpointError(f"with the settings of --init_from {path}: {problem}")
    return (path, state), merged


def init_source(config: Config) -> Path:
    """The checkpoint --init_from names: a file, or a model folder's best checkpoint (before
    any validation, its newest)."""
    source = Path(config.init_from)
    if source.is_file():
        return source
    if not source.is_dir():
        raise CheckpointError(f"--init_from {source}: no such model folder or checkpoint file")
    names = basenames(source, [config.model_basename])  # the source's own (--model_basename
    # names the new run's files)
    found = dataclasses.replace(config, model_folder=str(source), **(
        {"model_basename": names[0]} if len(names) == 1 else {}))
    if len(names) > 1 and config.model_basename not in names:  # (not "no checkpoint in it")
        found.model_basename = names[0]
        raise CheckpointError(f"--init_from {source} holds the checkpoints of {len(names)} runs "
                              f"({', '.join(names)}): give one checkpoint file, such as "
                              f"{best_or_latest(found)}")
    path = best_or_latest(found)
    if path is None:
        raise CheckpointError(f"--init_from {source}: no checkpoint in it"
                              f"{elsewhere(source, '--init_from')}")
    return path


def best_or_latest(config: Config):
    """The best checkpoint of config's folder and basename, else its newest (None: none)."""
    best = best_checkpoint_path(config)
    return best if best.exists() else latest_checkpoint_path(config)


def with_architecture(config: Config, saved: Config) -> Config:
    """This command's settings and the defaults, as a fresh run has them, with the model
    fields (architecture, languages, vocabulary, seq_len) of the trained model `saved`."""
    merged = dataclasses.replace(config)
    for name in fields_where(group="model"):
        setattr(merged, name, getattr(saved, name))
    return merged


def settings_to_check(config: Config, given: set) -> Config:
    """The settings a start of train.py will train with, as far as its folders tell before any
    work: its flags are checked against these (Config.validate), not against the defaults, so
    a run trained with --seq_len 24 resumes with --max_tokens 32. A resume's are its
    checkpoint's with the flags given over them; a new run from --init_from has its source's
    architecture; where the folder holds nothing to go by, the command line's and the defaults.
    Raises the start's own CheckpointError for a checkpoint it would refuse (damaged, another
    architecture given), rather than checking the flags against the defaults."""
    try:
        path = resolve_preload(config, training=True)
    except ValueError:  # --preload neither a word nor a number: validate's to say
        return config
    if path is not None:
        saved = Config.from_dict(load_checkpoint(path, mmap=True)["config"])
        return merge_config(saved, config, given, path, NOT_THE_MODEL)
    if config.init_from:
        path = init_source(config)
        return with_architecture(config, Config.from_dict(
            load_checkpoint(path, mmap=True)["config"]))
    return config


def own_tokenizer_file(absolute: str) -> str:
    """The file name, inside the new run's folder, of an --init_from source's tokenizers kept
    elsewhere: the absolute --tokenizer_file's name where it holds {0}, the language
    (/tok/tokenizer_{0}.json -> tokenizer_{0}.json); where only a folder holds it
    (/tok/{0}/tokenizer.json) the language goes into the name (tokenizer_{0}.json)."""
    name = Path(absolute).name
    if "{0}" in name:
        return name
    stem, suffix = Path(name).stem, Path(name).suffix
    return f"{stem}_{{0}}{suffix}"


def copy_tokenizers(path: Path, state: dict, config: Config) -> list:
    """The tokenizer files of the checkpoint `path` (beside it, or where its absolute
    --tokenizer_file says) and their recipes, copied into the new run's model folder: it keeps
    its source's vocabulary, never trains its own. Refused in one line if the folder holds
    another tokenizer of that name. Returns the files it created, for a failed start to take
    back (docs/resuming.md: a failed start leaves no file)."""
    source = dataclasses.replace(Config.from_dict(state["config"]), model_folder=str(path.parent))
    pairs = []
    for key in dict.fromkeys(tokenizer_keys(config)):  # one file with a joint vocabulary
        src, dst = tokenizer_path(source, key), tokenizer_path(config, key)
        if not src.exists():
            raise CheckpointError(f"--init_from {path}: its tokenizer {src} is not beside it")
        if dst.exists() and dst.read_bytes() != src.read_bytes():
            raise CheckpointError(f"{dst} is another tokenizer than {src}, which --init_from "
                                  f"{path} was trained with: give a new --model_folder")
        pairs += [(recipe_path(src), recipe_path(dst)), (src, dst)]  # the file last
    created = []
    for a, b in pairs:
        if a.exists() and not (b.exists() and b.samefile(a)):
            b.parent.mkdir(parents=True, exist_ok=True)
            if not b.exists():
                created.append(b)
            shutil.copyfile(a, b)
    return created


def coverage_note(state: dict, data):
    """What --init_from's vocabulary makes of the new corpus (its validation texts), beside what
    it made of its own (recorded in the checkpoint)."""
    mine, own = data.coverage, state.get("coverage") or {}
    return "vocabulary on the new corpus: " + "; ".join(
        f"{side} {c['tokens_per_word']:.2f} tokens a word, {100 * c['fallback']:.1f}% single "
        f"bytes" + (f" (on its own corpus: {own[side]['tokens_per_word']:.2f}, "
                    f"{100 * own[side]['fallback']:.1f}%)" if side in own else "")
        for side, c in mine.items())


# ---- the validation history -------------------------------------------------------------------

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


def best_validation(history: list) -> dict:
    """The best of a run's validations: by BLEU, ties broken by the lower loss (a young model
    at BLEU 0.00 still gets better while its loss falls)."""
    return max(history, key=lambda h: (h["bleu"], -h["loss"]))


def validations_since_best(history: list) -> int:
    """How many validations came after the best (--patience counts them)."""
    return len(history) - 1 - history.index(best_validation(history)) if history else 0


def validation_cut_short(config: Config, progress) -> bool:
    """Whether a resumed run's checkpoint is at a step the run validates (an epoch's end,
    every --eval_every steps, the run's end, by the settings it now has) and that step has no
    validation: the checkpoint was saved before it (an epoch's end, the run's), or by a stop
    that cut it short. train.py then validates it before anything else: otherwise that step is
    never validated, and a run cut short in its last validation would end with no best
    checkpoint to score the test sets."""
    if progress.step == 0 or any(h["step"] == progress.step for h in progress.history):
        return False
    return (progress.batch == 0 or bool(config.eval_every and progress.step % config.eval_every
                                        == 0) or nothing_to_do(config, progress) is not None)


def nothing_to_do(config: Config, progress):
    """Why a resumed run (train.py's Progress: its step, epoch and validations) has no step
    left to train (said instead of starting), or None."""
    if config.max_steps and progress.step >= config.max_steps:
        return (f"already at step {progress.step} of --max_steps {config.max_steps}; raise "
                f"it to train on")
    if config.time_budget and getattr(progress, "complete", False):
        return (f"the --time_budget {config.time_budget:g} minutes' schedule is complete "
                f"(step {progress.step}); raise --time_budget to train on")
    if not config.time_budget and progress.epoch >= config.num_epochs:  # (a budget's are not)
        trained = f"all {config.num_epochs} epochs are" if config.num_epochs != 1 else \
            "its 1 epoch is"
        return f"{trained} trained (step {progress.step}); raise --num_epochs to train on"
    since = validations_since_best(progress.history)
    if config.patience and since >= config.patience:  # (the limits above: said first)
        return (f"no better validation in the last {since} validations (--patience "
                f"{config.patience}): training ends here; raise --patience to train on")
    return None
