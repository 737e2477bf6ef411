"""Every bad input to the hidden-state losses raises a clear error (each message is tested)."""

from __future__ import annotations

import math

import pytest
import torch

import nitrobrew as nb
from hidden_cases import DIVERGENCES, LOSS_FNS, make_case
from nitrobrew.core import checks as _checks

CASE = make_case(shape=(2, 3), ds=6, dt=10, vocab=11, bias=True, labels="some", seed=1)


def call(fn=nb.hidden_loss, **override):
    """fn on CASE (labels, biases) with `override` replacing arguments."""
    args = dict(xs=CASE.xs, xt=CASE.xt, ws=CASE.ws, wt=CASE.wt, labels=CASE.labels, bs=CASE.bs, bt=CASE.bt)
    args.update(override)
    xs, xt, ws, wt = (args.pop(k) for k in ("xs", "xt", "ws", "wt"))
    return fn(xs, xt, ws, wt, **args)


def test_the_base_call_works(backend):
    assert torch.isfinite(call(backend=backend))


def _det(t):
    return t.detach()


BAD = [
    # (id, overrides, error type, message pattern)
    (
        "lead-shapes",
        dict(xt=torch.randn(3, 2, 10)),
        ValueError,
        r"xs \(2, 3, 6\) and xt \(3, 2, 10\) must share their leading shape",
    ),
    ("lead-rank", dict(xt=torch.randn(6, 10)), ValueError, "must share their leading shape"),
    ("0-d-xs", dict(xs=torch.tensor(1.0), labels=None), ValueError, "must share their leading shape"),
    ("student-hidden", dict(xs=torch.randn(2, 3, 7)), ValueError, r"student hidden size 7 does not match ws \(11, 6\)"),
    (
        "teacher-hidden",
        dict(xt=torch.randn(2, 3, 6)),
        ValueError,
        r"teacher hidden size 6 does not match wt \(11, 10\)",
    ),
    ("head-3d", dict(ws=torch.randn(11, 6, 1)), ValueError, r"ws and wt must be 2-D \[V, D\] heads"),
    ("head-1d", dict(wt=torch.randn(10)), ValueError, r"ws and wt must be 2-D \[V, D\] heads"),
    (
        "vocab-mismatch",
        dict(wt=torch.randn(12, 10), bt=None),
        ValueError,
        r"student vocab 11 != teacher vocab 12: pass vocab_size=N .* \(never zero-pad a head\)",
    ),
    ("vocab-size-zero", dict(vocab_size=0), ValueError, r"vocab_size must be an int in \[1, 11\], got 0"),
    ("vocab-size-negative", dict(vocab_size=-3), ValueError, r"vocab_size must be an int in \[1, 11\], got -3"),
    ("vocab-size-too-big", dict(vocab_size=12), ValueError, r"vocab_size must be an int in \[1, 11\], got 12"),
    (
        "vocab-size-beyond-smaller-head",
        dict(wt=torch.randn(9, 10), bt=None, vocab_size=10),
        ValueError,
        r"vocab_size must be an int in \[1, 9\], got 10",
    ),
    ("vocab-size-float", dict(vocab_size=5.0), ValueError, r"vocab_size must be an int in \[1, 11\], got 5.0"),
    ("vocab-size-bool", dict(vocab_size=True), ValueError, r"vocab_size must be an int in \[1, 11\], got True"),
    ("bias-shape", dict(bs=torch.randn(12)), ValueError, r"bs must have shape \(11,\), got \(12,\)"),
    ("teacher-bias-shape", dict(bt=torch.randn(11, 1)), ValueError, r"bt must have shape \(11,\), got \(11, 1\)"),
    ("temperature-zero", dict(temperature=0), ValueError, "temperature must be a finite number > 0, got 0"),
    ("temperature-negative", dict(temperature=-1.5), ValueError, r"temperature must be a finite number > 0, got -1.5"),
    ("temperature-nan", dict(temperature=math.nan), ValueError, "temperature must be a finite number > 0, got nan"),
    ("temperature-inf", dict(temperature=math.inf), ValueError, "temperature must be a finite number > 0, got inf"),
    ("temperature-str", dict(temperature="2"), ValueError, "temperature must be a finite number > 0, got '2'"),
    ("temperature-bool", dict(temperature=True), ValueError, "temperature must be a finite number > 0, got True"),
    ("beta-low", dict(divergence="jsd", beta=-0.1), ValueError, r"beta must be in \[0, 1\], got -0.1"),
    ("beta-high", dict(divergence="jsd", beta=1.5), ValueError, r"beta must be in \[0, 1\], got 1.5"),
    ("beta-nan", dict(divergence="jsd", beta=math.nan), ValueError, r"beta must be in \[0, 1\], got nan"),
    ("alpha-low", dict(divergence="skew_kl", alpha=-1e-3), ValueError, r"alpha must be in \[0, 1\], got -0.001"),
    ("alpha-high", dict(divergence="skew_reverse_kl", alpha=1.01), ValueError, r"alpha must be in \[0, 1\], got 1.01"),
    ("alpha-none", dict(divergence="skew_kl", alpha=None), ValueError, r"alpha must be in \[0, 1\], got None"),
    ("divergence", dict(divergence="kl"), ValueError, r"unknown divergence 'kl'; choose from \["),
    ("reduction", dict(reduction="avg"), ValueError, r"reduction must be one of \('mean', 'sum', 'none'\), got 'avg'"),
    ("reduction-none-object", dict(reduction=None), ValueError, "reduction must be one of .*, got None"),
    ("backend", dict(backend="cuda"), ValueError, r"backend must be one of \('auto', 'torch', 'triton'\), got 'cuda'"),
    ("mode", dict(mode="constant-memory"), ValueError, r"mode must be None or one of \('fast', 'constant_memory'\)"),
    ("memory-budget", dict(memory_budget=0), ValueError, "memory_budget must be a positive number of bytes, got 0"),
    (
        "labels-shape",
        dict(labels=torch.zeros(6, dtype=torch.long)),
        ValueError,
        r"labels shape \(6,\) must equal the leading shape of the hidden states \(2, 3\)",
    ),
    (
        "labels-float",
        dict(labels=torch.zeros(2, 3)),
        TypeError,
        r"labels must be an integer tensor \(int64 or int32\), got torch.float32",
    ),
    (
        "labels-bool",
        dict(labels=torch.zeros(2, 3, dtype=torch.bool)),
        TypeError,
        "labels must be an integer tensor .*torch.bool",
    ),
    (
        "labels-int16",
        dict(labels=torch.zeros(2, 3, dtype=torch.int16), ce_weight=1.0),
        TypeError,
        "labels must be an integer tensor .*torch.int16",
    ),
    ("labels-list", dict(labels=[[0, 1, 2], [0, 1, 2]]), TypeError, "labels must be a torch.Tensor, got list"),
    (
        "device-xs",
        dict(xs=CASE.xs.detach().to("meta")),
        ValueError,
        "all tensors must be on one device, got xs on meta, xt on cpu",
    ),
    ("device-teacher-head", dict(wt=CASE.wt.to("meta")), ValueError, "all tensors must be on one device, .*wt on meta"),
    (
        "device-bias",
        dict(bs=CASE.bs.detach().to("meta")),
        ValueError,
        "all tensors must be on one device, .*bs on meta",
    ),
    (
        "device-labels",
        dict(labels=CASE.labels.to("meta")),
        ValueError,
        "all tensors must be on one device, .*labels on meta",
    ),
    (
        "dtype-student-head",
        dict(ws=_det(CASE.ws).to(torch.bfloat16)),
        TypeError,
        r"tensors must share one dtype \(cast them first\), got xs: torch.float32, ws: torch.bfloat16",
    ),
    ("dtype-student-bias", dict(bs=_det(CASE.bs).double()), TypeError, "must share one dtype .*bs: torch.float64"),
    (
        "dtype-teacher",
        dict(xt=CASE.xt.half()),
        TypeError,
        "must share one dtype .*xt: torch.float16, wt: torch.float32",
    ),
    (
        "int-hidden",
        dict(xs=torch.zeros(2, 3, 6, dtype=torch.long)),
        TypeError,
        "xs must be a floating-point tensor, got torch.int64",
    ),
    (
        "int-head",
        dict(wt=torch.zeros(11, 10, dtype=torch.int32)),
        TypeError,
        "wt must be a floating-point tensor, got torch.int32",
    ),
    ("not-a-tensor", dict(ws=[[0.0] * 6] * 11), TypeError, "ws must be a torch.Tensor, got list"),
    ("bias-not-a-tensor", dict(bt=[0.0] * 11), TypeError, "bt must be a torch.Tensor, got list"),
    ("ce-without-labels", dict(labels=None, ce_weight=0.5), ValueError, r"ce_weight != 0 needs labels"),
    (
        "labels-out-of-range",
        dict(labels=torch.tensor([[0, 11, 2], [3, 4, 5]]), ce_weight=0.5),
        ValueError,
        r"labels must lie in \[0, 11\) \(or equal ignore_index\), found values in \[0, 11\]",
    ),
    (
        "labels-negative",
        dict(labels=torch.tensor([[0, -1, 2], [3, 4, 5]]), ce_weight=0.5),
        ValueError,
        r"labels must lie in \[0, 11\) .*found values in \[-1, 5\]",
    ),
    (
        "labels-beyond-vocab-size",
        dict(labels=torch.tensor([[0, 9, 2], [3, 4, 5]]), ce_weight=0.5, vocab_size=9),
        ValueError,
        r"labels must lie in \[0, 9\)",
    ),
    (
        "labels-other-ignore-index",
        dict(labels=torch.tensor([[0, -100, 2], [3, 4, 5]]), ce_weight=0.5, ignore_index=-1),
        ValueError,
        r"found values in \[-100, 5\]",
    ),
    ("chunk-zero", dict(chunk_V=0), ValueError, "chunk_V must be a positive int or None, got 0"),
    ("chunk-negative", dict(chunk_V=-8), ValueError, "chunk_V must be a positive int or None, got -8"),
    ("chunk-float", dict(chunk_V=8.0), ValueError, "chunk_V must be a positive int or None, got 8.0"),
    ("chunk-bool", dict(chunk_V=True), ValueError, "chunk_V must be a positive int or None, got True"),
    ("kd-weight-nan", dict(kd_weight=math.nan), ValueError, "kd_weight must be a finite number, got nan"),
    ("ce-weight-inf", dict(ce_weight=math.inf), ValueError, "ce_weight must be a finite number, got inf"),
    ("ce-weight-str", dict(ce_weight="0.5"), ValueError, "ce_weight must be a finite number, got '0.5'"),
    ("kd-weight-bool", dict(kd_weight=True), ValueError, "kd_weight must be a finite number, got True"),
]


@pytest.mark.parametrize("override, exc, pattern", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_input_raises(backend, override, exc, pattern):
    with pytest.raises(exc, match=pattern):
        call(**{"backend": backend, **override})


@pytest.mark.parametrize(
    "override, exc, pattern",
    [b[1:] for b in BAD if "divergence" not in b[1]],
    ids=[b[0] for b in BAD if "divergence" not in b[1]],
)
def test_bad_input_raises_from_functions_and_modules(backend, override, exc, pattern):
    override = {"backend": backend, **override}
    with pytest.raises(exc, match=pattern):
        call(nb.tvd, **override)
    tensors = [override.pop(k, getattr(CASE, k)) for k in ("xs", "xt", "ws", "wt", "labels")]
    module = nb.TVDLoss(**{"bs": CASE.bs, "bt": CASE.bt, **override})
    with pytest.raises(exc, match=pattern):
        module(*tensors)


def test_errors_leave_no_gradient():
    """Validation happens before any computation: nothing reaches the inputs' .grad."""
    case = make_case(seed=2)
    with pytest.raises(ValueError):
        nb.forward_kl(case.xs, case.xt, case.ws, case.wt, temperature=0.0)
    assert case.xs.grad is None and case.ws.grad is None


@pytest.mark.parametrize(
    "divergence, bad",
    [
        ("forward_kl", "beta"),
        ("reverse_kl", "alpha"),
        ("tvd", "beta"),
        ("jsd", "alpha"),
        ("skew_kl", "beta"),
        ("skew_reverse_kl", "beta"),
    ],
)
def test_parameter_of_another_divergence_is_rejected(divergence, bad):
    """beta/alpha exist only where they mean something: passing one elsewhere is a TypeError,
    not a silently ignored option (nb.skew_kl(beta=...) would otherwise run with alpha=0.1)."""
    with pytest.raises(TypeError, match=f"unexpected keyword argument '{bad}'"):
        call(LOSS_FNS[divergence], **{bad: 0.3})


def test_unknown_keyword_is_rejected():
    with pytest.raises(TypeError, match="unexpected keyword argument 'temprature'"):
        call(nb.forward_kl, temprature=2.0)
    with pytest.raises(TypeError, match="unexpected keyword argument 'divergence'"):
        call(nb.forward_kl, divergence="jsd")


def test_labels_out_of_range_are_fine_without_ce():
    """Without the CE term labels only mark ignored rows; their values are not used as ids."""
    labels = torch.tensor([[0, 11, 2], [3, -100, 500]])
    assert torch.isfinite(call(labels=labels))


def test_triton_backend_on_cpu_needs_the_interpreter(monkeypatch):
    if not _checks.triton_available():
        with pytest.raises(RuntimeError, match=r"backend='triton' needs the triton package"):
            call(backend="triton")
        return
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(
        RuntimeError, match=r"backend='triton' on CPU tensors needs Triton's interpreter: set TRITON_INTERPRET=1"
    ):
        call(backend="triton")


@pytest.mark.parametrize("divergence", DIVERGENCES)
def test_every_function_validates(divergence):
    with pytest.raises(ValueError, match="temperature must be"):
        call(LOSS_FNS[divergence], temperature=-1.0)
    with pytest.raises(ValueError, match="must share their leading shape"):
        call(LOSS_FNS[divergence], xt=torch.randn(5, 10))


@pytest.mark.parametrize(
    "cls, options, pattern",
    [
        (nb.JSDLoss, dict(alpha=0.3), r"JSDLoss got unexpected options \['alpha'\]"),
        (nb.ForwardKLLoss, dict(divergence="jsd"), r"ForwardKLLoss got unexpected options \['divergence'\]"),
        (nb.SkewKLLoss, dict(beta=0.5, temprature=2.0), r"got unexpected options \['beta', 'temprature'\]"),
    ],
)
def test_module_rejects_options_of_other_losses(cls, options, pattern):
    with pytest.raises(TypeError, match=pattern):
        cls(**options)
