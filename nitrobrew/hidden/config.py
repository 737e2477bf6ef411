"""Settings of one hidden-state loss call, shared by every backend."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Optional

import torch


class Operands(NamedTuple):
    """The tensors of one hidden-state loss call, rows flattened: student and teacher hidden states
    [N, Ds], [N, Dt], heads [V, Ds], [V, Dt] and optional logit biases [V]."""

    xs: torch.Tensor
    xt: torch.Tensor
    ws: torch.Tensor
    wt: torch.Tensor
    bs: Optional[torch.Tensor] = None
    bt: Optional[torch.Tensor] = None

    def rows(self, r0: int, r1: int) -> "Operands":
        """The same heads with the rows [r0, r1) of the hidden states."""
        return self._replace(xs=self.xs[r0:r1], xt=self.xt[r0:r1])

    @property
    def vocab(self) -> int:
        return self.ws.shape[0]


@dataclass(frozen=True)
class LossConfig:
    divergence: str  # canonical name (see nitrobrew.divergences)
    param: float  # beta for jsd, alpha for the skew losses, unused otherwise
    temperature: float
    kd_weight: float  # multiplies the divergence (T^2 already folded in when asked for)
    ce_weight: float  # multiplies the hard-label cross-entropy at temperature 1
    chunk_V: Optional[int]  # vocab chunk; None = automatic
    filter_eps: Optional[float] = None  # gradient filter threshold (grad_filter.py); None = off
    softcap_s: Optional[float] = None  # final-logit softcapping of the student (z -> c tanh(z / c)), None = off
    softcap_t: Optional[float] = None  # likewise of the teacher

    @classmethod
    def build(
        cls,
        divergence,
        param,
        temperature,
        kd_weight,
        ce_weight,
        scale_t2,
        chunk_V,
        filter_eps: Optional[float] = None,
        softcap_s: Optional[float] = None,
        softcap_t: Optional[float] = None,
    ) -> "LossConfig":
        """From the public options: T^2 (scale_t2) is folded into kd_weight."""
        return cls(
            divergence=divergence,
            param=param,
            temperature=float(temperature),
            kd_weight=float(kd_weight) * (temperature**2 if scale_t2 else 1.0),
            ce_weight=float(ce_weight),
            chunk_V=chunk_V,
            filter_eps=filter_eps,
            softcap_s=None if softcap_s is None else float(softcap_s),
            softcap_t=None if softcap_t is None else float(softcap_t),
        )

    @property
    def with_ce(self) -> bool:
        return self.ce_weight != 0.0

    @property
    def raw_lse(self) -> bool:
        """The CE's log-sum-exp at temperature 1 is kept apart from the tempered student's (the first
        pass's z state)."""
        return self.with_ce and self.temperature != 1.0
