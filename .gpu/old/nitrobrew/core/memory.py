"""Device-independent accounting of tensor memory created inside a region.

``TensorMemoryTracker`` is a TorchDispatchMode: it sees every tensor an operator returns (on
any device, CPU included), tracks the bytes still alive, and reports the peak of those live
bytes and the largest single tensor. Tests use it to check memory claims on CPU; the benchmark
uses it where CUDA's allocator statistics are not available.
"""

from __future__ import annotations

import gc
import weakref
from typing import Callable, Tuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class TensorMemoryTracker(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.live = 0
        self.peak = 0
        self.largest = 0
        self.largest_shape: Tuple[int, ...] = ()
        self._seen = set()

    def _track(self, t: torch.Tensor) -> None:
        try:
            storage = t.untyped_storage()
            key = storage.data_ptr()
            nbytes = storage.nbytes()
        except Exception:
            return
        if key in self._seen or nbytes == 0:
            return
        self._seen.add(key)
        self.live += nbytes
        self.peak = max(self.peak, self.live)
        if nbytes > self.largest:
            self.largest, self.largest_shape = nbytes, tuple(t.shape)
        weakref.finalize(storage, self._release, key, nbytes)

    def _release(self, key, nbytes) -> None:
        self._seen.discard(key)
        self.live -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        in_ptrs = set()
        for a in tree_flatten((args, kwargs))[0]:
            if isinstance(a, torch.Tensor):
                try:
                    in_ptrs.add(a.untyped_storage().data_ptr())
                except Exception:
                    pass
        for o in tree_flatten(out)[0]:
            if isinstance(o, torch.Tensor):
                try:
                    if o.untyped_storage().data_ptr() in in_ptrs:
                        continue  # a view or in-place result: no new memory
                except Exception:
                    continue
                self._track(o)
        return out


def peak_mib(fn: Callable[[], object], device: torch.device) -> float:
    """Peak memory above what was allocated before the call (inputs and their grads live), MiB."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        fn()
        torch.cuda.synchronize()
        return (torch.cuda.max_memory_allocated() - base) / 2**20
    with TensorMemoryTracker() as tracker:
        fn()
    return tracker.peak / 2**20
