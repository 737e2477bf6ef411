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
    LOG2,
    MIX_BLOCK_V,
    NEG_BIG,
    NUM_WARPS,
    REVERSE_KL,
    STATS_GROUP,
    STATS_WARPS,
    TVD,
    expm1,
    f32,
    fexp,
    finite,
    group_tail,
    lanes_tail,
    log1p_full,
    math_args,
    merge_tail2,
    recentre,
    row_block,
    row_grad,
    row_terms,
)
from .chunked import RowNorm, RowStats
from .config import LossConfig

# Columns of the pass-1 state tensor [R, NSTATE], declared once (the kernels read these constexprs, host
# code goes through `column`): each side's max and tail (the mass outside its maximal entry,
# docs/design.md §2.6), the accumulating side's centred sums a, r and their reference, the other side's
# lost mass b, the raw lse and label logit.
M_S, T_S, M_T, T_T, ACC, M_Z, T_Z, Z_LABEL, REL, LOST, REF = (tl.constexpr(i) for i in range(11))
NSTATE = tl.constexpr(11)
# Columns of the per-row values [R, NROW] the second pass and the gradient read: the split normalizers
# (chunked.RowNorm: m_s, log l_s, m_t, log l_t, c, g), then the second pass's four sums, or the
# gradient's lse_z, sum_u and v_rest; hidden_finish_kernel also writes the rest of
# chunked.RowStats: each side's log-sum-exp, the divergence and the cross-entropy of the row.
N_M_S, N_LL_S, N_M_T, N_LL_T, N_C, N_G = (tl.constexpr(i) for i in range(6))
PHI_SUM, V_SUM, V2_SUM, V3_SUM = (tl.constexpr(i) for i in range(6, 10))
LSE_Z, SUM_U, V_REST = (tl.constexpr(i) for i in range(6, 9))
LSE_S, LSE_T, KD, CE = (tl.constexpr(i) for i in range(10, 14))
NROW = tl.constexpr(14)
FINISH_ROWS = 128  # rows per program of hidden_finish_kernel
# the divergences whose row terms take a mixture's log-ratio (tl_utils.mix_logs): their own tiles
MIXTURES = ("jsd", "skew_kl", "skew_reverse_kl")
# Entries whose other side lies more than this many nats above their own (w e^d could overflow fp32)
# count in the other side's dropped mass: the PyTorch path's bound, as a constexpr.
FAR_NATS = tl.constexpr(online.FAR_NATS)


@triton.jit
def _kl_lanes_to_row(m_o, t_o, acc, rel, ref, m_x, t_x, lost, mo0, to0, a0, r0, ref0, mx0, tx0, b0):
    """The lane merge of the accumulating side o (max, tail, centred a and r, their reference) and the
    other side x (max, tail, b), then with the row's carried state. a and r are referred to the d of the
    lane (or state) that holds o's max (core.online.Online.recentre); wherever o's sums underflow on the
    merged scale (a lane, or the carried state or this tile's, far below the row's max) or r would grow
    by more than e^FAR_NATS in the re-referencing, x's mass there is lost to r: it moves to b."""
    mo, to_r, sc_o = lanes_tail(m_o, t_o)
    ref_r = tl.max(tl.where(m_o == mo, ref, float("-inf")), axis=0)
    ref_r = tl.where(ref_r == float("-inf"), 0.0, ref_r)
    mo_safe = tl.where(mo == float("-inf"), 0.0, mo)
    a_l, r_l, ok_l = recentre(acc, rel, ref, ref_r, t_o + 1.0, m_o - mo_safe)
    a_r = tl.sum(a_l, axis=0)
    r_r = tl.sum(r_l, axis=0)
    mx, tx_r, sc_x = lanes_tail(m_x, t_x)
    b_r = tl.sum(tl.where(sc_x > 0, tl.where(ok_l, lost, t_x + 1.0) * sc_x, 0.0), axis=0)
    mo_new, to_new, so_old, so_row = merge_tail2(mo0, to0, mo, to_r)
    ref_new = tl.where(mo >= mo0, ref_r, ref0)
    so_safe = tl.where(mo_new == float("-inf"), 0.0, mo_new)
    a0n, r0n, ok0 = recentre(a0, r0, ref0, ref_new, to0 + 1.0, mo0 - so_safe)
    a1n, r1n, ok1 = recentre(a_r, r_r, ref_r, ref_new, to_r + 1.0, mo - so_safe)
    mx_new, tx_new, sx_old, sx_row = merge_tail2(mx0, tx0, mx, tx_r)
    b_new = tl.where(ok0, b0, tx0 + 1.0) * sx_old + tl.where(ok1, b_r, tx_r + 1.0) * sx_row
    return mo_new, to_new, a0n + a1n, r0n + r1n, ref_new, mx_new, tx_new, b_new


@triton.jit
def _tails_to_row(m, tail, m0, t0):
    """The lanes' (max, tail) merged, then with the row's carried (m0, t0)."""
    mx, t_r, _sc = lanes_tail(m, tail)
    m_new, t_new, _s0, _s1 = merge_tail2(m0, t0, mx, t_r)
    return m_new, t_new


@triton.jit
def _carried(st, col, init: tl.constexpr, FRESH: tl.constexpr):
    """A pass-1 state column as the earlier slabs left it; FRESH: a new state, not read (`empty_state`),
    its initial value instead."""
    if FRESH:
        return tl.full([], init, tl.float32)
    else:
        return tl.load(st + col)


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
    DIVERGENCE: tl.constexpr,
    PASS: tl.constexpr,
    CENTRED: tl.constexpr,
    RAW_LSE: tl.constexpr,
    HAS_LABELS: tl.constexpr,
    CHUNK_MAX: tl.constexpr,
    FRESH: tl.constexpr,
    BLOCK_V: tl.constexpr,
    GROUP: tl.constexpr,
):
    """PASS 1: each side's online (max, tail), the accumulating side's centred sums (the student for
    reverse_kl, else the teacher; docs/design.md §2.6) and the other side's lost mass, CE pieces; with
    CHUNK_MAX also this slab's largest tempered student and teacher logits of the row (chunk_max[row,
    0:2]: the constant-memory gradient filter's bounds, grad_filter.negligible_tiles). State: [R, NSTATE];
    FRESH: the state is new and not read (the row's first slab), every column is written.
    PASS 2: the four row sums of divergences.row_terms given the split normalizers. State: [R, NROW].
    Every lane keeps its own running values over the row's tiles; they are reduced once at the end
    (a reduction per tile synchronizes the program's warps and costs more than the exps)."""
    inv_temp, param = f32(inv_temp), f32(param)
    row = tl.program_id(0).to(tl.int64)
    z_row = z_ptr + row * stride_z
    t_row = t_ptr + row * stride_t
    cols = tl.arange(0, BLOCK_V)
    zero = tl.zeros([BLOCK_V], dtype=tl.float32)
    if PASS == 1:
        st = state_ptr + row * NSTATE
        label = -1
        if HAS_LABELS:
            label = tl.load(labels_ptr + row).to(tl.int32) - col_offset
        # a tile is [GROUP, lanes]: each lane takes GROUP entries a lane-count apart per tile (group_tail)
        offs = tl.arange(0, GROUP)[:, None] * (BLOCK_V // GROUP) + tl.arange(0, BLOCK_V // GROUP)[None, :]
        lane = tl.zeros([BLOCK_V // GROUP], dtype=tl.float32)
        m_s = lane + NEG_BIG
        m_t = lane + NEG_BIG
        m_z = lane + NEG_BIG
        t_s = lane - 1.0
        t_t = lane - 1.0
        t_z = lane - 1.0
        acc = lane  # sum of w (dd - ref), dd = own - other (Online.a, centred)
        rel = lane  # sum of w expm1(ref - dd) (Online.r, centred)
        ref = lane  # dd at the lane's max of the accumulating side
        lost = lane  # the other side's weight where the accumulating side's w underflowed (Online.b)
        z_lab = tl.zeros([GROUP, BLOCK_V // GROUP], dtype=tl.float32)
        for start in range(0, n_cols, BLOCK_V):
            idx = start + offs
            valid = idx < n_cols
            z = tl.load(z_row + idx, mask=valid, other=float("-inf"))
            t = tl.load(t_row + idx, mask=valid, other=float("-inf")) * inv_temp
            s = z * inv_temp
            if CENTRED:  # the centred sums (jsd's single-process first pass: each side's (max, tail) only)
                if DIVERGENCE == REVERSE_KL:  # the side p that accumulates: the student
                    l_old = t_s + 1.0
                    ly_old = t_t + 1.0
                    y_top = m_s - ref  # the other side's logit at the reference (ref = own - other there)
                    m_s, t_s, w, sc, up, top = group_tail(m_s, t_s, s)
                    m_t, t_t, w_x, sc_x, _up, _top = group_tail(m_t, t_t, t)
                    m_o = m_s
                    dd = s - t
                else:  # the teacher
                    l_old = t_t + 1.0
                    ly_old = t_s + 1.0
                    y_top = m_t - ref
                    m_t, t_t, w, sc, up, top = group_tail(m_t, t_t, t)
                    m_s, t_s, w_x, sc_x, _up, _top = group_tail(m_s, t_s, s)
                    m_o = m_t
                    dd = t - s
                # where the lane's max moved to a group entry with a finite d, that entry's d becomes the
                # reference: the old sums are re-referred by D (a -= l D; r = e^D sc (r + l) - l sc, with
                # e^D sc = e^grow, grow the change of the other side's logit at the reference, in one exp,
                # and sc expm1(D) = -expm1(-D) e^grow: no cancellation; -sc where expm1(-D) is huge).
                # Where r's terms would grow by more than e^FAR_NATS, the lane's earlier entries move to
                # the lost sum instead: r keeps -w for each, `lost` takes the other side's whole mass.
                ref_new = tl.max(tl.where(top & (tl.abs(dd) < float("inf")), dd, float("-inf")), axis=0)
                re = up & (ref_new > float("-inf"))
                shift_ref = ref_new - ref
                grow = y_top - (m_o - ref_new)
                # (expm1 and exp may overflow where D < -FAR_NATS or grow > FAR_NATS: the selects drop them)
                esc = fexp(grow)
                far_up = re & (grow > FAR_NATS)
                em_sc = tl.where(shift_ref < -FAR_NATS, -sc, -expm1(-shift_ref) * esc)
                rel = tl.where(re, tl.where(far_up, -l_old * sc, esc * rel + l_old * em_sc), rel * sc)
                if DIVERGENCE == FORWARD_KL or DIVERGENCE == REVERSE_KL:  # the KL itself (the others: G only)
                    acc = tl.where(re, (acc - l_old * shift_ref) * sc, acc * sc)
                lost = tl.where(far_up, ly_old, lost) * sc_x
                ref = tl.where(re, ref_new, ref)
                # the group's entries on the (new) reference and scale: where w underflowed (w = 0, d may
                # be infinite), where w e^-(d - ref) could overflow (ref - d > FAR_NATS: r takes -w), and
                # where the other side lies FAR_NATS above (that mass would be lost to r when the lane's
                # reference moves later), the other side's mass goes to `lost` (on its own scale)
                shift = dd - ref[None, :]
                keep = w > 0
                near = keep & (-shift <= FAR_NATS) & (-dd <= FAR_NATS)
                rel += tl.sum(tl.where(near, w * expm1(-shift), -w), axis=0)
                lost += tl.sum(tl.where(near, 0.0, w_x), axis=0)
                if DIVERGENCE == FORWARD_KL or DIVERGENCE == REVERSE_KL:
                    acc += tl.sum(tl.where(keep, w * shift, 0.0), axis=0)
            else:  # jsd: each side's (max, tail) only (its terms do not move with an error of the gap: §2.6)
                m_s, t_s, _w, _sc, _up, _top = group_tail(m_s, t_s, s)
                m_t, t_t, _w, _sc, _up, _top = group_tail(m_t, t_t, t)
            if RAW_LSE:
                m_z, t_z, _w, _sc, _up, _top = group_tail(m_z, t_z, z)
            if HAS_LABELS:
                z_lab += tl.where(valid & (idx == label), z, 0.0)
        if CHUNK_MAX:
            cm_s = tl.max(m_s, axis=0)
            cm_t = tl.max(m_t, axis=0)
            tl.store(chunk_max_ptr + row * stride_cm, tl.where(cm_s == NEG_BIG, float("-inf"), cm_s))
            tl.store(chunk_max_ptr + row * stride_cm + 1, tl.where(cm_t == NEG_BIG, float("-inf"), cm_t))
        if CENTRED:
            # the accumulating side o (the student for reverse_kl, else the teacher) and the other side x,
            # with their state columns
            if DIVERGENCE == REVERSE_KL:
                m_o, t_o, m_x, t_x = m_s, t_s, m_t, t_t
                M_O, T_O, M_X, T_X = M_S, T_S, M_T, T_T
            else:
                m_o, t_o, m_x, t_x = m_t, t_t, m_s, t_s
                M_O, T_O, M_X, T_X = M_T, T_T, M_S, T_S
            mo_row, to_row, a_row, r_row, ref_row, mx_row, tx_row, b_row = _kl_lanes_to_row(
                m_o,
                t_o,
                acc,
                rel,
                ref,
                m_x,
                t_x,
                lost,
                _carried(st, M_O, float("-inf"), FRESH),
                _carried(st, T_O, -1.0, FRESH),
                _carried(st, ACC, 0.0, FRESH),
                _carried(st, REL, 0.0, FRESH),
                _carried(st, REF, 0.0, FRESH),
                _carried(st, M_X, float("-inf"), FRESH),
                _carried(st, T_X, -1.0, FRESH),
                _carried(st, LOST, 0.0, FRESH),
            )
            tl.store(st + M_O, mo_row)
            tl.store(st + T_O, to_row)
            tl.store(st + M_X, mx_row)
            tl.store(st + T_X, tx_row)
            tl.store(st + ACC, a_row)
            tl.store(st + REL, r_row)
            tl.store(st + REF, ref_row)
            tl.store(st + LOST, b_row)
        else:
            ms_row, ts_row = _tails_to_row(
                m_s, t_s, _carried(st, M_S, float("-inf"), FRESH), _carried(st, T_S, -1.0, FRESH)
            )
            mt_row, tt_row = _tails_to_row(
                m_t, t_t, _carried(st, M_T, float("-inf"), FRESH), _carried(st, T_T, -1.0, FRESH)
            )
            tl.store(st + M_S, ms_row)
            tl.store(st + T_S, ts_row)
            tl.store(st + M_T, mt_row)
            tl.store(st + T_T, tt_row)
            if FRESH:  # the sums this pass does not keep, as new_state has them
                tl.store(st + ACC, 0.0)
                tl.store(st + REL, 0.0)
                tl.store(st + REF, 0.0)
                tl.store(st + LOST, 0.0)
        if RAW_LSE:
            mz_row, tz_row = _tails_to_row(
                m_z, t_z, _carried(st, M_Z, float("-inf"), FRESH), _carried(st, T_Z, -1.0, FRESH)
            )
            tl.store(st + M_Z, mz_row)
            tl.store(st + T_Z, tz_row)
        elif FRESH:
            tl.store(st + M_Z, float("-inf"))
            tl.store(st + T_Z, -1.0)
        if HAS_LABELS:
            z_sum = tl.sum(tl.sum(z_lab, axis=0), axis=0)
            tl.store(st + Z_LABEL, _carried(st, Z_LABEL, 0.0, FRESH) + z_sum)
        elif FRESH:
            tl.store(st + Z_LABEL, 0.0)
    else:
        st = state_ptr + row * NROW
        m_s = tl.load(st + N_M_S)
        ll_s = tl.load(st + N_LL_S)
        m_t = tl.load(st + N_M_T)
        ll_t = tl.load(st + N_LL_T)
        c = tl.load(st + N_C)
        g = tl.load(st + N_G)
        # the student's top entry (NaN where its max is not a single entry: then no entry is left out)
        m_top = tl.where(ll_s < LOG2, m_s, float("nan"))
        # each side's log-normalizer in one number: log p, log q to ~1e-6 relative of p, q (a row constant
        # that the row's sums carry only times the divergence); d, formed from the logits, keeps its digits
        k_s = m_s + ll_s
        k_t = m_t + ll_t
        phi_sum = zero
        v_sum = zero
        v2_sum = zero
        v3_sum = zero
        for start in range(0, n_cols, BLOCK_V):
            idx = start + cols
            valid = idx < n_cols
            # past the row's end both sides load -inf: p = q = 0 there and every term is exactly 0
            s = tl.load(z_row + idx, mask=valid, other=float("-inf")) * inv_temp
            t = tl.load(t_row + idx, mask=valid, other=float("-inf")) * inv_temp
            d = ((s - t) - c) - g
            phi, v, v2, v3 = row_terms(t - k_t, s - k_s, d, param, DIVERGENCE)
            phi_sum += phi
            v_sum += v
            if DIVERGENCE == TVD:
                v2_sum += v2
                v3_sum += v3
            else:  # v without the student's top entry
                v2_sum += tl.where(s != m_top, v, 0.0)
        tl.store(st + PHI_SUM, tl.load(st + PHI_SUM) + tl.sum(phi_sum, axis=0))
        tl.store(st + V_SUM, tl.load(st + V_SUM) + tl.sum(v_sum, axis=0))
        tl.store(st + V2_SUM, tl.load(st + V2_SUM) + tl.sum(v2_sum, axis=0))
        tl.store(st + V3_SUM, tl.load(st + V3_SUM) + tl.sum(v3_sum, axis=0))


@triton.jit
def _grad_tile(
    z_row,
    t_row,
    idx,
    valid,
    m_top,
    k_s,
    k_t,
    c,
    g_row,
    one_m_qtop,
    lse_z,
    sum_u,
    v_rest,
    kd_scale,
    ce_scale,
    label,
    inv_temp,
    param,
    inv_cap,
    DIVERGENCE: tl.constexpr,
    WITH_CE: tl.constexpr,
    SOFTCAP: tl.constexpr,
):
    z = tl.load(z_row + idx, mask=valid, other=0.0)
    t = tl.load(t_row + idx, mask=valid, other=0.0) * inv_temp
    s = z * inv_temp
    lq = s - k_s  # to ~1e-6 relative of q (a row constant: the gradient's terms scale with q); d keeps its digits
    lp = t - k_t
    d = ((s - t) - c) - g_row
    top = s == m_top  # the student's max, where it is a single entry
    g = row_grad(lp, lq, d, top, one_m_qtop, param, sum_u, v_rest, DIVERGENCE)
    # an ignored row (scale 0) gets exactly 0, even where its divergence is infinite
    g = tl.where(kd_scale != 0.0, g * kd_scale, 0.0)
    if WITH_CE:
        ce_g = (fexp(z - lse_z) - tl.where(idx == label, 1.0, 0.0)) * ce_scale
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
    inv_cap,
    DIVERGENCE: tl.constexpr,
    WITH_CE: tl.constexpr,
    FILTER: tl.constexpr,
    SOFTCAP: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    """g = kd_scale/T * dD/ds (divergences.row_grad) + ce_scale * (softmax(z) - onehot(label)), per entry.

    g may alias the t slab (a 16-bit g written over fp32 t of the same row): the barrier makes every
    warp finish with a tile's loads before any warp stores it, and a tile's store only reaches
    columns this row has already loaded.
    FILTER: also writes the row's largest |g| over the slab to rowmax (the gradient filter's
    reference, see grad_filter.py).
    """
    inv_temp, param, inv_cap = f32(inv_temp), f32(param), f32(inv_cap)
    row = tl.program_id(0).to(tl.int64)
    z_row = z_ptr + row * stride_z
    t_row = t_ptr + row * stride_t
    g_out = g_ptr + row * stride_g
    rv = rowvals_ptr + row * NROW
    m_s = tl.load(rv + N_M_S)
    ll_s = tl.load(rv + N_LL_S)
    m_t = tl.load(rv + N_M_T)
    ll_t = tl.load(rv + N_LL_T)
    c = tl.load(rv + N_C)
    g_row = tl.load(rv + N_G)
    lse_z = tl.load(rv + LSE_Z)
    sum_u = tl.load(rv + SUM_U)
    v_rest = tl.load(rv + V_REST)
    m_top = tl.where(ll_s < LOG2, m_s, float("nan"))  # the student's max where it is a single entry (tail < 1)
    one_m_qtop = -expm1(-ll_s)  # 1 - q at that entry
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
            m_top,
            m_s + ll_s,
            m_t + ll_t,
            c,
            g_row,
            one_m_qtop,
            lse_z,
            sum_u,
            v_rest,
            kd_scale,
            ce_scale,
            label,
            inv_temp,
            param,
            inv_cap,
            DIVERGENCE,
            WITH_CE,
            SOFTCAP,
        )
        tl.debug_barrier()  # g may alias t: every warp has used its loads of this tile before any store
        tl.store(g_out + idx, g.to(g_ptr.dtype.element_ty), mask=valid)
        if FILTER:
            g_max = tl.maximum(g_max, tl.where(valid, tl.abs(g), 0.0))
    if FILTER:
        tl.store(rowmax_ptr + row, tl.max(g_max, axis=0))


@triton.jit
def hidden_finish_kernel(
    state_ptr,
    vals_ptr,
    n_rows,
    DIVERGENCE: tl.constexpr,
    FINAL: tl.constexpr,
    CENTRED: tl.constexpr,
    WITH_CE: tl.constexpr,
    RAW_LSE: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    """The row math after a pass, a row per lane: from a pass-1 state [R, NSTATE] to the split
    normalizers of chunked.row_norm (vals[:, :6]); FINAL: also the rest of chunked.finish_stats from
    them and the second pass's sums (vals[:, 6:10], read before they are overwritten): lse_z, sum_u,
    v_rest for the gradient, and each side's lse, the divergence and the cross-entropy of the row.
    Not FINAL: the sums' columns are zeroed for the second pass. (One launch where the same math in
    PyTorch takes ~100 small kernels per block of rows.)"""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    ok = rows < n_rows
    st = state_ptr + rows.to(tl.int64) * NSTATE
    out = vals_ptr + rows.to(tl.int64) * NROW
    m_s = tl.load(st + M_S, mask=ok, other=0.0)
    t_s = tl.load(st + T_S, mask=ok, other=0.0)
    m_t = tl.load(st + M_T, mask=ok, other=0.0)
    t_t = tl.load(st + T_T, mask=ok, other=0.0)
    ll_s = log1p_full(t_s)
    ll_t = log1p_full(t_t)
    both = finite(m_s) & finite(m_t)
    a_l = tl.zeros_like(m_s)
    g_own = tl.zeros_like(m_s)
    if CENTRED:  # chunked.row_norm with _centred: (a / l, G) of the accumulating side o, the other side x
        ref = tl.load(st + REF, mask=ok, other=0.0)
        gap = (m_s - m_t) + (ll_s - ll_t)  # lse_s - lse_t
        if DIVERGENCE == REVERSE_KL:
            t_o, t_x, lse_gap = t_s, t_t, -gap
        else:
            t_o, t_x, lse_gap = t_t, t_s, gap
        l_o = 1.0 + t_o.to(tl.float64)
        a64 = tl.load(st + ACC, mask=ok, other=0.0).to(tl.float64) / l_o
        r = tl.load(st + REL, mask=ok, other=0.0).to(tl.float64) / l_o
        lost = tl.load(st + LOST, mask=ok, other=0.0).to(tl.float64) / (1.0 + t_x.to(tl.float64))
        close = finite(r) & (tl.abs(r) < 0.5) & finite(a64) & (lost >= 0.0) & (lost < 0.5)
        r = tl.where(close, r, 0.0)
        lost = tl.where(close, lost, 0.0)
        # log1p(r) - log1p(-lost) = log1p((r + lost) / (1 - lost)): one log, no difference of two
        g_close = log1p_full(((r + lost) / (1.0 - lost)).to(tl.float32))
        g_own = tl.where(close, g_close, (ref.to(tl.float64) + lse_gap.to(tl.float64)).to(tl.float32))
        a_l = a64.to(tl.float32)
        if DIVERGENCE == REVERSE_KL:
            c, g = ref, -g_own
        else:
            c, g = -ref, g_own
        c = tl.where(close, c, tl.where(both, m_s - m_t, c))
        g = tl.where(close, g, tl.where(both, ll_s - ll_t, g))
    else:
        c = tl.where(both, m_s - m_t, 0.0)
        g = ll_s - ll_t
    tl.store(out + N_M_S, m_s, mask=ok)
    tl.store(out + N_LL_S, ll_s, mask=ok)
    tl.store(out + N_M_T, m_t, mask=ok)
    tl.store(out + N_LL_T, ll_t, mask=ok)
    tl.store(out + N_C, c, mask=ok)
    tl.store(out + N_G, g, mask=ok)
    zero = tl.zeros_like(m_s)
    if not FINAL:
        for col in tl.static_range(6, 10):
            tl.store(out + col, zero, mask=ok)
    else:
        lse_s = m_s + ll_s
        lse_t = m_t + ll_t
        v_rest = zero
        if DIVERGENCE == FORWARD_KL:
            kd = a_l + g_own
            sum_u = zero
        elif DIVERGENCE == REVERSE_KL:
            kd = a_l + g_own
            kd = tl.where(kd < 0.0, 0.0, kd)  # the gradient reads the clamped value
            sum_u = kd
            v_rest = a_l - expm1(-ll_s) * g_own
        else:
            kd = tl.load(out + PHI_SUM, mask=ok, other=0.0)
            v_a = tl.load(out + V_SUM, mask=ok, other=0.0)
            v_b = tl.load(out + V2_SUM, mask=ok, other=0.0)
            if DIVERGENCE == TVD:  # divergences.tvd_sum_u
                v_e = tl.load(out + V3_SUM, mask=ok, other=0.0)
                x = 2.0 * v_b + v_e
                y = 2.0 * v_a + v_e
                sum_u = tl.where(x <= y, x, -y)
                v_rest = v_b - v_a
            else:
                sum_u = v_a
                v_rest = v_b
        kd = tl.where(kd < 0.0, 0.0, kd)
        bad = (lse_s != lse_s) | (lse_t != lse_t)
        kd = tl.where(bad, float("nan"), kd)
        sum_u = tl.where(bad, float("nan"), sum_u)
        lse_z = lse_s
        ce = zero
        if WITH_CE:
            if RAW_LSE:
                lse_z = tl.load(st + M_Z, mask=ok, other=0.0) + log1p_full(tl.load(st + T_Z, mask=ok, other=0.0))
            ce = lse_z - tl.load(st + Z_LABEL, mask=ok, other=0.0)
        tl.store(out + LSE_Z, lse_z, mask=ok)
        tl.store(out + SUM_U, sum_u, mask=ok)
        tl.store(out + V_REST, v_rest, mask=ok)
        tl.store(out + V3_SUM, zero, mask=ok)  # a spare column in the gradient's layout
        tl.store(out + LSE_S, lse_s, mask=ok)
        tl.store(out + LSE_T, lse_t, mask=ok)
        tl.store(out + KD, kd, mask=ok)
        tl.store(out + CE, ce, mask=ok)


def column(st: torch.Tensor, col) -> torch.Tensor:
    """Column `col` (one of the constexprs above) of a state tensor [R, NSTATE] or [R, NROW]."""
    return st[:, int(col)]


def new_state(n: int, device) -> torch.Tensor:
    """A pass-1 state: maxima -inf, tails -1 (nothing seen), sums 0."""
    st = torch.zeros(n, int(NSTATE), dtype=torch.float32, device=device)
    for col in (M_S, M_T, M_Z):  # column by column: a list index would be a host-to-device copy (no CUDA graphs)
        st[:, int(col)] = float("-inf")
    for col in (T_S, T_T, T_Z):
        st[:, int(col)] = -1.0
    return st


def empty_state(n: int, device) -> torch.Tensor:
    """A pass-1 state for a first slab launched with fresh=True (the kernel writes every column)."""
    return torch.empty(n, int(NSTATE), dtype=torch.float32, device=device)


def new_rowvals(norm_rows: torch.Tensor) -> torch.Tensor:
    """A pass-2 state [n, NROW]: the split normalizers ([6, n], chunked.RowNorm.stacked) and zero sums."""
    st = torch.zeros(norm_rows.shape[1], int(NROW), dtype=torch.float32, device=norm_rows.device)
    st[:, : int(N_G) + 1] = norm_rows.t()
    return st


def second_pass_sums(st: torch.Tensor):
    """The four row sums of a pass-2 state (divergences.row_terms: phi, v, v2, v3)."""
    return tuple(column(st, k) for k in (PHI_SUM, V_SUM, V2_SUM, V3_SUM))


def new_gradvals(norm_rows: torch.Tensor, lse_z, sum_u, v_rest) -> torch.Tensor:
    """The gradient kernel's per-row values [n, NROW]: the split normalizers ([6, n]), lse_z, sum_u, v_rest."""
    out = new_rowvals(norm_rows)
    out[:, int(LSE_Z)], out[:, int(SUM_U)], out[:, int(V_REST)] = lse_z, sum_u, v_rest
    return out


def keeps_centred(cfg: LossConfig, centred: bool) -> bool:
    """Whether a pass-1 state holds the centred sums: every divergence's but jsd's single-process first
    pass (centred=False), which keeps each side's (max, tail) only (docs/design.md §2.6)."""
    return centred or cfg.divergence != "jsd"


def launch_finish(state: torch.Tensor, vals: torch.Tensor, cfg: LossConfig, final: bool, centred: bool = True) -> None:
    """The row math after a pass (hidden_finish_kernel), from a merged pass-1 `state` [R, NSTATE] into
    `vals` [R, NROW]: the split normalizers and zeroed sums for the second pass; final (after the last
    pass): the gradient's per-row values and the rows' lse, divergence and cross-entropy (`row_stats`).
    centred: as the pass-1 launches' (False: jsd's first pass kept the tails only)."""
    rows = state.shape[0]
    if rows == 0:
        return
    launch(
        hidden_finish_kernel,
        (triton.cdiv(rows, FINISH_ROWS),),
        state,
        vals,
        rows,
        DIVERGENCE=dv.DIVERGENCE_IDS[cfg.divergence],
        FINAL=final,
        CENTRED=keeps_centred(cfg, centred),
        WITH_CE=cfg.with_ce,
        RAW_LSE=cfg.raw_lse,
        BLOCK_R=FINISH_ROWS,
        num_warps=4,
    )


def row_stats(vals: torch.Tensor, cfg: LossConfig) -> RowStats:
    """The RowStats of a finished `vals` [R, NROW] (launch_finish): column views, `packed` the tensor."""
    norm = RowNorm(*(column(vals, k) for k in (N_M_S, N_LL_S, N_M_T, N_LL_T, N_C, N_G)))
    return RowStats(
        lse_s=column(vals, LSE_S),
        lse_t=column(vals, LSE_T),
        lse_z=column(vals, LSE_Z) if cfg.with_ce else None,
        sum_u=column(vals, SUM_U),
        kd=column(vals, KD),
        ce=column(vals, CE) if cfg.with_ce else None,
        norm=norm,
        v_rest=column(vals, V_REST),
        packed=vals,
    )


def launch_stats(
    z,
    t,
    state,
    labels,
    col_offset: int,
    cfg: LossConfig,
    pass_no: int,
    chunk_max=None,
    centred: bool = True,
    fresh: bool = False,
) -> None:
    """Update `state` rows with the slab (z, t) [R, C] (pass 1: [R, NSTATE] from new_state; pass 2:
    [R, NROW] from new_rowvals); labels are global ids (or None). chunk_max ([R, 2] view, pass 1): gets
    the slab's largest tempered logits per row. centred=False (jsd only): pass 1 keeps each side's (max,
    tail) only (docs/design.md §2.6); the vocab-parallel merge takes the centred sums of every divergence.
    fresh (pass 1): `state` is new (`empty_state`, not read): the rows' first slab."""
    rows, n_cols = z.shape
    if rows == 0:
        return
    inv_temp, a, _log_a, _log_1ma = math_args(cfg)
    has_labels = cfg.with_ce and labels is not None and pass_no == 1
    centred = keeps_centred(cfg, centred)
    kl = pass_no == 1 and centred  # the centred sums' register budget
    mix = pass_no == 2 and cfg.divergence in MIXTURES
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
        DIVERGENCE=dv.DIVERGENCE_IDS[cfg.divergence],
        PASS=pass_no,
        CENTRED=centred,
        RAW_LSE=cfg.raw_lse,
        HAS_LABELS=has_labels,
        CHUNK_MAX=chunk_max is not None and pass_no == 1,
        FRESH=fresh and pass_no == 1,
        BLOCK_V=row_block(n_cols, KL_STATS_BLOCK_V if kl else MIX_BLOCK_V if mix else 0),
        GROUP=STATS_GROUP,
        num_warps=KL_STATS_WARPS if kl else STATS_WARPS,
    )


def launch_grad(z, t, g, rowvals, kd_scale, ce_scale, labels, col_offset: int, cfg: LossConfig, rowmax=None) -> None:
    """Write the gradient slab g from the per-row values rowvals [R, NROW] (triton_function.row_values);
    with `rowmax` (fp32 [R]) also each row's largest |g| (the gradient filter's reference)."""
    rows, n_cols = z.shape
    if rows == 0:
        return
    inv_temp, a, _log_a, _log_1ma = math_args(cfg)
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
        0.0 if cfg.softcap_s is None else 1.0 / cfg.softcap_s,
        DIVERGENCE=dv.DIVERGENCE_IDS[cfg.divergence],
        WITH_CE=with_ce,
        FILTER=rowmax is not None,
        SOFTCAP=cfg.softcap_s is not None,
        BLOCK_V=row_block(n_cols, MIX_BLOCK_V if cfg.divergence in MIXTURES else 0),
        num_warps=NUM_WARPS,
    )
