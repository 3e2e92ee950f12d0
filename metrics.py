"""Scores of translations against references: corpus BLEU and chrF by sacreBLEU (with the
signatures a paper should quote), lowercased BLEU, and character and word error rates."""


def edit_distance(a, b) -> int:
    """Levenshtein distance between two sequences (characters or words)."""
    if len(a) < len(b):
        a, b = b, a
    previous = list(range(len(b) + 1))
    for i, x in enumerate(a, 1):
        current = [i]
        for j, y in enumerate(b, 1):
            current.append(min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (x != y)))
        previous = current
    return previous[-1]


def error_rate(predictions, references, words: bool) -> float:
    """Corpus WER (words=True) or CER: total edits / total reference length."""
    edits = total = 0
    for p, r in zip(predictions, references):
        p, r = (p.split(), r.split()) if words else (p, r)
        edits += edit_distance(p, r)
        total += len(r)
    return edits / max(total, 1)


def score(hypotheses, references, error_rates: bool = True) -> dict:
    """Corpus sacreBLEU BLEU and chrF (and CER/WER) of translations against one reference each:
    {"bleu", "chrf", "bleu_lc", "cer", "wer"} as numbers (bleu_lc: lowercased), and "report":
    sacreBLEU's lines, each with its signature (what a paper should quote)."""
    import sacrebleu
    bleu, chrf = sacrebleu.metrics.BLEU(), sacrebleu.metrics.CHRF()
    lower = sacrebleu.metrics.BLEU(lowercase=True)  # what tokenized, lowercased papers compare
    b, c = bleu.corpus_score(hypotheses, [references]), chrf.corpus_score(hypotheses, [references])
    lc = lower.corpus_score(hypotheses, [references])
    scores = {"bleu": b.score, "chrf": c.score, "bleu_lc": lc.score,
              "report": f"{b}  ({bleu.get_signature()})\n{c}  ({chrf.get_signature()})\n"
                        f"{lc}  ({lower.get_signature()})"}
    if error_rates:
        scores["cer"] = error_rate(hypotheses, references, words=False)
        scores["wer"] = error_rate(hypotheses, references, words=True)
    return scores
