"""Per-row top-k KD math on [rows, K] tensors, shared by every backend.

The vocab-wide work (the student's full log-sum-exp, the gradient over the whole vocabulary) is
done by the backends; everything that only involves the K stored entries of a row is here, once:
the support's log-probs on both sides, the optional tail bucket, the divergence value (through
``nitrobrew.divergences.elementwise``) and the gradient coefficients.

Gradient recipe. With L the log-normalizer of the student (``lse_s`` over the vocab for
normalize="full", the log-sum-exp over the K valid entries for normalize="topk") and
``lq_k = s_k - L``, the divergence D is a function of the s_k and of L. With ``u = dphi/dlq``
(from ``elementwise``):

    dD/ds_k |L fixed = u_k - u_tail * exp(lq_k - lq_tail)           ("sparse" part)
    dD/dL           = -sum_k u_k + u_tail * exp(log Q - lq_tail)      (Q = sum_k q_k)

(the tail terms exist only with tail=True: lq_tail = log(1 - Q), so d lq_tail / d lq_k =
-q_k / (1 - Q)). For normalize="full", dL/ds_j = q_j for every vocab entry j: the gradient is
``sparse`` at the K ids plus ``dense * q_j`` over the whole vocabulary. For normalize="topk",
dL/ds_k = q~_k (the renormalized student) and everything folds into the K entries.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

from .. import divergences as dv

Tensor = torch.Tensor
NEG_INF = float("-inf")


@dataclass(frozen=True)
class TopKConfig:
    divergence: str          # canonical name (nitrobrew.divergences)
    param: float             # jsd beta / skew alpha
    normalize: str           # "full" or "topk"
    tail: bool
    temperature: float       # applied to the student logits
    kd_weight: float         # T^2 already folded in when asked for
    ce_weight: float         # hard-label CE at temperature 1 (normalize="full" only)
    chunk_V: Optional[int] = None

    @property
    def with_ce(self) -> bool:
        return self.ce_weight != 0.0

    @property
    def full(self) -> bool:
        return self.normalize == "full"

    @property
    def renormalize_teacher(self) -> bool:
        """forward_kl uses the stored teacher log-probs as they are; the other divergences compare
        distributions, so without a tail bucket both sides are renormalized over the support."""
        return self.divergence != "forward_kl" and not self.tail


def log1mexp(x: Tensor) -> Tensor:
    """log(1 - exp(x)) for x <= 0, accurate at both ends (Maechler 2012); -inf at x >= 0."""
    x = torch.clamp(x, max=0.0)
    near = x > -math.log(2.0)
    a = torch.log(-torch.expm1(torch.where(near, x, torch.full_like(x, -1.0))))
    b = torch.log1p(-torch.exp(torch.where(near, torch.full_like(x, -1.0), x)))
    return torch.where(near, a, b)


def masked_lse(x: Tensor, valid: Tensor) -> Tensor:
    """logsumexp over the last axis of the valid entries (-inf if none)."""
    x = torch.where(valid, x, torch.full_like(x, NEG_INF))
    m = x.amax(-1, keepdim=True)
    safe = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    return (safe + torch.exp(x - safe).sum(-1, keepdim=True).log()).squeeze(-1)


@dataclass
class RowResult:
    kd: Tensor                # [N] divergence per row (compute dtype)
    sparse: Tensor            # [N, K] dD/ds_k (tempered-logit units), 0 at invalid entries
    dense: Optional[Tensor]   # [N] dD/dlse_s (normalize="full"), multiplies q_j over the vocab


def _xmul(w: Tensor, x: Tensor) -> Tensor:
    return torch.where(w != 0, w * x, torch.zeros_like(x))


def topk_rows(s: Tensor, lp: Tensor, valid: Tensor, lse_s: Optional[Tensor], cfg: TopKConfig) -> RowResult:
    """Divergence and gradient coefficients per row.

    s: [N, K] tempered student logits at the stored ids; lp: [N, K] stored teacher log-probs
    (finite where valid); valid: [N, K] bool; lse_s: [N] full-vocab log-sum-exp of the tempered
    student (normalize="full") or None.
    """
    ninf = torch.full_like(s, NEG_INF)
    s_v = torch.where(valid, s, ninf)
    lp_v = torch.where(valid, lp.to(s.dtype), ninf)
    if cfg.full:
        lnorm = lse_s
    else:
        lnorm = masked_lse(s_v, valid)
    safe_norm = torch.where(torch.isfinite(lnorm), lnorm, torch.zeros_like(lnorm))
    lq = torch.where(valid, s - safe_norm[:, None], ninf)
    if cfg.renormalize_teacher:
        lP = masked_lse(lp_v, valid)
        lp_v = torch.where(valid, lp_v - torch.where(torch.isfinite(lP), lP, torch.zeros_like(lP))[:, None], ninf)
    phi, u = dv.elementwise(cfg.divergence, lp_v, lq, cfg.param)
    phi = torch.where(valid, phi, torch.zeros_like(phi))
    u = torch.where(valid, u, torch.zeros_like(u))
    kd = phi.sum(-1)
    sum_u = u.sum(-1)
    sparse = u
    dL = -sum_u
    if cfg.tail:
        lQ = masked_lse(lq, valid)
        # 1 - Q is resolved to about eps (lse_s and the s_k carry that absolute error): below it
        # the student's tail is held at eps and takes no gradient, instead of log 0 = -inf.
        floor = -torch.finfo(lQ.dtype).eps
        held = lQ > floor
        lq_t = log1mexp(torch.clamp(lQ, max=floor))
        # the teacher's tail: 1 - sum of the stored probabilities (clamped at 0 mass)
        lp_t = log1mexp(masked_lse(lp_v, valid))
        phi_t, u_t = dv.elementwise(cfg.divergence, lp_t, lq_t, cfg.param)
        kd = kd + phi_t
        u_t = torch.where(held, torch.zeros_like(u_t), u_t)
        # u_t * q_k / (1 - Q), written in log space; 0 where u_t is 0 (no tail on either side)
        ratio_k = torch.exp(torch.clamp(lq - lq_t[:, None], max=80.0))
        sparse = sparse - torch.where(valid, _xmul(u_t[:, None], ratio_k), torch.zeros_like(ratio_k))
        dL = dL + _xmul(u_t, torch.exp(torch.clamp(lQ - lq_t, max=80.0)))
    if cfg.full:
        return RowResult(kd, sparse, dL)
    qt = torch.exp(lq)  # renormalized student over the support, 0 at invalid entries
    return RowResult(kd, sparse + qt * dL[:, None], None)
