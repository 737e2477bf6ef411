"""Online (streaming) softmax state and the bookkeeping every loss family shares: spans of rows or
vocab columns and the automatic vocab chunk.

The math (docs/design.md §2.3-§2.4): a row's running max m, rescaled sum l = sum e^(x - m), and the
forward/reverse KL's accumulators a, r (and b on the other side), merged across chunks, lanes and
ranks by rescaling to the larger max.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Optional, Tuple

import torch

Tensor = torch.Tensor
# In the KLs' close-distribution sum r, an entry whose other side lies more than this many nats above
# its own is counted in the other side's dropped mass b instead (p e^d could overflow float32 there).
FAR_NATS = 64.0


@dataclass
class Online:
    """Running max m, rescaled sum l = sum e^(x - m), and optional accumulators a = sum e^(x - m) d and
    r = sum e^(x - m) expm1(-d) for d = x - y: then lse_y - lse_x = log1p(r / l) - log1p(-b_y / l_y),
    which keeps its digits where the difference of the two log-sum-exps would not (y close to x).
    b, kept by the other side (y), is y's mass sum e^(y - m_y) over the entries where e^(x - m)
    underflowed to 0: those entries are missing from r (docs/design.md §2)."""

    m: Tensor
    l: Tensor
    a: Optional[Tensor] = None
    r: Optional[Tensor] = None
    b: Optional[Tensor] = None

    @staticmethod
    def empty(n: int, acc: torch.dtype, device, with_acc: bool = False, with_lost: bool = False) -> "Online":
        m = torch.full((n,), float("-inf"), dtype=acc, device=device)
        zero = torch.zeros(n, dtype=acc, device=device)
        return Online(
            m,
            zero,
            zero.clone() if with_acc else None,
            zero.clone() if with_acc else None,
            zero.clone() if with_lost else None,
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
        self.l = self.l * scale + e.sum(-1)
        if self.a is not None:
            self.a = self.a * scale + torch.where(e > 0, e * d, torch.zeros_like(d)).sum(-1)
        if self.r is not None:
            near = (e > 0) & (-d <= FAR_NATS)  # elsewhere only -e (the other side's mass goes to its b)
            r_new = torch.where(near, e * torch.expm1(torch.where(near, -d, 0.0)), -e).sum(-1)
            self.r = torch.where(scale > 0, self.r * scale, 0.0) + r_new
        if self.b is not None:
            self.b = self.b * scale + torch.where(lost, e, torch.zeros_like(e)).sum(-1)
        self.m = m_new
        return e, scale

    def rescale_to(self, m_new: Tensor) -> None:
        """Express l, a, r and b relative to a larger max (used when merging partial states)."""
        safe = torch.where(torch.isfinite(m_new), m_new, torch.zeros_like(m_new))
        scale = torch.exp(self.m - safe)
        self.l = self.l * scale
        for name in ("a", "r", "b"):
            if getattr(self, name) is not None:
                setattr(self, name, getattr(self, name) * scale)
        self.m = m_new

    def lse(self) -> Tensor:
        return self.m + self.l.log()


def spans(n: int, size: int) -> Iterator[Tuple[int, int]]:
    """(lo, hi) spans of `size` (the last one shorter) over [0, n): vocab chunks or row blocks."""
    for lo in range(0, n, size):
        yield lo, min(lo + size, n)


def auto_chunk_v(n_rows: int, vocab: int, budget_elems: int = 1 << 24, device=None) -> int:
    """A power-of-two vocab chunk with rows * chunk near `budget_elems` (64 MiB of fp32)."""
    chunk = 256
    while chunk * 2 * max(n_rows, 1) <= budget_elems and chunk < vocab:
        chunk *= 2
    return min(chunk, vocab)
