"""Reading a parallel corpus: local files (aligned text, TSV, JSON lines) or a Hugging Face
dataset (the hub, or a local folder laid out like a hub repository).

load_corpus -> {"train", "validation", maybe "test": {name: ...}}: `datasets.Dataset`s with
               `src`/`tgt` text (every test set by name), and "fingerprint": what identifies
               the corpus (recorded in checkpoints)
"""

import dataclasses
import gzip
import hashlib
import itertools
import json
import os
import shutil
import sys
import uuid
import zlib
from pathlib import Path

from config import Config, UserError, is_main

VAL_NAMES = ("validation", "valid", "val", "dev")
SPLITS = ("train", "validation", "test")

def note(message: str):
    """Data messages go to stderr, so translate.py's stdout holds translations only; under
    torchrun, from rank 0 only."""
    if is_main():
        print(message, file=sys.stderr)


class DataError(UserError):
    """A problem with the user's corpus or tokenizer files."""


class LanguageMissing(DataError):
    """A folder (--data_dir, --extra_data_dir) whose training files are of other languages:
    `what` says what was found, `fix` what to do (where the languages are a trained model's, or
    the corpus's, not flags to check, another fix)."""

    def __init__(self, what: str, fix: str = "check --lang_src and --lang_tgt"):
        super().__init__(f"{what}; {fix}")
        self.what = what


def quiet_datasets():
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


def _unread(splits: dict, split, name: str, wanted) -> bool:
    """Whether a file or hub split of `split`, named `name`, is still to be read: one train and
    one validation split (the first found), and every test set."""
    if split not in wanted:
        return False
    return name not in splits.get("test", {}) if split == "test" else split not in splits


def _keep(splits: dict, split: str, name: str, ds):
    """Stores a split read: the test sets by name ({"test_2016_flickr": ..., ...})."""
    if split == "test":
        splits.setdefault("test", {})[name] = ds
    else:
        splits[split] = ds


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


def _open_text(path: Path):
    """A file's bytes a line at a time: gzip-compressed ones (*.gz) unpacked as they are read."""
    return gzip.open(path, "rb") if path.name.endswith(".gz") else open(path, "rb")


def read_lines(path: Path) -> list:
    """The lines of a UTF-8 text file, plain or gzip-compressed (*.gz)."""
    try:
        with _open_text(Path(path)) as f:
            data = f.read()
    except (OSError, EOFError, zlib.error) as e:
        packed = Path(f"{path}.gz")  # Multi30k's raw files come packed: name the one that is
        hint = f" ({packed} is there: name it, or unpack it with gunzip -k {packed})" \
            if isinstance(e, FileNotFoundError) and packed.is_file() else ""
        raise DataError(f"cannot read {path}: {getattr(e, 'strerror', None) or e}{hint}") \
            from None
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


def text_file_name(path: Path):
    """(stem, language) of an aligned text file, plain or gzip-compressed as Multi30k's raw
    files come: train.en and train.en.gz are both ("train", "en"); (stem, "") for no language."""
    name = path.name[:-3] if path.name.endswith(".gz") else path.name
    stem, _, language = name.rpartition(".")
    return (stem, language) if stem else (name, "")


def language_files(folder: Path, language: str) -> dict:
    """The aligned text files of a language in a folder, {stem: path}: `stem.language`, or
    where there is none `stem.language.gz`."""
    found = {}
    for path in sorted(folder.glob(f"*.{language}.gz")) + sorted(folder.glob(f"*.{language}")):
        found[text_file_name(path)[0]] = path  # the plain file, globbed last, wins
    return dict(sorted(found.items()))


def _aligned_dataset(src_file: Path, tgt_file: Path, chunk: int = 100_000):
    """Two line-aligned files (each plain or .gz) read together, `chunk` lines at a time, into
    an Arrow table: no Python list of a whole (WMT-size) file is ever held."""
    tables, dropped, n = [], 0, 0
    reading = src_file
    try:
        with _open_text(src_file) as fs, _open_text(tgt_file) as ft:
            while True:
                reading = src_file
                a = list(itertools.islice(fs, chunk))
                reading = tgt_file
                b = list(itertools.islice(ft, chunk))
                if len(a) != len(b):
                    reading = src_file
                    n_src = n + len(a) + sum(1 for _ in fs)
                    reading = tgt_file
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
    except (OSError, EOFError, zlib.error) as e:  # gzip: BadGzipFile (an OSError), EOFError
        why = getattr(e, "strerror", None) or str(e) or type(e).__name__
        raise DataError(f"cannot read {getattr(e, 'filename', None) or reading}: {why}") \
            from None
    return _to_dataset(tables, dropped, f"{src_file.name}/{tgt_file.name}")


def _read_aligned(folder: Path, src: str, tgt: str, splits: dict, wanted=SPLITS):
    """train.en + train.de (+ val.*, valid.*, dev.*, test*.*), one sentence a line, each file
    plain or gzip-compressed (train.en.gz, as Multi30k's raw files come)."""
    targets = language_files(folder, tgt)
    for stem, src_file in language_files(folder, src).items():
        split = _split_name(stem)
        if not _unread(splits, split, stem, wanted):
            continue
        if stem not in targets:
            raise DataError(f"{src_file} has no matching target file "
                            f"{src_file.with_name(f'{stem}.{tgt}')}")
        _keep(splits, split, stem, _aligned_dataset(src_file, targets[stem]))


def _read_tsv(folder: Path, src: str, tgt: str, splits: dict, wanted=SPLITS):
    """train.tsv (+ val.tsv, test.tsv), or a single *.tsv: 'source<TAB>target' a line, with an
    optional header line naming the two languages; further columns (attribution) are ignored."""
    tsv_files = sorted(folder.glob("*.tsv"))
    for tsv in tsv_files:
        split = _split_name(tsv.stem) or ("train" if len(tsv_files) == 1 else None)
        if not _unread(splits, split, tsv.stem, wanted):
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
        _keep(splits, split, tsv.stem, _pairs_to_dataset(src_lines, tgt_lines, tsv.name))


def _read_jsonl(folder: Path, src: str, tgt: str, splits: dict, wanted=SPLITS):
    """train.jsonl (+ validation.jsonl ...): {"translation": {"en": ..., "de": ...}} a line."""
    for jl in sorted(list(folder.glob("*.jsonl")) + list(folder.glob("*.json"))):
        split = _split_name(jl.stem)
        if not _unread(splits, split, jl.stem, wanted):
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
        _keep(splits, split, jl.stem, _pairs_to_dataset(src_lines, tgt_lines, jl.name))


def _load_local(config: Config, wanted=SPLITS, flag: str = "--data_dir"):
    """Parallel files in the folder of `flag` (config.data_dir, or config.extra_data_dir):
    aligned text files, tab-separated pairs or JSON lines (see each reader); a split found in
    one format is not read again from another. The fingerprint is the names and texts of the
    folder's files this language pair could read (not their times, nor whether they are packed:
    a copy of the corpus, or its files unpacked, is the same corpus). Messages name `flag`."""
    folder = Path(getattr(config, flag.removeprefix("--")))
    if folder.is_file():
        raise DataError(f"{flag} {folder} is a file; give the folder that holds the "
                        f"corpus files (train.{config.lang_src} + train.{config.lang_tgt}, "
                        f"train.tsv or train.jsonl)")
    if not folder.is_dir():
        raise DataError(f"{flag} {folder}: no such folder")
    src, tgt = config.lang_src, config.lang_tgt
    train_files = sorted(f.name for f in folder.glob("train.*")
                         if text_file_name(f)[1] not in ("", "tsv", "jsonl", "json"))
    other_formats = any((folder / f"train.{x}").exists() for x in ("tsv", "jsonl", "json"))
    missing = [x for x in (src, tgt) if "train" not in language_files(folder, x)]
    if train_files and missing and not other_formats:  # before any other split is read
        what = (f"{flag} {folder} has no train.{missing[0]} (training files there: "
                f"{', '.join(train_files)})")
        if flag == "--data_dir":
            raise LanguageMissing(what)
        # (extra pairs are read after the corpus, which its languages fit: not flags to check)
        raise LanguageMissing(what, f"the pairs it adds must be {src}-{tgt}, as the corpus's")
    splits = {}
    for reader in (_read_aligned, _read_tsv, _read_jsonl):
        reader(folder, src, tgt, splits, wanted)
    splits["fingerprint"] = digest(text_digests(folder, {src, tgt}, {"tsv", "jsonl", "json"}))
    if "train" in wanted and "train" not in splits:
        unnamed = [f.name for f in sorted(folder.glob("*.tsv")) if not _split_name(f.stem)]
        raise DataError(f"{flag} {folder}: found no training data for {src}-{tgt} (expected "
                        f"train.{src} + train.{tgt}, train.tsv or train.jsonl)" + (
                            f"; {unnamed[0]} is read as the training pairs only where it is "
                            f"the folder's one .tsv: name it train.tsv" if unnamed else ""))
    return splits


def _hub_failure(name: str, error: Exception) -> DataError:
    """One line for a hub load that failed: for a network failure, the endpoint tried and the
    proxy in use (the hub client honours HTTPS_PROXY, HTTP_PROXY, NO_PROXY and HF_ENDPOINT)."""
    from huggingface_hub import constants
    message = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    kinds = [type(error).__name__] + [c.__name__ for c in type(error).__mro__]
    network = isinstance(error, (ConnectionError, TimeoutError)) or any(
        word in k for k in kinds for word in ("Connect", "Timeout", "Offline", "LocalEntry"))
    if not network:
        return DataError(f"could not load dataset '{name}': {message[:200]}")
    if constants.HF_HUB_OFFLINE:
        return DataError(f"dataset '{name}' is not in the Hugging Face cache and HF_HUB_OFFLINE "
                         f"is set; unset it to download the dataset, or train on local files "
                         f"with --data_dir DIR")
    proxy = next((os.environ[v] for v in ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY",
                                          "http_proxy") if os.environ.get(v)), None)
    return DataError(f"could not reach the Hugging Face hub at {constants.ENDPOINT}"
                     + (f" through the proxy {proxy}" if proxy else "")
                     + f" to load '{name}' ({message[:120]}); train on local files with "
                     f"--data_dir DIR, or set HF_HUB_OFFLINE=1 to use a cached copy")


def _open_hub(name: str, src: str, tgt: str):
    """The DatasetDict of `name`: its subset '{src}-{tgt}' (or '{tgt}-{src}'), as OPUS Books
    and WMT lay out their language pairs; or, for a dataset with no such subsets (one column
    per language, as bentrevett/multi30k), its default configuration."""
    from datasets import load_dataset
    for subset in (f"{src}-{tgt}", f"{tgt}-{src}", None):
        try:
            return load_dataset(name, subset) if subset else load_dataset(name)
        except ValueError as e:  # no such subset (BuilderConfig not found): try the next
            if subset is None:
                raise _hub_failure(name, e) from None
        except Exception as e:  # noqa: BLE001 - offline, unknown repo, proxy refused, ...
            raise _hub_failure(name, e) from None


def _hub_columns(ds, name: str, src: str, tgt: str):
    """The columns holding the two languages' texts: translation.{src} and translation.{tgt}
    (a `translation` dict per row), or the columns {src} and {tgt} themselves."""
    if "translation" in ds.column_names:
        first = ds[0]["translation"] if len(ds) else {src: "", tgt: ""}
        if src in first and tgt in first:
            return ds.flatten(), f"translation.{src}", f"translation.{tgt}"
        raise DataError(f"dataset '{name}' has no {src}/{tgt} texts (languages: "
                        f"{', '.join(first)})")
    if src in ds.column_names and tgt in ds.column_names:
        return ds, src, tgt
    raise DataError(f"dataset '{name}' has neither a 'translation' column nor the columns "
                    f"'{src}' and '{tgt}' (columns: {', '.join(ds.column_names)})")


def _load_hub(config: Config, wanted=SPLITS):
    """A Hugging Face dataset (OPUS Books by default), from the hub or a local folder laid out
    like a hub repository (README.md with `configs:` and data files), through load_dataset."""
    from huggingface_hub import constants
    quiet_datasets()
    src, tgt, name = config.lang_src, config.lang_tgt, config.datasource
    if not Path(name).is_dir():  # (the hub, unreachable, can take half a minute to fail)
        note(f"loading '{name}' from " + ("the Hugging Face cache (HF_HUB_OFFLINE is set)"
             if constants.HF_HUB_OFFLINE else f"the Hugging Face hub ({constants.ENDPOINT})"))
    raw = _open_hub(name, src, tgt)
    if "train" not in {_split_name(k) for k in raw}:
        raise DataError(f"dataset '{name}' has no train split (splits: {', '.join(raw)})")
    # the datasets library's own fingerprints of the downloaded splits identify the corpus
    splits = {"fingerprint": digest(sorted((k, ds._fingerprint) for k, ds in raw.items()))}
    for split_name, ds in raw.items():
        split = _split_name(split_name)
        if not _unread(splits, split, split_name, wanted):
            continue
        flat, src_column, tgt_column = _hub_columns(ds, name, src, tgt)
        # column by column through Arrow, a chunk at a time: WMT's 4.5M pairs never become
        # Python dicts all at once
        tables, dropped = [], 0
        for batch in flat.select_columns([src_column, tgt_column]).iter(batch_size=100_000):
            table, d = _non_empty_pairs([s or "" for s in batch[src_column]],
                                        [s or "" for s in batch[tgt_column]])
            tables.append(table)
            dropped += d
        _keep(splits, split, split_name, _to_dataset(tables, dropped, f"{name}:{split_name}"))
    return splits


def load_corpus(config: Config, wanted=SPLITS):
    """{"train", "validation"} -> datasets.Dataset with `src` and `tgt` columns, "test" -> {the
    name of each test set (file stem or hub split): its Dataset} if there are any, and
    "fingerprint": what identifies the corpus. Without a validation split of its own, a seeded
    `val_fraction` of train is held out, and splits["held_out"] is True. `wanted` names the
    splits to read (without "train", nothing is held out). With --extra_data_dir, its pairs
    join the training split (see _with_extra)."""
    splits = _load_local(config, wanted) if config.data_dir else _load_hub(config, wanted)
    where = f"--data_dir {config.data_dir}" if config.data_dir else \
        f"--datasource {config.datasource}"
    if "validation" in splits and not len(splits["validation"]):  # (not "no pair fits seq_len")
        raise DataError(f"the validation split of {where} has no usable pair (a pair with an "
                        f"empty side is skipped)")
    if "train" in wanted:
        if len(splits["train"]) < 2:
            raise DataError(f"the training split of {where} has {len(splits['train'])} usable "
                            f"pair(s), fewer than 2 (a pair with an empty side is skipped)")
        if "validation" not in splits:
            parts = splits["train"].train_test_split(test_size=config.val_fraction,
                                                     seed=config.seed)
            splits["train"], splits["validation"] = parts["train"], parts["test"]
            splits["held_out"] = True
    splits["text"] = splits["fingerprint"]  # the corpus alone (teachers are checked on it)
    if config.distill_from:
        splits = _with_distilled(config, splits, wanted)
    return _with_extra(config, splits, wanted) if config.extra_data_dir else splits


class DistilledTargets:
    """<model_folder>/distilled: the teachers' translations of the training split's sources
    (sequence-level distillation, --distill_from), one line each in the split's order. This
    class owns the format: nmt/distill.py writes through it, load_corpus reads through it.

        parts/NNNNN.tgt   a chunk of translations, each file written whole (a temporary
                          file renamed), under parts/plan.json (the key of what makes them)
        train.tgt         all of them, joined in order once every chunk is done
        meta.json         what made them (key, teachers, settings, sentences, seconds); written
                          last: its presence means train.tgt is complete

    A translation stopped at any point keeps its finished chunks and goes on from them when
    started again with the same key; another key starts afresh. Under torchrun each rank
    translates its own chunks (i, i + world, ...)."""

    def __init__(self, model_folder):
        self.folder = Path(model_folder) / "distilled"
        self.parts = self.folder / "parts"

    def meta(self):
        """The meta.json of complete translations, or None."""
        try:
            return json.loads((self.folder / "meta.json").read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None

    @staticmethod
    def sources_key(train) -> str:
        """What identifies the sources translated: the digest of the split's source column."""
        return lines_digest(train, "src")

    def begin(self, key: str) -> int:
        """Readies parts/ for translations made under `key` (the chunks of another key go, and
        complete translations of another: their meta.json first); returns the number of chunks
        already done."""
        try:
            plan = json.loads((self.parts / "plan.json").read_text(encoding="utf-8"))
        except (OSError, ValueError):
            plan = None
        for stale in ("meta.json", "train.tgt"):  # (of other teachers: meta.json first)
            (self.folder / stale).unlink(missing_ok=True)
        if plan is None or plan.get("key") != key:
            shutil.rmtree(self.parts, ignore_errors=True)
            self.parts.mkdir(parents=True)
            _write_atomic(self.parts / "plan.json", json.dumps({"key": key}))
        return len(list(self.parts.glob("*.tgt")))

    def done(self, chunk: int) -> bool:
        return (self.parts / f"{chunk:05d}.tgt").is_file()

    def write_chunk(self, chunk: int, lines: list):
        _write_atomic(self.parts / f"{chunk:05d}.tgt", "".join(t + "\n" for t in lines))

    def finish(self, chunks: int, meta: dict):
        """Joins the `chunks` parts in order into train.tgt, then writes meta.json (the mark of
        completion) and removes the parts."""
        missing = [c for c in range(chunks) if not self.done(c)]
        if missing:
            raise DataError(f"{self.parts}: chunk(s) {', '.join(map(str, missing[:5]))} of the "
                            f"teachers' translations are missing; the same command makes them")
        tmp = self.folder / ".train.tgt.tmp"
        with open(tmp, "wb") as out:
            for c in range(chunks):
                with open(self.parts / f"{c:05d}.tgt", "rb") as part:
                    shutil.copyfileobj(part, out)
        os.replace(tmp, self.folder / "train.tgt")
        _write_atomic(self.folder / "meta.json", json.dumps(meta, indent=1))
        shutil.rmtree(self.parts, ignore_errors=True)

    def pairs(self, train, chunk: int = 100_000):
        """The training pairs: the split's own sources with the teachers' translations, read
        `chunk` lines at a time (no Python list of a whole WMT-size split); a pair whose
        translation is empty is dropped, counted."""
        meta, path = self.meta() or {}, self.folder / "train.tgt"
        if meta.get("sources") != self.sources_key(train):
            raise DataError(f"{self.folder} translates other sources than this run's training "
                            f"split (another corpus, --seed or --val_fraction): train.py "
                            f"translates them again when it starts")
        tables, dropped = [], 0
        try:
            with open(path, "rb") as f:
                n = 0
                for batch in train.select_columns(["src"]).iter(batch_size=chunk):
                    lines = list(itertools.islice(f, len(batch["src"])))
                    if len(lines) < len(batch["src"]):
                        raise DataError(f"{path} has {n + len(lines)} lines for {len(train)} "
                                        f"sources; delete {self.folder} to translate again")
                    table, d = _non_empty_pairs(batch["src"],
                                                decode_lines(b"".join(lines), path, n + 1))
                    tables.append(table)
                    dropped, n = dropped + d, n + len(lines)
                if f.readline():
                    raise DataError(f"{path} has more lines than the {len(train)} sources; "
                                    f"delete {self.folder} to translate again")
        except OSError as e:
            raise DataError(f"cannot read {path}: {e.strerror}") from None
        return _to_dataset(tables, dropped, f"{path.name} (the teachers' translations)")


def _write_atomic(path: Path, text: str):
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def _with_distilled(config: Config, splits: dict, wanted):
    """Sequence-level knowledge distillation (--distill_from): the training split's targets
    are the teachers' translations of its sources (DistilledTargets, made by nmt/distill.py
    when train.py starts), alone or after the corpus's own pairs (--distill_data both).
    The fingerprint covers the teachers and the mode; splits["real"] keeps the corpus's own
    pairs (the tokenizers train on those), splits["distilled"] what made the translations."""
    from datasets import concatenate_datasets
    targets = DistilledTargets(config.model_folder)
    meta = targets.meta()
    if meta is None:
        raise DataError(f"{targets.folder} holds no teachers' translations for --distill_from: "
                        f"train.py makes them when it starts")
    splits["fingerprint"] = digest([splits["fingerprint"], meta["key"], config.distill_data])
    splits["distilled"] = {k: meta[k] for k in ("teachers", "beam", "average", "sentences")}
    if "train" not in wanted:
        return splits
    distilled = targets.pairs(splits["train"])
    splits["real"] = splits["train"]
    splits["train"] = (distilled if config.distill_data == "distilled"
                       else concatenate_datasets([splits["train"], distilled]))
    note(f"training pairs: {len(distilled)} translated by the teachers (--distill_from)"
         + (f", after the corpus's own {len(splits['real'])}" if config.distill_data == "both"
            else ", in place of the corpus's references"))
    return splits


def own_corpus(config: Config) -> Config:
    """The config reading the corpus alone: no teachers' translations, no extra pairs (the
    validation and test splits, what teachers must have been trained on)."""
    return dataclasses.replace(config, distill_from="", extra_data_dir="", extra_tag="",
                               upsample=1)


def _with_extra(config: Config, splits: dict, wanted):
    """The training pairs of --extra_data_dir (the synthetic pairs of back-translation, say)
    added to the training split, after any validation split was drawn from it (never from
    them): each of their sources prefixed with --extra_tag (tagged back-translation, Caswell et
    al. 2019), and the corpus's own pairs repeated --upsample times. The fingerprint covers
    them; splits["real"] keeps the corpus's own training pairs (the tokenizers train on those
    alone, so that a run with extra pairs keeps the vocabulary of one without, plus the tag: one
    token, tokenizer.build_tokenizer)."""
    from datasets import concatenate_datasets
    extra = _load_local(config, ("train",) if "train" in wanted else (), "--extra_data_dir")
    splits["fingerprint"] = digest([splits["fingerprint"], extra["fingerprint"],
                                    config.extra_tag, config.upsample])
    if "train" not in wanted:
        return splits
    synthetic, own = extra["train"], splits["train"]  # (own: distilled pairs, if any)
    if config.extra_tag:
        synthetic = synthetic.map(
            lambda batch: {"src": [f"{config.extra_tag} {s}" for s in batch["src"]]},
            batched=True, new_fingerprint=uuid.uuid4().hex)
    splits.setdefault("real", own)
    splits["train"] = concatenate_datasets([own] * config.upsample + [synthetic])
    note(f"training pairs: {len(own)} of the corpus"
         + (f" x {config.upsample}" if config.upsample > 1 else "")
         + f", {len(synthetic)} from --extra_data_dir {config.extra_data_dir}"
         + (f" (their sources tagged '{config.extra_tag}')" if config.extra_tag else ""))
    return splits


# The version of the corpus fingerprint a checkpoint records: 2 reads the files' contents (1, of
# earlier versions, their names, sizes and modification times).
CORPUS_FINGERPRINT = 2


def digest(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:32]


def pairs_digest(src: list, tgt: list) -> str:
    """What identifies a split's pairs, in order (a checkpoint records its validation split's:
    translate.py --example checks by it)."""
    return digest([list(src), list(tgt)])


def lines_digest(ds, name: str) -> str:
    """The SHA-256 of a column of text, a line each, read in batches (no list of a whole
    WMT-size column is held)."""
    sha = hashlib.sha256()
    for batch in ds.select_columns([name]).iter(batch_size=100_000):
        sha.update("".join(line + "\n" for line in batch[name]).encode("utf-8"))
    return sha.hexdigest()[:32]


def file_digest(path: Path) -> str:
    """The SHA-256 of a file's text: its bytes (about 1 s a gigabyte), a packed file's (*.gz)
    unpacked."""
    sha = hashlib.sha256()
    try:
        with _open_text(Path(path)) as f:
            while block := f.read(1 << 20):
                sha.update(block)
    except (OSError, EOFError, zlib.error) as e:
        raise DataError(f"cannot read {path}: {getattr(e, 'strerror', None) or e}") from None
    return sha.hexdigest()[:32]


def text_digests(folder: Path, languages: set, formats: set) -> list:
    """[(name, file_digest)] of the files a language pair could read from a folder, sorted as
    paths: its languages' text files as they are read, a packed one (train.en.gz) under its
    unpacked name unless its unpacked twin is there (which is what is read: the twin alone is
    digested), so that unpacking a corpus leaves it the same corpus; and the TSV and JSON lines
    files under their own names (they are read unpacked only). A folder of plain files gives
    the fingerprint it gave before the texts were digested unpacked."""
    chosen = {}
    for f in folder.iterdir():
        kind = text_file_name(f)[1]
        if not f.is_file() or kind not in languages | formats:
            continue
        name = f.name.removesuffix(".gz") if kind in languages else f.name
        if name not in chosen or not f.name.endswith(".gz"):
            chosen[name] = f
    return [(name, file_digest(chosen[name])) for name in sorted(chosen, key=lambda n: folder / n)]


def corpus_source(config: Config) -> str:
    """Where the corpus comes from: --data_dir, or --datasource (local folders absolute, as
    the user named them: a link stays a link, not the folder it points to)."""
    name = config.data_dir or config.datasource
    return os.path.abspath(name) if config.data_dir or Path(name).exists() else name

