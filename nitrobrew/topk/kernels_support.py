"""Kernels of topk_kl(normalize="topk"): the student's logits at the K stored ids (gathered rows of the
head, no vocab-wide work), the per-row divergence and its coefficients, dX, and dW over the entries
sorted by id."""

from __future__ import annotations

import triton
import triton.language as tl

from ..core.launch import launch
from ..core.tl_utils import LOG2, TVD, expm1, f32, log1p, row_grad, row_terms


@triton.jit
def _split_lse(x, ok, offs, BLOCK_K: tl.constexpr):
    """The log-sum-exp of the ok entries as (max m, log l = log1p(tail), top): tail the mass outside one
    maximal entry (ties count; rowmath.split_lse), top marks that entry. m = 0 where no entry is ok."""
    xm = tl.where(ok, x, float("-inf"))
    m = tl.max(xm, axis=0)
    m = tl.where(m == float("-inf"), 0.0, m)
    first = tl.min(tl.where(ok & (xm == m), offs, BLOCK_K), axis=0)
    top = offs == first
    tail = tl.sum(tl.where(ok & (offs != first), tl.exp(x - m), 0.0), axis=0)
    return m, log1p(tail), top


@triton.jit
def _row_dots(x_row, W, ids, ok, D, stride_wv, BLOCK_D: tl.constexpr):
    """[BLOCK_KB] fp32: x_row . W[ids] over the D columns (0 where not ok)."""
    acc = tl.zeros(ids.shape, dtype=tl.float32)
    for d0 in range(0, D, BLOCK_D):
        offs_d = d0 + tl.arange(0, BLOCK_D)
        dm = offs_d < D
        x = tl.load(x_row + offs_d, mask=dm, other=0.0).to(tl.float32)
        w = tl.load(W + ids[:, None] * stride_wv + offs_d[None, :], mask=ok[:, None] & dm[None, :], other=0.0)
        acc += tl.sum(w.to(tl.float32) * x[None, :], axis=1)
    return acc


@triton.jit
def _entries(IDS, LP, at_i, at_l, valid, V):
    """(ids as int64, ok): entries that count: valid (row counted, inside K), finite log-prob, id in
    [0, V) (ids outside it at finite entries are rejected before the launch; never read them anyway)."""
    lp = tl.load(LP + at_l, mask=valid, other=float("-inf"))
    ids = tl.load(IDS + at_i, mask=valid, other=0).to(tl.int64)
    ok = valid & (lp != float("-inf")) & (ids >= 0) & (ids < V)
    return tl.where(ok, ids, 0), ok


@triton.jit
def topk_support_logits_kernel(
    X,
    W,
    IDS,
    LP,
    MASK,
    Z,
    N,
    K,
    D,
    V,
    stride_xn,
    stride_wv,
    stride_in,
    stride_ln,
    BLOCK_R: tl.constexpr,
    BLOCK_KB: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Z[n, k] += x_n . W[id_nk] over one block of columns (fp32 atomic adds into zeroed Z). The row tiles
    of one column block run before the next block's, so W cut to the block (V * BLOCK_D) stays in L2:
    each row of W comes from HBM about once per pass instead of once per entry."""
    rows = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    counted = (tl.load(MASK + rows, mask=rows < N, other=0.0) != 0.0)[:, None]
    offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    dm = offs_d < D
    x = tl.load(X + rows[:, None] * stride_xn + offs_d[None, :], mask=counted & dm[None, :], other=0.0)
    for k0 in range(0, K, BLOCK_KB):
        offs_k = (k0 + tl.arange(0, BLOCK_KB))[None, :]
        ids, ok = _entries(
            IDS, LP, rows[:, None] * stride_in + offs_k, rows[:, None] * stride_ln + offs_k, counted & (offs_k < K), V
        )
        w = tl.load(
            W + ids[:, :, None] * stride_wv + offs_d[None, None, :], mask=ok[:, :, None] & dm[None, None, :], other=0.0
        )
        part = tl.sum(w.to(tl.float32) * x.to(tl.float32)[:, None, :], axis=2)
        tl.atomic_add(Z + rows[:, None] * K + offs_k, part, mask=ok, sem="relaxed")


@triton.jit
def topk_support_fwd_kernel(
    X,
    W,
    B,
    IDS,
    LP,
    MASK,
    KD,
    COEF,
    KEY,
    COUNTS,
    K,
    D,
    V,
    stride_xn,
    stride_wv,
    stride_in,
    stride_ln,
    inv_temp,
    param,
    log_a,
    log_1ma,
    HAS_BIAS: tl.constexpr,
    RENORM_T: tl.constexpr,
    DIVERGENCE: tl.constexpr,
    HAS_Z: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_KB: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """One row: its keys, the [K] math, its coefficients and divergence. The raw logits are in the row's
    coefficient slots already (HAS_Z: from ``topk_support_logits_kernel``) or gathered here (x_n . W[id],
    the same fp32 sums, in a fixed order: the deterministic path). HAS_Z also counts the entries of
    every id into COUNTS[1 + id] (the buckets of dW's counting sort)."""
    inv_temp = f32(inv_temp)
    n = tl.program_id(0).to(tl.int64)
    counted = tl.load(MASK + n) != 0.0
    c_row = COEF + n * K
    key_row = KEY + n * K
    for k0 in range(0, K, BLOCK_KB):
        offs_k = k0 + tl.arange(0, BLOCK_KB)
        km = offs_k < K
        ids, ok = _entries(IDS, LP, n * stride_in + offs_k, n * stride_ln + offs_k, tl.where(counted, km, False), V)
        if HAS_Z:
            tl.atomic_add(COUNTS + 1 + ids, 1, mask=ok, sem="relaxed")
        else:
            tl.store(c_row + offs_k, _row_dots(X + n * stride_xn, W, ids, ok, D, stride_wv, BLOCK_D), mask=km)
        tl.store(key_row + offs_k, tl.where(ok, ids, V).to(tl.int32), mask=km)
    tl.debug_barrier()  # the row's logits and keys, written by every warp, are read back whole
    offs = tl.arange(0, BLOCK_K)
    km = offs < K
    key = tl.load(key_row + offs, mask=km, other=V)
    ok = key < V
    z = tl.load(c_row + offs, mask=km, other=0.0)
    if HAS_BIAS:
        z += tl.load(B + key, mask=ok, other=0.0).to(tl.float32)
    s = z * inv_temp
    # rowmath._split_rows: the student renormalized over the support with its top entry's digits kept,
    # the terms from d = log q - log p, the gradient v - q sum v (at a unique top v (1 - q) - q sum_rest v)
    m_s, ll_s, top = _split_lse(s, ok, offs, BLOCK_K)
    lq = tl.where(ok, (s - m_s) - ll_s, float("-inf"))
    lp_raw = tl.where(ok, tl.load(LP + n * stride_ln + offs, mask=km, other=0.0).to(tl.float32), float("-inf"))
    m_p, ll_p, top_p = _split_lse(lp_raw, ok, offs, BLOCK_K)  # the stored mass over the support: log P
    lp_norm = tl.where(ok, (lp_raw - m_p) - ll_p, float("-inf"))
    if RENORM_T:  # compared distributions: the teacher renormalized over the same support
        lp = lp_norm
    else:
        lp = lp_raw
    # d = log q - log p from the logits' gap to the stored log-probs, referred to its value at the teacher's
    # top entry, minus the centred log E_p[e^(gap - c)] (rowmath._split_rows)
    gap = tl.where(ok, s - lp_raw, 0.0)
    c = tl.sum(tl.where(top_p, gap, 0.0), axis=0)
    delta = gap - c
    r = tl.sum(tl.where(ok, tl.exp(lp_norm) * expm1(delta), 0.0), axis=0)
    plain = ((m_s - m_p) + (ll_s - ll_p)) - c
    d = delta - tl.where((r == r) & (tl.abs(r) < 0.5), log1p(r), plain)
    if not RENORM_T:
        d = d - (m_p + ll_p)
    phi, v, v2, v3 = row_terms(lp, lq, d, f32(param), DIVERGENCE)
    phi = tl.where(ok, phi, 0.0)
    v = tl.where(ok, v, 0.0)
    sum_v = tl.sum(v, axis=0)
    if DIVERGENCE == TVD:  # divergences.tvd_sum_u from the student's mass where q > p, q < p, q = p
        b_sum = tl.sum(tl.where(ok, v2, 0.0), axis=0)
        x = 2.0 * b_sum + tl.sum(tl.where(ok, v3, 0.0), axis=0)
        y = 2.0 * sum_v + tl.sum(tl.where(ok, v3, 0.0), axis=0)
        g = row_grad(lp, lq, d, top, 0.0, f32(param), tl.where(x <= y, x, -y), b_sum - sum_v, DIVERGENCE)
    else:
        q = tl.exp(lq)
        v_rest = tl.sum(tl.where(top, 0.0, v), axis=0)
        g = tl.where(top & (ll_s + tl.zeros_like(q) < LOG2), v * -expm1(-ll_s) - q * v_rest, v - q * sum_v)
    coef = tl.where(ok, g, 0.0) * inv_temp  # dD/dz
    tl.debug_barrier()  # every warp has read the logits before they are overwritten
    tl.store(c_row + offs, coef, mask=km)
    tl.store(KD + n, tl.sum(phi, axis=0))


@triton.jit
def topk_support_dx_kernel(
    W,
    KEY,
    COEF,
    SCALE,
    DX,
    N,
    K,
    D,
    V,
    stride_wv,
    stride_dn,
    scale_stride,
    BLOCK_R: tl.constexpr,
    BLOCK_KB: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """A [BLOCK_R rows, BLOCK_D columns] tile of dX = g sum_k c_k W[key_k]. The row tiles of one column
    block run before the next block's, so the gathered rows of W, cut to the block (V * BLOCK_D), stay in L2."""
    rows = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    rm = rows < N
    offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    dm = offs_d < D
    acc = tl.zeros([BLOCK_R, BLOCK_D], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_KB):
        offs_k = k0 + tl.arange(0, BLOCK_KB)
        at = rows[:, None] * K + offs_k[None, :]
        key = tl.load(KEY + at, mask=rm[:, None] & (offs_k < K)[None, :], other=V)
        ok = key < V
        c = tl.load(COEF + at, mask=ok, other=0.0)
        w = tl.load(
            W + tl.where(ok, key, 0).to(tl.int64)[:, :, None] * stride_wv + offs_d[None, None, :],
            mask=ok[:, :, None] & dm[None, None, :],
            other=0.0,
        )
        acc += tl.sum(w.to(tl.float32) * c[:, :, None], axis=1)
    g = tl.load(SCALE + rows * scale_stride, mask=rm, other=0.0)
    tl.store(
        DX + rows[:, None] * stride_dn + offs_d[None, :],
        (acc * g[:, None]).to(DX.dtype.element_ty),
        mask=rm[:, None] & dm[None, :],
    )


@triton.jit
def _entry_terms(X, ROWS, CS, pos, has, offs_d, dm, stride_xn):
    """For sorted positions pos (any shape): (g_row c, x_row[offs_d]) in fp32, 0 where not has; the x
    tile has pos's shape + [BLOCK_D]. Two dependent loads: the entry's row and term, then its x row."""
    row = tl.load(ROWS + pos, mask=has, other=0)
    c = tl.load(CS + pos, mask=has, other=0.0)
    x = tl.load(
        X + tl.expand_dims(row.to(tl.int64) * stride_xn, -1) + offs_d, mask=tl.expand_dims(has, -1) & dm, other=0.0
    )
    return c, x.to(tl.float32)


@triton.jit
def topk_support_sort_kernel(
    KEY,
    COEF,
    SCALE,
    CURSOR,
    OFFS,
    ORDER,
    ROWS,
    CS,
    SORTED,
    E,
    V,
    K,
    scale_stride,
    COUNTING: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """What dW reads at each sorted position: the entry's row, its term g_row c and its key.
    COUNTING (a counting sort's last step): entry e with key v < V takes the next slot of v's bucket
    [OFFS[v], OFFS[v + 1]) from the zeroed counter CURSOR[v]; the order inside a bucket is whatever the
    atomics give. Else ORDER holds the entries already sorted (a stable sort) and the keys are there too."""
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = i < E
    if COUNTING:
        e = i
        key = tl.load(KEY + e, mask=inside, other=V)
        ok = key < V
        slot = tl.atomic_add(CURSOR + key, 1, mask=ok, sem="relaxed")
        pos = tl.load(OFFS + key, mask=ok, other=0) + slot
        tl.store(SORTED + pos, key, mask=ok)
    else:
        pos = i
        ok = inside
        e = tl.load(ORDER + i, mask=ok, other=0)
    row = e // K
    c = tl.load(COEF + e, mask=ok, other=0.0) * tl.load(SCALE + row * scale_stride, mask=ok, other=0.0)
    tl.store(ROWS + pos, row.to(tl.int32), mask=ok)
    tl.store(CS + pos, c, mask=ok)


@triton.jit
def topk_support_dw_long_kernel(
    X,
    ROWS,
    CS,
    KEYS,
    OFFS,
    PART,
    PART_B,
    PKEYS,
    E,
    V,
    D,
    stride_xn,
    HAS_BIAS: tl.constexpr,
    CAP: tl.constexpr,
    SUB: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """One window of CAP sorted entries: its sums over the entries of long rows (count > CAP), in the
    window's two slots (PART[2w], PART[2w + 1], their keys in PKEYS), no atomics. A long row has more
    than CAP entries, so a window meets at most two of them (one ending, one starting); windows
    without any return at once and their slots are never read."""
    w = tl.program_id(0)
    w0 = w * CAP
    pos = w0 + tl.arange(0, CAP)
    E = tl.minimum(E, tl.load(OFFS + V))  # sorted entries with a key < V (the rest are not written)
    key = tl.load(KEYS + pos, mask=pos < E, other=V)
    inside = key < V
    cnt = tl.load(OFFS + key + 1, mask=inside, other=0) - tl.load(OFFS + key, mask=inside, other=0)
    is_long = inside & (cnt > CAP)
    if tl.sum(is_long.to(tl.int32), axis=0) > 0:
        k1 = tl.min(tl.where(is_long, key, V), axis=0)
        k2 = tl.max(tl.where(is_long, key, -1), axis=0)
        tl.store(PKEYS + 2 * w, k1)
        tl.store(PKEYS + 2 * w + 1, k2)
        slot1 = (2 * w).to(tl.int64) * D
        for d0 in range(0, D, BLOCK_D):
            offs_d = d0 + tl.arange(0, BLOCK_D)
            dm = offs_d < D
            a1 = tl.zeros([BLOCK_D], dtype=tl.float32)
            a2 = tl.zeros([BLOCK_D], dtype=tl.float32)
            b1 = tl.zeros([SUB], dtype=tl.float32)
            b2 = tl.zeros([SUB], dtype=tl.float32)
            for s0 in range(0, CAP, SUB):
                p = w0 + s0 + tl.arange(0, SUB)
                kk = tl.load(KEYS + p, mask=p < E, other=V)
                sel1 = kk == k1
                sel2 = tl.where(k2 != k1, kk == k2, False)
                c, x = _entry_terms(X, ROWS, CS, p, sel1 | sel2, offs_d, dm, stride_xn)
                c1 = tl.where(sel1, c, 0.0)
                c2 = tl.where(sel2, c, 0.0)
                a1 += tl.sum(c1[:, None] * x, axis=0)
                a2 += tl.sum(c2[:, None] * x, axis=0)
                b1 += c1
                b2 += c2
            tl.store(PART + slot1 + offs_d, a1, mask=dm)
            tl.store(PART + slot1 + D + offs_d, a2, mask=dm)
            if HAS_BIAS:
                if d0 == 0:
                    tl.store(PART_B + 2 * w, tl.sum(b1, axis=0))
                    tl.store(PART_B + 2 * w + 1, tl.sum(b2, axis=0))


@triton.jit
def topk_support_dw_rows_kernel(
    X,
    ROWS,
    CS,
    OFFS,
    PART,
    PART_B,
    PKEYS,
    DW,
    DB,
    V,
    D,
    stride_xn,
    stride_wv,
    HAS_BIAS: tl.constexpr,
    CAP: tl.constexpr,
    BLOCK_R: tl.constexpr,
    J: tl.constexpr,
    BLOCK_D: tl.constexpr,
    D_STEPS: tl.constexpr,
):
    """A [BLOCK_R vocab rows, D_STEPS * BLOCK_D] tile of dW (and db): the rows' entries walked in lock
    step, J entries of every row per step (their loads in flight together); long rows (count > CAP)
    add up the slots ``topk_support_dw_long_kernel`` wrote for them, window by window (a fixed order); rows without
    entries get zeros. The row tiles of one column group are neighbouring programs (the group's
    columns of x stay in L2)."""
    pid_d = tl.program_id(1)
    offs_v = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    vm = offs_v < V
    start = tl.load(OFFS + offs_v, mask=vm, other=0)
    count = tl.load(OFFS + offs_v + 1, mask=vm, other=0) - start
    is_long = count > CAP
    any_long = tl.sum(is_long.to(tl.int32), axis=0) > 0
    first_w = start // CAP
    n_w = tl.where(is_long, (start + count - 1) // CAP - first_w + 1, 0)  # windows a long row spans
    steps = tl.where(is_long, 0, count)
    jj = tl.arange(0, J)
    for i in range(0, D_STEPS):
        offs_d = (pid_d * D_STEPS + i) * BLOCK_D + tl.arange(0, BLOCK_D)
        dm = offs_d < D
        acc = tl.zeros([BLOCK_R, BLOCK_D], dtype=tl.float32)
        acc_b = tl.zeros([BLOCK_R], dtype=tl.float32)
        for j0 in range(0, tl.max(steps, axis=0), J):
            has = (j0 + jj)[None, :] < steps[:, None]
            c, x = _entry_terms(
                X, ROWS, CS, start[:, None] + j0 + jj[None, :], has, offs_d[None, None, :], dm[None, None, :], stride_xn
            )
            acc += tl.sum(c[:, :, None] * x, axis=1)
            acc_b += tl.sum(c, axis=1)
        if any_long:
            for j in range(0, tl.max(n_w, axis=0)):
                has_w = j < n_w
                w = first_w + j
                slot = 2 * w + tl.where(tl.load(PKEYS + 2 * w, mask=has_w, other=-1) == offs_v, 0, 1)
                acc += tl.load(
                    PART + slot.to(tl.int64)[:, None] * D + offs_d[None, :],
                    mask=has_w[:, None] & dm[None, :],
                    other=0.0,
                )
                if HAS_BIAS:
                    acc_b += tl.load(PART_B + slot, mask=has_w, other=0.0)
        tl.store(
            DW + offs_v.to(tl.int64)[:, None] * stride_wv + offs_d[None, :],
            acc.to(DW.dtype.element_ty),
            mask=vm[:, None] & dm[None, :],
        )
        if HAS_BIAS:
            if pid_d + i == 0:
                tl.store(DB + offs_v, acc_b.to(DB.dtype.element_ty), mask=vm)


@triton.jit
def topk_scalar_reduction_kernel(
    KD, MASK, TOTAL, KD_OUT, CE, UNIT, N, kd_weight, MEAN: tl.constexpr, BLOCK: tl.constexpr
):
    """The scalar reduction in one program: kd = sum of the rows' divergences (/ counted rows for the
    mean, 0 when none counts), total = kd_weight kd, ce = 0, and UNIT = d total / d row value."""
    kd = tl.zeros([BLOCK], dtype=tl.float32)
    counted = tl.zeros([BLOCK], dtype=tl.float32)
    for n0 in range(0, N, BLOCK):
        offs = n0 + tl.arange(0, BLOCK)
        kd += tl.load(KD + offs, mask=offs < N, other=0.0)
        counted += tl.load(MASK + offs, mask=offs < N, other=0.0)
    per_row = tl.full((), 1.0, tl.float32)
    if MEAN:
        per_row = 1.0 / tl.maximum(tl.sum(counted, axis=0), 1.0)
    kd_total = tl.sum(kd, axis=0) * per_row
    tl.store(KD_OUT, kd_total)
    tl.store(TOTAL, kd_total * f32(kd_weight))
    tl.store(CE, 0.0)
    tl.store(UNIT, per_row * f32(kd_weight))


def launch_logits(grid, *args, **constexprs) -> None:
    """``topk_support_logits_kernel[grid](*args, **constexprs)`` through ``core.launch``."""
    launch(topk_support_logits_kernel, grid, *args, **constexprs)


def launch_fwd(grid, *args, **constexprs) -> None:
    """``topk_support_fwd_kernel[grid](*args, **constexprs)`` through ``core.launch``."""
    launch(topk_support_fwd_kernel, grid, *args, **constexprs)


def launch_dx(grid, *args, **constexprs) -> None:
    """``topk_support_dx_kernel[grid](*args, **constexprs)`` through ``core.launch``."""
    launch(topk_support_dx_kernel, grid, *args, **constexprs)


def launch_sort(grid, *args, **constexprs) -> None:
    """``topk_support_sort_kernel[grid](*args, **constexprs)`` through ``core.launch``."""
    launch(topk_support_sort_kernel, grid, *args, **constexprs)


def launch_dw_long(grid, *args, **constexprs) -> None:
    """``topk_support_dw_long_kernel[grid](*args, **constexprs)`` through ``core.launch``."""
    launch(topk_support_dw_long_kernel, grid, *args, **constexprs)


def launch_dw_rows(grid, *args, **constexprs) -> None:
    """``topk_support_dw_rows_kernel[grid](*args, **constexprs)`` through ``core.launch``."""
    launch(topk_support_dw_rows_kernel, grid, *args, **constexprs)


def launch_scalar_reduction(grid, *args, **constexprs) -> None:
    """``topk_scalar_reduction_kernel[grid](*args, **constexprs)`` through ``core.launch``."""
    launch(topk_scalar_reduction_kernel, grid, *args, **constexprs)
