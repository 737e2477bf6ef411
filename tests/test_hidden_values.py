"""Hidden-state losses against the float64 reference: values and gradients of xs, ws, bs."""

from __future__ import annotations

import inspect
import itertools
import math

import pytest
import torch
import torch.nn.functional as F

import nitrobrew as nb
from hidden_cases import (
    DEFAULT_PARAM,
    DIVERGENCES,
    LOSS_FNS,
    PARAM_NAME,
    SPREAD,
    TOLERANCES,
    Case,
    Tol,
    assert_close,
    check_against_reference,
    make_case,
    pairwise,
    rel_norm_err,
    run_loss,
    run_reference,
    upstream_grad,
)
from nitrobrew import divergences as dv

BF16 = torch.bfloat16
F32 = torch.float32
F64 = torch.float64

# name -> (vocab, chunk_V): chunked regimes, each a separate code path of the online passes.
CHUNKING = {
    "auto": (37, None),
    "one_tiny_v": (5, 1),
    "ragged": (37, 8),  # 8 does not divide 37
    "equal": (37, 37),
    "over": (37, 64),  # chunk >= V
}
PARAMS = {"jsd": {"beta": 0.3}, "skew_kl": {"alpha": 0.2}, "skew_reverse_kl": {"alpha": 0.2}}

FACTORS = {
    "divergence": DIVERGENCES,
    "dtype": (F32, BF16),
    "temperature": (0.5, 1.0, 2.7),
    "reduction": ("mean", "sum", "none"),
    "chunking": tuple(CHUNKING),
    "labels": (None, "some", "all"),
    "bias": (False, True),
    "shape": ((7,), (2, 3)),
    "dims": ((16, 16), (12, 20)),
    "padded": (False, True),
}
MATRIX = pairwise(FACTORS)


def _matrix_id(row) -> str:
    return "-".join(
        [
            row["divergence"],
            str(row["dtype"]).removeprefix("torch."),
            f"T{row['temperature']}",
            row["reduction"],
            row["chunking"],
            f"labels_{row['labels']}",
            "bias" if row["bias"] else "nobias",
            "x".join(map(str, row["shape"])),
            "ds{}_dt{}".format(*row["dims"]),
            "padded" if row["padded"] else "same",
        ]
    )


@pytest.mark.parametrize("seed, row", list(enumerate(MATRIX)), ids=[_matrix_id(r) for r in MATRIX])
def test_pairwise_matrix(backend, seed, row):
    """Every pair of (divergence, dtype, temperature, reduction, chunking, labels, bias, shape,
    hidden sizes, padded heads) against the float64 reference."""
    vocab, chunk = CHUNKING[row["chunking"]]
    ds, dt = row["dims"]
    check_against_reference(
        backend,
        row["dtype"],
        divergence=row["divergence"],
        shape=row["shape"],
        ds=ds,
        dt=dt,
        vocab=vocab,
        pad_s=3 if row["padded"] else 0,
        pad_t=5 if row["padded"] else 0,
        bias=row["bias"],
        labels=row["labels"],
        seed=seed,
        temperature=row["temperature"],
        reduction=row["reduction"],
        chunk_V=chunk,
        **PARAMS.get(row["divergence"], {}),
    )


def test_matrix_covers_every_pair():
    for a, b in itertools.combinations(FACTORS, 2):
        seen = {(repr(r[a]), repr(r[b])) for r in MATRIX}
        assert seen == {(repr(x), repr(y)) for x in FACTORS[a] for y in FACTORS[b]}, (a, b)
    assert len(MATRIX) < 2 * 6 * 5  # a covering selection (>= 6 x 5 rows), not the cross product (25920)


def test_inputs_have_realistic_spread():
    case = make_case(shape=(64,), ds=32, vocab=1000, seed=1)
    logits = (case.xs @ case.ws.t()).detach()
    span = logits.amax(-1) - logits.amin(-1)
    assert span.min() > 15 and span.mean() > 20, "logits should span tens of units"
    assert 0.7 * SPREAD < logits.std() < 1.3 * SPREAD
    close = make_case(shape=(64,), ds=32, vocab=1000, seed=1, close=True)
    gap = (close.xs @ close.ws.t() - close.xt @ close.wt.t()).detach()
    assert gap.abs().max() < 0.1 * span.min() and gap.abs().max() > 0


@pytest.mark.parametrize("divergence", DIVERGENCES)
def test_float64_inputs_stay_float64(backend, divergence):
    """float64 in -> float64 result and gradients, at float64 accuracy (CONTRIBUTING, docs/design.md §2)."""
    for reduction in ("mean", "none"):
        check_against_reference(
            backend,
            F64,
            divergence=divergence,
            bias=True,
            labels="some",
            chunk_V=8,
            temperature=1.7,
            reduction=reduction,
        )


@pytest.mark.parametrize("dtype", [F32, BF16], ids=["f32", "bf16"])
@pytest.mark.parametrize("divergence", DIVERGENCES)
def test_close_student(backend, divergence, dtype):
    """student = teacher + small noise: the loss is small and positive, and the gradient matches
    to a tight relative tolerance (the regime where bf16-rounded logits fail; see the next test)."""
    got = check_against_reference(
        backend,
        dtype,
        divergence=divergence,
        shape=(4, 8),
        ds=32,
        vocab=257,
        close=True,
        bias=True,
        chunk_V=64,
        reduction="none",
        temperature=1.3,
    )
    rows = got.loss.detach()
    far = run_loss(
        make_case(shape=(4, 8), ds=32, vocab=257, dtype=dtype), divergence, backend, reduction="none", temperature=1.3
    ).detach()
    assert (rows > 0).all(), f"close rows must be positive, got min {rows.min().item()}"
    assert rows.mean() < 0.1 * far.mean(), "the close case must be small"
    # per-row values (down to ~1e-4) to 1%, up to fp32 rounding of log-sum-exps near +-20
    assert_close(rows, got.ref, Tol(1e-2, 0.0, 5e-6), "close per-row value")
    limit = 3e-4 if dtype == F32 else 6e-3  # bf16 gradients are rounded to bf16 on return
    for name, g, rg in zip(("xs", "ws", "bs"), got.grads, got.ref_grads):
        assert rel_norm_err(g, rg) < limit, f"{name}: relative gradient error {rel_norm_err(g, rg):.2e}"


def test_close_regime_detects_bf16_logits():
    """Negative control for the tolerance above: the same case with the logits rounded to bf16
    before the softmax (the fault docs/design.md §7 lists) has a far larger gradient error."""
    case = make_case(shape=(4, 8), ds=32, vocab=257, close=True, bias=True, dtype=BF16)
    ref, (xs64, ws64, bs64) = run_reference(case, "forward_kl", reduction="none", temperature=1.3)
    up = upstream_grad(ref)
    (g_ref,) = torch.autograd.grad(ref, [xs64], up)
    xs = case.xs.detach().double().requires_grad_()

    def logits(x, w, b):
        return ((x @ w.double().t() + b.double()).to(BF16).double()) / 1.3

    t = logits(case.xt.double(), case.wt, case.bt)
    s = logits(xs, case.ws.detach(), case.bs.detach())
    bad = F.kl_div(F.log_softmax(s, -1), F.log_softmax(t, -1), log_target=True, reduction="none").sum(-1)
    (g_bad,) = torch.autograd.grad(bad.reshape(ref.shape), [xs], up)
    assert rel_norm_err(g_bad, g_ref) > 5 * 6e-3


def test_jsd_endpoints_are_exactly_the_kls(backend):
    case = make_case(shape=(2, 5), bias=True, labels="some", seed=3)
    for beta, other in ((0.0, "forward_kl"), (1.0, "reverse_kl"), (0, "forward_kl"), (1, "reverse_kl")):
        for reduction in ("mean", "none"):
            opts = dict(temperature=2.7, reduction=reduction, chunk_V=8)
            j = run_loss(case, "jsd", backend, beta=beta, **opts)
            k = run_loss(case, other, backend, **opts)
            assert torch.equal(j, k), (beta, reduction)
            up = upstream_grad(j).to(j.dtype)
            gj = torch.autograd.grad(j, case.student_leaves(), up)
            gk = torch.autograd.grad(k, case.student_leaves(), up)
            assert all(torch.equal(a, b) for a, b in zip(gj, gk)), (beta, reduction)
        via_hidden = nb.hidden_loss(
            case.xs, case.xt, case.ws, case.wt, divergence="jsd", beta=beta, backend=backend, **case.kwargs()
        )
        assert torch.equal(via_hidden, run_loss(case, other, backend))


@pytest.mark.parametrize("beta", [1e-6, 1e-3, 1 - 1e-3, 1 - 1e-6])
def test_jsd_near_endpoints(backend, beta):
    """Near the ends jsd matches the reference (no NaN, no cancellation blow-up), stays within its
    bound h(beta) = -beta log beta - (1 - beta) log(1 - beta), and tends to 0 there (beta = 0 and 1
    are *defined* as the full KLs: a documented discontinuity). For a close student it behaves like
    beta * forward_kl (beta -> 0) or (1 - beta) * reverse_kl (beta -> 1)."""
    opts = dict(divergence="jsd", beta=beta, bias=True, chunk_V=8, temperature=0.5, reduction="none")
    check_against_reference(backend, F64, **opts)
    got = check_against_reference(backend, F32, **opts)
    h = -beta * math.log(beta) - (1 - beta) * math.log(1 - beta)
    assert (got.loss >= -1e-6).all() and (got.loss <= h * (1 + 1e-4) + 1e-6).all()
    side, kl = (beta, "forward_kl") if beta < 0.5 else (1 - beta, "reverse_kl")
    close = make_case(dtype=F64, close=True, bias=True, seed=4)
    slope = run_loss(close, "jsd", backend, beta=beta, reduction="none") / side
    assert_close(slope, run_loss(close, kl, backend, reduction="none"), Tol(20 * side + 1e-6, 0.0), "jsd / beta")


@pytest.mark.parametrize("name, limit", [("skew_kl", "forward_kl"), ("skew_reverse_kl", "reverse_kl")])
def test_skew_endpoints(backend, name, limit):
    """alpha=0 is the plain KL of the same direction; alpha=1 compares a distribution with itself."""
    case = make_case(shape=(9,), bias=True, labels="some", seed=5)
    opts = dict(temperature=0.5, reduction="none", chunk_V=8)
    s = run_loss(case, name, backend, alpha=0.0, **opts)
    k = run_loss(case, limit, backend, **opts)
    value_tol, grad_tol = TOLERANCES[F32]
    assert_close(s, k, value_tol, f"{name}(alpha=0)")
    up = upstream_grad(s).to(s.dtype)
    for gs, gk in zip(
        torch.autograd.grad(s, case.student_leaves(), up), torch.autograd.grad(k, case.student_leaves(), up)
    ):
        assert_close(gs, gk, grad_tol, f"{name}(alpha=0) grad")
    one = run_loss(case, name, backend, alpha=1.0, **opts)
    assert one.abs().max() < 1e-6
    for g in torch.autograd.grad(one.sum(), case.student_leaves()):
        assert g.abs().max() < 1e-5


@pytest.mark.parametrize("divergence", ["forward_kl", "jsd", "tvd"])
def test_no_silent_t2(backend, divergence):
    """The value is the divergence of the tempered distributions; scale_t2=True multiplies by T^2."""
    case = make_case(shape=(6,), labels="some", seed=7)
    for T in (0.5, 2.7):
        plain = check_against_reference(backend, F32, divergence=divergence, case=case, temperature=T)
        scaled = check_against_reference(backend, F32, divergence=divergence, case=case, temperature=T, scale_t2=True)
        assert_close(scaled.loss, plain.loss * T**2, Tol(1e-6, 1e-7), "scale_t2 value")
        for a, b in zip(scaled.grads, plain.grads):
            assert_close(a, b * T**2, Tol(1e-5, 1e-7), "scale_t2 grad")
    default = run_loss(case, divergence, backend, temperature=2.7)
    assert torch.equal(default, run_loss(case, divergence, backend, temperature=2.7, scale_t2=False))


def test_documented_defaults():
    params = inspect.signature(nb.hidden_loss).parameters
    assert params["ce_weight"].default == 0.0  # never a hidden CE term
    assert params["kd_weight"].default == 1.0
    assert params["temperature"].default == 1.0
    assert params["scale_t2"].default is False
    assert params["reduction"].default == "mean"
    assert DEFAULT_PARAM == {"jsd": 0.5, "skew_kl": 0.1, "skew_reverse_kl": 0.1}
    assert DEFAULT_PARAM == {d.name: d.default for d in dv.REGISTRY.values() if d.param is not None}
    assert "beta" not in params and params["params"].kind is inspect.Parameter.VAR_KEYWORD  # registry-owned
    for name in DIVERGENCES:
        exposed = set(inspect.signature(LOSS_FNS[name]).parameters)
        assert ("beta" in exposed) == (name == "jsd")
        assert ("alpha" in exposed) == (name in ("skew_kl", "skew_reverse_kl"))


def test_default_params_are_used(backend):
    case = make_case(seed=8)
    for name, value in DEFAULT_PARAM.items():
        assert torch.equal(run_loss(case, name, backend), run_loss(case, name, backend, **{PARAM_NAME[name]: value}))
    check_against_reference(backend, F32, divergence="skew_reverse_kl", case=case)  # reference uses 0.1


def _materialized_ce(case, reduction):
    z = case.xs.detach().double() @ case.ws.detach().double().t()
    if case.bs is not None:
        z = z + case.bs.detach().double()
    z = z.reshape(-1, z.shape[-1]).requires_grad_()
    ce = F.cross_entropy(z, case.labels.reshape(-1), ignore_index=case.ignore_index, reduction=reduction)
    return ce, z


@pytest.mark.parametrize("kd_weight, ce_weight", [(1.0, 0.0), (0.0, 1.0), (0.7, 0.3), (1.0, 2.5)])
@pytest.mark.parametrize("temperature", [1.0, 2.7])
def test_ce_term(backend, kd_weight, ce_weight, temperature):
    case = make_case(shape=(3, 4), bias=True, labels="some", seed=11)
    opts = dict(
        divergence="jsd", case=case, temperature=temperature, chunk_V=8, kd_weight=kd_weight, ce_weight=ce_weight
    )
    got = check_against_reference(backend, F32, **opts)
    # each term brings its own gradient: grads are linear in the two weights
    kd_only = check_against_reference(backend, F32, **{**opts, "kd_weight": 1.0, "ce_weight": 0.0})
    ce_only = check_against_reference(backend, F32, **{**opts, "kd_weight": 0.0, "ce_weight": 1.0})
    assert_close(got.loss, kd_weight * kd_only.loss + ce_weight * ce_only.loss, Tol(1e-5, 1e-6), "loss")
    for g, gk, gc in zip(got.grads, kd_only.grads, ce_only.grads):
        assert_close(g, kd_weight * gk + ce_weight * gc, Tol(1e-4, 1e-6), "grad linearity")
    assert all(g.abs().max() > 0 for g in ce_only.grads), "the CE term must have a gradient"
    # CE is F.cross_entropy on the materialized logits at temperature 1, whatever the temperature
    ce_ref, z = _materialized_ce(case, "mean")
    assert_close(ce_only.loss, ce_ref, Tol(1e-5, 1e-6), "CE vs F.cross_entropy")
    (gz,) = torch.autograd.grad(ce_ref * 0.75, [z])  # 0.75: the upstream used by the helper
    assert_close(ce_only.grads[2], gz.sum(0), Tol(1e-4, 1e-6), "CE bias grad")
    assert_close(
        ce_only.grads[0].reshape(gz.shape[0], -1), gz @ case.ws.detach().double(), Tol(1e-4, 1e-6), "CE xs grad"
    )


def test_int32_labels(backend):
    """int32 labels (accepted by the validation) give the same result as int64, CE included."""
    case = make_case(shape=(3, 4), bias=True, labels="some", seed=14)
    opts = dict(temperature=2.0, chunk_V=8, ce_weight=0.5, reduction="none")
    a = run_loss(case, "jsd", backend, **opts)
    b = run_loss(case, "jsd", backend, **{**opts, "labels": case.labels.int()})
    assert torch.equal(a, b)
    up = upstream_grad(a).float()
    for ga, gb in zip(
        torch.autograd.grad(a, case.student_leaves(), up), torch.autograd.grad(b, case.student_leaves(), up)
    ):
        assert torch.equal(ga, gb)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_return_parts(backend, reduction):
    case = make_case(shape=(2, 5), bias=True, labels="some", seed=12)
    T, kw, cw = 2.7, 0.6, 0.4
    opts = dict(temperature=T, reduction=reduction, kd_weight=kw, ce_weight=cw, scale_t2=True, chunk_V=8)
    got = check_against_reference(backend, F32, divergence="reverse_kl", case=case, return_parts=True, **opts)
    out = got.out
    assert isinstance(out, nb.DistillOutput) and isinstance(out, tuple) and len(out) == 3
    loss, kd, ce = out
    assert torch.equal(loss, run_loss(case, "reverse_kl", backend, **opts))
    assert not kd.requires_grad and not ce.requires_grad
    assert kd.shape == ce.shape == loss.shape
    # kd is the plain divergence and ce the plain cross-entropy, reduced the same way
    assert_close(kd, run_reference(case, "reverse_kl", temperature=T, reduction=reduction)[0], Tol(1e-4, 2e-5), "kd")
    ce_ref = _materialized_ce(case, "none" if reduction == "none" else reduction)[0]
    if reduction == "none":
        ce_ref = ce_ref.reshape(loss.shape)  # F.cross_entropy gives 0 at ignored rows too
    assert_close(ce, ce_ref, Tol(1e-4, 2e-5), "ce")
    assert_close(loss, kw * T**2 * kd + cw * ce, Tol(1e-5, 1e-6), "loss = kd_weight*T^2*kd + ce_weight*ce")
    plain = run_loss(case, "reverse_kl", backend, temperature=T, reduction=reduction, return_parts=True, chunk_V=8)
    assert torch.equal(plain.ce, torch.zeros_like(plain.ce)) and torch.equal(plain.loss, plain.kd)


@pytest.mark.parametrize("divergence", ["forward_kl", "skew_reverse_kl"])
def test_gradient_accumulation(backend, divergence):
    """sum over micro-batches / global count == mean over the whole batch (values and grads)."""
    case = make_case(shape=(12,), bias=True, labels="some", seed=13)
    opts = dict(temperature=2.0, chunk_V=8, ce_weight=0.5)
    full = run_loss(case, divergence, backend, reduction="mean", **opts)
    full_grads = torch.autograd.grad(full, case.student_leaves())
    count = case.counted()
    total, acc, naive = 0.0, None, None
    for part in (slice(0, 3), slice(3, 8), slice(8, 12)):
        kw = dict(case.kwargs(), labels=case.labels[part])
        args = (case.xs[part], case.xt[part], case.ws, case.wt)
        mb = LOSS_FNS[divergence](*args, backend=backend, reduction="sum", **kw, **opts) / count
        total = total + mb.detach()
        grads = torch.autograd.grad(mb, case.student_leaves())
        acc = grads if acc is None else [a + g for a, g in zip(acc, grads)]
        mean_mb = LOSS_FNS[divergence](*args, backend=backend, reduction="mean", **kw, **opts) / 3
        grads = torch.autograd.grad(mean_mb, case.student_leaves())
        naive = grads if naive is None else [a + g for a, g in zip(naive, grads)]
    assert_close(total, full, Tol(1e-5, 1e-6), "accumulated loss")
    for a, f in zip(acc, full_grads):
        assert_close(a, f, Tol(1e-4, 1e-6), "accumulated grad")
    # the per-micro-batch mean is wrong here (unequal counted rows per micro-batch)
    assert rel_norm_err(naive[1], full_grads[1]) > 1e-2


_FINITE_SIDES = {  # which -inf placements keep each divergence mathematically finite
    "forward_kl": ("both", "teacher"),
    "reverse_kl": ("both", "student"),
    "jsd": ("both", "teacher", "student"),
    "tvd": ("both", "teacher", "student"),
    "skew_kl": ("both", "teacher", "student"),
    "skew_reverse_kl": ("both", "teacher", "student"),
}


@pytest.mark.parametrize("divergence, side", [(d, s) for d, ss in _FINITE_SIDES.items() for s in ss])
def test_masked_vocab_minus_inf_bias(backend, divergence, side):
    """-inf biases on some vocab entries: finite loss and gradients equal to the limit (the same
    case with a bias of -1e4, where exp underflows to exactly 0 in float64), zero bias gradient
    at masked entries."""
    case = make_case(shape=(2, 4), bias=True, labels="some", seed=17)
    masked = torch.tensor([0, 5, 6, 20, 36])
    bs, bt = case.bs.detach().clone(), case.bt.clone()
    if side in ("both", "student"):
        bs[masked] = float("-inf")
    if side in ("both", "teacher"):
        bt[masked] = float("-inf")
    case.bs, case.bt = bs.requires_grad_(), bt
    opts = dict(temperature=0.7, chunk_V=8, reduction="none", **PARAMS.get(divergence, {}))
    loss = run_loss(case, divergence, backend, **opts)
    up = upstream_grad(loss).to(loss.dtype)
    grads = torch.autograd.grad(loss, case.student_leaves(), up)

    finite = make_case(shape=(2, 4), bias=True, labels="some", seed=17)
    finite.bs = torch.where(torch.isinf(bs), torch.tensor(-1e4, dtype=bs.dtype), bs).detach().requires_grad_()
    finite.bt = torch.where(torch.isinf(bt), torch.tensor(-1e4, dtype=bt.dtype), bt)
    ref, leaves = run_reference(finite, divergence, **opts)
    ref_grads = torch.autograd.grad(ref, leaves, up.double())
    value_tol, grad_tol = TOLERANCES[F32]
    assert_close(loss, ref, value_tol, "masked value")
    for name, g, rg in zip(("xs", "ws", "bs"), grads, ref_grads):
        assert_close(g, rg, grad_tol, f"masked grad {name}")
    if side in ("both", "student"):
        assert (grads[2][masked] == 0).all()


@pytest.mark.parametrize("divergence", DIVERGENCES)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_all_rows_ignored(backend, divergence, reduction):
    """No counted row: loss exactly 0 and every gradient exactly 0 (never NaN), CE on or off."""
    for ce_weight in (0.0, 0.5):
        got = check_against_reference(
            backend,
            F32,
            divergence=divergence,
            shape=(2, 3),
            bias=True,
            labels="all",
            reduction=reduction,
            ce_weight=ce_weight,
            temperature=2.0,
            chunk_V=16,
        )
        assert (got.loss == 0).all() and all((g == 0).all() for g in got.grads)


def test_leading_shapes_are_equivalent(backend):
    """[B, T, D] is [B*T, D] row by row; a 1-D [D] input is one row with a 0-d "none" result."""
    case = make_case(shape=(3, 4), ds=12, dt=20, bias=True, labels="some", seed=19)
    opts = dict(temperature=1.5, chunk_V=8, **case.kwargs())
    opts["labels"] = None
    rows3 = nb.tvd(case.xs, case.xt, case.ws, case.wt, reduction="none", backend=backend, **opts)
    rows2 = nb.tvd(
        case.xs.reshape(12, -1), case.xt.reshape(12, -1), case.ws, case.wt, reduction="none", backend=backend, **opts
    )
    assert rows3.shape == (3, 4) and rows2.shape == (12,)
    assert_close(rows3.reshape(-1), rows2, Tol(1e-6, 1e-7), "3-D vs 2-D")
    one = nb.tvd(case.xs[1, 2], case.xt[1, 2], case.ws, case.wt, reduction="none", backend=backend, **opts)
    assert one.shape == ()
    assert_close(one, rows3[1, 2], Tol(1e-6, 1e-7), "1-D row")
    single = Case(xs=case.xs[1, 2].detach().requires_grad_(), xt=case.xt[1, 2], ws=case.ws, wt=case.wt)
    check_against_reference(backend, F32, divergence="tvd", case=single, reduction="none", temperature=1.5)


def test_teacher_gets_no_gradient(backend):
    case = make_case(seed=21, bias=True)
    xt, wt = case.xt.clone().requires_grad_(), case.wt.clone().requires_grad_()
    loss = nb.forward_kl(case.xs, xt, case.ws, wt, bs=case.bs, bt=case.bt, backend=backend)
    loss.backward()
    assert xt.grad is None and wt.grad is None
    assert case.xs.grad is not None and case.ws.grad is not None and case.bs.grad is not None


def test_student_and_teacher_dtypes_may_differ(backend):
    """bf16 student with an fp32 teacher (each side shares one dtype)."""
    case = make_case(dtype=BF16, teacher_dtype=F32, ds=12, dt=20, bias=True, labels="some", seed=22)
    check_against_reference(backend, BF16, divergence="jsd", case=case, chunk_V=8, temperature=2.0)


def test_only_student_head_gradient_needed(backend):
    """Gradients of xs alone (ws frozen) and of ws alone match the reference."""
    case = make_case(seed=23)
    loss = run_loss(case, "reverse_kl", backend, chunk_V=8)
    ref, (xs64, ws64) = run_reference(case, "reverse_kl")
    (gx,) = torch.autograd.grad(loss, [case.xs], retain_graph=True)
    (gw,) = torch.autograd.grad(loss, [case.ws])
    rx, rw = torch.autograd.grad(ref, [xs64, ws64])
    assert_close(gx, rx, TOLERANCES[F32][1], "xs only")
    assert_close(gw, rw, TOLERANCES[F32][1], "ws only")
    frozen = make_case(seed=23)
    frozen.ws.requires_grad_(False)
    (gx2,) = torch.autograd.grad(run_loss(frozen, "reverse_kl", backend, chunk_V=8), [frozen.xs])
    assert torch.equal(gx2, gx)


MODULES = {
    "forward_kl": nb.ForwardKLLoss,
    "reverse_kl": nb.ReverseKLLoss,
    "jsd": nb.JSDLoss,
    "tvd": nb.TVDLoss,
    "skew_kl": nb.SkewKLLoss,
    "skew_reverse_kl": nb.SkewReverseKLLoss,
}


@pytest.mark.parametrize("divergence", DIVERGENCES)
def test_modules_match_functions(backend, divergence):
    cls = MODULES[divergence]
    assert issubclass(cls, nb.DistillLoss) and issubclass(cls, torch.nn.Module)
    assert cls.divergence == divergence
    case = make_case(shape=(2, 3), bias=True, labels="some", seed=24)
    opts = dict(
        temperature=2.7,
        reduction="sum",
        chunk_V=8,
        bs=case.bs,
        bt=case.bt,
        backend=backend,
        **PARAMS.get(divergence, {}),
    )
    module = cls(**opts)
    assert "temperature=2.7" in repr(module) and "reduction='sum'" in repr(module)
    got = module(case.xs, case.xt, case.ws, case.wt, case.labels)
    want = LOSS_FNS[divergence](case.xs, case.xt, case.ws, case.wt, labels=case.labels, **opts)
    assert torch.equal(got, want)
    up = torch.tensor(0.75)
    assert all(
        torch.equal(a, b)
        for a, b in zip(
            torch.autograd.grad(got, case.student_leaves(), up), torch.autograd.grad(want, case.student_leaves(), up)
        )
    )
    # per-call overrides win over the stored options
    over = module(case.xs, case.xt, case.ws, case.wt, labels=case.labels, reduction="none")
    assert torch.equal(
        over,
        LOSS_FNS[divergence](case.xs, case.xt, case.ws, case.wt, labels=case.labels, **{**opts, "reduction": "none"}),
    )
    # and against the float64 reference, through the module
    check_against_reference(
        backend,
        F32,
        divergence=divergence,
        case=case,
        temperature=2.7,
        reduction="sum",
        chunk_V=8,
        **PARAMS.get(divergence, {}),
    )


def test_generic_module_defaults_to_forward_kl(backend):
    case = make_case(seed=25)
    assert torch.equal(
        nb.DistillLoss(backend=backend)(case.xs, case.xt, case.ws, case.wt),
        nb.forward_kl(case.xs, case.xt, case.ws, case.wt, backend=backend),
    )
