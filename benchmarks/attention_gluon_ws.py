"""Probe: the Gluon attention-KL forward in FlashAttention-3's warp-specialized form, and where its time goes.

The experiments behind the library's warp-specialized forward (`nitrobrew/attention/kernels_gluon.py:
attention_fwd_gluon_ws_kernel`, which took the three-consumer form, no ping-pong, the fold) and what did
not make it. A TMA producer warp (24 registers) fills a ring of key buffers for NC = 2 consumer warpgroups
(240 registers each, by `setmaxnreg`) or 3 (160 each), each owning 64 of a program's query rows and
releasing a buffer through an `empty` mbarrier; key blocks of BN = 128 or 64. Options:
- PINGPONG: 0 the warpgroups run freely; 1 a warpgroup issues its GEMMs only after the previous one (round
  robin) issued its own (turn mbarriers); 2 only after the previous one's GEMMs completed, so one
  warpgroup's update runs under the others' GEMMs (FlashAttention-3's schedule).
- FOLD: the softmax scale rides in the FMA of each exponent's argument (max(s * scale) = scale * max(s)
  for scale > 0) and the centred difference reuses both arguments: 26% fewer FP32 instructions per pair.
- POLY: 2^(y - m_y) on the FMA units (degree-5 polynomial, FlashAttention-4's trick) every block (1) or
  every other block (2), to unload the exponential unit.
- ABLATE: 1 the GEMMs alone (the update replaced by row sums), 2 the update alone (no GEMM; scores made
  up per element so that nothing folds).
The update is the library's (docs/design.md section 3): log2 units, centred online state, the same outputs
(KL per row, both lse's), so it is checked against the library's Triton forward row by row.

    python benchmarks/attention_gluon_ws.py [--ns 4096 8192 16384] [--rounds 3] [--no-check]

Needs an sm90 GPU and Triton 3.6's Gluon; a probe: the library runs its own kernel (results:
benchmarks/results/attention/gluon_ws_h100.md).
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch
import torch.nn.functional as F

from nitrobrew.attention import kernels_gluon as kg
from nitrobrew.attention.common import AttnSpec
from nitrobrew.attention.triton_function import Side, triton_forward
from nitrobrew.bench.common import time_ms

if kg.HAVE_GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import mbarrier, warpgroup_mma, warpgroup_mma_wait
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    tma_load = kg.tma_load

LOG2E = 1.4426950408889634
HALF = 64  # query rows of one consumer warpgroup

if kg.HAVE_GLUON:

    @gluon.jit
    def _exp2_fma(x):
        """2^x on the FMA units: x = n + f (n = rint x, |f| <= 1/2), a degree-5 near-minimax polynomial of
        2^f (max rel err 7.5e-8 in exact arithmetic), n added to the exponent bits; 0 below 2^-126."""
        magic = 12582912.0  # 1.5 * 2^23: x + magic holds rint(x) in its low mantissa bits
        t = x + magic
        f = x - (t - magic)
        p = 0.0013276444402470133 * f + 0.009675537697167797
        p = p * f + 0.05550713315236906
        p = p * f + 0.24022119793277946
        p = p * f + 0.69314696706795
        p = p * f + 1.0000000716400317
        r = (p.to(gl.int32, bitcast=True) + (t.to(gl.int32, bitcast=True) << 23)).to(gl.float32, bitcast=True)
        return gl.where(x < -126.0, 0.0, r)

    @gluon.jit
    def _ws_step(
        sx,
        sy,
        mx,
        my,
        lx,
        ly,
        c,
        start_m,
        start_n,
        Nk,
        causal_offset,
        scale_x,
        scale_y,
        j,
        BM: gl.constexpr,
        BN: gl.constexpr,
        LAYOUT: gl.constexpr,
        MASKED: gl.constexpr,
        CAUSAL: gl.constexpr,
        X_FIXED: gl.constexpr,
        Y_FIXED: gl.constexpr,
        POLY: gl.constexpr,
        ABLATE: gl.constexpr,
        FOLD: gl.constexpr,
    ):
        """kernels_fwd._online_step after the mask, with 2^(y - m_y) optionally on the FMA units (POLY 1:
        every block, 2: odd blocks)."""
        if ABLATE == 1:  # GEMMs only: the outputs stay live
            c = c + gl.sum(sx, 1) + gl.sum(sy, 1)
            return mx, my, lx + 1.0, ly + 1.0, c
        if FOLD:
            # the scale rides in the FMA of each exponent's argument: max(s * scale) = scale * max(s) for
            # scale > 0 (rounding is monotonic), d = arg_x - arg_y reuses both arguments
            if MASKED:
                cols = gl.expand_dims(start_n + gl.arange(0, BN, layout=gl.SliceLayout(0, LAYOUT)), 0)
                rows = gl.expand_dims(start_m + gl.arange(0, BM, layout=gl.SliceLayout(1, LAYOUT)), 1)
                if CAUSAL:
                    valid = (cols < Nk) & (cols <= rows + causal_offset)
                else:
                    valid = (cols < Nk) & (rows >= 0)
                rx = gl.where(valid, sx, float("-inf"))
                ry = gl.where(valid, sy, float("-inf"))
            else:
                rx = sx
                ry = sy
            if X_FIXED:
                mx_new = mx
            else:
                mx_new = gl.maximum(mx, gl.max(rx, 1) * scale_x)
            if Y_FIXED:
                my_new = my
            else:
                my_new = gl.maximum(my, gl.max(ry, 1) * scale_y)
            argx = sx * scale_x - gl.expand_dims(mx_new, 1)
            argy = sy * scale_y - gl.expand_dims(my_new, 1)
            if MASKED:
                ex = gl.where(valid, argx, float("-inf"))
                ey = gl.where(valid, argy, float("-inf"))
            else:
                ex = argx
                ey = argy
            px = gl.exp2(ex)
            if POLY == 1:
                py = _exp2_fma(ey)
            elif POLY == 2:
                if j % 2 == 1:
                    py = _exp2_fma(ey)
                else:
                    py = gl.exp2(ey)
            else:
                py = gl.exp2(ey)
            d = argx - argy
            ax = gl.exp2(mx - mx_new)
            ay = gl.exp2(my - my_new)
            c = ax * (c + lx * ((mx - mx_new) - (my - my_new))) + gl.sum(px * d, 1)
            lx = lx * ax + gl.sum(px, 1)
            ly = ly * ay + gl.sum(py, 1)
            return mx_new, my_new, lx, ly, c
        sx = sx * scale_x
        sy = sy * scale_y
        if MASKED:
            cols = gl.expand_dims(start_n + gl.arange(0, BN, layout=gl.SliceLayout(0, LAYOUT)), 0)
            if CAUSAL:
                rows = gl.expand_dims(start_m + gl.arange(0, BM, layout=gl.SliceLayout(1, LAYOUT)), 1)
                valid = (cols < Nk) & (cols <= rows + causal_offset)
            else:
                valid = (cols < Nk) & (
                    gl.expand_dims(start_m + gl.arange(0, BM, layout=gl.SliceLayout(1, LAYOUT)), 1) >= 0
                )
            sxm = gl.where(valid, sx, float("-inf"))
            sym = gl.where(valid, sy, float("-inf"))
        else:
            sxm = sx
            sym = sy
        if X_FIXED:
            mx_new = mx
        else:
            mx_new = gl.maximum(mx, gl.max(sxm, 1))
        if Y_FIXED:
            my_new = my
        else:
            my_new = gl.maximum(my, gl.max(sym, 1))
        px = gl.exp2(sxm - gl.expand_dims(mx_new, 1))
        if POLY == 1:
            py = _exp2_fma(sym - gl.expand_dims(my_new, 1))
        elif POLY == 2:
            if j % 2 == 1:
                py = _exp2_fma(sym - gl.expand_dims(my_new, 1))
            else:
                py = gl.exp2(sym - gl.expand_dims(my_new, 1))
        else:
            py = gl.exp2(sym - gl.expand_dims(my_new, 1))
        d = (sx - gl.expand_dims(mx_new, 1)) - (sy - gl.expand_dims(my_new, 1))
        ax = gl.exp2(mx - mx_new)
        ay = gl.exp2(my - my_new)
        c = ax * (c + lx * ((mx - mx_new) - (my - my_new))) + gl.sum(px * d, 1)
        lx = lx * ax + gl.sum(px, 1)
        ly = ly * ay + gl.sum(py, 1)
        return mx_new, my_new, lx, ly, c

    @gluon.jit
    def _ws_producer(
        qx_desc,
        kx_desc,
        qy_desc,
        ky_desc,
        qx_smem,
        qy_smem,
        kx_smem,
        ky_smem,
        q_bar,
        ready,
        empty,
        q_row0,
        kx_row0,
        ky_row0,
        n_blocks,
    ):
        STAGES: gl.constexpr = kx_smem.shape[0]
        BN: gl.constexpr = kx_smem.shape[1]
        HALF: gl.constexpr = qx_desc.block_type.shape[0]
        NC: gl.constexpr = qx_smem.shape[0]
        mbarrier.expect(q_bar, NC * (qx_desc.block_type.nbytes + qy_desc.block_type.nbytes))
        for i in gl.static_range(NC):
            tma_load(qx_desc, [q_row0 + i * HALF, 0], q_bar, qx_smem.index(i))
            tma_load(qy_desc, [q_row0 + i * HALF, 0], q_bar, qy_smem.index(i))
        for j in range(n_blocks):
            stage = j % STAGES
            mbarrier.wait(empty.index(stage), ((j // STAGES) & 1) ^ 1)
            bar = ready.index(stage)
            mbarrier.expect(bar, kx_desc.block_type.nbytes + ky_desc.block_type.nbytes)
            tma_load(kx_desc, [kx_row0 + j * BN, 0], bar, kx_smem.index(stage))
            tma_load(ky_desc, [ky_row0 + j * BN, 0], bar, ky_smem.index(stage))

    @gluon.jit
    def _ws_scores(
        qx, qy, kx_smem, ky_smem, ready, empty, turn, half, j, zero, PINGPONG: gl.constexpr, ABLATE: gl.constexpr
    ):
        STAGES: gl.constexpr = kx_smem.shape[0]
        stage = j % STAGES
        mbarrier.wait(ready.index(stage), (j // STAGES) & 1)
        NC: gl.constexpr = turn.shape[0]
        if PINGPONG > 0:
            # round robin: warpgroup 0 goes first, each then waits for the previous one's GEMMs of the block
            mbarrier.wait(turn.index(half), (j + (half == 0)) & 1)
        if ABLATE == 2:
            # update only: scores that differ per element (a uniform tile would fold into one value)
            BN_: gl.constexpr = zero.shape[1]
            BM_: gl.constexpr = zero.shape[0]
            colf = gl.arange(0, BN_, layout=gl.SliceLayout(0, zero.type.layout)).to(gl.float32)
            rowf = gl.arange(0, BM_, layout=gl.SliceLayout(1, zero.type.layout)).to(gl.float32)
            jf = (j % 7).to(gl.float32)
            sx = gl.expand_dims(rowf * 0.37, 1) + gl.expand_dims(colf * (0.11 + jf), 0)
            sy = gl.expand_dims(rowf * 0.23, 1) - gl.expand_dims(colf * (0.07 + jf), 0)
        else:
            sx = warpgroup_mma(qx, kx_smem.index(stage).permute((1, 0)), zero, use_acc=False, is_async=True)
            sy = warpgroup_mma(qy, ky_smem.index(stage).permute((1, 0)), zero, use_acc=False, is_async=True)
            if PINGPONG == 1:
                mbarrier.arrive(turn.index((half + 1) % NC), count=1)
            sx, sy = warpgroup_mma_wait(num_outstanding=0, deps=(sx, sy))
        if PINGPONG == 2:
            mbarrier.arrive(turn.index((half + 1) % NC), count=1)
        mbarrier.arrive(empty.index(stage), count=1)
        return sx, sy

    @gluon.jit
    def _ws_consumer(
        qx_smem,
        qy_smem,
        kx_smem,
        ky_smem,
        q_bar,
        ready,
        empty,
        turn,
        half,
        start_m0,
        pid_bh,
        n_blocks,
        Nq,
        Nk,
        causal_offset,
        scale_x,
        scale_y,
        LSEX_IN,
        LSEY_IN,
        KL_OUT,
        LSEX_OUT,
        LSEY_OUT,
        CAUSAL: gl.constexpr,
        X_FIXED: gl.constexpr,
        Y_FIXED: gl.constexpr,
        PINGPONG: gl.constexpr,
        POLY: gl.constexpr,
        ABLATE: gl.constexpr,
        FOLD: gl.constexpr,
    ):
        BM: gl.constexpr = qx_smem.shape[1]
        BN: gl.constexpr = kx_smem.shape[1]
        layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BN, 16])
        row_layout: gl.constexpr = gl.SliceLayout(1, layout)
        start_m = start_m0 + half * BM
        if CAUSAL:
            full_hi = gl.minimum(Nk, start_m + 1 + causal_offset)
        else:
            full_hi = Nk
        full_hi = gl.minimum(full_hi, (Nk // BN) * BN)
        n_full = gl.maximum(full_hi, 0) // BN
        rows = start_m + gl.arange(0, BM, layout=row_layout)
        row_ok = rows < Nq
        flat = pid_bh.to(gl.int64) * Nq + rows
        if X_FIXED:
            mx = gl.load(LSEX_IN + flat, mask=row_ok, other=0.0).to(gl.float32) * 1.4426950408889634
        else:
            mx = gl.full([BM], -1.0e30, gl.float32, row_layout)
        if Y_FIXED:
            my = gl.load(LSEY_IN + flat, mask=row_ok, other=0.0).to(gl.float32) * 1.4426950408889634
        else:
            my = gl.full([BM], -1.0e30, gl.float32, row_layout)
        lx = gl.zeros([BM], gl.float32, row_layout)
        ly = gl.zeros([BM], gl.float32, row_layout)
        c = gl.zeros([BM], gl.float32, row_layout)
        zero = gl.zeros([BM, BN], gl.float32, layout)
        qx = qx_smem.index(half)
        qy = qy_smem.index(half)
        mbarrier.wait(q_bar, 0)
        for j in range(0, n_full):
            sx, sy = _ws_scores(qx, qy, kx_smem, ky_smem, ready, empty, turn, half, j, zero, PINGPONG, ABLATE)
            mx, my, lx, ly, c = _ws_step(
                sx,
                sy,
                mx,
                my,
                lx,
                ly,
                c,
                start_m,
                j * BN,
                Nk,
                causal_offset,
                scale_x,
                scale_y,
                j,
                BM,
                BN,
                layout,
                False,
                CAUSAL,
                X_FIXED,
                Y_FIXED,
                POLY,
                ABLATE,
                FOLD,
            )
        for j in range(n_full, n_blocks):
            sx, sy = _ws_scores(qx, qy, kx_smem, ky_smem, ready, empty, turn, half, j, zero, PINGPONG, ABLATE)
            mx, my, lx, ly, c = _ws_step(
                sx,
                sy,
                mx,
                my,
                lx,
                ly,
                c,
                start_m,
                j * BN,
                Nk,
                causal_offset,
                scale_x,
                scale_y,
                j,
                BM,
                BN,
                layout,
                True,
                CAUSAL,
                X_FIXED,
                Y_FIXED,
                POLY,
                ABLATE,
                FOLD,
            )
        ok = (lx != 0) & (ly != 0)
        lxs = gl.where(ok, lx, 1.0)
        lys = gl.where(ok, ly, 1.0)
        kl2 = c / lxs - gl.log2(lxs) + gl.log2(lys)
        gl.store(KL_OUT + flat, gl.where(ok, kl2 * 0.6931471805599453, 0.0), mask=row_ok)
        gl.store(LSEX_OUT + flat, gl.where(ok, mx + gl.log2(lxs), 0.0), mask=row_ok)
        gl.store(LSEY_OUT + flat, gl.where(ok, my + gl.log2(lys), 0.0), mask=row_ok)

    @gluon.jit
    def attention_fwd_ws_kernel(
        qx_desc,
        kx_desc,
        qy_desc,
        ky_desc,
        LSEX_IN,
        LSEY_IN,
        KL_OUT,
        LSEX_OUT,
        LSEY_OUT,
        H,
        Nq,
        Nk,
        GX,
        GY,
        scale_x,
        scale_y,
        causal_offset,
        BN: gl.constexpr,
        STAGES: gl.constexpr,
        CAUSAL: gl.constexpr,
        X_FIXED: gl.constexpr,
        Y_FIXED: gl.constexpr,
        CONSUMER_REGS: gl.constexpr,
        PRODUCER_REGS: gl.constexpr,
        PINGPONG: gl.constexpr,
        POLY: gl.constexpr,
        ABLATE: gl.constexpr,
        FOLD: gl.constexpr,
        NC: gl.constexpr,
        num_warps: gl.constexpr,
    ):
        HALF: gl.constexpr = qx_desc.block_type.shape[0]
        gl.static_assert(num_warps == 4)
        gl.static_assert(NC == 2 or NC == 3)
        pid_m = gl.num_programs(0) - 1 - gl.program_id(0)
        pid_bh = gl.program_id(1)
        b = pid_bh // H
        h = pid_bh % H
        start_m0 = pid_m * (NC * HALF)
        q_row0 = pid_bh * Nq + start_m0
        kx_row0 = (b * (H // GX) + h // GX) * Nk
        ky_row0 = (b * (H // GY) + h // GY) * Nk
        if CAUSAL:
            hi = gl.minimum(Nk, start_m0 + NC * HALF + causal_offset)
        else:
            hi = Nk
        n_blocks = (hi + BN - 1) // BN

        qx_smem = gl.allocate_shared_memory(qx_desc.dtype, [NC] + qx_desc.block_type.shape, qx_desc.layout)
        qy_smem = gl.allocate_shared_memory(qy_desc.dtype, [NC] + qy_desc.block_type.shape, qy_desc.layout)
        kx_smem = gl.allocate_shared_memory(kx_desc.dtype, [STAGES] + kx_desc.block_type.shape, kx_desc.layout)
        ky_smem = gl.allocate_shared_memory(ky_desc.dtype, [STAGES] + ky_desc.block_type.shape, ky_desc.layout)
        q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        turn = gl.allocate_shared_memory(gl.int64, [NC, 1], mbarrier.MBarrierLayout())
        mbarrier.init(q_bar, count=1)
        for i in gl.static_range(NC):
            mbarrier.init(turn.index(i), count=1)
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=NC)

        # fmt: off
        if NC == 2:
            gl.warp_specialize(
                [
                    (
                        _ws_consumer,
                        (qx_smem, qy_smem, kx_smem, ky_smem, q_bar, ready, empty, turn, 0, start_m0,
                         pid_bh, n_blocks, Nq, Nk, causal_offset, scale_x, scale_y, LSEX_IN, LSEY_IN,
                         KL_OUT, LSEX_OUT, LSEY_OUT, CAUSAL, X_FIXED, Y_FIXED, PINGPONG, POLY, ABLATE, FOLD),
                    ),
                    (
                        _ws_consumer,
                        (qx_smem, qy_smem, kx_smem, ky_smem, q_bar, ready, empty, turn, 1, start_m0,
                         pid_bh, n_blocks, Nq, Nk, causal_offset, scale_x, scale_y, LSEX_IN, LSEY_IN,
                         KL_OUT, LSEX_OUT, LSEY_OUT, CAUSAL, X_FIXED, Y_FIXED, PINGPONG, POLY, ABLATE, FOLD),
                    ),
                    (
                        _ws_producer,
                        (qx_desc, kx_desc, qy_desc, ky_desc, qx_smem, qy_smem, kx_smem, ky_smem, q_bar, ready, empty,
                         q_row0, kx_row0, ky_row0, n_blocks),
                    ),
                ],
                [4, 1],
                [CONSUMER_REGS, PRODUCER_REGS],
            )
        else:
            gl.warp_specialize(
                [
                    (
                        _ws_consumer,
                        (qx_smem, qy_smem, kx_smem, ky_smem, q_bar, ready, empty, turn, 0, start_m0,
                         pid_bh, n_blocks, Nq, Nk, causal_offset, scale_x, scale_y, LSEX_IN, LSEY_IN,
                         KL_OUT, LSEX_OUT, LSEY_OUT, CAUSAL, X_FIXED, Y_FIXED, PINGPONG, POLY, ABLATE, FOLD),
                    ),
                    (
                        _ws_consumer,
                        (qx_smem, qy_smem, kx_smem, ky_smem, q_bar, ready, empty, turn, 1, start_m0,
                         pid_bh, n_blocks, Nq, Nk, causal_offset, scale_x, scale_y, LSEX_IN, LSEY_IN,
                         KL_OUT, LSEX_OUT, LSEY_OUT, CAUSAL, X_FIXED, Y_FIXED, PINGPONG, POLY, ABLATE, FOLD),
                    ),
                    (
                        _ws_consumer,
                        (qx_smem, qy_smem, kx_smem, ky_smem, q_bar, ready, empty, turn, 2, start_m0,
                         pid_bh, n_blocks, Nq, Nk, causal_offset, scale_x, scale_y, LSEX_IN, LSEY_IN,
                         KL_OUT, LSEX_OUT, LSEY_OUT, CAUSAL, X_FIXED, Y_FIXED, PINGPONG, POLY, ABLATE, FOLD),
                    ),
                    (
                        _ws_producer,
                        (qx_desc, kx_desc, qy_desc, ky_desc, qx_smem, qy_smem, kx_smem, ky_smem, q_bar, ready, empty,
                         q_row0, kx_row0, ky_row0, n_blocks),
                    ),
                ],
                [4, 4, 1],
                [CONSUMER_REGS, CONSUMER_REGS, PRODUCER_REGS],
            )
        # fmt: on


def tile_desc(t: torch.Tensor, rows: int):
    """TMA descriptor of a contiguous [B, H, N, D] 16-bit tensor seen as [B*H*N, D], tiles of [rows, D]."""
    flat = t.view(-1, t.shape[-1])
    dtype = gl.bfloat16 if t.dtype == torch.bfloat16 else gl.float16
    layout = gl.NVMMASharedLayout.get_default_for([rows, t.shape[-1]], dtype)
    return TensorDescriptor(flat, list(flat.shape), list(flat.stride()), [rows, t.shape[-1]], layout)


def ws_forward(
    X: Side, Y: Side, spec: AttnSpec, lse_x=None, *, BN=128, stages=2, pingpong=2, fold=1, poly=0, ablate=0, nc=2
):
    """(kl natural, lse_x, lse_y log2) [B, H, Nq] as triton_forward returns them; lse_x: a fixed teacher lse."""
    B, H, Nq, _ = X.q.shape
    Nk = X.k.shape[2]
    kl = torch.empty((B, H, Nq), dtype=torch.float32, device=X.q.device)
    lsx, lsy = torch.empty_like(kl), torch.empty_like(kl)
    lx_in = kl if lse_x is None else lse_x.float().contiguous()
    grid = ((Nq + nc * HALF - 1) // (nc * HALF), B * H)
    attention_fwd_ws_kernel[grid](
        tile_desc(X.q, HALF), tile_desc(X.k, BN), tile_desc(Y.q, HALF), tile_desc(Y.k, BN),
        lx_in, kl, kl, lsx, lsy,
        H, Nq, Nk, H // X.k.shape[1], H // Y.k.shape[1], X.scale * LOG2E, Y.scale * LOG2E,
        spec.causal_offset if spec.is_causal else 0,
        BN=BN, STAGES=stages, CAUSAL=spec.is_causal, X_FIXED=lse_x is not None, Y_FIXED=False,
        CONSUMER_REGS=240 if nc == 2 else 160, PRODUCER_REGS=24, PINGPONG=pingpong, POLY=poly, ABLATE=ablate, FOLD=fold,
        NC=nc, num_warps=4,
    )  # fmt: skip
    return kl, lsx, lsy


def make_case(B, H, Nq, Nk, Ds, Dt, hs, ht, dtype, causal, off, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)

    def r(*shape):
        return (torch.randn(*shape, generator=g) * 1.5).to("cuda", dtype)

    q_s, k_s, q_t, k_t = r(B, H, Nq, Ds), r(B, hs, Nk, Ds), r(B, H, Nq, Dt), r(B, ht, Nk, Dt)
    X, Y = Side(q_t, k_t, Dt**-0.5), Side(q_s, k_s, Ds**-0.5)  # forward KL: x = teacher
    spec = AttnSpec(is_causal=causal, causal_offset=off, scale_s=Y.scale, scale_t=X.scale, direction="forward")
    return X, Y, spec


CHECK_VARIANTS = [
    dict(pingpong=0, fold=0),
    dict(pingpong=2, fold=0),
    dict(pingpong=2, fold=1),
    dict(pingpong=2, fold=1, poly=1),
    dict(nc=3, BN=64, stages=3, pingpong=0, fold=1),
    dict(nc=3, BN=128, stages=2, pingpong=0, fold=1),
    dict(nc=3, BN=128, stages=2, pingpong=2, fold=1),
]
TIME_VARIANTS = {  # name: ws_forward options; --variants picks (default: all)
    "WS pp0": dict(pingpong=0, fold=0),
    "WS pp1": dict(pingpong=1, fold=0),
    "WS pp2": dict(pingpong=2, fold=0),
    "WS pp0 fold": dict(pingpong=0, fold=1),
    "WS pp2 fold": dict(pingpong=2, fold=1),
    "WS pp2 fold poly every 2nd": dict(pingpong=2, fold=1, poly=2),
    "WS pp2 fold poly": dict(pingpong=2, fold=1, poly=1),
    "WS pp0 GEMMs only": dict(pingpong=0, ablate=1),
    "WS pp0 update only": dict(pingpong=0, fold=0, ablate=2),
    "WS pp0 fold update only": dict(pingpong=0, fold=1, ablate=2),
    "WS3 BN64 st3 fold": dict(nc=3, BN=64, stages=3, pingpong=0, fold=1),
    "WS3 BN64 st2 fold": dict(nc=3, BN=64, stages=2, pingpong=0, fold=1),
    "WS3 BN128 st2 fold": dict(nc=3, BN=128, stages=2, pingpong=0, fold=1),
    "WS3 BN128 st2 fold pp2": dict(nc=3, BN=128, stages=2, pingpong=2, fold=1),
    "WS3 BN64 st3 fold pp2": dict(nc=3, BN=64, stages=3, pingpong=2, fold=1),
    "WS3 BN64 st3 GEMMs only": dict(nc=3, BN=64, stages=3, pingpong=0, ablate=1),
    "WS3 BN64 st3 fold update only": dict(nc=3, BN=64, stages=3, pingpong=0, fold=1, ablate=2),
}


def check() -> bool:
    print("## Rows against the library's Triton forward (max abs difference: KL per row / lse_x / lse_y)\n")
    print("| case | " + " | ".join(str(v) for v in CHECK_VARIANTS) + " |")
    print("|---|" + "---|" * len(CHECK_VARIANTS))
    cases = [
        ("causal N=1000 D=64 B=2", (2, 3, 1000, 1000, 64, 64, 3, 3, torch.bfloat16, True, 0)),
        ("non-causal N=333", (1, 4, 333, 333, 128, 128, 4, 4, torch.bfloat16, False, 0)),
        ("GQA 8/2 (s) 8/4 (t), Ds=64 Dt=128, N=517", (1, 8, 517, 517, 64, 128, 2, 4, torch.bfloat16, True, 0)),
        ("fp16 Nq=200 Nk=461 offset 261, Ds=32", (1, 2, 200, 461, 32, 128, 2, 2, torch.float16, True, 261)),
        ("offset 37, Ds=16 Dt=64, N=300", (1, 2, 300, 300, 16, 64, 1, 2, torch.bfloat16, True, 37)),
        ("causal N=4096 H=32 D=128", (1, 32, 4096, 4096, 128, 128, 32, 32, torch.bfloat16, True, 0)),
    ]
    worst = 0.0
    for name, args in cases:
        X, Y, spec = make_case(*args)
        ref = triton_forward(X, Y, None, spec)
        cells = []
        for v in CHECK_VARIANTS:
            got = ws_forward(X, Y, spec, **v)
            d = [(a - b).abs().max().item() for a, b in zip(got, ref)]
            worst = max(worst, *d) if all(torch.isfinite(g).all() for g in got) else float("inf")
            cells.append(" / ".join(f"{x:.1e}" for x in d))
        print(f"| {name} | " + " | ".join(cells) + " |")
    X, Y, spec = make_case(1, 2, 700, 700, 128, 128, 2, 2, torch.bfloat16, True, 0)
    lse_t = triton_forward(X, Y, None, spec)[1] / LOG2E
    ref = triton_forward(X, Y, None, spec, lse_x=lse_t)
    d = (ws_forward(X, Y, spec, lse_t)[0] - ref[0]).abs().max().item()
    print(f"\nteacher lse given (N=700): max abs KL row difference {d:.1e}")
    ok = max(worst, d) < 1e-4
    print(f"\nall within 1e-4: {ok}\n")
    return ok


def timing(ns, rounds, variants):
    print("## B=1, H=32, D=128, bf16, causal: forward kernel ms (median of rounds, each a 5-run CUDA-event median)\n")
    names = ["Triton fwd (library)", "Gluon fwd (library)"] + variants + ["SDPA default fwd"]
    print(
        "| N | "
        + " | ".join(names)
        + " | best full WS / library Gluon | best full WS / SDPA | TFLOP/s best full WS / SDPA |"
    )
    print("|---|" + "---|" * (len(names) + 3))
    dev = torch.device("cuda")
    for n in ns:
        X, Y, spec = make_case(1, 32, n, n, 128, 128, 32, 32, torch.bfloat16, True, 0)
        fns = [
            lambda: triton_forward(X, Y, None, spec),
            lambda: triton_forward(X, Y, None, spec, cfg={"fwd_kernel": "gluon"}),
        ]
        fns += [lambda v=TIME_VARIANTS[name]: ws_forward(X, Y, spec, **v) for name in variants]
        fns += [lambda: F.scaled_dot_product_attention(Y.q, Y.k, X.q, is_causal=True)]
        samples = [[] for _ in fns]
        for _ in range(rounds):  # interleaved: clocks and thermals drift between rounds, not within a comparison
            for i, fn in enumerate(fns):
                samples[i].append(time_ms(fn, dev, warmup=2, reps=5))
        t = [statistics.median(s) for s in samples]
        full = [t[2 + i] for i, name in enumerate(variants) if "only" not in name]
        best, sdpa = min(full), t[-1]
        flops = 4 * 32 * n * n * 128 / 2
        print(
            f"| {n} | " + " | ".join(f"{x:.3f}" for x in t)
            + f" | {best / t[1]:.2f} | {best / sdpa:.2f} | {flops / best / 1e9:.0f} / {flops / sdpa / 1e9:.0f} |",
            flush=True,
        )  # fmt: skip


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ns", type=int, nargs="+", default=[4096, 8192, 16384])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--no-check", action="store_true")
    p.add_argument("--variants", nargs="+", default=list(TIME_VARIANTS), choices=list(TIME_VARIANTS))
    a = p.parse_args()
    if not (kg.HAVE_GLUON and torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)):
        print("needs an sm90 GPU and Triton with Gluon")
        return 0
    print(torch.cuda.get_device_name(), "torch", torch.__version__, "triton", kg.TRITON_VERSION, "\n")
    ok = True if a.no_check else check()
    timing(a.ns, a.rounds, a.variants)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
