"""Dataset, collator and loader over a hidden store, yielding batches ready for ``distill_loss``.

A batch (padded on the right to the longest sequence, L) holds:

- ``input_ids`` [B, L] and ``attention_mask`` [B, L] for the student's forward;
- ``labels`` [B, L], already shifted: ``labels[b, i] = input_ids[b, i + 1]`` at the stored positions
  (``max(P - 1, 0) <= i < n - 1``), ``ignore_index`` elsewhere (prompt, last position, padding);
- ``teacher_hidden`` [B, L, Dt] in the stored dtype (row i at position i, zeros where nothing is
  stored) and, for an fp8 store, ``teacher_hidden_scale`` [B, L] float32.

The student's loss, with the teacher's head loaded once on the device::

    head = dataset.load_head(device)
    out = distill_loss(student, None, batch["input_ids"], batch["attention_mask"], targets=batch["labels"],
                       teacher_hidden=batch["teacher_hidden"],
                       teacher_hidden_scale=batch.get("teacher_hidden_scale"), teacher_head=head,
                       divergence="reverse_kl", temperature=2.0)

``hidden_loader`` streams the memory-mapped shards through DataLoader workers, prefetches and pins
the batches, so that reading the store hides behind the training step.
"""

from __future__ import annotations

from typing import Dict, List, Optional

import torch

from .data import PaddingCollator
from .hidden_store import HiddenStore, row_start


class HiddenDataset(torch.utils.data.Dataset):
    """Sequence i of a hidden store (see ``HiddenStore``); ``load_head`` gives the teacher's head.

    Shards are memory-mapped; each is checked (size, sha256) once per process (each DataLoader worker
    checks the shards it opens), and the ``max_open_shards`` most recently used stay open."""

    def __init__(self, path: str, verify: bool = True, allow_incomplete: bool = False, max_open_shards: int = 8):
        self.store = HiddenStore(
            path, verify=verify, allow_incomplete=allow_incomplete, max_open_shards=max_open_shards
        )

    def __len__(self) -> int:
        return len(self.store)

    def __getitem__(self, i: int) -> Dict:
        return self.store[i]

    @property
    def vocab_size(self) -> int:
        return self.store.vocab_size

    @property
    def hidden_dtype(self) -> str:
        return self.store.hidden_dtype

    @property
    def manifest(self) -> Dict:
        return self.store.manifest

    def load_head(self, device="cpu", dtype: Optional[torch.dtype] = None):
        """The teacher's head (``nitrobrew.hf.model.LMHead``) on `device`, its checksum checked."""
        return self.store.head(device, dtype)


class HiddenCollator(PaddingCollator):
    """Pads dataset items into one batch (see the module docstring for the layout)."""

    def _check(self, items: List[Dict]) -> None:
        D, dtype = items[0]["hidden"].shape[-1], items[0]["hidden"].dtype
        fp8 = "hidden_scale" in items[0]
        for it in items:
            n, start = it["input_ids"].numel(), row_start(it.get("prompt_length", 0))
            rows = max(n - 1 - start, 0)
            if tuple(it["hidden"].shape) != (rows, D) or it["hidden"].dtype != dtype or ("hidden_scale" in it) != fp8:
                raise ValueError(
                    f"item with {n} tokens and prompt {it.get('prompt_length', 0)} must carry ({rows}, {D}) "
                    f"{dtype} rows, got {tuple(it['hidden'].shape)} {it['hidden'].dtype}"
                )

    def _rows(self, items: List[Dict], L: int) -> Dict[str, torch.Tensor]:
        B, D, dtype = len(items), items[0]["hidden"].shape[-1], items[0]["hidden"].dtype
        fp8 = "hidden_scale" in items[0]
        hidden = torch.zeros(B, L, D, dtype=dtype)
        scale = torch.ones(B, L, dtype=torch.float32) if fp8 else None
        for b, it in enumerate(items):
            n, start = it["input_ids"].numel(), row_start(it.get("prompt_length", 0))
            if n - 1 > start:
                hidden[b, start : n - 1] = it["hidden"]
                if scale is not None:
                    scale[b, start : n - 1] = it["hidden_scale"]
        return (
            {"teacher_hidden": hidden} if scale is None else {"teacher_hidden": hidden, "teacher_hidden_scale": scale}
        )


def hidden_loader(
    dataset: HiddenDataset,
    batch_size: int,
    *,
    shuffle: bool = True,
    num_workers: int = 2,
    prefetch_factor: int = 4,
    pin_memory: Optional[bool] = None,
    seed: int = 0,
    drop_last: bool = False,
    collator: Optional[HiddenCollator] = None,
) -> torch.utils.data.DataLoader:
    """A DataLoader over a hidden store: `num_workers` processes read the memory-mapped shards and
    collate, `prefetch_factor` batches each ahead of the step, pinned (default: when CUDA is there)
    so that ``.to(device, non_blocking=True)`` overlaps the copy with compute."""
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size <= 0:
        raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
    if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 0:
        raise ValueError(f"num_workers must be an int >= 0, got {num_workers!r}")
    pin = torch.cuda.is_available() if pin_memory is None else bool(pin_memory)
    extra = dict(prefetch_factor=prefetch_factor, persistent_workers=True) if num_workers > 0 else {}
    return torch.utils.data.DataLoader(
        dataset,
        batch_size=batch_size,
        shuffle=shuffle,
        num_workers=num_workers,
        pin_memory=pin,
        drop_last=drop_last,
        collate_fn=collator or HiddenCollator(),
        generator=torch.Generator().manual_seed(seed) if shuffle else None,
        **extra,
    )
