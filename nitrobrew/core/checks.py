"""Argument checks and small helpers shared by every loss family.

Every public loss validates its inputs here, before any kernel runs, so bad input raises a
clear error instead of crashing inside a kernel or returning a silently wrong number.
"""

from __future__ import annotations

import functools
import math
import os
from typing import Any, Mapping, Optional, Sequence, Tuple, TypeVar, cast

import torch

REDUCTIONS = ("mean", "sum", "none")
BACKENDS = ("auto", "torch", "triton")
MODES = ("fast", "constant_memory")
T = TypeVar("T")


def is_int(value) -> bool:
    """A Python int that is not a bool (True would silently mean 1)."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value) -> bool:
    """A Python int or float that is not a bool."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_reduction(reduction: str) -> None:
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")


def check_backend(backend: str) -> None:
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")


def check_temperature(temperature: float) -> None:
    if not (is_number(temperature) and math.isfinite(temperature) and temperature > 0):
        raise ValueError(f"temperature must be a finite number > 0, got {temperature!r}")


def is_dtensor(t) -> bool:
    """Whether t is a DTensor; torch.distributed is imported only when the type's name says so."""
    if type(t).__name__ != "DTensor":
        return False
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def local_tensor(t: T) -> T:
    """t's local shard if t is a DTensor, else t itself (None included)."""
    return cast(Any, t).to_local() if is_dtensor(t) else t


def check_softcap(name: str, cap) -> None:
    if cap is not None and not (is_number(cap) and math.isfinite(cap) and cap > 0):
        raise ValueError(
            f"{name} must be None or a finite number > 0 (the logit cap c of c * tanh(z / c)), got {cap!r}"
        )


def check_unit_interval(name: str, value: float) -> None:
    if not (is_number(value) and 0.0 <= value <= 1.0):
        raise ValueError(f"{name} must be in [0, 1], got {value!r}")


def divergence_param(divergence: str, params: Mapping[str, float]) -> Tuple[str, float]:
    """The canonical (divergence, parameter) of the public options. ``params``: the divergence parameters
    given by keyword (``beta=...``); the registry (``divergences.PARAMS``) names them, their ranges and
    defaults. Unknown keywords raise TypeError, unknown divergences and values out of range ValueError."""
    from .. import divergences as dv

    for name in params:
        if name not in dv.PARAMS:
            raise TypeError(
                f"got an unexpected keyword argument {name!r} (the divergence parameters: {sorted(dv.PARAMS)})"
            )
    entry = dv.REGISTRY.get(divergence)
    if entry is None or entry.param is None:
        return dv.canonical(divergence, 0.0)
    spec = dv.PARAMS[entry.param]
    value = params.get(spec.name, spec.default)
    if not (is_number(value) and spec.low <= value <= spec.high):
        raise ValueError(f"{spec.name} must be in [{spec.low:g}, {spec.high:g}], got {value!r}")
    return dv.canonical(divergence, value)


def check_chunk(name: str, value: Optional[int]) -> None:
    if value is not None and (not is_int(value) or value <= 0):
        raise ValueError(f"{name} must be a positive int or None, got {value!r}")


def check_mode(mode: Optional[str], memory_budget: Optional[int]) -> None:
    """Triton options, validated on every backend so that a typo fails on CPU too."""
    if mode is not None and mode not in MODES:
        raise ValueError(f"mode must be None or one of {MODES}, got {mode!r}")
    if memory_budget is not None and (not is_int(memory_budget) or memory_budget <= 0):
        raise ValueError(f"memory_budget must be a positive number of bytes, got {memory_budget!r}")


def check_same_device(**tensors: Optional[torch.Tensor]) -> None:
    present = {k: t for k, t in tensors.items() if isinstance(t, torch.Tensor)}  # others: checked elsewhere
    devices = {k: t.device for k, t in present.items()}
    if len(set(devices.values())) > 1:
        desc = ", ".join(f"{k} on {d}" for k, d in devices.items())
        raise ValueError(f"all tensors must be on one device, got {desc}")


def check_float(name: str, t: torch.Tensor) -> None:
    if not t.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got {t.dtype}")


def check_same_dtype(**tensors: Optional[torch.Tensor]) -> None:
    present = {k: t for k, t in tensors.items() if t is not None}
    dtypes = {k: t.dtype for k, t in present.items()}
    if len(set(dtypes.values())) > 1:
        desc = ", ".join(f"{k}: {d}" for k, d in dtypes.items())
        raise TypeError(f"tensors must share one dtype (cast them first), got {desc}")


def check_labels(labels: Optional[torch.Tensor], lead_shape: Sequence[int]) -> None:
    if labels is None:
        return
    if not isinstance(labels, torch.Tensor):
        raise TypeError(f"labels must be a torch.Tensor, got {type(labels).__name__}")
    if labels.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"labels must be an integer tensor (int64 or int32), got {labels.dtype}")
    if tuple(labels.shape) != tuple(lead_shape):
        raise ValueError(
            f"labels shape {tuple(labels.shape)} must equal the leading shape of the hidden states {tuple(lead_shape)}"
        )


def check_ids_in_range(name: str, ids: torch.Tensor, upper: int, ignore_index: Optional[int] = None) -> None:
    """Raise if any id (other than ignore_index) is outside [0, upper). One small device sync."""
    if ids.numel() == 0 or torch.compiler.is_compiling():
        return
    if ids.is_cuda and torch.cuda.is_current_stream_capturing():
        return  # reading the range would sync inside a CUDA graph capture
    valid = ids if ignore_index is None else ids[ids != ignore_index]
    if valid.numel() == 0:
        return
    lo, hi = int(valid.min()), int(valid.max())
    if lo < 0 or hi >= upper:
        raise ValueError(f"{name} must lie in [0, {upper}) (or equal ignore_index), found values in [{lo}, {hi}]")


def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except Exception:
        return False
    return True


def interpreter_enabled() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def resolve_backend(backend: str, device: torch.device) -> str:
    """Map "auto" to a concrete backend; validate that "triton" can run on this device."""
    check_backend(backend)
    return backend_for(backend, device)


def backend_for(backend: str, device: torch.device) -> str:
    """``resolve_backend`` for a backend name already checked (a validation that checked every option
    first resolves it here without checking the name again)."""
    if backend == "torch":
        return "torch"
    if backend == "auto":
        if device.type == "cuda" and triton_available():
            return "triton"
        if device.type == "cuda":
            _warn_once("triton is not installed: nitrobrew falls back to its PyTorch implementation")
        return "torch"
    if not triton_available():
        raise RuntimeError("backend='triton' needs the triton package (pip install triton)")
    if device.type != "cuda" and not interpreter_enabled():
        raise RuntimeError(
            "backend='triton' on CPU tensors needs Triton's interpreter: set TRITON_INTERPRET=1 "
            "before importing nitrobrew"
        )
    return "triton"


_WARNED: set = set()


def _warn_once(msg: str) -> None:
    if msg not in _WARNED:
        _WARNED.add(msg)
        import warnings

        warnings.warn(msg, RuntimeWarning, stacklevel=3)


def no_double_backward(backward):
    """Decorates an autograd Function's backward: nitrobrew's backward passes are not differentiable
    themselves, so create_graph=True (double backward) is refused here with a clear error instead of
    giving second-order gradients that are silently wrong or missing."""

    @functools.wraps(backward)
    def checked(ctx, *grads):
        if torch.is_grad_enabled():  # the autograd engine enables grad mode only for create_graph=True
            raise RuntimeError(
                "nitrobrew losses do not support double backward (create_graph=True, e.g. for Hessian-vector "
                "products or gradient penalties through the loss): their backward is not differentiable. Take "
                "first-order gradients only, or use nitrobrew.hidden.reference_loss (materializing) for "
                "higher-order derivatives."
            )
        return backward(ctx, *grads)

    return checked
