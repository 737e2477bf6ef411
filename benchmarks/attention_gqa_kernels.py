"""Probe: where grouped-query attention's fwd+bwd time goes against the one-kv-head-per-query-head case.

attention_kl through the API (default kernels), B = 1, H = 32, D = 128, bf16, causal, forward KL, gradients to
the student's q and k: Hkv = 32 (MHA) against Hkv = 8 (GQA 32/8), the device time of each kernel of a step
(torch.profiler, averaged over 3 steps after warm-up). Needs a CUDA GPU:

    python benchmarks/attention_gqa_kernels.py [--ns 16384 65536]
"""

from __future__ import annotations

import argparse
import collections

import torch
from torch.profiler import ProfilerActivity, profile

import nitrobrew as nb
from nitrobrew.environment import environment


def kernel_times(hkv: int, n: int, steps: int = 3) -> dict:
    g = torch.Generator(device="cpu").manual_seed(0)
    dev = torch.device("cuda")
    q_s, q_t = (torch.randn(1, 32, n, 128, generator=g).to(dev, torch.bfloat16) for _ in range(2))
    k_s, k_t = (torch.randn(1, hkv, n, 128, generator=g).to(dev, torch.bfloat16) for _ in range(2))
    q_s.requires_grad_(True)
    k_s.requires_grad_(True)

    def step():
        nb.attention_kl(q_s, k_s, q_t, k_t, is_causal=True).backward()

    step(), step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    out = collections.defaultdict(float)
    for e in prof.key_averages():
        if e.self_device_time_total > 0:
            out[e.key[:60]] += e.self_device_time_total / steps / 1e3
    return dict(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ns", type=int, nargs="+", default=[16384, 65536])
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU: nothing to measure here")
        return 0
    print(f"# GQA against MHA, kernels of a fwd+bwd step, {torch.cuda.get_device_name()}\n")
    print(", ".join(f"{k} {v}" for k, v in environment().items()) + "\n")
    for n in args.ns:
        mha, gqa = kernel_times(32, n), kernel_times(8, n)
        print(f"## N = {n} (ms a step)\n\n| kernel | MHA | GQA 32/8 | GQA ÷ MHA |\n|---|---|---|---|")
        for k in sorted(set(mha) | set(gqa), key=lambda k: -max(mha.get(k, 0), gqa.get(k, 0))):
            a, b = mha.get(k, 0.0), gqa.get(k, 0.0)
            print(f"| {k} | {a:.3f} | {b:.3f} | {b / a if a else float('nan'):.2f} |")
        ta, tb = sum(mha.values()), sum(gqa.values())
        print(f"| total | {ta:.3f} | {tb:.3f} | {tb / ta:.2f} |\n")
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
