"""nmt/bpe_dropout.py: subword regularization, pools of batches segmented afresh and cut again,
in the training loader only."""

import pytest
import torch
from conftest import make_corpus, number_pairs

from dataset import BilingualDataset, Collator, encoder_mask
from nmt.bpe_dropout import POOL_BATCHES, BPEDropout
from tokenizer import EOS, PAD, SOS


def _pool_texts(batches, src_tok, tgt_tok):
    """The (source, target) texts of a list of padded batches, pair by pair, sorted."""
    pairs = []
    for batch in batches:
        for enc, label in zip(batch["encoder_input"], batch["label"]):
            src = [i for i in enc.tolist() if i != PAD]
            tgt = [i for i in label.tolist() if i != PAD]
            assert src[0] == SOS and src[-1] == EOS and tgt[-1] == EOS
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
    data = BilingualDataset([src_tok.encode(s).ids for s, _ in pairs],
                                    [tgt_tok.encode(t).ids for _, t in pairs])
    pool = [list(range(i, 60, 4)) for i in range(4)]  # four batches of mixed lengths
    plain = [Collator()([data[i] for i in b]) for b in pool]
    texts = _pool_texts(plain, src_tok, tgt_tok)
    same = BPEDropout(data, src_tok, tgt_tok, 0.0, 64).__getitems__(pool)
    assert len(same) == 4 and _pool_texts(same, src_tok, tgt_tok) == texts
    assert sum(int((b["label"] != PAD).sum()) for b in same) == \
        sum(int((b["label"] != PAD).sum()) for b in plain)

    def lengths(batch):  # each pair's padded length, as the sampler counts it
        return torch.maximum((batch["encoder_input"] != PAD).sum(1),
                             (batch["label"] != PAD).sum(1))

    dropout = BPEDropout(data, src_tok, tgt_tok, 0.5, 64)
    draws = [dropout.__getitems__(pool) for _ in range(2)]
    for batches in draws:
        assert len(batches) == 4 and _pool_texts(batches, src_tok, tgt_tok) == texts
        for batch in batches:
            unframed = torch.where(batch["label"] == EOS, PAD, batch["label"])
            assert torch.equal(batch["decoder_input"][:, 1:], unframed[:, :-1])  # [SOS] + same
            assert torch.equal(batch["encoder_mask"], encoder_mask(
                batch["encoder_input"]))
        for first, second in zip(batches, batches[1:]):  # the pool re-cut by the new lengths
            assert lengths(first).max() <= lengths(second).min()
        assert sum(int((b["label"] != PAD).sum()) for b in batches) > \
            sum(int((b["label"] != PAD).sum()) for b in plain)
    assert _pool_texts(draws[0], src_tok, tgt_tok) == _pool_texts(draws[1], src_tok, tgt_tok)
    assert [b["label"].tolist() for b in draws[0]] != [b["label"].tolist() for b in draws[1]]
    tight = max(b["encoder_input"].size(1) for b in plain)  # the longest plain source fits
    cut = BPEDropout(data, src_tok, tgt_tok, 0.9, tight).__getitems__(pool)
    assert max(b["encoder_input"].size(1) for b in cut) <= tight

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
        assert len(batches) == run.batches_per_epoch > POOL_BATCHES
        epochs.append(_pool_texts(batches, *tok))
        rest = [b for group, _ in train.accumulation_groups(run, 1, start=5) for b in group]
        assert len(rest) == run.batches_per_epoch - 5
    assert keys[0] == keys[1]
    assert epochs[0] == epochs[1] and len(epochs[0]) == 150

def test_bpe_dropout_keeps_special_token_text_as_text():
    """Issue 56, 6: a sentence holding the text "[EOS]" (or [PAD], [SOS], [UNK]) is text to
    the plain tokenizer; the dropout copy, made from to_str(), lost encode_special_tokens and
    encoded it as the control id mid-sentence, teaching the model to stop there."""
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


def test_pooled_batches_count_a_last_smaller_pool():
    """PooledBatches: `size` batches a pool, the last pool smaller; its length (the loader's
    steps of an epoch) counts that last pool, as many as it yields."""
    from nmt.bpe_dropout import PooledBatches
    batches = [[i] for i in range(10)]
    pools = PooledBatches(batches, 4)
    assert len(pools) == 3 == len(list(pools))
    assert [len(p) for p in pools] == [4, 4, 2] and len(PooledBatches(batches[:8], 4)) == 2


def test_bpe_dropout_leaves_the_plain_tokenizers_deterministic():
    """BPEDropout sets dropout on copies of the tokenizers: the plain ones (validation, test,
    translation and checkpoints use them) keep segmenting every sentence one way."""
    from tokenizer import build_tokenizer
    pairs = number_pairs(40, seed=3)
    tok = build_tokenizer("bpe", 300, [s for s, _ in pairs] + [t for _, t in pairs])
    text = pairs[0][0]
    plain = tok.encode(text).ids
    data = BilingualDataset([tok.encode(s).ids for s, _ in pairs],
                            [tok.encode(t).ids for _, t in pairs])
    BPEDropout(data, tok, tok, 0.9, 64)
    assert not tok.model.dropout
    assert all(tok.encode(text).ids == plain for _ in range(20))
