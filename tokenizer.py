"""Tokenizers: byte-level BPE (the default) or the write-ups' word level, trained once on a sample
of the training split and saved in the model folder beside the checkpoints, with the recipe they
were trained as (checked on every load).

Every tokenizer has the same four special tokens at ids 0-3: [UNK], [PAD], [SOS], [EOS].
"""

import hashlib
import json
import os
from pathlib import Path

from config import Config
from corpus import DataError, note

SPECIAL_TOKENS = ["[UNK]", "[PAD]", "[SOS]", "[EOS]"]  # ids 0, 1, 2, 3 in every tokenizer
UNK, PAD, SOS, EOS = range(4)  # load_tokenizer refuses a file where they differ


def tokenizer_path(config: Config, lang: str) -> Path:
    p = Path(config.tokenizer_file.format(lang))
    return p if p.is_absolute() else Path(config.model_folder) / p


def build_tokenizer(kind: str, vocab_size: int, texts, tag: str = ""):
    """bpe: byte-level BPE (every string encodes, decoding restores it exactly);
    word: the write-ups' word-level tokenizer (words seen fewer than twice become [UNK]), with
    word boundaries kept (Metaspace) so that decoding restores the spacing: "doesn't" comes
    back as "doesn't", not "doesn ' t". `tag` (--extra_tag), if any, becomes one token after
    the trained vocabulary, which takes the space after it: "<BT> A man" is the tag's id and
    then the ids of "A man"."""
    from tokenizers import (AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers,
                            trainers)
    if kind == "word":
        tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
        tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Metaspace(),
                                                     pre_tokenizers.Punctuation()])
        tok.decoder = decoders.Metaspace()
        trainer = trainers.WordLevelTrainer(vocab_size=vocab_size, min_frequency=2,
                                            special_tokens=SPECIAL_TOKENS, show_progress=False)
    else:
        tok = Tokenizer(models.BPE(unk_token="[UNK]"))
        tok.normalizer = normalizers.NFC()
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                      show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    if kind != "word" and tok.get_vocab_size() > vocab_size:  # (BPE keeps its whole alphabet)
        note(f"--vocab_size {vocab_size} is less than byte-level BPE's 256 bytes and 4 special "
             f"tokens: the vocabulary has {tok.get_vocab_size()}")
    if tag:
        tok.add_tokens([AddedToken(tag, normalized=False, rstrip=True)])
    tok.encode_special_tokens = True  # "[EOS]" in a text is text, not the control token
    return tok


def detokenize(tok, ids) -> str:
    """The text of token ids. Unknown words (word-level only) show as [UNK]; word-level files
    of older versions (no decoder) join their tokens with spaces, as the write-ups did."""
    if type(tok.model).__name__ != "WordLevel":
        return tok.decode(ids).strip()
    tokens = ["▁[UNK]" if i == UNK else tok.id_to_token(i) for i in ids]
    if tok.decoder is None:
        return " ".join(t.lstrip("▁") for t in tokens).strip()
    return "".join(tokens).replace("▁", " ").strip()


def tokenizer_fingerprint(tok) -> str:
    """What identifies a tokenizer's segmentation: a hash of its vocabulary (token and id) and
    its merges (BPE), stored in every checkpoint and prepared-data key, so that a tokenizer file
    swapped for another of the same size is caught where a checkpoint meets it. The merges are
    hashed as [left, right] pairs (`merge_pairs`), whichever tokenizers release wrote them."""
    return tokenizer_fingerprints(tok)[0]


def tokenizer_fingerprints(tok) -> tuple:
    """(the fingerprint, the one checkpoints written before it recorded): until 2026-11 the
    merges were hashed as the installed tokenizers wrote them, "left right" strings before
    release 0.20 and pairs after, so a checkpoint written under tokenizers < 0.20 holds the hash
    of the strings. A checkpoint matches its tokenizer if either is its record
    (nmt.checkpoint.check_tokenizers)."""
    model = json.loads(tok.to_str())["model"]
    vocab = sorted(tok.get_vocab(with_added_tokens=True).items(), key=lambda item: item[1])
    pairs = merge_pairs(model.get("merges"))
    strings = None if pairs is None else [" ".join(pair) for pair in pairs]
    return tuple(hashlib.sha256(json.dumps({"vocab": vocab, "merges": merges},
                                           ensure_ascii=False).encode("utf-8")).hexdigest()[:16]
                 for merges in (pairs, strings))


def merge_pairs(merges):
    """BPE merges as [left, right] pairs, as tokenizers 0.20 and later write them; earlier
    releases wrote "left right" strings (a byte-level token holds no space)."""
    if merges is None:
        return None
    return [m.split(" ", 1) if isinstance(m, str) else list(m) for m in merges]


def recipe_path(path: Path) -> Path:
    return path.with_name(path.stem + ".meta.json")  # tokenizer_en.json -> tokenizer_en.meta.json


def tokenizer_recipe(config: Config, lang: str) -> dict:
    """What a tokenizer file was trained as; saved beside it and checked on every load. The
    source side's records --extra_tag where one is given (its vocabulary holds the tag)."""
    tagged = config.extra_tag and lang == tokenizer_keys(config)[0]
    return {"lang": lang, "tokenizer_type": config.tokenizer_type,
            "vocab_size": config.vocab_size, "tokenizer_sample": config.tokenizer_sample,
            **({"extra_tag": config.extra_tag} if tagged else {})}


def load_tokenizer(path: Path, kind: str = None, recipe: dict = None, unsaved: bool = False,
                   shared: bool = False):
    """A tokenizer file, refused with one line if it is not what `kind` / `recipe` say (files
    saved before recipes were recorded are checked for their kind only). `unsaved`: it lies in
    a model folder with no checkpoint (a first start stopped before its first save left it);
    `shared`: a file another model folder finds too (an absolute --tokenizer_file, or one
    outside the model folder), so the advice names --tokenizer_file, not --model_folder."""
    from tokenizers import Tokenizer
    try:
        tok = Tokenizer.from_file(str(path))
    except Exception as e:  # noqa: BLE001 - the tokenizers library raises plain Exceptions
        if not path.exists():
            raise DataError(f"tokenizer file {path} not found") from None
        raise DataError(f"tokenizer file {path} is unreadable: {str(e).splitlines()[0]}") \
            from None
    found = "word" if type(tok.model).__name__ == "WordLevel" else "bpe"
    if kind and found != kind:
        other = "tokenizer_file" if shared else "model_folder"
        raise DataError(f"tokenizer file {path} is a {found} tokenizer, but --tokenizer_type "
                        f"is {kind}; use another --{other} or --tokenizer_type {found}")
    for i, special in enumerate(SPECIAL_TOKENS):
        if tok.token_to_id(special) != i:
            raise DataError(f"tokenizer file {path} lacks the special token {special} at id {i}")
    saved = recipe_path(path)
    if recipe and saved.exists():
        was = json.loads(saved.read_text(encoding="utf-8"))
        for key, value in recipe.items():  # (a tag: dataset.get_ds's note; the sample
            if key in was and was[key] != value and key != "extra_tag":  # unrecorded before)
                flag = "lang_src/--lang_tgt" if key == "lang" else key
                why = f"tokenizer file {path} was trained with --{flag} {was.get(key)}, not {value}"
                if unsaved:
                    raise DataError(f"{why}, by a start that saved no checkpoint: delete it and "
                                    f"{saved.name} to train a new one, or keep that value")
                if shared:  # (another model folder would find the same file)
                    raise DataError(f"{why}; keep that value, or give another --tokenizer_file "
                                    f"(runs trained with this one need it as it is)")
                raise DataError(f"{why}; keep that value, or train into another --model_folder "
                                f"(these files belong to its checkpoints)")
    tok.encode_special_tokens = True  # "[EOS]" in a text is text, not the control token
    return tok


def tokenizer_keys(config: Config):
    """The tokenizer names of source and target: their languages, or with shared_vocab one
    joint tokenizer for both ("en_de": tokenizer_en_de.json)."""
    if config.shared_vocab:
        joint = f"{config.lang_src}_{config.lang_tgt}"
        return joint, joint
    return config.lang_src, config.lang_tgt


def get_tokenizer(config: Config, lang: str, texts):
    """The tokenizer of `lang`: loaded from tokenizer_file if present (and trained as config
    says), else trained on `texts` (training sentences; or a function returning them, called
    only then) and saved there with its recipe."""
    path = tokenizer_path(config, lang)
    recipe = tokenizer_recipe(config, lang)
    if path.exists():
        folder = Path(config.model_folder).resolve()
        inside = folder in path.resolve().parents
        unsaved = inside and not any(folder.glob("*.pt"))
        # shared: another --model_folder would find the same file (outside this one, or absolute)
        shared = not inside or Path(config.tokenizer_file).is_absolute()
        return load_tokenizer(path, config.tokenizer_type, recipe, unsaved, shared)
    tok = build_tokenizer(config.tokenizer_type, config.vocab_size,
                          texts() if callable(texts) else texts, recipe.get("extra_tag", ""))
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tok.save(str(tmp))
    recipe_path(path).write_text(json.dumps(recipe), encoding="utf-8")
    os.replace(tmp, path)
    return tok


def sample_texts(ds, columns, n: int):
    """About n texts of each column (all for n = 0), evenly spaced through the split, in
    batches: what the tokenizers train on (streamed, never a list of the whole corpus)."""
    stride = max(1, -(-len(ds) // n)) if n else 1
    picked = ds.select(range(0, len(ds), stride)) if stride > 1 else ds
    for batch in picked.iter(batch_size=10_000):
        for name in columns:
            yield batch[name]


def get_tokenizers(config: Config, train):
    """Source and target tokenizers (one joint one with shared_vocab), trained on a sample of
    `train` if their files do not exist yet (`train` may be None when they do)."""
    src_key, tgt_key = tokenizer_keys(config)
    n = config.tokenizer_sample
    if config.shared_vocab:  # one tokenizer, trained on both sides of the training split
        tok = get_tokenizer(config, src_key, lambda: sample_texts(train, ["src", "tgt"], n))
        return tok, tok
    return (get_tokenizer(config, src_key, lambda: sample_texts(train, ["src"], n)),
            get_tokenizer(config, tgt_key, lambda: sample_texts(train, ["tgt"], n)))


def coverage(tok, texts, ids) -> dict:
    """How well a tokenizer's vocabulary covers texts, from their ids (tok's encoding of
    them): {"tokens_per_word": tokens over whitespace-separated words, "fallback": the share of
    tokens that are single bytes (BPE: pieces no merge covers) or [UNK] (word level)}. A
    vocabulary made for other text cuts it into more, shorter pieces: both rise."""
    single = {i for token, i in tok.get_vocab().items() if len(token) == 1} \
        if type(tok.model).__name__ == "BPE" else {UNK}
    tokens = sum(map(len, ids))
    return {"tokens_per_word": tokens / max(1, sum(len(t.split()) for t in texts)),
            "fallback": sum(i in single for seq in ids for i in seq) / max(1, tokens)}

