"""Gradient filtering: vocab columns whose logit gradients are all negligible skip dX and dW.

With ``grad_filter``, column j of a gradient slab (one vocab entry, over one block of rows: the
whole vocabulary in the fast mode, a vocab chunk in the constant-memory mode and the PyTorch
path) takes part in dX = G W and dW = G^T X only if some row i of the block has
|g_ij| > eps * max_j' |g_ij'| (the row's largest entry in the slab). eps = finfo(dtype).eps / 2
by default (2^-8 for bf16, 2^-11 for fp16, 2^-24 for fp32): half an ulp of the row's largest
entry, below the input dtype's resolution at that entry's scale. The threshold is relative to each
row's own gradient, so weights, the reduction and a student close to its teacher (a small
gradient everywhere) do not change which entries count as negligible. Peaked distributions
(trained LMs) leave most of the vocabulary below it, so the two products shrink to the active
columns (when at most half the slab's columns are active; otherwise the slab is not filtered).
The choice costs one host sync per slab (the number of active columns sizes the products), so it
cannot be captured in a CUDA graph, and it pays only on large slabs (the fast mode). Filtered
entries are dropped, not approximated; db, the bias gradient, is never filtered.
"""
from __future__ import annotations

from typing import Optional, Union

import torch

from .._ops import mm_acc, mm_acc_add

F32 = torch.float32
PIECE = 4096  # active columns per product: bounds the gathered copies (G, W rows, dW rows)


def resolve_eps(grad_filter: Union[bool, float, None], dtype: torch.dtype) -> Optional[float]:
    """The threshold eps of a ``grad_filter`` option (None: no filtering)."""
    if grad_filter is None or grad_filter is False:
        return None
    if grad_filter is True:
        return torch.finfo(dtype).eps / 2
    return float(grad_filter)


def check_grad_filter(grad_filter) -> None:
    if grad_filter is None or isinstance(grad_filter, bool):
        return
    if not isinstance(grad_filter, (int, float)) or not (0.0 < grad_filter < 1.0):
        raise ValueError(f"grad_filter must be a bool or a threshold in (0, 1), got {grad_filter!r}")


def check_not_capturing(device: torch.device) -> None:
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        raise RuntimeError("grad_filter syncs with the host once per slab: it cannot run inside a CUDA "
                           "graph capture (leave grad_filter off there)")


def active_columns(g: torch.Tensor, eps: float) -> torch.Tensor:
    """Columns of the slab g with some |g_ij| > eps * max_j' |g_ij'| (PyTorch path; the Triton
    kernel marks them while it writes the slab)."""
    mag = g.abs()
    return (mag > eps * mag.amax(1, keepdim=True)).any(0)


def compacted(active: torch.Tensor) -> Optional[torch.Tensor]:
    """Indices of the active columns, or None when more than half are active: then gathering the
    columns would cost more than the full products it saves."""
    idx = active.nonzero().squeeze(1)  # the host sync
    return idx if 2 * idx.numel() <= active.numel() else None


def add_column_grads(g: torch.Tensor, idx: torch.Tensor, xs: torch.Tensor, w: torch.Tensor,
                     dx_acc: Optional[torch.Tensor], dw: Optional[torch.Tensor], first: bool) -> None:
    """dx_acc += g[:, idx] w[idx]; dw[idx] += g[:, idx]^T xs (dw zeroed first when `first`)."""
    if dw is not None and first:
        dw.zero_()
    for p0 in range(0, idx.numel(), PIECE):
        cols = idx[p0:p0 + PIECE]
        g_act = g.index_select(1, cols)
        if dx_acc is not None:
            mm_acc_add(dx_acc, g_act, w.index_select(0, cols).to(g_act.dtype))
        if dw is not None:
            dw.index_add_(0, cols, mm_acc(g_act.t(), xs.to(g_act.dtype), dw.dtype))
