"""What a training run says as it goes (train.py's Run and Progress): the training loss and the
learning rate to TensorBoard and the progress bar, the bar's loss a moving average from the
first step; the updates skipped for a non-finite loss or gradient, and the stop when too many
come in a row."""

import torch
from tqdm import tqdm

from nmt.checkpoint import CheckpointError, list_checkpoints, start_again


def check_updates(run, progress):
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
        folder, fp32 = run.config.model_folder, run.precision == "fp32"
        raise CheckpointError(
            f"{bad} non-finite updates in a row: training stopped without saving the diverged "
            f"weights; lower --lr{'' if fp32 else ' or use --precision fp32'}, then " + (
                f"resume from the last checkpoint in {folder}" if list_checkpoints(run.config)
                else start_again(run.config)))


SMOOTHING = 0.9  # the progress bar's loss: each step's weight 0.1 in a moving average


def carried_loss(progress):
    """The postfix a new epoch's bar is drawn with from the start: the moving average carried
    from the steps before (it showed none before its first log, --log_every steps in)."""
    return None if progress.smoothed_loss is None else {"loss": f"{progress.smoothed_loss:6.3f}"}


def log_progress(run, progress, bar, lr: float, tokens_per_s: float):
    """The mean training loss since the last log (over all ranks) to TensorBoard, and to the
    progress bar a moving average of it (SMOOTHING a step, the first log its start: a loss
    from the first step on): the one place the loop waits for the GPU."""
    loss = torch.stack(progress.loss_window).mean()
    if run.world_size > 1:
        torch.distributed.all_reduce(loss)  # each rank holds its share of the update's loss
    first, steps = progress.smoothed_loss is None, len(progress.loss_window)
    loss, progress.loss_window = loss.item(), []
    kept = 0.0 if first else SMOOTHING ** steps  # the weight of the steps before these
    progress.smoothed_loss = kept * (progress.smoothed_loss or 0.0) + (1 - kept) * loss
    run.writer.add_scalar("train/loss", loss, progress.step)
    run.writer.add_scalar("train/lr", lr, progress.step)
    run.writer.add_scalar("train/tok_s", tokens_per_s, progress.step)
    bar.set_postfix(loss=f"{progress.smoothed_loss:6.3f}", tok_s=f"{tokens_per_s:,.0f}",
                    refresh=first)  # (drawn at once the first time, then with the bar)
