"""Generation engines for on-policy and sequence-level distillation, behind one seam (``base.Generator``).

Backends (``make_generator(backend, model, ...)``, YAML key ``generation_backend``):
- ``"hf"``: transformers' ``generate`` with the dynamic cache (any model, any device; the fallback);
- ``"callable"``: a user's ``generate_fn``;
- ``"auto"``: ``"hf"`` (faster engines register here as they land).

The engines import their optional packages only when made.
"""

from __future__ import annotations

from typing import Optional

from .base import Completions, GenerateFn, GenerationStats, Generator, Sampling, completion_mask
from .transformers_engine import CallableGenerator, DynamicCacheGenerator

BACKENDS = ("auto", "hf", "callable")


def make_generator(backend: str, model, *, generate_fn: Optional[GenerateFn] = None, **options) -> Generator:
    """The engine named ``backend`` for ``model`` (the student), with the backend's own ``options``."""
    if backend not in BACKENDS:
        raise ValueError(f"generation_backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    if generate_fn is not None or backend == "callable":
        if generate_fn is None:
            raise ValueError("generation_backend 'callable' needs generate_fn")
        return CallableGenerator(generate_fn, model)
    if options:
        raise ValueError(f"generation backend {backend!r} takes no options, got {sorted(options)}")
    return DynamicCacheGenerator(model)


__all__ = [
    "BACKENDS",
    "CallableGenerator",
    "Completions",
    "DynamicCacheGenerator",
    "GenerateFn",
    "GenerationStats",
    "Generator",
    "Sampling",
    "completion_mask",
    "make_generator",
]
