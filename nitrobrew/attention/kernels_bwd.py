"""Triton backward of attention KL: recompute score tiles from per-row statistics (FA-2 style).

Per row the forward left lse_x, lse_y (log2 units) and KL; with the upstream row gradient g,
the gradients w.r.t. the natural-unit scores are (docs/design.md §3, and the recipe of
``nitrobrew.divergences``: u = dphi/dlog q, grad = u - q sum(u)):

    dS_y = g (Y - X)                               (y: the "student" of a forward KL)
    dS_x = g X (ln X - ln Y - KL)                  (x: the "student" of a reverse KL)

with X = 2^{x - lse_x}, Y = 2^{y - lse_y}. Direction "forward" has x = teacher, y = student;
"reverse" swaps them, so both directions run the same two kernels. Then dq = scale * dS k and
dk = scale * dS^T q.

Two kernels, no atomics and no fp32 scratch beyond registers:
- ``attention_bwd_dq_kernel``: program = (query block, batch*head); loops over key blocks and
  accumulates dq for the sides that need it (both sides share the query head).
- ``attention_bwd_dk_kernel``: program = (key block, batch*kv head of side A); loops over the
  query heads that share that kv head (grouped-query attention) and over query blocks, and
  accumulates dk_A in registers. The other side's dk is accumulated in the same pass when its
  kv grouping is the same (ALSO_B); otherwise it gets its own launch with the roles swapped.
Each kernel recomputes both score tiles, so the backward does 2 x (2 score GEMMs) + 1 dq GEMM
+ 1 dk GEMM per side with gradients.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..core.launch import launch
from .kernels_tiles import (
    centred_diff,
    dot,
    exp2_pair,
    flat_rows,
    hide_invisible,
    key_block_scores,
    key_heads,
    key_ranges,
    load_tile,
    on_rows,
    program_block,
    scores,
    store_tile,
)


@triton.jit
def _row_stats(LSEX, LSEY, KL, G, rows, row_ok, EVEN: tl.constexpr, G_SCALAR: tl.constexpr):
    """Per-row statistics for the backward: lse_x, lse_y, KL (all log2 units) and the upstream
    gradient g (rows outside the mask read 0 unless EVEN). G_SCALAR: one upstream gradient for
    every row, at G itself (a scalar loss: no [B, H, Nq] gradient is built on the host)."""
    if EVEN:
        lsex = tl.load(LSEX + rows)
        lsey = tl.load(LSEY + rows)
        kl2 = tl.load(KL + rows) * 1.4426950408889634
    else:
        lsex = tl.load(LSEX + rows, mask=row_ok, other=0.0)
        lsey = tl.load(LSEY + rows, mask=row_ok, other=0.0)
        kl2 = tl.load(KL + rows, mask=row_ok, other=0.0) * 1.4426950408889634
    if G_SCALAR:
        g = tl.zeros_like(lsex) + tl.load(G).to(tl.float32)
    elif EVEN:
        g = tl.load(G + rows)
    else:
        g = tl.load(G + rows, mask=row_ok, other=0.0)
    return lsex, lsey, kl2, g


@triton.jit
def _log_ratio(sx, sy, lsex, lsey, kl2, KEYS_FIRST: tl.constexpr):
    """ln X - ln Y - KL of a tile in log2 units, from the raw scores: finite everywhere."""
    return centred_diff(sx, sy, lsex, lsey, KEYS_FIRST) - on_rows(kl2, KEYS_FIRST)


@triton.jit
def _ds_x(g, px, lr, KEYS_FIRST: tl.constexpr):
    """dS_x = g X (ln X - ln Y - KL), with the log-ratio lr in log2 units (hence the ln 2)."""
    return on_rows(g * 0.6931471805599453, KEYS_FIRST) * px * lr


@triton.jit
def _ds_y(g, px, py, KEYS_FIRST: tl.constexpr):
    """dS_y = g (Y - X) of a tile."""
    return on_rows(g, KEYS_FIRST) * (py - px)


@triton.jit
def _dq_tile(
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
    lsex,
    lsey,
    kl2,
    g,
    dqx,
    dqy,
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
    EVEN_N: tl.constexpr,
    NEED_X: tl.constexpr,
    NEED_Y: tl.constexpr,
    PREC_X: tl.constexpr,
    PREC_Y: tl.constexpr,
):
    kx, ky, sx, sy, sxm, sym = key_block_scores(
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
    px, py = exp2_pair(sxm, sym, lsex, lsey, False)
    if NEED_Y:
        dsy = _ds_y(g, px, py, False)
        dqy += dot(dsy.to(ky.dtype), ky, PREC_Y)
    if NEED_X:
        dsx = _ds_x(g, px, _log_ratio(sx, sy, lsex, lsey, kl2, False), False)
        dqx += dot(dsx.to(kx.dtype), kx, PREC_X)
    return dqx, dqy


@triton.jit
def attention_bwd_dq_kernel(
    QX,
    KX,
    QY,
    KY,
    KPM,
    LSEX,
    LSEY,
    KL,
    GROW,
    DQX,
    DQY,
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
    s_dqx_b,
    s_dqx_h,
    s_dqx_m,
    s_dqy_b,
    s_dqy_h,
    s_dqy_m,
    s_kpm_b,
    H,
    Nq,
    Nk,
    GX,
    GY,
    scale_x,
    scale_y,
    out_scale_x,
    out_scale_y,
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
    EVEN_M: tl.constexpr,
    EVEN_N: tl.constexpr,
    NEED_X: tl.constexpr,
    NEED_Y: tl.constexpr,
    PREC_X: tl.constexpr,
    PREC_Y: tl.constexpr,
    G_SCALAR: tl.constexpr,
):
    pid_bh, h, b64, start_m, offs_m, offs_n0, offs_dx, offs_dy = program_block(
        H, Nq, heads_per_section, BR=BM, BO=BN, BD1=BDX, BD2=BDY, LAST_FIRST=True
    )
    h64 = h.to(tl.int64)
    qx = load_tile(QX + b64 * s_qx_b + h64 * s_qx_h, offs_m, offs_dx, s_qx_m, Nq, DX, BDX, EVEN_M)
    qy = load_tile(QY + b64 * s_qy_b + h64 * s_qy_h, offs_m, offs_dy, s_qy_m, Nq, DY, BDY, EVEN_M)
    KXb, KYb, KPMb = key_heads(KX, KY, KPM, b64, h, GX, GY, s_kx_b, s_kx_h, s_ky_b, s_ky_h, s_kpm_b)
    row, row_ok = flat_rows(pid_bh, Nq, offs_m)
    lsex, lsey, kl2, g = _row_stats(LSEX, LSEY, KL, GROW, row, row_ok, False, G_SCALAR)
    if NEED_X:
        dqx = tl.zeros([BM, BDX], tl.float32)
    else:
        dqx = tl.zeros([16, 16], tl.float32)
    if NEED_Y:
        dqy = tl.zeros([BM, BDY], tl.float32)
    else:
        dqy = tl.zeros([16, 16], tl.float32)

    n_full, hi = key_ranges(start_m, Nk, causal_offset, BM, BN, CAUSAL, EVEN_N)
    for start_n in range(0, n_full, BN):
        dqx, dqy = _dq_tile(
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
            lsex,
            lsey,
            kl2,
            g,
            dqx,
            dqy,
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
            EVEN_N,
            NEED_X,
            NEED_Y,
            PREC_X,
            PREC_Y,
        )
    for start_n in range(n_full, hi, BN):
        dqx, dqy = _dq_tile(
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
            lsex,
            lsey,
            kl2,
            g,
            dqx,
            dqy,
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
            EVEN_N,
            NEED_X,
            NEED_Y,
            PREC_X,
            PREC_Y,
        )
    if NEED_X:
        store_tile(DQX + b64 * s_dqx_b + h64 * s_dqx_h, offs_m, offs_dx, s_dqx_m, Nq, DX, dqx, out_scale_x)
    if NEED_Y:
        store_tile(DQY + b64 * s_dqy_b + h64 * s_dqy_h, offs_m, offs_dy, s_dqy_m, Nq, DY, dqy, out_scale_y)


@triton.jit
def _dk_tile(
    ka,
    kb,
    QAb,
    QBb,
    KPMb,
    s_qa_m,
    s_qb_m,
    start_m,
    offs_n,
    offs_m0,
    offs_da,
    offs_db,
    LSEAb,
    LSEBb,
    KLb,
    Gb,
    dka,
    dkb,
    Nq,
    Nk,
    scale_a,
    scale_b,
    causal_offset,
    DA: tl.constexpr,
    DB: tl.constexpr,
    BDA: tl.constexpr,
    BDB: tl.constexpr,
    MASKED: tl.constexpr,
    CAUSAL: tl.constexpr,
    HAS_KPM: tl.constexpr,
    EVEN_M: tl.constexpr,
    A_IS_X: tl.constexpr,
    ALSO_B: tl.constexpr,
    PREC_A: tl.constexpr,
    PREC_B: tl.constexpr,
    G_SCALAR: tl.constexpr,
):
    offs_m = start_m + offs_m0
    qa = load_tile(QAb, offs_m, offs_da, s_qa_m, Nq, DA, BDA, EVEN_M)
    qb = load_tile(QBb, offs_m, offs_db, s_qb_m, Nq, DB, BDB, EVEN_M)
    lsea, lseb, kl2, g = _row_stats(LSEAb, LSEBb, KLb, Gb, offs_m, offs_m < Nq, EVEN_M, G_SCALAR)
    sa = scores(ka, qa, scale_a, PREC_A)  # [BN, BM]
    sb = scores(kb, qb, scale_b, PREC_B)
    sam, sbm = hide_invisible(sa, sb, offs_m, offs_n, KPMb, Nk, causal_offset, MASKED, CAUSAL, HAS_KPM, True)
    pa, pb = exp2_pair(sam, sbm, lsea, lseb, True)
    if A_IS_X:
        lr = _log_ratio(sa, sb, lsea, lseb, kl2, True)
        ds_a = _ds_x(g, pa, lr, True)
        ds_b = _ds_y(g, pa, pb, True)
    else:
        lr = _log_ratio(sb, sa, lseb, lsea, kl2, True)
        ds_a = _ds_y(g, pb, pa, True)
        ds_b = _ds_x(g, pb, lr, True)
    dka += dot(ds_a.to(qa.dtype), qa, PREC_A)
    if ALSO_B:
        dkb += dot(ds_b.to(qb.dtype), qb, PREC_B)
    return dka, dkb


@triton.jit
def _dk_head(
    h,
    b64,
    offs_n,
    offs_m0,
    offs_da,
    offs_db,
    ka,
    dka,
    dkb,
    QA,
    QB,
    KB,
    KPMb,
    LSEA,
    LSEB,
    KL,
    GROW,
    s_qa_b,
    s_qa_h,
    s_qa_m,
    s_qb_b,
    s_qb_h,
    s_qb_m,
    s_kb_b,
    s_kb_h,
    s_kb_n,
    H,
    Nq,
    Nk,
    GB,
    scale_a,
    scale_b,
    causal_offset,
    m_lo,
    m_full,
    DA: tl.constexpr,
    DB: tl.constexpr,
    BDA: tl.constexpr,
    BDB: tl.constexpr,
    BM: tl.constexpr,
    CAUSAL: tl.constexpr,
    HAS_KPM: tl.constexpr,
    EVEN_M: tl.constexpr,
    EVEN_N: tl.constexpr,
    A_IS_X: tl.constexpr,
    ALSO_B: tl.constexpr,
    PREC_A: tl.constexpr,
    PREC_B: tl.constexpr,
    G_SCALAR: tl.constexpr,
):
    """All query blocks of query head h against this program's key block."""
    h64 = h.to(tl.int64)
    hb = h // GB
    kb = load_tile(KB + b64 * s_kb_b + hb.to(tl.int64) * s_kb_h, offs_n, offs_db, s_kb_n, Nk, DB, BDB, EVEN_N)
    QAb = QA + b64 * s_qa_b + h64 * s_qa_h
    QBb = QB + b64 * s_qb_b + h64 * s_qb_h
    rowb = (b64 * H + h64) * Nq
    if G_SCALAR:
        Gb = GROW
    else:
        Gb = GROW + rowb
    for start_m in range(m_lo, m_full, BM):
        dka, dkb = _dk_tile(
            ka,
            kb,
            QAb,
            QBb,
            KPMb,
            s_qa_m,
            s_qb_m,
            start_m,
            offs_n,
            offs_m0,
            offs_da,
            offs_db,
            LSEA + rowb,
            LSEB + rowb,
            KL + rowb,
            Gb,
            dka,
            dkb,
            Nq,
            Nk,
            scale_a,
            scale_b,
            causal_offset,
            DA,
            DB,
            BDA,
            BDB,
            True,
            CAUSAL,
            HAS_KPM,
            EVEN_M,
            A_IS_X,
            ALSO_B,
            PREC_A,
            PREC_B,
            G_SCALAR,
        )
    for start_m in range(m_full, Nq, BM):
        dka, dkb = _dk_tile(
            ka,
            kb,
            QAb,
            QBb,
            KPMb,
            s_qa_m,
            s_qb_m,
            start_m,
            offs_n,
            offs_m0,
            offs_da,
            offs_db,
            LSEA + rowb,
            LSEB + rowb,
            KL + rowb,
            Gb,
            dka,
            dkb,
            Nq,
            Nk,
            scale_a,
            scale_b,
            causal_offset,
            DA,
            DB,
            BDA,
            BDB,
            False,
            CAUSAL,
            HAS_KPM,
            EVEN_M,
            A_IS_X,
            ALSO_B,
            PREC_A,
            PREC_B,
            G_SCALAR,
        )
    return dka, dkb


@triton.jit
def attention_bwd_dk_kernel(
    QA,
    KA,
    QB,
    KB,
    KPM,
    LSEA,
    LSEB,
    KL,
    GROW,
    DKA,
    DKB,
    s_qa_b,
    s_qa_h,
    s_qa_m,
    s_ka_b,
    s_ka_h,
    s_ka_n,
    s_qb_b,
    s_qb_h,
    s_qb_m,
    s_kb_b,
    s_kb_h,
    s_kb_n,
    s_dka_b,
    s_dka_h,
    s_dka_n,
    s_dkb_b,
    s_dkb_h,
    s_dkb_n,
    s_kpm_b,
    H,
    HKVA,
    Nq,
    Nk,
    GA,
    GB,
    scale_a,
    scale_b,
    out_scale_a,
    out_scale_b,
    causal_offset,
    heads_per_section,
    DA: tl.constexpr,
    DB: tl.constexpr,
    BDA: tl.constexpr,
    BDB: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    CAUSAL: tl.constexpr,
    HAS_KPM: tl.constexpr,
    EVEN_M: tl.constexpr,
    EVEN_N: tl.constexpr,
    A_IS_X: tl.constexpr,
    ALSO_B: tl.constexpr,
    PREC_A: tl.constexpr,
    PREC_B: tl.constexpr,
    GROUPED: tl.constexpr,
    G_SCALAR: tl.constexpr,
):
    _pid_bk, kvh, b64, start_n, offs_n, offs_m0, offs_da, offs_db = program_block(
        HKVA, Nk, heads_per_section, BR=BN, BO=BM, BD1=BDA, BD2=BDB, LAST_FIRST=False
    )
    ka = load_tile(KA + b64 * s_ka_b + kvh.to(tl.int64) * s_ka_h, offs_n, offs_da, s_ka_n, Nk, DA, BDA, EVEN_N)
    KPMb = KPM + b64 * s_kpm_b
    dka = tl.zeros([BN, BDA], tl.float32)
    if ALSO_B:
        dkb = tl.zeros([BN, BDB], tl.float32)
    else:
        dkb = tl.zeros([16, 16], tl.float32)

    if CAUSAL:
        m_lo = (tl.maximum(start_n - causal_offset, 0) // BM) * BM
        m_full = tl.maximum(start_n + BN - 1 - causal_offset, 0)
        m_full = tl.maximum(((m_full + BM - 1) // BM) * BM, m_lo)
    else:
        m_lo = 0
        m_full = 0
    m_end = ((Nq + BM - 1) // BM) * BM
    m_full = tl.minimum(m_full, m_end)
    if not EVEN_N:
        if start_n + BN > Nk:
            m_full = m_end  # the last, partial key block: every tile masks the keys past Nk
    if GROUPED:
        for gi in range(0, GA):
            dka, dkb = _dk_head(
                kvh * GA + gi,
                b64,
                offs_n,
                offs_m0,
                offs_da,
                offs_db,
                ka,
                dka,
                dkb,
                QA,
                QB,
                KB,
                KPMb,
                LSEA,
                LSEB,
                KL,
                GROW,
                s_qa_b,
                s_qa_h,
                s_qa_m,
                s_qb_b,
                s_qb_h,
                s_qb_m,
                s_kb_b,
                s_kb_h,
                s_kb_n,
                H,
                Nq,
                Nk,
                GB,
                scale_a,
                scale_b,
                causal_offset,
                m_lo,
                m_full,
                DA,
                DB,
                BDA,
                BDB,
                BM,
                CAUSAL,
                HAS_KPM,
                EVEN_M,
                EVEN_N,
                A_IS_X,
                ALSO_B,
                PREC_A,
                PREC_B,
                G_SCALAR,
            )
    else:  # one query head per kv head: no head loop (nested loops cost registers and spills)
        dka, dkb = _dk_head(
            kvh,
            b64,
            offs_n,
            offs_m0,
            offs_da,
            offs_db,
            ka,
            dka,
            dkb,
            QA,
            QB,
            KB,
            KPMb,
            LSEA,
            LSEB,
            KL,
            GROW,
            s_qa_b,
            s_qa_h,
            s_qa_m,
            s_qb_b,
            s_qb_h,
            s_qb_m,
            s_kb_b,
            s_kb_h,
            s_kb_n,
            H,
            Nq,
            Nk,
            GB,
            scale_a,
            scale_b,
            causal_offset,
            m_lo,
            m_full,
            DA,
            DB,
            BDA,
            BDB,
            BM,
            CAUSAL,
            HAS_KPM,
            EVEN_M,
            EVEN_N,
            A_IS_X,
            ALSO_B,
            PREC_A,
            PREC_B,
            G_SCALAR,
        )
    store_tile(DKA + b64 * s_dka_b + kvh.to(tl.int64) * s_dka_h, offs_n, offs_da, s_dka_n, Nk, DA, dka, out_scale_a)
    if ALSO_B:
        store_tile(DKB + b64 * s_dkb_b + kvh.to(tl.int64) * s_dkb_h, offs_n, offs_db, s_dkb_n, Nk, DB, dkb, out_scale_b)


def launch_bwd_dq(grid, *args, **constexprs) -> None:
    """``attention_bwd_dq_kernel[grid](*args, **constexprs)`` through ``core.launch``."""
    launch(attention_bwd_dq_kernel, grid, *args, **constexprs)


def launch_bwd_dk(grid, *args, **constexprs) -> None:
    """``attention_bwd_dk_kernel[grid](*args, **constexprs)`` through ``core.launch``."""
    launch(attention_bwd_dk_kernel, grid, *args, **constexprs)
