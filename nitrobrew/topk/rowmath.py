"""Per-row top-k KD math on [rows, K] tensors, shared by every backend.

The vocab-wide work (the student's log-sum-exp over the vocabulary, the gradient over the whole
vocabulary) is done by the backends; everything that only involves the K stored entries of a row is here,
once: both sides' log-probs, the divergence's terms (``nitrobrew.divergences.row_terms``) and the
gradient coefficients, in the cancellation-free form of docs/design.md §2.6 (``_split_rows``).

normalize="topk": the student renormalized over the K valid ids; everything folds into the K entries.

normalize="full": the backends give, per row, the K id logits and the log-sum-exp O of the student's
logits over the entries OUTSIDE the row's valid ids (-inf where the ids cover the vocabulary), never the
full log-sum-exp as one number. The row is then K + 1 "entries": the K ids and one bucket whose student
logit is O (its teacher mass 1 - sum_k p_k, ``log1mexp`` of the stored log-probs' split log-sum-exp).
The student over these K + 1 entries IS the student normalized over the vocabulary (the bucket holds the
rest), so its log-normalizer is split as (max, log1p(tail)) over them: a confident row keeps log q = -log1p
(tail) at its top entry, an id or the bucket, where s - lse would round it to 0. With the tail bucket
(tail=True) every divergence is taken over the K + 1 entries; without it (forward_kl against the stored
sub-distribution) the bucket's divergence term has p = 0 (its teacher mass still centres d). The
gradient w.r.t. the K + 1 entries is v - q sum_v (v (1 - q) - q sum_{others} v at the student's top
entry); at an outside vocabulary entry j it is the bucket's times exp(s_j - O), since
d log q_tail / d s_j = exp(s_j - O) - q_j there. So the backward has no dense q_j term: the K ids take
``sparse`` (their whole gradient) and the other entries ``tail * exp(s_j - O)`` (``DenseCoef``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Tuple

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
    sparse: Tensor  # [N, K] dD/ds_k (tempered-logit units), 0 at invalid entries: the ids' whole gradient
    tail: Optional[Tensor] = None  # [N] (normalize="full") multiplies exp(s_j - lse_tail) outside the ids
    lse_tail: Optional[Tensor] = None  # [N] logsumexp of s_j over the ids outside the valid top-k


@dataclass
class DenseCoef:
    """Per-row multipliers of a backward's vocab-wide term, already scaled to raw-logit units:

    g_nj += tail[n] * exp(s_nj - lse_tail[n])        at the entries outside row n's valid top-k ids
    """

    tail: Tensor
    lse_tail: Tensor

    def scaled(self, scale: Tensor) -> "DenseCoef":
        return DenseCoef(self.tail * scale, self.lse_tail)


def full_lse(s: Tensor, valid: Tensor, lse_tail: Tensor) -> Tensor:
    """The student's full log-sum-exp from its parts: the K id logits and the outside ids' lse."""
    return torch.logaddexp(lse_tail, masked_lse(s, valid))


def topk_rows(
    s: Tensor, lp: Tensor, valid: Tensor, cfg: TopKConfig, out: Optional[Tuple[Tensor, Tensor]] = None
) -> RowResult:
    """Divergence and gradient coefficients per row.

    s: [N, K] tempered student logits at the stored ids; lp: [N, K] stored teacher log-probs
    (finite where valid); valid: [N, K] bool; out (normalize="full"): the log-sum-exp of the tempered
    student over the vocabulary entries outside the row's valid ids, split as ([N] max, [N] log of the
    rescaled sum) (max -inf where there are none).
    """
    ninf = torch.full_like(s, NEG_INF)
    s_v = torch.where(valid, s, ninf)
    lp_v = torch.where(valid, lp.to(s.dtype), ninf)
    if not cfg.full:
        kd, g = _split_rows(s_v, lp_v, valid, cfg, renormalize=cfg.renormalize_teacher)
        return RowResult(kd, g)
    if out is None:
        raise ValueError("normalize='full' needs the log-sum-exp of the entries outside the ids")
    # the K + 1 entries: the ids and the bucket of the other entries (module notes)
    m_out, ll_out = out
    has_out = m_out != NEG_INF  # (a NaN state stays in, to show)
    lse_out = torch.where(has_out, m_out + ll_out, torch.full_like(m_out, NEG_INF))
    m_p, ll_p, _top = split_lse(lp_v, valid)
    lp_out = torch.where(has_out, log1mexp(m_p + ll_p), torch.full_like(m_p, NEG_INF))  # 1 - sum of the stored p
    # the bucket's gap of logit to log-prob, two ~10-nat numbers whose float32 roundings (~1e-6) would be
    # first-order errors of a close row's value: formed in float64 from the unrounded parts
    wide = torch.float64
    gap_out = (m_out.to(wide) + ll_out.to(wide)) - log1mexp(m_p.to(wide) + ll_p.to(wide))
    gap_out = torch.where(has_out & torch.isfinite(lp_out), gap_out.to(s.dtype), torch.zeros_like(m_out))
    s_b = torch.cat([s_v, lse_out[:, None]], 1)
    lp_b = torch.cat([lp_v, lp_out[:, None]], 1)
    valid_b = torch.cat([valid, has_out[:, None]], 1)
    gap_b = torch.cat([s_v - lp_v, gap_out[:, None]], 1)
    no_p = None
    if not cfg.tail:  # forward_kl against the stored p: the bucket has no term of its own
        no_p = torch.zeros_like(valid_b)
        no_p[:, -1] = True
    # with the bucket the teacher's K + 1 masses sum to 1 by construction (its total is not summed)
    kd, g = _split_rows(s_b, lp_b, valid_b, cfg, renormalize=False, no_p=no_p, gap=gap_b, normalized=has_out)
    K = s.shape[1]
    return RowResult(kd, g[:, :K], torch.where(has_out, g[:, K], torch.zeros_like(kd)), lse_out)


def _split(lx: Tensor, valid: Tensor):
    """(m, log l, top) of split_lse with m = 0 where no entry is valid."""
    m, ll, top = split_lse(lx, valid)
    return torch.where(torch.isfinite(m), m, torch.zeros_like(m)), ll, top


def _split_rows(
    s_v: Tensor,
    lp_raw: Tensor,
    valid: Tensor,
    cfg: TopKConfig,
    renormalize: bool,
    no_p: Optional[Tensor] = None,
    gap: Optional[Tensor] = None,
    normalized: Optional[Tensor] = None,
):
    """(value, gradient) per row of the student softmax(s) over the valid entries against the teacher's
    log-probs lp_raw, through the terms of ``divergences.row_terms`` and the gradient v - q sum_v, at the
    student's top entry of a row whose max is unique v (1 - q) - q sum_{j != top} v_j (1 - q from the tail:
    no difference of two numbers near 1; docs/design.md §2.6).

    The student's log-normalizer is split as (max, log1p(tail)) over its support (``valid``); the teacher's
    support is where lp_raw is finite too (renormalize: the teacher renormalized over it, else taken as
    stored). d = log q - log p keeps its digits where p and q are close: it is the gap of the logits to
    the stored log-probs, referred to its value c at the teacher's top entry, minus G = log E_p[e^(gap - c)]
    = log1p(sum_k p_k expm1(gap_k - c)) (the centred sum of §2.3-§2.6) where both supports are the same, or
    the normalizers' difference where that sum is not small or the student has mass outside the teacher's
    support (d = +inf there). no_p: entries whose divergence term sees p = 0 (their stored mass still
    centres d); gap: s_v - lp_raw where given more precisely; normalized: [N] rows whose teacher masses sum
    to 1 by construction (their total is taken as 1, not summed: a rounded entry then weighs only in
    sum_k p_k expm1(gap_k - c))."""
    ninf = torch.full_like(s_v, NEG_INF)
    zero = torch.zeros_like(s_v)
    nan = (torch.isnan(s_v) & valid).any(-1)  # a NaN logit: NaN never hides (row_terms reads a NaN d as 0)
    m, ll, top = _split(s_v, valid)
    lq = torch.where(valid, (s_v - m[:, None]) - ll[:, None], ninf)
    on_p = valid & torch.isfinite(lp_raw)
    m_p, ll_p, top_p = _split(lp_raw, on_p)  # the stored mass over the support, log P = m_p + ll_p
    lp_norm = torch.where(on_p, (lp_raw - m_p[:, None]) - ll_p[:, None], ninf)
    log_p = m_p + ll_p
    if normalized is not None:
        lp_norm = torch.where(normalized[:, None], torch.where(on_p, lp_raw, ninf), lp_norm)
        log_p = torch.where(normalized, torch.zeros_like(log_p), log_p)
    lp_v = lp_norm if renormalize else torch.where(on_p, lp_raw, ninf)
    gap = torch.where(on_p, s_v - lp_raw if gap is None else gap, zero)
    c = torch.where(top_p, gap, zero).sum(-1)
    delta = gap - c[:, None]
    r = torch.where(on_p, torch.exp(lp_norm) * torch.expm1(delta), zero).sum(-1)
    plain = ((m - m_p) + (ll - ll_p)) - c  # lse_q - log P - c
    if normalized is not None:
        plain = torch.where(normalized, (m - c) + ll, plain)
    same = (on_p == valid).all(-1)
    g_c = torch.where(same & torch.isfinite(r) & (r.abs() < 0.5), torch.log1p(r), plain)
    d = delta - g_c[:, None]
    if not renormalize:
        d = d - log_p[:, None]
    d = torch.where(on_p, d, torch.where(valid, torch.full_like(d, float("inf")), zero))
    if no_p is not None:
        lp_v = torch.where(no_p, ninf, lp_v)
        d = torch.where(no_p & valid, torch.full_like(d, float("inf")), d)
    phi, v, v2, v3 = dv.row_terms(cfg.divergence, lp_v, lq, d, cfg.param)
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
    kd = torch.where(nan, torch.full_like(nan, float("nan"), dtype=phi.dtype), phi.sum(-1))
    return kd, torch.where(valid, torch.where(nan[:, None], torch.full_like(g, float("nan")), g), zero)
