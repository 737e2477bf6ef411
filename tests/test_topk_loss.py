"""topk_kl (PyTorch backend) against the float64 reference; options, reductions and errors."""
import itertools

import pytest
import torch

import nitrobrew
from nitrobrew._memory import TensorMemoryTracker
from nitrobrew.topk import reference_topk_loss, topk_kl
from nitrobrew.topk.rowmath import log1mexp

DIVS = ["forward_kl", "reverse_kl", "jsd", "tvd", "skew_kl", "skew_reverse_kl"]


def make(N=11, D=20, V=61, K=6, dtype=torch.float64, close=False, seed=0, lead=None):
    g = torch.Generator().manual_seed(seed)
    xs = torch.randn(N, D, generator=g, dtype=dtype)
    ws = torch.randn(V, D, generator=g, dtype=dtype) * 1.6  # logits spread ~ tens of units
    bs = torch.randn(V, generator=g, dtype=dtype)
    if close:
        t = (xs @ ws.t()).double() + 0.3 * torch.randn(N, V, generator=g, dtype=torch.float64)
    else:
        t = torch.randn(N, V, generator=g, dtype=torch.float64) * 5
    lp, ids = torch.log_softmax(t, -1).topk(K, -1)
    lp = lp.clone()
    lp[2, K // 2:] = float("-inf")  # a row with padding entries (their ids are garbage)
    ids[2, K // 2:] = -7
    lp[4] = float("-inf")           # a row with no valid entry
    labels = torch.randint(0, V, (N,), generator=g)
    labels[1] = -100
    if lead is not None:
        xs, ids, lp, labels = xs.reshape(*lead, D), ids.reshape(*lead, K), lp.reshape(*lead, K), labels.reshape(lead)
    return xs.requires_grad_(), ws.requires_grad_(), bs.requires_grad_(), ids, lp.float(), labels


def combos():
    for div, norm, tail in itertools.product(DIVS, ["full", "topk"], [False, True]):
        if tail and norm == "topk":
            continue
        if div != "forward_kl" and norm == "full" and not tail:
            continue
        yield div, norm, tail


def _grads(loss, ts):
    return torch.autograd.grad(loss, ts)


def _rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


@pytest.mark.parametrize("div,norm,tail", list(combos()))
@pytest.mark.parametrize("close", [False, True])
def test_matches_reference_float64(div, norm, tail, close):
    xs, ws, bs, ids, lp, labels = make(close=close)
    param = 0.3 if div == "jsd" else 0.2
    kw = dict(normalize=norm, divergence=div, tail=tail, labels=labels, temperature=1.7,
              ce_weight=0.4 if norm == "full" else 0.0, bs=bs)
    out = topk_kl(xs, ws, ids, lp, backend="torch", chunk_V=16, beta=param, alpha=param, **kw)
    ref = reference_topk_loss(xs, ws, ids, lp, param=param, **kw)
    assert out.dtype == torch.float64
    assert abs(out.item() - ref.item()) <= 1e-10 * max(1.0, abs(ref.item()))
    for a, b in zip(_grads(out, [xs, ws, bs]), _grads(ref, [xs, ws, bs])):
        assert _rel(a, b) < 1e-9


@pytest.mark.parametrize("norm", ["full", "topk"])
def test_float32_and_bf16_inputs(norm):
    xs, ws, bs, ids, lp, labels = make(dtype=torch.float32, close=True)
    ref = reference_topk_loss(xs, ws, ids, lp, normalize=norm, labels=labels)
    out = topk_kl(xs, ws, ids, lp, normalize=norm, labels=labels, backend="torch")
    assert out.dtype == torch.float32
    assert abs(out.item() - ref.item()) <= 1e-5 * max(1.0, abs(ref.item()))
    for a, b in zip(_grads(out, [xs, ws]), _grads(ref, [xs, ws])):
        assert _rel(a, b) < 1e-4  # close case: q - p cancels to ~1e-4 of q
    xb, wb = xs.detach().bfloat16().requires_grad_(), ws.detach().bfloat16().requires_grad_()
    outb = topk_kl(xb, wb, ids, lp, normalize=norm, labels=labels, backend="torch")
    refb = reference_topk_loss(xb, wb, ids, lp, normalize=norm, labels=labels)
    assert outb.dtype == torch.float32
    assert abs(outb.item() - refb.item()) <= 1e-4 * max(1.0, abs(refb.item()))  # fp32 math on bf16 values
    gx, gw = _grads(outb, [xb, wb])
    rx, rw = _grads(refb, [xb, wb])
    assert gx.dtype == torch.bfloat16 and _rel(gx, rx) < 1e-2 and _rel(gw, rw) < 1e-2


def test_definition_forward_kl_full():
    """The value is sum_k p_k (log p_k - log q_k) with p as stored and q the full softmax."""
    xs, ws, _, ids, lp, _ = make()
    T = 2.0
    out = topk_kl(xs, ws, ids, lp, temperature=T, reduction="none", backend="torch")
    lq = torch.log_softmax((xs @ ws.t()) / T, -1)
    valid = torch.isfinite(lp)
    safe = torch.where(valid, ids, 0)
    p = torch.where(valid, lp.double().exp(), torch.zeros(()).double())
    want = (p * (torch.where(valid, lp.double(), 0) - lq.gather(1, safe))).sum(-1)
    torch.testing.assert_close(out.detach(), want.detach())
    assert out[4] == 0  # no valid entry: contributes nothing


def test_topk_normalize_reads_only_k_rows():
    """normalize="topk": only the K gathered rows of ws get gradient, and no [rows, V] tensor exists."""
    xs, ws, _, ids, lp, _ = make(N=7, V=500)
    with TensorMemoryTracker() as tr:
        out = topk_kl(xs, ws, ids, lp, normalize="topk", backend="torch")
    assert tr.largest < 7 * 500 * 8
    gw, = torch.autograd.grad(out, [ws])
    touched = torch.zeros(500, dtype=torch.bool)
    touched[ids[torch.isfinite(lp)]] = True
    assert (gw[~touched] == 0).all() and (gw[touched].abs().sum(-1) > 0).any()


def test_full_memory_is_chunked():
    N, V = 40, 4000
    xs, ws, bs, ids, lp, labels = make(N=N, V=V, D=16, dtype=torch.float32)
    ws = ws.detach()  # dW itself is [V, D]: look at the working memory only
    with TensorMemoryTracker() as tr:
        out = topk_kl(xs, ws, ids, lp, chunk_V=256, labels=labels, ce_weight=0.5, backend="torch")
        gx, = torch.autograd.grad(out, [xs])
    assert tr.largest < N * V * 4 / 4, tr.largest_shape  # no [rows, V] buffer


def test_reductions_ignore_and_no_counted_rows():
    xs, ws, bs, ids, lp, labels = make(lead=(1, 11))
    none = topk_kl(xs, ws, ids, lp, labels=labels, reduction="none", backend="torch")
    assert none.shape == (1, 11) and none[0, 1] == 0
    s = topk_kl(xs, ws, ids, lp, labels=labels, reduction="sum", backend="torch")
    m = topk_kl(xs, ws, ids, lp, labels=labels, reduction="mean", backend="torch")
    torch.testing.assert_close(s, none.sum())
    torch.testing.assert_close(m, none.sum() / 10)
    ign = torch.full_like(labels, -100)
    z = topk_kl(xs, ws, ids, lp, labels=ign, ce_weight=1.0, backend="torch")
    assert z.item() == 0
    gx, gw = torch.autograd.grad(z, [xs, ws])
    assert torch.isfinite(gx).all() and (gx == 0).all() and (gw == 0).all()


def test_return_parts_and_weights_and_t2():
    xs, ws, bs, ids, lp, labels = make()
    parts = topk_kl(xs, ws, ids, lp, labels=labels, kd_weight=0.7, ce_weight=0.3, temperature=2.0,
                    scale_t2=True, return_parts=True, backend="torch")
    assert isinstance(parts, nitrobrew.DistillOutput)
    torch.testing.assert_close(parts.loss, 0.7 * 4.0 * parts.kd + 0.3 * parts.ce)
    ref = reference_topk_loss(xs, ws, ids, lp, labels=labels, kd_weight=0.7, ce_weight=0.3, temperature=2.0,
                              scale_t2=True, return_parts=True)
    for a, b in zip(parts, ref):
        torch.testing.assert_close(a, b)
    assert not parts.kd.requires_grad and parts.loss.requires_grad


def test_lazy_export_and_tail_identity():
    assert nitrobrew.topk_kl is topk_kl
    # log(1 - e^x): accurate near 0 (where log1p(-exp(x)) loses everything) and far below it
    x = torch.tensor([-1e-12, -1e-5, -0.5, -3.0, -50.0, 0.0], dtype=torch.float64)
    got = log1mexp(x)
    torch.testing.assert_close(got[:3], torch.log(-torch.expm1(x[:3])), rtol=1e-13, atol=0)
    torch.testing.assert_close(got[3:5], torch.log1p(-torch.exp(x[3:5])), rtol=1e-13, atol=0)
    assert got[0] == pytest.approx(-27.631021115928547, rel=1e-12) and got[-1] == float("-inf")


def test_whole_vocab_top_k_is_the_exact_kl():
    """With K = V the stored top-k is the whole teacher: every mode gives the full-vocab KL."""
    g = torch.Generator().manual_seed(3)
    N, D, V = 5, 12, 17
    xs = torch.randn(N, D, generator=g, dtype=torch.float64, requires_grad=True)
    ws = torch.randn(V, D, generator=g, dtype=torch.float64, requires_grad=True)
    t = torch.randn(N, V, generator=g, dtype=torch.float64) * 3
    lp, ids = torch.log_softmax(t, -1).topk(V, -1)
    want = (lp.exp() * (lp - torch.log_softmax(xs @ ws.t(), -1).gather(1, ids))).sum(-1).mean()
    for norm, tail in (("full", False), ("topk", False), ("full", True)):
        out = topk_kl(xs, ws, ids, lp, normalize=norm, tail=tail, backend="torch")
        torch.testing.assert_close(out, want)


@pytest.mark.parametrize(
    "kwargs,exc,match",
    [
        (dict(ids=torch.full((11, 6), 61)), ValueError, r"topk_ids .* must lie in \[0, 61\)"),
        (dict(ids=torch.full((11, 6), -1)), ValueError, r"must lie in \[0, 61\)"),
        (dict(ids=torch.zeros(11, 5, dtype=torch.long)), ValueError, "must have the same shape"),
        (dict(ids=torch.zeros(10, 6, dtype=torch.long), lp=torch.zeros(10, 6)), ValueError, "leading shape"),
        (dict(ids=torch.zeros(11, 6)), TypeError, "integer tensor"),
        (dict(lp=torch.full((11, 6), float("nan"))), ValueError, "NaN or \\+inf"),
        (dict(temperature=0.0), ValueError, "temperature"),
        (dict(temperature=-1.0), ValueError, "temperature"),
        (dict(teacher_temperature=2.0), ValueError, "re-tempered"),
        (dict(normalize="nope"), ValueError, "normalize must be one of"),
        (dict(normalize="topk", tail=True), ValueError, "tail=True needs normalize='full'"),
        (dict(divergence="reverse_kl"), ValueError, "compares distributions"),
        (dict(divergence="bogus", normalize="topk"), ValueError, "unknown divergence"),
        (dict(normalize="topk", ce_weight=1.0), ValueError, "needs normalize='full'"),
        (dict(ce_weight=1.0, labels=None), ValueError, "needs labels"),
        (dict(reduction="avg"), ValueError, "reduction"),
        (dict(backend="cuda"), ValueError, "backend"),
        (dict(chunk_V=0), ValueError, "chunk_V"),
        (dict(kd_weight=float("nan")), ValueError, "kd_weight"),
        (dict(divergence="jsd", beta=1.5, normalize="topk"), ValueError, "beta"),
        (dict(bs=torch.zeros(60, dtype=torch.float64)), ValueError, "bs must have shape"),
        (dict(ws=torch.zeros(61, 19, dtype=torch.float64)), ValueError, "ws must be a"),
        (dict(ws=torch.zeros(61, 20, dtype=torch.float32)), TypeError, "share one dtype"),
        (dict(labels=torch.zeros(10, dtype=torch.long)), ValueError, "labels shape"),
        (dict(labels=torch.full((11,), 99), ce_weight=1.0), ValueError, r"labels must lie in"),
        (dict(xs=[1.0]), TypeError, "xs must be a torch.Tensor"),
    ],
)
def test_errors(kwargs, exc, match):
    xs, ws, bs, ids, lp, labels = make()
    kwargs = dict(kwargs)
    kwargs.setdefault("backend", "torch")
    args = dict(xs=xs, ws=ws, ids=ids, lp=lp, labels=labels)
    for k in ("xs", "ws", "ids", "lp"):
        if k in kwargs:
            args[k] = kwargs.pop(k)
    if "labels" in kwargs:
        args["labels"] = kwargs.pop("labels")
    with pytest.raises(exc, match=match):
        topk_kl(args["xs"], args["ws"], args["ids"], args["lp"], labels=args["labels"], **kwargs)


def test_padding_ids_are_ignored_even_out_of_range():
    xs, ws, bs, ids, lp, labels = make()
    ids2 = ids.clone()
    ids2[~torch.isfinite(lp)] = 10**6
    a = topk_kl(xs, ws, ids, lp, backend="torch")
    b = topk_kl(xs, ws, ids2, lp, backend="torch")
    torch.testing.assert_close(a, b)


try:
    from hypothesis import given, settings
    from hypothesis import strategies as st
except ImportError:  # pragma: no cover
    given = None

if given is not None:
    @settings(max_examples=12, deadline=None)
    @given(n=st.integers(1, 9), d=st.integers(1, 12), v=st.integers(2, 40), k=st.integers(1, 6),
           lead2=st.booleans(), combo=st.sampled_from(list(combos())), temperature=st.floats(0.3, 3.0),
           reduction=st.sampled_from(["mean", "sum", "none"]), seed=st.integers(0, 2**16))
    def test_property_shapes_and_options(n, d, v, k, lead2, combo, temperature, reduction, seed):
        div, norm, tail = combo
        k = min(k, v)
        g = torch.Generator().manual_seed(seed)
        xs = torch.randn(n, d, generator=g, dtype=torch.float64)
        ws = torch.randn(v, d, generator=g, dtype=torch.float64) * 2
        lp, ids = torch.log_softmax(torch.randn(n, v, generator=g, dtype=torch.float64) * 4, -1).topk(k, -1)
        lp[torch.rand(n, k, generator=g) < 0.2] = float("-inf")
        lead = (1, n) if lead2 else (n,)
        xs, ids, lp = xs.reshape(*lead, d).requires_grad_(), ids.reshape(*lead, k), lp.reshape(*lead, k)
        ws.requires_grad_()
        kw = dict(normalize=norm, divergence=div, tail=tail, temperature=temperature, reduction=reduction)
        out = topk_kl(xs, ws, ids, lp, backend="torch", chunk_V=7, beta=0.4, alpha=0.3, **kw)
        ref = reference_topk_loss(xs, ws, ids, lp, param=0.4 if div == "jsd" else 0.3, **kw)
        assert out.shape == ref.shape == (lead if reduction == "none" else ())
        torch.testing.assert_close(out, ref, rtol=1e-9, atol=1e-10)
        up = torch.ones_like(ref)
        for a, b in zip(torch.autograd.grad(out, [xs, ws], up), torch.autograd.grad(ref, [xs, ws], up)):
            torch.testing.assert_close(a, b, rtol=1e-8, atol=1e-10)
