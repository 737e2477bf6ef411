"""``topk_kl(normalize="topk")`` on the GPU: the K stored ids of a row are all it touches.

The student is renormalized over each row's valid ids, so the loss needs no vocabulary-wide work:
it is bound by gathering the K rows of ws of every row (x_n . w_id for the logits, again for dX) and
x rows for dW, and by writing dW. A gather from L2 runs at about twice HBM's rate, so the gathering
kernels walk D in column blocks, every row tile of one block before the next block: ws cut to 64
columns (V * 128 bytes) stays in L2 and each row of ws comes from HBM about once per pass instead of
once per entry. The kernels:

- ``ks.topk_support_logits_kernel``: the K raw logits of every row, summed over column blocks with fp32
  atomic adds (so their last bits can vary between runs; with
  ``torch.use_deterministic_algorithms(True)`` the row kernel gathers them itself, in a fixed order).
- ``ks.topk_support_fwd_kernel`` (one program per row): applies the [K] math of ``rowmath.topk_rows`` for
  normalize="topk" (the divergences of ``nitrobrew.divergences`` through ``tl_utils.row_terms``) and writes the
  row's divergence, its gradient coefficients per unit upstream gradient (raw-logit units) and each
  entry's sort key (its id; V at padding entries and ignored rows).
- ``ks.topk_support_dx_kernel``: dX_n = g_n sum_k c_nk w_{id_nk}, one [rows, column block] tile per program.
- dW_v = sum over the entries with id v of g_row c x_row, from the entries sorted by key (CSR over
  the vocabulary): a counting sort, its buckets counted by the row kernel and filled by
  ``ks.topk_support_sort_kernel``, which also writes each sorted entry's row and term g_row c (so dW reads
  them contiguously); under deterministic algorithms a stable sort instead (the order inside a
  counting-sort bucket varies between runs). ``ks.topk_support_dw_rows_kernel``: a tile of vocab rows walks its
  rows' entries in lock step, J entries of every row per step; every row of dW is written once, zeros
  included (no memset). A row with more than CAP entries (an id in many rows' top-k, as frequent
  tokens are with a trained teacher) would hold its whole tile for count / J steps: its entries are
  summed beforehand by ``ks.topk_support_dw_long_kernel``, one program per window of CAP sorted entries, each window
  storing its sums for the (at most two) long rows it meets in its own two slots; the tile then adds
  the slots of its long rows window by window. No atomics, so this part is deterministic. db comes
  out of the same walks.

g is the upstream gradient per row (times kd_weight and the mean's 1 / rows): a 1-element tensor
with stride 0 for "mean"/"sum", per row for "none".
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import divergences as dv
from ..core import checks as ck
from ..core.launch import cdiv, next_pow2
from ..core.reduction import PartsFunction
from ..core.tl_utils import math_args
from . import kernels_support as ks
from .rowmath import TopKConfig

F32 = torch.float32


@dataclass(frozen=True)
class SupportTiles:
    logit_block_r: int = 2  # forward logits by column blocks: rows per tile
    logit_block_kb: int = 32
    logit_block_d: int = 64  # W cut to 64 columns (V * 128 bytes in bf16) stays in L2
    logit_warps: int = 2
    block_kb: int = 64  # forward row kernel: ids at once (and gathered at once on the deterministic path)
    block_d: int = 64  # deterministic path: hidden columns per step
    warps: int = 2
    dx_block_r: int = 16  # rows per dX tile
    dx_block_kb: int = 8  # ids of every row at once
    dx_block_d: int = 64  # W cut to 64 columns (V * 128 bytes in bf16) stays in L2
    dx_warps: int = 4
    dw_block_r: int = 8  # vocab rows per dW tile
    dw_j: int = 4  # entries of every row per lock step
    dw_block_d: int = 64
    dw_d_steps: int = 7  # column blocks per program, one after the other (the entries' loads hit L1 again)
    dw_warps: int = 1
    scatter_block: int = 1024  # entries per program of the counting sort's scatter
    dw_min_cap: int = 64  # rows with more entries are summed by windows
    dw_sub: int = 32  # entries per step of a window
    dw_long_block_d: int = 256
    dw_long_warps: int = 2


TILES = SupportTiles()
# small: several blocks at the tests' odd shapes, long rows from 3 entries on
INTERPRETER_TILES = SupportTiles(
    logit_block_r=2,
    logit_block_kb=4,
    logit_block_d=16,
    logit_warps=1,
    block_kb=4,
    block_d=16,
    warps=1,
    dx_block_r=4,
    dx_block_kb=4,
    dx_block_d=16,
    dx_warps=1,
    dw_block_r=4,
    dw_j=2,
    dw_block_d=16,
    dw_d_steps=2,
    dw_warps=1,
    dw_min_cap=2,
    dw_sub=2,
    dw_long_block_d=16,
    scatter_block=16,
)


def tiles() -> SupportTiles:
    return INTERPRETER_TILES if ck.interpreter_enabled() else TILES


def scalar_reduction(kd_rows, mask, reduction: str, kd_weight: float):
    """(total, kd, ce, unit): the "mean"/"sum" reduction of the rows' divergences, as 0-dim fp32 tensors
    from one launch; unit = d total / d row value (times the upstream gradient in the backward)."""
    outs = [torch.empty((), dtype=F32, device=kd_rows.device) for _ in range(4)]
    ks.launch_scalar_reduction(
        (1,),
        kd_rows,
        mask,
        *outs,
        kd_rows.shape[0],
        kd_weight,
        MEAN=reduction == "mean",
        BLOCK=min(4096, next_pow2(max(kd_rows.shape[0], 16))),
        num_warps=4,
    )
    return outs


def support_forward(xs, ws, bs, ids, lp, mask, cfg: TopKConfig, check=None):
    """(kd [N], coef [N, K] per unit upstream gradient, key [N, K] int32: the id, V where not counted,
    counts: int32 [V + 1], 0 then each id's entries at 1 + id (None on the deterministic path)).
    ``check`` (the stored data's checks: one device sync) is called right before the first kernel,
    after the host's work, so the sync idles the device for one launch."""
    N, K = ids.shape
    D, V = xs.shape[1], ws.shape[0]
    t = tiles()
    kd = torch.empty(N, dtype=F32, device=xs.device)
    by_blocks = not torch.are_deterministic_algorithms_enabled()  # atomic sums: last bits vary between runs
    key = torch.empty(N, K, dtype=torch.int32, device=xs.device)
    if by_blocks:  # logits summed into zeroed coefficient slots, entries counted per id: one memset
        zeroed = torch.zeros(N * K + V + 1, dtype=torch.int32, device=xs.device)
        coef, counts = zeroed[: N * K].view(F32).view(N, K), zeroed[N * K :]
    else:
        coef, counts = torch.empty(N, K, dtype=F32, device=xs.device), None
    inv_temp, param, log_a, log_1ma = math_args(cfg)
    if check is not None:
        check()
    if N == 0:
        return kd, coef, key, counts
    if by_blocks:
        ks.launch_logits(
            (cdiv(N, t.logit_block_r), cdiv(D, t.logit_block_d)),
            xs,
            ws,
            ids,
            lp,
            mask,
            coef,
            N,
            K,
            D,
            V,
            xs.stride(0),
            ws.stride(0),
            ids.stride(0),
            lp.stride(0),
            BLOCK_R=t.logit_block_r,
            BLOCK_KB=min(t.logit_block_kb, next_pow2(K)),
            BLOCK_D=t.logit_block_d,
            num_warps=t.logit_warps,
        )
    ks.launch_fwd(
        (N,),
        xs,
        ws,
        bs if bs is not None else xs,
        ids,
        lp,
        mask,
        kd,
        coef,
        key,
        counts if by_blocks else key,
        K,
        D,
        V,
        xs.stride(0),
        ws.stride(0),
        ids.stride(0),
        lp.stride(0),
        inv_temp,
        param,
        log_a,
        log_1ma,
        HAS_BIAS=bs is not None,
        RENORM_T=cfg.renormalize_teacher,
        DIVERGENCE=dv.DIVERGENCE_IDS[cfg.divergence],
        HAS_Z=by_blocks,
        BLOCK_K=next_pow2(K),
        BLOCK_KB=min(t.block_kb, next_pow2(K)),
        BLOCK_D=t.block_d,
        num_warps=t.warps,
    )
    return kd, coef, key, counts


def support_dx(ws, key, coef, scale, dtype):
    N, K = key.shape
    D, V = ws.shape[1], ws.shape[0]
    t = tiles()
    dx = torch.empty(N, D, dtype=dtype, device=ws.device)
    if N:
        ks.launch_dx(
            (cdiv(N, t.dx_block_r), cdiv(D, t.dx_block_d)),
            ws,
            key,
            coef,
            scale,
            dx,
            N,
            K,
            D,
            V,
            ws.stride(0),
            dx.stride(0),
            scale.stride(0),
            BLOCK_R=t.dx_block_r,
            BLOCK_KB=min(t.dx_block_kb, next_pow2(K)),
            BLOCK_D=t.dx_block_d,
            num_warps=t.dx_warps,
        )
    return dx


def long_cap(entries: int, min_cap: int) -> int:
    """Entries above which a vocab row is summed by windows of that many sorted entries
    (``ks.topk_support_dw_long_kernel``): at most ~2048 windows whatever the batch (their two slots of partial sums
    take 2 * 2048 * D * 4 bytes), and lock-step walks of at most that many entries."""
    return max(min_cap, next_pow2(cdiv(entries, 2048)))


def sorted_entries(key, coef, scale, counts, V: int):
    """The entries sorted by key, as dW walks them: (rows int32 [E]: each sorted entry's row, terms fp32
    [E]: its g_row c, keys int32 [E], offs int32 [V + 1]: key v's entries are [offs[v], offs[v + 1])).
    With the forward's counts (int32 [V + 1]: 0, then each id's count), a counting sort: one cumsum and
    one kernel (the order inside a bucket varies between runs); without them a stable sort."""
    flat = key.view(-1)
    E, K, dev = flat.numel(), key.shape[1], key.device
    rows = torch.empty(E, dtype=torch.int32, device=dev)
    terms = torch.empty(E, dtype=F32, device=dev)
    if counts is None:
        srt, order = torch.sort(flat, stable=True)
        offs = torch.searchsorted(srt, torch.arange(V + 1, dtype=torch.int32, device=dev), out_int32=True)
        cursor = offs  # not read
    else:
        srt, order = torch.empty(E, dtype=torch.int32, device=dev), flat
        offs = torch.cumsum(counts, 0, dtype=torch.int32)
        cursor = torch.zeros(V, dtype=torch.int32, device=dev)  # counted up: the forward's counts stay
    if E:
        blk = tiles().scatter_block
        ks.launch_sort(
            (cdiv(E, blk),),
            flat,
            coef,
            scale,
            cursor,
            offs,
            order,
            rows,
            terms,
            srt,
            E,
            V,
            K,
            scale.stride(0),
            COUNTING=counts is not None,
            BLOCK=blk,
            num_warps=4,
        )
    return rows, terms, srt, offs


def support_dw(xs, key, coef, scale, V, bs, counts=None):
    """(dW [V, D] in xs's dtype, db [V] or None) from the entries sorted by key (counts: the forward's
    per-id entry counts, or None to sort: deterministic algorithms sort stably)."""
    D, E = xs.shape[1], key.numel()
    t = tiles()
    dev = xs.device
    if torch.are_deterministic_algorithms_enabled():
        counts = None
    rows, terms, srt, offs = sorted_entries(key, coef, scale, counts, V)
    cap = long_cap(E, t.dw_min_cap)
    n_win = cdiv(E, cap)
    part = torch.empty(2 * n_win, D, dtype=F32, device=dev)  # each window's two slots, read only if written
    part_b = torch.empty(2 * n_win, dtype=F32, device=dev) if bs is not None else part
    pkeys = torch.empty(2 * n_win, dtype=torch.int32, device=dev)
    dw = torch.empty(V, D, dtype=xs.dtype, device=dev)
    db = torch.empty(V, dtype=bs.dtype, device=dev) if bs is not None else None
    if E:
        ks.launch_dw_long(
            (n_win,),
            xs,
            rows,
            terms,
            srt,
            offs,
            part,
            part_b,
            pkeys,
            E,
            V,
            D,
            xs.stride(0),
            HAS_BIAS=bs is not None,
            CAP=cap,
            SUB=min(t.dw_sub, cap),
            BLOCK_D=t.dw_long_block_d,
            num_warps=t.dw_long_warps,
        )
    if V:
        ks.launch_dw_rows(
            (cdiv(V, t.dw_block_r), cdiv(D, t.dw_block_d * t.dw_d_steps)),
            xs,
            rows,
            terms,
            offs,
            part,
            part_b,
            pkeys,
            dw,
            dw if db is None else db,
            V,
            D,
            xs.stride(0),
            dw.stride(0),
            HAS_BIAS=bs is not None,
            CAP=cap,
            BLOCK_R=t.dw_block_r,
            J=t.dw_j,
            BLOCK_D=t.dw_block_d,
            D_STEPS=t.dw_d_steps,
            num_warps=t.dw_warps,
        )
    return dw, db


class SupportTopK(PartsFunction):
    """Reduced (total, kd, ce) of normalize="topk" (ce is 0: the hard-label CE needs normalize="full")."""

    @staticmethod
    def forward(ctx, xs, ws, bs, ids, lp, mask, cfg: TopKConfig, reduction: str, check):
        kd_rows, coef, key, counts = support_forward(
            xs=xs, ws=ws, bs=bs, ids=ids, lp=lp, mask=mask, cfg=cfg, check=check
        )
        if reduction == "none":
            kd, unit = kd_rows, None
            total, ce = kd_rows * cfg.kd_weight, torch.zeros_like(kd_rows)
        else:
            total, kd, ce, unit = scalar_reduction(kd_rows, mask, reduction, cfg.kd_weight)
        ctx.save_for_backward(xs, ws, bs, coef, key, counts, unit)
        ctx.cfg = cfg
        return SupportTopK.parts(ctx, total, kd, ce)

    @staticmethod
    @ck.no_double_backward
    def backward(ctx, grad_total, _gkd, _gce):
        xs, ws, bs, coef, key, counts, unit = ctx.saved_tensors
        scale = (grad_total.to(F32) * (ctx.cfg.kd_weight if unit is None else unit)).reshape(-1).contiguous()
        if scale.numel() == 1:
            scale = scale.as_strided((1,), (0,))  # one value for every row
        dx = dw = db = None
        if ctx.needs_input_grad[0]:
            dx = support_dx(ws, key, coef, scale, xs.dtype)
        if SupportTopK.head_needed(ctx):
            dw, db = support_dw(xs=xs, key=key, coef=coef, scale=scale, V=ws.shape[0], bs=bs, counts=counts)
        return SupportTopK.input_grads(ctx, dx, dw, db)


def support_topk(xs, ws, bs, ids, lp, mask, cfg: TopKConfig, reduction: str, check=None):
    """Entry used by the public API (flattened rows; "none" gives [N]; ``check``: see ``support_forward``)."""
    xs, ws = xs.contiguous(), ws.contiguous()
    bs = None if bs is None else bs.contiguous()
    return SupportTopK.apply(xs, ws, bs, ids.contiguous(), lp.contiguous(), mask.contiguous(), cfg, reduction, check)
