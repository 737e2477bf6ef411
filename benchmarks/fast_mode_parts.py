"""Where the hidden-state fast mode's time goes beyond the 4-GEMM floor, per part, in one process.

For each divergence and N: the floor (the bench's four bare GEMMs, `bench.baselines.gemm_floor`),
the same four GEMMs in the fast mode's own chunk schedule (fp32 logit slabs of the plan's rows,
dX per chunk, dW accumulated per chunk), the fast mode's fwd+bwd, and a torch.profiler trace of
fast-mode steps whose GPU kernels are grouped into parts:

  gemm s / t / dX / dW   cuBLAS kernels under the aten matmul ops, by operand shape
  stats / grad           the Triton row kernels (hidden_stats_kernel, hidden_grad_kernel)
  other kernels          elementwise and reduction kernels (row finishing, scales), casts, copies, fills
  gaps                   the step's CUDA-event time minus the sum of its kernel times (launch and host
                         waits; one stream, so kernels do not overlap)

Beside them, memory-bound references for the row passes: a plain read of both fp32 slabs (what the
statistics pass must read, 8 bytes per logit pair) and a read + bf16 write (the gradient pass's
10 bytes). Then the tries (`--tries`): variants of the schedule run in the same process, A/B
alternating with the default (script-local plan overrides; the library is not changed).

Runs anywhere: on CPU at tiny sizes it shows the parts of the PyTorch path (no Triton row kernels).

    python benchmarks/fast_mode_parts.py                      # GPU: V=152064, Ds=3584, Dt=5120
    python benchmarks/fast_mode_parts.py --tiny               # CPU: V=2048, Ds=64, Dt=96, N=256
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import defaultdict

import torch

import nitrobrew as nb
from nitrobrew.bench import baselines as bl
from nitrobrew.bench.common import time_ms
from nitrobrew.environment import environment

F32 = torch.float32


def sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize()


def alternating(fns: dict, dev, rounds=3, reps=3) -> dict:
    """Medians of each fn, timed in alternating rounds (same-process A/B)."""
    res = defaultdict(list)
    for f in fns.values():
        f()
    for _ in range(rounds):
        for k, f in fns.items():
            res[k].append(time_ms(f, dev, warmup=1, reps=reps))
    return {k: statistics.median(v) for k, v in res.items()}


class Data:
    _heads: dict = {}  # (v, ds, dt) -> (ws, wt): the heads are made once and shared by the cases

    def __init__(self, n, v, ds, dt, dev, dtype):
        g = torch.Generator(device=dev)
        g.manual_seed(0)

        def r(*s, scale=1.0):
            return (torch.randn(*s, generator=g, device=dev, dtype=F32) * scale).to(dtype)

        # logits of a few units (LM-like spreads)
        self.xs = r(n, ds).requires_grad_(True)
        self.xt = r(n, dt)
        key = (v, ds, dt)
        if key not in Data._heads:
            Data._heads.clear()
            Data._heads[key] = (r(v, ds, scale=ds**-0.5 * 2).requires_grad_(True), r(v, dt, scale=dt**-0.5 * 2))
        self.ws, self.wt = Data._heads[key]

    def step(self, div, **kw):
        self.xs.grad = None
        self.ws.grad = None
        loss = getattr(nb, div)(self.xs, self.xt, self.ws, self.wt, **kw)
        loss.backward()


def row_chunk(n, v, ds, dtype, budget=None) -> int:
    from nitrobrew.hidden.triton_function import make_plan  # the library's own plan, read-only

    return make_plan(n, v, ds, dtype, None, None, budget, "mean").row_chunk


def gemms_in_schedule(d: Data, chunk: int, dw_every: int = 1):
    """The fast mode's four GEMMs alone, in its chunk schedule (fp32 slabs, bf16 G, dW per chunk or per
    `dw_every` chunks of G side by side)."""
    xs, xt, ws, wt = d.xs.detach(), d.xt, d.ws.detach(), d.wt
    n, v = xs.shape[0], ws.shape[0]
    g_rows = min(chunk * dw_every, n)
    G = torch.randn(g_rows, v, device=xs.device, dtype=xs.dtype)
    dx = torch.empty_like(xs)
    dw = torch.empty_like(ws)

    def run():
        pending = 0
        first = True
        for r0 in range(0, n, chunk):
            r1 = min(n, r0 + chunk)
            s = mm_f32(xs[r0:r1], ws.t())
            t = mm_f32(xt[r0:r1], wt.t())
            g = G[pending * chunk : pending * chunk + (r1 - r0)]
            torch.mm(g, ws, out=dx[r0:r1])
            pending += 1
            if pending == dw_every or r1 == n:
                rows = slice(r1 - (pending - 1) * chunk - (r1 - r0), r1)
                gg = G[: (pending - 1) * chunk + (r1 - r0)]
                torch.mm(gg.t(), xs[rows], out=dw) if first else dw.addmm_(gg.t(), xs[rows])
                first, pending = False, 0
            del s, t

    return run


def mm_f32(a, b):
    if a.is_cuda and a.dtype != F32:
        return torch.mm(a, b, out_dtype=F32)
    return (a.float() @ b.float()) if a.dtype != F32 else a @ b


GEMM_OPS = ("aten::mm", "aten::addmm", "aten::addmm_")


def _dev_time(e) -> float:
    for name in ("device_time_total", "cuda_time_total", "self_device_time_total"):
        if hasattr(e, name):
            return float(getattr(e, name))
    return 0.0


def profile_parts(step, dev, shapes, steps=2) -> dict:
    """GPU kernel time per part (ms per step) from torch.profiler, plus the top 'other' kernels."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    step()
    sync(dev)
    with profile(activities=acts, record_shapes=True) as prof:
        for _ in range(steps):
            step()
        sync(dev)
    events = prof.events()
    parts = defaultdict(float)
    other = defaultdict(float)
    if dev.type == "cuda":
        kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
        if kernels:  # first kernel start to last kernel end: the device's busy span of the steps
            span = max(e.time_range.end for e in kernels) - min(e.time_range.start for e in kernels)
            parts["span (first kernel to last)"] = span
        for e in kernels:
            us = e.time_range.elapsed_us()
            name = e.name
            if "hidden_stats_kernel" in name:
                parts["stats (Triton)"] += us
            elif "hidden_grad_kernel" in name:
                parts["grad (Triton)"] += us
            elif any(k in name.lower() for k in ("gemm", "nvjet", "cutlass", "xmma", "sm90_", "sm80_", "cublas")):
                parts["gemm (all)"] += us
            else:
                key = name[:90]
                other[key] += us
                parts["other kernels"] += us
    # GEMMs by operand shape, from the aten ops that launched them (leaf matmul ops only)
    for e in events:
        if e.device_type != torch.autograd.DeviceType.CPU or e.name not in GEMM_OPS:
            continue
        parent = e.cpu_parent
        if parent is not None and parent.name in GEMM_OPS:
            continue
        key = shape_key(e.name, e.input_shapes, shapes)
        t = _dev_time(e) if dev.type == "cuda" else e.cpu_time_total
        parts[f"gemm {key}"] += t
    return {k: v / steps / 1e3 for k, v in parts.items()}, {k: v / steps / 1e3 for k, v in other.items()}


def shape_key(name, input_shapes, shapes) -> str:
    """Which of the four products a leaf matmul op is, from its operands: mm(a, b[, out]) and
    addmm(self, a, b) (an out= tensor comes last and is not an operand)."""
    n_ds, n_dt, v = shapes
    mats = [tuple(s) for s in (input_shapes or []) if isinstance(s, (list, tuple)) and len(s) == 2]
    ops = mats[1:3] if name.startswith("aten::addmm") else mats[0:2]
    if len(ops) < 2:
        return "?"
    a, b = ops
    if a[1] == v:
        return "dX = G ws"
    if a[0] == v:
        return "dW += G^T xs"
    if a[1] == n_ds:
        return "s = xs ws^T"
    if a[1] == n_dt:
        return "t = xt wt^T"
    return f"{a}x{b}"


def bandwidth_refs(n_rows, v, dev) -> dict:
    """ms to read two fp32 [rows, V] slabs (row sums) and to read them and write a bf16 slab."""
    z = torch.randn(n_rows, v, device=dev, dtype=F32)
    t = torch.randn(n_rows, v, device=dev, dtype=F32)
    gb = torch.empty(n_rows, v, device=dev, dtype=torch.bfloat16)

    def read():
        z.sum(1)
        t.sum(1)

    def read_write():
        torch.sub(z, t, out=gb)  # reads 8 bytes, writes 2 per pair

    out = {
        "read 8 B/pair (row sums)": time_ms(read, dev, 2, 5),
        "read 8 + write 2 B/pair": time_ms(read_write, dev, 2, 5),
    }
    del z, t, gb
    return out


def run_case(div, n, v, ds, dt, dev, dtype, tries: bool, reps: int):
    d = Data(n, v, ds, dt, dev, dtype)
    chunk = row_chunk(n, v, ds, dtype)
    kw = dict(backend="triton") if dev.type == "cuda" else {}
    fast = lambda: d.step(div, **kw)  # noqa: E731
    g_floor = torch.randn(min(n, bl.floor_chunk_rows(n, v, 2, dev)), v, device=dev, dtype=dtype)
    floor = lambda: bl.gemm_floor(d.xs.detach(), d.xt, d.ws.detach(), d.wt, g_floor)  # noqa: E731
    sched = gemms_in_schedule(d, chunk)
    fns = {"floor": floor, "gemms in the fast schedule": sched, "fast fwd+bwd": fast}
    if tries:
        big = 1024 * 8 * v  # 1024-row slabs (over the default 896 MiB budget)
        fns["try: 1024-row chunks"] = lambda: d.step(div, memory_budget=big, **kw)
        fns["try: gemms, dW every 2 chunks"] = gemms_in_schedule(d, chunk, dw_every=2)
    ms = alternating(fns, dev, rounds=3, reps=reps)
    del g_floor
    parts, other = profile_parts(fast, dev, (ds, dt, v))
    print(f"\n### {div}, N={n} (row chunk {chunk}, {-(-n // chunk)} chunks)\n")
    print("| what | ms | x floor |")
    print("|---|---|---|")
    for k, t in ms.items():
        print(f"| {k} | {t:.2f} | {t / ms['floor']:.3f} |")
    span = parts.pop("span (first kernel to last)", None)
    total_k = sum(t for k, t in parts.items() if not k.startswith("gemm ") or k == "gemm (all)")
    print("\nGPU kernel time per step, by part (torch.profiler):\n")
    print("| part | ms | share of fast | x floor |")
    print("|---|---|---|---|")
    for k in sorted(parts, key=lambda k: -parts[k]):
        print(f"| {k} | {parts[k]:.3f} | {parts[k] / ms['fast fwd+bwd']:.3f} | {parts[k] / ms['floor']:.3f} |")
    gap = ms["fast fwd+bwd"] - total_k
    print(f"| gaps (step - kernels) | {gap:.3f} | {gap / ms['fast fwd+bwd']:.3f} | {gap / ms['floor']:.3f} |")
    if span is not None:
        idle = span - total_k
        print(
            f"\nprofiled steps: kernels {total_k:.3f} ms of a {span:.3f} ms busy span per step (idle between kernels "
            f"{idle:.3f} ms); the timed step {ms['fast fwd+bwd']:.3f} ms"
        )
    if other:
        print(
            "\nlargest 'other' kernels (ms per step): "
            + "; ".join(f"{k} {t:.3f}" for k, t in sorted(other.items(), key=lambda kv: -kv[1])[:8])
        )
    if dev.type == "cuda":
        bw = bandwidth_refs(chunk, v, dev)
        n_chunks = -(-n // chunk)
        print(
            "\nrow-pass references per step (x chunks): "
            + "; ".join(f"{k} {t * n_chunks:.3f} ms" for k, t in bw.items())
        )
    sys.stdout.flush()
    del d
    if dev.type == "cuda":
        torch.cuda.empty_cache()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ns", type=int, nargs="+", default=[4096, 8192, 16384])
    ap.add_argument("--divs", nargs="+", default=["forward_kl", "jsd"])
    ap.add_argument("--tiny", action="store_true", help="V=2048, Ds=64, Dt=96, N=256 (CPU)")
    ap.add_argument("--tries", action="store_true", help="also time the variants (same process, alternating)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--budget-s", type=float, default=1e9, help="skip the remaining cases past this")
    args = ap.parse_args()
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if args.tiny:
        v, ds, dt, ns = 2048, 64, 96, [256]
    else:
        v, ds, dt, ns = 152064, 3584, 5120, args.ns
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    env = environment()
    name = torch.cuda.get_device_name() if dev.type == "cuda" else "cpu"
    print(f"# fast-mode parts, {name}\n\n" + ", ".join(f"{k} {val}" for k, val in env.items()))
    print(f"V={v}, Ds={ds}, Dt={dt}, {dtype}, fwd+bwd (gradients to xs and ws), medians of alternating rounds")
    t0 = time.time()
    for n in ns:
        for div in args.divs:
            if time.time() - t0 > args.budget_s:
                print(f"\n{div} N={n}: skipped (time budget)")
                continue
            run_case(div, n, v, ds, dt, dev, dtype, args.tries and div == args.divs[0], args.reps)
    print(f"\nwall {time.time() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
