"""Same-process A/B of two versions of nitrobrew on one GPU: the tree's against an older commit's copy.

    git archive OLD nitrobrew | tar -x -C .ab && mv .ab/nitrobrew .ab/nitrobrew_old
    sed -i 's/nitrobrew::/nitrobrew_old::/g' .ab/nitrobrew_old/hidden/custom_op.py
    python benchmarks/ab_versions.py .ab OLD

Hot paths, bf16, V = 152064: hidden forward_kl and jsd fast mode (Ds = 3584, Dt = 5120, N = 4096, 16384),
forward_kl constant-memory mode (N = 4096), topk_kl(normalize="full") fast mode (D = 3584, K = 64,
N = 4096) and attention_kl fwd+bwd (B = 1, H = 32, D = 128, causal, N = 4096). Three alternating rounds
of 5 timed calls (CUDA events, after warm-up); the ratio is new / old of the medians. Then the accuracy
of both against float64 (N = 256 rows, V = 152064) in the random, peaked and close regimes.
"""

import statistics
import sys

import torch

sys.path.insert(0, sys.argv[1])
import nitrobrew_old as old  # noqa: E402

import nitrobrew as new  # noqa: E402
from nitrobrew.bench.common import time_ms  # noqa: E402

DEV = torch.device("cuda")
V, DS, DT = 152064, 3584, 5120
OLD_COMMIT = sys.argv[2] if len(sys.argv) > 2 else "?"


def ab(label, make_step):
    outs, times = {}, {"old": [], "new": []}
    for rnd in range(3):
        for name, pkg in (("old", old), ("new", new)):
            step = make_step(pkg)
            if rnd == 0:
                outs[name] = step()
            times[name].append(time_ms(step, DEV, warmup=1, reps=5))
    rel = [
        float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))
        for a, b in zip(outs["old"], outs["new"])
    ]
    mo, mn = statistics.median(times["old"]), statistics.median(times["new"])
    print(f"| {label} | {mo:.2f} | {mn:.2f} | {mn / mo:.3f} | {' / '.join(f'{r:.1e}' for r in rel)} |", flush=True)


def hidden_step(n, divergence, **kw):
    g = torch.Generator(device=DEV).manual_seed(0)
    xs = torch.randn(n, DS, device=DEV, generator=g, dtype=torch.bfloat16)
    xt = torch.randn(n, DT, device=DEV, generator=g, dtype=torch.bfloat16)
    ws = (torch.randn(V, DS, device=DEV, generator=g) * (3 / DS**0.5)).bfloat16()
    wt = (torch.randn(V, DT, device=DEV, generator=g) * (3 / DT**0.5)).bfloat16()

    def make(pkg):
        fn = getattr(pkg, divergence)

        def step():
            x, w = xs.detach().requires_grad_(), ws.detach().requires_grad_()
            loss = fn(x, xt, w, wt, **kw)
            loss.backward()
            return loss.detach(), x.grad, w.grad

        return step

    return make


def topk_step(n, k=64):
    g = torch.Generator(device=DEV).manual_seed(1)
    xs = torch.randn(n, DS, device=DEV, generator=g, dtype=torch.bfloat16)
    ws = (torch.randn(V, DS, device=DEV, generator=g) * (3 / DS**0.5)).bfloat16()
    ids = torch.stack([torch.randperm(V, device=DEV, generator=g)[:k] for _ in range(n)])
    lp = torch.log_softmax(torch.randn(n, k, device=DEV, generator=g) * 2, -1) - 0.5

    def make(pkg):
        def step():
            x, w = xs.detach().requires_grad_(), ws.detach().requires_grad_()
            loss = pkg.topk_kl(x, w, ids, lp)
            loss.backward()
            return loss.detach(), x.grad, w.grad

        return step

    return make


def attention_step(n):
    g = torch.Generator(device=DEV).manual_seed(2)
    shape = (1, 32, n, 128)
    q, k, qt, kt = (torch.randn(shape, device=DEV, generator=g, dtype=torch.bfloat16) for _ in range(4))

    def make(pkg):
        def step():
            a, b = q.detach().requires_grad_(), k.detach().requires_grad_()
            loss = pkg.attention_kl(a, b, qt, kt, is_causal=True)
            loss.backward()
            return loss.detach(), a.grad, b.grad

        return step

    return make


def accuracy(pkg, regime, divergence, n=256):
    g = torch.Generator(device=DEV).manual_seed(3)
    xs = torch.randn(n, DS, device=DEV, generator=g)
    ws = torch.randn(V, DS, device=DEV, generator=g) * (3 / DS**0.5)
    if regime == "random":
        xt, wt = (
            torch.randn(n, DS, device=DEV, generator=g),
            torch.randn(V, DS, device=DEV, generator=g) * (3 / DS**0.5),
        )
    elif regime == "peaked":
        xt, wt = xs * 4, ws * 3
    else:  # close: teacher head = student head + 1% noise
        xt, wt = xs, ws + torch.randn(V, DS, device=DEV, generator=g) * (0.01 * 3 / DS**0.5)
    xs, ws, xt, wt = xs.bfloat16(), ws.bfloat16(), xt.bfloat16(), wt.bfloat16()
    x = xs.detach().requires_grad_()
    loss = getattr(pkg, divergence)(x, xt, ws, wt, reduction="sum")
    loss.backward()
    x64 = xs.double().requires_grad_()
    ref = new.hidden.reference_loss(
        x64,
        xt.double(),
        ws.double(),
        wt.double(),
        divergence=divergence,
        param=0.5 if divergence == "jsd" else 0.0,
        reduction="sum",
    )
    ref.backward()
    return abs(float(loss) - float(ref)) / abs(float(ref)), float((x.grad.double() - x64.grad).norm() / x64.grad.norm())


print(
    f"# A/B: tree vs {OLD_COMMIT}, {torch.cuda.get_device_name()}, torch {torch.__version__}, "
    f"triton {__import__('triton').__version__}\n"
)
print("| case | old ms | new ms | new / old | rel. diff loss / dX / dW |\n|---|---|---|---|---|")
for n in (4096, 16384):
    ab(f"forward_kl fast N={n}", hidden_step(n, "forward_kl"))
ab("jsd fast N=4096", hidden_step(4096, "jsd"))
ab("forward_kl constant-memory N=4096", hidden_step(4096, "forward_kl", chunk_V=4096))
ab("topk_kl full fast K=64 N=4096", topk_step(4096))
ab("attention_kl fwd+bwd N=4096", attention_step(4096))
print("\n| regime | divergence | old loss err | new loss err | old dX err | new dX err |\n|---|---|---|---|---|---|")
for regime in ("random", "peaked", "close"):
    for divergence in ("forward_kl", "reverse_kl", "jsd"):
        lo, go = accuracy(old, regime, divergence)
        ln, gn = accuracy(new, regime, divergence)
        print(f"| {regime} | {divergence} | {lo:.1e} | {ln:.1e} | {go:.1e} | {gn:.1e} |", flush=True)
