"""Token sampling from one decode step's logits, in float32, without sorting the vocabulary where avoidable.

At a 152k vocabulary a full sort per step costs more than the step's matrix products at small batches, so:
- temperature only (the usual on-policy setting): the exponential race, argmax(p / E) with E ~ Exp(1), an
  exact draw from p with one pass and no cumulative sum;
- top_k: ``torch.topk`` (a partial selection), then the draw among the k;
- top_p: the nucleus is searched within the top ``NUCLEUS_CANDIDATES`` tokens (a partial selection, then a
  sort of those few); only the rows whose candidates do not hold ``top_p`` of the mass (flat rows) are sorted
  in full (exact in every case: the fallback is taken, not assumed away);
- min_p: a threshold relative to the row's maximum, one pass.
"""

from __future__ import annotations

import math
from typing import Optional, Tuple

import torch

from .base import Sampling

NUCLEUS_CANDIDATES = 1024


def _nucleus_keep(sorted_logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep-mask over descending-sorted logits: the smallest prefix whose probability reaches top_p
    (the first token always kept)."""
    probs = torch.softmax(sorted_logits, -1)
    before = probs.cumsum(-1) - probs  # mass of the more probable tokens
    return before < top_p


def processed_logits(logits: torch.Tensor, s: Sampling) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """(logits, candidate ids): float32 logits / T with the filtered tokens at -inf, over the whole vocabulary
    (candidate ids None) or over a candidate set [B, C] (their vocabulary ids)."""
    x = logits.float()
    x = x.div_(s.temperature) if x is not logits else x / s.temperature  # in place on the float copy
    V = x.shape[-1]
    cand = None
    if s.top_k and s.top_k < V:
        x, cand = torch.topk(x, s.top_k, dim=-1)  # sorted, descending
    if s.top_p < 1.0:
        if cand is None:
            C = min(V, NUCLEUS_CANDIDATES)
            top, top_ids = torch.topk(x, C, dim=-1)
            lse = torch.logsumexp(x, -1, keepdim=True)
            # Does the candidate set hold top_p of the mass? (one sync; the rows where it does not are sorted)
            covered = torch.logsumexp(top, -1) - lse[:, 0] >= math.log(s.top_p)
            keep = _nucleus_keep_full(top, lse, s.top_p)
            if bool(covered.all()):
                x, cand = top.masked_fill(~keep, float("-inf")), top_ids
            else:
                out = torch.full_like(x, float("-inf"))
                out.scatter_(-1, top_ids, top.masked_fill(~(keep & covered[:, None]), float("-inf")))
                rows = (~covered).nonzero()[:, 0]
                srt, order = torch.sort(x[rows], dim=-1, descending=True)
                flat = srt.masked_fill(~_nucleus_keep(srt, s.top_p), float("-inf"))
                out[rows] = torch.full_like(srt, float("-inf")).scatter(-1, order, flat)
                x = out
        else:
            x = x.masked_fill(~_nucleus_keep(x, s.top_p), float("-inf"))
    if s.min_p > 0:
        m = x.max(-1, keepdim=True).values
        x = x.masked_fill(x < m + math.log(s.min_p), float("-inf"))
    return x, cand


def _nucleus_keep_full(top: torch.Tensor, lse: torch.Tensor, top_p: float) -> torch.Tensor:
    probs = torch.exp(top - lse)  # probabilities under the whole row
    before = probs.cumsum(-1) - probs
    return before < top_p


def sample(
    logits: torch.Tensor, s: Sampling, generator: Optional[torch.Generator] = None
) -> Tuple[torch.Tensor, torch.Tensor]:
    """(token ids [B], their log-probabilities [B] float32 under the sampling distribution) from logits [B, V];
    the draws come from ``generator`` (default: the global RNG)."""
    if s.greedy:
        x = logits.float()
        tok = x.argmax(-1)
        lp = x.gather(-1, tok[:, None])[:, 0] - torch.logsumexp(x, -1)
        return tok, lp
    x, cand = processed_logits(logits, s)
    lse = torch.logsumexp(x, -1, keepdim=True)
    # Exponential race: argmax(log p - log E) is a draw from p (the Gumbel-max trick, one pass).
    # argmax(x - log E) (the row's normalizer does not move the argmax), in place: passes over [B, V] are the cost.
    race = torch.empty_like(x).exponential_(generator=generator).log_().neg_().add_(x)
    pick = race.argmax(-1)
    lp = (x.gather(-1, pick[:, None]) - lse)[:, 0]
    tok = pick if cand is None else cand.gather(-1, pick[:, None])[:, 0]
    return tok, lp
