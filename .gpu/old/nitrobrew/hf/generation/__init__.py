"""Generation engines for on-policy and sequence-level distillation, behind one seam (``base.Generator``).

Backends (``make_generator(backend, model, ...)``, YAML key ``generation_backend``):
- ``"hf"``: transformers' ``generate`` with the dynamic cache (any model, any device; the fallback);
- ``"static"``: the fast in-process engine (``static_engine``): transformers' static KV cache, a compiled
  decode step, bucketed shapes, a float32 sampler without full sorts;
- ``"callable"``: a user's ``generate_fn``;
- ``"vllm"``: ``vllm.LLM`` in the training process (``vllm_engine.VLLMColocatedGenerator``);
- ``"vllm-server"``: a running vLLM server, by URL (``vllm_server.VLLMServerGenerator``);
- ``"auto"``: for a model on CUDA, ``"vllm"`` where vLLM is installed, else ``"static"`` where the architecture
  supports the static cache; ``"hf"`` otherwise (CPU, unusual models, FSDP2-sharded students).

The engines import their optional packages only when made.
"""

from __future__ import annotations

from typing import Optional

from .async_rollouts import AsyncRollouts, StalenessError
from .base import Completions, GenerateFn, GenerationStats, Generator, Sampling, completion_mask
from .static_engine import StaticCacheGenerator
from .transformers_engine import CallableGenerator, DynamicCacheGenerator

BACKENDS = ("auto", "hf", "static", "callable", "vllm", "vllm-server")
VLLM_BACKENDS = ("vllm", "vllm-server")


def supports_static_cache(model) -> bool:
    """Whether transformers declares ``model``'s architecture fit for a static cache and a compiled forward."""
    from ..model import unwrap

    m = unwrap(model)
    return bool(getattr(m, "_can_compile_fullgraph", False) or getattr(m, "_supports_static_cache", False))


def auto_backend(model, vllm: bool = True) -> str:
    """The engine ``"auto"`` picks for ``model`` (``vllm=False``: an in-process one, e.g. for the teacher)."""
    from ..model import is_fsdp2, unwrap

    m = unwrap(model)
    device = next(m.parameters()).device
    # FSDP2 shards gather in the forward's hooks: the dynamic cache, uncompiled, is the safe path there.
    if device.type != "cuda" or is_fsdp2(m):
        return "hf"
    from .vllm_engine import vllm_importable

    if vllm and vllm_importable():
        return "vllm"
    return "static" if supports_static_cache(m) else "hf"


def resolve_backend(backend: str, model=None) -> str:
    """The backend ``backend`` stands for with ``model`` (``"auto"`` resolved as ``auto_backend``)."""
    if backend != "auto":
        return backend
    if model is None:
        raise ValueError("resolving generation_backend 'auto' needs the model")
    return auto_backend(model)


def make_generator(backend: str, model, *, generate_fn: Optional[GenerateFn] = None, **options) -> Generator:
    """The engine named ``backend`` for ``model`` (the student), with the backend's own ``options``."""
    if backend not in BACKENDS:
        raise ValueError(f"generation_backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    if generate_fn is not None or backend == "callable":
        if generate_fn is None:
            raise ValueError("generation_backend 'callable' needs generate_fn")
        return CallableGenerator(generate_fn, model)
    resolved = resolve_backend(backend, model)
    if backend == "auto":
        options = {}  # the settings of a named backend do not carry over to the one "auto" finds
    if resolved == "vllm":
        from .vllm_engine import VLLMColocatedGenerator

        return VLLMColocatedGenerator(model, **options)
    if resolved == "vllm-server":
        from .vllm_server import VLLMServerGenerator

        if options.get("base_url") is None:
            raise ValueError("generation_backend 'vllm-server' needs vllm_server_url (the server's http:// address)")
        return VLLMServerGenerator(model, **options)
    if resolved == "static":
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
    "VLLM_BACKENDS",
    "auto_backend",
    "completion_mask",
    "make_generator",
    "resolve_backend",
]
