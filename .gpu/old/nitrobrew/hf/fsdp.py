"""FSDP2 (``fully_shard``) students whose head stays sharded: the vocab-parallel layout.

FSDP2 stores each parameter as a DTensor sharded on dim 0; for the head that is a block of the
vocabulary per rank. When the decoder (``model.model``) is its own ``fully_shard`` unit, apart
from the head, nitrobrew runs the decoder alone (FSDP gathers its layers as usual) and never
the head's forward, so the head is never gathered: every rank gathers the *rows* of all ranks
(``[rows, D]``, small next to ``[V, D]``), and the vocab-parallel loss of ``nitrobrew.parallel``
runs on this rank's block of the head, merging per-row statistics across ranks.

Gradients: the head block gets its complete gradient directly (FSDP does not average it again);
the rows' gradient, complete on every rank after the loss, is scaled by the world size on its
way back to this rank's rows, because FSDP averages the decoder's gradients over ranks. The
loss value is 1/world of the loss over all ranks' rows, so that the usual ``loss * world``
(what the trainer does with a global token count) gives exact gradients in both layouts.

Under accelerate's FSDP2 plugin with the decoder in the wrap list, ``shard_for_accelerate`` builds
the units before accelerate does (accelerate's own order fails on that layout).
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn

from ..core.checks import is_dtensor, local_tensor
from .wrapping import decoder, is_fsdp2, unwrap


class Layout(NamedTuple):
    """The vocab-parallel layout of an FSDP2 head: group, world, rank, and this rank's block."""

    group: object
    world: int
    rank: int
    offset: int
    rows: int


def head_is_sharded_apart(model: nn.Module) -> bool:
    """FSDP2 with the decoder under its own fully_shard (so the head is alone in the root's unit)
    and an untied head: the head can stay sharded."""
    m = unwrap(model)
    if not is_fsdp2(m):
        return False
    try:
        dec = decoder(m)
    except TypeError:
        return False
    out = m.get_output_embeddings() if callable(getattr(m, "get_output_embeddings", None)) else None
    w = getattr(out, "weight", None)
    tied = w is not None and w is getattr(m.get_input_embeddings(), "weight", None)
    return is_fsdp2(dec) and dec is not m and not tied and is_dtensor(w)


def layout(weight) -> Layout:
    """The layout of a DTensor head sharded Shard(0) over a 1-D mesh (torch.chunk block sizes)."""
    placements = tuple(weight.placements)
    if len(placements) != 1 or not placements[0].is_shard(0):
        raise ValueError(f"an FSDP2 head placed {placements}: nitrobrew.hf expects Shard(0) over a 1-D mesh")
    mesh = weight.device_mesh
    group = mesh.get_group(0)
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    V = weight.shape[0]
    chunk = -(-V // world)
    offset = min(rank * chunk, V)
    rows = weight.to_local().shape[0]
    if rows != max(min(chunk, V - offset), 0):
        raise ValueError(
            f"FSDP2 head block of {rows} rows on rank {rank}, expected torch.chunk's "
            f"{max(min(chunk, V - offset), 0)} of {V}"
        )
    return Layout(group, world, rank, offset, rows)


class _GatherRows(torch.autograd.Function):
    """All ranks' rows (uneven counts) in rank order; backward: this rank's rows' gradient x scale."""

    @staticmethod
    def forward(ctx, x, group, scale):
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        n = torch.tensor([x.shape[0]], device=x.device)
        sizes = [torch.zeros_like(n) for _ in range(world)]
        dist.all_gather(sizes, n, group=group)
        sizes = [int(s) for s in sizes]
        pad = max(sizes)
        padded = x.new_zeros((pad,) + tuple(x.shape[1:]))
        padded[: x.shape[0]] = x
        parts = [torch.empty_like(padded) for _ in range(world)]
        dist.all_gather(parts, padded.contiguous(), group=group)
        ctx.start, ctx.n, ctx.scale = sum(sizes[:rank]), x.shape[0], scale
        return torch.cat([p[:s] for p, s in zip(parts, sizes)])

    @staticmethod
    def backward(ctx, grad):
        return grad[ctx.start : ctx.start + ctx.n] * ctx.scale, None, None


def gather_rows(x: torch.Tensor, group, scale: float = 1.0) -> torch.Tensor:
    return _GatherRows.apply(x, group, scale)


def head_block(weight: torch.Tensor, bias: Optional[torch.Tensor], lay: Layout):
    """This rank's block of a head (and bias): the local shard of a DTensor on the same layout,
    or a slice of a full head (replicated, or gathered by FSDP for the forward)."""

    def block(t):
        if t is None:
            return None
        if is_dtensor(t):
            if any(p.is_shard() for p in t.placements):
                theirs = layout(t)
                if (theirs.offset, theirs.rows) != (lay.offset, lay.rows):
                    raise ValueError(
                        "the teacher's head is sharded into other blocks than the student's: use "
                        "heads of the same size (vocab_size= for padded ones) on the same mesh"
                    )
                return t.to_local()
            t = t.to_local()
        return t[lay.offset : lay.offset + lay.rows]

    return block(weight), block(bias)


def shard_student(
    xs: torch.Tensor, labels: torch.Tensor, ws: torch.Tensor, bs: Optional[torch.Tensor]
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, Optional[torch.Tensor], Layout]:
    """A student head sharded apart: (all ranks' rows, their labels, this rank's block of the head and bias,
    the layout). The rows' gradient comes back scaled by the world size (FSDP averages the decoder's)."""
    lay = layout(ws)
    xs = gather_rows(xs, lay.group, scale=lay.world)
    labels = gather_rows(labels, lay.group)
    return xs, labels, local_tensor(ws), local_tensor(bs), lay


def match_teacher(
    xt: torch.Tensor,
    wt: torch.Tensor,
    bt: Optional[torch.Tensor],
    *,
    student_layout: Optional[Layout],
    teacher_apart: bool,
) -> Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """The teacher's rows and head laid out like the student's: with a student head sharded apart, all ranks'
    teacher rows and this rank's block of the teacher's head; with only the teacher's head kept sharded, the
    teacher's head gathered whole."""
    if student_layout is not None:
        w, b = head_block(wt, bt, student_layout)
        return gather_rows(xt, student_layout.group), w, b
    if teacher_apart:
        return xt, wt.full_tensor(), None if bt is None else bt.full_tensor()  # type: ignore[attr-defined]
    return xt, wt, bt


def over_ranks(parts: Any, n_tokens: torch.Tensor, lay: Layout) -> Tuple[Any, torch.Tensor]:
    """A loss over all ranks' rows (a head sharded apart): (its parts as 1/world of it, the positions counted
    on all ranks), so that the usual ``loss * world`` of the trainer gives exact gradients."""
    n_all = n_tokens.clone()
    dist.all_reduce(n_all, group=lay.group)
    return parts._replace(**{k: getattr(parts, k) / lay.world for k in ("loss", "kd", "ce")}), n_all


def _accelerate_fsdp2_kwargs(accelerator, plugin, model) -> dict:
    """The fully_shard arguments accelerate's fsdp2_prepare_model passes (mesh, precision, offload)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    mesh = getattr(accelerator, "torch_device_mesh", None)
    kwargs = {
        "reshard_after_forward": plugin.reshard_after_forward,
        "offload_policy": plugin.cpu_offload,
        "mp_policy": plugin.mixed_precision_policy or MixedPrecisionPolicy(),
        "mesh": mesh[tuple(accelerator.parallelism_config.fsdp_dim_names)] if mesh is not None else None,
    }
    if getattr(plugin, "ignored_modules", None) is not None:
        from accelerate.utils.fsdp_utils import get_parameters_from_modules

        kwargs["ignored_params"] = get_parameters_from_modules(plugin.ignored_modules, model, accelerator.device)
    return kwargs


def shard_for_accelerate(accelerator, model: nn.Module) -> nn.Module:
    """Shard a student whose wrap policy names its decoder (the head sharded apart) before accelerate does.

    accelerate's ``fsdp2_prepare_model`` shards the policy's modules bottom-up and only then carves the
    input embeddings and the final norm into units of their own: when the decoder (which holds both)
    is already a unit, their parameters are DTensors and ``fully_shard`` fails on them (an invariant
    error in ``DeviceMesh._concatenate``). Here the same units are built in an order that works: the
    layers, the input embeddings, the decoder (with its final norm), then the root (with the head,
    which the vocab-parallel loss never gathers); accelerate then finds an FSDP2 model and keeps
    it. With a tied head the decoder cannot be a unit apart from it: the decoder is not wrapped
    (the root-wrapped layout), with a warning. Any other policy: the model is returned untouched.
    """
    state = getattr(accelerator, "state", None)
    plugin = getattr(state, "fsdp_plugin", None)
    if plugin is None or getattr(plugin, "fsdp_version", 1) != 2 or is_fsdp2(model):
        return model
    from accelerate.utils.fsdp_utils import fsdp2_prepare_auto_wrap_policy
    from accelerate.utils.other import get_module_children_bottom_up
    from torch.distributed.fsdp import fully_shard

    plugin.set_auto_wrap_policy(model)
    policy = fsdp2_prepare_auto_wrap_policy(plugin, model)
    embed = model.get_input_embeddings() if callable(getattr(model, "get_input_embeddings", None)) else None
    if policy is None or embed is None:
        return model
    chosen = [m for m in get_module_children_bottom_up(model)[:-1] if policy(m)]
    holders = {id(m) for m in chosen if m is not embed and any(sub is embed for sub in m.modules())}
    if not holders:
        return model  # accelerate's own order works
    if getattr(plugin, "cpu_ram_efficient_loading", False):
        raise ValueError(
            "cpu_ram_efficient_loading with the decoder wrapped apart from the head is not supported: "
            "load the model on every rank (cpu_ram_efficient_loading: false)"
        )
    if getattr(plugin, "activation_checkpointing", False):
        raise ValueError(
            "fsdp_config activation_checkpointing with the decoder wrapped apart from the head is not "
            "supported: use gradient_checkpointing=True instead"
        )
    head = model.get_output_embeddings() if callable(getattr(model, "get_output_embeddings", None)) else None
    tied = head is not None and getattr(head, "weight", None) is getattr(embed, "weight", None)
    if tied:
        import warnings

        warnings.warn(
            "the student's head is tied to its input embeddings: it cannot be sharded apart from the "
            "decoder, so the decoder is not wrapped (the head is gathered with the root)",
            stacklevel=2,
        )
        chosen = [m for m in chosen if id(m) not in holders]
    kwargs = _accelerate_fsdp2_kwargs(accelerator, plugin, model)
    # As accelerate: trainable parameters in fp32 under mixed precision (the policy casts for compute).
    if getattr(accelerator, "mixed_precision", "no") != "no":
        for p in model.parameters():
            if p.requires_grad and p.dtype != torch.float32:
                p.data = p.data.to(torch.float32)
    for m in chosen:
        if id(m) in holders and not tied and not is_fsdp2(embed):
            fully_shard(embed, **kwargs)
        fully_shard(m, **kwargs)
    # The root's leftovers (the head) are never gathered by the loss; torch's default for the root.
    fully_shard(model, **{k: v for k, v in kwargs.items() if k != "reshard_after_forward"})
    return model
