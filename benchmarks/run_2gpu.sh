#!/usr/bin/env bash
# Every 2-GPU measurement of the FSDP2 trainer, vocab-parallel and lost-rank work, in one go:
#
#     bash benchmarks/run_2gpu.sh
#
# on one host with 2 GPUs (H100 / H200), NVLink multicast off. Each part runs under its own
# `timeout`, in priority order, within a total budget (RUN_2GPU_BUDGET_S, default 500 s, so the
# whole command ends before 9 minutes); a part that does not fit is skipped and says so. Writes
# benchmarks/results/parallel/*.md, the logs under benchmarks/results/parallel/logs/, the device,
# versions and commit in run_2gpu_env.txt, and one line per part in run_2gpu_summary.txt.
set -u
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" TOKENIZERS_PARALLELISM=false
PY=${PYTHON:-python}
OUT=benchmarks/results/parallel
LOGS=$OUT/logs
mkdir -p "$LOGS"
BUDGET=${RUN_2GPU_BUDGET_S:-500}
START=$(date +%s)
SUMMARY=$OUT/run_2gpu_summary.txt
: > "$SUMMARY"

{
    echo "date: $(date -u +%FT%TZ)"
    echo "commit: $(git rev-parse HEAD 2>/dev/null) $(git status --porcelain 2>/dev/null | grep -qv '^??' && echo '(modified)')"
    nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv 2>&1
    nvidia-smi topo -m 2>&1 | head -8
    $PY -c "import sys, torch, triton, transformers, accelerate; print('python', sys.version.split()[0]); print('torch', torch.__version__, 'cuda', torch.version.cuda, 'nccl', '.'.join(map(str, torch.cuda.nccl.version()))); print('triton', triton.__version__, 'transformers', transformers.__version__, 'accelerate', accelerate.__version__)" 2>&1
    env | grep -E '^(NCCL_NVLS_ENABLE|TORCH_SYMM_MEM_DISABLE_MULTICAST|NVSHMEM_DISABLE_NVLS)='
} > "$OUT/run_2gpu_env.txt" 2>&1
cat "$OUT/run_2gpu_env.txt"

# part NAME LIMIT_S COMMAND...: run under timeout (capped by what is left of the budget), log, summarize
part() {
    local name=$1 limit=$2 t0 left rc
    shift 2
    t0=$(date +%s)
    left=$((BUDGET - (t0 - START)))
    if [ "$left" -lt 20 ]; then
        echo "$name: SKIPPED (budget spent: $((t0 - START)) s of $BUDGET)" | tee -a "$SUMMARY"
        return
    fi
    [ "$limit" -gt "$left" ] && limit=$left
    timeout -k 5 "$limit" "$@" > "$LOGS/$name.log" 2>&1
    rc=$?
    echo "$name: exit $rc in $(($(date +%s) - t0)) s (limit $limit s)$([ $rc -eq 124 ] && echo ' TIMED OUT')" | tee -a "$SUMMARY"
    if [ "$rc" -ne 0 ]; then  # the end of a failing part's log, in the command's own output
        echo "--- last lines of $LOGS/$name.log"
        tail -n 30 "$LOGS/$name.log"
        echo "---"
    fi
}
RUN="$PY -m torch.distributed.run --nproc-per-node 2 --monitor-interval 1"

# 1. DistillationTrainer under accelerate's FSDP2 plugin, both layouts, teacher replicated / sharded:
#    one SGD step against one process on the whole batch.
part hf_fsdp2_trainer 50 $RUN benchmarks/hf_fsdp2_trainer.py "$OUT/hf_fsdp2_trainer.md"

# 2. Vocab-parallel hidden-state loss over NCCL: speed vs one GPU (torch and Triton), per-rank phases.
part distributed_nccl 120 $RUN benchmarks/distributed_nccl.py --out "$OUT" --tokens 4096,16384 \
    --divergences forward_kl,jsd --reps 3 --warmup 1 --naive-max-tokens 0

# 3. FSDP2 plain loop at 7B/1.5B shapes: head sharded apart vs root-wrapped vs HF logits.
part fsdp2_plain_loop 130 $RUN benchmarks/fsdp2_plain_loop.py --out "$OUT" --lengths 8192,32768 --steps 3 --warmup 1

# 4. A rank killed mid-run (NCCL, torchrun): bounded stop, then --resume_from_checkpoint on the same curve.
part rank_death 100 $PY benchmarks/rank_death.py --out "$OUT" --device cuda --steps 300 --save-steps 20 --bound 45 \
    --run-timeout 70

# 5. `nitrobrew train` under accelerate launch (FSDP2, decoder apart) and torchrun (FSDP2, root-wrapped).
TL=$(mktemp -d)
part train_prepare 25 $PY benchmarks/hf_train_launch.py prepare "$TL"
part train_accelerate 55 $PY -m accelerate.commands.launch --config_file "$TL/fsdp2_apart.yaml" \
    -m nitrobrew.cli train "$TL/train.yaml" --output_dir "$TL/accelerate"
part train_torchrun 55 $RUN -m nitrobrew.cli train "$TL/train.yaml" --output_dir "$TL/torchrun" \
    --fsdp full_shard --fsdp_config "$TL/fsdp_root.json"
part train_report 10 $PY benchmarks/hf_train_launch.py report "$TL" "$OUT/hf_train_launch.md"
rm -rf "$TL"

echo "total: $(($(date +%s) - START)) s" | tee -a "$SUMMARY"
ls -l "$OUT" "$LOGS"
