"""Property tests (hypothesis): random shapes and options against the float64 reference."""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from attention_helpers import compare, one_thread  # noqa: F401
from nitrobrew import attention_kl
from nitrobrew.core.checks import interpreter_enabled, triton_available


@st.composite
def problems(draw, max_n=20, dims=(4, 8, 12)):
    B = draw(st.integers(1, 2))
    H = draw(st.sampled_from([1, 2, 4]))
    hkv_s = draw(st.sampled_from([d for d in (1, 2, 4) if H % d == 0]))
    hkv_t = draw(st.sampled_from([d for d in (1, 2, 4) if H % d == 0]))
    is_causal = draw(st.booleans())
    Nq = draw(st.integers(1, max_n))
    Nk = draw(st.integers(1, max_n))
    Ds, Dt = draw(st.sampled_from(dims)), draw(st.sampled_from(dims))
    seed = draw(st.integers(0, 2**16))
    g = torch.Generator().manual_seed(seed)
    sigma = draw(st.sampled_from([0.5, 2.0, 3.0]))
    ins = [
        torch.randn(B, H, Nq, Ds, generator=g) * sigma,
        torch.randn(B, hkv_s, Nk, Ds, generator=g) * sigma,
        torch.randn(B, H, Nq, Dt, generator=g) * sigma,
        torch.randn(B, hkv_t, Nk, Dt, generator=g) * sigma,
    ]
    kpm = None
    if draw(st.booleans()):
        kpm = torch.rand(B, Nk, generator=g) > draw(st.sampled_from([0.2, 0.6, 1.0]))
    opts = dict(
        is_causal=is_causal,
        causal_offset=draw(st.integers(-3, 3)) if is_causal else 0,
        direction=draw(st.sampled_from(["forward", "reverse"])),
        temperature=draw(st.sampled_from([0.5, 1.0, 2.0])),
        reduction=draw(st.sampled_from(["mean", "sum", "none"])),
        key_padding_mask=kpm,
    )
    return ins, opts


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problems(), st.integers(1, 9), st.booleans())
def test_chunked_matches_reference(problem, chunk, teacher_grad):
    ins, opts = problem
    compare(
        ins,
        backend="torch",
        chunk_size=chunk,
        teacher_grad=teacher_grad,
        rtol_val=2e-5,
        rtol_grad=2e-4,
        atol=2e-5,
        **opts,
    )


@pytest.mark.skipif(not (triton_available() and interpreter_enabled()), reason="needs TRITON_INTERPRET=1")
@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problems(max_n=24, dims=(8, 16, 24)), st.booleans())
def test_triton_matches_reference(problem, teacher_grad):
    ins, opts = problem
    compare(ins, backend="triton", teacher_grad=teacher_grad, rtol_val=2e-5, rtol_grad=2e-4, atol=2e-5, **opts)


@settings(max_examples=25, deadline=None)
@given(problems(max_n=12))
def test_rows_nonnegative_and_finite(problem):
    ins, opts = problem
    opts = {**opts, "reduction": "none"}
    rows = attention_kl(*ins, backend="torch", **opts)
    assert torch.isfinite(rows).all()
    assert (rows >= -1e-5).all()
