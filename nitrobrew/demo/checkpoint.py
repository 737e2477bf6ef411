"""Atomic safetensors checkpoints of a model, its optimizer and a JSON record.

A checkpoint is one file: written to a temporary name in the same directory, flushed to disk,
then renamed over the old one with ``os.replace`` (atomic on POSIX and Windows), so an
interrupted run always finds either the previous checkpoint or the new one, never half a file.
"""
from __future__ import annotations

import json
import os
from typing import Any, Dict, Optional, Tuple

import torch
from safetensors import safe_open
from safetensors.torch import save

from .._io import atomic_write_bytes


def save_checkpoint(path: str, model: torch.nn.Module, optimizer: Optional[torch.optim.Optimizer],
                    record: Dict[str, Any]) -> None:
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
    atomic_write_bytes(path, save(tensors, metadata={"nitrobrew": json.dumps(meta)}))


def load_checkpoint(path: str, model: torch.nn.Module, optimizer: Optional[torch.optim.Optimizer] = None,
                    device: str = "cpu") -> Dict[str, Any]:
    """Restore model (and optimizer) from `path`; returns the record."""
    with safe_open(path, framework="pt", device=str(device)) as f:
        meta = json.loads(f.metadata()["nitrobrew"])
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    model.load_state_dict({k[len("model."):]: v for k, v in tensors.items() if k.startswith("model.")})
    if optimizer is not None:
        state: Dict[int, Dict[str, Any]] = {}
        for k, v in tensors.items():
            if k.startswith("optim."):
                idx, key = _split(k[len("optim."):])
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
    with safe_open(path, framework="pt") as f:
        return json.loads(f.metadata()["nitrobrew"])["record"]


def _split(key: str) -> Tuple[int, str]:
    idx, name = key.split(".", 1)
    return int(idx), name
