"""FSDP2 (fully_shard) plain training loop on P GPUs: the head sharded apart vs root-wrapped vs HF logits.

A Qwen2-7B-shaped teacher (bf16, sharded) and a 1.5B-shaped student (fp32 master weights, bf16
compute, untied head, gradient checkpointing), batch 1 x L tokens per rank, forward KL, AdamW:

  head sharded apart   the student's decoder is its own fully_shard unit, apart from the head: the
                       head is never gathered; rows are gathered and the loss is vocab-parallel
                       over each rank's block of the head (nitrobrew.hf.fsdp); teacher likewise
  root-wrapped         layers + root: the root forward gathers the head (and keeps it until the
                       backward); nitrobrew's loss runs on each rank's own rows, whole vocabulary
  HF logits            layers + root, the models' own [L, V] logits and a PyTorch forward KL (the
                       path nitrobrew replaces), up to --logits-max-len

    torchrun --nproc-per-node 2 benchmarks/fsdp2_plain_loop.py --out benchmarks/results/parallel

CPU check of the script (gloo, tiny models): add --device cpu --small.
Writes fsdp2_plain_loop.md: ms/step (median over --steps after --warmup, max over ranks), tokens/s
(all ranks), peak GiB allocated per rank (max over ranks), and the loss of the first step (the
same in every layout: same weights, same data).
"""

from __future__ import annotations

import os
import sys

for _k, _v in {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}.items():
    os.environ.setdefault(_k, _v)

import argparse  # noqa: E402
import gc  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # run from a checkout

LAYOUTS = ("head sharded apart", "root-wrapped", "HF logits")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--lengths", default="8192,32768", help="tokens per rank, comma-separated")
    p.add_argument("--layouts", default=",".join(LAYOUTS))
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--logits-max-len", type=int, default=8192, help="largest L for the HF logits path")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--small", action="store_true", help="tiny models and lengths (a CPU check of the script)")
    return p.parse_args(argv)


def configs(small: bool):
    from transformers import Qwen2Config

    if small:
        common = dict(vocab_size=515, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096)
        teacher = Qwen2Config(hidden_size=96, intermediate_size=192, num_hidden_layers=2, **common)
        student = Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, **common)
    else:
        common = dict(vocab_size=152064, max_position_embeddings=131072, rope_theta=1e6, rms_norm_eps=1e-6)
        teacher = Qwen2Config(
            hidden_size=3584,
            intermediate_size=18944,
            num_hidden_layers=28,
            num_attention_heads=28,
            num_key_value_heads=4,
            **common,
        )
        student = Qwen2Config(
            hidden_size=1536,
            intermediate_size=8960,
            num_hidden_layers=28,
            num_attention_heads=12,
            num_key_value_heads=2,
            **common,
        )
    teacher.tie_word_embeddings = False
    student.tie_word_embeddings = False
    return student, teacher


def build(config, dtype, device, seed):
    from transformers import Qwen2ForCausalLM

    torch.manual_seed(seed)
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = Qwen2ForCausalLM(config)
    finally:
        torch.set_default_dtype(old)
    return model


def shard(model, mesh, apart: bool, mp=None):
    from torch.distributed.fsdp import fully_shard

    kw = {"mesh": mesh} if mp is None else {"mesh": mesh, "mp_policy": mp}
    for layer in model.model.layers:
        fully_shard(layer, **kw)
    if apart:
        fully_shard(model.model, **kw)
    fully_shard(model, **kw)
    return model


def logits_loss(student, teacher, ids):
    """The HF path: both models' [L, V] logits, a PyTorch forward KL over the shifted positions."""
    with torch.no_grad():
        t = teacher(input_ids=ids, use_cache=False).logits[:, :-1].float()
    z = student(input_ids=ids, use_cache=False).logits[:, :-1].float()
    lp_t = torch.log_softmax(t, -1)
    kl = (lp_t.exp() * (lp_t - torch.log_softmax(z, -1))).sum(-1)
    return kl.sum(), kl.numel()


def main(argv=None) -> int:
    args = parse_args(argv)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from nitrobrew.environment import environment
    from nitrobrew.hf import distill_loss

    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if args.device == "cuda":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh(device.type, (world,))
    lengths = [64, 256] if args.small else [int(x) for x in args.lengths.split(",")]
    layouts = [x.strip() for x in args.layouts.split(",")]
    s_cfg, t_cfg = configs(args.small)
    half = torch.float32 if device.type == "cpu" else torch.bfloat16
    mp = MixedPrecisionPolicy(param_dtype=half, reduce_dtype=torch.float32)

    teachers = {}  # one sharded teacher per layout kind (apart or root), built once

    def teacher_for(apart):
        if apart not in teachers:
            teachers[apart] = shard(build(t_cfg, half, device, 1).eval().requires_grad_(False), mesh, apart)
        return teachers[apart]

    results = []
    for L in lengths:
        for layout in layouts:
            if layout == "HF logits" and L > args.logits_max_len:
                results.append((L, layout, None, None, None, f"not run above L = {args.logits_max_len}"))
                continue
            apart = layout == "head sharded apart"
            student = opt = None
            try:
                teacher = teacher_for(apart)
                student = build(s_cfg, torch.float32, device, 0)
                student.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
                student.config.use_cache = False
                shard(student, mesh, apart, mp)
                student.train()
                opt = torch.optim.AdamW(student.parameters(), lr=1e-5)
                g = torch.Generator().manual_seed(100 + rank)
                ids = torch.randint(0, s_cfg.vocab_size, (1, L), generator=g).to(device)
                count = torch.tensor(L - 1, device=device)
                dist.all_reduce(count)  # tokens counted over all ranks

                def step():
                    if layout == "HF logits":
                        total, _ = logits_loss(student, teacher, ids)
                        loss = total / count
                    else:
                        loss = distill_loss(
                            student, teacher, ids, divergence="forward_kl", num_items_in_batch=count
                        ).loss
                    (loss * world).backward()  # FSDP averages gradients over ranks
                    opt.step()
                    opt.zero_grad(set_to_none=True)
                    return loss.detach()

                first = step()
                dist.all_reduce(first)
                for _ in range(args.warmup - 1):
                    step()
                if device.type == "cuda":
                    torch.cuda.synchronize()
                    torch.cuda.reset_peak_memory_stats()
                times = []
                for _ in range(args.steps):
                    dist.barrier()
                    t0 = time.perf_counter()
                    step()
                    if device.type == "cuda":
                        torch.cuda.synchronize()
                    times.append((time.perf_counter() - t0) * 1e3)
                ms = sorted(times)[len(times) // 2]
                peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else 0.0
                t = torch.tensor([ms, peak], dtype=torch.float64, device=device)
                dist.all_reduce(t, op=dist.ReduceOp.MAX)
                results.append((L, layout, float(t[0]), float(t[1]), float(first), ""))
            except Exception as e:  # noqa: BLE001 - reported in the table (OOM above all)
                oom = "out of memory" in str(e).lower()
                results.append((L, layout, None, None, None, "OOM" if oom else f"error: {type(e).__name__}"))
                if not oom:
                    traceback.print_exc()
            del student, opt
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
            if rank == 0:
                print(results[-1], flush=True)

    ok = all(r[5] in ("", "OOM") or r[5].startswith("not run") for r in results)
    if rank == 0:
        env = environment()
        env.update(world=str(world), device_kind=device.type)
        lines = [
            "# FSDP2 plain loop: head sharded apart vs root-wrapped vs HF logits",
            "",
            f"`torchrun --nproc-per-node {world} benchmarks/fsdp2_plain_loop.py {' '.join(sys.argv[1:])}`",
            "",
            ", ".join(f"{k}: {v}" for k, v in env.items()),
            "",
            f"Teacher {t_cfg.num_hidden_layers} layers x {t_cfg.hidden_size} (bf16, sharded), student "
            f"{s_cfg.num_hidden_layers} layers x {s_cfg.hidden_size} (fp32 master, bf16 compute, untied head, "
            f"gradient checkpointing), V = {s_cfg.vocab_size}, batch 1 x L per rank, forward KL, AdamW; "
            f"median of {args.steps} steps after {args.warmup} warm-up, max over ranks.",
            "",
            "| L per rank | layout | ms/step | tokens/s (all ranks) | peak GiB per rank | first loss | note |",
            "|---|---|---|---|---|---|---|",
        ]
        for L, layout, ms, peak, first, note in results:
            tps = "-" if ms is None else f"{world * L / ms * 1e3:.0f}"
            lines.append(
                f"| {L} | {layout} | {'-' if ms is None else f'{ms:.0f}'} | {tps} | "
                f"{'-' if peak is None else f'{peak:.1f}'} | {'-' if first is None else f'{first:.5f}'} | {note} |"
            )
        by = {(L, lay): (ms, peak) for L, lay, ms, peak, _, _ in results}
        lines += ["", "| L per rank | apart / root-wrapped time | memory saved by the apart layout |", "|---|---|---|"]
        for L in lengths:
            a, r = by.get((L, LAYOUTS[0])), by.get((L, LAYOUTS[1]))
            if a and r and a[0] and r[0]:
                lines.append(f"| {L} | {a[0] / r[0]:.3f} | {r[1] - a[1]:.1f} GiB |")
        text = "\n".join(lines) + "\n"
        print(text)
        os.makedirs(args.out, exist_ok=True)
        with open(
            os.path.join(args.out, "fsdp2_plain_loop.md" if not args.small else "fsdp2_plain_loop_small.md"), "w"
        ) as f:
            f.write(text)
    dist.barrier()
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
