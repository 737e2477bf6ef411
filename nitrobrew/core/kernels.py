"""Triton kernels shared by the loss families.

``core_scale_kernel`` multiplies gradients formed in the forward (up to four a launch) by the upstream
gradient, in place, reading that scalar on the device: when it is exactly 1 (``loss.backward()``) every
program returns at once, so the backward neither waits for the device to answer nor makes a pass over dW.
"""

from __future__ import annotations

import functools
from typing import Sequence

import torch
import triton
import triton.language as tl

from .launch import cdiv, launch

SCALE_BLOCK = 4096
SCALE_PROGRAMS_PER_SM = 4  # a grid-strided loop: few programs, each leaving at once when nothing is to do
SCALE_PROGRAMS_OFF_GPU = 4


MAX_SCALED = 4  # tensors one launch scales


@triton.jit
def _scale_segment(x_ptr, n, g, ACC: tl.constexpr, BLOCK: tl.constexpr):
    start = tl.program_id(0).to(tl.int64) * BLOCK
    step = tl.num_programs(0).to(tl.int64) * BLOCK
    cols = tl.arange(0, BLOCK)
    for s in range(start, n, step):
        offs = s + cols
        inside = offs < n
        x = tl.load(x_ptr + offs, mask=inside)
        tl.store(x_ptr + offs, (x.to(ACC) * g).to(x.dtype), mask=inside)


@triton.jit
def core_scale_kernel(
    g_ptr, x0_ptr, n0, x1_ptr, n1, x2_ptr, n2, x3_ptr, n3, COUNT: tl.constexpr, ACC: tl.constexpr, BLOCK: tl.constexpr
):
    """x_i *= g for the first COUNT tensors, unless g == 1."""
    g = tl.load(g_ptr).to(ACC)
    if g != 1.0:  # NaN included: it spreads as a multiply would spread it
        _scale_segment(x0_ptr, n0, g, ACC=ACC, BLOCK=BLOCK)
        if COUNT > 1:
            _scale_segment(x1_ptr, n1, g, ACC=ACC, BLOCK=BLOCK)
        if COUNT > 2:
            _scale_segment(x2_ptr, n2, g, ACC=ACC, BLOCK=BLOCK)
        if COUNT > 3:
            _scale_segment(x3_ptr, n3, g, ACC=ACC, BLOCK=BLOCK)


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _programs(t: torch.Tensor) -> int:
    if t.is_cuda:
        index = t.device.index if t.device.index is not None else torch.cuda.current_device()
        return _sm_count(index) * SCALE_PROGRAMS_PER_SM
    return SCALE_PROGRAMS_OFF_GPU


def launch_scale_all(tensors: Sequence[torch.Tensor], upstream: torch.Tensor) -> None:
    """Each tensor *= upstream in place, in one launch (the product in fp32, fp64 for all of them when one is
    fp64, rounded once to each tensor's dtype), skipped on the device when upstream == 1. tensors: 1 to
    MAX_SCALED contiguous tensors on one device; upstream: a one-element tensor on that device."""
    if not 1 <= len(tensors) <= MAX_SCALED:
        raise ValueError(f"launch_scale_all takes 1 to {MAX_SCALED} tensors, got {len(tensors)}")
    for t in tensors:
        if not t.is_contiguous():
            raise ValueError("launch_scale_all needs contiguous tensors")
        if upstream.numel() != 1 or upstream.device != t.device:
            raise ValueError("launch_scale_all needs a one-element upstream gradient on the tensors' device")
    tensors = [t for t in tensors if t.numel()]
    if not tensors:
        return
    acc = tl.float64 if any(t.dtype == torch.float64 for t in tensors) else tl.float32
    n_max = max(t.numel() for t in tensors)
    grid = (min(cdiv(n_max, SCALE_BLOCK), _programs(tensors[0])),)
    slots = []
    for k in range(MAX_SCALED):  # unused slots: the first tensor, no elements
        t = tensors[k] if k < len(tensors) else tensors[0]
        slots += [t, t.numel() if k < len(tensors) else 0]
    launch(core_scale_kernel, grid, upstream, *slots, COUNT=len(tensors), ACC=acc, BLOCK=SCALE_BLOCK)
