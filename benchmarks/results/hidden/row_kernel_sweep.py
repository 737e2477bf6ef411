"""Launch-configuration sweep of the hidden-state row kernels on one fp32 slab pair.

    python benchmarks/results/hidden/row_kernel_sweep.py

R = 768 rows (the fast mode's row block at V = 152064 and the default budget) x V = 152064 fp32
student and teacher logits: time of the statistics pass (reads 8 bytes per logit pair) of forward KL
(log-sum-exps and the KL's two sums) and of jsd (log-sum-exps only; its second pass is not timed),
and of forward KL's gradient pass (reads 8, writes a 2-byte gradient) per (BLOCK_V, num_warps: every
pass), against a clone of both slabs (a read and a write of 8 bytes per pair).
"""
import torch

import nitrobrew.hidden.triton_rows as tr
from nitrobrew.bench.common import time_ms
from nitrobrew.hidden.config import LossConfig


def main():
    dev = torch.device("cuda")
    cfg = LossConfig("forward_kl", 0.0, 1.0, 1.0, 0.0, None)
    cfg_jsd = LossConfig("jsd", 0.5, 1.0, 1.0, 0.0, None)
    R, V = 768, 152064
    g = torch.Generator(device=dev).manual_seed(0)
    z = torch.randn(R, V, device=dev, generator=g) * 3
    t = torch.randn(R, V, device=dev, generator=g) * 3
    gb = torch.empty(R, V, device=dev, dtype=torch.bfloat16)
    rowvals = torch.randn(R, 4, device=dev).abs() + 10
    kd = torch.full((R,), 1.0 / R, device=dev)
    st = tr.new_state(R, dev)
    default = (tr.BLOCK_V, tr.KL_STATS_BLOCK_V, tr.NUM_WARPS, tr.STATS_WARPS, tr.KL_STATS_WARPS)
    print("| BLOCK_V | warps | KL stats ms | KL stats TB/s | jsd stats ms | jsd stats TB/s | grad ms | grad TB/s |\n"
          "|---|---|---|---|---|---|---|---|")
    for blk, nw in ((1024, 4), (2048, 4), (4096, 4), (2048, 8), (4096, 8), (8192, 8), (8192, 16), (4096, 16)):
        tr.BLOCK_V, tr.KL_STATS_BLOCK_V, tr.NUM_WARPS, tr.STATS_WARPS, tr.KL_STATS_WARPS = blk, blk, nw, nw, nw
        ms = time_ms(lambda: tr.launch_stats(z, t, st, None, 0, cfg, 1), dev, 2, 7)
        mj = time_ms(lambda: tr.launch_stats(z, t, st, None, 0, cfg_jsd, 1), dev, 2, 7)
        mg = time_ms(lambda: tr.launch_grad(z, t, gb, rowvals, kd, None, None, 0, cfg), dev, 2, 7)
        print(f"| {blk} | {nw} | {ms:.3f} | {8 * R * V / ms / 1e9:.2f} | {mj:.3f} | {8 * R * V / mj / 1e9:.2f} | "
              f"{mg:.3f} | {10 * R * V / mg / 1e9:.2f} |")
    tr.BLOCK_V, tr.KL_STATS_BLOCK_V, tr.NUM_WARPS, tr.STATS_WARPS, tr.KL_STATS_WARPS = default
    mc = time_ms(lambda: (z.clone(), t.clone()), dev, 2, 7)
    print(f"\nclone of both slabs: {mc:.3f} ms, {16 * R * V / mc / 1e9:.2f} TB/s (read + write)")


if __name__ == "__main__":
    main()
