"""In-process generation with transformers' ``model.generate`` (the training model itself).

``DynamicCacheGenerator``: the dynamic KV cache, any model, any device (the fallback: CPU, unusual models).
``CallableGenerator``: a user's ``generate_fn(prompt_ids, prompt_mask, **options) -> ids`` behind the seam.
Both generate with the model they are given: the training model (``sync_weights`` only advances the weight
version) or a copy of it (``sync_weights`` copies the weights in); ``sleep`` / ``wake`` do nothing.
"""

from __future__ import annotations

import time
from typing import Optional

import torch

from ..model import unwrap
from .base import Completions, GenerateFn, Sampling, check_completion_ids, completion_mask


def vocab_of(model) -> Optional[int]:
    cfg = getattr(unwrap(model), "config", None)
    v = getattr(cfg, "vocab_size", None)
    return int(v) if isinstance(v, int) else None


def sampling_kwargs(s: Sampling) -> dict:
    """transformers' generate() arguments of a ``Sampling``."""
    if s.greedy:
        kw = dict(do_sample=False)
    else:
        kw = dict(do_sample=True, temperature=s.temperature, top_p=s.top_p, top_k=s.top_k)
        if s.min_p > 0:
            kw["min_p"] = s.min_p
    if s.repetition_penalty != 1.0:
        kw["repetition_penalty"] = s.repetition_penalty
    return kw


@torch.no_grad()
def copy_weights(dst: torch.nn.Module, src: torch.nn.Module) -> None:
    """Copy ``src``'s parameters and buffers into ``dst`` in place (same architecture; devices and dtypes may
    differ), so compiled graphs and CUDA graphs of ``dst`` stay valid."""
    theirs = dict(src.named_parameters())
    theirs.update(src.named_buffers())
    for name, t in [*dst.named_parameters(), *dst.named_buffers()]:
        if name not in theirs:
            raise ValueError(f"sync_weights: the training model has no {name!r}")
        t.copy_(theirs[name].detach(), non_blocking=True)


class _LiveModel:
    """Engines that generate with a model in this process: the training model itself (nothing to load, nothing
    to free), or a copy of it (asynchronous rollouts on another device), into which ``sync_weights`` copies."""

    weight_version = 0

    def sync_weights(self, model) -> None:
        if unwrap(model) is not unwrap(self.model):
            copy_weights(unwrap(self.model), unwrap(model))
        self.weight_version += 1

    def sleep(self) -> None:
        pass

    def wake(self) -> None:
        pass


class DynamicCacheGenerator(_LiveModel):
    """``model.generate`` with the dynamic KV cache, in eval mode under no_grad (the mode is restored)."""

    name = "hf"

    def __init__(self, model: torch.nn.Module):
        self.model = model

    @torch.no_grad()
    def generate(self, prompt_ids, prompt_mask, sampling: Sampling) -> Completions:
        m = unwrap(self.model)
        device = next(m.parameters()).device
        prompt_ids, prompt_mask = prompt_ids.to(device), prompt_mask.to(device)
        eos = sampling.eos_list()
        was_training = m.training
        m.eval()
        t0 = time.perf_counter()
        try:
            out = m.generate(
                input_ids=prompt_ids,
                attention_mask=prompt_mask,
                max_new_tokens=sampling.max_new_tokens,
                eos_token_id=eos or None,
                pad_token_id=sampling.pad_token_id,
                use_cache=True,
                **sampling_kwargs(sampling),
            )
        finally:
            m.train(was_training)
        if prompt_ids.device.type == "cuda":
            torch.cuda.current_stream(prompt_ids.device).synchronize()
        seconds = time.perf_counter() - t0
        ids = out[:, prompt_ids.shape[1] :]
        return Completions(
            ids=ids,
            mask=completion_mask(ids, eos),
            logprobs=None,
            weight_version=self.weight_version,
            seconds=seconds,
            decode_steps=ids.shape[1],
        )


class CallableGenerator(_LiveModel):
    """A ``generate_fn`` behind the seam; its output is checked (integer ids, shape, range) at the call."""

    name = "callable"

    def __init__(self, generate_fn: GenerateFn, model: torch.nn.Module):
        self.generate_fn = generate_fn
        self.model = model

    def generate(self, prompt_ids, prompt_mask, sampling: Sampling) -> Completions:
        t0 = time.perf_counter()
        raw = self.generate_fn(
            prompt_ids,
            prompt_mask,
            model=self.model,
            max_new_tokens=sampling.max_new_tokens,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            top_k=sampling.top_k,
            eos_token_id=sampling.eos_token_id,
            pad_token_id=sampling.pad_token_id,
            seed=sampling.seed,
        )
        ids = check_completion_ids(
            raw, prompt_ids.shape[0], sampling.max_new_tokens, vocab_of(self.model), "generate_fn"
        ).to(prompt_ids.device)
        if prompt_ids.device.type == "cuda":
            torch.cuda.current_stream(prompt_ids.device).synchronize()
        seconds = time.perf_counter() - t0
        return Completions(
            ids=ids,
            mask=completion_mask(ids, sampling.eos_list()),
            logprobs=None,
            weight_version=self.weight_version,
            seconds=seconds,
            decode_steps=ids.shape[1],
        )
