"""Probe: the attention-KL forward kernel's cost per program against its cost per key block.

The warp-specialized Gluon forward runs one program per (192 query rows, batch * head), one program an SM at
a time. Each program starts afresh: barriers, both sides' query tiles through TMA, the first key blocks, and at
its end the row outputs. Not causal, every program streams the same N / 128 key blocks, so with the number of
programs held constant (B = 16384 / N at H = 32: 2731 programs) the kernel's time is
waves * (F + blocks * t_b); a line through the sizes gives the fixed cost F per program and the cost t_b of a
key block. Causal rows at the same sizes beside them. Kernels launched back to back (``triton_forward``), CUDA
events, medians of rounds. Needs an sm90 GPU:

    python benchmarks/attention_fwd_fixed_cost.py [--ns 1024 2048 4096 8192 16384]
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch

from nitrobrew.attention import kernels_gluon as kg
from nitrobrew.attention.triton_function import triton_forward
from nitrobrew.bench.common import loop_ms
from nitrobrew.environment import environment

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from attention_gluon import inputs, sides, spec_of  # noqa: E402

WS = {"fwd_kernel": "gluon", "fwd_gluon": kg.WARP_SPECIALIZED}
ROWS, BN, H = 192, 128, 32


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ns", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384])
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0) or not kg.HAVE_GLUON:
        print("needs an sm90 GPU (H100/H200) and Triton with Gluon: nothing to measure here")
        return 0
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    print(f"# attention-KL forward: per-program against per-block cost, {torch.cuda.get_device_name()}\n")
    print(", ".join(f"{k} {v}" for k, v in environment().items()) + "\n")
    print("| N | B | programs | key blocks a program (not causal) | not causal ms | causal ms | us a program-wave |")
    print("|---|---|---|---|---|---|---|")
    pts = []
    for n in args.ns:
        b = max(1, 16384 // n)
        q_s, k_s, q_t, k_t = inputs(b, H, n, n, 128, 128, H, H, torch.bfloat16, dev)
        X, Y = sides(q_s, k_s, q_t, k_t)
        specs = {c: spec_of(c, 0, q_s, q_t) for c in (False, True)}
        fns = {c: (lambda s=s: triton_forward(X, Y, None, s, cfg=WS)) for c, s in specs.items()}
        for fn in fns.values():
            fn()
        res = {c: [] for c in fns}
        for _ in range(args.rounds):
            for c, fn in fns.items():
                res[c].append(loop_ms(fn, calls=10))
        nc, ca = (statistics.median(res[c]) for c in (False, True))
        programs = b * H * -(-n // ROWS)
        waves = programs / sms
        pts.append((n // BN, nc * 1e3 / waves))
        print(f"| {n} | {b} | {programs} | {n // BN} | {nc:.3f} | {ca:.3f} | {nc * 1e3 / waves:.1f} |")
        sys.stdout.flush()
        del q_s, k_s, q_t, k_t, X, Y
        torch.cuda.empty_cache()
    xs, ys = [p[0] for p in pts], [p[1] for p in pts]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mx) * (y - my) for x, y in pts) / sum((x - mx) ** 2 for x in xs)
    fixed = my - slope * mx
    print(
        f"\nfit (not causal): a key block {slope:.2f} us, fixed cost a program {fixed:.1f} us "
        f"= {fixed / slope:.1f} key blocks; residuals " + ", ".join(f"{y - (fixed + slope * x):+.1f}" for x, y in pts)
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
