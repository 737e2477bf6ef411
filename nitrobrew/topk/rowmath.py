"""Per-row top-k KD math on [rows, K] tensors, shared by every backend.

The vocab-wide work (the student's full log-sum-exp, the gradient over the whole vocabulary) is
done by the backends; everything that only involves the K stored entries of a row is here, once:
the support's log-probs on both sides, the optional tail bucket, the divergence value (through
``nitrobrew.divergences.elementwise``) and the gradient coefficients.

Gradient recipe. With L the log-normalizer of the student (``lse_s`` over the vocab for
normalize="full", the log-sum-exp over the K valid entries for normalize="topk") and
``lq_k = s_k - L``, the divergence D is a function of the s_k and of L. With ``u = dphi/dlq``
(from ``elementwise``):

    dD/ds_k |L fixed = u_k                      ("sparse" part, at the K ids)
    dD/dL            = -sum_k u_k               ("dense" part: dL/ds_j = q_j)

For normalize="full", dL/ds_j = q_j for every vocab entry j: the gradient is ``sparse`` at the K
ids plus ``dense * q_j`` over the whole vocabulary. For normalize="topk", dL/ds_k = q~_k (the
renormalized student) and everything folds into the K entries, in the cancellation-free form of
docs/design.md §2.6 (``_support_rows``: split normalizers, d from the logits' gap, the top entry's
gradient from the tail).

Tail bucket (tail=True, normalize="full" only). The student's tail is NOT 1 - sum_k q_k (that
difference cancels to nothing once the top-k holds all but ~eps of the mass): the backends
accumulate ``lse_tail`` = logsumexp of s_j over the ids j outside the row's valid top-k directly
in their vocabulary pass, and ``lq_tail = lse_tail - L`` exactly. The recipe of
``nitrobrew.divergences`` over the K + 1 buckets (u_tail = dphi/dlq_tail, S = sum_k u_k),

    at the ids k:        g_k = u_k - q_k (S + u_tail)
    outside the ids j:   g_j = -q_j (S + u_tail) + u_tail exp(s_j - lse_tail)

(d lq_tail/ds_j = [j outside] exp(s_j - lse_tail) - q_j), is evaluated in a rearranged form that
never subtracts numbers much larger than the result:

    g_k = u_k (1 - q_k) - q_k (S_k + u_tail)         S_k = sum over the other ids of u_j
    g_j = (u_tail Q - S q_tail) exp(s_j - lse_tail)   Q = sum_k q_k = 1 - q_tail

where 1 - q_k = q_tail + (the other ids' q) and S_k come from exclusive prefix/suffix sums, so
they are accurate however close q_k is to 1. (The plain form loses everything at a dominant id:
u_k - q_k S with q_k = 1 - 1e-8 is a difference of O(1) numbers whose result is O(1e-8).) So
the tail's backward has no dense q_j term at all: the K ids take ``sparse`` (the whole gradient
there) and the other entries ``tail * exp(s_j - lse_tail)`` (``DenseCoef``). A row whose valid ids
cover the whole vocabulary has no outside entry (lse_tail = -inf): its tail bucket is empty on
the student side and is dropped on both sides (the teacher's 1 - sum_k p_k is then only the
rounding of stored data). The teacher's tail, 1 - sum_k p_k of the stored log-probs, is computed
with ``log1mexp``.
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
    divergence: str  # canonical name (nitrobrew.divergences)
    param: float  # jsd beta / skew alpha
    normalize: str  # "full" or "topk"
    tail: bool
    temperature: float  # applied to the student logits
    kd_weight: float  # T^2 already folded in when asked for
    ce_weight: float  # hard-label CE at temperature 1 (normalize="full" only)
    chunk_V: Optional[int] = None
    softcap_s: Optional[float] = None  # final-logit softcapping of the student (z -> c tanh(z / c)), None = off

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


def split_lse(x: Tensor, valid: Tensor):
    """logsumexp over the last axis of the valid entries as (max m, log l = log1p(tail), top): tail the mass
    outside one maximal entry (ties count), so that x - m - log l keeps a confident row's top
    log-probability, -log1p(tail), where x - lse would round it to 0 (docs/design.md §2.6); top marks
    that entry. m = -inf (and log l = 0) where no entry is valid."""
    x = torch.where(valid, x, torch.full_like(x, NEG_INF))
    m = x.amax(-1)
    safe = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    e = torch.exp(x - safe[:, None])
    first = torch.arange(x.shape[-1], device=x.device) == (x == m[:, None]).to(torch.uint8).argmax(-1)[:, None]
    top = first & valid
    ll = torch.log1p(torch.where(top, torch.zeros_like(e), e).sum(-1))
    return m, ll, top


def masked_lse(x: Tensor, valid: Tensor) -> Tensor:
    """logsumexp over the last axis of the valid entries (-inf if none)."""
    x = torch.where(valid, x, torch.full_like(x, NEG_INF))
    m = x.amax(-1, keepdim=True)
    safe = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    return (safe + torch.exp(x - safe).sum(-1, keepdim=True).log()).squeeze(-1)


@dataclass
class RowResult:
    kd: Tensor  # [N] divergence per row (compute dtype)
    sparse: Tensor  # [N, K] dD/ds_k (tempered-logit units), 0 at invalid entries
    dense: Optional[Tensor]  # [N] dD/dlse_s (normalize="full", no tail), multiplies q_j over the vocab
    tail: Optional[Tensor] = None  # [N] (tail=True) multiplies exp(s_j - lse_tail) outside the ids
    lse_tail: Optional[Tensor] = None  # [N] logsumexp of s_j over the ids outside the valid top-k


@dataclass
class DenseCoef:
    """Per-row multipliers of a backward's vocab-wide terms, already scaled to raw-logit units:

    g_nj += q[n] * exp(s_nj - lse_s[n])              at every vocab entry j (without the tail)
    g_nj += tail[n] * exp(s_nj - lse_tail[n])        at the entries outside row n's valid top-k ids
    """

    q: Optional[Tensor]
    tail: Optional[Tensor] = None
    lse_tail: Optional[Tensor] = None

    def scaled(self, scale: Tensor) -> "DenseCoef":
        times = lambda t: None if t is None else t * scale  # noqa: E731
        return DenseCoef(times(self.q), times(self.tail), self.lse_tail)


def full_lse(s: Tensor, valid: Tensor, lse_tail: Tensor) -> Tensor:
    """The student's full log-sum-exp from its parts: the K id logits and the outside ids' lse."""
    return torch.logaddexp(lse_tail, masked_lse(s, valid))


def _exclusive_sum(x: Tensor) -> Tensor:
    """sum over the other entries of the last axis, as prefix + suffix sums (no total - self)."""
    zero = torch.zeros_like(x[..., :1])
    before = torch.cat([zero, x.cumsum(-1)[..., :-1]], -1)
    after = torch.cat([x.flip(-1).cumsum(-1).flip(-1)[..., 1:], zero], -1)
    return before + after


def _exclusive_lse(x: Tensor) -> Tensor:
    """logsumexp over the other entries of the last axis (prefix and suffix log-cumsum-exps)."""
    ninf = torch.full_like(x[..., :1], NEG_INF)
    before = torch.cat([ninf, torch.logcumsumexp(x, -1)[..., :-1]], -1)
    after = torch.cat([torch.logcumsumexp(x.flip(-1), -1).flip(-1)[..., 1:], ninf], -1)
    return torch.logaddexp(before, after)


def _tail_rows(
    kd: Tensor, u: Tensor, lq: Tensor, lp_v: Tensor, valid: Tensor, lse_s: Tensor, lse_tail: Tensor, cfg: TopKConfig
) -> RowResult:
    """Add the tail bucket and form the gradient in the rearranged form of the module notes."""
    has_tail = torch.isfinite(lse_tail)
    lq_t = torch.where(has_tail, lse_tail - lse_s, torch.full_like(lse_s, NEG_INF))
    # the teacher's tail: 1 - sum of the stored probabilities (clamped at 0 mass)
    lp_t = log1mexp(masked_lse(lp_v, valid))
    phi_t, u_t = dv.elementwise(cfg.divergence, lp_t, lq_t, cfg.param)
    zero = torch.zeros_like(phi_t)
    phi_t, u_t = torch.where(has_tail, phi_t, zero), torch.where(has_tail, u_t, zero)  # no tail: no bucket
    q, q_t = torch.exp(lq), torch.exp(lq_t)  # q = 0 at invalid entries
    rest = torch.exp(torch.logaddexp(_exclusive_lse(lq), lq_t[:, None]))  # 1 - q_k from the other masses
    sparse = u * rest - q * (_exclusive_sum(u) + u_t[:, None])
    sparse = torch.where(valid, sparse, torch.zeros_like(sparse))
    outside = u_t * torch.exp(masked_lse(lq, valid)) - u.sum(-1) * q_t
    return RowResult(kd + phi_t, sparse, None, outside, lse_tail)


def topk_rows(
    s: Tensor, lp: Tensor, valid: Tensor, lse_s: Optional[Tensor], cfg: TopKConfig, lse_tail: Optional[Tensor] = None
) -> RowResult:
    """Divergence and gradient coefficients per row.

    s: [N, K] tempered student logits at the stored ids; lp: [N, K] stored teacher log-probs
    (finite where valid); valid: [N, K] bool; lse_s: [N] full-vocab log-sum-exp of the tempered
    student (normalize="full") or None; lse_tail: [N] log-sum-exp of the tempered student over the
    ids outside the valid top-k (needed with tail=True; -inf where there are none).
    """
    if cfg.tail and (not cfg.full or lse_tail is None):
        raise ValueError("the tail bucket needs normalize='full' and the outside ids' log-sum-exp")
    ninf = torch.full_like(s, NEG_INF)
    s_v = torch.where(valid, s, ninf)
    lp_v = torch.where(valid, lp.to(s.dtype), ninf)
    if not cfg.full:
        return _support_rows(s_v, lp_v, valid, cfg)
    if cfg.renormalize_teacher:
        lp_v = _renormalized(lp_v, valid)
    lnorm = lse_s
    safe_norm = torch.where(torch.isfinite(lnorm), lnorm, torch.zeros_like(lnorm))
    lq = torch.where(valid, s - safe_norm[:, None], ninf)
    phi, u = dv.elementwise(cfg.divergence, lp_v, lq, cfg.param)
    phi = torch.where(valid, phi, torch.zeros_like(phi))
    u = torch.where(valid, u, torch.zeros_like(u))
    kd = phi.sum(-1)
    if cfg.tail:
        return _tail_rows(kd=kd, u=u, lq=lq, lp_v=lp_v, valid=valid, lse_s=lnorm, lse_tail=lse_tail, cfg=cfg)
    return RowResult(kd, u, -u.sum(-1))


def _split(lx: Tensor, valid: Tensor):
    """(m, log l, top) of split_lse with m = 0 where no entry is valid."""
    m, ll, top = split_lse(lx, valid)
    return torch.where(torch.isfinite(m), m, torch.zeros_like(m)), ll, top


def _renormalized(lx: Tensor, valid: Tensor) -> Tensor:
    """Log-probabilities lx renormalized over the valid entries, the top one's digits kept (split_lse)."""
    m, ll, _top = _split(lx, valid)
    return torch.where(valid, (lx - m[:, None]) - ll[:, None], torch.full_like(lx, NEG_INF))


def _support_rows(s_v: Tensor, lp_raw: Tensor, valid: Tensor, cfg: TopKConfig) -> RowResult:
    """normalize="topk": the student renormalized over the support, through the terms of
    ``divergences.row_terms`` and the gradient v - q sum_v, at the student's top entry of a row whose max
    is unique v (1 - q) - q sum_{j != top} v_j (1 - q from the tail: no difference of two numbers near 1;
    docs/design.md §2.6). d = log q - log p keeps its digits where p and q are close: it is the gap of the
    logits to the stored log-probs, referred to its value c at the teacher's top entry, minus
    G = log E_p[e^(gap - c)] = log1p(sum_k p_k expm1(gap_k - c)) (the centred sum of §2.3-§2.6; the
    normalizers' difference where that sum is not small)."""
    ninf = torch.full_like(s_v, NEG_INF)
    m, ll, top = _split(s_v, valid)
    lq = torch.where(valid, (s_v - m[:, None]) - ll[:, None], ninf)
    m_p, ll_p, top_p = _split(lp_raw, valid)  # the stored mass over the support, log P = m_p + ll_p
    lp_norm = torch.where(valid, (lp_raw - m_p[:, None]) - ll_p[:, None], ninf)
    # forward_kl compares with the stored probabilities as they are; the others renormalize the teacher
    lp_v = lp_norm if cfg.renormalize_teacher else lp_raw
    gap = torch.where(valid, s_v - lp_raw, torch.zeros_like(s_v))
    c = torch.where(top_p, gap, torch.zeros_like(gap)).sum(-1)
    delta = gap - c[:, None]
    r = torch.where(valid, torch.exp(lp_norm) * torch.expm1(delta), torch.zeros_like(gap)).sum(-1)
    plain = ((m - m_p) + (ll - ll_p)) - c  # lse_q - log P - c over the support
    g_c = torch.where(torch.isfinite(r) & (r.abs() < 0.5), torch.log1p(r), plain)
    d = delta - g_c[:, None]
    if not cfg.renormalize_teacher:
        d = d - (m_p + ll_p)[:, None]
    phi, v, v2, v3 = dv.row_terms(cfg.divergence, lp_v, lq, d, cfg.param)
    zero = torch.zeros_like(phi)
    phi, v = torch.where(valid, phi, zero), torch.where(valid, v, zero)
    if cfg.divergence == "tvd":
        sigma, b_minus_a = dv.tvd_sum_u(
            v.sum(-1), torch.where(valid, v2, zero).sum(-1), torch.where(valid, v3, zero).sum(-1)
        )
        g = dv.row_grad("tvd", lp_v, lq, d, cfg.param, sum_u=sigma[:, None], v_rest=b_minus_a[:, None])
    else:
        q = torch.exp(lq)
        v_rest = torch.where(top, zero, v).sum(-1)
        unique = (ll < math.log(2.0))[:, None]
        g_top = v * -torch.expm1(-ll)[:, None] - q * v_rest[:, None]
        g = torch.where(top & unique, g_top, v - q * v.sum(-1)[:, None])
    return RowResult(phi.sum(-1), torch.where(valid, g, zero), None)
