"""Materializing reference for the hidden-state losses.

Builds both [rows, V] logit tensors in float64 (by default) and lets autograd differentiate.
Memory O(rows * V): for tests, benchmarks and small problems only.
"""

from __future__ import annotations

from typing import Optional

import torch

from .. import divergences as dv
from ..core.reduction import IGNORE_INDEX, reduce_rows, row_weights


def reference_loss(
    xs: torch.Tensor,
    xt: torch.Tensor,
    ws: torch.Tensor,
    wt: torch.Tensor,
    *,
    divergence: str = "forward_kl",
    param: float = 0.0,
    labels: Optional[torch.Tensor] = None,
    ignore_index: int = IGNORE_INDEX,
    temperature: float = 1.0,
    reduction: str = "mean",
    vocab_size: Optional[int] = None,
    bs: Optional[torch.Tensor] = None,
    bt: Optional[torch.Tensor] = None,
    kd_weight: float = 1.0,
    ce_weight: float = 0.0,
    scale_t2: bool = False,
    softcap_s: Optional[float] = None,
    softcap_t: Optional[float] = None,
    dtype: torch.dtype = torch.float64,
) -> torch.Tensor:
    """kd_weight * D(p_T || q_T) [* T^2] + ce_weight * CE(labels, q_1), reduced over counted rows."""
    name, param = dv.canonical(divergence, param)
    lead = xs.shape[:-1]
    V = vocab_size if vocab_size is not None else ws.shape[0]
    x_s = xs.reshape(-1, xs.shape[-1]).to(dtype)
    x_t = xt.reshape(-1, xt.shape[-1]).to(dtype)
    z = x_s @ ws[:V].to(dtype).t()
    t = x_t @ wt[:V].to(dtype).t()
    if bs is not None:
        z = z + bs[:V].to(dtype)
    if bt is not None:
        t = t + bt[:V].to(dtype)
    if softcap_s is not None:
        z = softcap_s * torch.tanh(z / softcap_s)
    if softcap_t is not None:
        t = softcap_t * torch.tanh(t / softcap_t)
    kd = dv.divergence_rows(name, t / temperature, z / temperature, param)
    if scale_t2:
        kd = kd * temperature**2
    flat_labels = None if labels is None else labels.reshape(-1)
    mask = row_weights(flat_labels, ignore_index, x_s.shape[0], xs.device).to(dtype)
    rows = kd_weight * kd
    if ce_weight != 0.0:
        if flat_labels is None:
            raise ValueError("ce_weight != 0 needs labels")
        safe = torch.where(mask > 0, flat_labels, torch.zeros_like(flat_labels))
        ce = torch.logsumexp(z, -1) - z.gather(1, safe[:, None]).squeeze(1)
        rows = rows + ce_weight * ce
    rows = torch.where(mask > 0, rows, torch.zeros_like(rows))
    return reduce_rows(rows, mask, reduction, lead)
