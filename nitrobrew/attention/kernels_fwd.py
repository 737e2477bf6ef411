"""Triton forward of attention KL: one pass over key tiles, per-row statistics out.

Program = (query block of BM rows, batch * head). It keeps both query tiles (x side and y side,
their own head dims) and streams the two key tiles of each key block: two score products
``x = q_x k_x^T``, ``y = q_y k_y^T`` with fp32 accumulation, in log2 units (the scale folds in
log2(e), exponentials are exp2). Per row it carries the centred online state of docs/design.md §3:
running maxima m_x, m_y, sums l_x, l_y and

    c = sum_j 2^{x_j - m_x} ((x_j - m_x) - (y_j - m_y))          (log2 units)

and writes KL = ln2 (c / l_x - log2 l_x + log2 l_y) plus both log-sum-exps (log2 units) for the
backward. Causal programs skip key blocks above the diagonal and mask only the blocks that cut it
(two loops: unmasked, then masked). A fixed log-sum-exp (``lse_t``) replaces that side's running
max (no row max, no rescale); the result still normalizes by l. Masked entries use -inf in the
exponent only; the centred difference uses the raw (finite) scores, so no 0 * inf appears.

The per-block step, the initial state and the row outputs are helpers (``_online_step``,
``_init_state``, ``_store_rows``) so that variants of the key loop compute the same, op for op
(benchmarks/attention_fwd_tma.py: TMA descriptors, measured no faster on H100; the Gluon forward of
``kernels_gluon.py`` has the same step with the scale folded into the exponents' FMAs).
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..core.launch import launch, next_pow2
from .kernels_tiles import (
    centred_diff,
    exp2_pair,
    flat_rows,
    key_block_scores,
    key_heads,
    key_ranges,
    load_tile,
    program_block,
)

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453

# (BLOCK_M, BLOCK_N, num_warps, num_stages) per kernel. fwd/dq/dk: the best of the H200 sweep
# (benchmarks/results/attention/attention.md). "interp" is used by Triton's CPU interpreter
# (small tiles keep the tests fast and exercise many blocks and edges).
DEFAULT_CONFIGS = {
    "fwd": (128, 64, 8, 3),
    "dq": (128, 64, 8, 3),
    "dk": (32, 64, 4, 3),
    "dk_grouped": (32, 64, 4, 2),  # GQA: the loop over query heads sharing a kv head
    "small": (32, 32, 4, 2),  # fp32 inputs (FMA dots) or head dims > 128
    "interp": (16, 16, 1, 1),
}


@triton.jit
def _online_step(sx, sy, sxm, sym, mx, my, lx, ly, c, X_FIXED: tl.constexpr, Y_FIXED: tl.constexpr):
    """The row state after one key block, from the raw scores sx, sy (centred difference) and the
    masked ones sxm, sym (-inf where invisible: maxima and exponents)."""
    if X_FIXED:
        mx_new = mx
    else:
        mx_new = tl.maximum(mx, tl.max(sxm, 1))
    if Y_FIXED:
        my_new = my
    else:
        my_new = tl.maximum(my, tl.max(sym, 1))
    px, py = exp2_pair(sxm, sym, mx_new, my_new, False)
    d = centred_diff(sx, sy, mx_new, my_new, False)
    ax = tl.exp2(mx - mx_new)
    ay = tl.exp2(my - my_new)
    c = ax * (c + lx * ((mx - mx_new) - (my - my_new))) + tl.sum(px * d, 1)
    lx = lx * ax + tl.sum(px, 1)
    ly = ly * ay + tl.sum(py, 1)
    return mx_new, my_new, lx, ly, c


@triton.jit
def _fwd_tile(
    qx,
    qy,
    KXb,
    KYb,
    KPMb,
    s_kx_n,
    s_ky_n,
    start_n,
    offs_m,
    offs_n0,
    offs_dx,
    offs_dy,
    mx,
    my,
    lx,
    ly,
    c,
    Nk,
    scale_x,
    scale_y,
    causal_offset,
    DX: tl.constexpr,
    DY: tl.constexpr,
    BDX: tl.constexpr,
    BDY: tl.constexpr,
    MASKED: tl.constexpr,
    CAUSAL: tl.constexpr,
    HAS_KPM: tl.constexpr,
    X_FIXED: tl.constexpr,
    Y_FIXED: tl.constexpr,
    EVEN_N: tl.constexpr,
    PREC_X: tl.constexpr,
    PREC_Y: tl.constexpr,
):
    _kx, _ky, sx, sy, sxm, sym = key_block_scores(
        qx,
        qy,
        KXb,
        KYb,
        KPMb,
        s_kx_n,
        s_ky_n,
        offs_m,
        start_n + offs_n0,
        offs_dx,
        offs_dy,
        Nk,
        scale_x,
        scale_y,
        causal_offset,
        DX,
        DY,
        BDX,
        BDY,
        MASKED,
        CAUSAL,
        HAS_KPM,
        EVEN_N,
        PREC_X,
        PREC_Y,
    )
    return _online_step(sx, sy, sxm, sym, mx, my, lx, ly, c, X_FIXED, Y_FIXED)


@triton.jit
def _init_state(LSEX_IN, LSEY_IN, row, row_ok, BM: tl.constexpr, X_FIXED: tl.constexpr, Y_FIXED: tl.constexpr):
    """(m_x, m_y, l_x, l_y, c) before the first key block; a fixed side starts at its lse (log2)."""
    if X_FIXED:
        mx = tl.load(LSEX_IN + row, mask=row_ok, other=0.0).to(tl.float32) * 1.4426950408889634
    else:
        mx = tl.full([BM], -1.0e30, tl.float32)
    if Y_FIXED:
        my = tl.load(LSEY_IN + row, mask=row_ok, other=0.0).to(tl.float32) * 1.4426950408889634
    else:
        my = tl.full([BM], -1.0e30, tl.float32)
    lx = tl.zeros([BM], tl.float32)
    ly = tl.zeros([BM], tl.float32)
    c = tl.zeros([BM], tl.float32)
    return mx, my, lx, ly, c


@triton.jit
def _store_rows(mx, my, lx, ly, c, row, row_ok, KL_OUT, LSEX_OUT, LSEY_OUT):
    """KL (natural units) and both lse's (log2 units) of the block's rows."""
    ok = (lx != 0) & (ly != 0)  # 0: a row with no visible key (its KL is 0); NaN stays NaN
    lxs = tl.where(ok, lx, 1.0)
    lys = tl.where(ok, ly, 1.0)
    kl2 = c / lxs - tl.log2(lxs) + tl.log2(lys)
    tl.store(KL_OUT + row, tl.where(ok, kl2 * 0.6931471805599453, 0.0), mask=row_ok)
    tl.store(LSEX_OUT + row, tl.where(ok, mx + tl.log2(lxs), 0.0), mask=row_ok)
    tl.store(LSEY_OUT + row, tl.where(ok, my + tl.log2(lys), 0.0), mask=row_ok)


@triton.jit
def attention_fwd_kernel(
    QX,
    KX,
    QY,
    KY,
    LSEX_IN,
    LSEY_IN,
    KPM,
    KL_OUT,
    LSEX_OUT,
    LSEY_OUT,
    s_qx_b,
    s_qx_h,
    s_qx_m,
    s_kx_b,
    s_kx_h,
    s_kx_n,
    s_qy_b,
    s_qy_h,
    s_qy_m,
    s_ky_b,
    s_ky_h,
    s_ky_n,
    s_kpm_b,
    H,
    Nq,
    Nk,
    GX,
    GY,
    scale_x,
    scale_y,
    causal_offset,
    heads_per_section,
    DX: tl.constexpr,
    DY: tl.constexpr,
    BDX: tl.constexpr,
    BDY: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    CAUSAL: tl.constexpr,
    HAS_KPM: tl.constexpr,
    X_FIXED: tl.constexpr,
    Y_FIXED: tl.constexpr,
    EVEN_M: tl.constexpr,
    EVEN_N: tl.constexpr,
    PREC_X: tl.constexpr,
    PREC_Y: tl.constexpr,
):
    pid_bh, h, b64, start_m, offs_m, offs_n0, offs_dx, offs_dy = program_block(
        H, Nq, heads_per_section, BR=BM, BO=BN, BD1=BDX, BD2=BDY, LAST_FIRST=True
    )
    qx = load_tile(QX + b64 * s_qx_b + h.to(tl.int64) * s_qx_h, offs_m, offs_dx, s_qx_m, Nq, DX, BDX, EVEN_M)
    qy = load_tile(QY + b64 * s_qy_b + h.to(tl.int64) * s_qy_h, offs_m, offs_dy, s_qy_m, Nq, DY, BDY, EVEN_M)
    KXb, KYb, KPMb = key_heads(KX, KY, KPM, b64, h, GX, GY, s_kx_b, s_kx_h, s_ky_b, s_ky_h, s_kpm_b)
    row, row_ok = flat_rows(pid_bh, Nq, offs_m)
    mx, my, lx, ly, c = _init_state(LSEX_IN, LSEY_IN, row, row_ok, BM, X_FIXED, Y_FIXED)
    n_full, hi = key_ranges(start_m, Nk, causal_offset, BM, BN, CAUSAL, EVEN_N)
    for start_n in range(0, n_full, BN):
        mx, my, lx, ly, c = _fwd_tile(
            qx,
            qy,
            KXb,
            KYb,
            KPMb,
            s_kx_n,
            s_ky_n,
            start_n,
            offs_m,
            offs_n0,
            offs_dx,
            offs_dy,
            mx,
            my,
            lx,
            ly,
            c,
            Nk,
            scale_x,
            scale_y,
            causal_offset,
            DX,
            DY,
            BDX,
            BDY,
            False,
            CAUSAL,
            HAS_KPM,
            X_FIXED,
            Y_FIXED,
            EVEN_N,
            PREC_X,
            PREC_Y,
        )
    for start_n in range(n_full, hi, BN):
        mx, my, lx, ly, c = _fwd_tile(
            qx,
            qy,
            KXb,
            KYb,
            KPMb,
            s_kx_n,
            s_ky_n,
            start_n,
            offs_m,
            offs_n0,
            offs_dx,
            offs_dy,
            mx,
            my,
            lx,
            ly,
            c,
            Nk,
            scale_x,
            scale_y,
            causal_offset,
            DX,
            DY,
            BDX,
            BDY,
            True,
            CAUSAL,
            HAS_KPM,
            X_FIXED,
            Y_FIXED,
            EVEN_N,
            PREC_X,
            PREC_Y,
        )

    _store_rows(mx, my, lx, ly, c, row, row_ok, KL_OUT, LSEX_OUT, LSEY_OUT)


def next_pow2_dim(d: int) -> int:
    return max(16, next_pow2(d))


def launch_fwd(grid, *args, **constexprs) -> None:
    """``attention_fwd_kernel[grid](*args, **constexprs)`` through ``core.launch``."""
    launch(attention_fwd_kernel, grid, *args, **constexprs)
