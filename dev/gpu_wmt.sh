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
# PART 1 (the default) is the first call's list; PART 2 the second call's: the loss's block size
# in the whole step (the change the first call's split pointed to), train.py's own tokens/s, and
# the compiled base model (the first call's budget ended inside its compilation).
#
# Each step has its own time limit, and the whole stays within SECONDS (default 450): the most
# important steps come first, so a step cut short loses only what follows it.
set -u
log=${1:-gpu_wmt.log}
budget=${2:-450}
part=${3:-1}
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
