"""Distributed training: vocab-parallel (tensor-parallel) heads and data-parallel normalization.

- ``process_group=`` on every hidden-state loss (``nitrobrew.forward_kl(..., process_group=tp)``)
  and on ``topk_kl(normalize="full")``, or a DTensor head sharded Shard(0) on the vocabulary:
  see ``nitrobrew.parallel.hidden`` and ``nitrobrew.parallel.topk``.
- ``global_token_count`` / ``data_parallel_loss`` / ``global_mean``: DDP and FSDP normalization.
- ``count_comm()`` counts the bytes those collectives send; ``comm_bytes`` / ``topk_comm_bytes``
  predict them.

docs/parallel.md is the user guide.
"""

from __future__ import annotations

import torch

from .. import divergences as dv
from .comm import CommStats, count_comm
from .data import data_parallel_loss, global_mean, global_token_count
from .hidden import VocabParallelDistill, parallel_hidden_loss
from .topk import VocabParallelTopK, parallel_topk_kl, topk_comm_bytes


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
      fwd_sum   e * N * (2 + c + 3a + ce)     a = 1 for forward_kl/reverse_kl (a, r, b), ce = 1 if CE is on
      fwd_2nd   e * N * 2                     jsd, tvd, skew_kl, skew_reverse_kl only
      bwd_dx    e * N * Ds                    when xs requires grad
    Independent of the vocabulary size V. A ring all-reduce puts ~2 (world-1)/world of that on each link.
    """
    name, _ = dv.canonical(divergence, param)
    e = 8 if dtype == torch.float64 else 4
    c = 1 if (with_ce and temperature != 1.0) else 0
    a = 1 if name in dv.ONE_PASS else 0
    out = {
        "layout": 8 * 10 * world,
        "fwd_max": e * n_rows * (2 + c),
        "fwd_sum": e * n_rows * (2 + c + 3 * a + (1 if with_ce else 0)),
    }
    if name not in dv.ONE_PASS:
        out["fwd_second_pass"] = e * n_rows * 2
    if backward and x_requires_grad:
        out["bwd_dx"] = e * n_rows * d_student
    out["total"] = sum(out.values())
    return out


__all__ = [
    "parallel_hidden_loss",
    "VocabParallelDistill",
    "count_comm",
    "CommStats",
    "comm_bytes",
    "global_token_count",
    "data_parallel_loss",
    "global_mean",
    "parallel_topk_kl",
    "VocabParallelTopK",
    "topk_comm_bytes",
]
