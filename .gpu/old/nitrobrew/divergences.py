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
