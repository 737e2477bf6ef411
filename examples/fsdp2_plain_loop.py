"""Distill with nitrobrew under FSDP2 (``fully_shard``) in a plain PyTorch loop, one process per device.

    torchrun --nproc_per_node 2 examples/fsdp2_plain_loop.py                 # tiny random models, CPU (gloo)
    torchrun --nproc_per_node 8 examples/fsdp2_plain_loop.py --device cuda \\
        --teacher PATH --student PATH                                         # your models, NCCL

What FSDP2 asks of the loop, beyond examples/plain_pytorch.py:

1. shard each decoder layer, then the root, of the student (and of the teacher, or keep the teacher
   replicated): with the head in the root's unit, the root's forward gathers it and the loss reads
   the full head; with ``--apart`` the decoder is its own unit and the head stays sharded, the loss
   running vocab-parallel over each rank's block of it (``nitrobrew.hf.fsdp``);
2. count the positions that count over all ranks (``all_reduce`` of ``count_targets``): each rank's
   loss is its sum divided by the global count;
3. multiply the loss by the world size before ``backward``: FSDP averages gradients over ranks, and
   the global normalization already did.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist

from nitrobrew.hf import count_targets, distill_loss


def tiny_models(vocab: int):
    """A random 2x32 teacher and 2x16 student (Llama architecture), the same on every rank."""
    from transformers import LlamaConfig, LlamaForCausalLM

    def make(hidden, seed):
        torch.manual_seed(seed)
        return LlamaForCausalLM(
            LlamaConfig(
                vocab_size=vocab,
                hidden_size=hidden,
                intermediate_size=2 * hidden,
                num_hidden_layers=2,
                num_attention_heads=2,
                num_key_value_heads=2,
                max_position_embeddings=64,
                tie_word_embeddings=False,
            )
        )

    return make(32, 0), make(16, 1)


def shard(model, mesh, apart: bool):
    from torch.distributed.fsdp import fully_shard

    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    if apart:  # the decoder its own unit: the head alone at the root, never gathered by the loss
        fully_shard(model.model, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def batches(vocab: int, batch_size: int, seq_len: int, seed: int):
    """Endless right-padded batches (this rank's share: a seed per rank), labels -100 at padding."""
    g = torch.Generator().manual_seed(seed)
    while True:
        ids = torch.randint(0, vocab, (batch_size, seq_len), generator=g)
        lengths = torch.randint(seq_len // 2, seq_len + 1, (batch_size,), generator=g)
        mask = (torch.arange(seq_len)[None] < lengths[:, None]).long()
        yield {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def main(argv=None) -> float:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--teacher", help="teacher path or hub name (default: a tiny random model)")
    p.add_argument("--student", help="student path or hub name (default: a tiny random model)")
    p.add_argument("--divergence", default="forward_kl")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--batch-size", type=int, default=2, help="per rank")
    p.add_argument("--seq-len", type=int, default=16)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--device", default="cpu", help="cpu (gloo) or cuda (NCCL, one GPU per rank)")
    p.add_argument("--shard-teacher", action="store_true", help="shard the teacher too (default: replicated)")
    p.add_argument("--apart", action="store_true", help="keep the student's head sharded (vocab-parallel loss)")
    args = p.parse_args(argv)

    from torch.distributed.device_mesh import init_device_mesh

    cuda = args.device.startswith("cuda")
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    if args.teacher and args.student:
        from transformers import AutoModelForCausalLM

        teacher = AutoModelForCausalLM.from_pretrained(args.teacher, dtype=torch.bfloat16)
        student = AutoModelForCausalLM.from_pretrained(args.student)
    else:
        teacher, student = tiny_models(vocab=64)
    teacher.to(device).eval().requires_grad_(False)
    student.to(device).train()
    mesh = init_device_mesh(device.type, (world,))
    shard(student, mesh, args.apart)
    if args.shard_teacher:
        shard(teacher, mesh, apart=False)
    vocab = student.config.vocab_size
    optimizer = torch.optim.AdamW(student.parameters(), lr=args.lr)
    data = batches(vocab, args.batch_size, args.seq_len, seed=rank)
    kd = 0.0
    for step in range(args.steps):
        b = {k: v.to(device) for k, v in next(data).items()}
        count = count_targets(b["labels"], b["attention_mask"])
        dist.all_reduce(count)  # the positions that count, over all ranks
        out = distill_loss(
            student,
            teacher,
            b["input_ids"],
            b["attention_mask"],
            b["labels"],
            divergence=args.divergence,
            num_items_in_batch=count,
        )
        (out.loss * world).backward()  # FSDP averages gradients over ranks
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        total = out.kd.detach().clone()
        dist.all_reduce(total)  # each rank's share of the global mean
        kd = float(total)
        if rank == 0:
            print(f"step {step}: {args.divergence} {kd:.5f} nats/token over {int(count)} tokens ({world} ranks)")
    # every rank past its last collective before any tears gloo down: a rank that closes its pairs while
    # the other still waits on one aborts the other (seen under load on CPU)
    dist.barrier()
    dist.destroy_process_group()
    return kd


if __name__ == "__main__":
    main()
