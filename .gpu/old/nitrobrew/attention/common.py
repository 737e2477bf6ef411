"""Pieces every attention-KL backend shares: the call's settings, visibility masks, side roles.

Conventions (docs/design.md §3):
- Scores per (batch, head, query row i, key j): teacher ``a_j = scale_t * q_t.k_t[j] / T``,
  student ``b_j = scale_s * q_s.k_s[j] / T``; ``scale`` defaults to 1/sqrt(head_dim of that side).
- Key j is visible to query i iff the key padding mask keeps it and, when causal,
  ``j <= i + causal_offset``. ``causal_offset=0`` is SDPA's ``is_causal`` (top-left aligned when
  Nq != Nk); ``causal_offset = Nk - Nq`` is flash-attn's bottom-right alignment.
- The kernels compute KL(softmax(x) || softmax(y)) for two generic sides x and y. Direction
  "forward" (KL(P_teacher || Q_student)) maps x = teacher, y = student; "reverse" swaps them.
  One set of kernels and formulas therefore serves both directions.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

DIRECTIONS = ("forward", "reverse")
TARGETS = ("per_head", "head_mean")


@dataclass(frozen=True)
class AttnSpec:
    """Settings of one attention-KL call, shared by every backend (scales already divided by T)."""

    is_causal: bool
    causal_offset: int
    scale_s: float  # effective natural-unit scale of the student scores: alpha_s / T
    scale_t: float  # effective scale of the teacher scores: alpha_t / T
    direction: str  # "forward" = KL(P_t || Q_s), "reverse" = KL(Q_s || P_t)
    target: str = "per_head"  # "head_mean": each student head vs the mean of its teacher heads
    chunk: Optional[int] = None  # key chunk of the PyTorch path (None = automatic)

    @property
    def teacher_is_x(self) -> bool:
        return self.direction == "forward"


def default_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)


def effective_scales(q_s, q_t, scale_s, scale_t, temperature):
    s = default_scale(q_s.shape[-1]) if scale_s is None else float(scale_s)
    t = default_scale(q_t.shape[-1]) if scale_t is None else float(scale_t)
    return s / temperature, t / temperature


def key_mask(
    key_padding_mask: Optional[torch.Tensor], kv_lengths: Optional[torch.Tensor], B: int, Nk: int, device
) -> Optional[torch.Tensor]:
    """bool [B, Nk] (True = keep) combining a padding mask and per-batch key lengths, or None."""
    mask = key_padding_mask
    if kv_lengths is not None:
        by_len = torch.arange(Nk, device=device)[None, :] < kv_lengths.to(device)[:, None]
        mask = by_len if mask is None else (mask & by_len)
    return mask


def visible(
    Nq: int,
    Nk: int,
    is_causal: bool,
    causal_offset: int,
    kpm: Optional[torch.Tensor],
    device,
    r0: int = 0,
    c0: int = 0,
    c1: Optional[int] = None,
) -> Optional[torch.Tensor]:
    """bool mask of visible (row, key) pairs for rows [r0, Nq) and keys [c0, c1), shaped to
    broadcast against [B, H, rows, keys] (None when everything is visible)."""
    c1 = Nk if c1 is None else c1
    out = None
    if is_causal:
        rows = torch.arange(r0, Nq, device=device)[:, None]
        cols = torch.arange(c0, c1, device=device)[None, :]
        out = (cols <= rows + causal_offset)[None, None]
    if kpm is not None:
        k = kpm[:, c0:c1][:, None, None, :]
        out = k if out is None else (out & k)
    return out


def rows_with_keys(
    Nq: int, Nk: int, is_causal: bool, causal_offset: int, kpm: Optional[torch.Tensor], B: int, device
) -> torch.Tensor:
    """bool [B, Nq]: rows that see at least one key (the others are 'fully masked': KL 0, not counted)."""
    rows = torch.arange(Nq, device=device)
    if Nk == 0:
        return torch.zeros(B, Nq, dtype=torch.bool, device=device)
    if kpm is None:
        if not is_causal:
            return torch.ones(B, Nq, dtype=torch.bool, device=device)
        return (rows + causal_offset >= 0)[None, :].expand(B, Nq).clone()
    if not is_causal:
        return kpm.any(dim=1, keepdim=True).expand(B, Nq).clone()
    # number of kept keys among 0..min(i + offset, Nk - 1)
    csum = kpm.to(torch.int32).cumsum(dim=1)  # [B, Nk]
    last = (rows + causal_offset).clamp(max=Nk - 1)
    seen = torch.where(last[None, :] >= 0, csum[:, last.clamp(min=0)], torch.zeros_like(csum[:, :1]))
    return seen > 0


def row_weights(
    Nq: int, Nk: int, spec_causal: bool, causal_offset: int, kpm, query_mask, B: int, device
) -> torch.Tensor:
    """float32 [B, Nq]: 1 for rows that count (some visible key, and kept by query_mask)."""
    w = rows_with_keys(Nq=Nq, Nk=Nk, is_causal=spec_causal, causal_offset=causal_offset, kpm=kpm, B=B, device=device)
    if query_mask is not None:
        w = w & query_mask
    return w.to(torch.float32)
