#!/usr/bin/env bash
# One call on a 2-GPU host: single-GPU jobs side by side, then the 2-GPU jobs; everything into $OUT/r.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH="$PWD" TOKENIZERS_PARALLELISM=false
R=$OUT/r; mkdir -p $R/logs
T0=$(date +%s)
S=$R/summary.txt
nvidia-smi -L > $R/gpus.txt
python -c "import torch, triton, transformers, accelerate; print(torch.__version__, triton.__version__, transformers.__version__, accelerate.__version__)" >> $R/gpus.txt
job() { local name=$1 lim=$2; shift 2; local t=$(date +%s); timeout -k 5 $lim "$@" > $R/logs/$name.log 2>&1; echo "$name rc=$? $(( $(date +%s)-t ))s (at $(( $(date +%s)-T0 ))s)" >> $S; }
# phase 1: one GPU each
(CUDA_VISIBLE_DEVICES=0 job teacher_store ${TS_LIM:-200} python benchmarks/teacher_store.py --out $R/teacher_store) &
(CUDA_VISIBLE_DEVICES=1 job confident_rows ${CR_LIM:-200} python benchmarks/confident_rows_gpu.py --old-dir .gpu/old/nitrobrew --out $R/exactness/confident_rows.md) &
wait
# phase 2: both GPUs
job onpolicy_async ${OA_LIM:-120} python benchmarks/onpolicy_step.py --backends static --decode-batches 64 --step-batches 64 --decode-steps 16 --async-windows 3 --out $R/onpolicy_async
RUN="python -m torch.distributed.run --nproc-per-node 2 --monitor-interval 1"
mkdir -p $R/parallel
job rank_death ${RD_LIM:-90} python benchmarks/rank_death.py --out $R/parallel --device cuda --steps 300 --save-steps 20 --bound 45 --run-timeout 70
TL=$(mktemp -d)
job train_prepare 25 python benchmarks/hf_train_launch.py prepare "$TL"
job train_accelerate ${TA_LIM:-50} python -m accelerate.commands.launch --config_file "$TL/fsdp2_apart.yaml" -m nitrobrew.cli train "$TL/train.yaml" --output_dir "$TL/accelerate"
job train_torchrun ${TT_LIM:-50} $RUN -m nitrobrew.cli train "$TL/train.yaml" --output_dir "$TL/torchrun" --fsdp full_shard --fsdp_config "$TL/fsdp_root.json"
job train_report 10 python benchmarks/hf_train_launch.py report "$TL" $R/parallel/hf_train_launch.md
echo "total $(( $(date +%s)-T0 ))s" >> $S
cat $S
cd $OUT && tar czf r.tgz r && rm -rf r
