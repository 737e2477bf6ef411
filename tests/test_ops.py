"""The shared matmul helpers: fp32 accumulation of 16-bit operands, against float64."""

import pytest
import torch

from nitrobrew.core.ops import mm_acc, mm_acc_add


def _operands(dtype):
    g = torch.Generator().manual_seed(0)
    a = torch.randn(37, 300, generator=g).to(dtype)
    b = torch.randn(300, 19, generator=g).to(dtype)
    return a, b


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_mm_acc_matches_float64(dtype):
    a, b = _operands(dtype)
    out = mm_acc(a, b, torch.float32)
    ref = a.double() @ b.double()
    assert out.dtype == torch.float32
    assert torch.allclose(out.double(), ref, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_mm_acc_add_accumulates_in_place(dtype):
    a, b = _operands(dtype)
    out = torch.randn(37, 19)
    start = out.clone()
    mm_acc_add(out, a, b)
    mm_acc_add(out, a[:, :150], b[:150])
    ref = start.double() + a.double() @ b.double() + a[:, :150].double() @ b[:150].double()
    assert torch.allclose(out.double(), ref, rtol=1e-5, atol=1e-4)
