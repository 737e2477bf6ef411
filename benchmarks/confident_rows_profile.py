"""Where the fast mode's step time goes, per package: wall clock, summed kernel time, the Triton row kernels'
share and the count of small PyTorch kernels per step (torch.profiler; same process, same inputs as
confident_rows_gpu.py's speed table).

    python benchmarks/confident_rows_profile.py --old-dir OLD/nitrobrew [--before-dir BEFORE/nitrobrew] \
        [--losses forward_kl,tvd]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import confident_rows_gpu as crg  # noqa: E402

import nitrobrew as nb  # noqa: E402
from nitrobrew.bench.common import time_ms  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--old-dir", required=True)
    p.add_argument("--before-dir", default=None)
    p.add_argument("--losses", default="forward_kl,reverse_kl,tvd,skew_kl,jsd")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    pkgs = [("old", crg.load_old("", args.old_dir))]
    if args.before_dir:
        pkgs.append(("before", crg.load_old("", args.before_dir, "nitrobrew_before")))
    pkgs.append(("new", nb))
    dev = torch.device("cuda")
    v, ds, dt, n = 152064, 3584, 5120, 4096
    g = torch.Generator(device=dev).manual_seed(0)
    xs = torch.randn(n, ds, device=dev, generator=g, dtype=torch.bfloat16)
    xt = torch.randn(n, dt, device=dev, generator=g, dtype=torch.bfloat16)
    ws = (torch.randn(v, ds, device=dev, generator=g) * (3 / ds**0.5)).bfloat16()
    wt = (torch.randn(v, dt, device=dev, generator=g) * (3 / dt**0.5)).bfloat16()
    for name in args.losses.split(","):
        for label, pkg in pkgs:
            fn = getattr(pkg, name)

            def step():
                x, w = xs.detach().requires_grad_(), ws.detach().requires_grad_()
                fn(x, xt, w, wt, backend="triton", mode="fast").backward()

            for _ in range(3):
                step()
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(5):
                    step()
                torch.cuda.synchronize()
            rows = [(e.self_device_time_total / 5e3, e.key, e.count // 5) for e in prof.key_averages()]
            rows = [r for r in rows if r[0] > 0]
            wall = statistics.median(time_ms(step, dev, warmup=1, reps=5) for _ in range(3))
            total = sum(r[0] for r in rows)
            stats = sum(r[0] for r in rows if "hidden_stats" in r[1])
            grad = sum(r[0] for r in rows if "hidden_grad" in r[1])
            small = sum(r[2] for r in rows if "nvjet" not in r[1] and "hidden_" not in r[1])
            print(
                f"== {name} {label}: wall {wall:.2f} ms, kernels {total:.2f} ms, gap {wall - total:.2f} ms; "
                f"stats {stats:.2f} grad {grad:.2f}; small kernels/step {small}",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
