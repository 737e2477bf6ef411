"""``nitrobrew teacher-extract``: run a teacher once over a corpus (or rollouts) and store what it says.

``--kind hidden`` (default) stores the teacher's final hidden states and its head
(``hidden_store``: exact offline distillation with any divergence and temperature); ``--kind topk``
its top-k log-probs (``extract``, the path of ``nitrobrew topk-extract``, whose options it takes).
``--data`` may be a rollout dataset (``nitrobrew rollout``): its prompt positions are then neither
stored nor counted in a hidden store.
"""

from __future__ import annotations

import argparse

from . import extract, rollout


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.description = "run a teacher once over a corpus (or rollouts) and store its hidden states and head, or its top-k"
    extract.add_arguments(p, kinds=True)


def run(args: argparse.Namespace) -> int:
    return extract.run(args, prog="teacher-extract", open_data=_rollouts)


def _rollouts(spec: str):
    return rollout.rollout_corpus(spec) if rollout.is_rollouts(spec) else None
