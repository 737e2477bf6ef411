"""Run a Hugging Face causal LM to its final hidden states, and find its LM head.

Nothing here imports transformers: the helpers work on any model that follows its conventions
(``get_decoder()`` or ``base_model``, ``get_output_embeddings()``, ``config``), and on PEFT
models wrapping one (``get_base_model()``).

Alignment convention (used everywhere in nitrobrew.hf): the hidden state at position i predicts
token i+1. ``shift_labels`` turns per-token labels into per-position targets once, so that a
row of the hidden states and a row of the targets always belong together.
"""

from __future__ import annotations

import inspect
from typing import NamedTuple, Optional

import torch
from torch import nn

from ..core.checks import is_dtensor
from .wrapping import IGNORE_INDEX, decoder, is_fsdp2, is_wrapped, unwrap

__all__ = [
    "IGNORE_INDEX",
    "LMHead",
    "decoder",
    "is_fsdp2",
    "is_wrapped",
    "unwrap",
    "lm_head",
    "final_hidden_states",
    "labels_from_inputs",
    "shift_labels",
    "count_targets",
    "check_head",
]


class LMHead(NamedTuple):
    """The output layer: ``logits = scale * (h @ weight.T + bias)``, then ``softcap * tanh(logits / softcap)``
    when the model caps its final logits (Gemma 2/3: ``config.final_logit_softcapping``)."""

    weight: torch.Tensor
    bias: Optional[torch.Tensor]
    scale: float
    softcap: Optional[float] = None


def _final_softcap(model: nn.Module) -> Optional[float]:
    """The cap c of ``c * tanh(logits / c)`` the model applies to its final logits, or None."""
    config = getattr(unwrap(model), "config", None)
    cap = getattr(config, "final_logit_softcapping", None) if config is not None else None
    return float(cap) if cap else None


def _logit_scale(model: nn.Module) -> float:
    """The scalar some architectures apply after the head (before a final softcap)."""
    config = getattr(unwrap(model), "config", None)
    if config is None:
        return 1.0
    scale = 1.0
    if getattr(config, "logit_scale", None) is not None:  # Cohere: logits * logit_scale
        scale *= float(config.logit_scale)
    if getattr(config, "logits_scaling", None) is not None:  # Granite: logits / logits_scaling
        scale /= float(config.logits_scaling)
    return scale


def _active_linear(module: nn.Module) -> nn.Linear:
    if isinstance(module, nn.Linear):
        return module
    copies = getattr(module, "modules_to_save", None)  # PEFT modules_to_save=["lm_head"]
    if isinstance(copies, nn.ModuleDict):
        active = getattr(module, "active_adapter", None)
        active = active[0] if isinstance(active, (list, tuple)) and active else active
        disabled = getattr(module, "_disable_adapters", False)
        if not disabled and active in copies:
            return _active_linear(copies[active])
        return _active_linear(module.original_module)
    raise TypeError(
        f"the LM head is a {type(module).__name__}, not a plain nn.Linear (an adapter on the head, "
        "e.g. LoRA on lm_head, is not supported: merge it first, or use modules_to_save)"
    )


def lm_head(model: nn.Module) -> LMHead:
    """The LM head's weight [V, D] (tied to the input embeddings or not), its bias, and scale."""
    m = unwrap(model)
    get_out = getattr(m, "get_output_embeddings", None)
    head = get_out() if callable(get_out) else None
    if head is None:
        raise TypeError(f"{type(m).__name__} has no output embeddings (is it a causal LM with a head?)")
    linear = _active_linear(head)
    if linear.weight.numel() == 0:
        raise ValueError(
            "the LM head's weight is empty here (parameters partitioned, e.g. DeepSpeed ZeRO-3 or "
            "FSDP version 1): use FSDP2 (fully_shard) or ZeRO-2"
        )
    if is_dtensor(linear.weight) and is_fsdp2(m) and any(p.is_shard() for p in linear.weight.placements):
        from .fsdp import head_is_sharded_apart

        if not head_is_sharded_apart(m):
            # Each data-parallel rank holds other rows: a vocab-parallel loss over FSDP's mesh would mix them.
            raise ValueError(
                "the LM head is still sharded by FSDP2 when the loss reads it (lm_head under its own "
                "fully_shard, resharded after its forward): shard it with the root module (the root "
                "keeps its parameters gathered until the backward), or the decoder apart from it "
                "(fully_shard(model.model)) for the vocab-parallel layout"
            )
    return LMHead(linear.weight, linear.bias, _logit_scale(model), _final_softcap(model))


def _forward_kwargs(model: nn.Module) -> dict:
    params = inspect.signature(unwrap(model).forward).parameters
    for name in ("logits_to_keep", "num_logits_to_keep"):
        if name in params:
            return {name: 1}
    return {}


def final_hidden_states(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: Optional[torch.Tensor] = None,
    *,
    through_forward: bool = False,
    **kwargs,
) -> torch.Tensor:
    """The last hidden states [B, N, D] of a causal LM (after its final norm), no logits.

    By default the decoder (``model.get_decoder()`` / ``base_model``) is called directly, so the
    [B, N, V] logits are never formed. ``through_forward=True`` calls the model itself with
    ``output_hidden_states=True`` and ``logits_to_keep=1`` instead (logits of one position only):
    use it when the model is wrapped by something whose forward must run (DDP).
    """
    if through_forward:
        out = model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            use_cache=False,
            output_hidden_states=True,
            return_dict=True,
            **_forward_kwargs(model),
            **kwargs,
        )
        return out.hidden_states[-1]
    out = decoder(model)(
        input_ids=input_ids, attention_mask=attention_mask, use_cache=False, return_dict=True, **kwargs
    )
    return out.last_hidden_state


def labels_from_inputs(input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Per-token labels when the batch has none: the input ids, IGNORE_INDEX at padding."""
    labels = input_ids.clone()
    if attention_mask is not None:
        labels[attention_mask == 0] = IGNORE_INDEX
    return labels


def shift_labels(labels: torch.Tensor, attention_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Per-position targets [..., N]: target[i] = labels[i + 1]; IGNORE_INDEX at the last position.

    With an attention mask, positions that are padding themselves (left padding) and positions
    whose next token is padding are ignored as well.
    """
    target = labels.new_full(labels.shape, IGNORE_INDEX)
    target[..., :-1] = labels[..., 1:]
    if attention_mask is not None:
        keep = attention_mask != 0
        target[..., :-1] = target[..., :-1].masked_fill(~keep[..., 1:], IGNORE_INDEX)
        target = target.masked_fill(~keep, IGNORE_INDEX)
    return target


def count_targets(labels: torch.Tensor, attention_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Number of positions that count (after the shift): the normalizer of a summed loss."""
    return (shift_labels(labels, attention_mask) != IGNORE_INDEX).sum()


@torch.no_grad()
def check_head(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: Optional[torch.Tensor] = None,
    *,
    through_forward: bool = False,
    rtol: float = 1e-3,
    position_ids: Optional[torch.Tensor] = None,
    **varlen,
) -> float:
    """Verify that ``final_hidden_states`` and ``lm_head`` reproduce ``model(...).logits``.

    Computes the full logits once; raises ValueError when they differ (an architecture with a
    post-head transform nitrobrew does not know). Returns the max abs difference. position_ids
    and varlen kwargs: a packed batch (see ``nitrobrew.hf.packing``).
    """
    from .packing import model_inputs

    inputs = model_inputs(model, input_ids, attention_mask, position_ids, **varlen)
    ref = model(input_ids=input_ids, use_cache=False, **inputs).logits.float()
    h = final_hidden_states(model, input_ids, through_forward=through_forward or is_fsdp2(model), **inputs).float()
    head = lm_head(model)
    ours = h @ head.weight.float().T
    if head.bias is not None:
        ours = ours + head.bias.float()
    ours = ours * head.scale
    if head.softcap is not None:
        ours = head.softcap * torch.tanh(ours / head.softcap)
    keep = torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None else attention_mask != 0
    diff = float((ours - ref)[keep].abs().max()) if keep.any() else 0.0
    tol = rtol * max(1.0, float(ref[keep].abs().max()) if keep.any() else 1.0)
    if head.weight.dtype in (torch.bfloat16, torch.float16):
        tol *= 20  # the model's own logits went through a half-precision matmul
    if diff > tol:
        raise ValueError(
            f"{type(unwrap(model)).__name__}: hidden states @ head differ from model(...).logits "
            f"by {diff:.3g} (> {tol:.3g}): this architecture transforms its logits in a way "
            "nitrobrew.hf does not know; hidden-state losses would train a different model"
        )
    return diff
