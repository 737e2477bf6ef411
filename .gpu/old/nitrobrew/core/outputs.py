"""Output types shared by the loss families."""

from __future__ import annotations

from typing import NamedTuple

import torch


class DistillOutput(NamedTuple):
    """loss (differentiable) and its two terms, reduced the same way (detached, for logging)."""

    loss: torch.Tensor
    kd: torch.Tensor
    ce: torch.Tensor
