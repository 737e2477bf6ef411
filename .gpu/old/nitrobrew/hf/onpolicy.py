"""On-policy and sequence-level distillation: train on completions a model generates itself.

``on_policy_batch(student, prompt_ids, prompt_mask, ...)`` completes the prompts with the
student (eval mode, no grad, KV cache) or any other generator, and returns a batch ready for
``distill_loss``: the prompt and the completion, an attention mask, and per-token labels in
which only generated tokens count (up to and including the first EOS; the prompt and the
padding after EOS never do). Distilling on it with ``reverse_kl`` is "on-policy distillation";
GKD (TRL's GKDTrainer) mixes such batches with the dataset's with probability ``lmbda`` and
defaults to ``jsd``; ``seq_kd`` trains on the teacher's completions instead.
"""

from __future__ import annotations

import contextlib
from typing import NamedTuple, Optional, Sequence, Union

import torch
from torch import nn

from .generation.base import GenerateFn, Generator, Sampling
from .model import IGNORE_INDEX, unwrap


# generate_fn(prompt_ids, prompt_mask, **options) -> completion ids [B, G] (G <= max_new_tokens); options:
# model (the one asked to generate: the student, or the teacher for seq_kd), max_new_tokens, temperature,
# top_p, top_k, eos_token_id, pad_token_id, seed. Prompts come left-padded. Engines: nitrobrew.hf.generation.
class GeneratedBatch(NamedTuple):
    """input_ids, attention_mask, labels [B, <= P + G], right-padded; n_generated [B]: counted completion tokens
    per row (EOS included); seconds: the generation's wall time."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    labels: torch.Tensor
    n_generated: torch.Tensor
    seconds: float
    logprobs: Optional[torch.Tensor] = None
    weight_version: int = 0
    decode_steps: int = 0
    compiles: int = 0
    recompiles: int = 0


def left_pad(ids: torch.Tensor, mask: Optional[torch.Tensor], pad: int):
    """Move each row's tokens (mask != 0) to the right end: decoder-only generation continues
    from the last column."""
    if mask is None:
        return ids, torch.ones_like(ids)
    keep = mask != 0
    # A stable sort on "is a token" puts the padding first and keeps the tokens in order.
    order = torch.sort(keep.long(), dim=1, stable=True).indices
    keep = keep.gather(1, order)
    ids = ids.gather(1, order).masked_fill(~keep, pad)
    first = int(keep.any(0).long().argmax()) if bool(keep.any()) else 0  # drop all-padding columns
    return ids[:, first:], keep[:, first:].long()


def _rng(seed: Optional[int], device: torch.device):
    if seed is None:
        return contextlib.nullcontext()
    devices = [device] if device.type == "cuda" else []
    return torch.random.fork_rng(devices=devices)


def generation_request(
    model: nn.Module,
    prompt_ids: torch.Tensor,
    prompt_mask: Optional[torch.Tensor],
    *,
    eos_token_id=None,
    pad_token_id: Optional[int] = None,
    **sampling,
):
    """(left-padded prompt ids, their mask, ``Sampling``) on ``model``'s device; EOS and pad ids default to the
    model's generation config (the pad id to the EOS id, then 0)."""
    m = unwrap(model)
    gen_config = getattr(m, "generation_config", None)
    if eos_token_id is None:
        eos_token_id = getattr(gen_config, "eos_token_id", None)
    if pad_token_id is None:
        pad_token_id = getattr(gen_config, "pad_token_id", None)
    if pad_token_id is None:
        pad_token_id = eos_token_id[0] if isinstance(eos_token_id, (list, tuple)) else eos_token_id
    pad = 0 if pad_token_id is None else int(pad_token_id)
    s = Sampling(eos_token_id=eos_token_id, pad_token_id=pad, **sampling)  # checked before any work
    device = next(m.parameters()).device
    ids, mask = left_pad(prompt_ids.to(device), None if prompt_mask is None else prompt_mask.to(device), pad)
    return ids, mask, s


@torch.no_grad()
def on_policy_batch(
    model: nn.Module,
    prompt_ids: torch.Tensor,
    prompt_mask: Optional[torch.Tensor] = None,
    *,
    max_new_tokens: int = 128,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = 0,
    eos_token_id: Union[None, int, Sequence[int]] = None,
    pad_token_id: Optional[int] = None,
    seed: Optional[int] = None,
    generate_fn: Optional[GenerateFn] = None,
    generator: Optional[Generator] = None,
    min_p: float = 0.0,
    repetition_penalty: float = 1.0,
) -> GeneratedBatch:
    """Complete ``prompt_ids`` with ``model`` (the student, or the teacher for sequence-level KD).

    Args:
        model: a transformers causal LM (wrappers and PEFT are looked through); generation runs
            in eval mode under no_grad with the KV cache, and the mode is restored afterwards.
        prompt_ids, prompt_mask: [B, P]; left or right padded (re-padded on the left here).
        max_new_tokens, temperature, top_p, top_k: sampling (temperature 0: greedy; top_k 0 and
            top_p 1: off, as in TRL's GKD).
        eos_token_id, pad_token_id: default to the model's generation config; without an EOS id
            every row generates max_new_tokens tokens.
        seed: sample under this seed (the global RNG is left as it was); None: the global RNG.
        generate_fn: an external generator instead of ``model.generate`` (see ``GenerateFn``).
        generator: an engine of ``nitrobrew.hf.generation`` (vLLM, the fast in-process engine, ...);
            default: ``generate_fn`` if given, else ``model.generate`` with the dynamic cache.
        min_p, repetition_penalty: further sampling settings (0 and 1: off).

    Returns:
        ``GeneratedBatch``; pass its ``input_ids, attention_mask, labels`` to ``distill_loss``.
    """
    if prompt_ids.dim() != 2:
        raise ValueError(f"prompt_ids must be [batch, length], got shape {tuple(prompt_ids.shape)}")
    m = unwrap(model)
    from .fsdp import head_is_sharded_apart

    in_process = generator is None or (
        generator.name in ("hf", "static") and unwrap(getattr(generator, "model", None)) is m
    )
    if generate_fn is None and in_process and head_is_sharded_apart(m):
        raise ValueError(
            "generation with an FSDP2 head sharded apart from the decoder would gather it through the "
            "root's forward, breaking the vocab-parallel layout: pass generate_fn (an external "
            "generator), or shard the decoder and the head in one unit"
        )
    ids, mask, sampling = generation_request(
        m,
        prompt_ids,
        prompt_mask,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        min_p=min_p,
        repetition_penalty=repetition_penalty,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
        seed=seed,
    )
    device, pad = ids.device, sampling.pad_token_id
    if generator is None:
        from .generation import CallableGenerator, DynamicCacheGenerator

        generator = CallableGenerator(generate_fn, model) if generate_fn is not None else DynamicCacheGenerator(model)
    if getattr(generator, "seeds_itself", False):
        gen = generator.generate(ids, mask, sampling)
    else:
        with _rng(seed, device):
            if seed is not None:
                torch.manual_seed(seed)
            gen = generator.generate(ids, mask, sampling)
    return assemble(ids, mask, gen, pad)


def assemble(ids: torch.Tensor, mask: torch.Tensor, gen, pad: int) -> GeneratedBatch:
    """The training batch of left-padded prompts ``ids`` / ``mask`` and an engine's ``Completions``."""
    device = ids.device
    completion = gen.ids.to(device)
    cmask = gen.mask.to(device).long()
    labels = torch.cat([torch.full_like(ids, IGNORE_INDEX), completion.masked_fill(cmask == 0, IGNORE_INDEX)], 1)
    # Right-aligned again: every row starts at column 0, so the training forward numbers the
    # positions as generation did (from the prompt's first token) without position_ids.
    keep = torch.cat([mask, cmask], 1) != 0
    order = torch.sort((~keep).long(), dim=1, stable=True).indices
    keep = keep.gather(1, order)
    width = int(keep.sum(1).max())
    out_ids = torch.cat([ids, completion], 1).gather(1, order).masked_fill(~keep, pad)[:, :width]
    labels = labels.gather(1, order).masked_fill(~keep, IGNORE_INDEX)[:, :width]
    logprobs = None
    if gen.logprobs is not None:
        logprobs = torch.cat([torch.zeros_like(ids, dtype=torch.float32), gen.logprobs.to(device).float()], 1)
        logprobs = logprobs.gather(1, order).masked_fill(~keep, 0.0)[:, :width]
    return GeneratedBatch(
        out_ids,
        keep[:, :width].long(),
        labels,
        cmask.sum(1),
        gen.seconds,
        logprobs=logprobs,
        weight_version=gen.weight_version,
        decode_steps=gen.decode_steps,
        compiles=getattr(gen, "compiles", 0),
        recompiles=getattr(gen, "recompiles", 0),
    )


def prompts_of(batch: dict, pad: int = 0):
    """(prompt_ids, prompt_mask) of a training batch: its ``prompts`` / ``prompt_attention_mask``
    (TRL's names), else each row's tokens before its first counted label (labels -100 on the prompt)."""
    if batch.get("prompts") is not None:
        return batch["prompts"], batch.get("prompt_attention_mask")
    ids, labels, mask = batch["input_ids"], batch.get("labels"), batch.get("attention_mask")
    if labels is None:
        raise ValueError(
            "on-policy / seq_kd batches need prompts: a 'prompts' column (and "
            "'prompt_attention_mask'), or labels that are -100 on each row's prompt"
        )
    counted = labels != IGNORE_INDEX
    if mask is not None:
        counted &= mask != 0
    # The prompt: every position before the first counted label (all of a row without one).
    n = ids.shape[1]
    first = torch.where(counted.any(1), counted.float().argmax(1), torch.full_like(counted[:, 0], n, dtype=torch.long))
    before = torch.arange(n, device=ids.device)[None] < first[:, None]
    pmask = before if mask is None else before & (mask != 0)
    if not bool(pmask.any(1).all()):
        raise ValueError(
            "a row of the batch has no prompt (its first token already counts): mark the prompt "
            "with labels -100, or pass a 'prompts' column"
        )
    return ids.masked_fill(~pmask, pad), pmask.long()
