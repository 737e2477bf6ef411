#!/usr/bin/env bash
# Every single-GPU benchmark and GPU correctness check of the project, into OUT (default ./gpu-results).
# Optional baselines (liger-kernel, cut-cross-entropy) are used when importable. The regime
# comparison and the whole distillation step: benchmarks/gpu_bench_regimes.sh.
#   bash benchmarks/run_gpu_all.sh [OUT]
set -u
OUT=${1:-gpu-results}
mkdir -p "$OUT"/{hidden,attention,topk}
PY=${PYTHON:-python3}
run() { echo "== $*"; "$@"; }

run $PY benchmarks/topk_gpu_check.py "$OUT/topk/gpu_check.md" 2>&1 | tail -16
run $PY -m nitrobrew.cli bench attention --check --warm --md "$OUT/attention/attention.md" --csv "$OUT/attention/attention.csv" \
    --plot "$OUT/attention/attention.png" 2>&1 | tee "$OUT/attention/log.txt" | tail -25
run $PY -m nitrobrew.cli bench topk --extract --csv "$OUT/topk/topk.csv" --plot "$OUT/topk/topk.png" 2>&1 \
    | tee "$OUT/topk/log.txt" | tail -45
run $PY -m nitrobrew.cli bench --regimes lm flat spread peaked --reps 5 --warmup 2 --csv "$OUT/hidden/hidden.csv" \
    --plot "$OUT/hidden/hidden.png" 2>&1 | tee "$OUT/hidden/log.txt" | tail -40
