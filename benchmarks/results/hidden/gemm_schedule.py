"""Where the fast mode's time goes: its GEMMs alone, in its own row-chunk schedule, against the floor.

For each N: the floor (the four bare GEMMs, unchunked, bf16 outputs), the fast mode's four GEMMs
alone in its chunk schedule (fp32 logit slabs, dX per chunk, dW accumulated per chunk in bf16, no
row kernels), other chunk schedules of the same GEMMs (rows per chunk C; "dW every 2" accumulates
dW once per two chunks, as if their gradient slabs were kept side by side), and the fast mode itself.
The gradient slabs of the GEMM-only schedules are random (their values do not change GEMM time).

    python benchmarks/results/hidden/gemm_schedule.py [--seq-lens 4096 16384] [--md PATH]
"""
import argparse

import torch

import nitrobrew as nb
from nitrobrew.bench import baselines as bl
from nitrobrew.bench.common import environment, time_ms
from nitrobrew.bench.hidden import make_data
from nitrobrew.hidden.triton_dispatch import make_plan, row_blocks

F32, BF16 = torch.float32, torch.bfloat16
V, DS, DT = 152064, 3584, 5120
SCHEDULES = [(None, 1), (512, 1), (512, 2), (832, 1), (1024, 1)]  # (rows per chunk, chunks per dW GEMM)


def gemm_schedule(d, g, n: int, rows: int, per_dw: int):
    """The four GEMMs of the fast mode over chunks of `rows` rows, dW once per `per_dw` chunks."""
    blocks = list(row_blocks(n, rows))
    dw, dx = torch.empty_like(d.ws), torch.empty_like(d.xs)

    @torch.no_grad()
    def run():
        for i in range(0, len(blocks), per_dw):
            group = blocks[i:i + per_dw]
            a, b = group[0][0], group[-1][1]
            for r0, r1 in group:
                z = torch.mm(d.xs[r0:r1], d.ws.t(), out_dtype=F32)
                t = torch.mm(d.xt[r0:r1], d.wt.t(), out_dtype=F32)
                del z, t
                torch.mm(g[r0 - a:r1 - a], d.ws, out=dx[r0:r1])
            if i == 0:
                torch.mm(g[:b - a].t(), d.xs[a:b], out=dw)
            else:
                dw.addmm_(g[:b - a].t(), d.xs[a:b])
    return run, blocks


def fast_mode(d):
    x, w = d.xs.detach().requires_grad_(), d.ws.detach().requires_grad_()

    def run():
        x.grad = w.grad = None
        nb.forward_kl(x, d.xt, w, d.wt, backend="triton").backward()
    return run


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seq-lens", type=int, nargs="+", default=[4096, 16384])
    ap.add_argument("--md", default=None)
    args = ap.parse_args()
    dev = torch.device("cuda")
    env = environment()
    lines = [f"# Fast-mode GEMM schedule ({env.get('device')}, torch {env.get('torch')}, "
             f"Triton {env.get('triton')}, commit {env.get('commit')})", "",
             "| N | what | rows per chunk | chunks | dW GEMMs | ms | x floor |", "|---|---|---|---|---|---|---|"]
    for n in args.seq_lens:
        d = make_data("random", n, V, DS, DT, BF16, dev, 0)
        g = torch.randn(n, V, device=dev, dtype=BF16)
        floor = time_ms(lambda: bl.gemm_floor(d.xs, d.xt, d.ws, d.wt, g), dev, warmup=2, reps=5)
        lines.append(f"| {n} | floor (4 GEMMs, unchunked) | {n} | 1 | 1 | {floor:.2f} | 1.000 |")
        default_rows = make_plan(n, V, DS, BF16, "fast", None, None, "mean").row_chunk
        for rows, per_dw in SCHEDULES:
            rows = rows or default_rows
            run, blocks = gemm_schedule(d, g, n, rows, per_dw)
            ms = time_ms(run, dev, warmup=2, reps=5)
            what = "GEMMs alone" + (" (fast mode's schedule)" if rows == default_rows and per_dw == 1 else "")
            what += f", dW every {per_dw}" if per_dw > 1 else ""
            lines.append(f"| {n} | {what} | {rows} | {len(blocks)} | {-(-len(blocks) // per_dw)} | {ms:.2f} | "
                         f"{ms / floor:.3f} |")
            print(lines[-1], flush=True)
        del g
        torch.cuda.empty_cache()
        ms = time_ms(fast_mode(d), dev, warmup=2, reps=5)
        lines.append(f"| {n} | nitrobrew fast (GEMMs + row kernels) | {default_rows} | "
                     f"{len(list(row_blocks(n, default_rows)))} | same | {ms:.2f} | {ms / floor:.3f} |")
        print(lines[-1], flush=True)
        del d
        torch.cuda.empty_cache()
    text = "\n".join(lines) + "\n"
    print(text)
    if args.md:
        with open(args.md, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
