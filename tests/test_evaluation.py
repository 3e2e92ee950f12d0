"""Scoring a training run: the validation loss, negative log-likelihood and perplexity, and the
test split scored with the best checkpoint."""

import math

import pytest
import torch
from conftest import TINY, number_pairs, write_aligned

from config import parse_config
from model import LabelSmoothedCrossEntropy
from nmt.checkpoint import best_checkpoint, save_checkpoint
from nmt.evaluation import score_test_sets, validation_loss
from tokenizer import PAD
from train import set_up


@pytest.fixture
def run(tmp_path, monkeypatch):
    write_aligned(tmp_path / "c", "train", number_pairs(40, seed=1))
    write_aligned(tmp_path / "c", "val", number_pairs(4, seed=101))
    write_aligned(tmp_path / "c", "test", number_pairs(3, seed=9))
    monkeypatch.chdir(tmp_path)
    config, given = parse_config(["--data_dir", "c", *TINY, "--label_smoothing", "0.3"])
    run, progress = set_up(config, given)
    run.lock.release()
    yield run, progress
    run.writer.close()


def test_validation_reports_the_nll_and_perplexity_beside_the_smoothed_loss(run):
    """Issue 41: validation reported only the label-smoothed loss, which depends on the
    smoothing; the negative log-likelihood and perplexity (fairseq's nll_loss, ppl) compare
    runs of any smoothing. Checked against the formula on the whole logits."""
    run, _ = run
    run.model.eval()
    scores = validation_loss(run)
    val = run.data.validation
    batch = run.loader.collate_fn([val[i] for i in range(len(val))])
    label = batch["label"]
    with torch.no_grad():
        x = run.model.decode(run.model.encode(batch["encoder_input"], batch["encoder_mask"]),
                             batch["encoder_mask"], batch["decoder_input"])
        tokens = (label != PAD).sum().item()
        nll = LabelSmoothedCrossEntropy(0.0, PAD)(x, run.model.projection_layer, label) / tokens
        smoothed = LabelSmoothedCrossEntropy(0.3, PAD)(x, run.model.projection_layer, label)
    assert scores["nll"] == pytest.approx(nll.item(), rel=1e-4)
    assert scores["loss"] == pytest.approx(smoothed.item() / tokens, rel=1e-4)
    assert scores["ppl"] == pytest.approx(math.exp(scores["nll"]), rel=1e-6)


def test_test_scoring_leaves_the_runs_weights_as_they_were(run, tmp_path):
    """Issue 23: score_test_sets loaded the best checkpoint into the run's model, overwriting
    the weights it was handed. Now the best checkpoint decodes in a model of its own."""
    run, progress = run
    save_checkpoint(best_checkpoint(run, 0, 0, {}), tmp_path / "weights" / "tmodel_best.pt")
    with torch.no_grad():
        for p in run.model.parameters():
            p.add_(0.5)  # the run trained on past its best
    before = {k: v.clone() for k, v in run.model.state_dict().items()}
    score_test_sets(run, progress)
    assert (tmp_path / "weights" / "results.json").exists()
    for k, v in run.model.state_dict().items():
        assert torch.equal(v, before[k]), k
