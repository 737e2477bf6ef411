"""The hidden-state losses as registered PyTorch custom ops, used while ``torch.compile`` traces.

Dynamo cannot follow the host-side loops over row blocks and vocab chunks (nor Triton's launcher)
without breaking the graph many times, so under compilation the whole computation is one opaque
op, ``nitrobrew::hidden_distill``, with a fake (shape-only) implementation and a registered
backward: the surrounding training step stays one graph. The forward returns, besides the reduced
(total, kd, ce), what the backward needs: the gradients when the fast mode forms them in the
forward, else the per-row statistics [11, N] (lse_s, lse_t, lse_z, sum_u, the split normalizers,
v_rest) from which ``nitrobrew::hidden_distill_backward`` recomputes the slabs. Both ops run the same functions as
the eager autograd Functions, so the two paths agree bit for bit.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Dict, Mapping, Optional, Sequence, Tuple

import torch

from ..core import checks as ck
from ..core.online import auto_chunk_v
from ..core.ops import compute_dtype, grad_needed, kernel_operands
from ..core.reduction import combine_rows, reduce_rows, row_scales, row_upstream
from .chunked import RowNorm, RowStats, backward_chunks, compute_stats
from .config import LossConfig, Operands

if TYPE_CHECKING:
    from .validation import HiddenCall

Tensor = torch.Tensor
_NONE = -1  # stands for None in the integer options (custom ops take no Optional[int] defaults here)


def _op_options(call: "HiddenCall") -> dict:
    """The checked call's options as the ops' scalar arguments (``_OPTION_NAMES``): -1 stands for None
    (custom ops take no Optional[int] defaults here), negative floats too (filter off, no softcap)."""
    cfg = call.cfg
    return dict(
        divergence=cfg.divergence,
        param=float(cfg.param),
        temperature=cfg.temperature,
        kd_weight=cfg.kd_weight,
        ce_weight=cfg.ce_weight,
        chunk_V=_NONE if cfg.chunk_V is None else cfg.chunk_V,
        filter_eps=-1.0 if cfg.filter_eps is None else cfg.filter_eps,
        softcap_s=-1.0 if cfg.softcap_s is None else cfg.softcap_s,
        softcap_t=-1.0 if cfg.softcap_t is None else cfg.softcap_t,
        impl=call.impl,
        reduction=call.reduction,
        mode=call.mode or "",
        memory_budget=_NONE if call.memory_budget is None else call.memory_budget,
    )


# The ops' scalar arguments after the tensors, in schema order (``_op_options`` forms them): the first nine are
# LossConfig's (``_cfg`` reads them back). hidden_distill takes need_grad after them; hidden_distill_backward
# does not. tests/test_hidden_compile.py holds this list to both schemas.
_CFG_NAMES = (
    "divergence",
    "param",
    "temperature",
    "kd_weight",
    "ce_weight",
    "chunk_V",
    "filter_eps",
    "softcap_s",
    "softcap_t",
)
_OPTION_NAMES = (*_CFG_NAMES, "impl", "reduction", "mode", "memory_budget")


def _cfg(o: Mapping[str, Any]) -> LossConfig:
    """``_op_options`` back to the LossConfig: ``o`` holds (at least) the ``_CFG_NAMES`` by name, an op's own
    arguments (``locals()`` on entry) or the fake kernel's (``_named``)."""
    return LossConfig(
        divergence=o["divergence"],
        param=o["param"],
        temperature=o["temperature"],
        kd_weight=o["kd_weight"],
        ce_weight=o["ce_weight"],
        chunk_V=None if o["chunk_V"] == _NONE else o["chunk_V"],
        filter_eps=None if o["filter_eps"] < 0 else o["filter_eps"],
        softcap_s=None if o["softcap_s"] < 0 else o["softcap_s"],
        softcap_t=None if o["softcap_t"] < 0 else o["softcap_t"],
    )


def _named(options: Sequence[Any]) -> Dict[str, Any]:
    """hidden_distill's scalar arguments (``_OPTION_NAMES``, then need_grad) by name, from positional values
    (the fake kernel receives them so)."""
    names = (*_OPTION_NAMES, "need_grad")
    if len(options) != len(names):
        raise TypeError(f"nitrobrew::hidden_distill takes {len(names)} scalar arguments, got {len(options)}")
    return dict(zip(names, options))


def _plan(xs, ws, cfg: LossConfig, *, reduction: str, mode: str, memory_budget: int):
    from .triton_function import make_plan

    return make_plan(
        n=xs.shape[0],
        v=ws.shape[0],
        ds=ws.shape[1],
        dtype=xs.dtype,
        mode=mode or None,
        chunk_V=cfg.chunk_V,
        memory_budget=None if memory_budget == _NONE else memory_budget,
        reduction=reduction,
    )


def _precomputes(impl: str, xs, ws, cfg, *, reduction, mode, memory_budget, need_grad) -> bool:
    """Whether the forward forms the gradients itself (Triton fast mode, scalar reduction)."""
    return (
        impl == "triton"
        and need_grad
        and reduction != "none"
        and _plan(xs, ws, cfg, reduction=reduction, mode=mode, memory_budget=memory_budget).mode == "fast"
    )


N_STATS = 11  # lse_s, lse_t, lse_z, sum_u, the split normalizers (chunked.RowNorm, 6), v_rest


def _pack_stats(rs: RowStats) -> Tensor:
    v_rest = torch.zeros_like(rs.sum_u) if rs.v_rest is None else rs.v_rest
    head = torch.stack([rs.lse_s, rs.lse_t, rs.lse_s if rs.lse_z is None else rs.lse_z, rs.sum_u])
    return torch.cat([head, rs.row_norm().stacked(), v_rest[None]])


def _unpack_stats(stats: Tensor) -> RowStats:
    return RowStats(
        lse_s=stats[0],
        lse_t=stats[1],
        lse_z=stats[2],
        sum_u=stats[3],
        kd=None,
        ce=None,
        norm=RowNorm(*stats[4:10]),
        v_rest=stats[10],
    )


def _empty(like: Tensor) -> Tensor:
    return like.new_empty((0,))


@torch.library.custom_op("nitrobrew::hidden_distill", mutates_args=())
def hidden_distill(
    xs: Tensor,
    xt: Tensor,
    ws: Tensor,
    wt: Tensor,
    bs: Optional[Tensor],
    bt: Optional[Tensor],
    labels: Optional[Tensor],
    mask: Tensor,
    divergence: str,
    param: float,
    temperature: float,
    kd_weight: float,
    ce_weight: float,
    chunk_V: int,
    filter_eps: float,
    softcap_s: float,
    softcap_t: float,
    impl: str,
    reduction: str,
    mode: str,
    memory_budget: int,
    need_grad: bool,
) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(total, kd, ce, stats, dx, dw, db): unused entries are empty tensors."""
    cfg = _cfg(locals())  # the arguments, by name (first, before any other local)
    if labels is not None:  # the eager path checked them before tracing could not (data-dependent)
        ck.check_ids_in_range("labels", labels, ws.shape[0], -1)
    ops = Operands(xs=xs, xt=xt, ws=ws, wt=wt, bs=bs, bt=bt)
    if impl == "triton":
        from .triton_function import distill_forward

        plan = _plan(xs, ws, cfg, reduction=reduction, mode=mode, memory_budget=memory_budget)
        out, grads, rs = distill_forward(ops, labels, mask, cfg, plan=plan, need_grad=need_grad)
    else:
        chunk = cfg.chunk_V or auto_chunk_v(xs.shape[0], ws.shape[0], device=xs.device)
        rs = compute_stats(ops, labels, cfg, chunk)
        out = tuple(reduce_rows(r, mask, reduction, (xs.shape[0],)) for r in combine_rows(rs.kd, rs.ce, mask, cfg))
        grads = None
    if grads is not None:
        dx, dw, db = grads
        return (*out, _empty(out[0]), dx, dw, _empty(xs) if db is None else db)
    return (*out, _pack_stats(rs), _empty(xs), _empty(ws), _empty(xs))


@hidden_distill.register_fake
def _(xs, xt, ws, wt, bs, bt, labels, mask, *options):
    opts = _named(options)
    acc = compute_dtype(xs.dtype)
    n = xs.shape[0]
    reduction = opts["reduction"]
    shape = (n,) if reduction == "none" else ()
    out = tuple(xs.new_empty(shape, dtype=acc) for _ in range(3))
    if _precomputes(
        opts["impl"],
        xs,
        ws,
        _cfg(opts),
        reduction=reduction,
        mode=opts["mode"],
        memory_budget=opts["memory_budget"],
        need_grad=opts["need_grad"],
    ):
        db = _empty(xs) if bs is None else torch.empty_like(bs)
        return (*out, out[0].new_empty((0,)), torch.empty_like(xs), torch.empty_like(ws), db)
    return (*out, xs.new_empty((N_STATS, n), dtype=acc), _empty(xs), _empty(ws), _empty(xs))


@torch.library.custom_op("nitrobrew::hidden_distill_backward", mutates_args=())
def hidden_distill_backward(
    grad_total: Tensor,
    stats: Tensor,
    xs: Tensor,
    xt: Tensor,
    ws: Tensor,
    wt: Tensor,
    bs: Optional[Tensor],
    bt: Optional[Tensor],
    labels: Optional[Tensor],
    mask: Tensor,
    divergence: str,
    param: float,
    temperature: float,
    kd_weight: float,
    ce_weight: float,
    chunk_V: int,
    filter_eps: float,
    softcap_s: float,
    softcap_t: float,
    impl: str,
    reduction: str,
    mode: str,
    memory_budget: int,
) -> Tuple[Tensor, Tensor, Tensor]:
    """(dx, dw, db) recomputed from the row statistics; db is empty without a bias."""
    cfg = _cfg(locals())  # the arguments, by name (first, before any other local)
    rs = _unpack_stats(stats)
    ops = Operands(xs=xs, xt=xt, ws=ws, wt=wt, bs=bs, bt=bt)
    if impl == "triton":
        from .triton_function import distill_backward

        plan = _plan(xs, ws, cfg, reduction=reduction, mode=mode, memory_budget=memory_budget)
        dx, dw, db = distill_backward(ops, labels, mask, rs, cfg, plan=plan, grad_total=grad_total)
    else:
        kd_scale, ce_scale = row_scales(
            row_upstream(grad_total, mask, reduction, xs.shape[0]).to(stats.dtype), mask.to(stats.dtype), cfg
        )
        chunk = cfg.chunk_V or auto_chunk_v(xs.shape[0], ws.shape[0], device=xs.device)
        dx, dw, db = backward_chunks(ops, labels, rs, cfg, kd_scale, ce_scale=ce_scale, chunk=chunk)
        dx = dx.to(xs.dtype)
    return dx, dw, _empty(xs) if db is None else db


@hidden_distill_backward.register_fake
def _(grad_total, stats, xs, xt, ws, wt, bs, bt, labels, mask, *_options):
    return torch.empty_like(xs), torch.empty_like(ws), _empty(xs) if bs is None else torch.empty_like(bs)


def _setup_context(ctx, inputs, output):
    xs, xt, ws, wt, bs, bt, labels, mask, *options, need_grad = inputs
    ctx.options = dict(zip(_OPTION_NAMES, options))
    ctx.precomputed = output[4].numel() > 0 or output[5].numel() > 0
    if ctx.precomputed:
        ctx.save_for_backward(output[4], output[5], output[6] if bs is not None else None)
    else:
        ctx.save_for_backward(output[3], xs, xt, ws, wt, bs, bt, labels, mask)


@ck.no_double_backward
def _backward(ctx, grad_total, _gkd, _gce, *_grad_saved):
    if ctx.precomputed:
        grads = tuple(None if g is None else g * grad_total.to(g.dtype) for g in ctx.saved_tensors)
    else:
        stats, xs, xt, ws, wt, bs, bt, labels, mask = ctx.saved_tensors
        grads = hidden_distill_backward(
            grad_total=grad_total,
            stats=stats,
            xs=xs,
            xt=xt,
            ws=ws,
            wt=wt,
            bs=bs,
            bt=bt,
            labels=labels,
            mask=mask,
            **ctx.options,
        )
        grads = (grads[0], grads[1], grads[2] if bs is not None else None)
    dx, dw, db = grads
    need = ctx.needs_input_grad
    return (
        dx if need[0] else None,
        None,
        dw if need[2] else None,
        None,
        db if need[4] else None,
        *([None] * (3 + len(_OPTION_NAMES) + 1)),
    )


torch.library.register_autograd("nitrobrew::hidden_distill", _backward, setup_context=_setup_context)


def compiled_distill(call: "HiddenCall"):
    """Reduced (total, kd, ce) of a checked call through the custom op (kd and ce detached, like the eager
    path)."""
    ops = call.ops
    need_grad = grad_needed(ops.xs, ops.ws, ops.bs)
    xs, xt, ws, wt, bt, labels = kernel_operands(
        xs=ops.xs, xt=ops.xt, ws=ops.ws, wt=ops.wt, bt=ops.bt, labels=call.labels
    )
    out = hidden_distill(
        xs=xs,
        xt=xt,
        ws=ws,
        wt=wt,
        bs=ops.bs,
        bt=bt,
        labels=labels,
        mask=call.mask,
        need_grad=need_grad,
        **_op_options(call),
    )
    return out[0], out[1].detach(), out[2].detach()
