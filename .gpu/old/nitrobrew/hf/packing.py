"""Packed (padding-free) batches: several documents in one row, told apart by ``position_ids``.

``DataCollatorWithFlattening`` packs documents into one row and returns ``position_ids`` that
restart at 0 for each document (and, on request, the flash-attention varlen kwargs
``cu_seq_lens_q/k`` and ``max_length_q/k``). Position ids alone do not stop a document from
attending to the one before it under every attention implementation, so ``model_inputs``
builds what each one needs:

- ``sdpa`` / ``eager``: a block-diagonal causal 4-D mask (additive, in the model's dtype);
- flash attention: the position ids and varlen kwargs, passed through (it splits on them);
- anything else with a packed row: an error, rather than attention across documents.

Targets: the last position of a document does not predict the first token of the next one
(``document_targets``).
"""

from __future__ import annotations

from typing import Dict, Optional

import torch
from torch import nn

from .wrapping import IGNORE_INDEX, unwrap

VARLEN_KEYS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")
MASKED_IMPLEMENTATIONS = ("sdpa", "eager")


def check_position_ids(position_ids: torch.Tensor, shape) -> torch.Tensor:
    """``position_ids`` ([N], [1, N] or [B, N]) broadcast to ``shape`` ([B, N]), or a ValueError
    naming them (a raw shape error from deep inside otherwise)."""
    if not isinstance(position_ids, torch.Tensor) or position_ids.dtype.is_floating_point:
        raise TypeError(f"position_ids must be an integer tensor, got {getattr(position_ids, 'dtype', position_ids)!r}")
    shape = tuple(shape)
    if position_ids.dim() == 1:
        position_ids = position_ids[None]
    if position_ids.dim() != 2 or position_ids.shape[-1] != shape[-1] or position_ids.shape[0] not in (1, shape[0]):
        raise ValueError(
            f"position_ids {tuple(position_ids.shape)} must have the shape of input_ids {shape} (or [1, N])"
        )
    return position_ids.expand(shape)


def document_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """[B, N] index of the document each position belongs to: a new one wherever the position ids
    restart (go to 0) or jump forward; within a document they go up by exactly one. Position ids
    that go back (or repeat) without restarting at 0 are an error: read as document breaks, they
    would silently cut one document in two."""
    step = position_ids[..., 1:] - position_ids[..., :-1]
    back = (step <= 0) & (position_ids[..., 1:] != 0)
    if bool(back.any()):
        b, i = (int(v) for v in back.nonzero()[0])
        b_at = f"row {b}, " if position_ids.dim() > 1 else ""
        raise ValueError(
            f"position_ids go from {int(position_ids[..., i].flatten()[b])} to "
            f"{int(position_ids[..., i + 1].flatten()[b])} at {b_at}column {i + 1}: within a document they go "
            "up by one, and a new document starts at 0"
        )
    starts = torch.ones_like(position_ids, dtype=torch.bool)
    starts[..., 1:] = step != 1
    return starts.long().cumsum(-1)


def is_packed(position_ids: Optional[torch.Tensor]) -> bool:
    """Whether some row holds more than one document."""
    return position_ids is not None and bool((document_ids(position_ids)[..., -1] > 1).any())


def document_targets(target: torch.Tensor, position_ids: Optional[torch.Tensor]) -> torch.Tensor:
    """Per-position targets with the cross-document ones (last of a document -> first of the
    next) set to IGNORE_INDEX."""
    if position_ids is None:
        return target
    docs = document_ids(check_position_ids(position_ids, target.shape))
    cross = torch.zeros_like(target, dtype=torch.bool)
    cross[..., :-1] = docs[..., 1:] != docs[..., :-1]
    return target.masked_fill(cross, IGNORE_INDEX)


def attention_implementation(model: nn.Module) -> Optional[str]:
    config = getattr(unwrap(model), "config", None)
    return getattr(config, "_attn_implementation", None)


def block_causal_mask(
    position_ids: torch.Tensor, attention_mask: Optional[torch.Tensor], dtype: torch.dtype
) -> torch.Tensor:
    """[B, 1, N, N] additive mask: position i sees j <= i of its own document (and not padding)."""
    docs = document_ids(position_ids)
    n = docs.shape[-1]
    causal = torch.ones(n, n, dtype=torch.bool, device=docs.device).tril()
    allowed = (docs[:, :, None] == docs[:, None, :]) & causal
    if attention_mask is not None:
        allowed = allowed & (attention_mask[:, None, :] != 0)
    mask = torch.zeros(allowed.shape, dtype=dtype, device=docs.device)
    return mask.masked_fill(~allowed, torch.finfo(dtype).min)[:, None]


def model_inputs(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: Optional[torch.Tensor] = None,
    position_ids: Optional[torch.Tensor] = None,
    **varlen,
) -> Dict[str, torch.Tensor]:
    """The keyword arguments (besides input_ids) that make ``model`` attend within documents."""
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or 0 in input_ids.shape:
        raise ValueError(
            f"input_ids must be a [B, N] tensor with B, N >= 1, got {tuple(getattr(input_ids, 'shape', ()))}"
            f"{'' if isinstance(input_ids, torch.Tensor) else ' (' + type(input_ids).__name__ + ')'}"
        )
    unknown = sorted(set(varlen) - set(VARLEN_KEYS))
    if unknown:
        raise ValueError(f"unknown model inputs {unknown}: nitrobrew.hf passes position_ids and {VARLEN_KEYS}")
    varlen = {k: v for k, v in varlen.items() if v is not None}
    if position_ids is None:
        if varlen:
            raise ValueError(
                "flash-attention varlen kwargs without position_ids: pass the position_ids the "
                "collator made (DataCollatorWithFlattening(return_position_ids=True))"
            )
        return {"attention_mask": attention_mask}
    position_ids = check_position_ids(position_ids, input_ids.shape)
    impl = attention_implementation(model)
    if not is_packed(position_ids):
        return {"attention_mask": attention_mask, "position_ids": position_ids, **varlen}
    if impl in MASKED_IMPLEMENTATIONS:
        dtype = next(unwrap(model).parameters()).dtype
        dtype = dtype if dtype.is_floating_point else torch.float32
        return {"attention_mask": block_causal_mask(position_ids, attention_mask, dtype), "position_ids": position_ids}
    if impl is not None and "flash" in impl:
        if attention_mask is not None and not bool((attention_mask != 0).all()):
            raise ValueError(
                "a packed batch with padding under flash attention: drop the padding (the "
                "flattening collator makes none) or use attn_implementation='sdpa'"
            )
        return {"position_ids": position_ids, **varlen}
    raise ValueError(
        f"a packed batch (position_ids restarting inside a row) with attn_implementation={impl!r}: "
        "nitrobrew.hf can keep documents apart under 'sdpa', 'eager' or flash attention; load "
        "the model with one of those, or do not pack"
    )
