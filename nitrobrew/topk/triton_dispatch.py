"""Launchers and the autograd Function of the Triton top-k path.

The [rows, K] math (``rowmath``) and the statistics plumbing (``chunked.finish``,
``row_coefficients``) are shared with the PyTorch path; only the vocab-wide and gather/scatter
work runs in the kernels of ``triton_kernels``. float64 inputs take the PyTorch path.

Vocab-parallel pieces (a rank holding head rows [lo, lo + V_local)): ``lse_range`` (the
student's log-sum-exp over the local rows, as an ``Online`` state with l = 1, merged with
``chunked.merge_states``), ``gather_logits`` (logits at the ids inside the local range, 0
elsewhere: sum them over ranks) and ``full_backward_range`` (local dW, partial dX: sum over ranks).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from .. import _checks as ck
from ..hidden.chunked import Online
from . import triton_kernels as kern
from .chunked import Entries, chunked_rows, combine_rows, finish, row_coefficients
from .rowmath import TopKConfig

Tensor = torch.Tensor

# "fp32": dX and dW accumulate in fp32 buffers (the project's convention; 4 (N + V) D bytes of
# workspace). "native": locked adds straight into gradients of the input dtype, as CCE does
# (no workspace, bf16 rounding at every partial sum). A benchmark knob, not an API.
GRAD_ACCUM = "fp32"


@contextlib.contextmanager
def grad_accumulation(mode: str):
    """Set GRAD_ACCUM for a region; it is read when the backward runs, so wrap the backward too."""
    global GRAD_ACCUM
    if mode not in ("fp32", "native"):
        raise ValueError(f"grad accumulation must be 'fp32' or 'native', got {mode!r}")
    old, GRAD_ACCUM = GRAD_ACCUM, mode
    try:
        yield
    finally:
        GRAD_ACCUM = old


@dataclass(frozen=True)
class TileConfig:
    block_b: int
    block_v: int
    block_d: int
    mm_block_d: int
    num_warps: int
    num_stages: int
    group_b: int = 8


def _interpreting() -> bool:
    return ck.interpreter_enabled()


def _fwd_cfg(dtype: torch.dtype) -> TileConfig:
    if _interpreting():
        return TileConfig(16, 16, 16, 16, 1, 1)
    if dtype == torch.float32:
        return TileConfig(64, 64, 32, 32, 4, 2)
    return TileConfig(256, 128, 32, 32, 8, 3)  # CCE's forward configuration


def _bwd_cfg(dtype: torch.dtype) -> TileConfig:
    if _interpreting():
        return TileConfig(16, 16, 16, 16, 1, 1)
    if dtype == torch.float32:
        return TileConfig(64, 64, 32, 32, 4, 2)
    return TileConfig(128, 128, 32, 64, 4, 4)  # CCE's backward configuration


def _dot_prec(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"  # bf16/fp16 operands ignore it


def _dot_f32(dtype: torch.dtype) -> bool:
    # Triton's interpreter computes bf16 tl.dot wrongly (garbage, triton 3.x): upcast there only
    return _interpreting() and dtype == torch.bfloat16


def gather_logits(xs: Tensor, ws: Tensor, bs: Optional[Tensor], ids: Tensor, lo: int = 0) -> Tensor:
    """fp32 [N, K]: x_n . w_{ids - lo} (+ b) for ids in [lo, lo + V_local), 0 for the others."""
    N, K = ids.shape
    D = xs.shape[1]
    out = torch.empty(N, K, dtype=torch.float32, device=xs.device)
    if N == 0:
        return out
    block_k = 16 if _interpreting() else 32
    block_d = 16 if _interpreting() else 256
    kern._gather_kernel[(N, triton.cdiv(K, block_k))](
        xs, ws, bs if bs is not None else xs, ids, out, K, D, ws.shape[0], lo,
        xs.stride(0), ws.stride(0), ids.stride(0), out.stride(0),
        HAS_BIAS=bs is not None, ACC=tl.float32, BLOCK_K=block_k, BLOCK_D=block_d, num_warps=4,
    )
    return out


def gather_dx(ws: Tensor, coef: Tensor, ids: Tensor) -> Tensor:
    """fp32 [N, D]: sum_k coef_nk w_{id_nk}."""
    N, K = ids.shape
    D = ws.shape[1]
    dx = torch.empty(N, D, dtype=torch.float32, device=ws.device)
    if N == 0:
        return dx
    block_k = 16 if _interpreting() else 32
    block_d = 16 if _interpreting() else 256
    kern._gather_dx_kernel[(N, triton.cdiv(D, block_d))](
        ws, coef, ids, dx, K, D, ws.stride(0), coef.stride(0), ids.stride(0), dx.stride(0),
        ACC=tl.float32, BLOCK_K=block_k, BLOCK_D=block_d, num_warps=4,
    )
    return dx


def scatter_dw(xs: Tensor, entries: Entries, coef: Tensor, V: int, dtype: torch.dtype) -> Tensor:
    """[V, D] in `dtype`: row v = sum over the entries with id v of coef * x_row (zeros elsewhere)."""
    D = xs.shape[1]
    dw = torch.empty(V, D, dtype=dtype, device=xs.device)
    offs = torch.searchsorted(entries.ids, torch.arange(V + 1, device=xs.device)).to(torch.int32)
    c = coef[entries.flat].to(torch.float32).contiguous()
    rows = entries.rows.contiguous()
    rpp = 4 if _interpreting() else 16
    block_d = 16 if _interpreting() else 512
    kern._scatter_dw_kernel[(triton.cdiv(V, rpp), triton.cdiv(D, block_d))](
        xs, c, rows, offs, dw, V, D, xs.stride(0), dw.stride(0),
        ACC=tl.float32, ROWS_PER_PROG=rpp, BLOCK_E=16, BLOCK_D=block_d, num_warps=4,
    )
    return dw


def lse_range(xs: Tensor, ws: Tensor, bs: Optional[Tensor], temperature: float,
              with_raw: bool) -> Tuple[Tensor, Optional[Tensor]]:
    """Per-row log-sum-exp of the tempered logits over the rows of ws (and of the raw ones)."""
    N, D = xs.shape
    V = ws.shape[0]
    c = _fwd_cfg(xs.dtype)
    lse_s = torch.full((N,), float("-inf"), dtype=torch.float32, device=xs.device)
    lse_z = torch.full((N,), float("-inf"), dtype=torch.float32, device=xs.device) if with_raw else lse_s
    if N == 0 or V == 0:
        return lse_s, (lse_z if with_raw else None)
    locks = torch.zeros(triton.cdiv(N, c.block_b), dtype=torch.int32, device=xs.device)
    grid = (triton.cdiv(N, c.block_b) * triton.cdiv(V, c.block_v),)
    kern._lse_kernel[grid](
        xs, ws, bs if bs is not None else xs, lse_s, lse_z, locks, N, V, D, 1.0 / temperature,
        xs.stride(0), ws.stride(0),
        HAS_BIAS=bs is not None, HAS_Z=with_raw, DOT_PREC=_dot_prec(xs.dtype),
        BLOCK_B=c.block_b, BLOCK_V=c.block_v, BLOCK_D=c.block_d, GROUP_B=c.group_b,
        EVEN_D=D % c.block_d == 0, DOT_F32=_dot_f32(xs.dtype), num_warps=c.num_warps, num_stages=c.num_stages,
    )
    return lse_s, (lse_z if with_raw else None)


def full_backward_range(xs, ws, bs, lse_s, lse_z, dense, ce_scale, e_rows, e_cols, e_coef, temperature,
                        need_w: bool = True, accum: Optional[str] = None):
    """(dX, dW, db) of the rows of ws: dense part dense_n * q_nj (+ CE part ce_n * softmax(z)_nj)
    plus the sparse entries (e_rows, e_cols local to ws, e_coef), all w.r.t. the raw logits."""
    N, D = xs.shape
    V = ws.shape[0]
    c = _bwd_cfg(xs.dtype)
    accum = accum or GRAD_ACCUM
    acc_dtype = torch.float32 if accum == "fp32" else xs.dtype
    n_rb, n_vt = triton.cdiv(N, c.block_b), triton.cdiv(V, c.block_v)
    key = torch.div(e_rows, c.block_b, rounding_mode="floor") * n_vt + torch.div(e_cols, c.block_v,
                                                                                 rounding_mode="floor")
    key, order = torch.sort(key)
    offs = torch.searchsorted(key, torch.arange(n_rb * n_vt + 1, device=xs.device)).to(torch.int32)
    rows_s = e_rows[order].to(torch.int32).contiguous()
    cols_s = e_cols[order].to(torch.int32).contiguous()
    coef_s = e_coef[order].to(torch.float32).contiguous()
    dx = torch.zeros(N, D, dtype=acc_dtype, device=xs.device)
    dw = torch.zeros(V, D, dtype=torch.float32 if accum == "fp32" else ws.dtype, device=xs.device) if need_w else dx
    db = torch.zeros(V, dtype=torch.float32, device=xs.device) if (bs is not None and need_w) else dx
    n_dch = triton.cdiv(D, c.mm_block_d)
    locks_x = torch.zeros(n_rb * n_dch, dtype=torch.int32, device=xs.device)
    locks_w = torch.zeros(n_vt * n_dch if need_w else 1, dtype=torch.int32, device=xs.device)
    has_ce = ce_scale is not None
    if N > 0 and V > 0:
        kern._full_bwd_kernel[(n_rb * n_vt,)](
            xs, ws, bs if bs is not None else xs, lse_s, lse_z if has_ce else lse_s, dense.to(torch.float32).contiguous(),
            ce_scale.to(torch.float32).contiguous() if has_ce else lse_s, offs, rows_s, cols_s, coef_s,
            dx, dw, db, locks_x, locks_w, N, V, D, 1.0 / temperature,
            xs.stride(0), ws.stride(0), dx.stride(0), dw.stride(0), n_dch,
            HAS_BIAS=bs is not None, HAS_CE=has_ce, NEED_W=need_w, DOT_PREC=_dot_prec(xs.dtype),
            BLOCK_B=c.block_b, BLOCK_V=c.block_v, BLOCK_D=c.block_d, MM_BLOCK_D=c.mm_block_d,
            GROUP_B=c.group_b, EVEN_D=D % c.block_d == 0, DOT_F32=_dot_f32(xs.dtype),
            num_warps=c.num_warps, num_stages=c.num_stages,
        )
    return dx, (dw if need_w else None), (db if (bs is not None and need_w) else None)


def _full_entries(ids: Tensor, valid: Tensor, coef: Tensor, labels: Optional[Tensor], ce_scale: Optional[Tensor]):
    """Sparse (row, col, coef) entries of a full-vocab backward: stored ids, then CE labels."""
    N, K = ids.shape
    sel = torch.nonzero(valid.reshape(-1), as_tuple=False).squeeze(1)
    rows = torch.div(sel, K, rounding_mode="floor")
    cols = ids.reshape(-1)[sel]
    vals = coef[sel]
    if ce_scale is not None and labels is not None:
        has = labels >= 0
        lrows = torch.nonzero(has, as_tuple=False).squeeze(1)
        rows = torch.cat([rows, lrows])
        cols = torch.cat([cols, labels[lrows]])
        vals = torch.cat([vals, -ce_scale[lrows].to(vals.dtype)])
    return rows, cols.long(), vals


class TritonTopK(torch.autograd.Function):
    @staticmethod
    def forward(ctx, xs, ws, bs, ids, lp, labels, mask, cfg: TopKConfig):
        xs, ws = xs.contiguous(), ws.contiguous()
        bs = None if bs is None else bs.contiguous()
        valid = torch.isfinite(lp)
        N, K = ids.shape
        lpc = lp.to(torch.float32)
        if cfg.full:
            ids_g = ids if not cfg.with_ce else torch.cat([ids, labels.clamp_min(0)[:, None]], 1)
            z = gather_logits(xs, ws, bs, ids_g.contiguous())
            lse_s, lse_z = lse_range(xs, ws, bs, cfg.temperature, cfg.with_ce and cfg.temperature != 1.0)
            ones = torch.ones_like(lse_s)
            res, lse_s, lse_z, ce = finish(
                z[:, :K].reshape(-1), lpc, valid, Online(lse_s, ones),
                None if lse_z is None else Online(lse_z, ones), z[:, K] if cfg.with_ce else None, cfg)
        else:
            z = gather_logits(xs, ws, bs, ids)
            res, lse_s, lse_z, ce = finish(z.reshape(-1), lpc, valid, None, None, None, cfg)
        total, kd, ce_rows = combine_rows(res, ce, mask, cfg)
        ctx.save_for_backward(xs, ws, bs, ids, labels, mask, valid)
        ctx.res, ctx.lse_s, ctx.lse_z, ctx.cfg = res, lse_s, lse_z, cfg
        ctx.mark_non_differentiable(kd, ce_rows)
        return total, kd, ce_rows

    @staticmethod
    def backward(ctx, grad_total, _gkd, _gce):
        xs, ws, bs, ids, labels, mask, valid = ctx.saved_tensors
        cfg = ctx.cfg
        coef, dense, ce_scale = row_coefficients(grad_total, mask, ctx.res, cfg)
        need_w = ctx.needs_input_grad[1] or ctx.needs_input_grad[2]
        if cfg.full:
            rows, cols, vals = _full_entries(ids, valid, coef, labels, ce_scale)
            dx, dw, db = full_backward_range(xs, ws, bs, ctx.lse_s, ctx.lse_z, dense, ce_scale, rows, cols, vals,
                                             cfg.temperature, need_w=need_w)
            dw = None if dw is None else dw.to(ws.dtype)
            db = None if db is None else db.to(bs.dtype)
        else:
            N, K = ids.shape
            dx = gather_dx(ws, coef.view(N, K).to(torch.float32).contiguous(), ids)
            dw = db = None
            if need_w:
                entries = Entries.build(ids, valid)
                dw = scatter_dw(xs, entries, coef, ws.shape[0], ws.dtype)
                if bs is not None:
                    db = torch.zeros(bs.shape, dtype=torch.float32, device=bs.device).index_add_(
                        0, entries.ids, coef[entries.flat].float()).to(bs.dtype)
        dx = dx.to(xs.dtype) if ctx.needs_input_grad[0] else None
        dw = dw if ctx.needs_input_grad[1] else None
        db = db if ctx.needs_input_grad[2] else None
        return dx, dw, db, None, None, None, None, None


def triton_rows(xs, ws, bs, ids, lp, labels, mask, cfg: TopKConfig):
    """Entry used by the public API (float64 inputs run the PyTorch path)."""
    if xs.dtype == torch.float64:
        return chunked_rows(xs, ws, bs, ids, lp, labels, mask, cfg)
    return TritonTopK.apply(xs, ws, bs, ids, lp, labels, mask, cfg)
