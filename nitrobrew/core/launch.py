"""Launching Triton kernels with less host time.

Triton's JIT launch works out the kernel's specialization from every argument on every call: for
the 40-odd arguments of the attention kernels that is 30-80 us of Python per launch, more than
the kernel itself takes on small problems. ``launch(kernel, grid, *args, **constexprs)`` keys
the compiled kernel on exactly what Triton specializes on (each tensor's dtype and 16-byte
alignment; whether each int is 1, a multiple of 16, or needs 64 bits; each TMA descriptor's
element type, block shape and layout) plus the constexprs and launch options, and after the
first (JIT) launch of a key calls the compiled binary directly.

The direct path is used on CUDA with Triton 3.x and no launch hooks installed (profilers such as
proton install them); everything else, the interpreter included, goes through the JIT launch unchanged.
``NITROBREW_DIRECT_LAUNCH=0`` turns it off.

TMA descriptors: Triton's launcher encodes a tensor map (``fill_tma_descriptor``) from every host
descriptor on every launch. Where its launcher has the form this was written against (Triton 3.6's:
a wrapper around the C launcher that expands descriptors, checked when a kernel's entry is made), the
expanded arguments are kept on the descriptor, keyed on the kernel's descriptor metadata, and the C
launcher is called with them; a descriptor must then not be changed after its first launch (those of
``attention.kernels_gluon._desc`` are not). Any other form keeps Triton's own wrapper.
"""

from __future__ import annotations

import inspect
import os
import sys
from typing import Any, Dict, Optional, Tuple

import torch

try:
    import triton
except Exception:  # pragma: no cover - the PyTorch paths never import this module's callers
    triton = None

_I32 = (-(2**31), 2**31 - 1)
_CACHE: Dict[Tuple, Any] = {}
_TENSOR = torch.Tensor


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for launch grids (triton.cdiv is a constexpr function: ~2 us per host call)."""
    return -(-a // b)


def next_pow2(n: int) -> int:
    """The smallest power of 2 >= n (n >= 1), as triton.next_power_of_2 on the host."""
    return 1 << (n - 1).bit_length() if n > 1 else 1


def _enabled() -> bool:
    if os.environ.get("NITROBREW_DIRECT_LAUNCH", "1") in ("0", ""):
        return False
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        return False
    knobs = getattr(triton, "knobs", None)
    return triton is not None and triton.__version__.startswith("3.") and knobs is not None


_ENABLED = _enabled()
# Whether entries made from now on keep the tensor maps of TMA descriptors (see the module's docstring).
KEEP_TENSOR_MAPS = os.environ.get("NITROBREW_KEEP_TENSOR_MAPS", "1") not in ("0", "")
_MAPS_ATTR = "_nitrobrew_tensor_maps"


def _spec(v) -> Any:
    """What Triton specializes a launch argument on (see triton.runtime.jit's specialize_impl)."""
    if isinstance(v, torch.Tensor):
        return v.dtype, v.data_ptr() % 16 == 0
    if hasattr(v, "block_shape") and hasattr(v, "layout"):
        return getattr(v, _SPEC_ATTR, None) or _descriptor_spec(v)
    if isinstance(v, bool) or v is None or isinstance(v, float):
        return type(v)
    if isinstance(v, int):
        return v == 1, v % 16 == 0, _I32[0] <= v <= _I32[1], v >= 2**63
    return v  # anything else: by value


def _descriptor_spec(v) -> Tuple:
    # a host TMA descriptor (Gluon's TensorDescriptor): its type is the element type, the block shape
    # and the shared layout; the base, shape and strides are runtime values (the launcher builds the
    # tensor map from them on every launch)
    return "desc", v.base.dtype, tuple(v.block_shape), repr(v.layout), getattr(v, "padding", None)


_SPEC_ATTR = "_nitrobrew_launch_spec"


def remember_spec(descriptor) -> None:
    """Work out a TMA descriptor's specialization once and keep it on the descriptor (for descriptors
    built once and launched many times; it must not change afterwards)."""
    setattr(descriptor, _SPEC_ATTR, _descriptor_spec(descriptor))


def _arg_key(args) -> Tuple:
    """tuple(map(_spec, args)) with the common types inline: ints (most of the arguments) and tensors
    cost a call each otherwise, ~0.3 us an argument on the host."""
    lo, hi = _I32
    return tuple(
        [
            (v == 1, v % 16 == 0, lo <= v <= hi, v >= 2**63)
            if type(v) is int
            else (v.dtype, v.data_ptr() % 16 == 0)
            if type(v) is _TENSOR
            else _spec(v)
            for v in args
        ]
    )


def _hook_active(hook) -> bool:
    """A launch hook that does something: Triton 3.5+ always holds a HookChain, empty by default."""
    if hook is None:
        return False
    calls = getattr(hook, "calls", None)
    return calls is None or len(calls) > 0


def _hooks_installed() -> bool:
    rt = triton.knobs.runtime
    return _hook_active(rt.launch_enter_hook) or _hook_active(rt.launch_exit_hook)


def _direct_ok(first: torch.Tensor) -> bool:
    return _ENABLED and first.is_cuda and not _hooks_installed()


def _stream(device_index: int) -> int:
    return torch._C._cuda_getCurrentRawStream(device_index)


class _KeptMapsRun:
    """A compiled kernel's launcher (Triton 3.6's ``CudaLauncher``) called with the tensor maps of its
    descriptor arguments kept on the descriptors: the C launcher behind Triton's expanding wrapper,
    given what the wrapper would have built."""

    __slots__ = ("c_launch", "cooperative", "pdl", "positions", "expand")

    def __init__(self, c_launch, cooperative, pdl, positions, expand):
        self.c_launch, self.cooperative, self.pdl = c_launch, cooperative, pdl
        self.positions = positions  # (argument index, metadata key, metadata) of each descriptor
        self.expand = expand  # the driver's make_tensordesc_arg

    def __call__(self, gx, gy, gz, stream, function, metadata, launch_meta, enter, exit_, *args):
        expanded = list(args)
        for index, key, meta in reversed(self.positions):
            desc = args[index]
            maps = getattr(desc, _MAPS_ATTR, None)
            if maps is None:
                maps = {}
                setattr(desc, _MAPS_ATTR, maps)
            values = maps.get(key)
            if values is None:
                values = maps[key] = self.expand(desc, meta)
            expanded[index : index + 1] = values
        self.c_launch(
            gx, gy, gz, stream, function, self.cooperative, self.pdl, None, None, metadata, launch_meta, enter, exit_,
            *expanded,
        )  # fmt: skip


def _kept_maps_run(run, n_positional: int) -> Optional[_KeptMapsRun]:
    """run wrapped to keep its descriptors' tensor maps, or None where its launcher is not of the known form
    (no descriptors; scratch memory; another Triton's wrapper; a descriptor passed by keyword)."""
    if not KEEP_TENSOR_MAPS:
        return None
    wrapper = getattr(run, "launch", None)
    driver = sys.modules.get(getattr(type(run), "__module__", ""), None)
    if wrapper is None or driver is None or getattr(driver, "_BASE_ARGS_FORMAT_LEN", None) != 13:
        return None
    expand = getattr(driver, "make_tensordesc_arg", None)
    if getattr(run, "global_scratch_size", 1) or getattr(run, "profile_scratch_size", 1) or expand is None:
        return None
    if not hasattr(run, "launch_cooperative_grid") or not hasattr(run, "launch_pdl"):
        return None
    try:
        captured = inspect.getclosurevars(wrapper).nonlocals
    except TypeError:  # a builtin: no descriptors, nothing to expand
        return None
    indices, metas, c_launch = (captured.get(k) for k in ("tensordesc_indices", "tensordesc_meta", "launcher"))
    if not isinstance(indices, set) or not isinstance(metas, list) or c_launch is None or len(indices) != len(metas):
        return None
    if any(m is None or not isinstance(m, dict) for m in metas) or not indices or max(indices) >= n_positional:
        return None
    positions = tuple(
        (index, tuple(sorted((k, repr(v)) for k, v in meta.items())), meta)
        for index, meta in zip(sorted(indices), metas)
    )
    return _KeptMapsRun(c_launch, run.launch_cooperative_grid, run.launch_pdl, positions, expand)


def launch(kernel, grid: Tuple[int, ...], *args, **kwargs) -> None:
    """kernel[grid](*args, **kwargs), through the compiled binary when it is already known.

    Positional arguments are the kernel's leading parameters (one of them a tensor: its device is the
    launch's); every later parameter is passed by keyword, as the callers in nitrobrew do."""
    first = args[0] if type(args[0]) is _TENSOR else next((a for a in args if isinstance(a, _TENSOR)), None)
    if first is None or not _direct_ok(first):
        kernel[grid](*args, **kwargs)
        return
    device = first.device.index
    # keyword order is fixed at each call site: unsorted, another order only costs another entry
    key = (id(kernel), device, _arg_key(args), tuple(kwargs.items()))
    entry = _CACHE.get(key)
    if entry is None:
        compiled = kernel[grid](*args, **kwargs)
        names = getattr(kernel, "arg_names", ())[len(args) :]
        run = getattr(compiled, "run", None)
        if (
            run is not None
            and all(n in kwargs for n in names)
            and hasattr(compiled, "function")
            and hasattr(compiled, "packed_metadata")
        ):
            run = _kept_maps_run(run, len(args)) or run
            _CACHE[key] = (run, compiled.function, compiled.packed_metadata, tuple(kwargs[n] for n in names))
        return
    run, function, metadata, tail = entry
    g = tuple(grid) + (1, 1)
    run(g[0], g[1], g[2], _stream(device), function, metadata, None, None, None, *args, *tail)
