"""Reading a corpus: aligned files, TSV, JSON lines, hub datasets (offline, through a local folder
laid out like a hub repository), and the one-line refusals."""

import json

import pytest
from conftest import number_pairs, run_here, write_aligned

from config import Config
from corpus import DataError, column, load_corpus


def cfg(tmp_path, **kw):
    return Config(**{"model_folder": str(tmp_path / "weights"), "lang_src": "en",
                     "lang_tgt": "it", "vocab_size": 300, "seq_len": 24, **kw})


def test_aligned_text_files_with_their_own_validation_and_test_splits(tmp_path, corpus):
    write_aligned(corpus, "test_2016", number_pairs(5, seed=9))
    write_aligned(corpus, "test_2017", number_pairs(3, seed=10))  # issue 45: all test sets
    splits = load_corpus(cfg(tmp_path, data_dir=str(corpus)))
    assert (len(splits["train"]), len(splits["validation"])) == (64, 8)
    assert {name: len(ds) for name, ds in splits["test"].items()} == {"test_2016": 5,
                                                                     "test_2017": 3}
    first = number_pairs(64, seed=1)[0]
    assert (splits["train"][0]["src"], splits["train"][0]["tgt"]) == first


def test_without_a_validation_split_a_seeded_tenth_is_held_out(tmp_path):
    write_aligned(tmp_path / "c", "train", number_pairs(100, seed=1))
    config = cfg(tmp_path, data_dir=str(tmp_path / "c"))
    a, b = load_corpus(config), load_corpus(config)
    assert (len(a["train"]), len(a["validation"])) == (90, 10)
    assert column(a["validation"], "src") == column(b["validation"], "src")  # same seed, same split
    assert sorted(column(a["train"], "src") + column(a["validation"], "src")) == sorted(
        s for s, _ in number_pairs(100, seed=1))
    other = load_corpus(cfg(tmp_path, data_dir=str(tmp_path / "c"), seed=7))
    assert column(other["validation"], "src") != column(a["validation"], "src")


def test_tab_separated_pairs(tmp_path):
    folder = tmp_path / "tsv"
    folder.mkdir()
    (folder / "pairs.tsv").write_text("en\tit\nHello.\tCiao.\n\nThe cat.\tIl gatto.\n"
                                      "A dog.\tUn cane.\n", encoding="utf-8")
    splits = load_corpus(cfg(tmp_path, data_dir=str(folder), val_fraction=0.34))
    texts = sorted(column(splits["train"], "tgt") + column(splits["validation"], "tgt"))
    assert texts == ["Ciao.", "Il gatto.", "Un cane."]  # header skipped, empty line dropped


def test_tab_separated_pairs_with_an_attribution_column_take_the_first_two(tmp_path, capsys):
    folder = tmp_path / "anki"
    folder.mkdir()
    (folder / "fra.tsv").write_text("Go.\tVa !\tCC-BY 2.0 (France) #2877272\n"
                                    "Hi.\tSalut !\tCC-BY 2.0 (France) #538123\nRun!\tCours !\n",
                                    encoding="utf-8")
    splits = load_corpus(cfg(tmp_path, data_dir=str(folder), val_fraction=0.34))
    texts = sorted(column(splits["train"], "tgt") + column(splits["validation"], "tgt"))
    assert texts == ["Cours !", "Salut !", "Va !"]
    assert "fra.tsv: 2 line(s) have more than two tab-separated fields" in capsys.readouterr().err


def test_json_lines_with_a_translation_field(tmp_path):
    folder = tmp_path / "jl"
    folder.mkdir()
    rows = [{"translation": {"en": s, "it": t}} for s, t in number_pairs(12, seed=3)]
    (folder / "train.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    (folder / "validation.jsonl").write_text(json.dumps(rows[0]) + "\n")
    splits = load_corpus(cfg(tmp_path, data_dir=str(folder)))
    assert len(splits["train"]) == 12
    assert column(splits["validation"], "tgt") == [rows[0]["translation"]["it"]]


def make_hub_repo(folder, subset="en-it", pairs=None):
    """A folder laid out like a Hugging Face hub dataset repo (OPUS Books style): a README
    whose `configs:` names the subset, and a parquet file of {"id", "translation"} rows."""
    from datasets import Dataset
    pairs = pairs or number_pairs(40, seed=4)
    lang_a, lang_b = subset.split("-")
    (folder / subset).mkdir(parents=True)
    Dataset.from_dict({"id": [str(i) for i in range(len(pairs))],
                       "translation": [{lang_a: s, lang_b: t} for s, t in pairs]}).to_parquet(
        str(folder / subset / "train-00000-of-00001.parquet"))
    (folder / "README.md").write_text(
        f"---\nconfigs:\n- config_name: {subset}\n  data_files:\n  - split: train\n"
        f"    path: {subset}/train-*\n---\n")
    return folder


def test_hub_datasource_through_load_dataset_offline(tmp_path):
    repo = make_hub_repo(tmp_path / "opus_books")
    splits = load_corpus(cfg(tmp_path, datasource=str(repo)))
    assert (len(splits["train"]), len(splits["validation"])) == (36, 4)  # seeded 90/10
    # a pair published the other way round ("it-en") is found too
    repo2 = make_hub_repo(tmp_path / "reversed", subset="it-en",
                          pairs=[(t, s) for s, t in number_pairs(20, seed=4)])
    splits2 = load_corpus(cfg(tmp_path, datasource=str(repo2)))
    assert splits2["train"][0]["src"].endswith(".") and " " in splits2["train"][0]["src"]
    assert set(column(splits2["train"], "src")) <= {s for s, _ in number_pairs(20, seed=4)}


def test_hub_errors_are_one_clear_line(tmp_path, capsys):
    repo = make_hub_repo(tmp_path / "opus_books")
    with pytest.raises(DataError, match=r"has no en/fr texts \(languages: en, it\)"):
        load_corpus(Config(datasource=str(repo), lang_src="en", lang_tgt="fr"))
    assert "loading" not in capsys.readouterr().err  # a local folder: no wait to announce
    # offline (as in every test) and not cached: says so, with the local-files way out
    with pytest.raises(DataError, match=r"'nobody/no_such_dataset' is not in the Hugging Face "
                                        r"cache and HF_HUB_OFFLINE is set.*--data_dir DIR"):
        load_corpus(cfg(tmp_path, datasource="nobody/no_such_dataset"))
    # the hub can take half a minute to fail: what is loaded from where is said first
    assert capsys.readouterr().err == ("loading 'nobody/no_such_dataset' from the Hugging Face "
                                       "cache (HF_HUB_OFFLINE is set)\n")


def test_a_hub_failure_behind_a_proxy_names_the_endpoint_and_the_proxy(tmp_path, monkeypatch,
                                                                       capsys):
    """No probe of our own: the hub client's connection (which honours HTTPS_PROXY and
    HF_ENDPOINT) decides, and its failure becomes one line naming what was tried."""
    import datasets
    import huggingface_hub.constants as hub

    def unreachable(*args, **kwargs):
        raise ConnectionError("Couldn't reach 'nobody/x' on the Hub (LocalEntryNotFoundError)")
    monkeypatch.setattr(datasets, "load_dataset", unreachable)
    monkeypatch.setattr(hub, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(hub, "ENDPOINT", "https://hub.example")
    monkeypatch.setenv("HTTPS_PROXY", "http://proxy.example:3128")
    with pytest.raises(DataError, match=r"could not reach the Hugging Face hub at "
                                        r"https://hub.example through the proxy "
                                        r"http://proxy.example:3128 to load 'nobody/x'"):
        load_corpus(cfg(tmp_path, datasource="nobody/x"))
    assert capsys.readouterr().err == "loading 'nobody/x' from the Hugging Face hub " \
                                      "(https://hub.example)\n"


def make_columns_repo(folder, pairs, languages=("en", "de")):
    """A folder laid out like bentrevett/multi30k: JSON lines with one field per language, one
    default configuration, splits train / validation / test."""
    folder.mkdir(parents=True)
    for split, part in (("train", pairs[:30]), ("validation", pairs[30:35]),
                        ("test", pairs[35:])):
        (folder / f"{split}.jsonl").write_text("".join(
            json.dumps(dict(zip(languages, p))) + "\n" for p in part), encoding="utf-8")
    return folder


def test_a_hub_dataset_with_one_column_per_language_loads_like_a_translation_column(tmp_path):
    pairs = number_pairs(40, seed=5)
    repo = make_columns_repo(tmp_path / "multi30k", pairs)
    splits = load_corpus(cfg(tmp_path, datasource=str(repo), lang_src="en", lang_tgt="de"))
    assert [len(splits[s]) for s in ("train", "validation")] == [30, 5]
    assert list(splits["test"]) == ["test"] and len(splits["test"]["test"]) == 5
    assert column(splits["train"], "src") == [s for s, _ in pairs[:30]]
    assert column(splits["test"]["test"], "tgt") == [t for _, t in pairs[35:]]
    assert "held_out" not in splits  # its own validation split is used
    # the other direction reads the same columns the other way round
    back = load_corpus(cfg(tmp_path, datasource=str(repo), lang_src="de", lang_tgt="en"))
    assert column(back["validation"], "src") == [t for _, t in pairs[30:35]]
    with pytest.raises(DataError, match=r"neither a 'translation' column nor the columns 'en' "
                                        r"and 'fr' \(columns: en, de\)"):
        load_corpus(cfg(tmp_path, datasource=str(repo), lang_src="en", lang_tgt="fr"))


@pytest.mark.parametrize("problem, message", [
    ("missing_dir", "no such folder"),
    ("no_train", r"found no training data for en-it \(expected train.en \+ train.it, "
                 r"train.tsv or train.jsonl\)$"),
    ("two_tsv", r"\); pairs.tsv is read as the training pairs only where it is the folder's one "
                r"\.tsv: name it train.tsv$"),
    ("line_counts", "train.en has 3 lines but .*train.it has 2"),
    ("bad_utf8", "train.it, line 2: not valid UTF-8"),
    ("no_target", "has no train.it \\(training files there: train.en\\); check --lang_src and "
                  "--lang_tgt$"),
    ("other_language", "has no train.it \\(training files there: train.de, train.en\\)"),
    ("no_test_target", "test_2016.en has no matching target file"),
    ("a_file", "is a file; give the folder"),
    ("empty", r"the training split of --data_dir .*bad has 1 usable pair\(s\), fewer than 2 \(a "
              r"pair with an empty side is skipped\)$"),
])
def test_bad_local_data_is_refused_with_a_clear_message(tmp_path, problem, message):
    folder = tmp_path / "bad"
    folder.mkdir()
    if problem == "no_train":
        write_aligned(folder, "val", number_pairs(3))
    elif problem == "two_tsv":  # one of any name is the training pairs; beside val.tsv, not
        (folder / "pairs.tsv").write_text("one.\tuno.\n")
        (folder / "val.tsv").write_text("two.\tdue.\n")
    elif problem == "line_counts":
        (folder / "train.en").write_text("a\nb\nc\n")
        (folder / "train.it").write_text("a\nb\n")
    elif problem == "bad_utf8":
        (folder / "train.en").write_text("a\nb\n")
        (folder / "train.it").write_bytes(b"a\n\xff\xfeb\n")
    elif problem == "no_target":
        (folder / "train.en").write_text("a\n")
    elif problem == "other_language":  # issue 16, 14: it named a test file as missing
        write_aligned(folder, "train", number_pairs(3), tgt="de")
        write_aligned(folder, "test_2016", number_pairs(3), tgt="de")
    elif problem == "empty":  # (it named neither the folder nor what was found)
        (folder / "train.en").write_text("one.\n\nthree.\n")
        (folder / "train.it").write_text("uno.\ndue.\n\n")
    elif problem == "no_test_target":
        write_aligned(folder, "train", number_pairs(3))
        (folder / "test_2016.en").write_text("a\n")
    data_dir = {"missing_dir": tmp_path / "nowhere",
                "a_file": folder / "train.en"}.get(problem, folder)
    if problem == "a_file":
        (folder / "train.en").write_text("a\n")
    with pytest.raises(DataError, match=message):
        load_corpus(cfg(tmp_path, data_dir=str(data_dir)))


def test_empty_lines_are_skipped_and_counted(tmp_path, capsys):
    folder = tmp_path / "c"
    folder.mkdir()
    (folder / "train.en").write_text("one.\n\nthree.\nfour.\n")
    (folder / "train.it").write_text("uno.\ndue.\n \nquattro.\n")
    splits = load_corpus(cfg(tmp_path, data_dir=str(folder), val_fraction=0.5))
    assert len(splits["train"]) + len(splits["validation"]) == 2
    assert "skipped 2 pair(s) with an empty side" in capsys.readouterr().err


# ---- extra training pairs (issue 43: back-translation) ------------------------------------------

def test_extra_pairs_join_train_tagged_and_never_validation(tmp_path):
    """--extra_data_dir's pairs are added to the training split after the held-out validation
    pairs are drawn (all from the corpus's own), each source prefixed with --extra_tag, the
    corpus's pairs repeated --upsample times; the fingerprint says so (another corpus for a
    resume and for prepared data); "real" keeps the corpus's own pairs."""
    real, synthetic = number_pairs(30, seed=1), [(f"synthetic {i}.", f"sintetico {i}.")
                                                 for i in range(7)]
    write_aligned(tmp_path / "c", "train", real)
    write_aligned(tmp_path / "bt", "train", synthetic)
    plain = load_corpus(cfg(tmp_path, data_dir=str(tmp_path / "c")))
    both = load_corpus(cfg(tmp_path, data_dir=str(tmp_path / "c"),
                           extra_data_dir=str(tmp_path / "bt"), extra_tag="<BT>", upsample=2))
    assert column(both["validation"], "src") == column(plain["validation"], "src")
    assert column(both["real"], "src") == column(plain["train"], "src")
    sources = column(both["train"], "src")
    assert sources == column(plain["train"], "src") * 2 + [f"<BT> {s}" for s, _ in synthetic]
    assert column(both["train"], "tgt")[-7:] == [t for _, t in synthetic]
    assert both["fingerprint"] != plain["fingerprint"]
    partial = load_corpus(cfg(tmp_path, data_dir=str(tmp_path / "c"),
                              extra_data_dir=str(tmp_path / "bt"), extra_tag="<BT>",
                              upsample=2), wanted=("validation", "test"))
    assert partial["fingerprint"] == both["fingerprint"]  # what get_ds checks before preparing


def test_extra_pairs_of_other_languages_or_flags_without_them_are_one_line(tmp_path):
    """Each message names the flag of the folder it is about; extra pairs of other languages
    are not the flags' fault (the corpus was read in them)."""
    write_aligned(tmp_path / "c", "train", number_pairs(30, seed=1))
    (tmp_path / "bt").mkdir()
    (tmp_path / "none").mkdir()
    for lang, text in (("en", "one.\n"), ("fr", "un.\n")):
        (tmp_path / "bt" / f"train.{lang}").write_text(text)
    for args, said in ((["--extra_data_dir", "bt"], "--extra_data_dir bt has no train.it "
                        "(training files there: train.en, train.fr); the pairs it adds must be "
                        "en-it, as the corpus's\n"),
                       (["--extra_data_dir", "nowhere"], "--extra_data_dir nowhere: no such "
                        "folder"),
                       (["--extra_data_dir", "c/train.en"], "--extra_data_dir c/train.en is a "
                        "file"),
                       (["--extra_data_dir", "none"], "--extra_data_dir none: found no training "
                        "data for en-it"),
                       (["--extra_tag", "<BT>"], "--extra_tag and --upsample go with"),
                       (["--extra_data_dir", "bt", "--upsample", "0"], "--upsample must be"),
                       (["--extra_data_dir", "bt", "--extra_tag", "<B T>"], "must be one word")):
        t = run_here("train.py", "--data_dir", "c", "--lang_tgt", "it", *args, cwd=tmp_path)
        err = t.stderr.decode()
        assert t.returncode == 2 and said in err and len(err.strip().splitlines()) == 1, err
        assert not (tmp_path / "weights").exists()


def test_the_fingerprint_is_the_text_not_the_files_times(tmp_path, corpus):
    """A checkpoint refuses to resume on another corpus by this fingerprint. It was the files'
    names, sizes and times, so the same corpus copied or unpacked again refused every resume
    (and prepared its data again); now it is their contents, and only the files the language
    pair can read."""
    import os
    import shutil
    first = load_corpus(cfg(tmp_path, data_dir=str(corpus)))["fingerprint"]
    copy = tmp_path / "copy"
    shutil.copytree(corpus, copy)  # new times
    for f in copy.iterdir():
        os.utime(f, (1, 1))
    (copy / "train.fr").write_text("un autre côté\n")  # not this pair's
    assert load_corpus(cfg(tmp_path, data_dir=str(copy)))["fingerprint"] == first
    pairs = number_pairs(64, seed=1)
    pairs[3] = (pairs[3][0], pairs[3][1] + " x")  # one word more in one target sentence
    write_aligned(copy, "train", pairs)
    assert load_corpus(cfg(tmp_path, data_dir=str(copy)))["fingerprint"] != first


def test_a_corpus_unpacked_is_the_same_corpus(tmp_path, corpus):
    """The README unpacks Multi30k's download (`gunzip -k`): the fingerprint named the files
    as they lay, packed or not, so a run trained on the .gz files was refused on resume once
    they were unpacked ("the text of its files changed since"), or once the .gz were deleted."""
    import gzip
    import hashlib
    import json
    import shutil

    plain = load_corpus(cfg(tmp_path, data_dir=str(corpus)))["fingerprint"]
    # plain files give what they gave before: the checkpoints of then still resume
    then = [(f.name, hashlib.sha256(f.read_bytes()).hexdigest()[:32])
            for f in sorted(corpus.iterdir()) if f.suffix in (".en", ".it")]
    assert plain == hashlib.sha256(json.dumps(then, sort_keys=True).encode()).hexdigest()[:32]
    packed = tmp_path / "packed"
    packed.mkdir()
    for f in corpus.iterdir():
        (packed / f"{f.name}.gz").write_bytes(gzip.compress(f.read_bytes()))
    assert load_corpus(cfg(tmp_path, data_dir=str(packed)))["fingerprint"] == plain
    for f in corpus.iterdir():  # unpacked beside them (gunzip -k)
        shutil.copy(f, packed / f.name)
    assert load_corpus(cfg(tmp_path, data_dir=str(packed)))["fingerprint"] == plain
    (packed / "val.en").write_text("another text\n" * 8)  # what is read is the unpacked file
    assert load_corpus(cfg(tmp_path, data_dir=str(packed)))["fingerprint"] != plain
    mixed = tmp_path / "mixed"  # some packed, some not; a damaged packed twin is not read
    mixed.mkdir()
    for n, f in enumerate(sorted(corpus.iterdir())):
        if n % 2:
            (mixed / f"{f.name}.gz").write_bytes(gzip.compress(f.read_bytes()))
        else:
            shutil.copy(f, mixed / f.name)
            (mixed / f"{f.name}.gz").write_bytes(gzip.compress(f.read_bytes())[:20])
    assert load_corpus(cfg(tmp_path, data_dir=str(mixed)))["fingerprint"] == plain


def test_the_fingerprint_folds_only_the_packed_files_that_are_read_unpacked(tmp_path, corpus):
    """TSV and JSON lines files are read unpacked only: val.tsv.gz unpacked is a validation
    split the corpus did not have (it was held out of train), so another corpus. A damaged
    packed file no split reads still refuses the folder in one line."""
    import gzip
    import shutil

    folder = tmp_path / "tsv"
    shutil.copytree(corpus, folder)
    (folder / "val.en").unlink()
    (folder / "val.it").unlink()
    lines = "".join(f"{s}\t{t}\n" for s, t in number_pairs(8, seed=5)).encode()
    (folder / "val.tsv.gz").write_bytes(gzip.compress(lines))
    held_out = load_corpus(cfg(tmp_path, data_dir=str(folder)))
    (folder / "val.tsv").write_bytes(lines)
    (folder / "val.tsv.gz").unlink()
    read = load_corpus(cfg(tmp_path, data_dir=str(folder)))
    assert held_out.get("held_out") and not read.get("held_out")
    assert held_out["fingerprint"] != read["fingerprint"]
    (folder / "notes.en.gz").write_bytes(gzip.compress(b"a note\n")[:15])  # cut short
    with pytest.raises(DataError, match=r"cannot read .*notes\.en\.gz: "):
        load_corpus(cfg(tmp_path, data_dir=str(folder)))


def gzip_aligned(folder, split, pairs, src="en", tgt="it"):
    """Multi30k's raw layout: each file gzip-compressed (train.en.gz), as downloaded."""
    import gzip
    folder.mkdir(parents=True, exist_ok=True)
    for side, lang in ((0, src), (1, tgt)):
        with gzip.open(folder / f"{split}.{lang}.gz", "wt", encoding="utf-8") as f:
            f.write("".join(p[side] + "\n" for p in pairs))


def test_gzip_compressed_files_are_read_as_they_are(tmp_path):
    """data/task1/raw of multi30k/dataset holds train.en.gz etc.: read without unpacking."""
    folder = tmp_path / "raw"
    gzip_aligned(folder, "train", number_pairs(20, seed=1))
    gzip_aligned(folder, "val", number_pairs(4, seed=2))
    gzip_aligned(folder, "test_2016_flickr", number_pairs(3, seed=3))
    splits = load_corpus(cfg(tmp_path, data_dir=str(folder)))
    assert (len(splits["train"]), len(splits["validation"])) == (20, 4)
    assert list(splits["test"]) == ["test_2016_flickr"]
    assert (splits["train"][0]["src"], splits["train"][0]["tgt"]) == number_pairs(20, seed=1)[0]


def test_a_gzip_corpus_of_other_languages_lists_its_files_by_name(tmp_path):
    """It listed `train.gz, train.gz`: the files' own names, and the language missing."""
    folder = tmp_path / "raw"
    gzip_aligned(folder, "train", number_pairs(3), src="en", tgt="de")
    with pytest.raises(DataError, match=r"has no train\.it \(training files there: "
                                        r"train\.de\.gz, train\.en\.gz\); check --lang_src"):
        load_corpus(cfg(tmp_path, data_dir=str(folder)))


def test_a_damaged_gzip_file_is_one_line_naming_it(tmp_path):
    folder = tmp_path / "raw"
    gzip_aligned(folder, "train", number_pairs(3))
    (folder / "train.it.gz").write_bytes(b"not gzip at all\n")
    with pytest.raises(DataError, match=r"cannot read .*train\.it\.gz: "):
        load_corpus(cfg(tmp_path, data_dir=str(folder)))


def test_read_lines_unpacks_a_gzip_file(tmp_path):
    """translate.py --input/--reference read Multi30k's test_2016_flickr.en.gz as it is."""
    import gzip

    from corpus import read_lines
    path = tmp_path / "test.en.gz"
    path.write_bytes(gzip.compress("A dog runs.\nZwei Männer.\n".encode("utf-8")))
    assert read_lines(path) == ["A dog runs.", "Zwei Männer."]


def test_a_missing_file_whose_packed_copy_is_there_names_it(tmp_path):
    """The README's commands name val.en; Multi30k's download gives val.en.gz only, and the
    error said "No such file or directory" with no word of the file beside it."""
    import gzip

    from corpus import read_lines
    with pytest.raises(DataError) as e:
        read_lines(tmp_path / "val.en")
    assert str(e.value) == f"cannot read {tmp_path / 'val.en'}: No such file or directory"
    (tmp_path / "val.en.gz").write_bytes(gzip.compress(b"A dog runs.\n"))
    with pytest.raises(DataError) as e:
        read_lines(tmp_path / "val.en")
    packed = tmp_path / "val.en.gz"
    assert str(e.value) == (f"cannot read {tmp_path / 'val.en'}: No such file or directory "
                            f"({packed} is there: name it, or unpack it with gunzip -k {packed})")
    (tmp_path / "val.en").mkdir()  # there, but unreadable: nothing to say of the packed one
    with pytest.raises(DataError) as e:
        read_lines(tmp_path / "val.en")
    assert str(e.value) == f"cannot read {tmp_path / 'val.en'}: Is a directory"


# ---- behaviours a mutation audit found unguarded -------------------------------------------------

def test_the_held_out_share_is_val_fraction(tmp_path):
    """--val_fraction sets how many training pairs are held out for validation (not a fixed
    tenth)."""
    write_aligned(tmp_path / "c", "train", number_pairs(40, seed=1))
    splits = load_corpus(cfg(tmp_path, data_dir=str(tmp_path / "c"), val_fraction=0.25))
    assert (len(splits["train"]), len(splits["validation"])) == (30, 10)


def test_the_first_validation_split_found_is_the_one_read(tmp_path):
    """One validation split is read, the first found (dev.* before val.*), and a split found as
    aligned files is not read again from another format (val.tsv)."""
    folder = tmp_path / "c"
    write_aligned(folder, "train", number_pairs(10, seed=1))
    write_aligned(folder, "dev", [("dev one.", "dev uno.")])
    write_aligned(folder, "val", [("val one.", "val uno.")])
    (folder / "val.tsv").write_text("tsv one.\ttsv uno.\n", encoding="utf-8")
    splits = load_corpus(cfg(tmp_path, data_dir=str(folder)))
    assert column(splits["validation"], "src") == ["dev one."]


def test_a_byte_order_mark_is_not_part_of_the_first_sentence(tmp_path):
    """A UTF-8 file saved with a byte order mark (Windows editors) gives its first sentence
    without the invisible U+FEFF."""
    folder = tmp_path / "c"
    folder.mkdir()
    (folder / "train.en").write_bytes(b"\xef\xbb\xbfHello.\nThe cat.\n")
    (folder / "train.it").write_bytes(b"\xef\xbb\xbfCiao.\nIl gatto.\n")
    write_aligned(folder, "val", [("a.", "b.")])
    splits = load_corpus(cfg(tmp_path, data_dir=str(folder)))
    assert column(splits["train"], "src")[0] == "Hello."
    assert column(splits["train"], "tgt")[0] == "Ciao."


def test_the_fingerprint_of_extra_pairs_covers_upsample(tmp_path):
    """Another --upsample trains on other pairs: another corpus for resumes and prepared data."""
    write_aligned(tmp_path / "c", "train", number_pairs(30, seed=1))
    write_aligned(tmp_path / "bt", "train", [(f"s {i}.", f"t {i}.") for i in range(5)])
    prints = {load_corpus(cfg(tmp_path, data_dir=str(tmp_path / "c"),
                              extra_data_dir=str(tmp_path / "bt"), upsample=u))["fingerprint"]
              for u in (1, 2)}
    assert len(prints) == 2


def test_a_hub_datasets_fingerprint_is_its_text(tmp_path):
    """Two hub datasets with the same splits but other sentences are other corpora."""
    a = load_corpus(cfg(tmp_path, datasource=str(make_hub_repo(tmp_path / "a"))))
    b = load_corpus(cfg(tmp_path, datasource=str(make_hub_repo(
        tmp_path / "b", pairs=number_pairs(40, seed=5)))))
    assert a["fingerprint"] != b["fingerprint"]


def test_aligned_files_read_in_chunks_count_lines_across_chunks(tmp_path):
    """Read a chunk at a time, aligned files keep counting lines across chunks: a bad byte
    names its line in the whole file, unequal files their whole line counts."""
    from corpus import _aligned_dataset
    (tmp_path / "a.en").write_text("1\n2\n3\n4\n5\n")
    (tmp_path / "a.it").write_bytes(b"1\n2\n3\n\xff4\n5\n")
    with pytest.raises(DataError, match=r"a\.it, line 4: not valid UTF-8"):
        _aligned_dataset(tmp_path / "a.en", tmp_path / "a.it", chunk=2)
    with pytest.raises(DataError, match=r"a\.it, line 4: not valid UTF-8"):  # as the source
        _aligned_dataset(tmp_path / "a.it", tmp_path / "a.en", chunk=2)
    (tmp_path / "b.en").write_text("1\n2\n3\n4\n5\n")
    (tmp_path / "b.it").write_text("1\n2\n3\n4\n")
    with pytest.raises(DataError, match=r"b\.en has 5 lines but .*b\.it has 4"):
        _aligned_dataset(tmp_path / "b.en", tmp_path / "b.it", chunk=2)
    ds = _aligned_dataset(tmp_path / "a.en", tmp_path / "a.en", chunk=2)
    assert column(ds, "src") == ["1", "2", "3", "4", "5"]


def test_an_empty_validation_split_is_refused_as_empty(tmp_path):
    """A validation file with no usable pair (empty, or blank lines only) is refused as such
    when the corpus is read; it was refused after preparing, as "validation: no pair fits
    --seq_len", which no --seq_len could cure."""
    folder = tmp_path / "c"
    write_aligned(folder, "train", number_pairs(10, seed=1))
    (folder / "val.en").write_text("\n\n")
    (folder / "val.it").write_text("\n\n")
    for wanted in (("train", "validation", "test"), ("validation", "test")):
        with pytest.raises(DataError, match=r"the validation split of --data_dir .*c has no "
                                            r"usable pair \(a pair with an empty side"):
            load_corpus(cfg(tmp_path, data_dir=str(folder)), wanted)


def test_blank_lines_in_json_lines_are_skipped(tmp_path):
    """A JSON lines file with blank lines (between records, or trailing) reads its records,
    not a refusal of the blank line."""
    folder = tmp_path / "jl"
    folder.mkdir()
    rows = [json.dumps({"translation": {"en": s, "it": t}}) for s, t in number_pairs(6, seed=3)]
    (folder / "train.jsonl").write_text("\n".join(rows[:3]) + "\n\n" + "\n".join(rows[3:])
                                        + "\n\n")
    (folder / "val.jsonl").write_text(rows[0] + "\n")
    assert len(load_corpus(cfg(tmp_path, data_dir=str(folder)))["train"]) == 6


def test_a_hub_dataset_without_a_train_split_is_one_line(tmp_path):
    """A hub dataset with no train split is refused naming the splits it has (not a KeyError)."""
    repo = make_hub_repo(tmp_path / "no_train")
    readme = repo / "README.md"
    readme.write_text(readme.read_text().replace("split: train", "split: test"))
    with pytest.raises(DataError, match=r"'.*no_train' has no train split \(splits: test\)"):
        load_corpus(cfg(tmp_path, datasource=str(repo)))
