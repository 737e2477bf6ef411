"""Triton building blocks shared by every kernel family (jit helpers and launch settings).

``phi_u`` is the divergence math of nitrobrew.divergences in Triton, selected by the constexpr
DIVERGENCE (ids from ``divergences.DIVERGENCE_IDS``, spelled by the named constexprs below); the online
helpers are the streaming log-sum-exp of docs/design.md §2.3.
"""

from __future__ import annotations

import math

import triton
import triton.language as tl

from .. import divergences as dv
from . import checks as ck
from . import online
from .launch import next_pow2

FORWARD_KL = tl.constexpr(dv.DIVERGENCE_IDS["forward_kl"])
REVERSE_KL = tl.constexpr(dv.DIVERGENCE_IDS["reverse_kl"])
JSD = tl.constexpr(dv.DIVERGENCE_IDS["jsd"])
SKEW_KL = tl.constexpr(dv.DIVERGENCE_IDS["skew_kl"])
SKEW_REVERSE_KL = tl.constexpr(dv.DIVERGENCE_IDS["skew_reverse_kl"])
TVD = tl.constexpr(dv.DIVERGENCE_IDS["tvd"])


@triton.jit
def f32(x):
    # scalar arguments arrive as fp64 under torch.compile; keep every loop-carried value fp32
    return tl.cast(x, tl.float32)


@triton.jit
def xmul(w, x):
    # w * x, 0 where w == 0 (0 * inf would be NaN)
    return tl.where(w > 0, w * x, 0.0)


@triton.jit
def logaddexp(a, b):
    mx = tl.maximum(a, b)
    mx_safe = tl.where(tl.abs(mx) == float("inf"), 0.0, mx)  # +inf: inf, not inf - inf
    return mx_safe + tl.log(tl.exp(a - mx_safe) + tl.exp(b - mx_safe))


@triton.jit
def phi_u(lp, lq, param, log_a, log_1ma, DIVERGENCE: tl.constexpr):
    """(phi, u = dphi/dlog q) per entry; mirrors nitrobrew.divergences."""
    if DIVERGENCE == FORWARD_KL:
        p = tl.exp(lp)
        phi = xmul(p, lp - lq)
        u = -p
    elif DIVERGENCE == REVERSE_KL:
        q = tl.exp(lq)
        phi = xmul(q, lq - lp)
        u = xmul(q, lq - lp + 1.0)
    elif DIVERGENCE == JSD:  # beta = param
        p = tl.exp(lp)
        q = tl.exp(lq)
        lm = logaddexp(lp + log_a, lq + log_1ma)
        phi = param * xmul(p, lp - lm) + (1.0 - param) * xmul(q, lq - lm)
        u = (1.0 - param) * xmul(q, lq - lm)
    elif DIVERGENCE == SKEW_KL:  # KL(p || a p + (1-a) q)
        p = tl.exp(lp)
        lr = logaddexp(lp + log_a, lq + log_1ma)
        phi = xmul(p, lp - lr)
        e = lp + log_1ma + lq - lr
        u = -tl.exp(tl.where(e == e, e, float("-inf")))
    elif DIVERGENCE == SKEW_REVERSE_KL:  # KL(q || a q + (1-a) p)
        q = tl.exp(lq)
        lr = logaddexp(lq + log_a, lp + log_1ma)
        e = lq + log_a - lr
        share = tl.exp(tl.where(e == e, e, float("-inf")))
        phi = xmul(q, lq - lr)
        u = xmul(q, lq - lr + 1.0 - share)
    else:  # tvd
        p = tl.exp(lp)
        q = tl.exp(lq)
        phi = 0.5 * tl.abs(p - q)
        u = tl.where(q > p, 0.5 * q, tl.where(q < p, -0.5 * q, 0.0))
    return phi, u


@triton.jit
def online_tile(m, l, x, valid):
    """Online (max, rescaled sum) update with one tile x; returns new m, l and e = exp(x - m_new)."""
    m_new = tl.maximum(m, tl.max(tl.where(valid, x, float("-inf")), axis=0))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    scale = tl.exp(m - m_safe)
    e = tl.where(valid, tl.exp(x - m_safe), 0.0)
    return m_new, l * scale + tl.sum(e, axis=0), e, scale


@triton.jit
def expm1(x):
    """exp(x) - 1 to fp32 accuracy also for small |x| (a Taylor polynomial below 0.25)."""
    poly = x * (1.0 + x * (0.5 + x * (1.0 / 6.0 + x * (1.0 / 24.0 + x * (1.0 / 120.0 + x * (1.0 / 720.0))))))
    return tl.where(tl.abs(x) < 0.25, poly, tl.exp(x) - 1.0)


@triton.jit
def lane_update(m, l, x):
    """Per-lane online (max, rescaled sum) with one exp per element, exp(-|x - m|). Returns the new
    (m, l), the element's weight w = exp(x - m_new) and the factor the lane's old sums are rescaled by.
    An entry x = -inf (past the row's end: loaded as -inf; or masked by the caller) changes nothing
    and gets w = 0, so the loop needs no mask here (selects on every element cost as much as an exp).
    A NaN entry makes the lane's max NaN (and so the row's statistics): NaN never hides."""
    hi = tl.maximum(m, x, propagate_nan=tl.PropagateNan.ALL)
    e = tl.where(hi == float("-inf"), 0.0, tl.exp(tl.minimum(m, x) - hi))  # 0 while both are -inf
    up = x > m
    return hi, tl.where(up, l * e + 1.0, l + e), tl.where(up, 1.0, e), tl.where(up, e, 1.0)


@triton.jit
def lanes_to_row(m, l, acc, rel, m0, l0, a0, r0):
    """Merge the lanes' (max, sum, two accumulators on the sum's scale) into one row state, then with
    the row's carried state (m0, l0, a0, r0)."""
    mx = tl.max(m, axis=0)
    mx_safe = tl.where(mx == float("-inf"), 0.0, mx)
    sc = tl.exp(m - mx_safe)
    l_row = tl.sum(l * sc, axis=0)
    a_row = tl.sum(tl.where(sc > 0, acc * sc, 0.0), axis=0)
    r_row = tl.sum(tl.where(sc > 0, rel * sc, 0.0), axis=0)
    m_new = tl.maximum(m0, mx)
    safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    s_old = tl.exp(m0 - safe)
    s_row = tl.exp(mx - safe)
    return m_new, l0 * s_old + l_row * s_row, a0 * s_old + a_row * s_row, r0 * s_old + r_row * s_row


def math_args(cfg):
    """(1 / T, param, log param, log(1 - param)) of a config (any with .temperature and .param:
    the top-k kernels use it too)."""
    a = cfg.param
    log_a = math.log(a) if a > 0 else float("-inf")
    log_1ma = math.log(1.0 - a) if a < 1 else float("-inf")
    return 1.0 / cfg.temperature, a, log_a, log_1ma


# Launch configuration of the row kernels, also those of topk's fast mode (tuned on an H200: see
# benchmarks/results/hidden/row_kernel_sweep.md).
BLOCK_V = 4096
NUM_WARPS = 4  # gradient pass
STATS_WARPS = 8  # statistics passes
# The KLs' statistics pass keeps two more per-lane sums (a, r): with 4096-column tiles on 8 warps it
# needs more than 128 registers a thread, which halves the programs an SM holds
KL_STATS_BLOCK_V = 2048
KL_STATS_WARPS = 4


INTERPRETER_BLOCK_V = 64  # the tests' rows then span several tiles, the last one ragged


def row_block(n_cols: int, cap: int = 0) -> int:
    """Columns per tile of a row pass over n_cols columns (at most cap, default BLOCK_V)."""
    cap = INTERPRETER_BLOCK_V if ck.interpreter_enabled() else (cap or BLOCK_V)
    return min(cap, next_pow2(max(n_cols, 16)))


# ---------------------------------------------------------------------------------------------------
# Confident rows (docs/design.md §2.6): the tail-keeping online state and the cancellation-free row
# terms of divergences.row_terms / row_grad, in Triton.

LOG2 = tl.constexpr(math.log(2.0))
FAR = tl.constexpr(online.FAR_NATS)  # beyond: the lost sum (core.online.FAR_NATS)
MIX_SWITCH = tl.constexpr(dv.MIX_SWITCH)


@triton.jit
def log1p(x):
    """log(1 + x) to fp32 accuracy also for small |x| (a series below 1/32; the fast log's absolute
    error would be all of a small result's digits)."""
    series = x * (1.0 + x * (-0.5 + x * (1.0 / 3.0 + x * (-0.25 + x * (0.2 + x * (-1.0 / 6.0))))))
    return tl.where(tl.abs(x) < 0.03125, series, tl.log(1.0 + x))


@triton.jit
def mixlog(d, w, log_w, log_1mw):
    """log(w e^d + 1 - w) for a weight w in [0, 1] (divergences.mixlog)."""
    small = tl.abs(d) <= MIX_SWITCH
    near = log1p(w * expm1(tl.where(small, d, 0.0)))
    far = logaddexp(d + log_w, log_1mw + tl.zeros_like(d))
    out = tl.where(small, near, far)
    out = tl.where(w <= 0.0, 0.0, out)
    return tl.where(w >= 1.0, d, out)


@triton.jit
def p_minus_q(p, q, d):
    """p - q from d = log q - log p (divergences.p_minus_q)."""
    up = d > 0
    return tl.where(up, q * expm1(-tl.where(up, d, 0.0)), -p * expm1(tl.where(up, 0.0, d)))


@triton.jit
def row_terms(lp, lq, d, param, log_a, log_1ma, DIVERGENCE: tl.constexpr):
    """(phi, v, v2, v3) per entry (divergences.row_terms; v2, v3: tvd's, else 0)."""
    d = tl.where(d == d, d, 0.0)
    p = tl.exp(lp)
    q = tl.exp(lq)
    v2 = tl.zeros_like(d)
    v3 = tl.zeros_like(d)
    if DIVERGENCE == FORWARD_KL:
        phi = xmul(p, -d)
        v = -p_minus_q(p, q, d)
    elif DIVERGENCE == REVERSE_KL:
        phi = xmul(q, d)
        v = phi
    elif DIVERGENCE == JSD:  # beta = param
        lp_m = -mixlog(d, 1.0 - param, log_1ma, log_a)
        lq_m = -mixlog(-d, param, log_a, log_1ma)
        v = (1.0 - param) * xmul(q, lq_m)
        phi = param * xmul(p, lp_m) + v
    elif DIVERGENCE == SKEW_KL:  # r = a p + (1 - a) q
        lp_r = -mixlog(d, 1.0 - param, log_1ma, log_a)
        lq_r = -mixlog(-d, param, log_a, log_1ma)
        phi = xmul(p, lp_r)
        v = -(1.0 - param) * (1.0 - param) * p_minus_q(p, q, d) * tl.exp(lq_r)
    elif DIVERGENCE == SKEW_REVERSE_KL:  # r = a q + (1 - a) p
        lq_r = -mixlog(-d, 1.0 - param, log_1ma, log_a)
        phi = xmul(q, lq_r)
        v = phi + (1.0 - param) * param * p_minus_q(p, q, d) * tl.exp(lq_r)
    else:  # tvd: the student's mass where q > p, q < p, q = p
        pmq = p_minus_q(p, q, d)
        phi = 0.5 * tl.abs(pmq)
        v = tl.where(pmq < 0, q, 0.0)
        v2 = tl.where(pmq > 0, q, 0.0)
        v3 = tl.where(pmq == 0, q, 0.0)
    return phi, v, v2, v3


@triton.jit
def row_grad(lp, lq, d, top, log_l_s, param, log_a, log_1ma, sum_u, v_rest, DIVERGENCE: tl.constexpr):
    """dD/ds per entry (divergences.row_grad): v - q sum_u; at the student's top entry of a row whose
    max is unique v (1 - q) - q v_rest; tvd from its (sigma, B - A)."""
    q = tl.exp(lq)
    if DIVERGENCE == TVD:
        dd = tl.where(d == d, d, 0.0)
        pmq = p_minus_q(tl.exp(lp), q, dd)
        x = tl.where(sum_u >= 0, sum_u, 2.0 + sum_u)
        y = tl.where(sum_u >= 0, 2.0 - sum_u, -sum_u)
        g = 0.5 * q * tl.where(pmq < 0, x, tl.where(pmq > 0, -y, v_rest))
    elif DIVERGENCE == FORWARD_KL:  # sum_u = 0: v = q - p is the gradient
        _phi, v, _v2, _v3 = row_terms(lp, lq, d, param, log_a, log_1ma, DIVERGENCE)
        g = v
    else:
        _phi, v, _v2, _v3 = row_terms(lp, lq, d, param, log_a, log_1ma, DIVERGENCE)
        g = tl.where(top, v * -expm1(-log_l_s) - q * v_rest, v - q * sum_u)
    return g


@triton.jit
def lane_tail(m, tail, x):
    """lane_update keeping the lane's tail (the mass outside its maximal entry, -1 while empty) instead
    of its sum: the old max joins the tail when x is above it, x joins it otherwise (a tie counts 1).
    Returns the new (m, tail), x's weight w = exp(x - m_new), the factor the lane's old sums are
    rescaled by, and whether x is the lane's new max."""
    hi = tl.maximum(m, x, propagate_nan=tl.PropagateNan.ALL)
    e = tl.where(hi == float("-inf"), 0.0, tl.exp(tl.minimum(m, x) - hi))  # 0 while both are -inf
    up = x > m
    return hi, tl.where(up, (tail + 1.0) * e, tail + e), tl.where(up, 1.0, e), tl.where(up, e, 1.0), up


@triton.jit
def lanes_tail(m, tail):
    """(max, tail) of the union of the lanes: each lane holding the max adds its tail, the others their
    whole mass rescaled, plus (lanes holding the max - 1); no l - 1 is formed. Also returns each
    lane's rescale factor."""
    mx = tl.max(m, axis=0)
    mx_safe = tl.where(mx == float("-inf"), 0.0, mx)
    sc = tl.exp(m - mx_safe)
    top = m == mx
    share = tl.sum(tl.where(top, tail, (1.0 + tail) * sc), axis=0)
    n_top = tl.sum(tl.where(top, 1.0, 0.0), axis=0)
    return mx, share + (n_top - 1.0), sc


@triton.jit
def merge_tail2(m0, t0, m1, t1):
    """(max, tail) of two states, and each one's rescale factor (the rule of lanes_tail)."""
    mx = tl.maximum(m0, m1)
    safe = tl.where(mx == float("-inf"), 0.0, mx)
    s0 = tl.exp(m0 - safe)
    s1 = tl.exp(m1 - safe)
    top0 = m0 == mx
    top1 = m1 == mx
    share = tl.where(top0, t0, (1.0 + t0) * s0) + tl.where(top1, t1, (1.0 + t1) * s1)
    return mx, share + (tl.where(top0, 1.0, 0.0) + tl.where(top1, 1.0, 0.0) - 1.0), s0, s1


@triton.jit
def recentre(acc, rel, ref, ref_new, l, log_scale):
    """The centred sums (a, r on a weight sum l, referred to ref) referred to ref_new and rescaled by
    e^log_scale (core.online.Online.recentre), and whether r could be kept: where the scale is 0 (the
    sums underflow) or r's terms would grow by more than e^FAR_NATS (the other side at ref_new lies that
    far below the other side at ref), r is -l e^log_scale (every entry moved to the lost sum: the caller
    moves the other side's mass there); nothing where l = 0."""
    shift = tl.where(l > 0, ref_new - ref, 0.0)
    scale = tl.exp(log_scale)
    a = (acc - l * shift) * scale
    # e^shift scale in one exp (shift may be +-100 nats where the scale is tiny), and scale expm1(shift) =
    # -expm1(-shift) e^shift scale: no cancellation (-scale where expm1(-shift) is huge)
    grow = shift + log_scale
    es = tl.exp(tl.minimum(grow, FAR))
    r = es * rel + l * tl.where(shift < -FAR, -scale, -expm1(tl.minimum(-shift, FAR)) * es)
    ok = (scale > 0) & (grow <= FAR)
    return a, tl.where(ok, r, -l * scale), ok
