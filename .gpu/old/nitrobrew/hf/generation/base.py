"""The generation seam: what the trainer asks of any engine that completes prompts.

A backend implements ``Generator``: ``generate`` completes a batch of left-padded prompts under
``Sampling`` and returns ``Completions``; ``sync_weights(model)`` loads the student's current weights
into the engine (after optimizer steps); ``sleep()`` / ``wake()`` free and restore the engine's memory
(KV cache, and weights where the engine can) between generations. Engines without a memory of their
own (the in-process ones, which generate with the training model itself) make those no-ops.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, List, NamedTuple, Optional, Protocol, Sequence, Union, runtime_checkable

import torch

Tensor = torch.Tensor
EosIds = Union[None, int, Sequence[int]]


@dataclass(frozen=True)
class Sampling:
    """Sampling settings of one generation call (temperature 0: greedy; top_k 0, top_p 1, min_p 0: off)."""

    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    eos_token_id: EosIds = None
    pad_token_id: int = 0
    seed: Optional[int] = None

    def __post_init__(self):
        if isinstance(self.max_new_tokens, bool) or not isinstance(self.max_new_tokens, int):
            raise TypeError(f"max_new_tokens must be an int, got {self.max_new_tokens!r}")
        if self.max_new_tokens <= 0:
            raise ValueError(f"max_new_tokens must be positive, got {self.max_new_tokens}")
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature!r}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an int >= 0, got {self.top_k!r}")
        if not 0 <= self.min_p < 1:
            raise ValueError(f"min_p must be in [0, 1), got {self.min_p!r}")
        if not self.repetition_penalty > 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def eos_list(self) -> List[int]:
        e = self.eos_token_id
        return [] if e is None else [int(x) for x in e] if isinstance(e, (list, tuple)) else [int(e)]


class Completions(NamedTuple):
    """ids [B, G] (G <= max_new_tokens; padded with the pad id after a row ends), mask [B, G] (1 on the
    generated tokens up to and including the first EOS), logprobs [B, G] float32 of the sampled tokens
    under the engine's sampling distribution where the engine gives them (else None), the weight version
    the engine generated with, the wall seconds, the number of decode steps run, the graphs the engine
    compiled during the call, and of those the ones for shapes it had already compiled (recompilations:
    none expected once a compiling engine's shape buckets are warm)."""

    ids: Tensor
    mask: Tensor
    logprobs: Optional[Tensor]
    weight_version: int
    seconds: float
    decode_steps: int
    compiles: int = 0
    recompiles: int = 0


@runtime_checkable
class Generator(Protocol):
    """An engine that completes prompts (see the module docstring)."""

    name: str
    weight_version: int

    def generate(self, prompt_ids: Tensor, prompt_mask: Tensor, sampling: Sampling) -> Completions: ...

    def sync_weights(self, model: torch.nn.Module) -> None: ...

    def sleep(self) -> None: ...

    def wake(self) -> None: ...


@dataclass
class GenerationStats:
    """Running totals a trainer logs per step."""

    calls: int = 0
    tokens: int = 0
    seconds: float = 0.0
    decode_steps: int = 0
    compiles: int = 0
    recompiles: int = 0
    history: List[float] = field(default_factory=list)

    def add(self, c: Completions) -> None:
        self.calls += 1
        self.recompiles += getattr(c, "recompiles", 0)
        self.tokens += int(c.mask.sum())
        self.seconds += c.seconds
        self.decode_steps += c.decode_steps
        self.compiles += c.compiles
        self.history.append(c.seconds)

    def decode_ms(self) -> float:
        return 1e3 * self.seconds / max(self.decode_steps, 1)

    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


def completion_mask(completion: Tensor, eos_ids: Sequence[int]) -> Tensor:
    """1 up to and including the first EOS of each row, 0 after it (all 1 without an EOS id)."""
    if not eos_ids:
        return torch.ones_like(completion)
    eos = torch.as_tensor(list(eos_ids), device=completion.device)
    is_eos = torch.isin(completion, eos).long()
    after = (is_eos.cumsum(1) - is_eos) > 0
    return (~after).long()


def check_completion_ids(ids, batch: int, max_new_tokens: int, vocab: Optional[int], who: str) -> Tensor:
    """A generator's output as int64 [B, <= max_new_tokens] in [0, vocab): one clear error at the call."""
    t = torch.as_tensor(ids)
    if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
        raise TypeError(f"{who} returned {t.dtype} completions; token ids must be integers")
    if t.dim() != 2 or t.shape[0] != batch or t.shape[1] > max_new_tokens:
        raise ValueError(
            f"{who} returned completions of shape {tuple(t.shape)}; expected [{batch}, <= {max_new_tokens}]"
        )
    t = t.long()
    if t.numel() and (int(t.min()) < 0 or (vocab is not None and int(t.max()) >= vocab)):
        raise ValueError(
            f"{who} returned token ids in [{int(t.min())}, {int(t.max())}], outside the vocabulary [0, {vocab})"
        )
    return t


GenerateFn = Callable[..., Tensor]
