"""Dataset and collator over a top-k store, yielding batches ready for ``topk_kl``.

A batch (padded on the right to the longest sequence, L) holds:

- ``input_ids`` [B, L] and ``attention_mask`` [B, L] for the student's forward;
- ``labels`` [B, L], already shifted: ``labels[b, i] = input_ids[b, i + 1]`` (the token that
  position i predicts), ``ignore_index`` at each sequence's last position and at padding (and, in a
  store extracted over rollouts, at the prompt's positions: ``i < prompt_length - 1``);
- ``topk_ids`` [B, L, K] and ``topk_logprobs`` [B, L, K]: the stored rows, row i at position i
  (the teacher's distribution over token i + 1), padded with id 0 and log-prob -inf.

So the student's final hidden states ``h`` [B, L, D] go in as they are::

    loss = topk_kl(h, lm_head.weight, batch["topk_ids"], batch["topk_logprobs"],
                   labels=batch["labels"], temperature=store.temperature)

(these labels are shifted; do not pass them to a Hugging Face model's own ``labels=``, which
shifts again.)
"""

from __future__ import annotations

from typing import Dict, List, Optional

import torch

from ..core.reduction import IGNORE_INDEX
from .store import TopKStore, row_start


class TopKDataset(torch.utils.data.Dataset):
    """Sequence i of a store: dict of input_ids [L], topk_ids [L - 1, K], topk_logprobs [L - 1, K].

    Shuffling is cheap: each shard's sha256 is checked once per process (each DataLoader worker
    checks the shards it opens), and the ``max_open_shards`` most recently used shards stay open,
    memory-mapped."""

    def __init__(self, path: str, verify: bool = True, allow_incomplete: bool = False, max_open_shards: int = 8):
        self.store = TopKStore(path, verify=verify, allow_incomplete=allow_incomplete, max_open_shards=max_open_shards)
        self.prompt_lengths = _rollout_prompts(self.store.manifest.get("source", {}), len(self.store))

    def __len__(self) -> int:
        return len(self.store)

    def __getitem__(self, i: int) -> Dict[str, torch.Tensor]:
        item = self.store[i]
        if self.prompt_lengths is not None:  # a store over rollouts: the prompt's positions do not count
            item["prompt_length"] = self.prompt_lengths[i if i >= 0 else i + len(self.store)]
        return item

    @property
    def k(self) -> int:
        return self.store.k

    @property
    def temperature(self) -> float:
        """The temperature the stored log-probs were taken at (pass it to topk_kl)."""
        return self.store.temperature

    @property
    def vocab_size(self) -> int:
        return self.store.vocab_size


def _rollout_prompts(source: Dict, n: int) -> Optional[List[int]]:
    """The prompt lengths of a store extracted over a rollout set (``nitrobrew rollout``), read from the
    rollouts its manifest names (checked against the manifest hash recorded at extraction); None for a
    plain corpus. A top-k store keeps a row per position; only the completion's rows count."""
    path = source.get("rollouts") if isinstance(source, dict) else None
    if not path:
        return None
    import os
    import warnings

    from .rollout import read_rollouts
    from .store import MANIFEST, StoreError, sha256_file

    want = source.get("manifest_sha256")
    if not os.path.isfile(os.path.join(path, MANIFEST)) or (want and sha256_file(os.path.join(path, MANIFEST)) != want):
        warnings.warn(
            f"the store was extracted over the rollouts {path!r}, which are gone or changed: their prompt "
            "positions cannot be told apart and count in the loss",
            RuntimeWarning,
            stacklevel=3,
        )
        return None
    _, lengths, _ = read_rollouts(path)
    if len(lengths) != n:
        raise StoreError(f"the rollouts {path!r} hold {len(lengths)} sequences, the store {n}")
    return lengths


class PaddingCollator:
    """What the stores' collators share: items padded on the right to the longest (or to a multiple
    of ``pad_to_multiple_of``) into ``input_ids``, ``attention_mask`` and the shifted ``labels``
    (``ignore_index`` at a rollout's prompt, at each sequence's last position and at padding). A
    store's collator adds its checks (``_check``) and its rows (``_rows``)."""

    def __init__(
        self, pad_token_id: int = 0, ignore_index: int = IGNORE_INDEX, pad_to_multiple_of: Optional[int] = None
    ):
        self.pad_token_id = pad_token_id
        self.ignore_index = ignore_index
        self.pad_to_multiple_of = pad_to_multiple_of

    def __call__(self, items: List[Dict]) -> Dict[str, torch.Tensor]:
        if not items:
            raise ValueError("cannot collate an empty batch")
        self._check(items)
        L = max(it["input_ids"].numel() for it in items)
        if self.pad_to_multiple_of:
            m = self.pad_to_multiple_of
            L = (L + m - 1) // m * m
        B = len(items)
        input_ids = torch.full((B, L), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros(B, L, dtype=torch.long)
        labels = torch.full((B, L), self.ignore_index, dtype=torch.long)
        for b, it in enumerate(items):
            ids = it["input_ids"].long()
            n, start = ids.numel(), row_start(it.get("prompt_length", 0))
            input_ids[b, :n] = ids
            attention_mask[b, :n] = 1
            if n - 1 > start:
                labels[b, start : n - 1] = ids[start + 1 :]
        return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels, **self._rows(items, L)}

    def _check(self, items: List[Dict]) -> None:
        """ValueError naming an item whose rows do not fit its tokens."""

    def _rows(self, items: List[Dict], L: int) -> Dict[str, torch.Tensor]:
        """The store's rows of the batch, [B, L, ...]."""
        return {}


class TopKCollator(PaddingCollator):
    """Pads a list of dataset items into one batch (see the module docstring for the layout)."""

    def _check(self, items: List[Dict]) -> None:
        K = items[0]["topk_ids"].shape[-1]
        for it in items:
            n = it["input_ids"].numel()
            if tuple(it["topk_ids"].shape) != (max(n - 1, 0), K) or it["topk_logprobs"].shape != it["topk_ids"].shape:
                raise ValueError(
                    f"item with {n} tokens must carry ({max(n - 1, 0)}, {K}) top-k rows, got "
                    f"{tuple(it['topk_ids'].shape)} / {tuple(it['topk_logprobs'].shape)}"
                )

    def _rows(self, items: List[Dict], L: int) -> Dict[str, torch.Tensor]:
        B, K = len(items), items[0]["topk_ids"].shape[-1]
        topk_ids = torch.zeros(B, L, K, dtype=torch.long)
        topk_lp = torch.full((B, L, K), float("-inf"), dtype=torch.float32)
        for b, it in enumerate(items):
            n = it["input_ids"].numel()
            if n > 1:  # every position's row is stored, a rollout's prompt too (its labels do not count)
                topk_ids[b, : n - 1] = it["topk_ids"]
                topk_lp[b, : n - 1] = it["topk_logprobs"].float()
        return {"topk_ids": topk_ids, "topk_logprobs": topk_lp}
