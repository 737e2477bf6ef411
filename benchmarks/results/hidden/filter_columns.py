"""How many vocab columns the gradient filter keeps, on the benchmark's data (GPU, one call).

For the "peaked" and "close" regimes (nitrobrew.bench.hidden.make_data, V=152064, Ds=3584,
Dt=5120, N=4096) and forward KL, the logit gradient q - p of each slab is filtered as the
library does (a column is active if some row has |g_ij| > eps * max_j' |g_ij'| over the slab's
columns), per slab layout of the two modes (fast: 1536-row blocks over the whole vocabulary;
constant memory: 1024-row blocks x 4096-column chunks) and per eps: the mean fraction of active
columns and the number of slabs that get compacted (at most half their columns active).
Usage: filter_columns.py OUT.md
"""
import sys

import torch

from nitrobrew.bench.hidden import make_data

V, DS, DT, N = 152064, 3584, 5120, 4096
EPS = (2.0**-12, 2.0**-10, 2.0**-8, 2.0**-6)


def grad_rows(d, r0, r1):
    z = d.xs[r0:r1].float() @ d.ws.float().t()
    t = d.xt[r0:r1].float() @ d.wt.float().t()
    return (torch.softmax(z, -1) - torch.softmax(t, -1)).abs()


def main(path):
    dev = torch.device("cuda")
    lines = ["| regime | layout | eps | mean active column fraction | slabs compacted |", "|---|---|---|---|---|"]
    for regime in ("peaked", "close"):
        d = make_data(regime, N, V, DS, DT, torch.bfloat16, dev, seed=0)
        for label, rows, chunk in (("fast (1536 rows x V)", 1536, V), ("constant memory (1024 x 4096)", 1024, 4096)):
            stats = {eps: ([], 0) for eps in EPS}
            for r0 in range(0, N, rows):
                g = grad_rows(d, r0, min(r0 + rows, N))
                for c0 in range(0, V, chunk):
                    slab = g[:, c0:c0 + chunk]
                    row_max = slab.amax(1, keepdim=True)
                    for eps in EPS:
                        f = float((slab > eps * row_max).any(0).float().mean())
                        fracs, comp = stats[eps]
                        fracs.append(f)
                        stats[eps] = (fracs, comp + (f <= 0.5))
                del g
            for eps, (fracs, comp) in stats.items():
                lines.append(f"| {regime} | {label} | 2^{round(torch.log2(torch.tensor(eps)).item())} | "
                             f"{sum(fracs) / len(fracs):.3f} | {comp}/{len(fracs)} |")
                print(lines[-1], flush=True)
        del d
    open(path, "w").write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main(sys.argv[1])
