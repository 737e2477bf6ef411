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
    mx_safe = tl.where(mx == float("-inf"), 0.0, mx)
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
