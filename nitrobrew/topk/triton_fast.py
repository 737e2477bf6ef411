"""Fast (token-chunked) mode of ``topk_kl(normalize="full")`` on the GPU: cuBLAS slabs, Triton row passes.

For a block of C rows:
1. z = x W^T (+ b), an fp32 [C, V] slab from cuBLAS (bf16 operands, fp32 output: the logits are
   never rounded to bf16);
2. the logits at the row's stored ids (and at its label) are gathered, then the ids' entries of
   the slab are set to -inf, so that one row pass (``kf.topk_fast_lse_kernel``) gives the log-sum-exp
   over the OTHER entries directly, as (max, rescaled sum): the student's mass outside the ids, exact
   however small;
3. the [C, K] math of ``rowmath`` gives the losses and the gradient coefficients (the student's
   normalizer split over the ids and that bucket: docs/design.md §2.6);
4. ``kernels_fast.topk_fast_grad_kernel`` writes the gradient slab in the heads' dtype over the slab's own bytes
   (the bucket's coefficient at the other entries); the ids' gradients (computed in fp32 on [C, K], their
   whole KD gradient) are added at their columns (the kernel wrote exact zeros there); then dX = G W,
   dW += G^T X, db += sum G.

With a scalar reduction the gradient is formed in the forward while the slab exists, so fwd+bwd is
the three GEMMs of the floor plus two passes over the slab; with reduction="none" (or a later
non-unit upstream gradient) the backward recomputes the slabs. C follows ``memory_budget`` (default
``DEFAULT_BUDGET`` bytes of slab). The other mode ("constant_memory", ``triton_cm``) keeps
O(rows * K) memory with fused CCE-style kernels and is several times slower.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import List, Optional

import torch

from ..core import checks as ck
from ..core.online import Online, spans
from ..core.ops import linear_logits, softcap_, softcap_grad_
from ..core.reduction import PartsFunction, combine_rows, reduce_rows, reduction_scale, row_scales, row_upstream
from ..core.slabs import accumulate_dw, alloc_grads, finish_grads, keep_for_backward, take_precomputed_grads
from ..core.tl_utils import NUM_WARPS, row_block
from . import kernels_fast as kf
from .chunked import finish
from .rowmath import RowResult, TopKConfig, full_lse

F32 = torch.float32
DEFAULT_BUDGET = 896 << 20  # bytes of fp32 logit slab per row block (the gradient slab reuses them)


@dataclass(frozen=True)
class FastPlan:
    row_chunk: int
    reduction: str
    dw_fp32: bool


def make_fast_plan(
    n: int, v: int, d: int, dtype: torch.dtype, memory_budget: Optional[int], reduction: str
) -> FastPlan:
    budget = memory_budget or DEFAULT_BUDGET
    rows = budget // (4 * max(v, 1))
    rows = rows - rows % 64 if rows >= 128 else max(rows, 1)
    rows = max(1, min(rows, max(n, 1)))
    # an fp32 dW accumulator when it fits in the budget beside the slab, else the head's dtype (cuBLAS
    # adds each block's product in fp32 and rounds once per block)
    dw_fp32 = dtype == F32 or v * d * 4 + rows * v * 4 <= budget
    return FastPlan(rows, reduction, dw_fp32)


@dataclass
class BlockRows:
    """One row block's statistics: the raw logits at the ids (and label), and the forward's results."""

    z_ids: torch.Tensor  # [C, K] fp32
    res: RowResult
    lse_z: Optional[torch.Tensor]  # [C] raw full log-sum-exp (CE), else None
    ce: Optional[torch.Tensor]  # [C] per-row CE, else None


def _gradient_slab(z: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Where the gradient goes: over z itself (fp32), or over the first half of each fp32 row (16-bit)."""
    if dtype == F32:
        return z
    return z.view(dtype)[:, : z.shape[1]]


def exclude_ids(z: torch.Tensor, ids: torch.Tensor, valid: torch.Tensor) -> None:
    """Set z[r, ids[r, k]] = -inf at the valid entries (adds -inf there and 0 at padding entries, whose
    ids may repeat: no write races)."""
    add = torch.zeros(ids.shape, dtype=z.dtype, device=z.device).masked_fill_(valid, float("-inf"))
    z.scatter_add_(1, ids, add)


def _rest_lse(z: torch.Tensor, cfg: TopKConfig) -> torch.Tensor:
    """[C, 3] per row: the tempered logits' max and rescaled sum (cols 0, 1), the raw logits' log-sum-exp
    (col 2, CE at T != 1)."""
    rows, n_cols = z.shape
    raw = cfg.with_ce and cfg.temperature != 1.0
    out = torch.empty(rows, 3, dtype=F32, device=z.device)
    if rows:
        kf.launch_lse(
            (rows,),
            z,
            out,
            z.stride(0),
            n_cols,
            1.0 / cfg.temperature,
            RAW=raw,
            BLOCK_V=row_block(n_cols),
            num_warps=NUM_WARPS,
        )
    return out


def block_forward(z, ids, lp, valid, labels, cfg: TopKConfig) -> BlockRows:
    """Statistics of a row block from its slab z (which leaves with -inf at the valid ids)."""
    z_ids = z.gather(1, ids)
    z_label = z.gather(1, labels.clamp_min(0)[:, None]).squeeze(1) if cfg.with_ce else None
    exclude_ids(z, ids, valid)
    rest = _rest_lse(z, cfg)
    s_state = Online(rest[:, 0], rest[:, 1] - 1.0)  # tail = l - 1 (l in [1, n]: its log keeps ~eps)
    z_state = None
    if cfg.with_ce and cfg.temperature != 1.0:  # Online's tail 0: l = 1 (the state is the lse itself)
        z_state = Online(full_lse(z_ids, valid, rest[:, 2]), torch.zeros_like(rest[:, 2]))
    res, lse_z, ce = finish(
        z_ids=z_ids.reshape(-1), lp=lp.to(F32), valid=valid, s_state=s_state, z_state=z_state, z_label=z_label, cfg=cfg
    )
    return BlockRows(z_ids, res, lse_z, ce)


def _row_coefficients(grad_rows, mask, blk: BlockRows, cfg: TopKConfig):
    """(slab coefficients [C, 4] = (a, lse_a, b, lse_b) of ``kernels_fast.topk_fast_grad_kernel``, id gradients
    [C, K] fp32 without the label's one-hot)."""
    dt = blk.res.kd.dtype
    kd_scale, ce_scale = row_scales(grad_rows.to(dt), mask.to(dt), cfg)
    kd_scale = kd_scale / cfg.temperature
    g_ids = blk.res.sparse * kd_scale[:, None]  # the ids' whole KD gradient
    a = blk.res.tail * kd_scale  # the other entries': the bucket's
    lse_a = torch.where(torch.isfinite(blk.res.lse_tail), blk.res.lse_tail, torch.zeros_like(blk.res.lse_tail))
    b = lse_b = torch.zeros_like(a)
    if cfg.with_ce:
        b, lse_b = ce_scale, blk.lse_z
        g_ids = g_ids + b[:, None] * torch.exp(blk.z_ids - lse_b[:, None])
    return torch.stack([a, lse_a, b, lse_b], 1).to(F32).contiguous(), g_ids


def block_backward(
    z, xs, ws, bs, ids, valid, labels, mask, grad_rows, blk: BlockRows, cfg: TopKConfig, dx_out, dw, db, first: bool
) -> None:
    """Gradients of a row block from its slab z (raw logits, -inf at the valid ids): writes dx_out,
    accumulates dw (written by the first block) and db."""
    coef, g_ids = _row_coefficients(grad_rows, mask, blk, cfg)
    kernel_labels = None
    if cfg.with_ce:
        at_label = (ids == labels[:, None]) & valid  # the label's one-hot goes with the ids' gradients
        g_ids = g_ids - torch.where(at_label, coef[:, 2:3], torch.zeros_like(g_ids))
        kernel_labels = torch.where(at_label.any(1), torch.full_like(labels, -1), labels).to(torch.int32)
    g_ids = torch.where(valid, g_ids, torch.zeros_like(g_ids))
    softcap_grad_(g_ids, blk.z_ids, cfg.softcap_s)
    g = _gradient_slab(z, xs.dtype)
    rows, n_cols = z.shape
    kf.launch_grad(
        (rows,),
        z,
        g,
        coef,
        kernel_labels if cfg.with_ce else coef,
        z.stride(0),
        g.stride(0),
        n_cols,
        1.0 / cfg.temperature,
        0.0 if cfg.softcap_s is None else 1.0 / cfg.softcap_s,
        HAS_B=cfg.with_ce,
        SOFTCAP=cfg.softcap_s is not None,
        BLOCK_V=row_block(n_cols),
        num_warps=NUM_WARPS,
    )
    g.scatter_add_(1, ids, g_ids.to(g.dtype))  # the kernel wrote exact zeros at the ids
    if dx_out is not None:
        torch.mm(g, ws, out=dx_out)  # g has xs's dtype: cuBLAS accumulates in fp32
    if dw is not None:
        accumulate_dw(dw, g, xs, first)
    if db is not None:
        db += g.sum(0, dtype=F32)


def _cat_rows(blocks: List[BlockRows]) -> BlockRows:
    if len(blocks) == 1:
        return blocks[0]
    cat = lambda vals: None if vals[0] is None else torch.cat(vals)  # noqa: E731
    res = RowResult(*(cat([getattr(b.res, f.name) for b in blocks]) for f in fields(RowResult)))
    return BlockRows(cat([b.z_ids for b in blocks]), res, cat([b.lse_z for b in blocks]), cat([b.ce for b in blocks]))


def _slice_rows(blk: BlockRows, r0: int, r1: int) -> BlockRows:
    sl = lambda t: None if t is None else t[r0:r1]  # noqa: E731
    res = RowResult(*(sl(getattr(blk.res, f.name)) for f in fields(RowResult)))
    return BlockRows(blk.z_ids[r0:r1], res, sl(blk.lse_z), sl(blk.ce))


class FastTopK(PartsFunction):
    """Reduced (total, kd, ce) of normalize="full"; gradients to xs, ws, bs."""

    @staticmethod
    def forward(ctx, xs, ws, bs, ids, lp, labels, mask, cfg: TopKConfig, plan: FastPlan, need):
        n = xs.shape[0]
        valid = torch.isfinite(lp)
        precompute = any(need) and plan.reduction != "none"
        grads = (
            alloc_grads(xs=xs, ws=ws, bs=bs, dw_fp32=plan.dw_fp32, need_x=need[0], need_w=need[1] or need[2])
            if precompute
            else (None,) * 3
        )
        red = reduction_scale(mask, plan.reduction) if precompute else None
        blocks = []
        for r0, r1 in spans(n, plan.row_chunk):
            z = softcap_(linear_logits(xs[r0:r1], ws, bs, F32), cfg.softcap_s)
            lab = None if labels is None else labels[r0:r1]
            blk = block_forward(z=z, ids=ids[r0:r1], lp=lp[r0:r1], valid=valid[r0:r1], labels=lab, cfg=cfg)
            blocks.append(blk)
            if precompute:
                dx = None if grads[0] is None else grads[0][r0:r1]
                block_backward(
                    z=z,
                    xs=xs[r0:r1],
                    ws=ws,
                    bs=bs,
                    ids=ids[r0:r1],
                    valid=valid[r0:r1],
                    labels=lab,
                    mask=mask[r0:r1],
                    grad_rows=red.expand(r1 - r0),
                    blk=blk,
                    cfg=cfg,
                    dx_out=dx,
                    dw=grads[1],
                    db=grads[2],
                    first=r0 == 0,
                )
            del z
        rows = _cat_rows(blocks) if blocks else None
        if rows is None:
            per_row = (torch.zeros(0, dtype=F32, device=xs.device),) * 3
        else:
            per_row = combine_rows(rows.res.kd, rows.ce, mask, cfg)
        out = tuple(reduce_rows(r, mask, plan.reduction, (n,)) for r in per_row)
        keep_for_backward(
            ctx=ctx,
            cfg=cfg,
            plan=plan,
            grads=finish_grads(*grads, ws, bs) if precompute else None,
            state=rows,
            saved=(xs, ws, bs, ids, lp, labels, mask),
        )
        return FastTopK.parts(ctx, *out)

    @staticmethod
    @ck.no_double_backward
    def backward(ctx, grad_total, _gkd, _gce):
        if ctx.precompute:
            dx, dw, db = take_precomputed_grads(ctx, grad_total)
        else:
            dx, dw, db = _recomputed_grads(ctx, grad_total)
        return FastTopK.input_grads(ctx, dx, dw, db)


def _recomputed_grads(ctx, grad_total):
    xs, ws, bs, ids, lp, labels, mask = ctx.saved_tensors
    cfg, plan, rows = ctx.cfg, ctx.plan, ctx.state
    n = xs.shape[0]
    upstream = row_upstream(grad_total, mask, plan.reduction, n)
    need = ctx.needs_input_grad
    dx, dw, db = alloc_grads(xs=xs, ws=ws, bs=bs, dw_fp32=plan.dw_fp32, need_x=need[0], need_w=need[1] or need[2])
    valid = torch.isfinite(lp)
    for r0, r1 in spans(n, plan.row_chunk):
        z = softcap_(linear_logits(xs[r0:r1], ws, bs, F32), cfg.softcap_s)
        exclude_ids(z, ids[r0:r1], valid[r0:r1])
        block_backward(
            z=z,
            xs=xs[r0:r1],
            ws=ws,
            bs=bs,
            ids=ids[r0:r1],
            valid=valid[r0:r1],
            labels=None if labels is None else labels[r0:r1],
            mask=mask[r0:r1],
            grad_rows=upstream[r0:r1],
            blk=_slice_rows(rows, r0, r1),
            cfg=cfg,
            dx_out=None if dx is None else dx[r0:r1],
            dw=dw,
            db=db,
            first=r0 == 0,
        )
        del z
    return finish_grads(dx, dw, db, ws, bs)


def fast_topk(xs, ws, bs, ids, lp, labels, mask, cfg: TopKConfig, reduction: str, memory_budget: Optional[int] = None):
    """Reduced (total, kd, ce) over flattened rows (normalize="full"; reduction "none" gives [N])."""
    plan = make_fast_plan(
        n=xs.shape[0], v=ws.shape[0], d=ws.shape[1], dtype=xs.dtype, memory_budget=memory_budget, reduction=reduction
    )
    grad_on = torch.is_grad_enabled()
    need = tuple(grad_on and t is not None and t.requires_grad for t in (xs, ws, bs))
    xs, ws = xs.contiguous(), ws.contiguous()
    bs = None if bs is None else bs.contiguous()
    return FastTopK.apply(xs, ws, bs, ids.contiguous(), lp, labels, mask, cfg, plan, need)
