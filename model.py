"""The Transformer of "Attention Is All You Need" (Vaswani et al., 2017), written from scratch.

Each class is one piece of the paper (section numbers in the docstrings). Masks are boolean and
True where attention is allowed: encoder masks are (batch, 1, 1, src_len), decoder masks
(batch, 1, tgt_len, tgt_len). At the bottom: batched greedy and beam search with a key/value
cache, so each new target token costs one position of work.

Beside the paper's choices, `build_transformer` offers the options of the write-ups this repo
follows: pre- or post-norm, LayerNorm or RMSNorm, ReLU or SwiGLU feed-forward, sinusoidal or
rotary positions, grouped-query attention, and shared vocabularies and embeddings.
"""

import math
from copy import deepcopy

import torch
import torch.nn as nn
import torch.nn.functional as F

# scaled_dot_product_attention shares key/value heads itself from torch 2.5 on (enable_gqa)
SDPA_GQA = tuple(int(x) for x in torch.__version__.split(".")[:2]) >= (2, 5)


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
        self.dropout = nn.Dropout(dropout)
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
    """With rotary positions the embeddings carry no position: only the dropout of 5.4."""

    def __init__(self, seq_len: int, dropout: float):
        super().__init__()
        self.seq_len = seq_len
        self.dropout = nn.Dropout(dropout)

    def forward(self, x, start: int = 0):
        if start + x.size(1) > self.seq_len:
            raise ValueError(f"sequence of {start + x.size(1)} positions is longer than seq_len "
                             f"{self.seq_len}")
        return self.dropout(x)


class RotaryPositionalEmbedding(nn.Module):
    """RoPE (Su et al., 2021): each pair of query/key features (i, i + d_k/2) is rotated by the
    angle pos · 10000^(-2i/d_k), so q_m · k_n depends on m - n only: relative positions,
    inside self-attention, at any offset of cached decoding."""

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
    """Layer normalization (Ba et al., 2016) with a learnable gain and bias per feature."""

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
    """Section 3.3: FFN(x) = max(0, x W1 + b1) W2 + b2."""

    def __init__(self, d_model: int, d_ff: int, dropout: float):
        super().__init__()
        self.linear_1 = nn.Linear(d_model, d_ff)
        self.dropout = nn.Dropout(dropout)
        self.linear_2 = nn.Linear(d_ff, d_model)

    def forward(self, x):
        # (batch, seq_len, d_model) -> (batch, seq_len, d_ff) -> (batch, seq_len, d_model)
        return self.linear_2(self.dropout(torch.relu(self.linear_1(x))))


class RMSNormalization(nn.Module):
    """RMSNorm (Zhang and Sennrich, 2019): x / sqrt(mean(x²) + eps) · gain; no centring, no
    bias. Computed in float32 for stability under bf16."""

    def __init__(self, features: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.alpha = nn.Parameter(torch.ones(features))  # gain

    def forward(self, x):
        rms = torch.rsqrt(x.float().pow(2).mean(dim=-1, keepdim=True) + self.eps)  # (..., 1)
        return (x.float() * rms).to(x.dtype) * self.alpha


class SwiGLUFeedForwardBlock(nn.Module):
    """SwiGLU (Shazeer, 2020): FFN(x) = W2 (SiLU(x W1) ⊙ x W3). Three matrices instead of two,
    so the hidden width is 2/3 of d_ff (rounded up to a multiple of 8): the same parameters
    and FLOPs as the ReLU block of that d_ff."""

    def __init__(self, d_model: int, d_ff: int, dropout: float):
        super().__init__()
        hidden = swiglu_width(d_ff)
        self.linear_1 = nn.Linear(d_model, hidden, bias=False)  # gate
        self.linear_3 = nn.Linear(d_model, hidden, bias=False)  # value
        self.dropout = nn.Dropout(dropout)
        self.linear_2 = nn.Linear(hidden, d_model, bias=False)

    def forward(self, x):
        # (batch, seq_len, d_model) -> (batch, seq_len, hidden) -> (batch, seq_len, d_model)
        return self.linear_2(self.dropout(F.silu(self.linear_1(x)) * self.linear_3(x)))


def swiglu_width(d_ff: int) -> int:
    return -(-2 * d_ff // 3 // 8) * 8 if (2 * d_ff // 3) % 8 else 2 * d_ff // 3


def make_norm(kind: str, features: int) -> nn.Module:
    return RMSNormalization(features) if kind == "rms" else LayerNormalization(features)


class MultiHeadAttentionBlock(nn.Module):
    """Section 3.2: multi-head scaled dot-product attention.

    The query, key and value projections W_Q, W_K, W_V are stored as one matrix `w_qkv`:
    self-attention projects all three in one matmul; cross-attention projects the queries with
    the W_Q rows and the encoder output's keys and values with the rest.

    Options: grouped-query attention (Ainslie et al., 2023): `n_kv_heads` < h key/value heads,
    each shared by h / n_kv_heads query heads (fewer parameters, a smaller cache); `rotary`:
    RoPE on the queries and keys of self-attention.
    """

    def __init__(self, d_model: int, h: int, dropout: float, n_kv_heads: int = None,
                 rotary: RotaryPositionalEmbedding = None):
        super().__init__()
        assert d_model % h == 0, "d_model is not divisible by h"
        self.d_model, self.h, self.d_k = d_model, h, d_model // h
        self.n_kv_heads = n_kv_heads or h
        assert h % self.n_kv_heads == 0, "h is not divisible by n_kv_heads"
        self.d_kv = self.n_kv_heads * self.d_k  # width of the keys (and of the values)
        # W_Q, W_K, W_V stacked: (d_model + 2 · d_kv, d_model)
        self.w_qkv = nn.Linear(d_model, d_model + 2 * self.d_kv, bias=False)
        self.w_o = nn.Linear(d_model, d_model, bias=False)
        self.dropout = nn.Dropout(dropout)
        self.rotary = [rotary]  # in a list: one module shared by all layers, owned by the model
        self.use_reference = False  # True: the written-out math below instead of the fused kernel
        self.need_weights = False  # True: keep the attention weights in self.attention_scores
        self.attention_scores = None

    @staticmethod
    def attention(query, key, value, mask, dropout: nn.Dropout = None):
        """softmax(Q Kᵀ / sqrt(d_k)) V, written out. Returns (output, attention weights)."""
        d_k = query.size(-1)
        # (batch, h, q_len, d_k) @ (batch, h, d_k, k_len) -> (batch, h, q_len, k_len)
        scores = (query @ key.transpose(-2, -1)) / math.sqrt(d_k)
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        scores = scores.softmax(dim=-1)
        if dropout is not None:
            scores = dropout(scores)
        return scores @ value, scores  # (batch, h, q_len, d_k), (batch, h, q_len, k_len)

    def _heads(self, x):
        # (batch, seq_len, heads · d_k) -> (batch, heads, seq_len, d_k)
        return x.view(x.size(0), x.size(1), -1, self.d_k).transpose(1, 2)

    def forward(self, x, memory=None, mask=None, cache=None, causal=False):
        """Self-attention over x, or cross-attention from x to `memory` (the encoder output).

        `causal`: position i sees positions <= i, without a mask tensor (so the fused kernels,
        flash attention included, can run). `cache` (a dict) makes decoding incremental:
        self-attention appends this step's keys and values to it; cross-attention projects
        `memory` once and reuses it."""
        d, rotary = self.d_model, self.rotary[0]
        if memory is None:  # self-attention: one fused projection
            q, k, v = self.w_qkv(x).split([d, self.d_kv, self.d_kv], dim=-1)
            q, k, v = self._heads(q), self._heads(k), self._heads(v)  # (batch, heads, len, d_k)
            past = cache.length if cache is not None else 0
            if rotary is not None:  # positions past .. past + len - 1
                q, k = rotary(q, past), rotary(k, past)
            if cache is not None:
                k, v = cache.append(k, v)  # (batch, kv_heads, past + len, d_k)
        else:  # cross-attention: no positions (the queries and keys are of two sequences)
            q = self._heads(F.linear(x, self.w_qkv.weight[:d]))  # (batch, h, len, d_k)
            if cache is not None and cache.k is not None:
                k, v = cache.k, cache.v
            else:
                k, v = F.linear(memory, self.w_qkv.weight[d:]).split(self.d_kv, dim=-1)
                k, v = self._heads(k), self._heads(v)  # (batch, kv_heads, src_len, d_k)
                if cache is not None:
                    cache.k, cache.v = k, v
        grouped = self.n_kv_heads != self.h  # each key/value head serves h / n_kv_heads queries
        if grouped and (self.use_reference or self.need_weights or not SDPA_GQA):
            k = k.repeat_interleave(self.h // self.n_kv_heads, dim=1)  # (batch, h, k_len, d_k)
            v = v.repeat_interleave(self.h // self.n_kv_heads, dim=1)
            grouped = False
        if self.use_reference or self.need_weights:
            if causal:
                mask = causal_mask(q.size(2), q.device)  # (1, q_len, q_len)
            out, scores = self.attention(q, k, v, mask, self.dropout)
            self.attention_scores = scores if self.need_weights else None
        else:
            # grouped: the kernel shares each key/value head among its query heads, no copy
            out = F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, is_causal=causal,
                dropout_p=self.dropout.p if self.training else 0.0,
                **({"enable_gqa": True} if grouped else {}))
        # (batch, h, len, d_k) -> (batch, len, h, d_k) -> (batch, len, d_model)
        out = out.transpose(1, 2).reshape(x.size(0), x.size(1), d)
        return self.w_o(out)


class ResidualConnection(nn.Module):
    """Section 5.4. Pre-norm (the write-ups): x + Dropout(Sublayer(Norm(x))). Post-norm (the
    paper's "Add & Norm"): Norm(x + Dropout(Sublayer(x)))."""

    def __init__(self, features: int, dropout: float, norm: str = "layer",
                 norm_first: bool = True):
        super().__init__()
        self.dropout = nn.Dropout(dropout)
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
        self_cache = cache["self"] if cache is not None else None
        cross_cache = cache["cross"] if cache is not None else None
        x = self.residual_connections[0](
            x, lambda x: self.self_attention_block(x, mask=tgt_mask, cache=self_cache,
                                                   causal=causal))
        x = self.residual_connections[1](
            x, lambda x: self.cross_attention_block(x, encoder_output, src_mask, cross_cache))
        return self.residual_connections[2](x, self.feed_forward_block)


class Decoder(nn.Module):
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
    """Section 3.4: the linear layer before the softmax. Returns logits; the loss and the
    decoders apply (log-)softmax once, themselves."""

    def __init__(self, d_model: int, vocab_size: int):
        super().__init__()
        self.proj = nn.Linear(d_model, vocab_size)

    def forward(self, x):
        # (batch, seq_len, d_model) -> (batch, seq_len, vocab_size)
        return self.proj(x)


class LayerCache:
    """One attention block's keys and values for incremental decoding, (batch, kv_heads,
    positions, d_k). Self-attention: buffers of `capacity` positions, written in place one
    step at a time (`append`: no copy of the past each step). Cross-attention: the encoder
    output's, projected once (`k`, `v`)."""

    def __init__(self, capacity: int = 0):
        self.k = self.v = None
        self.length, self.capacity = 0, capacity

    def append(self, k, v):
        """Writes the new positions' keys and values; returns all of them so far."""
        end = self.length + k.size(2)
        if self.k is None or end > self.k.size(2):  # the first step (or past the capacity)
            size = max(self.capacity, end, 2 * self.length)
            old_k, old_v = self.k, self.v
            self.k = k.new_empty(k.size(0), k.size(1), size, k.size(3))
            self.v = v.new_empty(v.size(0), v.size(1), size, v.size(3))
            if old_k is not None:
                self.k[:, :, :self.length], self.v[:, :, :self.length] = \
                    old_k[:, :, :self.length], old_v[:, :, :self.length]
        self.k[:, :, self.length:end] = k
        self.v[:, :, self.length:end] = v
        self.length = end
        return self.k[:, :, :end], self.v[:, :, :end]  # (batch, kv_heads, end, d_k)

    def reorder(self, index):
        if self.k is not None:
            self.k, self.v = self.k.index_select(0, index), self.v.index_select(0, index)


class KVCache:
    """Keys and values of every decoder layer for incremental decoding: the self-attention's
    grow by one position a step (room for `capacity` made once), the cross-attention's are
    computed once per sentence."""

    def __init__(self, n_layers: int, capacity: int = 0):
        self.layers = [{"self": LayerCache(capacity), "cross": LayerCache()}
                       for _ in range(n_layers)]
        self.length = 0  # target positions already decoded

    def reorder(self, index, self_only: bool = False):
        """Keep and reorder batch rows (dropping finished sentences; beam search). Beams of one
        sentence share its cross-attention keys/values: shuffling beams needs `self_only`."""
        for layer in self.layers:
            for part in (layer["self"],) if self_only else layer.values():
                part.reorder(index)


class Transformer(nn.Module):
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

    def decode(self, encoder_output, src_mask, tgt, tgt_mask=None, cache: KVCache = None):
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

    def forward(self, src, tgt, src_mask, tgt_mask=None):
        """Teacher-forced logits: (batch, tgt_len, tgt_vocab_size); tgt_mask None: causal."""
        return self.project(self.decode(self.encode(src, src_mask), src_mask, tgt, tgt_mask))

    def new_cache(self, capacity: int = 0) -> KVCache:
        """An empty cache with room for `capacity` target positions."""
        return KVCache(len(self.decoder.layers), capacity)


def build_transformer(src_vocab_size: int, tgt_vocab_size: int, src_seq_len: int,
                      tgt_seq_len: int, d_model: int = 512, N: int = 6, h: int = 8,
                      dropout: float = 0.1, d_ff: int = 2048, tie_embeddings="none",
                      norm_first: bool = True, norm: str = "layer", ffn: str = "relu",
                      pos: str = "sinusoidal", n_kv_heads: int = None,
                      shared_vocab: bool = False, attention_dropout: float = None,
                      activation_dropout: float = None) -> Transformer:
    """The Transformer of the paper (with pre-norm by default, as in the write-ups).

    dropout: the paper's residual dropout (each sublayer's output, and the sum of embeddings
    and positions, section 5.4); attention_dropout: on the attention weights; activation_dropout:
    on the feed-forward's hidden activations (both None: as dropout; fairseq's default is 0).

    norm_first: pre-norm (True) or the paper's post-norm; norm: "layer" or "rms"; ffn: "relu"
    or "swiglu"; pos: "sinusoidal" (added to the embeddings) or "rope" (rotary, inside
    self-attention); n_kv_heads: key/value heads (grouped-query attention; None = h);
    shared_vocab: one embedding table for both languages (one joint vocabulary);
    tie_embeddings: "none", "decoder" (the projection shares the target embedding, section
    3.4) or "all" (source and target embeddings and the projection: one matrix, which needs
    shared_vocab). True and False mean "decoder" and "none"."""
    tie = {True: "decoder", False: "none"}.get(tie_embeddings, tie_embeddings)
    if (tie == "all" or shared_vocab) and src_vocab_size != tgt_vocab_size:
        raise ValueError("a shared vocabulary needs equal source and target vocabulary sizes")
    if tie == "all" and not shared_vocab:
        raise ValueError("tie_embeddings 'all' needs shared_vocab")
    src_embed = InputEmbeddings(d_model, src_vocab_size)
    tgt_embed = src_embed if shared_vocab else InputEmbeddings(d_model, tgt_vocab_size)
    rotary = RotaryPositionalEmbedding(d_model // h, max(src_seq_len, tgt_seq_len)) \
        if pos == "rope" else None
    if rotary is None:
        src_pos = PositionalEncoding(d_model, src_seq_len, dropout)
        tgt_pos = PositionalEncoding(d_model, tgt_seq_len, dropout)
    else:
        src_pos, tgt_pos = EmbeddingDropout(src_seq_len, dropout), EmbeddingDropout(
            tgt_seq_len, dropout)
    attention_dropout = dropout if attention_dropout is None else attention_dropout
    activation_dropout = dropout if activation_dropout is None else activation_dropout
    layer = dict(dropout=dropout, norm=norm, norm_first=norm_first)

    def feed_forward():
        block = SwiGLUFeedForwardBlock if ffn == "swiglu" else FeedForwardBlock
        return block(d_model, d_ff, activation_dropout)

    def attention(rotary=None):
        return MultiHeadAttentionBlock(d_model, h, attention_dropout, n_kv_heads, rotary)

    encoder_blocks = [EncoderBlock(d_model, attention(rotary), feed_forward(), **layer)
                      for _ in range(N)]
    decoder_blocks = [DecoderBlock(d_model, attention(rotary), attention(), feed_forward(),
                                   **layer)  # self-attention (rotary), cross-attention
                      for _ in range(N)]
    encoder = Encoder(d_model, nn.ModuleList(encoder_blocks), norm, norm_first)
    decoder = Decoder(d_model, nn.ModuleList(decoder_blocks), norm, norm_first)
    projection_layer = ProjectionLayer(d_model, tgt_vocab_size)
    transformer = Transformer(encoder, decoder, src_embed, tgt_embed, src_pos, tgt_pos,
                              projection_layer, max(src_seq_len, tgt_seq_len), rotary)
    for p in transformer.parameters():  # Xavier (Glorot) uniform on every matrix
        if p.dim() > 1:
            nn.init.xavier_uniform_(p)
    for embed in (src_embed, tgt_embed):  # N(0, 1/d_model): times sqrt(d_model), unit size
        nn.init.normal_(embed.embedding.weight, std=d_model ** -0.5)  # beside the positions
    if tie in ("decoder", "all"):  # Section 3.4: the target embedding is the projection
        projection_layer.proj.weight = tgt_embed.embedding.weight
    return transformer


# ---- masks --------------------------------------------------------------------------------------

def causal_mask(size: int, device=None):
    """(1, size, size), True on and below the diagonal: position i sees positions <= i."""
    return torch.ones(1, size, size, dtype=torch.bool, device=device).tril()


# ---- decoding -----------------------------------------------------------------------------------

def output_limits(src_lengths, max_len_a: float, max_len_b: int, seq_len: int):
    """The most output tokens ([EOS] not counted) of each sentence: fairseq's
    max_len_a · source length + max_len_b, and never more than seq_len allows ([SOS] and
    [EOS] included, as in training). src_lengths: (batch,) real source tokens."""
    limit = (max_len_a * src_lengths.double() + max_len_b).floor().long()  # (batch,)
    return limit.clamp(min=1, max=seq_len - 2)


def restrict(logp, step: int, limit, min_len: int, eos_id: int):
    """Length rules applied to log-probabilities (batch, vocab) of output token `step`
    (counting from 1): [EOS] is barred until min_len tokens are out (no empty translation),
    and is the only choice once a sentence has its `limit` (batch,) tokens. In place."""
    if step <= min_len:
        logp[:, eos_id] = float("-inf")
    force = limit < step  # (batch,)
    if force.any():
        eos = logp[force, eos_id].clone()
        logp[force] = float("-inf")
        logp[force, eos_id] = eos
    return logp


class PackedLinear(nn.Module):
    """A linear layer for decoding on CPU in float32: its weight prepacked once into oneDNN's
    blocked layout, so that the small matrix product of every decoding step does not repack it
    (for 100 rows of a 10,000-token vocabulary: 3.3 against 7.7 ms)."""

    def __init__(self, linear: nn.Linear, rows: int):
        super().__init__()
        self.weight = linear.weight  # still there for code that reads it
        self.bias = None if linear.bias is None else linear.bias.detach()
        self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), rows)
        probe = torch.linspace(-1, 1, 3 * linear.in_features).view(3, -1)  # no RNG draw
        if not torch.allclose(self(probe), linear(probe), rtol=1e-4, atol=1e-4):
            raise RuntimeError("the packed product does not match")

    def forward(self, x):
        y = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, x.size(-1)), self.packed,
                                               self.bias, "none", [], "")  # (rows, out)
        return y.view(*x.shape[:-1], y.size(-1))  # (..., out_features)


def decoding_model(model: Transformer, rows: int = 64) -> Transformer:
    """The model as the decoders run it. On CPU in float32: a copy sharing every weight, whose
    decoder layers' linear layers and output projection are PackedLinear (cross-attention's
    slice of the fused Q/K/V matrix is left unpacked). Elsewhere (a GPU, bf16 weights, quantized
    layers, a torch without these internal operators), or if a packed product does not match:
    the model itself. `rows`: the batch the packing is tuned for."""
    proj = model.projection_layer.proj
    if type(proj) is not nn.Linear or proj.weight.device.type != "cpu" or \
            proj.weight.dtype != torch.float32 or not torch.backends.mkldnn.is_available():
        return model
    shared = {id(t): t for t in [*model.parameters(), *model.buffers()]}
    copy = deepcopy(model, shared)  # the modules copied, their tensors not
    try:
        for module in [copy.projection_layer, *copy.decoder.modules()]:
            for name, child in module.named_children():
                if type(child) is nn.Linear:
                    setattr(module, name, PackedLinear(child, rows))
    except (RuntimeError, AttributeError):
        return model
    return copy


@torch.no_grad()
def greedy_decode(model: Transformer, src, src_mask, sos_id: int, eos_id: int, max_len,
                  use_cache: bool = True, banned=(), min_len: int = 0):
    """Greedy decoding of a batch. src (batch, src_len), src_mask (batch, 1, 1, src_len);
    max_len: most tokens to output per sentence before its [EOS] (an int or a (batch,)
    tensor); min_len: fewest.

    Returns one list of token ids per sentence, without [SOS] and [EOS]. Finished sentences
    leave the batch, so they stop costing work. use_cache=False re-runs the decoder over the
    whole prefix every step (the write-ups' way; kept as the reference)."""
    batch = src.size(0)
    limit = torch.as_tensor(max_len, device=src.device).expand(batch).clone()  # (batch,)
    memory = model.encode(src, src_mask)  # (batch, src_len, d_model)
    ys = torch.full((batch, 1), sos_id, dtype=torch.long, device=src.device)  # (batch, 1)
    alive = torch.arange(batch, device=src.device)  # original row of each row still decoding
    cache = model.new_cache(int(limit.max()) + 1) if use_cache else None
    banned = torch.tensor(list(banned), dtype=torch.long, device=src.device)
    results = [None] * batch
    for step in range(1, int(limit.max()) + 2):
        if use_cache:
            out = model.decode(memory, src_mask, ys[:, -1:], None, cache)  # (alive, 1, d)
        else:
            mask = causal_mask(ys.size(1), src.device)
            out = model.decode(memory, src_mask, ys, mask)  # (alive, step, d_model)
        logits = model.project(out[:, -1]).float()  # (alive, vocab)
        logits.index_fill_(1, banned, float("-inf"))  # never generated ([PAD], [SOS], ...)
        next_token = restrict(logits, step, limit[alive], min_len, eos_id).argmax(dim=-1)
        ys = torch.cat([ys, next_token.unsqueeze(1)], dim=1)  # (alive, step + 1)
        done = next_token == eos_id  # (alive,)
        if done.any():
            for row in done.nonzero().flatten().tolist():
                results[alive[row]] = ys[row, 1:-1].tolist()
            keep = (~done).nonzero().flatten()  # (still alive,)
            if keep.numel() == 0:
                break
            ys, memory, src_mask, alive = ys[keep], memory[keep], src_mask[keep], alive[keep]
            if cache is not None:
                cache.reorder(keep)
    return results


def length_penalty(length, alpha: float):
    """Wu et al. (2016), used by the paper with alpha = 0.6: ((5 + |Y|) / 6) ^ alpha, |Y|
    counting the [EOS]. (CTranslate2 divides by |Y| ^ alpha instead.)"""
    return ((5.0 + length) / 6.0) ** alpha


@torch.no_grad()
def beam_search(model: Transformer, src, src_mask, sos_id: int, eos_id: int, max_len,
                beam: int = 4, alpha: float = 0.6, nbest: int = 1, banned=(), min_len: int = 0):
    """Batched beam search with a key/value cache.

    Keeps `beam` live hypotheses per sentence; a hypothesis that emits [EOS] is finished with
    score log P / length_penalty (length with the [EOS]); max_len and min_len bound the tokens
    before it, as in greedy_decode. A sentence stops when it has `beam` finished hypotheses,
    or when its best candidate is [EOS] and it has `nbest` finished, and leaves the batch.
    Returns, per sentence, the `nbest` best (tokens without [SOS]/[EOS], score) pairs, best
    first."""
    batch, k = src.size(0), beam
    device = src.device
    limit = torch.as_tensor(max_len, device=device).expand(batch).clone()  # (batch,)
    memory = model.encode(src, src_mask).repeat_interleave(k, dim=0)  # (batch*k, src_len, d)
    src_mask = src_mask.repeat_interleave(k, dim=0)  # (batch*k, 1, 1, src_len)
    tokens = torch.full((batch * k, 1), sos_id, dtype=torch.long, device=device)
    scores = torch.zeros(batch, k, device=device)  # (batch, k) summed log-probabilities
    scores[:, 1:] = float("-inf")  # at first all beams are the same [SOS]: keep one
    alive = torch.arange(batch, device=device)  # original sentence of each live sentence
    finished = [[] for _ in range(batch)]
    banned = torch.tensor(list(banned), dtype=torch.long, device=device)
    cache = model.new_cache(int(limit.max()) + 1)
    for step in range(1, int(limit.max()) + 2):
        n = alive.numel()
        out = model.decode(memory, src_mask, tokens[:, -1:], None, cache)  # (n*k, 1, d_model)
        logits = model.project(out[:, -1]).float()  # (n*k, vocab)
        logits.index_fill_(1, banned, float("-inf"))  # never generated ([PAD], [SOS], ...)
        logp = restrict(logits.log_softmax(dim=-1), step,
                        limit[alive].repeat_interleave(k), min_len, eos_id)  # (n*k, vocab)
        # The best 2k continuations overall lie within each beam's own best 2k tokens.
        width = min(2 * k, logp.size(-1))
        top_logp, top_tokens = logp.topk(width, dim=-1)  # (n*k, 2k)
        cand = (scores.unsqueeze(-1) + top_logp.view(n, k, width)).view(n, k * width)
        top_scores, top_idx = cand.topk(width, dim=-1)  # (n, 2k)
        beam_idx = top_idx // width  # (n, 2k)
        token = top_tokens.view(n, k * width).gather(1, top_idx)  # (n, 2k)
        # A candidate [EOS] ends its hypothesis; only those ranked in the top k are kept.
        ends = token == eos_id  # (n, 2k)
        rank = torch.arange(top_idx.size(1), device=device)
        final = ends & (rank < k) & torch.isfinite(top_scores)
        for i, j in final.nonzero().tolist():
            hyp = tokens[i * k + beam_idx[i, j], 1:].tolist()
            score = top_scores[i, j].item() / length_penalty(step, alpha)
            finished[alive[i]].append((hyp, score))
        # The next live beams: the k best candidates that did not end.
        order = (ends.long() * top_idx.size(1) + rank).argsort(dim=-1)[:, :k]  # (n, k)
        scores = top_scores.gather(1, order)  # (n, k)
        rows = (torch.arange(n, device=device).unsqueeze(1) * k
                + beam_idx.gather(1, order)).flatten()  # (n*k,)
        tokens = torch.cat([tokens[rows], token.gather(1, order).reshape(-1, 1)], dim=1)
        cache.reorder(rows, self_only=True)  # rows stay within their sentence
        # A sentence is done past its limit, with k finished hypotheses, or (as in OpenNMT)
        # once its best candidate is [EOS] and it has the nbest hypotheses asked for.
        counts = torch.tensor([len(finished[s]) for s in alive.tolist()], device=device)  # (n,)
        best_ended = (token[:, 0] == eos_id) & torch.isfinite(top_scores[:, 0])  # (n,)
        done = (limit[alive] < step) | (counts >= k) | (best_ended & (counts >= nbest))  # (n,)
        if done.any():
            keep = (~done).nonzero().flatten()  # (still live,)
            if keep.numel() == 0:
                break
            keep_rows = (keep.unsqueeze(1) * k + torch.arange(k, device=device)).flatten()
            tokens, memory, src_mask = tokens[keep_rows], memory[keep_rows], src_mask[keep_rows]
            scores, alive = scores[keep], alive[keep]
            cache.reorder(keep_rows)
    return [sorted(hyps, key=lambda t: -t[1])[:nbest] for hyps in finished]


@torch.no_grad()
def translate_ids(model: Transformer, src_ids, sos_id: int, eos_id: int, pad_id: int,
                  seq_len: int, beam: int = 1, alpha: float = 0.6, batch_size: int = 64,
                  nbest: int = 1, max_len_a: float = 1.2, max_len_b: int = 10, min_len: int = 1,
                  use_cache: bool = True, unk_id: int = None, progress=None):
    """Translates lists of source token ids (no special tokens) in batches of similar length.

    Each sentence outputs at most max_len_a · its length + max_len_b tokens (capped by
    seq_len) and at least min_len (1: never an empty translation). [PAD], [SOS] and `unk_id`
    are never generated. Sources longer than seq_len allows are cut (translate.py warns
    first). `progress`: called with the number of sentences of each batch done (a progress
    bar; it may raise to stop). Returns per sentence the output ids (beam 1: greedy), or with
    nbest > 1 a list of (ids, score)."""
    device = next(model.parameters()).device
    banned = [pad_id, sos_id] + ([unk_id] if unk_id is not None else [])
    model = decoding_model(model, batch_size * beam)  # CPU: the weights prepacked
    order = sorted(range(len(src_ids)), key=lambda i: len(src_ids[i]))  # similar lengths
    results = [None] * len(src_ids)
    for start in range(0, len(order), batch_size):
        idx = order[start:start + batch_size]
        seqs = [torch.tensor([sos_id] + list(src_ids[i])[:seq_len - 2] + [eos_id]) for i in idx]
        src = nn.utils.rnn.pad_sequence(seqs, batch_first=True,
                                        padding_value=pad_id).to(device)  # (batch, src_len)
        src_mask = (src != pad_id)[:, None, None, :]  # (batch, 1, 1, src_len)
        lengths = (src != pad_id).sum(dim=1) - 2  # (batch,) real source tokens
        max_len = output_limits(lengths, max_len_a, max_len_b, seq_len)  # (batch,)
        if beam == 1 and nbest == 1:
            outputs = greedy_decode(model, src, src_mask, sos_id, eos_id, max_len, use_cache,
                                    banned, min_len)
        else:
            outputs = beam_search(model, src, src_mask, sos_id, eos_id, max_len, beam, alpha,
                                  nbest, banned, min_len)
            if nbest == 1:
                outputs = [hyps[0][0] for hyps in outputs]
        for i, out in zip(idx, outputs):
            results[i] = out
        if progress is not None:
            progress(len(idx))
    return results
