"""The stored top-k data's checks in one pass: NaN/+inf log-probs, ids outside [0, V) at finite
entries, an id repeated within a row, and rows whose log-probs are not a sub-distribution
(logsumexp over the K entries above a tolerance). One kernel writes the four flags (the PyTorch ops
it replaces are ~15 launches); reading them is the one device sync of the validation."""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from ..core.launch import cdiv, launch, next_pow2

TILE = 4096  # entries per program: rows x next_pow2(K)


@triton.jit
def topk_stored_flags_kernel(
    IDS, LP, FLAGS, N, K, V, lse_tol, CHECK_IDS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr
):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_K)
    inside = (rows < N)[:, None] & (cols < K)[None, :]
    offs = rows[:, None] * K + cols[None, :]
    lp = tl.load(LP + offs, mask=inside, other=float("-inf")).to(tl.float32)
    bad_lp = inside & ((lp != lp) | (lp == float("inf")))
    tl.atomic_max(FLAGS, tl.max(tl.max(bad_lp.to(tl.int32), axis=1), axis=0))
    finite = inside & (lp == lp) & (lp != float("inf")) & (lp != float("-inf"))
    ids = tl.load(IDS + offs, mask=inside, other=0).to(tl.int64)
    if CHECK_IDS:
        bad_id = finite & ((ids < 0) | (ids >= V))
        tl.atomic_max(FLAGS + 1, tl.max(tl.max(bad_id.to(tl.int32), axis=1), axis=0))
    # an id repeated among a row's valid entries: compare every entry with each earlier one
    dup = tl.zeros([BLOCK_R, BLOCK_K], dtype=tl.int32)
    for j in range(0, K):
        lp_j = tl.load(LP + rows * K + j, mask=rows < N, other=float("-inf")).to(tl.float32)
        id_j = tl.load(IDS + rows * K + j, mask=rows < N, other=0).to(tl.int64)
        fin_j = (lp_j == lp_j) & (lp_j != float("inf")) & (lp_j != float("-inf"))
        same = finite & fin_j[:, None] & (ids == id_j[:, None]) & (cols[None, :] > j)
        dup = tl.maximum(dup, same.to(tl.int32))
    tl.atomic_max(FLAGS + 2, tl.max(tl.max(dup, axis=1), axis=0))
    # logsumexp over the row's finite entries (padding, -inf, adds nothing)
    safe = tl.where(finite, lp, float("-inf"))
    m = tl.max(safe, axis=1)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    lse = m_safe + tl.log(tl.sum(tl.where(finite, tl.exp(safe - m_safe[:, None]), 0.0), axis=1))
    over = (m != float("-inf")) & (lse > lse_tol)
    tl.atomic_max(FLAGS + 3, tl.max(over.to(tl.int32), axis=0))


def launch_stored_flags(ids: torch.Tensor, lp: torch.Tensor, V: Optional[int], lse_tol: float) -> torch.Tensor:
    """int32 [4] on lp's device: (any NaN/+inf log-prob, any id outside [0, V) at a finite entry, any id
    repeated within a row at finite entries, any row whose finite log-probs sum to above e^lse_tol)."""
    flags = torch.zeros(4, dtype=torch.int32, device=lp.device)
    K = lp.shape[-1]
    n = lp.numel() // max(K, 1)
    block_k = next_pow2(max(K, 1))
    block_r = max(1, TILE // block_k)
    launch(
        topk_stored_flags_kernel,
        (cdiv(n, block_r),),
        ids.reshape(-1).contiguous(),
        lp.reshape(-1).contiguous(),
        flags,
        n,
        K,
        0 if V is None else V,
        lse_tol,
        CHECK_IDS=V is not None,
        BLOCK_R=block_r,
        BLOCK_K=block_k,
        num_warps=4,
    )
    return flags
