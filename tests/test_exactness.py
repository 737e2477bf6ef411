"""The exactness contract at the extremes (issue-style adversarial inputs), on every path that shares
the code: probabilities that underflow float32 on one side only, the autograd contract (double
backward, retain_graph, empty batches), NaN in counted and ignored rows, final-logit softcapping,
mixed teacher/student dtypes, and the inputs that must be refused."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import nitrobrew as nb
from hidden_cases import DIVERGENCES, LOSS_FNS, PARAM_NAME, tiny_kl_case
from nitrobrew.hidden import reference_loss
from nitrobrew.topk.reference import reference_topk_loss

# (backend, mode): the PyTorch path, the Triton fast mode and the constant-memory mode (interpreted on CPU)
PATHS = [("torch", None), ("triton", "fast"), ("triton", "constant_memory")]
PATH_IDS = ["torch", "triton-fast", "triton-cm"]
CHUNKED = ("torch", "chunked")  # the PyTorch path over vocab chunks of 64 (states merged across chunks)


def _opts(path, divergence, **kw):
    backend, mode = path
    opts = dict(backend=backend, **kw)
    if mode == "constant_memory":
        opts.update(mode=mode, chunk_V=64)
    elif mode == "chunked":
        opts.update(chunk_V=64)
    if divergence in PARAM_NAME:
        opts[PARAM_NAME[divergence]] = 0.3
    return opts


def _param(divergence):
    return 0.3 if divergence in PARAM_NAME else 0.0


def _rel(a, b):
    # unlike hidden_cases.rel_norm_err, a float32-resolution floor (1e-30): a gradient that is ~1e-86 in
    # float64 (exp(-200)) is exactly 0 in float32, which is right
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


# ------------------------------------------------------------------------------------------------
# probabilities that underflow float32 on one side only


@pytest.mark.parametrize("path", PATHS, ids=PATH_IDS)
@pytest.mark.parametrize("divergence", ["forward_kl", "reverse_kl"])
def test_uniform_against_peaked_is_log8(path, divergence):
    """Identity heads, one side uniform over 8 tokens, the other [0, -200, ..., -200]: KL = log 8 exactly
    (the close-distribution sum alone gave 0.0); the gradient matches float64 too."""
    eye = torch.eye(8)
    flat, peaked = torch.zeros(1, 8), torch.tensor([[0.0] + [-200.0] * 7])
    xs, xt = (flat, peaked) if divergence == "forward_kl" else (peaked, flat)
    xs = xs.clone().requires_grad_()
    loss = LOSS_FNS[divergence](xs, xt, eye, eye, **_opts(path, divergence))
    assert abs(float(loss) - math.log(8)) < 1e-6
    (g,) = torch.autograd.grad(loss, xs)
    x64 = xs.detach().double().requires_grad_()
    (g64,) = torch.autograd.grad(
        reference_loss(x64, xt.double(), eye.double(), eye.double(), divergence=divergence), x64
    )
    assert _rel(g, g64) < 1e-5


def _underflow_case(seed, gap, side, block, temperature, n=5, d=12, vocab=257):
    """Close-ish student and teacher (teacher head = student head + noise), with `block` vocab entries of
    one side pushed `gap` nats down (inf: masked with -inf) by its bias: there that side's probabilities
    underflow float32 while the other side keeps its mass."""
    g = torch.Generator().manual_seed(seed)
    xs = torch.randn(n, d, generator=g)
    ws = torch.randn(vocab, d, generator=g) * (3 / d**0.5)
    wt = ws + torch.randn(vocab, d, generator=g) * (0.5 / d**0.5)
    bias = torch.zeros(vocab)
    ids = torch.randperm(vocab, generator=g)[:block]
    bias[ids] = -gap * temperature
    bs, bt = (bias, None) if side == "student" else (None, bias)
    return xs, xs.clone(), ws, wt, bs, bt


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 10_000),
    gap=st.sampled_from([100.0, 130.0, 300.0, 1000.0, math.inf]),
    side=st.sampled_from(["teacher", "student"]),
    block=st.sampled_from([1, 7, 120]),
    temperature=st.sampled_from([0.25, 1.0, 3.0]),
    divergence=st.sampled_from(DIVERGENCES),
    path=st.sampled_from(PATHS + [CHUNKED]),
)
@example(seed=2275, gap=100.0, side="teacher", block=120, temperature=1.0, divergence="jsd", path=PATHS[1])
@example(seed=2275, gap=100.0, side="teacher", block=120, temperature=1.0, divergence="forward_kl", path=PATHS[2])
@example(seed=11, gap=100.0, side="student", block=120, temperature=3.0, divergence="reverse_kl", path=PATHS[1])
@example(seed=11, gap=100.0, side="student", block=120, temperature=3.0, divergence="skew_kl", path=PATHS[2])
@example(seed=3, gap=math.inf, side="teacher", block=120, temperature=0.25, divergence="jsd", path=PATHS[1])
@example(seed=3, gap=math.inf, side="teacher", block=120, temperature=0.25, divergence="jsd", path=CHUNKED)
@example(seed=49, gap=100.0, side="teacher", block=1, temperature=1.0, divergence="reverse_kl", path=PATHS[1])
@example(seed=0, gap=math.inf, side="student", block=1, temperature=0.25, divergence="skew_kl", path=PATHS[1])
@example(seed=1507, gap=100.0, side="student", block=7, temperature=3.0, divergence="skew_kl", path=PATHS[0])
def test_one_side_underflows(seed, gap, side, block, temperature, divergence, path):
    """Every divergence, every path, masks and gaps of 100-1000 nats on either side, cold and hot
    temperatures: value and gradient agree with float64 (where the divergence is finite). The examples:
    a lane of the Triton row kernels whose maximum moves between entries 100 nats apart on one side (its
    close-distribution sum rescaled by e^100 and back, or moved to the lost sum), the student's top entry
    where the teacher lies 100 nats down (reverse_kl's gradient reads that entry's d), the teacher's top
    entry where the student lies 100 nats down (the gap split there as two ~100-nat numbers put their
    rounding in every d), and a masked (-inf) side in the second pass and the gradient."""
    xs, xt, ws, wt, bs, bt = _underflow_case(seed, gap, side, block, temperature)

    # the materializing reference differentiates -inf logits into NaN (0 * inf): it gets -1e6 there, which
    # underflows the same way and has the same (zero) gradient
    def finite(b):
        return None if b is None else torch.where(torch.isinf(b), -1e6, b).double()

    kw = dict(divergence=divergence, param=_param(divergence), temperature=temperature, reduction="none")
    exact = reference_loss(
        xs.double(),
        xt.double(),
        ws.double(),
        wt.double(),
        bs=None if bs is None else bs.double(),
        bt=None if bt is None else bt.double(),
        **kw,
    )
    if not bool(torch.isfinite(exact).all()):  # e.g. reverse KL against a masked teacher entry the student covers
        return
    x64 = xs.double().requires_grad_()
    ref = reference_loss(x64, xt.double(), ws.double(), wt.double(), bs=finite(bs), bt=finite(bt), **kw)
    x = xs.clone().requires_grad_()
    got = LOSS_FNS[divergence](
        x, xt, ws, wt, bs=bs, bt=bt, temperature=temperature, reduction="none", **_opts(path, divergence)
    )
    assert (got.double() - ref).abs().max() <= 2e-5 * ref.abs().max() + 1e-6, (got, ref)
    w = torch.linspace(0.5, 1.5, got.numel())
    (g,) = torch.autograd.grad((got * w).sum(), x)
    (g64,) = torch.autograd.grad((ref * w.double()).sum(), x64)
    # relative, with an fp32-rounding floor: a gradient may vanish exactly (e.g. tvd when every entry the
    # student covers has q > p), leaving only rounding on our side
    assert float((g.double() - g64).norm()) <= 1e-3 * float(g64.norm()) + 1e-5


@pytest.mark.parametrize("path", PATHS, ids=PATH_IDS)
@pytest.mark.parametrize("divergence", ["forward_kl", "reverse_kl"])
def test_close_distributions_with_a_little_mass_underflowing(path, divergence):
    """A ~3e-5-nat KL of close distributions, where one vocab entry of the other side sits 300 nats down:
    its ~1e-4 share of the mass is what the KL measures, and the KL keeps its digits (the dropped share
    is added back exactly, not by switching to the difference of two log-sum-exps)."""
    xs, ws, wt = tiny_kl_case()
    bias = torch.zeros(ws.shape[0])
    bias[17] = -300.0
    bs, bt = (bias, None) if divergence == "reverse_kl" else (None, bias)
    got = LOSS_FNS[divergence](xs, xs, ws, wt, bs=bs, bt=bt, reduction="none", **_opts(path, divergence))
    ref = reference_loss(
        xs.double(),
        xs.double(),
        ws.double(),
        wt.double(),
        divergence=divergence,
        bs=None if bs is None else bs.double(),
        bt=None if bt is None else bt.double(),
        reduction="none",
    )
    assert float(((got.double() - ref).abs() / ref).max()) < 2e-3


@pytest.mark.parametrize("path", PATHS + [CHUNKED], ids=PATH_IDS + ["torch-chunked"])
@pytest.mark.parametrize("divergence", ["forward_kl", "reverse_kl"])
def test_close_distributions_after_a_chunk_far_below(path, divergence):
    """A ~1e-2-nat KL where the first vocab chunk of the accumulating side lies 100 nats down: the row's
    maximum then moves 100 nats up between chunks while the other side stays level, and the carried
    close-distribution sum is re-referenced by e^100 e^-100 (an overflowing expm1(100) made it infinite,
    and the KL fell back to the difference of two log-sum-exps: 1e-4 off)."""
    xs, ws, wt = tiny_kl_case()
    bias = torch.zeros(ws.shape[0])
    bias[:64] = -100.0
    bs, bt = (bias, None) if divergence == "reverse_kl" else (None, bias)
    got = LOSS_FNS[divergence](xs, xs, ws, wt, bs=bs, bt=bt, reduction="none", **_opts(path, divergence))
    ref = reference_loss(
        xs.double(),
        xs.double(),
        ws.double(),
        wt.double(),
        divergence=divergence,
        bs=None if bs is None else bs.double(),
        bt=None if bt is None else bt.double(),
        reduction="none",
    )
    assert float(((got.double() - ref).abs() / ref).max()) < 1e-5


# ------------------------------------------------------------------------------------------------
# mixed dtypes


@pytest.mark.parametrize("path", PATHS, ids=PATH_IDS)
def test_float32_teacher_with_bf16_student_is_not_rounded(path):
    """Each side is used in its own dtype: the Triton path gave another value than the PyTorch path
    because it rounded a float32 teacher to bf16."""
    g = torch.Generator().manual_seed(3)
    xs, ws = torch.randn(6, 16, generator=g).bfloat16(), torch.randn(70, 16, generator=g).bfloat16()
    xt, wt = torch.randn(6, 24, generator=g) * 2, torch.randn(70, 24, generator=g)
    got = nb.forward_kl(xs, xt, ws, wt, **_opts(path, "forward_kl"))
    ref = reference_loss(xs.double(), xt.double(), ws.double(), wt.double())
    assert abs(float(got) - float(ref)) < 1e-5 * abs(float(ref))


# ------------------------------------------------------------------------------------------------
# the autograd contract


def _small(seed=0, n=5, d=8, vocab=37):
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(n, d, generator=g).requires_grad_(),
        torch.randn(n, d, generator=g),
        torch.randn(vocab, d, generator=g).requires_grad_(),
        torch.randn(vocab, d, generator=g),
    )


@pytest.mark.parametrize("path", PATHS, ids=PATH_IDS)
def test_double_backward_is_refused(path):
    xs, xt, ws, wt = _small()
    loss = nb.jsd(xs, xt, ws, wt, **_opts(path, "jsd"))
    with pytest.raises(RuntimeError, match="do not support double backward"):
        torch.autograd.grad(loss, xs, create_graph=True)


def test_double_backward_is_refused_by_topk_and_attention():
    xs, _, ws, _ = _small()
    lp, ids = torch.log_softmax(torch.randn(5, 37), -1).topk(4, -1)
    for backend in ("torch", "triton"):
        loss = nb.topk_kl(xs, ws, ids, lp, backend=backend)
        with pytest.raises(RuntimeError, match="do not support double backward"):
            torch.autograd.grad(loss, xs, create_graph=True)
        q = torch.randn(1, 2, 9, 8, requires_grad=True)
        loss = nb.attention_kl(
            q,
            torch.randn(1, 2, 9, 8),
            torch.randn(1, 2, 9, 8),
            torch.randn(1, 2, 9, 8),
            is_causal=True,
            backend=backend,
        )
        with pytest.raises(RuntimeError, match="do not support double backward"):
            torch.autograd.grad(loss, q, create_graph=True)


@pytest.mark.parametrize("path", PATHS, ids=PATH_IDS)
def test_retain_graph_second_backward(path):
    """A second backward through a retained graph accumulates the same gradient again, or (the fast
    mode, which hands out gradients formed in the forward) is refused with a clear message."""
    xs, xt, ws, wt = _small()
    loss = nb.forward_kl(xs, xt, ws, wt, **_opts(path, "forward_kl"))
    loss.backward(retain_graph=True)
    first = xs.grad.clone()
    if path[1] == "fast":
        with pytest.raises(RuntimeError, match="second backward through the same graph"):
            loss.backward()
    else:
        loss.backward()
        assert torch.allclose(xs.grad, 2 * first, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("path", PATHS, ids=PATH_IDS)
@pytest.mark.parametrize("shape", [(0, 8), (2, 0, 8)])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_empty_batch(path, shape, reduction):
    _, _, ws, wt = _small()
    xs = torch.zeros(shape, requires_grad=True)
    loss = nb.reverse_kl(xs, torch.zeros(shape), ws, wt, reduction=reduction, **_opts(path, "reverse_kl"))
    assert loss.shape == (shape[:-1] if reduction == "none" else ())
    loss.sum().backward()
    assert float(loss.sum()) == 0.0 and xs.grad.shape == xs.shape
    assert ws.grad is None or float(ws.grad.abs().max()) == 0.0


def test_empty_batch_topk():
    _, _, ws, _ = _small()
    for backend in ("torch", "triton"):
        xs = torch.zeros(0, 8, requires_grad=True)
        loss = nb.topk_kl(xs, ws, torch.zeros(0, 4, dtype=torch.long), torch.zeros(0, 4), backend=backend)
        loss.backward()
        assert float(loss) == 0.0


# ------------------------------------------------------------------------------------------------
# NaN never hides, and never leaks from rows that do not count


@pytest.mark.parametrize("path", PATHS, ids=PATH_IDS)
@pytest.mark.parametrize("divergence", DIVERGENCES)
def test_nan_in_a_counted_row_gives_nan(path, divergence):
    xs, xt, ws, wt = _small()
    bad_x = xt.clone()
    bad_x[2, 3] = float("nan")
    assert torch.isnan(LOSS_FNS[divergence](xs, bad_x, ws, wt, **_opts(path, divergence)))
    bad_w = wt.clone()
    bad_w[5, 1] = float("nan")
    assert torch.isnan(LOSS_FNS[divergence](xs, xt, ws, bad_w, **_opts(path, divergence)))


@pytest.mark.parametrize("path", PATHS, ids=PATH_IDS)
@pytest.mark.parametrize("divergence", ["forward_kl", "jsd"])
def test_nan_in_ignored_rows_does_not_leak(path, divergence):
    xs, xt, ws, wt = _small()
    labels = torch.tensor([0, -100, 1, -100, 2])
    xt = xt.clone()
    xt[1] = float("nan")
    x = xs.detach().clone()
    x[3] = float("nan")
    x.requires_grad_()
    loss = LOSS_FNS[divergence](x, xt, ws, wt, labels=labels, **_opts(path, divergence))
    loss.backward()
    keep = torch.tensor([0, 2, 4])
    ref = LOSS_FNS[divergence](xs.detach()[keep], xt[keep], ws.detach(), wt, **_opts(path, divergence))
    assert torch.isfinite(loss) and abs(float(loss) - float(ref)) < 1e-5 * abs(float(ref))
    assert torch.isfinite(x.grad).all() and float(x.grad[[1, 3]].abs().max()) == 0.0
    assert torch.isfinite(ws.grad).all()
    # every row ignored: loss 0, zero gradients, never NaN
    ws.grad = None
    x.grad = None
    loss = LOSS_FNS[divergence](x, xt, ws, wt, labels=torch.full((5,), -100), **_opts(path, divergence))
    loss.backward()
    assert float(loss) == 0.0 and float(x.grad.abs().max()) == 0.0 and float(ws.grad.abs().max()) == 0.0


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_attention_nan_query_gives_nan(backend):
    q = torch.randn(1, 2, 9, 8)
    q[0, 1, 4, 2] = float("nan")
    q.requires_grad_()
    loss = nb.attention_kl(
        q, torch.randn(1, 2, 9, 8), torch.randn(1, 2, 9, 8), torch.randn(1, 2, 9, 8), is_causal=True, backend=backend
    )
    assert torch.isnan(loss)


# ------------------------------------------------------------------------------------------------
# final-logit softcapping (Gemma 2/3)


@pytest.mark.parametrize("path", PATHS, ids=PATH_IDS)
@pytest.mark.parametrize("divergence", DIVERGENCES)
def test_softcap_matches_float64(path, divergence):
    g = torch.Generator().manual_seed(11)
    xs = (torch.randn(6, 8, generator=g) * 3).requires_grad_()
    xt = torch.randn(6, 8, generator=g) * 3
    ws = torch.randn(53, 8, generator=g).requires_grad_()
    wt = torch.randn(53, 8, generator=g)
    labels = torch.tensor([1, 2, -100, 4, 5, 6])
    kw = dict(softcap_s=5.0, softcap_t=3.0, temperature=1.5, labels=labels, ce_weight=0.4)
    got = LOSS_FNS[divergence](xs, xt, ws, wt, **kw, **_opts(path, divergence))
    ref = reference_loss(xs, xt, ws, wt, divergence=divergence, param=_param(divergence), **kw)
    assert abs(float(got) - float(ref)) < 1e-5 * abs(float(ref))
    for a, b in zip(torch.autograd.grad(got, (xs, ws)), torch.autograd.grad(ref, (xs, ws))):
        assert _rel(a, b) < 1e-4
    uncapped = LOSS_FNS[divergence](
        xs, xt, ws, wt, labels=labels, ce_weight=0.4, temperature=1.5, **_opts(path, divergence)
    )
    assert abs(float(uncapped) - float(got)) > 1e-3  # the cap changes the loss: the option is applied


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("normalize,tail", [("full", False), ("full", True), ("topk", False)])
def test_topk_softcap_matches_float64(backend, normalize, tail):
    g = torch.Generator().manual_seed(12)
    xs = (torch.randn(6, 8, generator=g) * 3).requires_grad_()
    ws = torch.randn(41, 8, generator=g).requires_grad_()
    lp, ids = torch.log_softmax(torch.randn(6, 41, generator=g) * 3, -1).topk(5, -1)
    kw = dict(normalize=normalize, tail=tail, softcap_s=4.0, temperature=1.5)
    got = nb.topk_kl(xs, ws, ids, lp, backend=backend, **kw)
    ref = reference_topk_loss(xs, ws, ids, lp, **kw)
    assert abs(float(got) - float(ref)) < 1e-5 * abs(float(ref))
    for a, b in zip(torch.autograd.grad(got, (xs, ws)), torch.autograd.grad(ref, (xs, ws))):
        assert _rel(a, b) < 1e-4


# ------------------------------------------------------------------------------------------------
# inputs that must be refused


def test_refusals():
    xs, xt, ws, wt = _small()
    with pytest.raises(ValueError, match="hidden size 0"):
        nb.forward_kl(torch.zeros(3, 0), torch.zeros(3, 0), torch.zeros(37, 0), torch.zeros(37, 0))
    with pytest.raises(ValueError, match="hidden size 0"):
        nb.topk_kl(torch.zeros(3, 0), torch.zeros(37, 0), torch.zeros(3, 2, dtype=torch.long), torch.zeros(3, 2) - 1)
    for bad in (0.0, -1.0, float("inf"), float("nan"), True):
        with pytest.raises(ValueError, match="softcap_s must be None or a finite number > 0"):
            nb.forward_kl(xs, xt, ws, wt, softcap_s=bad)
        with pytest.raises(ValueError, match="softcap_s must be None or a finite number > 0"):
            nb.topk_kl(xs, ws, torch.zeros(5, 2, dtype=torch.long), torch.full((5, 2), -1.0), softcap_s=bad)
    with pytest.raises(ValueError, match="softcap_t must be None"):
        nb.jsd(xs, xt, ws, wt, softcap_t=-2.0)
    q = torch.randn(1, 2, 4, 8)
    with pytest.raises(TypeError, match="is_causal"):
        nb.attention_kl(q, q, q, q)


@pytest.mark.parametrize("path", PATHS, ids=PATH_IDS)
def test_no_grad_and_inference_mode(path):
    xs, xt, ws, wt = _small()
    ref = nb.forward_kl(xs, xt, ws, wt, **_opts(path, "forward_kl")).detach()
    with torch.no_grad():
        a = nb.forward_kl(xs, xt, ws, wt, **_opts(path, "forward_kl"))
    with torch.inference_mode():
        b = nb.forward_kl(xs, xt, ws, wt, **_opts(path, "forward_kl"))
    assert not a.requires_grad and not b.requires_grad
    assert float(a) == float(ref) == float(b)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_tiny_divergences_at_hot_temperature_documented_limit(backend):
    """The documented limit (README, Conventions): at T = 1e3 jsd is exact to ~1e-7 nats absolute and a
    few 1e-3 relative; attention_kl to ~1e-7 nats absolute."""
    g = torch.Generator().manual_seed(5)
    xs, xt = torch.randn(4, 16, generator=g) * 3, torch.randn(4, 16, generator=g) * 3
    ws, wt = torch.randn(300, 16, generator=g), torch.randn(300, 16, generator=g)
    got = nb.jsd(xs, xt, ws, wt, temperature=1e3, backend=backend, reduction="none")
    ref = reference_loss(xs, xt, ws, wt, divergence="jsd", param=0.5, temperature=1e3, reduction="none")
    assert float((got.double() - ref).abs().max()) < 1e-7 and float(((got.double() - ref) / ref).abs().max()) < 5e-3
    from nitrobrew.attention.reference import reference_attention_kl

    q, k, qt, kt = (torch.randn(1, 2, 16, 8, generator=g) for _ in range(4))
    a = nb.attention_kl(q, k, qt, kt, is_causal=True, temperature=1e3, backend=backend, reduction="none")
    r = reference_attention_kl(
        q.double(), k.double(), qt.double(), kt.double(), is_causal=True, temperature=1e3, reduction="none"
    )
    assert float((a.double() - r).abs().max()) < 1e-6


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("shape", [(0, 2, 8, 4), (1, 2, 0, 4)])
def test_attention_empty_batch(backend, shape):
    q = torch.zeros(shape, requires_grad=True)
    loss = nb.attention_kl(
        q, torch.zeros(shape), torch.zeros(shape), torch.zeros(shape), is_causal=True, backend=backend
    )
    loss.backward()
    assert float(loss) == 0.0 and q.grad.shape == q.shape
