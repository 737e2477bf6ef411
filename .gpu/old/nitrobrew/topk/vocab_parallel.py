"""Vocab-parallel ``topk_kl(normalize="full")``: the student's head split by vocabulary over ranks.

Each rank runs ``nitrobrew.topk.chunked.vocab_pass`` on its block (global ids [lo, lo + V_r)),
which yields the student's online (m, l) state, the raw logits at the stored ids that fall in the
block (0 elsewhere) and the label logit. The ranks combine them with one all-reduce MAX of the
maxima and one all-reduce SUM of the rescaled sums, the label logits and the [rows, K] id logits
(each stored id lives on exactly one rank); ``finish`` then gives the same losses and gradient
coefficients on every rank. The backward runs ``backward_range`` on the block and all-reduces dX.
Communication: O(rows * K) forward, O(rows * D) backward, independent of V.
"""

from __future__ import annotations

import math

import torch

from ..core import checks as ck
from ..core.online import auto_chunk_v
from ..core.ops import compute_dtype
from ..core.outputs import DistillOutput
from ..core.reduction import IGNORE_INDEX, reduce_rows, row_weights
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
from ..parallel.dtensor import is_dtensor, unwrap

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


class VocabParallelTopK(torch.autograd.Function):
    """Per-row (total, kd, ce) of normalize="full" top-k KD over the global vocabulary."""

    @staticmethod
    def forward(ctx, xs, ws, bs, ids, lp, labels, mask, cfg, group, lo: int):
        from ..core.reduction import combine_rows
        from .chunked import Entries, finish, vocab_pass

        acc = compute_dtype(xs.dtype)
        N, K = lp.shape
        valid = torch.isfinite(lp)
        entries = Entries.build(ids, valid)
        chunk = max(1, cfg.chunk_V or auto_chunk_v(N, max(ws.shape[0], 1)))
        st = vocab_pass(xs, ws, bs, labels, entries, cfg, lo=lo, chunk=chunk)
        states = [st.s] + ([st.z] if st.z is not None else [])
        extra = merge_online(states, group, extra=([st.z_label] if cfg.with_ce else []) + [st.z_ids])
        z_label = extra[0] if cfg.with_ce else st.z_label
        z_ids = extra[-1]
        res, lse_s, lse_z, ce = finish(z_ids, lp.to(acc), valid, st.s, st.z, z_label, cfg)
        total, kd, ce_rows = combine_rows(res.kd, ce, mask, cfg)
        ctx.save_for_backward(xs, ws, bs, labels, mask)
        ctx.res, ctx.lse_s, ctx.lse_z, ctx.entries, ctx.cfg = res, lse_s, lse_z, entries, cfg
        ctx.group, ctx.lo, ctx.chunk = group, lo, chunk
        ctx.mark_non_differentiable(kd, ce_rows)
        return total, kd, ce_rows

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
            coef,
            ctx.lse_s,
            dense,
            ctx.lse_z,
            ce_scale,
            ctx.cfg,
            lo=ctx.lo,
            chunk=ctx.chunk,
            need_w=ctx.needs_input_grad[1] or ctx.needs_input_grad[2],
        )
        dx = all_reduce(dx, "sum", ctx.group, "bwd_dx").to(xs.dtype) if ctx.needs_input_grad[0] else None
        dw = dw if ctx.needs_input_grad[1] else None
        db = db if ctx.needs_input_grad[2] else None
        return dx, dw, db, None, None, None, None, None, None, None


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

    layout 8 * 12 * world; fwd_max e N (1 + c); fwd_sum e N (1 + c + ce + K); bwd_dx e N D, with e = 4
    (8 for float64), c = 1 if CE is on and T != 1, ce = 1 if CE is on. Independent of V.
    """
    e = 8 if dtype == torch.float64 else 4
    c = 1 if (with_ce and temperature != 1.0) else 0
    out = {
        "layout": 8 * (len(TOPK_FIELDS) + 1) * world,
        "fwd_max": e * n_rows * (1 + c),
        "fwd_sum": e * n_rows * (1 + c + (1 if with_ce else 0) + k),
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
    from .rowmath import TopKConfig
    from .validation import validate

    xs, _, ws, _, bs, _, labels, group = unwrap(xs, None, ws, None, bs, None, labels, process_group)
    topk_ids = topk_ids.to_local() if is_dtensor(topk_ids) else topk_ids
    topk_logprobs = topk_logprobs.to_local() if is_dtensor(topk_logprobs) else topk_logprobs
    if group is None:
        raise ValueError(
            "parallel_topk_kl needs a process_group or a head sharded Shard(0) over a device mesh; "
            "for one process (or a replicated DTensor) call nitrobrew.topk_kl"
        )
    require_initialized()
    rank, world = group_rank_world(group)

    def local():
        if normalize != "full":
            raise ValueError(
                'process_group= supports topk_kl(normalize="full") (the student normalized over the '
                'whole, sharded vocabulary); normalize="topk" reads only the K stored rows of ws: gather '
                "those rows or run it without vocab parallelism"
            )
        if backend == "triton":
            raise ValueError(
                "process_group= (vocab-parallel) runs nitrobrew's PyTorch chunked path; pass "
                "backend='auto' or backend='torch'"
            )
        name, param = ck.divergence_param(divergence, params)
        validate(
            xs,
            ws,
            topk_ids,
            topk_logprobs,
            bs,
            labels,
            normalize,
            divergence,
            tail,
            temperature,
            teacher_temperature,
            reduction,
            chunk_V,
            kd_weight,
            ce_weight,
            ignore_index,
            backend,
            id_ranges=False,
            softcap_s=softcap_s,
        )()
        K = topk_ids.shape[-1]
        options = fingerprint(
            "topk",
            name,
            param,
            bool(tail),
            float(temperature),
            float(kd_weight),
            float(ce_weight),
            bool(scale_t2),
            reduction,
            ignore_index,
            str(compute_dtype(xs.dtype)),
            bool(xs.requires_grad),
            bs is None,
            labels is None,
        )
        head = torch.tensor([ws.shape[0], math.prod(xs.shape[:-1]), xs.shape[-1], K, options])
        valid_lab = None if labels is None else labels != ignore_index
        lab = ids_summary(labels, valid_lab, ce_weight != 0)
        idv = ids_summary(topk_ids, torch.isfinite(topk_logprobs), True)
        return (name, param), torch.cat([head.to(lab.device), lab, idv.to(lab.device)])

    (name, param), table = checked_exchange(group, comm_device(xs, group), TOPK_FIELDS, local)
    check_rows_agree(table)
    sizes = table["ws_rows"]
    V = sum(sizes)
    check_label_range(table, V, "topk_ids (at entries whose log-prob is finite)", "ids_min", "ids_max")
    if ce_weight != 0:
        check_label_range(table, V)
    lo = offsets_from_sizes(sizes)[rank]
    if V == 0:
        fail("the student head has no rows on any rank")

    lead = xs.shape[:-1]
    K = topk_ids.shape[-1]
    x = xs.reshape(-1, xs.shape[-1])
    lp = topk_logprobs.reshape(-1, K)
    ids = torch.where(
        torch.isfinite(lp), topk_ids.reshape(-1, K).long(), torch.zeros((), dtype=torch.long, device=lp.device)
    )
    flat_labels = None if labels is None else labels.reshape(-1)
    mask = row_weights(flat_labels, ignore_index, x.shape[0], xs.device)
    ce_labels = None
    if ce_weight != 0:
        ce_labels = torch.where(mask > 0, flat_labels, torch.full_like(flat_labels, -1)).long()
    cfg = TopKConfig(
        divergence=name,
        param=param,
        normalize=normalize,
        tail=bool(tail),
        temperature=float(temperature),
        kd_weight=float(kd_weight) * (temperature**2 if scale_t2 else 1.0),
        ce_weight=float(ce_weight),
        chunk_V=chunk_V,
        softcap_s=None if softcap_s is None else float(softcap_s),
    )
    rows = VocabParallelTopK.apply(x, ws, bs, ids, lp, ce_labels, mask, cfg, group, lo)
    total, kd, ce = (reduce_rows(r, mask, reduction, lead) for r in rows)
    if return_parts:
        return DistillOutput(total, kd, ce)
    return total
