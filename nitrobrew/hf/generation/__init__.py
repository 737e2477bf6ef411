"""Generation engines for on-policy and sequence-level distillation, behind one seam (``base.Generator``).

Backends (``make_generator(backend, model, ...)``, YAML key ``generation_backend``):
- ``"hf"``: transformers' ``generate`` with the dynamic cache (any model, any device; the fallback);
- ``"callable"``: a user's ``generate_fn``;
- ``"vllm"``: ``vllm.LLM`` in the training process (``vllm_engine.VLLMColocatedGenerator``);
- ``"vllm-server"``: a running vLLM server, by URL (``vllm_server.VLLMServerGenerator``);
- ``"auto"``: ``"vllm"`` where vLLM is installed and CUDA is available, else ``"hf"``.

The engines import their optional packages only when made.
"""

from __future__ import annotations

from typing import Optional

from .base import Completions, GenerateFn, GenerationStats, Generator, Sampling, completion_mask
from .transformers_engine import CallableGenerator, DynamicCacheGenerator

BACKENDS = ("auto", "hf", "callable", "vllm", "vllm-server")
VLLM_BACKENDS = ("vllm", "vllm-server")


def resolve_backend(backend: str) -> str:
    """The backend ``"auto"`` stands for here: vLLM when importable on CUDA, else transformers'."""
    if backend != "auto":
        return backend
    import torch

    from .vllm_engine import vllm_importable

    return "vllm" if torch.cuda.is_available() and vllm_importable() else "hf"


def make_generator(backend: str, model, *, generate_fn: Optional[GenerateFn] = None, **options) -> Generator:
    """The engine named ``backend`` for ``model`` (the student), with the backend's own ``options``."""
    if backend not in BACKENDS:
        raise ValueError(f"generation_backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    if generate_fn is not None or backend == "callable":
        if generate_fn is None:
            raise ValueError("generation_backend 'callable' needs generate_fn")
        return CallableGenerator(generate_fn, model)
    resolved = resolve_backend(backend)
    if resolved == "vllm":
        from .vllm_engine import VLLMColocatedGenerator

        return VLLMColocatedGenerator(model, **options)
    if resolved == "vllm-server":
        from .vllm_server import VLLMServerGenerator

        if options.get("base_url") is None:
            raise ValueError("generation_backend 'vllm-server' needs vllm_server_url (the server's http:// address)")
        return VLLMServerGenerator(model, **options)
    if backend == "auto":
        options = {}  # vLLM's settings, for where "auto" finds vLLM
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
    "VLLM_BACKENDS",
    "completion_mask",
    "make_generator",
    "resolve_backend",
]
