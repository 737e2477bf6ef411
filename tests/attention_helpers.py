"""Shared helpers for the attention-KL tests (inputs, reference comparison)."""

from __future__ import annotations

import pytest
import torch

from nitrobrew.attention import attention_kl, reference_attention_kl


def make_inputs(
    B=2, H=4, Nq=19, Nk=None, Ds=16, Dt=24, hkv_s=None, hkv_t=None, dtype=torch.float32, sigma=2.0, close=False, seed=0
):
    """randn inputs at realistic score spreads (score std ~ sigma^2); close=True: student ~ teacher."""
    g = torch.Generator().manual_seed(seed)
    Nk = Nq if Nk is None else Nk
    hkv_s = H if hkv_s is None else hkv_s
    hkv_t = H if hkv_t is None else hkv_t
    q_t = torch.randn(B, H, Nq, Dt, generator=g) * sigma
    k_t = torch.randn(B, hkv_t, Nk, Dt, generator=g) * sigma
    if close:
        assert Ds == Dt and hkv_s == hkv_t
        q_s = q_t + 0.02 * torch.randn(B, H, Nq, Ds, generator=g)
        k_s = k_t + 0.02 * torch.randn(B, hkv_s, Nk, Ds, generator=g)
    else:
        q_s = torch.randn(B, H, Nq, Ds, generator=g) * sigma
        k_s = torch.randn(B, hkv_s, Nk, Ds, generator=g) * sigma
    return [t.to(dtype) for t in (q_s, k_s, q_t, k_t)]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _abs(a, b) -> float:
    return float((a.detach().double() - b.detach().double()).norm())


def compare(
    inputs, *, teacher_grad=False, rtol_val=1e-5, rtol_grad=1e-4, atol=1e-6, reduction="mean", lse_t=None, **kw
):
    """Run attention_kl and the float64 reference on the same inputs; check value and gradients:
    ||out - ref|| <= rtol * ||ref|| + atol (atol: fp32 rounding of O(10)-unit scores, which
    matters when a value or gradient is itself ~0, e.g. saturated softmaxes)."""
    kw.setdefault("is_causal", True)
    ins = [t.clone().requires_grad_(i < 2 or teacher_grad) for i, t in enumerate(inputs)]
    ref_ins = [t.detach().double().requires_grad_(i < 2 or teacher_grad) for i, t in enumerate(inputs)]
    out = attention_kl(*ins, reduction=reduction, lse_t=lse_t, **kw)
    ref_kw = {k: v for k, v in kw.items() if k not in ("backend", "chunk_size", "block_config")}
    ref = reference_attention_kl(*ref_ins, reduction=reduction, **ref_kw)
    assert out.dtype in (torch.float32, torch.float64)
    assert torch.isfinite(out).all()
    err = rel(out, ref)
    assert err <= rtol_val or _abs(out, ref) <= atol, (
        f"value rel err {err:.2e} (got {out.double().sum().item()}, ref {ref.sum().item()})"
    )
    # a non-uniform upstream gradient for reduction="none" exercises per-row g
    if reduction == "none":
        w = torch.linspace(0.5, 1.5, out.numel()).reshape(out.shape)
        (out * w.to(out.dtype)).sum().backward()
        (ref * w.double()).sum().backward()
    else:
        out.backward()
        ref.backward()
    n = 4 if teacher_grad else 2
    for i in range(n):
        gi, gr = ins[i].grad, ref_ins[i].grad
        assert gi is not None and torch.isfinite(gi).all(), f"grad {i} missing or not finite"
        if gr.norm() == 0:
            assert gi.abs().max() == 0
            continue
        e = rel(gi, gr)
        assert e <= rtol_grad or _abs(gi, gr) <= atol, f"grad {['q_s', 'k_s', 'q_t', 'k_t'][i]} rel err {e:.2e}"
    if not teacher_grad:
        assert ins[2].grad is None and ins[3].grad is None
    return out, ref


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny tensors: one intra-op thread is faster, and avoids OpenMP spinning when pytest -n 2
    runs two workers on two cores. Restored after the module."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
