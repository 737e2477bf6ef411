"""normalize="topk" kernels on the GPU: correctness against float64, component times over tile settings,
id counts, a case with 8 ids in every row's top-k, and a profile of one default fwd+bwd.

Usage: OUT=dir python support_sweep.py (writes dir/support_sweep.csv). Forward rows: the logits by
column blocks (tile r x kb x d, warps) plus the row kernel; "deterministic": the per-row forward
(torch.use_deterministic_algorithms(True)). dX rows: tile r x kb x d, warps.
"""
import csv, os, sys, time, statistics, traceback
import torch
from nitrobrew.topk import topk_kl, reference_topk_loss
from nitrobrew.topk import triton_support as ts
from nitrobrew.bench.common import time_ms
from nitrobrew.bench.topk import make_inputs, copy_bandwidth

dev = torch.device("cuda")
OUT = os.environ.get("OUT", "/tmp")
rows = []
def rec(**kw):
    rows.append(kw); print(kw, flush=True)

def rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))

# ---- correctness (bf16, odd sizes, hot ids, padding, ignored rows) ----
def check():
    g = torch.Generator(device=dev).manual_seed(1)
    N, V, D, K = 1000, 30011, 1000, 100
    xs = torch.randn(N, D, device=dev, generator=g).bfloat16()
    ws = (torch.randn(V, D, device=dev, generator=g) * 3 / D**0.5).bfloat16()
    bs = torch.randn(V, device=dev, generator=g).bfloat16()
    t = torch.randn(N, V, device=dev, generator=g) * 3
    lp, ids = torch.log_softmax(t, -1).topk(K, -1)
    ids[:, :4] = torch.arange(4, device=dev)  # four ids in every row (hot dW rows); duplicates of none
    lp[5, 50:] = float("-inf"); lp[7] = float("-inf")
    labels = torch.randint(0, V, (N,), device=dev, generator=g); labels[::17] = -100
    for _ in (0,):
        for case in (dict(), dict(divergence="jsd", beta=0.3, temperature=2.0), dict(divergence="reverse_kl", reduction="none"),
                     dict(divergence="tvd", bias=True)):
            case = dict(case); bias = case.pop("bias", False)
            x = xs.clone().requires_grad_(); w = ws.clone().requires_grad_(); b = bs.clone().requires_grad_()
            kw = dict(normalize="topk", labels=labels, bs=b if bias else None, **case)
            out = topk_kl(x, w, ids, lp, backend="triton", **kw)
            x64 = xs.double().requires_grad_(); w64 = ws.double().requires_grad_(); b64 = bs.double().requires_grad_()
            kw64 = dict(kw, bs=b64 if bias else None); param = kw64.pop("beta", 0.0)
            ref = reference_topk_loss(x64, w64, ids, lp, param=param, **kw64)
            up = torch.randn_like(ref) if ref.dim() else torch.ones((), dtype=ref.dtype, device=dev)
            ins, ins64 = ([x, w, b], [x64, w64, b64]) if bias else ([x, w], [x64, w64])
            gr = torch.autograd.grad(out, ins, up.float())
            gr64 = torch.autograd.grad(ref, ins64, up)
            errs = [rel(out.detach(), ref.detach())] + [rel(a, c) for a, c in zip(gr, gr64)]
            rec(kind="check", case=str(case) + (" bias" if bias else ""), loss_err=errs[0],
                grad_errs=" ".join(f"{e:.2e}" for e in errs[1:]), ok=errs[0] < 1e-4 and max(errs[1:]) < 2e-2)
    ts.TILES = ts.SupportTiles()

def ev(fn, reps=15):
    return time_ms(fn, dev, warmup=3, reps=reps)

# (rows, ids, columns, warps)
FWD = [(2, 32, 64, 2), (1, 64, 64, 2), (4, 16, 64, 4), (2, 64, 64, 4)]
DX = [(16, 8, 64, 4), (32, 8, 64, 8), (16, 4, 64, 4), (16, 8, 128, 8)]
# (block_r, j, block_d, d_steps, warps)
DW = [(8, 4, 64, 7, 1), (16, 4, 64, 4, 2), (16, 4, 64, 7, 2), (8, 4, 64, 4, 1), (8, 4, 64, 14, 1)]

def sweep(N, K, hot=False):
    V, D = 152064, 3584
    xs, ws, ids, lp, labels = make_inputs(N, V, D, K, torch.bfloat16, dev, 0)
    if hot:
        ids = ids.clone(); ids[:, :8] = torch.arange(8, device=dev)  # 8 ids in every row's top-k
    mask = torch.ones(N, device=dev)
    from nitrobrew.topk.rowmath import TopKConfig
    cfg = TopKConfig("forward_kl", 0.0, "topk", False, 1.0, 1.0, 0.0)
    tag = dict(N=N, K=K, hot=hot)
    scale = torch.full((1,), 1.0 / N, device=dev).as_strided((1,), (0,))
    for (r, kb, bd, wp) in FWD:
        ts.TILES = ts.SupportTiles(logit_block_r=r, logit_block_kb=kb, logit_block_d=bd, logit_warps=wp)
        name = f"{r}x{kb}x{bd}w{wp}"
        try:
            rec(kind="fwd", cfg=name, ms=ev(lambda: ts.support_forward(xs, ws, None, ids, lp, mask, cfg)), **tag)
        except Exception as e:
            rec(kind="fwd", cfg=name, err=repr(e)[:200], **tag)
    ts.TILES = ts.SupportTiles()
    torch.use_deterministic_algorithms(True)
    rec(kind="fwd", cfg="deterministic", ms=ev(lambda: ts.support_forward(xs, ws, None, ids, lp, mask, cfg)), **tag)
    torch.use_deterministic_algorithms(False)
    ts.TILES = ts.SupportTiles()
    kd, coef, key, counts = ts.support_forward(xs, ws, None, ids, lp, mask, cfg)
    ref = None
    for (r, kb, bd, wp) in DX:
        ts.TILES = ts.SupportTiles(dx_block_r=r, dx_block_kb=kb, dx_block_d=bd, dx_warps=wp)
        name = f"{r}x{kb}x{bd}w{wp}"
        try:
            dx = ts.support_dx(ws, key, coef, scale, xs.dtype)
            ref = dx.float() if ref is None else ref
            rec(kind="dx", cfg=name, ms=ev(lambda: ts.support_dx(ws, key, coef, scale, xs.dtype)),
                agree=rel(dx, ref), **tag)
        except Exception as e:
            rec(kind="dx", cfg=name, err=repr(e)[:200], **tag)
    rec(kind="sort", cfg="torch.sort", ms=ev(lambda: torch.sort(key.view(-1))), **tag)
    rec(kind="sort", cfg="counting", ms=ev(lambda: ts.sorted_entries(key, coef, scale, counts, V)), **tag)
    hist = torch.bincount(key.view(-1).long(), minlength=V + 1)[:V]
    rec(kind="counts", max=int(hist.max()), mean=float(hist.float().mean()), over64=int((hist > 64).sum()),
        p99=float(hist.float().quantile(0.99)), **tag)
    ref = None
    for (br, j, bd, st, wp) in DW:
        ts.TILES = ts.SupportTiles(dw_block_r=br, dw_j=j, dw_block_d=bd, dw_d_steps=st, dw_warps=wp)
        name = f"r{br}j{j}d{bd}x{st}w{wp}"
        try:
            dw, _ = ts.support_dw(xs, key, coef, scale, V, None, counts)
            ref = dw.float() if ref is None else ref
            rec(kind="dw", cfg=name, ms=ev(lambda: ts.support_dw(xs, key, coef, scale, V, None, counts)), agree=rel(dw, ref), **tag)
        except Exception as e:
            rec(kind="dw", cfg=name, err=repr(e)[:200], **tag)
    ts.TILES = ts.SupportTiles()
    torch.use_deterministic_algorithms(True)  # a stable sort instead of the counting sort
    rec(kind="dw", cfg="deterministic", ms=ev(lambda: ts.support_dw(xs, key, coef, scale, V, None, None)), **tag)
    torch.use_deterministic_algorithms(False)
    def step(norm):
        x = xs.detach().requires_grad_(); w = ws.detach().requires_grad_()
        topk_kl(x, w, ids, lp, normalize=norm, backend="triton").backward()
    for norm in ("topk", "full"):
        if norm == "full" and hot:
            continue
        rec(kind="fwd+bwd", norm=norm, ms=ev(lambda: step(norm), reps=9), **tag)
    del xs, ws, ids, lp
    torch.cuda.empty_cache()

try:
    check()
except Exception:
    traceback.print_exc()
bw = copy_bandwidth(dev)
rec(kind="copy", GBps=bw)
for N, K, hot in ((4096, 64, False), (4096, 256, False), (16384, 64, False), (16384, 64, True)):
    try:
        sweep(N, K, hot)
    except Exception:
        traceback.print_exc()
keys = sorted({k for r in rows for k in r})
with open(os.path.join(OUT, "support_sweep.csv"), "w", newline="") as f:
    w = csv.DictWriter(f, fieldnames=keys); w.writeheader(); [w.writerow(r) for r in rows]

# host time and GPU gaps of one default fwd+bwd at N=4096
import cProfile, pstats, io
from torch.profiler import profile, ProfilerActivity
xs, ws, ids, lp, labels = make_inputs(4096, 152064, 3584, 64, torch.bfloat16, dev, 0)
def step():
    x = xs.detach().requires_grad_(); w = ws.detach().requires_grad_()
    topk_kl(x, w, ids, lp, normalize="topk", backend="triton").backward()
for _ in range(3): step()
torch.cuda.synchronize()
hs = []
for _ in range(20):
    torch.cuda.synchronize(); t0 = time.perf_counter(); step(); hs.append((time.perf_counter() - t0) * 1e3)
print("host enqueue ms (median of 20):", statistics.median(hs), "wall", ev(step))
with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
    for _ in range(5): step()
    torch.cuda.synchronize()
print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25))
pr = cProfile.Profile(); pr.enable()
for _ in range(20): step()
torch.cuda.synchronize(); pr.disable()
st = io.StringIO(); pstats.Stats(pr, stream=st).sort_stats("tottime").print_stats(25); print(st.getvalue())
