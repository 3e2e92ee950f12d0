"""Train a Transformer translation model.

    python train.py                                   # OPUS Books en->it from the hub
    python train.py --preset multi30k_modern --data_dir data/multi30k   # the README's recipe
    python train.py --help                            # every flag, with its default
    torchrun --standalone --nproc_per_node=4 train.py ...   # data-parallel on 4 GPUs
    tensorboard --logdir runs

Read top to bottom: Adam, its schedule and the loss (sections 5.3, 5.4); the run, set up once
(`set_up`); one optimizer step (`train_step`, `optimizer_step`); the loop (`train_epoch`,
`end_epoch`, `train_model`), which saves, validates and stops. Scoring is nmt/evaluation.py's,
stopping on a signal nmt/stopping.py's, a resume's checks nmt/resume.py's. Resumes from the
newest checkpoint in --model_folder by default (--preload latest).
"""

import math
import os
import shlex
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import torch
import torch.nn as nn
from torch.utils.data import DataLoader
from torch.utils.tensorboard import SummaryWriter
from tqdm import tqdm

from config import Config, parse_config
from dataset import Data, get_ds, real_tokens
from kernels import BlockwiseLabelSmoothedCrossEntropy
from nmt.batching import TokenBatchSampler
from nmt.bpe_dropout import training_batches
from nmt.checkpoint import (best_checkpoint, best_checkpoint_path, card_step,
                            check_tokenizers, epoch_checkpoint_path, prune_checkpoints,
                            save_checkpoint, step_checkpoint_path, training_checkpoint)
from nmt.cli import ArgumentParser, run_main
from nmt.budget import Budget, budget_for, clock
from nmt.compiling import check_cuda_graphs, choose_shapes, compiled
from nmt.distill import finish_translation, plan_translation, translate_share
from nmt.evaluation import run_validation, score_test_sets
from nmt.files import FolderLock, check_writable, remove_files, removed_if_left_empty
from nmt.model_card import write_run_card
from nmt.resume import (Progress, after_smaller_batches, best_validation, check_corpus,
                        check_resume_data, copy_tokenizers, coverage_note, init_state,
                        nothing_to_do, restore_progress, restore_rng, restore_training,
                        resume_state, rng_states, set_aside_later, settings_to_check,
                        validation_cut_short, validations_since_best, write_history)
from nmt.runtime import (NoWriter, autocast, autocast_dtype, busy_note, data_parallel,
                         exit_distributed, gather_to_main, get_device, is_out_of_memory, main_first,
                         max_over_ranks, note_precision, out_of_memory, say_device, setup_device,
                         start_distributed, sum_over_ranks, use_threads)
from nmt.stopping import (Stop, StopRequested, abort_watch, aborted, aborting,
                          catch_stop_signals, exit_code, ignore_sigint, launcher,
                          stop_message, validation_stop_message)
from nmt.trained_model import build_model, load_model_weights
from nmt.training_log import carried_loss, check_updates, log_progress
from tokenizer import PAD

ABORTED = "aborted; the checkpoints already saved are intact"  # a second Ctrl-C's line

# ---- sections 5.3 and 5.4: Adam, its learning rate, and the label-smoothed loss -----------------


def warmup_steps(config: Config, total_steps: int) -> int:
    """--warmup as given; 0 (the default): 4000 steps, but at most a tenth of a run of
    `total_steps` (0: unknown), so that a short run on small data warms up and learns too."""
    return config.warmup or max(min(4000, total_steps // 10) if total_steps else 4000, 1)


def learning_rate(config: Config, step: int, total_steps: int) -> float:
    """The learning rate of optimizer step `step` (counting from 1) of a run of `total_steps`
    (0: unknown), with `warmup_steps` of warm-up.

    constant:     lr
    inverse_sqrt: the paper's lr = d_model^-0.5 · min(step^-0.5, step · warmup^-1.5), rescaled so
                  that its peak (at step = warmup) is `lr`; --lr (d_model·warmup)^-0.5 gives the
                  paper's exact values (7.0e-4 for 512 and 4000).
    cosine:       linear warm-up to lr, then half a cosine that would reach 0 one step after
                  the last: every step of the run learns. A run lengthened on resume is laid
                  out again over its new length (nmt.resume.restore_progress)."""
    step, peak, warmup = max(step, 1), config.peak_lr(), warmup_steps(config, total_steps)
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
    CUDA): the default per-parameter loop is much slower on CPU (docs/performance.md)."""
    params = list(model.parameters())
    try:
        return torch.optim.Adam(params, lr=lr, betas=(0.9, 0.98), eps=1e-9, fused=True)
    except (RuntimeError, ValueError, TypeError):  # a device without the fused kernel
        return torch.optim.Adam(params, lr=lr, betas=(0.9, 0.98), eps=1e-9)


def make_loss(config: Config):
    """Cross-entropy with label smoothing (section 5.4), summed over the non-padding tokens:
    model.LabelSmoothedCrossEntropy's formula, computed a block of positions at a time
    (kernels.py; faster than the whole logits and torch's fused loss on CPU, and smaller)."""
    return BlockwiseLabelSmoothedCrossEntropy(config.label_smoothing, ignore_index=PAD)


# ---- the run: set up once, before the first step; and its progress ------------------------------

@dataclass(frozen=True)
class Run:
    """What a training run works with: made once by `set_up`, before the first step."""
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
    writer: object = field(default_factory=NoWriter)  # TensorBoard (rank 0)
    budget: Budget = None  # --time_budget's plan (nmt/budget.py), or None

    def steps(self) -> int:
        """The schedule's length now: under --time_budget, the plan the ranks agreed on."""
        return self.budget.agreed if self.budget else self.schedule_steps

    def lr(self, step: int) -> float:
        """The learning rate of optimizer step `step` (counting from 1)."""
        return learning_rate(self.config, step, self.steps())


def total_steps(config: Config, batches_per_epoch: int) -> int:
    """The length of the run in optimizer steps: num_epochs, or max_steps if sooner."""
    steps = math.ceil(batches_per_epoch / config.accum_steps) * config.num_epochs
    return min(steps, config.max_steps) if config.max_steps else steps


def set_up(config: Config, given: set, lock: FolderLock = None, started: float = None):
    """(run, progress): the data, the model and its optimizer, restored from the checkpoint
    --preload names. Under torchrun, rank 0 goes first (it alone moves files, trains tokenizers
    and prepares the data); every rank then builds the same model, and
    DistributedDataParallel keeps them equal. `started`: when the run began (a budget's)."""
    rank, world = start_distributed(config.device)
    if rank:
        sys.stdout = open(os.devnull, "w")  # one voice: rank 0's (errors still reach stderr)
    device = get_device(config.device)  # no device: refused here, before any file is written
    note_precision(device, config.precision)
    lock = lock or FolderLock(config.model_folder)  # rank 0's, before it writes anything
    created = []  # files this start wrote before it could fail: a failed start takes them back
    try:
        with main_first() as shared:  # rank 0's `shared` reaches the others
            resume, config = resume_state(config, given, world)
            init, config = init_state(config, given) if not resume else (None, config)
            check_cuda_graphs(config, device)  # (a resume takes the checkpoint's flag)
            if rank == 0:
                check_writable(config.model_folder)
                lock.acquire()
                if init:  # a new run from a trained model: its tokenizers, not new ones
                    created = copy_tokenizers(*init, config)
                shared["distilling"] = plan_translation(config, resume and resume[1])
        distilling = shared.get("distilling")  # --distill_from: each process translates a share
        translate_share(config, distilling, rank, world)
        with main_first() as shared:
            if rank == 0:
                finish_translation(config, distilling)  # the shares joined: the targets
            start = (resume or init) if rank == 0 else None  # (path, state): before preparing
            data = get_ds(config, shared.get("data_key"),
                          partial(check_corpus, *resume[::-1]) if resume and rank == 0 else None,
                          partial(check_tokenizers, *start[::-1]) if start else None)
            shared["data_key"] = data.key
            if resume:
                check_resume_data(resume[1], resume[0], config, data)
                if rank == 0 and config.preload not in ("latest", "none"):
                    set_aside_later(config, resume[0])
            elif init:
                print(f"a new run from {init[0]}: {coverage_note(init[1], data)}")
        if config.data_dir:  # a checkpoint's corpus is found from any working directory
            config.data_dir = data.corpus["source"]
        return build_run(config, data, resume, rank, world, lock, init, started or clock())
    except BaseException:
        remove_files(created)
        lock.release()
        raise


def build_run(config: Config, data: Data, resume, rank: int, world: int, lock: FolderLock,
              init=None, started: float = None):
    """(run, progress): the device, the model (seeded: the same on every rank), Adam, the loss
    and the batches; restored from `resume` ((path, state), or None for a fresh start), or
    with the weights of `init` (--init_from's (path, state)) and all else fresh."""
    device = setup_device(config.device)
    use_threads(config.threads)
    busy = busy_note(device) if rank == 0 else None
    if busy:
        print(busy, file=sys.stderr)
    amp_dtype = autocast_dtype(config, device)
    say_device(config, device, amp_dtype, rank, world)
    torch.manual_seed(config.seed)
    model = build_model(config, data.tokenizer_src.get_vocab_size(),
                        data.tokenizer_tgt.get_vocab_size()).to(device)
    if world > 1:
        torch.manual_seed(config.seed + rank)  # the same weights, but each rank its own dropout
    print(f"model: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters")
    shapes = choose_shapes(config, data, say=rank == 0)  # None without --fixed_shapes/--compile
    sampler = TokenBatchSampler(data.train.lengths(), config.max_tokens, config.batch_size,
                                shuffle=True, seed=config.seed, rank=rank, world_size=world,
                                shapes=shapes)
    workers = config.num_workers
    # the sampler is driven from this process: set_epoch reaches workers kept between epochs
    train_set, batch_sampler, collate = training_batches(data, sampler, config.bpe_dropout,
                                                         config.seq_len, shapes)
    loader = DataLoader(train_set, batch_sampler=batch_sampler, collate_fn=collate,
                        num_workers=workers, pin_memory=device.type == "cuda",
                        persistent_workers=workers > 0, prefetch_factor=4 if workers else None,
                        worker_init_fn=ignore_sigint if workers else None,
                        generator=torch.Generator())  # leaves the global RNG (dropout) alone
    optimizer = make_optimizer(model, config.peak_lr())
    scaler = torch.amp.GradScaler(device.type, enabled=amp_dtype == torch.float16)
    batches, progress = len(sampler.batches(0)), Progress(bad_steps=torch.zeros((), device=device),
                                                          began=started)
    schedule_steps = total_steps(config, batches)
    if resume:
        restore_training(resume[1], resume[0], model, optimizer, scaler)
        restore_rng(resume[1], rank, world, device, config.seed)
        schedule_steps = restore_progress(config, progress, *resume, schedule_steps,
                                          learning_rate)
    elif init:
        load_model_weights(model, init[1], init[0])
    step_model = model
    if world > 1:  # averages the gradients over the ranks during backward
        step_model = data_parallel(model, device)
    if config.compile:
        step_model = compiled(step_model, config, device, shapes)
    budget = budget_for(config, data, batches, schedule_steps, progress, started)
    writer = SummaryWriter(str(Path(config.experiment_name).resolve())) \
        if rank == 0 and not nothing_to_do(config, progress) else NoWriter()
    precision = str(amp_dtype).replace("torch.", "") + " autocast" if amp_dtype else "fp32"
    return Run(config, device, data, model, step_model, optimizer, scaler,
               autocast(device, amp_dtype), make_loss(config), sampler, loader, batches,
               schedule_steps, lock, precision, rank, world, writer, budget), progress


# ---- one optimizer step -------------------------------------------------------------------------

def accumulation_groups(run: Run, epoch: int, start: int = 0):
    """The epoch's batches from batch `start` on, in groups of accum_steps (the last may be
    shorter), each with the number of the epoch's batches done after it."""
    run.sampler.set_epoch(epoch, start)
    group, done = [], start
    for item in run.loader:
        for batch in item if isinstance(item, list) else [item]:  # a pool (BPE-dropout): batches
            group.append(batch)
            done += 1
            if len(group) == run.config.accum_steps or done == run.batches_per_epoch:
                yield group, done
                group = []


def target_tokens(group, pad_id: int = PAD) -> int:
    """The target tokens of a group of batches, counted on the host: no GPU synchronisation."""
    return sum(int((b["label"] != pad_id).sum()) for b in group)


def train_step(model, group, loss_fn, pad_id: int, device, amp=nullcontext, scaler=None,
               world_size: int = 1, no_sync=None, n_tokens: int = None):
    """Forward and backward over a group of batches (gradient accumulation). The loss is summed
    over tokens and divided by the token count of the whole update (`n_tokens`, over all ranks;
    counted here when not given), on every rank, so that k accumulated batches on N ranks give
    the gradients of one k·N-times batch. `no_sync` (DDP's) skips the gradient all-reduce on
    all but the last batch. Returns (mean loss per token of this rank's batches, as a tensor:
    reading it waits for the GPU; tokens of the update)."""
    if n_tokens is None:
        n_tokens = int(sum_over_ranks(target_tokens(group, pad_id))[0])
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
            scaled = loss * world_size  # DDP averages the ranks' gradients: this makes the sum
            (scaler.scale(scaled) if scaler is not None else scaled).backward()
        loss_total += loss.detach()
    return loss_total, n_tokens


def optimizer_step(run: Run, progress: Progress, loss: torch.Tensor, lr: float):
    """Clips the gradient and lets Adam apply it at learning rate `lr`, unless the gradient
    (or, with the fp16 scaler, the loss on any rank) is not finite: then the update is skipped
    and counted in progress.bad_steps. All on the device, without waiting for it: the skip is
    fused Adam's `found_inf`, as the gradient scaler uses it; `nmt.training_log.check_updates` reads
    the count."""
    run.scaler.unscale_(run.optimizer)
    grad_norm = nn.utils.clip_grad_norm_(run.model.parameters(),
                                         run.config.clip_grad or math.inf, foreach=True)
    for param_group in run.optimizer.param_groups:
        param_group["lr"] = lr
    finite = torch.isfinite(grad_norm)
    if run.scaler.is_enabled():  # fp16: the scaler skips overflows and lowers its scale
        run.scaler.step(run.optimizer)
        if run.world_size > 1:  # each rank holds its share of the loss: all decide together
            loss = loss.detach().clone()
            torch.distributed.all_reduce(loss)
        finite = torch.isfinite(loss)  # an overflow is not a diverged step; a NaN loss is
    elif run.optimizer.defaults.get("fused"):
        run.optimizer.found_inf = (~finite).float()
        run.optimizer.step()
        del run.optimizer.found_inf
    elif bool(finite):  # a device without fused Adam: decided on the host
        run.optimizer.step()
    run.scaler.update()
    run.optimizer.zero_grad(set_to_none=True)
    progress.bad_steps = torch.where(finite, 0, progress.bad_steps + 1)


# ---- the loop: epochs of steps, saving, validating and stopping ---------------------------------

def save(run: Run, progress: Progress, next_epoch: int, next_batch: int, path: Path):
    """A checkpoint of everything needed to continue at (next_epoch, next_batch), then
    pruning. Every rank calls it (each rank's random state is gathered); rank 0 writes."""
    ranks = gather_to_main(rng_states(run.device))
    if run.rank:
        return
    save_checkpoint(training_checkpoint(run, progress.step, progress.epoch, next_epoch,
                                        next_batch, ranks, progress.provenance()), path)
    prune_checkpoints(run.config)


def validate(run: Run, progress: Progress) -> Stop:
    """Validation (nmt/evaluation.py): every rank decodes its share, rank 0 scores the whole; a new
    best (by BLEU, ties broken by the lower loss: a young model at BLEU 0.00 still gets better
    while its loss falls) is saved as the best checkpoint. Returns, on every rank, Stop.PATIENCE
    if patience has run out, Stop.SIGNAL if a stop signal interrupted it, or Stop.NONE."""
    stop, config, history = Stop.NONE, run.config, progress.history
    began = clock()
    try:  # (the random state as it was after: the epoch's checkpoint, saved before, resumes)
        with torch.random.fork_rng([run.device] if run.device.type == "cuda" else []):
            metrics = run_validation(run, progress)  # None on ranks other than 0
    except StopRequested:  # (every rank, told by any)
        run.model.train()
        return Stop(max_over_ranks(Stop.SIGNAL))
    seconds = clock() - began
    decoding = metrics.pop("seconds_decoding", seconds) if metrics else seconds
    progress.validated(seconds, decoding)
    if run.budget:  # its cost, in the plan (--time_budget)
        tqdm.write(run.budget.validated(seconds, progress.step, decoding))
    if run.rank == 0:
        history.append({"step": progress.step, "epoch": progress.validated_epoch(),
                        **{k: v for k, v in metrics.items() if k != "report"}})
        best = best_validation(history)
        if best is history[-1]:  # (first: a history naming a best has its checkpoint)
            save_checkpoint(best_checkpoint(run, progress.step, best["epoch"], best),
                            best_checkpoint_path(config))
            tqdm.write(f"new best validation BLEU {best['bleu']:.2f} (loss {best['loss']:.3f}): "
                       f"saved {best_checkpoint_path(config)}")
        write_history(config, history)
        if config.patience and validations_since_best(history) >= config.patience:
            stop = Stop.PATIENCE
            tqdm.write(f"no better validation in the last {config.patience} validations "
                       f"(--patience {config.patience}): training stops")
    return Stop(max_over_ranks(stop))


def train_epoch(run: Run, progress: Progress) -> Stop:
    """Optimizer steps over the rest of epoch progress.epoch, validating every eval_every
    steps. Returns Stop.NONE at the end of the epoch, or why it stopped before."""
    config, epoch, end = run.config, progress.epoch, run.batches_per_epoch
    run.model.train()
    bar = tqdm(total=end, desc=f"epoch {epoch:02d}", dynamic_ncols=True, mininterval=1.0,
               initial=progress.batch, disable=run.rank != 0, postfix=carried_loss(progress))
    tokens_seen, started = 0, time.time()  # `started` moves past validations: tok_s trains
    stop = Stop.NONE
    no_sync = getattr(run.step_model, "no_sync", None)
    for group, done in accumulation_groups(run, epoch, progress.batch):
        # the step's one exchange between the ranks' hosts: the update's target tokens, whether a
        # stop signal came to any rank during the last step; under --time_budget rank 0's plan
        n_tokens, signals, *plan = sum_over_ranks(
            target_tokens(group), progress.signal is not None,
            *(run.budget.proposal(run.rank) if run.budget else ()))
        if signals or (run.budget and run.budget.agree(plan, progress.step)):
            stop = Stop.SIGNAL if signals else Stop.MAX_STEPS  # (or the plan shrank to here)
            break
        lr = run.lr(progress.step + 1)
        try:
            loss, _ = train_step(run.step_model, group, run.loss_fn, PAD, run.device, run.amp,
                                 run.scaler, run.world_size, no_sync, int(n_tokens))
            optimizer_step(run, progress, loss, lr)
        except (torch.OutOfMemoryError, RuntimeError) as e:
            bar.close()  # the line below the bar, not on it
            if is_out_of_memory(e):  # any other error: as it was, its cause kept
                raise out_of_memory(run.config, run.device, group, after_smaller_batches) from None
            raise
        progress.step, progress.batch = progress.step + 1, done
        progress.loss_window.append(loss)
        tokens_seen += sum(real_tokens(b) for b in group)
        bar.update(done - bar.n)
        logging = (progress.step % config.log_every == 0 or done == end
                   or progress.smoothed_loss is None)  # (the bar's loss from the first step)
        if logging:
            log_progress(run, progress, bar, lr, tokens_seen * run.world_size
                         / (time.time() - started))
        if logging or run.device.type == "cpu":  # a read from the device: free on a CPU
            check_updates(run, progress)
        ended = run.budget.stepped(progress.step, replan=logging) if run.budget else False
        if ended or (config.max_steps and progress.step >= config.max_steps):  # every rank
            stop = Stop.MAX_STEPS
            break
        if config.save_every and done < end and progress.step % config.save_every == 0:
            save(run, progress, epoch, done, step_checkpoint_path(config, epoch, progress.step))
        if (config.eval_every and progress.step % config.eval_every == 0 or run.budget and
                run.budget.timing) and done < end:  # (the epoch's end validates anyway)
            paused = time.time()
            stop = validate(run, progress)
            started += time.time() - paused
            if stop:  # patience ran out, or a signal came while validating (not recorded)
                break
    bar.close()  # before a stop message: the bar is not drawn again under it
    if stop is Stop.MAX_STEPS and progress.batch == 0 < progress.step:  # the plan ended at the
        progress.epoch, progress.batch = epoch - 1, end  # last epoch's end: end_epoch saves its
        return stop  # checkpoint again, with the schedule's end (saved before the plan shrank)
    if stop:  # (at max_steps on the epoch's last batch, the epoch's own checkpoint follows)
        if stop is not Stop.MAX_STEPS or progress.batch < end:
            save(run, progress, epoch, progress.batch,
                 step_checkpoint_path(config, epoch, progress.step))
        if stop is Stop.SIGNAL or (stop is Stop.MAX_STEPS and progress.batch < end):
            tqdm.write(stop_message(run, progress, stop))
        return stop
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
    if stop is not Stop.PATIENCE and progress.validated_at != progress.step:  # (not twice)
        stop = max(stop, validate(run, progress))
    run.writer.flush()
    if stop is Stop.SIGNAL:
        tqdm.write(validation_stop_message(run, progress, epoch_end=True))
    if ended:
        progress.epoch, progress.batch = progress.epoch + 1, 0
    return stop


def train_loop(run: Run, progress: Progress, argv=None, idle: str = None):
    """The run, set up: a validation first (--init_from's model, or the resumed checkpoint's if
    a stop cut it short), the epochs (none if `idle`: nothing is left), the test sets scored
    with the best checkpoint, the model card. Returns the signal that stopped it, or None."""
    script, args = ("train.py", argv) if argv is not None else (sys.argv[0], sys.argv[1:])
    progress.commands.append(f"{launcher(run.world_size)} {shlex.join([script, *args])}")
    progress.started, stop = clock(), Stop.NONE
    if run.budget and not idle:
        tqdm.write(run.budget.start())
    again = validation_cut_short(run.config, progress)
    if again or run.config.init_from and progress.step == 0 and not progress.history:
        stop = validate(run, progress)  # (--init_from's: the source model on the new data)
        if stop is Stop.SIGNAL:  # (nothing trained: nothing to save)
            tqdm.write(validation_stop_message(run, progress, epoch_end=False))
    while not idle and (run.budget or progress.epoch < run.config.num_epochs) and not stop:
        stop = train_epoch(run, progress)
        if stop is not Stop.SIGNAL:
            stop = end_epoch(run, progress, stop)
    if stop is not Stop.SIGNAL:
        return finish_run(run, progress)
    run.writer.close()
    return progress.signal


def finish_run(run: Run, progress: Progress):
    """The end of a run: the test sets scored with the best checkpoint (every rank translates
    its share), then the model card. Returns the signal that stopped it, or None."""
    results, samples = score_test_sets(run, progress)
    stopped = max_over_ranks(progress.signal is not None)  # a signal to any process stops all
    if run.rank == 0 and not stopped:  # a finished run: its model card
        tqdm.write(f"wrote {write_run_card(run, progress, results, samples)}")
    run.writer.close()
    return progress.signal


def train_model(config: Config, given: set = frozenset(), argv=None):
    """Trains as `config` says, resuming per --preload: epochs of optimizer steps, each epoch
    ending with a checkpoint, then validation; the best checkpoint by validation BLEU is kept,
    scores every test set at the end, and a finished run writes its model card. `argv`: the
    command line given (the card's record of how the run was made). Returns the name of the
    signal that stopped it (SIGINT, SIGTERM), or None."""
    catch_stop_signals()  # while setting up: a signal aborts, once
    lock, started = FolderLock(config.model_folder), clock()
    try:
        run, progress = set_up(config, given, lock, started)
        idle = nothing_to_do(run.config, progress)
        if idle and card_step(config.model_folder) == progress.step:  # (its end is done)
            print(idle)
            return
        catch_stop_signals(progress)
        if idle:  # trained, but stopped while validating or scoring the test sets
            print(f"{idle}; " + ("its last validation and " if validation_cut_short(
                run.config, progress) else "") + "the test sets are not scored yet (the run "
                "stopped at its end): scoring them")
        with abort_watch(f"train.py: {ABORTED}"):  # a second signal: out within seconds
            return train_loop(run, progress, argv, idle)
    except Exception:
        if aborting():  # an abort's aftermath (nmt.stopping.aborting): reported as the abort
            raise aborted() from None
        raise
    finally:
        lock.release()


def main(argv=None):
    parser = ArgumentParser(description="Train a Transformer for translation. Every flag "
                                        "defaults to config.py; on resume, to the checkpoint's.")
    config, given = parse_config(argv, parser, settings_to_check)

    def train_here():
        with removed_if_left_empty(config.model_folder):
            return train_model(config, given, argv)
    with exit_distributed():  # its code is the exit's (under torchrun, the process ends there)
        code = exit_code(run_main("train.py", train_here, aborted=ABORTED))
        if code:
            sys.exit(code)  # saved, and stopped: 130 or 143, not 0


if __name__ == "__main__":
    main()
