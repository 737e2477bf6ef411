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
    times = []
    for i in range(repeats + 1):
        x = xs.detach().requires_grad_()
        w = ws.detach().requires_grad_()
        t0 = time.perf_counter()
        hidden_loss(x, xt, w, wt, backend="torch", chunk_V=chunk).backward()
        if i:  # the first is a warm-up
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", nargs="?", default="benchmarks/results/hidden/cpu_auto_chunk.md")
    p.add_argument("--rows", type=int, default=256)
    p.add_argument("--vocab", type=int, default=65536)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--fixed", default="1024,4096,16384,65536", help="fixed chunks to compare")
    args = p.parse_args(argv)
    g = torch.Generator().manual_seed(0)
    xs = torch.randn(args.rows, args.hidden, generator=g)
    xt = torch.randn(args.rows, args.hidden, generator=g)
    ws = torch.randn(args.vocab, args.hidden, generator=g) / args.hidden**0.5
    wt = torch.randn(args.vocab, args.hidden, generator=g) / args.hidden**0.5
    auto = auto_chunk_v(args.rows, args.vocab, device=xs.device)
    rows = [("auto", auto, step_seconds(xs, xt, ws, wt, None, args.repeats))]
    for chunk in (int(c) for c in args.fixed.split(",")):
        if chunk <= args.vocab:
            rows.append(("fixed", chunk, step_seconds(xs, xt, ws, wt, chunk, args.repeats)))
    lines = [
        f"# CPU: automatic vocab chunk of the PyTorch path ({args.rows} rows, V = {args.vocab}, H = {args.hidden})",
        "",
        f"torch {torch.__version__}, {torch.get_num_threads()} threads; forward + backward of hidden_loss "
        f"(forward_kl, backend='torch'), median of {args.repeats}.",
        "",
        "| chunk_V | chosen | seconds |",
        "|---|---|---|",
        *(f"| {chunk} | {how} | {sec:.4f} |" for how, chunk, sec in rows),
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
