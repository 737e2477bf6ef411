"""CPU: the PyTorch path's automatic vocab chunk against fixed chunks (forward + backward).

    python benchmarks/cpu_auto_chunk.py [OUT.md] [--rows 256] [--vocab 65536] [--hidden 256] [--repeats 5]

Times hidden_loss(backend="torch") with chunk_V=None (the automatic choice) and with fixed chunks,
in one process, median of the repeats; writes a markdown table (default
benchmarks/results/hidden/cpu_auto_chunk.md).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from nitrobrew import hidden_loss  # noqa: E402
from nitrobrew.core.online import auto_chunk_v  # noqa: E402


def step_seconds(xs, xt, ws, wt, chunk, repeats):
    """(wall, process CPU) seconds of one forward + backward, medians over the repeats. CPU time is the
    steadier of the two on a machine shared with other work."""
    wall, cpu = [], []
    for i in range(repeats + 1):
        x = xs.detach().requires_grad_()
        w = ws.detach().requires_grad_()
        t0, c0 = time.perf_counter(), time.process_time()
        hidden_loss(x, xt, w, wt, backend="torch", chunk_V=chunk).backward()
        if i:  # the first is a warm-up
            wall.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
    return statistics.median(wall), statistics.median(cpu)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", nargs="?", default="benchmarks/results/hidden/cpu_auto_chunk.md")
    p.add_argument("--rows", type=int, default=256)
    p.add_argument("--vocab", type=int, default=65536)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--fixed", default="1024,4096,16384,65536", help="fixed chunks to compare")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    xs = torch.randn(args.rows, args.hidden, generator=g)
    xt = torch.randn(args.rows, args.hidden, generator=g)
    ws = torch.randn(args.vocab, args.hidden, generator=g) / args.hidden**0.5
    wt = torch.randn(args.vocab, args.hidden, generator=g) / args.hidden**0.5
    auto = auto_chunk_v(args.rows, args.vocab, device=xs.device)
    rows = [("automatic", auto, step_seconds(xs, xt, ws, wt, None, args.repeats))]
    for chunk in (int(c) for c in args.fixed.split(",")):
        if chunk <= args.vocab:
            rows.append(("fixed", chunk, step_seconds(xs, xt, ws, wt, chunk, args.repeats)))
    # the rule before the cache-size one: rows * chunk near 2^24 elements (64 MiB of fp32)
    before = auto_chunk_v(args.rows, args.vocab, device="cuda")
    lines = [
        f"# CPU: automatic vocab chunk of the PyTorch path ({args.rows} rows, V = {args.vocab}, H = {args.hidden})",
        "",
        f"torch {torch.__version__}, {torch.get_num_threads()} threads; forward + backward of hidden_loss "
        f"(forward_kl, backend='torch'), median of {args.repeats}.",
        "",
        f"Before the cache-size rule the automatic chunk here was {before} (rows * chunk near 2^24).",
        "",
        "| chunk_V | chosen | wall s | CPU s | CPU time / automatic |",
        "|---|---|---|---|---|",
        *(
            f"| {chunk} | {how} | {wall:.3f} | {cpu:.3f} | {cpu / rows[0][2][1]:.2f} |"
            for how, chunk, (wall, cpu) in rows
        ),
        "",
    ]
    text = "\n".join(lines)
    print(text)
    if os.path.dirname(args.out):
        os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
