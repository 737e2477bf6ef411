"""The Gluon (Hopper) forward of attention_kl against the Triton forward and SDPA's default forward.

(1) exactness on the GPU: the Gluon forward's rows (KL per row) against the Triton forward's on odd
cases (N not a multiple of the tiles, GQA, different head dims, causal offsets, lse_t given, fp16),
and the loss and gradients against float64; (2) a sweep of the one-warpgroup kernel's tiles (BM, BN,
warps, stages) at one N; (3) the table: B = 1, H = 32, D = 128, bf16, causal, forward KL: forward
kernel alone (Triton, Gluon one-warpgroup, Gluon warp-specialized: the default; interleaved over three
rounds), the API's fwd+bwd (Triton forward and backward; the warp-specialized forward with the Triton
backward; with the Gluon dq/dk kernels: the default from N = 6144 on),
SDPA with no backend forced (cuDNN attention on Hopper, torch 2.11), and the achieved TFLOP/s
(4 B H N^2 D / 2 per causal forward: the KL's two score GEMMs have the FLOPs of attention's QK^T
and PV) beside FlashAttention-3's published forward rate at head dim 128 on H100 (~600-650 TFLOP/s).
CUDA-event medians. Runs on CPU only to show its usage (it needs an sm90 GPU):

    python benchmarks/attention_gluon.py [--ns 2048 4096 8192 16384] [--sweep-n 8192] [--budget-s 100]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
import torch.nn.functional as F

import nitrobrew as nb
from nitrobrew.attention import kernels_gluon as kg
from nitrobrew.attention.common import AttnSpec
from nitrobrew.attention.reference import reference_attention_kl
from nitrobrew.attention.triton_function import Side, triton_forward
from nitrobrew.bench.common import time_ms
from nitrobrew.environment import environment

FA3_FWD_TFLOPS = "600-650 (FlashAttention-3, H100, hdim 128, published)"
SWEEP = [(64, 64, 4, 2), (64, 32, 4, 2), (64, 32, 4, 3), (64, 32, 4, 4)]


# The exactness cases: (B, H, Nq, Nk, Ds, Dt, kv heads student / teacher, dtype, causal, causal offset)
CASES = [
    ("causal N=1000 D=64 B=2", (2, 3, 1000, 1000, 64, 64, 3, 3, torch.bfloat16, True, 0)),
    ("non-causal N=333", (1, 4, 333, 333, 128, 128, 4, 4, torch.bfloat16, False, 0)),
    ("GQA 8/2 (s) 8/4 (t), Ds=64 Dt=128, N=517", (1, 8, 517, 517, 64, 128, 2, 4, torch.bfloat16, True, 0)),
    ("fp16 Nq=200 Nk=461 offset 261, Ds=32", (1, 2, 200, 461, 32, 128, 2, 2, torch.float16, True, 261)),
    ("offset 37, Ds=16 Dt=64, N=300", (1, 2, 300, 300, 16, 64, 1, 2, torch.bfloat16, True, 37)),
    ("causal N=1536 H=4 D=128", (1, 4, 1536, 1536, 128, 128, 4, 4, torch.bfloat16, True, 0)),
]


def inputs(B, H, Nq, Nk, Ds, Dt, hs, ht, dtype, dev, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)

    def r(*shape):
        return (torch.randn(*shape, generator=g) * 1.5).to(dev, dtype)

    return r(B, H, Nq, Ds), r(B, hs, Nk, Ds), r(B, H, Nq, Dt), r(B, ht, Nk, Dt)


def sides(q_s, k_s, q_t, k_t):
    ss, st = q_s.shape[-1] ** -0.5, q_t.shape[-1] ** -0.5
    return Side(q_t, k_t, st), Side(q_s, k_s, ss)  # forward KL: x = teacher


def spec_of(causal, off, q_s, q_t):
    return AttnSpec(
        is_causal=causal,
        causal_offset=off,
        scale_s=q_s.shape[-1] ** -0.5,
        scale_t=q_t.shape[-1] ** -0.5,
        direction="forward",
    )


def check(dev) -> bool:
    print("## Exactness on the GPU\n")
    print("| case | max abs KL rows (Gluon - Triton) | max abs lse_x | loss rel err vs float64 | dq_s / dk_s rel err |")
    print("|---|---|---|---|---|")
    ok = True
    for name, (B, H, Nq, Nk, Ds, Dt, hs, ht, dtype, causal, off) in CASES:
        q_s, k_s, q_t, k_t = inputs(B, H, Nq, Nk, Ds, Dt, hs, ht, dtype, dev)
        X, Y = sides(q_s, k_s, q_t, k_t)
        spec = spec_of(causal, off, q_s, q_t)
        try:
            kl_t, lx_t, _ = triton_forward(X, Y, None, spec)
            kl_g, lx_g, _ = triton_forward(X, Y, None, spec, cfg={"fwd_kernel": "gluon"})
            torch.cuda.synchronize()
            d_kl = (kl_g - kl_t).abs().max().item()
            d_lx = (lx_g - lx_t).abs().max().item()
            ins = [t.clone().requires_grad_(i < 2) for i, t in enumerate((q_s, k_s, q_t, k_t))]
            out = nb.attention_kl(*ins, is_causal=causal, causal_offset=off, block_config={"fwd_kernel": "gluon"})
            out.backward()
            ref_ins = [t.detach().double().requires_grad_(i < 2) for i, t in enumerate((q_s, k_s, q_t, k_t))]
            ref = reference_attention_kl(*ref_ins, is_causal=causal, causal_offset=off)
            ref.backward()

            def rel(a, b):
                return ((a.double() - b).norm() / b.norm()).item()

            e_val = abs(out.item() - ref.item()) / abs(ref.item())
            e_g = f"{rel(ins[0].grad, ref_ins[0].grad):.1e} / {rel(ins[1].grad, ref_ins[1].grad):.1e}"
            good = d_kl <= 1e-5 * max(1.0, kl_t.abs().max().item()) and e_val <= 1e-5
            ok &= good
            print(f"| {name} | {d_kl:.1e} | {d_lx:.1e} | {e_val:.1e} | {e_g} |{'' if good else ' FAIL'}")
        except Exception as err:  # noqa: BLE001 - report and go on
            ok = False
            print(f"| {name} | error: {type(err).__name__}: {str(err)[:300]} | | | |")
        sys.stdout.flush()
    # lse_t given (teacher side fixed)
    q_s, k_s, q_t, k_t = inputs(1, 2, 700, 700, 128, 128, 2, 2, torch.bfloat16, dev, seed=3)
    X, Y = sides(q_s, k_s, q_t, k_t)
    spec = spec_of(True, 0, q_s, q_t)
    kl_t, lx_t, _ = triton_forward(X, Y, None, spec)
    lse_nat = lx_t * 0.6931471805599453
    a, _, _ = triton_forward(X, Y, None, spec, lse_x=lse_nat)
    b, _, _ = triton_forward(X, Y, None, spec, lse_x=lse_nat, cfg={"fwd_kernel": "gluon"})
    print(f"| lse_t given, N=700 | {(a - b).abs().max().item():.1e} | | | |\n")
    return ok


def fwd_kernel_ms(X, Y, spec, cfg, dev, reps):
    return time_ms(lambda: triton_forward(X, Y, None, spec, cfg=cfg), dev, warmup=2, reps=reps)


def sweep(dev, n, reps) -> tuple:
    q_s, k_s, q_t, k_t = inputs(1, 32, n, n, 128, 128, 32, 32, torch.bfloat16, dev)
    X, Y = sides(q_s, k_s, q_t, k_t)
    spec = spec_of(True, 0, q_s, q_t)
    base = fwd_kernel_ms(X, Y, spec, None, dev, reps)
    print(f"## Gluon tile sweep, forward kernel alone, causal N={n}, B=1, H=32, D=128\n")
    print(f"Triton forward: {base:.3f} ms\n")
    print("| (BM, BN, warps, stages) | Gluon ms | ÷ Triton |")
    print("|---|---|---|")
    best, best_ms = kg.DEFAULT_CONFIG, float("inf")
    for c in SWEEP:
        try:
            ms = fwd_kernel_ms(X, Y, spec, {"fwd_kernel": "gluon", "fwd_gluon": c}, dev, reps)
            print(f"| {c} | {ms:.3f} | {ms / base:.2f} |")
            if ms < best_ms:
                best, best_ms = c, ms
        except Exception as err:  # noqa: BLE001
            print(f"| {c} | error: {type(err).__name__}: {str(err)[:200]} | |")
        sys.stdout.flush()
    print()
    return best


def table(dev, ns, best, reps, deadline):
    print(f"## B=1, H=32, D=128, bf16, causal; one-warpgroup Gluon tiles {best}\n")
    print(
        "| N | Triton fwd kernel ms | Gluon one-warpgroup fwd ms | Gluon warp-specialized fwd ms | SDPA fwd ms "
        "| WS ÷ one-warpgroup | **WS ÷ SDPA fwd** | TFLOP/s Triton / one-WG / WS / SDPA "
        "| API fwd+bwd ms: Triton fwd + bwd / WS fwd + Triton bwd / WS fwd + Gluon bwd | SDPA fwd+bwd ms "
        "| **fwd+bwd ÷ SDPA: Triton bwd / Gluon bwd** | max abs KL rows WS - Triton |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    one_wg = {"fwd_kernel": "gluon", "fwd_gluon": best}
    ws = {"fwd_kernel": "gluon", "fwd_gluon": kg.WARP_SPECIALIZED}  # the default from kg.WS_MIN_ROWS rows on
    for n in ns:
        if time.time() > deadline:
            print(f"| {n} | skipped: time budget | | | | | | | | | | |")
            continue
        r = max(3, reps if n <= 16384 else 3)
        q_s, k_s, q_t, k_t = inputs(1, 32, n, n, 128, 128, 32, 32, torch.bfloat16, dev)
        X, Y = sides(q_s, k_s, q_t, k_t)
        spec = spec_of(True, 0, q_s, q_t)
        v = torch.randn_like(q_s)
        t_tri, t_one, t_ws, t_sdpa = [], [], [], []
        for _ in range(3):  # interleaved rounds: clock drift falls on every kernel alike
            t_tri.append(fwd_kernel_ms(X, Y, spec, None, dev, r))
            t_one.append(fwd_kernel_ms(X, Y, spec, one_wg, dev, r))
            t_ws.append(fwd_kernel_ms(X, Y, spec, ws, dev, r))
            with torch.no_grad():
                t_sdpa.append(time_ms(lambda: F.scaled_dot_product_attention(q_s, k_s, v, is_causal=True), dev, 2, r))
        t_tri, t_one, t_ws, t_sdpa = (statistics.median(t) for t in (t_tri, t_one, t_ws, t_sdpa))
        diff = (triton_forward(X, Y, None, spec)[0] - triton_forward(X, Y, None, spec, cfg=ws)[0]).abs().max().item()
        flops = 4 * 32 * n * n * 128 / 2
        tf = " / ".join(f"{flops / t / 1e9:.0f}" for t in (t_tri, t_one, t_ws, t_sdpa))
        fb, sb, ratio = "-", "-", "-"
        if n <= 16384 and time.time() < deadline:
            qs, ks = q_s.clone().requires_grad_(True), k_s.clone().requires_grad_(True)

            def step(c):
                nb.attention_kl(qs, ks, q_t, k_t, is_causal=True, block_config=c).backward()

            qv, kv, vv = (t.clone().requires_grad_(True) for t in (q_s, k_s, v))
            b_tri = time_ms(lambda: step({"fwd_kernel": "triton", "bwd_kernel": "triton"}), dev, 2, r)
            b_ws_tri = time_ms(lambda: step({**ws, "bwd_kernel": "triton"}), dev, 2, r)
            b_ws = time_ms(lambda: step({**ws, "bwd_kernel": "gluon"}), dev, 2, r)
            b_sdpa = time_ms(
                lambda: F.scaled_dot_product_attention(qv, kv, vv, is_causal=True).sum().backward(), dev, 2, r
            )
            fb, sb = f"{b_tri:.3f} / {b_ws_tri:.3f} / {b_ws:.3f}", f"{b_sdpa:.3f}"
            ratio = f"{b_ws_tri / b_sdpa:.2f} / {b_ws / b_sdpa:.2f}"
        print(
            f"| {n} | {t_tri:.3f} | {t_one:.3f} | {t_ws:.3f} | {t_sdpa:.3f} | {t_ws / t_one:.2f} | {t_ws / t_sdpa:.2f} "
            f"| {tf} | {fb} | {sb} | {ratio} | {diff:.1e} |"
        )
        sys.stdout.flush()
        del q_s, k_s, q_t, k_t, v
        torch.cuda.empty_cache()
    print(f"\nFlashAttention-3 forward, for scale: {FA3_FWD_TFLOPS}.")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ns", type=int, nargs="+", default=[2048, 4096, 8192, 16384, 131072])
    ap.add_argument("--sweep-n", type=int, default=8192, help="0: no sweep (the default tiles)")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--budget-s", type=float, default=100.0, help="skip the remaining sizes past this")
    ap.add_argument("--no-check", action="store_true")
    args = ap.parse_args()
    t0 = time.time()
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0) or not kg.HAVE_GLUON:
        print("needs an sm90 GPU (H100/H200) and Triton with Gluon: nothing to measure here")
        return 0
    dev = torch.device("cuda")
    env = environment()
    print(f"# attention_kl Gluon forward, {torch.cuda.get_device_name()}\n")
    print(", ".join(f"{k} {v}" for k, v in env.items()) + "\n")
    ok = True if args.no_check else check(dev)
    best = sweep(dev, args.sweep_n, args.reps) if args.sweep_n else kg.DEFAULT_CONFIG
    table(dev, args.ns, best, args.reps, t0 + args.budget_s)
    print(f"\nwall {time.time() - t0:.0f} s")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
