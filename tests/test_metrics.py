"""Scores: sacreBLEU's BLEU, chrF and lowercased BLEU with their signatures, CER and WER."""

import pytest

from metrics import edit_distance, error_rate, score


def test_edit_distance_cer_and_wer():
    assert edit_distance("kitten", "sitting") == 3
    assert edit_distance([], ["a"]) == 1
    assert error_rate(["a b c"], ["a x c"], words=True) == pytest.approx(1 / 3)
    assert error_rate(["abcd", "xy"], ["abcd", "xz"], words=False) == pytest.approx(1 / 6)


def test_score_gives_sacrebleus_numbers_and_signatures():
    """Issue 41: metrics.score (what every results.json, model card and --reference report
    comes from) had no test. Its numbers are sacreBLEU's own, cased and lowercased, each line
    of the report carries its signature, and the error rates are the corpus's."""
    import sacrebleu
    hyps = ["The cat sat on the mat .", "a Dog runs in the park", "hello"]
    refs = ["The cat sat on the mat .", "A dog runs through the park", "Hello there"]
    s = score(hyps, refs)
    assert s["bleu"] == pytest.approx(sacrebleu.corpus_bleu(hyps, [refs]).score)
    assert s["chrf"] == pytest.approx(sacrebleu.corpus_chrf(hyps, [refs]).score)
    assert s["bleu_lc"] == pytest.approx(sacrebleu.corpus_bleu(hyps, [refs], lowercase=True).score)
    assert s["bleu_lc"] > s["bleu"]  # "a Dog" / "hello" match only lowercased
    lines = s["report"].splitlines()
    assert [line.split()[0] for line in lines] == ["BLEU", "chrF2", "BLEU"]
    assert "case:mixed" in lines[0] and "case:lc" in lines[2] and "nrefs:1" in lines[0]
    assert all("version:" in line for line in lines)
    assert s["wer"] == pytest.approx(error_rate(hyps, refs, words=True))
    assert s["cer"] == pytest.approx(error_rate(hyps, refs, words=False))
    assert "cer" not in score(hyps, refs, error_rates=False)
    assert score(refs, refs)["bleu"] == pytest.approx(100.0)
