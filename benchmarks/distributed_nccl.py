"""Vocab-parallel hidden-state losses over NCCL: correctness, speed, bytes communicated.

One command on a 2-GPU machine (any P works; P GPUs, one process each):

    torchrun --nproc-per-node 2 benchmarks/distributed_nccl.py --out $OUT

CPU check of the script itself (gloo, small sizes):

    torchrun --nproc-per-node 2 benchmarks/distributed_nccl.py --backend gloo --device cpu --small --out /tmp/nb

For each token count N and divergence, with the student/teacher heads split by vocabulary over
the P ranks (uneven blocks when V % P != 0), fwd+bwd (gradients to xs and the student head):

  single GPU torch      nitrobrew over the whole vocabulary on one GPU, backend="torch" (the
                        PyTorch chunked path, the one the vocab-parallel loss wraps): the baseline
  single GPU auto       the same with backend="auto" (Triton on CUDA when available), for context
  vocab-parallel        nitrobrew with process_group= (each rank its block; PyTorch path)
  gathered logits       the naive vocab-parallel loss: each rank's [N, V/P] logits (input dtype,
                        upcast to fp32) all-gathered to [N, V] and the divergence taken there with
                        autograd (O(N V) communication and memory), up to --naive-max-tokens
  comm only             the collectives of one vocab-parallel call alone (same sizes), to show
                        how much of the vocab-parallel time is communication

Per-rank phases of the vocab-parallel call (nitrobrew.parallel.time_phases, CUDA events on each
rank, median over --reps): local stats (logit GEMMs + row-statistics kernels), exchange (the
forward's collectives, waiting for the slower rank included), gradient pass (gradient slabs, dX and
dW GEMMs), dX all-reduce, and the whole step.

Columns: ms = median fwd+bwd time (CUDA events after warm-up; the max over ranks); peak MiB =
peak allocated memory during one fwd+bwd above what was allocated before (max over ranks; on a CPU
the live tensor bytes, nitrobrew.core.memory.TensorMemoryTracker);
speedup = single GPU torch ms / this ms (ideal for vocab-parallel: P); vs auto = single GPU auto
ms / this ms (the single-GPU Triton path: the target for vocab-parallel is >= 0.9 P); rel err = the largest of
|L - L_1| / |L_1|, ||dX - dX_1|| / ||dX_1||, ||dW_r - dW_1[r]|| / ||dW_1[r]|| against the
single-GPU torch path on the same inputs (bf16 gradients: ~4e-3 is the rounding of the output);
bytes/call = payload bytes one rank hands to collectives in one fwd+bwd (nitrobrew.parallel.
count_comm), checked against the formula (nitrobrew.hidden.vocab_parallel.comm_bytes); bytes/token = that / N.

Memory per rank (the second table): each rank's peak beside one GPU's Triton path (single GPU auto) on
the same inputs, and the buffers that make them up, from the plans both paths use
(nitrobrew.hidden.triton_function.make_plan): one pair of fp32 logit slabs (rows of a block x the
vocabulary held, 8 bytes per entry), dW (the head's rows x Ds, in the head's dtype unless fp32 fits the
budget), dX (one GPU: the input dtype; a rank: fp32, the partial sums the ranks all-reduce) and the
student rows with ignored rows zeroed (a copy of xs). Target: every rank at or below one GPU.

NVLink multicast (NVLS) is never used: NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1 and
NVSHMEM_DISABLE_NVLS=1 are set before torch is imported, and the script refuses to run if the
environment sets any of them otherwise.
"""

from __future__ import annotations

import os
import sys

_NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
for _k, _v in _NO_MULTICAST.items():
    if os.environ.get(_k, _v) != _v:
        sys.exit(
            f"refusing to run: {_k}={os.environ[_k]!r} would allow NVLink multicast; this benchmark needs {_k}={_v}"
        )
    os.environ[_k] = _v

import argparse  # noqa: E402
import gc  # noqa: E402
import math  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # run from a checkout

import nitrobrew as nb  # noqa: E402
from nitrobrew import divergences as dv  # noqa: E402
from nitrobrew.bench.common import Row, environment, is_oom, rel_err, write_csv  # noqa: E402
from nitrobrew.core.memory import peak_mib  # noqa: E402
from nitrobrew.hidden.vocab_parallel import comm_bytes  # noqa: E402
from nitrobrew.parallel import count_comm, time_phases  # noqa: E402
from nitrobrew.parallel.comm import _record as record_bytes  # noqa: E402

MAX_REL_ERR = 2e-2  # vocab-parallel vs single GPU (bf16 gradients round at ~4e-3)
PHASES = ("local stats", "exchange", "gradient pass", "dX all-reduce")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="directory for distributed_nccl.csv and distributed_nccl.md")
    p.add_argument("--tokens", default="4096,8192,16384", help="comma-separated N (rows)")
    p.add_argument("--vocab", type=int, default=152064)
    p.add_argument("--ds", type=int, default=3584, help="student hidden size")
    p.add_argument("--dt", type=int, default=5120, help="teacher hidden size")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--divergences", default="forward_kl,jsd", help="comma-separated; jsd takes the second pass")
    p.add_argument("--ce-weight", type=float, default=0.0, help="adds the fused hard-label CE term")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--naive-max-tokens", type=int, default=8192, help="largest N for the gathered-logits baseline")
    p.add_argument("--no-single-auto", action="store_true", help="skip the single-GPU backend='auto' row")
    p.add_argument("--backend", default="nccl", choices=["nccl", "gloo"])
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--small", action="store_true", help="tiny sizes for a CPU check of the script")
    args = p.parse_args(argv)
    if args.small:
        args.tokens, args.vocab, args.ds, args.dt, args.dtype = "64,256", 1001, 64, 96, "float32"
        args.warmup, args.reps = 1, 2
    return args


# ----------------------------------------------------------------------------------------------
# the naive vocab-parallel baseline: all-gather the logits


class _CopyToGroup(torch.autograd.Function):
    """Identity forward; backward all-reduces (the input feeds every rank's block)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        g = g.contiguous()
        record_bytes("bwd_dx", g)
        dist.all_reduce(g, group=ctx.group)
        return g, None


class _GatherVocab(torch.autograd.Function):
    """[N, V_r] blocks -> [N, V] on every rank; backward keeps this rank's columns."""

    @staticmethod
    def forward(ctx, x, sizes, rank, group):
        ctx.sizes, ctx.rank = sizes, rank
        width = max(sizes)  # blocks padded to one width (gloo gathers equal sizes only)
        padded = torch.nn.functional.pad(x, (0, width - x.shape[1])).contiguous()
        parts = [torch.empty_like(padded) for _ in sizes]
        record_bytes("gather_logits", padded)
        dist.all_gather(parts, padded, group=group)
        return torch.cat([p[:, :s] for p, s in zip(parts, sizes)], dim=1)

    @staticmethod
    def backward(ctx, g):
        lo = sum(ctx.sizes[: ctx.rank])
        return g[:, lo : lo + ctx.sizes[ctx.rank]], None, None, None


def gathered_logits_loss(xs, xt, ws, wt, labels, sizes, rank, group, name, param, T, ce_weight):
    x = _CopyToGroup.apply(xs, group)
    z = _GatherVocab.apply((x @ ws.t()).float(), sizes, rank, group)
    with torch.no_grad():
        t = _GatherVocab.apply((xt @ wt.t()).float(), sizes, rank, group)
    rows = dv.divergence_rows(name, t / T, z / T, param)
    if ce_weight:
        rows = rows + ce_weight * torch.nn.functional.cross_entropy(z, labels, reduction="none")
    return rows.mean()


# ----------------------------------------------------------------------------------------------


def timed(fn, device, warmup, reps):
    """Median ms of fn() (CUDA events / perf_counter), all ranks starting together; max over ranks."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        _barrier(device)
        if device.type == "cuda":
            torch.cuda.synchronize()
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            torch.cuda.synchronize()
            times.append(a.elapsed_time(b))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    times.sort()
    return reduce_max(times[len(times) // 2], device)


def peak(fn, device):
    """Peak MiB above the memory allocated before the call, per rank (CUDA: the allocator's statistics;
    CPU: the live tensor bytes)."""
    mine = torch.tensor([peak_mib(fn, device)], dtype=torch.float64, device=device)
    parts = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, mine)
    return [float(p.item()) for p in parts]


def predicted_mib(n, vocab, ds, dtype, world, memory_budget=None):
    """The buffers of one fwd+bwd's peak (MiB) for one GPU's fast Triton plan and for a rank of the
    vocab-parallel one (vocab blocks of ceil(V / world)); xs has ignored rows (a masked copy)."""
    from nitrobrew.hidden.triton_function import make_plan

    item = torch.tensor([], dtype=dtype).element_size()
    out = {}
    for who, v, dx_bytes in (("one GPU", vocab, item), ("per rank", -(-vocab // world), 4)):
        plan = make_plan(n, v, ds, dtype, "fast", None, memory_budget, "mean")
        parts = {
            "slabs": min(plan.row_chunk, n) * v * 8,
            "dW": v * ds * (4 if plan.dw_fp32 else item),
            "dX": n * ds * dx_bytes,
            "masked rows": n * ds * item,
        }
        out[who] = {k: b / 2**20 for k, b in parts.items()}
        out[who]["total"] = sum(out[who].values())
    return out


def _barrier(device):
    if device.type == "cuda":
        dist.barrier(device_ids=[device.index])
    else:
        dist.barrier()


def reduce_max(value, device):
    t = torch.tensor([float(value)], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def main(argv=None) -> int:
    args = parse_args(argv)
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if args.device == "cuda":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    if device.type == "cuda":
        dist.init_process_group(args.backend, device_id=device)
    else:
        dist.init_process_group(args.backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.group.WORLD
    torch.backends.cuda.matmul.allow_tf32 = False
    dtype = getattr(torch, args.dtype)
    V, Ds, Dt, T = args.vocab, args.ds, args.dt, args.temperature
    sizes = [V // world + (1 if r < V % world else 0) for r in range(world)]
    lo = sum(sizes[:rank])
    block = slice(lo, lo + sizes[rank])
    tokens = [int(n) for n in args.tokens.split(",")]
    divs = args.divergences.split(",")
    env = environment() if rank == 0 else {}
    if rank == 0:
        env.update(
            world=str(world),
            backend=args.backend,
            nccl=_nccl_version(),
            dtype=args.dtype,
            vocab=str(V),
            ds=str(Ds),
            dt=str(Dt),
            shards=str(sizes),
            **{k: os.environ[k] for k in _NO_MULTICAST},
        )
        print(f"# vocab-parallel benchmark: {env}", flush=True)

    gen = torch.Generator(device=device).manual_seed(1234)  # same inputs on every rank
    spread = 6.0
    ws_full = (torch.randn(V, Ds, device=device, generator=gen) * (spread / math.sqrt(Ds))).to(dtype)
    wt_full = (torch.randn(V, Dt, device=device, generator=gen) * (spread / math.sqrt(Dt))).to(dtype)
    ws_full.requires_grad_()
    ws_loc = ws_full.detach()[block].clone().requires_grad_()
    wt_loc = wt_full[block].clone()

    rows, failures, phase_rows = [], [], []
    for N in tokens:
        xs = torch.randn(N, Ds, device=device, generator=gen).to(dtype).requires_grad_()
        xt = torch.randn(N, Dt, device=device, generator=gen).to(dtype)
        labels = torch.randint(0, V, (N,), device=device, generator=gen)
        labels[::7] = -100
        for div in divs:
            name, param = dv.canonical(div, 0.5 if div == "jsd" else 0.1)
            opts = dict(divergence=div, labels=labels, temperature=T, ce_weight=args.ce_weight)
            size = {"N": N, "world": world, "div": div}
            methods = {
                "single GPU torch": lambda: nb.hidden_loss(xs, xt, ws_full, wt_full, backend="torch", **opts),
                "vocab-parallel": lambda: nb.hidden_loss(xs, xt, ws_loc, wt_loc, process_group=group, **opts),
            }
            if not args.no_single_auto and device.type == "cuda":
                methods["single GPU auto"] = lambda: nb.hidden_loss(xs, xt, ws_full, wt_full, backend="auto", **opts)
            if N <= args.naive_max_tokens:
                keep = labels != -100
                methods["gathered logits"] = lambda: gathered_logits_loss(
                    xs[keep], xt[keep], ws_loc, wt_loc, labels[keep], sizes, rank, group, name, param, T, args.ce_weight
                )

            def leaves(m):
                return [xs, ws_full] if m.startswith("single") else [xs, ws_loc]

            # correctness against the single-GPU torch path, and the bytes of one call
            ref = None
            results = {}
            for m, f in methods.items():
                try:
                    with count_comm() as c:
                        loss = f()
                        grads = torch.autograd.grad(loss, leaves(m))
                    g_w = grads[1] if not m.startswith("single") else grads[1][block]
                    results[m] = (loss.detach().float(), grads[0], g_w, c.bytes)
                    del loss, grads
                except Exception as e:  # noqa: BLE001 - reported in the table
                    results[m] = e
                    if not is_oom(e):
                        failures.append(f"N={N} {div} {m}: {traceback.format_exc()}")
                    if device.type == "cuda":
                        torch.cuda.empty_cache()
            ref = results["single GPU torch"]
            if isinstance(ref, Exception):
                ref = None
            pred = comm_bytes(N, Ds, divergence=div, with_ce=args.ce_weight != 0, temperature=T, world=world)
            for m, f in methods.items():
                res = results[m]
                if isinstance(res, Exception):
                    rows.append(Row("vocab-parallel", m, dict(size), note="OOM" if is_oom(res) else "error"))
                    continue

                def step(f=f, m=m):
                    loss = f()
                    torch.autograd.grad(loss, leaves(m))

                try:
                    ms = timed(step, device, args.warmup, args.reps)
                    per_rank = peak(step, device)
                except Exception as e:  # noqa: BLE001
                    if not is_oom(e):
                        failures.append(f"N={N} {div} {m} timing: {traceback.format_exc()}")
                    rows.append(Row("vocab-parallel", m, dict(size), note="OOM" if is_oom(e) else "error"))
                    continue
                err = (
                    None
                    if ref is None
                    else max(rel_err(res[0], ref[0]), rel_err(res[1], ref[1]), rel_err(res[2], ref[2]))
                )
                spread_loss = reduce_max(res[0].item(), device) + reduce_max(-res[0].item(), device)
                extra = {"bytes_per_call": float(res[3]), "bytes_per_token": res[3] / N}
                extra.update({f"peak_mib_rank{r}": v for r, v in enumerate(per_rank)})
                note = ""
                if m == "vocab-parallel":
                    extra["bytes_formula"] = float(pred["total"])
                    if res[3] != pred["total"]:
                        note = f"bytes {res[3]} != formula {pred['total']}"
                        failures.append(f"N={N} {div}: {note}")
                    if spread_loss != 0.0:
                        failures.append(f"N={N} {div}: the loss differs across ranks by {spread_loss}")
                    if err is not None and err > MAX_REL_ERR:
                        note = f"rel err {err:.1e} > {MAX_REL_ERR}"
                        failures.append(f"N={N} {div}: vocab-parallel {note}")
                rows.append(
                    Row(
                        "vocab-parallel",
                        m,
                        dict(size),
                        ms=ms,
                        peak_mib=max(per_rank),
                        rel_err=err,
                        note=note,
                        extra=extra,
                    )
                )
                if m == "vocab-parallel":
                    for r, ph in enumerate(phase_ms(step, device, args.reps)):
                        phase_rows.append((N, div, r, ph))
            comm_ms = timed(
                lambda: _replay_collectives(N, Ds, name, args.ce_weight != 0, T, group, device),
                device,
                args.warmup,
                args.reps,
            )
            rows.append(
                Row(
                    "vocab-parallel",
                    "comm only",
                    dict(size),
                    ms=comm_ms,
                    extra={"bytes_per_call": float(pred["total"]), "bytes_per_token": pred["total"] / N},
                )
            )
            base = next((r.ms for r in rows[::-1] if r.method == "single GPU torch" and r.size == size), None)
            auto = next((r.ms for r in rows[::-1] if r.method == "single GPU auto" and r.size == size), None)
            for r in rows:
                if r.size == size and r.ms and base and r.method != "comm only":
                    r.extra["speedup"] = base / r.ms
                if r.size == size and r.ms and auto and r.method != "comm only":
                    r.extra["vs_auto"] = auto / r.ms
            if rank == 0:
                print(f"N={N} {div} done", flush=True)
        del xs, xt, labels
        gc.collect()

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        text = _table(rows)
        phases = _phase_table(phase_rows)
        memory = _memory_table(rows, args, dtype, world)
        print(text + "\n\n" + memory + "\n\n" + phases)
        write_csv(os.path.join(args.out, "distributed_nccl.csv"), rows, env)
        _markdown(os.path.join(args.out, "distributed_nccl.md"), text, env, args, failures, phases, memory)
        if failures:
            print("FAILURES:\n" + "\n".join(failures), flush=True)
    ok = reduce_max(len(failures), device) == 0
    _barrier(device)
    dist.destroy_process_group()
    return 0 if ok else 1


def phase_ms(step, device, reps):
    """Per-rank median ms of each phase (and of the whole step) over reps: [world][len(PHASES) + 1]."""
    runs = []
    for _ in range(reps):
        _barrier(device)
        if device.type == "cuda":
            torch.cuda.synchronize()
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
        t0 = time.perf_counter()
        with time_phases() as pt:
            step()
        if device.type == "cuda":
            b.record()
            torch.cuda.synchronize()
            whole = a.elapsed_time(b)
        else:
            whole = (time.perf_counter() - t0) * 1e3
        ms = pt.ms()
        runs.append([ms.get(n, 0.0) for n in PHASES] + [whole])
    med = [sorted(col)[len(col) // 2] for col in zip(*runs)]
    mine = torch.tensor(med, dtype=torch.float64, device=device)
    parts = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, mine)
    return [p.tolist() for p in parts]


def _phase_table(phase_rows):
    head = ["N", "div", "rank", *PHASES, "sum of phases", "step"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for N, div, r, ph in phase_rows:
        vals = [f"{v:.2f}" for v in ph[:-1]] + [f"{sum(ph[:-1]):.2f}", f"{ph[-1]:.2f}"]
        lines.append("| " + " | ".join([str(N), div, str(r), *vals]) + " |")
    return "\n".join(lines)


def _memory_table(rows, args, dtype, world):
    """Each rank's peak beside one GPU's Triton path, with the predicted buffers of both."""
    head = ["N", "div", "one GPU (auto)", *(f"rank {r}" for r in range(world)), "max rank / one GPU"]
    head += ["predicted one GPU", "predicted per rank", "per rank: slabs + dW + dX fp32 + masked rows"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        if r.method != "vocab-parallel" or r.peak_mib is None:
            continue
        one = next((o for o in rows if o.method == "single GPU auto" and o.size == r.size), None)
        one_mib = None if one is None else one.peak_mib
        pred = predicted_mib(r.size["N"], args.vocab, args.ds, dtype, world)
        parts = pred["per rank"]
        cells = [str(r.size["N"]), r.size["div"], "-" if one_mib is None else f"{one_mib:.0f}"]
        cells += [f"{r.extra.get(f'peak_mib_rank{k}', float('nan')):.0f}" for k in range(world)]
        cells.append("-" if not one_mib else f"{r.peak_mib / one_mib:.2f}")
        if one_mib is None:  # no Triton path here (a CPU): the prediction is the Triton plans'
            cells += ["-", "-", "-"]
        else:
            cells += [f"{pred['one GPU']['total']:.0f}", f"{parts['total']:.0f}"]
            cells.append(" + ".join(f"{parts[k]:.0f}" for k in ("slabs", "dW", "dX", "masked rows")))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _replay_collectives(N, Ds, name, with_ce, T, group, device):
    """The collectives of one vocab-parallel fwd+bwd, with the same payloads (nothing else)."""
    c = 1 if (with_ce and T != 1.0) else 0
    world = dist.get_world_size(group)
    lay = torch.zeros(world, 10, dtype=torch.int64, device=device)
    dist.all_reduce(lay, group=group)
    lay.tolist()
    dist.all_reduce(torch.zeros(2 + c, N, device=device), op=dist.ReduceOp.MAX, group=group)
    dist.all_reduce(torch.zeros(2 + c + (name in dv.ONE_PASS) + with_ce, N, device=device), group=group)
    if name not in dv.ONE_PASS:
        dist.all_reduce(torch.zeros(2, N, device=device), group=group)
    dist.all_reduce(torch.zeros(N, Ds, device=device), group=group)


def _table(rows):
    head = [
        "N",
        "div",
        "method",
        "ms",
        "speedup",
        "vs auto",
        "peak MiB",
        "rel err",
        "bytes/call",
        "bytes/token",
        "note",
    ]
    body = []
    for r in rows:
        body.append(
            [
                str(r.size["N"]),
                r.size.get("div", ""),
                r.method,
                "-" if r.ms is None else f"{r.ms:.2f}",
                f"{r.extra['speedup']:.2f}x" if "speedup" in r.extra else "-",
                f"{r.extra['vs_auto']:.2f}x" if "vs_auto" in r.extra else "-",
                "-" if r.peak_mib is None else f"{r.peak_mib:.0f}",
                "-" if r.rel_err is None else f"{r.rel_err:.1e}",
                _fmt_bytes(r.extra.get("bytes_per_call")),
                _fmt_bytes(r.extra.get("bytes_per_token")),
                r.note,
            ]
        )
    widths = [max(len(h), *(len(b[i]) for b in body)) for i, h in enumerate(head)]
    line = "| " + " | ".join(h.ljust(w) for h, w in zip(head, widths)) + " |"
    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([line, sep] + ["| " + " | ".join(c.ljust(w) for c, w in zip(b, widths)) + " |" for b in body])


def _fmt_bytes(b):
    if b is None:
        return "-"
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if b >= scale:
            return f"{b / scale:.2f} {unit}"
    return f"{b:.0f} B"


def _markdown(path, table, env, args, failures, phases="", memory=""):
    with open(path, "w") as f:
        f.write("# Vocab-parallel hidden-state losses over NCCL\n\n")
        f.write(
            f"`torchrun --nproc-per-node {env.get('world')} benchmarks/distributed_nccl.py "
            f"{' '.join(sys.argv[1:])}`\n\n"
        )
        f.write(", ".join(f"{k}: {v}" for k, v in env.items()) + "\n\n")
        f.write(
            f"dtype {args.dtype}, V={args.vocab} split {env.get('shards')}, Ds={args.ds}, Dt={args.dt}, "
            f"T={args.temperature}, ce_weight={args.ce_weight}; fwd+bwd (grads to xs and the student head), "
            f"median of {args.reps} after {args.warmup} warm-up, max over ranks. speedup = single GPU torch ms / "
            "ms. rel err against the single-GPU torch path. bytes = payload bytes per rank per call "
            "(nitrobrew.parallel.count_comm; equals nitrobrew.hidden.vocab_parallel.comm_bytes).\n\n"
        )
        f.write(table + "\n")
        if memory:
            f.write(
                "\n## Memory per rank (MiB above the inputs, one fwd+bwd)\n\n"
                "Each rank's peak beside one GPU's Triton path on the same inputs; predicted: the buffers of the "
                "fast plans (one fp32 logit slab pair, dW in the head's dtype, dX: the input dtype on one GPU, fp32 "
                "on a rank, the masked copy of xs). Target: every rank at or below one GPU.\n\n" + memory + "\n"
            )
        if phases:
            f.write(
                "\n## Per-rank phases of the vocab-parallel call (ms, CUDA events, median)\n\n"
                "local stats: logit GEMMs + row-statistics kernels; exchange: the forward's collectives "
                "(waiting for the slower rank included); gradient pass: gradient slabs + dX / dW GEMMs; "
                "dX all-reduce: the backward's one collective; step: the whole fwd+bwd.\n\n" + phases + "\n"
            )
        if failures:
            f.write("\n## Failures\n\n```\n" + "\n".join(failures) + "\n```\n")


def _nccl_version():
    try:
        return ".".join(str(v) for v in torch.cuda.nccl.version())
    except Exception:
        return "n/a"


if __name__ == "__main__":
    sys.exit(main())
