"""Materializing float64 reference for top-k KD (tests and small problems only).

Builds the student's [rows, V] logits in float64 and lets autograd differentiate; written
independently of ``rowmath`` (only the per-entry divergence formulas are shared).
"""

from __future__ import annotations

from typing import Optional

import torch

from .. import divergences as dv
from ..core.reduction import IGNORE_INDEX, reduce_rows, row_weights


def _lse(x: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    return torch.logsumexp(torch.where(valid, x, torch.full_like(x, float("-inf"))), dim=-1)


def _log1m_exp(x: torch.Tensor) -> torch.Tensor:
    # plain float64 formula; x >= 0 (all mass inside the support) gives log 0 = -inf
    return torch.log1p(-torch.exp(torch.clamp(x, max=0.0)))


def reference_topk_loss(
    xs: torch.Tensor,
    ws: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_logprobs: torch.Tensor,
    *,
    normalize: str = "full",
    divergence: str = "forward_kl",
    param: float = 0.0,
    labels: Optional[torch.Tensor] = None,
    ignore_index: int = IGNORE_INDEX,
    temperature: float = 1.0,
    reduction: str = "mean",
    bs: Optional[torch.Tensor] = None,
    tail: bool = False,
    kd_weight: float = 1.0,
    ce_weight: float = 0.0,
    scale_t2: bool = False,
    softcap_s: Optional[float] = None,
    dtype: torch.dtype = torch.float64,
    return_parts: bool = False,
):
    """kd_weight * D(teacher top-k || student) [* T^2] + ce_weight * CE(labels), reduced."""
    name, param = dv.canonical(divergence, param)
    lead = xs.shape[:-1]
    K = topk_ids.shape[-1]
    x = xs.reshape(-1, xs.shape[-1]).to(dtype)
    ids = topk_ids.reshape(-1, K).long()
    lp_in = topk_logprobs.reshape(-1, K).to(dtype)
    valid = torch.isfinite(lp_in)
    ids = torch.where(valid, ids, torch.zeros_like(ids))
    z = x @ ws.to(dtype).t()
    if bs is not None:
        z = z + bs.to(dtype)
    if softcap_s is not None:
        z = softcap_s * torch.tanh(z / softcap_s)
    s = z / temperature
    s_k = s.gather(1, ids)
    if normalize == "full":
        lq = s_k - torch.logsumexp(s, dim=-1, keepdim=True)
    else:
        lq = s_k - _lse(s_k, valid)[:, None]
    lp = torch.where(valid, lp_in, torch.zeros_like(lp_in))
    if name != "forward_kl" and not tail:
        lp = lp - _lse(lp_in, valid)[:, None]
    lp = torch.where(valid, lp, torch.zeros_like(lp))
    lq_d = torch.where(valid, lq, torch.zeros_like(lq))
    phi, _ = dv.elementwise(name, lp, lq_d, param)
    kd = torch.where(valid, phi, torch.zeros_like(phi)).sum(-1)
    if tail:
        has_tail = torch.ones_like(kd, dtype=torch.bool)
        if normalize == "full":
            # the student's mass outside the top-k, summed directly over the other ids (exact even
            # where 1 - sum(q_k) rounds to 0)
            hits = torch.zeros_like(s).scatter_add_(1, ids, valid.to(dtype)) > 0
            # ids covering the whole vocabulary leave no tail bucket: it is dropped on both sides
            # (finite stand-ins there keep autograd free of inf * 0)
            has_tail = ~hits.all(-1)
            rest = torch.where(has_tail[:, None], s.masked_fill(hits, float("-inf")), s)
            lq_t = torch.logsumexp(rest, -1) - torch.logsumexp(s, -1)
        else:
            lq_t = _log1m_exp(_lse(lq, valid))
        lp_t = torch.where(has_tail, _log1m_exp(_lse(lp_in, valid)), torch.zeros_like(lq_t))
        phi_t, _ = dv.elementwise(name, lp_t, lq_t, param)
        kd = kd + torch.where(has_tail, phi_t, torch.zeros_like(phi_t))
    if scale_t2:
        kd_weight = kd_weight * temperature**2  # the weight carries T^2; the kd part stays plain
    flat_labels = None if labels is None else labels.reshape(-1)
    mask = row_weights(flat_labels, ignore_index, x.shape[0], xs.device).to(dtype)
    ce = torch.zeros_like(kd)
    if ce_weight != 0.0:
        safe = torch.where(mask > 0, flat_labels, torch.zeros_like(flat_labels)).long()
        ce = torch.logsumexp(z, -1) - z.gather(1, safe[:, None]).squeeze(1)
    kd = torch.where(mask > 0, kd, torch.zeros_like(kd))
    ce = torch.where(mask > 0, ce, torch.zeros_like(ce))
    total = reduce_rows(kd_weight * kd + ce_weight * ce, mask, reduction, lead)
    if return_parts:
        return total, reduce_rows(kd, mask, reduction, lead), reduce_rows(ce, mask, reduction, lead)
    return total
