"""DTensor inputs: heads sharded on the vocabulary dimension become (local shard, process group)."""

from __future__ import annotations

from typing import Optional, Tuple

from ..core.checks import is_dtensor
from .comm import ranks_of

__all__ = ["is_dtensor", "unwrap"]


def _head_spec(name: str, t) -> Tuple[object, Optional[int]]:
    """(mesh, mesh dim sharded on dim 0 or None) of a DTensor head; raise on other layouts."""
    placements = tuple(t.placements)
    shard_dims = [i for i, p in enumerate(placements) if p.is_shard(0)]
    other = [p for i, p in enumerate(placements) if i not in shard_dims and not p.is_replicate()]
    if other or len(shard_dims) > 1:
        raise ValueError(
            f"{name} is a DTensor with placements {placements}: nitrobrew accepts heads sharded on the "
            "vocabulary dimension (Shard(0)) over one mesh dimension and replicated over the others "
            "(redistribute it first, e.g. t.redistribute(mesh, [Shard(0)]))"
        )
    return t.device_mesh, (shard_dims[0] if shard_dims else None)


def unwrap(xs, xt, ws, wt, bs, bt, labels, process_group):
    """Replace DTensors by their local tensors (differentiably) and find the vocab-parallel group.

    Returns (xs, xt, ws, wt, bs, bt, labels, group); group is None when no head is sharded and no
    process_group was given (then the call is an ordinary single-process one).
    """
    group = process_group
    mesh_dim = None
    mesh = None
    heads = {"ws": ws, "wt": wt, "bs": bs, "bt": bt}
    for name, t in heads.items():
        if not is_dtensor(t):
            continue
        t_mesh, dim = _head_spec(name, t)
        if dim is None:
            continue
        g = t_mesh.get_group(dim)
        if group is None:
            group, mesh, mesh_dim = g, t_mesh, dim
        elif ranks_of(group) != ranks_of(g):
            raise ValueError(
                f"{name} is sharded over ranks {ranks_of(g)} but the vocab-parallel group is "
                f"{ranks_of(group)} (process_group= or another head): shard every head over the same ranks"
            )
        elif mesh is None:
            mesh, mesh_dim = t_mesh, dim
    for name, t in (("xs", xs), ("xt", xt)):
        if is_dtensor(t) and mesh is not None and t.device_mesh == mesh and not t.placements[mesh_dim].is_replicate():
            raise ValueError(
                f"{name} is a DTensor placed {tuple(t.placements)}: the vocab-parallel loss needs the same rows "
                f"on every rank of the vocabulary group (Replicate on mesh dimension {mesh_dim}); all-gather "
                "sequence-parallel activations first"
            )
    local = [t.to_local() if is_dtensor(t) else t for t in (xs, xt, ws, wt, bs, bt, labels)]
    return (*local, group)
