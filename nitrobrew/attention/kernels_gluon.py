"""Gluon forward of attention KL for Hopper (sm90): asynchronous warpgroup MMA under the softmax work.

Experimental. ``api.py`` selects it on sm90 for the cases it supports (``gluon_forward_supported``)
when asked, or by itself where it was measured faster (``gluon_forward_enabled``: Nq >= 4096 on the
Triton release it was tested with); the Triton kernel of ``kernels_fwd.py`` stays the portable path
and the reference it is tested against.

Why: in Triton's ``tl.dot`` forward the two score GEMMs of a key block and the two exponentials per
score run one after the other (benchmarks/results/attention/fwd_tma_h100.md). Two kernels here:

- ``attention_fwd_gluon_kernel`` (one warpgroup of 64 query rows a program): the program issues the
  next key block's two score GEMMs (``warpgroup_mma(..., is_async=True)``) and then does this block's
  online-KL update while the tensor cores work. Key tiles come through TMA into a ring of STAGES
  buffers (one mbarrier each); the query tiles stay in shared memory as the A operands.
- ``attention_fwd_gluon_ws_kernel`` (warp-specialized, FlashAttention-3's structure; the default from
  WS_MIN_ROWS query rows on): a producer warp fills a ring of 128-key blocks for three consumer
  warpgroups of 64 query rows each (``gl.warp_specialize``, registers moved to the consumers by
  ``setmaxnreg``), each releasing a buffer through an ``empty`` mbarrier. The update alone (two
  exponentials a score pair) takes about SDPA's whole forward time, so what pays is overlap: while one
  warpgroup waits on its GEMMs, the other two's exponentials run (benchmarks/results/attention/
  gluon_ws_h100.md). The tensor pipe and the exponential unit are each still idle about 45% of the time,
  the warps held at the warpgroup barriers around each key block (gluon_profile_h100.md there).

The math is the Triton forward's (docs/design.md §3), the scale taken inside each exponent's FMA
(``_kl_update``; same maxima, arguments rounded once): scores in log2 units (the scale folds in
log2(e), and must be > 0), the centred online state (m_x, m_y, l_x, l_y, c), the unmasked key blocks
first and the blocks that cut the causal diagonal or end past Nk masked, query blocks longest
first; it writes KL (natural units) and both lse's (log2 units) per row, so the Triton backward
runs on its outputs unchanged.

Operands are viewed as 2-D [rows, head_dim] (the [B, H, N, D] tensors contiguous): a key tile that
runs past Nk reads the next head's keys (masked out, finite), and TMA zero-fills past the end.
Case: 16-bit inputs, head dims 16/32/64/128 (each side its own), no key padding mask, causal
offsets >= 0, Nk > 0.
"""

from __future__ import annotations

import functools
import os
import warnings
from typing import Optional

import torch

from ..core.launch import launch, remember_spec

try:  # Gluon ships with Triton >= 3.5; the names below are those of Triton 3.6 (and 3.9: tma_load)
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    # TMA's global-to-shared copy: `async_copy_global_to_shared` up to Triton 3.6, `async_load` later (the
    # old name raises there); same arguments
    tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared

    # The Triton forward's row outputs, called as they are: a @triton.jit helper called from a @gluon.jit
    # function compiles with Gluon's semantics, on the caller's layouts.
    from .kernels_fwd import _store_rows
    from .kernels_tiles import key_bytes_per_query_head, program_grid, program_ids

    HAVE_GLUON = True
    TRITON_VERSION = __import__("triton").__version__
except ImportError:  # pragma: no cover - depends on the installed Triton
    HAVE_GLUON = False
    TRITON_VERSION = ""

LOG2E = 1.4426950408889634
HEAD_DIMS = (16, 32, 64, 128)
# The forward launched unless asked otherwise: the warp-specialized kernel (attention_fwd_gluon_ws_kernel).
# 0.79-0.96x the one-warpgroup kernel's time at N = 8192-32768 on an H100
# (benchmarks/results/attention/gluon_ws_h100.md).
WARP_SPECIALIZED = "warp_specialized"
# ... from this many query rows on; below, the one-warpgroup kernel (the warp-specialized one measured
# 1.11-1.15x its time at N = 2048-4096: fewer programs than the 3 x 64-row split needs to fill the GPU).
WS_MIN_ROWS = 8192
ONE_WARPGROUP = "one_warpgroup"
# Its shape: 3 consumer warpgroups of 64 query rows at 160 registers, key blocks of 128 in a ring of 2
# (3 x 2 query tiles and 2 x 2 key tiles of head dim 128 in bf16: 224 KiB of shared memory), a producer
# warp at 24 registers (3 x 160 + 24 <= 512 registers a thread of each warpgroup slot).
WS_ROWS, WS_BN, WS_STAGES, WS_CONSUMER_REGS, WS_PRODUCER_REGS = 64, 128, 2, 160, 24
# (BM, BN, num_warps, STAGES) of the one-warpgroup kernel (attention_fwd_gluon_kernel), asked for by a
# config tuple: one warpgroup of 64 query rows; BN = 64 keeps the in-flight and the current score tiles
# of both sides (4 x 32 fp32 registers a thread) with room for the update, and two stages let two
# programs share an SM (registers and shared memory), whose GEMMs and updates interleave. Measured on
# H100: benchmarks/results/attention/gluon_fwd.md.
DEFAULT_CONFIG = (64, 64, 4, 2)
ENV_SWITCH = "NITROBREW_ATTN_GLUON"  # "1": use this forward where supported; "0" never
# Chosen without being asked from this many query rows on (H100: the warp-specialized kernel 0.75-0.92x
# the Triton forward's time at N = 8192-131072; the one-warpgroup kernel 0.83x its kernel time and 0.95x
# a call's time at 4096; at 2048 its launch's extra host time outweighs the kernel's gain, 1.10x a call:
# benchmarks/results/attention/small_n_h100.md), on the Triton releases it was tested with.
AUTO_MIN_ROWS = 4096
TESTED_TRITON = ("3.6.",)
FAILED = False  # set by note_failure


if HAVE_GLUON:

    @gluon.jit
    def _visible_pairs(
        start_m,
        start_n,
        Nq,
        Nk,
        causal_offset,
        BM: gl.constexpr,
        BN: gl.constexpr,
        LAYOUT: gl.constexpr,
        CAUSAL: gl.constexpr,
        ROWS_TOO: gl.constexpr,
    ):
        """The visible (query row, key) pairs of a [BM, BN] tile at (start_m, start_n): keys < Nk, causal,
        and with ROWS_TOO query rows < Nq (rows past Nq matter where a tile's columns are summed: dk)."""
        cols = gl.expand_dims(start_n + gl.arange(0, BN, layout=gl.SliceLayout(0, LAYOUT)), 0)
        valid = cols < Nk
        if CAUSAL or ROWS_TOO:
            rows = gl.expand_dims(start_m + gl.arange(0, BM, layout=gl.SliceLayout(1, LAYOUT)), 1)
            if ROWS_TOO:
                valid = valid & (rows < Nq)
            if CAUSAL:
                valid = valid & (cols <= rows + causal_offset)
        return valid

    @gluon.jit
    def _kl_update(
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
        BM: gl.constexpr,
        BN: gl.constexpr,
        LAYOUT: gl.constexpr,
        MASKED: gl.constexpr,
        CAUSAL: gl.constexpr,
        X_FIXED: gl.constexpr,
        Y_FIXED: gl.constexpr,
    ):
        """The row state after one key block from the raw (unscaled) scores: kernels_fwd._online_step's math
        with the scale inside each exponent's FMA. max(s * scale) = scale * max(s) for scale > 0 (rounding
        is monotonic), so the maxima are the same; the arguments x - m_x, y - m_y are rounded once instead
        of twice, and the centred difference reuses them. 26% fewer FP32 instructions a score pair;
        benchmarks/results/attention/gluon_ws_h100.md."""
        if MASKED:
            valid = _visible_pairs(start_m, start_n, 0, Nk, causal_offset, BM, BN, LAYOUT, CAUSAL, False)
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
        arg_x = sx * scale_x - gl.expand_dims(mx_new, 1)
        arg_y = sy * scale_y - gl.expand_dims(my_new, 1)
        if MASKED:
            px = gl.exp2(gl.where(valid, arg_x, float("-inf")))
            py = gl.exp2(gl.where(valid, arg_y, float("-inf")))
        else:
            px = gl.exp2(arg_x)
            py = gl.exp2(arg_y)
        ax = gl.exp2(mx - mx_new)
        ay = gl.exp2(my - my_new)
        c = ax * (c + lx * ((mx - mx_new) - (my - my_new))) + gl.sum(px * (arg_x - arg_y), 1)
        lx = lx * ax + gl.sum(px, 1)
        ly = ly * ay + gl.sum(py, 1)
        return mx_new, my_new, lx, ly, c

    @gluon.jit
    def _kl_block(
        sx,
        sy,
        mx,
        my,
        lx,
        ly,
        c,
        start_m,
        block,
        n_full,
        Nk,
        causal_offset,
        scale_x,
        scale_y,
        BM: gl.constexpr,
        BN: gl.constexpr,
        LAYOUT: gl.constexpr,
        CAUSAL: gl.constexpr,
        X_FIXED: gl.constexpr,
        Y_FIXED: gl.constexpr,
    ):
        """_kl_update of key block `block`: unmasked below n_full, masked from there on."""
        if block < n_full:
            mx, my, lx, ly, c = _kl_update(
                sx, sy, mx, my, lx, ly, c, start_m, block * BN, Nk, causal_offset, scale_x, scale_y,
                BM, BN, LAYOUT, False, CAUSAL, X_FIXED, Y_FIXED,
            )  # fmt: skip
        else:
            mx, my, lx, ly, c = _kl_update(
                sx, sy, mx, my, lx, ly, c, start_m, block * BN, Nk, causal_offset, scale_x, scale_y,
                BM, BN, LAYOUT, True, CAUSAL, X_FIXED, Y_FIXED,
            )  # fmt: skip
        return mx, my, lx, ly, c

    @gluon.jit
    def _init_rows(
        LSEX_IN, LSEY_IN, flat, row_ok, ROW_LAYOUT: gl.constexpr, X_FIXED: gl.constexpr, Y_FIXED: gl.constexpr
    ):
        """The row state (m_x, m_y, l_x, l_y, c) before the first key block (kernels_fwd._init_state):
        the maxima start at the given lse's (log2 units) where fixed."""
        if X_FIXED:
            mx = gl.load(LSEX_IN + flat, mask=row_ok, other=0.0).to(gl.float32) * 1.4426950408889634
        else:
            mx = gl.full(flat.shape, -1.0e30, gl.float32, ROW_LAYOUT)
        if Y_FIXED:
            my = gl.load(LSEY_IN + flat, mask=row_ok, other=0.0).to(gl.float32) * 1.4426950408889634
        else:
            my = gl.full(flat.shape, -1.0e30, gl.float32, ROW_LAYOUT)
        zeros = gl.zeros(flat.shape, gl.float32, ROW_LAYOUT)
        return mx, my, zeros, zeros, zeros

    @gluon.jit
    def _key_blocks(start_m, rows, Nk, causal_offset, BN: gl.constexpr, CAUSAL: gl.constexpr):
        """Key blocks of query rows [start_m, start_m + rows) (kernels_tiles.key_ranges): [0, n_full)
        unmasked, [n_full, n_blocks) masked."""
        if CAUSAL:
            hi = gl.minimum(Nk, start_m + rows + causal_offset)
            full_hi = gl.minimum(Nk, start_m + 1 + causal_offset)
        else:
            hi = Nk
            full_hi = Nk
        full_hi = gl.minimum(full_hi, (Nk // BN) * BN)
        return gl.maximum(full_hi, 0) // BN, (hi + BN - 1) // BN

    @gluon.jit
    def _program_origin(H, Nq, Nk, GX, GY, heads_per_section, ROWS: gl.constexpr):
        """Program = (ROWS query rows, batch * head), longest query blocks first (causal): the head, its
        first query row and the first rows of its query tile and of both sides' key heads in the [rows, D]
        views."""
        pid_m, pid_bh = program_ids(Nq, heads_per_section, ROWS, True)
        b = pid_bh // H
        h = pid_bh % H
        start_m = pid_m * ROWS
        q_row0 = pid_bh * Nq + start_m
        kx_row0 = (b * (H // GX) + h // GX) * Nk
        ky_row0 = (b * (H // GY) + h // GY) * Nk
        return pid_bh, start_m, q_row0, kx_row0, ky_row0

    @gluon.jit
    def _load_keys(kx_desc, ky_desc, kx_smem, ky_smem, ready, block, kx_row0, ky_row0, BN: gl.constexpr, pred):
        """TMA both key tiles of key block `block` into buffer block % STAGES (if pred)."""
        stage = block % kx_smem.shape[0]
        bar = ready.index(stage)
        mbarrier.expect(bar, kx_desc.block_type.nbytes + ky_desc.block_type.nbytes, pred=pred)
        tma_load(kx_desc, [kx_row0 + block * BN, 0], bar, kx_smem.index(stage), pred=pred)
        tma_load(ky_desc, [ky_row0 + block * BN, 0], bar, ky_smem.index(stage), pred=pred)

    @gluon.jit
    def _issue_scores(qx_smem, qy_smem, kx_smem, ky_smem, ready, block, zero):
        """Wait for key block `block` and issue its two score GEMMs asynchronously."""
        STAGES: gl.constexpr = kx_smem.shape[0]
        stage = block % STAGES
        mbarrier.wait(ready.index(stage), (block // STAGES) & 1)
        sx = warpgroup_mma(qx_smem, kx_smem.index(stage).permute((1, 0)), zero, use_acc=False, is_async=True)
        sy = warpgroup_mma(qy_smem, ky_smem.index(stage).permute((1, 0)), zero, use_acc=False, is_async=True)
        return sx, sy

    @gluon.jit
    def attention_fwd_gluon_kernel(
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
        heads_per_section,
        BN: gl.constexpr,
        STAGES: gl.constexpr,
        CAUSAL: gl.constexpr,
        X_FIXED: gl.constexpr,
        Y_FIXED: gl.constexpr,
        num_warps: gl.constexpr,
    ):
        BM: gl.constexpr = qx_desc.block_type.shape[0]
        # one warpgroup: its wgmma wait is what frees a key buffer for the next TMA load
        gl.static_assert(num_warps == 4)
        gl.static_assert(BM == 64)
        layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, BN, 16]
        )
        row_layout: gl.constexpr = gl.SliceLayout(1, layout)

        pid_bh, start_m, q_row0, kx_row0, ky_row0 = _program_origin(H, Nq, Nk, GX, GY, heads_per_section, BM)

        n_full, n_blocks = _key_blocks(start_m, BM, Nk, causal_offset, BN, CAUSAL)

        qx_smem = gl.allocate_shared_memory(qx_desc.dtype, qx_desc.block_type.shape, qx_desc.layout)
        qy_smem = gl.allocate_shared_memory(qy_desc.dtype, qy_desc.block_type.shape, qy_desc.layout)
        kx_smem = gl.allocate_shared_memory(kx_desc.dtype, [STAGES] + kx_desc.block_type.shape, kx_desc.layout)
        ky_smem = gl.allocate_shared_memory(ky_desc.dtype, [STAGES] + ky_desc.block_type.shape, ky_desc.layout)
        q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        mbarrier.init(q_bar, count=1)
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=1)

        mbarrier.expect(q_bar, qx_desc.block_type.nbytes + qy_desc.block_type.nbytes)
        tma_load(qx_desc, [q_row0, 0], q_bar, qx_smem)
        tma_load(qy_desc, [q_row0, 0], q_bar, qy_smem)
        for i in gl.static_range(STAGES):
            _load_keys(kx_desc, ky_desc, kx_smem, ky_smem, ready, i, kx_row0, ky_row0, BN, i < n_blocks)

        rows = start_m + gl.arange(0, BM, layout=row_layout)
        row_ok = rows < Nq
        flat = pid_bh.to(gl.int64) * Nq + rows
        mx, my, lx, ly, c = _init_rows(LSEX_IN, LSEY_IN, flat, row_ok, row_layout, X_FIXED, Y_FIXED)
        zero = gl.zeros([BM, BN], gl.float32, layout)

        mbarrier.wait(q_bar, 0)
        # Two sets of score tiles, a and b, take turns: while one block's GEMMs run on the tensor cores
        # the other set's block updates the state. Unrolled by two so that a tile set is never copied
        # while its GEMMs are in flight (a loop-carried copy makes ptxas serialize the wgmma's).
        sxa, sya = _issue_scores(qx_smem, qy_smem, kx_smem, ky_smem, ready, 0, zero)
        for p in range(0, (n_blocks - 1) // 2):
            j = 2 * p
            sxa, sya = warpgroup_mma_wait(num_outstanding=0, deps=(sxa, sya))
            _load_keys(
                kx_desc, ky_desc, kx_smem, ky_smem, ready, j + STAGES, kx_row0, ky_row0, BN, j + STAGES < n_blocks
            )
            sxb, syb = _issue_scores(qx_smem, qy_smem, kx_smem, ky_smem, ready, j + 1, zero)
            mx, my, lx, ly, c = _kl_block(
                sxa, sya, mx, my, lx, ly, c, start_m, j, n_full, Nk, causal_offset, scale_x, scale_y,
                BM, BN, layout, CAUSAL, X_FIXED, Y_FIXED,
            )  # fmt: skip
            sxb, syb = warpgroup_mma_wait(num_outstanding=0, deps=(sxb, syb))
            _load_keys(
                kx_desc, ky_desc, kx_smem, ky_smem, ready, j + 1 + STAGES, kx_row0, ky_row0, BN,
                j + 1 + STAGES < n_blocks,
            )  # fmt: skip
            sxa, sya = _issue_scores(qx_smem, qy_smem, kx_smem, ky_smem, ready, j + 2, zero)
            mx, my, lx, ly, c = _kl_block(
                sxb, syb, mx, my, lx, ly, c, start_m, j + 1, n_full, Nk, causal_offset, scale_x, scale_y,
                BM, BN, layout, CAUSAL, X_FIXED, Y_FIXED,
            )  # fmt: skip
        # set a holds block 2 * ((n_blocks - 1) // 2); one or two blocks are left
        sxa, sya = warpgroup_mma_wait(num_outstanding=0, deps=(sxa, sya))
        if (n_blocks - 1) % 2 == 1:
            sxb, syb = _issue_scores(qx_smem, qy_smem, kx_smem, ky_smem, ready, n_blocks - 1, zero)
            mx, my, lx, ly, c = _kl_block(
                sxa, sya, mx, my, lx, ly, c, start_m, n_blocks - 2, n_full, Nk, causal_offset, scale_x, scale_y,
                BM, BN, layout, CAUSAL, X_FIXED, Y_FIXED,
            )  # fmt: skip
            sxb, syb = warpgroup_mma_wait(num_outstanding=0, deps=(sxb, syb))
            mx, my, lx, ly, c = _kl_block(
                sxb, syb, mx, my, lx, ly, c, start_m, n_blocks - 1, n_full, Nk, causal_offset, scale_x, scale_y,
                BM, BN, layout, CAUSAL, X_FIXED, Y_FIXED,
            )  # fmt: skip
        else:
            mx, my, lx, ly, c = _kl_block(
                sxa, sya, mx, my, lx, ly, c, start_m, n_blocks - 1, n_full, Nk, causal_offset, scale_x, scale_y,
                BM, BN, layout, CAUSAL, X_FIXED, Y_FIXED,
            )  # fmt: skip

        mbarrier.invalidate(q_bar)
        for i in gl.static_range(STAGES):
            mbarrier.invalidate(ready.index(i))

        _store_rows(mx, my, lx, ly, c, flat, row_ok, KL_OUT, LSEX_OUT, LSEY_OUT)

    @gluon.jit
    def _ws_load_partition(
        fx_desc,
        sx_desc,
        fy_desc,
        sy_desc,
        fx_smem,
        fy_smem,
        sx_smem,
        sy_smem,
        fixed_bar,
        ready,
        empty,
        fixed_row0,
        sx_row0,
        sy_row0,
        head_rows,
        heads,
        j_lo,
        j_hi,
    ):
        """The producer warp of the warp-specialized kernels: each consumer's fixed tiles of both sides (rows
        fixed_row0 + i * rows), then blocks [j_lo, j_hi) of both sides' streamed rows into the ring, block by
        block and within a block for each of `heads` heads head_rows apart, each as soon as every consumer has
        released its buffer. Forward and dq: fixed query tiles, streamed key blocks of one head; dk: fixed key
        tiles, streamed query blocks of every query head sharing the kv head (block-major, so that the programs
        running at once read the same query blocks while they are in L2)."""
        STAGES: gl.constexpr = sx_smem.shape[0]
        BS: gl.constexpr = sx_smem.shape[1]
        PARTS: gl.constexpr = fx_smem.shape[0]
        ROWS: gl.constexpr = fx_smem.shape[1]
        mbarrier.expect(fixed_bar, PARTS * (fx_desc.block_type.nbytes + fy_desc.block_type.nbytes))
        for i in gl.static_range(PARTS):
            tma_load(fx_desc, [fixed_row0 + i * ROWS, 0], fixed_bar, fx_smem.index(i))
            tma_load(fy_desc, [fixed_row0 + i * ROWS, 0], fixed_bar, fy_smem.index(i))
        t = 0
        for j in range(j_lo, j_hi):
            for h in range(heads):
                stage = t % STAGES
                # a fresh barrier passes a wait on the parity before its first phase: the first round is free
                mbarrier.wait(empty.index(stage), ((t // STAGES) & 1) ^ 1)
                bar = ready.index(stage)
                mbarrier.expect(bar, sx_desc.block_type.nbytes + sy_desc.block_type.nbytes)
                tma_load(sx_desc, [sx_row0 + h * head_rows + j * BS, 0], bar, sx_smem.index(stage))
                tma_load(sy_desc, [sy_row0 + h * head_rows + j * BS, 0], bar, sy_smem.index(stage))
                t += 1

    @gluon.jit
    def _ws_scores(qx, qy, kx_smem, ky_smem, ready, empty, j, zero):
        """Key block j's two score tiles; its buffer is released once both GEMMs have read it."""
        STAGES: gl.constexpr = kx_smem.shape[0]
        stage = j % STAGES
        mbarrier.wait(ready.index(stage), (j // STAGES) & 1)
        sx = warpgroup_mma(qx, kx_smem.index(stage).permute((1, 0)), zero, use_acc=False, is_async=True)
        sy = warpgroup_mma(qy, ky_smem.index(stage).permute((1, 0)), zero, use_acc=False, is_async=True)
        sx, sy = warpgroup_mma_wait(num_outstanding=0, deps=(sx, sy))
        mbarrier.arrive(empty.index(stage), count=1)
        return sx, sy

    @gluon.jit
    def _ws_release(ready, empty, j):
        """Release ring buffer of block j, unread, once it has landed (a block this warpgroup does not see). The
        wait keeps each arrival in its own phase of the `empty` barrier."""
        STAGES: gl.constexpr = ready.shape[0]
        mbarrier.wait(ready.index(j % STAGES), (j // STAGES) & 1)
        mbarrier.arrive(empty.index(j % STAGES), count=1)

    @gluon.jit
    def _ws_kl_partition(
        qx_smem,
        qy_smem,
        kx_smem,
        ky_smem,
        q_bar,
        ready,
        empty,
        part,
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
    ):
        """A consumer warpgroup of attention_fwd_gluon_ws_kernel: the online-KL update of its 64 query rows
        over the key blocks of the program it sees (the causal blocks past its own rows are released unread)."""
        BM: gl.constexpr = qx_smem.shape[1]
        BN: gl.constexpr = kx_smem.shape[1]
        layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BN, 16])
        start_m = start_m0 + part * BM
        n_full, n_seen = _key_blocks(start_m, BM, Nk, causal_offset, BN, CAUSAL)
        row_layout: gl.constexpr = gl.SliceLayout(1, layout)
        rows = start_m + gl.arange(0, BM, layout=row_layout)
        row_ok = rows < Nq
        flat = pid_bh.to(gl.int64) * Nq + rows
        mx, my, lx, ly, c = _init_rows(LSEX_IN, LSEY_IN, flat, row_ok, row_layout, X_FIXED, Y_FIXED)
        zero = gl.zeros([BM, BN], gl.float32, layout)
        qx = qx_smem.index(part)
        qy = qy_smem.index(part)
        mbarrier.wait(q_bar, 0)
        for j in range(0, n_full):
            sx, sy = _ws_scores(qx, qy, kx_smem, ky_smem, ready, empty, j, zero)
            mx, my, lx, ly, c = _kl_update(
                sx, sy, mx, my, lx, ly, c, start_m, j * BN, Nk, causal_offset, scale_x, scale_y,
                BM, BN, layout, False, CAUSAL, X_FIXED, Y_FIXED,
            )  # fmt: skip
        for j in range(n_full, n_seen):
            sx, sy = _ws_scores(qx, qy, kx_smem, ky_smem, ready, empty, j, zero)
            mx, my, lx, ly, c = _kl_update(
                sx, sy, mx, my, lx, ly, c, start_m, j * BN, Nk, causal_offset, scale_x, scale_y,
                BM, BN, layout, True, CAUSAL, X_FIXED, Y_FIXED,
            )  # fmt: skip
        for j in range(n_seen, n_blocks):  # past this warpgroup's rows (causal)
            _ws_release(ready, empty, j)
        _store_rows(mx, my, lx, ly, c, flat, row_ok, KL_OUT, LSEX_OUT, LSEY_OUT)

    @gluon.jit
    def _ws_barriers(STAGES: gl.constexpr, CONSUMERS: gl.constexpr):
        """The mbarriers of a warp-specialized program: one for the tiles it keeps, and per ring buffer
        `ready` (its TMA landed) and `empty` (every consumer released it)."""
        tiles_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        mbarrier.init(tiles_bar, count=1)
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=CONSUMERS)
        return tiles_bar, ready, empty

    @gluon.jit
    def _ws_tile_buffers(fx_desc, fy_desc, sx_desc, sy_desc, STAGES: gl.constexpr):
        """The shared memory _ws_load_partition fills: both sides' fixed tiles, one per consumer warpgroup (3),
        and a ring of STAGES streamed blocks of both sides."""
        fx_smem = gl.allocate_shared_memory(fx_desc.dtype, [3] + fx_desc.block_type.shape, fx_desc.layout)
        fy_smem = gl.allocate_shared_memory(fy_desc.dtype, [3] + fy_desc.block_type.shape, fy_desc.layout)
        sx_smem = gl.allocate_shared_memory(sx_desc.dtype, [STAGES] + sx_desc.block_type.shape, sx_desc.layout)
        sy_smem = gl.allocate_shared_memory(sy_desc.dtype, [STAGES] + sy_desc.block_type.shape, sy_desc.layout)
        return fx_smem, fy_smem, sx_smem, sy_smem

    @gluon.jit
    def attention_fwd_gluon_ws_kernel(
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
        heads_per_section,
        STAGES: gl.constexpr,
        CAUSAL: gl.constexpr,
        X_FIXED: gl.constexpr,
        Y_FIXED: gl.constexpr,
        CONSUMER_REGS: gl.constexpr,
        PRODUCER_REGS: gl.constexpr,
        num_warps: gl.constexpr,
    ):
        """Warp-specialized forward: program = (3 x 64 query rows, batch * head); three consumer warpgroups
        (CONSUMER_REGS registers each) run _ws_kl_partition on their rows, a producer warp (PRODUCER_REGS)
        runs _ws_load_partition. While one warpgroup waits on its GEMMs, the others' exponentials keep the
        MUFU busy (benchmarks/results/attention/gluon_ws_h100.md)."""
        ROWS: gl.constexpr = qx_desc.block_type.shape[0]
        BN: gl.constexpr = kx_desc.block_type.shape[0]
        gl.static_assert(num_warps == 4)
        gl.static_assert(ROWS == 64)
        pid_bh, start_m0, q_row0, kx_row0, ky_row0 = _program_origin(H, Nq, Nk, GX, GY, heads_per_section, 3 * ROWS)
        _, n_blocks = _key_blocks(start_m0, 3 * ROWS, Nk, causal_offset, BN, CAUSAL)

        qx_smem, qy_smem, kx_smem, ky_smem = _ws_tile_buffers(qx_desc, qy_desc, kx_desc, ky_desc, STAGES)
        q_bar, ready, empty = _ws_barriers(STAGES, 3)

        # The partitions' arguments are written out: a tuple built by concatenation loses its constexprs.
        gl.warp_specialize(
            [
                (
                    _ws_kl_partition,
                    (qx_smem, qy_smem, kx_smem, ky_smem, q_bar, ready, empty, 0, start_m0, pid_bh, n_blocks, Nq,
                     Nk, causal_offset, scale_x, scale_y, LSEX_IN, LSEY_IN, KL_OUT, LSEX_OUT, LSEY_OUT,
                     CAUSAL, X_FIXED, Y_FIXED),
                ),
                (
                    _ws_kl_partition,
                    (qx_smem, qy_smem, kx_smem, ky_smem, q_bar, ready, empty, 1, start_m0, pid_bh, n_blocks, Nq,
                     Nk, causal_offset, scale_x, scale_y, LSEX_IN, LSEY_IN, KL_OUT, LSEX_OUT, LSEY_OUT,
                     CAUSAL, X_FIXED, Y_FIXED),
                ),
                (
                    _ws_kl_partition,
                    (qx_smem, qy_smem, kx_smem, ky_smem, q_bar, ready, empty, 2, start_m0, pid_bh, n_blocks, Nq,
                     Nk, causal_offset, scale_x, scale_y, LSEX_IN, LSEY_IN, KL_OUT, LSEX_OUT, LSEY_OUT,
                     CAUSAL, X_FIXED, Y_FIXED),
                ),
                (
                    _ws_load_partition,
                    (qx_desc, kx_desc, qy_desc, ky_desc, qx_smem, qy_smem, kx_smem, ky_smem, q_bar, ready,
                     empty, q_row0, kx_row0, ky_row0, 0, 1, 0, n_blocks),
                ),
            ],
            [4, 4, 1],
            [CONSUMER_REGS, CONSUMER_REGS, PRODUCER_REGS],
        )  # fmt: skip


def _sm90(device: torch.device) -> bool:
    if device.type != "cuda":
        return False
    return _capability(torch.cuda.current_device() if device.index is None else device.index) == (9, 0)


@functools.lru_cache(maxsize=None)
def _capability(index: int) -> tuple:
    # asked on every call otherwise: ~7 us of host time (the device's properties)
    return torch.cuda.get_device_capability(index)


def gluon_forward_supported(q_x, k_x, q_y, k_y, *, kpm, is_causal: bool, causal_offset: int) -> bool:
    """Whether this forward can run the case: Gluon importable, an sm90 device, 16-bit inputs whose
    [B, H, N, D] layout is contiguous, head dims 16/32/64/128, no key padding mask, causal offset
    >= 0 (every row sees a key), Nk > 0, fewer than 2^31 rows."""
    if not HAVE_GLUON or os.environ.get("TRITON_INTERPRET") == "1" or not _sm90(q_x.device):
        return False
    tensors = (q_x, k_x, q_y, k_y)
    if kpm is not None or (is_causal and causal_offset < 0) or k_x.shape[2] == 0:
        return False
    if any(t.dtype not in (torch.float16, torch.bfloat16) or not t.is_contiguous() for t in tensors):
        return False
    if q_x.shape[-1] not in HEAD_DIMS or q_y.shape[-1] not in HEAD_DIMS:
        return False
    return all(t.shape[0] * t.shape[1] * t.shape[2] < 2**31 for t in tensors)


def gluon_chosen(choice: Optional[str], n_queries: int, min_rows: int, failed: bool) -> bool:
    """The selection rule of the Gluon kernels (forward here, dq / dk in kernels_gluon_bwd): the block
    config's choice ("gluon" / "triton") decides, then NITROBREW_ATTN_GLUON ("1" / "0"); otherwise they are
    chosen where they were measured faster than the Triton ones (Nq >= min_rows), on a Triton release they
    were tested with, unless a launch has failed."""
    if choice is not None:
        return choice == "gluon"
    env = os.environ.get(ENV_SWITCH)
    if env in ("0", "1"):
        return env == "1"
    return not failed and n_queries >= min_rows and TRITON_VERSION.startswith(TESTED_TRITON)


def gluon_forward_enabled(cfg: Optional[dict], n_queries: int) -> bool:
    """Whether to ask for this forward (block_config "fwd_kernel"; gluon_chosen's rule from AUTO_MIN_ROWS)."""
    return gluon_chosen((cfg or {}).get("fwd_kernel"), n_queries, AUTO_MIN_ROWS, FAILED)


def note_failure(err: BaseException) -> None:
    """A launch that failed (a Triton release whose Gluon differs): warn once, stop choosing it."""
    global FAILED
    if not FAILED:
        warnings.warn(
            f"the Gluon attention forward failed ({type(err).__name__}: {err}); using the Triton one", stacklevel=3
        )
    FAILED = True


@functools.lru_cache(maxsize=None)
def _shared_layout(rows: int, d: int, dtype: torch.dtype):
    # the same few layouts on every call: get_default_for costs ~10 us of Python per descriptor
    return gl.NVMMASharedLayout.get_default_for([rows, d], _gl_dtype(dtype))


def _gl_dtype(dtype: torch.dtype):
    return gl.bfloat16 if dtype == torch.bfloat16 else gl.float16


class _Address:
    """What a built TMA descriptor needs of its tensor: the address and the element type (Triton's launcher
    reads base.data_ptr() to build the tensor map, its specialization base.dtype). Holding this instead of
    the tensor lets descriptors be kept without keeping the tensors' memory."""

    __slots__ = ("_ptr", "dtype")

    def __init__(self, t: torch.Tensor):
        self._ptr, self.dtype = t.data_ptr(), t.dtype

    def data_ptr(self) -> int:
        return self._ptr


# Descriptors by (address, shape, strides, tile rows, dtype): one is those values and nothing else, so one
# built for memory since freed and reused by a tensor of the same shape is still right. Building one costs
# ~12 us of host time on an H100 machine (4 a launch); cleared when full.
_DESCRIPTORS: dict = {}
_MAX_DESCRIPTORS = 256


def _desc(t: torch.Tensor, rows: int):
    """TMA descriptor of a contiguous [B, H, N, D] tensor viewed as [B*H*N, D], tiles of [rows, D]."""
    key = (t.data_ptr(), t.shape, t.stride(), rows, t.dtype)
    desc = _DESCRIPTORS.get(key)
    if desc is None:
        d = t.shape[-1]
        flat = t.view(-1, d)
        layout = _shared_layout(rows, d, t.dtype)
        desc = TensorDescriptor(flat, list(flat.shape), list(flat.stride()), [rows, d], layout)
        desc.base = _Address(flat)
        remember_spec(desc)
        if len(_DESCRIPTORS) >= _MAX_DESCRIPTORS:
            _DESCRIPTORS.clear()
        _DESCRIPTORS[key] = desc
    return desc


def launch_fwd_gluon(q_x, k_x, q_y, k_y, *, lse_in, out, scales, causal, causal_offset, fixed, config=None) -> None:
    """Fill out = (kl, lse_x, lse_y) ([B, H, Nq] float32; lse's in log2 units) as kernels_fwd's
    forward does. lse_in: (x, y) fixed log-sum-exps (natural log; read where fixed says so), scales:
    (x, y) in log2 units, config: WARP_SPECIALIZED, ONE_WARPGROUP (its DEFAULT_CONFIG tiles) or its
    (BM, BN, num_warps, stages); None: the warp-specialized kernel from WS_MIN_ROWS query rows on."""
    B, H, Nq, _ = q_x.shape
    Nk = k_x.shape[2]
    if config is None:
        config = WARP_SPECIALIZED if Nq >= WS_MIN_ROWS else ONE_WARPGROUP
    # the arguments after the descriptors, and the constexprs, are the same for both kernels
    rows_in_out = (*lse_in, *out, H, Nq, Nk, H // k_x.shape[1], H // k_y.shape[1])
    scalars = (float(scales[0]), float(scales[1]), int(causal_offset) if causal else 0)
    flags = dict(CAUSAL=bool(causal), X_FIXED=bool(fixed[0]), Y_FIXED=bool(fixed[1]))
    key_bytes = key_bytes_per_query_head(k_x, k_y, H)
    if config == WARP_SPECIALIZED:
        grid, section = program_grid((Nq + 3 * WS_ROWS - 1) // (3 * WS_ROWS), B * H, key_bytes)
        descs = (_desc(q_x, WS_ROWS), _desc(k_x, WS_BN), _desc(q_y, WS_ROWS), _desc(k_y, WS_BN))
        launch(
            attention_fwd_gluon_ws_kernel,
            grid,
            *descs,
            *rows_in_out,
            *scalars,
            section,
            STAGES=WS_STAGES,
            CONSUMER_REGS=WS_CONSUMER_REGS,
            PRODUCER_REGS=WS_PRODUCER_REGS,
            num_warps=4,
            **flags,
        )
        return
    BM, BN, warps, stages = DEFAULT_CONFIG if config == ONE_WARPGROUP else config
    grid, section = program_grid((Nq + BM - 1) // BM, B * H, key_bytes)
    descs = (_desc(q_x, BM), _desc(k_x, BN), _desc(q_y, BM), _desc(k_y, BN))
    launch(
        attention_fwd_gluon_kernel,
        grid,
        *descs,
        *rows_in_out,
        *scalars,
        section,
        BN=BN,
        STAGES=stages,
        num_warps=warps,
        **flags,
    )
