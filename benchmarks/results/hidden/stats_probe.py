"""Kernel-only probe of the statistics pass (first pass) on one 768 x 152064 fp32 slab pair: time per
launch setting, registers and spills, for the tree's triton_rows.py and variants of it.

    git show e3b5dfc:nitrobrew/hidden/triton_rows.py > head.py
    sed -e '/rel = rel \* sc_/d' head.py > headnorel.py          # without the KL's expm1 sum
    sed -e '/rel = rel \* sc/d' nitrobrew/hidden/triton_rows.py > newnorel.py
    python benchmarks/results/hidden/stats_probe.py headnorel.py head.py newnorel.py

"rel" is the tree's module, "norel" the first file, the others by file name. Variants without the sum
are for timing only (their KL is not valid).
"""
import os, sys, torch
import nitrobrew.hidden.triton_rows as tr
from nitrobrew.bench.common import time_ms
from nitrobrew.hidden.config import LossConfig
from nitrobrew import divergences as dv
from nitrobrew._launch import launch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from row_stats_ab import load  # noqa: E402  (a kernel module from a file, under a package name)


def main():
    dev = torch.device("cuda")
    R, V = 768, 152064
    g = torch.Generator(device=dev).manual_seed(0)
    z = torch.randn(R, V, device=dev, generator=g) * 3
    t = z + torch.randn(R, V, device=dev, generator=g) * 0.05
    mods = {"rel": tr, "norel": load(sys.argv[1], "nitrobrew.hidden.norel")}
    for extra in sys.argv[2:]:
        mods[extra.split("/")[-1][:-3]] = load(extra, "nitrobrew.hidden." + extra.split("/")[-1][:-3])
    for div in ("forward_kl", "jsd"):
        cfg = LossConfig(div, 0.5 if div == "jsd" else 0.0, 1.0, 1.0, 0.0, None)
        inv_temp, a, log_a, log_1ma = tr._math_args(cfg)
        for blk, nw in ((1024, 4), (2048, 4), (2048, 8), (4096, 4), (4096, 8), (8192, 8), (8192, 16), (4096, 16)):
            for name, m in mods.items():
                st = m.new_state(R, dev)
                args = (z, t, z.stride(0), t.stride(0), st, st, V, 0, inv_temp, a, log_a, log_1ma)
                kw = dict(DIVERGENCE=dv.DIVERGENCE_IDS[div], PASS=1, RAW_LSE=False, HAS_LABELS=False, BLOCK_V=blk,
                          num_warps=nw)
                k = m.stats_kernel[(R,)](*args, **kw)
                launch(m.stats_kernel, (R,), *args, **kw)
                run = lambda: launch(m.stats_kernel, (R,), *args, **kw)  # noqa: E731
                ms = time_ms(run, dev, 2, 9)
                print(f"{div:10s} {name:8s} BLOCK_V={blk:5d} warps={nw:2d}: {ms:.3f} ms {8*R*V/ms/1e9:.2f} TB/s "
                      f"regs {k.n_regs} spills {k.n_spills}", flush=True)


if __name__ == "__main__":
    main()
