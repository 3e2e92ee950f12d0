"""Scores of translations against references: corpus BLEU and chrF by sacreBLEU (with the
signatures a paper should quote and 95% confidence intervals by bootstrap resampling),
lowercased BLEU, character and word error rates; and the paired significance tests between
systems (sacreBLEU's paired bootstrap resampling and approximate randomization); and BLEU as
the papers on Multi30k compute it (`papers_bleu`: lowercased, Moses-normalized and -tokenized,
against the dataset's tokenized references) and as the paper reports it on WMT14
(`tokenized_bleu`: cased, Moses-tokenized, compounds split), each named apart from sacreBLEU's
figures."""

import re

# sacreBLEU's own defaults for its --confidence, --paired-bs and --paired-ar (its seed: 12345,
# or the environment's SACREBLEU_SEED), so that the figures repeat from one run to the next.
BOOTSTRAP_SAMPLES = 1000
RANDOMIZATION_SAMPLES = 10000


def table_edit_distance(a, b) -> int:
    """Levenshtein distance between two sequences (characters or words): the dynamic
    programme's table, D[i][j] = the edits that turn a[:i] into b[:j], filled a row at a time
    (the reference `edit_distance` is held equal to)."""
    previous = list(range(len(b) + 1))  # D[0][j] = j
    for i, x in enumerate(a, 1):
        current = [i]  # D[i][0] = i
        for j, y in enumerate(b, 1):
            current.append(min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (x != y)))
        previous = current
    return previous[-1]


def edit_distance(a, b) -> int:
    """Levenshtein distance between two sequences (characters or words), by Myers's bit-vector
    algorithm (1999, in Hyyrö's form for the global distance): a column of the dynamic
    programme's table is held as two bit masks of its +1 and -1 vertical steps, one bit a
    symbol of the shorter sequence (any hashable symbols), and each symbol of the longer
    updates all of them at once in about twenty integer operations (Python's integers: any
    length). Held equal to `table_edit_distance` by a test; a validation's CER and WER cost
    about 18 times less (`python -m dev.bench_validation`, docs/training.md)."""
    if len(a) < len(b):
        a, b = b, a
    m = len(b)
    if m == 0:
        return len(a)
    match = {}  # symbol -> the bits of b's positions that hold it
    for i, y in enumerate(b):
        match[y] = match.get(y, 0) | (1 << i)
    # `& ones` keeps the integers m bits wide (bits above never reach those below: carries
    # and shifts move up), so an operation costs a length of m, not one growing every symbol
    ones, top = (1 << m) - 1, 1 << (m - 1)
    plus, minus, distance = ones, 0, m  # the first column: D[i][0] = i, each step +1
    for x in a:
        eq = match.get(x, 0)
        xv = eq | minus
        xh = (((eq & plus) + plus) ^ plus) | eq
        h_plus = minus | (~(xh | plus) & ones)  # the horizontal steps: +1 ...
        h_minus = plus & xh  # ... and -1
        if h_plus & top:  # the last row's step: D[m][j] - D[m][j-1]
            distance += 1
        elif h_minus & top:
            distance -= 1
        h_plus = ((h_plus << 1) | 1) & ones  # row 0 steps +1 (D[0][j] = j)
        h_minus = (h_minus << 1) & ones
        plus = h_minus | (~(xv | h_plus) & ones)
        minus = h_plus & xv
    return distance


def error_rate(predictions, references, words: bool) -> float:
    """Corpus WER (words=True) or CER: total edits / total reference length."""
    edits = total = 0
    for p, r in zip(predictions, references):
        p, r = (p.split(), r.split()) if words else (p, r)
        edits += edit_distance(p, r)
        total += len(r)
    return edits / max(total, 1)


def metrics(lowercase_bleu: bool = True) -> dict:
    """sacreBLEU's metric objects by name: BLEU and chrF, and lowercased BLEU (what tokenized,
    lowercased papers compare)."""
    from sacrebleu.metrics import BLEU, CHRF
    return {"bleu": BLEU(), "chrf": CHRF(), **({"bleu_lc": BLEU(lowercase=True)}
                                             if lowercase_bleu else {})}


def corpus_score(metric, hypotheses, references, n_bootstrap: int):
    """metric.corpus_score with its bootstrap interval. sacreBLEU 2.x takes statistics.mean of
    resampled scores that mix float and numpy.float32 (chrF, when some resamples score exactly
    0: small sets), which raises TypeError; then the same resamples (its own function, its
    seed) are summed up with its significance module's estimate_ci instead: the same interval."""
    try:
        return metric.corpus_score(hypotheses, [references], n_bootstrap=n_bootstrap)
    except TypeError:
        import numpy as np
        from sacrebleu.significance import _bootstrap_resample, estimate_ci
        stats = metric._extract_corpus_statistics(hypotheses, [references])
        result = metric._aggregate_and_compute(stats)
        metric.n_bootstrap = n_bootstrap  # the signature's bs:N, as corpus_score sets it
        metric.seed, resampled = _bootstrap_resample(stats, metric, n_bootstrap)
        mean, ci = estimate_ci(np.array([float(s.score) for s in resampled]))
        result._mean, result._ci = float(mean), float(ci)
        return result


def score(hypotheses, references, error_rates: bool = True,
          n_bootstrap: int = BOOTSTRAP_SAMPLES) -> dict:
    """Corpus sacreBLEU BLEU and chrF (and CER/WER) of translations against one reference each:
    {"bleu", "chrf", "bleu_lc", "cer", "wer"} as numbers (bleu_lc: lowercased); with
    n_bootstrap > 1, also "bleu_ci", "chrf_ci", "bleu_lc_ci": the half-width of the 95%
    confidence interval from that many bootstrap resamples of the sentences (sacreBLEU's
    --confidence); and "report": sacreBLEU's lines, each with its signature (what a paper
    should quote; "bs:1000" says the interval's resamples)."""
    scores, lines = {}, []
    for name, metric in metrics().items():
        result = corpus_score(metric, hypotheses, references, max(n_bootstrap, 1))
        scores[name] = result.score
        if n_bootstrap > 1:
            scores[f"{name}_ci"] = float(result._ci)  # sacreBLEU's attribute for its ± figure
        lines.append(f"{result}  ({metric.get_signature()})")
    scores["report"] = "\n".join(lines)
    if error_rates:
        scores["cer"] = error_rate(hypotheses, references, words=False)
        scores["wer"] = error_rate(hypotheses, references, words=True)
    return scores


PAPERS_BLEU = "papers' BLEU (lowercased, Moses-tokenized, against tokenized references)"


def moses_fallback(lang: str):
    """The warning for a language Moses has no rules of its own for (its nonbreaking prefixes:
    "Dr." or "z.B." kept whole), whose text sacremoses then tokenizes by English's, as
    tokenizer.perl does (it says so too); None for a language it knows."""
    from sacremoses.corpus import NonbreakingPrefixes
    if lang in NonbreakingPrefixes().available_langs:
        return None
    return (f"warning: Moses has no rules of its own for '{lang}': the BLEU on tokenized text "
            f"tokenizes it by English's, as tokenizer.perl does")


def moses_tokenized(lines, lang: str) -> list:
    """Lines as the Multi30k papers' references were made (data/task1/tok/*.lc.norm.tok.* of
    the multi30k/dataset repository): lowercased, then Moses's punctuation normalization and
    tokenization for `lang`, special characters escaped (&quot; &apos; ...) as tokenizer.perl
    does. On the dataset's raw val and test_2016_flickr German this reproduces 2,013 of their
    2,014 tokenized lines (the one other: a full stop inside quotes, moved by a Perl rule)."""
    from sacremoses import MosesPunctNormalizer, MosesTokenizer
    normalizer, tokenizer = MosesPunctNormalizer(lang=lang), MosesTokenizer(lang=lang)
    return [tokenizer.tokenize(normalizer.normalize(line.lower()), escape=True, return_str=True)
            for line in lines]


def papers_metric():
    """sacreBLEU's BLEU on text already tokenized: multi-bleu.perl's figure."""
    from sacrebleu.metrics import BLEU
    return BLEU(tokenize="none", force=True)


def papers_bleu(hypotheses, tokenized_references, lang: str) -> dict:
    """BLEU as the papers on Multi30k report it (multi-bleu.perl on lowercased, Moses-tokenized
    text): the hypotheses lowercased and tokenized (`moses_tokenized`), scored against
    references already tokenized so (the dataset's own tok/ files), with no tokenization of
    sacreBLEU's. Not sacreBLEU's BLEU: never set beside it as if the same measure. Returns
    {"bleu", "report"} (report: the figure, named, with sacreBLEU's signature)."""
    metric = papers_metric()
    result = metric.corpus_score(moses_tokenized(hypotheses, lang),
                                 [list(tokenized_references)])
    return {"bleu": result.score, "report": f"{PAPERS_BLEU}: {result}  ({metric.get_signature()})"}


def split_compounds(line: str) -> str:
    r"""A hyphen between two non-blank characters set apart as `##AT##-##AT##` ("rich-text" ->
    "rich ##AT##-##AT## text"), so that a hyphenated compound's parts match apart, as the
    WMT14 English->German papers score (the Stanford NMT group's convention, in
    tensor2tensor's get_ende_bleu.sh). That script's Perl, `s{(\S)-(\S)}{$1 ##AT##-##AT## $2}g`,
    runs on the UTF-8 bytes, and so does this: left to right, no match overlapping the last
    ("a-b-c" -> "a ##AT##-##AT## b-c"), but a match takes one byte of the character after
    the hyphen, so one of two or more bytes between hyphens is split on both sides ("a-ä-b" ->
    "a ##AT##-##AT## ä ##AT##-##AT## b"); blanks are ASCII ones (a no-break space is
    none). Every split falls between characters: the bytes decode."""
    return re.sub(rb"(\S)-(\S)", rb"\1 ##AT##-##AT## \2", line.encode("utf-8")).decode("utf-8")


def tokenized_bleu_name(compound_split: bool) -> str:
    """What `tokenized_bleu` is called where it is printed."""
    return (f"tokenized BLEU (cased, Moses-tokenized{', compounds split' if compound_split else ''}"
            f"; not sacreBLEU's)")


def moses_cased(lines, lang: str, compound_split: bool = False):
    """Lines as the paper's BLEU reads them (tensor2tensor's get_ende_bleu.sh, then
    multi-bleu.perl): Unicode punctuation replaced (replace-unicode-punctuation.perl: " for
    curly double quotes, ... for an ellipsis...), Moses-tokenized for `lang`, cased, escaped as
    tokenizer.perl does (&quot; ...), and with `compound_split`, compounds split
    (`split_compounds`). The script replaced the translations' punctuation only, against
    references tokenized without it, so a translation with the reference's own curly quotes lost
    them; both sides get it here, the figure the script's wherever the references hold none of
    the characters it replaces."""
    from sacremoses import MosesPunctNormalizer, MosesTokenizer
    normalizer, tokenizer = MosesPunctNormalizer(lang=lang), MosesTokenizer(lang=lang)
    found = []
    for line in lines:
        line = tokenizer.tokenize(normalizer.replace_unicode_punct(line), escape=True,
                                  return_str=True)
        found.append(split_compounds(line) if compound_split else line)
    return found


def tokenized_bleu(hypotheses, references, lang: str, compound_split: bool = False) -> dict:
    """BLEU as the paper reports it on WMT14 (27.3 for the base model, English->German, with
    `compound_split`): multi-bleu.perl's figure on cased, Moses-tokenized text (`moses_cased`,
    both sides: the references are given raw). Not sacreBLEU's BLEU, and not comparable with
    it: never set beside it as if the same measure. Returns {"bleu", "report"} (report: the
    figure, named, with sacreBLEU's signature)."""
    metric = papers_metric()
    result = metric.corpus_score(moses_cased(hypotheses, lang, compound_split),
                                 [moses_cased(references, lang, compound_split)])
    return {"bleu": result.score, "report": f"{tokenized_bleu_name(compound_split)}: {result}  "
                                            f"({metric.get_signature()})"}


def at_least_as_extreme(stats, observed: float) -> float:
    """The p-value of a paired test: the share of its resamples or permutations whose statistic
    is at least as extreme as the observed difference, counting the observed one ((c + 1) /
    (n + 1)). sacreBLEU counts only those strictly more extreme, so a difference of zero
    (two files with the same score) came out with the smallest p there is, as if significant;
    here it gets p = 1. Ties are compared to 1e-9 (scores are sums of the same floats)."""
    import numpy as np
    stats = np.asarray(stats, dtype=float)
    c = int(np.sum(stats >= observed - 1e-9))
    return (c + 1) / (len(stats) + 1)


def compare(systems, references, n_bootstrap: int = BOOTSTRAP_SAMPLES,
            n_randomization: int = RANDOMIZATION_SAMPLES, papers_lang: str = None,
            tokenized_lang: str = None, compound_split: bool = False) -> dict:
    """Paired significance tests of systems against the first (the baseline), on the same
    sentences: `systems` is a list of (name, hypotheses). For BLEU and chrF each system gets
    its score, the 95% confidence interval's half-width and, after the first, the p-values of
    its difference from the first by paired bootstrap resampling (Koehn 2004) and by paired
    approximate randomization (Riezler and Maxwell 2005): sacreBLEU's resampling, with the
    p-value counted by `at_least_as_extreme`. Returns {"systems": names, "bleu"/"chrf":
    [{"score", "ci", "p_bs", "p_ar"}, ...] (p None for the baseline), "signatures": {metric:
    signature of each test}}. `papers_lang`: the papers' BLEU alone (`papers_bleu`), the
    references already tokenized and each system's lines tokenized for that language.
    `tokenized_lang`: the paper's tokenized BLEU alone (`tokenized_bleu`), both sides
    tokenized for that language (and their compounds split with `compound_split`)."""
    from unittest import mock

    from sacrebleu import significance
    chosen = metrics(lowercase_bleu=False)
    if papers_lang:
        chosen = {"bleu": papers_metric()}
        systems = [(name, moses_tokenized(lines, papers_lang)) for name, lines in systems]
    elif tokenized_lang:
        chosen = {"bleu": papers_metric()}
        systems = [(name, moses_cased(lines, tokenized_lang, compound_split))
                   for name, lines in systems]
        references = moses_cased(references, tokenized_lang, compound_split)
    found = {"systems": [name for name, _ in systems], "signatures": {}}
    for test, samples in (("bs", n_bootstrap), ("ar", n_randomization)):
        with mock.patch.object(significance, "_compute_p_value", at_least_as_extreme):
            signatures, results = significance.PairedTest(
                list(systems), {m.upper(): chosen[m] for m in chosen}, [list(references)],
                test_type=test, n_samples=samples)()
        for name, (key, signature) in zip(chosen, signatures.items()):  # key: BLEU, chrF2
            rows = found.setdefault(name, [{} for _ in systems])
            found["signatures"].setdefault(name, []).append(str(signature))
            for row, result in zip(rows, results[key]):
                row["score"] = result.score
                row[f"p_{test}"] = result.p_value
                if result.ci is not None:
                    row["ci"] = float(result.ci)
    return found
