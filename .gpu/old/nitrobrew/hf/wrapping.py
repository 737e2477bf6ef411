"""What a model is under its wrappers (DDP, FSDP2, torch.compile, PEFT) and where its decoder is: the
basics every module of nitrobrew.hf uses (kept apart so that none of them imports another in a cycle)."""

from __future__ import annotations

from torch import nn

from ..core.reduction import IGNORE_INDEX

__all__ = ["IGNORE_INDEX"]


_WRAPPERS = (
    "DistributedDataParallel",
    "DataParallel",
    "FullyShardedDataParallel",
    "DeepSpeedEngine",
    "OptimizedModule",
)


def is_fsdp2(model: nn.Module) -> bool:
    """Whether ``fully_shard`` (FSDP2) manages the model: its root forward gathers the parameters."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # torch built without distributed
        return False
    return isinstance(model, FSDPModule)


def is_wrapped(model: nn.Module) -> bool:
    """Whether the model's own forward must run (DDP, torch.compile, FSDP2: their hooks run there)."""
    return type(model).__name__ in _WRAPPERS or is_fsdp2(model)


def unwrap(model: nn.Module) -> nn.Module:
    """The transformers model inside training wrappers (DDP, torch.compile) and PEFT (adapters stay
    injected in it), else the model itself."""
    while is_wrapped(model):
        inner = getattr(model, "module", None) or getattr(model, "_orig_mod", None)
        if not isinstance(inner, nn.Module):
            break
        model = inner
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


def decoder(model: nn.Module) -> nn.Module:
    """The module that maps input ids to the final (normed) hidden states, without the head."""
    m = unwrap(model)
    get_decoder = getattr(m, "get_decoder", None)
    if callable(get_decoder):
        dec = get_decoder()
        if isinstance(dec, nn.Module) and dec is not m:
            return dec
    base = getattr(m, "base_model", None)
    if isinstance(base, nn.Module) and base is not m:
        return base
    raise TypeError(
        f"cannot find the decoder of {type(m).__name__}: expected a transformers causal LM "
        "(with get_decoder() or base_model)"
    )
