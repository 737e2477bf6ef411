"""Gradient filtering: vocab columns whose logit gradients are all negligible are dropped.

With ``grad_filter``, column j of a gradient slab (one vocab entry, over one block of rows: the
whole vocabulary in the fast mode, a vocab chunk in the constant-memory mode and the PyTorch
path) is kept only if some row i of the block has |g_ij| > eps * max_j' |g_ij'| (the row's largest
entry in the slab); the other columns are dropped from dX = G W and dW = G^T X when at most half the
columns are kept (otherwise the slab is not filtered: keeping most of it is close to exact anyway). eps =
finfo(dtype).eps / 2 by default (2^-8 for bf16, 2^-11 for fp16, 2^-24 for fp32): half an ulp of the
row's largest entry, below the input dtype's resolution at that entry's scale. The threshold is
relative to each row's own gradient, so weights, the reduction and a student close to its teacher
(a small gradient everywhere) do not change which entries count as negligible. db, the bias
gradient, is never filtered.

What is dropped depends on the data only; how the products run is a speed choice. Triton backend
(no host synchronization: it runs inside CUDA graph captures and compiled graphs):
  1. the gradient kernel writes each row's largest |g| beside the slab (no extra sweep);
  2. ``kernels_filter.hidden_filter_columns_kernel`` flags and counts the active columns;
  3. the host picks a capacity from the active fractions of earlier slabs of the same width (read
     back asynchronously, never waited for); a stable sort on the device puts the active columns
     first (perm), and the products run over the columns perm[:cap] (cuBLAS; columns past the
     count are zero) plus, on the device, the columns perm[cap:count] that exceed it
     (``kernels_filter`` overflow products: nothing to do when count <= cap, slow when not); when
     earlier slabs had more than half their columns active, or nothing is known yet, the dense
     products run on g (its dropped columns zeroed by ``hidden_drop_columns_kernel`` if this slab is
     filtered after all).
The PyTorch backend reads the count on the host (one sync per slab): it cannot be captured.
Peaked distributions (trained LMs) leave most of the vocabulary below the threshold in the fast
mode's large slabs; the constant-memory mode's [rows, 4096] slabs rarely have a negligible column.

Constant-memory mode, forward KL without CE, bias or student softcap (``tiles_eligible``): the
backward skips whole (block of rows, vocab chunk) tiles, the recomputation of their logits
included, where a bound shows every entry negligible by the rule above with the row's largest
entry over the whole vocabulary as the reference (``negligible_tiles``). With g = k (q - p):
|g_ij| <= k max(q_ij, p_ij) <= k U_ic (U_ic: the chunk's largest q or p of the row, from the
forward's per-chunk maxima of the tempered logits), and the row's largest |g| is at least
k |max_j p_ij - max_j q_ij| = k L_i (at the argmax of the larger side). A tile is skipped when
U_ic <= eps L_i for every counted row of the block; nothing else is dropped there (the per-slab
column filter, whose reference would be the row's largest entry within a 4096-column chunk, is
off). The decision reads one [blocks, chunks] mask on the host per backward: one sync; inside a
graph capture, and under torch.compile (whose op does not carry the chunk maxima), this mode drops
nothing. Extra memory: 8 bytes per row per vocab chunk. Other losses in this mode keep the per-slab
column filter.
"""

from __future__ import annotations

from typing import List, Optional, Union

import torch

from ..core.ops import mm_acc, mm_acc_add

F32 = torch.float32
PIECE = 8192  # active columns per product: bounds the gathered copies (G, W rows, dW rows)


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
        raise RuntimeError(
            "grad_filter on the PyTorch backend syncs with the host once per slab: it cannot "
            "run inside a CUDA graph capture (use the Triton backend, or leave grad_filter off)"
        )


def active_columns(g: torch.Tensor, eps: float) -> torch.Tensor:
    """Columns of the slab g with some |g_ij| > eps * max_j' |g_ij'| (PyTorch path; the Triton
    kernel marks them while it writes the slab)."""
    mag = g.abs()
    return (mag > eps * mag.amax(1, keepdim=True)).any(0)


def compacted(active: torch.Tensor) -> Optional[torch.Tensor]:
    """Indices of the active columns, or None when more than half are active: then gathering the
    columns would cost more than the full products it saves (PyTorch path: a host sync)."""
    idx = active.nonzero().squeeze(1)  # the host sync
    return idx if 2 * idx.numel() <= active.numel() else None


HEADROOM = 1.25  # capacity over the largest active fraction seen: slabs of one call vary
CAP_STEP = 256  # capacities are multiples of this (fewer distinct product shapes)
RECENT = 8  # read-backs the capacity covers


class ActiveFractions:
    """The largest active-column fraction seen on slabs of one width and device, read back from the
    device asynchronously: a count is copied to pinned memory behind an event, and read once the
    event has passed (``event.query()``, never a wait). Nothing is recorded during a graph capture."""

    def __init__(self):
        self.fraction: Optional[float] = None
        self._pending = None  # (pinned count, event, n_cols) of a copy in flight
        self._host: Optional[torch.Tensor] = None  # the pinned buffer, reused
        self._recent: list = []

    def capacity(self, n_cols: int) -> int:
        """Columns the compacted products cover; n_cols means the dense products."""
        if not (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()):
            self._poll()  # no event queries inside a capture
        if self.fraction is None or 2 * self.fraction > 1:  # nothing known, or unfiltered slabs
            return n_cols
        return min(n_cols, -(-int(self.fraction * n_cols * HEADROOM + 1) // CAP_STEP) * CAP_STEP)

    def record(self, count: torch.Tensor, n_cols: int) -> None:
        if not count.is_cuda:
            self._update(int(count), n_cols)
            return
        if torch.cuda.is_current_stream_capturing() or self._pending is not None and not self._poll():
            return
        if self._host is None or self._host.dtype != count.dtype:
            self._host = torch.empty(1, dtype=count.dtype, pin_memory=True)
        host = self._host
        host.copy_(count.view(1), non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        self._pending = (host, event, n_cols)

    def _poll(self) -> bool:
        """Take a finished read-back; False while one is still in flight."""
        if self._pending is None:
            return True
        host, event, n_cols = self._pending
        if not event.query():
            return False
        self._pending = None
        self._update(int(host[0]), n_cols)
        return True

    def _update(self, count: int, n_cols: int) -> None:
        # the largest of the last few: slabs of one call differ (a short last block of rows)
        self._recent = (self._recent + [count / max(n_cols, 1)])[-RECENT:]
        self.fraction = max(self._recent)


_FRACTIONS: dict = {}


def fractions_for(device: torch.device, n_cols: int, eps: float) -> ActiveFractions:
    """The history of slabs of this width, device and threshold (losses of one process stay apart)."""
    key = (device.type, device.index, n_cols, eps)
    if key not in _FRACTIONS:
        _FRACTIONS[key] = ActiveFractions()
    return _FRACTIONS[key]


def kept_columns(count: torch.Tensor, n_cols: int) -> torch.Tensor:
    """Columns a slab keeps (on the device): the active ones, or all of them when more than half are
    active (an unfiltered slab)."""
    return torch.where(2 * count <= n_cols, count, n_cols)


def tiles_eligible(cfg, has_bias: bool) -> bool:
    """Whether the constant-memory backward may skip tiles (the bounds of ``negligible_tiles`` hold)."""
    return (
        cfg.filter_eps is not None
        and cfg.divergence == "forward_kl"
        and not cfg.with_ce
        and not has_bias
        and cfg.softcap_s is None
    )


def negligible_tiles(
    chunk_max: torch.Tensor,
    lse_s: torch.Tensor,
    lse_t: torch.Tensor,
    kd_scale: torch.Tensor,
    eps: float,
    rows_per_block: int,
) -> Optional[List[List[bool]]]:
    """skip[block][chunk]: tiles whose every entry is below eps x its row's largest |g| (module doc).
    chunk_max [N, chunks, 2]: per row and vocab chunk, the largest tempered student and teacher
    logits; lse_s, lse_t [N] tempered log-sum-exps. None inside a graph capture (no host read)."""
    if chunk_max.is_cuda and torch.cuda.is_current_stream_capturing():
        return None
    cm = chunk_max.float()
    ls, lt = lse_s.float()[:, None], lse_t.float()[:, None]
    upper = torch.maximum(cm[..., 0] - ls, cm[..., 1] - lt).exp()  # [N, chunks]
    lower = ((cm[..., 0].amax(1) - lse_s.float()).exp() - (cm[..., 1].amax(1) - lse_t.float()).exp()).abs()
    ok = (upper <= eps * lower[:, None]) | (kd_scale == 0)[:, None]  # NaN bounds never qualify
    return torch.stack([blk.all(0) for blk in ok.split(rows_per_block)]).tolist()  # the one host read


def active_first(active: torch.Tensor) -> torch.Tensor:
    """The column order with the active columns first, in order, then the others (on the device)."""
    return torch.sort(active, descending=True, stable=True).indices


def add_column_grads(
    g: torch.Tensor,
    idx: torch.Tensor,
    xs: torch.Tensor,
    w: torch.Tensor,
    dx_acc: Optional[torch.Tensor],
    dw: Optional[torch.Tensor],
    first: bool,
    kept: Optional[torch.Tensor] = None,
    scatter_add=None,
) -> None:
    """dx_acc += g[:, idx] w[idx]; dw[idx] += g[:, idx]^T xs (dw zeroed first when `first`). With
    `kept` (a device count), only the first `kept` entries of idx count; the others add zeros.
    scatter_add(dw, rows, idx, kept, first_row) replaces index_add_ where given (distinct idx)."""
    if dw is not None and first:
        dw.zero_()
    keep = None if kept is None else (torch.arange(idx.numel(), device=g.device) < kept).to(g.dtype)
    for p0 in range(0, idx.numel(), PIECE):
        cols = idx[p0 : p0 + PIECE]
        g_act = g.index_select(1, cols)
        if keep is not None:
            g_act.mul_(keep[p0 : p0 + PIECE])
        if dx_acc is not None:
            mm_acc_add(dx_acc, g_act, w.index_select(0, cols).to(g_act.dtype))
        if dw is not None:
            rows = mm_acc(g_act.t(), xs.to(g_act.dtype), dw.dtype)
            if scatter_add is None:
                dw.index_add_(0, cols, rows)
            else:
                scatter_add(dw, rows, cols, kept, p0)
