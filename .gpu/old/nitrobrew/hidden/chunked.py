"""Vocab-chunked hidden-state losses in plain PyTorch (any device, any float dtype).

Forward: one online pass over vocab chunks keeps per-row log-sum-exp state (and, for the two KL
directions, the divergence itself: docs/design.md §2.3); other divergences take a second pass once the
log-sum-exps are known. Backward recomputes each chunk's logits, forms the gradient chunk and
feeds it straight into dX and dW. Working memory is O(rows * chunk_V), never O(rows * V).

The pieces (``first_pass``, ``second_pass``, ``finish_stats``, ``TorchLocal``) are public so that
the vocab-parallel wrapper can combine per-rank partial states (the online state itself is
``nitrobrew.core.online.Online``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import torch

from .. import divergences as dv
from ..core import checks as ck
from ..core.online import FAR_NATS, Online, auto_chunk_v, spans
from ..core.ops import compute_dtype, softcap_grad_
from ..core.reduction import combine_rows, row_scales
from ..core.slabs import chunk_logits, gather_label_logit, head_grads_from_chunk
from . import grad_filter as gf
from .config import LossConfig, Operands

Tensor = torch.Tensor


@dataclass
class RowStats:
    """What the backward needs per row (all [N], compute dtype)."""

    lse_s: Tensor
    lse_t: Tensor
    lse_z: Optional[Tensor]  # student log-sum-exp at temperature 1 (hard-label CE)
    sum_u: Tensor  # sum_j dD/dlog q_j
    kd: Tensor  # divergence per row
    ce: Optional[Tensor]  # cross-entropy per row
    # [N, vocab chunks, 2] largest tempered student/teacher logits per chunk (Triton constant-memory
    # mode with grad_filter: grad_filter.negligible_tiles); not carried by rows()
    chunk_max: Optional[Tensor] = None

    def rows(self, r0: int, r1: int) -> "RowStats":
        """The statistics of rows [r0, r1)."""
        return RowStats(
            *(
                None if v is None else v[r0:r1]
                for v in (self.lse_s, self.lse_t, self.lse_z, self.sum_u, self.kd, self.ce)
            )
        )


@dataclass
class FirstPass:
    s: Online
    t: Online
    z: Optional[Online]  # raw student logits, only when CE is on and T != 1
    z_label: Tensor  # raw student logit at the label (0 where no label)


def first_pass(ops: Operands, labels, cfg: LossConfig, lo: int, hi: int, chunk: int) -> FirstPass:
    """Online statistics over the rows [lo, hi) of the heads, in chunks (labels index those rows)."""
    xs, xt, ws, wt, bs, bt = ops
    acc = compute_dtype(xs.dtype)
    n, dev = xs.shape[0], xs.device
    one_pass = cfg.divergence in dv.ONE_PASS
    fwd, rev = one_pass and cfg.divergence == "forward_kl", one_pass and cfg.divergence == "reverse_kl"
    st = FirstPass(
        s=Online.empty(n, acc, dev, with_acc=rev, with_lost=fwd),
        t=Online.empty(n, acc, dev, with_acc=fwd, with_lost=rev),
        z=Online.empty(n, acc, dev) if cfg.with_ce and cfg.temperature != 1.0 else None,
        z_label=torch.zeros(n, dtype=acc, device=dev),
    )
    for c0 in range(lo, hi, chunk):
        c1 = min(c0 + chunk, hi)
        z = chunk_logits(xs, ws, bs, c0, c1, acc, cfg.softcap_s)
        s = z / cfg.temperature
        t = chunk_logits(xt, wt, bt, c0, c1, acc, cfg.softcap_t) / cfg.temperature
        if rev:
            e_s, sc_s = st.s.update(s, s - t)
            st.t.update(t, lost=(e_s == 0) | (t - s > FAR_NATS), other_scale=sc_s)
        elif fwd:
            e_t, sc_t = st.t.update(t, t - s)
            st.s.update(s, lost=(e_t == 0) | (s - t > FAR_NATS), other_scale=sc_t)
        else:
            st.t.update(t)
            st.s.update(s)
        if st.z is not None:
            st.z.update(z)
        if cfg.with_ce:
            st.z_label += gather_label_logit(z, labels, c0, c1)
    return st


def second_pass(ops: Operands, cfg: LossConfig, lse_s, lse_t, lo, hi, chunk) -> Tuple[Tensor, Tensor]:
    """sum_j phi_j and sum_j u_j over [lo, hi), given the final log-sum-exps."""
    xs, xt, ws, wt, bs, bt = ops
    acc = compute_dtype(xs.dtype)
    phi_sum = torch.zeros_like(lse_s)
    u_sum = torch.zeros_like(lse_s)
    for c0 in range(lo, hi, chunk):
        c1 = min(c0 + chunk, hi)
        lq = chunk_logits(xs, ws, bs, c0, c1, acc, cfg.softcap_s) / cfg.temperature - lse_s[:, None]
        lp = chunk_logits(xt, wt, bt, c0, c1, acc, cfg.softcap_t) / cfg.temperature - lse_t[:, None]
        phi, u = dv.elementwise(cfg.divergence, lp, lq, cfg.param)
        phi_sum += phi.sum(-1)
        u_sum += u.sum(-1)
    return phi_sum, u_sum


def _one_pass_kd(own: Online, other: Online, lse_gap: Tensor) -> Tensor:
    """sum_j p_j (x_j - y_j) + lse_y - lse_x for the side p = softmax(x) that accumulated a and r.

    lse_y - lse_x = log1p(r / l) - log1p(-b_y / l_y) exactly (Online's docstring): r sums
    p_j expm1(y_j - x_j) over the entries where p_j is representable, b_y / l_y is the share of y's
    mass on the others (p_j = 0 in float32: a mask, a gap of ~100 nats, a cold temperature). Taken in
    float64 from the row's own sums it keeps its digits when x and y are close, where the difference
    of two ~log V log-sum-exps would leave their fp32 rounding (~1e-7 nats) in a KL that may be ~1e-4.
    When the form has nothing to gain (|r / l| >= 1/2, or most of y's mass dropped) or is not finite,
    the difference of the log-sum-exps is used: it has no cancellation there."""
    if own.r is None:
        return own.a / own.l + lse_gap
    a_l = own.a.double() / own.l.double()
    r = own.r.double() / own.l.double()
    lost = other.b.double() / other.l.double() if other.b is not None else torch.zeros_like(r)
    close = torch.isfinite(r) & (r.abs() < 0.5) & torch.isfinite(a_l) & (lost >= 0) & (lost < 0.5)
    r, lost = torch.where(close, r, 0.0), torch.where(close, lost, 0.0)
    gap = torch.where(close, torch.log1p(r) - torch.log1p(-lost), lse_gap.double())
    return (a_l + gap).to(own.a.dtype)


def finish_stats(fp: FirstPass, cfg: LossConfig, sums: Optional[Tuple[Tensor, Tensor]]) -> RowStats:
    """Turn (globally merged) first-pass state and second-pass sums into RowStats."""
    lse_s, lse_t = fp.s.lse(), fp.t.lse()
    if cfg.divergence == "forward_kl":
        kd = _one_pass_kd(fp.t, fp.s, lse_s - lse_t)
        sum_u = torch.full_like(kd, -1.0)
    elif cfg.divergence == "reverse_kl":
        kd = _one_pass_kd(fp.s, fp.t, lse_t - lse_s)
        sum_u = kd + 1.0
    else:
        kd, sum_u = sums
    # a NaN logit makes its row's log-sum-exps NaN; the elementwise sums skip p = 0 entries by design and
    # would hide it (divergences._xmul), so the row's value says NaN explicitly
    bad = torch.isnan(lse_s) | torch.isnan(lse_t)
    kd = torch.where(bad, float("nan"), kd)
    sum_u = torch.where(bad, float("nan"), sum_u)
    lse_z = None
    ce = None
    if cfg.with_ce:
        lse_z = fp.z.lse() if fp.z is not None else lse_s
        ce = lse_z - fp.z_label
    return RowStats(lse_s, lse_t, lse_z, sum_u, kd, ce)


def grad_chunk(z, t, labels, st: RowStats, cfg: LossConfig, kd_scale, ce_scale, lo: int) -> Tensor:
    """d loss / d raw student logits for one chunk: z (softcapped) student logits at temperature 1,
    t tempered teacher logits.

    kd_scale and ce_scale are per-row multipliers (upstream gradient, weights, row mask).
    """
    lq = z / cfg.temperature - st.lse_s[:, None]
    lp = t - st.lse_t[:, None]
    _, u = dv.elementwise(cfg.divergence, lp, lq, cfg.param)
    g = dv.student_logit_grad(u, lq, st.sum_u[:, None]) * (kd_scale / cfg.temperature)[:, None]
    # rows that do not count (scale 0) get exactly 0, even where their logits are not finite
    g = torch.where((kd_scale != 0)[:, None], g, torch.zeros_like(g))
    if cfg.with_ce:
        ce_g = torch.exp(z - st.lse_z[:, None]) * ce_scale[:, None]
        g = g + torch.where((ce_scale != 0)[:, None], ce_g, torch.zeros_like(ce_g))
        if labels is not None:
            inside = (labels >= lo) & (labels < lo + z.shape[1])
            col = torch.where(inside, labels - lo, torch.zeros_like(labels))
            g.scatter_add_(1, col[:, None], torch.where(inside, -ce_scale, torch.zeros_like(ce_scale))[:, None])
    return softcap_grad_(g, z, cfg.softcap_s)


def compute_stats(ops: Operands, labels, cfg: LossConfig, chunk: int) -> RowStats:
    V = ops.vocab
    fp = first_pass(ops, labels, cfg, 0, V, chunk)
    sums = None
    if cfg.divergence not in dv.ONE_PASS:
        sums = second_pass(ops, cfg, fp.s.lse(), fp.t.lse(), 0, V, chunk)
    return finish_stats(fp, cfg, sums)


def backward_chunks(ops: Operands, labels, st, cfg, kd_scale, ce_scale, chunk, lo=0, need_w=True):
    """Recompute chunk logits and accumulate (dX [acc], dW, db) over the local vocab."""
    xs, xt, ws, wt, bs, bt = ops
    acc = compute_dtype(xs.dtype)
    V = ws.shape[0]
    dx = torch.zeros(xs.shape, dtype=acc, device=xs.device)
    dw = torch.empty_like(ws) if need_w else None
    db = torch.empty_like(bs) if (bs is not None and need_w) else None
    xs_acc = xs.to(acc)
    if cfg.filter_eps is not None:
        gf.check_not_capturing(xs.device)
    for c0, c1 in spans(V, chunk):
        z = chunk_logits(xs, ws, bs, c0, c1, acc, cfg.softcap_s)
        t = chunk_logits(xt, wt, bt, c0, c1, acc, cfg.softcap_t) / cfg.temperature
        g = grad_chunk(z, t, None if labels is None else labels - lo, st, cfg, kd_scale, ce_scale, c0)
        if cfg.filter_eps is None:
            head_grads_from_chunk(g, xs_acc, ws, c0, c1, dx, dw, db)
            continue
        if db is not None:  # db is never filtered
            db[c0:c1] = g.sum(0).to(db.dtype)
        active = gf.active_columns(g, cfg.filter_eps)
        idx = gf.compacted(active)
        if idx is None:  # more than half active: not filtered
            head_grads_from_chunk(g, xs_acc, ws, c0, c1, dx, dw, None)
        else:
            gf.add_column_grads(g, idx, xs_acc, ws[c0:c1], dx, None if dw is None else dw[c0:c1], first=True)
    return dx, dw, db


class TorchLocal:
    """``first_pass`` / ``second_pass`` / ``backward`` over a (local) head in vocab chunks: the pieces a
    wrapper (vocab-parallel) merges across ranks. ``triton_function.TritonLocal`` has the same interface."""

    def __init__(self, xs, ws, cfg: LossConfig, memory_budget=None):
        self.chunk = max(1, cfg.chunk_V or auto_chunk_v(xs.shape[0], max(ws.shape[0], 1)))

    def first_pass(self, ops: Operands, labels, cfg: LossConfig) -> FirstPass:
        return first_pass(ops, labels, cfg, 0, ops.vocab, self.chunk)

    def second_pass(self, ops: Operands, cfg: LossConfig, lse_s, lse_t):
        return second_pass(ops, cfg, lse_s, lse_t, 0, ops.vocab, self.chunk)

    def backward(self, ops: Operands, labels, st: RowStats, cfg: LossConfig, kd_scale, ce_scale, need_w=True):
        return backward_chunks(ops, labels, st, cfg, kd_scale, ce_scale, self.chunk, need_w=need_w)


class ChunkedDistill(torch.autograd.Function):
    """Per-row (total, kd, ce) losses; gradients to xs, ws and bs (the teacher is constant)."""

    @staticmethod
    def forward(ctx, xs, xt, ws, wt, bs, bt, labels, mask, cfg: LossConfig):
        chunk = cfg.chunk_V or auto_chunk_v(xs.shape[0], ws.shape[0])
        st = compute_stats(Operands(xs, xt, ws, wt, bs, bt), labels, cfg, chunk)
        total, kd, ce = combine_rows(st.kd, st.ce, mask, cfg)
        ctx.save_for_backward(xs, xt, ws, wt, bs, bt, labels, mask)
        ctx.stats, ctx.cfg, ctx.chunk = st, cfg, chunk
        ctx.mark_non_differentiable(kd, ce)
        return total, kd, ce

    @staticmethod
    @ck.no_double_backward
    def backward(ctx, grad_total, _gkd, _gce):
        xs, xt, ws, wt, bs, bt, labels, mask = ctx.saved_tensors
        cfg = ctx.cfg
        kd_scale, ce_scale = row_scales(grad_total.to(ctx.stats.lse_s.dtype), mask.to(ctx.stats.lse_s.dtype), cfg)
        dx, dw, db = backward_chunks(
            Operands(xs, xt, ws, wt, bs, bt),
            labels,
            ctx.stats,
            cfg,
            kd_scale,
            ce_scale,
            ctx.chunk,
            need_w=ctx.needs_input_grad[2] or ctx.needs_input_grad[4],
        )
        dx = dx.to(xs.dtype) if ctx.needs_input_grad[0] else None
        dw = dw if ctx.needs_input_grad[2] else None
        db = db if ctx.needs_input_grad[4] else None
        return dx, None, dw, None, db, None, None, None, None


def chunked_rows(xs, xt, ws, wt, bs, bt, labels, mask, cfg: LossConfig):
    """Entry used by the public API: flattened inputs, returns per-row (total, kd, ce)."""
    return ChunkedDistill.apply(xs, xt, ws, wt, bs, bt, labels, mask, cfg)
