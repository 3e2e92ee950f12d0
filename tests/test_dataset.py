"""Loading every corpus format, tokenizers, the batch sampler and the masks of a batch."""

import json

import pytest
import torch
from conftest import number_pairs, write_aligned

from config import Config
from dataset import (BilingualDataset, Collator, DataError, TokenBatchSampler, build_tokenizer,
                     column, get_ds, get_tokenizer, load_corpus)


def cfg(tmp_path, **kw):
    return Config(model_folder=str(tmp_path / "weights"), lang_src="en", lang_tgt="it",
                  vocab_size=300, seq_len=24, **kw)


def test_aligned_text_files_with_their_own_validation_and_test_splits(tmp_path, corpus):
    write_aligned(corpus, "test_2016", number_pairs(5, seed=9))
    splits = load_corpus(cfg(tmp_path, data_dir=str(corpus)))
    assert (len(splits["train"]), len(splits["validation"]), len(splits["test"])) == (64, 8, 5)
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


def test_hub_errors_are_one_clear_line(tmp_path):
    repo = make_hub_repo(tmp_path / "opus_books")
    with pytest.raises(DataError, match="has no subset en-fr or fr-en"):
        load_corpus(Config(datasource=str(repo), lang_src="en", lang_tgt="fr"))
    # offline (as in every test) and not cached: the hub message, with the local-files way out
    with pytest.raises(DataError, match=r"could not reach the Hugging Face hub to load "
                                        r"'nobody/no_such_dataset' .*--data_dir DIR"):
        load_corpus(cfg(tmp_path, datasource="nobody/no_such_dataset"))


@pytest.mark.parametrize("problem, message", [
    ("missing_dir", "no such folder"),
    ("no_train", "found no training data"),
    ("line_counts", "train.en has 3 lines but .*train.it has 2"),
    ("bad_utf8", "train.it, line 2: not valid UTF-8"),
    ("no_target", "has no train.it \\(training files there: train.en\\); check --lang_src"),
    ("other_language", "has no train.it \\(training files there: train.de, train.en\\)"),
    ("no_test_target", "test_2016.en has no matching target file"),
    ("a_file", "is a file; give the folder"),
])
def test_bad_local_data_is_refused_with_a_clear_message(tmp_path, problem, message):
    folder = tmp_path / "bad"
    folder.mkdir()
    if problem == "no_train":
        write_aligned(folder, "val", number_pairs(3))
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


def test_bpe_tokenizer_has_no_unknown_words_and_detokenizes_exactly(tmp_path):
    tok = build_tokenizer("bpe", 300, [s for s, _ in number_pairs(50)])
    assert [tok.token_to_id(t) for t in ("[UNK]", "[PAD]", "[SOS]", "[EOS]")] == [0, 1, 2, 3]
    for text in ["Völlig neue Wörter, 😀 und 漢字!", "seven eight.", "tab\there"]:
        ids = tok.encode(text).ids
        assert 0 not in ids  # never [UNK]
        assert tok.decode(ids) == text
    word = build_tokenizer("word", 300, [s for s, _ in number_pairs(50)])
    assert word.encode("seven unseenword").ids[1] == 0  # the write-ups' tokenizer: [UNK]


def test_tokenizers_are_trained_on_train_only_saved_and_reused(tmp_path, corpus):
    config = cfg(tmp_path, data_dir=str(corpus))
    (corpus / "val.en").write_text("zebra xylophone quokka.\n" * 8)
    data = get_ds(config)
    path = tmp_path / "weights" / "tokenizer_en.json"
    assert path.exists() and (tmp_path / "weights" / "tokenizer_it.json").exists()
    assert "zebra" not in data.tokenizer_src.get_vocab()  # validation text never trained on
    before = path.read_bytes()
    again = get_tokenizer(config, "en", ["completely different text"] * 50)
    assert path.read_bytes() == before
    assert again.get_vocab() == data.tokenizer_src.get_vocab()
    with pytest.raises(DataError, match="is a bpe tokenizer, but --tokenizer_type is word"):
        get_tokenizer(cfg(tmp_path, tokenizer_type="word"), "en", [])


def test_pairs_longer_than_seq_len_are_dropped_with_a_count(tmp_path, corpus, capsys):
    write_aligned(corpus, "train", number_pairs(60, seed=1) + [("one " * 40 + ".", "uno.")])
    data = get_ds(cfg(tmp_path, data_dir=str(corpus)))
    assert len(data.train) == 60
    assert "dropped 1 of 61 pairs longer than seq_len 24" in capsys.readouterr().err
    item = data.train[0]
    assert item["encoder_input"][0] == 2 and item["encoder_input"][-1] == 3
    assert torch.equal(item["decoder_input"][1:], item["label"][:-1])
    assert item["decoder_input"][0] == 2 and item["label"][-1] == 3


def test_token_batches_never_exceed_max_tokens_and_cover_every_pair_once():
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(3, 60, (1000,), generator=g).tolist()
    sampler = TokenBatchSampler(lengths, max_tokens=500, shuffle=True, seed=1)
    for epoch in (0, 1):
        batches = sampler.batches(epoch)
        assert all(len(b) * max(lengths[i] for i in b) <= 500 for b in batches)
        assert sorted(i for b in batches for i in b) == list(range(1000))
        assert sum(len(b) * max(lengths[i] for i in b) for b in batches) < 1.15 * sum(lengths)
    def as_lists(batches):  # batches are arrays of indices
        return [b.tolist() for b in batches]
    assert as_lists(sampler.batches(0)) == as_lists(TokenBatchSampler(lengths, 500,
                                                                      seed=1).batches(0))
    assert as_lists(sampler.batches(0)) != as_lists(sampler.batches(1))  # reshuffled each epoch
    sampler.set_epoch(1, start=5)
    assert list(sampler) == as_lists(sampler.batches(1)[5:])
    assert len(sampler) == len(sampler.batches(1)) - 5
    by_count = TokenBatchSampler(lengths, batch_size=32, shuffle=False).batches()
    assert max(len(b) for b in by_count) == 32
    assert sorted(i for b in by_count for i in b) == list(range(1000))


def test_collate_pads_to_the_longest_and_builds_the_masks():
    ds = BilingualDataset([[10, 11, 12], [13]], [[20, 21], [22, 23, 24, 25]], ["a", "b"],
                          ["c", "d"])
    batch = Collator(pad_id=1)([ds[0], ds[1]])
    assert batch["encoder_input"].tolist() == [[2, 10, 11, 12, 3], [2, 13, 3, 1, 1]]
    assert batch["decoder_input"].tolist() == [[2, 20, 21, 1, 1], [2, 22, 23, 24, 25]]
    assert batch["label"].tolist() == [[20, 21, 3, 1, 1], [22, 23, 24, 25, 3]]
    assert batch["encoder_mask"].shape == (2, 1, 1, 5)
    assert batch["encoder_mask"][1, 0, 0].tolist() == [True, True, True, False, False]
    assert set(batch) == {"encoder_input", "decoder_input", "label", "encoder_mask"}
