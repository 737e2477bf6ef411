"""Checks of the hidden-state losses' inputs, once per call, and the checked call they give.

``validate`` checks every argument of a single-process call before any kernel runs and returns a
``HiddenCall``: the rows flattened, the heads cut to the vocabulary used, the backend resolved, the
options turned into a ``LossConfig``. The paths below it (PyTorch, Triton, the custom op) trust it
and check nothing again. The vocab-parallel path shares the tensor and option checks and the row
preparation (so that neither entry point imports the other).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Tuple

import torch

from ..core import checks as ck
from ..core.reduction import row_weights
from . import grad_filter as gf
from .config import LossConfig, Operands

Tensor = torch.Tensor


@dataclass(frozen=True)
class HiddenCall:
    """One hidden-state loss call, checked: only ``validate`` builds it, and the paths trust it."""

    ops: Operands  # rows flattened to [N, D] (rows that do not count zeroed), heads cut to the vocabulary used
    labels: Optional[Tensor]  # CE targets as ids into the heads' rows, -1 where a row has none; None without CE
    mask: Tensor  # [N] row weights: 1 where a row counts
    cfg: LossConfig
    impl: str  # the path: "triton" or "torch" (float64 and an empty batch take "torch")
    reduction: str
    mode: Optional[str]
    memory_budget: Optional[int]
    lead: Tuple[int, ...]  # the leading shape of xs ("none" gives rows back in it)


def validate(xs, xt, ws, wt, *, divergence: str, params: Mapping[str, float], options: Mapping[str, Any]) -> HiddenCall:
    """Every check of a single-process call, once, before any kernel runs; ``options``: ``HiddenOptions``
    (each present), ``params``: the divergence's parameter by keyword."""
    o = options
    labels, ce_weight = o["labels"], o["ce_weight"]
    name, param = ck.divergence_param(divergence, params)
    check_hidden_tensors(xs=xs, xt=xt, ws=ws, wt=wt, bs=o["bs"], bt=o["bt"], labels=labels)
    vocab = _vocab_used(ws, wt, o["vocab_size"])
    check_loss_options(
        temperature=o["temperature"],
        reduction=o["reduction"],
        chunk_V=o["chunk_V"],
        backend=o["backend"],
        kd_weight=o["kd_weight"],
        ce_weight=ce_weight,
        labels=labels,
        softcap_s=o["softcap_s"],
        softcap_t=o["softcap_t"],
    )
    ck.check_mode(o["mode"], o["memory_budget"])
    gf.check_grad_filter(o["grad_filter"])
    if ce_weight != 0 and labels is not None:  # labels are checked present for ce_weight != 0
        ck.check_ids_in_range("labels", labels, vocab, o["ignore_index"])
    impl = ck.backend_for(o["backend"], xs.device)  # the name was checked with the options
    x_s, x_t, ws, wt, bs, bt, ce_labels, mask = prepare_rows(
        xs=xs,
        xt=xt,
        ws=ws,
        wt=wt,
        bs=o["bs"],
        bt=o["bt"],
        labels=labels,
        ignore_index=o["ignore_index"],
        ce_weight=ce_weight,
        used=vocab,
    )
    cfg = LossConfig.build(
        divergence=name,
        param=param,
        temperature=o["temperature"],
        kd_weight=o["kd_weight"],
        ce_weight=ce_weight,
        scale_t2=o["scale_t2"],
        chunk_V=o["chunk_V"],
        filter_eps=gf.resolve_eps(o["grad_filter"], xs.dtype),
        softcap_s=o["softcap_s"],
        softcap_t=o["softcap_t"],
    )
    # float64 always takes the PyTorch path; so does an empty batch (nothing to launch: loss 0, zero grads)
    use_triton = impl == "triton" and xs.dtype != torch.float64 and x_s.shape[0] > 0
    if cfg.filter_eps is not None and not use_triton:
        gf.check_not_capturing(xs.device)  # the Triton filter needs no host sync; the PyTorch one does
    return HiddenCall(
        ops=Operands(xs=x_s, xt=x_t, ws=ws, wt=wt, bs=bs, bt=bt),
        labels=ce_labels,
        mask=mask,
        cfg=cfg,
        impl="triton" if use_triton else "torch",
        reduction=o["reduction"],
        mode=o["mode"],
        memory_budget=o["memory_budget"],
        lead=xs.shape[:-1],
    )


def _vocab_used(ws, wt, vocab_size) -> int:
    """The vocabulary size the loss compares: both heads', or the first ``vocab_size`` rows of each."""
    if vocab_size is None:
        if ws.shape[0] != wt.shape[0]:
            raise ValueError(
                f"student vocab {ws.shape[0]} != teacher vocab {wt.shape[0]}: pass vocab_size=N to "
                "compare the first N entries of both heads (never zero-pad a head)"
            )
        return ws.shape[0]
    if not (ck.is_int(vocab_size) and 0 < vocab_size <= min(ws.shape[0], wt.shape[0])):
        raise ValueError(f"vocab_size must be an int in [1, {min(ws.shape[0], wt.shape[0])}], got {vocab_size!r}")
    return vocab_size


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
