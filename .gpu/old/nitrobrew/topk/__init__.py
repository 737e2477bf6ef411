"""Offline (stored top-k) distillation: the loss, the teacher's top-k extraction and storage.

- ``topk_kl``: the loss from the student's hidden states against stored top-k log-probs.
- ``nitrobrew.teacher.extract``: the ``nitrobrew topk-extract`` command and ``extract_topk`` API.
- ``nitrobrew.teacher.store``: sharded safetensors store with a JSON manifest.
- ``nitrobrew.teacher.data``: dataset and collator producing batches ready for ``topk_kl``.
"""

from .api import topk_kl
from .reference import reference_topk_loss

__all__ = ["topk_kl", "reference_topk_loss"]
