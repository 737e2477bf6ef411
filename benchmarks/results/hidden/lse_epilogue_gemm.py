"""Can a Triton GEMM with a log-sum-exp epilogue match cuBLAS on the fast mode's logit slabs?

A persistent Triton GEMM (TMA descriptors) writing the fp32 slab, with or without per-(row, column
tile) max and sum-exp in its epilogue (what would replace the statistics pass), against cuBLAS
(torch.mm with an fp32 output) on the [768, K] x [K, 152064] slabs of the fast mode.

    python benchmarks/results/hidden/lse_epilogue_gemm.py
"""
import torch, triton, triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor
from nitrobrew.bench.common import time_ms
dev = torch.device("cuda"); BF = torch.bfloat16; F32 = torch.float32
NUM_SMS = torch.cuda.get_device_properties(0).multi_processor_count


@triton.jit
def _pid(tile, num_pid_in_group, num_pid_m, GROUP_M: tl.constexpr):
    group = tile // num_pid_in_group
    first_m = group * GROUP_M
    gsize = min(num_pid_m - first_m, GROUP_M)
    return first_m + (tile % gsize), (tile % num_pid_in_group) // gsize


@triton.jit
def gemm_lse(a_desc, b_desc, c_ptr, pm_ptr, pl_ptr, M, N, K, stride_c, n_tiles_n,
             BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
             STATS: tl.constexpr, NUM_SMS: tl.constexpr, STAGES: tl.constexpr, FLAT: tl.constexpr):
    start = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BM)
    num_pid_n = tl.cdiv(N, BN)
    k_tiles = tl.cdiv(K, BK)
    num_tiles = num_pid_m * num_pid_n
    num_pid_in_group = GROUP_M * num_pid_n
    for tile in tl.range(start, num_tiles, NUM_SMS, flatten=FLAT, num_stages=STAGES if FLAT else 1):
        pid_m, pid_n = _pid(tile, num_pid_in_group, num_pid_m, GROUP_M)
        om = pid_m * BM
        on = pid_n * BN
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        if FLAT:
            for ki in range(k_tiles):
                a = a_desc.load([om, ki * BK])
                b = b_desc.load([on, ki * BK])
                acc = tl.dot(a, b.T, acc)
        else:
            for ki in tl.range(k_tiles, num_stages=STAGES):
                a = a_desc.load([om, ki * BK])
                b = b_desc.load([on, ki * BK])
                acc = tl.dot(a, b.T, acc)
        rows = om + tl.arange(0, BM)
        cols = on + tl.arange(0, BN)
        cmask = cols < N
        tl.store(c_ptr + rows[:, None].to(tl.int64) * stride_c + cols[None, :], acc,
                 mask=(rows[:, None] < M) & cmask[None, :])
        if STATS:
            x = tl.where(cmask[None, :], acc, float("-inf"))
            m = tl.max(x, axis=1)
            l = tl.sum(tl.exp(x - m[:, None]), axis=1)
            off = rows.to(tl.int64) * n_tiles_n + pid_n
            tl.store(pm_ptr + off, m, mask=rows < M)
            tl.store(pl_ptr + off, l, mask=rows < M)


def run_gemm(a, b, c, pm, pl, BM, BN, BK, GROUP_M, STAGES, warps, stats, flat=True):
    M, K = a.shape; N = b.shape[0]
    a_desc = TensorDescriptor.from_tensor(a, [BM, BK])
    b_desc = TensorDescriptor.from_tensor(b, [BN, BK])
    grid = (min(NUM_SMS, triton.cdiv(M, BM) * triton.cdiv(N, BN)),)
    gemm_lse[grid](a_desc, b_desc, c, pm, pl, M, N, K, c.stride(0), triton.cdiv(N, BN),
                   BM=BM, BN=BN, BK=BK, GROUP_M=GROUP_M, STATS=stats, NUM_SMS=NUM_SMS, STAGES=STAGES, FLAT=flat,
                   num_warps=warps)


def main():
    V = 152064
    for M, K in ((768, 3584), (768, 5120)):
        g = torch.Generator(device=dev).manual_seed(0)
        a = torch.randn(M, K, device=dev, dtype=BF, generator=g)
        b = (torch.randn(V, K, device=dev, dtype=BF, generator=g) * (3 / K ** 0.5)).to(BF)
        flops = 2 * M * V * K
        ref = torch.mm(a, b.t(), out_dtype=F32)
        t_cublas = time_ms(lambda: torch.mm(a, b.t(), out_dtype=F32), dev, warmup=3, reps=9)
        print(f"M={M} K={K} cuBLAS fp32 out: {t_cublas:.3f} ms {flops / t_cublas / 1e9:.0f} TFLOP/s", flush=True)
        c = torch.empty(M, V, device=dev, dtype=F32)
        for BM, BN, BK, GM, ST, W, FL in ((128, 256, 64, 6, 2, 8, True), (128, 256, 64, 6, 3, 8, False),
                                     (128, 256, 64, 6, 4, 8, False), (128, 128, 64, 6, 4, 8, True),
                                     (128, 128, 64, 6, 5, 8, False), (256, 128, 64, 3, 3, 8, False),
                                     (128, 256, 32, 6, 4, 8, False), (128, 128, 128, 6, 3, 8, False)):
            nt = triton.cdiv(V, BN)
            pm = torch.empty(M, nt, device=dev, dtype=F32); pl = torch.empty_like(pm)
            try:
                for stats in (False, True):
                    run_gemm(a, b, c, pm, pl, BM, BN, BK, GM, ST, W, stats, FL)
                    torch.cuda.synchronize()
                    err = ((c - ref).abs().max() / ref.abs().max()).item()
                    t = time_ms(lambda: run_gemm(a, b, c, pm, pl, BM, BN, BK, GM, ST, W, stats, FL), dev, warmup=3, reps=9)
                    extra = ""
                    if stats:
                        mx = pm.max(1).values
                        lse = mx + torch.log((pl * torch.exp(pm - mx[:, None])).sum(1))
                        extra = f" lse err {(lse - torch.logsumexp(ref, 1)).abs().max().item():.1e}"
                    print(f"  triton BM={BM} BN={BN} BK={BK} G={GM} stages={ST} warps={W} flat={FL} stats={stats!s:5s} "
                          f"{t:.3f} ms {flops / t / 1e9:.0f} TFLOP/s ({t_cublas / t:.3f} of cuBLAS speed) err {err:.1e}{extra}",
                          flush=True)
            except Exception as e:
                print(f"  triton BM={BM} BN={BN} stages={ST} warps={W}: {type(e).__name__}: {str(e)[:200]}", flush=True)


main()
