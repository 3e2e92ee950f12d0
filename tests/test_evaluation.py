"""Scoring a training run: the validation loss, negative log-likelihood and perplexity, and the
test split scored with the best checkpoint."""

import dataclasses
import math

import numpy as np

import pytest
import torch
from conftest import TINY, number_pairs, write_aligned

from config import parse_config
from model import LabelSmoothedCrossEntropy
from nmt.batching import TokenBatchSampler
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


def validation_batches(run) -> int:
    return len(TokenBatchSampler(run.data.validation.lengths(), run.config.max_tokens,
                                 run.config.batch_size or 32, shuffle=False).batches())


@pytest.mark.parametrize("several", [False, True])
def test_validation_reports_the_nll_and_perplexity_beside_the_smoothed_loss(run, several):
    """Issue 41: validation reported only the label-smoothed loss, which depends on the
    smoothing; the negative log-likelihood and perplexity (fairseq's nll_loss, ppl) compare
    runs of any smoothing. Checked against the formula on the whole logits, the sums over one
    batch and over several (each batch's loss and nll from one projection)."""
    run, _ = run
    val = run.data.validation
    if several:  # batches of a sentence or two
        run = dataclasses.replace(run, config=dataclasses.replace(
            run.config, max_tokens=int(max(val.lengths()))))
    assert (validation_batches(run) > 1) == several
    run.model.eval()
    scores = validation_loss(run)
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


def test_validation_reads_its_sums_from_the_device_once_whatever_its_batches(run, monkeypatch):
    """The validation loss's sums stay on the device until the end: the host reads values back
    as often for several batches as for one (a read a batch makes the host wait for a GPU at
    every batch)."""
    run, _ = run
    run.model.eval()
    reads = []
    for name in ("item", "tolist", "__float__", "__int__", "__bool__"):
        real = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name, lambda t, *a, real=real, name=name, **k: (
            reads.append(name), real(t, *a, **k))[1])
    counts = []
    for max_tokens in (run.config.max_tokens, int(max(run.data.validation.lengths()))):
        several = dataclasses.replace(run, config=dataclasses.replace(run.config,
                                                                       max_tokens=max_tokens))
        reads.clear()
        validation_loss(several)
        counts.append((validation_batches(several), len(reads)))
    assert counts[0][0] == 1 and counts[1][0] > 1 and counts[0][1] == counts[1][1], counts


def test_the_validation_line_times_the_decoding_alone(run, monkeypatch, capsys):
    """"N sentences decoded in X s" counted the scoring and the attention picture too (about
    3.5 s said for about 1 s of decoding, the README's modern model): on a clock that the
    decoding moves by 2 s and the scoring by 100 s, the line says 2.0 s."""
    from nmt import evaluation
    run, progress = run
    now = [1000.0]
    monkeypatch.setattr(evaluation.time, "time", lambda: now[0])
    translations, score = evaluation.validation_translations, evaluation.score

    def decoding(*args):
        now[0] += 2.0
        return translations(*args)

    def scoring(*args, **kwargs):
        now[0] += 100.0
        return score(*args, **kwargs)
    monkeypatch.setattr(evaluation, "validation_translations", decoding)
    monkeypatch.setattr(evaluation, "score", scoring)
    evaluation.run_validation(run, progress)
    line = [x for x in capsys.readouterr().out.splitlines() if x.startswith("validation: ")]
    assert line and line[0].endswith(f"({len(run.data.validation)} sentences decoded in 2.0s)")


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


# ---- the attention picture TensorBoard shows at each validation ---------------------------------

class Images:
    """A TensorBoard writer that keeps the images it is given."""

    def __init__(self):
        self.images = []

    def add_image(self, tag, image, step, dataformats):
        self.images.append((tag, image, step, dataformats))


@pytest.fixture(scope="module")
def two_layers():
    """A model of 2 decoder layers of 4 heads (the layers and heads tell apart), its tokenizer."""
    from conftest import tiny_model

    from tokenizer import build_tokenizer
    tokenizer = build_tokenizer("bpe", 300, [f"{a} {b}" for a, b in number_pairs(200, seed=4)])
    model = tiny_model(vocab=tokenizer.get_vocab_size(), seq_len=40, seed=5, N=2, h=4)
    return model, tokenizer


def test_the_tensorboard_picture_is_each_layer_the_mean_of_its_heads_with_tokens(two_layers,
                                                                                monkeypatch):
    """It was 428x112 pixels of four unlabelled 8-px-a-token maps, and averaging over layers
    instead of heads passed: now translate.py --attention's renderer, a panel a layer (each the
    mean of that layer's heads, read from the block alone), titled, the tokens on both axes,
    24 px a token or more."""
    import types

    import nmt.attention_map as attention_map
    from nmt.evaluation import log_attention
    from test_attention_map import block_weights, panel_axes
    model, tokenizer = two_layers
    src_ids, tgt_ids = tokenizer.encode("one two three.").ids, tokenizer.encode("uno due.").ids
    drawn, real = {}, attention_map.draw

    def spy(weights, view="cross", layer=0, head="all", **kw):
        fig = real(weights, view, layer, head, **kw)
        drawn.update(view=view, axes=[(ax.get_title(), ax.images[0].get_array(),
                                       [t.get_text() for t in ax.get_yticklabels()],
                                       [t.get_text() for t in ax.get_xticklabels()])
                                      for ax in panel_axes(fig)])
        return fig
    monkeypatch.setattr(attention_map, "draw", spy)
    writer = Images()
    run = types.SimpleNamespace(model=model, writer=writer, data=types.SimpleNamespace(
        tokenizer_src=tokenizer, tokenizer_tgt=tokenizer))
    log_attention(run, src_ids, tgt_ids, 7)
    [(tag, image, step, formats)] = writer.images
    assert (tag, step, formats) == ("validation/cross_attention", 7, "HWC")
    assert drawn["view"] == "cross" and len(drawn["axes"]) == 2  # a panel a decoder layer
    targets = [tokenizer.decode([i]) for i in tgt_ids] + ["[EOS]"]
    sources = ["[SOS]"] + [tokenizer.decode([i]) for i in src_ids] + ["[EOS]"]
    for layer, (title, matrix, rows, columns) in enumerate(drawn["axes"]):
        assert title == f"layer {layer + 1}, mean of 4 heads"
        known = block_weights(model, "cross", layer, src_ids, tgt_ids).mean(0)
        torch.testing.assert_close(torch.as_tensor(matrix).float(), known)
        assert rows == targets and columns == sources
    assert image.dtype == np.uint8
    height, width, channels = image.shape
    assert channels == 3 and height >= 24 * len(targets) and width >= 24 * 2 * len(sources)


def test_the_picture_shows_the_tokens_the_model_generated_not_their_text_encoded_again(
        run, monkeypatch):
    """It re-encoded the detokenized prediction, so its rows were not the tokens the model
    generated (7 of 8 validation sentences differed in a tiny run). Here the greedy output is
    one word spelled out a token at a time, which encoding its text again would merge."""
    import nmt.evaluation as evaluation
    run, progress = run
    tokenizer = run.data.tokenizer_tgt
    word = "quattro"
    spelled = [tokenizer.token_to_id(c) for c in word]
    assert None not in spelled and tokenizer.encode(word).ids != spelled
    monkeypatch.setattr(evaluation, "validation_translations",
                        lambda run, progress, n: [spelled] * n)
    seen = {}
    monkeypatch.setattr(evaluation, "picture", lambda weights, view, head: seen.update(
        rows=weights.tgt_tokens, columns=weights.src_tokens) or np.zeros((1, 1, 3), np.uint8))
    evaluation.run_validation(run, progress)
    assert seen["rows"] == list(word) + ["[EOS]"]
    source = run.data.validation.src_ids[0]
    assert seen["columns"] == ["[SOS]"] + [run.data.tokenizer_src.decode([int(i)])
                                           for i in source] + ["[EOS]"]


def test_test_sets_without_a_best_checkpoint_are_said_not_scored(tmp_path, capsys):
    """A run whose validations were all cut short has no best checkpoint: its test sets were
    skipped without a word and its model card said the corpus had no test split. Both say
    what happened now."""
    import types

    from config import Config
    from nmt.model_card import card_text
    config = Config(model_folder=str(tmp_path))
    run = types.SimpleNamespace(config=config, rank=0, data=types.SimpleNamespace(
        test={"test_2016_flickr": (["a ."], ["b ."])}))
    assert score_test_sets(run, None) == (None, [])
    assert capsys.readouterr().out.strip() == (
        f"no best checkpoint {tmp_path}/tmodel_best.pt: the test sets are not scored "
        f"(translate.py --model_folder {tmp_path} --preload latest --input ... --reference ... "
        f"scores one)")
    card = card_text({"config": config, "folder": "w", "vocab": (300, 300), "parameters": 1e5,
                      "commands": [], "corpus": "c", "sizes": "", "history": [], "curve": False,
                      "results": None, "samples": [], "test_sets": ["test_2016_flickr"],
                      "steps": 1, "epochs": 1, "seconds": 1.0, "precision": "fp32",
                      "device": "cpu"})
    assert "The test sets (test_2016_flickr) were not scored: the run has no best checkpoint" \
        in card and "no test split" not in card


def test_validation_decodes_without_unk_and_scores_without_bootstrap_resamples(run):
    """Validation decodes as translate.py does, never generating [UNK] (here the likeliest
    token at every step, by the projection's bias), and scores its translations without
    sacreBLEU's 1000 bootstrap resamples a metric (their intervals are the test sets'): no
    `_ci` figure, no `bs:` in the signatures."""
    from nmt.evaluation import run_validation, validation_translations
    from tokenizer import UNK
    run, progress = run
    run.model.eval()
    with torch.no_grad():
        run.model.projection_layer.proj.bias[UNK] = 30.0
    outputs = validation_translations(run, progress, len(run.data.validation))
    assert outputs and all(out and UNK not in out for out in outputs), outputs
    metrics = run_validation(run, progress)
    assert not any(name.endswith("_ci") for name in metrics) and "bs:" not in metrics["report"]
    assert {"bleu", "chrf", "cer", "wer", "loss"} <= set(metrics)


def test_validation_times_its_decoding_apart(run, monkeypatch):
    """The validation's metrics carry the seconds of its decoding alone, not its loss pass or
    scoring (a --time_budget's reserve scales them by the test sentences): 5 s of a fake clock
    spent decoding, 3 s in the loss pass."""
    import types

    import nmt.evaluation as evaluation
    run, progress = run
    now = [0.0]
    monkeypatch.setattr(evaluation, "time", types.SimpleNamespace(time=lambda: now[0]))
    decode, loss = evaluation.validation_translations, evaluation.validation_loss

    def slow(real, seconds):
        def call(*args, **kwargs):
            now[0] += seconds
            return real(*args, **kwargs)
        return call
    monkeypatch.setattr(evaluation, "validation_translations", slow(decode, 5.0))
    monkeypatch.setattr(evaluation, "validation_loss", slow(loss, 3.0))
    assert evaluation.run_validation(run, progress)["seconds_decoding"] == 5.0


def test_validation_decodes_the_first_val_max_sentences_or_all(run):
    """--val_max_sentences N decodes the first N validation sentences (0: all of them; more
    than the split holds: all of them), not one more or one fewer."""
    from nmt.evaluation import validated_sentences
    run, _ = run
    total = len(run.data.validation)
    assert total == 4
    for most, n in ((0, 4), (1, 1), (3, 3), (10, 4)):
        limited = dataclasses.replace(run, config=dataclasses.replace(
            run.config, val_max_sentences=most))
        assert validated_sentences(limited) == n, most
