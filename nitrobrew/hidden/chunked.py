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

import math
from dataclasses import dataclass
from typing import Optional, Tuple

import torch

from .. import divergences as dv
from ..core import checks as ck
from ..core.online import FAR_NATS, Online, auto_chunk_v, spans
from ..core.ops import compute_dtype, softcap_grad_
from ..core.reduction import PartsFunction, combine_rows, row_scales
from ..core.slabs import chunk_logits, gather_label_logit, head_grads_from_chunk
from . import grad_filter as gf
from .config import LossConfig, Operands

Tensor = torch.Tensor


LOG2 = math.log(2.0)


@dataclass
class RowNorm:
    """Each side's normalizer split as its max m and log l = log1p(tail) (core.online.Online), and the
    log-sum-exp gap lse_s - lse_t = c + g split as a logit difference c (s - t at the accumulating side's
    top entry) and a small rest g from the centred sums (Online's docstring). Then log q = (s - m_s) -
    log l_s keeps a confident row's top entry, -log1p(tail), where s - lse_s rounds it to 0, and
    d = log q - log p = ((s - t) - c) - g keeps its digits where p and q are close (docs/design.md §2.6).
    All [N], compute dtype."""

    m_s: Tensor
    ll_s: Tensor
    m_t: Tensor
    ll_t: Tensor
    c: Tensor
    g: Tensor

    FIELDS = ("m_s", "ll_s", "m_t", "ll_t", "c", "g")

    def rows(self, r0: int, r1: int) -> "RowNorm":
        return RowNorm(*(getattr(self, k)[r0:r1] for k in self.FIELDS))

    def stacked(self) -> Tensor:
        return torch.stack([getattr(self, k) for k in self.FIELDS])

    def log_probs(self, s: Tensor, t: Tensor) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
        """(log p, log q, d = log q - log p, top) of a chunk of tempered logits s, t. d is formed from the
        logits' difference, so it keeps its digits where p and q are close; top marks the student's
        maximal entry in rows where it is unique (tail < 1)."""
        lq = (s - self.m_s[:, None]) - self.ll_s[:, None]
        lp = (t - self.m_t[:, None]) - self.ll_t[:, None]
        d = ((s - t) - self.c[:, None]) - self.g[:, None]
        top = (s == self.m_s[:, None]) & (self.ll_s < LOG2)[:, None]
        return lp, lq, d, top


@dataclass
class RowStats:
    """What the backward needs per row (all [N], compute dtype)."""

    lse_s: Tensor
    lse_t: Tensor
    lse_z: Optional[Tensor]  # student log-sum-exp at temperature 1 (hard-label CE)
    sum_u: Tensor  # sum_j v_j (divergences.row_terms; tvd: divergences.tvd_sum_u)
    kd: Tensor  # divergence per row
    ce: Optional[Tensor]  # cross-entropy per row
    # [N, vocab chunks, 2] largest tempered student/teacher logits per chunk (Triton constant-memory
    # mode with grad_filter: grad_filter.negligible_tiles); not carried by rows()
    chunk_max: Optional[Tensor] = None
    norm: Optional[RowNorm] = None  # the split normalizers (None: lse_s, lse_t with log l = 0)
    v_rest: Optional[Tensor] = None  # sum_u without the student's top entry (divergences.row_grad)
    # [N, columns] the fields above are column views of, where the Triton finish kernel formed them in one
    # tensor (hidden.kernels.row_stats): the gradient kernel reads it as it is
    packed: Optional[Tensor] = None

    def rows(self, r0: int, r1: int) -> "RowStats":
        """The statistics of rows [r0, r1)."""
        return RowStats(
            *(
                None if v is None else v[r0:r1]
                for v in (self.lse_s, self.lse_t, self.lse_z, self.sum_u, self.kd, self.ce)
            ),
            chunk_max=None,
            norm=None if self.norm is None else self.norm.rows(r0, r1),
            v_rest=None if self.v_rest is None else self.v_rest[r0:r1],
            packed=None if self.packed is None else self.packed[r0:r1],
        )

    def row_norm(self) -> RowNorm:
        if self.norm is not None:
            return self.norm
        zero = torch.zeros_like(self.lse_s)
        # log l_s = log 2: no top entry singled out
        return RowNorm(m_s=self.lse_s, ll_s=zero + LOG2, m_t=self.lse_t, ll_t=zero, c=self.lse_s - self.lse_t, g=zero)


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
    # every divergence keeps the centred sums on one side (the student for reverse_kl, else the teacher):
    # the KLs' values and every row's lse gap come from them (docs/design.md §2.6)
    rev = cfg.divergence == "reverse_kl"
    fwd = not rev
    st = FirstPass(
        s=Online.empty(n, acc, dev, with_acc=rev, with_lost=fwd),
        t=Online.empty(n, acc, dev, with_acc=fwd, with_lost=rev),
        z=Online.empty(n, acc, dev) if cfg.raw_lse else None,
        z_label=torch.zeros(n, dtype=acc, device=dev),
    )
    for c0 in range(lo, hi, chunk):
        c1 = min(c0 + chunk, hi)
        z = chunk_logits(xs, ws, bs, c0, c1, acc=acc, softcap=cfg.softcap_s)
        s = z / cfg.temperature
        t = chunk_logits(xt, wt, bt, c0, c1, acc=acc, softcap=cfg.softcap_t) / cfg.temperature
        if rev:  # lost: where the accumulating side's r leaves the entry out (Online.update's `near`)
            e_s, sc_s = st.s.update(s, s - t)
            far = (t - s > FAR_NATS) | ((t - s) + st.s.ref[:, None] > FAR_NATS)
            st.t.update(t, lost=(e_s == 0) | far, other_scale=sc_s)
        elif fwd:
            e_t, sc_t = st.t.update(t, t - s)
            far = (s - t > FAR_NATS) | ((s - t) + st.t.ref[:, None] > FAR_NATS)
            st.s.update(s, lost=(e_t == 0) | far, other_scale=sc_t)
        if st.z is not None:
            st.z.update(z)
        if cfg.with_ce:
            st.z_label += gather_label_logit(z, labels, c0, c1)
    return st


def second_pass(ops: Operands, cfg: LossConfig, norm: RowNorm, lo, hi, chunk) -> Tuple[Tensor, ...]:
    """Row sums over [lo, hi), given the final normalizers: (sum phi, sum v, sum v2, sum v3) of
    ``divergences.row_terms``; for every divergence but tvd, v2 is v without the student's top entry
    and v3 is 0."""
    xs, xt, ws, wt, bs, bt = ops
    acc = compute_dtype(xs.dtype)
    phi_sum = torch.zeros_like(norm.m_s)
    u_sum = torch.zeros_like(norm.m_s)
    u2_sum = torch.zeros_like(norm.m_s)
    u3_sum = torch.zeros_like(norm.m_s)
    for c0 in range(lo, hi, chunk):
        c1 = min(c0 + chunk, hi)
        s = chunk_logits(xs, ws, bs, c0, c1, acc=acc, softcap=cfg.softcap_s) / cfg.temperature
        t = chunk_logits(xt, wt, bt, c0, c1, acc=acc, softcap=cfg.softcap_t) / cfg.temperature
        lp, lq, d, top = norm.log_probs(s, t)
        phi, v, v2, v3 = dv.row_terms(cfg.divergence, lp, lq, d, cfg.param)
        phi_sum += phi.sum(-1)
        u_sum += v.sum(-1)
        u2_sum += (torch.where(top, torch.zeros_like(v), v) if v2 is None else v2).sum(-1)
        if v3 is not None:
            u3_sum += v3.sum(-1)
    return phi_sum, u_sum, u2_sum, u3_sum


def _centred(own: Online, other: Online, lse_gap: Tensor) -> Tuple[Tensor, Tensor]:
    """(a / l, G) for the side p = softmax(x) that accumulated the centred sums, y the other side:
    G = lse_y - lse_x + ref, so that KL(p || softmax(y)) = a / l + G.

    G = log1p(r / l) - log1p(-b_y / l_y) exactly (Online's docstring): r sums p_j expm1(-(d_j - ref))
    over the entries where p_j is representable, b_y / l_y is the share of y's mass on the others (p_j
    = 0 in float32: a mask, a gap of ~100 nats, a cold temperature). Taken in float64 from the row's own
    sums it keeps its digits when x and y are close up to a shift, where the difference of two ~log V
    log-sum-exps would leave their fp32 rounding (~1e-7 nats) in a KL that may be ~1e-4, or a confident
    row's ~1e-9. When the form has nothing to gain (|r / l| >= 1/2, or most of y's mass dropped) or is
    not finite, G = ref + lse_y - lse_x (lse_gap): no cancellation there."""
    l_own = 1.0 + own.tail.double()
    a_l = own.a.double() / l_own
    r = own.r.double() / l_own
    lost = other.b.double() / (1.0 + other.tail.double())
    close = torch.isfinite(r) & (r.abs() < 0.5) & torch.isfinite(a_l) & (lost >= 0) & (lost < 0.5)
    r, lost = torch.where(close, r, 0.0), torch.where(close, lost, 0.0)
    # log1p(r) - log1p(-lost) as one log: log1p((r + lost) / (1 - lost))
    g = torch.where(close, torch.log1p((r + lost) / (1.0 - lost)), own.ref.double() + lse_gap.double())
    return a_l.to(own.a.dtype), g.to(own.a.dtype), close


def row_norm(fp: "FirstPass", rev: bool) -> Tuple[RowNorm, Tensor, Tensor]:
    """(RowNorm, a / l, G) of merged first-pass state (``_centred``; rev: the student accumulated). Where
    the close form does not apply, the gap is split at the maxima instead, c = m_s - m_t and g = log l_s
    - log l_t: there c = -+ref and G may be two copies of ~100 nats that cancel (the accumulating side's
    top entry where the other side lies far below), leaving their fp32 rounding in every d."""
    ll_s, ll_t = torch.log1p(fp.s.tail), torch.log1p(fp.t.tail)
    finite = torch.isfinite(fp.s.m) & torch.isfinite(fp.t.m)
    if (fp.s if rev else fp.t).ref is None:  # no centred sums (the Triton first pass of jsd)
        zero = torch.zeros_like(ll_s)
        c = torch.where(finite, fp.s.m - fp.t.m, zero)
        return RowNorm(m_s=fp.s.m, ll_s=ll_s, m_t=fp.t.m, ll_t=ll_t, c=c, g=ll_s - ll_t), zero, zero
    gap = (fp.s.m - fp.t.m) + (ll_s - ll_t)  # lse_s - lse_t
    if rev:
        a_l, g_own, close = _centred(fp.s, fp.t, -gap)
        c, g = fp.s.ref, -g_own  # lse_s - lse_t = ref - G
    else:
        a_l, g_own, close = _centred(fp.t, fp.s, gap)
        c, g = -fp.t.ref, g_own  # lse_s - lse_t = G - ref
    c = torch.where(close, c, torch.where(finite, fp.s.m - fp.t.m, c))
    g = torch.where(close, g, torch.where(finite, ll_s - ll_t, g))
    return RowNorm(m_s=fp.s.m, ll_s=ll_s, m_t=fp.t.m, ll_t=ll_t, c=c, g=g), a_l, g_own


def finish_stats(
    fp: FirstPass,
    cfg: LossConfig,
    sums: Optional[Tuple[Tensor, ...]],
    normed: Optional[Tuple[RowNorm, Tensor, Tensor]] = None,
) -> RowStats:
    """Turn (globally merged) first-pass state and second-pass sums into RowStats. normed: row_norm(fp, ...)
    where the caller has it (the second pass took it): a dozen small ops per block of rows fewer.

    sum_u is what ``divergences.row_grad`` reads: 0 for forward_kl, the value for reverse_kl, the sum
    of v for the others (tvd: ``divergences.tvd_sum_u``). Every value is clamped at 0 (every divergence
    is >= 0; rounding may leave -1e-12 on a row where p = q), NaN kept."""
    norm, a_l, g_own = normed if normed is not None else row_norm(fp, cfg.divergence == "reverse_kl")
    lse_s, lse_t = fp.s.lse(), fp.t.lse()
    v_rest = None
    if cfg.divergence == "forward_kl":
        kd = a_l + g_own
        sum_u = torch.zeros_like(kd)
    elif cfg.divergence == "reverse_kl":
        kd = a_l + g_own
        kd = torch.where(kd < 0, torch.zeros_like(kd), kd)  # the gradient reads the clamped value
        sum_u = kd
        # sum over j != top of q_j d_j = a / l + (1 - q_top) d_top, d_top = G (a refers to the top's d)
        v_rest = a_l - torch.expm1(-norm.ll_s) * g_own
    elif cfg.divergence == "tvd":
        kd = sums[0]
        sum_u, v_rest = dv.tvd_sum_u(sums[1], sums[2], sums[3])
    else:
        kd, sum_u, v_rest = sums[0], sums[1], sums[2]
    kd = torch.where(kd < 0, torch.zeros_like(kd), kd)
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
    return RowStats(lse_s=lse_s, lse_t=lse_t, lse_z=lse_z, sum_u=sum_u, kd=kd, ce=ce, norm=norm, v_rest=v_rest)


def grad_chunk(z, t, labels, st: RowStats, cfg: LossConfig, kd_scale, ce_scale, lo: int) -> Tensor:
    """d loss / d raw student logits for one chunk: z (softcapped) student logits at temperature 1,
    t tempered teacher logits.

    kd_scale and ce_scale are per-row multipliers (upstream gradient, weights, row mask).
    """
    norm = st.row_norm()
    lp, lq, d, top = norm.log_probs(z / cfg.temperature, t)
    v_rest = None if st.v_rest is None else st.v_rest[:, None]
    g = (
        dv.row_grad(
            cfg.divergence,
            lp,
            lq,
            d,
            cfg.param,
            sum_u=st.sum_u[:, None],
            top=top,
            log_l=norm.ll_s[:, None],
            v_rest=v_rest,
        )
        * (kd_scale / cfg.temperature)[:, None]
    )
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
    fp = first_pass(ops, labels, cfg, 0, V, chunk=chunk)
    sums, normed = None, None
    if cfg.divergence not in dv.ONE_PASS:
        normed = row_norm(fp, False)
        sums = second_pass(ops, cfg, normed[0], 0, V, chunk=chunk)
    return finish_stats(fp, cfg, sums, normed)


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
        z = chunk_logits(xs, ws, bs, c0, c1, acc=acc, softcap=cfg.softcap_s)
        t = chunk_logits(xt, wt, bt, c0, c1, acc=acc, softcap=cfg.softcap_t) / cfg.temperature
        g = grad_chunk(
            z, t, None if labels is None else labels - lo, st, cfg, kd_scale=kd_scale, ce_scale=ce_scale, lo=c0
        )
        if cfg.filter_eps is None:
            head_grads_from_chunk(g, xs_acc, ws, c0, c1, dx=dx, dw=dw, db=db)
            continue
        if db is not None:  # db is never filtered
            db[c0:c1] = g.sum(0).to(db.dtype)
        active = gf.active_columns(g, cfg.filter_eps)
        idx = gf.compacted(active)
        if idx is None:  # more than half active: not filtered
            head_grads_from_chunk(g, xs_acc, ws, c0, c1, dx=dx, dw=dw, db=None)
        else:
            gf.add_column_grads(g, idx, xs_acc, ws[c0:c1], dx, dw=None if dw is None else dw[c0:c1], first=True)
    return dx, dw, db


class TorchLocal:
    """``first_pass`` / ``second_pass`` / ``backward`` over a (local) head in vocab chunks: the pieces a
    wrapper (vocab-parallel) merges across ranks. ``triton_function.TritonLocal`` has the same interface."""

    def __init__(self, xs, ws, cfg: LossConfig, memory_budget=None):
        self.chunk = max(1, cfg.chunk_V or auto_chunk_v(xs.shape[0], max(ws.shape[0], 1), device=xs.device))

    def first_pass(self, ops: Operands, labels, cfg: LossConfig) -> FirstPass:
        return first_pass(ops, labels, cfg, 0, ops.vocab, chunk=self.chunk)

    def second_pass(self, ops: Operands, cfg: LossConfig, norm: RowNorm):
        return second_pass(ops, cfg, norm, 0, ops.vocab, chunk=self.chunk)

    def backward(self, ops: Operands, labels, st: RowStats, cfg: LossConfig, kd_scale, ce_scale, need_w=True):
        return backward_chunks(ops, labels, st, cfg, kd_scale, ce_scale=ce_scale, chunk=self.chunk, need_w=need_w)


class ChunkedDistill(PartsFunction):
    """Per-row (total, kd, ce) losses; gradients to xs, ws and bs (the teacher is constant)."""

    STUDENT_INPUTS = (0, 2, 4)

    @staticmethod
    def forward(ctx, xs, xt, ws, wt, bs, bt, labels, mask, cfg: LossConfig):
        chunk = cfg.chunk_V or auto_chunk_v(xs.shape[0], ws.shape[0], device=xs.device)
        st = compute_stats(Operands(xs=xs, xt=xt, ws=ws, wt=wt, bs=bs, bt=bt), labels, cfg, chunk)
        total, kd, ce = combine_rows(st.kd, st.ce, mask, cfg)
        ctx.save_for_backward(xs, xt, ws, wt, bs, bt, labels, mask)
        ctx.stats, ctx.cfg, ctx.chunk = st, cfg, chunk
        return ChunkedDistill.parts(ctx, total, kd, ce)

    @staticmethod
    @ck.no_double_backward
    def backward(ctx, grad_total, _gkd, _gce):
        xs, xt, ws, wt, bs, bt, labels, mask = ctx.saved_tensors
        cfg = ctx.cfg
        kd_scale, ce_scale = row_scales(grad_total.to(ctx.stats.lse_s.dtype), mask.to(ctx.stats.lse_s.dtype), cfg)
        dx, dw, db = backward_chunks(
            Operands(xs=xs, xt=xt, ws=ws, wt=wt, bs=bs, bt=bt),
            labels,
            ctx.stats,
            cfg,
            kd_scale,
            ce_scale=ce_scale,
            chunk=ctx.chunk,
            need_w=ChunkedDistill.head_needed(ctx),
        )
        return ChunkedDistill.input_grads(ctx, dx.to(xs.dtype) if ctx.needs_input_grad[0] else None, dw, db)


def chunked_rows(ops: Operands, *, labels, mask, cfg: LossConfig):
    """Entry used by the public API (checked operands, rows flattened): per-row (total, kd, ce)."""
    return ChunkedDistill.apply(*ops, labels, mask, cfg)
