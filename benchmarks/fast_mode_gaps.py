"""Where the fast mode's device sits idle between kernels: a torch.profiler trace of two fwd+bwd steps
(after three warm-up steps), the gaps between consecutive GPU kernels summed by the pair of kernels
around them (cuBLAS GEMMs, the Triton row kernels, and the others by name). Same inputs as
fast_mode_parts.py.

    python benchmarks/fast_mode_gaps.py [--ns 4096 16384] [--divs forward_kl jsd]
"""

from __future__ import annotations

import argparse
import collections
import os
import sys

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import fast_mode_parts as fmp  # noqa: E402

V, DS, DT = 152064, 3584, 5120


def kind(name: str) -> str:
    low = name.lower()
    for part in ("hidden_stats", "hidden_grad", "hidden_finish"):
        if part in name:
            return part
    if any(k in low for k in ("gemm", "nvjet", "cutlass", "xmma", "sm90_", "cublas")):
        return "gemm"
    return name[:60]


def gaps_of(step, steps: int = 2):
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    kernels = sorted(
        (e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA), key=lambda e: e.time_range.start
    )
    by_pair = collections.defaultdict(lambda: [0, 0.0])
    total = 0.0
    for a, b in zip(kernels, kernels[1:]):
        gap = b.time_range.start - a.time_range.end
        if gap > 0:
            total += gap
            entry = by_pair[(kind(a.name), kind(b.name))]
            entry[0] += 1
            entry[1] += gap
    return (
        len(kernels) / steps,
        total / steps / 1e3,
        {k: (c / steps, t / steps / 1e3, t / c) for k, (c, t) in by_pair.items()},
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ns", type=int, nargs="+", default=[4096, 16384])
    ap.add_argument("--divs", nargs="+", default=["forward_kl", "jsd"])
    ap.add_argument("--top", type=int, default=8)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    dev = torch.device("cuda")
    for n in args.ns:
        for div in args.divs:
            data = fmp.Data(n, V, DS, DT, dev, torch.bfloat16)
            count, idle, pairs = gaps_of(lambda data=data, div=div: data.step(div))
            print(f"\n### {div}, N = {n}: {count:.0f} kernels per step, idle between kernels {idle:.3f} ms per step\n")
            print("| before the gap | after the gap | gaps per step | ms per step | mean us |")
            print("|---|---|---|---|---|")
            for (a, b), (c, ms, mean) in sorted(pairs.items(), key=lambda kv: -kv[1][1])[: args.top]:
                print(f"| {a} | {b} | {c:g} | {ms:.3f} | {mean:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
