"""Validation BLEU against training minutes, one curve a run, from their TensorBoard logs.

    python -m dev.plot_runs runs/prenorm runs/paper runs/modern --output docs/validation_bleu.png
    python -m dev.plot_runs runs/fp32 runs/bf16 --metric loss --x steps --output loss.png

A run's minutes count from its first logged training step; the time between a stop and its
resume is left out (a gap of more than --gap minutes between two events is not counted).
--metric picks another validation figure (loss, chrF), --x steps puts it against optimizer
steps: runs compared at equal steps, whatever their speed.
"""

import sys
from pathlib import Path

from config import UserError
from nmt.cli import ArgumentParser, run_main
from nmt.plotting import pyplot


METRICS = {"bleu": "validation BLEU (greedy, sacreBLEU)", "loss": "validation loss",
           "chrf": "validation chrF (greedy, sacreBLEU)"}


def curve(folder: Path, gap_minutes: float, metric: str = "bleu", x: str = "minutes"):
    """(minutes, value) of every validation logged in `folder`; (step, value) with x="steps"."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(str(folder), size_guidance={"scalars": 0})
    acc.Reload()
    tag = f"validation/{metric}"
    if tag not in acc.Tags()["scalars"]:
        raise UserError(f"{folder}: no {tag} in its TensorBoard logs")
    if x == "steps":
        return [(e.step, e.value) for e in acc.Scalars(tag)]
    events = sorted([(e.wall_time, "train") for e in acc.Scalars("train/loss")]
                    + [(e.wall_time, e.value) for e in acc.Scalars(tag)])
    minutes, last, points = 0.0, None, []
    for wall, value in events:
        if last is not None and (wall - last) / 60 <= gap_minutes:
            minutes += (wall - last) / 60
        last = wall
        if value != "train":
            points.append((minutes, value))
    return points


def main(argv=None):
    parser = ArgumentParser(prog="python -m dev.plot_runs", description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", help="TensorBoard folders (--experiment_name)")
    parser.add_argument("--labels", nargs="*", help="a name for each run (default: folder)")
    parser.add_argument("--output", default="docs/validation_bleu.png")
    parser.add_argument("--metric", choices=sorted(METRICS), default="bleu")
    parser.add_argument("--x", choices=("minutes", "steps"), default="minutes",
                        help="training minutes (default), or optimizer steps")
    parser.add_argument("--gap", type=float, default=10.0, help="minutes between two logged "
                        "events beyond which the time is not counted (a stop, then a resume)")
    args = parser.parse_args(argv)
    labels = args.labels or [Path(r).name for r in args.runs]
    if len(labels) != len(args.runs):
        parser.error("give one label a run")
    plt = pyplot()
    if plt is None:
        parser.error("python -m dev.plot_runs needs matplotlib (pip install matplotlib)")
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for run, label in zip(args.runs, labels):
        points = curve(Path(run), args.gap, args.metric, args.x)
        ax.plot([m for m, _ in points], [b for _, b in points], marker="o", markersize=3,
                label=label)
    ax.set_xlabel("training minutes (validation included)" if args.x == "minutes"
                  else "optimizer steps")
    ax.set_ylabel(METRICS[args.metric])
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.output, dpi=120)
    print(f"wrote {args.output}", file=sys.stderr)


if __name__ == "__main__":
    run_main("python -m dev.plot_runs", main)
