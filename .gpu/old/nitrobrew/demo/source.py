"""A synthetic language whose true next-token distribution is known exactly.

The source is a hidden Markov model: a sparse random walk over hidden "grammar states", each of
which emits a word from its own small, overlapping vocabulary. A word is ambiguous about the
state that produced it, so predicting the next word needs the whole prefix (the posterior over
states), which is what a language model has to learn. The forward algorithm gives the exact
``p(x_{t+1} | x_1..x_t)`` for any sequence, so a model's quality can be measured as its KL
divergence to the source, not only its perplexity on sampled text.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def _sparse_rows(n: int, m: int, k: int, concentration: float, gen: torch.Generator) -> torch.Tensor:
    """n probability rows over m outcomes, each with k nonzero Dirichlet(concentration) entries."""
    rows = torch.zeros(n, m, dtype=torch.float64)
    for i in range(n):
        support = torch.randperm(m, generator=gen)[:k]
        w = torch._standard_gamma(torch.full((k,), concentration, dtype=torch.float64), generator=gen)
        rows[i, support] = w / w.sum()
    return rows


def _draw(cdf: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """One index per row of the cumulative distributions `cdf` [n, m], by inverse CDF at `u` [n]."""
    return torch.searchsorted(cdf, (u * cdf[:, -1])[:, None]).squeeze(1).clamp_max(cdf.shape[1] - 1)


@dataclass
class HMMSource:
    """The language: initial state distribution, transitions [S, S] and emissions [S, V]."""

    initial: torch.Tensor
    transitions: torch.Tensor
    emissions: torch.Tensor

    @classmethod
    def make(
        cls, vocab: int = 64, states: int = 16, successors: int = 3, words_per_state: int = 6, seed: int = 0
    ) -> "HMMSource":
        gen = torch.Generator().manual_seed(seed)
        transitions = _sparse_rows(states, states, min(successors, states), 1.0, gen)
        emissions = _sparse_rows(states, vocab, min(words_per_state, vocab), 0.7, gen)
        unused = emissions.sum(0) == 0  # every word gets some state that can say it
        for word in unused.nonzero().flatten().tolist():
            s = int(torch.randint(states, (1,), generator=gen))
            emissions[s] = 0.9 * emissions[s]
            emissions[s, word] += 0.1
        initial = torch.full((states,), 1.0 / states, dtype=torch.float64)
        return cls(initial, transitions, emissions)

    @property
    def vocab(self) -> int:
        return self.emissions.shape[1]

    def sample(self, n: int, length: int, seed: int) -> torch.Tensor:
        """n sequences of `length` words, int64 [n, length]."""
        gen = torch.Generator().manual_seed(seed)
        u = torch.rand(2 * length + 1, n, dtype=torch.float64, generator=gen)
        emit, move = self.emissions.cumsum(-1), self.transitions.cumsum(-1)
        state = _draw(self.initial.cumsum(-1).repeat(n, 1), u[0])
        out = torch.empty(n, length, dtype=torch.long)
        for t in range(length):
            out[:, t] = _draw(emit[state], u[2 * t + 1])
            state = _draw(move[state], u[2 * t + 2])
        return out

    def next_token_probs(self, tokens: torch.Tensor) -> torch.Tensor:
        """Exact p(x_{t+1} | x_1..x_t) for t = 1..N-1, float64 [n, N-1, V] (forward algorithm)."""
        belief = self.initial.expand(tokens.shape[0], -1)
        out = []
        for t in range(tokens.shape[1] - 1):
            belief = belief * self.emissions[:, tokens[:, t]].T
            belief = belief / belief.sum(-1, keepdim=True)
            belief = belief @ self.transitions
            out.append(belief @ self.emissions)
        return torch.stack(out, 1)
