"""nmt/attention_map.py: every view of the attention (cross, encoder, decoder), each layer x
head, for the three designs; translate.py --attention's flags; the picture TensorBoard shows at
each validation."""

import pytest
import torch
from conftest import TINY, make_corpus, number_pairs, run_here

from config import parse_config
from nmt.attention_map import VIEWS, attention_weights, draw, grid
from nmt.plotting import pyplot
from nmt.trained_model import build_model
from tokenizer import build_tokenizer

SIZE = ["--d_model", "32", "--N", "3", "--N_dec", "2", "--h", "4", "--d_ff", "64",
        "--seq_len", "40", "--vocab_size", "300"]


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer("bpe", 300, [f"{a} {b}" for a, b in number_pairs(200, seed=4)])


@pytest.mark.parametrize("preset", ["multi30k", "multi30k_paper", "multi30k_modern"])
def test_every_view_is_a_grid_of_layers_by_heads_with_the_tokens_on_both_axes(preset,
                                                                              tokenizer):
    """Issue 64: each view of each design's model (pre-norm; post-norm with a joint vocabulary;
    modern, whose grouped-query attention draws its 4 query heads, not its 2 key/value heads)
    is layers x heads panels, each (queries x keys) with a token a row and a column."""
    config, _ = parse_config(["--preset", preset, *SIZE])
    torch.manual_seed(0)
    model = build_model(config, 300, 300).eval()
    sentence, translation = "one two three.", "uno due tre."
    weights = attention_weights(model, tokenizer, tokenizer, sentence, translation)
    n_src = len(tokenizer.encode(sentence).ids) + 2  # [SOS] ... [EOS]
    n_tgt = len(tokenizer.encode(translation).ids) + 1  # ... [EOS] (queries), [SOS] ... (keys)
    layers = {"cross": 2, "encoder": 3, "decoder": 2}
    for view in VIEWS:
        queries, keys = weights.axes(view)
        assert tuple(weights.views[view].shape) == (layers[view], 4, len(queries), len(keys))
        assert len(queries) == (n_src if view == "encoder" else n_tgt)
        assert len(keys) == (n_tgt if view == "decoder" else n_src)
        rows = grid(weights, view)
        assert [len(r) for r in rows] == [4] * layers[view]  # layers x heads
        fig = draw(weights, view)
        assert len(fig.axes) == layers[view] * 4
        ax = fig.axes[0]
        assert [t.get_text() for t in ax.get_xticklabels()] == keys
        assert [t.get_text() for t in ax.get_yticklabels()] == queries
        assert ax.images[0].get_array().shape == (len(queries), len(keys))
        pyplot().close(fig)
        # each row of weights sums to 1 over the keys; the decoder's is causal
        torch.testing.assert_close(weights.views[view].sum(-1),
                                   torch.ones(weights.views[view].shape[:-1]))
    causal = weights.views["decoder"][0, 0]
    assert torch.all(causal.triu(1) == 0) and torch.all(causal.diagonal() > 0)
    # one layer, one head or the mean
    assert [len(r) for r in grid(weights, "encoder", layer=2, head="3")] == [1]
    assert grid(weights, "encoder", layer=2, head="3")[0][0][0] == "layer 2, head 3"
    torch.testing.assert_close(grid(weights, "cross", head="mean")[1][0][1],
                               weights.views["cross"][1].mean(0))


def test_a_layer_or_head_that_does_not_exist_is_one_line(tokenizer):
    from config import UserError
    config, _ = parse_config(SIZE)
    model = build_model(config, 300, 300).eval()
    weights = attention_weights(model, tokenizer, tokenizer, "one two.", "uno due.")
    with pytest.raises(UserError, match="--attention_layer 4: the encoder self-attention has 3"):
        grid(weights, "encoder", layer=4)
    with pytest.raises(UserError, match="--attention_head 5: the decoder cross-attention has 4"):
        grid(weights, "cross", head="5")


def test_translate_draws_each_view(trained):
    home, _ = trained
    for flags in (["--attention_view", "encoder"], ["--attention_view", "decoder",
                                                    "--attention_layer", "1"],
                  ["--attention_head", "mean"]):
        t = run_here("translate.py", "--attention", "view.png", *flags, "one two three",
                     cwd=home)
        assert t.returncode == 0, t.stderr.decode()
        assert (home / "view.png").read_bytes()[:4] == b"\x89PNG"
        (home / "view.png").unlink()
    t = run_here("translate.py", "--attention_view", "encoder", "one two", cwd=home)
    assert t.returncode == 2 and "--attention_view goes with --attention PNG" in \
        t.stderr.decode()
    t = run_here("translate.py", "--attention", "x.png", "--attention_layer", "9", "one two",
                 cwd=home)
    assert t.returncode == 2 and "--attention_layer 9: the decoder cross-attention has 1 " \
        "layers" in t.stderr.decode()


def test_each_validation_writes_the_cross_attention_picture_to_tensorboard(tmp_path):
    """Issue 64: the run's event file holds one attention image per validation (the epochs'
    ends and --eval_every's), at the validation's step."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    make_corpus(tmp_path / "c", n=48, val=4)
    t = run_here("train.py", "--data_dir", "c", *TINY, "--num_epochs", "2", "--eval_every",
                 "2", "--experiment_name", "runs/x", cwd=tmp_path)
    assert t.returncode == 0, t.stderr.decode()[-2000:]
    import json

    from config import Config
    from nmt.checkpoint import history_path
    history = json.loads(history_path(Config(model_folder=str(tmp_path / "weights")))
                         .read_text())
    acc = EventAccumulator(str(tmp_path / "runs" / "x"), size_guidance={"images": 0})
    acc.Reload()
    images = acc.Images("validation/cross_attention")
    assert [i.step for i in images] == [h["step"] for h in history] and len(images) >= 3
    assert images[0].encoded_image_string[:4] == b"\x89PNG"
