"""The fast in-process engine: transformers' static KV cache, a compiled decode step, bucketed shapes.

``StaticCacheGenerator(model)`` generates with the model itself (the training student, or a copy of it on
another device for asynchronous rollouts). Per call:

1. the prompts (left-padded) are padded on the left to a length bucket (a multiple of ``prompt_bucket``)
   and the batch to a batch bucket (the next power of two; the extra rows repeat the first prompt and are
   dropped afterwards), so that a few graphs serve every step;
2. a ``transformers.StaticCache`` of ``cache_bucket``-rounded length is kept per (batch, length) bucket
   and reset between calls; the prompt is prefilled eagerly (one forward, the last position's logits);
3. each decode step is the model's forward compiled by transformers' own ``get_compiled_call`` (CUDA:
   inductor, "reduce-overhead", i.e. CUDA graphs; static shapes: the token, its position, the cache
   position and an attention mask as wide as the cache), followed by the float32 sampler of ``sampler``;
4. rows that emitted an EOS keep stepping (static shapes) with their tokens replaced by the pad id; every
   ``check_every`` steps one host sync ends the loop once every row is done.

``compiles`` counts the graphs dynamo compiled (``torch._dynamo`` counters): after the first call of a
bucket no more should appear (``recompiles``). ``sleep()`` frees the caches (the KV memory) until the
next call; ``sync_weights`` copies the weights when the engine holds a model of its own.
"""

from __future__ import annotations

import inspect
import time
from typing import Dict, Optional, Tuple

import torch

from ..model import unwrap
from .base import Completions, Sampling, completion_mask
from .sampler import sample
from .transformers_engine import _LiveModel


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def batch_bucket(n: int) -> int:
    """The next power of two >= n."""
    return 1 << max(n - 1, 0).bit_length()


def compiled_graphs() -> int:
    """Graphs dynamo has compiled in this process so far."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


class StaticCacheGenerator(_LiveModel):
    """transformers' static cache with a compiled decode step (see the module docstring).

    Args:
        model: a transformers causal LM (wrappers and PEFT are looked through).
        compile: compile the decode step (default: on CUDA only).
        compile_backend, compile_mode: ``torch.compile``'s (default "inductor" and, on CUDA,
            "reduce-overhead"; "eager" compiles the graph without code generation, for tests).
        prompt_bucket: prompts are padded on the left to a multiple of this.
        cache_bucket: the cache's length (prompt bucket + max_new_tokens) is rounded up to a multiple of this.
        check_every: decode steps between the host syncs that stop the loop once every row has ended.
        max_caches: KV caches kept between calls (the most recently used buckets).
        gqa_decode: for a model with SDPA attention and grouped key/value heads, run each decode step's
            attention on the key/value heads (``decode_attention``) instead of repeating the cache per query
            head (what transformers' SDPA does under torch.compile whenever a mask is given).
    """

    name = "static"
    # Sampling.seed seeds a generator of the engine's own: the process's RNG is never touched, so an engine
    # in a background thread (asynchronous rollouts) is deterministic and leaves training's draws alone.
    seeds_itself = True

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        compile: Optional[bool] = None,
        compile_backend: str = "inductor",
        compile_mode: Optional[str] = None,
        prompt_bucket: int = 64,
        cache_bucket: int = 256,
        check_every: int = 16,
        max_caches: int = 2,
        gqa_decode: bool = True,
    ):
        sizes = dict(
            prompt_bucket=prompt_bucket, cache_bucket=cache_bucket, check_every=check_every, max_caches=max_caches
        )
        for name, v in sizes.items():
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        self.model = model
        device = next(unwrap(model).parameters()).device
        self.compile = device.type == "cuda" if compile is None else bool(compile)
        self.compile_backend = compile_backend
        self.compile_mode = (
            compile_mode
            if compile_mode is not None or compile_backend != "inductor"
            else ("reduce-overhead" if device.type == "cuda" else None)
        )
        self.prompt_bucket, self.cache_bucket, self.check_every = prompt_bucket, cache_bucket, check_every
        self.max_caches = max_caches
        self.gqa_decode = bool(gqa_decode)
        self._caches: Dict[Tuple[int, int], object] = {}
        self._warm: set = set()
        self._step = None
        self.compiles = 0
        self.recompiles = 0

    # -- memory -----------------------------------------------------------------------------------
    def sleep(self) -> None:
        """Free the KV caches (allocated again, and CUDA graphs re-recorded, at the next call)."""
        self._caches.clear()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def wake(self) -> None:
        pass  # the caches come back lazily, at the shapes the next call needs

    # -- the pieces -------------------------------------------------------------------------------
    def _cache(self, m, batch: int, length: int):
        key = (batch, length)
        cache = self._caches.pop(key, None)
        if cache is None:
            while len(self._caches) >= self.max_caches:  # the least recently used bucket's memory goes first
                self._caches.pop(next(iter(self._caches)))
            from transformers import StaticCache

            try:  # transformers >= 4.56: allocated at the first update, at its batch
                cache = StaticCache(config=m.config, max_cache_len=length)
            except TypeError:  # older: the batch, the device and the dtype up front
                p = next(m.parameters())
                cache = StaticCache(
                    config=m.config, max_batch_size=batch, max_cache_len=length, device=p.device, dtype=p.dtype
                )
        else:
            cache.reset()
        self._caches[key] = cache  # most recently used last
        return cache

    def _decode_fn(self, m):
        if not self.compile:
            return m.__call__
        if self._step is None:
            from transformers.generation.configuration_utils import CompileConfig

            # One graph per (batch, cache length) bucket, all of the same code object: room for more of them
            # than dynamo's default of 8 before it falls back to eager.
            for limit in ("recompile_limit", "cache_size_limit"):
                if hasattr(torch._dynamo.config, limit):
                    setattr(torch._dynamo.config, limit, max(getattr(torch._dynamo.config, limit), 64))
            cfg = CompileConfig(fullgraph=False, dynamic=False, backend=self.compile_backend, mode=self.compile_mode)
            self._step = m.get_compiled_call(cfg)
        return self._step

    @torch.no_grad()
    def generate(self, prompt_ids, prompt_mask, sampling: Sampling) -> Completions:
        m = unwrap(self.model)
        device = next(m.parameters()).device
        B, P = prompt_ids.shape
        G = sampling.max_new_tokens
        Pb = _round_up(max(P, 1), self.prompt_bucket)
        Bb = batch_bucket(B)
        L = _round_up(Pb + G, self.cache_bucket)
        pad = sampling.pad_token_id
        ids = torch.full((Bb, Pb), pad, dtype=torch.long, device=device)
        pmask = torch.zeros((Bb, Pb), dtype=torch.long, device=device)
        ids[:B, Pb - P :] = prompt_ids.to(device)
        pmask[:B, Pb - P :] = prompt_mask.to(device).long()
        ids[B:], pmask[B:] = ids[:1], pmask[:1]  # filler rows: a copy of the first prompt, dropped at the end
        mask = torch.ones((Bb, L), dtype=torch.long, device=device)
        mask[:, :Pb] = pmask
        positions = (pmask.cumsum(1) - 1).clamp(min=0)
        next_position = positions[:, -1:] + 1
        eos = sampling.eos_list()
        eos_t = torch.tensor(eos, device=device, dtype=torch.long) if eos else None
        out_ids = torch.full((Bb, G), pad, dtype=torch.long, device=device)
        out_lp = torch.zeros((Bb, G), dtype=torch.float32, device=device)
        penalty = sampling.repetition_penalty != 1.0
        if penalty:
            # Seen tokens: the prompt's, padding replaced by each row's last prompt token (already seen).
            seen = torch.where(pmask != 0, ids, ids[:, -1:])
            seen = torch.cat([seen, ids[:, -1:].expand(Bb, G).clone()], 1)
        was_training = m.training
        m.eval()
        swapped = self.gqa_decode and _use_decode_attention(m)
        graphs0 = compiled_graphs()
        if device.type == "cuda":
            torch.cuda.current_stream(device).synchronize()  # this stream: training may run beside it
        rng = None
        if sampling.seed is not None and not sampling.greedy:
            rng = torch.Generator(device=device).manual_seed(int(sampling.seed))
        t0 = time.perf_counter()
        steps = 0
        try:
            cache = self._cache(m, Bb, L)
            cache_kw = {_cache_keyword(m): cache}
            logits = m(
                input_ids=ids,
                attention_mask=mask,
                position_ids=positions,
                cache_position=torch.arange(Pb, device=device),
                use_cache=True,
                logits_to_keep=1,
                **cache_kw,
            ).logits[:, -1]
            step = self._decode_fn(m)
            graphs = self.compile and self.compile_mode == "reduce-overhead"
            done = torch.zeros(Bb, dtype=torch.bool, device=device)
            cache_positions = torch.arange(Pb, Pb + G, device=device)
            for t in range(G):
                if penalty:
                    logits = _penalize(logits.float(), seen, sampling.repetition_penalty)
                tok, lp = sample(logits, sampling, rng)
                tok = tok.masked_fill(done, pad)
                out_ids[:, t], out_lp[:, t] = tok, lp.masked_fill(done, 0.0)
                steps = t + 1
                if eos_t is not None:
                    done = done | torch.isin(tok, eos_t)
                    if (t + 1) % self.check_every == 0 and bool(done[:B].all()):
                        break
                if t + 1 == G:
                    break
                if penalty:
                    seen[:, Pb + t] = tok
                if graphs:
                    torch.compiler.cudagraph_mark_step_begin()  # the last step's outputs are consumed
                logits = step(
                    input_ids=tok[:, None],
                    attention_mask=mask,
                    position_ids=next_position + t,
                    cache_position=cache_positions[t : t + 1],
                    use_cache=True,
                    **cache_kw,
                ).logits[:, -1]
                # CUDA graphs reuse their output buffers: take the row out before the next replay.
                logits = logits.clone() if self.compile else logits
        finally:
            m.train(was_training)
            if swapped:
                m.config._attn_implementation = "sdpa"
        if device.type == "cuda":
            torch.cuda.current_stream(device).synchronize()  # this stream: training may run beside it
        seconds = time.perf_counter() - t0
        new_graphs = compiled_graphs() - graphs0
        again = new_graphs if (Bb, L) in self._warm else 0  # a bucket compiled before: recompiled
        self.compiles += new_graphs
        self.recompiles += again
        self._warm.add((Bb, L))
        ids_out = out_ids[:B, :steps]
        return Completions(
            ids=ids_out,
            mask=completion_mask(ids_out, eos),
            logprobs=out_lp[:B, :steps],
            weight_version=self.weight_version,
            seconds=seconds,
            decode_steps=steps,
            compiles=new_graphs,
            recompiles=again,
        )


DECODE_ATTENTION = "nitrobrew_decode_sdpa"


def decode_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs):
    """transformers' SDPA attention, except for a single query token with grouped key/value heads: the query
    heads that share a key/value head become that head's query rows ([B, H, 1, D] -> [B, H_kv, H / H_kv, D]),
    so the cache is read once per key/value head instead of repeated for every query head (transformers'
    SDPA repeats it whenever a mask is given, as a static cache always gives one; its own packing is eager
    only). Exact: every query row of a group sees the same keys under the same mask."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    groups = getattr(module, "num_key_value_groups", 1)
    mask_per_head = attention_mask is not None and attention_mask.dim() == 4 and attention_mask.shape[1] != 1
    if groups == 1 or query.shape[2] != 1 or mask_per_head or kwargs.get("position_bias") is not None:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs
        )
    B, H, _, D = query.shape
    out = torch.nn.functional.scaled_dot_product_attention(
        query.reshape(B, H // groups, groups, D), key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling
    )
    return out.reshape(B, H, 1, value.shape[-1]).transpose(1, 2).contiguous(), None


def _use_decode_attention(m) -> bool:
    """Switch an SDPA model to ``decode_attention`` (registered with transformers' attention and mask
    interfaces, the mask as SDPA's) for this call; False where the model does not use SDPA."""
    config = getattr(m, "config", None)
    if getattr(config, "_attn_implementation", None) != "sdpa":
        return False
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    except ImportError:  # older transformers: repeat the cache as before
        return False
    AttentionInterface.register(DECODE_ATTENTION, decode_attention)
    AttentionMaskInterface.register(DECODE_ATTENTION, sdpa_mask)
    config._attn_implementation = DECODE_ATTENTION
    return True


def _cache_keyword(m) -> str:
    """The forward's name for the cache: ``cache`` in newer transformers, ``past_key_values`` before."""
    return "cache" if "cache" in inspect.signature(type(m).forward).parameters else "past_key_values"


def _penalize(logits: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    """transformers' repetition penalty: seen tokens' logits divided (positive) or multiplied (negative)."""
    score = logits.gather(1, seen)
    score = torch.where(score < 0, score * penalty, score / penalty)
    return logits.scatter(1, seen, score)
