"""Atomic, checksummed safetensors checkpoints of a model, its optimizer and a JSON record.

A checkpoint is one file: written to a temporary name in the same directory, flushed to disk,
then renamed over the old one with ``os.replace`` (atomic on POSIX and Windows), so an
interrupted run always finds either the previous checkpoint or the new one, never half a file.
Its metadata carries a sha256 over the record and every tensor (name, dtype, shape, bytes): a
flipped byte is refused on load (``CheckpointError`` naming the file) instead of resuming with
different numbers.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any, Dict, Optional, Tuple

import torch
from safetensors import safe_open
from safetensors.torch import save

from ..core.atomic_io import atomic_write_bytes


class CheckpointError(ValueError):
    """A checkpoint that cannot be read as written (corrupted, truncated, not a checkpoint)."""


def _digest(meta_json: str, tensors: Dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256(meta_json.encode())
    for name in sorted(tensors):
        t = tensors[name].detach().contiguous().cpu()
        h.update(f"\0{name}\0{t.dtype}\0{tuple(t.shape)}\0".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def save_checkpoint(
    path: str, model: torch.nn.Module, optimizer: Optional[torch.optim.Optimizer], record: Dict[str, Any]
) -> None:
    """Model weights, optimizer state and `record` (JSON-serializable) in one safetensors file."""
    tensors = {f"model.{k}": v.detach().contiguous() for k, v in model.state_dict().items()}
    meta: Dict[str, Any] = {"record": record}
    if optimizer is not None:
        state = optimizer.state_dict()
        meta["param_groups"] = state["param_groups"]
        scalars = {}
        for idx, entries in state["state"].items():
            for key, value in entries.items():
                if isinstance(value, torch.Tensor):
                    tensors[f"optim.{idx}.{key}"] = value.detach().contiguous()
                else:
                    scalars[f"{idx}.{key}"] = value
        meta["optim_scalars"] = scalars
    # Tied weights share storage; safetensors wants distinct tensors.
    seen = {}
    for k, v in list(tensors.items()):
        ptr = (v.data_ptr(), v.shape, v.stride())
        if ptr in seen:
            tensors[k] = v.clone()
        seen[ptr] = k
    meta_json = json.dumps(meta)
    atomic_write_bytes(path, save(tensors, metadata={"nitrobrew": meta_json, "sha256": _digest(meta_json, tensors)}))


def _read(path: str, with_tensors: bool) -> Tuple[Dict[str, Any], Dict[str, torch.Tensor]]:
    try:
        with safe_open(path, framework="pt", device="cpu") as f:
            header = f.metadata() or {}
            meta_json = header["nitrobrew"]
            tensors = {k: f.get_tensor(k) for k in f.keys()} if with_tensors else {}
        meta = json.loads(meta_json)
    except FileNotFoundError:
        raise
    except Exception as err:  # safetensors' own errors do not name the file
        raise CheckpointError(
            f"checkpoint {path} is corrupted or not a nitrobrew checkpoint ({type(err).__name__}: {err})"
        ) from None
    want = header.get("sha256")
    if with_tensors and want is not None and _digest(meta_json, tensors) != want:
        raise CheckpointError(f"checkpoint {path} is corrupted: its sha256 does not match its contents")
    return meta, tensors


def load_checkpoint(
    path: str, model: torch.nn.Module, optimizer: Optional[torch.optim.Optimizer] = None, device: str = "cpu"
) -> Dict[str, Any]:
    """Restore model (and optimizer) from `path`; returns the record. The checksum is checked
    before anything is restored (checkpoints written before it existed load unchecked)."""
    meta, tensors = _read(path, with_tensors=True)
    tensors = {k: v.to(device) for k, v in tensors.items()}
    model.load_state_dict({k[len("model.") :]: v for k, v in tensors.items() if k.startswith("model.")})
    if optimizer is not None:
        state: Dict[int, Dict[str, Any]] = {}
        for k, v in tensors.items():
            if k.startswith("optim."):
                idx, key = _split(k[len("optim.") :])
                state.setdefault(idx, {})[key] = v
        for k, v in meta.get("optim_scalars", {}).items():
            idx, key = _split(k)
            state.setdefault(idx, {})[key] = v
        optimizer.load_state_dict({"state": state, "param_groups": meta["param_groups"]})
    return meta["record"]


def read_record(path: str) -> Optional[Dict[str, Any]]:
    """The record of a checkpoint without loading its tensors (None if there is none)."""
    if not os.path.exists(path):
        return None
    return _read(path, with_tensors=False)[0]["record"]


def _split(key: str) -> Tuple[int, str]:
    idx, name = key.split(".", 1)
    return int(idx), name
