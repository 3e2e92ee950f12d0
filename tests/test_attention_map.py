"""nmt/attention_map.py: every view of the attention (cross, encoder, decoder), each layer x
head, for the three designs; translate.py --attention's flags; the picture TensorBoard shows at
each validation."""

import pytest
import torch
from conftest import TINY, make_corpus, number_pairs, run_here

from config import parse_config
from nmt.attention_map import AXIS_NAMES, VIEWS, attention_weights, draw, grid
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
        assert len(panel_axes(fig)) == layers[view] * 4
        ax = fig.axes[0]
        assert [t.get_text() for t in ax.get_xticklabels()] == keys
        assert [t.get_text() for t in ax.get_yticklabels()] == queries
        # each axis named once a row (the first panel) and once a column (the bottom row)
        panels = panel_axes(fig)
        assert [a.get_ylabel() for a in panels[::4]] == [AXIS_NAMES[view][0]] * layers[view]
        assert [a.get_xlabel() for a in panels[-4:]] == [AXIS_NAMES[view][1]] * 4
        assert sum(bool(a.get_ylabel()) for a in panels) == layers[view]
        assert sum(bool(a.get_xlabel()) for a in panels) == 4
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


def panel_axes(fig):
    """The panels of a figure of `draw` (the colour bar's axes left out)."""
    return [ax for ax in fig.axes if ax.images and ax.get_label() != "<colorbar>"]


def test_a_layer_or_head_that_does_not_exist_is_one_line(tokenizer):
    from config import UserError
    config, _ = parse_config(SIZE)
    model = build_model(config, 300, 300).eval()
    weights = attention_weights(model, tokenizer, tokenizer, "one two.", "uno due.")
    with pytest.raises(UserError, match="--attention_layer 4: the encoder self-attention has 3"):
        grid(weights, "encoder", layer=4)
    with pytest.raises(UserError, match="--attention_head 5: the decoder cross-attention has 4"):
        grid(weights, "cross", head="5")
    from nmt.attention_map import check_layer_and_head  # one of each: no plural
    with pytest.raises(UserError, match=r"^--attention_layer 2: .* has 1 layer \(1 to 1; 0:"):
        check_layer_and_head("encoder", 1, 1, 2, "all")
    with pytest.raises(UserError, match=r"^--attention_head 2: .* has 1 head \(1 to 1, mean"):
        check_layer_and_head("encoder", 1, 1, 0, "2")
    with pytest.raises(UserError, match=r"^--attention_head ²: "):  # a digit, not a number
        check_layer_and_head("encoder", 1, 4, 0, "²")


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
        "layer (1 to 1; 0: all)" in t.stderr.decode()


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


# ---- each panel is the weights of its layer and head; each view its own (issue 70) -------------

def block_weights(model, view: str, layer: int, src_ids, tgt_ids):
    """The weights (heads, queries, keys) of one block, read from that block alone in a forward
    pass of its own: what a panel titled with its layer must show."""
    from dataset import source_batch
    from model import causal_mask
    from nmt.attention_map import attention_blocks
    from tokenizer import SOS
    block = attention_blocks(model)[view][layer]
    src, src_mask = source_batch([src_ids], model.seq_len)
    tgt = torch.tensor([[SOS] + list(tgt_ids)])
    block.need_weights = True
    try:
        with torch.no_grad():
            model.decode(model.encode(src, src_mask), src_mask, tgt, causal_mask(tgt.size(1)))
        return block.attention_scores[0].float().clone()
    finally:
        block.need_weights, block.attention_scores = False, None


@pytest.fixture(scope="module")
def modern(tokenizer):
    """A modern-design model (grouped-query attention: 4 query heads, 2 key/value heads) of 3
    encoder and 2 decoder layers, seeded, with a sentence and a translation as ids."""
    config, _ = parse_config(["--preset", "multi30k_modern", *SIZE])
    torch.manual_seed(3)
    model = build_model(config, 300, 300).eval()
    return (model, tokenizer.encode("one two three four.").ids,
            tokenizer.encode("uno due tre.").ids)


@pytest.mark.parametrize("view", sorted(VIEWS))
def test_each_panel_shows_the_weights_of_its_own_layer_and_head(modern, tokenizer, view):
    """Layers and heads swapped (`x.transpose(0, 1).reshape(x.shape)`, panels off by up to
    0.23) passed every test: each panel, and each image drawn, is checked against the block
    of its layer read alone, head by head."""
    from nmt.attention_map import attention_of_ids
    model, src_ids, tgt_ids = modern
    weights = attention_of_ids(model, tokenizer, tokenizer, src_ids, tgt_ids)
    layers = {"cross": 2, "encoder": 3, "decoder": 2}[view]
    fig = draw(weights, view)
    drawn = {ax.get_title(): ax.images[0].get_array() for ax in panel_axes(fig)}
    pyplot().close(fig)
    panels = {title: matrix for row in grid(weights, view) for title, matrix in row}
    for layer in range(layers):
        known = block_weights(model, view, layer, src_ids, tgt_ids)  # (h, queries, keys)
        for head in range(4):
            title = f"layer {layer + 1}, head {head + 1}"
            torch.testing.assert_close(panels[title], known[head])
            torch.testing.assert_close(torch.as_tensor(drawn[title]).float(), known[head])
        mean = grid(weights, view, layer=layer + 1, head="mean")[0][0][1]
        torch.testing.assert_close(mean, known.mean(0))  # the mean of this layer's heads


def view_content(view, rows, queries, keys, n_src, n_tgt):
    """What a picture of each view holds: cross, target tokens down and source tokens across;
    encoder, the source both ways (not causal); decoder, the target both ways, causal."""
    shape = {"cross": (n_tgt, n_src), "encoder": (n_src, n_src), "decoder": (n_tgt, n_tgt)}
    for matrix in rows:
        assert tuple(matrix.shape) == shape[view]
        upper = torch.as_tensor(matrix).triu(1)
        if view == "decoder":
            assert torch.all(upper == 0)  # nothing attends to a later token
        elif view == "encoder":
            assert torch.any(upper > 0)
    assert (len(queries), len(keys)) == shape[view]


@pytest.mark.parametrize("view", sorted(VIEWS))
def test_translate_draws_the_view_asked_for(trained, monkeypatch, view):
    """translate.py passing "cross" for every --attention_view passed: each view is checked by
    what its picture holds (the decoder's self-attention is causal, the encoder's reads the
    source both ways)."""
    import nmt.attention_map as attention_map
    home, _ = trained
    seen, real = {}, attention_map.draw

    def spy(weights, view="cross", layer=0, head="all", **kw):
        fig = real(weights, view, layer, head, **kw)
        axes = panel_axes(fig)
        seen.update(arrays=[ax.images[0].get_array() for ax in axes],
                    queries=[t.get_text() for t in axes[0].get_yticklabels()],
                    keys=[t.get_text() for t in axes[0].get_xticklabels()],
                    src=weights.src_tokens, tgt=weights.tgt_tokens)
        return fig
    monkeypatch.setattr(attention_map, "draw", spy)
    t = run_here("translate.py", "--attention", "view.png", "--attention_view", view,
                 "one two three four", cwd=home)
    assert t.returncode == 0, t.stderr.decode()
    assert (home / "view.png").read_bytes()[:4] == b"\x89PNG"
    view_content(view, seen["arrays"], seen["queries"], seen["keys"], len(seen["src"]),
                 len(seen["tgt"]))


def test_the_picture_is_readable_a_colour_bar_and_no_title_over_the_panels(modern, tokenizer):
    """translate.py --attention's title overlapped the first row of panel titles, and had no
    colour bar; TensorBoard's picture had neither labels nor titles, at 8 px a token. Now one
    renderer: every panel's title below the view's, a colour bar, 24 px a token or more."""
    from nmt.attention_map import DPI, attention_of_ids
    _, src_ids, tgt_ids = modern
    config, _ = parse_config([*SIZE, "--N", "6"])  # six rows of panels (the overlap grew with them)
    torch.manual_seed(0)
    weights = attention_of_ids(build_model(config, 300, 300).eval(), tokenizer, tokenizer,
                               src_ids, tgt_ids)
    for view, head in (("cross", "all"), ("encoder", "all"), ("decoder", "2"), ("cross", "mean")):
        fig = draw(weights, view, head=head)
        try:
            fig.canvas.draw()
            renderer = fig.canvas.get_renderer()
            above = fig._suptitle.get_window_extent(renderer).y0
            titles = [ax.title.get_window_extent(renderer).y1 for ax in panel_axes(fig)]
            assert above >= max(titles), view  # (it overlapped from 4 rows on)
            assert [ax.get_ylabel() for ax in fig.axes if ax.get_label() == "<colorbar>"] == \
                ["attention weight"]
            queries, keys = weights.axes(view)
            for ax in panel_axes(fig):
                box = ax.get_window_extent(renderer)
                assert box.width / len(keys) >= 24 and box.height / len(queries) >= 24
            assert fig.dpi == DPI  # as saved: the layout is the PNG's
        finally:
            pyplot().close(fig)


# ---- what each picture says: names, labels, colour scale, size, tokens (mutation audit) ------

NAMES = {"cross": ("decoder cross-attention", "translation (queries)", "source (keys)"),
         "encoder": ("encoder self-attention", "source (queries)", "source (keys)"),
         "decoder": ("decoder self-attention", "translation (queries)", "translation read (keys)")}


@pytest.fixture(scope="module")
def long_weights(modern, tokenizer):
    """The modern model's weights of a 35-token source and a 30-token translation, as ids."""
    from nmt.attention_map import attention_of_ids
    return attention_of_ids(modern[0], tokenizer, tokenizer, list(range(10, 45)),
                            list(range(10, 40)))


@pytest.mark.parametrize("view", sorted(VIEWS))
def test_every_panel_is_labelled_named_and_coloured_on_one_scale(modern, tokenizer, view):
    """The view's name above; the queries' name at the left, the keys' at the bottom (cross:
    the translation down, the source across); every panel's tokens on both axes, readable;
    one viridis scale from 0 to the largest weight, its colour bar beside all the panels."""
    from nmt.attention_map import attention_of_ids
    model, src_ids, tgt_ids = modern
    weights = attention_of_ids(model, tokenizer, tokenizer, src_ids, tgt_ids)
    queries, keys = weights.axes(view)
    fig = draw(weights, view, layer=0, head="all")
    try:
        fig.canvas.draw()
        renderer = fig.canvas.get_renderer()
        assert fig._suptitle.get_text() == NAMES[view][0]
        panels = panel_axes(fig)
        assert panels[0].get_ylabel() == NAMES[view][1]
        assert panels[-1].get_xlabel() == NAMES[view][2]
        top = float(weights.views[view].max())
        for ax in panels:
            assert [t.get_text() for t in ax.get_xticklabels()] == keys
            assert [t.get_text() for t in ax.get_yticklabels()] == queries
            assert min(t.get_fontsize() for t in ax.get_xticklabels() + ax.get_yticklabels()) >= 7
            assert ax.images[0].get_cmap().name == "viridis"
            assert ax.images[0].get_clim() == pytest.approx((0.0, top))
        bar, = [ax for ax in fig.axes if ax.get_label() == "<colorbar>"]
        boxes = [ax.get_window_extent(renderer) for ax in panels]
        span = max(b.y1 for b in boxes) - min(b.y0 for b in boxes)
        assert bar.get_window_extent(renderer).height >= 0.6 * span  # beside every row
        assert bar.get_ylim() == pytest.approx((0.0, top))
    finally:
        pyplot().close(fig)


def test_a_token_takes_24_pixels_or_more_however_many_there_are(long_weights, modern,
                                                               tokenizer):
    """With 30 and 35 tokens the margins no longer hide a smaller cell: 24 px a token, each
    axis sized by its own tokens (a long translation of a short source too)."""
    from nmt.attention_map import attention_of_ids
    tall = attention_of_ids(modern[0], tokenizer, tokenizer, [10, 11, 12], list(range(10, 40)))
    for weights in (long_weights, tall):
        queries, keys = weights.axes("cross")
        fig = draw(weights, "cross", layer=1, head="1")
        try:
            fig.canvas.draw()
            box = panel_axes(fig)[0].get_window_extent(fig.canvas.get_renderer())
            assert box.width / len(keys) >= 24 and box.height / len(queries) >= 24
        finally:
            pyplot().close(fig)


def test_the_heads_mean_draws_every_layer_side_by_side(modern, tokenizer):
    from nmt.attention_map import attention_of_ids
    model, src_ids, tgt_ids = modern
    weights = attention_of_ids(model, tokenizer, tokenizer, src_ids, tgt_ids)
    fig = draw(weights, "encoder", head="mean")
    try:
        panels = panel_axes(fig)
        assert [ax.get_title() for ax in panels] == [f"layer {n}, mean of 4 heads"
                                                      for n in (1, 2, 3)]
        assert len({round(ax.get_position().y0, 3) for ax in panels}) == 1  # one row
    finally:
        pyplot().close(fig)


def test_the_tokens_are_those_the_model_read_and_the_model_is_left_as_found(modern, tokenizer):
    """The decoder's keys are what each position reads ([SOS], then the translation); a
    generated [EOS] and what follows it are cut; a source longer than the model's seq_len is
    cut as the model cuts it; a model in training mode is left in it."""
    from nmt.attention_map import attention_of_ids
    from tokenizer import EOS, PAD
    model, src_ids, tgt_ids = modern
    weights = attention_of_ids(model, tokenizer, tokenizer, src_ids, tgt_ids)
    assert weights.tgt_inputs == ["[SOS]"] + weights.tgt_tokens[:-1]
    assert weights.axes("decoder") == (weights.tgt_tokens, weights.tgt_inputs)
    padded = attention_of_ids(model, tokenizer, tokenizer, src_ids, tgt_ids + [EOS, PAD, PAD])
    assert padded.tgt_tokens == weights.tgt_tokens
    for view in VIEWS:
        torch.testing.assert_close(padded.views[view], weights.views[view])
    long = attention_of_ids(model, tokenizer, tokenizer, list(range(10, 90)), tgt_ids)
    assert len(long.src_tokens) == model.seq_len == long.views["encoder"].shape[-1]
    model.train()
    try:
        attention_of_ids(model, tokenizer, tokenizer, src_ids, tgt_ids)
        assert model.training
    finally:
        model.eval()


def test_a_token_without_printable_text_is_labelled_by_its_vocabulary_name():
    from nmt.attention_map import label
    names = {1: "Ġ", 2: "âĢ", 3: "Hund"}
    texts = {1: " ", 2: "\ufffd\x00", 3: "Hund"}
    tokenizer = type("T", (), {"decode": lambda self, ids: texts[ids[0]],
                               "id_to_token": lambda self, i: names[i]})()
    assert [label(tokenizer, i) for i in (1, 2, 3)] == ["Ġ", "âĢ", "Hund"]


def test_tensorboards_picture_and_the_png_are_the_figure_drawn(modern, tokenizer, tmp_path):
    """picture: draw's figure of the view asked for, as RGB; save_attention_map's PNG at DPI,
    the size of that figure."""
    import struct

    import numpy as np

    from nmt.attention_map import attention_weights, picture, save_attention_map
    model = modern[0]
    weights = attention_weights(model, tokenizer, tokenizer, "one two three four five.", "uno.")
    for view in ("encoder", "cross"):
        image = picture(weights, view, head="mean")
        fig = draw(weights, view, head="mean")
        fig.canvas.draw()
        expected = np.asarray(fig.canvas.buffer_rgba())[..., :3]
        pyplot().close(fig)
        assert image.shape == expected.shape and np.array_equal(image, expected), view
    save_attention_map(model, tokenizer, tokenizer, "one two three four five.", "uno.",
                       tmp_path / "a.png", view="decoder")
    width, height = struct.unpack(">II", (tmp_path / "a.png").read_bytes()[16:24])
    assert (height, width, 3) == picture(weights, "decoder", head="all").shape
