"""A trained model rebuilt from the config its checkpoint carries: the model a config describes
(`build_model`), its weights loaded with an architecture mismatch said in one line, the model
with its tokenizers for inference (`load_translator`: translate.py, export.py, the
benchmarks), and several models as one ensemble (`load_ensemble`: translate.py --ensemble)."""

import dataclasses
import sys
from pathlib import Path

from config import TRANSLATE_FIELDS, Config, is_main
from model import build_transformer
from nmt.checkpoint import (CheckpointError, check_tokenizers, load_averaged, merge_config,
                            translation_checkpoint)
from nmt.decoding import Ensemble
from nmt.runtime import setup_device, use_threads
from tokenizer import (load_tokenizer, tokenizer_fingerprint, tokenizer_keys, tokenizer_path,
                       tokenizer_recipe)


def build_model(config: Config, src_vocab_size: int, tgt_vocab_size: int):
    """The Transformer that `config` describes (what a checkpoint's config rebuilds)."""
    return build_transformer(src_vocab_size, tgt_vocab_size, config.seq_len, config.seq_len,
                             d_model=config.d_model, N=config.N,
                             N_dec=config.decoder_layers(), h=config.h,
                             dropout=config.dropout, d_ff=config.d_ff,
                             attention_dropout=config.attention_dropout,
                             activation_dropout=config.activation_dropout,
                             tie_embeddings=config.tie_embeddings, norm_first=config.norm_first,
                             norm=config.norm, ffn=config.ffn, pos=config.pos,
                             n_kv_heads=config.n_kv_heads or None,
                             shared_vocab=config.shared_vocab)


def load_model_weights(model, state: dict, path: Path):
    """load_state_dict, with an architecture mismatch as one CheckpointError line."""
    try:
        model.load_state_dict(state["model_state_dict"])
    except RuntimeError as e:
        lines = [line.strip() for line in str(e).splitlines() if line.strip()]
        detail = lines[1] if len(lines) > 1 else lines[0]
        raise CheckpointError(f"checkpoint {path} does not fit this architecture: "
                              f"{detail[:300]}") from None


def with_tokenizers(config: Config):
    """(config, tokenizer_src, tokenizer_tgt): a translate-time config, checked, with the
    tokenizer files it names (in its model folder)."""
    problem = config.validate(training=False)
    if problem:
        raise CheckpointError(problem)
    tokenizer_src, tokenizer_tgt = (
        load_tokenizer(tokenizer_path(config, key), config.tokenizer_type,
                       tokenizer_recipe(config, key)) for key in tokenizer_keys(config))
    return config, tokenizer_src, tokenizer_tgt


def load_translator(config: Config, given=frozenset(), checkpoint=None, average: int = 1,
                    saves: bool = False):
    """(model, config, tokenizer_src, tokenizer_tgt): the checkpoint file `checkpoint`, or the
    one --preload names in --model_folder (by default the best where there is one, else the
    newest: nmt.checkpoint.translation_checkpoint, said on stderr), rebuilt from its own config;
    with `average` N the mean of the newest N per-epoch checkpoints up to it, or with `saves`
    of those saved --save_every apart. `config` holds the command line's values; `given` names
    the flags the user set."""
    if checkpoint:
        path = Path(checkpoint)
        if path.is_dir():
            raise CheckpointError(f"--checkpoint {path} is a folder: give a checkpoint file "
                                  f"(.pt), or the folder as --model_folder")
        if "model_folder" not in given:  # the tokenizers live beside the checkpoint
            config.model_folder = str(path.parent)
    else:
        path, why = translation_checkpoint(config, given, average, saves)
    state, paths = load_averaged(config, path, average,
                                 "--average_saves" if saves else "--average", saves)
    if len(paths) > 1:
        loaded = f"the average of {', '.join(str(p) for p in paths)}"
        said = (f"averaged {len(paths)} checkpoints of {paths[0].parent}: "
                f"{', '.join(p.name for p in paths)}")  # (an ensemble's say whose they are)
    else:
        loaded = f"{paths[0]} (epoch {state['epoch']}, step {state['global_step']})"
        said = f"loaded {loaded}" + (f": {why}" if not checkpoint and why else "")
    if is_main():  # (under torchrun, each process loads its teachers: rank 0 says so)
        print(said, file=sys.stderr)
    config = merge_config(Config.from_dict(state["config"]), config, given, path,
                          TRANSLATE_FIELDS, translating=True)
    beside = not Path(config.tokenizer_file).is_absolute()  # (an absolute one: its own error)
    if checkpoint and "model_folder" not in given and beside:  # (copied out of its folder?)
        for file in (tokenizer_path(config, key) for key in tokenizer_keys(config)):
            if not file.exists():
                raise CheckpointError(f"--checkpoint {checkpoint}: no tokenizer {file}: copy "
                                      f"the tokenizer files of the folder it was trained in "
                                      f"beside it, or give that folder as --model_folder")
    config, tokenizer_src, tokenizer_tgt = with_tokenizers(config)
    check_tokenizers(state, path, tokenizer_src, tokenizer_tgt)
    device = setup_device(config.device)
    use_threads(config.threads)
    model = build_model(config, tokenizer_src.get_vocab_size(), tokenizer_tgt.get_vocab_size())
    load_model_weights(model, state, path)
    model.loaded_from = loaded  # said by export.py
    model.trained_on = state.get("corpus")  # what translate.py --example checks its corpus by
    return model.to(device).eval(), config, tokenizer_src, tokenizer_tgt


def check_languages(what: str, one: Config, other: str, expected: Config, why: str):
    """One line unless the model `what` (its config `one`) translates between the languages of
    `expected` (the config of `other`)."""
    if (one.lang_src, one.lang_tgt) != (expected.lang_src, expected.lang_tgt):
        raise CheckpointError(f"{what} translates {one.lang_src}->{one.lang_tgt}, {other} "
                              f"{expected.lang_src}->{expected.lang_tgt}: {why}")


def load_ensemble(config: Config, given, paths, average: int = 1, saves: bool = False):
    """(Ensemble, config, [each model's source tokenizer], target tokenizer): the models of `paths`
    (each a model folder, loaded at --preload, or a checkpoint file), each rebuilt from its own
    config, with --average (or --average_saves: `saves`) applied to each. They may differ in design,
    size and source tokenizer, but must translate between the same two languages and share the
    target tokenizer (the tokens whose log-probabilities are averaged): otherwise one
    CheckpointError line. (With one joint vocabulary, an en->de model and a de->en one share every
    tokenizer: only their languages tell them apart.) The config is the first model's, with the
    shortest seq_len of all."""
    models, sources, target, first = [], [], None, None
    for path in paths:
        one, named = dataclasses.replace(config), set(given)
        if Path(path).is_dir():
            one.model_folder, checkpoint = str(path), None
            named.add("model_folder")
        elif Path(path).is_file():
            checkpoint = path
        else:
            raise CheckpointError(f"--ensemble {path}: no such model folder or checkpoint file")
        model, one, tokenizer_src, tokenizer_tgt = load_translator(one, named, checkpoint,
                                                                   average, saves)
        if target is None:
            target, first = tokenizer_tgt, (path, one)
        check_languages(f"--ensemble: {path}", one, str(first[0]), first[1],
                        "an ensemble's models must translate between the same languages")
        if tokenizer_fingerprint(tokenizer_tgt) != tokenizer_fingerprint(target):
            raise CheckpointError(
                f"--ensemble: {path} has another target tokenizer than {first[0]} "
                f"({tokenizer_tgt.get_vocab_size()} tokens, fingerprint "
                f"{tokenizer_fingerprint(tokenizer_tgt)}, against {target.get_vocab_size()}, "
                f"{tokenizer_fingerprint(target)}): an ensemble averages the models' "
                f"probabilities of the same target tokens")
        models.append(model)
        sources.append(tokenizer_src)
        first[1].seq_len = min(first[1].seq_len, one.seq_len)
    return Ensemble(models), first[1], sources, target
