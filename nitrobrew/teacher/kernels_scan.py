"""Triton pass of the streaming top-k extraction over one fp32 logit chunk.

One program per row reads the chunk's raw logits once and does what took five PyTorch passes:
scales them by 1/T, updates the row's online log-sum-exp (max m and tail, the mass outside the maximal
entry, of an ``Online`` state, in place: docs/design.md §2.6) and writes the maximum of every group of
GROUP consecutive entries (the grouped top-k of ``extract.py`` picks its candidate groups from those).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..core.launch import cdiv, launch, next_pow2
from ..core.online import Online
from ..core.tl_utils import f32, lanes_tail, merge_tail2

BLOCK = 4096


@triton.jit
def teacher_scan_kernel(
    z_ptr,
    m_ptr,
    tail_ptr,
    gmax_ptr,
    n_cols,
    n_groups,
    stride_z,
    stride_g,
    inv_temp,
    GROUP: tl.constexpr,
    BLOCK: tl.constexpr,
):
    inv_temp = f32(inv_temp)
    row = tl.program_id(0).to(tl.int64)
    z_row = z_ptr + row * stride_z
    g_row = gmax_ptr + row * stride_g
    m = tl.load(m_ptr + row)
    tail = tl.load(tail_ptr + row)
    cols = tl.arange(0, BLOCK)
    groups = tl.arange(0, BLOCK // GROUP)
    for start in range(0, n_cols, BLOCK):
        idx = start + cols
        valid = idx < n_cols
        x = tl.load(z_row + idx, mask=valid, other=float("-inf")) * inv_temp
        # the tile's (max, tail) from its entries (each a state of tail 0; past the row's end, empty: -1),
        # merged with the row's: no l - 1 is ever formed (a confident row's tail keeps its digits)
        m_tile, t_tile, _sc = lanes_tail(x, tl.where(valid, 0.0, -1.0))
        m, tail, _s0, _s1 = merge_tail2(m, tail, m_tile, t_tile)
        gidx = start // GROUP + groups
        tl.store(g_row + gidx, tl.max(tl.reshape(x, (BLOCK // GROUP, GROUP)), axis=1), mask=gidx < n_groups)
    tl.store(m_ptr + row, m)
    tl.store(tail_ptr + row, tail)


def launch_scan_chunk(z: torch.Tensor, state: Online, inv_temp: float, group: int) -> torch.Tensor:
    """Update the fp32 online state (m, tail [R], contiguous, in place) with the chunk z [R, C] (raw fp32
    logits, tempered here); returns the group maxima of the tempered logits, [R, ceil(C / group)] fp32."""
    rows, n_cols = z.shape
    n_groups = cdiv(n_cols, group)
    gmax = torch.empty(rows, n_groups, dtype=torch.float32, device=z.device)
    if rows and n_cols:
        block = max(group, min(BLOCK, next_pow2(n_cols)))
        state.m, state.tail = state.m.contiguous(), state.tail.contiguous()  # updated in place
        launch(
            teacher_scan_kernel,
            (rows,),
            z,
            state.m,
            state.tail,
            gmax,
            n_cols,
            n_groups,
            z.stride(0),
            gmax.stride(0),
            inv_temp,
            GROUP=group,
            BLOCK=block,
            num_warps=4,
        )
    return gmax
