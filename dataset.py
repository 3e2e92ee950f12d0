"""Masked batches for training and validation, and the prepared training data.

get_ds -> the tokenizers and the training split prepared once (token ids in memory-mapped files,
          long pairs dropped) and reloaded in seconds; validation encoded; wrapped for a DataLoader
BilingualDataset + Collator -> batches padded to their longest sequence, with the source mask

Which pairs make a batch is nmt/batching.py's (token batches), fixed batch shapes are
nmt/shapes.py's, BPE-dropout's batches nmt/bpe_dropout.py's.
"""

import itertools
import json
import os
import shutil
import time
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset as TorchDataset
from tqdm import tqdm

from config import Config, is_main
from corpus import (CORPUS_FINGERPRINT, DataError, column, corpus_source, digest, load_corpus, note,
                    pairs_digest, quiet_datasets)
from tokenizer import (EOS, PAD, SOS, coverage, get_tokenizers, recipe_path, tokenizer_fingerprint,
                       tokenizer_keys, tokenizer_path)


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

    def __getitems__(self, indices):
        """A batch at once (the DataLoader calls this in place of __getitem__ for each index):
        from prepared data, the batch's three id tensors, padded in a few array operations (item
        by item it took 70 ms for 25,000 tokens, as long as an H100's training step of the base
        model; the collator adds the mask); from lists, the items."""
        if not isinstance(self.src_ids, TokenArray):
            return [self[i] for i in indices]
        indices = np.asarray(indices, dtype=np.int64)
        src, src_len = self.src_ids.padded(indices)  # (batch, max_src), (batch,)
        tgt, tgt_len = self.tgt_ids.padded(indices)  # (batch, max_tgt), (batch,)
        rows = np.arange(len(indices))
        sos = np.full((len(indices), 1), SOS, dtype=np.int64)  # (batch, 1)
        pad = np.full((len(indices), 1), PAD, dtype=np.int64)  # (batch, 1)
        enc = np.concatenate([sos, src, pad], axis=1)  # (batch, max_src + 2)
        enc[rows, src_len + 1] = EOS
        label = np.concatenate([tgt, pad], axis=1)  # (batch, max_tgt + 1)
        label[rows, tgt_len] = EOS
        return {"encoder_input": torch.from_numpy(enc),
                "decoder_input": torch.from_numpy(np.concatenate([sos, tgt], axis=1)),
                "label": torch.from_numpy(label)}

    def __getitem__(self, i):
        tgt = torch.as_tensor(np.asarray(self.tgt_ids[i], dtype=np.int64))  # (tgt_len - 1,)
        sos, eos = torch.tensor([SOS]), torch.tensor([EOS])
        return {
            "encoder_input": framed_source(self.src_ids[i]),  # (src_len,)
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

    def padded(self, indices: np.ndarray):
        """The sequences `indices`, right-padded with PAD into one int64 array, and their
        lengths: one gather from the flat ids, no loop over the sequences."""
        starts = self.offsets[indices]  # (batch,)
        lengths = self.offsets[indices + 1] - starts  # (batch,)
        columns = np.arange(lengths.max(initial=0))  # (max_len,)
        real = columns < lengths[:, None]  # (batch, max_len)
        at = np.where(real, starts[:, None] + columns, 0)  # (batch, max_len)
        return np.where(real, self.ids[at], PAD).astype(np.int64), lengths


def real_tokens(batch) -> int:
    """Non-padding source and target tokens of a batch: what throughput counts (the rows that
    fill a fixed shape, weightless, not counted)."""
    real = batch["label"] != PAD  # (batch, tgt_len)
    filler = int((~real.any(dim=1)).sum())  # rows with no target: each holds [SOS] [EOS]
    return int((batch["encoder_input"] != PAD).sum() + real.sum()) - 2 * filler


class Collator:
    """Pads a list of items to the longest sequence of the batch and builds the source mask.

    The decoder needs no mask tensor: its self-attention is causal (the model applies it
    inside attention, so the flash kernel can run), and for right-padded targets that is
    enough, since a real position never sees a later padded one and the loss ignores padding.
    `shapes` (nmt.shapes.FixedShapes): each batch padded on to its fixed shape."""

    def __init__(self, pad_id: int = PAD, shapes=None):
        self.pad_id, self.shapes = pad_id, shapes

    def __call__(self, items):
        if isinstance(items, dict):  # ids BilingualDataset.__getitems__ has padded
            enc, dec, label = items["encoder_input"], items["decoder_input"], items["label"]
        else:
            pad = torch.nn.utils.rnn.pad_sequence
            enc = pad([it["encoder_input"] for it in items], batch_first=True,
                      padding_value=self.pad_id)  # (batch, src_len)
            dec = pad([it["decoder_input"] for it in items], batch_first=True,
                      padding_value=self.pad_id)  # (batch, tgt_len)
            label = pad([it["label"] for it in items], batch_first=True,
                        padding_value=self.pad_id)  # (batch, tgt_len)
        batch = {"encoder_input": enc, "decoder_input": dec, "label": label,
                 "encoder_mask": encoder_mask(enc, self.pad_id)}  # (batch, 1, 1, src_len)
        return self.shapes.pad(batch) if self.shapes else batch


def framed_source(ids, seq_len: int = None, sos_id: int = SOS, eos_id: int = EOS):
    """The encoder's input for one sentence of source ids (no special tokens): [SOS] ids [EOS],
    the ids cut to seq_len - 2 if seq_len is given. (BilingualDataset.__getitems__ frames a
    batch of prepared data the same way in array operations.)"""
    ids = list(ids) if seq_len is None else list(ids)[:seq_len - 2]
    return torch.tensor([sos_id, *ids, eos_id], dtype=torch.int64)  # (len(ids) + 2,)


def encoder_mask(src, pad_id: int = PAD):
    """(batch, 1, 1, src_len), True at real tokens: the source mask of a padded batch."""
    return (src != pad_id)[:, None, None, :]


def source_batch(sources, seq_len: int, sos_id: int = SOS, eos_id: int = EOS,
                 pad_id: int = PAD):
    """Sentences of source ids, framed (`framed_source`) and right-padded for the encoder:
    (src (batch, src_len), src_mask (batch, 1, 1, src_len))."""
    src = torch.nn.utils.rnn.pad_sequence([framed_source(ids, seq_len, sos_id, eos_id)
                                           for ids in sources],
                                          batch_first=True, padding_value=pad_id)
    return src, encoder_mask(src, pad_id)


@dataclass
class Data:
    tokenizer_src: object
    tokenizer_tgt: object
    train: BilingualDataset
    validation: BilingualDataset
    held_out: bool  # the validation pairs were drawn from the training split
    test: dict = None  # each test set's name: (source texts, reference texts); None if none
    key: str = None  # what the prepared data was made from (see prepared_key)
    corpus: dict = None  # {"source", "fingerprint"}: the corpus (recorded in checkpoints)
    tokenizers: list = None  # the tokenizers' fingerprints, [source, target] (the same)
    coverage: dict = None  # per side, tokenizer.coverage of the validation texts


def encode_pairs(src_texts, tgt_texts, tokenizer_src, tokenizer_tgt, seq_len: int):
    """Token ids of pairs, and the indices of those that fit seq_len ([SOS], [EOS] included)."""
    src = [e.ids for e in tokenizer_src.encode_batch(src_texts)]
    tgt = [e.ids for e in tokenizer_tgt.encode_batch(tgt_texts)]
    keep = [i for i in range(len(src)) if len(src[i]) + 2 <= seq_len and len(tgt[i]) + 2 <= seq_len]
    return src, tgt, keep


def balanced(src_len: int, tgt_len: int, max_len_ratio: float) -> bool:
    """Whether a pair's sides are within --max_len_ratio of each other in tokens (0: any), as
    Moses' clean-corpus-n.perl -ratio (fairseq's WMT preparation)."""
    return not max_len_ratio or max(src_len, tgt_len) <= max_len_ratio * min(src_len, tgt_len)


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


def prepared_parts(config: Config, fingerprint: str, tokenizer_src, tokenizer_tgt,
                   held_out: bool) -> dict:
    """What prepared data depends on: the corpus, the tokenizers, seq_len, --max_len_ratio
    (where it is set: data prepared before it keeps its key) and (only for a validation split
    held out of train) seed and val_fraction."""
    return {"format": PREPARED_FORMAT, "corpus": fingerprint,
            "languages": [config.lang_src, config.lang_tgt], "seq_len": config.seq_len,
            "tokenizers": [tokenizer_fingerprint(t) for t in (tokenizer_src, tokenizer_tgt)],
            "split": [config.seed, config.val_fraction] if held_out else None,
            **({"max_len_ratio": config.max_len_ratio} if config.max_len_ratio else {})}


def prepared_key(parts: dict) -> str:
    return digest(parts)


PART_NAMES = {"format": "an earlier version of this code", "corpus": "another corpus",
              "languages": "other languages", "seq_len": "another --seq_len",
              "tokenizers": "other tokenizers",
              "split": "another --seed or --val_fraction (held-out validation split)",
              "max_len_ratio": "another --max_len_ratio"}


def prepared_folder(config: Config) -> Path:
    return Path(config.model_folder) / "prepared"


def _crc32(path: Path) -> int:
    crc = 0
    with open(path, "rb") as f:
        while block := f.read(1 << 24):
            crc = zlib.crc32(block, crc)
    return crc


def prepare(folder: Path, parts: dict, splits, tokenizer_src, tokenizer_tgt, seq_len: int,
            max_len_ratio: float = 0.0):
    """Encodes the training split chunk by chunk into flat id files (uint16 when the vocabulary
    allows) with their offsets, the pairs that fit seq_len and max_len_ratio (`balanced`), and
    keeps the validation texts; written to a temporary folder that replaces `folder` only when
    complete, its checksums last."""
    started = time.time()
    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    vocab = max(tokenizer_src.get_vocab_size(), tokenizer_tgt.get_vocab_size())
    dtype = np.uint16 if vocab <= 1 << 16 else np.int32
    lengths, total, shortest, unbalanced = {"src": [], "tgt": []}, 0, None, 0
    bar = tqdm(total=len(splits["train"]), desc="encoding", unit=" pairs", unit_scale=True,
               disable=None)  # shown on a terminal only
    with open(tmp / "train.src.bin", "wb") as fs, open(tmp / "train.tgt.bin", "wb") as ft:
        for batch in splits["train"].iter(batch_size=CHUNK):
            bar.update(len(batch["src"]))
            src, tgt, keep = encode_pairs(batch["src"], batch["tgt"], tokenizer_src,
                                          tokenizer_tgt, seq_len)
            total += len(src)
            fits = len(keep)
            keep = [i for i in keep if balanced(len(src[i]), len(tgt[i]), max_len_ratio)]
            unbalanced += fits - len(keep)
            needs = [max(len(a), len(b)) + 2 for a, b in zip(src, tgt)]  # with [SOS], [EOS]
            shortest = min(needs + ([shortest] if shortest else [])) if needs else shortest
            for side, ids, f in (("src", src, fs), ("tgt", tgt, ft)):
                kept = [ids[i] for i in keep]
                n = np.fromiter(map(len, kept), np.int64, len(kept))
                f.write(np.fromiter(itertools.chain.from_iterable(kept), dtype,
                                    int(n.sum())).tobytes())
                lengths[side].append(n)
    bar.close()
    if total and not sum(len(n) for n in lengths["src"]):  # refused before anything is kept
        shutil.rmtree(tmp, ignore_errors=True)
        if unbalanced:
            raise DataError(f"no training pair fits --seq_len {seq_len} and --max_len_ratio "
                            f"{max_len_ratio:g}: {unbalanced} of the {total} fit --seq_len, "
                            f"but their sides' lengths differ more")
        raise DataError(f"no training pair fits --seq_len {seq_len}: the shortest needs "
                        f"{shortest} tokens with [SOS] and [EOS]")
    for side in ("src", "tgt"):
        n = np.concatenate(lengths[side])
        np.save(tmp / f"train.{side}.offsets.npy", np.concatenate([[0], np.cumsum(n)]))
    validation = splits["validation"]
    (tmp / "validation.json").write_text(json.dumps(
        {"src": column(validation, "src"), "tgt": column(validation, "tgt")}), encoding="utf-8")
    meta = {"format": PREPARED_FORMAT, "key": prepared_key(parts), "parts": parts,
            "dtype": np.dtype(dtype).name,
            "pairs": total, "kept": int(sum(len(n) for n in lengths["src"])),
            "unbalanced": unbalanced,
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


def prepare_once(config: Config, folder: Path):
    """Trains the tokenizers (where their files do not exist) and prepares the training split:
    (tokenizer_src, tokenizer_tgt, what the prepared data depends on). A failure removes the
    tokenizer files it made: a refused start leaves the folder as it found it."""
    full = load_corpus(config)
    note(f"preparing the data in {folder} (once: later starts load it)")
    made = [p for key in dict.fromkeys(tokenizer_keys(config))
            for p in (tokenizer_path(config, key), recipe_path(tokenizer_path(config, key)))
            if not p.exists()]
    try:
        tokenizer_src, tokenizer_tgt = get_tokenizers(config, full.get("real", full["train"]))
        parts = prepared_parts(config, full["fingerprint"], tokenizer_src, tokenizer_tgt,
                               bool(full.get("held_out")))
        prepare(folder, parts, full, tokenizer_src, tokenizer_tgt, config.seq_len,
                config.max_len_ratio)
    except BaseException as e:
        for p in made:
            p.unlink(missing_ok=True)
        shutil.rmtree(folder.with_name(folder.name + ".tmp"), ignore_errors=True)
        if isinstance(e, OSError):  # a full disk, a folder that became unwritable
            raise DataError(f"could not write {e.filename or folder}: {e.strerror or e}; the "
                            f"files already there are untouched") from None
        raise
    return tokenizer_src, tokenizer_tgt, parts


def get_ds(config: Config, key: str = None, check_corpus=None, check_tokenizers=None) -> Data:
    """The tokenizers and the prepared training data: made once (tokenizers trained on a sample of
    train, the training split encoded to memory-mapped arrays), then loaded in seconds by every
    later start, resume and torchrun rank, as long as corpus, tokenizers, seq_len and
    --max_len_ratio are the same. Validation and test texts are kept in memory; training texts are
    not. `key`: under torchrun, the key of the data rank 0 has just prepared or checked, which the
    other ranks load (without reading their own copy of the corpus to check it again).
    `check_corpus`: called with the corpus ({"source", "fingerprint"}) before anything is prepared
    (a resume refuses another corpus there); `check_tokenizers`: called with the tokenizers found in
    the model folder, before their data is looked for or prepared."""
    quiet_datasets()
    folder = prepared_folder(config)
    # the fingerprint, the test texts, and whether validation must be held out of train
    splits = load_corpus(config, wanted=("validation", "test"))
    held_out = "validation" not in splits
    corpus = {"source": corpus_source(config), "fingerprint": splits["fingerprint"],
              "text": splits["text"], "version": CORPUS_FINGERPRINT,
              **({"distilled": splits["distilled"]} if "distilled" in splits else {})}
    if check_corpus is not None:
        check_corpus(corpus)
    prepared = None
    if all(tokenizer_path(config, k).exists() for k in tokenizer_keys(config)):
        tokenizer_src, tokenizer_tgt = get_tokenizers(config, None)
        if check_tokenizers is not None:
            check_tokenizers(tokenizer_src, tokenizer_tgt)
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
        tokenizer_src, tokenizer_tgt, parts = prepare_once(config, folder)
        # its checksums were just taken
        prepared = load_prepared(folder, prepared_key(parts), verify=False)
    train, val_texts, meta = prepared
    # the validation split's pairs (before seq_len's cut): translate.py --example checks by it
    corpus = {**corpus, "validation": pairs_digest(val_texts["src"], val_texts["tgt"])}
    unbalanced = meta.get("unbalanced", 0)  # (data prepared before --max_len_ratio: none)
    dropped_note("train", meta["pairs"] - meta["kept"] - unbalanced, meta["pairs"],
                 config.seq_len)
    if unbalanced:
        note(f"train: dropped {unbalanced} of {meta['pairs']} pairs whose longer side has more "
             f"than --max_len_ratio {config.max_len_ratio:g} times the tokens of the shorter")
    validation = to_bilingual(val_texts["src"], val_texts["tgt"], tokenizer_src, tokenizer_tgt,
                              config.seq_len, "validation")
    test = {name: (column(ds, "src"), column(ds, "tgt"))
            for name, ds in sorted(splits.get("test", {}).items())} or None
    if config.extra_tag and tokenizer_src.token_to_id(config.extra_tag) is None:
        note(f"the source tokenizer has no token for --extra_tag {config.extra_tag} (made "
             f"without the flag, or before tags became tokens): the tag is encoded as text, "
             f"{len(tokenizer_src.encode(config.extra_tag).ids)} tokens")
    vocabulary = (f"{tokenizer_src.get_vocab_size()} (joint)" if config.shared_vocab else
                  f"{tokenizer_src.get_vocab_size()} ({config.lang_src}) / "
                  f"{tokenizer_tgt.get_vocab_size()} ({config.lang_tgt})")
    unused = not meta["held_out"] and config.val_fraction != Config.val_fraction
    note(f"data: {len(train)} training pairs, {len(validation)} validation pairs"
         + (f" (the corpus's own: --val_fraction {config.val_fraction} is not used)"
            if unused else "")
         + "".join(f", {len(src)} test pairs ({name})" for name, (src, _) in (test or {}).items())
         + f"; vocabulary {vocabulary}")
    cover = {"source": coverage(tokenizer_src, validation.src_texts, validation.src_ids),
             "target": coverage(tokenizer_tgt, validation.tgt_texts, validation.tgt_ids)}
    return Data(tokenizer_src, tokenizer_tgt, train, validation, held_out=meta["held_out"],
                test=test, key=meta["key"], corpus=corpus, tokenizers=parts["tokenizers"],
                coverage=cover)
