"""How many vocab columns the gradient filter keeps, on the benchmark's data (GPU, one call).

For the "peaked" and "random" regimes (nitrobrew.bench.hidden.make_data, V=152064, Ds=3584,
Dt=5120) and forward KL, the logit gradient's unscaled entries |q - p| are compared with the
bf16 threshold 2^-12; reported per slab layout of the two modes (fast: 1536-row blocks over the
whole vocabulary; constant memory: 1024-row blocks x 4096-column chunks): the mean fraction of
active columns and the fraction of slabs that get compacted (at most half their columns active).
Usage: filter_columns.py OUT.md
"""
import sys

import torch

from nitrobrew.bench.hidden import make_data

V, DS, DT, N, EPS = 152064, 3584, 5120, 4096, 2.0**-12


def active_columns(d, r0, r1):
    z = d.xs[r0:r1].float() @ d.ws.float().t()
    t = d.xt[r0:r1].float() @ d.wt.float().t()
    g = (torch.softmax(z, -1) - torch.softmax(t, -1)).abs()
    return g > EPS  # [rows, V]


def main(path):
    dev = torch.device("cuda")
    lines = ["| regime | layout | mean active column fraction | slabs compacted |", "|---|---|---|---|"]
    for regime in ("peaked", "random"):
        d = make_data(regime, N, V, DS, DT, torch.bfloat16, dev, seed=0)
        for label, rows, chunk in (("fast (1536 rows x V)", 1536, V), ("constant memory (1024 x 4096)", 1024, 4096)):
            fracs, compacted = [], 0
            for r0 in range(0, N, rows):
                act = active_columns(d, r0, min(r0 + rows, N)).any(0)
                for c0 in range(0, V, chunk):
                    f = float(act[c0:c0 + chunk].float().mean())
                    fracs.append(f)
                    compacted += f <= 0.5
            lines.append(f"| {regime} | {label} | {sum(fracs) / len(fracs):.3f} | {compacted}/{len(fracs)} |")
            print(lines[-1], flush=True)
        del d
    open(path, "w").write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main(sys.argv[1])
