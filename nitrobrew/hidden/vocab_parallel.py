"""Vocab-parallel (tensor-parallel LM head) hidden-state losses (docs/design.md §5).

Each rank of the process group holds a contiguous block of the vocabulary (rank r the r-th block,
in group rank order; blocks may be uneven or empty) of both heads, and the *same* rows xs, xt,
labels. The forward runs the single-process online pass (``chunked.first_pass``) on the local
block, then merges the per-row states across ranks exactly as the online update merges chunks:

    all-reduce MAX of the running maxima -> rescale -> all-reduce SUM of the rescaled sums,
    accumulators and label logits [-> second pass on the local block -> all-reduce SUM of
    (sum phi, sum u) for the divergences that need the final log-sum-exps]

and the backward runs ``chunked.backward_chunks`` on the local block and all-reduces dX once.
Communication is O(rows) in the forward and O(rows * Ds) in the backward, never O(rows * V);
``comm_bytes`` below gives the exact count.
"""

from __future__ import annotations

import math
from typing import Any, List, Mapping, Optional, Tuple

import torch

from .. import divergences as dv
from ..core import checks as ck
from ..core.ops import compute_dtype, grad_needed
from ..core.outputs import DistillOutput
from ..core.reduction import IGNORE_INDEX, PartsFunction, combine_rows, reduce_rows, reduction_scale, row_scales
from ..core.slabs import scale_by_upstream
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
    phase,
    require_initialized,
)
from ..parallel.dtensor import unwrap
from . import grad_filter as gf
from .chunked import RowStats, TorchLocal, finish_stats, row_norm
from .config import LossConfig, Operands
from .validation import check_hidden_tensors, check_loss_options, prepare_rows

Tensor = torch.Tensor

# int64 fields every rank sends before any kernel runs (+ an error flag: one small all-reduce of
# 8 * world * 10 bytes).
LAYOUT_FIELDS = ("ws_rows", "wt_rows", "rows", "ds", "dt", "options", "label_min", "label_max", "label_hash")


class VocabLayout:
    """Where this rank's block sits in the global vocabulary."""

    def __init__(self, rank: int, world: int, sizes: List[int], vocab: int):
        self.rank, self.world, self.sizes, self.vocab = rank, world, list(sizes), vocab
        self.offsets = offsets_from_sizes(sizes)
        self.offset = self.offsets[rank]
        # rows of the local block that lie below the global vocab_size
        self.used = max(0, min(sizes[rank], vocab - self.offset))

    def __repr__(self) -> str:
        return (
            f"VocabLayout(rank={self.rank}, offset={self.offset}, used={self.used}, sizes={self.sizes}, "
            f"vocab={self.vocab})"
        )


# ----------------------------------------------------------------------------------------------
# merged statistics and the autograd Function


def local_impl(xs, ws, cfg: LossConfig, backend: str, memory_budget=None):
    """The single-process pieces this rank runs on its block: the Triton row kernels where the
    single-process loss would use them (CUDA, or backend="triton"), else the PyTorch chunks."""
    if xs.dtype != torch.float64 and ck.backend_for(backend, xs.device) == "triton":  # checked in negotiate
        from .triton_function import TritonLocal

        return TritonLocal(xs, ws, cfg, memory_budget)
    return TorchLocal(xs, ws, cfg)


def _merged_stats(fp, cfg: LossConfig, group, second_pass) -> RowStats:
    """Merge a first pass over this rank's block with the other ranks' (and, for the divergences that
    need the final normalizers, the sums of ``second_pass(norm)``, norm a chunked.RowNorm) into global
    RowStats."""
    states = [fp.s, fp.t] + ([fp.z] if fp.z is not None else [])
    pairs = [(fp.s, fp.t), (fp.t, fp.s)]  # every divergence keeps the centred sums on one side
    if cfg.with_ce:
        (fp.z_label,) = merge_online(states, group, extra=[fp.z_label], kl_pairs=pairs)
    else:
        merge_online(states, group, kl_pairs=pairs)
    sums, normed = None, None
    if cfg.divergence not in dv.ONE_PASS:
        normed = row_norm(fp, False)
        sums = all_reduce(torch.stack(second_pass(normed[0])), "sum", group, "fwd_second_pass")
    return finish_stats(fp, cfg, sums, normed)


def parallel_stats(ops: Operands, labels, cfg: LossConfig, local, group) -> RowStats:
    """RowStats over the global vocabulary from this rank's block [0, ws.shape[0]) (labels local ids)."""
    with phase("local stats"):
        fp = local.first_pass(ops, labels, cfg)

    def second_pass(norm):
        with phase("local stats"):
            return local.second_pass(ops, cfg, norm)

    return _merged_stats(fp, cfg, group, second_pass)


class VocabParallelDistill(PartsFunction):
    """Per-row (total, kd, ce) over the global vocabulary; gradients to xs (full), ws and bs (local)."""

    STUDENT_INPUTS = (0, 2, 4)

    @staticmethod
    def forward(ctx, xs, xt, ws, wt, bs, bt, labels, mask, cfg: LossConfig, group, local):
        st = parallel_stats(Operands(xs, xt, ws, wt, bs=bs, bt=bt), labels, cfg, local, group)
        total, kd, ce = combine_rows(st.kd, st.ce, mask, cfg)
        ctx.save_for_backward(xs, xt, ws, wt, bs, bt, labels, mask)
        ctx.stats, ctx.cfg, ctx.local, ctx.group = st, cfg, local, group
        return VocabParallelDistill.parts(ctx, total, kd, ce)

    @staticmethod
    @ck.no_double_backward
    def backward(ctx, grad_total, _gkd, _gce):
        xs, xt, ws, wt, bs, bt, labels, mask = ctx.saved_tensors
        cfg, acc = ctx.cfg, ctx.stats.lse_s.dtype
        kd_scale, ce_scale = row_scales(grad_total.to(acc), mask.to(acc), cfg)
        with phase("gradient pass"):
            dx, dw, db = ctx.local.backward(
                Operands(xs, xt, ws, wt, bs=bs, bt=bt),
                labels,
                ctx.stats,
                cfg,
                kd_scale,
                ce_scale=ce_scale,
                need_w=VocabParallelDistill.head_needed(ctx),
            )
        dx = all_reduce(dx, "sum", ctx.group, "bwd_dx").to(xs.dtype) if ctx.needs_input_grad[0] else None
        return VocabParallelDistill.input_grads(ctx, dx, dw, db)


# ----------------------------------------------------------------------------------------------
# the fast plan: one pair of logit GEMMs per block of rows, the gradient formed in the forward


def fused_forward(
    ops: Operands, labels, mask, cfg: LossConfig, group, plan, reduction: str, need_x: bool = True, need_w: bool = True
):
    """Per-row (total, kd, ce) and this rank's (dx fp32 over its block, dw, db), block of rows by block.

    For each block of rows: the student and teacher slabs over this rank's block of the vocabulary
    (two GEMMs), the first-pass statistics, the merge with the other ranks (O(rows) all-reduces, no
    host synchronization), the second pass on the same slabs where the divergence needs one, then
    the gradient slab (over the teacher slab's bytes) and its dX and dW GEMMs. As the single-GPU
    fast mode: four GEMMs over the block in all, none recomputed, same slab memory; the rows'
    upstream multipliers are those of the scalar reduction (the backward scales by its gradient).
    """
    from ..core.online import spans
    from ..core.slabs import alloc_grads
    from . import kernels as tr
    from .triton_function import _first_pass_from_state, _slabs, block_grads

    xs, ws, bs = ops.xs, ops.ws, ops.bs
    n = xs.shape[0]
    _, dw, db = alloc_grads(xs, ws, bs, plan.dw_fp32, need_x=False, need_w=need_w)
    dx = torch.zeros(xs.shape, dtype=torch.float32, device=xs.device) if need_x else None
    red = reduction_scale(mask, reduction)
    stats = []
    empty = ws.shape[0] == 0  # a rank left without ids (vocab_size): it still joins every collective
    for r0, r1 in spans(n, plan.row_chunk):
        block = ops.rows(r0, r1)
        lab = None if labels is None else labels[r0:r1]
        with phase("local stats"):
            slabs = None if empty else _slabs(block, 0, ws.shape[0], cfg)
            st = tr.new_state(r1 - r0, xs.device)
            if not empty:
                tr.launch_stats(*slabs, st, lab, 0, cfg, 1)

        def second_pass(norm, slabs=slabs):
            with phase("local stats"):
                st2 = tr.new_rowvals(norm.stacked())
                if slabs is not None:
                    tr.launch_stats(*slabs, st2, None, 0, cfg, 2)
                return tr.second_pass_sums(st2)

        rs = _merged_stats(_first_pass_from_state(st, cfg), cfg, group, second_pass)
        del second_pass  # it holds this block's slabs: gone before the next block's are made
        stats.append(rs)
        if empty:
            continue
        kd_scale, ce_scale = row_scales(red.expand(r1 - r0), mask[r0:r1], cfg)
        with phase("gradient pass"):
            block_grads(
                block,
                lab,
                rs,
                kd_scale.contiguous(),
                ce_scale.contiguous(),
                cfg=cfg,
                vchunk=ws.shape[0],
                dx_out=None if dx is None else dx[r0:r1],
                dw=dw,
                db=db,
                first_rows=r0 == 0,
                slabs=slabs,
            )
        del slabs
    rows = combine_rows(*_cat_rows(stats), mask, cfg)
    return rows, (dx, None if dw is None else dw.to(ws.dtype), None if db is None else db.to(bs.dtype))


def _cat_rows(stats: List[RowStats]):
    kd = torch.cat([s.kd for s in stats])
    ce = None if stats[0].ce is None else torch.cat([s.ce for s in stats])
    return kd, ce


class VocabParallelFused(PartsFunction):
    """Reduced (total, kd, ce) with the gradients formed in the forward (``fused_forward``); the
    backward all-reduces dX once and scales by the upstream gradient."""

    STUDENT_INPUTS = (0, 2, 4)

    @staticmethod
    def forward(ctx, xs, xt, ws, wt, bs, bt, labels, mask, cfg: LossConfig, group, plan, reduction: str):
        need = ctx.needs_input_grad
        rows, grads = fused_forward(
            Operands(xs, xt, ws, wt, bs=bs, bt=bt),
            labels,
            mask,
            cfg,
            group,
            plan=plan,
            reduction=reduction,
            need_x=need[0],
            need_w=need[2] or need[4],
        )
        out = tuple(reduce_rows(r, mask, reduction, ()) for r in rows)
        ctx.grads, ctx.group, ctx.x_dtype = grads, group, xs.dtype
        return VocabParallelFused.parts(ctx, *out)

    @staticmethod
    @ck.no_double_backward
    def backward(ctx, grad_total, _gkd, _gce):
        if ctx.grads is None:
            raise RuntimeError(
                "nitrobrew: this vocab-parallel loss formed its gradients in the forward and handed them out "
                "in the first backward; a second backward through the same graph is not supported"
            )
        dx, dw, db = ctx.grads
        ctx.grads = None
        need = ctx.needs_input_grad
        dx = all_reduce(dx, "sum", ctx.group, "bwd_dx") if need[0] and dx is not None else None
        dw = dw if need[2] else None
        db = db if need[4] else None
        dx, dw, db = scale_by_upstream((dx, dw, db), grad_total)
        dx = None if dx is None else dx.to(ctx.x_dtype)
        return VocabParallelFused.input_grads(ctx, dx, dw, db)


# ----------------------------------------------------------------------------------------------
# validation: every rank reaches the same verdict (no rank left waiting in a collective)


def _local_checks(
    xs,
    xt,
    ws,
    wt,
    bs,
    bt,
    labels,
    divergence,
    params,
    temperature,
    reduction,
    chunk_V,
    vocab_size,
    kd_weight,
    ce_weight,
    backend,
    softcap_s=None,
    softcap_t=None,
) -> Tuple[str, float]:
    """Checks that need nothing from other ranks; returns the canonical (divergence, param)."""
    check_hidden_tensors(xs, xt, ws, wt, bs, bt=bt, labels=labels, heads="[V_local, D] head shards")
    name, param = ck.divergence_param(divergence, params)
    check_loss_options(
        temperature,
        reduction,
        chunk_V,
        backend,
        kd_weight,
        ce_weight=ce_weight,
        labels=labels,
        softcap_s=softcap_s,
        softcap_t=softcap_t,
    )
    if vocab_size is not None and not (ck.is_int(vocab_size) and vocab_size > 0):
        raise ValueError(f"vocab_size must be a positive int (a global vocabulary size), got {vocab_size!r}")
    return name, param


def _check_layout(table: dict, vocab_size: Optional[int], world: int) -> Tuple[List[int], int]:
    """Student/teacher blocks must cover the same global ids on every rank; returns (sizes, V)."""
    s_sizes, t_sizes = table["ws_rows"], table["wt_rows"]
    Vs, Vt = sum(s_sizes), sum(t_sizes)
    if vocab_size is None:
        if Vs != Vt:
            fail(
                f"student vocab {Vs} != teacher vocab {Vt} (summed over the shards): pass vocab_size=N to "
                "compare global ids [0, N) of both heads (never zero-pad a head)"
            )
        V = Vs
    else:
        if vocab_size > min(Vs, Vt):
            fail(
                f"vocab_size must be an int in [1, {min(Vs, Vt)}] (global ids; student {Vs}, teacher {Vt}), "
                f"got {vocab_size}"
            )
        V = vocab_size
    s_off, t_off = offsets_from_sizes(s_sizes), offsets_from_sizes(t_sizes)
    for r in range(world):
        s_rng = (min(s_off[r], V), min(s_off[r] + s_sizes[r], V))
        t_rng = (min(t_off[r], V), min(t_off[r] + t_sizes[r], V))
        if s_rng != t_rng:
            fail(
                f"the student and teacher heads must be split the same way over the vocabulary: rank {r} holds "
                f"student ids [{s_rng[0]}, {s_rng[1]}) but teacher ids [{t_rng[0]}, {t_rng[1]}) (rows per rank: "
                f"student {s_sizes}, teacher {t_sizes}). Shard both heads with one partition, e.g. pad the "
                "smaller head's rows to the larger size before sharding and pass vocab_size=N"
            )
    return s_sizes, V


def negotiate(xs, xt, ws, wt, bs, bt, labels, group, opts: dict) -> Tuple[VocabLayout, str, float, bool]:
    """Validate on every rank, exchange shard sizes (one all-reduce of 8 * world * 11 bytes) and agree;
    also on the plan (whether the gradients are formed in the forward: it sets the collectives)."""
    require_initialized()
    rank, world = group_rank_world(group)

    def local():
        name, param = _local_checks(
            xs,
            xt,
            ws,
            wt,
            bs,
            bt=bt,
            labels=labels,
            divergence=opts["divergence"],
            params=opts["params"],
            temperature=opts["temperature"],
            reduction=opts["reduction"],
            chunk_V=opts["chunk_V"],
            vocab_size=opts["vocab_size"],
            kd_weight=opts["kd_weight"],
            ce_weight=opts["ce_weight"],
            backend=opts["backend"],
            softcap_s=opts["softcap_s"],
            softcap_t=opts["softcap_t"],
        )
        acc = compute_dtype(xs.dtype)
        fused = (
            xs.dtype != torch.float64
            and ck.backend_for(opts["backend"], xs.device) == "triton"  # name checked by _local_checks
            and opts["chunk_V"] is None
            and opts["reduction"] != "none"
            and grad_needed(xs, ws, bs)
        )
        agreed = (  # options that must agree on every rank
            fused,
            opts["memory_budget"] if fused else None,
            name,
            param,
            float(opts["temperature"]),
            float(opts["kd_weight"]),
            float(opts["ce_weight"]),
            bool(opts["scale_t2"]),
            opts["reduction"],
            opts["vocab_size"],
            opts["ignore_index"],
            str(acc),
            bool(xs.requires_grad),
            bs is None,
            bt is None,
            labels is None,
            opts["softcap_s"],
            opts["softcap_t"],
        )
        options = fingerprint(*agreed)
        valid = None if labels is None else labels != opts["ignore_index"]
        head = torch.tensor([ws.shape[0], wt.shape[0], math.prod(xs.shape[:-1]), xs.shape[-1], xt.shape[-1], options])
        lab = ids_summary(labels, valid, opts["ce_weight"] != 0)
        return (name, param, fused), torch.cat([head.to(lab.device), lab])

    (name, param, fused), table = checked_exchange(group, comm_device(xs, group), LAYOUT_FIELDS, local)
    check_rows_agree(table)
    sizes, V = _check_layout(table, opts["vocab_size"], world)
    if opts["ce_weight"] != 0:
        check_label_range(table, V)
    return VocabLayout(rank, world, sizes, V), name, param, fused


# ----------------------------------------------------------------------------------------------
# entry point used by nitrobrew.hidden.api.hidden_loss(process_group=...)


def parallel_hidden_loss(
    xs,
    xt,
    ws,
    wt,
    *,
    process_group=None,
    divergence="forward_kl",
    labels=None,
    ignore_index=IGNORE_INDEX,
    temperature=1.0,
    reduction="mean",
    chunk_V=None,
    vocab_size=None,
    bs=None,
    bt=None,
    kd_weight=1.0,
    ce_weight=0.0,
    scale_t2=False,
    backend="auto",
    mode=None,
    memory_budget=None,
    grad_filter=False,
    softcap_s=None,
    softcap_t=None,
    return_parts=False,
    **params,
):
    """``hidden_loss`` over a vocabulary split across the ranks of ``process_group``.

    ws, wt (and bs, bt) hold this rank's contiguous block of the vocabulary (rank r of the group the
    r-th block; uneven or empty blocks are fine; DTensors sharded Shard(0) are unwrapped); xs, xt and
    labels are the same on every rank; labels are global ids. The result is the loss over the
    full vocabulary, identical on every rank; xs gets the full gradient, ws/bs their block's.
    ``vocab_size=N`` uses global ids [0, N): each rank drops the rows of its block at ids >= N.
    Each rank runs the Triton row kernels on its block where the single-process loss would (CUDA,
    or ``backend="triton"``; ``chunk_V`` then selects the constant-memory plan and ``memory_budget``
    sizes the slabs), else the PyTorch chunked path; ``mode`` is not used.
    """
    given = dict(locals())  # the arguments by name (first, before any other local)
    xs, xt, ws, wt, bs, bt, labels, group = unwrap(
        xs, xt, ws, wt, bs, bt=bt, labels=labels, process_group=process_group
    )
    if group is None:
        raise ValueError(
            "parallel_hidden_loss needs a process_group or heads sharded Shard(0) over a device mesh; "
            "for one process (or replicated DTensors) call nitrobrew.hidden_loss"
        )
    # hidden_loss's HiddenOptions (the keyword options of both: tests/test_parallel.py), of the local tensors
    options = {k: v for k, v in given.items() if k not in ("xs", "xt", "ws", "wt", "divergence", "params")}
    options.update(labels=labels, bs=bs, bt=bt, process_group=group)
    return vocab_parallel_hidden(xs, xt, ws, wt, divergence=divergence, params=params, options=options)


def vocab_parallel_hidden(xs, xt, ws, wt, *, divergence: str, params: Mapping[str, float], options: Mapping[str, Any]):
    """``parallel_hidden_loss`` of local tensors (DTensors already unwrapped: ``hidden_loss`` enters here, after
    its own unwrap) and ``options`` a full ``hidden.api.HiddenOptions`` whose process_group is the group."""
    group = options["process_group"]
    labels, bs, bt = options["labels"], options["bs"], options["bt"]
    reduction, memory_budget = options["reduction"], options["memory_budget"]
    opts = dict(options, divergence=divergence, params=params)
    layout, name, param, fused = negotiate(xs, xt, ws, wt, bs, bt=bt, labels=labels, group=group, opts=opts)

    lead = xs.shape[:-1]
    # labels become ids into this rank's block: rows whose label lives on another rank fall outside
    x_s, x_t, ws, wt, bs, bt, local_labels, mask = prepare_rows(
        xs,
        xt,
        ws,
        wt,
        bs,
        bt=bt,
        labels=labels,
        ignore_index=options["ignore_index"],
        ce_weight=options["ce_weight"],
        used=layout.used,
        label_offset=layout.offset,
    )
    grad_filter = options["grad_filter"]
    gf.check_grad_filter(grad_filter)
    cfg = LossConfig.build(
        name,
        param,
        options["temperature"],
        options["kd_weight"],
        options["ce_weight"],
        scale_t2=options["scale_t2"],
        chunk_V=options["chunk_V"],
        filter_eps=gf.resolve_eps(grad_filter, xs.dtype),
        softcap_s=options["softcap_s"],
        softcap_t=options["softcap_t"],
    )
    if fused:
        # Blocks of rows sized from the largest block of the vocabulary: the same on every rank (each
        # block of rows is one round of collectives).
        from .triton_function import make_plan

        widest = max(max(0, min(size, layout.vocab - off)) for size, off in zip(layout.sizes, layout.offsets))
        plan = make_plan(
            x_s.shape[0],
            widest,
            ws.shape[1],
            x_s.dtype,
            "fast",
            chunk_V=None,
            memory_budget=memory_budget,
            reduction=reduction,
        )
        total, kd, ce = VocabParallelFused.apply(
            x_s, x_t, ws, wt, bs, bt, local_labels, mask, cfg, group, plan, reduction
        )
    else:
        local = local_impl(x_s, ws, cfg, options["backend"], memory_budget)
        rows = VocabParallelDistill.apply(x_s, x_t, ws, wt, bs, bt, local_labels, mask, cfg, group, local)
        total, kd, ce = (reduce_rows(r, mask, reduction, lead) for r in rows)
    if options["return_parts"]:
        return DistillOutput(total, kd, ce)
    return total


def comm_bytes(
    n_rows: int,
    d_student: int,
    *,
    divergence: str = "forward_kl",
    param: float = 0.5,
    with_ce: bool = False,
    temperature: float = 1.0,
    dtype: torch.dtype = torch.float32,
    world: int = 2,
    backward: bool = True,
    x_requires_grad: bool = True,
) -> dict:
    """Payload bytes one rank sends in one vocab-parallel hidden-loss call (forward + backward).

    e = 8 for float64 inputs, else 4 (statistics are fp32). N rows, Ds the student hidden size.
      layout    8 * 10 * world               (int64 shard sizes + checks, before any kernel)
      fwd_max   e * N * (2 + c)               c = 1 if CE is on and T != 1 (a T=1 student lse)
      fwd_ref   e * N                         the d of the accumulating side's top entry (MAX)
      fwd_sum   e * N * (2 (2 + c) + 3 + ce)  each side's tail share and max count, the centred sums
                                              (a, r) and the other side's lost mass b; ce = 1 if CE is on
      fwd_2nd   e * N * 4                     jsd, tvd, skew_kl, skew_reverse_kl only
      bwd_dx    e * N * Ds                    when xs requires grad
    Independent of the vocabulary size V. A ring all-reduce puts ~2 (world-1)/world of that on each link.
    """
    name, _ = dv.canonical(divergence, param)
    e = 8 if dtype == torch.float64 else 4
    c = 1 if (with_ce and temperature != 1.0) else 0
    out = {
        "layout": 8 * 10 * world,
        "fwd_max": e * n_rows * (2 + c),
        "fwd_ref": e * n_rows,
        "fwd_sum": e * n_rows * (2 * (2 + c) + 3 + (1 if with_ce else 0)),
    }
    if name not in dv.ONE_PASS:
        out["fwd_second_pass"] = e * n_rows * 4
    if backward and x_requires_grad:
        out["bwd_dx"] = e * n_rows * d_student
    out["total"] = sum(out.values())
    return out
