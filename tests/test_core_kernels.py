"""The upstream-gradient scale of the gradients a fast mode forms in the forward (core/kernels.py,
core/slabs.py: scale_by_upstream): in place, the product rounded once, skipped when the upstream
gradient is exactly 1, the same on the kernel path and the host path."""

import math

import pytest
import torch

from nitrobrew.core import checks as ck
from nitrobrew.core import slabs

# the kernel runs on a GPU, or on the CPU under Triton's interpreter
KERNEL_DEVICE = "cuda" if torch.cuda.is_available() and not ck.interpreter_enabled() else "cpu"
needs_triton = pytest.mark.skipif(
    not (ck.triton_available() and (KERNEL_DEVICE == "cuda" or ck.interpreter_enabled())),
    reason="a GPU or Triton's interpreter (TRITON_INTERPRET=1)",
)
INTERPRETED = KERNEL_DEVICE == "cpu"

UPSTREAMS = [0.5, 2.0, -3.0, 1 / 3, 0.0, 1e-30, float("inf"), float("nan"), 1.0]


def _grad(n, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g, dtype=torch.float64) * 3
    x[:3] = torch.tensor([0.0, -0.0, 65504.0], dtype=torch.float64)
    return x.to(dtype)


def _expected(x, up):
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    return (x.to(acc) * torch.tensor(up, dtype=acc)).to(x.dtype)


def _same(a, b, interpreted=False):
    """Equal bit for bit, NaN where NaN. Triton's interpreter truncates fp32 to 16 bits where the GPU
    rounds to nearest: with `interpreted`, 16-bit values may differ by one unit in the last place."""
    if a.dtype != b.dtype or not torch.equal(torch.isnan(a), torch.isnan(b)):
        return False
    a, b = a.nan_to_num(), b.nan_to_num()
    if not (interpreted and a.element_size() == 2):
        return torch.equal(a, b)
    ulp = torch.finfo(a.dtype).eps * b.double().abs().clamp_min(torch.finfo(a.dtype).tiny)
    return bool(((a.double() - b.double()).abs() <= ulp).all())


@needs_triton
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
@pytest.mark.parametrize("up", UPSTREAMS)
def test_scale_kernel_multiplies_in_place_and_rounds_once(dtype, up):
    from nitrobrew.core import kernels

    # 4096 * 4 programs + 5: every program walks more than one block, and the last block is partial
    x = _grad(kernels.SCALE_BLOCK * kernels.SCALE_PROGRAMS_OFF_GPU * 2 + 5, dtype).to(KERNEL_DEVICE)
    up_t = torch.tensor([up], dtype=torch.float64 if dtype == torch.float64 else torch.float32, device=KERNEL_DEVICE)
    want = _expected(x.cpu(), float(up_t))
    ptr = x.data_ptr()
    kernels.launch_scale_all([x], up_t)
    assert x.data_ptr() == ptr
    assert _same(x.cpu(), want, interpreted=INTERPRETED)


@needs_triton
def test_scale_kernel_refuses_what_it_cannot_scale():
    from nitrobrew.core import kernels

    x = torch.ones(4, 6, device=KERNEL_DEVICE)
    with pytest.raises(ValueError, match="contiguous"):
        kernels.launch_scale_all([x.t()], torch.tensor(2.0, device=KERNEL_DEVICE))
    with pytest.raises(ValueError, match="one-element"):
        kernels.launch_scale_all([x], torch.tensor([2.0, 3.0], device=KERNEL_DEVICE))
    kernels.launch_scale_all([torch.empty(0, device=KERNEL_DEVICE)], torch.tensor(2.0, device=KERNEL_DEVICE))


@pytest.mark.parametrize("kernel_path", [True, False])
@pytest.mark.parametrize("up", [0.25, 1.0, float("nan")])
def test_scale_by_upstream_is_in_place_on_both_paths(monkeypatch, kernel_path, up):
    if kernel_path and not (ck.triton_available() and (KERNEL_DEVICE == "cuda" or ck.interpreter_enabled())):
        pytest.skip("a GPU or Triton's interpreter (TRITON_INTERPRET=1)")
    dev = KERNEL_DEVICE if kernel_path else "cpu"
    if dev == "cpu":
        monkeypatch.setattr(ck, "interpreter_enabled", lambda: kernel_path)
    dx, dw = _grad(300, torch.bfloat16, 1).reshape(20, 15), _grad(600, torch.bfloat16, 2).reshape(40, 15)
    db = _grad(40, torch.float32, 3)
    up32 = float(torch.tensor(up, dtype=torch.float32))
    want = [_expected(t, up32) for t in (dx, dw, db)]
    dx, dw, db = dx.to(dev), dw.to(dev), db.to(dev)
    ptrs = [t.data_ptr() for t in (dx, dw, db)]
    out = slabs.scale_by_upstream((dx, None, dw, db), torch.tensor(up, dtype=torch.float32, device=dev))
    assert out[1] is None
    got = (out[0], out[2], out[3])
    assert [t.data_ptr() for t in got] == ptrs
    for g, w in zip(got, want):
        assert _same(g.cpu(), w, interpreted=kernel_path and INTERPRETED)


def test_scale_by_upstream_reads_a_bf16_upstream_once():
    """A bf16 upstream gradient (a bf16 loss) is taken as it is, not rounded again."""
    up = torch.tensor(1 / 3).bfloat16()
    x = _grad(64, torch.float32)
    want = x * float(up)
    (got,) = slabs.scale_by_upstream((x.clone(),), up)
    assert torch.equal(got, want)
    assert not math.isclose(float(up), 1 / 3, rel_tol=1e-6)  # the test would not tell otherwise


@needs_triton
def test_scale_by_upstream_scales_a_permuted_gradient_in_place():
    """A dense gradient with permuted strides (e.g. dX of transposed hidden states) takes the kernel too."""
    dx = _grad(24 * 40, torch.float32, 4).reshape(24, 40).t()  # [40, 24], strides (1, 40)
    want = _expected(dx, 0.25)
    dx = dx.to(KERNEL_DEVICE)
    assert not dx.is_contiguous()
    (got,) = slabs.scale_by_upstream((dx,), torch.tensor(0.25, device=KERNEL_DEVICE))
    assert got is dx and got.stride() == (1, 40)
    assert torch.equal(got.cpu(), want)
    gap = torch.ones(8, 10, device=KERNEL_DEVICE)[:, ::2]  # not dense: the host path, still in place
    (got,) = slabs.scale_by_upstream((gap,), torch.tensor(3.0, device=KERNEL_DEVICE))
    assert got is gap and torch.equal(got.cpu(), torch.full((8, 5), 3.0))


def _count_launches(monkeypatch) -> list:
    """A list that gets one entry per kernel launch of nitrobrew.core.kernels."""
    from nitrobrew.core import kernels

    launches = []
    real = kernels.launch
    monkeypatch.setattr(kernels, "launch", lambda *a, **k: (launches.append(1), real(*a, **k)))
    return launches


@needs_triton
def test_scale_kernel_scales_several_tensors_in_one_launch(monkeypatch):
    from nitrobrew.core import kernels

    launches = _count_launches(monkeypatch)
    sizes = [5, kernels.SCALE_BLOCK * 3 + 1, 3, 7]
    dtypes = [torch.bfloat16, torch.float32, torch.float16, torch.float16]
    xs = [_grad(n, d).to(KERNEL_DEVICE) for n, d in zip(sizes, dtypes)]
    xs[2] = xs[2][:0]  # an empty one among them
    for up in (1.0, -0.3):
        wants = [_expected(x.cpu(), up) for x in xs]
        kernels.launch_scale_all(xs, torch.tensor([up], device=KERNEL_DEVICE))
        for x, want in zip(xs, wants):
            assert _same(x.cpu(), want, interpreted=INTERPRETED)
    assert len(launches) == 2
    with pytest.raises(ValueError, match="1 to 4"):
        kernels.launch_scale_all(xs + xs, torch.tensor([2.0], device=KERNEL_DEVICE))


@needs_triton
def test_scale_by_upstream_launches_once_per_precision(monkeypatch):

    launches = _count_launches(monkeypatch)
    grads = [_grad(n, d).to(KERNEL_DEVICE) for n, d in ((9, torch.bfloat16), (11, torch.float64), (13, torch.float32))]
    up = torch.tensor(1 / 3, device=KERNEL_DEVICE)
    wants = [_expected(g.cpu(), float(up)) for g in grads]  # fp32 products for the 16/32-bit ones, fp64 for fp64
    out = slabs.scale_by_upstream([grads[0], None, grads[1], grads[2]], up)
    assert out[1] is None and [t is g for t, g in zip([out[0], out[2], out[3]], grads)] == [True] * 3
    for g, want in zip(grads, wants):
        assert _same(g.cpu(), want, interpreted=INTERPRETED)
    assert len(launches) == 2
