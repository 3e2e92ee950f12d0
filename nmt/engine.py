"""CTranslate2, the fastest inference engine for this model family: a trained model mapped one
to one into its Transformer specification (export.py writes it), and `Engine`, which decodes an
exported model as nmt.decoding.translate_ids does (translate.py --ctranslate2).

The specification is built from CTranslate2's constructors: pre- or post-norm, LayerNorm or
RMSNorm, ReLU or SwiGLU, sinusoidal positions (this repo's own table, written into the model) or
rotary ones (halves rotated, as here), any number of key/value heads, tied or separate
embeddings. Beside the engine's files the folder holds the tokenizers and `export.json`: the
training config (seq_len, the decoding limits) and where the weights came from.
"""

import json
import shutil
import sys
from pathlib import Path

import torch

from config import LENGTH_PENALTY, TRANSLATE_FIELDS, Config, UserError, decode_batch_size
from nmt.checkpoint import merge_config
from nmt.decoding import output_limits
from nmt.trained_model import with_tokenizers
from tokenizer import SPECIAL_TOKENS, recipe_path, tokenizer_keys, tokenizer_path

QUANTIZATIONS = ["float32", "int8", "int8_float32", "float16", "bfloat16", "int8_float16",
                 "int8_bfloat16"]
EXPORT_NOTE = "export.json"
# the engine's beam search stops as nmt.decoding.beam_search's early_stop=True (translate.py refuses
# --early_stop false with --ctranslate2 as it parses its flags; translate_ids, at a call)
EARLY_STOP_ONLY = ("--early_stop false: CTranslate2 searches by its own rule (a sentence ends "
                   "once its best hypothesis ends)")


class ExportError(UserError):
    """ctranslate2 missing, an output folder in the way, a model the engine cannot hold."""


def import_ctranslate2():
    try:
        import ctranslate2
    except ImportError:
        raise ExportError("CTranslate2 is not installed: pip install 'ctranslate2>=4.7' (it is "
                          "optional, for serving exported models)") from None
    version = tuple(int(x) for x in ctranslate2.__version__.split(".")[:2] if x.isdigit())
    if version < (4, 7):  # the first with key/value heads in the encoder's specification
        raise ExportError(f"CTranslate2 {ctranslate2.__version__} is too old: pip install "
                          f"'ctranslate2>=4.7'")
    return ctranslate2


def numpy(t):
    """A copy: CTranslate2 optimizes (quantizes) the arrays it is given in place."""
    return t.detach().float().cpu().numpy().copy()


def _linear(spec, linear=None, weight=None):
    """A linear layer's weight (and bias, if it has one) into a CTranslate2 LinearSpec."""
    spec.weight = numpy(linear.weight if weight is None else weight)
    if linear is not None and linear.bias is not None:
        spec.bias = numpy(linear.bias)


def _norm(spec, norm):
    spec.gamma = numpy(norm.alpha)
    if getattr(norm, "bias", None) is not None:  # LayerNorm; RMSNorm has no bias
        spec.beta = numpy(norm.bias)


def _ffn(spec, block, residual):
    """FFN: ReLU (linear_1, linear_2) or SwiGLU (gate linear_1, value linear_3, linear_2)."""
    _norm(spec.layer_norm, residual.norm)
    _linear(spec.linear_0, block.linear_1)
    if hasattr(block, "linear_3"):
        _linear(spec.linear_0_noact, block.linear_3)
    _linear(spec.linear_1, block.linear_2)


def _self_attention(spec, block, residual):
    _norm(spec.layer_norm, residual.norm)
    _linear(spec.linear[0], weight=block.w_qkv.weight)  # W_Q, W_K, W_V stacked, as here
    _linear(spec.linear[1], block.w_o)


def _cross_attention(spec, block, residual):
    _norm(spec.layer_norm, residual.norm)
    d = block.d_model
    _linear(spec.linear[0], weight=block.w_qkv.weight[:d])  # queries
    _linear(spec.linear[1], weight=block.w_qkv.weight[d:])  # keys and values of the memory
    _linear(spec.linear[2], block.w_o)


def build_spec(model, config, tokenizer_src, tokenizer_tgt):
    """The CTranslate2 TransformerSpec of `model` (a Transformer of model.py built from
    `config`), with its vocabularies and special tokens."""
    ctranslate2 = import_ctranslate2()
    from ctranslate2.specs import common_spec, transformer_spec
    rope = config.pos == "rope"
    options = dict(
        pre_norm=config.norm_first, rms_norm=config.norm == "rms",
        ffn_glu=config.ffn == "swiglu",
        activation=common_spec.Activation.SWISH if config.ffn == "swiglu" else
        common_spec.Activation.RELU,
        num_heads_kv=config.n_kv_heads if config.n_kv_heads not in (0, config.h) else None)
    if rope:  # every feature of each head, the two halves rotated together (not interleaved)
        options.update(rotary_dim=0, rotary_interleave=False, rotary_base=10000)
    encoder = transformer_spec.TransformerEncoderSpec(config.N, config.h, **options)
    decoder = transformer_spec.TransformerDecoderSpec(config.decoder_layers(), config.h,
                                                      **options)
    encoder.embeddings[0].weight = numpy(model.src_embed.embedding.weight)
    decoder.embeddings.weight = numpy(model.tgt_embed.embedding.weight)
    encoder.scale_embeddings = decoder.scale_embeddings = True  # · sqrt(d_model), section 3.4
    if rope:  # no position added to the embeddings
        for stack in (encoder, decoder):
            if hasattr(stack, "position_encodings"):
                del stack.position_encodings
    else:  # this repo's own sinusoid table (the engine's own is laid out otherwise)
        encoder.position_encodings.encodings = numpy(model.src_pos.pe[0])
        decoder.position_encodings.encodings = numpy(model.tgt_pos.pe[0])
    for layer, block in zip(encoder.layer, model.encoder.layers):
        _self_attention(layer.self_attention, block.self_attention_block,
                        block.residual_connections[0])
        _ffn(layer.ffn, block.feed_forward_block, block.residual_connections[1])
    for layer, block in zip(decoder.layer, model.decoder.layers):
        _self_attention(layer.self_attention, block.self_attention_block,
                        block.residual_connections[0])
        _cross_attention(layer.attention, block.cross_attention_block,
                         block.residual_connections[1])
        _ffn(layer.ffn, block.feed_forward_block, block.residual_connections[2])
    if config.norm_first:  # a pre-norm stack ends with a norm
        _norm(encoder.layer_norm, model.encoder.norm)
        _norm(decoder.layer_norm, model.decoder.norm)
    _linear(decoder.projection, model.projection_layer.proj)
    spec = transformer_spec.TransformerSpec(encoder, decoder)
    unk, _, sos, eos = SPECIAL_TOKENS
    spec.config.unk_token, spec.config.bos_token, spec.config.eos_token = unk, sos, eos
    spec.config.decoder_start_token = sos
    spec.config.add_source_bos = spec.config.add_source_eos = True  # [SOS] source [EOS]
    spec.config.layer_norm_epsilon = 1e-6  # as model.py's norms
    for register, tok in ((spec.register_source_vocabulary, tokenizer_src),
                          (spec.register_target_vocabulary, tokenizer_tgt)):
        register([tok.id_to_token(i) for i in range(tok.get_vocab_size())])
    del ctranslate2
    return spec


def check_output(output) -> Path:
    """Refuses an --output that holds anything: an export never overwrites."""
    output = Path(output)
    if output.exists() and (not output.is_dir() or any(output.iterdir())):
        raise ExportError(f"--output {output} already exists and is not an empty folder; "
                          f"choose another (an export never overwrites)")
    return output


def export(model, config, tokenizer_src, tokenizer_tgt, output, quantization="float32",
           source=None, corpus=None):
    """Writes the CTranslate2 model of `model` into the new folder `output`, with the
    tokenizer files and export.json beside it. `source`: where the weights came from;
    `corpus`: the corpus record of their checkpoint (translate.py --example checks by it)."""
    output = check_output(output)
    spec = build_spec(model, config, tokenizer_src, tokenizer_tgt)
    spec.validate()
    spec.optimize(quantization=quantization)
    try:
        output.mkdir(parents=True, exist_ok=True)
        spec.save(str(output))
        for key in dict.fromkeys(tokenizer_keys(config)):  # each with its recipe file
            path = tokenizer_path(config, key)
            for f in (path, recipe_path(path)):
                if f.exists():
                    shutil.copy(f, output / f.name.replace(path.stem, f"tokenizer_{key}"))
    except OSError as e:
        raise ExportError(f"cannot write {output}: {e.strerror}") from None
    note = {"config": {**config.to_dict(), "model_folder": str(output.resolve()),
                       "tokenizer_file": "tokenizer_{0}.json"},
            "source": source, "corpus": corpus, "quantization": quantization,
            "decoding": {"max_len_a": config.max_len_a, "max_len_b": config.max_len_b,
                         "min_len": config.min_len, "seq_len": config.seq_len,
                         "length_penalty": "CTranslate2 divides a beam hypothesis' log "
                                           "probability by length^alpha; translate.py's own "
                                           "beam search by ((5 + length) / 6)^alpha (GNMT)"}}
    (output / EXPORT_NOTE).write_text(json.dumps(note, indent=1), encoding="utf-8")
    return output


# ---- decoding on the engine ---------------------------------------------------------------------

class Engine:
    """A model exported by export.py, on CTranslate2: `translate_ids` decodes as decoding.py's
    translate_ids does (the same length rules, the same tokens never generated). `threads`:
    each batch's (intra-op) threads; `at_once`: batches decoded at the same time, each by a
    replica of the model (the engine's inter_threads)."""

    def __init__(self, folder: Path, tokenizer_src, tokenizer_tgt, device: str = "auto",
                 threads: int = 0, at_once: int = 1):
        ctranslate2 = import_ctranslate2()
        kind, _, index = device.partition(":")
        self.at_once = at_once
        if kind not in ("auto", "cpu", "cuda"):
            raise ExportError(f"--device {device}: CTranslate2 runs on cpu or cuda")
        try:
            self.translator = ctranslate2.Translator(
                str(folder), device=kind, device_index=int(index or 0),
                intra_threads=threads, inter_threads=at_once)
        except (RuntimeError, ValueError) as e:
            raise ExportError(f"--ctranslate2 {folder}: cannot load it "
                             f"({str(e).splitlines()[0]})") from None
        self.tokens = [tokenizer_src.id_to_token(i) for i in range(tokenizer_src.get_vocab_size())]
        self.ids = tokenizer_tgt.get_vocab()  # token -> id

    def translate_ids(self, src_ids, sos_id, eos_id, pad_id, seq_len, beam=1, alpha=LENGTH_PENALTY,
                      batch_size=None, nbest=1, max_len_a=1.2, max_len_b=10, min_len=1,
                      unk_id=None, progress=None, early_stop=True):
        """As nmt.decoding.translate_ids. The engine takes one maximum length a call. Greedy: one
        call per batch of similar lengths (as nmt.decoding.translate_ids makes them) under the
        batch's longest limit, each output then cut to its own limit (greedy outputs are
        prefixes of longer ones: the same tokens; one call for all sentences would decode every
        one that never ends to the longest limit of all). Beam search is not prefix-consistent:
        sentences go in groups of equal limits. The engine's beam search stops as
        early_stop=True does; early_stop=False is refused for a search (greedy decoding has no
        stop to choose)."""
        if not early_stop and max(beam, nbest) > 1:
            raise UserError(EARLY_STOP_ONLY)
        beam = max(beam, nbest)  # (nbest alone: a beam of that width)
        batch_size = batch_size or decode_batch_size(beam, nbest)
        sources = [[self.tokens[i] for i in ids[:seq_len - 2]] for ids in src_ids]
        limits = output_limits(torch.tensor([len(s) for s in sources]), max_len_a, max_len_b,
                               seq_len, min_len).tolist()
        banned = [[SPECIAL_TOKENS[i]] for i in (pad_id, sos_id)]
        results = [None] * len(sources)
        greedy = beam == 1 and nbest == 1
        if greedy:
            # by source length, longest first (the engine's replicas end together)
            order = sorted(range(len(limits)), key=lambda n: limits[n], reverse=True)
            groups = [order[i:i + batch_size] for i in range(0, len(order), batch_size)]
            groups = [(max(limits[n] for n in group), group) for group in groups]
        else:
            groups = [(limit, [n for n, x in enumerate(limits) if x == limit])
                      for limit in sorted(set(limits))]
        def call(limit, group):  # queued: the engine's at_once workers take the calls in turn
            return self.translator.translate_batch(
                [sources[n] for n in group], beam_size=beam, length_penalty=alpha,
                num_hypotheses=nbest, max_batch_size=batch_size, max_input_length=0,
                max_decoding_length=limit, min_decoding_length=min_len,
                disable_unk=unk_id is not None, suppress_sequences=banned,
                return_scores=nbest > 1, asynchronous=True)
        queued = [call(*g) for g in groups[:self.at_once]]  # at most at_once calls ahead
        for k, (_, group) in enumerate(groups):
            out = [result.result() for result in queued[k]]
            if k + self.at_once < len(groups):
                queued.append(call(*groups[k + self.at_once]))
            for n, r in zip(group, out):
                hyps = [[self.ids[t] for t in h[:limits[n]]] for h in r.hypotheses]
                results[n] = list(zip(hyps, r.scores)) if nbest > 1 else hyps[0]
            if progress is not None:
                progress(len(group))
        return results


def load_engine(folder, config: Config, given=frozenset(), threads: int = 0):
    """(engine, config, tokenizer_src, tokenizer_tgt) of a folder written by export.py: the
    training config from its export.json, with the translate-time flags given on top."""
    folder = Path(folder)
    try:
        note = json.loads((folder / EXPORT_NOTE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        if folder.is_dir() and any(folder.glob("*.pt")):  # a model folder of train.py's
            raise ExportError(f"--ctranslate2 {folder} holds PyTorch checkpoints, not an "
                              f"exported model: give it as --model_folder, or export it with "
                              f"export.py --model_folder {folder} --output NEW") from None
        raise ExportError(f"--ctranslate2 {folder}: no {EXPORT_NOTE} there; export a "
                          f"checkpoint with export.py --output {folder}") from None
    config = merge_config(Config.from_dict(note["config"]), config, given,
                          folder / EXPORT_NOTE, TRANSLATE_FIELDS, translating=True)
    config.model_folder = str(folder)
    config, tokenizer_src, tokenizer_tgt = with_tokenizers(config)
    engine = Engine(folder, tokenizer_src, tokenizer_tgt, config.device, threads)
    engine.trained_on = note.get("corpus")  # (an export of an earlier version: None)
    print(f"loaded the CTranslate2 model {folder} ({note['quantization']}, from "
          f"{note.get('source')})", file=sys.stderr)
    return engine, config, tokenizer_src, tokenizer_tgt
