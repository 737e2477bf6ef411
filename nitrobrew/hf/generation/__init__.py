"""Generation engines for on-policy and sequence-level distillation, behind one seam (``base.Generator``).

Backends (``make_generator(backend, model, ...)``, YAML key ``generation_backend``):
- ``"hf"``: transformers' ``generate`` with the dynamic cache (any model, any device; the fallback);
- ``"static"``: the fast in-process engine (``static_engine``): transformers' static KV cache, a compiled
  decode step, bucketed shapes, a float32 sampler without full sorts;
- ``"callable"``: a user's ``generate_fn``;
- ``"auto"``: ``"static"`` for a model on CUDA whose architecture supports the static cache, else ``"hf"``
  (CPU, unusual models).

The engines import their optional packages only when made.
"""

from __future__ import annotations

from typing import Optional

from .async_rollouts import AsyncRollouts, StalenessError
from .base import Completions, GenerateFn, GenerationStats, Generator, Sampling, completion_mask
from .static_engine import StaticCacheGenerator
from .transformers_engine import CallableGenerator, DynamicCacheGenerator

BACKENDS = ("auto", "hf", "static", "callable")


def supports_static_cache(model) -> bool:
    """Whether transformers declares ``model``'s architecture fit for a static cache and a compiled forward."""
    from ..model import unwrap

    m = unwrap(model)
    return bool(getattr(m, "_can_compile_fullgraph", False) or getattr(m, "_supports_static_cache", False))


def auto_backend(model) -> str:
    """The engine ``"auto"`` picks for ``model``."""
    from ..model import is_fsdp2, unwrap

    m = unwrap(model)
    device = next(m.parameters()).device
    # FSDP2 shards gather in the forward's hooks: the dynamic cache, uncompiled, is the safe path there.
    return "static" if device.type == "cuda" and supports_static_cache(m) and not is_fsdp2(m) else "hf"


def make_generator(backend: str, model, *, generate_fn: Optional[GenerateFn] = None, **options) -> Generator:
    """The engine named ``backend`` for ``model`` (the student), with the backend's own ``options``."""
    if backend not in BACKENDS:
        raise ValueError(f"generation_backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    if generate_fn is not None or backend == "callable":
        if generate_fn is None:
            raise ValueError("generation_backend 'callable' needs generate_fn")
        return CallableGenerator(generate_fn, model)
    if backend == "auto":
        backend = auto_backend(model)
        if backend == "hf":
            options = {}  # the fallback: the static engine's options do not apply
    if backend == "static":
        return StaticCacheGenerator(model, **options)
    if options:
        raise ValueError(f"generation backend {backend!r} takes no options, got {sorted(options)}")
    return DynamicCacheGenerator(model)


__all__ = [
    "AsyncRollouts",
    "BACKENDS",
    "CallableGenerator",
    "Completions",
    "DynamicCacheGenerator",
    "GenerateFn",
    "GenerationStats",
    "Generator",
    "Sampling",
    "StalenessError",
    "StaticCacheGenerator",
    "auto_backend",
    "completion_mask",
    "make_generator",
]
