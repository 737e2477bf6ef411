"""Random-row gather rate on the GPU: rows of C bf16 columns (C * 2 bytes) picked at random from a
table of a given size, summed per program. Tables up to a few tens of MB are served from L2, the 1 GB
one from HBM ("seq": the same rows in order, a copy-like reference).

Usage: python gather_rates.py (output: gather_rates.txt, H200, torch 2.11, Triton 3.6).
"""
import torch, triton, triton.language as tl
from triton.testing import do_bench

dev = torch.device("cuda")
props = torch.cuda.get_device_properties(dev)
print("device", props.name, "sms", props.multi_processor_count, "L2", getattr(props, "L2_cache_size", None), flush=True)


def bench(fn):
    return do_bench(fn, warmup=10, rep=60, return_mode="median")


@triton.jit
def gather_k(T, IDS, OUT, C: tl.constexpr, BLOCK: tl.constexpr, STEPS: tl.constexpr):
    pid = tl.program_id(0)
    acc = tl.zeros([BLOCK, C], dtype=tl.float32)
    for s in range(STEPS):
        base = (pid * STEPS + s) * BLOCK
        ids = tl.load(IDS + base + tl.arange(0, BLOCK)).to(tl.int64)
        acc += tl.load(T + ids[:, None] * C + tl.arange(0, C)[None, :]).to(tl.float32)
    tl.store(OUT + pid * C + tl.arange(0, C), tl.sum(acc, axis=0))

M = 1 << 24
for C in (64, 32, 128):
    for mb in (4, 8, 16, 24, 32, 40, 48, 64, 1024):
        R = (mb << 20) // (C * 2)
        T = torch.randn(R, C, device=dev).bfloat16()
        for kind in ("rand", "seq"):
            if kind == "seq" and mb != 1024:
                continue
            m = min(M, R) if kind == "seq" else M
            ids = torch.randint(0, R, (m,), device=dev, dtype=torch.int32) if kind == "rand" else torch.arange(m, device=dev, dtype=torch.int32)
            for BLOCK, STEPS, W in ((64, 8, 4), (128, 4, 8)):
                out = torch.empty(m // (BLOCK * STEPS), C, device=dev)
                f = lambda: gather_k[(m // (BLOCK * STEPS),)](T, ids, out, C=C, BLOCK=BLOCK, STEPS=STEPS, num_warps=W)
                ms = bench(f)
                print(f"gather C={C} table={mb}MB {kind} block={BLOCK}x{STEPS} w{W}: {ms:.3f} ms {m*C*2/ms/1e9:.2f} TB/s", flush=True)
        del T
