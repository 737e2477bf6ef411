"""Probe: the attention-KL forward written in the CUTLASS Python DSL (CuTe DSL) for sm90, beside the Gluon
kernel and SDPA's default forward, in one process. Not part of the library: it measures how far a first CuTe DSL
kernel gets before the FA3 pieces it still lacks (a producer warpgroup with register reallocation, a deeper ring).

The kernel (``KLForwardSm90``): a CTA takes BM = 128 query rows of one batch*head (two consumer warpgroups of 64
rows) and streams key blocks of BN keys of both sides through a TMA ring of ``stages`` buffers; warp 0 issues
the loads. Per block each warpgroup issues both score MMAs (S_x = Q_x K_x^T, S_y = Q_y K_y^T, fp32 accumulators
made fresh each block, so no MMA is in flight across iterations: ptxas serializes the MMAs otherwise), runs the
x side's update while the y side's MMA finishes, then the y side's and the KL term. With ``pingpong`` the two
warpgroups take turns issuing their MMAs (named barriers, FlashAttention-3's schedule); ``late_refill`` issues
the ring refill after the update instead of before it. Online update in log2 units: row maxima m, sums l of
2^(s - m), c = sum 2^(s_x - m_x) (s_x - s_y); per row kl = ln2 (c / l_x - lse_x + lse_y) (nats), lse in log2
units, as the Gluon kernel writes them. Causal (key j visible to query i when j <= i), N a multiple of 128,
no GQA, D = 128, bf16; x = teacher, y = student.

Needs an sm90 GPU and ``nvidia-cutlass-dsl`` with its CUDA libraries (``nvidia-cutlass-dsl-libs-cu13``):

    python benchmarks/attention_cute_fwd.py [--configs 128,128,2,1,1 128,64,4,1,1] [--ns 2048 4096 8192 16384]

A config is BM,BN,stages,pingpong,late_refill[,producer].
"""

import math

import cutlass
import cutlass.cute as cute
import cutlass.memory
import cutlass.pipeline as pipeline
import cutlass.tensor_utils as tensor_utils
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import cpasync, warpgroup
from cutlass.pipeline import pipeline_init_arrive, pipeline_init_wait

LN2 = math.log(2.0)
LOG2E = 1.0 / LN2


class KLForwardSm90:
    def __init__(
        self,
        head_dim: int = 128,
        bm: int = 128,
        bn: int = 128,
        stages: int = 2,
        causal: bool = True,
        pingpong: bool = True,
        late_refill: bool = True,
        producer: bool = False,
    ):
        self.d, self.bm, self.bn, self.stages, self.causal = head_dim, bm, bn, stages, causal
        self.pingpong, self.late_refill, self.producer = pingpong, late_refill, producer
        self.wgs = bm // 64
        # with `producer`, warpgroup 0 only loads (24 registers a thread) and the consumers take 240
        self.threads = 128 * (self.wgs + (1 if producer else 0))

    @cute.jit
    def __call__(
        self,
        mQx: cute.Tensor,  # (B*H*N, D), D contiguous
        mKx: cute.Tensor,
        mQy: cute.Tensor,
        mKy: cute.Tensor,
        mKL: cute.Tensor,  # (B*H*N,) float32
        mLx: cute.Tensor,
        mLy: cute.Tensor,
        scale_x: Float32,  # log2 units
        scale_y: Float32,
        n: Int32,  # sequence length (queries = keys)
        bh: Int32,  # batch * heads
        stream,
    ):
        dtype = mQx.element_type
        self.dtype = dtype
        tiler = (self.bm, self.bn, self.d)
        self.tiled_mma = sm90_utils.make_trivial_tiled_mma(
            dtype, dtype, cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.K, Float32,
            (self.wgs, 1, 1), tiler_mn=(64, self.bn),
        )  # fmt: skip
        self.sq_layout = sm90_utils.make_smem_layout_a(tensor_utils.LayoutEnum.ROW_MAJOR, tiler, dtype, 1)
        self.sk_layout = sm90_utils.make_smem_layout_b(tensor_utils.LayoutEnum.ROW_MAJOR, tiler, dtype, self.stages)
        sq_one = cute.slice_(self.sq_layout, (None, None, 0))
        sk_one = cute.slice_(self.sk_layout, (None, None, 0))
        op = cpasync.CopyBulkTensorTileG2SOp()
        tma_qx, tQx = cpasync.make_tiled_tma_atom(op, mQx, sq_one, (self.bm, self.d))
        tma_qy, tQy = cpasync.make_tiled_tma_atom(op, mQy, sq_one, (self.bm, self.d))
        tma_kx, tKx = cpasync.make_tiled_tma_atom(op, mKx, sk_one, (self.bn, self.d))
        tma_ky, tKy = cpasync.make_tiled_tma_atom(op, mKy, sk_one, (self.bn, self.d))
        self.q_bytes = 2 * cute.size_in_bytes(dtype, sq_one)
        self.k_bytes = 2 * cute.size_in_bytes(dtype, sk_one)

        @cute.struct
        class Storage:
            q_bar: cute.struct.MemRange[cutlass.Int64, 2]
            k_bar: cute.struct.MemRange[cutlass.Int64, self.stages * 2]
            sQx: cute.struct.Align[cute.struct.MemRange[dtype, cute.cosize(self.sq_layout)], 1024]
            sQy: cute.struct.Align[cute.struct.MemRange[dtype, cute.cosize(self.sq_layout)], 1024]
            sKx: cute.struct.Align[cute.struct.MemRange[dtype, cute.cosize(self.sk_layout)], 1024]
            sKy: cute.struct.Align[cute.struct.MemRange[dtype, cute.cosize(self.sk_layout)], 1024]

        self.storage = Storage
        m_blocks = n // self.bm
        self.kernel(
            tma_qx, tQx, tma_qy, tQy, tma_kx, tKx, tma_ky, tKy, mKL, mLx, mLy, scale_x, scale_y, n, m_blocks,
            self.tiled_mma, self.sq_layout, self.sk_layout,
        ).launch(grid=(m_blocks * bh, 1, 1), block=(self.threads, 1, 1), stream=stream)  # fmt: skip

    @cute.kernel
    def kernel(
        self,
        tma_qx: cute.CopyAtom,
        gQx_all: cute.Tensor,
        tma_qy: cute.CopyAtom,
        gQy_all: cute.Tensor,
        tma_kx: cute.CopyAtom,
        gKx_all: cute.Tensor,
        tma_ky: cute.CopyAtom,
        gKy_all: cute.Tensor,
        mKL: cute.Tensor,
        mLx: cute.Tensor,
        mLy: cute.Tensor,
        scale_x: Float32,
        scale_y: Float32,
        n: Int32,
        m_blocks: Int32,
        tiled_mma: cute.TiledMma,
        sq_layout: cute.ComposedLayout,
        sk_layout: cute.ComposedLayout,
    ):
        bm, bn = self.bm, self.bn
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        # longest causal blocks first: the last query block of each head first
        head = bidx // m_blocks
        m_blk = m_blocks - 1 - bidx % m_blocks
        if warp_idx == 0:
            for atom in (tma_qx, tma_qy, tma_kx, tma_ky):
                cpasync.prefetch_descriptor(atom)

        smem = cutlass.memory.SmemAllocator()
        st = smem.allocate(self.storage)
        q_pipe = pipeline.PipelineTmaAsync.create(
            barrier_storage=st.q_bar.data_ptr(), num_stages=1,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, self.wgs * 4),
            tx_count=self.q_bytes, defer_sync=True,
        )  # fmt: skip
        k_pipe = pipeline.PipelineTmaAsync.create(
            barrier_storage=st.k_bar.data_ptr(), num_stages=self.stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, self.wgs * 4),
            tx_count=self.k_bytes, defer_sync=True,
        )  # fmt: skip
        pipeline_init_arrive(cluster_shape_mn=(1, 1), is_relaxed=True)

        sQx = st.sQx.get_tensor(sq_layout.outer, swizzle=sq_layout.inner)
        sQy = st.sQy.get_tensor(sq_layout.outer, swizzle=sq_layout.inner)
        sKx = st.sKx.get_tensor(sk_layout.outer, swizzle=sk_layout.inner)
        sKy = st.sKy.get_tensor(sk_layout.outer, swizzle=sk_layout.inner)

        # global tiles: rows of this head start at head * n
        q_tile = head * m_blocks + m_blk
        k_tile0 = head * (n // bn)
        gQx = cute.local_tile(gQx_all, (bm, self.d), (None, 0))  # (bm, d, tiles)
        gQy = cute.local_tile(gQy_all, (bm, self.d), (None, 0))
        gKx = cute.local_tile(gKx_all, (bn, self.d), (None, 0))
        gKy = cute.local_tile(gKy_all, (bn, self.d), (None, 0))
        one = cute.make_layout(1)
        tQx_s, tQx_g = cpasync.tma_partition(tma_qx, 0, one, cute.group_modes(sQx, 0, 2), cute.group_modes(gQx, 0, 2))
        tQy_s, tQy_g = cpasync.tma_partition(tma_qy, 0, one, cute.group_modes(sQy, 0, 2), cute.group_modes(gQy, 0, 2))
        tKx_s, tKx_g = cpasync.tma_partition(tma_kx, 0, one, cute.group_modes(sKx, 0, 2), cute.group_modes(gKx, 0, 2))
        tKy_s, tKy_g = cpasync.tma_partition(tma_ky, 0, one, cute.group_modes(sKy, 0, 2), cute.group_modes(gKy, 0, 2))

        wg = cute.arch.make_warp_uniform(tidx // 128)
        if const_expr(self.producer):
            n_blocks_p = (m_blk + 1) * (bm // bn) if const_expr(self.causal) else n // bn
            if wg == 0:
                cute.arch.setmaxregister_decrease(24)
                pipeline_init_wait(cluster_shape_mn=(1, 1))
                if warp_idx == 0:
                    qs = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)
                    q_pipe.producer_acquire(qs)
                    bar_q = q_pipe.producer_get_barrier(qs)
                    cute.copy(tma_qx, tQx_g[(None, q_tile)], tQx_s[(None, 0)], tma_bar_ptr=bar_q)
                    cute.copy(tma_qy, tQy_g[(None, q_tile)], tQy_s[(None, 0)], tma_bar_ptr=bar_q)
                    ps = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.stages)
                    for _ in cutlass.range(n_blocks_p, unroll=1):
                        k_pipe.producer_acquire(ps)
                        bar = k_pipe.producer_get_barrier(ps)
                        cute.copy(tma_kx, tKx_g[(None, k_tile0 + ps.count)], tKx_s[(None, ps.index)], tma_bar_ptr=bar)
                        cute.copy(tma_ky, tKy_g[(None, k_tile0 + ps.count)], tKy_s[(None, ps.index)], tma_bar_ptr=bar)
                        k_pipe.producer_commit(ps)
                        ps.advance()
            else:
                cute.arch.setmaxregister_increase(240)
                self._consume(
                    tiled_mma, sQx, sQy, sKx, sKy, q_pipe, k_pipe, mKL, mLx, mLy,
                    scale_x, scale_y, n, head, m_blk, n_blocks_p, tidx, wg - 1,
                )  # fmt: skip
            return
        thr_mma = tiled_mma.get_slice(cute.make_layout(self.wgs, stride=128)(wg))
        rQx = tiled_mma.make_fragment_A(thr_mma.partition_A(sQx))
        rQy = tiled_mma.make_fragment_A(thr_mma.partition_A(sQy))
        rKx = tiled_mma.make_fragment_B(thr_mma.partition_B(sKx))
        rKy = tiled_mma.make_fragment_B(thr_mma.partition_B(sKy))
        coords = thr_mma.partition_C(cute.make_identity_tensor((bm, bn)))

        n_blocks = (m_blk + 1) * (bm // bn) if const_expr(self.causal) else n // bn
        pipeline_init_wait(cluster_shape_mn=(1, 1))

        prod = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.stages)
        if warp_idx == 0:
            qs = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)
            q_pipe.producer_acquire(qs)
            cute.copy(tma_qx, tQx_g[(None, q_tile)], tQx_s[(None, 0)], tma_bar_ptr=q_pipe.producer_get_barrier(qs))
            cute.copy(tma_qy, tQy_g[(None, q_tile)], tQy_s[(None, 0)], tma_bar_ptr=q_pipe.producer_get_barrier(qs))
            for _ in cutlass.range(cutlass.min(self.stages, n_blocks), unroll=1):
                k_pipe.producer_acquire(prod)
                bar = k_pipe.producer_get_barrier(prod)
                cute.copy(tma_kx, tKx_g[(None, k_tile0 + prod.count)], tKx_s[(None, prod.index)], tma_bar_ptr=bar)
                cute.copy(tma_ky, tKy_g[(None, k_tile0 + prod.count)], tKy_s[(None, prod.index)], tma_bar_ptr=bar)
                k_pipe.producer_commit(prod)
                prod.advance()

        mx, my, lx, ly, cc = self._row_state()
        lane, row_t, col_t = self._thread_rows(tidx, wg)
        row0 = m_blk * bm

        q_pipe.consumer_wait(pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1))
        read = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
        # Ping-pong (FA3): a warpgroup issues its block's two score MMAs only after the other warpgroup has
        # issued its own, so one's MMAs run under the other's exponentials; in a warpgroup, the x side's
        # update runs while the y side's MMA does. No MMA is in flight across iterations.
        if const_expr(self.pingpong):
            if wg == 0:
                cute.arch.barrier_arrive(barrier_id=1, number_of_threads=256)
        for j in cutlass.range(n_blocks, unroll=1):
            k_pipe.consumer_wait(read)
            if const_expr(self.pingpong):
                cute.arch.barrier(barrier_id=1 + wg, number_of_threads=256)
            acc_x = cute.make_rmem_tensor(coords.shape, Float32)
            acc_y = cute.make_rmem_tensor(coords.shape, Float32)
            self._issue(tiled_mma, acc_x, rQx, rKx, read.index)
            self._issue(tiled_mma, acc_y, rQy, rKy, read.index)
            if const_expr(self.pingpong):
                cute.arch.barrier_arrive(barrier_id=2 - wg, number_of_threads=256)
            warpgroup.wait_group(1)
            masked = const_expr(self.causal) and j * bn + bn > row0 + wg * 64
            px = cute.make_rmem_tensor(coords.shape, Float32)
            ax = cute.make_rmem_tensor((2,), Float32)
            bsum = cute.make_rmem_tensor((2,), Float32)
            shift = cute.make_rmem_tensor((2,), Float32)
            if masked:
                self._update_x(acc_x, px, ax, bsum, shift, mx, lx, j, row0, row_t, col_t, scale_x, True)
            else:
                self._update_x(acc_x, px, ax, bsum, shift, mx, lx, j, row0, row_t, col_t, scale_x, False)
            warpgroup.wait_group(0)
            k_pipe.consumer_release(read)
            read.advance()
            if const_expr(not self.late_refill):
                prod = self._refill(
                    k_pipe, prod, warp_idx, n_blocks, k_tile0, tma_kx, tma_ky, tKx_g, tKy_g, tKx_s, tKy_s
                )
            if masked:
                self._update_y(acc_x, acc_y, px, ax, bsum, shift, my, ly, cc, j, row0, row_t, col_t, scale_y, True)
            else:
                self._update_y(acc_x, acc_y, px, ax, bsum, shift, my, ly, cc, j, row0, row_t, col_t, scale_y, False)
            if const_expr(self.late_refill):
                prod = self._refill(
                    k_pipe, prod, warp_idx, n_blocks, k_tile0, tma_kx, tma_ky, tKx_g, tKy_g, tKx_s, tKy_s
                )

        self._store_rows(mx, my, lx, ly, cc, mKL, mLx, mLy, head * n + row0 + row_t, lane)

    @cute.jit
    def _issue(self, tiled_mma: cute.TiledMma, acc: cute.Tensor, rQ: cute.Tensor, rK: cute.Tensor, stage: Int32):
        warpgroup.fence()
        # a fresh atom: its accumulate flag changes here
        atom = cute.make_mma_atom(tiled_mma.op)
        atom.set(warpgroup.Field.ACCUMULATE, False)
        for k in cutlass.range_constexpr(self.d // 16):
            cute.gemm(atom, acc, rQ[None, None, k, 0], rK[None, None, k, stage], acc)
            atom.set(warpgroup.Field.ACCUMULATE, True)
        warpgroup.commit_group()

    @cute.jit
    def _row_state(self):
        """Per row (two rows a thread): the maxima, sums of both sides and the KL accumulator, (mx, my, lx, ly, cc)."""
        state = [cute.make_rmem_tensor((2,), Float32) for _ in range(5)]
        for r in cutlass.range_constexpr(2):
            state[0][r] = -Float32.inf
            state[1][r] = -Float32.inf
            for t in state[2:]:
                t[r] = 0.0
        return tuple(state)

    @cute.jit
    def _thread_rows(self, tidx: Int32, wg: Int32):
        """(lane, this thread's first row in the tile (the second: + 8), its first column in a block (+ c0 + 8 g))
        for a thread of consumer warpgroup wg."""
        lane = tidx % 32
        warp_in_wg = (tidx % 128) // 32
        return lane, wg * 64 + warp_in_wg * 16 + lane // 4, 2 * (lane % 4)

    @cute.jit
    def _block_max(
        self,
        acc: cute.Tensor,
        m_old: Float32,
        r: cutlass.Constexpr,
        col0: Int32,
        row0: Int32,
        row_t: Int32,
        col_t: Int32,
        scale: Float32,
        masked: cutlass.Constexpr,
    ):
        """One side's row r (of this thread's two) in a block: masks the scores past the diagonal to -inf (when
        masked), and returns the row's new maximum (log2 units), the shift to use (0 while every key so far is
        masked: the maximum stays -inf) and the rescale 2^(m_old - shift) of the row's earlier sums."""
        b = -Float32.inf
        for e in cutlass.range_constexpr(cute.size(acc) // 2):
            i = (e % 2) + 2 * r + 4 * (e // 2)
            if const_expr(masked):
                if col0 + col_t + (e % 2) + 8 * (e // 2) > row0 + row_t + 8 * r:
                    acc[i] = -Float32.inf
            b = cute.arch.fmax(b, acc[i])
        for off in cutlass.range_constexpr(2):  # the row's four threads
            b = cute.arch.fmax(b, cute.arch.shuffle_sync_bfly(b, offset=1 << off))
        m_new = cute.arch.fmax(m_old, b * scale)
        shift = m_new if m_new != -Float32.inf else Float32(0.0)
        return m_new, shift, cute.math.exp2(m_old - shift, fastmath=True)

    @cute.jit
    def _store_rows(
        self,
        mx: cute.Tensor,
        my: cute.Tensor,
        lx: cute.Tensor,
        ly: cute.Tensor,
        cc: cute.Tensor,
        mKL: cute.Tensor,
        mLx: cute.Tensor,
        mLy: cute.Tensor,
        first_row: Int32,
        lane: Int32,
    ):
        """Sums over each row's four threads, then one thread of each four writes the rows first_row and
        first_row + 8: kl (nats), lse_x and lse_y (log2 units)."""
        for r in cutlass.range_constexpr(2):
            sx = lx[r]
            sy = ly[r]
            sc = cc[r]
            for off in cutlass.range_constexpr(2):
                sx += cute.arch.shuffle_sync_bfly(sx, offset=1 << off)
                sy += cute.arch.shuffle_sync_bfly(sy, offset=1 << off)
                sc += cute.arch.shuffle_sync_bfly(sc, offset=1 << off)
            if lane % 4 == 0:
                row = first_row + 8 * r
                lse_x = mx[r] + cute.math.log2(sx, fastmath=False)
                lse_y = my[r] + cute.math.log2(sy, fastmath=False)
                mKL[row] = Float32(LN2) * (sc / sx - lse_x + lse_y)
                mLx[row] = lse_x
                mLy[row] = lse_y

    @cute.jit
    def _update_x(
        self,
        acc_x: cute.Tensor,
        px: cute.Tensor,
        ax: cute.Tensor,
        bsum: cute.Tensor,
        shift: cute.Tensor,
        mx: cute.Tensor,
        lx: cute.Tensor,
        j: Int32,
        row0: Int32,
        row_t: Int32,
        col_t: Int32,
        scale_x: Float32,
        masked: cutlass.Constexpr,
    ):
        """x side of block j: masks, maxima, acc_x <- t_x = s_x - m_x (log2 units), px <- 2^t_x, lx; ax the
        rescale of the row's earlier sums."""
        per_row = cute.size(acc_x) // 2
        col0 = j * self.bn
        for r in cutlass.range_constexpr(2):
            nx, nx_safe, ax[r] = self._block_max(acc_x, mx[r], r, col0, row0, row_t, col_t, scale_x, masked)
            sum_x = Float32(0.0)
            for e in cutlass.range_constexpr(per_row):
                i = (e % 2) + 2 * r + 4 * (e // 2)
                tx = acc_x[i] * scale_x - nx_safe
                p = cute.math.exp2(tx, fastmath=True)
                acc_x[i] = tx
                px[i] = p
                sum_x += p
            lx[r] = lx[r] * ax[r] + sum_x
            mx[r] = nx
            bsum[r] = sum_x
            shift[r] = nx_safe

    @cute.jit
    def _update_y(
        self,
        acc_x: cute.Tensor,
        acc_y: cute.Tensor,
        px: cute.Tensor,
        ax: cute.Tensor,
        bsum: cute.Tensor,
        shift: cute.Tensor,
        my: cute.Tensor,
        ly: cute.Tensor,
        cc: cute.Tensor,
        j: Int32,
        row0: Int32,
        row_t: Int32,
        col_t: Int32,
        scale_y: Float32,
        masked: cutlass.Constexpr,
    ):
        """y side of block j and the KL term c = sum 2^(s_x - m_x) (s_x - s_y), kept relative to m_x."""
        per_row = cute.size(acc_y) // 2
        col0 = j * self.bn
        for r in cutlass.range_constexpr(2):
            ny, ny_safe, ay = self._block_max(acc_y, my[r], r, col0, row0, row_t, col_t, scale_y, masked)
            sum_y = Float32(0.0)
            sum_c = Float32(0.0)
            for e in cutlass.range_constexpr(per_row):
                i = (e % 2) + 2 * r + 4 * (e // 2)
                ty = acc_y[i] * scale_y - ny_safe
                sum_y += cute.math.exp2(ty, fastmath=True)
                if const_expr(masked):
                    sum_c += px[i] * (acc_x[i] - ty) if px[i] > Float32(0.0) else Float32(0.0)
                else:
                    sum_c += px[i] * (acc_x[i] - ty)
            ly[r] = ly[r] * ay + sum_y
            my[r] = ny
            # c = sum 2^(s_x - m_x) (s_x - s_y); the block's terms were relative to the shifts
            cc[r] = cc[r] * ax[r] + sum_c + (shift[r] - ny_safe) * bsum[r]

    @cute.jit
    def _refill(
        self,
        k_pipe,
        prod,
        warp_idx: Int32,
        n_blocks: Int32,
        k_tile0: Int32,
        tma_kx: cute.CopyAtom,
        tma_ky: cute.CopyAtom,
        tKx_g: cute.Tensor,
        tKy_g: cute.Tensor,
        tKx_s: cute.Tensor,
        tKy_s: cute.Tensor,
    ):
        if warp_idx == 0 and prod.count < n_blocks:
            k_pipe.producer_acquire(prod)
            bar = k_pipe.producer_get_barrier(prod)
            cute.copy(tma_kx, tKx_g[(None, k_tile0 + prod.count)], tKx_s[(None, prod.index)], tma_bar_ptr=bar)
            cute.copy(tma_ky, tKy_g[(None, k_tile0 + prod.count)], tKy_s[(None, prod.index)], tma_bar_ptr=bar)
            k_pipe.producer_commit(prod)
            prod.advance()
        return prod

    @cute.jit
    def _consume(
        self,
        tiled_mma: cute.TiledMma,
        sQx: cute.Tensor,
        sQy: cute.Tensor,
        sKx: cute.Tensor,
        sKy: cute.Tensor,
        q_pipe,
        k_pipe,
        mKL: cute.Tensor,
        mLx: cute.Tensor,
        mLy: cute.Tensor,
        scale_x: Float32,
        scale_y: Float32,
        n: Int32,
        head: Int32,
        m_blk: Int32,
        n_blocks: Int32,
        tidx: Int32,
        cwg: Int32,
    ):
        """Consumer warpgroup cwg (0 or 1) of a CTA whose warpgroup 0 loads: the y side's update first (t_y kept
        in its accumulator), then the x side's with the KL term, so no probabilities are stored (240 registers)."""
        bm, bn = self.bm, self.bn
        thr_mma = tiled_mma.get_slice(cute.make_layout(self.wgs, stride=128)(cwg))
        rQx = tiled_mma.make_fragment_A(thr_mma.partition_A(sQx))
        rQy = tiled_mma.make_fragment_A(thr_mma.partition_A(sQy))
        rKx = tiled_mma.make_fragment_B(thr_mma.partition_B(sKx))
        rKy = tiled_mma.make_fragment_B(thr_mma.partition_B(sKy))
        acc_shape = thr_mma.partition_C(cute.make_identity_tensor((bm, bn))).shape
        mx, my, lx, ly, cc = self._row_state()
        lane, row_t, col_t = self._thread_rows(tidx, cwg)
        row0 = m_blk * bm
        pipeline_init_wait(cluster_shape_mn=(1, 1))
        q_pipe.consumer_wait(pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1))
        read = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
        if const_expr(self.pingpong):
            if cwg == 0:
                cute.arch.barrier_arrive(barrier_id=1, number_of_threads=256)
        for j in cutlass.range(n_blocks, unroll=1):
            k_pipe.consumer_wait(read)
            if const_expr(self.pingpong):
                cute.arch.barrier(barrier_id=1 + cwg, number_of_threads=256)
            acc_x = cute.make_rmem_tensor(acc_shape, Float32)
            acc_y = cute.make_rmem_tensor(acc_shape, Float32)
            self._issue(tiled_mma, acc_y, rQy, rKy, read.index)
            self._issue(tiled_mma, acc_x, rQx, rKx, read.index)
            if const_expr(self.pingpong):
                cute.arch.barrier_arrive(barrier_id=2 - cwg, number_of_threads=256)
            warpgroup.wait_group(1)
            masked = const_expr(self.causal) and j * bn + bn > row0 + cwg * 64
            ny_s = cute.make_rmem_tensor((2,), Float32)
            if masked:
                self._first_y(acc_y, ny_s, my, ly, j, row0, row_t, col_t, scale_y, True)
            else:
                self._first_y(acc_y, ny_s, my, ly, j, row0, row_t, col_t, scale_y, False)
            warpgroup.wait_group(0)
            k_pipe.consumer_release(read)
            read.advance()
            if masked:
                self._then_x(acc_x, acc_y, ny_s, mx, lx, cc, j, row0, row_t, col_t, scale_x, True)
            else:
                self._then_x(acc_x, acc_y, ny_s, mx, lx, cc, j, row0, row_t, col_t, scale_x, False)
        self._store_rows(mx, my, lx, ly, cc, mKL, mLx, mLy, head * n + row0 + row_t, lane)

    @cute.jit
    def _first_y(
        self,
        acc_y: cute.Tensor,
        ny_s: cute.Tensor,
        my: cute.Tensor,
        ly: cute.Tensor,
        j: Int32,
        row0: Int32,
        row_t: Int32,
        col_t: Int32,
        scale_y: Float32,
        masked: cutlass.Constexpr,
    ):
        """y side of block j: masks, maxima, ly; acc_y <- t_y = s_y - m_y (log2 units); ny_s the shift used."""
        per_row = cute.size(acc_y) // 2
        col0 = j * self.bn
        for r in cutlass.range_constexpr(2):
            ny, ny_safe, ay = self._block_max(acc_y, my[r], r, col0, row0, row_t, col_t, scale_y, masked)
            sum_y = Float32(0.0)
            for e in cutlass.range_constexpr(per_row):
                i = (e % 2) + 2 * r + 4 * (e // 2)
                ty = acc_y[i] * scale_y - ny_safe
                sum_y += cute.math.exp2(ty, fastmath=True)
                acc_y[i] = ty
            ly[r] = ly[r] * ay + sum_y
            my[r] = ny
            ny_s[r] = ny_safe

    @cute.jit
    def _then_x(
        self,
        acc_x: cute.Tensor,
        acc_y: cute.Tensor,
        ny_s: cute.Tensor,
        mx: cute.Tensor,
        lx: cute.Tensor,
        cc: cute.Tensor,
        j: Int32,
        row0: Int32,
        row_t: Int32,
        col_t: Int32,
        scale_x: Float32,
        masked: cutlass.Constexpr,
    ):
        """x side of block j and the KL term c = sum 2^(s_x - m_x) (s_x - s_y), from t_x and t_y."""
        per_row = cute.size(acc_x) // 2
        col0 = j * self.bn
        for r in cutlass.range_constexpr(2):
            nx, nx_safe, ax = self._block_max(acc_x, mx[r], r, col0, row0, row_t, col_t, scale_x, masked)
            sum_x = Float32(0.0)
            sum_c = Float32(0.0)
            for e in cutlass.range_constexpr(per_row):
                i = (e % 2) + 2 * r + 4 * (e // 2)
                tx = acc_x[i] * scale_x - nx_safe
                px = cute.math.exp2(tx, fastmath=True)
                sum_x += px
                if const_expr(masked):
                    sum_c += px * (tx - acc_y[i]) if px > Float32(0.0) else Float32(0.0)
                else:
                    sum_c += px * (tx - acc_y[i])
            lx[r] = lx[r] * ax + sum_x
            mx[r] = nx
            cc[r] = cc[r] * ax + sum_c + (nx_safe - ny_s[r]) * sum_x


def reference(qx, kx, qy, ky):
    """float64 forward KL(P_x || P_y) per row, causal, and both log-sum-exps (natural log)."""
    import torch

    d = qx.shape[-1]
    sx = (qx.double() @ kx.double().transpose(-1, -2)) / math.sqrt(d)
    sy = (qy.double() @ ky.double().transpose(-1, -2)) / math.sqrt(d)
    n = sx.shape[-1]
    mask = torch.ones(n, n, dtype=torch.bool, device=qx.device).triu(1)
    sx, sy = sx.masked_fill(mask, -math.inf), sy.masked_fill(mask, -math.inf)
    lx, ly = torch.log_softmax(sx, -1), torch.log_softmax(sy, -1)
    px = lx.exp()
    kl = torch.where(px > 0, px * (lx - ly), torch.zeros_like(px)).sum(-1)
    return kl, torch.logsumexp(sx, -1), torch.logsumexp(sy, -1)


class CuteForward:
    """One compiled KLForwardSm90 per (N, B*H) and config, called on [B, H, N, D] inputs."""

    def __init__(self, config):
        self.config, self.compiled = config, {}

    def __call__(self, qx, kx, qy, ky):
        import cuda.bindings.driver as cuda
        import torch
        from cutlass.cute.runtime import from_dlpack

        b, h, n, d = qx.shape
        outs = [torch.empty(b * h * n, device=qx.device, dtype=torch.float32) for _ in range(3)]
        args = [from_dlpack(t.reshape(b * h * n, d), assumed_align=16) for t in (qx, kx, qy, ky)]
        args += [from_dlpack(o, assumed_align=16) for o in outs]
        scalars = (Float32(LOG2E / math.sqrt(d)), Float32(LOG2E / math.sqrt(d)), Int32(n), Int32(b * h))
        stream = cuda.CUstream(torch.cuda.current_stream().cuda_stream)
        key = (n, b * h)
        if key not in self.compiled:
            bm, bn, stages, pingpong, late, producer = (*self.config, 0)[:6]
            kernel = KLForwardSm90(
                bm=bm, bn=bn, stages=stages, pingpong=bool(pingpong), late_refill=bool(late), producer=bool(producer)
            )
            self.compiled[key] = cute.compile(kernel, *args, *scalars, stream)
        fn = self.compiled[key]

        def call():
            fn(*args, *scalars, stream)

        call()
        return [o.view(b, h, n) for o in outs], call


def main() -> int:
    import argparse
    import sys

    import torch
    import torch.nn.functional as F

    from nitrobrew.attention.kernels_gluon import launch_fwd_gluon
    from nitrobrew.bench.common import loop_ms

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--configs",
        nargs="+",
        default=[
            "128,128,2,1,1,0",
            "128,128,2,1,1,1",
            "128,128,2,0,1,1",
            "128,128,2,0,1,0",
            "128,128,2,1,0,0",
            "128,64,4,1,1,0",
        ],
    )
    p.add_argument("--ns", type=int, nargs="+", default=[2048, 4096, 8192, 16384])
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU")
        return 2
    dev = torch.device("cuda")
    print(torch.cuda.get_device_name(), "torch", torch.__version__)
    configs = {c: CuteForward(tuple(int(x) for x in c.split(","))) for c in args.configs}

    def gluon(qx, kx, qy, ky):
        b, h, n, d = qx.shape
        outs = tuple(torch.empty(b, h, n, device=dev, dtype=torch.float32) for _ in range(3))
        scale = LOG2E / math.sqrt(d)

        def call():
            launch_fwd_gluon(qx, kx, qy, ky, lse_in=(outs[0], outs[0]), out=outs, scales=(scale, scale),
                             causal=True, causal_offset=0, fixed=(False, False), config=None)  # fmt: skip

        call()
        return outs, call

    g = torch.Generator(device="cpu").manual_seed(0)
    n = 1024
    qx, kx, qy, ky = ((torch.randn(1, 4, n, 128, generator=g) * 1.5).to(dev, torch.bfloat16) for _ in "1234")
    kl_r, lx_r, ly_r = reference(qx, kx, qy, ky)
    print(f"\nfloat64 reference, B = 1, H = 4, N = {n}, logits of std ~1.5 x 1.5: mean KL {kl_r.mean().item():.4f}")
    print("| kernel | max abs error of kl | of lse_x | of lse_y |")
    print("|---|---|---|---|")
    runs = [(f"CuTe DSL {c}", fwd) for c, fwd in configs.items()] + [("Gluon (the library's)", gluon)]
    for name, fwd in runs:
        (kl, lx, ly), _ = fwd(qx, kx, qy, ky)
        torch.cuda.synchronize()
        e = [(a.double() * s - r).abs().max().item() for a, s, r in ((kl, 1, kl_r), (lx, LN2, lx_r), (ly, LN2, ly_r))]
        print(f"| {name} | {e[0]:.2e} | {e[1]:.2e} | {e[2]:.2e} |")
    sys.stdout.flush()
    for n in args.ns:
        qx, kx, qy, ky, v = ((torch.randn(1, 32, n, 128, generator=g) * 1.5).to(dev, torch.bfloat16) for _ in "12345")
        fns = {}
        ref_out, fns["Gluon kernel (the library's)"] = gluon(qx, kx, qy, ky)
        for c, fwd in configs.items():
            (kl, lx, _), fns[f"CuTe DSL {c}"] = fwd(qx, kx, qy, ky)
            torch.cuda.synchronize()
            kl_diff = ((kl - ref_out[0]).abs() / ref_out[0].abs().clamp_min(1.0)).max().item()
            assert (lx - ref_out[1]).abs().max().item() < 1e-4 and kl_diff < 1e-3, (c, kl_diff)
        fns["SDPA default forward"] = lambda: F.scaled_dot_product_attention(qx, kx, v, is_causal=True)
        times: dict = {}
        with torch.no_grad():
            for _ in range(args.rounds):
                for name, fn in fns.items():
                    times.setdefault(name, []).append(loop_ms(fn, calls=20))
        base = sorted(times["SDPA default forward"])[len(times["SDPA default forward"]) // 2]
        print(f"\nN = {n} (B = 1, H = 32): kernels back to back, ms per call (median of {args.rounds} rounds)")
        print("| kernel | ms | x SDPA | TFLOP/s (2 score GEMMs) |")
        print("|---|---|---|---|")
        for name, t in times.items():
            m = sorted(t)[len(t) // 2]
            print(f"| {name} | {m:.3f} | {m / base:.2f} | {2 * 2 * 32 * n * n * 128 / 2 / m / 1e9:.0f} |")
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
