"""Data in, masked batches out.

load_corpus   -> {"train", "validation", maybe "test"}: `datasets.Dataset`s with `src`/`tgt` text
get_tokenizer -> a `tokenizers.Tokenizer` per language, trained on the training split only
get_ds        -> tokenized once (datasets.map), long pairs dropped, wrapped for a DataLoader
TokenBatchSampler + Collator -> length-bucketed batches padded to their longest sequence
"""

import json
import os
import socket
import sys
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

import torch
from torch.utils.data import Dataset as TorchDataset

from checkpoint import tokenizer_path
from config import Config, UserError

SPECIAL_TOKENS = ["[UNK]", "[PAD]", "[SOS]", "[EOS]"]  # ids 0, 1, 2, 3 in every tokenizer
UNK, PAD, SOS, EOS = range(4)  # load_tokenizer refuses a file where they differ
VAL_NAMES = ("validation", "valid", "val", "dev")


def note(message: str):
    """Data messages go to stderr, so translate.py's stdout holds translations only."""
    print(message, file=sys.stderr)


class DataError(UserError):
    """A problem with the user's corpus or tokenizer files."""


def _quiet_datasets():
    import datasets
    import huggingface_hub
    datasets.disable_progress_bars()
    datasets.logging.set_verbosity_error()
    huggingface_hub.utils.logging.set_verbosity_error()


def column(ds, name: str) -> list:
    """A column of a datasets.Dataset as a Python list (datasets >= 4 returns a lazy Column)."""
    return ds.select_columns([name]).to_dict()[name]


# ---- loading a corpus ---------------------------------------------------------------------------

def _split_name(stem: str):
    """train / validation / test for a file stem such as 'valid' or 'test_2016_flickr'."""
    stem = stem.lower()
    if stem == "train":
        return "train"
    if stem in VAL_NAMES:
        return "validation"
    if stem.startswith("test"):
        return "test"
    return None


def decode_lines(data: bytes, name) -> list:
    """The lines of UTF-8 text (no line endings, no BOM); a bad byte names its line."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data[:e.start].count(b"\n") + 1
        raise DataError(f"{name}, line {line}: not valid UTF-8 (byte {data[e.start]:#04x})") \
            from None
    if text.startswith("\ufeff"):
        text = text[1:]
    lines = text.split("\n")  # not splitlines(): it also splits on \x1c, \x85, \u2028 ...
    if lines and lines[-1] == "":
        lines.pop()
    return [line.rstrip("\r") for line in lines]


def read_lines(path: Path) -> list:
    """The lines of a UTF-8 text file."""
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise DataError(f"cannot read {path}: {e.strerror}") from None
    return decode_lines(data, path)


def _pairs_to_dataset(src, tgt, where: str):
    """A datasets.Dataset of non-empty pairs; pairs with an empty side are dropped, counted."""
    from datasets import Dataset
    keep = [i for i, (s, t) in enumerate(zip(src, tgt)) if s.strip() and t.strip()]
    if len(keep) < len(src):
        note(f"{where}: skipped {len(src) - len(keep)} pair(s) with an empty side")
    return Dataset.from_dict({"src": [src[i].strip() for i in keep],
                              "tgt": [tgt[i].strip() for i in keep]})


def _read_aligned(folder: Path, src: str, tgt: str, splits: dict):
    """train.en + train.de (+ val.*, valid.*, dev.*, test*.*), one sentence a line."""
    for src_file in sorted(folder.glob(f"*.{src}")):
        split = _split_name(src_file.stem)
        if split is None or split in splits:
            continue
        tgt_file = src_file.with_suffix(f".{tgt}")
        if not tgt_file.exists():
            raise DataError(f"{src_file} has no matching target file {tgt_file}")
        src_lines, tgt_lines = read_lines(src_file), read_lines(tgt_file)
        if len(src_lines) != len(tgt_lines):
            raise DataError(f"{src_file} has {len(src_lines)} lines but {tgt_file} has "
                            f"{len(tgt_lines)}: the files must be aligned line by line")
        splits[split] = _pairs_to_dataset(src_lines, tgt_lines, f"{src_file.name}/{tgt_file.name}")


def _read_tsv(folder: Path, src: str, tgt: str, splits: dict):
    """train.tsv (+ val.tsv, test.tsv), or a single *.tsv: 'source<TAB>target' a line, with an
    optional header line naming the two languages; further columns (attribution) are ignored."""
    tsv_files = sorted(folder.glob("*.tsv"))
    for tsv in tsv_files:
        split = _split_name(tsv.stem) or ("train" if len(tsv_files) == 1 else None)
        if split is None or split in splits:
            continue
        lines = read_lines(tsv)
        if lines and lines[0].strip().split("\t") == [src, tgt]:
            lines = lines[1:]
        src_lines, tgt_lines, extra = [], [], 0
        for n, line in enumerate(lines, 1):
            parts = line.split("\t") if line.strip() else ["", ""]
            if len(parts) < 2:
                raise DataError(f"{tsv}, line {n}: expected 'source<TAB>target', found "
                                f"{len(parts)} field(s)")
            extra += len(parts) > 2
            src_lines.append(parts[0])
            tgt_lines.append(parts[1])
        if extra:  # the Anki files carry a third, attribution column
            note(f"{tsv.name}: {extra} line(s) have more than two tab-separated fields; the "
                 f"first two are taken as source and target")
        splits[split] = _pairs_to_dataset(src_lines, tgt_lines, tsv.name)


def _read_jsonl(folder: Path, src: str, tgt: str, splits: dict):
    """train.jsonl (+ validation.jsonl ...): {"translation": {"en": ..., "de": ...}} a line."""
    for jl in sorted(list(folder.glob("*.jsonl")) + list(folder.glob("*.json"))):
        split = _split_name(jl.stem)
        if split is None or split in splits:
            continue
        src_lines, tgt_lines = [], []
        for n, line in enumerate(read_lines(jl), 1):
            if not line.strip():
                continue
            try:
                pair = json.loads(line)["translation"]
                src_lines.append(str(pair[src]))
                tgt_lines.append(str(pair[tgt]))
            except (ValueError, KeyError, TypeError):
                raise DataError(f"{jl}, line {n}: expected {{\"translation\": {{\"{src}\": ..., "
                                f"\"{tgt}\": ...}}}}") from None
        splits[split] = _pairs_to_dataset(src_lines, tgt_lines, jl.name)


def _load_local(config: Config):
    """Parallel files in config.data_dir: aligned text files, tab-separated pairs or JSON lines
    (see each reader); a split found in one format is not read again from another."""
    folder = Path(config.data_dir)
    if not folder.is_dir():
        raise DataError(f"--data_dir {folder}: no such folder")
    src, tgt = config.lang_src, config.lang_tgt
    splits = {}
    for reader in (_read_aligned, _read_tsv, _read_jsonl):
        reader(folder, src, tgt, splits)
    if "train" not in splits:
        raise DataError(f"--data_dir {folder}: found no training data for {src}-{tgt} (expected "
                        f"train.{src} + train.{tgt}, train.tsv or train.jsonl)")
    return splits


def _hub_reachable(timeout: float = 5.0) -> bool:
    from huggingface_hub import constants
    url = urlparse(constants.ENDPOINT)
    try:
        socket.create_connection((url.hostname, url.port or (443 if url.scheme == "https"
                                                              else 80)), timeout).close()
        return True
    except OSError:
        return False


def _load_hub(config: Config):
    """`load_dataset(datasource, "{src}-{tgt}")`: a hub repo (OPUS Books by default), or a
    local folder laid out like one (README.md with `configs:` and data files)."""
    import datasets
    from datasets import load_dataset
    _quiet_datasets()
    src, tgt, name = config.lang_src, config.lang_tgt, config.datasource
    is_local = Path(name).exists()
    local_hint = (f"train on local files with --data_dir DIR (train.{src} + train.{tgt}, one "
                  f"sentence a line)")
    if not is_local and not datasets.config.HF_HUB_OFFLINE and not _hub_reachable():
        raise DataError(f"could not reach the Hugging Face hub to load '{name}'; {local_hint}, "
                        f"or set HF_HUB_OFFLINE=1 to use a cached copy")
    subsets = [f"{src}-{tgt}", f"{tgt}-{src}"]
    raw, errors = None, []
    for subset in subsets:
        try:
            raw = load_dataset(name, subset)
            break
        except ValueError as e:  # no such subset (BuilderConfig not found)
            errors.append(str(e).splitlines()[0])
        except ConnectionError:
            raise DataError(f"could not reach the Hugging Face hub to load '{name}' (offline, "
                            f"and no cached copy); {local_hint}") from None
        except Exception as e:  # noqa: BLE001 - unknown repo, offline without a cache, ...
            msg = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise DataError(f"could not load dataset '{name}' ({subsets[0]}): {msg}") from None
    if raw is None:
        raise DataError(f"dataset '{name}' has no subset {subsets[0]} or {subsets[1]}: "
                        f"{errors[0]}")
    splits = {}
    for split_name, ds in raw.items():
        split = _split_name(split_name)
        if split is None or split in splits:
            continue
        if "translation" not in ds.column_names:
            raise DataError(f"dataset '{name}' has no 'translation' column "
                            f"(columns: {', '.join(ds.column_names)})")
        first = ds[0]["translation"] if len(ds) else {src: "", tgt: ""}
        if src not in first or tgt not in first:
            raise DataError(f"dataset '{name}' has no {src}/{tgt} texts "
                            f"(languages: {', '.join(first)})")
        pairs = column(ds, "translation")
        splits[split] = _pairs_to_dataset([p[src] or "" for p in pairs],
                                          [p[tgt] or "" for p in pairs], f"{name}:{split_name}")
    if "train" not in splits:
        raise DataError(f"dataset '{name}' has no train split (splits: {', '.join(raw)})")
    return splits


def load_corpus(config: Config):
    """{"train", "validation"(, "test")} -> datasets.Dataset with `src` and `tgt` columns.
    Without a validation split of its own, a seeded `val_fraction` of train is held out, and
    splits["held_out"] is True."""
    splits = _load_local(config) if config.data_dir else _load_hub(config)
    if len(splits["train"]) < 2:
        raise DataError("the training split has fewer than 2 usable pairs")
    if "validation" not in splits:
        parts = splits["train"].train_test_split(test_size=config.val_fraction,
                                                 seed=config.seed)
        splits["train"], splits["validation"] = parts["train"], parts["test"]
        splits["held_out"] = True
    return splits


# ---- tokenizers ---------------------------------------------------------------------------------

def build_tokenizer(kind: str, vocab_size: int, texts):
    """bpe: byte-level BPE (every string encodes, decoding restores it exactly);
    word: the write-ups' word-level tokenizer (words seen fewer than twice become [UNK]), with
    word boundaries kept (Metaspace) so that decoding restores the spacing: "doesn't" comes
    back as "doesn't", not "doesn ' t"."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
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


def _recipe_path(path: Path) -> Path:
    return path.with_name(path.stem + ".meta.json")  # tokenizer_en.json -> tokenizer_en.meta.json


def tokenizer_recipe(config: Config, lang: str) -> dict:
    """What a tokenizer file was trained as; saved beside it and checked on every load."""
    return {"lang": lang, "tokenizer_type": config.tokenizer_type,
            "vocab_size": config.vocab_size}


def load_tokenizer(path: Path, kind: str = None, recipe: dict = None):
    """A tokenizer file, refused with one line if it is not what `kind` / `recipe` say (files
    saved before recipes were recorded are checked for their kind only)."""
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
        raise DataError(f"tokenizer file {path} is a {found} tokenizer, but --tokenizer_type "
                        f"is {kind}; use another --model_folder or --tokenizer_type {found}")
    for i, special in enumerate(SPECIAL_TOKENS):
        if tok.token_to_id(special) != i:
            raise DataError(f"tokenizer file {path} lacks the special token {special} at id {i}")
    saved = _recipe_path(path)
    if recipe and saved.exists():
        was = json.loads(saved.read_text(encoding="utf-8"))
        for key, value in recipe.items():
            if was.get(key) != value:
                flag = "lang_src/--lang_tgt" if key == "lang" else key
                raise DataError(f"tokenizer file {path} was trained with --{flag} {was.get(key)}"
                                f", not {value}; use another --model_folder, or delete the "
                                f"tokenizer files to train new ones")
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
    says), else trained on `texts` (the training split) and saved there with its recipe."""
    path = tokenizer_path(config, lang)
    recipe = tokenizer_recipe(config, lang)
    if path.exists():
        return load_tokenizer(path, config.tokenizer_type, recipe)
    tok = build_tokenizer(config.tokenizer_type, config.vocab_size, texts)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tok.save(str(tmp))
    _recipe_path(path).write_text(json.dumps(recipe), encoding="utf-8")
    os.replace(tmp, path)
    return tok


# ---- the dataset and its batches ----------------------------------------------------------------

class BilingualDataset(TorchDataset):
    """Items: encoder_input [SOS] src [EOS], decoder_input [SOS] tgt, label tgt [EOS]. The texts
    are kept for validation's scores and examples."""

    def __init__(self, src_ids, tgt_ids, src_texts, tgt_texts):
        self.src_ids, self.tgt_ids = src_ids, tgt_ids
        self.src_texts, self.tgt_texts = src_texts, tgt_texts

    def __len__(self):
        return len(self.src_ids)

    def lengths(self):
        """Padded length of each pair in a batch: the longer of encoder input and label."""
        return [max(len(s) + 2, len(t) + 1) for s, t in zip(self.src_ids, self.tgt_ids)]

    def __getitem__(self, i):
        src, tgt = self.src_ids[i], self.tgt_ids[i]
        return {
            "encoder_input": torch.tensor([SOS] + src + [EOS]),  # (src_len,)
            "decoder_input": torch.tensor([SOS] + tgt),  # (tgt_len,)
            "label": torch.tensor(tgt + [EOS]),  # (tgt_len,)
        }


def real_tokens(batch) -> int:
    """Non-padding source and target tokens of a batch: what throughput counts."""
    return int((batch["encoder_input"] != PAD).sum() + (batch["label"] != PAD).sum())


class Collator:
    """Pads a list of items to the longest sequence of the batch and builds the source mask.

    The decoder needs no mask tensor: its self-attention is causal (the model applies it
    inside attention, so the flash kernel can run), and for right-padded targets that is
    enough, since a real position never sees a later padded one and the loss ignores padding."""

    def __init__(self, pad_id: int = PAD):
        self.pad_id = pad_id

    def __call__(self, items):
        pad = torch.nn.utils.rnn.pad_sequence
        enc = pad([it["encoder_input"] for it in items], batch_first=True,
                  padding_value=self.pad_id)  # (batch, src_len)
        dec = pad([it["decoder_input"] for it in items], batch_first=True,
                  padding_value=self.pad_id)  # (batch, tgt_len)
        label = pad([it["label"] for it in items], batch_first=True,
                    padding_value=self.pad_id)  # (batch, tgt_len)
        encoder_mask = (enc != self.pad_id)[:, None, None, :]  # (batch, 1, 1, src_len)
        return {"encoder_input": enc, "decoder_input": dec, "label": label,
                "encoder_mask": encoder_mask}


class TokenBatchSampler:
    """Length-bucketed batches (fairseq's --max-tokens): pairs sorted by length (ties in a
    seeded random order), cut into batches of at most `max_tokens` padded tokens, or of
    `batch_size` sentences when max_tokens is 0; batch order shuffled each epoch. Every pair
    lands in exactly one batch per epoch. The order depends only on (seed, epoch), so a resumed
    run can skip the batches it already trained on (`set_epoch(epoch, start=k)`)."""

    def __init__(self, lengths, max_tokens: int = 0, batch_size: int = 0,
                 shuffle: bool = True, seed: int = 0):
        if max_tokens and max(lengths, default=0) > max_tokens:
            raise ValueError(f"a pair of {max(lengths)} tokens does not fit max_tokens "
                             f"{max_tokens}")
        self.lengths, self.max_tokens, self.batch_size = list(lengths), max_tokens, batch_size
        self.shuffle, self.seed = shuffle, seed
        self.epoch, self.start = 0, 0

    def set_epoch(self, epoch: int, start: int = 0):
        self.epoch, self.start = epoch, start

    def batches(self, epoch: int = None):
        epoch = self.epoch if epoch is None else epoch
        g = torch.Generator().manual_seed(self.seed * 1000003 + epoch)
        n = len(self.lengths)
        lengths = torch.tensor(self.lengths)
        if self.shuffle:
            perm = torch.randperm(n, generator=g)
            order = perm[torch.sort(lengths[perm], stable=True).indices]
        else:
            order = torch.sort(lengths, stable=True).indices
        batches, current, longest = [], [], 0
        for i, length in zip(order.tolist(), lengths[order].tolist()):
            longest_if_added = max(longest, length)
            full = (len(current) + 1) * longest_if_added > self.max_tokens if self.max_tokens \
                else len(current) >= self.batch_size
            if current and full:
                batches.append(current)
                current, longest_if_added = [], length
            current.append(i)
            longest = longest_if_added
        if current:
            batches.append(current)
        if self.shuffle:
            batches = [batches[j] for j in torch.randperm(len(batches), generator=g).tolist()]
        return batches

    def __iter__(self):
        yield from self.batches()[self.start:]

    def __len__(self):
        return len(self.batches()) - self.start


@dataclass
class Data:
    tokenizer_src: object
    tokenizer_tgt: object
    train: BilingualDataset
    validation: BilingualDataset
    held_out: bool  # the validation pairs were drawn from the training split
    test: tuple = None  # (source texts, reference texts) of the test split, if there is one


def tokenize_split(ds, tokenizer_src, tokenizer_tgt):
    """Adds src_ids/tgt_ids columns, in batches, once (not in every __getitem__)."""
    def encode(batch):
        return {"src_ids": [e.ids for e in tokenizer_src.encode_batch(batch["src"])],
                "tgt_ids": [e.ids for e in tokenizer_tgt.encode_batch(batch["tgt"])]}
    return ds.map(encode, batched=True, batch_size=1000)


def to_bilingual(ds, seq_len: int, name: str):
    """Drops pairs that do not fit seq_len ([SOS] and [EOS] included), with a printed count."""
    src_ids, tgt_ids = column(ds, "src_ids"), column(ds, "tgt_ids")
    keep = [i for i in range(len(src_ids))
            if len(src_ids[i]) + 2 <= seq_len and len(tgt_ids[i]) + 2 <= seq_len]
    if len(keep) < len(src_ids):
        note(f"{name}: dropped {len(src_ids) - len(keep)} of {len(src_ids)} pairs longer than "
             f"seq_len {seq_len}")
    if not keep:
        raise DataError(f"{name}: no pair fits --seq_len {seq_len}")
    src_texts, tgt_texts = column(ds, "src"), column(ds, "tgt")
    return BilingualDataset([src_ids[i] for i in keep], [tgt_ids[i] for i in keep],
                            [src_texts[i] for i in keep], [tgt_texts[i] for i in keep])


def get_ds(config: Config) -> Data:
    """Loads the corpus, gets the tokenizers (trained on train only), tokenizes once."""
    _quiet_datasets()
    splits = load_corpus(config)
    src_key, tgt_key = tokenizer_keys(config)
    if config.shared_vocab:  # one tokenizer, trained on both sides of the training split
        tokenizer_src = tokenizer_tgt = get_tokenizer(
            config, src_key, column(splits["train"], "src") + column(splits["train"], "tgt"))
    else:
        tokenizer_src = get_tokenizer(config, src_key, column(splits["train"], "src"))
        tokenizer_tgt = get_tokenizer(config, tgt_key, column(splits["train"], "tgt"))
    train = to_bilingual(tokenize_split(splits["train"], tokenizer_src, tokenizer_tgt),
                         config.seq_len, "train")
    validation = to_bilingual(tokenize_split(splits["validation"], tokenizer_src, tokenizer_tgt),
                              config.seq_len, "validation")
    test = None
    if "test" in splits:
        test = (column(splits["test"], "src"), column(splits["test"], "tgt"))
    vocabulary = (f"{tokenizer_src.get_vocab_size()} (joint)" if config.shared_vocab else
                  f"{tokenizer_src.get_vocab_size()} ({config.lang_src}) / "
                  f"{tokenizer_tgt.get_vocab_size()} ({config.lang_tgt})")
    note(f"data: {len(train)} training pairs, {len(validation)} validation pairs"
         + (f", {len(test[0])} test pairs" if test else "") + f"; vocabulary {vocabulary}")
    return Data(tokenizer_src, tokenizer_tgt, train, validation,
                held_out=splits.get("held_out", False), test=test)
