"""grad_filter in the constant-memory mode on one GPU: skipped (rows x vocab chunk) tiles, time, memory and
gradient error, with the vocabulary as generated and ordered by frequency.

The regimes' generator places frequent tokens at random ids; tokenizers' vocabularies are closer to
frequency order (BPE merges). "by frequency" reorders the head rows by the teacher's mean logit over
the batch (the loss is the same sum; only the order of the vocab chunks changes). Forward KL fwd+bwd,
bf16, V = 152064, Ds = 3584, Dt = 5120, N = 4096; alternating rounds of CUDA-event medians; dX/dW error
against float64 on the first 1024 rows.

    NITROBREW_COMMIT=$(git rev-parse --short HEAD) python benchmarks/grad_filter_const_gpu.py > const.md
"""

import statistics

import torch

import nitrobrew as nb
from nitrobrew.bench import baselines as bl
from nitrobrew.bench import hidden as bh
from nitrobrew.bench import regimes as rg
from nitrobrew.bench.common import environment, time_ms
from nitrobrew.hidden import grad_filter as gf

V, DS, DT, N = 152064, 3584, 5120, 4096
DEV = torch.device("cuda")
ROUNDS = 5
tiles = []


margins = []


def spy(*args, f=gf.negligible_tiles):
    out = f(*args)
    if out is not None:
        tiles.append(sum(map(sum, out)) / max(1, sum(map(len, out))))
        cm, ls, lt, k, eps, rpb = args
        upper = torch.maximum(cm[..., 0] - ls[:, None], cm[..., 1] - lt[:, None]).exp()
        lower = ((cm[..., 0].amax(1) - ls).exp() - (cm[..., 1].amax(1) - lt).exp()).abs()
        ratio = torch.where((k == 0)[:, None], 0.0, upper / (eps * lower[:, None]))  # skip iff <= 1
        per_tile = torch.stack([b.amax(0) for b in ratio.split(rpb)]).flatten()
        margins.append((float(per_tile.min()), float(per_tile.median())))
    return out


gf.negligible_tiles = spy


def by_frequency(d):
    mean = torch.zeros(V, device=DEV)
    for r0 in range(0, N, 1024):
        mean += (d.xt[r0 : r0 + 1024].float() @ d.wt.float().t()).sum(0)
    perm = mean.argsort(descending=True)
    d.ws = d.ws.detach()[perm].contiguous().requires_grad_()
    d.wt = d.wt[perm].contiguous()
    return d


def step_of(filt, d):
    def step():
        d.xs.grad = None
        d.ws.grad = None
        nb.forward_kl(d.xs, d.xt, d.ws, d.wt, mode="constant_memory", grad_filter=filt).backward()

    return step


def peak_extra_mib(step, d):
    step()
    torch.cuda.synchronize()
    d.xs.grad = d.ws.grad = None
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    grads = d.xs.grad.nbytes + d.ws.grad.nbytes  # the gradients themselves are not counted
    return (torch.cuda.max_memory_allocated() - base - grads) / 2**20


print(f"# grad_filter, constant-memory mode, {torch.cuda.get_device_name()}\n")
print(", ".join(f"{k} {v}" for k, v in sorted(environment().items())) + "\n")
print(
    "| regime (teacher entropy) | vocabulary order | method | ms | round medians | x floor | x const-mem | "
    "tiles skipped (a tile's largest bound / threshold; skipped at <= 1) | peak MiB above inputs+grads | "
    "dX / dW rel err |"
)
print("|---|---|---|---|---|---|---|---|---|---|")
for regime in ("lm", "peaked", "close"):
    for order in ("as generated", "by frequency"):
        d = rg.make_hidden(regime, N, V, DS, DT, torch.bfloat16, DEV, seed=0)
        if order == "by frequency":
            d = by_frequency(d)
        g = torch.randn(bl.floor_chunk_rows(N, V, 2, DEV), V, device=DEV, dtype=torch.bfloat16)
        steps = {
            "4 GEMMs (floor)": lambda: bl.gemm_floor(d.xs.detach(), d.xt, d.ws.detach(), d.wt, g),
            "const-mem": step_of(False, d),
            "const-mem + filter": step_of(True, d),
        }
        times = {k: [] for k in steps}
        for _ in range(ROUNDS):
            for k, s in steps.items():
                tiles.clear()
                times[k].append(time_ms(s, DEV, warmup=1, reps=3))
        skipped = statistics.mean(tiles) if tiles else float("nan")
        closest = margins[-1] if margins else (float("nan"), float("nan"))
        del g
        med = {k: statistics.median(v) for k, v in times.items()}
        mem = {k: peak_extra_mib(steps[k], d) for k in ("const-mem", "const-mem + filter")}
        d.xs.grad = d.ws.grad = None
        ref = bh.reference(d, 1024, "forward_kl", 1.0)
        err = {}
        for k, filt in (("const-mem", False), ("const-mem + filter", True)):
            acc = bh.accuracy(
                lambda xs, xt, ws, wt, lab, div, T, filt=filt: nb.forward_kl(
                    xs, xt, ws, wt, mode="constant_memory", grad_filter=filt
                ),
                d,
                1024,
                "forward_kl",
                1.0,
                ref,
            )
            err[k] = f"{acc['err_dx']:.1e} / {acc['err_dw']:.1e}"
        del ref
        for k, t in med.items():
            print(
                f"| {regime} ({d.entropy:.1f}) | {order} | {k} | {t:.2f} | "
                f"{min(times[k]):.2f}-{max(times[k]):.2f} | {t / med['4 GEMMs (floor)']:.3f} | "
                f"{t / med['const-mem']:.3f} | "
                + (
                    f"{skipped:.3f} (bound/threshold: min {closest[0]:.3g}, median {closest[1]:.3g})"
                    if k.endswith("filter")
                    else "-"
                )
                + " | "
                f"{mem.get(k, float('nan')):.1f} | {err.get(k, '-')} |",
                flush=True,
            )
        del d
        torch.cuda.empty_cache()
