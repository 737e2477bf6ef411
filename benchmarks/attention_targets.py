"""attention_kl's speed targets through the public API, against SDPA's default, over the whole range.

The targets: forward <= 1.3x SDPA-default's forward, fwd+bwd <= 1.0x SDPA-default's fwd+bwd, at
N = 2048 ... 131072, grouped-query attention and different student / teacher head dims included. One
process; for each case and N, the KL and SDPA alternate within each round and the medians are kept:

- wall: one call from a synchronized start (CUDA events), the target tables' protocol;
- loop: calls back to back, per call (the host hidden behind the kernels where they are longer).

Cases (B = 1, H = 32 query heads, bf16, causal, forward KL, gradients to the student's q and k):

  mha    Hkv = 32 on both sides, Ds = Dt = 128
  gqa    Hkv = 8 on both sides, D = 128 (SDPA with enable_gqa)
  dims   Ds = 64, Dt = 128 (SDPA once at the student's shape, once at the teacher's)

The forward runs under no_grad (no autograd node); the default kernels throughout (``block_config`` unset),
plus, in the mha case up to N = 8192, the option that forms the gradients in the forward. TFLOP/s: the two
score GEMMs over the causal half grid, 2 N^2 H (Ds + Dt) / 2 FLOP (attention's forward: 4 N^2 H D / 2),
printed next to FlashAttention-3's published forward rate. Needs a CUDA GPU:

    python benchmarks/attention_targets.py [--cases mha gqa dims] [--budget-s 420]
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
import torch.nn.functional as F
from attention_small_n import measure

import nitrobrew as nb
from nitrobrew.environment import environment

FA3_FWD = "600-650 TFLOP/s (H100, head dim 128, causal, FlashAttention-3's paper)"
NS = {
    "mha": [2048, 4096, 8192, 16384, 32768, 65536, 131072],
    "gqa": [4096, 16384, 65536],
    "dims": [4096, 16384, 65536],
}
SHAPES = {"mha": (32, 128, 128), "gqa": (8, 128, 128), "dims": (32, 64, 128)}  # Hkv, Ds, Dt
H = 32
IN_FORWARD = {"grads_in_forward": True}


def reps_for(n: int) -> tuple:
    """(rounds, wall reps, loop calls) by size: many short calls, few long ones."""
    if n <= 8192:
        return 5, 10, 20
    if n <= 32768:
        return 3, 4, 5
    return 3, 2, 2


def run_case(case: str, n: int, dev) -> list:
    hkv, ds, dt = SHAPES[case]
    g = torch.Generator(device="cpu").manual_seed(n)

    def r(h, d, scale=1.0):
        return (torch.randn(1, h, n, d, generator=g) * scale).to(dev, torch.bfloat16)

    q_s, k_s, v_s = r(H, ds), r(hkv, ds), r(hkv, ds)
    q_t, k_t = r(H, dt, 1.2), r(hkv, dt, 1.2)
    gqa = hkv != H
    qs, ks = q_s.clone().requires_grad_(True), k_s.clone().requires_grad_(True)
    sd_in = [t.clone().requires_grad_(True) for t in (q_s, k_s, v_s)]

    def kl_fwd(cfg=None):
        with torch.no_grad():
            nb.attention_kl(q_s, k_s, q_t, k_t, is_causal=True, block_config=cfg)

    def kl_step(cfg=None):
        nb.attention_kl(qs, ks, q_t, k_t, is_causal=True, block_config=cfg).backward()

    def sdpa_fwd(q, k, v):
        with torch.no_grad():
            F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)

    def sdpa_step():
        F.scaled_dot_product_attention(*sd_in, is_causal=True, enable_gqa=gqa).sum().backward()

    fwd = {"KL": kl_fwd, "SDPA": lambda: sdpa_fwd(q_s, k_s, v_s)}
    step = {"KL": kl_step, "SDPA": sdpa_step}
    if case == "dims":  # SDPA also at the teacher's head dim
        k_tt, v_tt = r(hkv, dt), r(hkv, dt)
        sd_t = [t.clone().requires_grad_(True) for t in (q_t, k_tt, v_tt)]
        fwd["SDPA (Dt)"] = lambda: sdpa_fwd(q_t, k_tt, v_tt)
        step["SDPA (Dt)"] = lambda: F.scaled_dot_product_attention(*sd_t, is_causal=True).sum().backward()
    if case == "mha" and n <= 8192:
        step["KL, grads in forward"] = lambda: kl_step(IN_FORWARD)
    rows = []
    rounds, reps, calls = reps_for(n)
    mf, mb = (measure(f, rounds, reps, loop_calls=calls, host=False, kernels=False) for f in (fwd, step))
    flop = 2 * n * n * H * (ds + dt) / 2
    for what, med in (("forward", mf), ("fwd+bwd", mb)):
        base = med["SDPA"]
        for k, m in med.items():
            ratio = f"{m['wall'] / base['wall']:.2f} / {m['loop'] / base['loop']:.2f}"
            extra = ""
            if case == "dims" and not k.startswith("SDPA"):
                bt = med["SDPA (Dt)"]
                extra = f"; ÷ SDPA (Dt) {m['wall'] / bt['wall']:.2f} / {m['loop'] / bt['loop']:.2f}"
            tf = f"{flop / m['loop'] / 1e9:.0f}" if (what == "forward" and k == "KL") else ""
            if what == "forward" and k.startswith("SDPA"):
                d = ds if k == "SDPA" else dt
                tf = f"{4 * n * n * H * d / 2 / m['loop'] / 1e9:.0f}"
            rows.append(f"| {case} | {n} | {what} | {k} | {m['wall']:.3f} | {m['loop']:.3f} | {ratio}{extra} | {tf} |")
    del q_s, k_s, v_s, q_t, k_t, qs, ks, sd_in
    torch.cuda.empty_cache()
    return rows


def exactness(dev) -> str:
    """The API's default kernels against the PyTorch backend (float32 chunked) at N = 2048, each case."""
    out = []
    for case, (hkv, ds, dt) in SHAPES.items():
        g = torch.Generator(device="cpu").manual_seed(1)
        q_s, k_s = (torch.randn(1, h, 2048, ds, generator=g).to(dev, torch.bfloat16) for h in (H, hkv))
        q_t, k_t = (torch.randn(1, h, 2048, dt, generator=g).to(dev, torch.bfloat16) for h in (H, hkv))
        a = nb.attention_kl(q_s, k_s, q_t, k_t, is_causal=True, reduction="none")
        b = nb.attention_kl(q_s, k_s, q_t, k_t, is_causal=True, reduction="none", backend="torch")
        out.append(f"{case} {(a - b).abs().max().item():.1e} (mean KL {b.mean().item():.3f})")
    return "max |row KL, default kernels - torch backend| at N = 2048: " + "; ".join(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cases", nargs="+", default=list(NS), choices=list(NS))
    ap.add_argument("--ns", type=int, nargs="+", default=None, help="these sizes for every case")
    ap.add_argument("--budget-s", type=float, default=420.0, help="skip the remaining sizes past this")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU: nothing to measure here")
        return 0
    t0 = time.time()
    dev = torch.device("cuda")
    print(f"# attention_kl targets, {torch.cuda.get_device_name()}\n")
    print(", ".join(f"{k} {v}" for k, v in environment().items()) + "\n")
    print(exactness(dev) + "\n")
    print("ms; ratios are ÷ SDPA's default of the same case, wall / loop; TFLOP/s from the loop time\n")
    print("| case | N | what | method | wall | loop | ÷ SDPA, wall / loop | TFLOP/s |")
    print("|---|---|---|---|---|---|---|---|")
    for case in args.cases:
        for n in args.ns or NS[case]:
            if time.time() - t0 > args.budget_s:
                print(f"| {case} | {n} | skipped: time budget | | | | | |")
                continue
            print("\n".join(run_case(case, n, dev)))
            sys.stdout.flush()
    print(f"\nFlashAttention-3's forward, for scale: {FA3_FWD}.\n\nwall {time.time() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
