"""The fast mode's backward without a device-to-host read: a same-process A/B of the tree against an
older package (--before-dir, a copy of its nitrobrew/ folder, imported as `nitrobrew_before`).

Before: the backward read the upstream gradient on the host (a sync) to skip the multiply when it is 1,
and otherwise multiplied dX and dW out of place. Now a kernel reads it on the device and scales in place.

Per case (bf16, V = 152064, Ds = 3584, Dt = 5120, fast mode, fwd+bwd with gradients to xs and ws):
- "synced call": one call timed from a synchronized start (the bench's protocol), upstream 1;
- "loop": 10 steps back to back without a sync between them, per step, upstream 1 (`loss.backward()`),
  1/4 (`(loss / 4).backward()`, a loss scaled for gradient accumulation) and with labels (CE on;
  the labels' range check reads the device in the forward);
- peak: max_memory_allocated of one step with upstream 1/4, above what was allocated before it.
Rounds alternate the order of the packages; medians of --rounds rounds. Gradients of both packages are
compared (upstream 1: bit for bit; 1/4: a power of two, bit for bit too).

    python benchmarks/upstream_scale_ab.py --before-dir DIR [--ns 4096 16384] [--divs forward_kl jsd]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from confident_rows_gpu import load_old  # noqa: E402

import nitrobrew as nb  # noqa: E402
from nitrobrew.bench.common import loop_ms, peak_mib, time_ms  # noqa: E402
from nitrobrew.environment import environment  # noqa: E402

V, DS, DT = 152064, 3584, 5120
F32 = torch.float32


class Case:
    def __init__(self, n, dev, labels: bool):
        g = torch.Generator(device=dev).manual_seed(0)

        def r(*s, scale=1.0):
            return (torch.randn(*s, generator=g, device=dev, dtype=F32) * scale).bfloat16()

        self.xs = r(n, DS).requires_grad_(True)
        self.xt = r(n, DT)
        self.ws = r(V, DS, scale=DS**-0.5 * 2).requires_grad_(True)
        self.wt = r(V, DT, scale=DT**-0.5 * 2)
        self.labels = torch.randint(0, V, (n,), device=dev, generator=g) if labels else None

    def step(self, pkg, div, scale=None):
        self.xs.grad = None
        self.ws.grad = None
        kw = {"labels": self.labels, "kd_weight": 0.5} if self.labels is not None else {}
        loss = getattr(pkg, div)(self.xs, self.xt, self.ws, self.wt, backend="triton", mode="fast", **kw)
        (loss if scale is None else loss * scale).backward()


def loop(case, pkg, div, scale=None, k=10) -> float:
    for _ in range(2):
        case.step(pkg, div, scale)
    return loop_ms(lambda: case.step(pkg, div, scale), calls=k)


def step_peak_mib(case, pkg, div, scale) -> float:
    """One step's peak above what was allocated before it, the previous step's gradients released."""
    case.xs.grad = None
    case.ws.grad = None
    return peak_mib(lambda: case.step(pkg, div, scale), case.xs.device)


def grads(case, pkg, div, scale):
    case.step(pkg, div, scale)
    return case.xs.grad.clone(), case.ws.grad.clone()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before-dir", required=True)
    ap.add_argument("--ns", type=int, nargs="+", default=[4096, 16384])
    ap.add_argument("--divs", nargs="+", default=["forward_kl", "jsd"])
    ap.add_argument("--rounds", type=int, default=4)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    dev = torch.device("cuda")
    before = load_old("", args.before_dir, "nitrobrew_before")
    pkgs = (("before", before), ("new", nb))
    env = environment()
    print(
        f"device {env.get('device')}, torch {torch.__version__}, triton {env.get('triton')}, commit {env.get('commit')}"
    )
    print(
        "\n| divergence, N | synced call, upstream 1: before / new ms (ratio) | loop, upstream 1 | loop, upstream 1/4"
        " | loop, labels + CE | peak MiB, upstream 1/4: before / new | gradients equal |"
    )
    print("|---|---|---|---|---|---|---|")
    for n in args.ns:
        case, lab = Case(n, dev, labels=False), Case(n, dev, labels=True)
        for div in args.divs:
            equal = all(
                torch.equal(a, b)
                for s in (None, 0.25)
                for a, b in zip(grads(case, before, div, s), grads(case, nb, div, s))
            )
            peaks = {name: step_peak_mib(case, pkg, div, 0.25) for name, pkg in pkgs}
            times = {key: {"before": [], "new": []} for key in ("synced", "one", "quarter", "labels")}
            for rnd in range(args.rounds):
                for name, pkg in pkgs if rnd % 2 == 0 else pkgs[::-1]:
                    times["synced"][name].append(time_ms(lambda pkg=pkg: case.step(pkg, div), dev, warmup=1, reps=5))
                    times["one"][name].append(loop(case, pkg, div))
                    times["quarter"][name].append(loop(case, pkg, div, 0.25))
                    times["labels"][name].append(loop(lab, pkg, div))
            cells = []
            for key in ("synced", "one", "quarter", "labels"):
                b, w = (statistics.median(times[key][k]) for k in ("before", "new"))
                cells.append(f"{b:.2f} / {w:.2f} ({w / b:.3f})")
            peak = f"{peaks['before']:.0f} / {peaks['new']:.0f}"
            print(f"| {div}, {n} | " + " | ".join(cells) + f" | {peak} | {'yes' if equal else 'NO'} |", flush=True)
            torch.cuda.empty_cache()
        del case, lab
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
