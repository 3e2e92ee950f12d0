#!/usr/bin/env bash
# The README's hour on this CPU, end to end, as docs/results.md's protocol says: the modern row's
# command as written (`--time_budget 60`, `--precision auto`), the decoding chosen on `val`,
# then `test_2016_flickr` scored once:
#   bash dev/readme_hour.sh OUT [DATA_DIR] [BASELINE.hyp]
# OUT is made anew (the code run is HEAD's, archived there, so edits to the checkout during the
# hour change nothing); DATA_DIR the unpacked Multi30k files (default data/multi30k, with its
# tok/ for the papers' BLEU); BASELINE.hyp another run's test translations, tested against this
# one's with compare.py. Run it alone on the machine: the schedule is sized by the speed it
# measures. Takes about 70 minutes; its summary ends OUT/summary.txt. MINUTES=3 bash dev/...
# tries the script itself in a few minutes (a 3-minute budget).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:?usage: bash dev/readme_hour.sh OUT [DATA_DIR] [BASELINE.hyp]}
DATA=$(realpath "${2:-data/multi30k}")
BASELINE=${3:+$(realpath "$3")}
if [ -e "$OUT" ]; then echo "$OUT exists: name a new folder" >&2; exit 2; fi
for f in train.en train.de val.en val.de test_2016_flickr.en test_2016_flickr.de; do
    [ -f "$DATA/$f" ] || { echo "$DATA/$f is missing (Multi30k's data/task1/raw)" >&2; exit 2; }
done
mkdir -p "$OUT/src" && OUT=$(realpath "$OUT")
git archive HEAD | tar -x -C "$OUT/src"
exec > >(tee "$OUT/summary.txt") 2>&1
field() { grep -m1 "^$1" /proc/cpuinfo | cut -d: -f2 | xargs; }  # the first core's
flags=$({ grep -o -w -E 'avx2|avx512f|avx512_bf16|amx_tile' /proc/cpuinfo || true; } | sort -u \
    | paste -sd ' ')
echo "code $(git rev-parse --short HEAD); $(field 'model name'), family $(field 'cpu family')," \
    "$(nproc) cores; flags: $flags"
cd "$OUT/src"
score() {  # score HYP REF: sacreBLEU's cased corpus BLEU
    python -c "import sys, sacrebleu; h, r = (open(f).read().splitlines() for f in sys.argv[1:]);
print(f'{sacrebleu.corpus_bleu(h, [r]).score:.2f}')" "$1" "$2"
}

echo "train: $(date -u +%T)"
python train.py --preset multi30k_modern --data_dir "$DATA" --time_budget "${MINUTES:-60}" \
    --model_folder "$OUT/model" --experiment_name "$OUT/tb" > "$OUT/train.log" 2>&1 \
    || { tail -c 2000 "$OUT/train.log" | tr '\r' '\n' | tail -3; echo "train.py failed"; exit 1; }
echo "trained: $(date -u +%T)"
log=$(tr '\r' '\n' < "$OUT/train.log")
{ grep -m1 "^device " <<< "$log"; grep "schedule is complete" <<< "$log"
  grep "^new best" <<< "$log" | tail -1; grep -E "^test |^(BLEU|chrF2) = " <<< "$log" \
  | cut -c1-100; } || true  # (a line not found is no failure)

# The decoding chosen on validation: best, latest, or the last 3 or 5 averaged; beam 4 or 5.
best_bleu=-1 best=""
for choice in "--preload best" "--preload latest" "--average 3" "--average 5"; do
    for beam in 4 5; do
        # shellcheck disable=SC2086  # the choice is two words
        if ! python translate.py --model_folder "$OUT/model" $choice --beam $beam \
            --input "$DATA/val.en" --output "$OUT/val.hyp" 2> "$OUT/val.err"; then
            echo "val: $choice --beam $beam: $(tail -1 "$OUT/val.err")"  # (too few to average)
            continue
        fi
        bleu=$(score "$OUT/val.hyp" "$DATA/val.de")
        echo "val: $choice --beam $beam: BLEU $bleu"
        if python -c "import sys; sys.exit(not float(sys.argv[1]) > float(sys.argv[2]))" \
            "$bleu" "$best_bleu"; then best_bleu=$bleu; best="$choice --beam $beam"; fi
    done
done
rm -f "$OUT/val.hyp" "$OUT/val.err"
[ -n "$best" ] || { echo "no decoding of val succeeded"; exit 1; }
echo "chosen on val: $best (BLEU $best_bleu)"

# Test once, with the choice.
papers=()
[ -f "$DATA/tok/test_2016_flickr.lc.norm.tok.de" ] \
    && papers=(--papers_reference "$DATA/tok/test_2016_flickr.lc.norm.tok.de")
# shellcheck disable=SC2086
python translate.py --model_folder "$OUT/model" $best --input "$DATA/test_2016_flickr.en" \
    --output "$OUT/test.hyp" --reference "$DATA/test_2016_flickr.de" "${papers[@]}" 2>&1 \
    | grep -v "^loaded"
if [ -n "$BASELINE" ]; then
    python compare.py "$BASELINE" "$OUT/test.hyp" --reference "$DATA/test_2016_flickr.de"
fi
echo "done: $(date -u +%T)"
