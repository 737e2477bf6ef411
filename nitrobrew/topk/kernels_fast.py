"""Row kernels of topk_kl's fast mode over an fp32 logit slab: the log-sum-exps of a row (the top-k
ids excluded; the tempered one split as max and rescaled sum) and the gradient slab (written over the
slab's own bytes)."""

from __future__ import annotations

import triton
import triton.language as tl

from ..core.launch import launch
from ..core.tl_utils import f32, online_tile


@triton.jit
def topk_fast_lse_kernel(Z, OUT, stride_z, n_cols, inv_temp, RAW: tl.constexpr, BLOCK_V: tl.constexpr):
    """OUT[row] = (m, l, logsumexp_j z_j) over a row of an fp32 slab, logsumexp_j z_j * inv_temp = m + log l
    kept as its two parts (m the max, l = sum_j e^(z_j * inv_temp - m)); -inf entries are skipped (a row of
    -inf only gives m = -inf, l = 0, and -inf)."""
    inv_temp = f32(inv_temp)
    row = tl.program_id(0).to(tl.int64)
    z_row = Z + row * stride_z
    cols = tl.arange(0, BLOCK_V)
    m_s = tl.full((), float("-inf"), tl.float32)
    l_s = tl.zeros((), tl.float32)
    m_z = tl.full((), float("-inf"), tl.float32)
    l_z = tl.zeros((), tl.float32)
    for start in range(0, n_cols, BLOCK_V):
        idx = start + cols
        valid = idx < n_cols
        z = tl.load(z_row + idx, mask=valid, other=float("-inf"))
        m_s, l_s, _e, _sc = online_tile(m_s, l_s, z * inv_temp, valid)
        if RAW:
            m_z, l_z, _e2, _sc2 = online_tile(m_z, l_z, z, valid)
    tl.store(OUT + row * 3, m_s)
    tl.store(OUT + row * 3 + 1, l_s)
    if RAW:
        tl.store(OUT + row * 3 + 2, tl.where(l_z > 0, m_z + tl.log(l_z), float("-inf")))


@triton.jit
def topk_fast_grad_kernel(
    Z,
    G,
    COEF,
    LABELS,
    stride_z,
    stride_g,
    n_cols,
    inv_temp,
    inv_cap,
    HAS_B: tl.constexpr,
    SOFTCAP: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    """g_j = a exp(z_j * inv_temp - lse_a) + b (exp(z_j - lse_b) - [j == label]) with COEF[row] =
    (a, lse_a, b, lse_b), written in G's dtype. G may alias Z's bytes (a 16-bit row over the first half
    of the fp32 row): the barrier makes every warp load a tile before any warp stores it, and a tile's
    store only reaches columns that earlier tiles (or this one) loaded."""
    inv_temp, inv_cap = f32(inv_temp), f32(inv_cap)
    row = tl.program_id(0).to(tl.int64)
    z_row = Z + row * stride_z
    g_row = G + row * stride_g
    a = tl.load(COEF + row * 4)
    lse_a = tl.load(COEF + row * 4 + 1)
    b = 0.0
    lse_b = 0.0
    label = -1
    if HAS_B:
        b = tl.load(COEF + row * 4 + 2)
        lse_b = tl.load(COEF + row * 4 + 3)
        label = tl.load(LABELS + row).to(tl.int32)
    cols = tl.arange(0, BLOCK_V)
    for start in range(0, n_cols, BLOCK_V):
        idx = start + cols
        valid = idx < n_cols
        z = tl.load(z_row + idx, mask=valid, other=float("-inf"))
        # an ignored row (a = b = 0) gets exact zeros whatever its statistics
        g = tl.where(a != 0.0, a * tl.exp(z * inv_temp - lse_a), 0.0)
        if HAS_B:
            g += tl.where(b != 0.0, b * (tl.exp(z - lse_b) - tl.where(idx == label, 1.0, 0.0)), 0.0)
        if SOFTCAP:  # z holds capped logits c tanh(raw / c) (-inf at the ids): d capped / d raw = 1 - (z / c)^2
            zc = tl.where(z == float("-inf"), 0.0, z * inv_cap)
            g = g * (1.0 - zc * zc)
        tl.debug_barrier()
        tl.store(g_row + idx, g.to(G.dtype.element_ty), mask=valid)


def launch_lse(grid, *args, **constexprs) -> None:
    """``topk_fast_lse_kernel[grid](*args, **constexprs)`` through ``core.launch``."""
    launch(topk_fast_lse_kernel, grid, *args, **constexprs)


def launch_grad(grid, *args, **constexprs) -> None:
    """``topk_fast_grad_kernel[grid](*args, **constexprs)`` through ``core.launch``."""
    launch(topk_fast_grad_kernel, grid, *args, **constexprs)
