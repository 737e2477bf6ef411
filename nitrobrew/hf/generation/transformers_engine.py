"""In-process generation with transformers' ``model.generate`` (the training model itself).

``DynamicCacheGenerator``: the dynamic KV cache, any model, any device (the fallback: CPU, unusual models).
``CallableGenerator``: a user's ``generate_fn(prompt_ids, prompt_mask, **options) -> ids`` behind the seam.
Both generate with the live model, so ``sync_weights`` only advances the weight version and ``sleep`` /
``wake`` do nothing.
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


class _LiveModel:
    """Engines that generate with the training model: nothing to load, nothing to free."""

    weight_version = 0

    def sync_weights(self, model) -> None:
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
            torch.cuda.synchronize(prompt_ids.device)
        seconds = time.perf_counter() - t0
        ids = out[:, prompt_ids.shape[1] :]
        return Completions(ids, completion_mask(ids, eos), None, self.weight_version, seconds, ids.shape[1])


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
            torch.cuda.synchronize(prompt_ids.device)
        seconds = time.perf_counter() - t0
        return Completions(
            ids, completion_mask(ids, sampling.eos_list()), None, self.weight_version, seconds, ids.shape[1]
        )
