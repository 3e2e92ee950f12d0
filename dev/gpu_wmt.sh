#!/usr/bin/env bash
# Issue 58's measurements on one lent GPU, in one call (about 8 minutes on an H100): the base and
# big models at WMT14's sentence lengths in bf16, eager then compiled, against nn.Transformer
# (dev/bench.py: real tokens/s, MFU, peak memory, the loop against the step, the profiler's split,
# the attention kernels); the batch per GPU and the loss's block size as levers; a short
# train.py run of the quick start's preset on Multi30k, and dev/bench_decode.py on it (greedy and
# beam 4, CTranslate2 beside it, the attention kernels of cached decoding).
#
#   bash dev/gpu_wmt.sh [LOG] [SECONDS] [PART]   # from the repo root; Multi30k in data/multi30k
#
# PART 3 (the default) is issue 62's call (6.4 minutes on an H100 on 2026-11-27, 5.7 on an H200 on
# 2026-11-28; give it SECONDS 570): the base and big models at WMT lengths and 25,000 tokens, eager,
# compiled under fixed shapes, and compiled with CUDA graphs, each against nn.Transformer in the
# same mode (MFU, peak memory), train.py's loop over an epoch (up to 200 steps) against the bare
# step, and the host time a step of the loop adds (the device's work removed). PART 1 and 2 are
# issue 58's two calls: the first list; the loss's block size in the whole step, train.py's own
# tokens/s, and the compiled base model. It needs requirements.txt's packages on the GPU's machine,
# and says so before any step where one is missing (a lent machine's image had no `datasets`).
# PART 4 times train.py's loop under --compile against the compiled step (about 6 minutes; give
# it SECONDS 420): the base model compiled, the base and big models with CUDA graphs, the loop on
# the step's own batches of the most frequent shape after the step's warm-up.
#
#   DRY=1 bash dev/gpu_wmt.sh LOG 600 3       # the rehearsal: every command line checked, no run
#   TINY=1 bash dev/gpu_wmt.sh LOG 900 3      # every step for real at a toy size, on the CPU
#
# Each step has its own time limit, and the whole stays within SECONDS (default 450): the most
# important steps come first, so a step cut short loses only what follows it.
set -u
log=${1:-gpu_wmt.log}
budget=${2:-450}
part=${3:-3}
start=$(date +%s)
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1

step() {  # step LIMIT TITLE COMMAND...: run COMMAND for at most LIMIT seconds (and the budget)
    local limit=$1 title=$2 left
    shift 2
    left=$((budget - ($(date +%s) - start)))
    [ "$left" -lt "$limit" ] && limit=$left
    if [ "$limit" -le 10 ]; then
        echo "=== $title: skipped, the budget is spent" | tee -a "$log"
        return
    fi
    echo "=== $title (at $(($(date +%s) - start)) s, limit $limit s): $*" | tee -a "$log"
    local t0=$(date +%s)
    timeout "$limit" "$@" 2>&1 | grep -v -E "USDT" | tee -a "$log"
    echo "=== $title: exit ${PIPESTATUS[0]}, $(($(date +%s) - t0)) s" | tee -a "$log"
}

WMT="--wmt_pairs 100000 --precision bf16 --baseline_steps 0 --steps 20 --warmup_steps 5"
BASE="--preset paper_base"
BIG="--preset paper_big"
GRAPHS="--cuda_graphs true"
if [ "${TINY:-0}" = 1 ]; then  # the same steps at a toy size on the CPU (no CUDA graphs there)
    WMT="--wmt_pairs 3000 --vocab_size 3000 --device cpu --baseline_steps 0 --steps 4 --warmup_steps 1"
    BASE="--d_model 32 --N 1 --h 2 --d_ff 64"
    BIG="--d_model 48 --N 1 --h 2 --d_ff 96"
    GRAPHS=""
fi
DRYRUN=""
[ "${DRY:-0}" = 1 ] && DRYRUN="--dry_run"
if ! missing=$(python3 -c "import datasets, tokenizers, sacrebleu, tqdm, tensorboard" 2>&1); then
    echo "=== stopped before any step: ${missing##*$'\n'} (pip install -r requirements.txt)" \
        | tee -a "$log"
    exit 1
fi
if [ "$part" = 4 ]; then
step 15 "the machine" bash -c "nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv 2>/dev/null; python3 -c 'import torch; print(torch.__version__, torch.version.cuda, torch.cuda.is_available() and torch.cuda.get_device_name())'; nproc"
LOOP="--max_tokens 25000 --compile true --shapes_timed 1 --train_steps 40 --profile_steps 0"
step 130 "base, WMT lengths, compiled; train.py's loop on the step's batches" \
    python3 -m dev.bench $BASE $WMT $LOOP $DRYRUN
step 130 "base, WMT lengths, compiled with CUDA graphs; train.py's loop on the step's batches" \
    python3 -m dev.bench $BASE $WMT $LOOP $GRAPHS $DRYRUN
step 150 "big, WMT lengths, compiled with CUDA graphs; train.py's loop on the step's batches" \
    python3 -m dev.bench $BIG $WMT $LOOP $GRAPHS $DRYRUN
echo "=== done at $(($(date +%s) - start)) s" | tee -a "$log"
exit 0
fi
if [ "$part" = 3 ]; then
step 15 "the machine" bash -c "nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv 2>/dev/null; python3 -c 'import torch; print(torch.__version__, torch.version.cuda, torch.cuda.is_available() and torch.cuda.get_device_name())'; nproc"
step 100 "base, WMT lengths, 25,000 tokens, eager; train.py's loop, up to 200 steps; its host time" \
    python3 -m dev.bench $BASE $WMT --max_tokens 25000 --train_steps 200 --host_steps 50 \
    --profile_steps 2 $DRYRUN
# one shape per compiled step: each shape is one compilation of each model (80-100 s a model on
# the H100 before fixed shapes), and the later steps find the kernels in the compile cache
step 150 "base, WMT lengths, 25,000 tokens, compiled (fixed shapes, the most frequent)" \
    python3 -m dev.bench $BASE $WMT --max_tokens 25000 --compile true --shapes_timed 1 \
    --train_steps 0 --profile_steps 2 $DRYRUN
step 110 "base, WMT lengths, 25,000 tokens, compiled with CUDA graphs" \
    python3 -m dev.bench $BASE $WMT --max_tokens 25000 --compile true $GRAPHS \
    --shapes_timed 1 --train_steps 0 --profile_steps 0 $DRYRUN
step 60 "big, WMT lengths, 25,000 tokens, eager" \
    python3 -m dev.bench $BIG $WMT --max_tokens 25000 --train_steps 0 --profile_steps 0 $DRYRUN
step 200 "big, WMT lengths, 25,000 tokens, compiled with CUDA graphs" \
    python3 -m dev.bench $BIG $WMT --max_tokens 25000 --compile true $GRAPHS \
    --shapes_timed 1 --train_steps 0 --profile_steps 0 $DRYRUN
echo "=== done at $(($(date +%s) - start)) s" | tee -a "$log"
exit 0
fi
step 30 "the machine" bash -c "nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv; python3 -c 'import torch; print(torch.__version__, torch.version.cuda, torch.cuda.get_device_name())'; nproc"
if [ "$part" = 2 ]; then
for rows in 0 8192; do
    step 60 "base, WMT lengths, eager, 25,000 tokens, loss blocks of $rows rows (0: default)" \
        python3 -m dev.bench --preset paper_base $WMT --max_tokens 25000 --train_steps 0 \
        --profile_steps 0 --loss_block_rows $rows
done
step 60 "train.py, the quick start's preset on Multi30k, 1 epoch" \
    python3 train.py --preset multi30k_modern --data_dir data/multi30k --num_epochs 1 \
    --model_folder weights/gpu_m30k1 --experiment_name runs/gpu_m30k1
step 300 "base, WMT lengths, compiled, 12,500 tokens" \
    python3 -m dev.bench --preset paper_base $WMT --max_tokens 12500 --compile true \
    --train_steps 0 --profile_steps 2
echo "=== done at $(($(date +%s) - start)) s" | tee -a "$log"
exit 0
fi
step 120 "base, WMT lengths, eager, 12,500 tokens" \
    python3 -m dev.bench --preset paper_base $WMT --max_tokens 12500 --train_steps 10 --profile_steps 3
step 60 "base, WMT lengths, eager, 25,000 tokens" \
    python3 -m dev.bench --preset paper_base $WMT --max_tokens 25000 --train_steps 0 --profile_steps 3
step 40 "the loss alone, base shape, by block size" \
    python3 -m dev.bench_loss --device cuda --precision bf16 --shapes 512x37000 --positions 12500 \
    --rows 0 4096 12500 --calls 10
step 90 "big, WMT lengths, eager, 12,500 tokens" \
    python3 -m dev.bench --preset paper_big $WMT --max_tokens 12500 --train_steps 10 --profile_steps 3
step 100 "train.py, the quick start's preset on Multi30k, 3 epochs" \
    python3 train.py --preset multi30k_modern --data_dir data/multi30k --num_epochs 3 \
    --model_folder weights/gpu_m30k --experiment_name runs/gpu_m30k
step 40 "dev/bench.py, the quick start's preset on Multi30k" \
    python3 -m dev.bench --preset multi30k_modern --data_dir data/multi30k --steps 20 \
    --warmup_steps 5 --baseline_steps 0 --train_steps 20 --profile_steps 3
step 60 "dev/bench_decode.py on that model" \
    python3 -m dev.bench_decode --model_folder weights/gpu_m30k --repeats 2
step 180 "base, WMT lengths, compiled, 12,500 tokens" \
    python3 -m dev.bench --preset paper_base $WMT --max_tokens 12500 --compile true \
    --train_steps 0 --profile_steps 3
step 180 "big, WMT lengths, compiled, 12,500 tokens" \
    python3 -m dev.bench --preset paper_big $WMT --max_tokens 12500 --compile true \
    --train_steps 0 --profile_steps 3
echo "=== done at $(($(date +%s) - start)) s" | tee -a "$log"
