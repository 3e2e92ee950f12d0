"""Batches and prepared data: token batches, masks, long pairs dropped, the memory-mapped training
split made once and trusted only while it matches."""

import os
import pickle

import numpy as np
import pytest
import torch
from conftest import make_corpus, number_pairs, write_aligned

import corpus as corpus_module
import dataset
from config import Config
from corpus import DataError
from dataset import (BilingualDataset, Collator, TokenArray, encode_pairs, get_ds,
                     prepared_folder)
from nmt.batching import TokenBatchSampler


def test_pairs_longer_than_seq_len_are_dropped_with_a_count(tmp_path, corpus, capsys):
    write_aligned(corpus, "train", number_pairs(60, seed=1) + [("one " * 40 + ".", "uno.")])
    data = get_ds(cfg(tmp_path, corpus))
    assert len(data.train) == 60
    assert "dropped 1 of 61 pairs longer than seq_len 24" in capsys.readouterr().err
    item = data.train[0]
    assert item["encoder_input"][0] == 2 and item["encoder_input"][-1] == 3
    assert torch.equal(item["decoder_input"][1:], item["label"][:-1])
    assert item["decoder_input"][0] == 2 and item["label"][-1] == 3


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


def test_prepared_data_pads_a_whole_batch_at_once_as_the_collator_does():
    """The DataLoader's fast path (BilingualDataset.__getitems__ on memory-mapped ids) gives
    the collator's batches exactly, shuffled indices, an empty sequence and one pair alone
    included; from lists it gives the items."""
    g = np.random.default_rng(0)
    src = [g.integers(4, 300, g.integers(0, 9)).tolist() for _ in range(50)] + [[]]
    tgt = [g.integers(4, 300, g.integers(1, 12)).tolist() for _ in range(51)]
    def flat(seqs):
        return TokenArray(np.array([t for s in seqs for t in s], dtype=np.uint16),
                          np.cumsum([0] + [len(s) for s in seqs]))
    lists, prepared = BilingualDataset(src, tgt), BilingualDataset(flat(src), flat(tgt))
    loader = torch.utils.data.DataLoader(prepared, batch_sampler=[[7, 50, 3, 41, 0], [50],
                                                                  list(range(51))[::-1]],
                                         collate_fn=Collator())
    for indices, batch in zip(loader.batch_sampler, loader, strict=True):
        assert isinstance(prepared.__getitems__(indices), dict)
        expected = Collator()([lists[i] for i in indices])
        assert batch.keys() == expected.keys()
        for key in batch:
            assert batch[key].dtype == expected[key].dtype
            assert torch.equal(batch[key], expected[key]), key
    assert isinstance(lists.__getitems__([0, 1]), list)


def test_the_length_a_pair_is_batched_by_is_its_padded_width_so_max_tokens_holds():
    """BilingualDataset.lengths() (what TokenBatchSampler cuts by) is each pair's width in a
    batch: the longer of encoder_input ([SOS] src [EOS]) and label (tgt [EOS]), from lists and
    from prepared data alike; so no collated batch of the sampler's holds more than max_tokens
    padded tokens on either side, targets longer than their sources included."""
    g = np.random.default_rng(1)
    src = [g.integers(4, 300, g.integers(0, 4)).tolist() for _ in range(40)]
    tgt = [g.integers(4, 300, g.integers(8, 12)).tolist() for _ in range(40)]
    src += [g.integers(4, 300, 11).tolist() for _ in range(10)]  # and sources the longer
    tgt += [g.integers(4, 300, 3).tolist() for _ in range(10)]

    def flat(seqs):
        return TokenArray(np.array([t for s in seqs for t in s], dtype=np.uint16),
                          np.cumsum([0] + [len(s) for s in seqs]))
    for ds in (BilingualDataset(src, tgt), BilingualDataset(flat(src), flat(tgt))):
        widths = [max(len(ds[i]["encoder_input"]), len(ds[i]["label"])) for i in range(len(ds))]
        assert np.asarray(ds.lengths()).tolist() == widths
        for batch in TokenBatchSampler(ds.lengths(), max_tokens=60, seed=0).batches():
            collated = Collator()([ds[i] for i in batch])
            for key in ("encoder_input", "decoder_input", "label"):
                assert collated[key].numel() <= 60, key


def cfg(tmp_path, corpus, **kw):
    kw = {"vocab_size": 300, "seq_len": 24, **kw}
    return Config(model_folder=str(tmp_path / "weights"), data_dir=str(corpus), lang_src="en",
                  lang_tgt="it", **kw)


@pytest.fixture
def reads(monkeypatch):
    """Counts how often a training file is read."""
    calls = []
    real = corpus_module._aligned_dataset

    def counting(src_file, tgt_file, chunk=100_000):
        calls.append(src_file.stem)
        return real(src_file, tgt_file, chunk)
    monkeypatch.setattr(corpus_module, "_aligned_dataset", counting)
    return calls


def batches(data, seed=3):
    sampler = TokenBatchSampler(data.train.lengths(), max_tokens=100, seed=seed)
    return [Collator()([data.train[i] for i in b]) for b in sampler.batches(0)]


def test_prepared_data_gives_the_batches_of_fresh_tokenization(tmp_path, corpus, reads):
    config = cfg(tmp_path, corpus)
    first = get_ds(config)  # prepares: reads train
    assert reads.count("train") == 1 and isinstance(first.train.src_ids, TokenArray)
    assert first.train.src_texts is None  # training texts are not kept
    again = get_ds(config)  # loads: does not read train again
    assert reads.count("train") == 1
    # the same ids as encoding the texts now, pair by pair and batch by batch
    pairs = number_pairs(64, seed=1)
    src, tgt, keep = encode_pairs([s for s, _ in pairs], [t for _, t in pairs],
                                  again.tokenizer_src, again.tokenizer_tgt, 24)
    assert [list(again.train.src_ids[i]) for i in range(len(again.train))] == \
        [src[i] for i in keep]
    assert [list(again.train.tgt_ids[i]) for i in range(len(again.train))] == \
        [tgt[i] for i in keep]
    for a, b in zip(batches(first), batches(again), strict=True):
        for key in a:
            assert torch.equal(a[key], b[key])
    assert again.train.src_ids.ids.dtype == np.uint16  # 300 tokens fit 16 bits
    # a spawned DataLoader worker gets the file's name, and maps the same ids
    pickled = pickle.dumps(again.train.tgt_ids)
    assert again.train.tgt_ids.ids.tobytes() not in pickled
    copy = pickle.loads(pickled)
    assert isinstance(copy.ids, np.memmap) and np.array_equal(copy.ids, again.train.tgt_ids.ids)


def test_a_changed_corpus_or_tokenizer_is_prepared_again(tmp_path, corpus, reads, capsys):
    config = cfg(tmp_path, corpus)
    get_ds(config)
    write_aligned(corpus, "train", number_pairs(70, seed=8))  # the corpus changes
    assert len(get_ds(config).train) == 70
    assert "was prepared for another corpus: preparing again" in capsys.readouterr().err
    assert reads.count("train") == 2
    # other tokenizer files (trained elsewhere, on a sample) make the prepared ids stale too
    get_ds(cfg(tmp_path / "other", corpus, tokenizer_sample=10))
    for f in (tmp_path / "other" / "weights").glob("tokenizer_*[!a].json"):  # (their recipes
        (tmp_path / "weights" / f.name).write_bytes(f.read_bytes())  # left: the files alone)
    capsys.readouterr()
    get_ds(config)
    assert "was prepared for other tokenizers: preparing again" in capsys.readouterr().err
    assert reads.count("train") == 4
    get_ds(cfg(tmp_path, corpus, seq_len=12))  # another seq_len keeps other pairs
    assert "was prepared for another --seq_len" in capsys.readouterr().err
    assert reads.count("train") == 5


def test_another_seed_prepares_again_only_when_validation_is_held_out(tmp_path, corpus, reads,
                                                                      capsys):
    """Issue 16, defect 5: --seed re-prepared a corpus with a validation split of its own (15
    minutes at WMT size), saying the corpus had changed."""
    get_ds(cfg(tmp_path, corpus))
    get_ds(cfg(tmp_path, corpus, seed=7, val_fraction=0.2))  # val.en/val.it: nothing to redraw
    err = capsys.readouterr().err  # (and --val_fraction, unused, is said so: it was silent)
    assert reads.count("train") == 1 and "prepared for" not in err
    assert "validation pairs (the corpus's own: --val_fraction 0.2 is not used)" in err, err
    (corpus / "val.en").unlink()
    (corpus / "val.it").unlink()
    get_ds(cfg(tmp_path, corpus, val_fraction=0.2))  # now held out of train: prepared again,
    assert "is not used" not in capsys.readouterr().err  # once (--val_fraction used)
    get_ds(cfg(tmp_path, corpus, val_fraction=0.2))
    assert reads.count("train") == 2
    capsys.readouterr()
    get_ds(cfg(tmp_path, corpus, seed=7))  # another seed draws another validation split
    assert "prepared for another --seed or --val_fraction" in capsys.readouterr().err
    assert reads.count("train") == 3


def test_damaged_prepared_data_is_detected_and_prepared_again(tmp_path, corpus, reads, capsys):
    config = cfg(tmp_path, corpus)
    expected = [list(x) for x in get_ds(config).train.tgt_ids]
    ids = prepared_folder(config) / "train.tgt.bin"
    data = bytearray(ids.read_bytes())
    data[10] ^= 0xFF  # one flipped byte
    ids.write_bytes(bytes(data))
    again = get_ds(config)
    assert "train.tgt.bin is damaged or missing: preparing again" in capsys.readouterr().err
    assert [list(x) for x in again.train.tgt_ids] == expected
    (prepared_folder(config) / "train.src.offsets.npy").unlink()
    get_ds(config)
    assert "damaged or missing" in capsys.readouterr().err
    assert reads.count("train") == 3


def test_other_ranks_load_rank_0s_data_and_never_prepare_their_own(tmp_path, corpus, monkeypatch):
    """Under torchrun rank 0 prepares, then the others load its files; a process that cannot
    see them (machines without a shared --model_folder) stops with one line instead of
    preparing a copy of its own in the same folder as its neighbours."""
    config = cfg(tmp_path, corpus)
    monkeypatch.setattr(dataset, "is_main", lambda: False)
    with pytest.raises(dataset.DataError, match="shared filesystem"):
        get_ds(config)
    assert not prepared_folder(config).exists() and not list((tmp_path / "weights").glob("*"))
    monkeypatch.setattr(dataset, "is_main", lambda: True)
    made = get_ds(config)  # rank 0 prepares ...
    monkeypatch.setattr(dataset, "is_main", lambda: False)
    assert len(get_ds(config).train) == 64  # ... and the others load it
    # another machine's copy of the corpus with other modification times is the same corpus;
    # one whose text differs is not, but with the key rank 0 passes on, its processes load
    # rank 0's prepared data
    for f in corpus.iterdir():
        os.utime(f, (f.stat().st_atime, f.stat().st_mtime + 3600))
    assert get_ds(config).key == made.key
    write_aligned(corpus, "val", number_pairs(8, seed=3))
    with pytest.raises(dataset.DataError, match="shared filesystem"):
        get_ds(config)
    again = get_ds(config, made.key)
    assert again.key == made.key and len(again.train) == 64


def test_a_seq_len_no_pair_fits_is_refused_leaving_no_files(tmp_path, corpus):
    """Issue 24: --seq_len 5 trained the tokenizers and prepared the corpus, then refused,
    leaving prepared/ behind. Now the refusal comes before anything is kept, and the files
    the start made are removed: the folder is as it was."""
    config = cfg(tmp_path, corpus, seq_len=4)
    with pytest.raises(DataError, match=r"no training pair fits --seq_len 4: the shortest "
                                        r"needs \d+ tokens with \[SOS\] and \[EOS\]"):
        get_ds(config)
    folder = tmp_path / "weights"
    assert not folder.exists() or not any(folder.iterdir()), list(folder.iterdir())


def test_a_full_disk_while_preparing_is_one_line_and_leaves_no_files(tmp_path, corpus,
                                                                      monkeypatch):
    """Issue 24, the rest of its kind: a full disk while the training split was being
    encoded ended in a traceback, leaving prepared.tmp/ and the new tokenizers behind."""
    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(np, "save", disk_full)
    with pytest.raises(DataError, match="No space left on device; the files already there "
                                        "are untouched"):
        get_ds(cfg(tmp_path, corpus))
    folder = tmp_path / "weights"
    assert not folder.exists() or not any(folder.iterdir()), list(folder.iterdir())


# ---- subword regularization (issue 43: --bpe_dropout) ------------------------------------------


def test_extra_pairs_are_trained_on_but_leave_the_vocabulary_as_it_was(tmp_path):
    """Issue 43: the tokenizers train on the corpus's own pairs only, so that a run with
    back-translated pairs keeps the vocabulary of the run without; the prepared data holds
    both (and is another prepared data: another key)."""
    from tokenizer import tokenizer_fingerprint
    make_corpus(tmp_path / "c", n=40, seed=1, val=4)
    write_aligned(tmp_path / "bt", "train", [(f"zzyzx qwv {i}.", f"kkrq jjw {i}.")
                                             for i in range(30)])
    found = []
    for name, extra in (("plain", {}), ("bt", {"extra_data_dir": str(tmp_path / "bt")})):
        data = dataset.get_ds(Config(data_dir=str(tmp_path / "c"), model_folder=str(
            tmp_path / name), vocab_size=300, seq_len=24, **extra))
        found.append(([tokenizer_fingerprint(t) for t in (data.tokenizer_src,
                                                         data.tokenizer_tgt)], len(data.train),
                      data.key))
    assert found[0][0] == found[1][0] and found[1][1] == found[0][1] + 30
    assert found[0][2] != found[1][2]


def test_an_extra_tag_is_one_token_of_the_source_vocabulary(tmp_path, capsys):
    """Issue 43: --extra_tag becomes one token, after the trained vocabulary, of the source
    side only, and takes the space after it: a tagged source is the tag's id, then the ids of
    the untagged sentence (merges and every other id as without the flag); BPE-dropout never
    splits it. A tokenizer made without the tag keeps encoding it as text, and says so."""
    from nmt.bpe_dropout import BPEDropout
    from tokenizer import tokenizer_fingerprint
    make_corpus(tmp_path / "c", n=40, seed=1, val=4)
    write_aligned(tmp_path / "bt", "train", number_pairs(30, seed=3))
    base = {"data_dir": str(tmp_path / "c"), "vocab_size": 300, "seq_len": 24,
            "extra_data_dir": str(tmp_path / "bt")}
    plain = dataset.get_ds(Config(model_folder=str(tmp_path / "plain"), **base))
    tagged = dataset.get_ds(Config(model_folder=str(tmp_path / "tagged"), extra_tag="<BT>",
                                   **base))
    src, tgt = tagged.tokenizer_src, tagged.tokenizer_tgt
    tag = src.token_to_id("<BT>")
    assert tag == plain.tokenizer_src.get_vocab_size() == src.get_vocab_size() - 1
    assert tgt.token_to_id("<BT>") is None
    assert tokenizer_fingerprint(tgt) == tokenizer_fingerprint(plain.tokenizer_tgt)
    assert {k: v for k, v in src.get_vocab().items() if v != tag} == \
        plain.tokenizer_src.get_vocab()
    sentence = number_pairs(1, seed=3)[0][0]
    ids = src.encode(f"<BT> {sentence}").ids
    assert ids == [tag] + plain.tokenizer_src.encode(sentence).ids
    dropout = BPEDropout(None, src, tgt, 0.9, 24)
    assert all(dropout.segment(0, [ids])[0][0] == tag for _ in range(5))
    assert "encoded as text" not in capsys.readouterr().err
    dataset.get_ds(Config(model_folder=str(tmp_path / "plain"), extra_tag="<BT>", **base))
    assert "no token for --extra_tag <BT>" in capsys.readouterr().err




# ---- behaviours a mutation audit found unguarded -------------------------------------------------

def _word_tokenizer():
    from tokenizer import build_tokenizer
    return build_tokenizer("word", 100, ["a b c d e f g"] * 2)


def test_a_pair_fits_seq_len_exactly_and_a_long_target_alone_drops_it():
    """encode_pairs keeps a pair whose sides need exactly seq_len tokens with [SOS]/[EOS], and
    drops one whose target alone is too long (the source fitting)."""
    tok = _word_tokenizer()
    src, tgt, keep = encode_pairs(["a b c", "a", "a b"], ["a b", "a b c d e f", "a b c"],
                                  tok, tok, 5)
    assert [len(s) for s in src] == [3, 1, 2]
    assert keep == [0, 2]  # 3 + 2 == seq_len fits; a 6-token target does not


def test_a_pair_is_balanced_up_to_max_len_ratio_times_either_way():
    """balanced (--max_len_ratio R, as Moses' clean-corpus-n -ratio): a pair whose longer side
    has R times the shorter's tokens stays, one token more on either side drops it; 0 keeps
    every pair."""
    from dataset import balanced
    assert balanced(2, 3, 1.5) and balanced(3, 2, 1.5) and balanced(4, 4, 1.0)
    assert not balanced(2, 4, 1.5) and not balanced(4, 2, 1.5) and not balanced(4, 5, 1.0)
    assert balanced(1, 40, 0.0) and not balanced(0, 1, 3.0)


def test_max_len_ratio_drops_unbalanced_training_pairs_alone(tmp_path, corpus, capsys):
    """--max_len_ratio 1.5: the training pairs beyond it are dropped from the prepared data,
    with a count apart from seq_len's; validation keeps such a pair. Data prepared without the
    flag keeps its key (no flag in its parts), and a ratio given prepares it again, saying
    why."""
    import json
    long = "one two three four five six seven eight nine ."
    pairs = number_pairs(60, seed=1) + [(long, "uno."),
                                        ("one.", "uno due tre quattro cinque sei sette otto .")]
    write_aligned(corpus, "train", pairs)
    write_aligned(corpus, "val", [(long, "uno.")] + number_pairs(7, seed=2))
    plain = get_ds(cfg(tmp_path, corpus))
    meta = json.loads((prepared_folder(cfg(tmp_path, corpus)) / "meta.json").read_text())
    src, tgt, keep = encode_pairs([s for s, _ in pairs], [t for _, t in pairs],
                                  plain.tokenizer_src, plain.tokenizer_tgt, 24)
    assert "max_len_ratio" not in meta["parts"] and len(plain.train) == len(keep)
    capsys.readouterr()
    data = get_ds(cfg(tmp_path, corpus, max_len_ratio=1.5))  # (the same tokenizer files)
    err = capsys.readouterr().err
    assert "was prepared for another --max_len_ratio: preparing again" in err
    kept = [i for i in keep if max(len(src[i]), len(tgt[i])) <= 1.5 * min(len(src[i]),
                                                                          len(tgt[i]))]
    assert {60, 61} <= set(keep) - set(kept)
    assert [list(data.train.src_ids[i]) for i in range(len(data.train))] == [src[i] for i in kept]
    assert (f"train: dropped {len(keep) - len(kept)} of 62 pairs whose longer side has more "
            f"than --max_len_ratio 1.5 times the tokens of the shorter") in err
    assert len(keep) == 62 and "longer than seq_len" not in err  # (counted apart)
    assert len(data.validation) == 8


def test_a_framed_source_is_cut_to_seq_len_with_its_special_tokens():
    """framed_source(ids, seq_len): [SOS] ids [EOS], seq_len tokens at most, [EOS] kept last."""
    from dataset import framed_source
    from tokenizer import EOS, SOS
    assert framed_source(range(10, 20), 6).tolist() == [SOS, 10, 11, 12, 13, EOS]
    assert framed_source([10, 11], 6).tolist() == [SOS, 10, 11, EOS]


def test_validation_texts_stay_with_their_ids_when_a_pair_is_dropped():
    """to_bilingual drops long pairs from the ids and from the texts alike: each kept pair's
    texts (what BLEU is scored against) are its own."""
    from dataset import to_bilingual
    tok = _word_tokenizer()
    ds = to_bilingual(["a", "a b c d e f", "b"], ["c", "d", "e f"], tok, tok, 5, "validation")
    assert ds.src_texts == ["a", "b"] and ds.tgt_texts == ["c", "e f"]
    assert [tok.decode(ids) for ids in ds.tgt_ids] == ["c", "e f"]


class NumberIds:
    """The two methods prepare asks of a tokenizer: a text of numbers is their ids, of a
    vocabulary of 70,000."""

    class Encoding:
        def __init__(self, ids):
            self.ids = ids

    def get_vocab_size(self):
        return 70_000

    def encode_batch(self, texts):
        return [self.Encoding([int(w) for w in t.split()]) for t in texts]


def test_a_max_len_ratio_that_leaves_no_pair_says_so_and_writes_nothing(tmp_path):
    """Every pair fits --seq_len, none --max_len_ratio: one line naming both, and no prepared
    folder (nor its temporary one) is left."""
    from datasets import Dataset
    pairs = {"src": ["5 6 7 8", "5"], "tgt": ["5", "5 6 7"]}
    splits = {"train": Dataset.from_dict(pairs), "validation": Dataset.from_dict(pairs)}
    folder = tmp_path / "prepared"
    with pytest.raises(DataError, match=r"^no training pair fits --seq_len 16 and --max_len_ratio "
                                        r"1\.5: 2 of the 2 fit --seq_len, but their sides' "
                                        r"lengths differ more$"):
        dataset.prepare(folder, {"k": 1}, splits, NumberIds(), NumberIds(), 16, 1.5)
    assert list(tmp_path.iterdir()) == []


def test_prepared_ids_beyond_uint16_are_stored_whole(tmp_path):
    """Prepared ids are uint16 only while the vocabulary fits 65,536 ids: a larger vocabulary's
    ids (70,000 here) are stored in int32 and come back as they were encoded."""
    from datasets import Dataset
    pairs = {"src": ["69999 5", "70000"], "tgt": ["65537", "4 66000"]}
    splits = {"train": Dataset.from_dict(pairs), "validation": Dataset.from_dict(pairs)}
    folder = tmp_path / "prepared"
    dataset.prepare(folder, {"k": 1}, splits, NumberIds(), NumberIds(), 16)
    train, _, _ = dataset.load_prepared(folder, dataset.prepared_key({"k": 1}))
    assert [list(map(int, train.src_ids[i])) for i in range(2)] == [[69999, 5], [70000]]
    assert [list(map(int, train.tgt_ids[i])) for i in range(2)] == [[65537], [4, 66000]]
