"""What a translation attends to, in every view: the decoder's cross-attention (which source
tokens each output token looked at), the encoder's self-attention and the decoder's (causal)
self-attention, each of every layer and head (translate.py --attention, the tour notebook, and
the picture TensorBoard shows at each validation).

    weights = attention_weights(model, tok_src, tok_tgt, "A dog runs.", "Ein Hund rennt.")
    weights.views["cross"]     # (decoder layers, heads, target tokens, source tokens)
    weights.views["encoder"]   # (encoder layers, heads, source tokens, source tokens)
    weights.views["decoder"]   # (decoder layers, heads, target tokens, target tokens)

Grouped-query attention draws its query heads: h of them, each with its shared key/value head.
"""

from dataclasses import dataclass
from pathlib import Path

import torch

from config import UserError
from dataset import source_batch
from model import causal_mask
from nmt.plotting import pyplot
from tokenizer import EOS, SOS

VIEWS = {"cross": "decoder cross-attention", "encoder": "encoder self-attention",
         "decoder": "decoder self-attention"}
AXIS_NAMES = {"cross": ("translation (queries)", "source (keys)"),  # (down, across)
              "encoder": ("source (queries)", "source (keys)"),
              "decoder": ("translation (queries)", "translation read (keys)")}


@dataclass
class AttentionWeights:
    """The weights of each view, (layers, heads, query tokens, key tokens), and the tokens of
    both axes: the source tokens framed by [SOS] and [EOS]; the target positions labelled by
    the token each predicts (the translation, then [EOS]) as queries, and by the token each
    reads (its input: [SOS], then the translation) as the decoder's keys."""
    views: dict
    src_tokens: list
    tgt_tokens: list  # what each decoder position predicts (queries)
    tgt_inputs: list  # what each decoder position reads (keys of the decoder's self-attention)

    def axes(self, view: str) -> tuple:
        """(query tokens, key tokens) of a view."""
        return {"cross": (self.tgt_tokens, self.src_tokens),
                "encoder": (self.src_tokens, self.src_tokens),
                "decoder": (self.tgt_tokens, self.tgt_inputs)}[view]


def attention_blocks(model) -> dict:
    """The MultiHeadAttentionBlocks of each view, in layer order."""
    return {"cross": [layer.cross_attention_block for layer in model.decoder.layers],
            "encoder": [layer.self_attention_block for layer in model.encoder.layers],
            "decoder": [layer.self_attention_block for layer in model.decoder.layers]}


@torch.no_grad()
def attention_weights(model, tokenizer_src, tokenizer_tgt, sentence: str,
                      translation: str) -> AttentionWeights:
    """Teacher-forces `translation` of `sentence` through the model (in eval mode) and keeps
    the attention weights of every block: one forward pass."""
    return attention_of_ids(model, tokenizer_src, tokenizer_tgt, tokenizer_src.encode(sentence).ids,
                            tokenizer_tgt.encode(translation).ids)


@torch.no_grad()
def attention_of_ids(model, tokenizer_src, tokenizer_tgt, src_ids, tgt_ids) -> AttentionWeights:
    """attention_weights of token ids: the source as the model read it and the tokens it
    generated (cut at [EOS]), not a re-encoding of their text (training's picture)."""
    device = next(model.parameters()).device
    tgt_ids = [int(i) for i in tgt_ids]
    tgt_ids = tgt_ids[:tgt_ids.index(EOS)] if EOS in tgt_ids else tgt_ids
    src_ids = [int(i) for i in src_ids][:model.seq_len - 2]
    tgt_ids = tgt_ids[:model.seq_len - 1]
    src, src_mask = (t.to(device) for t in source_batch([src_ids], model.seq_len))  # (1, len)
    tgt = torch.tensor([[SOS] + tgt_ids], device=device)  # (1, tgt_len)
    blocks = attention_blocks(model)
    every = [b for view in blocks.values() for b in view]
    training = model.training
    model.eval()
    for block in every:
        block.need_weights = True
    try:
        model.decode(model.encode(src, src_mask), src_mask, tgt,
                     causal_mask(tgt.size(1), device))
        views = {view: torch.stack([b.attention_scores[0] for b in found]).float().cpu()
                 for view, found in blocks.items()}  # each (layers, h, queries, keys)
    finally:
        for block in every:
            block.need_weights, block.attention_scores = False, None
        model.train(training)
    target = [label(tokenizer_tgt, i) for i in tgt_ids]
    return AttentionWeights(views, ["[SOS]"] + [label(tokenizer_src, i) for i in src_ids]
                            + ["[EOS]"], target + ["[EOS]"], ["[SOS]"] + target)


def label(tokenizer, i: int) -> str:
    """A token as an axis label: its text, or where that is blank or not printable (a byte of
    a character split by byte-level BPE, a control character) the vocabulary's own name."""
    text = tokenizer.decode([i])
    return text if text.strip() and text.isprintable() else tokenizer.id_to_token(i)


def cross_attention(model, tokenizer_src, tokenizer_tgt, sentence: str, translation: str):
    """The decoder's cross-attention weights, (layers, heads, target tokens, source tokens),
    with the token strings of both axes."""
    found = attention_weights(model, tokenizer_src, tokenizer_tgt, sentence, translation)
    return found.views["cross"], found.src_tokens, found.tgt_tokens


def check_layer_and_head(view: str, layers: int, heads: int, layer: int, head: str):
    """A `layer` (from 1; 0: all) and `head` (from 1, mean or all) that the view's `layers`
    and `heads` have, or one UserError line."""
    if not 0 <= layer <= layers:
        raise UserError(f"--attention_layer {layer}: the {VIEWS[view]} has {layers} "
                        f"layer{'s' * (layers != 1)} (1 to {layers}; 0: all)")
    if head not in ("all", "mean") and not (head.isdecimal() and 1 <= int(head) <= heads):
        raise UserError(f"--attention_head {head}: the {VIEWS[view]} has {heads} "
                        f"head{'s' * (heads != 1)} (1 to {heads}, mean or all)")


def grid(weights: AttentionWeights, view: str = "cross", layer: int = 0, head: str = "all"):
    """The panels of a picture of one view: rows the layers (or the one `layer`, counting from
    1; 0: all), columns the heads (or the one `head`, counting from 1; "mean": their mean;
    "all": each). A list of rows, each a list of (title, (queries, keys) matrix). A layer or
    head that does not exist is one UserError line."""
    found = weights.views[view]  # (layers, h, queries, keys)
    layers, heads = found.shape[:2]
    check_layer_and_head(view, layers, heads, layer, head)
    rows = []
    for n in ([layer - 1] if layer else range(layers)):
        if head == "mean":
            rows.append([(f"layer {n + 1}, mean of {heads} heads", found[n].mean(0))])
        else:
            chosen = [int(head) - 1] if head != "all" else range(heads)
            rows.append([(f"layer {n + 1}, head {j + 1}", found[n, j]) for j in chosen])
    return rows


DPI = 110  # the pictures' pixels an inch: a token's cell of CELL inches is 33 pixels
CELL = 0.3  # inches a token takes on each axis of a panel


def draw(weights: AttentionWeights, view: str = "cross", layer: int = 0, head: str = "all",
         cell: float = CELL):
    """The one picture of attention (translate.py --attention, TensorBoard's at each
    validation): a matplotlib figure of `grid`'s panels, one heatmap each, query tokens down,
    key tokens across, every token labelled, each axis named (at the left and the bottom),
    each panel titled by its layer and head, one colour scale (viridis, 0 to the largest
    weight shown) with its colour bar, the view's name above (laid out so that nothing
    overlaps). Rows of one panel each (one head, or the heads' mean) are laid side by side.
    Returns the figure (the caller saves and closes it)."""
    plt = pyplot()
    if plt is None:
        raise UserError("drawing attention needs matplotlib (pip install matplotlib)")
    rows = grid(weights, view, layer, head)
    if len(rows) > 1 and all(len(row) == 1 for row in rows):
        rows = [[panel for row in rows for panel in row]]  # the layers side by side
    queries, keys = weights.axes(view)
    width = max(2.5, cell * len(keys) + 1.2)
    height = max(2.0, cell * len(queries) + 1.2)
    fig, axes = plt.subplots(len(rows), len(rows[0]), squeeze=False, layout="constrained",
                             figsize=(width * len(rows[0]) + 1.0, height * len(rows) + 0.4),
                             dpi=DPI)
    top = max(float(matrix.max()) for row in rows for _, matrix in row)
    for r, (panels, row) in enumerate(zip(axes, rows)):
        for c, (ax, (title, matrix)) in enumerate(zip(panels, row)):
            image = ax.imshow(matrix.numpy(), cmap="viridis", vmin=0.0, vmax=top, aspect="auto")
            ax.set_xticks(range(len(keys)), keys, rotation=90, fontsize=7)
            ax.set_yticks(range(len(queries)), queries, fontsize=7)
            ax.set_title(title, fontsize=8)
            if c == 0:  # what each axis holds, once a row and once a column
                ax.set_ylabel(AXIS_NAMES[view][0], fontsize=8)
            if r == len(rows) - 1:
                ax.set_xlabel(AXIS_NAMES[view][1], fontsize=8)
    fig.colorbar(image, ax=axes, shrink=0.8, label="attention weight")
    fig.suptitle(VIEWS[view], fontsize=9)
    return fig


def picture_problem(path: str):
    """Why `path` cannot take a picture of attention, or None: matplotlib missing, or a name
    without a format matplotlib writes (it would add .png to `attmap`, and refuse `a.txt`):
    checked before any sentence is decoded (translate.py --attention)."""
    plt = pyplot()
    if plt is None:
        return "drawing attention needs matplotlib (pip install matplotlib)"
    from matplotlib.backend_bases import FigureCanvasBase  # (its formats: no figure made)
    if Path(path).suffix[1:].lower() not in FigureCanvasBase.get_supported_filetypes():
        return (f"--attention {path}: end the file name with a picture format (.png, .pdf, "
                f".svg or another that matplotlib writes)")
    return None


def save_attention_map(model, tokenizer_src, tokenizer_tgt, sentence, translation, path,
                       view: str = "cross", layer: int = 0, head: str = "all"):
    """A PNG of one view of the translation's attention (`draw`)."""
    weights = attention_weights(model, tokenizer_src, tokenizer_tgt, sentence, translation)
    fig = draw(weights, view, layer, head)
    try:
        fig.savefig(path, dpi=DPI)
    except OSError as e:
        raise UserError(f"cannot write {path}: {e.strerror}") from None
    finally:
        pyplot().close(fig)


def picture(weights: AttentionWeights, view: str = "cross", head: str = "mean"):
    """`draw`'s figure as an RGB image, uint8 (height, width, 3), at DPI: TensorBoard's
    picture (its layers side by side, each the mean of its heads)."""
    import numpy as np
    fig = draw(weights, view, head=head)
    try:
        fig.canvas.draw()
        return np.asarray(fig.canvas.buffer_rgba())[..., :3].copy()  # (H, W, 3)
    finally:
        pyplot().close(fig)
