"""Vocab-parallel ``topk_kl(normalize="full")``: the student's head split by vocabulary over ranks.

Each rank runs ``nitrobrew.topk.chunked.vocab_pass`` on its block (global ids [lo, lo + V_r)),
which yields the student's online (m, tail) state over the block's entries outside each row's stored
ids, the raw logits at the stored ids that fall in the block (0 elsewhere) and the label logit. The
ranks combine them with one all-reduce MAX of the maxima and one all-reduce SUM of the rescaled sums,
the label logits and the [rows, K] id logits (each stored id lives on exactly one rank); ``finish``
then gives the same losses and gradient coefficients on every rank. The backward runs
``backward_range`` on the block and all-reduces dX.
Communication: O(rows * K) forward, O(rows * D) backward, independent of V.
"""

from __future__ import annotations

import math
from typing import Mapping

import torch

from ..core import checks as ck
from ..core.online import auto_chunk_v
from ..core.ops import compute_dtype
from ..core.outputs import DistillOutput
from ..core.reduction import IGNORE_INDEX, PartsFunction, reduce_rows
from ..parallel.comm import (
    all_reduce,
    check_label_range,
    check_rows_agree,
    checked_exchange,
    comm_device,
    fail,
    fingerprint,
    group_rank_world,
    ids_summary,
    merge_online,
    offsets_from_sizes,
    require_initialized,
)
from ..parallel.dtensor import unwrap
from .validation import TopKInputs, TopKOptions, safe_ids, validate

Tensor = torch.Tensor

TOPK_FIELDS = (
    "ws_rows",
    "rows",
    "ds",
    "k",
    "options",
    "label_min",
    "label_max",
    "label_hash",
    "ids_min",
    "ids_max",
    "ids_hash",
)


class VocabParallelTopK(PartsFunction):
    """Per-row (total, kd, ce) of normalize="full" top-k KD over the global vocabulary."""

    @staticmethod
    def forward(ctx, xs, ws, bs, ids, lp, labels, mask, cfg, group, lo: int):
        from ..core.reduction import combine_rows
        from .chunked import Entries, finish, vocab_pass

        acc = compute_dtype(xs.dtype)
        N, K = lp.shape
        valid = torch.isfinite(lp)
        entries = Entries.build(ids, valid)
        chunk = max(1, cfg.chunk_V or auto_chunk_v(N, max(ws.shape[0], 1), device=xs.device))
        st = vocab_pass(xs, ws, bs, labels, entries, cfg=cfg, lo=lo, chunk=chunk)
        states = [st.s] + ([st.z] if st.z is not None else [])
        extra = merge_online(states, group, extra=([st.z_label] if cfg.with_ce else []) + [st.z_ids])
        z_label = extra[0] if cfg.with_ce else st.z_label
        z_ids = extra[-1]
        res, lse_z, ce = finish(z_ids, lp.to(acc), valid, s_state=st.s, z_state=st.z, z_label=z_label, cfg=cfg)
        total, kd, ce_rows = combine_rows(res.kd, ce, mask, cfg)
        ctx.save_for_backward(xs, ws, bs, labels, mask)
        ctx.res, ctx.lse_z, ctx.entries, ctx.cfg = res, lse_z, entries, cfg
        ctx.group, ctx.lo, ctx.chunk = group, lo, chunk
        return VocabParallelTopK.parts(ctx, total, kd, ce_rows)

    @staticmethod
    @ck.no_double_backward
    def backward(ctx, grad_total, _gkd, _gce):
        from .chunked import backward_range, row_coefficients

        xs, ws, bs, labels, mask = ctx.saved_tensors
        coef, dense, ce_scale = row_coefficients(grad_total, mask, ctx.res, ctx.cfg)
        dx, dw, db = backward_range(
            xs,
            ws,
            bs,
            labels,
            ctx.entries,
            coef=coef,
            dense=dense,
            lse_z=ctx.lse_z,
            ce_scale=ce_scale,
            cfg=ctx.cfg,
            lo=ctx.lo,
            chunk=ctx.chunk,
            need_w=VocabParallelTopK.head_needed(ctx),
        )
        dx = all_reduce(dx, "sum", ctx.group, "bwd_dx").to(xs.dtype) if ctx.needs_input_grad[0] else None
        return VocabParallelTopK.input_grads(ctx, dx, dw, db)


def topk_comm_bytes(
    n_rows: int,
    k: int,
    d: int,
    *,
    with_ce: bool = False,
    temperature: float = 1.0,
    dtype: torch.dtype = torch.float32,
    world: int = 2,
    backward: bool = True,
) -> dict:
    """Payload bytes of one vocab-parallel ``topk_kl(normalize="full")`` call on one rank.

    layout 8 * 12 * world; fwd_max e N (1 + c); fwd_sum e N (2 (1 + c) + ce + K) (a tail share and a max
    count per state); bwd_dx e N D, with e = 4 (8 for float64), c = 1 if CE is on and T != 1, ce = 1 if
    CE is on. Independent of V.
    """
    e = 8 if dtype == torch.float64 else 4
    c = 1 if (with_ce and temperature != 1.0) else 0
    out = {
        "layout": 8 * (len(TOPK_FIELDS) + 1) * world,
        "fwd_max": e * n_rows * (1 + c),
        "fwd_sum": e * n_rows * (2 * (1 + c) + (1 if with_ce else 0) + k),
    }
    if backward:
        out["bwd_dx"] = e * n_rows * d
    out["total"] = sum(out.values())
    return out


def parallel_topk_kl(
    xs,
    ws,
    topk_ids,
    topk_logprobs,
    *,
    process_group=None,
    normalize="full",
    divergence="forward_kl",
    tail=False,
    labels=None,
    ignore_index=IGNORE_INDEX,
    temperature=1.0,
    teacher_temperature=None,
    reduction="mean",
    bs=None,
    kd_weight=1.0,
    ce_weight=0.0,
    scale_t2=False,
    chunk_V=None,
    backend="auto",
    softcap_s=None,
    return_parts=False,
    **params,
):
    """``topk_kl`` with ws (bs) holding this rank's contiguous vocabulary block (rank order).

    Everything else (xs, topk_ids as global ids, topk_logprobs, labels) is the same on every rank.
    """
    xs, _, ws, _, bs, _, labels, group = unwrap(
        xs=xs, xt=None, ws=ws, wt=None, bs=bs, bt=None, labels=labels, process_group=process_group
    )
    if group is None:
        raise ValueError(
            "parallel_topk_kl needs a process_group or a head sharded Shard(0) over a device mesh; "
            "for one process (or a replicated DTensor) call nitrobrew.topk_kl"
        )
    inputs = TopKInputs(
        xs=xs, ws=ws, ids=ck.local_tensor(topk_ids), lp=ck.local_tensor(topk_logprobs), bs=bs, labels=labels
    )
    options = TopKOptions(
        normalize=normalize,
        divergence=divergence,
        tail=tail,
        temperature=temperature,
        teacher_temperature=teacher_temperature,
        reduction=reduction,
        chunk_V=chunk_V,
        kd_weight=kd_weight,
        ce_weight=ce_weight,
        scale_t2=scale_t2,
        ignore_index=ignore_index,
        backend=backend,
        softcap_s=softcap_s,
    )
    return vocab_parallel_topk(inputs, options, params, group=group, return_parts=return_parts)


def vocab_parallel_topk(
    inputs: TopKInputs, options: TopKOptions, params: Mapping[str, float], *, group, return_parts: bool = False
):
    """``parallel_topk_kl`` of unwrapped inputs and a group (``topk_kl`` enters here): the checks run on
    every rank and the ranks agree on the verdict before any collective of the loss. The options are
    checked here as given, once (``validate``); ``mode`` and ``memory_budget`` (Triton only) are not used."""
    require_initialized()
    rank, world = group_rank_world(group)
    xs, ws, topk_ids, topk_logprobs, bs, labels = inputs
    o = options

    def local():
        if o.normalize != "full":
            raise ValueError(
                'process_group= supports topk_kl(normalize="full") (the student normalized over the '
                'whole, sharded vocabulary); normalize="topk" reads only the K stored rows of ws: gather '
                "those rows or run it without vocab parallelism"
            )
        if o.backend == "triton":
            raise ValueError(
                "process_group= (vocab-parallel) runs nitrobrew's PyTorch chunked path; pass "
                "backend='auto' or backend='torch'"
            )
        call = validate(inputs, o, params, id_ranges=False)
        call.check()
        K = topk_ids.shape[-1]
        agreed = (
            "topk",
            call.cfg.divergence,
            call.cfg.param,
            bool(o.tail),
            float(o.temperature),
            float(o.kd_weight),
            float(o.ce_weight),
            bool(o.scale_t2),
            o.reduction,
            o.ignore_index,
            str(compute_dtype(xs.dtype)),
            bool(xs.requires_grad),
            bs is None,
            labels is None,
        )
        head = torch.tensor([ws.shape[0], math.prod(xs.shape[:-1]), xs.shape[-1], K, fingerprint(*agreed)])
        valid_lab = None if labels is None else labels != o.ignore_index
        lab = ids_summary(labels, valid_lab, o.ce_weight != 0)
        idv = ids_summary(topk_ids, torch.isfinite(topk_logprobs), True)
        return call, torch.cat([head.to(lab.device), lab, idv.to(lab.device)])

    call, table = checked_exchange(group, comm_device(xs, group), TOPK_FIELDS, local)
    check_rows_agree(table)
    sizes = table["ws_rows"]
    V = sum(sizes)
    check_label_range(table, V, "topk_ids (at entries whose log-prob is finite)", "ids_min", "ids_max")
    if o.ce_weight != 0:
        check_label_range(table, V)
    lo = offsets_from_sizes(sizes)[rank]
    if V == 0:
        fail("the student head has no rows on any rank")

    r = call.rows
    ids = safe_ids(r.ids, r.lp)
    per_row = VocabParallelTopK.apply(r.x, ws, bs, ids, r.lp, r.ce_labels, r.mask, call.cfg, group, lo)
    total, kd, ce = (reduce_rows(t, r.mask, o.reduction, r.lead) for t in per_row)
    if return_parts:
        return DistillOutput(total, kd, ce)
    return total
