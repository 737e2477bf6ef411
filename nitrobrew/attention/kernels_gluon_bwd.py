"""Gluon dq and dk kernels of attention KL for Hopper (sm90): the warp-specialized forward's structure.

Experimental, like ``kernels_gluon.py``, whose producer warp, program layout, key-block ranges and
barriers they share. The Triton kernels (``kernels_bwd.py``) stay the portable path and the reference
these are tested against; they also run what these do not: both sides' gradients at once, kv heads
grouped unlike on the two sides (dk), key padding masks.

- ``attention_bwd_dq_gluon_ws_kernel``: program = (3 x 64 query rows, batch * head). A producer warp
  (``kernels_gluon._ws_load_partition``) loads the program's query tiles and streams both sides' key
  blocks into a ring; three consumer warpgroups (``_ws_dq_partition``) each own 64 query rows. Per key
  block a consumer recomputes both score tiles (two asynchronous warpgroup MMAs), forms dS from the
  forward's row statistics (``_dq_scores_grad``: kernels_bwd's dS_y = g (Y - X) or
  dS_x = g X (ln X - ln Y - KL), the scale inside each exponent's FMA as in the forward), and adds dS k
  with a third MMA whose A operand comes from registers.
- ``attention_bwd_dk_gluon_ws_kernel``: program = (3 x 64 keys, batch * kv head). The same producer
  loads the key tiles and streams 64-row query blocks of every query head
  sharing the kv head, block-major (each block for every head of the group); each consumer
  (``_ws_dk_partition``) computes [query rows, keys] score tiles (the
  row statistics stay per row of the tile: along its columns they cost 16 registers a vector and
  spilled), writes dS to shared memory and reads it back transposed as the A operand of dk += dS^T q
  (FlashAttention-3's dV step).

While one warpgroup waits on its MMAs the others' exponentials run. One side's gradient a launch
(``GRAD_X``), written once, scaled by ``out_scale`` (the side's scale times the upstream multiplier).
Measured: benchmarks/results/attention/gluon_bwd_h100.md.
"""

from __future__ import annotations

import warnings
from typing import Optional

from ..core.launch import launch
from . import kernels_gluon as kg

if kg.HAVE_GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        warpgroup_mma,
        warpgroup_mma_wait,
    )

    from .kernels_gluon import (
        _key_blocks,
        _program_origin,
        _visible_pairs,
        _ws_barriers,
        _ws_load_partition,
        _ws_release,
        _ws_tile_buffers,
    )
    from .kernels_tiles import key_bytes_per_query_head, program_grid, program_ids, query_bytes_per_kv_head

# Chosen without being asked from this many query rows on, on the Triton releases the forward was tested
# with (kernels_gluon.TESTED_TRITON). H100, the API's fwd+bwd with the Gluon backward against the Triton
# one: 1.23x at N = 2048, 1.02x at 3072, 0.86-0.97x at 4096 (three runs), 0.88x at 6144, 0.85-0.88x at
# 8192-16384 (benchmarks/results/attention/gluon_bwd_h100.md); launched directly, 0.92x at 4096 and 0.93x
# at 3072 (kernels 0.92x, but back-to-back steps 1.02x: host-bound; small_n_h100.md, call 4).
AUTO_MIN_ROWS = 4096
FAILED = False  # set by note_failure
# 3 consumer warpgroups of 64 query rows; BN keys a block in a ring of STAGES; registers a thread of a
# consumer / of the producer (3 x CONSUMER + PRODUCER <= 512). A consumer holds two [64, BN] score tiles
# and the [64, D] dq accumulator: BN = 64 keeps that within 160 registers at D = 128.
DQ_ROWS, DQ_BN, DQ_STAGES, DQ_CONSUMER_REGS, DQ_PRODUCER_REGS = 64, 64, 3, 160, 24
# The dk kernel: 3 consumer warpgroups of 64 keys at DQ_CONSUMER_REGS; query blocks of DK_BQ rows in a ring
# of DK_STAGES (two stages: 1.02-1.06x slower).
DK_KEYS, DK_BQ, DK_STAGES = 64, 64, 3


if kg.HAVE_GLUON:

    @gluon.jit
    def _dq_scores_grad(
        sx,
        sy,
        lsex,
        lsey,
        kl2,
        g,
        start_m,
        start_n,
        Nq,
        Nk,
        causal_offset,
        scale_x,
        scale_y,
        BM: gl.constexpr,
        BN: gl.constexpr,
        LAYOUT: gl.constexpr,
        MASKED: gl.constexpr,
        CAUSAL: gl.constexpr,
        GRAD_X: gl.constexpr,
    ):
        """dS of one [rows, keys] tile from the raw scores (natural units of the scores): the arguments
        x - lse_x, y - lse_y each one FMA; invisible pairs have X = Y = 0, hence dS = 0."""
        arg_x = sx * scale_x - gl.expand_dims(lsex, 1)
        arg_y = sy * scale_y - gl.expand_dims(lsey, 1)
        if MASKED:
            valid = _visible_pairs(start_m, start_n, Nq, Nk, causal_offset, BM, BN, LAYOUT, CAUSAL, True)
            px = gl.exp2(gl.where(valid, arg_x, float("-inf")))
        else:
            px = gl.exp2(arg_x)
        if GRAD_X:
            # ln 2 turns the log2-unit log-ratio into nats
            ds = gl.expand_dims(g * 0.6931471805599453, 1) * px * ((arg_x - arg_y) - gl.expand_dims(kl2, 1))
        else:
            if MASKED:
                py = gl.exp2(gl.where(valid, arg_y, float("-inf")))
            else:
                py = gl.exp2(arg_y)
            ds = gl.expand_dims(g, 1) * (py - px)
        return ds

    @gluon.jit
    def _dq_block(
        qx,
        qy,
        kx_smem,
        ky_smem,
        ready,
        empty,
        j,
        acc,
        zero,
        lsex,
        lsey,
        kl2,
        g,
        start_m,
        Nq,
        Nk,
        causal_offset,
        scale_x,
        scale_y,
        S_LAYOUT: gl.constexpr,
        OP_LAYOUT: gl.constexpr,
        MASKED: gl.constexpr,
        CAUSAL: gl.constexpr,
        GRAD_X: gl.constexpr,
    ):
        """Key block j: both score tiles, dS, acc += dS k; the buffer is released once the three MMAs
        have read it."""
        STAGES: gl.constexpr = kx_smem.shape[0]
        BN: gl.constexpr = kx_smem.shape[1]
        BM: gl.constexpr = qx.shape[0]
        stage = j % STAGES
        mbarrier.wait(ready.index(stage), (j // STAGES) & 1)
        kx = kx_smem.index(stage)
        ky = ky_smem.index(stage)
        sx = warpgroup_mma(qx, kx.permute((1, 0)), zero, use_acc=False, is_async=True)
        sy = warpgroup_mma(qy, ky.permute((1, 0)), zero, use_acc=False, is_async=True)
        sx, sy = warpgroup_mma_wait(num_outstanding=0, deps=(sx, sy))
        ds = _dq_scores_grad(
            sx, sy, lsex, lsey, kl2, g, start_m, j * BN, Nq, Nk, causal_offset, scale_x, scale_y,
            BM, BN, S_LAYOUT, MASKED, CAUSAL, GRAD_X,
        )  # fmt: skip
        op = gl.convert_layout(ds.to(qx.dtype), OP_LAYOUT)
        if GRAD_X:
            acc = warpgroup_mma(op, kx, acc, is_async=True)
        else:
            acc = warpgroup_mma(op, ky, acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        mbarrier.arrive(empty.index(stage), count=1)
        return acc

    @gluon.jit
    def _ws_dq_partition(
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
        out_scale,
        LSEX,
        LSEY,
        KL,
        G,
        DQ,
        CAUSAL: gl.constexpr,
        GRAD_X: gl.constexpr,
        G_SCALAR: gl.constexpr,
    ):
        """A consumer warpgroup of attention_bwd_dq_gluon_ws_kernel: dq of its 64 query rows over the key
        blocks of the program it sees (the causal blocks past its own rows are released unread)."""
        BM: gl.constexpr = qx_smem.shape[1]
        BN: gl.constexpr = kx_smem.shape[1]
        DG: gl.constexpr = kx_smem.shape[2] if GRAD_X else ky_smem.shape[2]
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BN, 16]
        )
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, DG, 16]
        )
        op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
        row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
        start_m = start_m0 + part * BM
        n_full, n_seen = _key_blocks(start_m, BM, Nk, causal_offset, BN, CAUSAL)
        rows = start_m + gl.arange(0, BM, layout=row_layout)
        row_ok = rows < Nq
        flat = pid_bh.to(gl.int64) * Nq + rows
        lsex = gl.load(LSEX + flat, mask=row_ok, other=0.0)
        lsey = gl.load(LSEY + flat, mask=row_ok, other=0.0)
        kl2 = gl.load(KL + flat, mask=row_ok, other=0.0) * 1.4426950408889634
        if G_SCALAR:
            g = gl.where(row_ok, gl.load(G).to(gl.float32), 0.0)
        else:
            g = gl.load(G + flat, mask=row_ok, other=0.0)
        zero = gl.zeros([BM, BN], gl.float32, s_layout)
        acc = gl.zeros([BM, DG], gl.float32, acc_layout)
        qx = qx_smem.index(part)
        qy = qy_smem.index(part)
        mbarrier.wait(q_bar, 0)
        for j in range(0, n_full):
            acc = _dq_block(
                qx, qy, kx_smem, ky_smem, ready, empty, j, acc, zero, lsex, lsey, kl2, g, start_m, Nq, Nk,
                causal_offset, scale_x, scale_y, s_layout, op_layout, False, CAUSAL, GRAD_X,
            )  # fmt: skip
        for j in range(n_full, n_seen):
            acc = _dq_block(
                qx, qy, kx_smem, ky_smem, ready, empty, j, acc, zero, lsex, lsey, kl2, g, start_m, Nq, Nk,
                causal_offset, scale_x, scale_y, s_layout, op_layout, True, CAUSAL, GRAD_X,
            )  # fmt: skip
        for j in range(n_seen, n_blocks):  # past this warpgroup's rows (causal)
            _ws_release(ready, empty, j)
        out_rows = start_m + gl.arange(0, BM, layout=gl.SliceLayout(1, acc_layout))
        cols = gl.arange(0, DG, layout=gl.SliceLayout(0, acc_layout))
        ptrs = DQ + gl.expand_dims(pid_bh.to(gl.int64) * Nq + out_rows, 1) * DG + gl.expand_dims(cols, 0)
        gl.store(ptrs, (acc * out_scale).to(DQ.dtype.element_ty), mask=gl.expand_dims(out_rows < Nq, 1))

    @gluon.jit
    def attention_bwd_dq_gluon_ws_kernel(
        qx_desc,
        kx_desc,
        qy_desc,
        ky_desc,
        LSEX,
        LSEY,
        KL,
        G,
        DQ,
        H,
        Nq,
        Nk,
        GX,
        GY,
        scale_x,
        scale_y,
        out_scale,
        causal_offset,
        heads_per_section,
        STAGES: gl.constexpr,
        CAUSAL: gl.constexpr,
        GRAD_X: gl.constexpr,
        G_SCALAR: gl.constexpr,
        CONSUMER_REGS: gl.constexpr,
        PRODUCER_REGS: gl.constexpr,
        num_warps: gl.constexpr,
    ):
        """Warp-specialized dq: program = (3 x 64 query rows, batch * head); three consumer warpgroups run
        _ws_dq_partition on their rows, a producer warp runs kernels_gluon._ws_load_partition."""
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
                    _ws_dq_partition,
                    (qx_smem, qy_smem, kx_smem, ky_smem, q_bar, ready, empty, 0, start_m0, pid_bh, n_blocks, Nq,
                     Nk, causal_offset, scale_x, scale_y, out_scale, LSEX, LSEY, KL, G, DQ,
                     CAUSAL, GRAD_X, G_SCALAR),
                ),
                (
                    _ws_dq_partition,
                    (qx_smem, qy_smem, kx_smem, ky_smem, q_bar, ready, empty, 1, start_m0, pid_bh, n_blocks, Nq,
                     Nk, causal_offset, scale_x, scale_y, out_scale, LSEX, LSEY, KL, G, DQ,
                     CAUSAL, GRAD_X, G_SCALAR),
                ),
                (
                    _ws_dq_partition,
                    (qx_smem, qy_smem, kx_smem, ky_smem, q_bar, ready, empty, 2, start_m0, pid_bh, n_blocks, Nq,
                     Nk, causal_offset, scale_x, scale_y, out_scale, LSEX, LSEY, KL, G, DQ,
                     CAUSAL, GRAD_X, G_SCALAR),
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

    @gluon.jit
    def _dk_block(
        kx,
        ky,
        qx_smem,
        qy_smem,
        ds_smem,
        ready,
        empty,
        t,
        acc,
        zero,
        LSEX,
        LSEY,
        KL,
        G,
        q_flat0,
        start_n,
        start_q,
        Nq,
        Nk,
        causal_offset,
        scale_x,
        scale_y,
        S_LAYOUT: gl.constexpr,
        MASKED: gl.constexpr,
        CAUSAL: gl.constexpr,
        GRAD_X: gl.constexpr,
        G_SCALAR: gl.constexpr,
    ):
        """Streamed query block t (rows [start_q, start_q + BQ) of the head whose first flat row is q_flat0):
        both [rows, keys] score tiles, dS (_dq_scores_grad: the row statistics are per row of the tile,
        cheap in registers), then acc += dS^T q with dS^T read from shared memory (FlashAttention-3's dV
        step); the buffer is released after the three MMAs."""
        STAGES: gl.constexpr = qx_smem.shape[0]
        BQ: gl.constexpr = qx_smem.shape[1]
        BN: gl.constexpr = kx.shape[0]
        stage = t % STAGES
        # the rows' statistics load before the wait: their latency overlaps it and the MMA issue (loaded
        # after the issue, fwd+bwd took 1.01-1.02x as long; benchmarks/results/attention/gluon_profile_h100.md)
        rows = start_q + gl.arange(0, BQ, layout=gl.SliceLayout(1, S_LAYOUT))
        row_ok = rows < Nq
        flat = q_flat0 + rows
        lsex = gl.load(LSEX + flat, mask=row_ok, other=0.0)
        lsey = gl.load(LSEY + flat, mask=row_ok, other=0.0)
        kl2 = gl.load(KL + flat, mask=row_ok, other=0.0) * 1.4426950408889634
        if G_SCALAR:
            g = gl.where(row_ok, gl.load(G).to(gl.float32), 0.0)
        else:
            g = gl.load(G + flat, mask=row_ok, other=0.0)
        mbarrier.wait(ready.index(stage), (t // STAGES) & 1)
        qx = qx_smem.index(stage)
        qy = qy_smem.index(stage)
        sx = warpgroup_mma(qx, kx.permute((1, 0)), zero, use_acc=False, is_async=True)
        sy = warpgroup_mma(qy, ky.permute((1, 0)), zero, use_acc=False, is_async=True)
        sx, sy = warpgroup_mma_wait(num_outstanding=0, deps=(sx, sy))
        ds = _dq_scores_grad(
            sx, sy, lsex, lsey, kl2, g, start_q, start_n, Nq, Nk, causal_offset, scale_x, scale_y,
            BQ, BN, S_LAYOUT, MASKED, CAUSAL, GRAD_X,
        )  # fmt: skip
        ds_smem.store(ds.to(kx.dtype))
        fence_async_shared()
        if GRAD_X:
            acc = warpgroup_mma(ds_smem.permute((1, 0)), qx, acc, is_async=True)
        else:
            acc = warpgroup_mma(ds_smem.permute((1, 0)), qy, acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        mbarrier.arrive(empty.index(stage), count=1)
        return acc

    @gluon.jit
    def _dk_query_blocks(start_n, keys, Nq, causal_offset, BQ: gl.constexpr, CAUSAL: gl.constexpr):
        """Query blocks of keys [start_n, start_n + keys): [0, vis) invisible, [vis, full) masked (they cut
        the causal diagonal), [full, tail) unmasked, [tail, n_q) masked (past Nq) (kernels_bwd's dk ranges)."""
        n_q = (Nq + BQ - 1) // BQ
        if CAUSAL:
            # keys past the last query row (+ offset) see no block at all: vis = n_q, every loop empty
            vis = gl.minimum(gl.maximum(start_n - causal_offset, 0) // BQ, n_q)
            full = gl.minimum(gl.maximum(start_n + keys - 1 - causal_offset + BQ - 1, 0) // BQ, n_q)
        else:
            vis = n_q * 0
            full = vis
        tail = gl.maximum(full, Nq // BQ)
        return vis, full, tail, n_q

    @gluon.jit
    def _ws_dk_partition(
        kx_smem,
        ky_smem,
        qx_smem,
        qy_smem,
        ds_smem,
        k_bar,
        ready,
        empty,
        part,
        start_n0,
        bh_q0,
        heads,
        j_lo,
        Nq,
        Nk,
        causal_offset,
        scale_x,
        scale_y,
        out_scale,
        LSEX,
        LSEY,
        KL,
        G,
        DK,
        dk_row0,
        CAUSAL: gl.constexpr,
        GRAD_X: gl.constexpr,
        G_SCALAR: gl.constexpr,
    ):
        """A consumer warpgroup of attention_bwd_dk_gluon_ws_kernel: dk of its 64 keys over the query blocks
        of every query head sharing the kv head, block by block and within a block head by head, as the
        producer streams them from block j_lo on (blocks before this warpgroup's first visible one are only
        released)."""
        BN: gl.constexpr = kx_smem.shape[1]
        BQ: gl.constexpr = qx_smem.shape[1]
        DG: gl.constexpr = kx_smem.shape[2] if GRAD_X else ky_smem.shape[2]
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BN, 16]
        )
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, DG, 16]
        )
        start_n = start_n0 + part * BN
        vis, full, tail, n_q = _dk_query_blocks(start_n, BN, Nq, causal_offset, BQ, CAUSAL)
        ds = ds_smem.index(part)
        zero = gl.zeros([BQ, BN], gl.float32, s_layout)
        acc = gl.zeros([BN, DG], gl.float32, acc_layout)
        kx = kx_smem.index(part)
        ky = ky_smem.index(part)
        mbarrier.wait(k_bar, 0)
        for j in range(j_lo, vis):  # invisible to these keys
            for hl in range(heads):
                _ws_release(ready, empty, (j - j_lo) * heads + hl)
        for j in range(vis, full):
            for hl in range(heads):
                acc = _dk_block(
                    kx, ky, qx_smem, qy_smem, ds, ready, empty, (j - j_lo) * heads + hl, acc, zero, LSEX, LSEY, KL,
                    G, (bh_q0 + hl).to(gl.int64) * Nq, start_n, j * BQ, Nq, Nk, causal_offset, scale_x, scale_y,
                    s_layout, True, CAUSAL, GRAD_X, G_SCALAR,
                )  # fmt: skip
        for j in range(full, tail):
            for hl in range(heads):
                acc = _dk_block(
                    kx, ky, qx_smem, qy_smem, ds, ready, empty, (j - j_lo) * heads + hl, acc, zero, LSEX, LSEY, KL,
                    G, (bh_q0 + hl).to(gl.int64) * Nq, start_n, j * BQ, Nq, Nk, causal_offset, scale_x, scale_y,
                    s_layout, False, CAUSAL, GRAD_X, G_SCALAR,
                )  # fmt: skip
        for j in range(tail, n_q):
            for hl in range(heads):
                acc = _dk_block(
                    kx, ky, qx_smem, qy_smem, ds, ready, empty, (j - j_lo) * heads + hl, acc, zero, LSEX, LSEY, KL,
                    G, (bh_q0 + hl).to(gl.int64) * Nq, start_n, j * BQ, Nq, Nk, causal_offset, scale_x, scale_y,
                    s_layout, True, CAUSAL, GRAD_X, G_SCALAR,
                )  # fmt: skip
        keys = start_n + gl.arange(0, BN, layout=gl.SliceLayout(1, acc_layout))
        cols = gl.arange(0, DG, layout=gl.SliceLayout(0, acc_layout))
        ptrs = DK + gl.expand_dims(dk_row0 + keys, 1) * DG + gl.expand_dims(cols, 0)
        gl.store(ptrs, (acc * out_scale).to(DK.dtype.element_ty), mask=gl.expand_dims(keys < Nk, 1))

    @gluon.jit
    def attention_bwd_dk_gluon_ws_kernel(
        kx_desc,
        qx_desc,
        ky_desc,
        qy_desc,
        LSEX,
        LSEY,
        KL,
        G,
        DK,
        H,
        Nq,
        Nk,
        GROUP,
        scale_x,
        scale_y,
        out_scale,
        causal_offset,
        heads_per_section,
        STAGES: gl.constexpr,
        CAUSAL: gl.constexpr,
        GRAD_X: gl.constexpr,
        G_SCALAR: gl.constexpr,
        CONSUMER_REGS: gl.constexpr,
        PRODUCER_REGS: gl.constexpr,
        num_warps: gl.constexpr,
    ):
        """Warp-specialized dk of one side: program = (3 x 64 keys, batch * kv head), both sides' kv heads
        shared by the same GROUP query heads; three consumer warpgroups run _ws_dk_partition on their keys,
        a producer warp (kernels_gluon._ws_load_partition) streams the query blocks."""
        BN: gl.constexpr = kx_desc.block_type.shape[0]
        gl.static_assert(num_warps == 4)
        gl.static_assert(BN == 64)
        pid_n, pid_bkv = program_ids(Nk, heads_per_section, 3 * BN, False)
        hkv_total = H // GROUP
        b = pid_bkv // hkv_total
        hkv = pid_bkv % hkv_total
        start_n0 = pid_n * 3 * BN
        k_row0 = pid_bkv * Nk + start_n0
        bh_q0 = b * H + hkv * GROUP
        BQ: gl.constexpr = qx_desc.block_type.shape[0]
        j_lo, _, _, _ = _dk_query_blocks(start_n0, BN, Nq, causal_offset, BQ, CAUSAL)

        kx_smem, ky_smem, qx_smem, qy_smem = _ws_tile_buffers(kx_desc, ky_desc, qx_desc, qy_desc, STAGES)
        # each consumer's dS tile, the A operand (transposed) of its dk MMA
        ds_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
        ds_smem = gl.allocate_shared_memory(kx_desc.dtype, [3, qx_desc.block_type.shape[0], BN], ds_layout)
        k_bar, ready, empty = _ws_barriers(STAGES, 3)

        # The partitions' arguments are written out: a tuple built by concatenation loses its constexprs.
        gl.warp_specialize(
            [
                (
                    _ws_dk_partition,
                    (kx_smem, ky_smem, qx_smem, qy_smem, ds_smem, k_bar, ready, empty, 0, start_n0, bh_q0, GROUP,
                     j_lo, Nq, Nk, causal_offset, scale_x, scale_y, out_scale, LSEX, LSEY, KL, G, DK, pid_bkv * Nk,
                     CAUSAL, GRAD_X, G_SCALAR),
                ),
                (
                    _ws_dk_partition,
                    (kx_smem, ky_smem, qx_smem, qy_smem, ds_smem, k_bar, ready, empty, 1, start_n0, bh_q0, GROUP,
                     j_lo, Nq, Nk, causal_offset, scale_x, scale_y, out_scale, LSEX, LSEY, KL, G, DK, pid_bkv * Nk,
                     CAUSAL, GRAD_X, G_SCALAR),
                ),
                (
                    _ws_dk_partition,
                    (kx_smem, ky_smem, qx_smem, qy_smem, ds_smem, k_bar, ready, empty, 2, start_n0, bh_q0, GROUP,
                     j_lo, Nq, Nk, causal_offset, scale_x, scale_y, out_scale, LSEX, LSEY, KL, G, DK, pid_bkv * Nk,
                     CAUSAL, GRAD_X, G_SCALAR),
                ),
                (
                    _ws_load_partition,
                    (kx_desc, qx_desc, ky_desc, qy_desc, kx_smem, ky_smem, qx_smem, qy_smem, k_bar, ready, empty,
                     k_row0, bh_q0 * Nq, bh_q0 * Nq, Nq, GROUP, j_lo, (Nq + BQ - 1) // BQ),
                ),
            ],
            [4, 4, 1],
            [CONSUMER_REGS, CONSUMER_REGS, PRODUCER_REGS],
        )  # fmt: skip


def launch_bwd_gluon(
    kind: str,
    q_x,
    k_x,
    q_y,
    k_y,
    *,
    out,
    lse,
    kl,
    g,
    scales,
    out_scale,
    causal,
    causal_offset,
    grad_x,
    g_scalar,
    config=None,
) -> None:
    """Fill out with one side's dq (kind "dq": the q of side x if grad_x, else of side y) or dk ("dk": its
    k; both sides' kv heads shared by the same number of query heads), as kernels_bwd's kernels do; out is
    contiguous in that tensor's dtype. lse: (x, y) row log-sum-exps (log2 units), kl: the forward's rows
    (nats), g: [B, H, Nq] float32 upstream gradients, or with g_scalar a 0-dim tensor; scales: (x, y) in
    log2 units; out_scale: the side's scale times the upstream multiplier; config: (streamed block rows,
    STAGES, CONSUMER_REGS) over the kind's defaults (DQ_BN / DK_BQ, DQ_STAGES / DK_STAGES,
    DQ_CONSUMER_REGS)."""
    B, H, Nq, _ = q_x.shape
    Nk = k_x.shape[2]
    if kind == "dq":  # program = 3 x 64 query rows of a head; key blocks streamed
        block, stages, regs = config or (DQ_BN, DQ_STAGES, DQ_CONSUMER_REGS)
        kernel, blocks, heads = attention_bwd_dq_gluon_ws_kernel, (Nq + 3 * DQ_ROWS - 1) // (3 * DQ_ROWS), B * H
        streamed = key_bytes_per_query_head(k_x, k_y, H)
        descs = (kg._desc(q_x, DQ_ROWS), kg._desc(k_x, block), kg._desc(q_y, DQ_ROWS), kg._desc(k_y, block))
        groups = (H // k_x.shape[1], H // k_y.shape[1])
    else:  # program = 3 x 64 keys of a kv head; query blocks streamed
        block, stages, regs = config or (DK_BQ, DK_STAGES, DQ_CONSUMER_REGS)
        kernel, heads = attention_bwd_dk_gluon_ws_kernel, B * k_x.shape[1]
        blocks = (Nk + 3 * DK_KEYS - 1) // (3 * DK_KEYS)
        streamed = query_bytes_per_kv_head(q_x, q_y, k_x.shape[1])
        descs = (kg._desc(k_x, DK_KEYS), kg._desc(q_x, block), kg._desc(k_y, DK_KEYS), kg._desc(q_y, block))
        groups = (H // k_x.shape[1],)
    grid, section = program_grid(blocks, heads, streamed)
    launch(
        kernel,
        grid,
        *descs,
        *lse,
        kl,
        g,
        out,
        H,
        Nq,
        Nk,
        *groups,
        float(scales[0]),
        float(scales[1]),
        float(out_scale),
        int(causal_offset) if causal else 0,
        section,
        STAGES=stages,
        CAUSAL=bool(causal),
        GRAD_X=bool(grad_x),
        G_SCALAR=bool(g_scalar),
        CONSUMER_REGS=regs,
        PRODUCER_REGS=DQ_PRODUCER_REGS,
        num_warps=4,
    )


def gluon_backward_enabled(cfg: Optional[dict], n_queries: int) -> bool:
    """Whether to ask for these kernels (block_config "bwd_kernel"; kernels_gluon.gluon_chosen's rule from
    AUTO_MIN_ROWS). The case must also be one the forward supports (kernels_gluon.gluon_forward_supported)."""
    return kg.gluon_chosen((cfg or {}).get("bwd_kernel"), n_queries, AUTO_MIN_ROWS, FAILED)


def note_failure(err: BaseException) -> None:
    """A launch that failed (a Triton release whose Gluon differs): warn once, stop choosing these kernels."""
    global FAILED
    if not FAILED:
        warnings.warn(
            f"the Gluon attention backward failed ({type(err).__name__}: {err}); using the Triton one", stacklevel=3
        )
    FAILED = True
