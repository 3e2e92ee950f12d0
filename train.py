"""Train a Transformer translation model.

    python train.py                                   # OPUS Books en->it from the hub
    python train.py --data_dir ../shared/data/multi30k --lang_src en --lang_tgt de
    python train.py --help                            # every flag, with its default
    tensorboard --logdir runs

Resumes from the newest checkpoint in --model_folder by default (--preload latest).
"""

import math
import signal
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.nn as nn
from torch.utils.data import DataLoader
from torch.utils.tensorboard import SummaryWriter
from tqdm import tqdm

from config import (MODEL_FIELDS, ArgumentParser, CheckpointError, Config, UserError,
                    add_config_arguments, build_model, check_vocab, config_from_args,
                    epoch_checkpoint_path, list_checkpoints, load_checkpoint, load_model_weights,
                    resolve_preload, save_checkpoint, step_checkpoint_path)
from dataset import Collator, TokenBatchSampler, get_ds, real_tokens
from model import translate_ids

# Settings that locate the run; on resume they are never taken from the checkpoint.
RUN_FIELDS = ("model_folder", "model_basename", "preload")


# ---- set-up helpers -----------------------------------------------------------------------------

def get_device(name: str = "auto") -> torch.device:
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise UserError(f"--device {name}: CUDA is not available on this machine")
    if name == "mps" and not (getattr(torch.backends, "mps", None)
                              and torch.backends.mps.is_available()):
        raise UserError("--device mps: MPS is not available on this machine")
    if name != "auto":
        return torch.device(name)
    if torch.cuda.is_available():
        return torch.device("cuda")
    if getattr(torch.backends, "mps", None) and torch.backends.mps.is_available():
        return torch.device("mps")
    return torch.device("cpu")


def tune_cpu_allocator():
    """On Linux/glibc, keep freed memory for reuse instead of handing each large activation
    buffer back to the OS and page-faulting it in again next step (about 25% faster CPU steps
    here). Memory stays reserved by the process; elsewhere this does nothing."""
    import ctypes
    import platform
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3
    return bool(libc.mallopt(m_mmap_threshold, 1 << 30) and
                libc.mallopt(m_trim_threshold, 1 << 31))


def autocast_dtype(config: Config, device: torch.device):
    """The dtype of mixed precision, or None for fp32."""
    if config.precision == "auto":
        if device.type != "cuda":
            return None
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}[config.precision]


def learning_rate(config: Config, step: int, total_steps: int) -> float:
    """The learning rate of optimizer step `step` (counting from 1).

    constant:     lr
    inverse_sqrt: the paper's lr = d_model^-0.5 · min(step^-0.5, step · warmup^-1.5), rescaled so
                  that its peak (at step = warmup) is `lr`; --lr (d_model·warmup)^-0.5 gives the
                  paper's exact values (7.0e-4 for 512 and 4000).
    cosine:       linear warm-up to lr, then half a cosine down to 0 at the last step."""
    step = max(step, 1)
    if config.lr_schedule == "inverse_sqrt":
        warmup = max(config.warmup, 1)
        paper = config.d_model ** -0.5 * min(step ** -0.5, step * warmup ** -1.5)
        return config.lr * paper / (config.d_model * warmup) ** -0.5
    if config.lr_schedule == "cosine":
        if step < config.warmup:
            return config.lr * step / config.warmup
        progress = min((step - config.warmup) / max(total_steps - config.warmup, 1), 1.0)
        return config.lr * 0.5 * (1.0 + math.cos(math.pi * progress))
    return config.lr


def make_optimizer(model, lr: float):
    """Adam with the paper's betas and epsilon (section 5.3), fused into one kernel where torch
    has one (CPU, CUDA): on CPU the default per-parameter loop costs 8x as long per step."""
    params = list(model.parameters())
    try:
        return torch.optim.Adam(params, lr=lr, betas=(0.9, 0.98), eps=1e-9, fused=True)
    except (RuntimeError, ValueError, TypeError):  # a device without the fused kernel
        return torch.optim.Adam(params, lr=lr, betas=(0.9, 0.98), eps=1e-9)


# ---- validation ---------------------------------------------------------------------------------

def edit_distance(a, b) -> int:
    """Levenshtein distance between two sequences (characters or words)."""
    if len(a) < len(b):
        a, b = b, a
    previous = list(range(len(b) + 1))
    for i, x in enumerate(a, 1):
        current = [i]
        for j, y in enumerate(b, 1):
            current.append(min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (x != y)))
        previous = current
    return previous[-1]


def error_rate(predictions, references, words: bool) -> float:
    """Corpus WER (words=True) or CER: total edits / total reference length."""
    edits = total = 0
    for p, r in zip(predictions, references):
        p, r = (p.split(), r.split()) if words else (p, r)
        edits += edit_distance(p, r)
        total += len(r)
    return edits / max(total, 1)


def score_translations(predictions, references) -> dict:
    import sacrebleu
    return {"bleu": sacrebleu.corpus_bleu(predictions, [references]).score,
            "chrf": sacrebleu.corpus_chrf(predictions, [references]).score,
            "cer": error_rate(predictions, references, words=False),
            "wer": error_rate(predictions, references, words=True)}


@torch.no_grad()
def run_validation(model, data, config: Config, device, loss_fn, writer, global_step: int):
    """Validation loss, then greedy decoding of the validation set (or its first
    val_max_sentences) scored with BLEU, chrF, CER and WER; prints a few examples."""
    model.eval()
    val = data.validation
    pad_id = data.tokenizer_tgt.token_to_id("[PAD]")
    sampler = TokenBatchSampler(val.lengths(), config.max_tokens, config.batch_size or 32,
                                shuffle=False)
    loss_sum, tokens = 0.0, 0
    for batch in DataLoader(val, batch_sampler=sampler, collate_fn=Collator(pad_id)):
        logits = model(batch["encoder_input"].to(device), batch["decoder_input"].to(device),
                       batch["encoder_mask"].to(device), batch["decoder_mask"].to(device))
        label = batch["label"].to(device)  # (batch, tgt_len)
        loss_sum += loss_fn(logits.float().view(-1, logits.size(-1)), label.view(-1)).item()
        tokens += (label != pad_id).sum().item()
    n = len(val) if config.val_max_sentences == 0 else min(config.val_max_sentences, len(val))
    started = time.time()
    outputs = translate_ids(model, val.src_ids[:n], data.tokenizer_tgt.token_to_id("[SOS]"),
                            data.tokenizer_tgt.token_to_id("[EOS]"), pad_id, config.seq_len,
                            batch_size=max(config.max_tokens // 40, config.batch_size, 1))
    predictions = [data.tokenizer_tgt.decode(ids).strip() for ids in outputs]
    metrics = {"loss": loss_sum / max(tokens, 1),
               **score_translations(predictions, val.tgt_texts[:n])}
    for name, value in metrics.items():
        writer.add_scalar(f"validation/{name}", value, global_step)
    examples = []
    for i in range(min(config.val_examples, n)):
        examples.append(f"{'SOURCE:':>12} {val.src_texts[i]}\n{'TARGET:':>12} "
                        f"{val.tgt_texts[i]}\n{'PREDICTED:':>12} {predictions[i]}")
    if examples:
        tqdm.write("-" * 80 + "\n" + ("\n" + "-" * 80 + "\n").join(examples) + "\n" + "-" * 80)
        writer.add_text("validation/examples",
                        "\n\n".join("    " + e.replace("\n", "\n    ") for e in examples),
                        global_step)
    tqdm.write(f"validation: loss {metrics['loss']:.3f}  BLEU {metrics['bleu']:.2f}  "
               f"chrF {metrics['chrf']:.2f}  CER {metrics['cer']:.3f}  WER {metrics['wer']:.3f}"
               f"  ({n} sentences decoded in {time.time() - started:.1f}s)")
    model.train()
    return metrics


# ---- checkpoints --------------------------------------------------------------------------------

def resume_state(config: Config, given: set):
    """The checkpoint --preload names (or None) and the config to train with: flags given on
    the command line win; everything else comes from the checkpoint's own config."""
    path = resolve_preload(config)
    if path is None:
        existing = list_checkpoints(config)
        if config.preload == "none" and existing:
            raise CheckpointError(
                f"{config.model_folder} already holds checkpoints ({existing[-1][0].name}); "
                f"--preload none would overwrite them: resume with --preload latest or train "
                f"into another --model_folder")
        return None, config
    state = load_checkpoint(path)
    saved = Config.from_dict(state["config"])
    for name in MODEL_FIELDS:
        if name in given and getattr(config, name) != getattr(saved, name):
            raise CheckpointError(
                f"{path} was trained with --{name} {getattr(saved, name)}, not "
                f"{getattr(config, name)}; drop the flag to resume it, or train into another "
                f"--model_folder")
    for name, value in saved.to_dict().items():
        if name not in given and name not in RUN_FIELDS:
            setattr(config, name, value)
    if "batch_size" in given and "max_tokens" not in given:
        config.max_tokens = 0
    if state.get("next_batch"):  # mid-epoch: the rest of the epoch needs the same batches
        for name in ("max_tokens", "batch_size", "seed", "accum_steps"):
            if getattr(saved, name) != getattr(config, name):
                raise CheckpointError(
                    f"{path} was saved mid-epoch with --{name} {getattr(saved, name)}; resume "
                    f"it with the same value (the epoch's batch order depends on it), or from a "
                    f"per-epoch checkpoint with --preload")
    return (path, state), config


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


class StopRequest:
    """Ctrl-C / SIGTERM: finish the current step, save, exit. A second Ctrl-C stops at once
    (the checkpoints already written stay intact: saves are atomic)."""

    def __init__(self):
        self.signal = None
        signal.signal(signal.SIGINT, self.handle)
        signal.signal(signal.SIGTERM, self.handle)

    def handle(self, signum, frame):
        if self.signal is not None:
            raise KeyboardInterrupt
        self.signal = signal.Signals(signum).name
        tqdm.write(f"{self.signal}: stopping after this step (press Ctrl-C again to abort)")


def ignore_sigint(_worker_id):
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # DataLoader workers: the main process decides


# ---- training -----------------------------------------------------------------------------------

def train_step(model, group, loss_fn, pad_id: int, device, amp=nullcontext, scaler=None):
    """Forward and backward over a group of batches (gradient accumulation). The loss is summed
    over tokens and divided by the group's token count, so k accumulated batches give the
    gradients of one k-times batch. Returns (mean loss per token, tokens)."""
    n_tokens = sum((b["label"] != pad_id).sum().item() for b in group)  # the loss's tokens
    loss_total = 0.0
    for b in group:
        with amp():
            logits = model(b["encoder_input"].to(device, non_blocking=True),
                           b["decoder_input"].to(device, non_blocking=True),
                           b["encoder_mask"].to(device, non_blocking=True),
                           b["decoder_mask"].to(device, non_blocking=True))
        label = b["label"].to(device, non_blocking=True)  # (batch, tgt_len)
        # (batch * tgt_len, vocab) against (batch * tgt_len,)
        loss = loss_fn(logits.float().view(-1, logits.size(-1)), label.view(-1)) / n_tokens
        (scaler.scale(loss) if scaler is not None else loss).backward()
        loss_total += loss.item()
    return loss_total, n_tokens


def train_model(config: Config, given: set = frozenset()):
    """Trains as `config` says (resuming per --preload). Returns per-step token counts and
    wall times (data loading, loss and logging included)."""
    resume, config = resume_state(config, given)
    problem = config.validate()
    if problem:
        raise CheckpointError(f"with the resumed checkpoint's settings: {problem}")
    Path(config.model_folder).mkdir(parents=True, exist_ok=True)
    probe = Path(config.model_folder) / ".write-test"
    try:
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise CheckpointError(f"--model_folder {config.model_folder} is not writable: "
                              f"{e.strerror}") from None

    torch.manual_seed(config.seed)
    device = get_device(config.device)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True  # TF32 matmuls on Ampere and newer
        torch.backends.cudnn.allow_tf32 = True
    if device.type == "cpu":
        tune_cpu_allocator()
    amp_dtype = autocast_dtype(config, device)
    print(f"device {device}" + (f", {amp_dtype} autocast" if amp_dtype else ", fp32"))

    data = get_ds(config)
    src_vocab, tgt_vocab = data.tokenizer_src.get_vocab_size(), data.tokenizer_tgt.get_vocab_size()
    pad_id = data.tokenizer_tgt.token_to_id("[PAD]")
    model = build_model(config, src_vocab, tgt_vocab).to(device)
    print(f"model: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters")
    optimizer = make_optimizer(model, config.lr)
    scaler = torch.amp.GradScaler(device.type, enabled=amp_dtype == torch.float16)

    start_epoch, start_batch, global_step = 0, 0, 0
    if resume:
        path, state = resume
        check_vocab(state, path, src_vocab, tgt_vocab)
        load_model_weights(model, state, path)
        optimizer.load_state_dict(state["optimizer_state_dict"])
        if state.get("scaler_state_dict"):
            scaler.load_state_dict(state["scaler_state_dict"])
        if "rng_state" in state:
            torch.set_rng_state(state["rng_state"])
        start_epoch, start_batch = state["next_epoch"], state["next_batch"]
        global_step = state["global_step"]
        print(f"resumed from {path}: epoch {start_epoch}, batch {start_batch}, "
              f"step {global_step}")
        del state

    writer = SummaryWriter(config.experiment_name)
    loss_fn = nn.CrossEntropyLoss(ignore_index=pad_id, label_smoothing=config.label_smoothing,
                                  reduction="sum")
    sampler = TokenBatchSampler(data.train.lengths(), config.max_tokens, config.batch_size,
                                shuffle=True, seed=config.seed)
    batches_per_epoch = len(sampler.batches(0))
    total_steps = math.ceil(batches_per_epoch / config.accum_steps) * config.num_epochs
    step_model = torch.compile(model, dynamic=True) if config.compile else model
    amp = (lambda: torch.autocast(device.type, dtype=amp_dtype)) if amp_dtype else nullcontext
    stop = StopRequest()
    bad_steps = 0  # non-finite updates in a row
    stats = {"step_tokens": [], "step_seconds": []}  # per optimizer step, for bench.py

    def save(epoch: int, next_epoch: int, next_batch: int, path: Path):
        save_checkpoint({
            "model_state_dict": model.state_dict(),
            "optimizer_state_dict": optimizer.state_dict(),
            "scaler_state_dict": scaler.state_dict() if scaler.is_enabled() else {},
            "epoch": epoch, "next_epoch": next_epoch, "next_batch": next_batch,
            "global_step": global_step, "rng_state": torch.get_rng_state(),
            "config": config.to_dict(),
        }, path)
        prune_checkpoints(config)

    if config.max_steps and global_step >= config.max_steps:
        print(f"already at step {global_step} of --max_steps {config.max_steps}; raise it to "
              f"train on")
        return stats
    for epoch in range(start_epoch, config.num_epochs):
        model.train()
        sampler.set_epoch(epoch, start_batch if epoch == start_epoch else 0)
        loader = DataLoader(data.train, batch_sampler=sampler, collate_fn=Collator(pad_id),
                            num_workers=config.num_workers, pin_memory=device.type == "cuda",
                            worker_init_fn=ignore_sigint if config.num_workers else None,
                            generator=torch.Generator())  # leaves the global RNG (dropout) alone
        batch_index = sampler.start  # batches of this epoch already trained
        bar = tqdm(total=batches_per_epoch, initial=batch_index, desc=f"epoch {epoch:02d}",
                   dynamic_ncols=True, mininterval=1.0)
        group, tokens_seen, started, step_started = [], 0, time.time(), time.perf_counter()
        for batch in loader:
            group.append(batch)
            batch_index += 1
            if len(group) < config.accum_steps and batch_index < batches_per_epoch:
                continue
            loss_total, n_tokens = train_step(step_model, group, loss_fn, pad_id, device, amp,
                                              scaler)
            scaler.unscale_(optimizer)
            grad_norm = nn.utils.clip_grad_norm_(model.parameters(),
                                                 config.clip_grad or float("inf"), foreach=True)
            lr = learning_rate(config, global_step + 1, total_steps)
            for param_group in optimizer.param_groups:
                param_group["lr"] = lr
            if math.isfinite(loss_total) and torch.isfinite(grad_norm):
                scaler.step(optimizer)
                bad_steps = 0
            elif scaler.is_enabled() and math.isfinite(loss_total):
                scaler.step(optimizer)  # fp16 overflow: the scaler skips it and lowers its scale
            else:
                bad_steps += 1
                writer.add_scalar("train/skipped_nonfinite", bad_steps, global_step)
                tqdm.write(f"step {global_step + 1}: non-finite loss or gradient, update skipped"
                           f" ({bad_steps} in a row)")
                if bad_steps >= config.max_bad_steps:
                    raise CheckpointError(
                        f"{bad_steps} non-finite updates in a row: training stopped without "
                        f"saving the diverged weights; lower --lr or use --precision fp32, then "
                        f"resume from the last checkpoint in {config.model_folder}")
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
            global_step += 1
            real = sum(real_tokens(b, pad_id) for b in group)
            group = []
            tokens_seen += real
            stats["step_tokens"].append(real)
            stats["step_seconds"].append(time.perf_counter() - step_started)
            step_started = time.perf_counter()
            bar.update(batch_index - bar.n)
            bar.set_postfix(loss=f"{loss_total:6.3f}",
                            tok_s=f"{tokens_seen / (time.time() - started):,.0f}",
                            refresh=False)
            if global_step % config.log_every == 0:
                writer.add_scalar("train/loss", loss_total, global_step)
                writer.add_scalar("train/lr", lr, global_step)
            at_max_steps = config.max_steps and global_step >= config.max_steps
            if stop.signal or at_max_steps or (config.save_every and batch_index <
                                               batches_per_epoch and
                                               global_step % config.save_every == 0):
                path = step_checkpoint_path(config, epoch, global_step)
                save(epoch, epoch, batch_index, path)
                if stop.signal or at_max_steps:
                    bar.close()
                    writer.close()
                    why = f"stopped by {stop.signal}" if stop.signal else \
                        f"reached --max_steps {config.max_steps}"
                    print(f"{why} in epoch {epoch} after batch {batch_index} of "
                          f"{batches_per_epoch} (step {global_step}); saved {path}. "
                          f"Resume with: python train.py --model_folder {config.model_folder}")
                    return stats
        bar.close()
        writer.add_scalar("train/epoch_tokens_per_s", tokens_seen / (time.time() - started),
                          global_step)
        run_validation(model, data, config, device, loss_fn, writer, global_step)
        writer.flush()
        save(epoch, epoch + 1, 0, epoch_checkpoint_path(config, epoch))
        start_batch = 0
    writer.close()
    return stats


def main(argv=None):
    parser = ArgumentParser(description="Train a Transformer for translation. Every flag "
                                        "defaults to config.py; on resume, to the checkpoint's.")
    add_config_arguments(parser)
    config, given = config_from_args(parser.parse_args(argv))
    problem = config.validate()
    if problem:
        parser.error(problem)
    try:
        train_model(config, given)
    except UserError as e:
        print(f"train.py: error: {e}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        print("train.py: aborted; the checkpoints already saved are intact", file=sys.stderr)
        sys.exit(130)


if __name__ == "__main__":
    main()
