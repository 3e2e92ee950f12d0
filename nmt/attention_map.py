"""The cross-attention map of a translation: which source tokens each output token looked at
(translate.py --attention PNG)."""

import torch

from config import UserError
from dataset import source_batch
from model import causal_mask
from nmt.plotting import pyplot
from tokenizer import SOS


@torch.no_grad()
def cross_attention(model, tokenizer_src, tokenizer_tgt, sentence: str, translation: str):
    """Teacher-forces `translation` and returns the decoder's cross-attention weights,
    (layers, heads, target tokens, source tokens), with the token strings of both axes."""
    device = next(model.parameters()).device
    src_ids = tokenizer_src.encode(sentence).ids[:model.seq_len - 2]
    tgt_ids = tokenizer_tgt.encode(translation).ids[:model.seq_len - 1]
    src, src_mask = (t.to(device) for t in source_batch([src_ids], model.seq_len))  # (1, len)
    tgt = torch.tensor([[SOS] + tgt_ids], device=device)  # (1, tgt_len)
    blocks = [layer.cross_attention_block for layer in model.decoder.layers]
    for block in blocks:
        block.need_weights = True
    try:
        model.decode(model.encode(src, src_mask), src_mask, tgt,
                     causal_mask(tgt.size(1), device))
        weights = torch.stack([b.attention_scores[0] for b in blocks])  # (N, h, tgt, src)
    finally:
        for block in blocks:
            block.need_weights, block.attention_scores = False, None
    label = (lambda tok, i: tok.decode([i]) or tok.id_to_token(i))
    src_tokens = ["[SOS]"] + [label(tokenizer_src, i) for i in src_ids] + ["[EOS]"]
    tgt_tokens = [label(tokenizer_tgt, i) for i in tgt_ids] + ["[EOS]"]
    return weights.float().cpu(), src_tokens, tgt_tokens


def save_attention_map(model, tokenizer_src, tokenizer_tgt, sentence, translation, path):
    """A PNG: one heatmap per decoder layer (averaged over heads), target rows x source
    columns, so you can see which source words each output word looked at."""
    plt = pyplot()
    if plt is None:
        raise UserError("--attention needs matplotlib (pip install matplotlib)")
    weights, src_tokens, tgt_tokens = cross_attention(model, tokenizer_src, tokenizer_tgt,
                                                      sentence, translation)
    layers = weights.size(0)
    width = max(4.0, 0.35 * len(src_tokens) + 1.5)
    height = max(3.0, 0.3 * len(tgt_tokens) + 1.2)
    fig, axes = plt.subplots(1, layers, figsize=(width * layers, height), squeeze=False)
    for n, ax in enumerate(axes[0]):
        ax.imshow(weights[n].mean(0).numpy(), cmap="viridis", vmin=0.0, aspect="auto")
        ax.set_xticks(range(len(src_tokens)), src_tokens, rotation=90, fontsize=8)
        ax.set_yticks(range(len(tgt_tokens)), tgt_tokens, fontsize=8)
        ax.set_title(f"decoder layer {n + 1}", fontsize=9)
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=120)
    except OSError as e:
        raise UserError(f"cannot write {path}: {e.strerror}") from None
    finally:
        plt.close(fig)
