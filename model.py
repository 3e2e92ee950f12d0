"""The Transformer of "Attention Is All You Need" (Vaswani et al., 2017), written from scratch.

Each class is one piece of the paper, its section named in the docstring; the classes that are
not in the paper say so ("An addition"): the options of the write-ups this repo follows (pre-norm,
RMSNorm, SwiGLU, rotary positions, grouped-query attention) and the key/value cache hook that
makes decoding incremental (the cache itself and the searches are in nmt/decoding.py).

Masks are boolean and True where attention is allowed: encoder masks are (batch, 1, 1, src_len),
decoder masks (batch, 1, tgt_len, tgt_len); the decoder's own is causal without a mask tensor.
"""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from kernels import Dropout, written_out_attention_is_faster


class InputEmbeddings(nn.Module):
    """Section 3.4: token embeddings, multiplied by sqrt(d_model)."""

    def __init__(self, d_model: int, vocab_size: int):
        super().__init__()
        self.d_model = d_model
        self.embedding = nn.Embedding(vocab_size, d_model)

    def forward(self, x):
        # (batch, seq_len) -> (batch, seq_len, d_model)
        return self.embedding(x) * math.sqrt(self.d_model)


class PositionalEncoding(nn.Module):
    """Section 3.5: PE(pos, 2i) = sin(pos / 10000^(2i/d_model)), PE(pos, 2i+1) = cos(...)."""

    def __init__(self, d_model: int, seq_len: int, dropout: float):
        super().__init__()
        self.dropout = Dropout(dropout)
        position = torch.arange(seq_len, dtype=torch.float).unsqueeze(1)  # (seq_len, 1)
        div_term = torch.exp(torch.arange(0, d_model, 2).float()
                             * (-math.log(10000.0) / d_model))  # (d_model / 2)
        pe = torch.zeros(seq_len, d_model)
        pe[:, 0::2] = torch.sin(position * div_term)
        pe[:, 1::2] = torch.cos(position * div_term)
        # A buffer, not a parameter; not saved, so it is rebuilt for any seq_len.
        self.register_buffer("pe", pe.unsqueeze(0), persistent=False)  # (1, seq_len, d_model)

    def forward(self, x, start: int = 0):
        # x: (batch, seq_len, d_model); `start` is the first position (for cached decoding)
        end = start + x.size(1)
        if end > self.pe.size(1):
            raise ValueError(f"sequence of {end} positions is longer than seq_len "
                             f"{self.pe.size(1)}")
        return self.dropout(x + self.pe[:, start:end].to(x.dtype))


class EmbeddingDropout(nn.Module):
    """An addition (with rotary positions): the embeddings carry no position, so this is only
    section 5.4's dropout on them, and the check that a sequence fits seq_len."""

    def __init__(self, seq_len: int, dropout: float):
        super().__init__()
        self.seq_len = seq_len
        self.dropout = Dropout(dropout)

    def forward(self, x, start: int = 0):
        if start + x.size(1) > self.seq_len:
            raise ValueError(f"sequence of {start + x.size(1)} positions is longer than seq_len "
                             f"{self.seq_len}")
        return self.dropout(x)


class RotaryPositionalEmbedding(nn.Module):
    """An addition, RoPE (Su et al., 2021): each pair of query/key features (i, i + d_k/2) is
    rotated by the angle pos · 10000^(-2i/d_k), so q_m · k_n depends on m - n only: relative
    positions, inside self-attention, at any offset of cached decoding."""

    def __init__(self, d_k: int, seq_len: int, base: float = 10000.0):
        super().__init__()
        inv_freq = base ** (-torch.arange(0, d_k, 2).float() / d_k)  # (d_k / 2,)
        angles = torch.outer(torch.arange(seq_len).float(), inv_freq)  # (seq_len, d_k / 2)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def forward(self, x, start: int = 0):
        # x: (batch, heads, len, d_k) at positions start .. start + len - 1
        cos = self.cos[start:start + x.size(2)].to(x.dtype)  # (len, d_k / 2)
        sin = self.sin[start:start + x.size(2)].to(x.dtype)
        x1, x2 = x.chunk(2, dim=-1)  # 2 x (batch, heads, len, d_k / 2)
        return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


class LayerNormalization(nn.Module):
    """Section 3.1's LayerNorm (Ba et al., 2016), with a learnable gain and bias per feature."""

    def __init__(self, features: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.alpha = nn.Parameter(torch.ones(features))  # gain
        self.bias = nn.Parameter(torch.zeros(features))

    def forward(self, x):
        # The fused kernel; `reference` is the same math written out (tests hold them equal).
        return F.layer_norm(x, self.alpha.shape, self.alpha, self.bias, self.eps)

    def reference(self, x):
        mean = x.mean(dim=-1, keepdim=True)  # (batch, seq_len, 1)
        var = x.var(dim=-1, keepdim=True, unbiased=False)  # (batch, seq_len, 1)
        return self.alpha * (x - mean) / torch.sqrt(var + self.eps) + self.bias


class FeedForwardBlock(nn.Module):
    """Section 3.3: FFN(x) = max(0, x W1 + b1) W2 + b2; the dropout of max(...) is an addition."""

    def __init__(self, d_model: int, d_ff: int, dropout: float):
        super().__init__()
        self.linear_1 = nn.Linear(d_model, d_ff)
        self.dropout = Dropout(dropout)
        self.linear_2 = nn.Linear(d_ff, d_model)

    def forward(self, x):
        # (batch, seq_len, d_model) -> (batch, seq_len, d_ff) -> (batch, seq_len, d_model)
        return self.linear_2(self.dropout(torch.relu(self.linear_1(x))))


class RMSNormalization(nn.Module):
    """An addition, RMSNorm (Zhang and Sennrich, 2019): x / sqrt(mean(x²) + eps) · gain; no
    centring, no bias. Computed in float32 for stability under bf16."""

    def __init__(self, features: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.alpha = nn.Parameter(torch.ones(features))  # gain

    def forward(self, x):
        rms = torch.rsqrt(x.float().pow(2).mean(dim=-1, keepdim=True) + self.eps)  # (..., 1)
        return (x.float() * rms).to(x.dtype) * self.alpha


class SwiGLUFeedForwardBlock(nn.Module):
    """An addition, SwiGLU (Shazeer, 2020): FFN(x) = W2 (SiLU(x W1) ⊙ x W3). Three matrices
    instead of two, so the hidden width is 2/3 of d_ff (rounded up to a multiple of 8): the
    same parameters and FLOPs as the ReLU block of that d_ff."""

    def __init__(self, d_model: int, d_ff: int, dropout: float):
        super().__init__()
        hidden = swiglu_width(d_ff)
        self.linear_1 = nn.Linear(d_model, hidden, bias=False)  # gate
        self.linear_3 = nn.Linear(d_model, hidden, bias=False)  # value
        self.dropout = Dropout(dropout)
        self.linear_2 = nn.Linear(hidden, d_model, bias=False)

    def forward(self, x):
        # (batch, seq_len, d_model) -> (batch, seq_len, hidden) -> (batch, seq_len, d_model)
        return self.linear_2(self.dropout(F.silu(self.linear_1(x)) * self.linear_3(x)))


def swiglu_width(d_ff: int) -> int:
    return -(-2 * d_ff // 3 // 8) * 8 if (2 * d_ff // 3) % 8 else 2 * d_ff // 3


def make_norm(kind: str, features: int) -> nn.Module:
    return RMSNormalization(features) if kind == "rms" else LayerNormalization(features)


def causal_mask(size: int, device=None):
    """(1, size, size), True on and below the diagonal: position i sees positions <= i."""
    return torch.ones(1, size, size, dtype=torch.bool, device=device).tril()


def attention(query, key, value, mask=None, dropout: nn.Module = None):
    """Section 3.2.1, scaled dot-product attention: softmax(Q Kᵀ / sqrt(d_k)) V, written out;
    `dropout` of the weights is an addition. Returns the output (batch, h, q_len, d_k) and the
    weights (batch, h, q_len, k_len). Grouped-query attention: `key` and `value` may have fewer
    heads than `query`, each shared by g = h / kv_heads query heads that follow one another,
    laid side by side against it: nothing is copied, forward or backward."""
    batch, h, q_len, d_k = query.shape
    kv_heads, k_len = key.size(1), key.size(2)
    # (batch, h, q_len, d_k) -> (batch, kv_heads, g · q_len, d_k)
    query = query.reshape(batch, kv_heads, -1, d_k)
    # (batch, kv_heads, g · q_len, d_k) @ (batch, kv_heads, d_k, k_len) -> (.., g · q_len, k_len)
    scores = (query @ key.transpose(-2, -1)) / math.sqrt(d_k)
    scores = scores.view(batch, h, q_len, k_len)  # (batch, h, q_len, k_len)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    weights = scores.softmax(dim=-1)
    if dropout is not None:
        weights = dropout(weights)
    # (batch, kv_heads, g · q_len, k_len) @ (batch, kv_heads, k_len, d_k) -> (.., g · q_len, d_k)
    out = weights.reshape(batch, kv_heads, -1, k_len) @ value
    return out.view(batch, h, q_len, d_k), weights  # (batch, h, q_len, d_k), weights


class MultiHeadAttentionBlock(nn.Module):
    """Section 3.2.2, multi-head attention: MultiHead(Q, K, V) = Concat(head_1 .. head_h) W_O,
    head_i = Attention(Q W_Q_i, K W_K_i, V W_V_i). In self-attention Q, K and V are the layer's
    input x; in the decoder's cross-attention (section 3.2.3) K and V are the encoder output.
    W_Q, W_K and W_V are stacked as one matrix `w_qkv`: self-attention projects in one matmul.

    Additions: grouped-query attention (Ainslie et al., 2023), `n_kv_heads` < h key/value heads
    each shared by h / n_kv_heads query heads; `rotary`, RoPE on self-attention's queries and
    keys; `cache`, the keys and values of earlier steps for incremental decoding (nmt/decoding.py).
    """

    def __init__(self, d_model: int, h: int, dropout: float, n_kv_heads: int = None,
                 rotary: "RotaryPositionalEmbedding" = None):
        super().__init__()
        assert d_model % h == 0, "d_model is not divisible by h"
        self.d_model, self.h, self.d_k = d_model, h, d_model // h
        self.n_kv_heads = n_kv_heads or h
        assert h % self.n_kv_heads == 0, "h is not divisible by n_kv_heads"
        self.d_kv = self.n_kv_heads * self.d_k  # width of the keys (and of the values)
        # W_Q, W_K, W_V stacked: (d_model + 2 · d_kv, d_model)
        self.w_qkv = nn.Linear(d_model, d_model + 2 * self.d_kv, bias=False)
        self.w_o = nn.Linear(d_model, d_model, bias=False)
        self.dropout = Dropout(dropout)
        self.rotary = [rotary]  # in a list: one module shared by all layers, owned by the model
        self.use_reference = False  # True: `attention` written out instead of the fused kernel
        self.need_weights = False  # True: keep the attention weights in self.attention_scores
        self.attention_scores = None

    def forward(self, x, memory=None, mask=None, causal=False, cache=None):
        """Self-attention over x (batch, len, d_model), or cross-attention from x to `memory`
        (the encoder output). `causal`: position i sees positions <= i, with no mask tensor (so
        the fused kernels, flash attention included, can run)."""
        # q: (batch, h, len, d_k); k, v: (batch, kv_heads, k_len, d_k), k_len memory's or cache's
        q, k, v = self.project(x, memory, cache)
        out = self.attend(q, k, v, mask, causal)  # (batch, h, len, d_k)
        out = out.transpose(1, 2).reshape(x.size(0), x.size(1), self.d_model)  # (batch, len, d)
        return self.w_o(out)

    def heads(self, x):
        # (batch, len, heads · d_k) -> (batch, heads, len, d_k)
        return x.view(x.size(0), x.size(1), -1, self.d_k).transpose(1, 2)

    def project(self, x, memory=None, cache=None):
        """Q = x W_Q, and K = m W_K, V = m W_V with m = x or `memory`, split into heads. With a
        cache (decoding): self-attention appends this step's keys and values to the earlier
        ones; cross-attention projects `memory` once and reuses it."""
        d = self.d_model
        if memory is None:  # self-attention: one fused projection
            # (batch, len, d_model + 2 · d_kv) -> (batch, len, d_model), 2 x (batch, len, d_kv)
            q, k, v = self.w_qkv(x).split([d, self.d_kv, self.d_kv], dim=-1)
            q, k, v = self.heads(q), self.heads(k), self.heads(v)  # (batch, heads, len, d_k)
            if self.rotary[0] is not None:  # positions start .. start + len - 1
                start = cache.length if cache is not None else 0
                q, k = self.rotary[0](q, start), self.rotary[0](k, start)
            if cache is not None:
                k, v = cache.append(k, v)  # (batch, kv_heads, past + len, d_k)
            return q, k, v
        q = self.heads(F.linear(x, self.w_qkv.weight[:d]))  # (batch, h, len, d_k)
        if cache is not None and cache.k is not None:
            return q, cache.k, cache.v
        kv = F.linear(memory, self.w_qkv.weight[d:])  # (batch, src_len, 2 · d_kv)
        k, v = map(self.heads, kv.split(self.d_kv, dim=-1))  # (batch, kv_heads, src_len, d_k)
        if cache is not None:
            cache.k, cache.v = k, v
        return q, k, v

    def attend(self, q, k, v, mask=None, causal=False):
        """`attention` over the heads: torch's fused kernel, one call for the same formula
        (grouped-query attention shares each key/value head among its query heads without
        copying it), or the formula written out where the weights are kept (need_weights),
        asked for (use_reference), or faster (kernels.py: CPU, bf16 or attention dropout)."""
        dropout = self.training and self.dropout.p > 0
        if self.use_reference or self.need_weights or written_out_attention_is_faster(q, dropout):
            if causal:
                mask = causal_mask(q.size(2), q.device)  # (1, q_len, q_len)
            out, weights = attention(q, k, v, mask, self.dropout)
            self.attention_scores = weights if self.need_weights else None
            return out
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=None if causal else mask, is_causal=causal,
            dropout_p=self.dropout.p if dropout else 0.0, enable_gqa=self.n_kv_heads != self.h)


class ResidualConnection(nn.Module):
    """Sections 3.1 and 5.4, the paper's "Add & Norm" (post-norm): Norm(x + Dropout(Sublayer(x))).
    An addition, pre-norm (the write-ups', the default): x + Dropout(Sublayer(Norm(x)))."""

    def __init__(self, features: int, dropout: float, norm: str = "layer",
                 norm_first: bool = True):
        super().__init__()
        self.dropout = Dropout(dropout)
        self.norm = make_norm(norm, features)
        self.norm_first = norm_first

    def forward(self, x, sublayer):
        if self.norm_first:
            return x + self.dropout(sublayer(self.norm(x)))
        return self.norm(x + self.dropout(sublayer(x)))


class EncoderBlock(nn.Module):
    """Section 3.1: self-attention, then feed-forward, each in a residual connection."""

    def __init__(self, features: int, self_attention_block: MultiHeadAttentionBlock,
                 feed_forward_block: nn.Module, dropout: float, norm: str = "layer",
                 norm_first: bool = True):
        super().__init__()
        self.self_attention_block = self_attention_block
        self.feed_forward_block = feed_forward_block
        self.residual_connections = nn.ModuleList(
            [ResidualConnection(features, dropout, norm, norm_first) for _ in range(2)])

    def forward(self, x, src_mask):
        x = self.residual_connections[0](x, lambda x: self.self_attention_block(x, mask=src_mask))
        return self.residual_connections[1](x, self.feed_forward_block)


class Encoder(nn.Module):
    """Section 3.1: a stack of N identical encoder layers."""

    def __init__(self, features: int, layers: nn.ModuleList, norm: str = "layer",
                 norm_first: bool = True):
        super().__init__()
        self.layers = layers
        # A pre-norm stack ends with a norm; a post-norm one already ends normalised.
        self.norm = make_norm(norm, features) if norm_first else nn.Identity()

    def forward(self, x, mask):
        for layer in self.layers:
            x = layer(x, mask)
        return self.norm(x)  # (batch, src_len, d_model)


class DecoderBlock(nn.Module):
    """Section 3.1: masked self-attention, cross-attention over the encoder output, then
    feed-forward, each in a residual connection."""

    def __init__(self, features: int, self_attention_block: MultiHeadAttentionBlock,
                 cross_attention_block: MultiHeadAttentionBlock,
                 feed_forward_block: nn.Module, dropout: float, norm: str = "layer",
                 norm_first: bool = True):
        super().__init__()
        self.self_attention_block = self_attention_block
        self.cross_attention_block = cross_attention_block
        self.feed_forward_block = feed_forward_block
        self.residual_connections = nn.ModuleList(
            [ResidualConnection(features, dropout, norm, norm_first) for _ in range(3)])

    def forward(self, x, encoder_output, src_mask, tgt_mask, cache=None, causal=False):
        self_cache, cross_cache = (None, None) if cache is None else (cache["self"], cache["cross"])
        x = self.residual_connections[0](x, lambda x: self.self_attention_block(
            x, mask=tgt_mask, cache=self_cache, causal=causal))
        x = self.residual_connections[1](
            x, lambda x: self.cross_attention_block(x, encoder_output, src_mask, cache=cross_cache))
        return self.residual_connections[2](x, self.feed_forward_block)


class Decoder(nn.Module):
    """Section 3.1: a stack of N identical decoder layers."""

    def __init__(self, features: int, layers: nn.ModuleList, norm: str = "layer",
                 norm_first: bool = True):
        super().__init__()
        self.layers = layers
        self.norm = make_norm(norm, features) if norm_first else nn.Identity()

    def forward(self, x, encoder_output, src_mask, tgt_mask, cache=None, causal=False):
        for i, layer in enumerate(self.layers):
            x = layer(x, encoder_output, src_mask, tgt_mask,
                      cache.layers[i] if cache is not None else None, causal)
        return self.norm(x)  # (batch, tgt_len, d_model)


class ProjectionLayer(nn.Module):
    """Section 3.4: the linear layer before the softmax. Returns logits; the decoders apply
    log-softmax themselves, and the loss takes this layer and the decoder's output (so that a
    faster loss may project a block of positions at a time)."""

    def __init__(self, d_model: int, vocab_size: int):
        super().__init__()
        self.proj = nn.Linear(d_model, vocab_size)

    def forward(self, x):
        # (batch, seq_len, d_model) -> (batch, seq_len, vocab_size)
        return self.proj(x)


class LabelSmoothedCrossEntropy(nn.Module):
    """Section 5.4, label smoothing: the cross-entropy of the model's distribution (the softmax
    of the projection, section 3.4) against (1 - ε) · one-hot(label) + ε / vocab, summed over
    the positions whose label is not `ignore_index` (padding): what
    nn.CrossEntropyLoss(ignore_index=..., label_smoothing=ε, reduction="sum") gives on the
    logits. Training computes the same a block of positions at a time, without the whole
    logits (kernels.BlockwiseLabelSmoothedCrossEntropy), where that is faster."""

    def __init__(self, label_smoothing: float = 0.0, ignore_index: int = -100):
        super().__init__()
        self.label_smoothing, self.ignore_index = label_smoothing, ignore_index

    def forward(self, x, projection: ProjectionLayer, label):
        """x: (batch, tgt_len, d_model), the decoder's output; label: (batch, tgt_len)."""
        eps = self.label_smoothing
        log_probs = projection(x).float().log_softmax(dim=-1)  # (batch, tgt_len, vocab)
        real = label != self.ignore_index  # (batch, tgt_len), False at padding
        label = label.masked_fill(~real, 0).unsqueeze(-1)  # (batch, tgt_len, 1)
        nll = -log_probs.gather(-1, label).squeeze(-1)  # (batch, tgt_len): -log p(label)
        uniform = -log_probs.mean(dim=-1)  # (batch, tgt_len): -Σ_j log p(j) / vocab
        loss = (1 - eps) * nll + eps * uniform  # (batch, tgt_len)
        return loss.masked_fill(~real, 0.0).sum()


class Transformer(nn.Module):
    """Section 3 and figure 1: embeddings and positions, the encoder, the decoder, and the
    projection to the target vocabulary."""

    def __init__(self, encoder: Encoder, decoder: Decoder, src_embed: InputEmbeddings,
                 tgt_embed: InputEmbeddings, src_pos: nn.Module, tgt_pos: nn.Module,
                 projection_layer: ProjectionLayer, seq_len: int,
                 rotary: RotaryPositionalEmbedding = None):
        super().__init__()
        self.encoder, self.decoder = encoder, decoder
        self.src_embed, self.tgt_embed = src_embed, tgt_embed
        self.src_pos, self.tgt_pos = src_pos, tgt_pos  # PositionalEncoding, or EmbeddingDropout
        self.projection_layer = projection_layer
        self.seq_len = seq_len  # the longest source or target
        self.rotary = rotary  # registered here so that .to(device) moves its tables

    def encode(self, src, src_mask):
        # (batch, src_len) -> (batch, src_len, d_model)
        return self.encoder(self.src_pos(self.src_embed(src)), src_mask)

    def decode(self, encoder_output, src_mask, tgt, tgt_mask=None, cache=None):
        """(batch, tgt_len) -> (batch, tgt_len, d_model). With a cache, `tgt` holds only the new
        positions and attends to the cached ones as well.

        tgt_mask None means causal: right-padded targets need no more, since a real position
        never sees a later (padding) one and the loss ignores the padded positions. Without a
        mask tensor, scaled_dot_product_attention can use its flash kernel."""
        start = cache.length if cache is not None else 0
        if tgt_mask is None and start > 0 and tgt.size(1) > 1:
            raise ValueError("several new positions after cached ones need an explicit tgt_mask")
        x = self.tgt_pos(self.tgt_embed(tgt), start)
        causal = tgt_mask is None and start == 0 and tgt.size(1) > 1
        out = self.decoder(x, encoder_output, src_mask, tgt_mask, cache, causal)
        if cache is not None:
            cache.length += tgt.size(1)
        return out

    def project(self, x):
        return self.projection_layer(x)

    def forward(self, src, tgt, src_mask, tgt_mask=None, label=None,
                loss: LabelSmoothedCrossEntropy = None):
        """Teacher-forced logits: (batch, tgt_len, tgt_vocab_size); tgt_mask None: causal. With
        `label` (batch, tgt_len) and `loss`, the summed loss instead (the logits never whole)."""
        x = self.decode(self.encode(src, src_mask), src_mask, tgt, tgt_mask)  # (b, len, d)
        return self.project(x) if loss is None else loss(x, self.projection_layer, label)


def build_transformer(src_vocab_size: int, tgt_vocab_size: int, src_seq_len: int,
                      tgt_seq_len: int, d_model: int = 512, N: int = 6, h: int = 8,
                      dropout: float = 0.1, d_ff: int = 2048, tie_embeddings="none",
                      norm_first: bool = True, norm: str = "layer", ffn: str = "relu",
                      pos: str = "sinusoidal", n_kv_heads: int = None,
                      shared_vocab: bool = False, attention_dropout: float = None,
                      activation_dropout: float = None, N_dec: int = None) -> Transformer:
    """The Transformer of the paper (with pre-norm by default, as in the write-ups).

    N: the encoder's layers, and the decoder's unless N_dec (a deep encoder with a shallow
    decoder translates faster, Kasai et al., 2021). dropout: the paper's residual dropout (each
    sublayer's output, and the sum of embeddings and positions, section 5.4);
    attention_dropout, activation_dropout: additions, on the attention weights and the
    feed-forward's hidden activations (None: as dropout). norm_first: pre-norm (True) or the paper's
    post-norm; norm: "layer" or "rms"; ffn: "relu" or "swiglu"; pos: "sinusoidal" or "rope";
    n_kv_heads: key/value heads (grouped-query attention; None = h); shared_vocab: one
    embedding table for both languages (one joint vocabulary); tie_embeddings: "none",
    "decoder" (the projection shares the target embedding) or "all" (section 3.4's sharing:
    both embeddings and the projection; needs shared_vocab); True/False: decoder/none."""
    tie = {True: "decoder", False: "none"}.get(tie_embeddings, tie_embeddings)
    if (tie == "all" or shared_vocab) and src_vocab_size != tgt_vocab_size:
        raise ValueError("a shared vocabulary needs equal source and target vocabulary sizes")
    if tie == "all" and not shared_vocab:
        raise ValueError("tie_embeddings 'all' needs shared_vocab")
    src_embed = InputEmbeddings(d_model, src_vocab_size)
    tgt_embed = src_embed if shared_vocab else InputEmbeddings(d_model, tgt_vocab_size)
    rotary = RotaryPositionalEmbedding(d_model // h, max(src_seq_len, tgt_seq_len)) \
        if pos == "rope" else None
    src_pos, tgt_pos = (PositionalEncoding(d_model, n, dropout) if rotary is None
                        else EmbeddingDropout(n, dropout) for n in (src_seq_len, tgt_seq_len))
    attention_dropout = dropout if attention_dropout is None else attention_dropout
    activation_dropout = dropout if activation_dropout is None else activation_dropout
    layer = dict(dropout=dropout, norm=norm, norm_first=norm_first)
    ffn_block = SwiGLUFeedForwardBlock if ffn == "swiglu" else FeedForwardBlock

    def feed_forward():
        return ffn_block(d_model, d_ff, activation_dropout)

    def attention(rotary=None):
        return MultiHeadAttentionBlock(d_model, h, attention_dropout, n_kv_heads, rotary)

    encoder_blocks = [EncoderBlock(d_model, attention(rotary), feed_forward(), **layer)
                      for _ in range(N)]
    decoder_blocks = [DecoderBlock(d_model, attention(rotary), attention(), feed_forward(),
                                   **layer)  # self-attention (rotary), cross-attention
                      for _ in range(N if N_dec is None else N_dec)]
    encoder = Encoder(d_model, nn.ModuleList(encoder_blocks), norm, norm_first)
    decoder = Decoder(d_model, nn.ModuleList(decoder_blocks), norm, norm_first)
    projection_layer = ProjectionLayer(d_model, tgt_vocab_size)
    transformer = Transformer(encoder, decoder, src_embed, tgt_embed, src_pos, tgt_pos,
                              projection_layer, max(src_seq_len, tgt_seq_len), rotary)
    init_weights(transformer, d_model)
    if tie in ("decoder", "all"):  # (section 3.4's sharing) the target embedding is the projection
        projection_layer.proj.weight = tgt_embed.embedding.weight
    return transformer


def init_weights(transformer: Transformer, d_model: int):
    """Xavier uniform on every matrix (`w_qkv`, W_Q/W_K/W_V stacked: fairseq's 1/sqrt(2) gain
    where n_kv_heads = h), N(0, 1/d_model) on the embedding tables: unit size after the ·sqrt(d)."""
    for p in transformer.parameters():
        if p.dim() > 1:
            nn.init.xavier_uniform_(p)
    for embed in (transformer.src_embed, transformer.tgt_embed):
        nn.init.normal_(embed.embedding.weight, std=d_model ** -0.5)

