"""Per-row bookkeeping every loss family shares: which rows count, the reductions over rows, their
gradients, and the (total, kd, ce) rows of a loss with a hard-label CE term.

Ignored rows hold 0; "mean" over no counted row is 0, never NaN (docs/design.md §1).
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

Tensor = torch.Tensor
# The label of a row that does not count (PyTorch's cross_entropy and the HF collators use it too).
IGNORE_INDEX = -100


def row_weights(labels: Optional[torch.Tensor], ignore_index: int, n_rows: int, device: torch.device) -> torch.Tensor:
    """float32 [n_rows] mask: 1 where the row counts, 0 where its label is ignore_index."""
    if labels is None:
        return torch.ones(n_rows, device=device, dtype=torch.float32)
    return (labels.reshape(-1) != ignore_index).to(torch.float32)


def reduce_rows(per_row: torch.Tensor, mask: torch.Tensor, reduction: str, lead_shape) -> torch.Tensor:
    """Apply a reduction to per-row values that are already 0 at ignored rows.

    "mean" divides by the number of counted rows; with none counted the result is 0 (not NaN).
    """
    if reduction == "none":
        return per_row.reshape(lead_shape)
    total = per_row.sum()
    if reduction == "sum":
        return total
    return total / mask.sum().clamp_min(1.0)


def reduction_scale(mask: torch.Tensor, reduction: str) -> torch.Tensor:
    """d loss / d row_value for "mean" and "sum", as a float32 scalar tensor (0 if no row counts)."""
    if reduction == "sum":
        return torch.ones((), device=mask.device, dtype=torch.float32)
    return 1.0 / mask.sum().clamp_min(1.0)


def row_upstream(grad_total: torch.Tensor, mask: torch.Tensor, reduction: str, n: int) -> torch.Tensor:
    """d loss / d row value for each of the n rows, given the gradient of the reduced output."""
    if reduction == "none":
        return grad_total.to(torch.float32)
    return (reduction_scale(mask, reduction) * grad_total.to(torch.float32)).expand(n)


def row_scales(grad_rows: Tensor, mask: Tensor, cfg) -> Tuple[Tensor, Tensor]:
    """Per-row multipliers of the divergence's and the CE's gradients (upstream x row mask x weight)."""
    g = grad_rows * mask
    return g * cfg.kd_weight, g * cfg.ce_weight


def combine_rows(kd: Tensor, ce: Optional[Tensor], mask: Tensor, cfg) -> Tuple[Tensor, Tensor, Tensor]:
    """Per-row (total, kd, ce) in the compute dtype (float32; float64 for float64 inputs), 0 at
    ignored rows (cfg: any config with kd_weight and ce_weight)."""
    kd = torch.where(mask > 0, kd, torch.zeros_like(kd))
    ce = torch.zeros_like(kd) if ce is None else torch.where(mask > 0, ce, torch.zeros_like(ce))
    return cfg.kd_weight * kd + cfg.ce_weight * ce, kd, ce


class PartsFunction(torch.autograd.Function):
    """Base of the autograd Functions with a (total, kd, ce) output: total carries the gradient; kd and ce
    (the unweighted divergence and cross-entropy, reported) do not. STUDENT_INPUTS: the positions of the
    student's hidden rows, head weight and head bias among the forward's inputs; the rest get no gradient.
    A subclass ends its forward with ``parts`` and its backward with ``input_grads``."""

    STUDENT_INPUTS: Tuple[int, int, int] = (0, 1, 2)

    @staticmethod
    def parts(ctx, total: Tensor, kd: Tensor, ce: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
        ctx.mark_non_differentiable(kd, ce)
        return total, kd, ce

    @classmethod
    def head_needed(cls, ctx) -> bool:
        """Whether the backward must form the head's gradient (of the weight or the bias)."""
        _, w, b = cls.STUDENT_INPUTS
        return bool(ctx.needs_input_grad[w] or ctx.needs_input_grad[b])

    @classmethod
    def input_grads(cls, ctx, dx: Optional[Tensor], dw: Optional[Tensor], db: Optional[Tensor]) -> tuple:
        """The backward's return: dx, dw, db at the student's inputs that need them, None elsewhere."""
        grads: list = [None] * len(ctx.needs_input_grad)
        for i, g in zip(cls.STUDENT_INPUTS, (dx, dw, db)):
            grads[i] = g if ctx.needs_input_grad[i] else None
        return tuple(grads)
