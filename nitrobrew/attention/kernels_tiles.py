"""Score-tile pieces shared by the Triton attention-KL kernels (forward, dq, dk).

Every kernel recomputes the two score tiles ``x = q_x k_x^T``, ``y = q_y k_y^T`` of a (query block,
key block) pair in log2 units, hides the invisible pairs at -inf and exponentiates against per-row
statistics. The forward and dq kernels hold a query block and stream key blocks: [rows, keys]
tiles. The dk kernel holds a key block and streams query blocks: [keys, rows] tiles
(``KEYS_FIRST``). These are @triton.jit helpers: Triton inlines them and the constexpr switches
select the code, so each kernel compiles as if it were written inline.
"""

from __future__ import annotations

import triton
import triton.language as tl

# The streamed rows (both sides' keys, or queries for the dk kernel) that the heads of one launch section
# (program_grid) may read at once: a part of the L2 cache (50 MiB on H100), so each head's rows are read
# from memory about once per section.
L2_SECTION_BYTES = 32 * 2**20


def program_grid(blocks: int, heads: int, streamed_bytes: int) -> tuple[tuple[int], int]:
    """The launch grid (one axis) of `blocks` row blocks for each of `heads` batch*heads, and the heads of
    a section (program_ids' heads_per_section). The GPU starts programs in order of their index. The
    heads go in sections, and within a section the programs run block by block across its heads, the
    kernel's longest (causal) block first: the launch ends on short programs. Head by head, the last
    heads' longest blocks start near the end and run on alone (the forward 1.09-1.17x its time in sections at
    N = 2048-16384 on H100); every head at once spreads the reads of all their keys over the same time,
    more than the L2 cache holds (1.02-1.15x at 16384-32768; benchmarks/results/attention/
    launch_order_h100.md). A section holds as many heads as fit L2_SECTION_BYTES, streamed_bytes a head."""
    section = max(1, min(heads, L2_SECTION_BYTES // max(1, streamed_bytes)))
    return (blocks * heads,), section


def row_bytes(*tensors) -> int:
    """Bytes of one row ([..., D]) of each tensor, summed: program_grid's streamed bytes a row."""
    return sum(t.shape[-1] * t.element_size() for t in tensors)


def key_bytes_per_query_head(k_x, k_y, query_heads: int) -> int:
    """program_grid's streamed bytes a head for kernels that stream keys ([B, Hkv, Nk, D] each side):
    both sides' keys of one batch over its query heads, since grouped query heads share their kv head's
    keys (grouped-query attention fits more query heads a section)."""
    n_keys = k_x.shape[2]
    return n_keys * (k_x.shape[1] * row_bytes(k_x) + k_y.shape[1] * row_bytes(k_y)) // query_heads


def query_bytes_per_kv_head(q_x, q_y, kv_heads: int) -> int:
    """program_grid's streamed bytes a head for the dk kernels, whose programs hold a kv head's keys and
    stream the queries ([B, H, Nq, D] each side) of every query head sharing it."""
    return q_x.shape[2] * (q_x.shape[1] // kv_heads) * row_bytes(q_x, q_y)


@triton.jit
def program_ids(n_rows, heads_per_section, BR: tl.constexpr, LAST_FIRST: tl.constexpr):
    """(block, batch*head) of this program on program_grid's axis: blocks of BR of the n_rows rows (query
    rows, or keys for the dk kernel); LAST_FIRST numbers them from the last (causal query blocks: the
    longest rows first). Scalars only: the Gluon kernels call it too."""
    blocks = tl.cdiv(n_rows, BR)
    pid = tl.program_id(0)
    heads = tl.num_programs(0) // blocks
    first_head = pid // (heads_per_section * blocks) * heads_per_section
    section_heads = tl.minimum(heads_per_section, heads - first_head)
    within = pid - first_head * blocks
    pid_r = within // section_heads
    if LAST_FIRST:
        pid_r = blocks - 1 - pid_r
    return pid_r, first_head + within % section_heads


@triton.jit
def program_block(
    H,
    n_rows,
    heads_per_section,
    BR: tl.constexpr,
    BO: tl.constexpr,
    BD1: tl.constexpr,
    BD2: tl.constexpr,
    LAST_FIRST: tl.constexpr,
):
    """This program's block of BR rows (program_ids) and batch*head: (pid_bh, head, batch as int64,
    first row, the block's rows, offsets in a block of BO along the other axis, both head-dim ranges)."""
    pid_r, pid_bh = program_ids(n_rows, heads_per_section, BR, LAST_FIRST)
    b = pid_bh // H
    h = pid_bh % H
    start_r = pid_r * BR
    offs_r = start_r + tl.arange(0, BR)
    offs_o = tl.arange(0, BO)
    offs_d1 = tl.arange(0, BD1)
    offs_d2 = tl.arange(0, BD2)
    return pid_bh, h, b.to(tl.int64), start_r, offs_r, offs_o, offs_d1, offs_d2


@triton.jit
def key_heads(KX, KY, KPM, b64, h, GX, GY, s_kx_b, s_kx_h, s_ky_b, s_ky_h, s_kpm_b):
    """Bases of both sides' key heads for query head h (grouped-query: h // G) and of the padding
    mask row of batch b."""
    KXb = KX + b64 * s_kx_b + (h // GX).to(tl.int64) * s_kx_h
    KYb = KY + b64 * s_ky_b + (h // GY).to(tl.int64) * s_ky_h
    KPMb = KPM + b64 * s_kpm_b
    return KXb, KYb, KPMb


@triton.jit
def flat_rows(pid_bh, Nq, offs_m):
    """Flat [B*H*Nq] indices of the block's rows and their in-range mask."""
    row = pid_bh.to(tl.int64) * Nq + offs_m
    row_ok = offs_m < Nq
    return row, row_ok


@triton.jit
def key_ranges(
    start_m, Nk, causal_offset, BM: tl.constexpr, BN: tl.constexpr, CAUSAL: tl.constexpr, EVEN_N: tl.constexpr
):
    """Key-loop bounds of a query block: blocks in [0, n_full) need no mask, [n_full, hi) do
    (they cut the causal diagonal or end past Nk); blocks from hi on are invisible."""
    if CAUSAL:
        hi = tl.minimum(Nk, start_m + BM + causal_offset)
        full_hi = tl.minimum(Nk, start_m + 1 + causal_offset)
    else:
        hi = Nk
        full_hi = Nk
    if not EVEN_N:
        full_hi = tl.minimum(full_hi, (Nk // BN) * BN)
    n_full = (tl.maximum(full_hi, 0) // BN) * BN
    return n_full, hi


@triton.jit
def load_tile(ptr, offs_r, offs_d, stride_r, n_rows, D: tl.constexpr, BD: tl.constexpr, EVEN_R: tl.constexpr):
    """A [rows, BD] tile of a row-major matrix with contiguous last dim (zero-filled outside)."""
    ptrs = ptr + offs_r[:, None] * stride_r + offs_d[None, :]
    if EVEN_R and BD == D:
        t = tl.load(ptrs)
    elif EVEN_R:
        t = tl.load(ptrs, mask=offs_d[None, :] < D, other=0.0)
    else:
        t = tl.load(ptrs, mask=(offs_r[:, None] < n_rows) & (offs_d[None, :] < D), other=0.0)
    return t


@triton.jit
def store_tile(ptr, offs_r, offs_d, stride_r, n_rows, D: tl.constexpr, acc, out_scale):
    """acc * out_scale into a [rows, BD] tile of ptr's dtype (rows < n_rows, columns < D only)."""
    ptrs = ptr + offs_r[:, None] * stride_r + offs_d[None, :]
    tl.store(ptrs, (acc * out_scale).to(ptr.dtype.element_ty), mask=(offs_r[:, None] < n_rows) & (offs_d[None, :] < D))


@triton.jit
def dot(a, b, PREC: tl.constexpr):
    """tl.dot with fp32 accumulation. PREC "upcast" (Triton's CPU interpreter with bf16 inputs,
    whose bf16 dot is wrong) multiplies the exactly upcast operands instead: same math."""
    if PREC == "upcast":
        out = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        out = tl.dot(a, b, input_precision=PREC)
    return out


@triton.jit
def scores(a, b, scale, PREC: tl.constexpr):
    """One side's score tile a b^T * scale (fp32 accumulation; scale folds in log2(e))."""
    return dot(a, tl.trans(b), PREC) * scale


@triton.jit
def on_rows(v, KEYS_FIRST: tl.constexpr):
    """A per-row vector broadcast over the key axis of a tile."""
    if KEYS_FIRST:
        out = v[None, :]
    else:
        out = v[:, None]
    return out


@triton.jit
def _on_keys(v, KEYS_FIRST: tl.constexpr):
    """A per-key vector broadcast over the row axis of a tile."""
    if KEYS_FIRST:
        out = v[:, None]
    else:
        out = v[None, :]
    return out


@triton.jit
def _visible(
    offs_m,
    offs_n,
    KPMb,
    Nk,
    causal_offset,
    MASKED: tl.constexpr,
    CAUSAL: tl.constexpr,
    HAS_KPM: tl.constexpr,
    KEYS_FIRST: tl.constexpr,
):
    """Visible (row, key) pairs of a tile: key in range, causal, and kept by the padding mask.
    Unmasked tiles (MASKED False) only consult the padding mask."""
    if MASKED:
        valid = _on_keys(offs_n, KEYS_FIRST) < Nk
        if CAUSAL:
            valid = valid & (_on_keys(offs_n, KEYS_FIRST) <= on_rows(offs_m, KEYS_FIRST) + causal_offset)
        if HAS_KPM:
            keep = tl.load(KPMb + offs_n, mask=offs_n < Nk, other=0)
            valid = valid & (_on_keys(keep, KEYS_FIRST) != 0)
    else:
        keep = tl.load(KPMb + offs_n, mask=offs_n < Nk, other=0)
        valid = _on_keys(keep, KEYS_FIRST) != 0
    return valid


@triton.jit
def hide_invisible(
    sx,
    sy,
    offs_m,
    offs_n,
    KPMb,
    Nk,
    causal_offset,
    MASKED: tl.constexpr,
    CAUSAL: tl.constexpr,
    HAS_KPM: tl.constexpr,
    KEYS_FIRST: tl.constexpr,
):
    """Both score tiles with the invisible pairs at -inf. For exponents only: the centred
    differences use the raw (finite) scores, so no 0 * inf appears."""
    if MASKED or HAS_KPM:
        valid = _visible(offs_m, offs_n, KPMb, Nk, causal_offset, MASKED, CAUSAL, HAS_KPM, KEYS_FIRST)
        sxm = tl.where(valid, sx, float("-inf"))
        sym = tl.where(valid, sy, float("-inf"))
    else:
        sxm = sx
        sym = sy
    return sxm, sym


@triton.jit
def key_block_scores(
    qx,
    qy,
    KXb,
    KYb,
    KPMb,
    s_kx_n,
    s_ky_n,
    offs_m,
    offs_n,
    offs_dx,
    offs_dy,
    Nk,
    scale_x,
    scale_y,
    causal_offset,
    DX: tl.constexpr,
    DY: tl.constexpr,
    BDX: tl.constexpr,
    BDY: tl.constexpr,
    MASKED: tl.constexpr,
    CAUSAL: tl.constexpr,
    HAS_KPM: tl.constexpr,
    EVEN_N: tl.constexpr,
    PREC_X: tl.constexpr,
    PREC_Y: tl.constexpr,
):
    """The key tiles kx, ky of the key block at offs_n and the [rows, keys] score tiles against
    qx, qy: raw x, y and masked x, y (-inf where invisible)."""
    even = EVEN_N or not MASKED
    kx = load_tile(KXb, offs_n, offs_dx, s_kx_n, Nk, DX, BDX, even)
    ky = load_tile(KYb, offs_n, offs_dy, s_ky_n, Nk, DY, BDY, even)
    sx = scores(qx, kx, scale_x, PREC_X)
    sy = scores(qy, ky, scale_y, PREC_Y)
    sxm, sym = hide_invisible(sx, sy, offs_m, offs_n, KPMb, Nk, causal_offset, MASKED, CAUSAL, HAS_KPM, False)
    return kx, ky, sx, sy, sxm, sym


@triton.jit
def exp2_pair(sxm, sym, rx, ry, KEYS_FIRST: tl.constexpr):
    """2^(x - rx), 2^(y - ry) against per-row references (running maxima or log-sum-exps)."""
    px = tl.exp2(sxm - on_rows(rx, KEYS_FIRST))
    py = tl.exp2(sym - on_rows(ry, KEYS_FIRST))
    return px, py


@triton.jit
def centred_diff(sx, sy, rx, ry, KEYS_FIRST: tl.constexpr):
    """(x - rx) - (y - ry) from the raw scores: finite everywhere."""
    return (sx - on_rows(rx, KEYS_FIRST)) - (sy - on_rows(ry, KEYS_FIRST))
