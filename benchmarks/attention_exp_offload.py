"""Part of side y's exponentials on the FMA units in the Gluon attention-KL kernels (kernels_gluon._exp2_mixed).

The KL forward takes two exponentials a score pair, and alone its update takes about SDPA's whole forward
time on the exponential unit (benchmarks/results/attention/gluon_ws_h100.md). _exp2_mixed computes the
last 1 / share of a tile's columns of 2^(y - m_y) with a degree-5 polynomial on the FMA units
(FlashAttention-4's offload), in unmasked key blocks. This script, on an sm90 GPU:

(1) exactness: KL rows of each share against share 0 and the Triton forward, on the forward's cases and
on hot logits (scores x 8: arguments down to the -126 clamp); loss and gradients (Gluon forward and
backward with the shares) against float64;
(2) the forward kernel (warp-specialized) per share, and SDPA's default forward, interleaved over rounds;
(3) fwd+bwd through the API per (forward share, backward share), and SDPA's default fwd+bwd.

    python benchmarks/attention_exp_offload.py [--ns 8192 16384 32768] [--fwd-variants share0 share8 late]
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch
import torch.nn.functional as F
from attention_gluon import CASES, inputs, sides, spec_of  # the forward's script, beside this one

import nitrobrew as nb
from nitrobrew.attention import kernels_gluon as kg
from nitrobrew.attention.reference import reference_attention_kl
from nitrobrew.attention.triton_function import triton_forward
from nitrobrew.bench.common import time_ms
from nitrobrew.environment import environment

WS = {"fwd_kernel": "gluon", "fwd_gluon": kg.WARP_SPECIALIZED}


def check(dev, shares, bwd_shares) -> bool:
    print("## Exactness on the GPU\n")
    print(
        "| case | share fwd / bwd | max abs KL rows vs share 0 | vs Triton fwd | loss rel err vs float64 "
        "| dq_s / dk_s rel err vs float64 |"
    )
    print("|---|---|---|---|---|---|")
    ok = True
    cases = CASES + [("hot logits (q x 8), N=1536 H=4", (1, 4, 1536, 1536, 128, 128, 4, 4, torch.bfloat16, True, 0))]
    for name, (B, H, Nq, Nk, Ds, Dt, hs, ht, dtype, causal, off) in cases:
        q_s, k_s, q_t, k_t = inputs(B, H, Nq, Nk, Ds, Dt, hs, ht, dtype, dev)
        if name.startswith("hot"):
            q_s, q_t = q_s * 8, q_t * 8
        X, Y = sides(q_s, k_s, q_t, k_t)
        spec = spec_of(causal, off, q_s, q_t)
        kl_tri = triton_forward(X, Y, None, spec)[0]
        kl_0 = triton_forward(X, Y, None, spec, cfg={**WS, "fwd_fma_share": 0})[0]
        ref_ins = [t.detach().double().requires_grad_(i < 2) for i, t in enumerate((q_s, k_s, q_t, k_t))]
        ref = reference_attention_kl(*ref_ins, is_causal=causal, causal_offset=off)
        ref.backward()
        for s_f, s_b in zip(shares, bwd_shares):
            try:
                kl_s = triton_forward(X, Y, None, spec, cfg={**WS, "fwd_fma_share": s_f})[0]
                d0 = (kl_s - kl_0).abs().max().item()
                dt = (kl_s - kl_tri).abs().max().item()
                ins = [t.clone().requires_grad_(i < 2) for i, t in enumerate((q_s, k_s, q_t, k_t))]
                cfg = {**WS, "bwd_kernel": "gluon", "fwd_fma_share": s_f, "bwd_fma_share": s_b}
                out = nb.attention_kl(*ins, is_causal=causal, causal_offset=off, block_config=cfg)
                out.backward()

                def rel(a, b):
                    return ((a.double() - b).norm() / b.norm()).item()

                e_val = abs(out.item() - ref.item()) / abs(ref.item())
                e_g = f"{rel(ins[0].grad, ref_ins[0].grad):.1e} / {rel(ins[1].grad, ref_ins[1].grad):.1e}"
                scale = max(1.0, kl_tri.abs().max().item())
                good = dt <= 1e-5 * scale and e_val <= 1e-5 and rel(ins[0].grad, ref_ins[0].grad) <= 2e-2
                ok &= good
                print(
                    f"| {name} | {s_f} / {s_b} | {d0:.1e} | {dt:.1e} | {e_val:.1e} | {e_g} |{'' if good else ' FAIL'}"
                )
            except Exception as err:  # noqa: BLE001 - report and go on
                ok = False
                print(f"| {name} | {s_f} / {s_b} | error: {type(err).__name__}: {str(err)[:300]} | | | |")
            sys.stdout.flush()
    print()
    return ok


def variant_cfg(name: str) -> dict:
    """A variant's block-config keys: "share<k>" (1 / k of side y's exponentials of the forward on the FMA units),
        "bshare<k>" (the same in the backward's dq and dk kernels), "late" (the forward releases each key buffer
        after the update instead of after the GEMMs), "estats" (the dk kernel loads a query block's row statistics
    before waiting for its tiles instead of under the score MMAs), joined by "+"."""
    cfg = {}
    for part in name.split("+"):
        if part.startswith("bshare"):
            cfg["bwd_fma_share"] = int(part[6:])
        elif part.startswith("share"):
            cfg["fwd_fma_share"] = int(part[5:])
        elif part == "late":
            cfg["fwd_late_release"] = True
        elif part == "estats":
            cfg["bwd_early_stats"] = True
        elif part != "base":
            raise SystemExit(f"unknown forward variant {part!r}")
    return cfg


def forward_table(dev, ns, variants, reps, rounds) -> None:
    print("## Forward kernel (warp-specialized), B=1, H=32, D=128, bf16, causal, forward KL\n")
    head = " | ".join(f"{v} ms" for v in variants)
    ratio = " | ".join(f"{v} / {variants[0]}" for v in variants[1:])
    print(f"| N | {head} | SDPA default fwd ms | {ratio} | best / SDPA | TFLOP/s best / SDPA |")
    print("|" + "---|" * (3 + 2 * len(variants) + 1))
    for n in ns:
        q_s, k_s, q_t, k_t = inputs(1, 32, n, n, 128, 128, 32, 32, torch.bfloat16, dev)
        X, Y = sides(q_s, k_s, q_t, k_t)
        spec = spec_of(True, 0, q_s, q_t)
        v = torch.randn_like(q_s)
        times = {name: [] for name in variants}
        sdpa = []
        r = reps if n <= 16384 else max(3, reps // 2)
        for _ in range(rounds):  # interleaved: clock drift falls on every variant alike
            for name in variants:
                cfg = {**WS, **variant_cfg(name)}
                times[name].append(time_ms(lambda: triton_forward(X, Y, None, spec, cfg=cfg), dev, 2, r))
            with torch.no_grad():
                sdpa.append(time_ms(lambda: F.scaled_dot_product_attention(q_s, k_s, v, is_causal=True), dev, 2, r))
        med = {name: statistics.median(t) for name, t in times.items()}
        t_sdpa = statistics.median(sdpa)
        best = min(med.values())
        flops = 4 * 32 * n * n * 128 / 2
        cells = " | ".join(f"{med[name]:.3f}" for name in variants)
        ratios = " | ".join(f"{med[name] / med[variants[0]]:.3f}" for name in variants[1:])
        print(
            f"| {n} | {cells} | {t_sdpa:.3f} | {ratios} | {best / t_sdpa:.2f} "
            f"| {flops / best / 1e9:.0f} / {flops / t_sdpa / 1e9:.0f} |"
        )
        sys.stdout.flush()
        del q_s, k_s, q_t, k_t, v
        torch.cuda.empty_cache()
    print()


def train_table(dev, ns, variants, reps, rounds) -> None:
    print("## fwd+bwd through the API (Gluon forward and backward), gradients to the student's q and k\n")
    head = " | ".join(f"{v} ms" for v in variants)
    ratio = " | ".join(f"{v} ÷ SDPA" for v in variants)
    print(f"| N | {head} | SDPA default fwd+bwd ms | {ratio} |")
    print("|" + "---|" * (2 + 2 * len(variants)))
    for n in ns:
        q_s, k_s, q_t, k_t = inputs(1, 32, n, n, 128, 128, 32, 32, torch.bfloat16, dev)
        v = torch.randn_like(q_s)
        qs, ks = q_s.clone().requires_grad_(True), k_s.clone().requires_grad_(True)
        qv, kv, vv = (t.clone().requires_grad_(True) for t in (q_s, k_s, v))

        def step(name):
            cfg = {**WS, "bwd_kernel": "gluon", **variant_cfg(name)}
            nb.attention_kl(qs, ks, q_t, k_t, is_causal=True, block_config=cfg).backward()

        times = {name: [] for name in variants}
        sdpa = []
        for _ in range(rounds):
            for name in variants:
                times[name].append(time_ms(lambda: step(name), dev, 2, reps))
            sdpa.append(
                time_ms(
                    lambda: F.scaled_dot_product_attention(qv, kv, vv, is_causal=True).sum().backward(), dev, 2, reps
                )
            )
        med = {name: statistics.median(t) for name, t in times.items()}
        t_sdpa = statistics.median(sdpa)
        cells = " | ".join(f"{med[name]:.3f}" for name in variants)
        ratios = " | ".join(f"{med[name] / t_sdpa:.3f}" for name in variants)
        print(f"| {n} | {cells} | {t_sdpa:.3f} | {ratios} |")
        sys.stdout.flush()
        del q_s, k_s, q_t, k_t, v, qs, ks, qv, kv, vv
        torch.cuda.empty_cache()
    print()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ns", type=int, nargs="*", default=[8192, 16384, 32768], help="forward table sizes")
    ap.add_argument("--train-ns", type=int, nargs="*", default=[8192, 16384], help="fwd+bwd table sizes")
    ap.add_argument("--fwd-variants", nargs="+", default=["share0", "share2", "share4", "share8"], help="variant_cfg")
    ap.add_argument(
        "--train-variants",
        nargs="*",
        default=["base", "share4", "bshare2", "bshare4", "share4+bshare2"],
        help="variant_cfg",
    )
    ap.add_argument("--check-combos", nargs="*", default=["4,2", "2,4", "8,0"], help="fwd,bwd shares checked")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--no-check", action="store_true")
    args = ap.parse_args()
    dev = torch.device("cuda")
    print(environment(), "\n")
    ok = True
    if not args.no_check:
        checked = [tuple(int(x) for x in c.split(",")) for c in args.check_combos]
        ok = check(dev, [a for a, _ in checked], [b for _, b in checked])
    forward_table(dev, args.ns, args.fwd_variants, args.reps, args.rounds)
    train_table(dev, args.train_ns, args.train_variants, args.reps, args.rounds)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
