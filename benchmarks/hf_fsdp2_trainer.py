"""DistillationTrainer under accelerate's FSDP2 plugin on 2 GPUs: one SGD step == one process.

The real plugin path (Trainer -> accelerate -> fully_shard) on GPUs over NCCL (tests/
test_hf_fsdp_accelerate.py runs the same path on CPU over gloo): root-wrapped with the teacher
replicated and sharded, and with the decoder wrapped apart from the head (the head stays sharded:
the vocab-parallel layout) with the teacher replicated and sharded; compares the parameter change
of one SGD step (lr 1: minus the gradient) with the gradient of one process on the whole batch.

    torchrun --nproc_per_node 2 benchmarks/hf_fsdp2_trainer.py OUT.md

Writes OUT.md (a table: variant, worst relative error over the parameters) and exits non-zero
when an error exceeds 1e-4.
"""

import copy
import os
import sys
import tempfile

import torch
import torch.distributed as dist
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from nitrobrew.hf import IGNORE_INDEX, DistillationArguments, DistillationTrainer, distill_loss

V = 1031


def models():
    torch.manual_seed(0)
    student = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=V,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            tie_word_embeddings=False,
        )
    )
    torch.manual_seed(1)
    teacher = Qwen2ForCausalLM(
        Qwen2Config(
            vocab_size=V,
            hidden_size=96,
            intermediate_size=192,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            tie_word_embeddings=True,
        )
    )
    for m in (student, teacher):
        with torch.no_grad():
            m.get_output_embeddings().weight.mul_(8.0)
    return student, teacher.eval().requires_grad_(False)


def data():
    g = torch.Generator().manual_seed(3)
    return [{"input_ids": torch.randint(0, V, (n,), generator=g).tolist()} for n in (33, 9, 21, 17)]


def collate(items):
    N = max(len(it["input_ids"]) for it in items)
    ids = torch.zeros(len(items), N, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, it in enumerate(items):
        ids[b, : len(it["input_ids"])] = torch.tensor(it["input_ids"])
        mask[b, : len(it["input_ids"])] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, IGNORE_INDEX)}


def one(variant, out_dir):
    apart = variant.startswith("head sharded")
    wrap = ["LlamaDecoderLayer", "LlamaModel"] if apart else ["LlamaDecoderLayer"]
    student, teacher = models()
    ref = copy.deepcopy(student)
    if variant.endswith("teacher sharded"):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        teacher.cuda()
        mesh = init_device_mesh("cuda", (dist.get_world_size(),))
        for layer in teacher.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(teacher, mesh=mesh)
    args = DistillationArguments(
        output_dir=out_dir,
        per_device_train_batch_size=2,
        max_steps=1,
        learning_rate=1.0,
        lr_scheduler_type="constant",
        optim="sgd",
        weight_decay=0.0,
        max_grad_norm=0.0,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        divergence="jsd",
        ce_weight=0.2,
        fsdp="full_shard",
        fsdp_config={"version": 2, "transformer_layer_cls_to_wrap": wrap},
        seed=0,
    )
    before = {n: p.detach().clone().cuda() for n, p in student.named_parameters()}
    trainer = DistillationTrainer(
        model=student, teacher_model=teacher, args=args, train_dataset=data(), data_collator=collate
    )
    trainer.train()
    after = {
        n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach() for n, p in trainer.model.named_parameters()
    }
    ref.cuda()
    t_ref = models()[1].cuda()
    b = {k: v.cuda() for k, v in collate(data()).items()}
    distill_loss(
        ref, t_ref, b["input_ids"], b["attention_mask"], b["labels"], divergence="jsd", ce_weight=0.2
    ).loss.backward()
    worst = 0.0
    for n, q in ref.named_parameters():
        g = before[n] - after[n]
        worst = max(worst, float((g - q.grad).abs().max() / q.grad.abs().max().clamp_min(1e-30)))
    if apart:
        assert type(trainer.model.lm_head.weight).__name__ == "DTensor"
    return worst, type(trainer.model).__name__ + (" (decoder apart)" if apart else "")


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else "hf_fsdp2_trainer.md"
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for variant in (
            "root-wrapped, teacher replicated",
            "root-wrapped, teacher sharded",
            "head sharded apart, teacher replicated",
            "head sharded apart, teacher sharded",
        ):
            worst, cls = one(variant, os.path.join(tmp, variant.replace(" ", "_")))
            rows.append((variant, cls, worst))
    if int(os.environ.get("RANK", "0")) == 0:
        lines = ["| variant | student class | worst relative error of the step vs one process |", "|---|---|---|"]
        lines += [f"| {v} | {c} | {w:.2e} |" for v, c, w in rows]
        text = "\n".join(lines) + f"\n\n{dist.get_world_size()} processes, torch {torch.__version__}.\n"
        print(text)
        with open(out, "w") as f:
            f.write(text)
    if dist.is_initialized():
        dist.barrier()
    return 0 if all(w < 1e-4 for _, _, w in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
