"""Run by tests/test_distributed.py under torchrun: one rank's view of a data-parallel run
(and, for the one-process run it is compared with, as `main([OUT.pt, *flags])` in the test's
own process).

    torchrun --standalone --nproc_per_node=2 tests/ddp_worker.py OUT.pt [train.py flags]

Rank 0 writes to OUT.pt what every rank saw: its starting weights, its batches of epoch 0,
its gradient after one DDP step on its first batch, its weights after one epoch, the
validation loss and translations (each rank its share, gathered), and the test sets' scores
(each rank translating its share) with the best checkpoint that validation saves."""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from config import parse_config  # noqa: E402
from dataset import Collator  # noqa: E402
from nmt.evaluation import score_test_sets, validation_loss, validation_translations  # noqa: E402
from nmt.runtime import exit_distributed, gather_to_main  # noqa: E402
from tokenizer import PAD  # noqa: E402
from train import set_up, train_epoch, train_step, validate  # noqa: E402


def flat(model):
    return torch.cat([p.detach().flatten() for p in model.parameters()]).clone()


def main(argv=None):
    out, *argv = sys.argv[1:] if argv is None else argv
    config, given = parse_config(argv)
    run, progress = set_up(config, given)
    report = {"start": gather_to_main(flat(run.model)),
              "batches": gather_to_main([b.tolist() for b in run.sampler.batches(0)])}
    first = Collator()([run.data.train[i] for i in run.sampler.batches(0)[0]])
    train_step(run.step_model, [first], run.loss_fn, PAD, run.device, run.amp, run.scaler,
               run.world_size)
    report["grads"] = gather_to_main({n: p.grad.clone() for n, p in run.model.named_parameters()})
    run.optimizer.zero_grad(set_to_none=True)
    train_epoch(run, progress)
    report["end"] = gather_to_main(flat(run.model))
    report["world_size"] = run.world_size
    run.model.eval()
    report["validation"] = (validation_loss(run),
                            validation_translations(run, progress, len(run.data.validation)))
    validate(run, progress)  # (rank 0 saves the best checkpoint)
    report["test"] = score_test_sets(run, progress)
    if run.rank == 0:
        torch.save(report, out)
    run.writer.close()
    run.lock.release()


if __name__ == "__main__":
    with exit_distributed():
        main()
