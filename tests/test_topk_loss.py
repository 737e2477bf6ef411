"""topk_kl (PyTorch backend) against the float64 reference; options, reductions and errors."""

import itertools
import math

import pytest
import torch

import nitrobrew
from nitrobrew.core.memory import TensorMemoryTracker
from nitrobrew.core.online import Online, merge_tails
from nitrobrew.core.reduction import combine_rows
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
    lp[2, K // 2 :] = float("-inf")  # a row with padding entries (their ids are garbage)
    ids[2, K // 2 :] = -7
    lp[4] = float("-inf")  # a row with no valid entry
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
    kw = dict(
        normalize=norm,
        divergence=div,
        tail=tail,
        labels=labels,
        temperature=1.7,
        ce_weight=0.4 if norm == "full" else 0.0,
        bs=bs,
    )
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
    (gw,) = torch.autograd.grad(out, [ws])
    touched = torch.zeros(500, dtype=torch.bool)
    touched[ids[torch.isfinite(lp)]] = True
    assert (gw[~touched] == 0).all() and (gw[touched].abs().sum(-1) > 0).any()


def test_full_memory_is_chunked():
    N, V = 40, 4000
    xs, ws, bs, ids, lp, labels = make(N=N, V=V, D=16, dtype=torch.float32)
    ws = ws.detach()  # dW itself is [V, D]: look at the working memory only
    with TensorMemoryTracker() as tr:
        out = topk_kl(xs, ws, ids, lp, chunk_V=256, labels=labels, ce_weight=0.5, backend="torch")
        (gx,) = torch.autograd.grad(out, [xs])
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
    parts = topk_kl(
        xs,
        ws,
        ids,
        lp,
        labels=labels,
        kd_weight=0.7,
        ce_weight=0.3,
        temperature=2.0,
        scale_t2=True,
        return_parts=True,
        backend="torch",
    )
    assert isinstance(parts, nitrobrew.DistillOutput)
    torch.testing.assert_close(parts.loss, 0.7 * 4.0 * parts.kd + 0.3 * parts.ce)
    ref = reference_topk_loss(
        xs, ws, ids, lp, labels=labels, kd_weight=0.7, ce_weight=0.3, temperature=2.0, scale_t2=True, return_parts=True
    )
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


def test_whole_vocab_ids_drop_the_tail_bucket_like_the_reference():
    """Where a row's valid ids cover the vocabulary the student has no tail: the bucket is dropped on
    both sides (here the teacher's stored mass is 0.9, so keeping it would give an infinite KL)."""
    g = torch.Generator().manual_seed(4)
    N, D, V = 4, 6, 9
    xs = torch.randn(N, D, generator=g, dtype=torch.float64, requires_grad=True)
    ws = torch.randn(V, D, generator=g, dtype=torch.float64, requires_grad=True)
    lp, ids = (torch.log_softmax(torch.randn(N, V, generator=g, dtype=torch.float64), -1) + math.log(0.9)).topk(V, -1)
    lp[1, -2:] = float("-inf")  # this row keeps two outside ids: its tail counts
    out = topk_kl(xs, ws, ids, lp, tail=True, reduction="none", backend="torch", chunk_V=4)
    ref = reference_topk_loss(xs, ws, ids, lp, tail=True, reduction="none")
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-12)
    up = torch.rand(N, generator=g, dtype=torch.float64)
    for a, b in zip(_grads((out * up).sum(), [xs, ws]), _grads((ref * up).sum(), [xs, ws])):
        assert torch.isfinite(a).all() and _rel(a, b) < 1e-9


# --- the student's tail when the top-k holds all but a sliver of its mass ---------------------------


def old_tail_logprob(xs, ws, bs, ids, temperature=1.0):
    """log(1 - sum_k q_k) in the working dtype, the formula that cancels (for the tests to show it)."""
    s = (xs.detach().float() @ ws.detach().float().t() + (0 if bs is None else bs.detach().float())) / temperature
    lq = s.gather(1, ids) - torch.logsumexp(s, -1, keepdim=True)
    return log1mexp(torch.logsumexp(lq, -1)).double()


def exact_tail_logprob(xs, ws, bs, ids, temperature=1.0):
    """float64 logsumexp over the ids outside the top-k minus the full one."""
    s = (xs.detach().double() @ ws.detach().double().t() + (0 if bs is None else bs.detach().double())) / temperature
    outside = s.scatter(1, ids, float("-inf"))
    return torch.logsumexp(outside, -1) - torch.logsumexp(s, -1)


def saturated_case(N=7, D=12, V=41, K=5, dtype=torch.float32, first_hot=3, gap=23.0, seed=0):
    """The student puts all but ~1e-9 of its mass (far below fp32 eps) on K clustered "hot" ids
    [first_hot, first_hot + K), which are the teacher's top-k of every row (in a per-row order); the
    teacher keeps 1-10% outside them. Cold logits sit ``gap`` below the hot ones (through the bias)."""
    g = torch.Generator().manual_seed(seed)
    xs = torch.randn(N, D, generator=g).to(dtype)
    ws = (torch.randn(V, D, generator=g) * 0.3).to(dtype)
    hot = torch.arange(first_hot, first_hot + K)
    bs = torch.full((V,), -gap)
    bs[hot] = 0.0
    bs = bs.to(dtype)
    ids = hot[torch.argsort(torch.rand(N, K, generator=g), -1)]
    p_tail = 0.01 + 0.09 * torch.rand(N, 1, generator=g, dtype=torch.float64)
    lp = torch.log_softmax(torch.randn(N, K, generator=g, dtype=torch.float64) * 2, -1) + torch.log1p(-p_tail)
    return xs.requires_grad_(), ws.requires_grad_(), bs.requires_grad_(), ids, lp.float(), hot


def check_saturated(xs, ws, bs, ids, hot, temperature=1.0):
    """The regime holds (q_tail in [1e-12, 1e-7]) and the old formula is visibly wrong in it."""
    exact = exact_tail_logprob(xs, ws, bs, ids, temperature)
    assert ((exact > math.log(1e-12)) & (exact < math.log(1e-7))).all(), exact.exp()
    old = old_tail_logprob(xs, ws, bs, ids, temperature)
    assert not ((old - exact).abs() < 1.0).any(), (old, exact)  # -inf or off by > 1 nat (counts NaN too)
    cold = torch.ones(ws.shape[0], dtype=torch.bool)
    cold[hot] = False
    return cold


def _mp_logit_grad(s, k: int, lp_k: float, div: str, beta: float):
    """d D / d s of one row with one stored id k and the tail bucket, in 60-digit arithmetic."""
    mp = pytest.importorskip("mpmath")
    mp.mp.dps = 60
    beta = mp.mpf(beta)

    def phi(a, b):  # a = log p, b = log q
        p, q = mp.e**a, mp.e**b
        if div == "forward_kl":
            return p * (a - b)
        if div == "reverse_kl":
            return q * (b - a)
        m = mp.log(beta * p + (1 - beta) * q)
        return beta * p * (a - m) + (1 - beta) * q * (b - m)

    lp = mp.mpf(lp_k)
    lp_t = mp.log(1 - mp.e**lp)

    def loss(*z):
        L = mp.log(sum(mp.e**zj for zj in z))
        rest = mp.log(sum(mp.e**zj for j, zj in enumerate(z) if j != k))
        return phi(lp, z[k] - L) + phi(lp_t, rest - L)

    s = [mp.mpf(float(v)) for v in s]
    return torch.tensor(
        [float(mp.diff(lambda t, j=j: loss(*(s[:j] + [t] + s[j + 1 :])), s[j])) for j in range(len(s))],
        dtype=torch.float64,
    )


def test_tail_of_a_peaked_student_float64():
    """q_tail ~ 1e-18, below even float64 eps (n=1, d=9, v=2, k=1, T=0.5: reference 2.2621). The
    gradient, ~1e-16 here, is checked against 60-digit arithmetic: the reference's autograd (the
    plain u_k - q_k sum u at q_k = 1 - 1e-18) loses it for jsd and reverse_kl."""
    g = torch.Generator().manual_seed(0)
    xs = torch.randn(1, 9, generator=g, dtype=torch.float64)
    ws = torch.randn(2, 9, generator=g, dtype=torch.float64) * 2
    lp, ids = torch.log_softmax(torch.randn(1, 2, generator=g, dtype=torch.float64) * 4, -1).topk(1, -1)
    xs.requires_grad_()
    ws.requires_grad_()
    exact = exact_tail_logprob(xs, ws, None, ids, 0.5)
    assert exact.item() < -40 and torch.isinf(old_tail_logprob(xs.double(), ws, None, ids, 0.5)).all()
    s = (xs.detach() @ ws.detach().t())[0] / 0.5
    for div in ("forward_kl", "jsd", "reverse_kl"):
        kw = dict(tail=True, temperature=0.5, divergence=div)
        out = topk_kl(xs, ws, ids, lp, backend="torch", chunk_V=1, beta=0.3, **kw)
        ref = reference_topk_loss(xs, ws, ids, lp, param=0.3, **kw)
        assert abs(out.item() - ref.item()) <= 1e-12 * max(1.0, abs(ref.item())), (div, out.item(), ref.item())
        gx, gw = _grads(out, [xs, ws])
        if div == "forward_kl":
            assert ref.item() == pytest.approx(2.2621, abs=1e-4)
            rx, rw = _grads(ref, [xs, ws])
            assert _rel(gx, rx) < 1e-9 and _rel(gw, rw) < 1e-9
        g_s = _mp_logit_grad(s, int(ids[0, 0]), float(lp[0, 0]), div, 0.3)
        assert _rel(gx[0], g_s @ ws.detach() / 0.5) < 1e-9, div
        assert _rel(gw, g_s[:, None] * xs.detach() / 0.5) < 1e-9, div


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("div,K", [("forward_kl", 5), ("jsd", 5), ("reverse_kl", 1), ("jsd", 1)])
def test_tail_of_a_saturated_student_low_precision(dtype, div, K):
    """K = 1: one id holds all but ~1e-9 of the student's mass, where the gradient's plain form
    u_k - q_k sum u cancels to nothing for jsd and reverse_kl (it gave 100% error here)."""
    xs, ws, bs, ids, lp, hot = saturated_case(dtype=dtype, K=K)
    cold = check_saturated(xs, ws, bs, ids, hot)
    kw = dict(tail=True, divergence=div, beta=0.3, bs=bs, reduction="none")
    out = topk_kl(xs, ws, ids, lp, backend="torch", chunk_V=16, **kw)
    ref = reference_topk_loss(xs, ws, ids, lp, param=0.3, **{k: v for k, v in kw.items() if k != "beta"})
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-6)
    up = torch.rand(out.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    grads = _grads((out * up.float()).sum(), [xs, ws, bs])
    want = _grads((ref * up).sum(), [xs, ws, bs])
    tol = 1e-4 if dtype == torch.float32 else 1e-2  # bf16 gradients are rounded to bf16
    for a, b in zip(grads, want):
        assert a.dtype == dtype and _rel(a, b) < tol
    # the tail's own gradient: the head rows and biases of the ids outside the top-k
    assert _rel(grads[1][cold], want[1][cold]) < tol and _rel(grads[2][cold], want[2][cold]) < tol


def merge_states(states):
    """Online states of disjoint vocab ranges merged (max first, then rescaled sums), as ranks merge."""
    m = states[0].m
    for st in states[1:]:
        m = torch.maximum(m, st.m)
    return Online(m, merge_tails([st.m for st in states], [st.tail for st in states], m))


def test_tail_vocab_range_pieces_merge_to_the_whole():
    """The pieces a vocab-parallel wrapper uses (vocab_pass per range, merge_states + summed id
    logits, finish, backward_range per range, summed dX): the same losses and gradients as one call,
    in the saturated regime."""
    from nitrobrew.topk import chunked as tc
    from nitrobrew.topk.rowmath import TopKConfig

    xs, ws, bs, ids, lp, hot = saturated_case(V=45, K=6, first_hot=14)  # the hot ids straddle a cut
    check_saturated(xs, ws, bs, ids, hot)
    x, w, b = xs.detach(), ws.detach(), bs.detach()
    N = x.shape[0]
    labels = torch.randint(0, 45, (N,), generator=torch.Generator().manual_seed(2))
    cfg = TopKConfig("forward_kl", 0.0, "full", True, 1.3, 1.0, 0.4)
    valid = torch.isfinite(lp)
    entries = tc.Entries.build(ids, valid)
    cuts = [0, 17, 30, 45]
    parts = [
        tc.vocab_pass(x, w[lo:hi], b[lo:hi], labels, entries, cfg, lo=lo, chunk=5) for lo, hi in zip(cuts, cuts[1:])
    ]
    s_state, z_state = merge_states([p.s for p in parts]), merge_states([p.z for p in parts])
    res, lse_z, ce = tc.finish(
        sum(p.z_ids for p in parts), lp, valid, s_state, z_state, sum(p.z_label for p in parts), cfg
    )
    mask = torch.ones(N)
    total = combine_rows(res.kd, ce, mask, cfg)[0]
    want = reference_topk_loss(
        xs, ws, ids, lp, bs=bs, tail=True, temperature=1.3, labels=labels, ce_weight=0.4, reduction="none"
    )
    torch.testing.assert_close(total.double(), want, rtol=1e-5, atol=1e-6)
    up = torch.rand(N, generator=torch.Generator().manual_seed(3))
    coef, dense, ce_scale = tc.row_coefficients(up, mask, res, cfg)
    pieces = [
        tc.backward_range(x, w[lo:hi], b[lo:hi], labels, entries, coef, dense, lse_z, ce_scale, cfg, lo=lo, chunk=4)
        for lo, hi in zip(cuts, cuts[1:])
    ]
    gx = sum(p[0] for p in pieces)
    gw = torch.cat([p[1] for p in pieces])
    gb = torch.cat([p[2] for p in pieces])
    rx, rw, rb = _grads((want * up.double()).sum(), [xs, ws, bs])
    assert _rel(gx, rx) < 1e-4 and _rel(gw, rw) < 1e-4 and _rel(gb, rb) < 1e-4


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
        (dict(mode="fastest"), ValueError, "mode must be None or one of"),
        (dict(memory_budget=0), ValueError, "memory_budget must be a positive number of bytes"),
        (dict(memory_budget=1.5), ValueError, "memory_budget must be a positive number of bytes"),
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
    from hypothesis import example, given, settings
    from hypothesis import strategies as st
except ImportError:  # pragma: no cover
    given = None

if given is not None:

    @settings(max_examples=12, deadline=None)
    @given(
        n=st.integers(1, 9),
        d=st.integers(1, 12),
        v=st.integers(2, 40),
        k=st.integers(1, 6),
        lead2=st.booleans(),
        combo=st.sampled_from(list(combos())),
        temperature=st.floats(0.3, 3.0),
        reduction=st.sampled_from(["mean", "sum", "none"]),
        seed=st.integers(0, 2**16),
    )
    # a student whose tail mass (~1e-18) is below float64 eps: 1 - sum_k q_k used to cancel to 0
    @example(
        n=1, d=9, v=2, k=1, lead2=False, combo=("forward_kl", "full", True), temperature=0.5, reduction="mean", seed=0
    )
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
