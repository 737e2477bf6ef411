"""Triton row kernels over fp32 logit slabs: online statistics, divergence sums, gradient.

A slab holds raw student logits z and raw teacher logits t for R rows and a run of vocab
columns (the whole vocabulary in the fast mode, a vocab chunk in the constant-memory mode).
Each program owns one row and walks its columns in BLOCK_V tiles, so a row's state is updated
by one program only, and slabs can be processed chunk after chunk with the state carried in a
small [R, NSTATE] fp32 tensor. The divergence math is the one of nitrobrew.divergences, in Triton,
selected by the constexpr DIVERGENCE (ids from divergences.DIVERGENCE_IDS).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import divergences as dv
from ..core import online
from ..core.launch import launch
from ..core.tl_utils import (
    FORWARD_KL,
    KL_STATS_BLOCK_V,
    KL_STATS_WARPS,
    NUM_WARPS,
    REVERSE_KL,
    STATS_WARPS,
    expm1,
    f32,
    lane_update,
    lanes_to_row,
    math_args,
    phi_u,
    row_block,
)
from .config import LossConfig

# Columns of the per-row state tensor (host ints; the kernels read the constexpr twins C_*).
M_S, L_S, M_T, L_T, ACC, M_Z, L_Z, Z_LABEL, PHI_SUM, U_SUM = range(10)
NSTATE = 10
REL = PHI_SUM  # one-pass divergences (no second pass): Online.r, on ACC's scale
LOST = U_SUM  # one-pass divergences: Online.b, on the other side's scale
C_M_S, C_L_S, C_M_T, C_L_T, C_ACC, C_M_Z, C_L_Z, C_Z_LABEL, C_PHI_SUM, C_U_SUM = (tl.constexpr(i) for i in range(10))
C_NSTATE, C_REL, C_LOST = tl.constexpr(NSTATE), tl.constexpr(REL), tl.constexpr(LOST)
# Columns of the per-row finished values the gradient kernel reads.
LSE_S, LSE_T, LSE_Z, SUM_U = range(4)
C_LSE_S, C_LSE_T, C_LSE_Z, C_SUM_U = (tl.constexpr(i) for i in range(4))
# Entries whose other side lies more than this many nats above their own (w e^d could overflow fp32)
# count in the other side's dropped mass: the PyTorch path's bound, as a constexpr.
FAR_NATS = tl.constexpr(online.FAR_NATS)


@triton.jit
def _kl_lanes_to_row(m_o, l_o, acc, rel, m_x, l_x, lost, mo0, lo0, a0, r0, mx0, lx0, b0):
    """The KLs' lane merge: the accumulating side o (max, sum, a, r) and the other side x (max, sum, b),
    then with the row's carried state. Wherever o's sums underflow on the merged scale (a lane, or the
    carried state or this tile's, far below the row's max), x's mass there is lost to r: it moves to b."""
    mo = tl.max(m_o, axis=0)
    mo_safe = tl.where(mo == float("-inf"), 0.0, mo)
    sc_o = tl.exp(m_o - mo_safe)
    l_or = tl.sum(l_o * sc_o, axis=0)
    a_r = tl.sum(tl.where(sc_o > 0, acc * sc_o, 0.0), axis=0)
    r_r = tl.sum(tl.where(sc_o > 0, rel * sc_o, 0.0), axis=0)
    mx = tl.max(m_x, axis=0)
    mx_safe = tl.where(mx == float("-inf"), 0.0, mx)
    sc_x = tl.exp(m_x - mx_safe)
    l_xr = tl.sum(l_x * sc_x, axis=0)
    b_r = tl.sum(tl.where(sc_x > 0, tl.where(sc_o > 0, lost, l_x) * sc_x, 0.0), axis=0)
    mo_new = tl.maximum(mo0, mo)
    so_safe = tl.where(mo_new == float("-inf"), 0.0, mo_new)
    so_old = tl.exp(mo0 - so_safe)
    so_row = tl.exp(mo - so_safe)
    mx_new = tl.maximum(mx0, mx)
    sx_safe = tl.where(mx_new == float("-inf"), 0.0, mx_new)
    sx_old = tl.exp(mx0 - sx_safe)
    sx_row = tl.exp(mx - sx_safe)
    b_new = tl.where(so_old > 0, b0, lx0) * sx_old + tl.where(so_row > 0, b_r, l_xr) * sx_row
    return (
        mo_new,
        lo0 * so_old + l_or * so_row,
        a0 * so_old + a_r * so_row,
        r0 * so_old + r_r * so_row,
        mx_new,
        lx0 * sx_old + l_xr * sx_row,
        b_new,
    )


@triton.jit
def hidden_stats_kernel(
    z_ptr,
    t_ptr,
    stride_z,
    stride_t,
    state_ptr,
    labels_ptr,
    chunk_max_ptr,
    stride_cm,
    n_cols,
    col_offset,
    inv_temp,
    param,
    log_a,
    log_1ma,
    DIVERGENCE: tl.constexpr,
    PASS: tl.constexpr,
    RAW_LSE: tl.constexpr,
    HAS_LABELS: tl.constexpr,
    CHUNK_MAX: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    """PASS 1: online log-sum-exps (+ the one-pass KL accumulator, CE pieces); with CHUNK_MAX also
    this slab's largest tempered student and teacher logits of the row (chunk_max[row, 0:2]: the
    constant-memory gradient filter's bounds, grad_filter.negligible_tiles).
    PASS 2: sum of phi and of u given the final log-sum-exps (stored in M_S/M_T as lse).
    Every lane keeps its own running values over the row's tiles; they are reduced once at the end
    (a reduction per tile synchronizes the program's warps and costs more than the exps)."""
    inv_temp, param, log_a, log_1ma = f32(inv_temp), f32(param), f32(log_a), f32(log_1ma)
    row = tl.program_id(0).to(tl.int64)
    z_row = z_ptr + row * stride_z
    t_row = t_ptr + row * stride_t
    st = state_ptr + row * C_NSTATE
    cols = tl.arange(0, BLOCK_V)
    zero = tl.zeros([BLOCK_V], dtype=tl.float32)
    if PASS == 1:
        label = -1
        if HAS_LABELS:
            label = tl.load(labels_ptr + row).to(tl.int32) - col_offset
        m_s = zero + float("-inf")
        m_t = zero + float("-inf")
        m_z = zero + float("-inf")
        l_s = zero
        l_t = zero
        l_z = zero
        acc = zero
        rel = zero  # sum of w expm1(other - own) for the side that accumulates (chunked.Online.r)
        lost = zero  # the other side's weight where the accumulating side's w underflowed (Online.b)
        z_lab = zero
        for start in range(0, n_cols, BLOCK_V):
            idx = start + cols
            valid = idx < n_cols
            z = tl.load(z_row + idx, mask=valid, other=float("-inf"))
            t = tl.load(t_row + idx, mask=valid, other=float("-inf")) * inv_temp
            s = z * inv_temp
            m_s, l_s, w_s, sc_s = lane_update(m_s, l_s, s)
            m_t, l_t, w_t, sc_t = lane_update(m_t, l_t, t)
            if (
                DIVERGENCE == FORWARD_KL or DIVERGENCE == REVERSE_KL
            ):  # the side p that accumulates: the teacher (forward KL) or the student
                w = w_t if DIVERGENCE == FORWARD_KL else w_s
                sc = sc_t if DIVERGENCE == FORWARD_KL else sc_s
                d = s - t if DIVERGENCE == FORWARD_KL else t - s  # other - own
                keep = w > 0  # w = 0 where d may be infinite
                # the other side's mass goes to `lost` (on its own scale) where p underflowed, and where
                # w e^d could overflow (d > FAR_NATS: rel keeps only -w there, the "-1" of expm1)
                near = keep & (d <= FAR_NATS)
                acc = acc * sc - tl.where(keep, w * d, 0.0)
                rel = rel * sc + tl.where(near, w * expm1(d), -w)  # rel stays finite: near bounds w e^d
                # (when a lane's own max jumps by > 104 nats, its earlier near entries' other-side mass is
                # below e^-40 of the new scale: negligible, so no per-element select for it; lanes, tiles
                # and ranks whose sums underflow as a whole are handled where they merge)
                lost = lost * (sc_s if DIVERGENCE == FORWARD_KL else sc_t) + tl.where(
                    near, 0.0, w_s if DIVERGENCE == FORWARD_KL else w_t
                )
            if RAW_LSE:
                m_z, l_z, _w, _sc = lane_update(m_z, l_z, z)
            if HAS_LABELS:
                z_lab += tl.where(valid & (idx == label), z, 0.0)
        if CHUNK_MAX:
            tl.store(chunk_max_ptr + row * stride_cm, tl.max(m_s, axis=0))
            tl.store(chunk_max_ptr + row * stride_cm + 1, tl.max(m_t, axis=0))
        if DIVERGENCE == FORWARD_KL:
            mt_row, lt_row, a_row, r_row, ms_row, ls_row, b_row = _kl_lanes_to_row(
                m_t,
                l_t,
                acc,
                rel,
                m_s,
                l_s,
                lost,
                tl.load(st + C_M_T),
                tl.load(st + C_L_T),
                tl.load(st + C_ACC),
                tl.load(st + C_REL),
                tl.load(st + C_M_S),
                tl.load(st + C_L_S),
                tl.load(st + C_LOST),
            )
        elif DIVERGENCE == REVERSE_KL:
            ms_row, ls_row, a_row, r_row, mt_row, lt_row, b_row = _kl_lanes_to_row(
                m_s,
                l_s,
                acc,
                rel,
                m_t,
                l_t,
                lost,
                tl.load(st + C_M_S),
                tl.load(st + C_L_S),
                tl.load(st + C_ACC),
                tl.load(st + C_REL),
                tl.load(st + C_M_T),
                tl.load(st + C_L_T),
                tl.load(st + C_LOST),
            )
        else:
            ms_row, ls_row, _a, _r = lanes_to_row(
                m_s, l_s, zero, zero, tl.load(st + C_M_S), tl.load(st + C_L_S), 0.0, 0.0
            )
            mt_row, lt_row, _a, _r = lanes_to_row(
                m_t, l_t, zero, zero, tl.load(st + C_M_T), tl.load(st + C_L_T), 0.0, 0.0
            )
        tl.store(st + C_M_S, ms_row)
        tl.store(st + C_L_S, ls_row)
        tl.store(st + C_M_T, mt_row)
        tl.store(st + C_L_T, lt_row)
        if DIVERGENCE == FORWARD_KL or DIVERGENCE == REVERSE_KL:
            tl.store(st + C_ACC, a_row)
            tl.store(st + C_REL, r_row)
            tl.store(st + C_LOST, b_row)
        if RAW_LSE:
            mz_row, lz_row, _a, _r = lanes_to_row(
                m_z, l_z, zero, zero, tl.load(st + C_M_Z), tl.load(st + C_L_Z), 0.0, 0.0
            )
            tl.store(st + C_M_Z, mz_row)
            tl.store(st + C_L_Z, lz_row)
        if HAS_LABELS:
            tl.store(st + C_Z_LABEL, tl.load(st + C_Z_LABEL) + tl.sum(z_lab, axis=0))
    else:
        lse_s = tl.load(st + C_M_S)
        lse_t = tl.load(st + C_M_T)
        phi_sum = zero
        u_sum = zero
        for start in range(0, n_cols, BLOCK_V):
            idx = start + cols
            valid = idx < n_cols
            lq = tl.load(z_row + idx, mask=valid, other=0.0) * inv_temp - lse_s
            lp = tl.load(t_row + idx, mask=valid, other=0.0) * inv_temp - lse_t
            phi, u = phi_u(lp, lq, param, log_a, log_1ma, DIVERGENCE)
            phi_sum += tl.where(valid, phi, 0.0)
            u_sum += tl.where(valid, u, 0.0)
        tl.store(st + C_PHI_SUM, tl.load(st + C_PHI_SUM) + tl.sum(phi_sum, axis=0))
        tl.store(st + C_U_SUM, tl.load(st + C_U_SUM) + tl.sum(u_sum, axis=0))


@triton.jit
def _grad_tile(
    z_row,
    t_row,
    idx,
    valid,
    lse_s,
    lse_t,
    lse_z,
    sum_u,
    kd_scale,
    ce_scale,
    label,
    inv_temp,
    param,
    log_a,
    log_1ma,
    inv_cap,
    DIVERGENCE: tl.constexpr,
    WITH_CE: tl.constexpr,
    SOFTCAP: tl.constexpr,
):
    z = tl.load(z_row + idx, mask=valid, other=0.0)
    t = tl.load(t_row + idx, mask=valid, other=0.0)
    lq = z * inv_temp - lse_s
    lp = t * inv_temp - lse_t
    _phi, u = phi_u(lp, lq, param, log_a, log_1ma, DIVERGENCE)
    # an ignored row (scale 0) gets exactly 0, even where its divergence is infinite
    g = tl.where(kd_scale != 0.0, (u - tl.exp(lq) * sum_u) * kd_scale, 0.0)
    if WITH_CE:
        ce_g = (tl.exp(z - lse_z) - tl.where(idx == label, 1.0, 0.0)) * ce_scale
        g += tl.where(ce_scale != 0.0, ce_g, 0.0)
    if SOFTCAP:  # z holds the capped logits c tanh(raw / c): d capped / d raw = 1 - (z / c)^2
        zc = z * inv_cap
        g = g * (1.0 - zc * zc)
    return g


@triton.jit
def hidden_grad_kernel(
    z_ptr,
    t_ptr,
    g_ptr,
    stride_z,
    stride_t,
    stride_g,
    rowvals_ptr,
    kd_scale_ptr,
    ce_scale_ptr,
    labels_ptr,
    rowmax_ptr,
    n_cols,
    col_offset,
    inv_temp,
    param,
    log_a,
    log_1ma,
    inv_cap,
    DIVERGENCE: tl.constexpr,
    WITH_CE: tl.constexpr,
    FILTER: tl.constexpr,
    SOFTCAP: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    """g = kd_scale/T * (u - q * sum_u) + ce_scale * (softmax(z) - onehot(label)), per entry.

    g may alias the t slab (a 16-bit g written over fp32 t of the same row): the barrier makes every
    warp finish with a tile's loads before any warp stores it, and a tile's store only reaches
    columns this row has already loaded.
    FILTER: also writes the row's largest |g| over the slab to rowmax (the gradient filter's
    reference, see grad_filter.py).
    """
    inv_temp, param, log_a, log_1ma, inv_cap = f32(inv_temp), f32(param), f32(log_a), f32(log_1ma), f32(inv_cap)
    row = tl.program_id(0).to(tl.int64)
    z_row = z_ptr + row * stride_z
    t_row = t_ptr + row * stride_t
    g_row = g_ptr + row * stride_g
    lse_s = tl.load(rowvals_ptr + row * 4 + C_LSE_S)
    lse_t = tl.load(rowvals_ptr + row * 4 + C_LSE_T)
    lse_z = tl.load(rowvals_ptr + row * 4 + C_LSE_Z)
    sum_u = tl.load(rowvals_ptr + row * 4 + C_SUM_U)
    kd_scale = tl.load(kd_scale_ptr + row) * inv_temp
    ce_scale = 0.0
    label = -1
    if WITH_CE:
        ce_scale = tl.load(ce_scale_ptr + row)
        label = tl.load(labels_ptr + row).to(tl.int32) - col_offset
    cols = tl.arange(0, BLOCK_V)
    g_max = tl.zeros([BLOCK_V], dtype=tl.float32)
    for start in range(0, n_cols, BLOCK_V):
        idx = start + cols
        valid = idx < n_cols
        g = _grad_tile(
            z_row,
            t_row,
            idx,
            valid,
            lse_s,
            lse_t,
            lse_z,
            sum_u,
            kd_scale,
            ce_scale,
            label,
            inv_temp,
            param,
            log_a,
            log_1ma,
            inv_cap,
            DIVERGENCE,
            WITH_CE,
            SOFTCAP,
        )
        tl.debug_barrier()  # g may alias t: every warp has used its loads of this tile before any store
        tl.store(g_row + idx, g.to(g_ptr.dtype.element_ty), mask=valid)
        if FILTER:
            g_max = tl.maximum(g_max, tl.where(valid, tl.abs(g), 0.0))
    if FILTER:
        tl.store(rowmax_ptr + row, tl.max(g_max, axis=0))


def new_state(n: int, device) -> torch.Tensor:
    st = torch.zeros(n, NSTATE, dtype=torch.float32, device=device)
    for col in (M_S, M_T, M_Z):  # column by column: a list index would be a host-to-device copy (no CUDA graphs)
        st[:, col] = float("-inf")
    return st


def launch_stats(z, t, state, labels, col_offset: int, cfg: LossConfig, pass_no: int, chunk_max=None) -> None:
    """Update `state` rows with the slab (z, t) [R, C]; labels are global ids (or None). chunk_max
    ([R, 2] view, pass 1): gets the slab's largest tempered logits per row."""
    rows, n_cols = z.shape
    if rows == 0:
        return
    inv_temp, a, log_a, log_1ma = math_args(cfg)
    has_labels = cfg.with_ce and labels is not None and pass_no == 1
    kl = pass_no == 1 and cfg.divergence in dv.ONE_PASS
    launch(
        hidden_stats_kernel,
        (rows,),
        z,
        t,
        z.stride(0),
        t.stride(0),
        state,
        labels if has_labels else state,
        state if chunk_max is None else chunk_max,
        0 if chunk_max is None else chunk_max.stride(0),
        n_cols,
        col_offset,
        inv_temp,
        a,
        log_a,
        log_1ma,
        DIVERGENCE=dv.DIVERGENCE_IDS[cfg.divergence],
        PASS=pass_no,
        RAW_LSE=cfg.with_ce and cfg.temperature != 1.0,
        HAS_LABELS=has_labels,
        CHUNK_MAX=chunk_max is not None and pass_no == 1,
        BLOCK_V=row_block(n_cols, KL_STATS_BLOCK_V if kl else 0),
        num_warps=KL_STATS_WARPS if kl else STATS_WARPS,
    )


def launch_grad(z, t, g, rowvals, kd_scale, ce_scale, labels, col_offset: int, cfg: LossConfig, rowmax=None) -> None:
    """Write the gradient slab g; with `rowmax` (fp32 [R]) also each row's largest |g| (the
    gradient filter's reference)."""
    rows, n_cols = z.shape
    if rows == 0:
        return
    inv_temp, a, log_a, log_1ma = math_args(cfg)
    with_ce = cfg.with_ce and labels is not None
    launch(
        hidden_grad_kernel,
        (rows,),
        z,
        t,
        g,
        z.stride(0),
        t.stride(0),
        g.stride(0),
        rowvals,
        kd_scale,
        ce_scale if with_ce else kd_scale,
        labels if with_ce else kd_scale,
        rowmax if rowmax is not None else kd_scale,
        n_cols,
        col_offset,
        inv_temp,
        a,
        log_a,
        log_1ma,
        0.0 if cfg.softcap_s is None else 1.0 / cfg.softcap_s,
        DIVERGENCE=dv.DIVERGENCE_IDS[cfg.divergence],
        WITH_CE=with_ce,
        FILTER=rowmax is not None,
        SOFTCAP=cfg.softcap_s is not None,
        BLOCK_V=row_block(n_cols),
        num_warps=NUM_WARPS,
    )
