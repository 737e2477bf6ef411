"""Is the CUTLASS Python DSL (CuTe DSL) a route to the attention-KL targets on this GPU? FlashAttention-4's
CuTe DSL kernels (the ``flash-attn-4`` package, its sm90 path: FlashAttention-3's structure) against SDPA's
default (cuDNN attention) and nitrobrew's attention_kl (the Gluon kernels), in one process.

B = 1, H = 32, D = 128, bf16, causal. For each: wall (one call from a synchronized start, CUDA events) and
loop (10 calls back to back, per call), medians of 3 rounds; TFLOP/s from the loop time and attention's
GEMM count (forward 2 GEMMs of the causal half grid, fwd+bwd 3.5x that; attention_kl's forward has as many
GEMM FLOPs as attention's, its backward more). Needs an sm90 GPU, ``flash-attn-4`` and
``nvidia-cutlass-dsl`` (with its CUDA libraries):

    python benchmarks/attention_cute_route.py [--ns 2048 4096 8192 16384]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
import torch.nn.functional as F

import nitrobrew as nb
from nitrobrew.bench.common import loop_ms, time_ms

GLUON = {"fwd_kernel": "gluon", "bwd_kernel": "gluon"}


def attention_tflop(n: int, fwd_bwd: bool) -> float:
    """Attention's GEMM TFLOP at B = 1, H = 32, D = 128, causal: QK^T and PV over half the score grid."""
    return (3.5 if fwd_bwd else 1.0) * 2 * 2 * 32 * n * n * 128 / 2 / 1e12


def compare(n: int, flash_attn_func, rounds: int) -> None:
    dev = torch.device("cuda")
    g = torch.Generator(device="cpu").manual_seed(0)
    q, k, v, q_t, k_t = (torch.randn(1, 32, n, 128, generator=g).to(dev, torch.bfloat16) for _ in "12345")
    q_fa, k_fa, v_fa = (t.transpose(1, 2).contiguous() for t in (q, k, v))  # flash-attn's [B, N, H, D]
    t0 = time.perf_counter()
    out = flash_attn_func(q_fa, k_fa, v_fa, causal=True)
    out = out[0] if isinstance(out, tuple) else out
    torch.cuda.synchronize()
    first_s = time.perf_counter() - t0
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2)
    err = (out.float() - ref.float()).abs().max().item()
    fa_in = [t.clone().requires_grad_(True) for t in (q_fa, k_fa, v_fa)]
    sdpa_in = [t.clone().requires_grad_(True) for t in (q, k, v)]
    kl_in = [t.clone().requires_grad_(True) for t in (q, k)]

    def fa_forward():
        with torch.no_grad():
            flash_attn_func(q_fa, k_fa, v_fa, causal=True)

    def fa_step():
        o = flash_attn_func(*fa_in, causal=True)
        (o[0] if isinstance(o, tuple) else o).sum().backward()

    def sdpa_forward():
        with torch.no_grad():
            F.scaled_dot_product_attention(q, k, v, is_causal=True)

    def sdpa_step():
        F.scaled_dot_product_attention(*sdpa_in, is_causal=True).sum().backward()

    def kl_forward():
        with torch.no_grad():
            nb.attention_kl(q, k, q_t, k_t, is_causal=True, block_config=GLUON)

    def kl_step():
        nb.attention_kl(*kl_in, q_t, k_t, is_causal=True, block_config=GLUON).backward()

    t0 = time.perf_counter()
    fa_step()
    torch.cuda.synchronize()
    print(f"\nN = {n}: FA4's first forward {first_s:.1f} s, first fwd+bwd {time.perf_counter() - t0:.1f} s (with "
          f"compilation at the first N); max |FA4 - SDPA| {err:.2e}")  # fmt: skip
    fns = {
        "FA4 (CuTe DSL) forward": fa_forward,
        "SDPA default forward": sdpa_forward,
        "attention_kl forward": kl_forward,
        "FA4 (CuTe DSL) fwd+bwd": fa_step,
        "SDPA default fwd+bwd": sdpa_step,
        "attention_kl fwd+bwd": kl_step,
    }
    times: dict = {name: ([], []) for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            times[name][0].append(time_ms(fn, dev, warmup=2, reps=10))
            times[name][1].append(loop_ms(fn, calls=10))
    print("| kernel | wall ms | loop ms | TFLOP/s (loop; attention's GEMMs) |")
    print("|---|---|---|---|")
    for name, (wall, loop) in times.items():
        w, lp = statistics.median(wall), statistics.median(loop)
        print(f"| {name} | {w:.3f} | {lp:.3f} | {attention_tflop(n, 'fwd+bwd' in name) / lp * 1e3:.0f} |")
    sys.stdout.flush()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ns", type=int, nargs="+", default=[2048, 4096, 8192, 16384])
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU")
        return 2
    try:
        from flash_attn.cute.interface import flash_attn_func
    except ImportError as err:
        print(f"needs flash-attn-4 and nvidia-cutlass-dsl ({err})")
        return 2
    print(torch.cuda.get_device_name(), "torch", torch.__version__)
    for n in args.ns:
        compare(n, flash_attn_func, args.rounds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
