"""Triton building blocks shared by every kernel family (jit helpers and launch settings).

``row_terms`` and ``row_grad`` are the divergence math of nitrobrew.divergences (its ``row_terms`` /
``row_grad``, docs/design.md §2.6) in Triton, selected by the constexpr DIVERGENCE (ids from
``divergences.DIVERGENCE_IDS``, spelled by the named constexprs below); the online helpers are the
streaming log-sum-exp of docs/design.md §2.3 with the tail of §2.6.
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
def online_tile(m, l, x, valid):
    """Online (max, rescaled sum) update with one tile x; returns new m, l and e = exp(x - m_new)."""
    m_new = tl.maximum(m, tl.max(tl.where(valid, x, float("-inf")), axis=0))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    scale = tl.exp(m - m_safe)
    e = tl.where(valid, tl.exp(x - m_safe), 0.0)
    return m_new, l * scale + tl.sum(e, axis=0), e, scale


LOG2E = tl.constexpr(1.4426950408889634)
# a lane's running max before its first entry: finite, so that e^(min - max) is 0 (not NaN) for the -inf
# entries past a row's end; lanes_tail reads it as -inf
NEG_BIG = tl.constexpr(-3.4028234663852886e38)


@triton.jit
def fexp(x):
    """e^x as one MUFU.EX2 (tl.exp adds a rescale for results below 2^-126: here they flush to 0, as any
    weight that underflows)."""
    return tl.exp2(x * LOG2E)


@triton.jit
def expm1(x):
    """exp(x) - 1 to fp32 accuracy also for small |x| (a Taylor polynomial below 0.25)."""
    poly = x * (1.0 + x * (0.5 + x * (1.0 / 6.0 + x * (1.0 / 24.0 + x * (1.0 / 120.0 + x * (1.0 / 720.0))))))
    return tl.where(tl.abs(x) < 0.25, poly, fexp(x) - 1.0)


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
# entries per lane and tile in the first pass (group_tail): the lane's rescale is shared by them
STATS_GROUP = 4
# The mixture divergences' (jsd, skews) row terms in the second pass and the gradient: at 4096 columns
# (32 a thread on 4 warps) ~190 registers a thread; at 2048, ~50-100 (compiled for sm_90)
MIX_BLOCK_V = 2048


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
def log_normal(y):
    """log y for a normal, finite y > 0: libdevice's logf (same reduction to [2/3, 4/3), same polynomial,
    under 1 ulp) without its cases for 0, infinity and subnormals."""
    i = y.to(tl.int32, bitcast=True)
    e = (i - 0x3F2AAAAB) & -8388608  # 0xFF800000: the exponent that puts the mantissa in [2/3, 4/3)
    m = (i - e).to(tl.float32, bitcast=True) - 1.0
    p = m * -0.13018770515918732 + 0.14084610342979431
    p = m * p - 0.12148627638816833
    p = m * p + 0.13980610668659210
    p = m * p - 0.16684235632419586
    p = m * p + 0.20012299716472626
    p = m * p - 0.24999669194221497
    p = m * p + 0.33333182334899902
    p = m * p - 0.5
    return (e.to(tl.float32) * 1.1920928955078125e-07) * 0.6931471805599453 + (m + m * (m * p))


@triton.jit
def log1p(x):
    """log(1 + x) to fp32 accuracy also for small |x| (a series below 1/32; the log of 1 + x would lose
    a small result's digits), for 1 + x normal (see log_normal)."""
    series = x * (1.0 + x * (-0.5 + x * (1.0 / 3.0 + x * (-0.25 + x * (0.2 + x * (-1.0 / 6.0))))))
    return tl.where(tl.abs(x) < 0.03125, series, log_normal(1.0 + x))


@triton.jit
def finite(x):
    # torch.isfinite: False for +-inf and NaN
    return tl.abs(x) < float("inf")


@triton.jit
def log1p_full(x):
    """torch.log1p for any x: log1p above, -inf at x = -1, NaN below it and for NaN, inf at inf (a row
    state's tail is -1 while the row has no entry)."""
    y = 1.0 + x
    normal = (y >= 1.1754943508222875e-38) & (y < float("inf"))
    r = log1p(tl.where(normal, x, 0.0))
    r = tl.where(y == 0.0, float("-inf"), tl.where(y == float("inf"), float("inf"), r))
    return tl.where((y < 0.0) | (x != x), float("nan"), r)


@triton.jit
def mix_logs(d, w1, EDGE: tl.constexpr):
    """(M1, M2) = (log(w1 e^d + 1 - w1), log(w1 + (1 - w1) e^-d)) for d = log q - log p (not NaN) and a
    weight w1 in [0, 1]: divergences.mixlog(d, w1) and mixlog(-d, 1 - w1), with M1 - M2 = d. One expm1
    and one log1p for both: M1 from x = d or M2 from x = -d, the other by +-d. Beyond |d| = MIX_SWITCH
    the one with x = -|d| (log1p of a number in [-w, 0]: no overflow, no cancellation); below it the one
    whose weight is at most 1/2 (the other then cancels at most a factor 3). EDGE: w1 may be 0 or 1 (then
    log e^x, which 1 + (e^x - 1) would lose). Also returns expm1(x) and x."""
    first = tl.where(tl.abs(d) <= MIX_SWITCH, w1 <= 0.5, d <= 0)
    x = tl.where(first, d, -d)
    w = tl.where(first, w1, 1.0 - w1)
    em = expm1(x)
    r = log1p(w * em)
    if EDGE:
        r = tl.where(w >= 1.0, x, r)
    return tl.where(first, r, r + d), tl.where(first, r - d, r), em, x


@triton.jit
def p_minus_q(p, q, d, em_neg):
    """p - q from d = log q - log p and em_neg = expm1(-|d|) (divergences.p_minus_q)."""
    return tl.where(d > 0, q * em_neg, -p * em_neg)


@triton.jit
def row_terms(lp, lq, d, param, DIVERGENCE: tl.constexpr):
    """(phi, v, v2, v3) per entry (divergences.row_terms; v2, v3: tvd's, else 0). tvd's masks read the
    sign of d (q > p where d > 0), as its gradient does."""
    d = tl.where(d == d, d, 0.0)
    p = fexp(lp)
    q = fexp(lq)
    v2 = tl.zeros_like(d)
    v3 = tl.zeros_like(d)
    if DIVERGENCE == FORWARD_KL:
        phi = xmul(p, -d)
        v = -p_minus_q(p, q, d, expm1(-tl.abs(d)))
    elif DIVERGENCE == REVERSE_KL:
        phi = xmul(q, d)
        v = phi
    elif DIVERGENCE == JSD:  # beta = param in (0, 1) (divergences.canonical); log p/M = -M1, log q/M = -M2
        m1, m2, _em, _x = mix_logs(d, 1.0 - param, False)
        v = (1.0 - param) * xmul(q, -m2)
        phi = param * xmul(p, -m1) + v
    elif DIVERGENCE == SKEW_KL:  # r = a p + (1 - a) q: log p - log r = -M1, log q - log r = -M2
        m1, m2, em, x = mix_logs(d, 1.0 - param, True)
        em_neg = tl.where(x <= 0, em, -em / (1.0 + em))  # expm1(-|d|)
        phi = xmul(p, -m1)
        v = -(1.0 - param) * (1.0 - param) * p_minus_q(p, q, d, em_neg) * fexp(-m2)
    elif DIVERGENCE == SKEW_REVERSE_KL:  # r = a q + (1 - a) p: log q - log r = -M2
        _m1, m2, em, x = mix_logs(d, param, True)
        em_neg = tl.where(x <= 0, em, -em / (1.0 + em))
        phi = xmul(q, -m2)
        v = phi + (1.0 - param) * param * p_minus_q(p, q, d, em_neg) * fexp(-m2)
    else:  # tvd: the student's mass where q > p, q < p, q = p
        phi = 0.5 * tl.abs(p_minus_q(p, q, d, expm1(-tl.abs(d))))
        v = tl.where(d > 0, q, 0.0)
        v2 = tl.where(d < 0, q, 0.0)
        v3 = tl.where(d == 0, q, 0.0)
    return phi, v, v2, v3


@triton.jit
def row_grad(lp, lq, d, top, one_m_qtop, param, sum_u, v_rest, DIVERGENCE: tl.constexpr):
    """dD/ds per entry (divergences.row_grad): v - q sum_u; at the student's top entry of a row whose
    max is unique (top) v (1 - q) - q v_rest, 1 - q = one_m_qtop (the row's -expm1(-log l_s)); tvd
    from its (sigma, B - A)."""
    if DIVERGENCE == TVD:  # by the sign of d, as the second pass's masks
        x = tl.where(sum_u >= 0, sum_u, 2.0 + sum_u)
        y = tl.where(sum_u >= 0, 2.0 - sum_u, -sum_u)
        g = 0.5 * fexp(lq) * tl.where(d > 0, x, tl.where(d < 0, -y, v_rest))
    elif DIVERGENCE == FORWARD_KL:  # sum_u = 0: v = q - p is the gradient
        # q - p = -q expm1(-d) where d > 0, p expm1(d) elsewhere: one exp, of the larger side (log p = lq - d)
        dd = tl.where(d == d, d, 0.0)
        big = fexp(lq - tl.minimum(dd, 0.0))
        g = tl.where(dd > 0, -big, big) * expm1(-tl.abs(dd))
    else:
        q = fexp(lq)
        _phi, v, _v2, _v3 = row_terms(lp, lq, d, param, DIVERGENCE)
        g = tl.where(top, v * one_m_qtop - q * v_rest, v - q * sum_u)
    return g


@triton.jit
def max_nan(a, b):
    # a max that propagates NaN (a reduction's combine: tl.max would drop a NaN entry)
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def group_tail(m, tail, x):
    """A lane's online (max, tail) with a group of entries x [GROUP, lanes] at once: the mass outside
    its maximal entry (-1 while empty); when the group holds a new max the old max joins the tail, entries
    equal to the new max count 1 each but one (no l - 1 is formed). m starts at NEG_BIG, so x = -inf
    entries (past a row's end, or masked) change nothing and get w = 0. Returns the new (m, tail), each
    entry's weight w = exp(x - m_new), the factor the lane's old sums are rescaled by, whether the max
    moved, and the entries at the new max. A NaN entry makes the lane's max NaN: NaN never hides.
    (One rescale per group instead of one per entry: the per-lane work is shared by GROUP entries; the
    group is the tile's first axis, which a thread holds whole: the reductions stay in registers.)"""
    mx = tl.reduce(x, 0, max_nan)
    hi = tl.maximum(m, mx, propagate_nan=tl.PropagateNan.ALL)
    up = mx > m
    sc = fexp(m - hi)
    w = fexp(x - hi[None, :])
    top = x == hi[None, :]
    others = tl.sum(tl.where(top, 0.0, w), axis=0)
    n_top = tl.sum(tl.where(top, 1.0, 0.0), axis=0)
    return hi, tl.where(up, (tail + 1.0) * sc + (n_top - 1.0), tail + n_top) + others, w, sc, up, top


@triton.jit
def lanes_tail(m, tail):
    """(max, tail) of the union of the lanes: each lane holding the max adds its tail, the others their
    whole mass rescaled, plus (lanes holding the max - 1); no l - 1 is formed. Also returns each
    lane's rescale factor."""
    m = tl.where(m == NEG_BIG, float("-inf"), m)  # a lane that saw no entry
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
