"""Triton kernels of top-k KD.

normalize="full" (vocab-wide, in the manner of cut-cross-entropy; memory O(rows * K)):
- ``topk_cm_lse_kernel``: one program per (row block, vocab tile), grouped for L2 reuse; the logit
  tile is accumulated in fp32 from bf16/fp16/fp32 operands, its tempered log-sum-exp over the entries
  outside each row's valid top-k ids (the student's mass there, accumulated directly: exact however
  small), kept as (max, rescaled sum), and the raw log-sum-exp over all entries (the hard-label CE at
  T != 1) are merged into the per-row results under a per-row-block lock.
- ``topk_cm_bwd_kernel``: recomputes each logit tile, forms the gradient tile (the coefficients of
  the row's stored ids that fall in the tile, their whole KD gradient, + ``tail_n * exp(s_nj -
  lse_tail_n)`` at the other entries, + the CE part) and feeds it into dX and dW through locked
  read-add-write of fp32 accumulators (or of the gradients themselves in their dtype, as CCE does).

Finding a row's top-k ids inside a tile (``_tile_row_ids``): each row's valid ids are sorted once
on the host ([rows, K] int32). A program binary-searches, for each of its BLOCK_B rows at once,
where the tile's column range starts and ends in the row's list (2 * ceil(log2(K + 1)) gathered
loads of BLOCK_B ids), then walks the rows' slices in lock step: c = the largest number of one
row's ids inside the tile, c compare-selects of the [BLOCK_B, BLOCK_V] tile. c is at most
min(K, BLOCK_V) and usually 0-3 (K ids spread over V / BLOCK_V tiles), so the cost stays a small
fraction of the tile's 2 * BLOCK_B * BLOCK_V * D matmul FLOPs for K up to 256 and beyond; ids
clustered in one tile (c = BLOCK_V in the worst case) cost BLOCK_V elementwise passes there.

The ids of "full" (bandwidth-bound): ``topk_cm_gather_kernel``: s_nk = x_n . w_{id_nk} (+ b).
normalize="topk" has its own kernels (``triton_support``).
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..core.launch import launch
from ..core.tl_utils import logaddexp


@triton.jit
def topk_cm_gather_kernel(
    X,
    W,
    B,
    IDS,
    OUT,
    K,
    D,
    V_LOCAL,
    stride_xn,
    stride_wv,
    stride_in,
    stride_on,
    HAS_BIAS: tl.constexpr,
    ACC: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    n = tl.program_id(0).to(tl.int64)
    offs_k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    kmask = offs_k < K
    ids = tl.load(IDS + n * stride_in + offs_k, mask=kmask, other=0).to(tl.int64)
    inside = kmask & (ids >= 0) & (ids < V_LOCAL)
    ids = tl.where(inside, ids, 0)
    acc = tl.zeros([BLOCK_K], dtype=ACC)
    for d0 in range(0, D, BLOCK_D):
        offs_d = d0 + tl.arange(0, BLOCK_D)
        dmask = offs_d < D
        x = tl.load(X + n * stride_xn + offs_d, mask=dmask, other=0.0).to(ACC)
        w = tl.load(
            W + ids[:, None] * stride_wv + offs_d[None, :], mask=inside[:, None] & dmask[None, :], other=0.0
        ).to(ACC)
        acc += tl.sum(w * x[None, :], axis=1)
    if HAS_BIAS:
        acc += tl.load(B + ids, mask=inside, other=0.0).to(ACC)
    acc = tl.where(inside, acc, 0.0)
    tl.store(OUT + n * stride_on + offs_k, acc, mask=kmask)


@triton.jit
def _tile_ids(N, V, BLOCK_B: tl.constexpr, BLOCK_V: tl.constexpr, GROUP_B: tl.constexpr):
    """Grouped ordering of (row block, vocab tile) programs: GROUP_B row blocks share vocab tiles."""
    pid = tl.program_id(0)
    num_pid_b = tl.cdiv(N, BLOCK_B)
    num_pid_v = tl.cdiv(V, BLOCK_V)
    num_pid_in_group = GROUP_B * num_pid_v
    group_id = pid // num_pid_in_group
    first_pid_b = group_id * GROUP_B
    group_size_b = min(num_pid_b - first_pid_b, GROUP_B)
    pid_b = first_pid_b + ((pid % num_pid_in_group) % group_size_b)
    pid_v = (pid % num_pid_in_group) // group_size_b
    return pid_b, pid_v


@triton.jit
def _logit_tile(
    X,
    W,
    B,
    offs_b,
    offs_v,
    D,
    stride_xn,
    stride_wv,
    HAS_BIAS: tl.constexpr,
    DOT_PREC: tl.constexpr,
    BLOCK_B: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_D: tl.constexpr,
    EVEN_D: tl.constexpr,
    DOT_F32: tl.constexpr,
):
    offs_d = tl.arange(0, BLOCK_D)
    x_ptrs = X + (offs_b[:, None].to(tl.int64) * stride_xn + offs_d[None, :])
    w_ptrs = W + (offs_v[None, :].to(tl.int64) * stride_wv + offs_d[:, None])
    acc = tl.zeros((BLOCK_B, BLOCK_V), dtype=tl.float32)
    for d in range(0, tl.cdiv(D, BLOCK_D)):
        if EVEN_D:
            x = tl.load(x_ptrs)
            w = tl.load(w_ptrs)
        else:
            x = tl.load(x_ptrs, mask=offs_d[None, :] < D - d * BLOCK_D, other=0.0)
            w = tl.load(w_ptrs, mask=offs_d[:, None] < D - d * BLOCK_D, other=0.0)
        if DOT_F32:  # Triton's interpreter computes bf16 dots wrongly: upcast there
            x = x.to(tl.float32)
            w = w.to(tl.float32)
        acc = tl.dot(x, w, acc, input_precision=DOT_PREC)
        x_ptrs += BLOCK_D
        w_ptrs += BLOCK_D
    if HAS_BIAS:
        acc += tl.load(B + offs_v).to(tl.float32)[None, :]
    return acc


@triton.jit
def _count_below(IDS, base, target, K, n_steps, BLOCK_B: tl.constexpr):
    """Per row: how many of the row's ascending ids (at IDS + base) are < target (lower bound)."""
    lo = tl.zeros((BLOCK_B,), dtype=tl.int32)
    hi = lo + K
    for _ in range(n_steps):
        active = lo < hi
        mid = (lo + hi) // 2
        v = tl.load(IDS + base + mid, mask=active, other=0)
        lo = tl.where(active & (v < target), mid + 1, lo)
        hi = tl.where(active & (v >= target), mid, hi)
    return lo


@triton.jit
def _tile_row_ids(
    IDS,
    COEF,
    rows_c,
    cols_g,
    col_lo,
    col_hi,
    stride_in,
    K,
    n_steps,
    s,
    MASK: tl.constexpr,
    WITH_COEF: tl.constexpr,
    BLOCK_B: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    """The rows' sorted top-k ids inside the tile's global columns [col_lo, col_hi): returns s with
    -inf there (MASK) and the tile of their coefficients COEF (WITH_COEF, same layout as IDS).
    Cost: see the module notes."""
    base = rows_c.to(tl.int64) * stride_in
    start = _count_below(IDS, base, col_lo, K, n_steps, BLOCK_B)
    count = _count_below(IDS, base, col_hi, K, n_steps, BLOCK_B) - start
    sparse = tl.zeros((BLOCK_B, BLOCK_V), dtype=tl.float32)
    for i in range(0, tl.max(count, axis=0)):
        here = i < count
        idv = tl.load(IDS + base + start + i, mask=here, other=-1)
        hit = idv[:, None] == cols_g[None, :]
        if MASK:
            s = tl.where(hit, float("-inf"), s)
        if WITH_COEF:
            c = tl.load(COEF + base + start + i, mask=here, other=0.0)
            sparse += tl.where(hit, c[:, None], 0.0)
    return s, sparse


@triton.jit
def topk_cm_lse_kernel(
    X,
    W,
    B,
    M_S,
    L_S,
    LSE_Z,
    LOCKS,
    IDS,
    N,
    V,
    D,
    K,
    n_steps,
    inv_t,
    stride_xn,
    stride_wv,
    stride_in,
    HAS_BIAS: tl.constexpr,
    HAS_Z: tl.constexpr,
    DOT_PREC: tl.constexpr,
    BLOCK_B: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_D: tl.constexpr,
    GROUP_B: tl.constexpr,
    EVEN_D: tl.constexpr,
    DOT_F32: tl.constexpr,
):
    """Per row: (M_S, L_S) the max and rescaled sum of the tempered logits outside the row's valid ids
    (M_S = -inf, L_S = 0 before any entry), LSE_Z the raw logits' log-sum-exp (HAS_Z)."""
    pid_b, pid_v = _tile_ids(N, V, BLOCK_B, BLOCK_V, GROUP_B)
    rows = pid_b * BLOCK_B + tl.arange(0, BLOCK_B)
    cols = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
    z = _logit_tile(
        X,
        W,
        B,
        rows % N,
        cols % V,
        D,
        stride_xn,
        stride_wv,
        HAS_BIAS,
        DOT_PREC,
        BLOCK_B,
        BLOCK_V,
        BLOCK_D,
        EVEN_D,
        DOT_F32,
    )
    z = tl.where((cols < V)[None, :], z, float("-inf"))
    s = z * inv_t
    # the student's mass outside the ids: leave out each row's top-k ids
    s, _ = _tile_row_ids(
        IDS,
        IDS,
        rows % N,
        cols,
        pid_v * BLOCK_V,
        tl.minimum(pid_v * BLOCK_V + BLOCK_V, V),
        stride_in,
        K,
        n_steps,
        s,
        True,
        False,
        BLOCK_B,
        BLOCK_V,
    )
    m = tl.max(s, axis=1)  # -inf where the tile has no entry left
    total = tl.sum(tl.exp(s - tl.where(m == float("-inf"), 0.0, m)[:, None]), axis=1)
    if HAS_Z:
        mz = tl.max(z, axis=1)
        lse_z = mz + tl.log(tl.sum(tl.exp(z - mz[:, None]), axis=1))
    rmask = rows < N
    lock = LOCKS + pid_b
    while tl.atomic_cas(lock, 0, 1) == 1:
        pass
    tl.debug_barrier()
    m_old = tl.load(M_S + rows, mask=rmask, other=0.0, cache_modifier=".cg")
    l_old = tl.load(L_S + rows, mask=rmask, other=0.0, cache_modifier=".cg")
    m_new = tl.maximum(m_old, m)
    safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    tl.store(M_S + rows, m_new, mask=rmask)
    tl.store(L_S + rows, l_old * tl.exp(m_old - safe) + total * tl.exp(m - safe), mask=rmask)
    if HAS_Z:
        old_z = tl.load(LSE_Z + rows, mask=rmask, other=0.0, cache_modifier=".cg")
        tl.store(LSE_Z + rows, logaddexp(old_z, lse_z), mask=rmask)
    tl.debug_barrier()
    tl.atomic_xchg(lock, 0)


@triton.jit
def _locked_add(ptrs, val, mask, lock):
    while tl.atomic_cas(lock, 0, 1) == 1:
        pass
    tl.debug_barrier()
    cur = tl.load(ptrs, mask=mask, other=0.0, cache_modifier=".cg")
    tl.store(ptrs, (cur.to(tl.float32) + val).to(ptrs.dtype.element_ty), mask=mask, cache_modifier=".cg")
    tl.debug_barrier()
    tl.atomic_xchg(lock, 0)


@triton.jit
def topk_cm_bwd_kernel(
    X,
    W,
    B,
    LSE_Z,
    CE,
    LABELS,
    IDS,
    COEF,
    TAIL_C,
    LSE_T,
    DX,
    DW,
    DB,
    LOCKS_X,
    LOCKS_W,
    N,
    V,
    D,
    K,
    n_steps,
    inv_t,
    stride_xn,
    stride_wv,
    stride_dxn,
    stride_dwv,
    stride_in,
    n_dchunks,
    HAS_BIAS: tl.constexpr,
    HAS_CE: tl.constexpr,
    NEED_W: tl.constexpr,
    DOT_PREC: tl.constexpr,
    BLOCK_B: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_D: tl.constexpr,
    MM_BLOCK_D: tl.constexpr,
    GROUP_B: tl.constexpr,
    EVEN_D: tl.constexpr,
    DOT_F32: tl.constexpr,
):
    pid_b, pid_v = _tile_ids(N, V, BLOCK_B, BLOCK_V, GROUP_B)
    ar_b = tl.arange(0, BLOCK_B)
    ar_v = tl.arange(0, BLOCK_V)
    rows = pid_b * BLOCK_B + ar_b
    cols = pid_v * BLOCK_V + ar_v
    rmask = rows < N
    vmask = cols < V
    rows_c = rows % N
    cols_c = cols % V
    z = _logit_tile(
        X, W, B, rows_c, cols_c, D, stride_xn, stride_wv, HAS_BIAS, DOT_PREC, BLOCK_B, BLOCK_V, BLOCK_D, EVEN_D, DOT_F32
    )
    s = z * inv_t
    cols_g = cols
    # the stored ids of the tile: their coefficients (their whole KD gradient), and -inf in the outside logits
    s_out, g = _tile_row_ids(
        IDS,
        COEF,
        rows_c,
        cols_g,
        pid_v * BLOCK_V,
        tl.minimum(pid_v * BLOCK_V + BLOCK_V, V),
        stride_in,
        K,
        n_steps,
        s,
        True,
        True,
        BLOCK_B,
        BLOCK_V,
    )
    # the other entries: the bucket's coefficient
    tail = tl.load(TAIL_C + rows_c)
    lse_t = tl.load(LSE_T + rows_c)  # finite (0 where the row has no outside entry: tail is 0 there)
    s_out = tl.where(vmask[None, :], s_out, float("-inf"))
    g += tail[:, None] * tl.exp(s_out - lse_t[:, None])
    if HAS_CE:
        lse_z = tl.load(LSE_Z + rows_c)
        ce = tl.load(CE + rows_c)
        g += ce[:, None] * tl.exp(z - lse_z[:, None])
        label = tl.load(LABELS + rows_c)  # global id, -1 where none
        g += tl.where(label[:, None] == cols_g[None, :], -ce[:, None], 0.0)
    g = tl.where(rmask[:, None] & vmask[None, :], g, 0.0)
    if HAS_BIAS:
        if NEED_W:
            tl.atomic_add(DB + cols, tl.sum(g, axis=0), mask=vmask)
    gd = g.to(X.dtype.element_ty)
    if DOT_F32:
        gd = gd.to(tl.float32)
    offs_md = tl.arange(0, MM_BLOCK_D)
    # dX[rows] += g @ W[cols]
    w_ptrs = W + cols_c[:, None].to(tl.int64) * stride_wv + offs_md[None, :]
    dx_ptrs = DX + rows_c[:, None].to(tl.int64) * stride_dxn + offs_md[None, :]
    for d in range(0, tl.cdiv(D, MM_BLOCK_D)):
        dm = offs_md[None, :] < D - d * MM_BLOCK_D
        w = tl.load(w_ptrs, mask=vmask[:, None] & dm, other=0.0)
        if DOT_F32:
            w = w.to(tl.float32)
        part = tl.dot(gd, w, input_precision=DOT_PREC)
        _locked_add(dx_ptrs, part, rmask[:, None] & dm, LOCKS_X + pid_b * n_dchunks + d)
        w_ptrs += MM_BLOCK_D
        dx_ptrs += MM_BLOCK_D
    if NEED_W:
        # dW[cols] += g^T @ X[rows]
        gt = tl.trans(gd)
        x_ptrs = X + rows_c[:, None].to(tl.int64) * stride_xn + offs_md[None, :]
        dw_ptrs = DW + cols_c[:, None].to(tl.int64) * stride_dwv + offs_md[None, :]
        for d in range(0, tl.cdiv(D, MM_BLOCK_D)):
            dm = offs_md[None, :] < D - d * MM_BLOCK_D
            x = tl.load(x_ptrs, mask=rmask[:, None] & dm, other=0.0)
            if DOT_F32:
                x = x.to(tl.float32)
            part = tl.dot(gt, x, input_precision=DOT_PREC)
            _locked_add(dw_ptrs, part, vmask[:, None] & dm, LOCKS_W + pid_v * n_dchunks + d)
            x_ptrs += MM_BLOCK_D
            dw_ptrs += MM_BLOCK_D


def launch_gather(grid, *args, **constexprs) -> None:
    """``topk_cm_gather_kernel[grid](*args, **constexprs)`` through ``core.launch``."""
    launch(topk_cm_gather_kernel, grid, *args, **constexprs)


def launch_lse(grid, *args, **constexprs) -> None:
    """``topk_cm_lse_kernel[grid](*args, **constexprs)`` through ``core.launch``."""
    launch(topk_cm_lse_kernel, grid, *args, **constexprs)


def launch_bwd(grid, *args, **constexprs) -> None:
    """``topk_cm_bwd_kernel[grid](*args, **constexprs)`` through ``core.launch``."""
    launch(topk_cm_bwd_kernel, grid, *args, **constexprs)
