"""Data in, masked batches out.

load_corpus   -> {"train", "validation", maybe "test"}: `datasets.Dataset`s with `src`/`tgt` text
get_tokenizer -> a `tokenizers.Tokenizer` per language, trained on a sample of the training split
get_ds        -> the training split prepared once (token ids in memory-mapped files, long pairs
                 dropped) and reloaded in seconds; validation encoded; wrapped for a DataLoader
TokenBatchSampler + Collator -> length-bucketed batches padded to their longest sequence
"""

import hashlib
import itertools
import json
import os
import shutil
import socket
import sys
import time
import uuid
import zlib
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

import numpy as np
import torch
from torch.utils.data import Dataset as TorchDataset
from tqdm import tqdm

from checkpoint import tokenizer_path
from config import Config, UserError
from runtime import is_main

SPECIAL_TOKENS = ["[UNK]", "[PAD]", "[SOS]", "[EOS]"]  # ids 0, 1, 2, 3 in every tokenizer
UNK, PAD, SOS, EOS = range(4)  # load_tokenizer refuses a file where they differ
VAL_NAMES = ("validation", "valid", "val", "dev")
SPLITS = ("train", "validation", "test")


def note(message: str):
    """Data messages go to stderr, so translate.py's stdout holds translations only; under
    torchrun, from rank 0 only."""
    if is_main():
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


def decode_lines(data: bytes, name, first_line: int = 1) -> list:
    """The lines of UTF-8 text (no line endings, no BOM); a bad byte names its line (counting
    from `first_line`)."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data[:e.start].count(b"\n") + first_line
        raise DataError(f"{name}, line {line}: not valid UTF-8 (byte {data[e.start]:#04x})") \
            from None
    if text.startswith("\ufeff") and first_line == 1:  # a byte order mark
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


def _non_empty_pairs(src, tgt):
    """An Arrow table of the stripped pairs with no empty side, and how many were dropped."""
    import pyarrow as pa
    keep = [i for i, (s, t) in enumerate(zip(src, tgt)) if s.strip() and t.strip()]
    table = pa.table({"src": [src[i].strip() for i in keep], "tgt": [tgt[i].strip() for i in keep]})
    return table, len(src) - len(keep)


def _to_dataset(tables, dropped: int, where: str):
    import pyarrow as pa
    from datasets import Dataset
    from datasets.table import InMemoryTable
    if dropped:
        note(f"{where}: skipped {dropped} pair(s) with an empty side")
    schema = pa.schema([("src", pa.string()), ("tgt", pa.string())])
    # a fingerprint of our own: without one, datasets hashes the whole table (for WMT, a
    # serialized copy of 1.7 GB, about 7 GB of peak memory and 20 s, measured)
    return Dataset(InMemoryTable(pa.concat_tables(tables) if tables else schema.empty_table()),
                   fingerprint=uuid.uuid4().hex)


def _pairs_to_dataset(src, tgt, where: str):
    """A datasets.Dataset of non-empty pairs; pairs with an empty side are dropped, counted."""
    table, dropped = _non_empty_pairs(src, tgt)
    return _to_dataset([table], dropped, where)


def _aligned_dataset(src_file: Path, tgt_file: Path, chunk: int = 100_000):
    """Two line-aligned files read together, `chunk` lines at a time, into an Arrow table: no
    Python list of a whole (WMT-size) file is ever held."""
    tables, dropped, n = [], 0, 0
    try:
        with open(src_file, "rb") as fs, open(tgt_file, "rb") as ft:
            while True:
                a, b = list(itertools.islice(fs, chunk)), list(itertools.islice(ft, chunk))
                if len(a) != len(b):
                    n_src = n + len(a) + sum(1 for _ in fs)
                    n_tgt = n + len(b) + sum(1 for _ in ft)
                    raise DataError(f"{src_file} has {n_src} lines but {tgt_file} has {n_tgt}: "
                                    f"the files must be aligned line by line")
                if not a:
                    break
                src = decode_lines(b"".join(a), src_file, n + 1)
                tgt = decode_lines(b"".join(b), tgt_file, n + 1)
                table, d = _non_empty_pairs(src, tgt)
                tables.append(table)
                dropped, n = dropped + d, n + len(a)
    except OSError as e:
        raise DataError(f"cannot read {e.filename}: {e.strerror}") from None
    return _to_dataset(tables, dropped, f"{src_file.name}/{tgt_file.name}")


def _read_aligned(folder: Path, src: str, tgt: str, splits: dict, wanted=SPLITS):
    """train.en + train.de (+ val.*, valid.*, dev.*, test*.*), one sentence a line."""
    for src_file in sorted(folder.glob(f"*.{src}")):
        split = _split_name(src_file.stem)
        if split not in wanted or split in splits:
            continue
        tgt_file = src_file.with_suffix(f".{tgt}")
        if not tgt_file.exists():
            raise DataError(f"{src_file} has no matching target file {tgt_file}")
        splits[split] = _aligned_dataset(src_file, tgt_file)


def _read_tsv(folder: Path, src: str, tgt: str, splits: dict, wanted=SPLITS):
    """train.tsv (+ val.tsv, test.tsv), or a single *.tsv: 'source<TAB>target' a line, with an
    optional header line naming the two languages; further columns (attribution) are ignored."""
    tsv_files = sorted(folder.glob("*.tsv"))
    for tsv in tsv_files:
        split = _split_name(tsv.stem) or ("train" if len(tsv_files) == 1 else None)
        if split not in wanted or split in splits:
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


def _read_jsonl(folder: Path, src: str, tgt: str, splits: dict, wanted=SPLITS):
    """train.jsonl (+ validation.jsonl ...): {"translation": {"en": ..., "de": ...}} a line."""
    for jl in sorted(list(folder.glob("*.jsonl")) + list(folder.glob("*.json"))):
        split = _split_name(jl.stem)
        if split not in wanted or split in splits:
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


def _load_local(config: Config, wanted=SPLITS):
    """Parallel files in config.data_dir: aligned text files, tab-separated pairs or JSON lines
    (see each reader); a split found in one format is not read again from another. The
    fingerprint is the folder's file names, sizes and modification times."""
    folder = Path(config.data_dir)
    if folder.is_file():
        raise DataError(f"--data_dir {folder} is a file; give the folder that holds the "
                        f"corpus files (train.{config.lang_src} + train.{config.lang_tgt}, "
                        f"train.tsv or train.jsonl)")
    if not folder.is_dir():
        raise DataError(f"--data_dir {folder}: no such folder")
    src, tgt = config.lang_src, config.lang_tgt
    languages = sorted(f.suffix[1:] for f in folder.glob("train.*")
                       if f.suffix not in (".tsv", ".jsonl", ".json"))
    other_formats = any((folder / f"train.{x}").exists() for x in ("tsv", "jsonl", "json"))
    missing = [x for x in (src, tgt) if not (folder / f"train.{x}").exists()]
    if languages and missing and not other_formats:  # before any other split is read
        missing = missing[0]
        raise DataError(f"--data_dir {folder} has no train.{missing} (training files there: "
                        f"{', '.join('train.' + x for x in languages)}); check --lang_src and "
                        f"--lang_tgt")
    splits = {}
    for reader in (_read_aligned, _read_tsv, _read_jsonl):
        reader(folder, src, tgt, splits, wanted)
    files = sorted((f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in folder.iterdir()
                   if f.is_file())
    splits["fingerprint"] = _digest(files)
    if "train" in wanted and "train" not in splits:
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


def _load_hub(config: Config, wanted=SPLITS):
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
    if "train" not in {_split_name(k) for k in raw}:
        raise DataError(f"dataset '{name}' has no train split (splits: {', '.join(raw)})")
    # the datasets library's own fingerprints of the downloaded splits identify the corpus
    splits = {"fingerprint": _digest(sorted((k, ds._fingerprint) for k, ds in raw.items()))}
    for split_name, ds in raw.items():
        split = _split_name(split_name)
        if split is None or split in splits:
            continue
        if split not in wanted:
            continue
        if "translation" not in ds.column_names:
            raise DataError(f"dataset '{name}' has no 'translation' column "
                            f"(columns: {', '.join(ds.column_names)})")
        first = ds[0]["translation"] if len(ds) else {src: "", tgt: ""}
        if src not in first or tgt not in first:
            raise DataError(f"dataset '{name}' has no {src}/{tgt} texts "
                            f"(languages: {', '.join(first)})")
        # column by column through Arrow, a chunk at a time: WMT's 4.5M pairs never become
        # Python dicts all at once
        flat = ds.flatten().select_columns([f"translation.{src}", f"translation.{tgt}"])
        tables, dropped = [], 0
        for batch in flat.iter(batch_size=100_000):
            table, d = _non_empty_pairs([s or "" for s in batch[f"translation.{src}"]],
                                        [s or "" for s in batch[f"translation.{tgt}"]])
            tables.append(table)
            dropped += d
        splits[split] = _to_dataset(tables, dropped, f"{name}:{split_name}")
    return splits


def load_corpus(config: Config, wanted=SPLITS):
    """{"train", "validation"(, "test")} -> datasets.Dataset with `src` and `tgt` columns, and
    "fingerprint": what identifies the corpus. Without a validation split of its own, a seeded
    `val_fraction` of train is held out, and splits["held_out"] is True. `wanted` names the
    splits to read (without "train", nothing is held out)."""
    splits = _load_local(config, wanted) if config.data_dir else _load_hub(config, wanted)
    if "train" not in wanted:
        return splits
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
                                f", not {value}; keep that value, or train into another "
                                f"--model_folder (these files belong to its checkpoints)")
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
        return load_tokenizer(path, config.tokenizer_type, recipe)
    tok = build_tokenizer(config.tokenizer_type, config.vocab_size,
                          texts() if callable(texts) else texts)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tok.save(str(tmp))
    _recipe_path(path).write_text(json.dumps(recipe), encoding="utf-8")
    os.replace(tmp, path)
    return tok


# ---- the dataset and its batches ----------------------------------------------------------------

class BilingualDataset(TorchDataset):
    """Items: encoder_input [SOS] src [EOS], decoder_input [SOS] tgt, label tgt [EOS]. The ids
    are lists, or TokenArrays of prepared data; the texts are kept for validation's scores and
    examples (training keeps none)."""

    def __init__(self, src_ids, tgt_ids, src_texts=None, tgt_texts=None):
        self.src_ids, self.tgt_ids = src_ids, tgt_ids
        self.src_texts, self.tgt_texts = src_texts, tgt_texts

    def __len__(self):
        return len(self.src_ids)

    def lengths(self):
        """Padded length of each pair in a batch: the longer of encoder input and label."""
        if isinstance(self.src_ids, TokenArray):
            return np.maximum(self.src_ids.lengths() + 2, self.tgt_ids.lengths() + 1)
        return [max(len(s) + 2, len(t) + 1) for s, t in zip(self.src_ids, self.tgt_ids)]

    def __getitem__(self, i):
        src = torch.as_tensor(np.asarray(self.src_ids[i], dtype=np.int64))  # (src_len - 2,)
        tgt = torch.as_tensor(np.asarray(self.tgt_ids[i], dtype=np.int64))  # (tgt_len - 1,)
        sos, eos = torch.tensor([SOS]), torch.tensor([EOS])
        return {
            "encoder_input": torch.cat([sos, src, eos]),  # (src_len,)
            "decoder_input": torch.cat([sos, tgt]),  # (tgt_len,)
            "label": torch.cat([tgt, eos]),  # (tgt_len,)
        }


class TokenArray:
    """Token-id sequences stored flat: `ids`, every sequence one after another, and `offsets`,
    where each starts (one more than there are sequences). Memory-mapped from the prepared
    data, so that ranks and DataLoader workers share the same pages instead of copies."""

    def __init__(self, ids, offsets):
        self.ids, self.offsets = ids, offsets

    def __getstate__(self):  # to a spawned DataLoader worker: the file's name, not its ids
        if isinstance(self.ids, np.memmap):
            return {"file": self.ids.filename, "dtype": self.ids.dtype.name,
                    "offsets": self.offsets}
        return self.__dict__

    def __setstate__(self, state):
        if "file" in state:
            state = {"ids": np.memmap(state["file"], dtype=state["dtype"], mode="r"),
                     "offsets": state["offsets"]}
        self.__dict__.update(state)

    def __len__(self):
        return len(self.offsets) - 1

    def __getitem__(self, i):
        return self.ids[self.offsets[i]:self.offsets[i + 1]]

    def lengths(self):
        return np.diff(self.offsets)


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
    run can skip the batches it already trained on (`set_epoch(epoch, start=k)`).

    Data-parallel (world_size > 1): every rank builds the same order and takes every
    world_size-th batch from its rank on. So that all ranks make the same number of steps
    without dropping or repeating a pair, the largest batches are first halved until the count
    divides by world_size."""

    def __init__(self, lengths, max_tokens: int = 0, batch_size: int = 0,
                 shuffle: bool = True, seed: int = 0, rank: int = 0, world_size: int = 1):
        self.lengths = torch.as_tensor(np.asarray(lengths, dtype=np.int64))
        longest = int(self.lengths.max()) if len(self.lengths) else 0
        if max_tokens and longest > max_tokens:
            raise ValueError(f"a pair of {longest} tokens does not fit max_tokens {max_tokens}")
        self.max_tokens, self.batch_size = max_tokens, batch_size
        self.shuffle, self.seed = shuffle, seed
        self.rank, self.world_size = rank, world_size
        self.epoch, self.start = 0, 0

    def set_epoch(self, epoch: int, start: int = 0):
        self.epoch, self.start = epoch, start

    def batches(self, epoch: int = None):
        epoch = self.epoch if epoch is None else epoch
        g = torch.Generator().manual_seed(self.seed * 1000003 + epoch)
        n, lengths = len(self.lengths), self.lengths
        if self.shuffle:
            perm = torch.randperm(n, generator=g)
            order = perm[torch.sort(lengths[perm], stable=True).indices]
        else:
            order = torch.sort(lengths, stable=True).indices
        order = order.numpy()
        cuts = self._cuts(lengths[order].numpy())
        batches = [order[a:b] for a, b in zip(cuts, cuts[1:])]  # index arrays, views of order
        if self.shuffle:
            batches = [batches[j] for j in torch.randperm(len(batches), generator=g).tolist()]
        if self.world_size > 1:
            batches = split_for_ranks(batches, self.world_size)[self.rank::self.world_size]
        return batches

    def _cuts(self, lengths):
        """Where the batches of pairs sorted by length (ascending) begin, and the end: greedy,
        each batch as long as (its size) x (its longest) stays within max_tokens. Computed a
        run of equal lengths at a time (a few hundred runs, not millions of pairs)."""
        n = len(lengths)
        if n == 0:
            return [0]
        if not self.max_tokens:
            return list(range(0, n, self.batch_size)) + [n]
        values, firsts = np.unique(lengths, return_index=True)
        cuts, start = [0], 0  # the open batch is [start, i)
        for length, i, run_end in zip(values.tolist(), firsts.tolist(),
                                      firsts[1:].tolist() + [n]):
            cap = self.max_tokens // length  # pairs in a batch whose longest has this length
            if i - start >= cap:  # the open batch is full
                cuts.append(i)
                start = i
            i = min(i + cap - (i - start), run_end)
            while i < run_end:
                cuts.append(i)
                start, i = i, min(i + cap, run_end)
        return cuts + [n]

    def __iter__(self):
        for batch in self.batches()[self.start:]:
            yield batch.tolist()

    def __len__(self):
        return len(self.batches()) - self.start


def split_for_ranks(batches, world_size: int):
    """The batches, with the largest halved (in place in the order) until their count divides
    by world_size; refuses when there are too few pairs."""
    batches = list(batches)
    while len(batches) % world_size:
        i = max(range(len(batches)), key=lambda j: len(batches[j]))
        if len(batches[i]) < 2:
            raise DataError(f"too little training data for {world_size} processes: "
                            f"{len(batches)} pairs cannot be shared out evenly")
        half = len(batches[i]) // 2
        batches[i:i + 1] = [batches[i][:half], batches[i][half:]]
    return batches


@dataclass
class Data:
    tokenizer_src: object
    tokenizer_tgt: object
    train: BilingualDataset
    validation: BilingualDataset
    held_out: bool  # the validation pairs were drawn from the training split
    test: tuple = None  # (source texts, reference texts) of the test split, if there is one
    key: str = None  # what the prepared data was made from (see prepared_key)
    corpus: dict = None  # {"source", "fingerprint"}: the corpus (recorded in checkpoints)


def encode_pairs(src_texts, tgt_texts, tokenizer_src, tokenizer_tgt, seq_len: int):
    """Token ids of pairs, and the indices of those that fit seq_len ([SOS], [EOS] included)."""
    src = [e.ids for e in tokenizer_src.encode_batch(src_texts)]
    tgt = [e.ids for e in tokenizer_tgt.encode_batch(tgt_texts)]
    keep = [i for i in range(len(src)) if len(src[i]) + 2 <= seq_len and len(tgt[i]) + 2 <= seq_len]
    return src, tgt, keep


def dropped_note(name: str, dropped: int, total: int, seq_len: int):
    if dropped:
        note(f"{name}: dropped {dropped} of {total} pairs longer than seq_len {seq_len}")
    if dropped == total:
        raise DataError(f"{name}: no pair fits --seq_len {seq_len}")


def to_bilingual(src_texts, tgt_texts, tokenizer_src, tokenizer_tgt, seq_len: int, name: str):
    """A BilingualDataset of the pairs that fit seq_len, texts kept (validation)."""
    src, tgt, keep = encode_pairs(src_texts, tgt_texts, tokenizer_src, tokenizer_tgt, seq_len)
    dropped_note(name, len(src) - len(keep), len(src), seq_len)
    return BilingualDataset([src[i] for i in keep], [tgt[i] for i in keep],
                            [src_texts[i] for i in keep], [tgt_texts[i] for i in keep])


# ---- prepared data: the training split as token ids on disk, memory-mapped ----------------------

PREPARED_FORMAT = 1
CHUNK = 50_000  # pairs encoded at a time (tokenizers spreads each chunk over all cores)


def _digest(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:32]


def prepared_parts(config: Config, fingerprint: str, tokenizer_src, tokenizer_tgt,
                   held_out: bool) -> dict:
    """What prepared data depends on: the corpus, the tokenizers, seq_len, and (only for a
    validation split held out of train) seed and val_fraction."""
    return {"format": PREPARED_FORMAT, "corpus": fingerprint,
            "languages": [config.lang_src, config.lang_tgt], "seq_len": config.seq_len,
            "tokenizers": [hashlib.sha256(t.to_str().encode()).hexdigest()
                           for t in (tokenizer_src, tokenizer_tgt)],
            "split": [config.seed, config.val_fraction] if held_out else None}


def prepared_key(parts: dict) -> str:
    return _digest(parts)


PART_NAMES = {"format": "an earlier version of this code", "corpus": "another corpus",
              "languages": "other languages", "seq_len": "another --seq_len",
              "tokenizers": "other tokenizers",
              "split": "another --seed or --val_fraction (held-out validation split)"}


def prepared_folder(config: Config) -> Path:
    return Path(config.model_folder) / "prepared"


def _crc32(path: Path) -> int:
    crc = 0
    with open(path, "rb") as f:
        while block := f.read(1 << 24):
            crc = zlib.crc32(block, crc)
    return crc


def prepare(folder: Path, parts: dict, splits, tokenizer_src, tokenizer_tgt, seq_len: int):
    """Encodes the training split chunk by chunk into flat id files (uint16 when the vocabulary
    allows) with their offsets, and keeps the validation texts; written to a temporary folder
    that replaces `folder` only when complete, its checksums last."""
    started = time.time()
    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    vocab = max(tokenizer_src.get_vocab_size(), tokenizer_tgt.get_vocab_size())
    dtype = np.uint16 if vocab <= 1 << 16 else np.int32
    lengths, total = {"src": [], "tgt": []}, 0
    bar = tqdm(total=len(splits["train"]), desc="encoding", unit=" pairs", unit_scale=True,
               disable=None)  # shown on a terminal only
    with open(tmp / "train.src.bin", "wb") as fs, open(tmp / "train.tgt.bin", "wb") as ft:
        for batch in splits["train"].iter(batch_size=CHUNK):
            bar.update(len(batch["src"]))
            src, tgt, keep = encode_pairs(batch["src"], batch["tgt"], tokenizer_src,
                                          tokenizer_tgt, seq_len)
            total += len(src)
            for side, ids, f in (("src", src, fs), ("tgt", tgt, ft)):
                kept = [ids[i] for i in keep]
                n = np.fromiter(map(len, kept), np.int64, len(kept))
                f.write(np.fromiter(itertools.chain.from_iterable(kept), dtype,
                                    int(n.sum())).tobytes())
                lengths[side].append(n)
    bar.close()
    for side in ("src", "tgt"):
        n = np.concatenate(lengths[side])
        np.save(tmp / f"train.{side}.offsets.npy", np.concatenate([[0], np.cumsum(n)]))
    validation = splits["validation"]
    (tmp / "validation.json").write_text(json.dumps(
        {"src": column(validation, "src"), "tgt": column(validation, "tgt")}), encoding="utf-8")
    meta = {"format": PREPARED_FORMAT, "key": prepared_key(parts), "parts": parts,
            "dtype": np.dtype(dtype).name,
            "pairs": total, "kept": int(sum(len(n) for n in lengths["src"])),
            "seq_len": seq_len, "held_out": bool(splits.get("held_out")),
            "checksums": {f.name: _crc32(f) for f in sorted(tmp.iterdir())}}
    (tmp / "meta.json").write_text(json.dumps(meta), encoding="utf-8")
    shutil.rmtree(folder, ignore_errors=True)
    os.replace(tmp, folder)
    note(f"prepared {meta['kept']} training pairs in {folder} ({time.time() - started:.0f}s)")


def load_prepared(folder: Path, key: str, verify: bool = True, parts: dict = None):
    """(train BilingualDataset over memory-mapped ids, validation texts, meta), or None when
    there is no prepared data, or it was made from something else (stale) or, with `verify`,
    does not match its checksums (damaged): then it is prepared again, saying why."""
    try:
        meta = json.loads((folder / "meta.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if meta.get("key") != key:
        changed = [PART_NAMES[k] for k in PART_NAMES if "parts" in meta and parts
                   and parts.get(k) != meta["parts"].get(k)]
        note(f"{folder} was prepared for {' and '.join(changed) or 'other data'}: preparing "
             f"again")
        return None
    for name, crc in meta["checksums"].items() if verify else ():
        if not (folder / name).is_file() or _crc32(folder / name) != crc:
            note(f"{folder}/{name} is damaged or missing: preparing again")
            return None
    sides = []
    for side in ("src", "tgt"):
        offsets = np.load(folder / f"train.{side}.offsets.npy")
        path = folder / f"train.{side}.bin"
        ids = (np.memmap(path, dtype=meta["dtype"], mode="r") if path.stat().st_size else
               np.zeros(0, dtype=meta["dtype"]))
        sides.append(TokenArray(ids, offsets))
    validation = json.loads((folder / "validation.json").read_text(encoding="utf-8"))
    return BilingualDataset(*sides), validation, meta


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


def corpus_source(config: Config) -> str:
    """Where the corpus comes from: --data_dir, or --datasource (local folders absolute)."""
    name = config.data_dir or config.datasource
    return str(Path(name).resolve()) if config.data_dir or Path(name).exists() else name


def get_ds(config: Config, key: str = None, check_corpus=None) -> Data:
    """The tokenizers and the prepared training data: made once (tokenizers trained on a sample
    of train, the training split encoded to memory-mapped arrays), then loaded in seconds by
    every later start, resume and torchrun rank, as long as corpus, tokenizers and seq_len are
    the same. Validation and test texts are kept in memory; training texts are not. `key`:
    under torchrun, the key of the data rank 0 has just prepared or checked, which the other
    ranks load (their own copy of the corpus files may differ in modification times).
    `check_corpus`: called with the corpus ({"source", "fingerprint"}) before anything is
    prepared (a resume refuses another corpus there)."""
    _quiet_datasets()
    folder = prepared_folder(config)
    # the fingerprint, the test texts, and whether validation must be held out of train
    splits = load_corpus(config, wanted=("validation", "test"))
    held_out = "validation" not in splits
    corpus = {"source": corpus_source(config), "fingerprint": splits["fingerprint"]}
    if check_corpus is not None:
        check_corpus(corpus)
    prepared = None
    if all(tokenizer_path(config, k).exists() for k in tokenizer_keys(config)):
        tokenizer_src, tokenizer_tgt = get_tokenizers(config, None)
        verify = key is None  # a rank other than 0 is given the key of data rank 0 just checked
        parts = prepared_parts(config, splits["fingerprint"], tokenizer_src, tokenizer_tgt,
                               held_out)
        key = key or prepared_key(parts)
        prepared = load_prepared(folder, key, verify, parts)
    if prepared is None and not is_main():  # rank 0 has just made them: this process must see them
        raise DataError(f"{folder}: no tokenizers and prepared data matching this corpus, after "
                        f"rank 0 made them. Under torchrun on several machines, --model_folder "
                        f"must be one folder all of them see (a shared filesystem)")
    if prepared is None:
        full = load_corpus(config)
        note(f"preparing the data in {folder} (once: later starts load it)")
        tokenizer_src, tokenizer_tgt = get_tokenizers(config, full["train"])
        parts = prepared_parts(config, full["fingerprint"], tokenizer_src, tokenizer_tgt,
                               bool(full.get("held_out")))
        prepare(folder, parts, full, tokenizer_src, tokenizer_tgt, config.seq_len)
        del full
        # its checksums were just taken
        prepared = load_prepared(folder, prepared_key(parts), verify=False)
    train, val_texts, meta = prepared
    dropped_note("train", meta["pairs"] - meta["kept"], meta["pairs"], config.seq_len)
    validation = to_bilingual(val_texts["src"], val_texts["tgt"], tokenizer_src, tokenizer_tgt,
                              config.seq_len, "validation")
    test = None
    if "test" in splits:
        test = (column(splits["test"], "src"), column(splits["test"], "tgt"))
    vocabulary = (f"{tokenizer_src.get_vocab_size()} (joint)" if config.shared_vocab else
                  f"{tokenizer_src.get_vocab_size()} ({config.lang_src}) / "
                  f"{tokenizer_tgt.get_vocab_size()} ({config.lang_tgt})")
    note(f"data: {len(train)} training pairs, {len(validation)} validation pairs"
         + (f", {len(test[0])} test pairs" if test else "") + f"; vocabulary {vocabulary}")
    return Data(tokenizer_src, tokenizer_tgt, train, validation, held_out=meta["held_out"],
                test=test, key=meta["key"], corpus=corpus)
