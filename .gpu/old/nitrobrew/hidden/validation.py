"""Checks of the hidden-state losses' inputs and the row preparation, shared by the single-process
API and the vocab-parallel path (so that neither imports the other's entry point)."""

from __future__ import annotations

import math

import torch

from ..core import checks as ck
from ..core.reduction import row_weights


def check_hidden_tensors(xs, xt, ws, wt, bs, bt, labels, heads: str = "[V, D] heads") -> None:
    """Types, devices, dtypes and shapes of the tensors of a hidden-state loss (also used by the
    vocab-parallel path, whose heads are "[V_local, D] head shards")."""
    for name, t in (("xs", xs), ("xt", xt), ("ws", ws), ("wt", wt), ("bs", bs), ("bt", bt)):
        if t is None and name in ("bs", "bt"):
            continue
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        ck.check_float(name, t)
    ck.check_same_device(xs=xs, xt=xt, ws=ws, wt=wt, bs=bs, bt=bt, labels=labels)
    ck.check_same_dtype(xs=xs, ws=ws, bs=bs)
    ck.check_same_dtype(xt=xt, wt=wt, bt=bt)
    if xs.dim() < 1 or xt.dim() < 1 or xs.shape[:-1] != xt.shape[:-1]:
        raise ValueError(
            f"xs {tuple(xs.shape)} and xt {tuple(xt.shape)} must share their leading shape "
            "(one teacher row per student row)"
        )
    if ws.dim() != 2 or wt.dim() != 2:
        raise ValueError(f"ws and wt must be 2-D {heads}, got {tuple(ws.shape)} and {tuple(wt.shape)}")
    for name, x in (("xs", xs), ("xt", xt)):
        if x.shape[-1] == 0:
            raise ValueError(f"{name} has hidden size 0 (shape {tuple(x.shape)}): the heads need at least one feature")
    if ws.shape[1] != xs.shape[-1]:
        raise ValueError(f"student hidden size {xs.shape[-1]} does not match ws {tuple(ws.shape)}")
    if wt.shape[1] != xt.shape[-1]:
        raise ValueError(f"teacher hidden size {xt.shape[-1]} does not match wt {tuple(wt.shape)}")
    for name, b, w in (("bs", bs, ws), ("bt", bt, wt)):
        if b is not None and tuple(b.shape) != (w.shape[0],):
            raise ValueError(f"{name} must have shape ({w.shape[0]},), got {tuple(b.shape)}")
    ck.check_labels(labels, xs.shape[:-1])


def check_loss_options(
    temperature, reduction, chunk_V, backend, kd_weight, ce_weight, labels, softcap_s=None, softcap_t=None
) -> None:
    """The scalar options every hidden-state loss shares."""
    ck.check_temperature(temperature)
    ck.check_softcap("softcap_s", softcap_s)
    ck.check_softcap("softcap_t", softcap_t)
    ck.check_reduction(reduction)
    ck.check_chunk("chunk_V", chunk_V)
    ck.check_backend(backend)
    for name, wgt in (("kd_weight", kd_weight), ("ce_weight", ce_weight)):
        if not (ck.is_number(wgt) and math.isfinite(wgt)):
            raise ValueError(f"{name} must be a finite number, got {wgt!r}")
    if ce_weight != 0 and labels is None:
        raise ValueError("ce_weight != 0 needs labels (the hard targets of each row)")


def prepare_rows(xs, xt, ws, wt, bs, bt, labels, ignore_index, ce_weight, used: int, label_offset: int = 0):
    """Rows flattened to [N, D], the row mask, the CE targets as ids into the heads' rows (-1 where a
    row has none here), and the heads cut to their first `used` rows. Student rows that do not
    count are zeroed: dW sums over rows, and a NaN there must not reach it (0 * NaN is NaN)."""
    x_s = xs.reshape(-1, xs.shape[-1])
    x_t = xt.reshape(-1, xt.shape[-1])
    flat_labels = None if labels is None else labels.reshape(-1)
    mask = row_weights(flat_labels, ignore_index, x_s.shape[0], xs.device)
    if labels is not None:
        x_s = torch.where(mask[:, None] > 0, x_s, torch.zeros((), dtype=x_s.dtype, device=x_s.device))
    ce_labels = None
    if ce_weight != 0:
        ce_labels = torch.where(mask > 0, flat_labels - label_offset, torch.full_like(flat_labels, -1))
    if used != ws.shape[0] or used != wt.shape[0]:
        ws, wt = ws[:used], wt[:used]
        bs = None if bs is None else bs[:used]
        bt = None if bt is None else bt[:used]
    return x_s, x_t, ws, wt, bs, bt, ce_labels, mask
