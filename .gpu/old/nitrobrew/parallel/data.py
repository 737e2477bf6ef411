"""Data parallelism: normalize over the counted tokens of every rank, not per rank.

With DDP or FSDP each rank sees a different slice of the batch, so a per-rank ``reduction="mean"``
weights a token by 1 / (its rank's count): ranks with many ignored rows get their few tokens
over-weighted, and gradient accumulation makes it worse (docs/design.md §1). The exact recipe is the
sum over counted rows divided by the *global* count (HF's ``num_items_in_batch``)::

    count = global_token_count(labels, group=dp_group)           # one all-reduce of one number
    loss = data_parallel_loss(forward_kl(..., labels=labels, reduction="sum"), count, group=dp_group)
    loss.backward()   # DDP / FSDP average gradients over dp_group: the result is d(global mean)

With gradient accumulation pass every micro-batch's labels of the optimizer step at once
(``global_token_count([labels_1, labels_2, ...])``) and scale each micro-batch by the same count.
"""

from __future__ import annotations

from typing import Optional, Sequence, Union

import torch
import torch.distributed as dist

from ..core.reduction import IGNORE_INDEX
from .comm import all_reduce

Tensor = torch.Tensor


def global_token_count(
    labels: Union[Tensor, Sequence[Tensor], None] = None,
    *,
    ignore_index: int = IGNORE_INDEX,
    group=None,
    n_rows: Optional[int] = None,
    device=None,
) -> Tensor:
    """Number of counted rows (label != ignore_index) summed over every rank of ``group``.

    ``labels`` may be one tensor or a list (micro-batches of one optimizer step). Without labels
    every row counts: give ``n_rows`` (and ``device``: a CUDA device for NCCL). Returns an int64
    scalar tensor, identical on every rank. Outside torch.distributed it is the local count.
    Under tensor x data parallelism pass the data-parallel group: rows are replicated within a
    tensor-parallel group and must be counted once.
    """
    if labels is None:
        if n_rows is None:
            raise ValueError("global_token_count needs labels or n_rows")
        count = torch.tensor(int(n_rows), dtype=torch.int64, device=device)
    else:
        parts = [labels] if isinstance(labels, Tensor) else list(labels)
        if not parts:
            raise ValueError("global_token_count got an empty list of labels")
        count = sum((p != ignore_index).sum().to(torch.int64) for p in parts).to(parts[0].device)
        count = count.reshape(())
    if dist.is_available() and dist.is_initialized():
        all_reduce(count, "sum", group, "token_count")
    return count


def data_parallel_loss(loss_sum: Tensor, count: Tensor, *, group=None, grad_average: bool = True) -> Tensor:
    """Scale this rank's summed loss so that gradients equal those of the mean over ``count`` tokens.

    ``grad_average=True`` for wrappers that average gradients over ``group`` (DDP, FSDP/FSDP2's
    default): the factor is world_size / count. ``False`` when gradients are summed. No counted
    row anywhere gives 0 (count is clamped to 1). The returned value is not the global mean
    (each rank holds its share times world_size); log ``global_mean(loss_sum, count, group)``.
    """
    world = dist.get_world_size(group) if (grad_average and dist.is_available() and dist.is_initialized()) else 1
    return loss_sum * (world / count.clamp_min(1).to(loss_sum.dtype))


def global_mean(loss_sum: Tensor, count: Tensor, *, group=None) -> Tensor:
    """The global mean loss for logging (detached): all-reduced sum over ranks / count."""
    total = loss_sum.detach().clone().reshape(())
    if dist.is_available() and dist.is_initialized():
        all_reduce(total, "sum", group, "log_mean")
    return total / count.clamp_min(1).to(total.dtype)
