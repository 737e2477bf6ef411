"""Triton pass of the streaming top-k extraction over one fp32 logit chunk.

One program per row reads the chunk's raw logits once and does what took five PyTorch passes:
scales them by 1/T, updates the row's online log-sum-exp (max m, rescaled sum l of an
``Online`` state, in place) and writes the
maximum of every group of GROUP consecutive entries (the grouped top-k of ``extract.py`` picks
its candidate groups from those).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..core.launch import cdiv, launch, next_pow2
from ..core.online import Online
from ..core.tl_utils import f32, online_tile

BLOCK = 4096


@triton.jit
def teacher_scan_kernel(
    z_ptr,
    m_ptr,
    l_ptr,
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
    s = tl.load(l_ptr + row)
    cols = tl.arange(0, BLOCK)
    groups = tl.arange(0, BLOCK // GROUP)
    for start in range(0, n_cols, BLOCK):
        idx = start + cols
        valid = idx < n_cols
        x = tl.load(z_row + idx, mask=valid, other=float("-inf")) * inv_temp
        m, s, _e, _scale = online_tile(m, s, x, valid)
        gidx = start // GROUP + groups
        tl.store(g_row + gidx, tl.max(tl.reshape(x, (BLOCK // GROUP, GROUP)), axis=1), mask=gidx < n_groups)
    tl.store(m_ptr + row, m)
    tl.store(l_ptr + row, s)


def launch_scan_chunk(z: torch.Tensor, state: Online, inv_temp: float, group: int) -> torch.Tensor:
    """Update the fp32 online state (m, l [R], contiguous) with the chunk z [R, C] (raw fp32 logits,
    tempered here); returns the group maxima of the tempered logits, [R, ceil(C / group)] fp32."""
    rows, n_cols = z.shape
    n_groups = cdiv(n_cols, group)
    gmax = torch.empty(rows, n_groups, dtype=torch.float32, device=z.device)
    if rows and n_cols:
        block = max(group, min(BLOCK, next_pow2(n_cols)))
        # The state keeps the mass outside the maximal entry (tail = l - 1); the kernel runs on l.
        total = state.l.contiguous()
        launch(
            teacher_scan_kernel,
            (rows,),
            z,
            state.m,
            total,
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
        state.tail.copy_(total - 1.0)
    return gmax
