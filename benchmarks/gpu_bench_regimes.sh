#!/usr/bin/env bash
# The benches across input regimes (lm flat spread peaked) at real sizes, and the whole
# distillation step, on one GPU in about 8 minutes, offline. Optional baselines (liger-kernel,
# cut-cross-entropy, trl) are used when importable, else their rows say "skipped".
#   bash benchmarks/gpu_bench_regimes.sh OUT       (OUT defaults to $OUT, else ./gpu-regimes)
# Writes into OUT (flat, 7 files): hidden.csv topk.csv attention.csv e2e_step.csv e2e_step.png
# bench.md (every table as markdown) and log.txt. Without CUDA it runs the same steps at tiny
# sizes on the CPU (the test of this script). Exit status: 1 if any step failed. The results
# record nitrobrew's commit from the git tree of this checkout; in a copy without .git, pass it:
#   NITROBREW_COMMIT=$(git rev-parse --short HEAD) bash benchmarks/gpu_bench_regimes.sh OUT
set -u
ROOT=$(cd "$(dirname "$0")/.." && pwd)
DEST=${1:-${OUT:-gpu-regimes}}
mkdir -p "$DEST"
DEST=$(cd "$DEST" && pwd)
cd "$ROOT"
PY=${PYTHON:-python3}
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
MD=$(mktemp -d)
trap 'rm -rf "$MD"' EXIT
LOG="$DEST/log.txt"
: > "$LOG"
REGIMES="lm flat spread peaked"
status=0
step() {  # step SECONDS cmd...: run with a time limit, log everything, remember failures
    local limit=$1; shift
    echo "== $*" | tee -a "$LOG"
    local t0=$SECONDS
    timeout "$limit" "$@" >> "$LOG" 2>&1
    local rc=$?
    echo "== exit $rc after $((SECONDS - t0)) s" | tee -a "$LOG"
    [ $rc -eq 0 ] || status=1
}

if $PY -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)'; then
    $PY -c 'import torch; print("device:", torch.cuda.get_device_name())' | tee -a "$LOG"
    HIDDEN="--vocab 152064 --seq-lens 4096 --d-models 3584 5120 --dtype bfloat16 --reps 5 --warmup 2
            --methods floor naive compile liger-chunked liger-fused cce fast const-mem fast-filter"
    TOPK="--vocab 152064 --seq-lens 4096 --d-model 3584 --ks 64 --reps 5 --warmup 2
          --methods floor cce cce-exact full full-64m topk"
    ATTN="--seq-lens 2048 8192 16384 --heads 32 --head-dim 128 --accuracy-n 1024 --warm
          --methods nitrobrew nitrobrew-fwd sdpa sdpa-fwd sdpa-flash sdpa-flash-fwd"
    E2E="--seq-len 4096 --fit-lens 8192 16384 32768 65536 --steps 3 --warmup 1 --fit-time-limit 20"
    T_HIDDEN=170; T_TOPK=70; T_ATTN=70; T_E2E=150
else
    echo "device: cpu (no CUDA): tiny sizes" | tee -a "$LOG"
    HIDDEN="--device cpu --vocab 256 --seq-lens 32 --d-models 16 24 --reps 1 --warmup 0 --ref-rows 16
            --methods floor naive torch fast"
    TOPK="--device cpu --vocab 256 --seq-lens 16 --d-model 16 --ks 4 --reps 1 --warmup 0 --ref-rows 8
          --methods floor cce cce-exact torch-full torch-topk full"
    ATTN="--device cpu --seq-lens 64 --heads 1 --head-dim 8 --accuracy-n 0 --reps 1 --warmup 0
          --methods nitrobrew sdpa sdpa-flash"
    E2E="--small --seq-len 16 --fit-lens 32 --steps 1 --warmup 1 --methods nitrobrew hf-logits trl-gkd liger-jsd"
    T_HIDDEN=300; T_TOPK=300; T_ATTN=300; T_E2E=300
fi

# shellcheck disable=SC2086  # the size lists split on purpose
step $T_HIDDEN $PY -m nitrobrew.cli bench $HIDDEN --regimes $REGIMES --csv "$DEST/hidden.csv" --md "$MD/1-hidden.md"
step $T_TOPK $PY -m nitrobrew.cli bench topk $TOPK --regimes $REGIMES --csv "$DEST/topk.csv" --md "$MD/2-topk.md"
step $T_ATTN $PY -m nitrobrew.cli bench attention $ATTN --regimes $REGIMES --csv "$DEST/attention.csv" \
    --md "$MD/3-attention.md"
step $T_E2E $PY benchmarks/e2e_step.py $E2E --out "$MD"
[ -f "$MD/e2e_step.csv" ] && cp "$MD/e2e_step.csv" "$DEST/"
[ -f "$MD/e2e_step.png" ] && cp "$MD/e2e_step.png" "$DEST/"
cat "$MD"/*.md > "$DEST/bench.md" 2>/dev/null
echo "wrote $(ls "$DEST" | tr '\n' ' ')" | tee -a "$LOG"
exit $status
