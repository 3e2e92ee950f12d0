"""Tokenizers: trained on train only, saved with their recipe and reused, exact round trips,
special tokens in text stay text."""

import dataclasses
import json

import pytest
from conftest import number_pairs, write_aligned

from config import Config
from corpus import DataError
from dataset import get_ds
from tokenizer import EOS, PAD, SOS, UNK, build_tokenizer, detokenize, get_tokenizer


def cfg(tmp_path, corpus=None, **kw):
    data = {"data_dir": str(corpus)} if corpus else {}
    return Config(**{"model_folder": str(tmp_path / "weights"), "lang_src": "en",
                     "lang_tgt": "it", "vocab_size": 300, "seq_len": 24, **data, **kw})


def test_bpe_tokenizer_has_no_unknown_words_and_detokenizes_exactly(tmp_path):
    tok = build_tokenizer("bpe", 300, [s for s, _ in number_pairs(50)])
    assert [tok.token_to_id(t) for t in ("[UNK]", "[PAD]", "[SOS]", "[EOS]")] == [0, 1, 2, 3]
    for text in ["Völlig neue Wörter, 😀 und 漢字!", "seven eight.", "tab\there"]:
        ids = tok.encode(text).ids
        assert 0 not in ids  # never [UNK]
        assert tok.decode(ids) == text
    word = build_tokenizer("word", 300, [s for s, _ in number_pairs(50)])
    assert word.encode("seven unseenword").ids[1] == 0  # the write-ups' tokenizer: [UNK]


def test_a_bpe_vocabulary_smaller_than_its_alphabet_is_said(capsys):
    """--vocab_size 10 gave a vocabulary of 260 without a word: BPE keeps every byte."""
    texts = [s for s, _ in number_pairs(50)]
    assert build_tokenizer("bpe", 10, texts).get_vocab_size() == 260
    assert capsys.readouterr().err == ("--vocab_size 10 is less than byte-level BPE's 256 bytes "
                                       "and 4 special tokens: the vocabulary has 260\n")
    build_tokenizer("bpe", 300, texts), build_tokenizer("word", 10, texts)
    assert build_tokenizer("word", 3, texts).get_vocab_size() == 4  # its 4 special tokens: no
    assert capsys.readouterr().err == ""  # word of BPE's bytes


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
    with pytest.raises(DataError, match="is a bpe tokenizer, but --tokenizer_type is word; use "
                       "another --model_folder or --tokenizer_type bpe$"):
        get_tokenizer(cfg(tmp_path, tokenizer_type="word"), "en", [])
    shared = cfg(tmp_path / "other", tokenizer_type="word", tokenizer_file=str(path).replace(
        "_en", "_{0}"))  # an absolute file outside the model folder: another folder finds it too
    with pytest.raises(DataError, match="use another --tokenizer_file or --tokenizer_type bpe$"):
        get_tokenizer(shared, "en", [])


def test_tokenizers_train_on_an_evenly_spaced_sample(tmp_path):
    corpus = tmp_path / "corpus"
    pairs = number_pairs(40, seed=1)
    # a word found only in the odd-numbered pairs: a sample of every other pair never sees it
    pairs = [(s + (" zebra" if i % 2 else ""), t) for i, (s, t) in enumerate(pairs)]
    write_aligned(corpus, "train", pairs)
    write_aligned(corpus, "val", number_pairs(4, seed=2))
    sampled = get_ds(cfg(tmp_path / "a", corpus, tokenizer_type="word", tokenizer_sample=20))
    assert "▁zebra" not in sampled.tokenizer_src.get_vocab()
    everything = get_ds(cfg(tmp_path / "b", corpus, tokenizer_type="word", tokenizer_sample=0))
    assert "▁zebra" in everything.tokenizer_src.get_vocab()


def test_special_token_strings_in_text_are_text(tmp_path):
    """9. "[EOS]" written in a sentence is not the end-of-sentence token."""
    pairs = number_pairs(30)
    for kind in ("bpe", "word"):
        config = Config(model_folder=str(tmp_path / kind), tokenizer_type=kind, vocab_size=300)
        get_tokenizer(config, "en", [s for s, _ in pairs] + ["[EOS] [PAD] [SOS] [UNK] one"] * 2)
        tok = get_tokenizer(config, "en", [])  # loaded from the file
        ids = tok.encode("one [EOS] two [PAD] [SOS]").ids
        assert not {PAD, SOS, EOS} & set(ids), (kind, ids)


def test_word_level_detokenizes_and_shows_unknown_words():
    """10. Word level: "doesn't" comes back as "doesn't", and unknown words are visible."""
    texts = ["He doesn't know (really).", "She doesn't know it, really!"] * 3
    tok = build_tokenizer("word", 100, texts)
    ids = tok.encode("She doesn't know (really).").ids
    assert detokenize(tok, ids) == "She doesn't know (really)."
    ids = tok.encode("He doesn't fly.").ids
    assert UNK in ids and detokenize(tok, ids) == "He doesn't [UNK]."


def test_tokenizer_files_of_another_recipe_are_refused(tmp_path, monkeypatch):
    """11. A model folder's tokenizers are reused only for the same type, size and language."""
    texts = [s for s, _ in number_pairs(40)]
    config = Config(model_folder=str(tmp_path), vocab_size=300)
    get_tokenizer(config, "en", texts)
    larger = Config(model_folder=str(tmp_path), vocab_size=500)
    # a folder with no checkpoint: a first start stopped after training them left them there
    with pytest.raises(DataError, match=r"was trained with --vocab_size 300, not 500, by a start "
                       r"that saved no checkpoint: delete it and tokenizer_en.meta.json to train "
                       r"a new one, or keep that value$"):
        get_tokenizer(larger, "en", texts)
    with pytest.raises(DataError, match=r"was trained with --tokenizer_sample 1000000, not 20, by "
                       r"a start that saved no checkpoint"):  # (it was reused without a word)
        get_tokenizer(dataclasses.replace(config, tokenizer_sample=20), "en", texts)
    meta = tmp_path / "tokenizer_en.meta.json"  # a recipe of before the sample was recorded
    meta.write_text(json.dumps({k: v for k, v in json.loads(meta.read_text()).items()
                                if k != "tokenizer_sample"}))
    get_tokenizer(dataclasses.replace(config, tokenizer_sample=20), "en", texts)
    # a --tokenizer_file outside the model folder: not that folder's to delete
    elsewhere = dataclasses.replace(larger, model_folder=str(tmp_path / "run"),
                                    tokenizer_file=str(tmp_path / "tokenizer_{0}.json"))
    with pytest.raises(DataError, match=r"not 500; keep that value, or give another "
                       r"--tokenizer_file \(runs trained with this one need it as it is\)$"):
        get_tokenizer(elsewhere, "en", texts)  # (another --model_folder finds the same file)
    monkeypatch.chdir(tmp_path)  # the default, relative --model_folder: the same advice
    relative = Config(model_folder="rel", vocab_size=300)
    get_tokenizer(relative, "en", texts)
    with pytest.raises(DataError, match="by a start that saved no checkpoint"):
        get_tokenizer(dataclasses.replace(relative, vocab_size=500), "en", texts)
    (tmp_path / "tmodel_00_s0000005.pt").write_bytes(b"")
    with pytest.raises(DataError, match=r"was trained with --vocab_size 300, not 500; keep that "
                       r"value, or train into another --model_folder \(these files belong to "
                       r"its checkpoints\)$"):
        get_tokenizer(larger, "en", texts)
    absolute = dataclasses.replace(larger, tokenizer_file=str(tmp_path / "tokenizer_{0}.json"))
    # an absolute --tokenizer_file in the model folder: another --model_folder finds it too
    for folder in (tmp_path, tmp_path / "another"):
        with pytest.raises(DataError, match=r"or give another --tokenizer_file"):
            get_tokenizer(dataclasses.replace(absolute, model_folder=str(folder)), "en", texts)
    with pytest.raises(DataError, match="use another --tokenizer_file or --tokenizer_type bpe$"):
        get_tokenizer(dataclasses.replace(absolute, tokenizer_type="word"), "en", texts)
    renamed = Config(model_folder=str(tmp_path), vocab_size=300,
                     tokenizer_file=str(tmp_path / "tokenizer_en.json").replace("_en", "_{0}"))
    (tmp_path / "tokenizer_en.json").rename(tmp_path / "tokenizer_fr.json")
    (tmp_path / "tokenizer_en.meta.json").rename(tmp_path / "tokenizer_fr.meta.json")
    with pytest.raises(DataError, match="was trained with --lang_src/--lang_tgt en, not fr"):
        get_tokenizer(renamed, "fr", texts)


def test_the_fingerprint_does_not_depend_on_how_the_merges_are_written():
    """Issue 56 (suspected by the review, confirmed): the fingerprint hashed the merges as the
    installed tokenizers writes them, lists from 0.20 on and "left right" strings before, so a
    tokenizers upgrade across 0.20 would have refused every earlier checkpoint. Both forms
    give the same pairs, and the fingerprint of a checkpoint written before keeps its value."""
    import json
    from pathlib import Path

    from tokenizers import Tokenizer

    from tokenizer import merge_pairs, tokenizer_fingerprint
    assert merge_pairs(["Ġ t", "h e"]) == merge_pairs([["Ġ", "t"], ["h", "e"]]) == \
        [["Ġ", "t"], ["h", "e"]]
    assert merge_pairs(None) is None
    from conftest import old_checkpoint_state
    data = Path(__file__).parent / "data" / "checkpoint_2026_11"
    tok = Tokenizer.from_file(str(data / "tokenizer_en.json"))
    merges = json.loads(tok.to_str())["model"]["merges"]
    assert merge_pairs([" ".join(m) for m in merges]) == merge_pairs(merges)
    state = old_checkpoint_state()
    assert state["tokenizers"][0] == tokenizer_fingerprint(tok)  # recorded in 2026-11


def test_a_checkpoint_recording_the_fingerprint_of_merges_as_strings_still_loads(tmp_path):
    """Issue 63, defect 1: checkpoints written before the fix under tokenizers < 0.20 recorded
    the hash of the merges as "left right" strings; the fix hashed pairs only, so such a
    checkpoint was refused by translate, resume, --init_from and --ensemble under any release.
    Either form is accepted; another tokenizer still is not."""
    from pathlib import Path

    from conftest import old_checkpoint_state
    from tokenizers import Tokenizer

    from nmt.checkpoint import CheckpointError, check_tokenizers
    from tokenizer import tokenizer_fingerprints
    data = Path(__file__).parent / "data" / "checkpoint_2026_11"
    src = Tokenizer.from_file(str(data / "tokenizer_en.json"))
    tgt = Tokenizer.from_file(str(data / "tokenizer_it.json"))
    assert tokenizer_fingerprints(src) == ("d711b1fca901f1b7", "e90c2c529e5d9a07")
    state = old_checkpoint_state()
    state["tokenizers"] = [tokenizer_fingerprints(src)[1], tokenizer_fingerprints(tgt)[1]]
    check_tokenizers(state, data / "tmodel_best.pt", src, tgt)  # as written under < 0.20
    state["tokenizers"][0] = tokenizer_fingerprints(tgt)[1]  # the target's: another tokenizer
    with pytest.raises(CheckpointError, match="other tokens or merges"):
        check_tokenizers(state, data / "tmodel_best.pt", src, tgt)


# ---- behaviours a mutation audit found unguarded -------------------------------------------------

def test_word_level_files_without_a_decoder_join_their_words_with_spaces():
    """Word-level tokenizer files of older versions have no decoder: detokenize joins their
    words with spaces, as the write-ups did."""
    tok = build_tokenizer("word", 100, ["the cat sat", "the cat sat"])
    tok.decoder = None
    assert detokenize(tok, tok.encode("the cat sat").ids) == "the cat sat"


def test_the_tokenizer_sample_holds_at_most_tokenizer_sample_texts():
    """sample_texts(ds, columns, n): evenly spaced, never more than n texts of a column (50
    pairs sampled to 20 is every third, not every second)."""
    from datasets import Dataset

    from tokenizer import sample_texts
    ds = Dataset.from_dict({"src": [f"s{i}" for i in range(50)],
                            "tgt": [f"t{i}" for i in range(50)]})
    src = [t for batch in sample_texts(ds, ["src"], 20) for t in batch]
    assert len(src) <= 20 and src[:3] == ["s0", "s3", "s6"]
    assert len([t for batch in sample_texts(ds, ["src"], 0) for t in batch]) == 50


def test_the_target_tokenizer_is_trained_on_the_target_side(tmp_path):
    """Separate vocabularies: the target tokenizer learns the target's words, the source's its
    own (word level, so a word is one vocabulary entry)."""
    from datasets import Dataset

    from tokenizer import get_tokenizers
    train = Dataset.from_dict({"src": ["the cat sat"] * 4, "tgt": ["il gatto sedeva"] * 4})
    src, tgt = get_tokenizers(cfg(tmp_path, tokenizer_type="word"), train)
    assert "▁gatto" in tgt.get_vocab() and "▁gatto" not in src.get_vocab()
    assert "▁cat" in src.get_vocab() and "▁cat" not in tgt.get_vocab()


def test_word_level_words_seen_once_are_unknown():
    """The write-ups' word level: a word seen fewer than twice in training becomes [UNK]."""
    tok = build_tokenizer("word", 100, ["the cat sat", "the cat ran"])
    assert tok.encode("ran").ids == [UNK] and UNK not in tok.encode("the cat").ids


def test_coverage_counts_single_byte_tokens_as_fallback():
    """tokenizer.coverage: BPE's fallback share is its single-character tokens only (a merged
    two-character token is covered)."""
    from tokenizer import coverage
    tok = build_tokenizer("bpe", 300, [s for s, _ in number_pairs(40)])
    vocab = tok.get_vocab()
    single = next(i for t, i in vocab.items() if len(t) == 1)
    double = next(i for t, i in vocab.items() if len(t) == 2)
    got = coverage(tok, ["one two"], [[single, double]])
    assert got == {"tokens_per_word": 1.0, "fallback": 0.5}


def test_a_tokenizer_file_with_its_special_tokens_at_other_ids_is_refused(tmp_path):
    """Every tokenizer has [UNK], [PAD], [SOS], [EOS] at ids 0-3: a file holding them at other
    ids (here [PAD] and [UNK] swapped) is refused, not read as if PAD were 1."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    from tokenizer import load_tokenizer
    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(["a b c"] * 2, trainers.WordLevelTrainer(
        special_tokens=["[PAD]", "[UNK]", "[SOS]", "[EOS]"], show_progress=False))
    tok.save(str(tmp_path / "tokenizer_en.json"))
    with pytest.raises(DataError, match=r"lacks the special token \[UNK\] at id 0"):
        load_tokenizer(tmp_path / "tokenizer_en.json")


def test_a_shared_vocabulary_is_one_joint_tokenizer_of_both_sides(tmp_path):
    """--shared_vocab: one tokenizer (tokenizer_en_it.json), trained on both sides, serves
    source and target (what tied embeddings need)."""
    from datasets import Dataset

    from tokenizer import get_tokenizers
    train = Dataset.from_dict({"src": ["the cat sat"] * 4, "tgt": ["il gatto sedeva"] * 4})
    config = cfg(tmp_path, tokenizer_type="word", shared_vocab=True)
    src, tgt = get_tokenizers(config, train)
    assert src is tgt and {"▁cat", "▁gatto"} <= set(src.get_vocab())
    assert (tmp_path / "weights" / "tokenizer_en_it.json").is_file()
