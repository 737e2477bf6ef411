"""Settings of one hidden-state loss call, shared by every backend."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class LossConfig:
    divergence: str          # canonical name (see nitrobrew.divergences)
    param: float             # beta for jsd, alpha for the skew losses, unused otherwise
    temperature: float
    kd_weight: float         # multiplies the divergence (T^2 already folded in when asked for)
    ce_weight: float         # multiplies the hard-label cross-entropy at temperature 1
    chunk_V: Optional[int]   # vocab chunk; None = automatic
    filter_eps: Optional[float] = None  # gradient filter threshold (grad_filter.py); None = off
    softcap_s: Optional[float] = None   # final-logit softcapping of the student (z -> c tanh(z / c)), None = off
    softcap_t: Optional[float] = None   # likewise of the teacher

    @classmethod
    def build(cls, divergence, param, temperature, kd_weight, ce_weight, scale_t2, chunk_V,
              filter_eps: Optional[float] = None, softcap_s: Optional[float] = None,
              softcap_t: Optional[float] = None) -> "LossConfig":
        """From the public options: T^2 (scale_t2) is folded into kd_weight."""
        return cls(divergence, param, float(temperature),
                   float(kd_weight) * (temperature**2 if scale_t2 else 1.0), float(ce_weight), chunk_V,
                   filter_eps, None if softcap_s is None else float(softcap_s),
                   None if softcap_t is None else float(softcap_t))

    @property
    def with_ce(self) -> bool:
        return self.ce_weight != 0.0


def auto_chunk_v(n_rows: int, vocab: int, budget_elems: int = 1 << 24) -> int:
    """A power-of-two vocab chunk with rows * chunk near `budget_elems` (64 MiB of fp32)."""
    chunk = 256
    while chunk * 2 * max(n_rows, 1) <= budget_elems and chunk < vocab:
        chunk *= 2
    return min(chunk, vocab)
