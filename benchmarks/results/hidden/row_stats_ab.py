"""Same-process A/B of a row-pass kernel module against the tree's, fwd+bwd.

    git show 6048236:nitrobrew/hidden/triton_rows.py > old_rows.py
    git show 6048236:nitrobrew/topk/triton_fast.py > old_topk_fast.py
    python benchmarks/results/hidden/row_stats_ab.py old_rows.py [old_topk_fast.py | - [MODE ...] [DIVERGENCE ...]]

The DIVERGENCEs given (default forward_kl; bf16, V=152064, Ds=3584, Dt=5120) in the MODEs given
("fast", the default, and/or "constant_memory") with the hidden-state row kernels of old_rows.py
swapped in for the tree's, and topk_kl(normalize="full") (D=3584, K=64) with old_topk_fast.py's fast mode (skipped with "-");
three alternating rounds of 5 timed calls each, N = 4096 and 16384, and the relative difference of
loss, dX and dW between the two.
"""
import importlib.util
import statistics
import sys

import torch

import nitrobrew as nb
from nitrobrew import divergences as dv
from nitrobrew.bench.common import time_ms
from nitrobrew.hidden import triton_dispatch as td
from nitrobrew.hidden import triton_rows as rows_new

DEV = torch.device("cuda")
MODES = [m for m in ("fast", "constant_memory") if m in sys.argv[3:]] or ["fast"]
DIVERGENCES = [d for d in dv.DIVERGENCE_IDS if d in sys.argv[3:]] or ["forward_kl"]
V, DS, DT = 152064, 3584, 5120


def load(path: str, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def fwd_bwd(loss_fn, xs, ws):
    def step():
        x = xs.detach().requires_grad_()
        w = ws.detach().requires_grad_()
        loss = loss_fn(x, w)
        loss.backward()
        return loss.detach(), x.grad, w.grad
    return step


def ab(label: str, step, use_old, use_new) -> None:
    outs, times = {}, {"old": [], "new": []}
    for rnd in range(3):
        for name, use in (("old", use_old), ("new", use_new)):
            use()
            if rnd == 0:
                outs[name] = step()
            times[name].append(time_ms(step, DEV, warmup=1, reps=5))
    use_new()
    rel = [float((a.float() - b.float()).norm() / b.float().norm()) for a, b in zip(outs["old"], outs["new"])]
    ratio = statistics.median(times["new"]) / statistics.median(times["old"])
    print(f"{label}: old {' '.join(f'{t:.2f}' for t in times['old'])} ms | new "
          f"{' '.join(f'{t:.2f}' for t in times['new'])} ms | median new/old {ratio:.4f} | loss/dX/dW rel diff "
          f"{' '.join(f'{r:.1e}' for r in rel)}", flush=True)


def hidden(old_rows) -> None:
    g = torch.Generator(device=DEV).manual_seed(0)
    for n in (4096, 16384):
        xs = torch.randn(n, DS, device=DEV, generator=g).bfloat16()
        xt = torch.randn(n, DT, device=DEV, generator=g).bfloat16()
        ws = (torch.randn(V, DS, device=DEV, generator=g) * (3 / DS**0.5)).bfloat16()
        wt = (torch.randn(V, DT, device=DEV, generator=g) * (3 / DT**0.5)).bfloat16()
        for div in DIVERGENCES:
            for mode in MODES:
                step = fwd_bwd(lambda x, w: nb.hidden_loss(x, xt, w, wt, divergence=div, backend="triton", mode=mode),
                               xs, ws)
                ab(f"{div} {mode} N={n}", step, lambda: setattr(td, "tr", old_rows),
                   lambda: setattr(td, "tr", rows_new))
        del xs, xt, ws, wt
        torch.cuda.empty_cache()


def topk_full(old_fast) -> None:
    import nitrobrew.topk.triton_fast as fast_new
    from nitrobrew.bench.topk import make_inputs
    new_fn = fast_new.fast_topk
    for n in (4096, 16384):
        xs, ws, ids, lp, _ = make_inputs(n, V, DS, 64, torch.bfloat16, DEV, 0)
        step = fwd_bwd(lambda x, w: nb.topk_kl(x, w, ids, lp, normalize="full", backend="triton"), xs, ws)
        ab(f"topk_kl full N={n} K=64", step, lambda: setattr(fast_new, "fast_topk", old_fast.fast_topk),
           lambda: setattr(fast_new, "fast_topk", new_fn))
        del xs, ws, ids, lp
        torch.cuda.empty_cache()


if __name__ == "__main__":
    hidden(load(sys.argv[1], "nitrobrew.hidden.old_rows"))
    if len(sys.argv) > 2 and sys.argv[2] != "-":
        topk_full(load(sys.argv[2], "nitrobrew.topk.old_fast"))
