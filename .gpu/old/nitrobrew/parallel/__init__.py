"""Collectives and rank checks the vocab-parallel losses share, and data-parallel normalization.

This package sits below the loss families and imports none of them. The vocab-parallel forms live in
their families: ``nitrobrew.hidden.vocab_parallel`` (``process_group=`` on every hidden-state loss, or a
DTensor head sharded Shard(0) on the vocabulary) and ``nitrobrew.topk.vocab_parallel``
(``topk_kl(normalize="full", process_group=...)``).

- ``global_token_count`` / ``data_parallel_loss`` / ``global_mean``: DDP and FSDP normalization.
- ``count_comm()`` counts the bytes the collectives send (``hidden.vocab_parallel.comm_bytes`` /
  ``topk.vocab_parallel.topk_comm_bytes`` predict them; the old names here are deprecated re-exports);
  ``time_phases()`` times the phases of a call on this rank (local statistics, exchange, gradient pass,
  dX all-reduce).

docs/parallel.md is the user guide.
"""

from __future__ import annotations

import warnings

from .comm import CommStats, PhaseTimes, count_comm, time_phases
from .data import data_parallel_loss, global_mean, global_token_count

# Names that moved into the families; kept importable from here for one release.
_MOVED = {
    "parallel_hidden_loss": "nitrobrew.hidden.vocab_parallel",
    "VocabParallelDistill": "nitrobrew.hidden.vocab_parallel",
    "comm_bytes": "nitrobrew.hidden.vocab_parallel",
    "parallel_topk_kl": "nitrobrew.topk.vocab_parallel",
    "VocabParallelTopK": "nitrobrew.topk.vocab_parallel",
    "topk_comm_bytes": "nitrobrew.topk.vocab_parallel",
}


def __getattr__(name):
    if name in _MOVED:
        import importlib

        warnings.warn(
            f"nitrobrew.parallel.{name} moved to {_MOVED[name]}; the old path goes in the next release",
            DeprecationWarning,
            stacklevel=2,
        )
        return getattr(importlib.import_module(_MOVED[name]), name)
    raise AttributeError(f"module 'nitrobrew.parallel' has no attribute {name!r}")


__all__ = [
    "count_comm",
    "CommStats",
    "time_phases",
    "PhaseTimes",
    "global_token_count",
    "data_parallel_loss",
    "global_mean",
]
