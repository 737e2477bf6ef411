#!/usr/bin/env bash
# The 2-GPU measurements, by named stage, each under its own timeout, within a total budget:
#
#     bash benchmarks/run_2gpu.sh STAGE...          # e.g.  train   /   memory async
#
# on one host with 2 GPUs (H100 / H200), NVLink multicast off. Stages (expected time on 2x H100):
#   memory    vocab-parallel loss over NCCL: speed and peak memory per rank vs one GPU
#             (forward KL, JSD; N = 4096, 16384)                          -> results/parallel/     ~1.5 min
#   async     on-policy step at B = 64: off-policy, SFT, synchronous, asynchronous rollouts on
#             cuda:1 and on the training GPU                              -> results/onpolicy/async_b64/  ~4 min
#   async8    the same at B = 8, asynchronous on cuda:1 only             -> results/onpolicy/async_b8/   ~2.5 min
#   train     `nitrobrew train` at real shapes (1.5B / 7B-shaped, V = 152064, 200 steps of 4096 tokens
#             per GPU) under accelerate launch (FSDP2, head apart) and torchrun (root-wrapped)
#                                                                         -> results/parallel/hf_train_launch.md  ~6 min
#   fsdp2_trainer, plain_loop, rank_death: the earlier runs (results/parallel/), ~1, 2 and 1.5 min
# ASYNC_SAME_GPU= (set, empty) leaves out the async run on the training GPU; TRAIN_PREPARE_FLAGS adds flags to
# `hf_train_launch.py prepare --real` (e.g. "--length 1024 --steps 250"); HF_TRAIN_PROFILE=START:COUNT profiles
# those optimizer steps of both launches (train/<launcher>/profile_rank*.txt).
# Stages run in the order given; a stage that cannot start with 30 s of the budget left is skipped
# (RUN_2GPU_BUDGET_S, default 510 s: the command ends before 9 minutes). Writes the results into
# benchmarks/results/..., the logs, env.txt and summary.txt (each stage: exit status, seconds) into
# benchmarks/results/gpu_run/, and, where $OUT is set, all of it as $OUT/r.tgz (paths from the
# repository root). Wheels in $WHEELS (default .whl/) are installed first into /tmp/site (the train
# stage needs `datasets`). CPU_CHECK=1 runs the same stages on a CPU at tiny sizes (gloo; the accelerate
# launch, which refuses FSDP without GPUs, replaced by torchrun data parallel): a check of the scripts.
set -u
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export TOKENIZERS_PARALLELISM=false
PY=${PYTHON:-python}
START=$(date +%s)
BUDGET=${RUN_2GPU_BUDGET_S:-510}
RES=benchmarks/results
RUNDIR=$RES/gpu_run
LOGS=$RUNDIR/logs
SUMMARY=$RUNDIR/summary.txt
mkdir -p "$LOGS"
: > "$SUMMARY"
WRITTEN=("$RUNDIR")
RUN="$PY -m torch.distributed.run --nproc-per-node 2 --monitor-interval 1"
if [ "${CPU_CHECK:-0}" = 1 ]; then
    export CUDA_VISIBLE_DEVICES="" OMP_NUM_THREADS=1
    MEMORY_FLAGS=(--backend gloo --device cpu --small)
    ONPOLICY_FLAGS=(--tiny)
    PREPARE_FLAGS=(--small --steps 30)
    ACCELERATE=($RUN)
else
    MEMORY_FLAGS=(--tokens 4096,16384)
    ONPOLICY_FLAGS=()
    PREPARE_FLAGS=(--real ${TRAIN_PREPARE_FLAGS:-})  # e.g. TRAIN_PREPARE_FLAGS="--length 1024 --steps 250"
    ACCELERATE=($PY -m accelerate.commands.launch --config_file)
fi

pack() {  # everything this run wrote, as $OUT/r.tgz (paths from the repository root)
    if [ -n "${OUT:-}" ]; then
        tar czf "$OUT/r.tgz" "${WRITTEN[@]}" 2>/dev/null
        echo "packed: $OUT/r.tgz ($(du -h "$OUT/r.tgz" | cut -f1)): ${WRITTEN[*]}"
    fi
}
trap pack EXIT

WHEELS=${WHEELS:-.whl}
if ls "$WHEELS"/*.whl > /dev/null 2>&1; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        "$WHEELS"/*.whl > "$LOGS/wheels.log" 2>&1
    echo "wheels: exit $? ($(ls "$WHEELS"/*.whl | xargs -n1 basename | tr '\n' ' '))" | tee -a "$SUMMARY"
    export PYTHONPATH="$PWD:/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
else
    export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi

{
    echo "date: $(date -u +%FT%TZ)  stages: $*"
    echo "commit: $(git rev-parse HEAD 2>/dev/null) $(git status --porcelain 2>/dev/null | grep -qv '^??' && echo '(modified)')"
    nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv 2>&1
    nvidia-smi topo -m 2>&1 | head -8
    $PY -c "import sys, torch, triton, transformers, accelerate; print('python', sys.version.split()[0]); print('torch', torch.__version__, 'cuda', torch.version.cuda, 'nccl', '.'.join(map(str, torch.cuda.nccl.version()))); print('triton', triton.__version__, 'transformers', transformers.__version__, 'accelerate', accelerate.__version__)" 2>&1
    $PY -c "import datasets; print('datasets', datasets.__version__)" 2>&1 | tail -1
    env | grep -E '^(NCCL_NVLS_ENABLE|TORCH_SYMM_MEM_DISABLE_MULTICAST|NVSHMEM_DISABLE_NVLS)='
} > "$RUNDIR/env.txt" 2>&1
cat "$RUNDIR/env.txt"

# part NAME LIMIT_S COMMAND...: run under timeout (capped by what is left of the budget), log, summarize
part() {
    local name=$1 limit=$2 t0 left rc
    shift 2
    t0=$(date +%s)
    left=$((BUDGET - (t0 - START)))
    if [ "$left" -lt 30 ]; then
        echo "$name: SKIPPED (budget spent: $((t0 - START)) s of $BUDGET)" | tee -a "$SUMMARY"
        return 1
    fi
    [ "$limit" -gt "$left" ] && limit=$left
    timeout -k 10 "$limit" "$@" > "$LOGS/$name.log" 2>&1
    rc=$?
    echo "$name: exit $rc in $(($(date +%s) - t0)) s (limit $limit s, at $(($(date +%s) - START)) s)$([ $rc -eq 124 ] && echo ' TIMED OUT')" | tee -a "$SUMMARY"
    if [ "$rc" -ne 0 ]; then  # the end of a failing part's log, in the command's own output
        echo "--- last lines of $LOGS/$name.log"
        tail -n 25 "$LOGS/$name.log"
        echo "---"
    fi
    return $rc
}

for stage in "$@"; do
    case $stage in
    memory)
        WRITTEN+=("$RES/parallel/distributed_nccl.md" "$RES/parallel/distributed_nccl.csv")
        part memory 150 $RUN benchmarks/distributed_nccl.py --out "$RES/parallel" "${MEMORY_FLAGS[@]}" \
            --divergences forward_kl,jsd --reps 3 --warmup 1 --naive-max-tokens 0
        ;;
    async)
        WRITTEN+=("$RES/onpolicy/async_b64")
        part async 330 $PY benchmarks/onpolicy_step.py --backends static --decode-batches --step-batches 64 \
            --sync-windows 2 --async-windows 4 ${ASYNC_SAME_GPU---async-same-gpu} --out "$RES/onpolicy/async_b64" "${ONPOLICY_FLAGS[@]}"
        ;;
    async8)
        WRITTEN+=("$RES/onpolicy/async_b8")
        part async8 200 $PY benchmarks/onpolicy_step.py --backends static --decode-batches --step-batches 8 \
            --sync-windows 2 --async-windows 4 --async-batches 8 --out "$RES/onpolicy/async_b8" "${ONPOLICY_FLAGS[@]}"
        ;;
    train)
        TL=$(mktemp -d)
        WRITTEN+=("$RES/parallel/hf_train_launch.md")
        mkdir -p "$RUNDIR/train"
        if part train_prepare 120 $PY benchmarks/hf_train_launch.py prepare "$TL" "${PREPARE_FLAGS[@]}"; then
            if [ "${CPU_CHECK:-0}" = 1 ]; then ACCELERATE_CONFIG=(); else ACCELERATE_CONFIG=("$TL/fsdp2_apart.yaml"); fi
            part train_accelerate 240 "${ACCELERATE[@]}" "${ACCELERATE_CONFIG[@]}" \
                benchmarks/hf_train_launch.py train "$TL/train.yaml" --output_dir "$TL/accelerate"
            part train_torchrun 240 $RUN benchmarks/hf_train_launch.py train "$TL/train.yaml" \
                --output_dir "$TL/torchrun" --fsdp full_shard --fsdp_config "$TL/fsdp_root.json"
            part train_report 20 $PY benchmarks/hf_train_launch.py report "$TL" "$RES/parallel/hf_train_launch.md"
            for run in accelerate torchrun; do  # the loss curves and clocks behind the report
                mkdir -p "$RUNDIR/train/$run"
                cp "$TL/$run"/trainer_state.json "$TL/$run"/clock_rank*.json "$TL/$run"/profile_rank*.txt \
                    "$RUNDIR/train/$run/" 2>/dev/null
            done
            cp "$TL"/*.yaml "$TL"/*.json "$RUNDIR/train/" 2>/dev/null
        fi
        rm -rf "$TL"
        ;;
    fsdp2_trainer)
        WRITTEN+=("$RES/parallel/hf_fsdp2_trainer.md")
        part fsdp2_trainer 60 $RUN benchmarks/hf_fsdp2_trainer.py "$RES/parallel/hf_fsdp2_trainer.md"
        ;;
    plain_loop)
        WRITTEN+=("$RES/parallel/fsdp2_plain_loop.md")
        part plain_loop 130 $RUN benchmarks/fsdp2_plain_loop.py --out "$RES/parallel" --lengths 8192,32768 \
            --steps 3 --warmup 1
        ;;
    rank_death)
        WRITTEN+=("$RES/parallel/rank_death_cuda.md" "$RES/parallel/rank_death.log")
        part rank_death 100 $PY benchmarks/rank_death.py --out "$RES/parallel" --device cuda --steps 300 \
            --save-steps 20 --bound 45 --run-timeout 70
        ;;
    *)
        echo "$stage: no such stage (memory async async8 train fsdp2_trainer plain_loop rank_death)" | tee -a "$SUMMARY"
        ;;
    esac
done

echo "total: $(($(date +%s) - START)) s" | tee -a "$SUMMARY"
