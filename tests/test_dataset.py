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
from dataset import (BilingualDataset, Collator, TokenArray, TokenBatchSampler, encode_pairs,
                     get_ds, prepared_folder)


def test_pairs_longer_than_seq_len_are_dropped_with_a_count(tmp_path, corpus, capsys):
    write_aligned(corpus, "train", number_pairs(60, seed=1) + [("one " * 40 + ".", "uno.")])
    data = get_ds(cfg(tmp_path, corpus))
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
    for f in (tmp_path / "other" / "weights").glob("tokenizer_*"):
        (tmp_path / "weights" / f.name).write_bytes(f.read_bytes())
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
    assert reads.count("train") == 1 and "prepared for" not in capsys.readouterr().err
    (corpus / "val.en").unlink()
    (corpus / "val.it").unlink()
    get_ds(cfg(tmp_path, corpus))  # now held out of train: prepared again, once
    get_ds(cfg(tmp_path, corpus))
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

def _pool_texts(batches, src_tok, tgt_tok):
    """The (source, target) texts of a list of padded batches, pair by pair, sorted."""
    pairs = []
    for batch in batches:
        for enc, label in zip(batch["encoder_input"], batch["label"]):
            src = [i for i in enc.tolist() if i != dataset.PAD]
            tgt = [i for i in label.tolist() if i != dataset.PAD]
            assert src[0] == dataset.SOS and src[-1] == dataset.EOS and tgt[-1] == dataset.EOS
            pairs.append((src_tok.decode(src[1:-1]), tgt_tok.decode(tgt[:-1])))
    return sorted(pairs)


def test_bpe_dropout_segments_a_pool_afresh_and_cuts_it_into_as_many_batches():
    """A pool of the sampler's batches comes back as as many batches of the same pairs (each
    source still with its own target, framed [SOS] ... [EOS]) in other, longer segmentations,
    drawn afresh at every call, sorted by their new lengths (what keeps padding low); a pair
    that would outgrow seq_len keeps its plain ids; p = 0 segments as the plain tokenizer."""
    from tokenizer import build_tokenizer
    pairs = number_pairs(60, seed=3, max_len=8)
    src_tok = build_tokenizer("bpe", 300, [s for s, _ in pairs])
    tgt_tok = build_tokenizer("bpe", 300, [t for _, t in pairs])
    data = dataset.BilingualDataset([src_tok.encode(s).ids for s, _ in pairs],
                                    [tgt_tok.encode(t).ids for _, t in pairs])
    pool = [list(range(i, 60, 4)) for i in range(4)]  # four batches of mixed lengths
    plain = [dataset.Collator()([data[i] for i in b]) for b in pool]
    texts = _pool_texts(plain, src_tok, tgt_tok)
    same = dataset.BPEDropout(data, src_tok, tgt_tok, 0.0, 64).__getitems__(pool)
    assert len(same) == 4 and _pool_texts(same, src_tok, tgt_tok) == texts
    assert sum(int((b["label"] != dataset.PAD).sum()) for b in same) == \
        sum(int((b["label"] != dataset.PAD).sum()) for b in plain)

    def lengths(batch):  # each pair's padded length, as the sampler counts it
        return torch.maximum((batch["encoder_input"] != dataset.PAD).sum(1),
                             (batch["label"] != dataset.PAD).sum(1))

    dropout = dataset.BPEDropout(data, src_tok, tgt_tok, 0.5, 64)
    draws = [dropout.__getitems__(pool) for _ in range(2)]
    for batches in draws:
        assert len(batches) == 4 and _pool_texts(batches, src_tok, tgt_tok) == texts
        for batch in batches:
            unframed = torch.where(batch["label"] == dataset.EOS, dataset.PAD, batch["label"])
            assert torch.equal(batch["decoder_input"][:, 1:], unframed[:, :-1])  # [SOS] + same
            assert torch.equal(batch["encoder_mask"], dataset.encoder_mask(
                batch["encoder_input"]))
        for first, second in zip(batches, batches[1:]):  # the pool re-cut by the new lengths
            assert lengths(first).max() <= lengths(second).min()
        assert sum(int((b["label"] != dataset.PAD).sum()) for b in batches) > \
            sum(int((b["label"] != dataset.PAD).sum()) for b in plain)
    assert _pool_texts(draws[0], src_tok, tgt_tok) == _pool_texts(draws[1], src_tok, tgt_tok)
    assert [b["label"].tolist() for b in draws[0]] != [b["label"].tolist() for b in draws[1]]
    tight = max(b["encoder_input"].size(1) for b in plain)  # the longest plain source fits
    cut = dataset.BPEDropout(data, src_tok, tgt_tok, 0.9, tight).__getitems__(pool)
    assert max(b["encoder_input"].size(1) for b in cut) <= tight


@pytest.mark.parametrize("k", [1, 2, 5, 13])
def test_even_cuts_make_exactly_k_batches_of_about_equal_tokens(k):
    """BPE-dropout's pools are cut into exactly as many batches as came in, each a run of the
    pairs sorted by length, none over the pool's padded tokens shared out k ways (and one pair)."""
    lengths = np.sort(np.random.default_rng(k).integers(3, 40, size=13 * 17))
    cuts = dataset.even_cuts(lengths, k)
    assert len(cuts) == k + 1 and cuts[0] == 0 and cuts[-1] == len(lengths)
    assert all(a < b for a, b in zip(cuts, cuts[1:]))
    padded = [(b - a) * int(lengths[b - 1]) for a, b in zip(cuts, cuts[1:])]
    assert max(padded) <= len(lengths) * int(lengths[-1]) / k + int(lengths[-1])


def test_training_batches_are_resegmented_and_validation_is_not(tmp_path):
    """--bpe_dropout reaches the training loader (validation and test decode sentences, never
    these batches): an epoch (its pools made in a DataLoader worker) is as many batches as
    without it, of every training pair once; a resumed epoch trains on the rest of it. The
    prepared data is the same with or without the flag (not part of its key)."""
    import train
    from config import parse_config
    make_corpus(tmp_path / "c", n=150, seed=1, val=4)
    keys, epochs = [], []
    for extra in ([], ["--bpe_dropout", "0.2", "--num_workers", "1"]):  # pools made in a worker
        config, given = parse_config(["--data_dir", str(tmp_path / "c"), "--vocab_size", "300",
                                      "--model_folder", str(tmp_path / "w"), "--d_model", "16",
                                      "--N", "1", "--h", "2", "--d_ff", "32", "--preload",
                                      "none", "--max_tokens", "30", "--seq_len", "30",
                                      "--experiment_name", str(tmp_path / "r"), *extra])
        run, _ = train.set_up(config, given)
        run.lock.release()
        run.writer.close()
        keys.append(run.data.key)
        dropped = getattr(run.loader.dataset, "dropped", None)
        assert (dropped is None) == (not extra) and (dropped is None or dropped[0].model.dropout
                                                     == pytest.approx(0.2))
        tok = run.data.tokenizer_src, run.data.tokenizer_tgt
        batches = [b for group, _ in train.accumulation_groups(run, 1) for b in group]
        assert len(batches) == run.batches_per_epoch > dataset.POOL_BATCHES
        epochs.append(_pool_texts(batches, *tok))
        rest = [b for group, _ in train.accumulation_groups(run, 1, start=5) for b in group]
        assert len(rest) == run.batches_per_epoch - 5
    assert keys[0] == keys[1]
    assert epochs[0] == epochs[1] and len(epochs[0]) == 150


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
    dropout = dataset.BPEDropout(None, src, tgt, 0.9, 24)
    assert all(dropout.segment(0, [ids])[0][0] == tag for _ in range(5))
    assert "encoded as text" not in capsys.readouterr().err
    dataset.get_ds(Config(model_folder=str(tmp_path / "plain"), extra_tag="<BT>", **base))
    assert "no token for --extra_tag <BT>" in capsys.readouterr().err


def test_bpe_dropout_keeps_special_token_text_as_text():
    """Issue 56, 6: a sentence holding the text "[EOS]" (or [PAD], [SOS], [UNK]) is text to
    the plain tokenizer; the dropout copy, made from to_str(), lost encode_special_tokens and
    encoded it as the control id mid-sentence, teaching the model to stop there."""
    from dataset import BPEDropout
    from tokenizer import SPECIAL_TOKENS, build_tokenizer
    texts = [f"{w} {v}" for w, v in number_pairs(200, seed=3)] + ["a [EOS] b [PAD] c"] * 5
    tok = build_tokenizer("bpe", 300, texts)
    text = "one [EOS] two [PAD] three [SOS] [UNK] four"
    plain = tok.encode(text).ids
    assert not set(plain) & {0, 1, 2, 3}
    import pickle
    made = BPEDropout(None, tok, tok, 0.5, seq_len=100)
    # issue 63, 5: as a DataLoader worker started by spawn or forkserver gets it (macOS's
    # default; Linux's from Python 3.14): pickled, which drops encode_special_tokens
    for dropped in (made, pickle.loads(pickle.dumps(made))):
        assert all(t.encode_special_tokens for t in dropped.plain + dropped.dropped)
        for _ in range(5):
            (ids,) = dropped.segment(0, [plain])
            assert not set(ids) & set(range(len(SPECIAL_TOKENS))), ids
            assert tok.decode(ids) == text


# ---- fixed batch shapes (issue 62) ---------------------------------------------------------------

def test_best_lengths_pad_the_least_of_every_choice():
    """dataset.best_lengths against every choice of k lengths (the longest always among them):
    no other pads these pairs less."""
    import itertools

    import numpy as np

    from dataset import best_lengths
    rng = np.random.default_rng(3)
    lengths = rng.integers(2, 30, 300)
    values = sorted(set(lengths.tolist()))

    def padding(bounds):
        bounds = np.array(bounds)
        return int((bounds[np.searchsorted(bounds, lengths)] - lengths).sum())
    for k in (1, 2, 3, 4):
        found = best_lengths(lengths, k)
        assert len(found) == k and found[-1] == max(values)
        least = min(padding(list(c) + [max(values)])
                    for c in itertools.combinations(values[:-1], k - 1))
        assert padding(found) == least
    assert best_lengths([5, 5, 7], 9) == (5, 7)  # no more lengths than there are


def test_a_fixed_shape_batch_has_the_loss_and_gradients_of_its_pairs():
    """Issue 62: a batch padded to its fixed (rows, length) shape, filler rows and all, gives
    the summed loss and the gradients of the same pairs batched as before; the sampler never
    puts more pairs in a batch than its shape has rows, and an epoch uses few shapes."""
    import numpy as np

    from conftest import tiny_model
    from dataset import (BilingualDataset, Collator, FixedShapes, TokenBatchSampler,
                         best_lengths, real_tokens)
    from kernels import BlockwiseLabelSmoothedCrossEntropy
    from tokenizer import PAD
    rng = np.random.default_rng(0)
    src = [rng.integers(4, 20, rng.integers(1, 14)).tolist() for _ in range(200)]
    tgt = [rng.integers(4, 20, rng.integers(1, 14)).tolist() for _ in range(200)]
    data = BilingualDataset(src, tgt)
    shapes = FixedShapes(best_lengths(data.lengths(), 4), 120, 0)
    sampler = TokenBatchSampler(data.lengths(), 120, shapes=shapes, seed=2)
    batches = sampler.batches(0)
    plain, fixed = Collator(PAD), Collator(PAD, shapes)
    seen = set()
    for b in batches:
        batch = fixed([data[i] for i in b])
        rows, length = batch["encoder_input"].shape
        assert (rows, length) == shapes.shape(max(data.lengths()[i] for i in b))
        assert len(b) <= rows and batch["label"].shape == (rows, length)
        seen.add((rows, length))
    assert len(seen) <= 4
    model = tiny_model(vocab=20, seq_len=32)  # dropout 0
    loss_fn = BlockwiseLabelSmoothedCrossEntropy(0.1, ignore_index=PAD)
    lengths = data.lengths()
    short = next(b for b in batches  # a batch with filler rows and a longer length than its own
                 if len(b) < shapes.shape(max(lengths[i] for i in b))[0]
                 and shapes.length(max(lengths[i] for i in b)) > max(lengths[i] for i in b))
    grads = []
    for collate in (plain, fixed):
        batch = collate([data[i] for i in short])
        model.zero_grad()
        loss = model(batch["encoder_input"], batch["decoder_input"], batch["encoder_mask"],
                     label=batch["label"], loss=loss_fn)
        loss.backward()
        grads.append((loss.detach(), [p.grad.clone() for p in model.parameters()],
                      real_tokens(batch), int((batch["label"] != PAD).sum())))
    (loss_a, grad_a, real_a, n_a), (loss_b, grad_b, real_b, n_b) = grads
    torch.testing.assert_close(loss_a, loss_b, rtol=1e-5, atol=1e-5)
    for a, b in zip(grad_a, grad_b):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    assert (real_a, n_a) == (real_b, n_b)  # filler rows count as no tokens
