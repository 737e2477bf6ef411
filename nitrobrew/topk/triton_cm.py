"""Launchers and the autograd Function of the constant-memory Triton path of normalize="full".

The [rows, K] math (``rowmath``) and the statistics plumbing (``chunked.finish``,
``row_coefficients``) are shared with the PyTorch path; only the vocab-wide and gather work runs
in the kernels of ``kernels_cm``. float64 inputs take the PyTorch path; normalize="topk" has
its own kernels (``triton_support``).

Kept beside the fast mode (which is faster at a 64 MiB slab budget) because it is the one mode whose
working memory does not depend on a slab: O(N * K) state, 7-25 MiB at N = 4096-16384, K = 64
(docs/topk.md), against 69-134 MiB for the fast mode's smallest useful budget.
"""

from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass
from typing import Optional, Tuple

import torch
import triton.language as tl

from ..core import checks as ck
from ..core.launch import cdiv
from ..core.online import Online
from ..core.reduction import PartsFunction, combine_rows
from . import kernels_cm as kern
from .chunked import chunked_rows, finish, row_coefficients
from .rowmath import DenseCoef, TopKConfig

Tensor = torch.Tensor

# "fp32": dX and dW accumulate in fp32 buffers (the project's convention; 4 (N + V) D bytes of
# workspace). "native": locked adds straight into gradients of the input dtype, as CCE does
# (no workspace, bf16 rounding at every partial sum). A benchmark knob, not an API: the forward reads
# it and hands it to its backward (which may run on another thread).
_GRAD_ACCUM: contextvars.ContextVar[str] = contextvars.ContextVar("nitrobrew_topk_grad_accum", default="fp32")


@contextlib.contextmanager
def grad_accumulation(mode: str):
    """The gradient accumulation ("fp32" or "native") of the constant-memory losses formed in this region."""
    if mode not in ("fp32", "native"):
        raise ValueError(f"grad accumulation must be 'fp32' or 'native', got {mode!r}")
    token = _GRAD_ACCUM.set(mode)
    try:
        yield
    finally:
        _GRAD_ACCUM.reset(token)


PAD_ID = 2**31 - 1  # sorts after every real id and matches no column


@dataclass
class RowIds:
    """Each row's valid ids in ascending order, as the kernels search them (``_tile_row_ids``)."""

    ids: Tensor  # [N, K] int32, PAD_ID at padding entries (last)
    order: Tensor  # [N, K] int64: ids[n, j] = topk_ids[n, order[n, j]]
    steps: int  # binary-search steps over K entries: ceil(log2(K + 1))

    @staticmethod
    def build(ids: Tensor, valid: Tensor) -> "RowIds":
        key = torch.where(valid, ids.long(), torch.full_like(ids, PAD_ID, dtype=torch.long))
        srt, order = torch.sort(key, dim=1)
        return RowIds(srt.to(torch.int32).contiguous(), order, int(ids.shape[1]).bit_length())

    def sorted_values(self, values: Tensor) -> Tensor:
        """fp32 [N, K] per-entry values (row-major [N * K] or [N, K]) in the order of ``ids``."""
        return values.reshape(self.order.shape).gather(1, self.order).to(torch.float32).contiguous()


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
    return _tile_cfg(
        dtype, TileConfig(block_b=256, block_v=128, block_d=32, mm_block_d=32, num_warps=8, num_stages=3)
    )  # CCE's forward configuration


def _bwd_cfg(dtype: torch.dtype) -> TileConfig:
    return _tile_cfg(
        dtype, TileConfig(block_b=128, block_v=128, block_d=32, mm_block_d=64, num_warps=4, num_stages=4)
    )  # CCE's backward configuration


def _tile_cfg(dtype: torch.dtype, half_precision: TileConfig) -> TileConfig:
    """Tiles for the interpreter (tiny), fp32 inputs (FMA dots: small tiles), or 16-bit inputs."""
    if _interpreting():
        return TileConfig(block_b=16, block_v=16, block_d=16, mm_block_d=16, num_warps=1, num_stages=1)
    if dtype == torch.float32:
        return TileConfig(block_b=64, block_v=64, block_d=32, mm_block_d=32, num_warps=4, num_stages=2)
    return half_precision


def _dot_prec(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"  # bf16/fp16 operands ignore it


def _dot_f32(dtype: torch.dtype) -> bool:
    # Triton's interpreter computes bf16 tl.dot wrongly (garbage, triton 3.x): upcast there only
    return _interpreting() and dtype == torch.bfloat16


def gather_logits(xs: Tensor, ws: Tensor, bs: Optional[Tensor], ids: Tensor) -> Tensor:
    """fp32 [N, K]: x_n . w_{ids} (+ b) for ids in [0, V), 0 for the others."""
    N, K = ids.shape
    D = xs.shape[1]
    out = torch.empty(N, K, dtype=torch.float32, device=xs.device)
    if N == 0:
        return out
    block_k = 16 if _interpreting() else 32
    block_d = 16 if _interpreting() else 256
    kern.launch_gather(
        (N, cdiv(K, block_k)),
        xs,
        ws,
        bs if bs is not None else xs,
        ids,
        out,
        K,
        D,
        ws.shape[0],
        xs.stride(0),
        ws.stride(0),
        ids.stride(0),
        out.stride(0),
        HAS_BIAS=bs is not None,
        ACC=tl.float32,
        BLOCK_K=block_k,
        BLOCK_D=block_d,
        num_warps=4,
    )
    return out


def lse_range(
    xs: Tensor, ws: Tensor, bs: Optional[Tensor], temperature: float, with_raw: bool, outside: RowIds
) -> Tuple[Online, Optional[Tensor]]:
    """Per row: the online (max, tail) state of the tempered logits over the rows of ws outside
    ``outside``'s ids (the student's mass outside the stored ids), and the log-sum-exp of the raw ones
    over all of them (with_raw, else None)."""
    N, D = xs.shape
    V = ws.shape[0]
    c = _fwd_cfg(xs.dtype)
    m_s = torch.full((N,), float("-inf"), dtype=torch.float32, device=xs.device)
    l_s = torch.zeros((N,), dtype=torch.float32, device=xs.device)
    lse_z = torch.full((N,), float("-inf"), dtype=torch.float32, device=xs.device) if with_raw else m_s
    if N == 0 or V == 0:
        return Online(m_s, l_s - 1.0), (lse_z if with_raw else None)
    locks = torch.zeros(cdiv(N, c.block_b), dtype=torch.int32, device=xs.device)
    K = outside.ids.shape[1]
    kern.launch_lse(
        (cdiv(N, c.block_b) * cdiv(V, c.block_v),),
        xs,
        ws,
        bs if bs is not None else xs,
        m_s,
        l_s,
        lse_z,
        locks,
        outside.ids,
        N,
        V,
        D,
        K,
        outside.steps,
        1.0 / temperature,
        xs.stride(0),
        ws.stride(0),
        K,
        HAS_BIAS=bs is not None,
        HAS_Z=with_raw,
        DOT_PREC=_dot_prec(xs.dtype),
        BLOCK_B=c.block_b,
        BLOCK_V=c.block_v,
        BLOCK_D=c.block_d,
        GROUP_B=c.group_b,
        EVEN_D=D % c.block_d == 0,
        DOT_F32=_dot_f32(xs.dtype),
        num_warps=c.num_warps,
        num_stages=c.num_stages,
    )
    # tail = l - 1: l in [1, V], its log keeps ~eps (-1 where nothing was seen)
    return Online(m_s, l_s - 1.0), (lse_z if with_raw else None)


def full_backward_range(
    xs,
    ws,
    bs,
    lse_z,
    dense: DenseCoef,
    ce_scale,
    labels,
    row_ids: RowIds,
    coef,
    temperature,
    need_w: bool = True,
    accum: str = "fp32",
):
    """(dX, dW, db) w.r.t. the raw logits: coef at each row's stored ids (coef [N * K] in the order of
    topk_ids: their whole KD gradient) + dense.tail_n * exp(s_nj - lse_tail_n) outside the row's ids, + the
    CE part ce_n * (softmax(z)_nj - [j == label_n]) (labels global, -1 where none)."""
    N, D = xs.shape
    V = ws.shape[0]
    c = _bwd_cfg(xs.dtype)
    acc_dtype = torch.float32 if accum == "fp32" else xs.dtype
    n_rb, n_vt = cdiv(N, c.block_b), cdiv(V, c.block_v)
    f32 = lambda t: t.to(torch.float32).contiguous()  # noqa: E731
    coef_s = row_ids.sorted_values(coef)
    has_ce = ce_scale is not None
    lse_t = torch.where(torch.isfinite(dense.lse_tail), dense.lse_tail, 0.0)  # no outside entry: 0
    dx = torch.zeros(N, D, dtype=acc_dtype, device=xs.device)
    dw = torch.zeros(V, D, dtype=torch.float32 if accum == "fp32" else ws.dtype, device=xs.device) if need_w else dx
    db = torch.zeros(V, dtype=torch.float32, device=xs.device) if (bs is not None and need_w) else dx
    n_dch = cdiv(D, c.mm_block_d)
    locks_x = torch.zeros(n_rb * n_dch, dtype=torch.int32, device=xs.device)
    locks_w = torch.zeros(n_vt * n_dch if need_w else 1, dtype=torch.int32, device=xs.device)
    if N > 0 and V > 0:
        kern.launch_bwd(
            (n_rb * n_vt,),
            xs,
            ws,
            bs if bs is not None else xs,
            lse_z if has_ce else coef_s,
            f32(ce_scale) if has_ce else coef_s,
            labels.to(torch.int32).contiguous() if has_ce else locks_x,
            row_ids.ids,
            coef_s,
            f32(dense.tail),
            f32(lse_t),
            dx,
            dw,
            db,
            locks_x,
            locks_w,
            N,
            V,
            D,
            row_ids.ids.shape[1],
            row_ids.steps,
            1.0 / temperature,
            xs.stride(0),
            ws.stride(0),
            dx.stride(0),
            dw.stride(0),
            row_ids.ids.stride(0),
            n_dch,
            HAS_BIAS=bs is not None,
            HAS_CE=has_ce,
            NEED_W=need_w,
            DOT_PREC=_dot_prec(xs.dtype),
            BLOCK_B=c.block_b,
            BLOCK_V=c.block_v,
            BLOCK_D=c.block_d,
            MM_BLOCK_D=c.mm_block_d,
            GROUP_B=c.group_b,
            EVEN_D=D % c.block_d == 0,
            DOT_F32=_dot_f32(xs.dtype),
            num_warps=c.num_warps,
            num_stages=c.num_stages,
        )
    return dx, (dw if need_w else None), (db if (bs is not None and need_w) else None)


class TritonTopK(PartsFunction):
    @staticmethod
    def forward(ctx, xs, ws, bs, ids, lp, labels, mask, cfg: TopKConfig):
        xs, ws = xs.contiguous(), ws.contiguous()
        bs = None if bs is None else bs.contiguous()
        valid = torch.isfinite(lp)
        N, K = ids.shape
        lpc = lp.to(torch.float32)
        row_ids = RowIds.build(ids, valid)
        ids_g = ids if not cfg.with_ce else torch.cat([ids, labels.clamp_min(0)[:, None]], 1)
        z = gather_logits(xs, ws, bs, ids_g.contiguous())
        s_state, lse_z = lse_range(
            xs, ws, bs, cfg.temperature, with_raw=cfg.with_ce and cfg.temperature != 1.0, outside=row_ids
        )
        res, lse_z, ce = finish(
            z_ids=z[:, :K].reshape(-1),
            lp=lpc,
            valid=valid,
            s_state=s_state,
            z_state=None if lse_z is None else Online(lse_z, torch.zeros_like(lse_z)),  # tail 0: l = 1
            z_label=z[:, K] if cfg.with_ce else None,
            cfg=cfg,
        )
        total, kd, ce_rows = combine_rows(res.kd, ce, mask, cfg)
        ctx.save_for_backward(xs, ws, bs, labels, mask)
        ctx.res, ctx.lse_z, ctx.cfg, ctx.row_ids = res, lse_z, cfg, row_ids
        ctx.accum = _GRAD_ACCUM.get()
        return TritonTopK.parts(ctx, total, kd, ce_rows)

    @staticmethod
    @ck.no_double_backward
    def backward(ctx, grad_total, _gkd, _gce):
        xs, ws, bs, labels, mask = ctx.saved_tensors
        cfg = ctx.cfg
        coef, dense, ce_scale = row_coefficients(grad_total, mask, ctx.res, cfg)
        need_w = TritonTopK.head_needed(ctx)
        dx, dw, db = full_backward_range(
            xs=xs,
            ws=ws,
            bs=bs,
            lse_z=ctx.lse_z,
            dense=dense,
            ce_scale=ce_scale,
            labels=labels,
            row_ids=ctx.row_ids,
            coef=coef,
            temperature=cfg.temperature,
            need_w=need_w,
            accum=ctx.accum,
        )
        dw = None if dw is None else dw.to(ws.dtype)
        db = None if db is None else db.to(bs.dtype)
        return TritonTopK.input_grads(ctx, dx.to(xs.dtype) if ctx.needs_input_grad[0] else None, dw, db)


def constant_memory_rows(xs, ws, bs, ids, lp, labels, mask, cfg: TopKConfig):
    """Entry used by the public API (float64 inputs run the PyTorch path)."""
    if xs.dtype == torch.float64:
        return chunked_rows(xs=xs, ws=ws, bs=bs, ids=ids, lp=lp, labels=labels, mask=mask, cfg=cfg)
    return TritonTopK.apply(xs, ws, bs, ids, lp, labels, mask, cfg)
