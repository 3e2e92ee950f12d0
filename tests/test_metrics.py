"""Scores: sacreBLEU's BLEU, chrF and lowercased BLEU with their signatures, CER and WER."""

import random

import pytest

from nmt.metrics import compare, edit_distance, error_rate, score, table_edit_distance


def test_edit_distance_cer_and_wer():
    for distance in (edit_distance, table_edit_distance):
        assert distance("kitten", "sitting") == 3 and distance("sitting", "kitten") == 3
        assert distance([], ["a"]) == 1 and distance(["a", "b"], ["b"]) == 1
    assert error_rate(["a b c"], ["a x c"], words=True) == pytest.approx(1 / 3)
    assert error_rate(["abcd", "xy"], ["abcd", "xz"], words=False) == pytest.approx(1 / 6)


def test_error_rates_divide_by_the_reference_length_not_the_hypothesis():
    """CER and WER are the corpus's edits over its reference characters or words: a short
    hypothesis (2 of 4 characters; 1 of 4 words) has an error rate of 0.5 and 0.75, not 1 and
    3, and an empty one 1.0; an over-long one can exceed 1."""
    assert error_rate(["ab"], ["abcd"], words=False) == pytest.approx(2 / 4)
    assert error_rate(["a"], ["a b c d"], words=True) == pytest.approx(3 / 4)
    assert error_rate([""], ["abc"], words=False) == pytest.approx(1.0)
    assert error_rate(["abcdef", "x"], ["ab", "xy"], words=False) == pytest.approx(5 / 4)
    assert score(["ab"], ["abcd"], n_bootstrap=1)["cer"] == pytest.approx(0.5)


def test_the_bit_vector_edit_distance_is_the_tables():
    """The bit-parallel distance (every validation's CER and WER) against the table, on random
    pairs: either one the longer, empty ones, small and large alphabets (many matches and
    few), longer than 64 symbols (more than one machine word), words as symbols."""
    rng = random.Random(0)
    for trial in range(3000):
        alphabet = "ab" if trial % 3 == 0 else "abcdefghijklmnopqrstuvwxyz "
        a, b = ("".join(rng.choice(alphabet) for _ in range(rng.randint(0, n)))
                for n in (rng.choice([3, 20, 150]), rng.choice([3, 20, 150])))
        assert edit_distance(a, b) == table_edit_distance(a, b), (a, b)
        assert edit_distance(a.split(), b.split()) == table_edit_distance(a.split(), b.split())
    assert edit_distance("x" * 100, "") == 100 and edit_distance("", "") == 0
    assert edit_distance("abc" * 40, "abc" * 40) == 0


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


def test_every_score_carries_sacrebleus_bootstrap_confidence_interval():
    """Issue 42: a score without its uncertainty cannot tell a gain from a draw's noise. Each
    BLEU and chrF carries the half-width of sacreBLEU's own 95% interval (1000 resamples, its
    seed), and the signature says so; validation during training skips it (n_bootstrap 1)."""
    from sacrebleu.metrics import BLEU, CHRF
    hyps = [f"the cat number {i} sat on {'the' if i % 3 else 'a'} mat" for i in range(30)]
    refs = [f"the cat number {i} sat on the mat" for i in range(30)]
    s = score(hyps, refs, error_rates=False)
    assert s["bleu_ci"] == pytest.approx(BLEU().corpus_score(hyps, [refs], n_bootstrap=1000)._ci)
    assert s["chrf_ci"] == pytest.approx(CHRF().corpus_score(hyps, [refs], n_bootstrap=1000)._ci)
    assert 0 < s["bleu_ci"] < 20 and s["bleu_lc_ci"] > 0
    assert all("bs:1000|seed:12345" in line and "±" in line for line in s["report"].splitlines())
    quick = score(hyps, refs, n_bootstrap=1)
    assert "bleu_ci" not in quick and "bs:" not in quick["report"]
    assert quick["bleu"] == s["bleu"]


def test_paired_tests_tell_a_real_gain_from_none():
    """Issue 42: compare's p-values are sacreBLEU's paired bootstrap and approximate
    randomization against the first system: small for a much better system, large for one
    that differs from the baseline by chance, 1 for the baseline's own output."""
    from sacrebleu.metrics import BLEU
    from sacrebleu.significance import PairedTest
    refs = [f"a dog number {i} runs through the green grass" for i in range(60)]
    one, other = "runs on the grass", "runs through grass"  # two ways, as good as each other
    base = [f"a dog number {i} {one if i % 2 else other}" for i in range(60)]
    better = [r if i % 2 else b for i, (r, b) in enumerate(zip(refs, base))]
    noise = [f"a dog number {i} {other if i % 2 else one}" for i in range(60)]  # swapped
    found = compare([("base", base), ("better", better), ("noise", noise), ("same", base)],
                    refs)
    assert found["systems"] == ["base", "better", "noise", "same"]
    for metric in ("bleu", "chrf"):
        rows = found[metric]
        assert rows[0]["p_bs"] is None and rows[0]["p_ar"] is None and rows[1]["ci"] > 0
        assert rows[1]["p_bs"] < 0.01 and rows[1]["p_ar"] < 0.01 and \
            rows[1]["score"] > rows[0]["score"]
        assert rows[3]["p_bs"] == rows[3]["p_ar"] == 1.0
    assert found["bleu"][2]["p_ar"] > 0.05 and found["bleu"][2]["p_bs"] > 0.05  # no difference
    own = PairedTest([("base", base), ("better", better)], {"BLEU": BLEU()}, [refs],
                     test_type="ar", n_samples=10000)()[1]["BLEU"][1]
    assert found["bleu"][1]["p_ar"] == own.p_value and found["bleu"][1]["score"] == own.score
    assert "|bs:1000|" in found["signatures"]["bleu"][0]
    assert "|ar:10000|" in found["signatures"]["bleu"][1]


def test_the_interval_of_a_tiny_set_where_sacrebleus_own_mean_fails():
    """sacreBLEU 2.x's bootstrap takes statistics.mean of chrF scores that mix float and
    numpy.float32 when some resamples score 0 (a 4-sentence test set: a run's model card failed
    on it). The same resamples give the interval all the same."""
    hyps, refs = ["uno due tre quattro", "xx yy", "zz", "ww"], ["uno due tre quattro",
                                                               "aa bb", "cc", "dd"]
    s = score(hyps, refs, error_rates=False)
    assert 0 < s["chrf_ci"] <= 50 and "bs:1000" in s["report"].splitlines()[1]
    assert s["bleu_ci"] > 0 and "±" in s["report"].splitlines()[1]


def test_the_p_value_is_the_share_at_least_as_extreme():
    """Issue 56, 1: p = (c + 1) / (n + 1), c the resamples or permutations whose statistic is at
    least as extreme as the observed difference (ties counted): a difference of zero gets 1."""
    from nmt.metrics import at_least_as_extreme
    stats = [0.0, 0.5, 1.0, 1.0, 2.0]
    assert at_least_as_extreme(stats, 1.0) == 4 / 6  # 1.0, 1.0 and 2.0, and the observed one
    assert at_least_as_extreme(stats, 2.5) == 1 / 6
    assert at_least_as_extreme([0.0] * 9, 0.0) == 1.0


def test_moses_tokenized_is_the_papers_reference_pipeline():
    """Issue 61: lowercased, then Moses's punctuation normalization and tokenization with
    tokenizer.perl's escaping: the form of Multi30k's tok/*.lc.norm.tok.* references."""
    from nmt.metrics import moses_tokenized
    assert moses_tokenized(['Ein Mann hält ein Schild: "Joe\'s Bar".'], "de") == [
        "ein mann hält ein schild : &quot; joe &apos; s bar &quot; ."]  # as the dataset's
    assert moses_tokenized(["A dog, running."], "en") == ["a dog , running ."]


def test_papers_bleu_scores_tokenized_lowercased_text_and_says_so():
    """Issue 61: the papers' BLEU tokenizes and lowercases the hypotheses only (the references
    come tokenized), scores with sacreBLEU's tokenize none, and names itself apart from
    sacreBLEU's BLEU."""
    import sacrebleu

    from nmt.metrics import PAPERS_BLEU, papers_bleu
    hyps = ["Ein Hund läuft, schnell.", "Zwei Männer sitzen auf einer Bank"]
    refs = ["ein hund läuft , schnell .", "zwei männer stehen auf einer bank ."]
    found = papers_bleu(hyps, refs, "de")
    assert found["bleu"] == pytest.approx(sacrebleu.corpus_bleu(
        ["ein hund läuft , schnell .", "zwei männer sitzen auf einer bank"], [refs],
        tokenize="none").score)
    assert papers_bleu(["Ein Hund läuft, schnell."], refs[:1], "de")["bleu"] == pytest.approx(100)
    # cased sacreBLEU on the raw text is another measure: the lowercased reference loses there
    assert sacrebleu.corpus_bleu(hyps[:1], [refs[:1]]).score < 100.0
    assert found["report"].startswith(PAPERS_BLEU) and "tok:none" in found["report"]


@pytest.mark.parametrize("line, split", [
    ("Rich-Text-Format", "Rich ##AT##-##AT## Text ##AT##-##AT## Format"),
    ("a-b-c", "a ##AT##-##AT## b-c"),  # left to right, no overlap: as Perl's s{}{}g
    ("x - y -z z- 3-4", "x - y -z z- 3 ##AT##-##AT## 4"),  # a blank on either side: no compound
    ("x\xa0-y", "x\xa0 ##AT##-##AT## y"),  # a no-break space is no blank to Perl on bytes
    ("x\t-y", "x\t-y"),
    # Perl's \S is a byte: a character of two or three bytes between hyphens ends one match
    # and starts the next, where an ASCII one ("a-b-c") is taken by the first match alone
    ("a-\xe4-b", "a ##AT##-##AT## \xe4 ##AT##-##AT## b"),
    ("10-\u20ac-Schein x-\xe4-\xf6-y", "10 ##AT##-##AT## \u20ac ##AT##-##AT## Schein "
     "x ##AT##-##AT## \xe4 ##AT##-##AT## \xf6 ##AT##-##AT## y"),
])
def test_split_compounds_is_the_perl_rule_of_get_ende_bleu(line, split):
    r"""The WMT14 English->German papers' compound splitting, `perl -ple 's{(\S)-(\S)}{$1
    ##AT##-##AT## $2}g'` (these outputs are that command's, and the module's output matched it
    byte for byte on Multi30k's 31,014 tokenized German lines)."""
    from nmt.metrics import split_compounds
    assert split_compounds(line) == split


def test_moses_cased_replaces_unicode_punctuation_then_tokenizes_cased():
    """Cased, Moses-tokenized, escaped; curly quotes and an ellipsis replaced first
    (replace-unicode-punctuation.perl; German's low opening quote is not among them);
    compounds split on request; each language's own rules."""
    from nmt.metrics import moses_cased
    line = "Er sagt: \u201eDas E-Mail-Programm\u201c\u2026 ist \u201cgut\u201d."
    assert moses_cased([line], "de") == [
        "Er sagt : \u201e Das E-Mail-Programm &quot; ... ist &quot; gut &quot; ."]
    assert moses_cased([line], "de", compound_split=True) == [
        "Er sagt : \u201e Das E ##AT##-##AT## Mail ##AT##-##AT## Programm &quot; ... ist "
        "&quot; gut &quot; ."]
    assert moses_cased(["l'uomo"], "it") == ["l&apos; uomo"]  # the language's own rules
    assert moses_cased(["l'uomo"], "en") == ["l &apos;uomo"]


def test_a_language_moses_has_no_rules_for_is_warned_of():
    """sacremoses tokenizes a language it has no nonbreaking prefixes for by English's, as
    tokenizer.perl does (which warns): moses_fallback says so for it, and nothing for one it
    knows."""
    from nmt.metrics import moses_cased, moses_fallback
    assert moses_fallback("de") is None and moses_fallback("it") is None
    assert moses_fallback("xx") == ("warning: Moses has no rules of its own for 'xx': the BLEU on "
                                    "tokenized text tokenizes it by English's, as tokenizer.perl "
                                    "does")
    assert moses_cased(["Mr. Smith"], "xx") == moses_cased(["Mr. Smith"], "en") == ["Mr. Smith"]


def test_moses_fallback_knows_the_names_sacremoses_knows_and_no_others():
    """moses_fallback warns exactly where sacremoses takes English's rules: not for a name it
    knows as well as the code ("german": German's "ca." kept whole), but for a code in another
    case ("DE": English's, "ca ." split)."""
    from nmt.metrics import moses_cased, moses_fallback
    line = ["Sie kam ca. Montag."]
    assert moses_fallback("german") is None
    assert moses_cased(line, "german") == moses_cased(line, "de") == ["Sie kam ca. Montag ."]
    assert moses_fallback("DE") == ("warning: Moses has no rules of its own for 'DE': the BLEU on "
                                    "tokenized text tokenizes it by English's, as tokenizer.perl "
                                    "does")
    assert moses_cased(line, "DE") == moses_cased(line, "en") == ["Sie kam ca . Montag ."]


def test_tokenized_bleu_is_multi_bleu_on_the_tokenized_lines_and_says_so():
    """The paper's figure: sacreBLEU with no tokenization of its own on both sides tokenized
    (cased), named apart from sacreBLEU's; split compounds let a compound's parts match."""
    import sacrebleu

    from nmt.metrics import moses_cased, tokenized_bleu
    hyps = ["Ein Rich-Text Format, sagt er.", "Zwei Hunde laufen"]
    refs = ["ein Rich-Text-Format, sagt er.", "Zwei Hunde laufen schnell."]
    for split in (False, True):
        found = tokenized_bleu(hyps, refs, "de", split)
        assert found["bleu"] == pytest.approx(sacrebleu.corpus_bleu(
            moses_cased(hyps, "de", split), [moses_cased(refs, "de", split)],
            tokenize="none").score)
        assert found["report"].startswith("tokenized BLEU (cased, Moses-tokenized" +
                                          (", compounds split" if split else ";"))
        assert "tok:none" in found["report"] and "case:mixed" in found["report"]
    assert tokenized_bleu(hyps, refs, "de", True)["bleu"] > tokenized_bleu(hyps, refs, "de")["bleu"]
    assert tokenized_bleu(refs, refs, "de", True)["bleu"] == pytest.approx(100)
    assert tokenized_bleu(["ein Hund"], ["Ein Hund"], "de")["bleu"] < 100  # cased


def test_compare_tests_the_tokenized_bleu(tmp_path):
    """compare(tokenized_lang=...): both sides tokenized (the reference raw), compounds split
    on request; the p-values of that BLEU alone."""
    refs = [f"Ein Hund Nummer {i} läuft durch das Rich-Text-Gras." for i in range(30)]
    base = [f"Ein Hund Nummer {i} läuft auf dem Gras." for i in range(30)]
    split = [f"Ein Hund Nummer {i} läuft durch das Rich-Text Gras." for i in range(30)]
    scored = {}
    for compound_split in (False, True):
        found = compare([("base", base), ("split", split), ("good", refs)], refs,
                        n_bootstrap=100, n_randomization=100, tokenized_lang="de",
                        compound_split=compound_split)
        assert set(found) == {"systems", "signatures", "bleu"}
        assert found["bleu"][2]["score"] == pytest.approx(100) and found["bleu"][2]["p_bs"] < 0.05
        assert "tok:none" in found["signatures"]["bleu"][0]
        scored[compound_split] = found["bleu"][1]["score"]
    assert scored[True] > scored[False] + 10, scored  # split, the compound's parts match


def test_tokenized_bleu_treats_both_sides_alike():
    """A translation equal to its reference scores 100, curly quotes and all, in tokenized_bleu
    and in compare's test alike: get_ende_bleu.sh replaced the translations' punctuation only
    (a reference's “ stayed, a translation's became &quot;), and an exact match lost its
    quotes (83.9 on such a line)."""
    from nmt.metrics import tokenized_bleu
    quoted = [f"Hund {i} sagt: \u201eWau-Wau\u201c, und \u201cgeht\u201d\u2026" for i in range(20)]
    plain = [f"Hund {i} sagt: Wau-Wau, und geht." for i in range(20)]
    for split in (False, True):
        assert tokenized_bleu(quoted, quoted, "de", split)["bleu"] == pytest.approx(100)
        tested = compare([("a", plain), ("b", quoted)], quoted, n_bootstrap=100,
                         n_randomization=100, tokenized_lang="de", compound_split=split)
        assert tested["bleu"][1]["score"] == pytest.approx(100)
        assert tested["bleu"][0]["score"] == pytest.approx(
            tokenized_bleu(plain, quoted, "de", split)["bleu"])


def test_compare_tests_the_papers_bleu(tmp_path):
    """compare.py --papers_bleu: the systems' lines tokenized for the language, the reference
    taken as tokenized; the p-values of the papers' BLEU alone."""
    refs = [f"ein hund nummer {i} läuft durch das grüne gras ." for i in range(30)]
    base = [f"Ein Hund Nummer {i} läuft auf dem Gras." for i in range(30)]
    good = [f"Ein Hund Nummer {i} läuft durch das grüne Gras." for i in range(30)]
    found = compare([("base", base), ("good", good)], refs, n_bootstrap=100,
                    n_randomization=100, papers_lang="de")
    assert set(found) == {"systems", "signatures", "bleu"}
    assert found["bleu"][1]["score"] == pytest.approx(100) and found["bleu"][1]["p_bs"] < 0.05
    assert "tok:none" in found["signatures"]["bleu"][0]


def test_a_statistic_equal_to_the_observed_one_but_for_rounding_counts_as_a_tie():
    """The p-value's ties are compared to 1e-9 (a permutation's difference and the observed
    one are sums of the same floats in another order): a statistic 1e-12 below the observed
    difference counts as at least as extreme; a strict comparison left it out, the p-value
    smaller than it is."""
    from nmt.metrics import at_least_as_extreme
    assert at_least_as_extreme([1.0 - 1e-12, 0.5], 1.0) == 2 / 3
    assert at_least_as_extreme([1.0 - 1e-6, 0.5], 1.0) == 1 / 3  # a real difference


def test_compare_tests_cased_bleu_and_chrf_and_nothing_else():
    """compare's paired tests are of sacreBLEU's cased BLEU and chrF only (score's lowercased
    BLEU is left out): the results and the signatures printed hold those two."""
    refs = [f"a dog number {i} runs through the grass" for i in range(10)]
    hyps = [f"A dog number {i} runs on the grass" for i in range(10)]
    found = compare([("a", hyps), ("b", refs)], refs, n_bootstrap=20, n_randomization=20)
    assert set(found) == {"systems", "signatures", "bleu", "chrf"}
    assert set(found["signatures"]) == {"bleu", "chrf"}
    assert all("case:mixed" in s for s in found["signatures"]["bleu"])


def test_papers_bleu_takes_the_references_as_tokenized_and_escaped():
    """The papers' references come tokenized and escaped as tokenizer.perl leaves them
    (&quot; &apos;): they are scored as they are, only the hypotheses tokenized; tokenizing
    them again escapes their & a second time (&amp;quot;), and a perfect translation loses."""
    from nmt.metrics import papers_bleu
    hyps = ['Ein Mann hält ein Schild: "Joe\'s Bar".']
    refs = ["ein mann hält ein schild : &quot; joe &apos; s bar &quot; ."]
    assert papers_bleu(hyps, refs, "de")["bleu"] == pytest.approx(100.0)


def test_the_fallback_interval_is_sacrebleus_own_on_a_set_where_both_work():
    """When sacreBLEU's own bootstrap raises TypeError (tiny sets), corpus_score sums up the
    same resamples itself: on a set where sacreBLEU's works, that path (forced here) gives
    sacreBLEU's own mean, interval and signature (1000 resamples, its seed), not an interval
    from fewer resamples or another draw."""
    from sacrebleu.metrics import CHRF

    from nmt.metrics import corpus_score

    class Failing(CHRF):  # sacreBLEU's corpus_score failing as it does on tiny sets
        def corpus_score(self, *args, **kwargs):
            super().corpus_score(*args, **kwargs)
            raise TypeError("don't know how to coerce float and float32")
    hyps = [f"the cat number {i} sat on {'the' if i % 3 else 'a'} mat" for i in range(30)]
    refs = [f"the cat number {i} sat on the mat" for i in range(30)]
    own = CHRF().corpus_score(hyps, [refs], n_bootstrap=1000)
    metric = Failing()
    found = corpus_score(metric, hyps, refs, 1000)
    assert found.score == pytest.approx(own.score)
    assert found._ci == pytest.approx(own._ci, rel=1e-5)
    assert found._mean == pytest.approx(own._mean, rel=1e-5)
    assert "bs:1000|seed:12345" in metric.get_signature().format()


def test_wer_counts_words_split_on_any_whitespace():
    """WER's words are what str.split() gives: runs of spaces, tabs and a trailing space
    make no empty words (split(" ") counted them as words to insert or delete)."""
    assert error_rate(["a  b\tc "], ["a b c"], words=True) == 0.0
    assert error_rate(["a b c"], [" a  b c"], words=True) == 0.0
