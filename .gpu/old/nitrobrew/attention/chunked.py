"""Attention KL in plain PyTorch over key chunks (any device, any float dtype).

Forward: one online pass over key chunks with per-row state (m_x, l_x, m_y, l_y, c) in the
*centred* form of docs/design.md §3/§2.3:

    c = sum_j e^{x_j - m_x} ((x_j - m_x) - (y_j - m_y)),   KL = c / l_x - log l_x + log l_y,

where x is the side the KL is taken "from" (the teacher for direction="forward") and y the other.
Both terms stay small when the two score sets differ by a per-row shift (common for attention),
so there is no cancellation of large numbers. When the maxima grow, c is rescaled:
``c <- e^{m_x - m_x'} (c + l_x ((m_x - m_x') - (m_y - m_y')))``. A side with a given log-sum-exp
(``lse_t``) uses it as a fixed shift instead of a running max (the result stays exact: l still
normalizes). Rows with no visible key give 0.

Backward recomputes each chunk's scores from the stored per-row (lse_x, lse_y, KL) and forms the
score gradients with the shared recipe of ``nitrobrew.divergences`` (u = dphi/dlog q,
grad = u - q * sum(u)): the y side gets the forward_kl gradient ``Y - X``, the x side the
reverse_kl gradient with the roles swapped, ``X (log X - log Y - KL)``. Then ``dq += dS k`` and
``dk[chunk] = sum over the query heads of a kv head of dS^T q`` (times the side's scale).

Working memory: a few [B, H, rows, chunk] tiles, plus per-row statistics and a float32 dq
accumulator; never a [Nq, Nk] map. Causal chunks skip the rows that see none of their keys.

``target="head_mean"``: the teacher side is the head-mean of the teacher's per-head attention
(groups of Ht/Hs teacher heads per student head, DeepSeek-V3.2 indexer style). Its per-head
log-sum-exps come from ``lse_t`` or from a first pass over the keys; then the mixture's log-probs
``log mean_h exp(a_h - lse_h)`` are just another "score" tile with a known log-sum-exp of 0.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from .. import divergences as dv
from ..core import checks as ck
from .common import AttnSpec, visible

Tensor = torch.Tensor
_NEG = -1.0e30  # finite initial running max: avoids inf - inf in the rescaling


def auto_chunk(B: int, H: int, Nq: int, Nk: int, budget_elems: int = 1 << 22) -> int:
    """A power-of-two key chunk with B*H*Nq*chunk near budget_elems (16 MiB of fp32 per tile)."""
    chunk = 16
    while chunk * 2 * max(B * H * Nq, 1) <= budget_elems and chunk < Nk:
        chunk *= 2
    return max(1, min(chunk, max(Nk, 1)))


class _Side:
    """One score product: queries [B, H, Nq, D], keys [B, Hkv, Nk, D], natural-unit scale."""

    def __init__(self, q: Tensor, k: Tensor, scale: float, acc: torch.dtype):
        self.q, self.k, self.scale, self.acc = q, k, scale, acc
        self.Hkv = k.shape[1]
        self.G = q.shape[1] // self.Hkv
        self.q_acc = q.to(acc)

    def _qv(self, r0: int) -> Tensor:
        return self.q_acc[:, :, r0:].unflatten(1, (self.Hkv, self.G))  # [B, Hkv, G, M, D]

    def _kc(self, c0: int, c1: int) -> Tensor:
        return self.k[:, :, c0:c1].to(self.acc).unsqueeze(2)  # [B, Hkv, 1, C, D]

    def scores(self, r0: int, c0: int, c1: int) -> Tensor:
        """Finite scores [B, H, Nq - r0, c1 - c0] (masking is the caller's job)."""
        s = torch.matmul(self._qv(r0), self._kc(c0, c1).transpose(-1, -2))
        return s.flatten(1, 2) * self.scale

    def add_grads(self, ds: Tensor, r0: int, c0: int, c1: int, dq: Optional[Tensor], dk: Optional[Tensor]):
        """dq[:, :, r0:] += dS k * scale;  dk[:, :, c0:c1] = sum_g dS^T q * scale."""
        dsv = ds.unflatten(1, (self.Hkv, self.G))
        if dq is not None:
            dq[:, :, r0:] += torch.matmul(dsv, self._kc(c0, c1)).flatten(1, 2) * self.scale
        if dk is not None:
            part = torch.matmul(dsv.transpose(-1, -2), self._qv(r0)).sum(2) * self.scale
            dk[:, :, c0:c1] = part.to(dk.dtype)


class _HeadMeanSide:
    """Teacher head-mean target: log mean_{h in group} P_h as a score tile with log-sum-exp 0."""

    def __init__(self, inner: _Side, lse_heads: Tensor, Hs: int):
        self.inner, self.Hs = inner, Hs
        self.G = inner.q.shape[1] // Hs
        self.lse = torch.where(torch.isfinite(lse_heads), lse_heads, torch.zeros_like(lse_heads)).to(inner.acc)

    def scores(self, r0: int, c0: int, c1: int) -> Tensor:
        lp = self.inner.scores(r0, c0, c1) - self.lse[:, :, r0:, None]
        return torch.logsumexp(lp.unflatten(1, (self.Hs, self.G)), dim=2) - math.log(self.G)


def _row_start(spec: AttnSpec, c0: int, Nq: int) -> int:
    """First row that sees any key of a chunk starting at c0 (causal); 0 otherwise."""
    if not spec.is_causal:
        return 0
    return min(max(0, c0 - spec.causal_offset), Nq)


def key_chunks(spec: AttnSpec, Nq: int, Nk: int, chunk: int):
    """(r0, c0, c1) per key chunk [c0, c1): rows before r0 see none of its keys (causal); stops at
    the first chunk no row sees."""
    for c0 in range(0, Nk, chunk):
        r0 = _row_start(spec, c0, Nq)
        if r0 >= Nq:
            return
        yield r0, c0, min(c0 + chunk, Nk)


def _safe(x: Tensor) -> Tensor:
    return torch.where(torch.isfinite(x), x, torch.zeros_like(x))


def head_lse(side: _Side, spec: AttnSpec, kpm: Optional[Tensor], chunk: int) -> Tensor:
    """Per-head log-sum-exp of one side's scores over visible keys (-inf for rows with none)."""
    B, H, Nq, _ = side.q.shape
    Nk = side.k.shape[2]
    m = torch.full((B, H, Nq), float("-inf"), dtype=side.acc, device=side.q.device)
    l = torch.zeros_like(m)
    for r0, c0, c1 in key_chunks(spec, Nq, Nk, chunk):
        s = side.scores(r0, c0, c1)
        vis = visible(
            Nq=Nq,
            Nk=Nk,
            is_causal=spec.is_causal,
            causal_offset=spec.causal_offset,
            kpm=kpm,
            device=s.device,
            r0=r0,
            c0=c0,
            c1=c1,
        )
        if vis is not None:
            s = s.masked_fill(~vis, float("-inf"))
        mo = m[:, :, r0:]
        mn = torch.maximum(mo, s.amax(-1))
        safe = _safe(mn)
        l[:, :, r0:] = l[:, :, r0:] * torch.exp(mo - safe) + torch.exp(s - safe[..., None]).sum(-1)
        m[:, :, r0:] = mn
    return m + l.log()


def forward_stats(X, Y, spec: AttnSpec, kpm, Nq: int, Nk: int, chunk: int, lse_x=None, lse_y=None):
    """One online pass: per-row KL(softmax x || softmax y) and both log-sum-exps (0 at empty rows)."""
    q_ref = X.inner.q if isinstance(X, _HeadMeanSide) else X.q
    B, H, dev = q_ref.shape[0], (Y.q.shape[1] if isinstance(Y, _Side) else Y.Hs), q_ref.device
    acc = (X.inner if isinstance(X, _HeadMeanSide) else X).acc

    def init(lse):
        if lse is not None:
            return _safe(lse.to(acc)).clone()
        return torch.full((B, H, Nq), _NEG, dtype=acc, device=dev)

    mx, my = init(lse_x), init(lse_y)
    lx = torch.zeros((B, H, Nq), dtype=acc, device=dev)
    ly, c = torch.zeros_like(lx), torch.zeros_like(lx)
    for r0, c0, c1 in key_chunks(spec, Nq, Nk, chunk):
        sx, sy = X.scores(r0, c0, c1), Y.scores(r0, c0, c1)
        vis = visible(
            Nq=Nq,
            Nk=Nk,
            is_causal=spec.is_causal,
            causal_offset=spec.causal_offset,
            kpm=kpm,
            device=dev,
            r0=r0,
            c0=c0,
            c1=c1,
        )
        sxm = sx if vis is None else sx.masked_fill(~vis, float("-inf"))
        sym = sy if vis is None else sy.masked_fill(~vis, float("-inf"))
        mxo, myo = mx[:, :, r0:], my[:, :, r0:]
        mxn = mxo if lse_x is not None else torch.maximum(mxo, sxm.amax(-1))
        myn = myo if lse_y is not None else torch.maximum(myo, sym.amax(-1))
        ex = torch.exp(sxm - mxn[..., None])
        ey = torch.exp(sym - myn[..., None])
        d = (sx - mxn[..., None]) - (sy - myn[..., None])  # finite: raw scores
        ax = torch.exp(mxo - mxn)
        lxo = lx[:, :, r0:]
        c[:, :, r0:] = ax * (c[:, :, r0:] + lxo * ((mxo - mxn) - (myo - myn))) + (ex * d).sum(-1)
        lx[:, :, r0:] = lxo * ax + ex.sum(-1)
        ly[:, :, r0:] = ly[:, :, r0:] * torch.exp(myo - myn) + ey.sum(-1)
        mx[:, :, r0:], my[:, :, r0:] = mxn, myn
    ok = (lx != 0) & (ly != 0)  # 0: a row with no visible key (its KL is 0); NaN stays NaN
    one = torch.ones_like(lx)
    lxs, lys = torch.where(ok, lx, one), torch.where(ok, ly, one)
    zero = torch.zeros_like(lx)
    kl = torch.where(ok, c / lxs - lxs.log() + lys.log(), zero)
    return kl, torch.where(ok, mx + lxs.log(), zero), torch.where(ok, my + lys.log(), zero)


def score_grads(sx, sy, vis, lse_x, lse_y, kl, g, need_x: bool, need_y: bool):
    """Gradients of g * KL(softmax x || softmax y) w.r.t. the score tiles, via the divergences recipe."""
    lx = sx - lse_x[..., None]
    ly = sy - lse_y[..., None]
    if vis is not None:
        lx = lx.masked_fill(~vis, float("-inf"))
        ly = ly.masked_fill(~vis, float("-inf"))
    dsx = dsy = None
    if need_y:  # y is the "student" of a forward KL:  u = -p,  sum u = -1  ->  Y - X
        _, u = dv.elementwise("forward_kl", lx, ly)
        dsy = dv.student_logit_grad(u, ly, -torch.ones_like(kl)[..., None]) * g[..., None]
    if need_x:  # x is the "student" of a reverse KL:  sum u = KL + 1  ->  X (log X - log Y - KL)
        _, u = dv.elementwise("reverse_kl", ly, lx)
        dsx = dv.student_logit_grad(u, lx, (kl + 1.0)[..., None]) * g[..., None]
    return dsx, dsy


class ChunkedAttentionKL(torch.autograd.Function):
    """Per-row KL [B, H, Nq] (0 at rows with no visible key); grads to q_s, k_s and, when they
    require grad, q_t, k_t (per_head target only)."""

    @staticmethod
    def forward(ctx, q_s, k_s, q_t, k_t, lse_t, kpm, spec: AttnSpec):
        acc = torch.float64 if torch.float64 in (q_s.dtype, q_t.dtype) else torch.float32
        B, Hs, Nq, _ = q_s.shape
        Nk = k_s.shape[2]
        chunk = spec.chunk or auto_chunk(B, q_t.shape[1], Nq, Nk)
        S = _Side(q_s, k_s, spec.scale_s, acc)
        T = _Side(q_t, k_t, spec.scale_t, acc)
        lse_fixed = lse_t
        if spec.target == "head_mean":
            lse_heads = lse_t if lse_t is not None else head_lse(T, spec, kpm, chunk)
            T = _HeadMeanSide(T, lse_heads, Hs)
            lse_fixed = torch.zeros((B, Hs, Nq), dtype=acc, device=q_s.device)
            ctx.lse_heads = lse_heads
        X, Y = (T, S) if spec.teacher_is_x else (S, T)
        lse_x, lse_y = (lse_fixed, None) if spec.teacher_is_x else (None, lse_fixed)
        kl, lsx, lsy = forward_stats(X=X, Y=Y, spec=spec, kpm=kpm, Nq=Nq, Nk=Nk, chunk=chunk, lse_x=lse_x, lse_y=lse_y)
        ctx.save_for_backward(q_s, k_s, q_t, k_t, kpm, lsx, lsy, kl)
        ctx.spec, ctx.chunk, ctx.acc = spec, chunk, acc
        return kl.to(torch.float64 if acc == torch.float64 else torch.float32)

    @staticmethod
    @ck.no_double_backward
    def backward(ctx, grad_rows):
        q_s, k_s, q_t, k_t, kpm, lsx, lsy, kl = ctx.saved_tensors
        spec, chunk, acc = ctx.spec, ctx.chunk, ctx.acc
        need = ctx.needs_input_grad
        B, Hs, Nq, _ = q_s.shape
        Nk = k_s.shape[2]
        S = _Side(q_s, k_s, spec.scale_s, acc)
        T = _Side(q_t, k_t, spec.scale_t, acc)
        teacher_grads = (need[2] or need[3]) and spec.target == "per_head"
        if spec.target == "head_mean":
            T = _HeadMeanSide(T, ctx.lse_heads, Hs)
        dq_s = torch.zeros(q_s.shape, dtype=acc, device=q_s.device) if need[0] else None
        dk_s = torch.zeros_like(k_s) if need[1] else None
        dq_t = torch.zeros(q_t.shape, dtype=acc, device=q_t.device) if (teacher_grads and need[2]) else None
        dk_t = torch.zeros_like(k_t) if (teacher_grads and need[3]) else None
        X, Y = (T, S) if spec.teacher_is_x else (S, T)
        need_s = need[0] or need[1]
        need_x = need_s if not spec.teacher_is_x else teacher_grads
        need_y = need_s if spec.teacher_is_x else teacher_grads
        g = grad_rows.to(acc)
        for r0, c0, c1 in key_chunks(spec, Nq, Nk, chunk):
            sx, sy = X.scores(r0, c0, c1), Y.scores(r0, c0, c1)
            vis = visible(
                Nq=Nq,
                Nk=Nk,
                is_causal=spec.is_causal,
                causal_offset=spec.causal_offset,
                kpm=kpm,
                device=q_s.device,
                r0=r0,
                c0=c0,
                c1=c1,
            )
            dsx, dsy = score_grads(
                sx=sx,
                sy=sy,
                vis=vis,
                lse_x=lsx[:, :, r0:],
                lse_y=lsy[:, :, r0:],
                kl=kl[:, :, r0:],
                g=g[:, :, r0:],
                need_x=need_x,
                need_y=need_y,
            )
            ds_s, ds_t = (dsy, dsx) if spec.teacher_is_x else (dsx, dsy)
            if need_s:
                S.add_grads(ds_s, r0=r0, c0=c0, c1=c1, dq=dq_s, dk=dk_s)
            if teacher_grads:
                T.add_grads(ds_t, r0=r0, c0=c0, c1=c1, dq=dq_t, dk=dk_t)
        return (
            None if dq_s is None else dq_s.to(q_s.dtype),
            dk_s,
            None if dq_t is None else dq_t.to(q_t.dtype),
            dk_t,
            None,
            None,
            None,
        )


def chunked_rows(q_s, k_s, q_t, k_t, lse_t, kpm, spec: AttnSpec) -> Tensor:
    return ChunkedAttentionKL.apply(q_s, k_s, q_t, k_t, lse_t, kpm, spec)
