"""Property tests (hypothesis): random shapes and options against the float64 reference, and
invariances of the hidden-state losses."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hidden_cases import (
    DIVERGENCES,
    PARAM_NAME,
    TOLERANCES,
    Case,
    assert_close,
    check_against_reference,
    make_case,
    run_loss,
    upstream_grad,
)

F32, BF16, F64 = torch.float32, torch.bfloat16, torch.float64

leading = st.one_of(
    st.just(()),  # a single [D] row
    st.tuples(st.integers(0, 9)),  # [N, D], N = 0 and 1 included
    st.tuples(st.integers(1, 3), st.integers(0, 4)),  # [B, T, D]
)
param_values = st.one_of(st.sampled_from([0.0, 1.0]), st.floats(0.01, 0.99))


@st.composite
def problems(draw, dtypes=(F32, BF16, F64)):
    """Inputs (make_case arguments) and loss options."""
    divergence = draw(st.sampled_from(DIVERGENCES))
    vocab = draw(st.integers(1, 24))
    labels = draw(st.sampled_from([None, "some", "all", "none_ignored"]))
    inputs = dict(
        shape=draw(leading),
        ds=draw(st.integers(1, 12)),
        dt=draw(st.integers(1, 12)),
        vocab=vocab,
        pad_s=draw(st.sampled_from([0, 0, 1, 3])),
        pad_t=draw(st.sampled_from([0, 0, 2])),
        bias=draw(st.booleans()),
        labels=labels,
        seed=draw(st.integers(0, 2**16)),
    )
    options = dict(
        temperature=draw(st.sampled_from([0.5, 1.0, 2.7]) | st.floats(0.5, 4.0)),
        reduction=draw(st.sampled_from(["mean", "sum", "none"])),
        chunk_V=draw(st.none() | st.integers(1, vocab + 3)),
        scale_t2=draw(st.booleans()),
    )
    if divergence in PARAM_NAME:
        options[PARAM_NAME[divergence]] = draw(param_values)
    if labels is not None:
        options["kd_weight"], options["ce_weight"] = draw(st.sampled_from([(1.0, 0.0), (0.4, 0.6), (0.0, 1.0)]))
    return draw(st.sampled_from(dtypes)), divergence, inputs, options


@settings(max_examples=3 * settings.default.max_examples)
@given(problem=problems())
def test_random_problems_match_reference(backend, problem):
    dtype, divergence, inputs, options = problem
    check_against_reference(backend, dtype, divergence=divergence, **inputs, **options)


def _permuted_vocab(case: Case, perm: torch.Tensor) -> Case:
    inv = torch.argsort(perm)

    def rows(t, grad):
        return None if t is None else (t.detach()[perm].requires_grad_() if grad else t[perm])

    labels = case.labels
    if labels is not None:
        labels = torch.where(labels == case.ignore_index, labels, inv[labels.clamp_min(0)])
    return Case(
        xs=case.xs,
        xt=case.xt,
        ws=rows(case.ws, True),
        wt=rows(case.wt, False),
        bs=rows(case.bs, True),
        bt=rows(case.bt, False),
        labels=labels,
        vocab_size=case.vocab_size,
        ignore_index=case.ignore_index,
    )


@given(
    divergence=st.sampled_from(DIVERGENCES),
    n=st.integers(1, 6),
    vocab=st.integers(2, 20),
    chunk=st.none() | st.integers(1, 8),
    bias=st.booleans(),
    ce=st.booleans(),
    seed=st.integers(0, 2**16),
    temperature=st.floats(0.5, 3.0),
)
def test_vocab_permutation_invariance(backend, divergence, n, vocab, chunk, bias, ce, seed, temperature):
    """Permuting the vocabulary of both heads (and the label ids) changes nothing but the order of
    the head gradients' rows."""
    case = make_case(shape=(n,), ds=5, dt=7, vocab=vocab, bias=bias, labels="some", seed=seed)
    perm = torch.randperm(vocab, generator=torch.Generator().manual_seed(seed))
    other = _permuted_vocab(case, perm)
    opts = dict(temperature=temperature, chunk_V=chunk, reduction="none", ce_weight=0.5 if ce else 0.0)
    a, b = run_loss(case, divergence, backend, **opts), run_loss(other, divergence, backend, **opts)
    value_tol, grad_tol = TOLERANCES[F32]
    assert_close(b, a, value_tol, "permuted vocab value")
    up = upstream_grad(a).float()
    ga = torch.autograd.grad(a, case.student_leaves(), up)
    gb = torch.autograd.grad(b, other.student_leaves(), up)
    assert_close(gb[0], ga[0], grad_tol, "xs grad")
    for g_other, g in zip(gb[1:], ga[1:]):
        assert_close(g_other, g[perm], grad_tol, "head grad rows")


@given(
    divergence=st.sampled_from(DIVERGENCES),
    n=st.integers(2, 9),
    seed=st.integers(0, 2**16),
    chunk=st.none() | st.integers(1, 40),
)
def test_row_permutation_permutes_none(backend, divergence, n, seed, chunk):
    case = make_case(shape=(n,), bias=True, labels="some", seed=seed)
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed + 1))
    other = Case(
        xs=case.xs.detach()[perm].requires_grad_(),
        xt=case.xt[perm],
        ws=case.ws,
        wt=case.wt,
        bs=case.bs,
        bt=case.bt,
        labels=case.labels[perm],
    )
    opts = dict(temperature=1.3, chunk_V=chunk, reduction="none")
    a, b = run_loss(case, divergence, backend, **opts), run_loss(other, divergence, backend, **opts)
    assert_close(b, a[perm], TOLERANCES[F32][0], "permuted rows")  # rows are independent
    (ga,) = torch.autograd.grad(a.sum(), [case.xs])
    (gb,) = torch.autograd.grad(b.sum(), [other.xs])
    assert_close(gb, ga[perm], TOLERANCES[F32][1], "xs grad rows")
    for reduction in ("mean", "sum"):
        assert_close(
            run_loss(other, divergence, backend, **{**opts, "reduction": reduction}),
            run_loss(case, divergence, backend, **{**opts, "reduction": reduction}),
            TOLERANCES[F32][0],
            reduction,
        )


@given(
    divergence=st.sampled_from(DIVERGENCES),
    dtype=st.sampled_from([F32, BF16]),
    seed=st.integers(0, 2**16),
    temperature=st.floats(0.5, 4.0),
    close=st.booleans(),
    chunk=st.none() | st.integers(1, 40),
    param=param_values,
)
def test_nonnegative(backend, divergence, dtype, seed, temperature, close, chunk, param):
    """Every divergence is >= 0 per row (up to fp32 rounding), also for a close student."""
    case = make_case(shape=(8,), ds=12, vocab=37, bias=True, close=close, dtype=dtype, seed=seed)
    opts = {PARAM_NAME[divergence]: param} if divergence in PARAM_NAME else {}
    rows = run_loss(case, divergence, backend, temperature=temperature, chunk_V=chunk, reduction="none", **opts)
    assert torch.isfinite(rows).all()
    assert rows.min() >= -1e-5, rows


@given(
    divergence=st.sampled_from(DIVERGENCES),
    dtype=st.sampled_from([F32, BF16, F64]),
    seed=st.integers(0, 2**16),
    temperature=st.floats(0.5, 4.0),
    chunk=st.none() | st.integers(1, 40),
    bias=st.booleans(),
    param=param_values,
)
def test_identical_teacher_and_student(backend, divergence, dtype, seed, temperature, chunk, bias, param):
    """Teacher == student: loss ~0 and gradients ~0 (the gradient floor: fp32 log-sum-exps of
    logits up to ~50 at T=0.5 leave sum(q) - 1 ~ 1e-6, against gradients of order 0.1-1)."""
    src = make_case(shape=(2, 3), ds=12, vocab=37, bias=bias, dtype=dtype, seed=seed)
    case = Case(
        xs=src.xt.detach().clone().requires_grad_(),
        xt=src.xt,
        ws=src.wt.detach().clone().requires_grad_(),
        wt=src.wt,
        bs=None if src.bt is None else src.bt.detach().clone().requires_grad_(),
        bt=src.bt,
    )
    opts = {PARAM_NAME[divergence]: param} if divergence in PARAM_NAME else {}
    rows = run_loss(case, divergence, backend, temperature=temperature, chunk_V=chunk, reduction="none", **opts)
    assert rows.abs().max() <= (1e-12 if dtype == F64 else 1e-6)
    for g in torch.autograd.grad(rows.sum(), case.student_leaves()):
        assert g.abs().max() <= (1e-10 if dtype == F64 else 1e-4)
