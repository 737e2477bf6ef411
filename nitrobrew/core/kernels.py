"""Triton kernels shared by the loss families.

``core_scale_kernel`` multiplies a gradient formed in the forward by the upstream gradient, in place,
reading that scalar on the device: when it is exactly 1 (``loss.backward()``) every program returns at
once, so the backward neither waits for the device to answer nor makes a pass over dW.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .launch import cdiv, launch

SCALE_BLOCK = 4096
SCALE_PROGRAMS_PER_SM = 4  # a grid-strided loop: few programs, each leaving at once when nothing is to do
SCALE_PROGRAMS_OFF_GPU = 4


@triton.jit
def core_scale_kernel(x_ptr, g_ptr, n, ACC: tl.constexpr, BLOCK: tl.constexpr):
    g = tl.load(g_ptr).to(ACC)
    if g != 1.0:  # NaN included: it spreads as a multiply would spread it
        start = tl.program_id(0).to(tl.int64) * BLOCK
        step = tl.num_programs(0).to(tl.int64) * BLOCK
        cols = tl.arange(0, BLOCK)
        for s in range(start, n, step):
            offs = s + cols
            inside = offs < n
            x = tl.load(x_ptr + offs, mask=inside)
            tl.store(x_ptr + offs, (x.to(ACC) * g).to(x.dtype), mask=inside)


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _programs(t: torch.Tensor) -> int:
    if t.is_cuda:
        index = t.device.index if t.device.index is not None else torch.cuda.current_device()
        return _sm_count(index) * SCALE_PROGRAMS_PER_SM
    return SCALE_PROGRAMS_OFF_GPU


def launch_scale(t: torch.Tensor, upstream: torch.Tensor) -> None:
    """t *= upstream in place (the product in fp32, fp64 for fp64, rounded once to t's dtype), skipped on the device
    when upstream == 1. t: contiguous; upstream: a one-element tensor on t's device."""
    if not t.is_contiguous():
        raise ValueError("launch_scale needs a contiguous tensor")
    if upstream.numel() != 1 or upstream.device != t.device:
        raise ValueError("launch_scale needs a one-element upstream gradient on the tensor's device")
    n = t.numel()
    if n == 0:
        return
    acc = tl.float64 if t.dtype == torch.float64 else tl.float32
    grid = (min(cdiv(n, SCALE_BLOCK), _programs(t)),)
    launch(core_scale_kernel, grid, t, upstream, n, ACC=acc, BLOCK=SCALE_BLOCK)
