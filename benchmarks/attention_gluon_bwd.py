"""The Gluon (Hopper) dq kernel of attention_kl against the Triton dq kernel, and the backward's parts.

(1) exactness on the GPU: the Gluon dq (kernels_gluon_bwd) against the Triton dq kernel on the same
forward outputs, both directions (forward KL: dq of y; reverse: of x), per-row and scalar upstream
gradients, odd cases (N not a multiple of the tiles, GQA, different head dims, causal offsets, fp16);
(2) the table: B = 1, H = 32, D = 128, bf16, causal, forward KL: the Triton dq and dk kernels alone,
the Gluon dq for each config, SDPA's default fwd+bwd, interleaved over rounds (CUDA-event medians).
Needs an sm90 GPU:

    python benchmarks/attention_gluon_bwd.py [--ns 4096 8192 16384] [--configs 64,3,160 64,2,160]
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch
import torch.nn.functional as F
from attention_gluon import CASES, inputs  # the forward's script, beside this one

import nitrobrew as nb
from nitrobrew.attention import kernels_gluon as kg
from nitrobrew.attention import kernels_gluon_bwd as kgb
from nitrobrew.attention import triton_function as tf
from nitrobrew.attention.common import AttnSpec
from nitrobrew.attention.triton_function import Side, triton_backward, triton_forward
from nitrobrew.bench.common import time_ms
from nitrobrew.environment import environment

NEED_NONE = dict(qx=False, kx=False, qy=False, ky=False)
WS_FWD = {"fwd_kernel": "gluon", "fwd_gluon": "warp_specialized"}


def setup(q_s, k_s, q_t, k_t, causal, off, direction):
    S, T = Side(q_s, k_s, q_s.shape[-1] ** -0.5), Side(q_t, k_t, q_t.shape[-1] ** -0.5)
    spec = AttnSpec(is_causal=causal, causal_offset=off, scale_s=S.scale, scale_t=T.scale, direction=direction)
    # forward KL: x = teacher, y = student (dq of y); reverse: x = student (dq of x)
    X, Y = (T, S) if direction == "forward" else (S, T)
    return X, Y, spec


def gluon_grad(kind, X, Y, spec, lsx, lsy, kl, g, grad_x, g_mult, config=None):
    """One side's dq or dk from the Gluon kernels (the library's call, with a config)."""
    return tf.gluon_grad(kind, X, Y, spec, rows=(lsx, lsy, kl, g, g_mult), grad_x=grad_x, config=config)


def triton_grad(kind, X, Y, spec, lsx, lsy, kl, g, grad_x, g_mult):
    """The same from the Triton kernels."""
    name = ("q" if kind == "dq" else "k") + ("x" if grad_x else "y")
    need = dict(NEED_NONE, **{name: True})
    return triton_backward(X, Y, None, spec, lsx, lsy, kl, g, need, g_mult=g_mult)[name]


def check(dev, configs, dk_configs) -> bool:
    print("## Exactness on the GPU: Gluon dq / dk against the Triton dq / dk kernels\n")
    print("| case | direction | upstream | kernel, config | rel diff (norm) | max abs diff / max abs |")
    print("|---|---|---|---|---|---|")
    # the forward's cases, and two for dk: kv heads grouped alike on both sides, Nq < Nk at a large offset
    cases = CASES + [
        ("GQA 8/2 both sides, Ds=64 Dt=128, N=700", (1, 8, 700, 700, 64, 128, 2, 2, torch.bfloat16, True, 0)),
        ("Nq=300 Nk=1000 offset 700, Dt=64, B=2", (2, 2, 300, 1000, 128, 64, 2, 2, torch.bfloat16, True, 700)),
    ]
    ok = True
    for name, (B, H, Nq, Nk, Ds, Dt, hs, ht, dtype, causal, off) in cases:
        q_s, k_s, q_t, k_t = inputs(B, H, Nq, Nk, Ds, Dt, hs, ht, dtype, dev)
        for direction in ("forward", "reverse"):
            X, Y, spec = setup(q_s, k_s, q_t, k_t, causal, off, direction)
            kl, lsx, lsy = triton_forward(X, Y, None, spec)
            grad_x = direction == "reverse"
            for upstream in ("rows", "scalar"):
                if upstream == "rows":
                    g, g_mult = torch.rand(B, H, Nq, device=dev) + 0.5, None
                else:
                    g, g_mult = torch.tensor(0.75, device=dev), 1.0 / kl.numel()
                runs = [("dq", c) for c in configs] + ([("dk", c) for c in dk_configs] if X.G == Y.G else [])
                refs = {}
                for kind, config in runs:
                    try:
                        if kind not in refs:
                            refs[kind] = triton_grad(kind, X, Y, spec, lsx, lsy, kl, g, grad_x, g_mult).float()
                        ref = refs[kind]
                        got = gluon_grad(kind, X, Y, spec, lsx, lsy, kl, g, grad_x, g_mult, config).float()
                        torch.cuda.synchronize()
                        rel = ((got - ref).norm() / ref.norm()).item()
                        mx = ((got - ref).abs().max() / ref.abs().max()).item()
                        good = rel <= 2e-2 and torch.isfinite(got).all().item()
                        ok &= good
                        flag = "" if good else " FAIL"
                        print(f"| {name} | {direction} | {upstream} | {kind} {config} | {rel:.1e} | {mx:.1e} |{flag}")
                    except Exception as err:  # noqa: BLE001 - report and go on
                        ok = False
                        print(f"| {name} | {direction} | {upstream} | {kind} {config} | error: {type(err).__name__}: "
                              f"{str(err)[:300]} | |")  # fmt: skip
                    sys.stdout.flush()
    print()
    return ok


def table(dev, ns, configs, dk_configs, reps, rounds):
    print("## B=1, H=32, D=128, bf16, causal, forward KL (dq and dk of the student): kernels alone\n")
    head = " | ".join([f"Gluon dq {c} ms" for c in configs] + [f"Gluon dk {c} ms" for c in dk_configs])
    print(f"| N | Triton dq ms | Triton dk ms | {head} | best Gluon dq ÷ Triton dq | best Gluon dk ÷ Triton dk "
          "| SDPA fwd ms | SDPA fwd+bwd ms | Triton fwd ms | Gluon WS fwd ms | WS fwd + best Gluon dq + dk "
          "÷ SDPA fwd+bwd |")  # fmt: skip
    print("|" + "---|" * (10 + len(configs) + len(dk_configs)))
    for n in ns:
        q_s, k_s, q_t, k_t = inputs(1, 32, n, n, 128, 128, 32, 32, torch.bfloat16, dev)
        X, Y, spec = setup(q_s, k_s, q_t, k_t, True, 0, "forward")
        kl, lsx, lsy = triton_forward(X, Y, None, spec)
        g = torch.ones((), device=dev)
        v = torch.randn_like(q_s)
        qv, kv, vv = (t.clone().requires_grad_(True) for t in (q_s, k_s, v))
        fns = {
            "dq": lambda: triton_grad("dq", X, Y, spec, lsx, lsy, kl, g, False, 1.0),
            "dk": lambda: triton_grad("dk", X, Y, spec, lsx, lsy, kl, g, False, 1.0),
            "sdpa_fwd": lambda: F.scaled_dot_product_attention(q_s, k_s, v, is_causal=True),
            "sdpa": lambda: F.scaled_dot_product_attention(qv, kv, vv, is_causal=True).sum().backward(),
            "fwd_triton": lambda: triton_forward(X, Y, None, spec),
            "fwd_ws": lambda: triton_forward(X, Y, None, spec, cfg=WS_FWD),
        }  # fmt: skip
        for c in configs:
            fns[("dq", c)] = lambda c=c: gluon_grad("dq", X, Y, spec, lsx, lsy, kl, g, False, 1.0, c)
        for c in dk_configs:
            fns[("dk", c)] = lambda c=c: gluon_grad("dk", X, Y, spec, lsx, lsy, kl, g, False, 1.0, c)
        times = {k: [] for k in fns}
        for _ in range(rounds):
            for k, fn in fns.items():
                try:
                    times[k].append(time_ms(fn, dev, 2, reps))
                except Exception as err:  # noqa: BLE001
                    print(f"<!-- {k}: {type(err).__name__}: {str(err)[:200]} -->")
                    times[k].append(float("nan"))
        med = {k: statistics.median(t) for k, t in times.items()}
        best_dq = min(med[("dq", c)] for c in configs)
        best_dk = min(med[("dk", c)] for c in dk_configs)
        cells = " | ".join(f"{med[k]:.3f}" for k in fns if isinstance(k, tuple))
        total = (med["fwd_ws"] + best_dq + best_dk) / med["sdpa"]
        print(f"| {n} | {med['dq']:.3f} | {med['dk']:.3f} | {cells} | {best_dq / med['dq']:.2f} "
              f"| {best_dk / med['dk']:.2f} | {med['sdpa_fwd']:.3f} | {med['sdpa']:.3f} | {med['fwd_triton']:.3f} "
              f"| {med['fwd_ws']:.3f} | {total:.2f} |")  # fmt: skip
        sys.stdout.flush()
        del q_s, k_s, q_t, k_t, v, qv, kv, vv
        torch.cuda.empty_cache()


API_CASES = [
    # (name, N, kv heads student / teacher, Ds, Dt, direction)
    ("MHA D=128, forward KL", 4096, 32, 32, 128, 128, "forward"),
    ("MHA D=128, forward KL", 8192, 32, 32, 128, 128, "forward"),
    ("MHA D=128, reverse KL", 16384, 32, 32, 128, 128, "reverse"),
    ("GQA 32/8 both sides, forward KL", 8192, 8, 8, 128, 128, "forward"),
    ("GQA 32/8 both sides, forward KL", 16384, 8, 8, 128, 128, "forward"),
    ("GQA 32/8 (s) 32/4 (t), forward KL", 16384, 8, 4, 128, 128, "forward"),
    ("Ds=64, Dt=128, forward KL", 16384, 32, 32, 64, 128, "forward"),
]


def api_table(dev, reps, rounds, ns=None):
    """The API's fwd+bwd (gradients to the student's q and k) with the Triton and the Gluon backward (the
    Gluon forward in both), against SDPA's default fwd+bwd on the student's shapes (GQA as enable_gqa)."""
    print("\n## API fwd+bwd, B=1, H=32, bf16, causal: Triton backward / Gluon backward / SDPA default\n")
    print("| case | N | Triton bwd ms | Gluon bwd ms | SDPA fwd+bwd ms | Gluon ÷ Triton | **÷ SDPA**: Triton / Gluon |")
    print("|---|---|---|---|---|---|---|")
    cases = [("MHA D=128, forward KL", n, 32, 32, 128, 128, "forward") for n in ns] if ns else API_CASES
    for name, n, hs, ht, ds, dt, direction in cases:
        q_s, k_s, q_t, k_t = inputs(1, 32, n, n, ds, dt, hs, ht, torch.bfloat16, dev)
        qs, ks = q_s.clone().requires_grad_(True), k_s.clone().requires_grad_(True)
        v = torch.randn_like(k_s)
        qv, kv, vv = (t.clone().requires_grad_(True) for t in (q_s, k_s, v))

        def step(bwd):
            cfg = {**WS_FWD, "bwd_kernel": bwd}
            nb.attention_kl(qs, ks, q_t, k_t, is_causal=True, direction=direction, block_config=cfg).backward()

        fns = {
            "triton": lambda: step("triton"),
            "gluon": lambda: step("gluon"),
            "sdpa": lambda: (
                F.scaled_dot_product_attention(qv, kv, vv, is_causal=True, enable_gqa=hs != 32).sum().backward()
            ),
        }
        times = {k: [] for k in fns}
        for _ in range(rounds):
            for k, fn in fns.items():
                times[k].append(time_ms(fn, dev, 2, reps))
        med = {k: statistics.median(t) for k, t in times.items()}
        tri, glu, sdpa = med["triton"], med["gluon"], med["sdpa"]
        print(
            f"| {name} | {n} | {tri:.3f} | {glu:.3f} | {sdpa:.3f} | {glu / tri:.2f} "
            f"| {tri / sdpa:.2f} / {glu / sdpa:.2f} |"
        )
        sys.stdout.flush()
        del q_s, k_s, q_t, k_t, qs, ks, v, qv, kv, vv
        torch.cuda.empty_cache()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ns", type=int, nargs="*", default=[4096, 8192, 16384])
    ap.add_argument("--configs", nargs="+", default=["64,3,160"], help="BN,STAGES,CONSUMER_REGS of the Gluon dq")
    dk_default = f"{kgb.DK_BQ},{kgb.DK_STAGES},{kgb.DQ_CONSUMER_REGS}"
    ap.add_argument("--dk-configs", nargs="+", default=[dk_default], help="BQ,STAGES,CONSUMER_REGS of the Gluon dk")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--no-check", action="store_true")
    ap.add_argument("--api", action="store_true", help="also the API table (GQA, head dims, reverse KL)")
    ap.add_argument("--api-ns", type=int, nargs="*", help="the API table for MHA forward KL at these N instead")
    args = ap.parse_args()
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    print(f"# attention_kl Gluon dq, {torch.cuda.get_device_name() if dev.type == 'cuda' else 'cpu'}\n")
    print(", ".join(f"{k} {v}" for k, v in environment().items()) + "\n")
    if dev.type != "cuda" or torch.cuda.get_device_capability() != (9, 0) or not kg.HAVE_GLUON:
        print("needs an sm90 GPU and Gluon")
        return 0
    configs = [tuple(int(v) for v in c.split(",")) for c in args.configs]
    dk_configs = [tuple(int(v) for v in c.split(",")) for c in args.dk_configs]
    ok = True if args.no_check else check(dev, configs, dk_configs)
    if args.ns:
        table(dev, args.ns, configs, dk_configs, args.reps, args.rounds)
    if args.api:
        api_table(dev, args.reps, args.rounds, args.api_ns)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
