"""Triton backend of the hidden-state losses: two modes over one set of row kernels.

fast (default): token-chunked. For C rows, both [C, V] logit slabs come from cuBLAS with fp32
  output; the row kernels compute the statistics and write the gradient slab (bf16, over the
  teacher slab's bytes); then dX = G W and dW += G^T X. With a scalar reduction the gradient is
  formed in the forward pass (the slabs are already there), so fwd+bwd costs the four GEMMs of
  the floor plus the row passes. C follows `memory_budget` (default 896 MiB of slabs).
constant_memory (chunk_V given): rows in blocks of R, vocab in chunks of chunk_V; slabs are
  [R, chunk_V], the forward keeps per-row statistics only, the backward recomputes each slab.
  Memory O(R * chunk_V + R * D), independent of V; two extra GEMMs (the recompute).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from .. import divergences as dv
from ..core import checks as ck
from ..core.online import Online, spans
from ..core.ops import grad_needed, kernel_operands, linear_logits, mm_acc, mm_acc_add, softcap_
from ..core.reduction import PartsFunction, combine_rows, reduce_rows, reduction_scale, row_scales, row_upstream
from ..core.slabs import accumulate_dw, alloc_grads, finish_grads, keep_for_backward, take_precomputed_grads
from . import grad_filter as gf
from . import kernels as tr
from . import kernels_filter as kf
from .chunked import FirstPass, RowNorm, RowStats
from .config import LossConfig, Operands

F32 = torch.float32
DEFAULT_FAST_BUDGET = 896 << 20  # bytes of fp32 logit slabs in the fast mode (peak stays under 1 GiB)
DEFAULT_CONST_BUDGET = 48 << 20  # bytes of slabs + dX block in the constant-memory mode


@dataclass(frozen=True)
class Plan:
    mode: str
    row_chunk: int
    vocab_chunk: int
    reduction: str
    dw_fp32: bool


def make_plan(n: int, v: int, ds: int, dtype, mode, chunk_V, memory_budget, reduction) -> Plan:
    v = max(v, 1)  # an empty vocabulary shard (vocab-parallel) still gets a valid plan
    # mode and memory_budget were validated by the public API (nitrobrew.core.checks.check_mode)
    if mode is None:
        mode = "constant_memory" if chunk_V is not None else "fast"
    if mode == "fast":
        budget = memory_budget or DEFAULT_FAST_BUDGET
        rows = _round_rows(budget // (8 * v))
        # fp32 dW accumulation when it fits in the budget beside the slabs, else the head's dtype
        dw_fp32 = dtype == F32 or (v * ds * 4 + min(rows, n) * v * 8 <= budget)
        return Plan(mode, max(1, min(rows, max(n, 1))), v, reduction, dw_fp32)
    vc = min(chunk_V or 4096, v)
    budget = memory_budget or DEFAULT_CONST_BUDGET
    rows = _round_rows(budget // (8 * vc + 4 * ds))
    return Plan(mode, max(1, min(rows, max(n, 1))), vc, reduction, dtype == F32)


def _round_rows(rows: int) -> int:
    return rows - rows % 64 if rows >= 128 else max(rows, 1)


def _slabs(ops: Operands, v0, v1, cfg):
    xs, xt, ws, wt, bs, bt = ops
    z = linear_logits(xs, ws[v0:v1], None if bs is None else bs[v0:v1], F32)
    t = linear_logits(xt, wt[v0:v1], None if bt is None else bt[v0:v1], F32)
    return softcap_(z, cfg.softcap_s), softcap_(t, cfg.softcap_t)


def _first_pass_from_state(st: torch.Tensor, cfg: LossConfig, centred: bool = True) -> FirstPass:
    # the centred sums on the side that accumulates them (the student for reverse_kl, else the teacher;
    # a = 0 but for the KLs), unless the first pass kept each side's (max, tail) only (jsd, centred=False)
    centred = tr.keeps_centred(cfg, centred)
    col = tr.column
    own = dict(a=col(st, tr.ACC), r=col(st, tr.REL), ref=col(st, tr.REF)) if centred else {}
    lost = dict(b=col(st, tr.LOST)) if centred else {}  # on the other side's scale
    rev = cfg.divergence == "reverse_kl"
    return FirstPass(
        s=Online(col(st, tr.M_S), col(st, tr.T_S), **(own if rev else lost)),
        t=Online(col(st, tr.M_T), col(st, tr.T_T), **(lost if rev else own)),
        z=Online(col(st, tr.M_Z), col(st, tr.T_Z)) if cfg.raw_lse else None,
        z_label=col(st, tr.Z_LABEL),
    )


def block_stats(ops: Operands, labels, cfg: LossConfig, vchunk: int, chunk_max=None):
    """RowStats of a block of rows, streaming the vocab; also returns the slabs if there was one.
    chunk_max ([rows, chunks, 2]): gets each vocab chunk's largest tempered logits per row."""
    V = ops.vocab
    st = tr.empty_state(ops.xs.shape[0], ops.xs.device)  # the first slab's launch writes it whole
    slabs = None
    for ci, (v0, v1) in enumerate(spans(V, vchunk)):
        slabs = _slabs(ops, v0, v1, cfg)
        cm = None if chunk_max is None else chunk_max[:, ci]
        # jsd: no centred sums (§2.6)
        tr.launch_stats(*slabs, st, labels, v0, cfg, 1, cm, centred=False, fresh=ci == 0)
    # the row math between the passes in one launch each (chunked.row_norm / finish_stats in Triton)
    vals = torch.empty(st.shape[0], int(tr.NROW), dtype=F32, device=st.device)
    if cfg.divergence not in dv.ONE_PASS:
        tr.launch_finish(st, vals, cfg, final=False, centred=False)
        for v0, v1 in spans(V, vchunk):
            if vchunk < V:
                slabs = _slabs(ops, v0, v1, cfg)
            tr.launch_stats(*slabs, vals, None, v0, cfg, 2)
    tr.launch_finish(st, vals, cfg, final=True, centred=False)
    return tr.row_stats(vals, cfg), (slabs if vchunk >= V else None)


def _grad_buffer(z: torch.Tensor, t: torch.Tensor, dtype) -> torch.Tensor:
    """Where the gradient slab goes: over z for fp32 inputs, over t's bytes for 16-bit ones (rows padded
    to twice their length). On the CPU (the interpreter) a 16-bit slab gets a buffer of its own: there a
    one-thread bf16 matmul reads the padded rows' spare halves (NaN dX under `pytest -n 2`, torch 2.13)."""
    if dtype == F32:
        return z
    if z.device.type == "cpu":
        return torch.empty(z.shape, dtype=dtype)
    return t.view(dtype)[:, : t.shape[1]]


def _rowvals(rs: RowStats) -> torch.Tensor:
    """The gradient kernel's per-row values [N, NROW] (kernels: the split normalizers, lse_z, sum_u,
    v_rest): hidden_finish_kernel's tensor where it formed them."""
    if rs.packed is not None:
        return rs.packed
    lse_z = rs.lse_z if rs.lse_z is not None else rs.lse_s
    v_rest = rs.v_rest if rs.v_rest is not None else torch.zeros_like(rs.sum_u)
    return tr.new_gradvals(rs.row_norm().stacked(), lse_z, rs.sum_u, v_rest)


def block_grads(
    ops: Operands,
    labels,
    rs,
    kd_scale,
    ce_scale,
    cfg,
    vchunk,
    dx_out,
    dw,
    db,
    first_rows: bool,
    slabs=None,
    skip=None,
    column_filter: bool = True,
):
    """Gradient of a block of rows: writes dx_out (its rows), accumulates dw (written by the
    first block of rows) and db. skip[c]: vocab chunk c's gradient is negligible (not recomputed)."""
    xs, ws = ops.xs, ops.ws
    V = ws.shape[0]
    rowvals = _rowvals(rs)
    filtering = cfg.filter_eps is not None and column_filter
    dx_acc = None if vchunk >= V else torch.zeros(xs.shape, dtype=F32, device=xs.device)
    if filtering:  # one capacity per block of rows (host work per slab counts in the narrow slabs)
        fractions = gf.fractions_for(xs.device, min(vchunk, V), cfg.filter_eps)
        cap = fractions.capacity(min(vchunk, V))
    for ci, (v0, v1) in enumerate(spans(V, vchunk)):
        if skip is not None and skip[ci]:
            if first_rows and dw is not None:
                dw[v0:v1].zero_()  # the first block writes dw
            continue
        z, t = slabs if slabs is not None else _slabs(ops, v0, v1, cfg)
        g = _grad_buffer(z, t, xs.dtype)
        rowmax = torch.empty(g.shape[0], dtype=F32, device=xs.device) if filtering else None
        tr.launch_grad(z, t, g, rowvals, kd_scale, ce_scale, labels, v0, cfg, rowmax)
        if db is not None:  # before the filter: db is never filtered
            db[v0:v1] += g.sum(0, dtype=F32)
        w_chunk, dw_chunk = ws[v0:v1], None if dw is None else dw[v0:v1]
        if filtering:
            _filtered_column_grads(
                g,
                rowmax,
                cfg.filter_eps,
                xs,
                w_chunk,
                dx_out=dx_out,
                dx_acc=dx_acc,
                dw=dw_chunk,
                first=first_rows,
                fractions=fractions if v0 == 0 else None,
                cap=cap if v1 - v0 == min(vchunk, V) else v1 - v0,
            )
        else:
            _all_column_grads(g, xs, w_chunk, dx_out, dx_acc, dw=dw_chunk, first=first_rows)
        del z, t, g
    if dx_acc is not None and dx_out is not None:
        dx_out.copy_(dx_acc)


def _filtered_column_grads(g, rowmax, eps, xs, w, dx_out, dx_acc, dw, first: bool, fractions, cap: int) -> None:
    """As _all_column_grads, over the slab's active columns only when it is filtered (grad_filter.py);
    no host synchronization. cap: the compacted products' columns (n_cols: dense); the slab's active
    count goes to `fractions` when given."""
    n_cols = g.shape[1]
    active, count = kf.launch_filter_columns(g, rowmax, eps)
    if fractions is not None:
        fractions.record(count, n_cols)
    if cap >= n_cols:
        kf.launch_drop_columns(g, active, count)  # zero the dropped columns (a filtered slab)
        _all_column_grads(g, xs, w, dx_out, dx_acc, dw=dw, first=first)
        return
    perm = gf.active_first(active)
    acc = dx_acc
    if acc is None and dx_out is not None:
        acc = torch.zeros(dx_out.shape, dtype=F32, device=g.device)
    kept = gf.kept_columns(count, n_cols)
    gf.add_column_grads(
        g, perm[:cap], xs, w, acc, dw=dw, first=first, kept=kept, scatter_add=kf.launch_scatter_add_rows
    )
    kf.launch_overflow(g, perm, kept, cap, xs, w, acc, dw)
    if acc is not dx_acc:
        dx_out.copy_(acc)


def _all_column_grads(g, xs, w, dx_out, dx_acc, dw, first: bool) -> None:
    """dX (written to dx_out, or added to the fp32 dx_acc) and dW of one gradient slab."""
    if dx_out is not None:
        if dx_acc is None and dx_out.dtype == g.dtype:
            torch.mm(g, w, out=dx_out)  # g has the heads' dtype: cuBLAS, fp32 accumulate
        elif dx_acc is None:
            dx_out.copy_(mm_acc(g, w, dx_out.dtype))
        else:
            mm_acc_add(dx_acc, g, w)
    if dw is not None:
        accumulate_dw(dw, g, xs, first)


def _drops_tiles(cfg: LossConfig, plan: Plan, ws, bs) -> bool:
    """Whether the filter drops whole (rows x vocab chunk) tiles, not columns: the constant-memory mode
    (vocab chunks narrower than the head) with a loss whose bounds hold (grad_filter.negligible_tiles)."""
    return plan.vocab_chunk < ws.shape[0] and gf.tiles_eligible(cfg, bs is not None)


def distill_forward(
    ops: Operands, labels, mask, cfg: LossConfig, plan: Plan, need_grad: bool, tile_bounds: bool = False
):
    """Reduced (total, kd, ce), the gradients (dx, dw, db) when they are formed here (fast mode,
    scalar reduction, need_grad) else None, and the row statistics the backward needs otherwise
    (with the per-chunk maxima the constant-memory filter skips tiles by, when tile_bounds)."""
    xs, ws, bs = ops.xs, ops.ws, ops.bs
    n = xs.shape[0]
    precompute = need_grad and plan.mode == "fast" and plan.reduction != "none"
    grads = alloc_grads(xs, ws, bs, plan.dw_fp32) if precompute else None
    red = reduction_scale(mask, plan.reduction) if precompute else None
    chunk_max = None
    if tile_bounds and need_grad and _drops_tiles(cfg, plan, ws, bs):
        chunk_max = torch.empty(n, -(-ws.shape[0] // plan.vocab_chunk), 2, dtype=F32, device=xs.device)
    stats = []
    for r0, r1 in spans(n, plan.row_chunk):
        lab = None if labels is None else labels[r0:r1]
        rs, slabs = block_stats(
            ops.rows(r0, r1), lab, cfg, plan.vocab_chunk, None if chunk_max is None else chunk_max[r0:r1]
        )
        stats.append(rs)
        if precompute:
            kd_scale, ce_scale = row_scales(red.expand(r1 - r0), mask[r0:r1], cfg)
            block_grads(
                ops.rows(r0, r1),
                lab,
                rs,
                kd_scale,
                ce_scale,
                cfg=cfg,
                vchunk=plan.vocab_chunk,
                dx_out=grads[0][r0:r1],
                dw=grads[1],
                db=grads[2],
                first_rows=r0 == 0,
                slabs=slabs,
            )
        del slabs
    rs = _concat_stats(stats, cfg)
    rs.chunk_max = chunk_max
    rows = combine_rows(rs.kd, rs.ce, mask, cfg)
    out = tuple(reduce_rows(r, mask, plan.reduction, (n,)) for r in rows)
    return out, (finish_grads(*grads, ws, bs) if precompute else None), rs


def distill_backward(ops: Operands, labels, mask, rs: RowStats, cfg: LossConfig, plan: Plan, grad_total):
    """(dx, dw, db) recomputing the slabs from the row statistics of the forward."""
    xs, ws, bs = ops.xs, ops.ws, ops.bs
    n = xs.shape[0]
    kd_scale, ce_scale = row_scales(row_upstream(grad_total, mask, plan.reduction, n), mask, cfg)
    dx, dw, db = alloc_grads(xs, ws, bs, plan.dw_fp32)
    tile_rule = _drops_tiles(cfg, plan, ws, bs)
    skip = None
    if tile_rule and rs.chunk_max is not None:
        skip = gf.negligible_tiles(
            rs.chunk_max, rs.lse_s, rs.lse_t, kd_scale, eps=cfg.filter_eps, rows_per_block=plan.row_chunk
        )
    for bi, (r0, r1) in enumerate(spans(n, plan.row_chunk)):
        sub = rs.rows(r0, r1)
        block_grads(
            ops.rows(r0, r1),
            None if labels is None else labels[r0:r1],
            sub,
            kd_scale[r0:r1].contiguous(),
            ce_scale[r0:r1].contiguous(),
            cfg=cfg,
            vchunk=plan.vocab_chunk,
            dx_out=dx[r0:r1],
            dw=dw,
            db=db,
            first_rows=r0 == 0,
            skip=None if skip is None else skip[bi],
            column_filter=not tile_rule,
        )
    return finish_grads(dx, dw, db, ws, bs)


class TritonDistill(PartsFunction):
    """Reduced (total, kd, ce); gradients to xs, ws, bs."""

    STUDENT_INPUTS = (0, 2, 4)

    @staticmethod
    def forward(ctx, xs, xt, ws, wt, bs, bt, labels, mask, cfg: LossConfig, plan: Plan, need_grad: bool):
        out, grads, rs = distill_forward(
            Operands(xs, xt, ws, wt, bs=bs, bt=bt), labels, mask, cfg, plan, need_grad=need_grad, tile_bounds=True
        )
        keep_for_backward(ctx, cfg, plan, grads, rs, saved=(xs, xt, ws, wt, bs, bt, labels, mask))
        return TritonDistill.parts(ctx, *out)

    @staticmethod
    @ck.no_double_backward
    def backward(ctx, grad_total, _gkd, _gce):
        if ctx.precompute:
            dx, dw, db = take_precomputed_grads(ctx, grad_total)
        else:
            xs, xt, ws, wt, bs, bt, labels, mask = ctx.saved_tensors
            dx, dw, db = distill_backward(
                Operands(xs, xt, ws, wt, bs=bs, bt=bt),
                labels,
                mask,
                ctx.state,
                ctx.cfg,
                plan=ctx.plan,
                grad_total=grad_total,
            )
        return TritonDistill.input_grads(ctx, dx, dw, db)


def _concat_stats(stats, cfg: LossConfig) -> RowStats:
    """The blocks' RowStats as one (each holds its hidden_finish_kernel tensor: block_stats)."""
    return stats[0] if len(stats) == 1 else tr.row_stats(torch.cat([s.packed for s in stats]), cfg)


def triton_distill(
    xs,
    xt,
    ws,
    wt,
    bs,
    bt,
    labels,
    mask,
    cfg: LossConfig,
    reduction: str,
    mode: Optional[str] = None,
    memory_budget: Optional[int] = None,
):
    """Reduced (total, kd, ce) over flattened rows with the Triton row kernels."""
    if xs.dtype == torch.float64:
        raise TypeError("the Triton backend computes in float32; use backend='torch' for float64 inputs")
    plan = make_plan(
        xs.shape[0],
        ws.shape[0],
        ws.shape[1],
        xs.dtype,
        mode,
        chunk_V=cfg.chunk_V,
        memory_budget=memory_budget,
        reduction=reduction,
    )
    need_grad = grad_needed(xs, ws, bs)
    xs, xt, ws, wt, bt, labels = kernel_operands(xs, xt, ws, wt, bt, labels=labels)
    return TritonDistill.apply(xs, xt, ws, wt, bs, bt, labels, mask, cfg, plan, need_grad)


class TritonLocal:
    """``first_pass`` / ``second_pass`` / ``backward`` over a (local) head with the Triton row kernels:
    the interface of ``chunked.TorchLocal``, so that the vocab-parallel wrapper merges their states."""

    def __init__(self, xs, ws, cfg: LossConfig, memory_budget: Optional[int] = None):
        self.plan = make_plan(
            xs.shape[0],
            ws.shape[0],
            ws.shape[1],
            xs.dtype,
            None,
            chunk_V=cfg.chunk_V,
            memory_budget=memory_budget,
            reduction="none",
        )

    def _row_blocks(self, n: int):
        return spans(n, self.plan.row_chunk)

    def first_pass(self, ops: Operands, labels, cfg: LossConfig) -> FirstPass:
        xs, ws = ops.xs, ops.ws
        st = tr.new_state(xs.shape[0], xs.device)
        for r0, r1 in self._row_blocks(xs.shape[0]):
            for v0, v1 in spans(ws.shape[0], self.plan.vocab_chunk):
                z, t = _slabs(ops.rows(r0, r1), v0, v1, cfg)
                tr.launch_stats(z, t, st[r0:r1], None if labels is None else labels[r0:r1], v0, cfg, 1)
        return _first_pass_from_state(st, cfg)

    def second_pass(self, ops: Operands, cfg: LossConfig, norm: RowNorm):
        xs, ws = ops.xs, ops.ws
        st = tr.new_rowvals(norm.stacked())
        for r0, r1 in self._row_blocks(xs.shape[0]):
            for v0, v1 in spans(ws.shape[0], self.plan.vocab_chunk):
                z, t = _slabs(ops.rows(r0, r1), v0, v1, cfg)
                tr.launch_stats(z, t, st[r0:r1], None, v0, cfg, 2)
        return tr.second_pass_sums(st)

    def backward(self, ops: Operands, labels, rs: RowStats, cfg: LossConfig, kd_scale, ce_scale, need_w=True):
        """(dX in fp32 over the local vocabulary, dW, db)."""
        xs, ws, bs = ops.xs, ops.ws, ops.bs
        dx = torch.zeros(xs.shape, dtype=F32, device=xs.device)
        dw = torch.empty_like(ws) if need_w else None
        db = torch.zeros(bs.shape, dtype=F32, device=bs.device) if (need_w and bs is not None) else None
        for r0, r1 in self._row_blocks(xs.shape[0]):
            sub = rs.rows(r0, r1)
            block_grads(
                ops.rows(r0, r1),
                None if labels is None else labels[r0:r1],
                sub,
                kd_scale[r0:r1].float().contiguous(),
                ce_scale[r0:r1].float().contiguous(),
                cfg=cfg,
                vchunk=self.plan.vocab_chunk,
                dx_out=dx[r0:r1],
                dw=dw,
                db=db,
                first_rows=r0 == 0,
            )
        return dx, dw, None if db is None else db.to(bs.dtype)
