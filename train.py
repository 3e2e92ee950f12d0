"""Train a Transformer translation model.

    python train.py                                   # OPUS Books en->it from the hub
    python train.py --preset multi30k_small           # the headline recipe (README)
    python train.py --help                            # every flag, with its default
    torchrun --standalone --nproc_per_node=4 train.py ...   # data-parallel on 4 GPUs
    tensorboard --logdir runs

Read top to bottom: the optimizer and its schedule; the run (what is fixed at start) and its
progress (what moves); one step; saving and stopping; validation; the loop, `train_model`.
Resumes from the newest checkpoint in --model_folder by default (--preload latest).
"""

import enum
import json
import math
import os
import platform
import signal
import sys
import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader
from torch.utils.tensorboard import SummaryWriter
from tqdm import tqdm

from checkpoint import (CheckpointError, FolderLock, best_checkpoint, best_checkpoint_path,
                        build_model, check_corpus, check_resume_data, check_writable,
                        epoch_checkpoint_path,
                        latest_checkpoint_path, load_checkpoint, load_model_weights,
                        prune_checkpoints, read_history, restore_rng, restore_training,
                        resume_state, rng_states, save_checkpoint, set_aside_later,
                        step_checkpoint_path, training_checkpoint, write_history,
                        write_text_atomic)
from config import ArgumentParser, Config, parse_config, run_main
from dataset import Collator, Data, TokenBatchSampler, get_ds, real_tokens
from decoding import decoding_limits, translate, translate_ids
from metrics import score
from model import LabelSmoothedCrossEntropy
from model_card import write_card
from runtime import (autocast, autocast_dtype, gather_to_main, main_first, max_over_ranks,
                     setup_device, start_distributed, stop_distributed, sum_over_ranks)
from tokenizer import EOS, PAD, SOS, UNK, detokenize

# ---- the paper's section 5.3: Adam and its learning rate ----------------------------------------


def warmup_steps(config: Config, total_steps: int) -> int:
    """--warmup as given; 0 (the default): 4000 steps, but at most a tenth of a run of
    `total_steps` (0: unknown), so that a short run on small data warms up and learns too."""
    if config.warmup:
        return config.warmup
    return max(min(4000, total_steps // 10) if total_steps else 4000, 1)


def learning_rate(config: Config, step: int, total_steps: int) -> float:
    """The learning rate of optimizer step `step` (counting from 1) of a run of `total_steps`
    (0: unknown), with `warmup_steps` of warm-up.

    constant:     lr
    inverse_sqrt: the paper's lr = d_model^-0.5 · min(step^-0.5, step · warmup^-1.5), rescaled so
                  that its peak (at step = warmup) is `lr`; --lr (d_model·warmup)^-0.5 gives the
                  paper's exact values (7.0e-4 for 512 and 4000).
    cosine:       linear warm-up to lr, then half a cosine that would reach 0 one step after
                  the last: every step of the run learns. A run lengthened on resume is laid
                  out again over its new length (see `restore`)."""
    step, peak = max(step, 1), config.peak_lr()
    warmup = warmup_steps(config, total_steps)
    if config.lr_schedule == "inverse_sqrt":
        paper = config.d_model ** -0.5 * min(step ** -0.5, step * warmup ** -1.5)
        return peak * paper / (config.d_model * warmup) ** -0.5
    if config.lr_schedule == "cosine":
        if step < warmup:
            return peak * step / warmup
        progress = min((step - warmup) / max(total_steps + 1 - warmup, 1), 1.0)
        return peak * 0.5 * (1.0 + math.cos(math.pi * progress))
    return peak


def make_optimizer(model, lr: float):
    """Adam with the paper's betas and epsilon, fused into one kernel where torch has one (CPU,
    CUDA): the default per-parameter loop is much slower on CPU (see the README)."""
    params = list(model.parameters())
    try:
        return torch.optim.Adam(params, lr=lr, betas=(0.9, 0.98), eps=1e-9, fused=True)
    except (RuntimeError, ValueError, TypeError):  # a device without the fused kernel
        return torch.optim.Adam(params, lr=lr, betas=(0.9, 0.98), eps=1e-9)


def make_loss(config: Config):
    """Cross-entropy with label smoothing (section 5.4), summed over the non-padding tokens."""
    return LabelSmoothedCrossEntropy(config.label_smoothing, ignore_index=PAD)


# ---- the run: what is fixed at start, and its progress -------------------------------------------

class NoWriter:
    """The TensorBoard writer of ranks other than 0: writes nothing."""

    def __getattr__(self, name):
        return lambda *args, **kwargs: None


class Stop(enum.IntEnum):
    """Why training stops before its last epoch ends. Ranks agree on the largest."""
    NONE = 0
    MAX_STEPS = 1  # --max_steps reached
    PATIENCE = 2  # --patience validations without a better one
    SIGNAL = 3  # Ctrl-C or SIGTERM


@dataclass
class Run:
    """What a training run works with, fixed by `set_up` before the first step."""
    config: Config
    device: torch.device
    data: Data
    model: nn.Module
    step_model: nn.Module  # what the step calls: the model, DDP-wrapped and/or compiled
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler
    amp: object  # a function returning the autocast context
    loss_fn: nn.Module
    sampler: TokenBatchSampler
    loader: DataLoader  # the training batches, made once (its workers persist)
    batches_per_epoch: int
    schedule_steps: int  # the run length the learning-rate schedule is laid out for
    lock: FolderLock  # rank 0's hold on the model folder: one writer (released at the end)
    precision: str  # fp32, or the autocast dtype
    rank: int = 0  # this process among world_size (torchrun), 0 of 1 otherwise
    world_size: int = 1
    writer: object = field(default_factory=NoWriter)  # TensorBoard (rank 0, opened in the loop)

    def lr(self, step: int) -> float:
        """The learning rate of optimizer step `step` (counting from 1)."""
        return learning_rate(self.config, step, self.schedule_steps)

    @property
    def total_steps(self):
        """The length of the run in optimizer steps: num_epochs, or max_steps if sooner."""
        steps = math.ceil(self.batches_per_epoch / self.config.accum_steps) * self.config.num_epochs
        return min(steps, self.config.max_steps) if self.config.max_steps else steps


@dataclass
class Progress:
    """Where the run is: all that changes while it trains (and what a checkpoint saves)."""
    step: int = 0  # optimizer steps taken
    epoch: int = 0  # the epoch being trained (counting from 0)
    batch: int = 0  # batches of that epoch done
    history: list = field(default_factory=list)  # every validation: step, epoch, scores
    bad_steps: torch.Tensor = None  # non-finite updates in a row, counted on the device
    loss_window: list = field(default_factory=list)  # losses (tensors) since the last log
    signal: str = None  # the name of a SIGINT/SIGTERM received
    commands: list = field(default_factory=list)  # the command of every start of the run
    seconds_before: float = 0.0  # training time of the earlier starts (validations included)
    started: float = field(default_factory=time.time)  # when this start began training

    def provenance(self) -> dict:
        """What a checkpoint keeps of how the run was made, for its model card."""
        return {"commands": self.commands,
                "seconds": self.seconds_before + time.time() - self.started}


def set_up(config: Config, given: set, lock: FolderLock = None):
    """(run, progress): the data, the model and its optimizer, restored from the checkpoint
    --preload names. Under torchrun, rank 0 goes first (it alone moves files, trains tokenizers
    and prepares the data); every rank then builds the same model, and
    DistributedDataParallel keeps them equal."""
    rank, world = start_distributed(config.device)
    if rank:
        sys.stdout = open(os.devnull, "w")  # one voice: rank 0's (errors still reach stderr)
    lock = lock or FolderLock(config.model_folder)  # rank 0's, before it writes anything
    try:
        with main_first() as shared:  # rank 0's `shared` reaches the others
            resume, config = resume_state(config, given, world)
            if rank == 0:
                check_writable(config.model_folder)
                lock.acquire()
            check = (lambda corpus: check_corpus(resume[1], resume[0], corpus)) \
                if resume and rank == 0 else None  # (path, state): before any preparing
            data = get_ds(config, shared.get("data_key"), check)
            shared["data_key"] = data.key
            if resume:
                check_resume_data(resume[1], resume[0], config, data)
                if rank == 0 and config.preload not in ("latest", "none"):
                    set_aside_later(config, resume[0])
        if config.data_dir:  # a checkpoint's corpus is found from any working directory
            config.data_dir = data.corpus["source"]
        run = build_run(config, data, rank, world, lock)
        progress = Progress(bad_steps=torch.zeros((), device=run.device))
        if resume:
            restore(run, progress, *resume)
        if world > 1:  # averages the gradients over the ranks during backward
            run.step_model = DistributedDataParallel(
                run.model, device_ids=[run.device.index] if run.device.type == "cuda" else None)
        if config.compile:
            run.step_model = torch.compile(run.step_model, dynamic=True)
    except BaseException:
        lock.release()
        raise
    return run, progress


def build_run(config: Config, data: Data, rank: int, world: int, lock: FolderLock) -> Run:
    """The device, the model (seeded: the same on every rank), Adam, the loss and the batches."""
    device = setup_device(config.device)
    amp_dtype = autocast_dtype(config, device)
    print(f"device {device}" + (f", {amp_dtype} autocast" if amp_dtype else ", fp32")
          + (f", {world} processes (torchrun)" if world > 1 else ""))
    torch.manual_seed(config.seed)
    model = build_model(config, data.tokenizer_src.get_vocab_size(),
                        data.tokenizer_tgt.get_vocab_size()).to(device)
    if world > 1:
        torch.manual_seed(config.seed + rank)  # the same weights, but each rank its own dropout
    print(f"model: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters")
    sampler = TokenBatchSampler(data.train.lengths(), config.max_tokens, config.batch_size,
                                shuffle=True, seed=config.seed, rank=rank, world_size=world)
    workers = config.num_workers
    # the sampler is driven from this process: set_epoch reaches workers kept between epochs
    loader = DataLoader(data.train, batch_sampler=sampler, collate_fn=Collator(),
                        num_workers=workers, pin_memory=device.type == "cuda",
                        persistent_workers=workers > 0, prefetch_factor=4 if workers else None,
                        worker_init_fn=ignore_sigint if workers else None,
                        generator=torch.Generator())  # leaves the global RNG (dropout) alone
    run = Run(config, device, data, model, model, make_optimizer(model, config.peak_lr()),
              torch.amp.GradScaler(device.type, enabled=amp_dtype == torch.float16),
              autocast(device, amp_dtype), make_loss(config), sampler, loader,
              len(sampler.batches(0)), 0, lock,
              str(amp_dtype).replace("torch.", "") + " autocast" if amp_dtype else "fp32",
              rank, world)
    run.schedule_steps = run.total_steps
    return run


def restore(run: Run, progress: Progress, path: Path, state: dict):
    """Continues the run saved in `state`: weights, optimizer, scaler, random state, position,
    learning-rate schedule and validation history."""
    restore_training(state, path, run.model, run.optimizer, run.scaler)
    restore_rng(state, run.rank, run.world_size, run.device, run.config.seed)
    progress.epoch, progress.batch = state["next_epoch"], state["next_batch"]
    progress.step = state["global_step"]
    progress.history = read_history(run.config, up_to_step=progress.step)
    made = state.get("provenance") or {}
    progress.commands, progress.seconds_before = list(made.get("commands", [])), \
        made.get("seconds", 0.0)
    saved_steps = state.get("schedule_steps", run.total_steps)
    run.schedule_steps = saved_steps  # the warm-up and decay go on as laid out
    if run.config.lr_schedule == "cosine" and saved_steps != run.total_steps:
        old = run.lr(progress.step + 1)
        run.schedule_steps = run.total_steps  # the cosine is laid out over the new length
        print(f"the run is now {run.total_steps} steps long (was {saved_steps}): the cosine "
              f"schedule is laid out again over its new length; the learning rate goes on at "
              f"{run.lr(progress.step + 1):.2e} (it was to be {old:.2e})")
    print(f"resumed from {path}: epoch {progress.epoch}, batch {progress.batch}, "
          f"step {progress.step}")


def nothing_to_do(run: Run, progress: Progress):
    """Why a resumed run has no step left to train (said instead of starting), or None."""
    config = run.config
    if config.max_steps and progress.step >= config.max_steps:
        return (f"already at step {progress.step} of --max_steps {config.max_steps}; raise "
                f"it to train on")
    if progress.epoch >= config.num_epochs:
        return (f"all {config.num_epochs} epochs are trained (step {progress.step}); raise "
                f"--num_epochs to train on")
    return None


def ignore_sigint(_worker_id):
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # DataLoader workers: the main process decides


# ---- one step -----------------------------------------------------------------------------------

def accumulation_groups(run: Run, epoch: int, start: int = 0):
    """The epoch's batches from batch `start` on, in groups of accum_steps (the last may be
    shorter), each with the number of the epoch's batches done after it."""
    run.sampler.set_epoch(epoch, start)
    group, done = [], start
    for batch in run.loader:
        group.append(batch)
        done += 1
        if len(group) == run.config.accum_steps or done == run.batches_per_epoch:
            yield group, done
            group = []


def train_step(model, group, loss_fn, pad_id: int, device, amp=nullcontext, scaler=None,
               world_size: int = 1, no_sync=None):
    """Forward and backward over a group of batches (gradient accumulation). The loss is summed
    over tokens and divided by the token count of the whole update, on every rank, so that k
    accumulated batches on N ranks give the gradients of one k·N-times batch. `no_sync` (DDP's)
    skips the gradient all-reduce on all but the last batch. Returns (mean loss per token of
    this rank's batches, as a tensor: reading it waits for the GPU; tokens of the update)."""
    n_tokens = sum(int((b["label"] != pad_id).sum()) for b in group)  # on the host: no sync
    if world_size > 1:
        n_tokens = int(sum_over_ranks(n_tokens)[0])
    loss_total = torch.zeros((), device=device)
    for i, b in enumerate(group):
        last = i == len(group) - 1
        with nullcontext() if last or no_sync is None else no_sync():
            with amp():  # the summed loss over the batch's target tokens; causal decoder
                loss = model(b["encoder_input"].to(device, non_blocking=True),
                             b["decoder_input"].to(device, non_blocking=True),
                             b["encoder_mask"].to(device, non_blocking=True),
                             label=b["label"].to(device, non_blocking=True), loss=loss_fn)
            loss = loss / n_tokens
            # DDP averages the ranks' gradients: times world_size makes it their sum
            scaled = loss * world_size
            (scaler.scale(scaled) if scaler is not None else scaled).backward()
        loss_total += loss.detach()
    return loss_total, n_tokens


def optimizer_step(run: Run, progress: Progress, loss: torch.Tensor, lr: float):
    """Clips the gradient and lets Adam apply it at learning rate `lr`, unless the gradient
    (or, with the fp16 scaler, the loss) is not finite: then the update is skipped and counted
    in progress.bad_steps. All on the device, without waiting for it: the skip is fused Adam's
    `found_inf`, as the gradient scaler uses it; `check_updates` reads the count."""
    run.scaler.unscale_(run.optimizer)
    grad_norm = nn.utils.clip_grad_norm_(run.model.parameters(),
                                         run.config.clip_grad or math.inf, foreach=True)
    for param_group in run.optimizer.param_groups:
        param_group["lr"] = lr
    finite = torch.isfinite(grad_norm)
    if run.scaler.is_enabled():  # fp16: the scaler skips overflows and lowers its scale
        run.scaler.step(run.optimizer)
        # an overflow is not a diverged step; a NaN loss is, on any rank: all of them decide
        # together (each holds only its share of the loss), so they stop at the same step
        finite = torch.isfinite(loss_over_ranks(loss, run.world_size))
    elif run.optimizer.defaults.get("fused"):
        run.optimizer.found_inf = (~finite).float()
        run.optimizer.step()
        del run.optimizer.found_inf
    elif bool(finite):  # a device without fused Adam: decided on the host
        run.optimizer.step()
    run.scaler.update()
    run.optimizer.zero_grad(set_to_none=True)
    progress.bad_steps = torch.where(finite, 0, progress.bad_steps + 1)


def loss_over_ranks(loss: torch.Tensor, world_size: int) -> torch.Tensor:
    """The update's loss summed over the ranks (on the device, no wait): non-finite if any
    rank's share is."""
    if world_size == 1:
        return loss
    total = loss.detach().clone()
    torch.distributed.all_reduce(total)
    return total


def check_updates(run: Run, progress: Progress):
    """Reads the count of skipped (non-finite) updates in a row: says so, and stops training
    without saving when it reaches max_bad_steps. Called where reading from the device is
    free (CPU) or asked for (--log_every)."""
    bad = int(progress.bad_steps)
    if not bad:
        return
    run.writer.add_scalar("train/skipped_nonfinite", bad, progress.step)
    tqdm.write(f"step {progress.step}: non-finite loss or gradient, update skipped "
               f"({bad} in a row)")
    if bad >= run.config.max_bad_steps:
        raise CheckpointError(
            f"{bad} non-finite updates in a row: training stopped without saving the diverged "
            f"weights; lower --lr or use --precision fp32, then resume from the last checkpoint "
            f"in {run.config.model_folder}")


def log_progress(run: Run, progress: Progress, bar, lr: float, tokens_per_s: float):
    """The mean training loss since the last log (over all ranks), to TensorBoard and the
    progress bar: the one place the loop waits for the GPU."""
    loss = torch.stack(progress.loss_window).mean()
    if run.world_size > 1:
        torch.distributed.all_reduce(loss)  # each rank holds its share of the update's loss
    loss, progress.loss_window = loss.item(), []
    run.writer.add_scalar("train/loss", loss, progress.step)
    run.writer.add_scalar("train/lr", lr, progress.step)
    run.writer.add_scalar("train/tok_s", tokens_per_s, progress.step)
    bar.set_postfix(loss=f"{loss:6.3f}", tok_s=f"{tokens_per_s:,.0f}", refresh=False)


# ---- saving and stopping ------------------------------------------------------------------------

def save(run: Run, progress: Progress, next_epoch: int, next_batch: int, path: Path):
    """A checkpoint of everything needed to continue at (next_epoch, next_batch), then
    pruning. Every rank calls it (each rank's random state is gathered); rank 0 writes."""
    ranks = gather_to_main(rng_states(run.device))
    if run.rank:
        return
    save_checkpoint(training_checkpoint(run, progress.step, progress.epoch, next_epoch,
                                        next_batch, ranks, progress.provenance()), path)
    prune_checkpoints(run.config)


def abort(signum=None, frame=None):
    """Stops at once (KeyboardInterrupt), and lets no later signal cut short the clean-up on
    the way out (releasing the folder, closing the process group): under torchrun a Ctrl-C
    reaches each process twice, from the terminal and from torchrun."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise KeyboardInterrupt


def catch_stop_signals(progress: Progress = None):
    """Ctrl-C / SIGTERM while training: finish the current step, save, exit; a second one
    aborts (the checkpoints already written stay intact: saves are atomic). Without
    `progress` (while setting up, before any step): abort at once."""
    def handle(signum, frame):
        if progress is None or progress.signal:
            abort()
        progress.signal = signal.Signals(signum).name
        tqdm.write(f"{progress.signal}: stopping after this step or decoding batch (press "
                   f"Ctrl-C again to abort)")
    signal.signal(signal.SIGINT, handle)
    signal.signal(signal.SIGTERM, handle)


def stop_after_step(run: Run, progress: Progress) -> Stop:
    """Saves mid-epoch every save_every steps, and on a stop signal (on any rank) or at
    max_steps; returns why training stops now. Reaching max_steps on the epoch's last batch
    ends the epoch as usual (its checkpoint, its validation)."""
    config = run.config
    stop = Stop(max_over_ranks(Stop.SIGNAL if progress.signal else Stop.NONE))
    if not stop and config.max_steps and progress.step >= config.max_steps:
        stop = Stop.MAX_STEPS
    end_of_epoch = progress.batch == run.batches_per_epoch
    periodic = config.save_every and not end_of_epoch and progress.step % config.save_every == 0
    if (stop or periodic) and not (stop is Stop.MAX_STEPS and end_of_epoch):
        save(run, progress, progress.epoch, progress.batch,
             step_checkpoint_path(config, progress.epoch, progress.step))
    return stop


def resume_command(run: Run) -> str:
    """The command that continues this run: where it works (the run group of flags, which a
    resume never takes from the checkpoint) as given, under the launcher it ran under; the
    rest comes from the checkpoint."""
    config, default = run.config, Config()
    flags = [f"--{name} {getattr(config, name)}" for name in
             ("model_folder", "model_basename", "experiment_name", "device", "num_workers")
             if name == "model_folder" or getattr(config, name) != getattr(default, name)]
    return f"{launcher(run.world_size)} train.py {' '.join(flags)}"


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


def stop_message(run: Run, progress: Progress, stop: Stop) -> str:
    why = (f"stopped by {progress.signal or 'a signal'}" if stop is Stop.SIGNAL else
           f"reached --max_steps {run.config.max_steps}")
    return (f"{why} in epoch {progress.epoch} after batch {progress.batch} of "
            f"{run.batches_per_epoch} (step {progress.step}); saved "
            f"{latest_checkpoint_path(run.config)}. Resume with: {resume_command(run)}")


# ---- validation ---------------------------------------------------------------------------------

class StopRequested(Exception):
    """Ctrl-C or SIGTERM while decoding (validation, test scoring): stop at the next batch."""


@contextmanager
def decoding_bar(run: Run, progress: Progress, total: int, what: str):
    """A progress bar over the sentences decoded, yielding translate_ids's `progress`: it
    raises StopRequested at the next batch once a stop signal came."""
    bar = tqdm(total=total, desc=what, unit=" sentences", leave=False, dynamic_ncols=True,
               mininterval=1.0, disable=run.rank != 0)

    def advance(done: int):
        bar.update(done)
        if progress.signal:
            raise StopRequested()
    try:
        yield advance
    finally:
        bar.close()


@torch.no_grad()
def validation_loss(run: Run) -> float:
    """The loss per target token over the validation split, teacher-forced."""
    config, val, device = run.config, run.data.validation, run.device
    sampler = TokenBatchSampler(val.lengths(), config.max_tokens, config.batch_size or 32,
                                shuffle=False)
    loss_sum, tokens = 0.0, 0
    for batch in DataLoader(val, batch_sampler=sampler, collate_fn=Collator()):
        label = batch["label"].to(device)  # (batch, tgt_len)
        with run.amp():
            loss_sum += run.model(batch["encoder_input"].to(device),
                                  batch["decoder_input"].to(device),
                                  batch["encoder_mask"].to(device), label=label,
                                  loss=run.loss_fn).item()
        tokens += (label != PAD).sum().item()
    return loss_sum / max(tokens, 1)


@torch.no_grad()
def run_validation(run: Run, progress: Progress) -> dict:
    """Validation loss, then greedy decoding of the validation set (or its first
    val_max_sentences) scored with BLEU, chrF, CER and WER; prints a few examples."""
    config, val = run.config, run.data.validation
    run.model.eval()
    loss = validation_loss(run)
    n = len(val) if config.val_max_sentences == 0 else min(config.val_max_sentences, len(val))
    started = time.time()
    with decoding_bar(run, progress, n, "validating") as advance:
        outputs = translate_ids(run.model, val.src_ids[:n], SOS, EOS, PAD, config.seq_len,
                                unk_id=UNK, **decoding_limits(config), progress=advance,
                                batch_size=max(config.max_tokens // 40, config.batch_size, 1))
    predictions = [detokenize(run.data.tokenizer_tgt, ids) for ids in outputs]
    metrics = {"loss": loss, **score(predictions, val.tgt_texts[:n])}
    for name, value in metrics.items():
        if name != "report":
            run.writer.add_scalar(f"validation/{name}", value, progress.step)
    examples = [f"{'SOURCE:':>12} {val.src_texts[i]}\n{'TARGET:':>12} {val.tgt_texts[i]}\n"
                f"{'PREDICTED:':>12} {predictions[i]}" for i in range(min(config.val_examples, n))]
    if examples:
        tqdm.write("-" * 80 + "\n" + ("\n" + "-" * 80 + "\n").join(examples) + "\n" + "-" * 80)
        run.writer.add_text("validation/examples",
                            "\n\n".join("    " + e.replace("\n", "\n    ") for e in examples),
                            progress.step)
    tqdm.write(f"validation: loss {metrics['loss']:.3f}  BLEU {metrics['bleu']:.2f}  "
               f"chrF {metrics['chrf']:.2f}  CER {metrics['cer']:.3f}  WER {metrics['wer']:.3f}"
               f"  ({n} sentences decoded in {time.time() - started:.1f}s)")
    run.model.train()
    return metrics


def validate(run: Run, progress: Progress) -> Stop:
    """Validation, once: on rank 0 while the others wait. Returns, on every rank, Stop.PATIENCE
    if patience has run out, Stop.SIGNAL if a stop signal interrupted it, or Stop.NONE."""
    stop = Stop.NONE
    if run.rank == 0:
        try:
            stop = keep_best(run, progress, run_validation(run, progress))
        except StopRequested:
            run.model.train()
            stop = Stop.SIGNAL
    return Stop(max_over_ranks(stop))


def rank_of(h: dict):
    """How validations compare: by BLEU, ties broken by the lower loss (a young model at BLEU
    0.00 is still getting better while its loss falls)."""
    return h["bleu"], -h["loss"]


def keep_best(run: Run, progress: Progress, metrics: dict) -> Stop:
    """Records a validation; a new best (by `rank_of`) is saved as the best checkpoint
    (weights and config only). Returns Stop.PATIENCE if patience has run out."""
    config, history = run.config, progress.history
    history.append({"step": progress.step, "epoch": progress.epoch,
                    **{k: v for k, v in metrics.items() if k != "report"}})
    write_history(config, history)
    best = max(history, key=rank_of)
    if best is history[-1]:
        save_checkpoint(best_checkpoint(run, progress.step, progress.epoch, best),
                        best_checkpoint_path(config))
        tqdm.write(f"new best validation BLEU {best['bleu']:.2f} (loss {best['loss']:.3f}): "
                   f"saved {best_checkpoint_path(config)}")
    since = len(history) - 1 - history.index(best)
    return Stop.PATIENCE if config.patience and since >= config.patience else Stop.NONE


@torch.no_grad()
def score_test_sets(run: Run, progress: Progress):
    """Translates the corpus's test split with the best checkpoint (loaded into a model of its
    own: the run's weights are left as they are), greedy and beam 4, and prints, logs and
    writes (results.json in the model folder) sacreBLEU BLEU and chrF. Returns the results and
    a few (source, reference, greedy translation) samples; (None, []) without a test split or
    when a stop signal interrupts."""
    config, test, data = run.config, run.data.test, run.data
    path = best_checkpoint_path(config)
    if test is None or not path.exists():
        return None, []
    best = build_model(config, data.tokenizer_src.get_vocab_size(),
                       data.tokenizer_tgt.get_vocab_size())
    load_model_weights(best, load_checkpoint(path), path)
    best = best.to(run.device).eval()
    results = {"checkpoint": str(path), "sentences": len(test[0]), "scores": {}}
    for beam in (1, 4):
        name = "greedy" if beam == 1 else f"beam{beam}"
        try:
            with decoding_bar(run, progress, len(test[0]), f"test, {name}") as advance:
                hyps = translate(best, config, data.tokenizer_src, data.tokenizer_tgt, test[0],
                                 beam=beam, progress=advance)
        except StopRequested:
            tqdm.write(f"test scoring stopped by {progress.signal}: no results.json written "
                       f"(translate.py --preload best --input ... --reference ... scores it)")
            return None, []
        if beam == 1:
            samples = list(zip(test[0][:3], test[1][:3], hyps[:3]))
        scores = score(hyps, test[1], error_rates=False)
        results["scores"][name] = scores
        for metric in ("bleu", "chrf"):
            run.writer.add_scalar(f"test/{metric}_{name}", scores[metric], progress.step)
        tqdm.write(f"test ({len(hyps)} sentences, best checkpoint, {name}):\n{scores['report']}")
    out = Path(config.model_folder) / "results.json"
    write_text_atomic(out, json.dumps(results, indent=1))
    tqdm.write(f"wrote {out}")
    return results, samples


def write_model_card(run: Run, progress: Progress, results: dict, samples: list):
    """MODEL_CARD.md and its validation curve in the model folder of a finished run."""
    data, config = run.data, run.config
    sizes = (f"{len(data.train):,} training pairs, {len(data.validation):,} validation pairs"
             + (f", {len(data.test[0]):,} test pairs" if data.test else "")
             + (" (validation held out of the training split)" if data.held_out else ""))
    threads = f", {torch.get_num_threads()} threads" if run.device.type == "cpu" else ""
    card = {"folder": config.model_folder, "config": config, "commands": progress.commands,
            "corpus": data.corpus["source"], "sizes": sizes,
            "vocab": (data.tokenizer_src.get_vocab_size(), data.tokenizer_tgt.get_vocab_size()),
            "parameters": sum(p.numel() for p in run.model.parameters()),
            "steps": progress.step, "epochs": progress.epoch + (progress.batch > 0),
            "seconds": progress.provenance()["seconds"], "precision": run.precision,
            "device": f"{run.device}{threads} ({platform.processor() or platform.machine()})",
            "history": progress.history, "results": results, "samples": samples}
    tqdm.write(f"wrote {write_card(card, write_text_atomic)}")


# ---- the loop -----------------------------------------------------------------------------------

def train_epoch(run: Run, progress: Progress) -> Stop:
    """Optimizer steps over the rest of epoch progress.epoch, validating every eval_every
    steps. Returns Stop.NONE at the end of the epoch, or why it stopped before."""
    config, epoch = run.config, progress.epoch
    run.model.train()
    bar = tqdm(total=run.batches_per_epoch, desc=f"epoch {epoch:02d}", dynamic_ncols=True,
               mininterval=1.0, initial=progress.batch, disable=run.rank != 0)
    tokens_seen, started = 0, time.time()  # `started` moves past validations: tok_s trains
    no_sync = getattr(run.step_model, "no_sync", None)
    for group, done in accumulation_groups(run, epoch, progress.batch):
        loss, _ = train_step(run.step_model, group, run.loss_fn, PAD, run.device, run.amp,
                             run.scaler, run.world_size, no_sync)
        lr = run.lr(progress.step + 1)
        optimizer_step(run, progress, loss, lr)
        progress.step, progress.batch = progress.step + 1, done
        progress.loss_window.append(loss)
        tokens_seen += sum(real_tokens(b) for b in group)
        bar.update(done - bar.n)
        logging = progress.step % config.log_every == 0 or done == run.batches_per_epoch
        if logging:
            tokens_per_s = tokens_seen * run.world_size / (time.time() - started)
            log_progress(run, progress, bar, lr, tokens_per_s)
        if logging or run.device.type == "cpu":
            check_updates(run, progress)
        stop = stop_after_step(run, progress)
        if stop:
            bar.close()  # before the stop message: the bar is not drawn again under it
            if stop is Stop.SIGNAL or done < run.batches_per_epoch:
                tqdm.write(stop_message(run, progress, stop))
            return stop
        if (config.eval_every and progress.step % config.eval_every == 0
                and done < run.batches_per_epoch):  # the epoch's end validates anyway
            paused = time.time()
            stop = validate(run, progress)
            started += time.time() - paused
            if stop:
                save(run, progress, epoch, done,
                     step_checkpoint_path(config, epoch, progress.step))
                bar.close()
                if stop is Stop.SIGNAL:
                    tqdm.write(stop_message(run, progress, stop) + " (validation at this step "
                               "was interrupted and is not recorded)")
                return stop
    bar.close()
    run.writer.add_scalar("train/epoch_tokens_per_s",
                          tokens_seen * run.world_size / (time.time() - started), progress.step)
    return Stop.NONE


def end_epoch(run: Run, progress: Progress, stop: Stop) -> Stop:
    """After the epoch's last batch, or a stop within it at max_steps or patience: the epoch's
    checkpoint if it ended (first: a crash while decoding loses nothing), then validation
    (unless patience has just validated). Returns why training stops (Stop.NONE: go on)."""
    config, ended = run.config, progress.batch == run.batches_per_epoch
    if ended:
        save(run, progress, progress.epoch + 1, 0, epoch_checkpoint_path(config, progress.epoch))
        if stop is Stop.MAX_STEPS:
            tqdm.write(stop_message(run, progress, stop))
    if stop is not Stop.PATIENCE:
        stop = max(stop, validate(run, progress))
    run.writer.flush()
    if stop is Stop.SIGNAL:
        tqdm.write(f"stopped by {progress.signal or 'a signal'} while validating epoch "
                   f"{progress.epoch} (not recorded); saved {latest_checkpoint_path(config)}. "
                   f"Resume with: {resume_command(run)}")
    elif stop is Stop.PATIENCE:
        print(f"no better validation in the last {config.patience} validations "
              f"(--patience {config.patience}): training stops")
    if ended:
        progress.epoch, progress.batch = progress.epoch + 1, 0
    return stop


def train_model(config: Config, given: set = frozenset(), argv=None):
    """Trains as `config` says, resuming per --preload: epochs of optimizer steps, each epoch
    ending with a checkpoint, then validation; the best checkpoint by validation BLEU is kept,
    scores the test split at the end, and a finished run writes its model card. `argv`: the
    command line given (the card's record of how the run was made)."""
    catch_stop_signals()  # while setting up: a signal aborts, once
    lock = FolderLock(config.model_folder)
    try:
        run, progress = set_up(config, given, lock)
        idle = nothing_to_do(run, progress)
        if idle:
            print(idle)
            return
        run.writer = SummaryWriter(run.config.experiment_name) if run.rank == 0 else NoWriter()
        catch_stop_signals(progress)
        script, args = ("train.py", argv) if argv is not None else (sys.argv[0], sys.argv[1:])
        progress.commands.append(f"{launcher(run.world_size)} {' '.join([script, *args])}")
        progress.started, stop = time.time(), Stop.NONE
        while progress.epoch < run.config.num_epochs and not stop:
            stop = train_epoch(run, progress)
            if stop is not Stop.SIGNAL:
                stop = end_epoch(run, progress, stop)
        if run.rank == 0 and stop is not Stop.SIGNAL:
            results, samples = score_test_sets(run, progress)
            if not progress.signal:  # a finished run: its model card
                write_model_card(run, progress, results, samples)
        run.writer.close()
    finally:
        lock.release()


@contextmanager
def removed_if_left_empty(folder):
    """A failed start (a bad path, a refused checkpoint) leaves no empty folder behind: the
    model folder is removed again if this run created it and wrote nothing in it."""
    new = not Path(folder).exists()
    try:
        yield
    except BaseException:
        if new:
            try:
                Path(folder).rmdir()  # only an empty folder
            except OSError:
                pass
        raise


def main(argv=None):
    parser = ArgumentParser(description="Train a Transformer for translation. Every flag "
                                        "defaults to config.py; on resume, to the checkpoint's.")
    config, given = parse_config(argv, parser)

    def train_here():
        with removed_if_left_empty(config.model_folder):
            train_model(config, given, argv)
    try:
        run_main("train.py", train_here, aborted="aborted; the checkpoints already saved are "
                                                 "intact")
    finally:
        stop_distributed()


if __name__ == "__main__":
    main()
