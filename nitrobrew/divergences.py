"""The math of every divergence, written once.

Each divergence D(p, q) between the teacher p and the student q is a sum over the vocabulary of
an elementwise term phi(log p_j, log q_j). Its gradient w.r.t. the student logits s follows from

    u_j = d phi / d log q_j        (holding the other entries fixed)
    dD/ds_j = u_j - q_j * sum_k u_k

because d log q_j / d s_k = [j == k] - q_k. So a divergence is defined by (phi, u) alone: the
reference, the chunked PyTorch path and the Triton kernels all use this one recipe (the Triton
kernels carry the same formulas, selected by the integer ``DIVERGENCE_IDS``).

Everything is in log space: mixtures use logaddexp of log-weights (never log of a probability-
space sum, which underflows to log 0 and gives NaN), and every p*log-ratio product is guarded so
that an entry with p = 0 (a -inf logit) contributes 0, not 0 * inf = NaN.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Dict, Optional, Tuple

import torch

Tensor = torch.Tensor


@dataclass(frozen=True)
class Param:
    """A divergence's parameter: the keyword users pass, its closed range and its default. Every signature
    that takes it (``jsd(beta=...)``, ``hidden_loss(**params)``, ``distill_loss``) reads them from here."""

    name: str
    default: float
    low: float
    high: float
    help: str  # one line for argument parsers and docstrings


PARAMS: Dict[str, Param] = {
    p.name: p
    for p in (
        Param(name="beta", default=0.5, low=0.0, high=1.0, help="jsd mixture weight (0 = forward_kl, 1 = reverse_kl)"),
        Param(name="alpha", default=0.1, low=0.0, high=1.0, help="skew_kl / skew_reverse_kl mixture weight"),
    )
}


def default(param: str) -> float:
    """The default of a divergence parameter, by its keyword."""
    return PARAMS[param].default


@dataclass(frozen=True)
class Divergence:
    """One entry of the registry: everything else (checks, kernel ids, the HF arguments, the bench and
    the tests' lists) derives from it."""

    name: str
    kernel_id: int  # DIVERGENCE constexpr of the Triton kernels (core.tl_utils)
    param: Optional[str]  # the keyword of its parameter (a key of PARAMS) or None
    one_pass: bool  # value and sum_k u_k from the online recurrence alone (docs/design.md §2.3)
    summary: str  # one line for docstrings

    @property
    def default(self) -> Optional[float]:
        """Its parameter's default (None without a parameter)."""
        return None if self.param is None else PARAMS[self.param].default


REGISTRY: Dict[str, Divergence] = {
    d.name: d
    for d in (
        Divergence(
            name="forward_kl", kernel_id=0, param=None, one_pass=True, summary="KL(teacher || student): mean-seeking."
        ),
        Divergence(
            name="reverse_kl", kernel_id=1, param=None, one_pass=True, summary="KL(student || teacher): mode-seeking."
        ),
        Divergence(
            name="jsd",
            kernel_id=2,
            param="beta",
            one_pass=False,
            summary="Generalized Jensen-Shannon divergence beta KL(p||M) + (1 - beta) KL(q||M), M = beta p + "
            "(1 - beta) q; beta=0 is exactly forward_kl, beta=1 reverse_kl.",
        ),
        Divergence(
            name="skew_kl",
            kernel_id=3,
            param="alpha",
            one_pass=False,
            summary="Skew KL: KL(p || alpha p + (1 - alpha) q).",
        ),
        Divergence(
            name="skew_reverse_kl",
            kernel_id=4,
            param="alpha",
            one_pass=False,
            summary="Skew reverse KL: KL(q || alpha q + (1 - alpha) p).",
        ),
        Divergence(
            name="tvd", kernel_id=5, param=None, one_pass=False, summary="Total variation distance 1/2 sum |p - q|."
        ),
    )
}
NAMES: Tuple[str, ...] = tuple(REGISTRY)
# Names users write -> the Triton kernels' numbers.
DIVERGENCE_IDS: Dict[str, int] = {d.name: d.kernel_id for d in REGISTRY.values()}
# Divergences whose value and sum_k u_k come out of the one-pass online recurrence; the others need
# the final log-sum-exps, hence a second pass over the vocabulary.
ONE_PASS: Tuple[str, ...] = tuple(d.name for d in REGISTRY.values() if d.one_pass)


def _log(x: float) -> float:
    return math.log(x) if x > 0 else float("-inf")


def _xmul(w: Tensor, x: Tensor) -> Tensor:
    """w * x with 0 wherever w == 0 (so 0 * inf = 0)."""
    return torch.where(w > 0, w * x, torch.zeros_like(x))


def _forward_kl(lp: Tensor, lq: Tensor, param: float) -> Tuple[Tensor, Tensor]:
    p = lp.exp()
    return _xmul(p, lp - lq), -p


def _reverse_kl(lp: Tensor, lq: Tensor, param: float) -> Tuple[Tensor, Tensor]:
    q = lq.exp()
    ratio = lq - lp
    return _xmul(q, ratio), _xmul(q, ratio + 1.0)


def _jsd(lp: Tensor, lq: Tensor, beta: float) -> Tuple[Tensor, Tensor]:
    # M = beta p + (1 - beta) q;  D = beta KL(p||M) + (1 - beta) KL(q||M);  u = (1-beta) q (log q - log M)
    p, q = lp.exp(), lq.exp()
    lm = torch.logaddexp(lp + _log(beta), lq + _log(1.0 - beta))
    phi = beta * _xmul(p, lp - lm) + (1.0 - beta) * _xmul(q, lq - lm)
    return phi, (1.0 - beta) * _xmul(q, lq - lm)


def _skew_kl(lp: Tensor, lq: Tensor, alpha: float) -> Tuple[Tensor, Tensor]:
    # D = KL(p || r), r = alpha p + (1 - alpha) q;  u = -p (1 - alpha) q / r
    p = lp.exp()
    la, l1a = _log(alpha), _log(1.0 - alpha)
    lr = torch.logaddexp(lp + la, lq + l1a)
    return _xmul(p, lp - lr), -torch.exp(lp + l1a + lq - lr).nan_to_num(0.0)


def _skew_reverse_kl(lp: Tensor, lq: Tensor, alpha: float) -> Tuple[Tensor, Tensor]:
    # D = KL(q || r), r = alpha q + (1 - alpha) p;  u = q (log q - log r + 1 - alpha q / r)
    q = lq.exp()
    la, l1a = _log(alpha), _log(1.0 - alpha)
    lr = torch.logaddexp(lq + la, lp + l1a)
    share = torch.exp(lq + la - lr).nan_to_num(0.0)  # alpha q / r, in [0, 1]
    return _xmul(q, lq - lr), _xmul(q, lq - lr + 1.0 - share)


def _tvd(lp: Tensor, lq: Tensor, param: float) -> Tuple[Tensor, Tensor]:
    p, q = lp.exp(), lq.exp()
    return 0.5 * (p - q).abs(), 0.5 * q * torch.sign(q - p)


ELEMENTWISE: Dict[str, Callable[[Tensor, Tensor, float], Tuple[Tensor, Tensor]]] = {
    "forward_kl": _forward_kl,
    "reverse_kl": _reverse_kl,
    "jsd": _jsd,
    "skew_kl": _skew_kl,
    "skew_reverse_kl": _skew_reverse_kl,
    "tvd": _tvd,
}


def canonical(name: str, param: float) -> Tuple[str, float]:
    """Resolve the documented endpoints: jsd(beta=0) is forward KL, jsd(beta=1) reverse KL."""
    if name not in ELEMENTWISE:
        raise ValueError(f"unknown divergence {name!r}; choose from {sorted(ELEMENTWISE)}")
    if name == "jsd" and param == 0.0:
        return "forward_kl", 0.0
    if name == "jsd" and param == 1.0:
        return "reverse_kl", 0.0
    return name, float(param)


def elementwise(name: str, lp: Tensor, lq: Tensor, param: float = 0.0) -> Tuple[Tensor, Tensor]:
    """(phi, u) per entry for log-probs lp (teacher) and lq (student) of one vocab slice."""
    return ELEMENTWISE[name](lp, lq, param)


def student_logit_grad(u: Tensor, lq: Tensor, sum_u: Tensor) -> Tensor:
    """dD/ds = u - q * sum_k u_k, with sum_u shaped to broadcast over the vocab axis."""
    return u - lq.exp() * sum_u


def divergence_rows(name: str, t: Tensor, s: Tensor, param: float = 0.0) -> Tensor:
    """Materialized per-row divergence from full teacher logits t and student logits s [..., V]."""
    lp = torch.log_softmax(t, dim=-1)
    lq = torch.log_softmax(s, dim=-1)
    phi, _ = elementwise(name, lp, lq, param)
    return phi.sum(-1)


# ---------------------------------------------------------------------------------------------------
# Row terms that keep their digits on confident rows (docs/design.md §2.6)
#
# When a row's top probability is within ~1e-7 of 1, p_top and q_top both round to 1 in float32 and
# every difference of near-1 quantities (p_top - q_top, u_top - q_top * sum_u) loses the top token's
# term. The forms below never take such a difference: they see d = log q - log p per entry (formed
# from the logits, so it keeps its digits where p and q are close), write every mixture's log-ratio
# as log1p(w expm1(d)) and p - q as q expm1(-d), and write the gradient as
#     dD/ds_j = v_j - q_j sum_k v_k,     v = u - kappa q
# (any constant kappa: the q-proportional part of u drops out) with kappa chosen so that v has a closed
# form without cancellation: small where q is near 1, exactly 0 where q = 0.
# ---------------------------------------------------------------------------------------------------

# Below this |d| a mixture's log-ratio is log1p(w expm1(d)) (no cancellation); above, logaddexp (no
# overflow). Both are accurate at the switch.
MIX_SWITCH = 1.0


def mixlog(d: Tensor, w: float) -> Tensor:
    """log(w e^d + 1 - w) for a constant weight w in [0, 1], accurate for small and large |d|."""
    if w <= 0.0:
        return torch.zeros_like(d)
    if w >= 1.0:
        return d.clone()
    small = d.abs() <= MIX_SWITCH
    near = torch.log1p(w * torch.expm1(torch.where(small, d, torch.zeros_like(d))))
    far = torch.logaddexp(d + math.log(w), torch.full_like(d, math.log1p(-w)))
    return torch.where(small, near, far)


def p_minus_q(p: Tensor, q: Tensor, d: Tensor) -> Tensor:
    """p - q from d = log q - log p without cancelling two numbers near 1."""
    up = d > 0
    return torch.where(up, q * torch.expm1(-torch.where(up, d, 0.0)), -p * torch.expm1(torch.where(up, 0.0, d)))


def row_terms(name: str, lp: Tensor, lq: Tensor, d: Tensor, param: float = 0.0):
    """(phi, v, v2, v3) per entry from log-probs lp (teacher), lq (student) and d = lq - lp.

    v = u - kappa q: forward_kl q - p (kappa = -1), reverse_kl q d (kappa = 1), jsd u, skew_kl
    -(1-a)^2 (p - q) q / r (kappa = -(1-a)), skew_reverse_kl q log(q/r) + (1-a) a (p - q) q / r
    (kappa = 1-a). v2, v3 are None except for tvd, where v, v2, v3 are q on the entries with q > p,
    q < p, q = p: their row sums A, B, E give tvd's gradient without a difference of near-1 sums
    (``tvd_sum_u``)."""
    d = torch.where(torch.isnan(d), torch.zeros_like(d), d)  # both -inf: no term (a NaN logit: lp, lq say so)
    p, q = lp.exp(), lq.exp()
    if name == "forward_kl":
        return _xmul(p, -d), -p_minus_q(p, q, d), None, None
    if name == "reverse_kl":
        v = _xmul(q, d)
        return v, v, None, None
    if name == "jsd":  # M = beta p + (1 - beta) q
        lp_m = -mixlog(d, 1.0 - param)  # log p - log M = -log(beta + (1 - beta) q / p)
        lq_m = -mixlog(-d, param)  # log q - log M = -log(beta p / q + 1 - beta)
        v = (1.0 - param) * _xmul(q, lq_m)
        return param * _xmul(p, lp_m) + v, v, None, None
    if name == "skew_kl":  # r = a p + (1 - a) q
        lp_r = -mixlog(d, 1.0 - param)  # log p - log r
        lq_r = -mixlog(-d, param)  # log q - log r
        return _xmul(p, lp_r), -((1.0 - param) ** 2) * p_minus_q(p, q, d) * lq_r.exp(), None, None
    if name == "skew_reverse_kl":  # r = a q + (1 - a) p
        lq_r = -mixlog(-d, 1.0 - param)
        phi = _xmul(q, lq_r)
        return phi, phi + (1.0 - param) * param * p_minus_q(p, q, d) * lq_r.exp(), None, None
    if name == "tvd":
        pmq = p_minus_q(p, q, d)
        zero = torch.zeros_like(q)
        return (
            0.5 * pmq.abs(),
            torch.where(pmq < 0, q, zero),
            torch.where(pmq > 0, q, zero),
            torch.where(pmq == 0, q, zero),
        )
    if name not in ELEMENTWISE:
        raise ValueError(f"unknown divergence {name!r}; choose from {sorted(ELEMENTWISE)}")
    # a divergence known by its (phi, u) alone (ELEMENTWISE): v = u (kappa = 0)
    phi, u = ELEMENTWISE[name](lp, lq, param)
    return phi, u, None, None


def tvd_sum_u(a: Tensor, b: Tensor, e: Tensor) -> Tuple[Tensor, Tensor]:
    """tvd's per-row gradient scalars from the student's mass A, B, E where q > p, q < p, q = p:
    (sigma, B - A). With S = A - B, the gradient is q (sign(q - p) - S) / 2, and 1 - S = X = 2B + E,
    1 + S = Y = 2A + E: sigma is the smaller of X and Y, negated when it is Y, so that neither is taken
    as 2 minus a number near 2 (the one near 0 is where a confident row's top entry sits); an entry
    with p = q uses -S = B - A itself."""
    x, y = 2.0 * b + e, 2.0 * a + e
    return torch.where(x <= y, x, -y), b - a


def row_grad(
    name: str,
    lp: Tensor,
    lq: Tensor,
    d: Tensor,
    param: float,
    sum_u: Tensor,
    top: Optional[Tensor] = None,
    log_l: Optional[Tensor] = None,
    v_rest: Optional[Tensor] = None,
) -> Tensor:
    """dD/ds per entry = v - q sum_u; sum_u (broadcast over the vocab axis) is the row's sum of v
    (``row_terms``): 0 for forward_kl, the value for reverse_kl, ``tvd_sum_u`` for tvd (v_rest: its
    B - A).

    At the student's top entry (``top``, where the row's max is unique) of a confident row v and q sum_u
    are two near-equal numbers; there the gradient is v (1 - q) - q v_rest, with 1 - q = -expm1(-log l)
    from the student's log l = log1p(tail) and v_rest the row's sum of v without that entry."""
    if name == "tvd":
        d = torch.where(torch.isnan(d), torch.zeros_like(d), d)
        p, q = lp.exp(), lq.exp()
        pmq = p_minus_q(p, q, d)
        x = torch.where(sum_u >= 0, sum_u, 2.0 + sum_u)
        y = torch.where(sum_u >= 0, 2.0 - sum_u, -sum_u)
        assert v_rest is not None, "tvd needs v_rest (B - A)"
        return 0.5 * q * torch.where(pmq < 0, x, torch.where(pmq > 0, -y, v_rest))
    _, v, _, _ = row_terms(name, lp, lq, d, param)
    q = lq.exp()
    g = v - q * sum_u
    # forward_kl: sum_u = 0, v = q - p is the gradient
    if top is None or v_rest is None or log_l is None or name == "forward_kl":
        return g
    return torch.where(top, v * -torch.expm1(-log_l) - q * v_rest, g)
