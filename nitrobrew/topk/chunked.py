"""Top-k KD in plain PyTorch (any device, any float dtype).

normalize="full": one online pass over vocab chunks keeps the student's per-row (m, tail) state
(``nitrobrew.core.online.Online``) over the entries OUTSIDE each row's valid top-k ids (the chunk's
logits at the row's ids are set to -inf before the exp) and picks the logits at the stored ids out of
each chunk as it goes by: the outside mass is summed directly, exact however small (never 1 - sum_k
q_k), and ``rowmath.topk_rows`` splits the student's normalizer over the ids and that bucket (a
confident row keeps its top log-probability; docs/design.md §2.6). The backward recomputes each chunk,
adds the K coefficients of the rows whose ids fall in it (their whole gradient) and the bucket's at the
other entries, and feeds the chunk's gradient into dX and dW. Working memory O(rows * chunk + rows * K);
the [rows, V] logits never exist.

normalize="topk": no vocab-wide work at all: the K logits of a row are gathered from the K rows
of ``ws`` (in row blocks of bounded size), and the gradients scatter back to those rows.

Vocab-parallel pieces: ``vocab_pass`` computes a vocab range's statistics (the student's online
state, the logits at the ids that fall in the range, the label logit), merged across ranks by
``parallel.comm.merge_online``; ``finish`` turns merged statistics into losses and gradient coefficients;
``backward_range`` accumulates a range's gradient. A wrapper that holds rows [lo, hi) of the head
on each rank calls them with ``lo`` and reduces (m, l), the id logits and dX over ranks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import torch

from ..core import checks as ck
from ..core.online import Online, auto_chunk_v, spans
from ..core.ops import compute_dtype, softcap_, softcap_grad_
from ..core.reduction import PartsFunction, combine_rows, row_scales
from ..core.slabs import chunk_logits, gather_label_logit, head_grads_from_chunk
from .rowmath import DenseCoef, RowResult, TopKConfig, full_lse, topk_rows

Tensor = torch.Tensor
GATHER_BUDGET = 1 << 22  # elements of gathered [rows, K, D] (or [entries, D]) held at once


@dataclass
class Entries:
    """The valid (row, id) entries of a batch sorted by id, so a vocab range is one slice."""

    ids: Tensor  # [E] int64, sorted
    rows: Tensor  # [E] int64
    flat: Tensor  # [E] int64, row * K + k
    size: int  # N * K

    @staticmethod
    def build(ids: Tensor, valid: Tensor) -> "Entries":
        K = ids.shape[1]
        flat = torch.nonzero(valid.reshape(-1), as_tuple=False).squeeze(1)
        idv = ids.reshape(-1)[flat].long()
        order = torch.argsort(idv, stable=True)
        flat = flat[order]
        return Entries(idv[order], torch.div(flat, K, rounding_mode="floor"), flat, ids.numel())

    def span(self, lo: int, hi: int) -> Tuple[int, int]:
        bounds = torch.searchsorted(self.ids, torch.tensor([lo, hi], device=self.ids.device))
        return int(bounds[0]), int(bounds[1])


@dataclass
class VocabStats:
    """Statistics of one vocab range (ranges merge like ``Online`` states; z_ids by summing)."""

    s: Optional[Online]  # tempered student logits outside the row's valid top-k ids
    z: Optional[Online]  # raw logits (hard-label CE at T != 1), else None
    z_ids: Tensor  # [N*K] raw logits at the stored ids inside the range, 0 elsewhere
    z_label: Tensor  # [N] raw logit at the label inside the range, 0 elsewhere


def without_ids(s: Tensor, entries: Entries, a: int, b: int, c0: int) -> Tensor:
    """A copy of the chunk s (global columns from c0) with -inf at the entries [a, b) (a row's top-k ids)."""
    return s.index_put(
        (entries.rows[a:b], entries.ids[a:b] - c0), torch.tensor(float("-inf"), dtype=s.dtype, device=s.device)
    )


def vocab_pass(
    xs, ws, bs, labels, entries: Entries, cfg: TopKConfig, lo: int = 0, chunk: Optional[int] = None
) -> VocabStats:
    """Online statistics over the head rows ``ws`` = global vocab [lo, lo + ws.shape[0]).

    labels (global ids, -1 where none) give the CE label logit when cfg.with_ce. The tempered state
    skips each row's valid top-k ids (see the module notes).
    """
    acc = compute_dtype(xs.dtype)
    n, dev = xs.shape[0], xs.device
    V = ws.shape[0]
    chunk = chunk or cfg.chunk_V or auto_chunk_v(n, V, device=dev)
    st = VocabStats(
        s=Online.empty(n, acc, dev),
        z=Online.empty(n, acc, dev) if cfg.with_ce and cfg.temperature != 1.0 else None,
        z_ids=torch.zeros(entries.size, dtype=acc, device=dev),
        z_label=torch.zeros(n, dtype=acc, device=dev),
    )
    local_labels = None if labels is None else labels - lo
    for c0, c1 in spans(V, chunk):
        z = chunk_logits(x=xs, w=ws, b=bs, lo=c0, hi=c1, acc=acc, softcap=cfg.softcap_s)
        a, b = entries.span(lo + c0, lo + c1)
        s = z / cfg.temperature
        st.s.update(without_ids(s, entries, a, b, lo + c0) if b > a else s)
        if st.z is not None:
            st.z.update(z)
        if b > a:
            st.z_ids[entries.flat[a:b]] = z[entries.rows[a:b], entries.ids[a:b] - lo - c0]
        if cfg.with_ce and local_labels is not None:
            st.z_label += gather_label_logit(z, local_labels, c0, c1)
    return st


def gather_logits(xs: Tensor, ws: Tensor, bs: Optional[Tensor], ids: Tensor) -> Tensor:
    """Raw logits x_n . w_{ids[n, k]} (+ b) as [N, K] in the compute dtype, no vocab-wide work."""
    acc = compute_dtype(xs.dtype)
    N, K = ids.shape
    D = xs.shape[1]
    out = torch.empty(N, K, dtype=acc, device=xs.device)
    step = max(1, GATHER_BUDGET // max(K * D, 1))
    for r0 in range(0, N, step):
        r1 = min(r0 + step, N)
        w = ws[ids[r0:r1]].to(acc)  # [r, K, D]
        out[r0:r1] = torch.einsum("rd,rkd->rk", xs[r0:r1].to(acc), w)
    if bs is not None:
        out += bs.to(acc)[ids]
    return out


def finish(
    z_ids: Tensor,
    lp: Tensor,
    valid: Tensor,
    s_state: Optional[Online],
    z_state: Optional[Online],
    z_label: Tensor,
    cfg: TopKConfig,
) -> Tuple[RowResult, Optional[Tensor], Optional[Tensor]]:
    """Losses and gradient coefficients from (merged) statistics.

    s_state: the tempered student over the entries outside each row's valid ids (``vocab_pass``; None for
    normalize="topk"); z_state: the raw logits over the whole vocabulary (the CE at T != 1, else None).
    Returns (rows, lse_z, ce): lse_z the raw full log-sum-exp used by the CE (None without CE), ce the
    per-row CE.
    """
    N, K = lp.shape
    s = z_ids.view(N, K) / cfg.temperature
    out = None if s_state is None or not cfg.full else (s_state.m, torch.log1p(s_state.tail))
    res = topk_rows(s=s, lp=lp, valid=valid, cfg=cfg, out=out)
    lse_z = ce = None
    if cfg.with_ce:  # at T = 1 s is z
        lse_z = z_state.lse() if z_state is not None else full_lse(s, valid, res.lse_tail)
        ce = lse_z - z_label
    return res, lse_z, ce


def backward_range(
    xs,
    ws,
    bs,
    labels,
    entries: Entries,
    coef: Tensor,
    dense: DenseCoef,
    lse_z: Optional[Tensor],
    ce_scale: Optional[Tensor],
    cfg: TopKConfig,
    lo: int = 0,
    chunk: Optional[int] = None,
    need_w: bool = True,
):
    """Gradient of a vocab range w.r.t. the raw logits, fed into (dX [acc], dW, db).

    coef: [N*K] d loss / d raw logit at each stored id (0 at invalid entries; the KD part's whole
    gradient there); dense: the per-row multiplier of exp(s_j - lse_tail) at the entries outside the
    row's top-k (already divided by T); ce_scale: [N] CE weight per row (softmax of the raw logits minus
    the label's one-hot). dW/db cover this range only.
    """
    acc = compute_dtype(xs.dtype)
    V = ws.shape[0]
    chunk = chunk or cfg.chunk_V or auto_chunk_v(xs.shape[0], V, device=xs.device)
    dx = torch.zeros(xs.shape, dtype=acc, device=xs.device)
    dw = torch.empty_like(ws) if need_w else None
    db = torch.empty_like(bs) if (bs is not None and need_w) else None
    xs_acc = xs.to(acc)
    local_labels = None if labels is None else labels - lo
    lse_tail = dense.lse_tail
    lse_tail = torch.where(torch.isfinite(lse_tail), lse_tail, torch.zeros_like(lse_tail))  # no outside ids: 0
    for c0, c1 in spans(V, chunk):
        z = chunk_logits(x=xs, w=ws, b=bs, lo=c0, hi=c1, acc=acc, softcap=cfg.softcap_s)
        s = z / cfg.temperature
        a, b = entries.span(lo + c0, lo + c1)
        outside = without_ids(s, entries, a, b, lo + c0) if b > a else s  # the ids: their whole gradient in coef
        g = dense.tail[:, None] * torch.exp(outside - lse_tail[:, None])
        if ce_scale is not None:
            g += ce_scale[:, None] * torch.exp(z - lse_z[:, None])
            if local_labels is not None:
                inside = (local_labels >= c0) & (local_labels < c1)
                col = torch.where(inside, local_labels - c0, torch.zeros_like(local_labels))
                g.scatter_add_(1, col[:, None], torch.where(inside, -ce_scale, torch.zeros_like(ce_scale))[:, None])
        if b > a:
            g.index_put_((entries.rows[a:b], entries.ids[a:b] - lo - c0), coef[entries.flat[a:b]], accumulate=True)
        softcap_grad_(g, z, cfg.softcap_s)
        head_grads_from_chunk(g=g, xs_acc=xs_acc, ws=ws, c0=c0, c1=c1, dx=dx, dw=dw, db=db)
    return dx, dw, db


def sparse_grads(xs, ws, bs, ids: Tensor, entries: Entries, coef: Tensor, need_w: bool = True):
    """Gradients of normalize="topk": dX_n = sum_k c_nk w_{id_nk}; dW[v] = sum c x over v's entries."""
    acc = compute_dtype(xs.dtype)
    N, K = ids.shape
    D = xs.shape[1]
    c = coef.view(N, K)
    dx = torch.empty(N, D, dtype=acc, device=xs.device)
    step = max(1, GATHER_BUDGET // max(K * D, 1))
    for r0 in range(0, N, step):
        r1 = min(r0 + step, N)
        dx[r0:r1] = torch.einsum("rk,rkd->rd", c[r0:r1], ws[ids[r0:r1]].to(acc))
    dw = db = None
    if need_w:
        dw_acc = torch.zeros(ws.shape, dtype=acc, device=ws.device)
        ce = coef[entries.flat]
        estep = max(1, GATHER_BUDGET // max(D, 1))
        for e0 in range(0, entries.ids.numel(), estep):
            e1 = min(e0 + estep, entries.ids.numel())
            dw_acc.index_add_(0, entries.ids[e0:e1], ce[e0:e1, None] * xs[entries.rows[e0:e1]].to(acc))
        dw = dw_acc.to(ws.dtype)
        if bs is not None:
            db = torch.zeros(bs.shape, dtype=acc, device=bs.device).index_add_(0, entries.ids, ce).to(bs.dtype)
    return dx, dw, db


def row_coefficients(grad_rows: Tensor, mask: Tensor, res: RowResult, cfg: TopKConfig):
    """Per-entry coefficients (raw-logit units), the vocab-wide ``DenseCoef`` (normalize="full", else
    None) and the per-row CE multipliers for a backward."""
    dt = res.kd.dtype
    kd_scale, ce_scale = row_scales(grad_rows.to(dt), mask.to(dt), cfg)
    kd_scale = kd_scale / cfg.temperature
    coef = (res.sparse * kd_scale[:, None]).reshape(-1)
    dense = DenseCoef(res.tail, res.lse_tail).scaled(kd_scale) if cfg.full else None
    return coef, dense, (ce_scale if cfg.with_ce else None)


class ChunkedTopK(PartsFunction):
    """Per-row (total, kd, ce); gradients to xs, ws and bs (the stored teacher is constant)."""

    @staticmethod
    def forward(ctx, xs, ws, bs, ids, lp, labels, mask, cfg: TopKConfig):
        valid = torch.isfinite(lp)
        entries = Entries.build(ids, valid)
        lpc = lp.to(compute_dtype(xs.dtype))
        if cfg.full:
            st = vocab_pass(xs=xs, ws=ws, bs=bs, labels=labels, entries=entries, cfg=cfg)
            res, lse_z, ce = finish(
                z_ids=st.z_ids, lp=lpc, valid=valid, s_state=st.s, z_state=st.z, z_label=st.z_label, cfg=cfg
            )
        else:
            z_ids = softcap_(gather_logits(xs, ws, bs, ids).reshape(-1), cfg.softcap_s)
            ctx.z_ids = z_ids
            res, lse_z, ce = finish(z_ids=z_ids, lp=lpc, valid=valid, s_state=None, z_state=None, z_label=None, cfg=cfg)
        total, kd, ce_rows = combine_rows(res.kd, ce, mask, cfg)
        ctx.save_for_backward(xs, ws, bs, ids, labels, mask)
        ctx.res, ctx.lse_z, ctx.entries, ctx.cfg = res, lse_z, entries, cfg
        return ChunkedTopK.parts(ctx, total, kd, ce_rows)

    @staticmethod
    @ck.no_double_backward
    def backward(ctx, grad_total, _gkd, _gce):
        xs, ws, bs, ids, labels, mask = ctx.saved_tensors
        cfg = ctx.cfg
        coef, dense, ce_scale = row_coefficients(grad_total, mask, ctx.res, cfg)
        need_w = ChunkedTopK.head_needed(ctx)
        if cfg.full:
            dx, dw, db = backward_range(
                xs=xs,
                ws=ws,
                bs=bs,
                labels=labels,
                entries=ctx.entries,
                coef=coef,
                dense=dense,
                lse_z=ctx.lse_z,
                ce_scale=ce_scale,
                cfg=cfg,
                need_w=need_w,
            )
        else:
            dx, dw, db = sparse_grads(
                xs=xs,
                ws=ws,
                bs=bs,
                ids=ids,
                entries=ctx.entries,
                coef=softcap_grad_(coef, ctx.z_ids, cfg.softcap_s),
                need_w=need_w,
            )
        return ChunkedTopK.input_grads(ctx, dx.to(xs.dtype) if ctx.needs_input_grad[0] else None, dw, db)


def chunked_rows(xs, ws, bs, ids, lp, labels, mask, cfg: TopKConfig):
    """Entry used by the public API: flattened inputs, returns per-row (total, kd, ce)."""
    return ChunkedTopK.apply(xs, ws, bs, ids, lp, labels, mask, cfg)
