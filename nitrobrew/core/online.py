"""Online (streaming) softmax state and the bookkeeping every loss family shares: spans of rows or
vocab columns and the automatic vocab chunk.

The math (docs/design.md §2.3-§2.4, §2.6): a row's running max m, the mass outside one maximal entry
tail = sum e^(x - m) - 1 (so l = 1 + tail keeps the digits of a confident row's tail), and the
forward/reverse KL's accumulators a, r (and b on the other side), merged across chunks, lanes and
ranks by rescaling to the larger max.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Iterator, Optional, Tuple

import torch

Tensor = torch.Tensor
# In the KLs' close-distribution sum r, an entry whose other side lies more than this many nats above
# its own is counted in the other side's dropped mass b instead (p e^d could overflow float32 there).
FAR_NATS = 64.0


def merge_tails(ms, tails, m_new: Tensor) -> Tensor:
    """The tail of the union of states (ms[i], tails[i]) on the max m_new: every state that holds the
    max adds its own tail (the max entry itself counted once for all of them), the others their whole
    mass rescaled. No difference of two numbers near 1 is taken."""
    safe = torch.where(torch.isfinite(m_new), m_new, torch.zeros_like(m_new))
    out, n_top = torch.zeros_like(tails[0]), torch.zeros_like(tails[0])
    for m, tail in zip(ms, tails):
        top = m == m_new
        out = out + torch.where(top, tail, (1.0 + tail) * torch.exp(m - safe))
        n_top = n_top + top.to(out.dtype)
    return out + (n_top - 1.0)


def split_lse(m: Tensor, tail: Tensor) -> Tuple[Tensor, Tensor]:
    """lse = m + log1p(tail) as hi + lo: hi the rounded lse, lo what rounding dropped (0 where hi is not
    finite). (x - hi) - lo keeps a confident row's top log-probability, -log1p(tail), where x - lse
    would round it to 0."""
    full = m.double() + torch.log1p(tail.double())
    hi = full.to(m.dtype)
    lo = torch.where(torch.isfinite(hi), full - hi.double(), torch.zeros_like(full)).to(m.dtype)
    return hi, lo


@dataclass
class Online:
    """Running max m, the mass outside one maximal entry tail = sum e^(x - m) - 1 (l = 1 + tail; -1 while
    nothing is seen), and optional accumulators a = sum e^(x - m) d and
    r = sum e^(x - m) expm1(-d) for d = x - y: then lse_y - lse_x = log1p(r / l) - log1p(-b_y / l_y),
    which keeps its digits where the difference of the two log-sum-exps would not (y close to x).
    b, kept by the other side (y), is y's mass sum e^(y - m_y) over the entries where e^(x - m)
    underflowed to 0: those entries are missing from r (docs/design.md §2).

    a and r are centred: they sum d - ref, ref the d of the row's maximal entry (re-referenced when
    the max moves), so that a confident row's a / l and log1p(r / l) are tail-sized numbers instead of
    two copies of d_top that cancel (docs/design.md §2.6): KL = a / l + log1p(r / l) - log1p(-b_y / l_y),
    or a / l + ref + lse_y - lse_x."""

    m: Tensor
    tail: Tensor
    a: Optional[Tensor] = None
    r: Optional[Tensor] = None
    b: Optional[Tensor] = None
    ref: Optional[Tensor] = None

    @staticmethod
    def empty(n: int, acc: torch.dtype, device, with_acc: bool = False, with_lost: bool = False) -> "Online":
        m = torch.full((n,), float("-inf"), dtype=acc, device=device)
        zero = torch.zeros(n, dtype=acc, device=device)
        return Online(
            m=m,
            tail=zero - 1.0,
            a=zero.clone() if with_acc else None,
            r=zero.clone() if with_acc else None,
            b=zero.clone() if with_lost else None,
            ref=zero.clone() if with_acc else None,
        )

    def update(
        self, x: Tensor, d: Optional[Tensor] = None, lost: Optional[Tensor] = None, other_scale: Optional[Tensor] = None
    ) -> Tuple[Tensor, Tensor]:
        """Add a chunk x [n, c]; d = x - y feeds a and r. For b: lost (bool [n, c]) marks the entries
        whose weight on the other side underflowed, and rows whose other_scale is 0 had the other
        side's earlier sums underflow away (all of this side's mass so far is lost to them).
        Returns this side's weights e^(x - m) and the factor its earlier sums were rescaled by."""
        if other_scale is not None:
            self.b = torch.where(other_scale == 0, self.l, self.b)
        m_new = torch.maximum(self.m, x.amax(-1))
        safe = torch.where(torch.isfinite(m_new), m_new, torch.zeros_like(m_new))
        scale = torch.exp(self.m - safe)  # 0 while both are -inf
        e = torch.exp(x - safe[:, None])
        # the new max's entries leave the tail (one of them: ties count 1 each); the old max joins it
        top = (x == m_new[:, None]) & torch.isfinite(m_new)[:, None]
        n_top = top.sum(-1).to(e.dtype)
        rest = torch.where(top, torch.zeros_like(e), e).sum(-1)
        grew = m_new > self.m
        l_old = self.l
        self.tail = torch.where(grew, (1.0 + self.tail) * scale + (n_top - 1.0), self.tail + n_top) + rest
        if self.a is not None:
            d_top = d.gather(1, x.argmax(-1, keepdim=True)).squeeze(1)
            self.recentre(torch.where(grew & torch.isfinite(d_top), d_top, self.ref), l_old, self.m - safe)
            dc = d - self.ref[:, None]
            self.a = self.a + torch.where(e > 0, e * dc, torch.zeros_like(d)).sum(-1)
            # elsewhere only -e (the other side's mass goes to its b): where p underflowed, where e^-(d - ref)
            # could overflow, and where the other side lies FAR_NATS above (its mass would be lost to r
            # when this side's max later jumps: the uncentred bound)
            near = (e > 0) & (-dc <= FAR_NATS) & (-d <= FAR_NATS)
            self.r = self.r + torch.where(near, e * torch.expm1(torch.where(near, -dc, 0.0)), -e).sum(-1)
        if self.b is not None:
            self.b = self.b * scale + torch.where(lost, e, torch.zeros_like(e)).sum(-1)
        self.m = m_new
        return e, scale

    def recentre(self, ref_new: Tensor, l: Tensor, log_scale: Tensor) -> None:
        """Refer a and r (on a sum of weights l) to a new reference and rescale them by e^log_scale:
        a = (a - l D) s, r = e^D r s + l s expm1(D), D = ref_new - ref, s = e^log_scale (the factor e^D s
        taken in one exp: it stays finite where e^D alone would not; s expm1(D) as -expm1(-D) e^D s, or -s
        where expm1(-D) is huge)."""
        shift = torch.where(l > 0, ref_new - self.ref, torch.zeros_like(ref_new))
        scale = torch.exp(log_scale)
        self.a = (self.a - l * shift) * scale
        es = torch.exp(shift + log_scale)
        far = shift < -FAR_NATS
        em = torch.where(far, -scale, -torch.expm1(torch.where(far, 0.0, -shift)) * es)
        r = es * self.r + l * em
        self.r = torch.where(scale > 0, r, torch.zeros_like(r))
        self.ref = ref_new

    @property
    def l(self) -> Tensor:  # noqa: E743 (the sum's name in docs/design.md)
        """The rescaled sum sum e^(x - m) = 1 + tail."""
        return 1.0 + self.tail

    def tail_part(self, m_new: Tensor) -> Tuple[Tensor, Tensor]:
        """This state's share of a merged tail on a max m_new >= m (``merge_tails``, term by term):
        (tail if it holds the max else l e^(m - m_new), 1 if it holds the max else 0). Summed over the
        parts (ranks): tail = sum of shares + (sum of counts - 1)."""
        safe = torch.where(torch.isfinite(m_new), m_new, torch.zeros_like(m_new))
        top = self.m == m_new
        share = torch.where(top, self.tail, (1.0 + self.tail) * torch.exp(self.m - safe))
        return share, top.to(self.tail.dtype)

    def rescale_to(self, m_new: Tensor) -> None:
        """Express a, r and b relative to a larger max (used when merging partial states; the tail
        merges by ``tail_part`` / ``merge_tails``)."""
        safe = torch.where(torch.isfinite(m_new), m_new, torch.zeros_like(m_new))
        scale = torch.exp(self.m - safe)
        for name in ("a", "r", "b"):
            if getattr(self, name) is not None:
                setattr(self, name, getattr(self, name) * scale)
        self.m = m_new

    def lse(self) -> Tensor:
        return self.m + torch.log1p(self.tail)

    def lse_parts(self) -> Tuple[Tensor, Tensor]:
        """(hi, lo) of the log-sum-exp (``split_lse``)."""
        return split_lse(self.m, self.tail)


def spans(n: int, size: int) -> Iterator[Tuple[int, int]]:
    """(lo, hi) spans of `size` (the last one shorter) over [0, n): vocab chunks or row blocks."""
    for lo in range(0, n, size):
        yield lo, min(lo + size, n)


def _cache_bytes() -> int:
    """This CPU's per-core L2 cache in bytes (2 MiB where the system does not say)."""
    try:
        size = os.sysconf("SC_LEVEL2_CACHE_SIZE")
    except (AttributeError, ValueError, OSError):
        size = 0
    return size if size and size > 0 else 2 << 20


def auto_chunk_v(n_rows: int, vocab: int, budget_elems: int = 1 << 24, device=None) -> int:
    """A power-of-two vocab chunk (at least 256, at most the vocabulary).

    On a GPU: rows * chunk near `budget_elems` (64 MiB of fp32): few, large launches. On a CPU
    (``device`` a CPU device, or None on a machine without CUDA): the fp32 slab of rows * chunk
    within twice the core's L2 cache, since each chunk's slab is read and written several times
    (exp, sums, the gradient) and a slab that spills to memory runs ~3x slower (256 rows,
    V = 65536: 4096 columns, not the whole vocabulary)."""
    rows = max(n_rows, 1)
    on_cpu = torch.device(device).type == "cpu" if device is not None else not torch.cuda.is_available()
    if on_cpu:
        budget_elems = min(budget_elems, max((2 * _cache_bytes()) // 4, 1))
    chunk = 256
    while chunk * 2 * rows <= budget_elems and chunk < vocab:
        chunk *= 2
    return min(chunk, vocab)
