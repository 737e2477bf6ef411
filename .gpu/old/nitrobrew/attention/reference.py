"""Materializing reference for attention KL (float64 by default, plain autograd).

Builds both [B, H, Nq, Nk] score maps, so memory is O(B * H * Nq * Nk): for tests, accuracy
checks and small problems only. Uses the shared elementwise math of ``nitrobrew.divergences``.
"""

from __future__ import annotations

import math

import torch

from .. import divergences as dv
from .common import effective_scales, key_mask, row_weights, visible


def _scores(q: torch.Tensor, k: torch.Tensor, scale: float, dtype) -> torch.Tensor:
    G = q.shape[1] // k.shape[1]
    kk = k.to(dtype).repeat_interleave(G, dim=1)
    return (q.to(dtype) @ kk.transpose(-1, -2)) * scale


def reference_rows(
    q_s,
    k_s,
    q_t,
    k_t,
    *,
    is_causal,
    causal_offset=0,
    scale_s=None,
    scale_t=None,
    temperature=1.0,
    direction="forward",
    target="per_head",
    key_padding_mask=None,
    kv_lengths=None,
    dtype=torch.float64,
) -> torch.Tensor:
    """Per-row KL [B, H_s, Nq] in ``dtype`` (0 at rows that see no key)."""
    B, _, Nq, _ = q_s.shape
    Nk = k_s.shape[2]
    ss, st = effective_scales(q_s, q_t, scale_s, scale_t, temperature)
    b = _scores(q_s, k_s, ss, dtype)
    a = _scores(q_t, k_t, st, dtype)
    kpm = key_mask(key_padding_mask, kv_lengths, B, Nk, q_s.device)
    vis = visible(Nq=Nq, Nk=Nk, is_causal=is_causal, causal_offset=causal_offset, kpm=kpm, device=q_s.device)
    if vis is not None:
        # A huge finite fill (not -inf): exp gives exactly 0, and no inf - inf reaches autograd.
        fill = torch.finfo(dtype).min / 4
        a = a.masked_fill(~vis, fill)
        b = b.masked_fill(~vis, fill)
    lp = torch.log_softmax(a, dim=-1)
    lq = torch.log_softmax(b, dim=-1)
    if target == "head_mean":
        Hs = q_s.shape[1]
        G = q_t.shape[1] // Hs
        lp = torch.logsumexp(lp.unflatten(1, (Hs, G)), dim=2) - math.log(G)
    name = "forward_kl" if direction == "forward" else "reverse_kl"
    phi, _ = dv.elementwise(name, lp, lq)
    if vis is not None:
        phi = torch.where(vis, phi, torch.zeros_like(phi))
    return phi.sum(-1)


def reference_attention_kl(
    q_s,
    k_s,
    q_t,
    k_t,
    *,
    is_causal,
    causal_offset=0,
    scale_s=None,
    scale_t=None,
    temperature=1.0,
    direction="forward",
    reduction="mean",
    target="per_head",
    key_padding_mask=None,
    kv_lengths=None,
    query_mask=None,
    dtype: torch.dtype = torch.float64,
) -> torch.Tensor:
    """Same contract as ``attention_kl`` (lse_t is not needed: the reference computes it)."""
    rows = reference_rows(
        q_s,
        k_s,
        q_t,
        k_t,
        is_causal=is_causal,
        causal_offset=causal_offset,
        scale_s=scale_s,
        scale_t=scale_t,
        temperature=temperature,
        direction=direction,
        target=target,
        key_padding_mask=key_padding_mask,
        kv_lengths=kv_lengths,
        dtype=dtype,
    )
    B, H, Nq = rows.shape
    kpm = key_mask(key_padding_mask, kv_lengths, B, k_s.shape[2], q_s.device)
    w = row_weights(
        Nq=Nq,
        Nk=k_s.shape[2],
        spec_causal=is_causal,
        causal_offset=causal_offset,
        kpm=kpm,
        query_mask=query_mask,
        B=B,
        device=q_s.device,
    ).to(dtype)
    rows = rows * w[:, None, :]
    if reduction == "none":
        return rows
    if reduction == "sum":
        return rows.sum()
    return rows.sum() / (w.sum() * H).clamp_min(1.0)
