"""Triton backward of attention KL: recompute score tiles from per-row statistics (FA-2 style).

Per row the forward left lse_x, lse_y (log2 units) and KL; with the upstream row gradient g,
the gradients w.r.t. the natural-unit scores are (design §3, and the recipe of
``nitrobrew.divergences``: u = dphi/dlog q, grad = u - q sum(u)):

    dS_y = g (Y - X)                               (y: the "student" of a forward KL)
    dS_x = g X (ln X - ln Y - KL)                  (x: the "student" of a reverse KL)

with X = 2^{x - lse_x}, Y = 2^{y - lse_y}. Direction "forward" has x = teacher, y = student;
"reverse" swaps them, so both directions run the same two kernels. Then dq = scale * dS k and
dk = scale * dS^T q.

Two kernels, no atomics and no fp32 scratch beyond registers:
- ``attn_kl_bwd_dq_kernel``: program = (query block, batch*head); loops over key blocks and
  accumulates dq for the sides that need it (both sides share the query head).
- ``attn_kl_bwd_dk_kernel``: program = (key block, batch*kv head of side A); loops over the
  query heads that share that kv head (grouped-query attention) and over query blocks, and
  accumulates dk_A in registers. The other side's dk is accumulated in the same pass when its
  kv grouping is the same (ALSO_B); otherwise it gets its own launch with the roles swapped.
Each kernel recomputes both score tiles, so the backward does 2 x (2 score GEMMs) + 1 dq GEMM
+ 1 dk GEMM per side with gradients.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .triton_fwd import _valid, dot, load_tile


@triton.jit
def _valid_t(offs_m, offs_n, KPMb, Nk, causal_offset, MASKED: tl.constexpr, CAUSAL: tl.constexpr,
             HAS_KPM: tl.constexpr):
    """Visible pairs of a transposed [keys, rows] tile."""
    if MASKED:
        valid = offs_n[:, None] < Nk
        if CAUSAL:
            valid = valid & (offs_n[:, None] <= offs_m[None, :] + causal_offset)
        if HAS_KPM:
            keep = tl.load(KPMb + offs_n, mask=offs_n < Nk, other=0)
            valid = valid & (keep[:, None] != 0)
    else:
        keep = tl.load(KPMb + offs_n, mask=offs_n < Nk, other=0)
        valid = keep[:, None] != 0
    return valid


@triton.jit
def _dq_tile(qx, qy, KXb, KYb, KPMb, s_kx_n, s_ky_n, start_n, offs_m, offs_n0, offs_dx, offs_dy,
             lsex, lsey, kl2, g, dqx, dqy, Nk, scale_x, scale_y, causal_offset,
             DX: tl.constexpr, DY: tl.constexpr, BDX: tl.constexpr, BDY: tl.constexpr,
             MASKED: tl.constexpr, CAUSAL: tl.constexpr, HAS_KPM: tl.constexpr, EVEN_N: tl.constexpr,
             NEED_X: tl.constexpr, NEED_Y: tl.constexpr, PREC_X: tl.constexpr, PREC_Y: tl.constexpr):
    offs_n = start_n + offs_n0
    even = EVEN_N or not MASKED
    kx = load_tile(KXb, offs_n, offs_dx, s_kx_n, Nk, DX, BDX, even)
    ky = load_tile(KYb, offs_n, offs_dy, s_ky_n, Nk, DY, BDY, even)
    sx = dot(qx, tl.trans(kx), PREC_X) * scale_x
    sy = dot(qy, tl.trans(ky), PREC_Y) * scale_y
    if MASKED or HAS_KPM:
        valid = _valid(offs_m, offs_n, KPMb, Nk, causal_offset, MASKED, CAUSAL, HAS_KPM)
        sxm = tl.where(valid, sx, float("-inf"))
        sym = tl.where(valid, sy, float("-inf"))
    else:
        sxm = sx
        sym = sy
    px = tl.exp2(sxm - lsex[:, None])
    py = tl.exp2(sym - lsey[:, None])
    if NEED_Y:
        dsy = g[:, None] * (py - px)
        dqy += dot(dsy.to(ky.dtype), ky, PREC_Y)
    if NEED_X:
        dsx = (g * 0.6931471805599453)[:, None] * px * ((sx - lsex[:, None]) - (sy - lsey[:, None]) - kl2[:, None])
        dqx += dot(dsx.to(kx.dtype), kx, PREC_X)
    return dqx, dqy


@triton.jit
def attn_kl_bwd_dq_kernel(
    QX, KX, QY, KY, KPM, LSEX, LSEY, KL, GROW, DQX, DQY,
    s_qx_b, s_qx_h, s_qx_m, s_kx_b, s_kx_h, s_kx_n,
    s_qy_b, s_qy_h, s_qy_m, s_ky_b, s_ky_h, s_ky_n,
    s_dqx_b, s_dqx_h, s_dqx_m, s_dqy_b, s_dqy_h, s_dqy_m,
    s_kpm_b,
    H, Nq, Nk, GX, GY, scale_x, scale_y, out_scale_x, out_scale_y, causal_offset,
    DX: tl.constexpr, DY: tl.constexpr, BDX: tl.constexpr, BDY: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr,
    CAUSAL: tl.constexpr, HAS_KPM: tl.constexpr, EVEN_M: tl.constexpr, EVEN_N: tl.constexpr,
    NEED_X: tl.constexpr, NEED_Y: tl.constexpr, PREC_X: tl.constexpr, PREC_Y: tl.constexpr,
):
    pid_m = tl.num_programs(0) - 1 - tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // H
    h = pid_bh % H
    start_m = pid_m * BM
    offs_m = start_m + tl.arange(0, BM)
    offs_n0 = tl.arange(0, BN)
    offs_dx = tl.arange(0, BDX)
    offs_dy = tl.arange(0, BDY)
    b64 = b.to(tl.int64)
    h64 = h.to(tl.int64)
    qx = load_tile(QX + b64 * s_qx_b + h64 * s_qx_h, offs_m, offs_dx, s_qx_m, Nq, DX, BDX, EVEN_M)
    qy = load_tile(QY + b64 * s_qy_b + h64 * s_qy_h, offs_m, offs_dy, s_qy_m, Nq, DY, BDY, EVEN_M)
    KXb = KX + b64 * s_kx_b + (h // GX).to(tl.int64) * s_kx_h
    KYb = KY + b64 * s_ky_b + (h // GY).to(tl.int64) * s_ky_h
    KPMb = KPM + b64 * s_kpm_b
    row = pid_bh.to(tl.int64) * Nq + offs_m
    row_ok = offs_m < Nq
    lsex = tl.load(LSEX + row, mask=row_ok, other=0.0)
    lsey = tl.load(LSEY + row, mask=row_ok, other=0.0)
    kl2 = tl.load(KL + row, mask=row_ok, other=0.0) * 1.4426950408889634
    g = tl.load(GROW + row, mask=row_ok, other=0.0)
    if NEED_X:
        dqx = tl.zeros([BM, BDX], tl.float32)
    else:
        dqx = tl.zeros([16, 16], tl.float32)
    if NEED_Y:
        dqy = tl.zeros([BM, BDY], tl.float32)
    else:
        dqy = tl.zeros([16, 16], tl.float32)

    if CAUSAL:
        hi = tl.minimum(Nk, start_m + BM + causal_offset)
        full_hi = tl.minimum(Nk, start_m + 1 + causal_offset)
    else:
        hi = Nk
        full_hi = Nk
    if not EVEN_N:
        full_hi = tl.minimum(full_hi, (Nk // BN) * BN)
    n_full = (tl.maximum(full_hi, 0) // BN) * BN
    for start_n in range(0, n_full, BN):
        dqx, dqy = _dq_tile(qx, qy, KXb, KYb, KPMb, s_kx_n, s_ky_n, start_n, offs_m, offs_n0, offs_dx, offs_dy,
                            lsex, lsey, kl2, g, dqx, dqy, Nk, scale_x, scale_y, causal_offset,
                            DX, DY, BDX, BDY, False, CAUSAL, HAS_KPM, EVEN_N, NEED_X, NEED_Y, PREC_X, PREC_Y)
    for start_n in range(n_full, hi, BN):
        dqx, dqy = _dq_tile(qx, qy, KXb, KYb, KPMb, s_kx_n, s_ky_n, start_n, offs_m, offs_n0, offs_dx, offs_dy,
                            lsex, lsey, kl2, g, dqx, dqy, Nk, scale_x, scale_y, causal_offset,
                            DX, DY, BDX, BDY, True, CAUSAL, HAS_KPM, EVEN_N, NEED_X, NEED_Y, PREC_X, PREC_Y)
    if NEED_X:
        ptrs = DQX + b64 * s_dqx_b + h64 * s_dqx_h + offs_m[:, None] * s_dqx_m + offs_dx[None, :]
        tl.store(ptrs, (dqx * out_scale_x).to(DQX.dtype.element_ty),
                 mask=(offs_m[:, None] < Nq) & (offs_dx[None, :] < DX))
    if NEED_Y:
        ptrs = DQY + b64 * s_dqy_b + h64 * s_dqy_h + offs_m[:, None] * s_dqy_m + offs_dy[None, :]
        tl.store(ptrs, (dqy * out_scale_y).to(DQY.dtype.element_ty),
                 mask=(offs_m[:, None] < Nq) & (offs_dy[None, :] < DY))


@triton.jit
def _dk_tile(ka, kb, QAb, QBb, KPMb, s_qa_m, s_qb_m, start_m, offs_n, offs_m0, offs_da, offs_db,
             LSEAb, LSEBb, KLb, Gb, dka, dkb, Nq, Nk, scale_a, scale_b, causal_offset,
             DA: tl.constexpr, DB: tl.constexpr, BDA: tl.constexpr, BDB: tl.constexpr,
             MASKED: tl.constexpr, CAUSAL: tl.constexpr, HAS_KPM: tl.constexpr, EVEN_M: tl.constexpr,
             A_IS_X: tl.constexpr, ALSO_B: tl.constexpr, PREC_A: tl.constexpr, PREC_B: tl.constexpr):
    offs_m = start_m + offs_m0
    qa = load_tile(QAb, offs_m, offs_da, s_qa_m, Nq, DA, BDA, EVEN_M)
    qb = load_tile(QBb, offs_m, offs_db, s_qb_m, Nq, DB, BDB, EVEN_M)
    if EVEN_M:
        lsea = tl.load(LSEAb + offs_m)
        lseb = tl.load(LSEBb + offs_m)
        kl2 = tl.load(KLb + offs_m) * 1.4426950408889634
        g = tl.load(Gb + offs_m)
    else:
        row_ok = offs_m < Nq
        lsea = tl.load(LSEAb + offs_m, mask=row_ok, other=0.0)
        lseb = tl.load(LSEBb + offs_m, mask=row_ok, other=0.0)
        kl2 = tl.load(KLb + offs_m, mask=row_ok, other=0.0) * 1.4426950408889634
        g = tl.load(Gb + offs_m, mask=row_ok, other=0.0)
    sa = dot(ka, tl.trans(qa), PREC_A) * scale_a     # [BN, BM]
    sb = dot(kb, tl.trans(qb), PREC_B) * scale_b
    if MASKED or HAS_KPM:
        valid = _valid_t(offs_m, offs_n, KPMb, Nk, causal_offset, MASKED, CAUSAL, HAS_KPM)
        sam = tl.where(valid, sa, float("-inf"))
        sbm = tl.where(valid, sb, float("-inf"))
    else:
        sam = sa
        sbm = sb
    pa = tl.exp2(sam - lsea[None, :])
    pb = tl.exp2(sbm - lseb[None, :])
    # log-ratio ln X - ln Y - KL in log2 units, finite everywhere (raw scores)
    if A_IS_X:
        lr = (sa - lsea[None, :]) - (sb - lseb[None, :]) - kl2[None, :]
        ds_a = (g * 0.6931471805599453)[None, :] * pa * lr          # dS_x
        ds_b = g[None, :] * (pb - pa)                                # dS_y
    else:
        lr = (sb - lseb[None, :]) - (sa - lsea[None, :]) - kl2[None, :]
        ds_a = g[None, :] * (pa - pb)                                # dS_y
        ds_b = (g * 0.6931471805599453)[None, :] * pb * lr          # dS_x
    dka += dot(ds_a.to(qa.dtype), qa, PREC_A)
    if ALSO_B:
        dkb += dot(ds_b.to(qb.dtype), qb, PREC_B)
    return dka, dkb


@triton.jit
def _dk_head(h, b64, offs_n, offs_m0, offs_da, offs_db, ka, dka, dkb,
             QA, QB, KB, KPMb, LSEA, LSEB, KL, GROW,
             s_qa_b, s_qa_h, s_qa_m, s_qb_b, s_qb_h, s_qb_m, s_kb_b, s_kb_h, s_kb_n,
             H, Nq, Nk, GB, scale_a, scale_b, causal_offset, m_lo, m_full,
             DA: tl.constexpr, DB: tl.constexpr, BDA: tl.constexpr, BDB: tl.constexpr, BM: tl.constexpr,
             CAUSAL: tl.constexpr, HAS_KPM: tl.constexpr, EVEN_M: tl.constexpr, EVEN_N: tl.constexpr,
             A_IS_X: tl.constexpr, ALSO_B: tl.constexpr, PREC_A: tl.constexpr, PREC_B: tl.constexpr):
    """All query blocks of query head h against this program's key block."""
    h64 = h.to(tl.int64)
    hb = h // GB
    kb = load_tile(KB + b64 * s_kb_b + hb.to(tl.int64) * s_kb_h, offs_n, offs_db, s_kb_n, Nk, DB, BDB, EVEN_N)
    QAb = QA + b64 * s_qa_b + h64 * s_qa_h
    QBb = QB + b64 * s_qb_b + h64 * s_qb_h
    rowb = (b64 * H + h64) * Nq
    for start_m in range(m_lo, m_full, BM):
        dka, dkb = _dk_tile(ka, kb, QAb, QBb, KPMb, s_qa_m, s_qb_m, start_m, offs_n, offs_m0, offs_da, offs_db,
                            LSEA + rowb, LSEB + rowb, KL + rowb, GROW + rowb, dka, dkb, Nq, Nk, scale_a, scale_b,
                            causal_offset, DA, DB, BDA, BDB, True, CAUSAL, HAS_KPM, EVEN_M, A_IS_X, ALSO_B,
                            PREC_A, PREC_B)
    for start_m in range(m_full, Nq, BM):
        dka, dkb = _dk_tile(ka, kb, QAb, QBb, KPMb, s_qa_m, s_qb_m, start_m, offs_n, offs_m0, offs_da, offs_db,
                            LSEA + rowb, LSEB + rowb, KL + rowb, GROW + rowb, dka, dkb, Nq, Nk, scale_a, scale_b,
                            causal_offset, DA, DB, BDA, BDB, False, CAUSAL, HAS_KPM, EVEN_M, A_IS_X, ALSO_B,
                            PREC_A, PREC_B)
    return dka, dkb


@triton.jit
def attn_kl_bwd_dk_kernel(
    QA, KA, QB, KB, KPM, LSEA, LSEB, KL, GROW, DKA, DKB,
    s_qa_b, s_qa_h, s_qa_m, s_ka_b, s_ka_h, s_ka_n,
    s_qb_b, s_qb_h, s_qb_m, s_kb_b, s_kb_h, s_kb_n,
    s_dka_b, s_dka_h, s_dka_n, s_dkb_b, s_dkb_h, s_dkb_n,
    s_kpm_b,
    H, HKVA, Nq, Nk, GA, GB, scale_a, scale_b, out_scale_a, out_scale_b, causal_offset,
    DA: tl.constexpr, DB: tl.constexpr, BDA: tl.constexpr, BDB: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr,
    CAUSAL: tl.constexpr, HAS_KPM: tl.constexpr, EVEN_M: tl.constexpr, EVEN_N: tl.constexpr,
    A_IS_X: tl.constexpr, ALSO_B: tl.constexpr, PREC_A: tl.constexpr, PREC_B: tl.constexpr,
    GROUPED: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_bk = tl.program_id(1)
    b = pid_bk // HKVA
    kvh = pid_bk % HKVA
    start_n = pid_n * BN
    offs_n = start_n + tl.arange(0, BN)
    offs_m0 = tl.arange(0, BM)
    offs_da = tl.arange(0, BDA)
    offs_db = tl.arange(0, BDB)
    b64 = b.to(tl.int64)
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
            dka, dkb = _dk_head(kvh * GA + gi, b64, offs_n, offs_m0, offs_da, offs_db, ka, dka, dkb,
                                QA, QB, KB, KPMb, LSEA, LSEB, KL, GROW,
                                s_qa_b, s_qa_h, s_qa_m, s_qb_b, s_qb_h, s_qb_m, s_kb_b, s_kb_h, s_kb_n,
                                H, Nq, Nk, GB, scale_a, scale_b, causal_offset, m_lo, m_full,
                                DA, DB, BDA, BDB, BM, CAUSAL, HAS_KPM, EVEN_M, EVEN_N, A_IS_X, ALSO_B,
                                PREC_A, PREC_B)
    else:  # one query head per kv head: no head loop (nested loops cost registers and spills)
        dka, dkb = _dk_head(kvh, b64, offs_n, offs_m0, offs_da, offs_db, ka, dka, dkb,
                            QA, QB, KB, KPMb, LSEA, LSEB, KL, GROW,
                            s_qa_b, s_qa_h, s_qa_m, s_qb_b, s_qb_h, s_qb_m, s_kb_b, s_kb_h, s_kb_n,
                            H, Nq, Nk, GB, scale_a, scale_b, causal_offset, m_lo, m_full,
                            DA, DB, BDA, BDB, BM, CAUSAL, HAS_KPM, EVEN_M, EVEN_N, A_IS_X, ALSO_B,
                            PREC_A, PREC_B)
    ptrs = DKA + b64 * s_dka_b + kvh.to(tl.int64) * s_dka_h + offs_n[:, None] * s_dka_n + offs_da[None, :]
    tl.store(ptrs, (dka * out_scale_a).to(DKA.dtype.element_ty), mask=(offs_n[:, None] < Nk) & (offs_da[None, :] < DA))
    if ALSO_B:
        ptrs = DKB + b64 * s_dkb_b + kvh.to(tl.int64) * s_dkb_h + offs_n[:, None] * s_dkb_n + offs_db[None, :]
        tl.store(ptrs, (dkb * out_scale_b).to(DKB.dtype.element_ty),
                 mask=(offs_n[:, None] < Nk) & (offs_db[None, :] < DB))
