"""Vocab-parallel KL of close distributions over NCCL (Triton row kernels on each rank) vs float64.

    torchrun --nproc-per-node 2 benchmarks/results/parallel/close_kl_nccl.py
"""
import os
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
import torch
import torch.distributed as dist
import nitrobrew as nb

dist.init_process_group("nccl")
r, world = dist.get_rank(), dist.get_world_size()
torch.cuda.set_device(r)
dev = torch.device("cuda", r)
for n, d, vocab, noise in ((6, 32, 4099, 0.01), (256, 256, 152064, 0.01), (256, 256, 152064, 0.1)):
    g = torch.Generator().manual_seed(0)
    xs = torch.randn(n, d, generator=g)
    ws = torch.randn(vocab, d, generator=g) * (3 / d**0.5)
    wt = ws + torch.randn(vocab, d, generator=g) * (noise / d**0.5)
    lo, hi = vocab * r // world, vocab * (r + 1) // world
    for name in ("forward_kl", "reverse_kl"):
        fn = getattr(nb, name)
        ref = fn(xs.double().to(dev), xs.double().to(dev), ws.double().to(dev), wt.double().to(dev), backend="torch",
                 reduction="none")
        x = xs.to(dev)
        for mode in ("fast", "constant_memory"):
            par = fn(x, x, ws[lo:hi].to(dev), wt[lo:hi].to(dev), process_group=dist.group.WORLD, backend="triton",
                     reduction="none", chunk_V=4096 if mode == "constant_memory" else None)
            one = fn(x, x, ws.to(dev), wt.to(dev), backend="triton", mode=mode, reduction="none")
            e_par = float(((par.double() - ref).abs() / ref).max())
            e_one = float(((one.double() - ref).abs() / ref).max())
            if r == 0:
                print(f"V={vocab} N={n} noise={noise} {name} {mode}: KL max {float(ref.max()):.2e} | rel err "
                      f"vocab-parallel {e_par:.1e}, one GPU {e_one:.1e}", flush=True)
dist.destroy_process_group()
