"""grad_filter on one GPU: time, active columns and gradient error per input regime, and the filter
inside a CUDA graph capture and under torch.compile.

Same process, same tensors for every method of a regime: the 4-GEMM floor, the exact fast mode,
fast + grad_filter, the constant-memory mode with and without the filter, and (with --prev DIR, a
folder holding an older copy of the package as ``nitrobrew_prev``) the older filter, for an A/B.
Forward KL fwd+bwd, bf16, V = 152064, Ds = 3584, Dt = 5120; alternating rounds of CUDA-event
medians. dX/dW relative errors against float64 autograd on the first --ref-rows rows.

    NITROBREW_COMMIT=$(git rev-parse --short HEAD) python benchmarks/grad_filter_gpu.py --prev .ab > filter.md
"""

import argparse
import statistics
import sys

import torch

import nitrobrew as nb
from nitrobrew.bench import baselines as bl
from nitrobrew.bench import hidden as bh
from nitrobrew.bench import regimes as rg
from nitrobrew.bench.common import environment, time_ms
from nitrobrew.hidden import grad_filter as gf

V, DS, DT = 152064, 3584, 5120
DEV = torch.device("cuda")

p = argparse.ArgumentParser()
p.add_argument("--n", type=int, default=4096)
p.add_argument("--regimes", nargs="+", default=["lm", "peaked", "close", "spread", "flat"])
p.add_argument("--big-n", type=int, default=16384, help="also this N on the first two regimes (0: no)")
p.add_argument("--ref-rows", type=int, default=1024)
p.add_argument("--rounds", type=int, default=5)
p.add_argument("--prev", default=None)
p.add_argument("--eps", type=float, nargs="*", default=[], help="more thresholds for fast + filter")
p.add_argument("--no-const", action="store_true", help="skip the constant-memory methods")
p.add_argument("--checks-only", action="store_true", help="only the graph-capture and compile check")
args = p.parse_args()
prev = None
if args.prev:
    sys.path.insert(0, args.prev)
    import nitrobrew_prev as prev  # noqa: E402


def methods(pkg_new, pkg_prev):
    m = {
        "fast": lambda x, xt, w, wt: pkg_new.forward_kl(x, xt, w, wt, mode="fast"),
        "fast + filter": lambda x, xt, w, wt: pkg_new.forward_kl(x, xt, w, wt, mode="fast", grad_filter=True),
        "const-mem": lambda x, xt, w, wt: pkg_new.forward_kl(x, xt, w, wt, mode="constant_memory"),
        "const-mem + filter": lambda x, xt, w, wt: pkg_new.forward_kl(
            x, xt, w, wt, mode="constant_memory", grad_filter=True
        ),
    }
    for eps in args.eps:
        m[f"fast + filter (eps {eps:g})"] = lambda x, xt, w, wt, eps=eps: pkg_new.forward_kl(
            x, xt, w, wt, mode="fast", grad_filter=eps
        )
    if args.no_const:
        m = {k: f for k, f in m.items() if not k.startswith("const")}
    if pkg_prev is not None:
        m["fast + filter (previous)"] = lambda x, xt, w, wt: pkg_prev.forward_kl(
            x, xt, w, wt, mode="fast", grad_filter=True
        )
    return m


def step_of(fn, d):
    def step():
        d.xs.grad = None
        d.ws.grad = None
        fn(d.xs, d.xt, d.ws, d.wt).backward()

    return step


def floor_step(d):
    chunk = bl.floor_chunk_rows(d.xs.shape[0], V, 2, DEV)
    g = torch.randn(chunk, V, device=DEV, dtype=torch.bfloat16)
    return lambda: bl.gemm_floor(d.xs.detach(), d.xt, d.ws.detach(), d.wt, g)


def fraction_seen(n_cols, eps=2.0**-8):
    f = gf.fractions_for(torch.device("cuda", torch.cuda.current_device()), n_cols, eps)
    f.capacity(n_cols)  # takes a finished read-back
    return f.fraction


def regime_rows(regime, n):
    d = rg.make_hidden(regime, n, V, DS, DT, torch.bfloat16, DEV, seed=0)
    ms = methods(nb, prev)
    steps = {"4 GEMMs (floor)": floor_step(d)}
    steps.update({k: step_of(f, d) for k, f in ms.items()})
    if n > 4096:
        steps = {k: s for k, s in steps.items() if not k.startswith("const")}
    gf._FRACTIONS.clear()
    times = {k: [] for k in steps}
    for _ in range(args.rounds):
        for k, s in steps.items():
            times[k].append(time_ms(s, DEV, warmup=2, reps=5))
    med = {k: statistics.median(v) for k, v in times.items()}
    torch.cuda.synchronize()
    frac_fast = fraction_seen(V)
    frac_const = fraction_seen(4096)
    errs = {}
    if n <= 4096 and args.ref_rows:
        d.xs.grad = d.ws.grad = None
        ref = bh.reference(d, args.ref_rows, "forward_kl", 1.0)
        for k, f in ms.items():
            if k.startswith("const") and "filter" not in k:
                continue
            acc = bh.accuracy(
                lambda xs, xt, ws, wt, lab, div, T, f=f: f(xs, xt, ws, wt), d, args.ref_rows, "forward_kl", 1.0, ref
            )
            errs[k] = (acc["err_dx"], acc["err_dw"])
        del ref
    floor = med["4 GEMMs (floor)"]
    for k, t in med.items():
        e = errs.get(k)
        err = f"{e[0]:.1e} / {e[1]:.1e}" if e else "-"
        spread = f"{min(times[k]):.2f}-{max(times[k]):.2f}"
        vs_fast = f"{t / med['fast']:.3f}" if "fast" in med else "-"
        print(
            f"| {regime} ({d.entropy:.1f}) | {n} | {k} | {t:.2f} | {spread} | {t / floor:.3f} | {vs_fast} | {err} |",
            flush=True,
        )
    print(
        f"| {regime} | {n} | active column fraction seen: fast slabs {frac_fast}, const-mem slabs {frac_const} "
        "| | | | | |",
        flush=True,
    )
    del d
    torch.cuda.empty_cache()


def graph_and_compile_check():
    """grad_filter=True inside a CUDA graph capture and under torch.compile: gradients equal eager's."""
    d = rg.make_hidden("peaked", 2048, V, DS, DT, torch.bfloat16, DEV, seed=1)
    x, w = d.xs.detach().requires_grad_(), d.ws.detach().requires_grad_()

    def fwd_bwd(loss_fn):
        loss = loss_fn(x, d.xt, w, d.wt, grad_filter=True)
        return (loss.detach(), *torch.autograd.grad(loss, [x, w]))

    eager = [fwd_bwd(nb.forward_kl) for _ in range(3)][-1]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fwd_bwd(nb.forward_kl)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = fwd_bwd(nb.forward_kl)
    graph.replay()
    compiled = fwd_bwd(torch.compile(nb.forward_kl, fullgraph=True))
    compiled = fwd_bwd(torch.compile(nb.forward_kl, fullgraph=True))  # the second call: warm
    torch.cuda.synchronize()
    for name, out in (("CUDA graph (captured once, replayed)", captured), ("torch.compile(fullgraph=True)", compiled)):
        rx, rw = (float((a.float() - b.float()).norm() / b.float().norm()) for a, b in zip(out[1:], eager[1:]))
        print(f"| {name} | {float(out[0]):.6f} (eager {float(eager[0]):.6f}) | {rx:.1e} | {rw:.1e} |", flush=True)


env = environment()
print(f"# grad_filter, {torch.cuda.get_device_name()}\n")
print(", ".join(f"{k} {v}" for k, v in sorted(env.items())) + "\n")
print(
    f"forward KL fwd+bwd, bf16, V={V}, Ds={DS}, Dt={DT}; median of {args.rounds} rounds of 5 (CUDA events); "
    f"errors on the first {args.ref_rows} rows vs float64\n"
)
print("| regime (teacher entropy) | N | method | ms | round medians | x floor | x fast | dX / dW rel err |")
print("|---|---|---|---|---|---|---|---|")
for regime in [] if args.checks_only else args.regimes:
    regime_rows(regime, args.n)
for regime in args.regimes[:2] if args.big_n and not args.checks_only else []:
    regime_rows(regime, args.big_n)
print("\n## Inside a CUDA graph capture and torch.compile (peaked, N = 2048): gradients against eager\n")
print("| run | loss | dX rel diff | dW rel diff |")
print("|---|---|---|---|")
graph_and_compile_check()
