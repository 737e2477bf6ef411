"""Triton side of the gradient filter (grad_filter.py): column flags, and the products of the active
columns that a compacted product sized on the host did not cover.

Nothing here returns a value to the host: counts stay on the device, so the filter runs inside CUDA
graph captures and compiled graphs.

``hidden_filter_columns_kernel``: a program takes BLOCK_V columns of a gradient slab g [R, C] over ROWS of its
rows (atomic max into int32 flags). A column is active when some row i has |g_ij| > eps * rowmax_i
(rowmax: the row's largest |g| over the slab, written by the gradient kernel).
``hidden_drop_columns_kernel``: when at most half the columns are active (the count, on the device), zeroes
the inactive ones in g, so every later product, dense or compacted, drops exactly them.
``hidden_scatter_add_rows_kernel``: dW rows of the compacted product added into place (distinct rows: plain
loads and stores, where index_add_ on a 16-bit head takes atomics).

``hidden_overflow_dx_kernel`` / ``hidden_overflow_dw_kernel``: the columns perm[cap:kept] (kept: the columns the
slab keeps, read on the device: its active ones, all of them in an unfiltered slab; nothing to do
when kept <= cap):
dX[m] += sum_k g[m, perm[k]] W[perm[k]] and dW[perm[k]] += sum_m g[m, perm[k]] X[m].
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..core.launch import cdiv, launch

FILTER_BLOCK_V = 128  # columns per program of the flag kernels
FILTER_BLOCK_R = 64  # rows per tile of the flag kernels (best of an H100 sweep: 0.125 ms per 704 x 152064 slab)
FILTER_ROWS = 128  # rows per program (a second grid axis: narrow slabs still fill the GPU)
OVERFLOW_TILES = (64, 64, 32)  # (BLOCK_M, BLOCK_N, BLOCK_K) of the overflow products
OVERFLOW_DW_PROGRAMS = 64  # column-block programs of the dW overflow (each walks a stride)


@triton.jit
def hidden_filter_columns_kernel(
    g_ptr,
    stride_g,
    rowmax_ptr,
    active_ptr,
    count_ptr,
    n_rows,
    n_cols,
    eps,
    ROWS: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    # grid (column blocks, groups of ROWS rows): a column's flag is the max over its row groups; the
    # group that turns a flag on (atomic max returns the old 0) counts the column
    cols = tl.program_id(0) * BLOCK_V + tl.arange(0, BLOCK_V)
    col_ok = cols < n_cols
    hit = tl.zeros([BLOCK_V], dtype=tl.int32)
    for r0 in range(tl.program_id(1) * ROWS, tl.minimum(n_rows, (tl.program_id(1) + 1) * ROWS), BLOCK_R):
        rows = r0 + tl.arange(0, BLOCK_R)
        row_ok = rows < n_rows
        thr = tl.load(rowmax_ptr + rows, mask=row_ok, other=float("inf")) * eps
        ptrs = g_ptr + rows.to(tl.int64)[:, None] * stride_g + cols[None, :]
        g = tl.load(ptrs, mask=row_ok[:, None] & col_ok[None, :], other=0.0).to(tl.float32)
        hit = tl.maximum(hit, tl.max((tl.abs(g) > thr[:, None]).to(tl.int32), axis=0))
    on = col_ok & (hit > 0)
    old = tl.atomic_max(active_ptr + cols, hit, mask=on)
    tl.atomic_add(count_ptr, tl.sum((on & (old == 0)).to(tl.int32), axis=0))


@triton.jit
def hidden_drop_columns_kernel(
    g_ptr,
    stride_g,
    active_ptr,
    count_ptr,
    n_rows,
    n_cols,
    ROWS: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    """Zero the inactive columns of g when at most half the columns are active (else the slab is not
    filtered): stores only, and none at all in an unfiltered slab."""
    count = tl.load(count_ptr)
    if 2 * count <= n_cols:
        cols = tl.program_id(0) * BLOCK_V + tl.arange(0, BLOCK_V)
        drop = (cols < n_cols) & (tl.load(active_ptr + cols, mask=cols < n_cols, other=1) == 0)
        if tl.max(drop.to(tl.int32), axis=0) > 0:
            for r0 in range(tl.program_id(1) * ROWS, tl.minimum(n_rows, (tl.program_id(1) + 1) * ROWS), BLOCK_R):
                rows = r0 + tl.arange(0, BLOCK_R)
                ptrs = g_ptr + rows.to(tl.int64)[:, None] * stride_g + cols[None, :]
                zero = tl.zeros([BLOCK_R, BLOCK_V], dtype=g_ptr.dtype.element_ty)
                tl.store(ptrs, zero, mask=(rows < n_rows)[:, None] & drop[None, :])


@triton.jit
def hidden_scatter_add_rows_kernel(
    dst_ptr, stride_dst, src_ptr, stride_src, idx_ptr, kept_ptr, first_row, n_dims, BLOCK_D: tl.constexpr
):
    """dst[idx[r]] += src[r] for first_row + r < kept (idx: distinct rows, so no atomics)."""
    r = tl.program_id(0)
    if first_row + r < tl.load(kept_ptr):
        dst_row = dst_ptr + tl.load(idx_ptr + r).to(tl.int64) * stride_dst
        src_row = src_ptr + r.to(tl.int64) * stride_src
        for d0 in range(0, n_dims, BLOCK_D):
            d = d0 + tl.arange(0, BLOCK_D)
            ok = d < n_dims
            acc = tl.load(dst_row + d, mask=ok, other=0.0).to(tl.float32) + tl.load(src_row + d, mask=ok, other=0.0)
            tl.store(dst_row + d, acc.to(dst_ptr.dtype.element_ty), mask=ok)


@triton.jit
def hidden_overflow_dx_kernel(
    g_ptr,
    stride_g,
    w_ptr,
    stride_w,
    perm_ptr,
    kept_ptr,
    dx_ptr,
    stride_dx,
    n_rows,
    n_dims,
    cap,
    IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    kept = tl.load(kept_ptr).to(tl.int32)
    if kept > cap:
        rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        m_ok, n_ok = rm < n_rows, rn < n_dims
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(cap, kept, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_ok = ks < kept
            cols = tl.load(perm_ptr + ks, mask=k_ok, other=0)
            a = tl.load(
                g_ptr + rm.to(tl.int64)[:, None] * stride_g + cols[None, :],
                mask=m_ok[:, None] & k_ok[None, :],
                other=0.0,
            )
            b = tl.load(
                w_ptr + cols.to(tl.int64)[:, None] * stride_w + rn[None, :],
                mask=k_ok[:, None] & n_ok[None, :],
                other=0.0,
            ).to(a.dtype)
            acc += tl.dot(a, b, input_precision="ieee" if IEEE else "tf32")
        out = dx_ptr + rm.to(tl.int64)[:, None] * stride_dx + rn[None, :]
        mask = m_ok[:, None] & n_ok[None, :]
        tl.store(out, tl.load(out, mask=mask, other=0.0) + acc, mask=mask)


@triton.jit
def hidden_overflow_dw_kernel(
    g_ptr,
    stride_g,
    x_ptr,
    stride_x,
    perm_ptr,
    kept_ptr,
    dw_ptr,
    stride_dw,
    n_rows,
    n_dims,
    cap,
    IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    # a bounded grid: each program walks every num_programs-th block of BLOCK_K columns past cap
    kept = tl.load(kept_ptr).to(tl.int32)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = rn < n_dims
    for k0 in range(cap + tl.program_id(0) * BLOCK_K, kept, tl.num_programs(0) * BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < kept
        cols = tl.load(perm_ptr + ks, mask=k_ok, other=0)
        acc = tl.zeros([BLOCK_K, BLOCK_N], dtype=tl.float32)
        for m0 in range(0, n_rows, BLOCK_M):
            rm = m0 + tl.arange(0, BLOCK_M)
            m_ok = rm < n_rows
            a = tl.load(
                g_ptr + rm.to(tl.int64)[:, None] * stride_g + cols[None, :],
                mask=m_ok[:, None] & k_ok[None, :],
                other=0.0,
            )
            x = tl.load(
                x_ptr + rm.to(tl.int64)[:, None] * stride_x + rn[None, :], mask=m_ok[:, None] & n_ok[None, :], other=0.0
            ).to(a.dtype)
            acc += tl.dot(tl.trans(a), x, input_precision="ieee" if IEEE else "tf32")
        out = dw_ptr + cols.to(tl.int64)[:, None] * stride_dw + rn[None, :]
        mask = k_ok[:, None] & n_ok[None, :]
        prev = tl.load(out, mask=mask, other=0.0).to(tl.float32)
        tl.store(out, (prev + acc).to(dw_ptr.dtype.element_ty), mask=mask)


def launch_filter_columns(g: torch.Tensor, rowmax: torch.Tensor, eps: float):
    """(active, count): active[j] = 1 (int32) for the slab's active columns, count [1] their number."""
    rows, n_cols = g.shape
    flags = torch.zeros(n_cols + 1, dtype=torch.int32, device=g.device)  # one fill for both
    active, count = flags[:n_cols], flags[n_cols:]
    launch(
        hidden_filter_columns_kernel,
        (cdiv(n_cols, FILTER_BLOCK_V), cdiv(rows, FILTER_ROWS)),
        g,
        g.stride(0),
        rowmax,
        active,
        count,
        rows,
        n_cols,
        eps,
        ROWS=FILTER_ROWS,
        BLOCK_R=FILTER_BLOCK_R,
        BLOCK_V=FILTER_BLOCK_V,
        num_warps=4,
    )
    return active, count


def launch_drop_columns(g: torch.Tensor, active: torch.Tensor, count: torch.Tensor) -> None:
    """g's inactive columns zeroed if the slab is filtered (count <= half its columns)."""
    rows, n_cols = g.shape
    launch(
        hidden_drop_columns_kernel,
        (cdiv(n_cols, FILTER_BLOCK_V), cdiv(rows, FILTER_ROWS)),
        g,
        g.stride(0),
        active,
        count,
        rows,
        n_cols,
        ROWS=FILTER_ROWS,
        BLOCK_R=FILTER_BLOCK_R,
        BLOCK_V=FILTER_BLOCK_V,
        num_warps=4,
    )


def launch_scatter_add_rows(
    dst: torch.Tensor, src: torch.Tensor, idx: torch.Tensor, kept: torch.Tensor, first_row: int = 0
) -> None:
    """dst[idx[r]] += src[r] for the rows r with first_row + r < kept (a device count)."""
    if src.shape[0] == 0:
        return
    launch(
        hidden_scatter_add_rows_kernel,
        (src.shape[0],),
        dst,
        dst.stride(0),
        src,
        src.stride(0),
        idx,
        kept,
        first_row,
        src.shape[1],
        BLOCK_D=1024,
        num_warps=4,
    )


def launch_overflow(g, perm, kept, cap: int, xs, w, dx_acc, dw) -> None:
    """The products of the columns perm[cap:kept] (kept: grad_filter.kept_columns, on the device; none
    when kept <= cap)."""
    rows, n_cols = g.shape
    if n_cols <= cap or rows == 0:
        return
    bm, bn, bk = OVERFLOW_TILES
    ieee = g.dtype == torch.float32
    if dx_acc is not None:
        launch(
            hidden_overflow_dx_kernel,
            (cdiv(rows, bm), cdiv(w.shape[1], bn)),
            g,
            g.stride(0),
            w,
            w.stride(0),
            perm,
            kept,
            dx_acc,
            dx_acc.stride(0),
            rows,
            w.shape[1],
            cap,
            IEEE=ieee,
            BLOCK_M=bm,
            BLOCK_N=bn,
            BLOCK_K=bk,
            num_warps=4,
        )
    if dw is not None:
        launch(
            hidden_overflow_dw_kernel,
            (min(cdiv(n_cols - cap, bk), OVERFLOW_DW_PROGRAMS), cdiv(xs.shape[1], bn)),
            g,
            g.stride(0),
            xs,
            xs.stride(0),
            perm,
            kept,
            dw,
            dw.stride(0),
            rows,
            xs.shape[1],
            cap,
            IEEE=ieee,
            BLOCK_M=bm,
            BLOCK_N=bn,
            BLOCK_K=bk,
            num_warps=4,
        )
