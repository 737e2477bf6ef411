"""``topk_kl(normalize="topk")`` on the GPU: the K stored ids of a row are all it touches.

The student is renormalized over each row's valid ids, so the loss needs no vocabulary-wide work:
it is bound by gathering the K rows of ws of every row (x_n . w_id for the logits, again for dX) and
x rows for dW, and by writing dW. A gather from L2 runs at about twice HBM's rate, so the gathering
kernels walk D in column blocks, every row tile of one block before the next block: ws cut to 64
columns (V * 128 bytes) stays in L2 and each row of ws comes from HBM about once per pass instead of
once per entry. The kernels:

- ``_support_logits_kernel``: the K raw logits of every row, summed over column blocks with fp32
  atomic adds (so their last bits can vary between runs; with
  ``torch.use_deterministic_algorithms(True)`` the row kernel gathers them itself, in a fixed order).
- ``_support_fwd_kernel`` (one program per row): applies the [K] math of ``rowmath.topk_rows`` for
  normalize="topk" (the divergences of ``nitrobrew.divergences`` through ``phi_u``) and writes the
  row's divergence, its gradient coefficients per unit upstream gradient (raw-logit units) and each
  entry's sort key (its id; V at padding entries and ignored rows).
- ``_support_dx_kernel``: dX_n = g_n sum_k c_nk w_{id_nk}, one [rows, column block] tile per program.
- dW_v = sum over the entries with id v of g_row c x_row, from the entries sorted by key (CSR over
  the vocabulary): a counting sort, its buckets counted by the row kernel and filled by
  ``_sorted_entries_kernel``, which also writes each sorted entry's row and term g_row c (so dW reads
  them contiguously); under deterministic algorithms a stable sort instead (the order inside a
  counting-sort bucket varies between runs). ``_dw_rows_kernel``: a tile of vocab rows walks its
  rows' entries in lock step, J entries of every row per step; every row of dW is written once, zeros
  included (no memset). A row with more than CAP entries (an id in many rows' top-k, as frequent
  tokens are with a trained teacher) would hold its whole tile for count / J steps: its entries are
  summed beforehand by ``_dw_long_kernel``, one program per window of CAP sorted entries, each window
  storing its sums for the (at most two) long rows it meets in its own two slots; the tile then adds
  the slots of its long rows window by window. No atomics, so this part is deterministic. db comes
  out of the same walks.

g is the upstream gradient per row (times kd_weight and the mean's 1 / rows): a 1-element tensor
with stride 0 for "mean"/"sum", per row for "none".
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .. import _checks as ck
from .. import divergences as dv
from .._launch import cdiv, launch, next_pow2
from ..hidden.triton_rows import _f32, _math_args, phi_u
from .rowmath import TopKConfig

F32 = torch.float32


@dataclass(frozen=True)
class SupportTiles:
    logit_block_r: int = 2   # forward logits by column blocks: rows per tile
    logit_block_kb: int = 32
    logit_block_d: int = 64  # W cut to 64 columns (V * 128 bytes in bf16) stays in L2
    logit_warps: int = 2
    block_kb: int = 64    # forward row kernel: ids at once (and gathered at once on the deterministic path)
    block_d: int = 64     # deterministic path: hidden columns per step
    warps: int = 2
    dx_block_r: int = 16   # rows per dX tile
    dx_block_kb: int = 8   # ids of every row at once
    dx_block_d: int = 64   # W cut to 64 columns (V * 128 bytes in bf16) stays in L2
    dx_warps: int = 4
    dw_block_r: int = 8   # vocab rows per dW tile
    dw_j: int = 4         # entries of every row per lock step
    dw_block_d: int = 64
    dw_d_steps: int = 7   # column blocks per program, one after the other (the entries' loads hit L1 again)
    dw_warps: int = 1
    scatter_block: int = 1024  # entries per program of the counting sort's scatter
    dw_min_cap: int = 64   # rows with more entries are summed by windows
    dw_sub: int = 32       # entries per step of a window
    dw_long_block_d: int = 256
    dw_long_warps: int = 2


TILES = SupportTiles()
# small: several blocks at the tests' odd shapes, long rows from 3 entries on
INTERPRETER_TILES = SupportTiles(logit_block_r=2, logit_block_kb=4, logit_block_d=16, logit_warps=1,
                                 block_kb=4, block_d=16, warps=1, dx_block_r=4, dx_block_kb=4, dx_block_d=16,
                                 dx_warps=1, dw_block_r=4, dw_j=2, dw_block_d=16, dw_d_steps=2, dw_warps=1,
                                 dw_min_cap=2, dw_sub=2, dw_long_block_d=16, scatter_block=16)


def tiles() -> SupportTiles:
    return INTERPRETER_TILES if ck.interpreter_enabled() else TILES


@triton.jit
def _masked_lse(x, ok):
    m = tl.max(tl.where(ok, x, float("-inf")), axis=0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    total = tl.sum(tl.where(ok, tl.exp(x - m_safe), 0.0), axis=0)  # >= 1 when any entry is valid
    return m_safe + tl.log(tl.maximum(total, 1.0))  # no valid entry: 0 (every entry is masked anyway)


@triton.jit
def _row_dots(x_row, W, ids, ok, D, stride_wv, BLOCK_D: tl.constexpr):
    """[BLOCK_KB] fp32: x_row . W[ids] over the D columns (0 where not ok)."""
    acc = tl.zeros(ids.shape, dtype=tl.float32)
    for d0 in range(0, D, BLOCK_D):
        offs_d = d0 + tl.arange(0, BLOCK_D)
        dm = offs_d < D
        x = tl.load(x_row + offs_d, mask=dm, other=0.0).to(tl.float32)
        w = tl.load(W + ids[:, None] * stride_wv + offs_d[None, :], mask=ok[:, None] & dm[None, :], other=0.0)
        acc += tl.sum(w.to(tl.float32) * x[None, :], axis=1)
    return acc


@triton.jit
def _entries(IDS, LP, at_i, at_l, valid, V):
    """(ids as int64, ok): entries that count: valid (row counted, inside K), finite log-prob, id in
    [0, V) (ids outside it at finite entries are rejected before the launch; never read them anyway)."""
    lp = tl.load(LP + at_l, mask=valid, other=float("-inf"))
    ids = tl.load(IDS + at_i, mask=valid, other=0).to(tl.int64)
    ok = valid & (lp != float("-inf")) & (ids >= 0) & (ids < V)
    return tl.where(ok, ids, 0), ok


@triton.jit
def _support_logits_kernel(X, W, IDS, LP, MASK, Z, N, K, D, V, stride_xn, stride_wv, stride_in, stride_ln,
                           BLOCK_R: tl.constexpr, BLOCK_KB: tl.constexpr, BLOCK_D: tl.constexpr):
    """Z[n, k] += x_n . W[id_nk] over one block of columns (fp32 atomic adds into zeroed Z). The row tiles
    of one column block run before the next block's, so W cut to the block (V * BLOCK_D) stays in L2:
    each row of W comes from HBM about once per pass instead of once per entry."""
    rows = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    counted = (tl.load(MASK + rows, mask=rows < N, other=0.0) != 0.0)[:, None]
    offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    dm = offs_d < D
    x = tl.load(X + rows[:, None] * stride_xn + offs_d[None, :], mask=counted & dm[None, :], other=0.0)
    for k0 in range(0, K, BLOCK_KB):
        offs_k = (k0 + tl.arange(0, BLOCK_KB))[None, :]
        ids, ok = _entries(IDS, LP, rows[:, None] * stride_in + offs_k, rows[:, None] * stride_ln + offs_k,
                           counted & (offs_k < K), V)
        w = tl.load(W + ids[:, :, None] * stride_wv + offs_d[None, None, :], mask=ok[:, :, None] & dm[None, None, :],
                    other=0.0)
        part = tl.sum(w.to(tl.float32) * x.to(tl.float32)[:, None, :], axis=2)
        tl.atomic_add(Z + rows[:, None] * K + offs_k, part, mask=ok, sem="relaxed")


@triton.jit
def _support_fwd_kernel(X, W, B, IDS, LP, MASK, KD, COEF, KEY, COUNTS, K, D, V,
                        stride_xn, stride_wv, stride_in, stride_ln,
                        inv_temp, param, log_a, log_1ma,
                        HAS_BIAS: tl.constexpr, RENORM_T: tl.constexpr, DIVERGENCE: tl.constexpr,
                        HAS_Z: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_KB: tl.constexpr, BLOCK_D: tl.constexpr):
    """One row: its keys, the [K] math, its coefficients and divergence. The raw logits are in the row's
    coefficient slots already (HAS_Z: from ``_support_logits_kernel``) or gathered here (x_n . W[id],
    the same fp32 sums, in a fixed order: the deterministic path). HAS_Z also counts the entries of
    every id into COUNTS[1 + id] (the buckets of dW's counting sort)."""
    inv_temp = _f32(inv_temp)
    n = tl.program_id(0).to(tl.int64)
    counted = tl.load(MASK + n) != 0.0
    c_row = COEF + n * K
    key_row = KEY + n * K
    for k0 in range(0, K, BLOCK_KB):
        offs_k = k0 + tl.arange(0, BLOCK_KB)
        km = offs_k < K
        ids, ok = _entries(IDS, LP, n * stride_in + offs_k, n * stride_ln + offs_k, tl.where(counted, km, False), V)
        if HAS_Z:
            tl.atomic_add(COUNTS + 1 + ids, 1, mask=ok, sem="relaxed")
        else:
            tl.store(c_row + offs_k, _row_dots(X + n * stride_xn, W, ids, ok, D, stride_wv, BLOCK_D), mask=km)
        tl.store(key_row + offs_k, tl.where(ok, ids, V).to(tl.int32), mask=km)
    tl.debug_barrier()  # the row's logits and keys, written by every warp, are read back whole
    offs = tl.arange(0, BLOCK_K)
    km = offs < K
    key = tl.load(key_row + offs, mask=km, other=V)
    ok = key < V
    z = tl.load(c_row + offs, mask=km, other=0.0)
    if HAS_BIAS:
        z += tl.load(B + key, mask=ok, other=0.0).to(tl.float32)
    s = z * inv_temp
    lq = tl.where(ok, s - _masked_lse(s, ok), float("-inf"))
    lp = tl.where(ok, tl.load(LP + n * stride_ln + offs, mask=km, other=0.0).to(tl.float32), float("-inf"))
    if RENORM_T:  # compared distributions: the teacher renormalized over the same support
        lp = tl.where(ok, lp - _masked_lse(lp, ok), float("-inf"))
    phi, u = phi_u(lp, lq, _f32(param), _f32(log_a), _f32(log_1ma), DIVERGENCE)
    phi = tl.where(ok, phi, 0.0)
    u = tl.where(ok, u, 0.0)
    coef = (u - tl.exp(lq) * tl.sum(u, axis=0)) * inv_temp  # dD/dz: rowmath's u + q~ (-sum u), / T
    tl.debug_barrier()  # every warp has read the logits before they are overwritten
    tl.store(c_row + offs, coef, mask=km)
    tl.store(KD + n, tl.sum(phi, axis=0))


@triton.jit
def _support_dx_kernel(W, KEY, COEF, SCALE, DX, N, K, D, V, stride_wv, stride_dn, scale_stride,
                       BLOCK_R: tl.constexpr, BLOCK_KB: tl.constexpr, BLOCK_D: tl.constexpr):
    """A [BLOCK_R rows, BLOCK_D columns] tile of dX = g sum_k c_k W[key_k]. The row tiles of one column
    block run before the next block's, so the gathered rows of W, cut to the block (V * BLOCK_D), stay in L2."""
    rows = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    rm = rows < N
    offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    dm = offs_d < D
    acc = tl.zeros([BLOCK_R, BLOCK_D], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_KB):
        offs_k = k0 + tl.arange(0, BLOCK_KB)
        at = rows[:, None] * K + offs_k[None, :]
        key = tl.load(KEY + at, mask=rm[:, None] & (offs_k < K)[None, :], other=V)
        ok = key < V
        c = tl.load(COEF + at, mask=ok, other=0.0)
        w = tl.load(W + tl.where(ok, key, 0).to(tl.int64)[:, :, None] * stride_wv + offs_d[None, None, :],
                    mask=ok[:, :, None] & dm[None, None, :], other=0.0)
        acc += tl.sum(w.to(tl.float32) * c[:, :, None], axis=1)
    g = tl.load(SCALE + rows * scale_stride, mask=rm, other=0.0)
    tl.store(DX + rows[:, None] * stride_dn + offs_d[None, :], (acc * g[:, None]).to(DX.dtype.element_ty),
             mask=rm[:, None] & dm[None, :])


@triton.jit
def _entry_terms(X, ROWS, CS, pos, has, offs_d, dm, stride_xn):
    """For sorted positions pos (any shape): (g_row c, x_row[offs_d]) in fp32, 0 where not has; the x
    tile has pos's shape + [BLOCK_D]. Two dependent loads: the entry's row and term, then its x row."""
    row = tl.load(ROWS + pos, mask=has, other=0)
    c = tl.load(CS + pos, mask=has, other=0.0)
    x = tl.load(X + tl.expand_dims(row.to(tl.int64) * stride_xn, -1) + offs_d, mask=tl.expand_dims(has, -1) & dm,
                other=0.0)
    return c, x.to(tl.float32)


@triton.jit
def _sorted_entries_kernel(KEY, COEF, SCALE, CURSOR, OFFS, ORDER, ROWS, CS, SORTED, E, V, K, scale_stride,
                           COUNTING: tl.constexpr, BLOCK: tl.constexpr):
    """What dW reads at each sorted position: the entry's row, its term g_row c and its key.
    COUNTING (a counting sort's last step): entry e with key v < V takes the next slot of v's bucket
    [OFFS[v], OFFS[v + 1]) from the zeroed counter CURSOR[v]; the order inside a bucket is whatever the
    atomics give. Else ORDER holds the entries already sorted (a stable sort) and the keys are there too."""
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = i < E
    if COUNTING:
        e = i
        key = tl.load(KEY + e, mask=inside, other=V)
        ok = key < V
        slot = tl.atomic_add(CURSOR + key, 1, mask=ok, sem="relaxed")
        pos = tl.load(OFFS + key, mask=ok, other=0) + slot
        tl.store(SORTED + pos, key, mask=ok)
    else:
        pos = i
        ok = inside
        e = tl.load(ORDER + i, mask=ok, other=0)
    row = e // K
    c = tl.load(COEF + e, mask=ok, other=0.0) * tl.load(SCALE + row * scale_stride, mask=ok, other=0.0)
    tl.store(ROWS + pos, row.to(tl.int32), mask=ok)
    tl.store(CS + pos, c, mask=ok)


@triton.jit
def _dw_long_kernel(X, ROWS, CS, KEYS, OFFS, PART, PART_B, PKEYS, E, V, D, stride_xn,
                    HAS_BIAS: tl.constexpr, CAP: tl.constexpr, SUB: tl.constexpr, BLOCK_D: tl.constexpr):
    """One window of CAP sorted entries: its sums over the entries of long rows (count > CAP), in the
    window's two slots (PART[2w], PART[2w + 1], their keys in PKEYS), no atomics. A long row has more
    than CAP entries, so a window meets at most two of them (one ending, one starting); windows
    without any return at once and their slots are never read."""
    w = tl.program_id(0)
    w0 = w * CAP
    pos = w0 + tl.arange(0, CAP)
    E = tl.minimum(E, tl.load(OFFS + V))  # sorted entries with a key < V (the rest are not written)
    key = tl.load(KEYS + pos, mask=pos < E, other=V)
    inside = key < V
    cnt = tl.load(OFFS + key + 1, mask=inside, other=0) - tl.load(OFFS + key, mask=inside, other=0)
    is_long = inside & (cnt > CAP)
    if tl.sum(is_long.to(tl.int32), axis=0) > 0:
        k1 = tl.min(tl.where(is_long, key, V), axis=0)
        k2 = tl.max(tl.where(is_long, key, -1), axis=0)
        tl.store(PKEYS + 2 * w, k1)
        tl.store(PKEYS + 2 * w + 1, k2)
        slot1 = (2 * w).to(tl.int64) * D
        for d0 in range(0, D, BLOCK_D):
            offs_d = d0 + tl.arange(0, BLOCK_D)
            dm = offs_d < D
            a1 = tl.zeros([BLOCK_D], dtype=tl.float32)
            a2 = tl.zeros([BLOCK_D], dtype=tl.float32)
            b1 = tl.zeros([SUB], dtype=tl.float32)
            b2 = tl.zeros([SUB], dtype=tl.float32)
            for s0 in range(0, CAP, SUB):
                p = w0 + s0 + tl.arange(0, SUB)
                kk = tl.load(KEYS + p, mask=p < E, other=V)
                sel1 = kk == k1
                sel2 = tl.where(k2 != k1, kk == k2, False)
                c, x = _entry_terms(X, ROWS, CS, p, sel1 | sel2, offs_d, dm, stride_xn)
                c1 = tl.where(sel1, c, 0.0)
                c2 = tl.where(sel2, c, 0.0)
                a1 += tl.sum(c1[:, None] * x, axis=0)
                a2 += tl.sum(c2[:, None] * x, axis=0)
                b1 += c1
                b2 += c2
            tl.store(PART + slot1 + offs_d, a1, mask=dm)
            tl.store(PART + slot1 + D + offs_d, a2, mask=dm)
            if HAS_BIAS:
                if d0 == 0:
                    tl.store(PART_B + 2 * w, tl.sum(b1, axis=0))
                    tl.store(PART_B + 2 * w + 1, tl.sum(b2, axis=0))


@triton.jit
def _dw_rows_kernel(X, ROWS, CS, OFFS, PART, PART_B, PKEYS, DW, DB, V, D, stride_xn, stride_wv,
                    HAS_BIAS: tl.constexpr, CAP: tl.constexpr, BLOCK_R: tl.constexpr, J: tl.constexpr,
                    BLOCK_D: tl.constexpr, D_STEPS: tl.constexpr):
    """A [BLOCK_R vocab rows, D_STEPS * BLOCK_D] tile of dW (and db): the rows' entries walked in lock
    step, J entries of every row per step (their loads in flight together); long rows (count > CAP)
    add up the slots ``_dw_long_kernel`` wrote for them, window by window (a fixed order); rows without
    entries get zeros. The row tiles of one column group are neighbouring programs (the group's
    columns of x stay in L2)."""
    pid_d = tl.program_id(1)
    offs_v = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    vm = offs_v < V
    start = tl.load(OFFS + offs_v, mask=vm, other=0)
    count = tl.load(OFFS + offs_v + 1, mask=vm, other=0) - start
    is_long = count > CAP
    any_long = tl.sum(is_long.to(tl.int32), axis=0) > 0
    first_w = start // CAP
    n_w = tl.where(is_long, (start + count - 1) // CAP - first_w + 1, 0)  # windows a long row spans
    steps = tl.where(is_long, 0, count)
    jj = tl.arange(0, J)
    for i in range(0, D_STEPS):
        offs_d = (pid_d * D_STEPS + i) * BLOCK_D + tl.arange(0, BLOCK_D)
        dm = offs_d < D
        acc = tl.zeros([BLOCK_R, BLOCK_D], dtype=tl.float32)
        acc_b = tl.zeros([BLOCK_R], dtype=tl.float32)
        for j0 in range(0, tl.max(steps, axis=0), J):
            has = (j0 + jj)[None, :] < steps[:, None]
            c, x = _entry_terms(X, ROWS, CS, start[:, None] + j0 + jj[None, :], has, offs_d[None, None, :],
                                dm[None, None, :], stride_xn)
            acc += tl.sum(c[:, :, None] * x, axis=1)
            acc_b += tl.sum(c, axis=1)
        if any_long:
            for j in range(0, tl.max(n_w, axis=0)):
                has_w = j < n_w
                w = first_w + j
                slot = 2 * w + tl.where(tl.load(PKEYS + 2 * w, mask=has_w, other=-1) == offs_v, 0, 1)
                acc += tl.load(PART + slot.to(tl.int64)[:, None] * D + offs_d[None, :],
                               mask=has_w[:, None] & dm[None, :], other=0.0)
                if HAS_BIAS:
                    acc_b += tl.load(PART_B + slot, mask=has_w, other=0.0)
        tl.store(DW + offs_v.to(tl.int64)[:, None] * stride_wv + offs_d[None, :], acc.to(DW.dtype.element_ty),
                 mask=vm[:, None] & dm[None, :])
        if HAS_BIAS:
            if pid_d + i == 0:
                tl.store(DB + offs_v, acc_b.to(DB.dtype.element_ty), mask=vm)


@triton.jit
def _scalar_reduction_kernel(KD, MASK, TOTAL, KD_OUT, CE, UNIT, N, kd_weight, MEAN: tl.constexpr, BLOCK: tl.constexpr):
    """The scalar reduction in one program: kd = sum of the rows' divergences (/ counted rows for the
    mean, 0 when none counts), total = kd_weight kd, ce = 0, and UNIT = d total / d row value."""
    kd = tl.zeros([BLOCK], dtype=tl.float32)
    counted = tl.zeros([BLOCK], dtype=tl.float32)
    for n0 in range(0, N, BLOCK):
        offs = n0 + tl.arange(0, BLOCK)
        kd += tl.load(KD + offs, mask=offs < N, other=0.0)
        counted += tl.load(MASK + offs, mask=offs < N, other=0.0)
    per_row = tl.full((), 1.0, tl.float32)
    if MEAN:
        per_row = 1.0 / tl.maximum(tl.sum(counted, axis=0), 1.0)
    kd_total = tl.sum(kd, axis=0) * per_row
    tl.store(KD_OUT, kd_total)
    tl.store(TOTAL, kd_total * _f32(kd_weight))
    tl.store(CE, 0.0)
    tl.store(UNIT, per_row * _f32(kd_weight))


def scalar_reduction(kd_rows, mask, reduction: str, kd_weight: float):
    """(total, kd, ce, unit): the "mean"/"sum" reduction of the rows' divergences, as 0-dim fp32 tensors
    from one launch; unit = d total / d row value (times the upstream gradient in the backward)."""
    outs = [torch.empty((), dtype=F32, device=kd_rows.device) for _ in range(4)]
    launch(_scalar_reduction_kernel, (1,), kd_rows, mask, *outs, kd_rows.shape[0], kd_weight, MEAN=reduction == "mean",
           BLOCK=min(4096, next_pow2(max(kd_rows.shape[0], 16))), num_warps=4)
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
        coef, counts = zeroed[:N * K].view(F32).view(N, K), zeroed[N * K:]
    else:
        coef, counts = torch.empty(N, K, dtype=F32, device=xs.device), None
    inv_temp, param, log_a, log_1ma = _math_args(cfg)
    if check is not None:
        check()
    if N == 0:
        return kd, coef, key, counts
    if by_blocks:
        launch(_support_logits_kernel, (cdiv(N, t.logit_block_r), cdiv(D, t.logit_block_d)),
               xs, ws, ids, lp, mask, coef, N, K, D, V, xs.stride(0), ws.stride(0), ids.stride(0), lp.stride(0),
               BLOCK_R=t.logit_block_r, BLOCK_KB=min(t.logit_block_kb, next_pow2(K)), BLOCK_D=t.logit_block_d,
               num_warps=t.logit_warps)
    launch(_support_fwd_kernel, (N,),
           xs, ws, bs if bs is not None else xs, ids, lp, mask, kd, coef, key, counts if by_blocks else key, K, D, V,
           xs.stride(0), ws.stride(0), ids.stride(0), lp.stride(0), inv_temp, param, log_a, log_1ma,
           HAS_BIAS=bs is not None, RENORM_T=cfg.renormalize_teacher, DIVERGENCE=dv.DIVERGENCE_IDS[cfg.divergence],
           HAS_Z=by_blocks, BLOCK_K=next_pow2(K), BLOCK_KB=min(t.block_kb, next_pow2(K)), BLOCK_D=t.block_d,
           num_warps=t.warps)
    return kd, coef, key, counts


def support_dx(ws, key, coef, scale, dtype):
    N, K = key.shape
    D, V = ws.shape[1], ws.shape[0]
    t = tiles()
    dx = torch.empty(N, D, dtype=dtype, device=ws.device)
    if N:
        launch(_support_dx_kernel, (cdiv(N, t.dx_block_r), cdiv(D, t.dx_block_d)), ws, key, coef, scale, dx,
               N, K, D, V, ws.stride(0), dx.stride(0), scale.stride(0), BLOCK_R=t.dx_block_r,
               BLOCK_KB=min(t.dx_block_kb, next_pow2(K)), BLOCK_D=t.dx_block_d, num_warps=t.dx_warps)
    return dx


def long_cap(entries: int, min_cap: int) -> int:
    """Entries above which a vocab row is summed by windows of that many sorted entries
    (``_dw_long_kernel``): at most ~2048 windows whatever the batch (their two slots of partial sums
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
        launch(_sorted_entries_kernel, (cdiv(E, blk),), flat, coef, scale, cursor, offs, order, rows, terms, srt,
               E, V, K, scale.stride(0), COUNTING=counts is not None, BLOCK=blk, num_warps=4)
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
        launch(_dw_long_kernel, (n_win,), xs, rows, terms, srt, offs, part, part_b, pkeys, E, V, D, xs.stride(0),
               HAS_BIAS=bs is not None, CAP=cap, SUB=min(t.dw_sub, cap), BLOCK_D=t.dw_long_block_d,
               num_warps=t.dw_long_warps)
    if V:
        launch(_dw_rows_kernel, (cdiv(V, t.dw_block_r), cdiv(D, t.dw_block_d * t.dw_d_steps)),
               xs, rows, terms, offs, part, part_b, pkeys, dw, dw if db is None else db, V, D, xs.stride(0),
               dw.stride(0), HAS_BIAS=bs is not None, CAP=cap, BLOCK_R=t.dw_block_r, J=t.dw_j,
               BLOCK_D=t.dw_block_d, D_STEPS=t.dw_d_steps, num_warps=t.dw_warps)
    return dw, db


class SupportTopK(torch.autograd.Function):
    """Reduced (total, kd, ce) of normalize="topk" (ce is 0: the hard-label CE needs normalize="full")."""

    @staticmethod
    def forward(ctx, xs, ws, bs, ids, lp, mask, cfg: TopKConfig, reduction: str, check):
        kd_rows, coef, key, counts = support_forward(xs, ws, bs, ids, lp, mask, cfg, check)
        if reduction == "none":
            kd, unit = kd_rows, None
            total, ce = kd_rows * cfg.kd_weight, torch.zeros_like(kd_rows)
        else:
            total, kd, ce, unit = scalar_reduction(kd_rows, mask, reduction, cfg.kd_weight)
        ctx.save_for_backward(xs, ws, bs, coef, key, counts, unit)
        ctx.cfg = cfg
        ctx.mark_non_differentiable(kd, ce)
        return total, kd, ce

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
        if ctx.needs_input_grad[1] or ctx.needs_input_grad[2]:
            dw, db = support_dw(xs, key, coef, scale, ws.shape[0], bs, counts)
        return (dx, dw if ctx.needs_input_grad[1] else None, db if ctx.needs_input_grad[2] else None,
                None, None, None, None, None, None)


def support_topk(xs, ws, bs, ids, lp, mask, cfg: TopKConfig, reduction: str, check=None):
    """Entry used by the public API (flattened rows; "none" gives [N]; ``check``: see ``support_forward``)."""
    xs, ws = xs.contiguous(), ws.contiguous()
    bs = None if bs is None else bs.contiguous()
    return SupportTopK.apply(xs, ws, bs, ids.contiguous(), lp.contiguous(), mask.contiguous(), cfg, reduction, check)
