"""The stored top-k data's checks in one pass: NaN/+inf log-probs, and ids outside [0, V) at finite
entries. One kernel writes two flags (the PyTorch ops it replaces were ~10 launches); reading them is
the one device sync of the validation."""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from .._launch import cdiv, launch

BLOCK = 4096


@triton.jit
def _stored_flags_kernel(IDS, LP, FLAGS, E, V, CHECK_IDS: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = offs < E
    lp = tl.load(LP + offs, mask=inside, other=0.0)
    bad_lp = inside & ((lp != lp) | (lp == float("inf")))
    tl.atomic_max(FLAGS, tl.max(bad_lp.to(tl.int32), axis=0))
    if CHECK_IDS:
        ids = tl.load(IDS + offs, mask=inside, other=0).to(tl.int64)
        finite = inside & (lp == lp) & (lp != float("inf")) & (lp != float("-inf"))
        bad_id = finite & ((ids < 0) | (ids >= V))
        tl.atomic_max(FLAGS + 1, tl.max(bad_id.to(tl.int32), axis=0))


def stored_flags(ids: torch.Tensor, lp: torch.Tensor, V: Optional[int]) -> torch.Tensor:
    """int32 [2] on lp's device: (any NaN/+inf log-prob, any id outside [0, V) at a finite entry)."""
    flags = torch.zeros(2, dtype=torch.int32, device=lp.device)
    E = lp.numel()
    launch(_stored_flags_kernel, (cdiv(E, BLOCK),), ids.reshape(-1), lp.reshape(-1), flags, E,
           0 if V is None else V, CHECK_IDS=V is not None, BLOCK=BLOCK, num_warps=4)
    return flags
