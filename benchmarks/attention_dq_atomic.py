"""attention_kl's backward with dq added by the dk kernel (fp32 atomics) against the two-kernel backward.

The default backward recomputes both score tiles twice: once in the dq kernel (program = query block)
and once in the dk kernel (program = key block), 6U of GEMMs against SDPA's 5U (docs/attention.md).
With ``block_config={"dq_atomic": True}`` the dk kernel also forms each tile's dq share (dS^T k) and
adds it into a zeroed fp32 buffer with relaxed atomics, and the dq kernel does not run: 4U of GEMMs,
two exponentials per score instead of four, and N^2 D / (2 BN) fp32 atomic adds per head (causal).

Same process, alternating: fwd+bwd (gradients to the student's q and k) of the default backward and of
the atomic one with the dk kernel's default tile and wider key blocks, against SDPA's default backend
(fwd+bwd of one attention of the same shape, gradients to q, k, v). B = 1, H = 32, D = 128, bf16,
causal, forward KL; GQA (8 kv heads) at N = 8192. Accuracy at N = 1024 against float64.

    python benchmarks/attention_dq_atomic.py [--ns 4096 8192 16384] [--dk-tiles 32,64,4,3 64,128,8,2]
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch
import torch.nn.functional as F

import nitrobrew as nb
from nitrobrew.attention.reference import reference_attention_kl
from nitrobrew.bench.common import time_ms
from nitrobrew.environment import environment


def inputs(n, h=32, hkv=32, d=128, dev="cuda", dtype=torch.bfloat16, seed=0):
    g = torch.Generator(device=dev).manual_seed(seed)

    def r(*shape):
        return (torch.randn(*shape, generator=g, device=dev) * 1.5).to(dtype)

    return r(1, h, n, d), r(1, hkv, n, d), r(1, h, n, d), r(1, hkv, n, d)


def kl_step(qs, ks, qt, kt, cfg):
    q, k = qs.detach().requires_grad_(), ks.detach().requires_grad_()

    def step():
        loss = nb.attention_kl(q, k, qt, kt, is_causal=True, backend="triton", block_config=cfg)
        return (loss.detach(), *torch.autograd.grad(loss, [q, k]))

    return step


def sdpa_step(q0, k0):
    q, k = q0.detach().requires_grad_(), k0.detach().requires_grad_()
    v = torch.randn_like(k0).requires_grad_()
    go = torch.randn_like(q0)

    def step():
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=k.shape[1] != q.shape[1])
        return torch.autograd.grad(out, [q, k, v], go)

    return step


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ns", type=int, nargs="+", default=[4096, 8192, 16384])
    ap.add_argument("--dk-tiles", nargs="+", default=["32,64,4,3", "64,128,8,2", "32,128,4,3"])
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    env = environment()
    print(f"# attention_kl backward with dq atomics, {env['device']}")
    print(f"torch {env['torch']}, triton {env['triton']}, commit {env['commit']}\n")

    # accuracy against float64 at N = 1024
    qs, ks, qt, kt = inputs(1024)
    ins = [t.double().requires_grad_(i < 2) for i, t in enumerate((qs, ks, qt, kt))]
    ref = torch.autograd.grad(reference_attention_kl(*ins, is_causal=True), ins[:2])
    print("| backward | dq_s rel err | dk_s rel err |")
    print("|---|---|---|")
    for name, cfg in (("two kernels", None), ("dq atomics", {"dq_atomic": True})):
        _, dq, dk = kl_step(qs, ks, qt, kt, cfg)()
        errs = [float((a.double() - b).norm() / b.norm()) for a, b in zip((dq, dk), ref)]
        print(f"| {name} | {errs[0]:.2e} | {errs[1]:.2e} |")

    print("\n| N, kv heads | method | fwd+bwd ms | x SDPA default | x two kernels | dq / dk rel diff to two kernels |")
    print("|---|---|---|---|---|---|")
    cases = [(n, 32) for n in args.ns] + [(8192, 8)]
    for n, hkv in cases:
        qs, ks, qt, kt = inputs(n, hkv=hkv)
        methods = [("SDPA default (one attention)", sdpa_step(qs, ks)), ("two kernels", kl_step(qs, ks, qt, kt, None))]
        for tile in args.dk_tiles:
            cfg = {"dq_atomic": True, "dk": tuple(int(x) for x in tile.split(","))}
            if hkv != 32:
                cfg = {"dq_atomic": True}  # the grouped dk kernel keeps its own tile
                if tile != args.dk_tiles[0]:
                    continue
            methods.append((f"dq atomics, dk tile {cfg.get('dk', 'default')}", kl_step(qs, ks, qt, kt, cfg)))
        base = methods[1][1]()
        times = {name: [] for name, _ in methods}
        diffs = {}
        for name, step in methods[2:]:
            try:
                out = step()
                diffs[name] = " / ".join(
                    f"{float((a.float() - b.float()).norm() / b.float().norm()):.1e}" for a, b in zip(out[1:], base[1:])
                )
            except Exception as err:  # a tile that does not build is reported, not fatal
                diffs[name] = f"failed: {type(err).__name__}: {str(err)[:80]}"
        for rnd in range(args.rounds):
            order = methods if rnd % 2 == 0 else methods[::-1]
            for name, step in order:
                if diffs.get(name, "").startswith("failed"):
                    continue
                times[name].append(time_ms(step, torch.device("cuda"), warmup=2, reps=5))
        sdpa = statistics.median(times[methods[0][0]])
        two = statistics.median(times["two kernels"])
        for name, _ in methods:
            if not times[name]:
                print(f"| {n}, {hkv} | {name} | - | - | - | {diffs[name]} |")
                continue
            t = statistics.median(times[name])
            print(f"| {n}, {hkv} | {name} | {t:.2f} | {t / sdpa:.3f} | {t / two:.3f} | {diffs.get(name, '-')} |")
        del qs, ks, qt, kt, methods
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
