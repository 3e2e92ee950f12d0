"""Export a trained checkpoint to CTranslate2, the fastest inference engine for this model family.

    pip install 'ctranslate2>=4.7'                            # optional: serving only
    python export.py --output ct2                             # newest checkpoint, float32
    python export.py --output ct2_int8 --quantization int8 --preload best
    python export.py --output ct2_avg --average 5             # the last 5 epochs averaged
    python translate.py --ctranslate2 ct2 "A dog runs."       # the same translate.py, on the engine

The weights are mapped one to one into CTranslate2's Transformer specification, built from its
constructors: pre- or post-norm, LayerNorm or RMSNorm, ReLU or SwiGLU, sinusoidal positions (this
repo's own table, written into the model) or rotary ones (halves rotated, as here), any number
of key/value heads, tied or separate embeddings. Beside the engine's files the folder holds the
tokenizers and `export.json`: the training config (seq_len, the decoding limits) and where the
weights came from, which translate.py reads.
"""

import json
import shutil
import sys
from pathlib import Path

from checkpoint import tokenizer_path
from config import ArgumentParser, UserError, run_main
from dataset import SPECIAL_TOKENS, tokenizer_keys

QUANTIZATIONS = ["float32", "int8", "int8_float32", "float16", "bfloat16", "int8_float16",
                 "int8_bfloat16"]
EXPORT_NOTE = "export.json"


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
    decoder = transformer_spec.TransformerDecoderSpec(config.N, config.h, **options)
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
           source=None):
    """Writes the CTranslate2 model of `model` into the new folder `output`, with the
    tokenizer files and export.json beside it. `source`: where the weights came from."""
    output = check_output(output)
    spec = build_spec(model, config, tokenizer_src, tokenizer_tgt)
    spec.validate()
    spec.optimize(quantization=quantization)
    try:
        output.mkdir(parents=True, exist_ok=True)
        spec.save(str(output))
        for key in dict.fromkeys(tokenizer_keys(config)):  # each with its recipe file
            path = tokenizer_path(config, key)
            for f in (path, path.with_name(path.stem + ".meta.json")):
                if f.exists():
                    shutil.copy(f, output / f.name.replace(path.stem, f"tokenizer_{key}"))
    except OSError as e:
        raise ExportError(f"cannot write {output}: {e.strerror}") from None
    note = {"config": {**config.to_dict(), "model_folder": str(output.resolve()),
                       "tokenizer_file": "tokenizer_{0}.json"},
            "source": source, "quantization": quantization,
            "decoding": {"max_len_a": config.max_len_a, "max_len_b": config.max_len_b,
                         "min_len": config.min_len, "seq_len": config.seq_len,
                         "length_penalty": "CTranslate2 divides a beam hypothesis' log "
                                           "probability by length^alpha; translate.py's own "
                                           "beam search by ((5 + length) / 6)^alpha (GNMT)"}}
    (output / EXPORT_NOTE).write_text(json.dumps(note, indent=1), encoding="utf-8")
    return output


def parse_args(argv):
    from translate import add_locating_arguments, checkpoint_config
    parser = ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", required=True, help="new folder for the CTranslate2 model")
    parser.add_argument("--quantization", choices=QUANTIZATIONS, default="float32",
                        help="weight type of the exported model (default: float32); int8 is "
                             "the fastest on CPU")
    add_locating_arguments(parser)
    args = parser.parse_args(argv)
    return args, *checkpoint_config(parser, args)


def main(argv=None):
    from translate import load_translator
    args, config, given = parse_args(argv)
    import_ctranslate2()  # before any loading: one line if it is missing
    check_output(args.output)
    model, config, tokenizer_src, tokenizer_tgt = load_translator(
        config, given, args.checkpoint, args.average)
    model.float()
    output = export(model, config, tokenizer_src, tokenizer_tgt, args.output, args.quantization,
                    source=getattr(model, "loaded_from", None))
    print(f"wrote the CTranslate2 model ({args.quantization}) to {output}; translate with: "
          f"python translate.py --ctranslate2 {output} \"...\"", file=sys.stderr)


if __name__ == "__main__":
    run_main("export.py", main)
