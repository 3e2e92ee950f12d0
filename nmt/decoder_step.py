"""The decoder's one-token step on CPU with nothing around it: a speed path beside model.py.

Decoding the README's model (128 wide) on CPU spends more time around the matrix products than
in them: model.py's decoder, run one token at a time, dispatches about a hundred operations a
layer (views, norms written out, rotary positions per tensor, the cache's bookkeeping) on
tensors of a few thousand numbers. `FastDecoder` computes the same step from the same weights
laid out once per file: each layer is about twenty operations on 2-d tensors (rows, features):

- the norms as one fused call each (F.layer_norm, F.rms_norm);
- the self-attention's W_Q, W_K, W_V in one product; rotary positions as one product of the
  queries and keys with the step's rotation matrix; the step's keys and values written in place
  into a cache made once per batch at its length limit; the scale inside the score product;
- the cross-attention's keys and values of every layer projected once per batch in one
  product, kept once per sentence (a sentence's beams attend them in one product), the source
  mask an additive bias folded into the score product;
- W_O and the feed-forward's last matrix as one product that adds the residual (torch.addmm);
  SwiGLU's gate and value matrices as one product;
- the output projection prepacked once into oneDNN's layout (`PackedLinear`);
- the searches' choices over the vocabulary (`row_argmax`, `row_topk`) from the maxima of
  blocks of columns, one vectorized pass: torch's argmax and topk are not vectorized on CPU
  (for 100 rows of 10,000 logits, one thread of an AMD EPYC: argmax 1.0 ms, amax 0.05 ms);
- for the modern design (pre-norm RMSNorm, rotary positions, grouped-query attention, SwiGLU),
  every decoder layer of a step in one call of nmt/decoder_step.c, and the encoder's layers in
  another once a batch (`NativeLayers`), built where a C compiler is (once a CPU, kept in a
  cache: `_built`): the same computation, its products through torch's own sgemm_, without
  the fixed cost of some hundred operators a step (greedy decoding a fifth faster on 2 cores).
  Its cache is written once at each position and does not move (unless it grows, which the
  searches never need): a table (`where`) says which row holds each row's keys and values at
  each position, and beams that follow other beams, and rows that stay when others finish,
  take their rows of it;
- beam search's candidates over the vocabulary from one C call that visits each row once
  (`top_logits`: the log-softmax's normalizer and the k largest logits), where the log-softmax,
  the length rules and row_topk each sweep the rows and the first writes a copy of them (beam
  4 an eighth faster on 2 cores).

`FastState` is the search state over a batch (nmt/decoding.py's searches call it as they call
ModelState): finished sentences and reordered beams move only the positions decoded so far
(the operators' step) or nothing of the cache (the C step).
It is used where it applies (a CPU, float32, eval mode, nn.Linear layers: `fast_decoder`), and
is held to model.py's decoder by tests/test_decoder_step.py (greedy tokens identical; beam
hypotheses identical and scores within 1e-4), for the three designs and their options.
"""

import contextlib
import ctypes
import hashlib
import math
import os
import shlex
import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from model import (DecoderBlock, EncoderBlock, LayerNormalization, MultiHeadAttentionBlock,
                   PositionalEncoding, ResidualConnection, RMSNormalization,
                   SwiGLUFeedForwardBlock, Transformer)


class PackedLinear(nn.Module):
    """A linear layer for decoding on CPU in float32: its weight prepacked once into oneDNN's
    blocked layout, so that the small matrix product of every decoding step does not repack it
    (for 100 rows of a 10,000-token vocabulary, 2 cores of an AMD EPYC with AVX-512: 3.3
    against 7.7 ms)."""

    def __init__(self, linear: nn.Linear, rows: int):
        super().__init__()
        self.bias = None if linear.bias is None else linear.bias.detach()
        self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), rows)
        probe = torch.linspace(-1, 1, 3 * linear.in_features).view(3, -1)  # no RNG draw
        if not torch.allclose(self(probe), linear(probe), rtol=1e-4, atol=1e-4):
            raise RuntimeError("the packed product does not match")

    def forward(self, x):
        y = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, x.size(-1)), self.packed,
                                               self.bias, "none", [], "")  # (rows, out)
        return y.view(*x.shape[:-1], y.size(-1))  # (..., out_features)


def _compiled_layers():
    """nmt/decoder_step.c compiled for this CPU (the C compiler `CC` names, else cc or gcc) and
    given the sgemm_ of torch's own libtorch_cpu, once a process: built once per source,
    compiler and CPU and kept in the build cache (`build_cache`), where later processes load it
    (a build takes a second, about a third of translating a sentence from the command line);
    None, silently, where there is no compiler, the build fails or this torch has no sgemm_
    (the operators' step then runs)."""
    global _COMPILED
    with _COMPILING:  # one build, whichever thread asks first
        if _COMPILED is None:
            _COMPILED = _compile()
    return _COMPILED or None


def _compile():
    """The compiled library (see _compiled_layers), or False."""
    try:
        compiler = shlex.split(os.environ.get("CC", "")) or \
            [shutil.which("cc") or shutil.which("gcc") or "cc"]
        sgemm = ctypes.cast(ctypes.CDLL(str(TORCH_CPU)).sgemm_, ctypes.c_void_p)
        compiled = _built([*compiler, "-O3", "-march=native", "-fopenmp-simd", "-shared",
                           "-fPIC", str(SOURCE), "-lm"])
        compiled.set_sgemm(sgemm)
        compiled.encoder_layers.restype = compiled.top_logits.restype = None
        compiled.layers.restype = ctypes.c_int
        return compiled
    except (OSError, AttributeError, ValueError, subprocess.SubprocessError):
        return False


def build_cache() -> Path:
    """Where built libraries are kept: NMT_CACHE_DIR, else $XDG_CACHE_HOME/nmt, else
    ~/.cache/nmt (an absolute path: a library is loaded by its path)."""
    named = os.environ.get("NMT_CACHE_DIR") or \
        os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "nmt")
    return Path(named).expanduser().absolute()


def _built(command: list) -> ctypes.CDLL:
    """The library that `command` (a compiler's, without its -o) builds, loaded: the one kept in
    the build cache where a process built it before for the same source, command, compiler and
    CPU (`_build_key`), else built, once, in a temporary folder, and kept for the next
    (`_keep`). The cache is passed over where it cannot serve: a folder another user owns or
    others can write (a library there would run in this process), or a compiler that does not
    say what it builds for. A kept file that does not load (damaged, a noexec mount) is built
    again."""
    folder, key = build_cache(), _build_key(command)
    library = folder / f"{SOURCE.stem}-{key}.so" if key and _ours(folder) else None
    damaged = False
    if library is not None and library.exists():
        try:
            return ctypes.CDLL(str(library))
        except OSError:
            damaged = True
    with tempfile.TemporaryDirectory() as temporary:
        built = Path(temporary) / SOURCE.with_suffix(".so").name
        subprocess.run([*command, "-o", str(built)], check=True, capture_output=True,
                       timeout=120)
        compiled = ctypes.CDLL(str(built))  # stays mapped once the file is gone
        if library is not None:
            _keep(built, library, damaged)
    return compiled


def _ours(folder: Path) -> bool:
    """Whether `folder` (made where missing, for this user alone) may hold libraries this
    process loads: it is this user's, and no one else can write in it."""
    try:
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        held = folder.stat()
    except OSError:
        return False
    return held.st_uid == os.getuid() and not held.st_mode & 0o022


def _keep(built: Path, library: Path, damaged: bool):
    """`built` kept as `library`, whole or not at all: copied under a name of its own and
    linked into place, never over a library another process may have mapped (processes that
    build at once keep the first), but over a damaged one; a killed copy's leftovers swept.
    Nothing where the folder cannot take it (a full disk): the next process builds again."""
    for stale in library.parent.glob(f".{SOURCE.stem}-*"):
        with contextlib.suppress(OSError):
            if time.time() - stale.lstat().st_mtime > STALE:
                stale.unlink()
    try:
        descriptor, partial = tempfile.mkstemp(prefix=f".{library.name}.", dir=library.parent)
    except OSError:
        return
    try:
        with os.fdopen(descriptor, "wb") as copy, open(built, "rb") as original:
            shutil.copyfileobj(original, copy)
        try:
            os.link(partial, library)
        except FileExistsError:
            if damaged:
                os.replace(partial, library)
        except OSError:  # a file system without hard links
            os.replace(partial, library)
    except OSError:
        pass
    finally:
        with contextlib.suppress(OSError):
            os.unlink(partial)


def _build_key(command: list):
    """A digest of what a build's library depends on: the C source, the command (but where
    the source lies) and what the compiler says it builds for with the command's flags
    (`_compiler_says`: its version, and the CPU `-march=native` resolves to, so that a home
    folder shared by machines keeps one library a CPU); None where it does not say."""
    flags = [a for a in command if a != str(SOURCE)]
    said = _compiler_says(flags)
    if said is None:
        return None
    digest = hashlib.sha256(SOURCE.read_bytes())
    digest.update("\0".join(flags).encode() + b"\0" + said)
    return digest.hexdigest()[:20]


def _compiler_says(flags: list):
    """The compiler's account of what it would run for `flags` on C from stdin (gcc and
    clang's -###: its version, and `-march=native` resolved to the CPU's name and instruction
    sets), or None where it gives none."""
    try:  # (from / and in the C locale: clang names the working folder, gcc speaks the
        # locale's language)
        said = subprocess.run([*flags, "-###", "-E", "-x", "c", "-"], capture_output=True,
                              stdin=subprocess.DEVNULL, timeout=30, cwd="/",
                              env=dict(os.environ, LC_ALL="C"))
    except (OSError, subprocess.SubprocessError):
        return None
    return said.stdout + said.stderr if said.returncode == 0 else None


TORCH_CPU = Path(torch.__file__).parent / "lib" / "libtorch_cpu.so"  # its sgemm_: MKL's here
SOURCE = Path(__file__).with_suffix(".c")
STALE = 600  # seconds: a partial copy in the build cache older than this was a killed one's
_COMPILED, _COMPILING = None, threading.Lock()  # the library once tried (or False); its lock


class NativeLayers:
    """Every decoder layer's step in one call of nmt/decoder_step.c, and the encoder's layers in
    another (the modern design: pre-norm RMSNorm, rotary positions, grouped-query attention,
    SwiGLU, no biases): the operators' step issues some hundred operators a step, each with its
    own fixed cost, about 1.7 ms a step whatever the rows on one core of an AMD EPYC
    (dev/LOG.md). Its weights are model.py's, held as nn.Linear holds them."""

    def __init__(self, decoder: "FastDecoder", library):
        self.library, self.decoder = library, decoder
        blocks = decoder.model.decoder.layers
        self.eps = blocks[0].residual_connections[0].norm.eps
        self.hidden = blocks[0].feed_forward_block.linear_1.out_features
        d = decoder.d
        self.tensors = []  # the weights the pointers point into, kept alive

        def pointers(tensors):
            tensors = [t.detach().contiguous() for t in tensors]
            self.tensors += tensors
            return (ctypes.c_void_p * len(tensors))(*[t.data_ptr() for t in tensors])
        def stack(blocks):  # the weights both stacks have, as the C functions take them
            return (pointers([r.norm.alpha for b in blocks for r in b.residual_connections]),
                    pointers([b.self_attention_block.w_qkv.weight for b in blocks]),
                    pointers([b.self_attention_block.w_o.weight for b in blocks]),
                    pointers([torch.cat([b.feed_forward_block.linear_1.weight,
                                         b.feed_forward_block.linear_3.weight]) for b in blocks]),
                    pointers([b.feed_forward_block.linear_2.weight for b in blocks]))
        self.norms, self.w_qkv, self.w_o, self.w_13, self.w_2 = stack(blocks)
        self.w_q_cross = pointers([b.cross_attention_block.w_qkv.weight[:d] for b in blocks])
        self.w_o_cross = pointers([b.cross_attention_block.w_o.weight for b in blocks])
        encoder = decoder.model.encoder.layers
        self.encoder = stack(encoder)
        self.encoder_hidden = encoder[0].feed_forward_block.linear_1.out_features
        rotary = decoder.model.rotary
        self.cos, self.sin = rotary.cos.contiguous(), rotary.sin.contiguous()  # (seq_len, d_k/2)

    @staticmethod
    def applies(model: Transformer) -> bool:
        """Whether the model's encoder and decoder are the design the C functions compute, made
        of model.py's own classes (a subclass may compute otherwise; the C code reads only the
        weights) and nn.Linear layers without a bias."""
        if model.rotary is None or type(model.encoder.norm) is not RMSNormalization or \
                type(model.decoder.norm) is not RMSNormalization:
            return False
        eps = set()  # one for every residual connection's norm (the C step's)
        blocks = [(b, EncoderBlock) for b in model.encoder.layers] + \
            [(b, DecoderBlock) for b in model.decoder.layers]
        for block, kind in blocks:
            ff, connections = block.feed_forward_block, block.residual_connections
            attentions = [block.self_attention_block, getattr(block, "cross_attention_block",
                                                              block.self_attention_block)]
            if type(block) is not kind or type(ff) is not SwiGLUFeedForwardBlock or \
                    any(type(a) is not MultiHeadAttentionBlock for a in attentions):
                return False
            linears = [ff.linear_1, ff.linear_2, ff.linear_3,
                       *(m for a in attentions for m in (a.w_qkv, a.w_o))]
            if any(type(m) is not nn.Linear or m.bias is not None for m in linears):
                return False
            if any(type(c) is not ResidualConnection or not c.norm_first or
                   type(c.norm) is not RMSNormalization for c in connections):
                return False
            eps.update(c.norm.eps for c in connections)
            if block.self_attention_block.d_k % 2:
                return False
        return len(eps) == 1

    def encode(self, src, src_mask):
        """model.encode(src, src_mask) with the encoder's layers in one call: (batch, len, d)."""
        model, dec = self.decoder.model, self.decoder
        x = model.src_pos(model.src_embed(src)).contiguous()  # (batch, len, d), a new tensor
        batch, length, d = x.shape
        bias = x.new_zeros(batch, length).masked_fill_(~src_mask.reshape(batch, length),
                                                       float("-inf"))  # (batch, len)
        rows, hidden = batch * length, self.encoder_hidden
        width = max(d + 2 * dec.kv * dec.d_k, hidden)
        normed, heads = x.new_empty(rows, d), x.new_empty(rows, d)
        wide, ffn = x.new_empty(rows, width), x.new_empty(rows, 2 * hidden)
        scores = x.new_empty(length)
        i, p = ctypes.c_int, ctypes.c_void_p
        self.library.encoder_layers(
            p(x.data_ptr()), i(batch), i(length), i(d), i(dec.h), i(dec.kv), i(dec.d_k),
            i(hidden), i(len(model.encoder.layers)), *self.encoder, p(bias.data_ptr()),
            p(self.cos.data_ptr()), p(self.sin.data_ptr()), ctypes.c_float(self.eps),
            ctypes.c_float(dec.scale), p(normed.data_ptr()), p(wide.data_ptr()),
            p(heads.data_ptr()), p(ffn.data_ptr()), p(scores.data_ptr()))
        return model.encoder.norm(x)

    def __call__(self, x, position: int, cache, cross, bias, per: int, where):
        """x (rows, d) through every layer at `position`, in place: cache (layers, 2, capacity,
        slots · kv_heads, d_k) gets each row's keys and values of this position in its own row,
        where (rows, capacity) int32 their row (see FastState)."""
        dec, rows = self.decoder, x.size(0)
        if not (x.is_contiguous() and cache.is_contiguous() and where.is_contiguous()):
            raise RuntimeError("the C step writes into contiguous tensors only")
        cross, bias = cross.contiguous(), bias.contiguous()  # views of one sentence's
        kv, capacity = dec.kv, cache.size(2)  # the layouts the C code indexes, in bounds
        layers = (len(dec.layers), 2)
        if rows % per or x.shape != (rows, dec.d) or cache.dim() != 5 or cross.dim() != 5 or \
                cache.shape[:2] != layers or cache.size(3) % kv or \
                cache.size(3) < rows * kv or cache.size(4) != dec.d_k or \
                cross.shape[:2] != layers or cross.size(2) != rows // per * kv or \
                cross.size(4) != dec.d_k or bias.shape != (cross.size(2), cross.size(3)) or \
                not 0 <= position < capacity or \
                where.shape != (rows, capacity) or where.dtype != torch.int32 or \
                any(t.dtype != torch.float32 for t in (x, cache, cross, bias)):
            raise RuntimeError("the C step's tensors do not match its rows")
        width = max(dec.d + 2 * dec.kv * dec.d_k, self.hidden)
        normed, heads = x.new_empty(rows, dec.d), x.new_empty(rows, dec.d)
        wide, ffn = x.new_empty(rows, width), x.new_empty(rows, 2 * self.hidden)
        scores = x.new_empty(max(position + 1, cross.size(3)))
        at = torch.empty(rows, position + 1, dtype=torch.long)
        i, p = ctypes.c_int, ctypes.c_void_p
        failed = self.library.layers(  # -1 where `where` names a row outside the cache's
            p(x.data_ptr()), i(rows), i(dec.d), i(dec.h), i(dec.kv), i(dec.d_k), i(self.hidden),
            i(len(dec.layers)), i(position), self.norms, self.w_qkv, self.w_o, self.w_q_cross,
            self.w_o_cross, self.w_13, self.w_2, p(cache.data_ptr()), i(capacity),
            i(cache.size(3) // kv), p(where.data_ptr()), p(cross.data_ptr()), i(cross.size(3)),
            i(per), p(bias.data_ptr()), p(self.cos[position].data_ptr()),
            p(self.sin[position].data_ptr()), ctypes.c_float(self.eps),
            ctypes.c_float(dec.scale), p(normed.data_ptr()), p(wide.data_ptr()),
            p(heads.data_ptr()), p(ffn.data_ptr()), p(scores.data_ptr()), p(at.data_ptr()))
        if failed:
            raise RuntimeError("the C step's tensors do not match its rows")
        return x


def _norm(module):
    """A function of x (rows, d) computing `module` in one call: LayerNormalization or
    RMSNormalization; None for nn.Identity (a post-norm stack's end). Any other module: a
    RuntimeError (fast_decoder then leaves the model to model.py's decoder)."""
    if type(module) is RMSNormalization:
        return lambda x: F.rms_norm(x, module.alpha.shape, module.alpha.detach(), module.eps)
    if type(module) is LayerNormalization:
        return lambda x: F.layer_norm(x, module.alpha.shape, module.alpha.detach(),
                                      module.bias.detach(), module.eps)
    if type(module) is nn.Identity:
        return None
    raise RuntimeError(f"no fast step for {type(module).__name__}")


class FastLayer:
    """One decoder layer's weights, laid out for the step (each product's weight transposed
    as torch.mm takes it)."""

    def __init__(self, block):
        sa, ca, ff = (block.self_attention_block, block.cross_attention_block,
                      block.feed_forward_block)
        d = sa.d_model
        self.norms = [_norm(r.norm) for r in block.residual_connections]
        if None in self.norms:
            raise RuntimeError("a residual connection without a norm")
        self.w_qkv = sa.w_qkv.weight.detach().t()  # (d, d + 2 d_kv)
        self.w_o = sa.w_o.weight.detach().t()  # (d, d)
        self.w_q_cross = ca.w_qkv.weight.detach()[:d].t()  # (d, d)
        self.w_kv_cross = ca.w_qkv.weight.detach()[d:]  # (2 d_kv, d), stacked over layers
        self.w_o_cross = ca.w_o.weight.detach().t()
        self.swiglu = isinstance(ff, SwiGLUFeedForwardBlock)
        if self.swiglu:  # gate and value in one product: (d, 2 hidden)
            self.w_1 = torch.cat([ff.linear_1.weight, ff.linear_3.weight]).detach().t()
            self.b_1 = self.b_2 = None
        else:
            self.w_1, self.b_1 = ff.linear_1.weight.detach().t(), ff.linear_1.bias.detach()
            self.b_2 = ff.linear_2.bias.detach()
        self.w_2 = ff.linear_2.weight.detach().t()  # (hidden, d)


class FastDecoder(nn.Module):
    """A trained Transformer's decoder and projection laid out for one-token steps on CPU
    (see the module's docstring); `model` stays whole inside (its encoder encodes)."""

    @torch.no_grad()
    def __init__(self, model: Transformer, rows: int):
        super().__init__()
        self.model = model
        blocks = model.decoder.layers
        attention = blocks[0].self_attention_block
        self.d, self.h, self.kv, self.d_k = (attention.d_model, attention.h,
                                             attention.n_kv_heads, attention.d_k)
        self.scale = 1 / math.sqrt(self.d_k)
        self.norm_first = blocks[0].residual_connections[0].norm_first
        self.layers = [FastLayer(block) for block in blocks]
        self.w_kv_cross = torch.cat([layer.w_kv_cross for layer in self.layers]).t()
        self.final_norm = _norm(model.decoder.norm)
        embed = model.tgt_embed
        self.embedding = (embed.embedding.weight * math.sqrt(embed.d_model)).detach()
        self.positions = model.tgt_pos.pe[0] if isinstance(model.tgt_pos, PositionalEncoding) \
            else None  # (seq_len, d): sinusoids added to the embeddings, or rotary (None)
        self.rotations = None
        if model.rotary is not None:  # the rotation of each position, (seq_len, d_k, d_k)
            cos, sin = model.rotary.cos, model.rotary.sin  # (seq_len, d_k / 2) each
            half = self.d_k // 2
            rot = torch.zeros(cos.size(0), self.d_k, self.d_k)
            idx = torch.arange(half)
            rot[:, idx, idx] = cos  # x1' = x1 cos - x2 sin, x2' = x1 sin + x2 cos
            rot[:, idx + half, idx] = -sin
            rot[:, idx, idx + half] = sin
            rot[:, idx + half, idx + half] = cos
            self.rotations = rot
        self.projection = PackedLinear(model.projection_layer.proj, rows)
        library = _compiled_layers() if NativeLayers.applies(model) else None
        self.native = library and NativeLayers(self, library)  # the layers in one C call

    def cross_keys_values(self, memory):
        """Every layer's cross-attention keys and values of the encoder output memory
        (batch, src_len, d), in one product: (layers, 2, batch · kv_heads, src_len, d_k)."""
        batch, src_len, _ = memory.shape
        kv = torch.mm(memory.reshape(-1, self.d), self.w_kv_cross)  # (batch·src_len, L·2·d_kv)
        kv = kv.view(batch, src_len, len(self.layers), 2, self.kv, self.d_k)  # split
        # -> (layers, 2, batch, kv_heads, src_len, d_k) -> (layers, 2, batch·kv_heads, src_len, d_k)
        return kv.permute(2, 3, 0, 4, 1, 5).reshape(len(self.layers), 2, -1, src_len, self.d_k)

    def step(self, tokens, position: int, cache, cross, bias, per: int = 1, where=None):
        """The logits (rows, vocab) of the next token after `tokens` (rows,), the last token of
        each row, at `position` (0 for [SOS]). cache: (layers, 2, rows · kv_heads, capacity, d_k)
        keys and values of the earlier positions, this one's written in (the C step's: as
        NativeLayers takes it, with `where`); cross: as cross_keys_values, of the rows'
        sentences; bias: (sentences · kv_heads, 1, src_len), 0 or -inf at padding; per: the rows
        of each sentence, one after the other (a sentence's beams: their queries attend its keys
        and values in one product)."""
        x = F.embedding(tokens, self.embedding)  # (rows, d)
        if self.native is not None:  # every layer in one call of the C step
            x = self.native(x, position, cache, cross, bias.view(-1, bias.size(-1)), per, where)
            return self.projection(self.final_norm(x))  # (rows, vocab)
        rows, d, h, kv, d_k = tokens.size(0), self.d, self.h, self.kv, self.d_k
        group, sentences = h // kv, tokens.size(0) // per
        if self.positions is not None:
            x = x + self.positions[position]
        rotation = None if self.rotations is None else self.rotations[position]  # (d_k, d_k)
        length = position + 1
        for i, layer in enumerate(self.layers):
            # masked self-attention over the cached positions and this one
            h_ = layer.norms[0](x) if self.norm_first else x
            qkv = torch.mm(h_, layer.w_qkv)  # (rows, d + 2 d_kv)
            d_qk = d + kv * d_k
            if rotation is not None:  # (rows, h + kv, d_k) @ (d_k, d_k)
                qk = torch.matmul(qkv[:, :d_qk].view(rows, h + kv, d_k), rotation)
            else:
                qk = qkv[:, :d_qk].view(rows, h + kv, d_k)  # (rows, h + kv, d_k)
            q, k = qk[:, :h], qk[:, h:]  # (rows, h, d_k), (rows, kv, d_k)
            v = qkv[:, d_qk:].view(rows, kv, d_k)  # (rows, kv, d_k)
            keys, values = cache[i, 0], cache[i, 1]  # (rows·kv, capacity, d_k) each
            keys[:, position].view(rows, kv, d_k).copy_(k)
            values[:, position].view(rows, kv, d_k).copy_(v)
            q = q.reshape(rows * kv, group, d_k)  # the query heads of each key/value head
            scores = torch.baddbmm(x.new_empty(()), q, keys[:, :length].transpose(1, 2),
                                   beta=0, alpha=self.scale)  # (rows·kv, group, length)
            out = torch.bmm(scores.softmax(dim=-1), values[:, :length])  # (rows·kv, group, d_k)
            x = self._residual(x, out.view(rows, d), layer.w_o, None, layer.norms[0])
            # cross-attention over the encoder output
            h_ = layer.norms[1](x) if self.norm_first else x
            q = torch.mm(h_, layer.w_q_cross).view(sentences, per, kv, group, d_k)
            # a sentence's queries of each key/value head together: (sentences·kv, per·group, d_k)
            q = q.transpose(1, 2).reshape(sentences * kv, per * group, d_k)
            scores = torch.baddbmm(bias, q, cross[i, 0].transpose(1, 2),
                                   alpha=self.scale)  # (sentences·kv, per·group, src_len)
            out = torch.bmm(scores.softmax(dim=-1), cross[i, 1])  # (sentences·kv, per·group, d_k)
            out = out.view(sentences, kv, per, group, d_k).transpose(1, 2)  # rows back in order
            x = self._residual(x, out.reshape(rows, d), layer.w_o_cross, None, layer.norms[1])
            # feed-forward
            h_ = layer.norms[2](x) if self.norm_first else x
            if layer.swiglu:  # (rows, 2 hidden) -> (rows, hidden) each
                gate, value = torch.mm(h_, layer.w_1).chunk(2, dim=-1)
                hidden = F.silu(gate).mul_(value)  # (rows, hidden)
            else:
                hidden = torch.addmm(layer.b_1, h_, layer.w_1).relu_()  # (rows, d_ff)
            x = self._residual(x, hidden, layer.w_2, layer.b_2, layer.norms[2])
        if self.final_norm is not None:
            x = self.final_norm(x)
        return self.projection(x)  # (rows, vocab)

    def _residual(self, x, hidden, weight, bias, norm):
        """x + hidden · weight (+ bias): pre-norm; post-norm normalizes the sum."""
        out = torch.addmm(x, hidden, weight)  # (rows, d)
        if bias is not None:
            out = out.add_(bias)
        return out if self.norm_first else norm(out)


def fast_decoder(model, rows: int):
    """The FastDecoder of `model` where it applies, else None (the searches then run model.py's
    decoder): a model.py Transformer itself (not a subclass, not wrapped or compiled), every
    module in eval mode, every parameter and buffer float32 on CPU, its decoder's and
    projection's layers nn.Linear (the attention's without a bias, as model.py makes them), its
    norms model.py's, torch's oneDNN operators there."""
    if type(model) is not Transformer or any(m.training for m in model.modules()) or \
            not torch.backends.mkldnn.is_available():
        return None
    if any(t.dtype != torch.float32 or t.device.type != "cpu"
           for t in [*model.parameters(), *model.buffers()]):
        return None
    attention = [m for b in model.decoder.layers  # W_QKV and W_O of both attentions
                 for a in (b.self_attention_block, b.cross_attention_block)
                 for m in (a.w_qkv, a.w_o)]
    linears = [model.projection_layer.proj, *attention]
    for block in model.decoder.layers:
        ff = block.feed_forward_block
        linears += [ff.linear_1, ff.linear_2, getattr(ff, "linear_3", ff.linear_1)]
    if any(type(m) is not nn.Linear for m in linears) or \
            any(m.bias is not None for m in attention):
        return None
    try:
        return FastDecoder(model, rows)
    except (RuntimeError, AttributeError):  # a norm it has no step for; no packing operators
        return None


class FastState:
    """A FastDecoder's part of a search over a batch, as nmt.decoding.ModelState: the encoder
    output's cross-attention keys and values and the source mask as a bias, once per sentence
    while each sentence's rows (its beams) are together in order (`per` of them), else once per
    row; and the self-attention cache (made at the first step, room for `capacity` positions):
    for the operators' step row for row with the search's hypotheses, for the C step written
    once at each position with `where` saying which of its rows holds each hypothesis's."""
    normalized = False  # scores() gives logits

    @torch.no_grad()
    def __init__(self, decoder: FastDecoder, src, src_mask, capacity: int):
        self.decoder, self.capacity = decoder, max(capacity, 1)
        encode = decoder.native.encode if decoder.native else decoder.model.encode
        memory = encode(src, src_mask)  # (batch, src_len, d_model)
        self.cross = decoder.cross_keys_values(memory)  # (L, 2, batch·kv, src_len, d_k)
        src_len = src_mask.size(-1)
        bias = torch.zeros(src_mask.size(0), 1, 1, src_len, dtype=memory.dtype)
        bias = bias.masked_fill_(~src_mask, float("-inf"))  # (batch, 1, 1, src_len)
        # one row per key/value head, as the cross-attention's: (batch·kv, 1, src_len)
        self.bias = bias.expand(-1, decoder.kv, -1, -1).reshape(-1, 1, src_len)
        self.per = 1  # rows of each sentence of self.cross, one after the other
        self.cache, self.length = None, 0  # the keys and values (see scores()), positions in it
        self.spare = None  # the operators' step's second cache, written by follow(), swapped in
        self.where = None  # the C step's (rows, capacity): the row of each row's position

    @torch.no_grad()
    def scores(self, ys, banned):
        """The next token's logits after each row's prefix ys (rows, step), `banned` tokens at
        -inf: (rows, vocab)."""
        c, rows, kv = self.cross, ys.size(0), self.decoder.kv  # (L, 2, sentences·kv, src_len, d_k)
        if self.decoder.native is None:  # the operators' step: (L, 2, rows·kv, capacity, d_k)
            if self.cache is None:
                self.cache = c.new_empty(c.size(0), 2, rows * kv, self.capacity, c.size(4))
            elif self.length == self.cache.size(3):  # past the capacity (never, by the searches)
                self.cache = torch.cat([self.cache, torch.zeros_like(self.cache)], dim=3)
                self.spare = None
        else:  # the C step's: (L, 2, capacity, slots·kv, d_k) and where (rows, capacity)
            if self.cache is None:
                self.cache = c.new_empty(c.size(0), 2, self.capacity, rows * kv, c.size(4))
                self.where = torch.empty(rows, self.capacity, dtype=torch.int32)
            elif self.length == self.cache.size(2):  # twice the positions
                self.cache = torch.cat([self.cache, torch.zeros_like(self.cache)], dim=2)
                self.where = torch.cat([self.where, torch.zeros_like(self.where)], dim=1)
            if self.cache.size(3) < rows * kv:  # more rows than slots (a repeat after a step)
                more = self.cache.new_zeros(*self.cache.shape[:3], rows * kv - self.cache.size(3),
                                            c.size(4))  # (L, 2, capacity, new slots·kv, d_k)
                self.cache = torch.cat([self.cache, more], dim=3)  # (L, 2, capacity, rows·kv, d_k)
        logits = self.decoder.step(ys[:, -1], self.length, self.cache, self.cross, self.bias,
                                   self.per, self.where)
        self.length += 1
        return logits.index_fill_(1, banned, float("-inf"))

    def _rows(self, rows):
        """Row indices (rows,) as indices of the rows · kv_heads of the tensors."""
        kv = self.decoder.kv
        return (rows.unsqueeze(1) * kv + torch.arange(kv)).flatten()  # (rows·kv,)

    @torch.no_grad()
    def repeat(self, k: int):
        """Each row k times in a row (beam search's beams, sampling's samples): the sentences'
        keys and values stay, shared by k times as many rows."""
        self.per *= k
        if self.cache is not None:  # the rows decoded so far
            rows = self.cache.size(2) // self.decoder.kv if self.where is None else \
                self.where.size(0)
            self.follow(torch.arange(rows).repeat_interleave(k))

    @torch.no_grad()
    def keep(self, rows):
        """Only these rows, in this order (finished sentences leave the batch). Rows that come
        in groups of `per` of one sentence each (beam search's) keep sharing their sentences'
        keys and values; any other choice (sampling's finished samples) gives each row its own
        copy from then on."""
        per, sentences = self.per, rows // self.per  # (rows,) the sentence of each row
        groups = sentences.view(-1, per) if per > 1 and rows.numel() % per == 0 else None
        if groups is not None and bool((groups == groups[:, :1]).all()):
            sentences = groups[:, 0]  # (sentences kept,)
        else:
            self.per = 1
        index = self._rows(sentences)  # (sentences kept · kv,) or (rows · kv,)
        self.cross = self.cross.index_select(2, index)  # (L, 2, ·, src_len, d_k)
        self.bias = self.bias.index_select(0, index)  # (·, 1, src_len)
        self.spare = None
        self.follow(rows)

    @torch.no_grad()
    def follow(self, rows):
        """Row i continues the prefix of row rows[i] of its own sentence (beam search; the
        cross-attention's keys and values stay). The C step's cache stays as it is: row i takes
        row rows[i]'s row of `where`. The operators' step's: only the positions decoded so far
        move, into the spare cache, which then becomes the cache."""
        if self.cache is None:
            return
        if self.where is not None:
            self.where = self.where.index_select(0, rows)  # (rows, capacity)
            return
        index, cache = self._rows(rows), self.cache
        shape = (cache.size(0), 2, index.numel(), *cache.shape[3:])
        moved = self.spare if self.spare is not None and self.spare.shape == shape else \
            cache.new_empty(shape)  # (L, 2, rows·kv, capacity, d_k)
        torch.index_select(cache[:, :, :, :self.length], 2, index,
                           out=moved[:, :, :, :self.length])
        self.cache, self.spare = moved, cache


# ---- the searches' choices over the vocabulary --------------------------------------------------

def _blocks(x, block: int):
    """The columns of x (rows, n) as whole blocks (rows, n // block, block), and where the
    columns left over (fewer than a block) begin."""
    whole = x.size(-1) // block * block
    return x[:, :whole].reshape(x.size(0), -1, block), whole


def _candidates(x, blocks, block: int, whole: int):
    """The columns (rows, b · block + the left-over ones) of the chosen blocks (rows, b), then
    those left over, in order."""
    offsets = torch.arange(block, device=x.device)
    columns = (blocks.unsqueeze(-1) * block + offsets).flatten(1)  # (rows, b · block)
    if whole < x.size(-1):  # the columns past the last whole block are always candidates
        rest = torch.arange(whole, x.size(-1), device=x.device).expand(x.size(0), -1)
        columns = torch.cat([columns, rest], dim=1)  # (rows, b · block + n - whole)
    return columns


def row_argmax(x, block: int = 128):
    """x.argmax(dim=-1) of x (rows, n), the first of equal maxima as torch's: the first whole
    block of `block` columns holding its largest maximum (the blocks' maxima: one vectorized
    pass) and the columns past the last whole block are the only candidates. On CPU about ten
    times faster than torch's argmax at a vocabulary's width."""
    if x.device.type != "cpu" or x.size(-1) < 4 * block:
        return x.argmax(dim=-1)
    blocks, whole = _blocks(x, block)  # (rows, n // block, block)
    first = blocks.amax(dim=-1).argmax(dim=-1, keepdim=True)  # (rows, 1)
    columns = _candidates(x, first, block, whole)  # (rows, block + n - whole), in order
    best = x.gather(1, columns).argmax(dim=-1, keepdim=True)  # (rows, 1)
    return columns.gather(1, best).squeeze(1)  # (rows,)


def row_topk(x, k: int, block: int = 64):
    """x.topk(k, dim=-1) of x (rows, n): the k largest values of each row, largest first, and
    their columns. Those of the whole blocks of `block` columns lie in the k blocks with the
    largest maxima, so torch's topk runs on those k · block columns and the ones past the last
    whole block only. The same values as torch's; among equal values the columns may differ
    (torch's choice among ties is unspecified too)."""
    if x.device.type != "cpu" or x.size(-1) < 8 * k * block:
        return x.topk(k, dim=-1)
    blocks, whole = _blocks(x, block)  # (rows, n // block, block)
    chosen = blocks.amax(dim=-1).topk(k, dim=-1).indices  # (rows, k)
    columns = _candidates(x, chosen, block, whole)  # (rows, k · block + n - whole)
    values, best = x.gather(1, columns).topk(k, dim=-1)  # (rows, k) each
    return values, columns.gather(1, best)


def top_logits(x, k: int, skip: int = -1):
    """Beam search's candidates from one call of nmt/decoder_step.c, which visits each row of
    the logits x (rows, n) once (three sweeps while it is in the cache): each row's log-sum-exp
    (rows,), and its k largest values (rows, k), largest first (the first of equal values
    first), and their columns (rows, k), the column `skip` taken as -inf (-1: none). The
    log-softmax alone sweeps the rows twice and writes a copy that the top-k reads again. None
    where the library is not compiled (see _compiled_layers), x is not a contiguous float32
    matrix on CPU, or k is not within 1 to n."""
    library = _compiled_layers()
    if library is None or x.dtype != torch.float32 or x.device.type != "cpu" or \
            x.dim() != 2 or not x.is_contiguous() or not 0 < k <= x.size(1):
        return None
    rows, n = x.shape
    lse, values = x.new_empty(rows), x.new_empty(rows, k)
    columns, blocks = torch.empty(rows, k, dtype=torch.long), x.new_empty(n // 16 + 1)
    p, i = ctypes.c_void_p, ctypes.c_int
    library.top_logits(p(x.data_ptr()), i(rows), i(n), i(k), i(skip), p(lse.data_ptr()),
                       p(values.data_ptr()), p(columns.data_ptr()), p(blocks.data_ptr()))
    return lse, values, columns
