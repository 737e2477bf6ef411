"""Hugging Face Transformers integration (``pip install nitrobrew[hf]``).

- ``distill_loss(student, teacher, input_ids, ...)``: the loss of one batch, for plain loops.
- ``DistillationTrainer`` / ``DistillationArguments``: a transformers.Trainer that distills.
- ``on_policy_batch(student, prompt_ids, prompt_mask, ...)``: prompts completed by a model, as a
  batch whose labels count the generated tokens only (on-policy / sequence-level distillation).
- ``nitrobrew train config.yaml``: the trainer from a config file (``nitrobrew.hf.train_cli``).
- Helpers: ``final_hidden_states``, ``lm_head``, ``shift_labels``, ``count_targets``, ``check_head``.

The helpers and ``distill_loss`` do not import transformers; the trainer does (on first use).
"""

from .generation import Generator, Sampling, make_generator
from .loss import DIVERGENCES, LMDistillOutput, distill_loss
from .model import (
    IGNORE_INDEX,
    LMHead,
    check_head,
    count_targets,
    decoder,
    final_hidden_states,
    labels_from_inputs,
    lm_head,
    shift_labels,
    unwrap,
)
from .onpolicy import GeneratedBatch, on_policy_batch
from .packing import block_causal_mask, document_targets
from .schedules import scheduled


def __getattr__(name):
    if name in ("DistillationTrainer", "DistillationArguments"):
        from . import trainer

        return getattr(trainer, name)
    raise AttributeError(f"module 'nitrobrew.hf' has no attribute {name!r}")


__all__ = [
    "Generator",
    "Sampling",
    "make_generator",
    "distill_loss",
    "LMDistillOutput",
    "DIVERGENCES",
    "DistillationTrainer",
    "DistillationArguments",
    "final_hidden_states",
    "lm_head",
    "LMHead",
    "decoder",
    "unwrap",
    "shift_labels",
    "labels_from_inputs",
    "count_targets",
    "check_head",
    "IGNORE_INDEX",
    "on_policy_batch",
    "GeneratedBatch",
    "block_causal_mask",
    "document_targets",
    "scheduled",
]
