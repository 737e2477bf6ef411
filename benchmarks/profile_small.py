"""Where the time of the small problems goes: GPU kernel time vs host time (torch.profiler).

    python benchmarks/profile_small.py [--out DIR]

Cases: topk_kl(normalize="topk") at N=4096, K=64 (V=152064, D=3584) and attention_kl fwd+bwd at
B=1, H=32, N=2048, D=128 (bf16, causal). For each: the median wall time of one call (CUDA events),
the host time to enqueue it (no synchronization), and the profiler's per-kernel CUDA times.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats

import torch
from torch.profiler import ProfilerActivity, profile

from nitrobrew import attention_kl, topk_kl
from nitrobrew.bench.common import host_ms, time_ms
from nitrobrew.bench.topk import make_inputs as topk_inputs


def report(name, fn, out_dir):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    wall = time_ms(fn, torch.device("cuda"), warmup=2, reps=10)
    host = host_ms(fn)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            fn()
        torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=25)
    cp = cProfile.Profile()
    cp.enable()
    for _ in range(20):
        fn()
        torch.cuda.synchronize()
    cp.disable()
    buf = io.StringIO()
    pstats.Stats(cp, stream=buf).sort_stats("tottime").print_stats(18)
    text = (
        f"## {name}\n\nwall {wall:.3f} ms (CUDA events), host enqueue {host:.3f} ms per call\n\n```\n{table}\n```\n"
        f"\nhost (cProfile, 20 calls):\n```\n{buf.getvalue()}\n```\n"
    )
    print(text, flush=True)
    if out_dir:
        with open(os.path.join(out_dir, "profile_small.md"), "a") as f:
            f.write(text)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=None)
    args = p.parse_args()
    dev = torch.device("cuda")

    xs, ws, ids, lp, _, _ = topk_inputs(4096, 152064, 3584, 64, torch.bfloat16, dev)

    def topk_step():
        x = xs.detach().requires_grad_()
        w = ws.detach().requires_grad_()
        topk_kl(x, w, ids, lp, normalize="topk").backward()

    report("topk_kl normalize=topk N=4096 K=64", topk_step, args.out)
    del xs, ws, ids, lp

    g = torch.Generator(device=dev).manual_seed(0)
    qkv = [torch.randn(1, 32, 2048, 128, device=dev, dtype=torch.bfloat16, generator=g) for _ in range(4)]
    q_s, k_s = (t.requires_grad_() for t in qkv[:2])

    def attn_step():
        q_s.grad = k_s.grad = None
        attention_kl(q_s, k_s, qkv[2], qkv[3], is_causal=True).backward()

    def attn_fwd():
        with torch.no_grad():
            attention_kl(q_s, k_s, qkv[2], qkv[3], is_causal=True)

    for name, fn in (("attention_kl fwd+bwd N=2048", attn_step), ("attention_kl fwd N=2048", attn_fwd)):
        try:
            report(name, fn, args.out)
        except Exception as err:  # report and go on
            print(f"{name}: {type(err).__name__}: {err}", flush=True)


if __name__ == "__main__":
    main()
