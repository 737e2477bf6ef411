"""Confident rows: a top probability within ~1e-7 of 1 (a 10-20 nat gap to the next logit, or a smaller
one at a cold temperature). In float32 p_top and q_top both round to 1 there, and any difference of
near-1 quantities loses the top token's term (docs/design.md §2.6). Every divergence on every path
(PyTorch, Triton fast and constant-memory modes, the Triton ones interpreted on CPU) must keep it:
per-row values within 1e-3 relative of float64 (1e-12 absolute floor), never negative, per-row
gradients within 1e-2. Identity heads make the logits exact in float32, so float64 of the same inputs
is the reference."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import nitrobrew as nb
from hidden_cases import DIVERGENCES, LOSS_FNS, PARAM_NAME
from nitrobrew import divergences as dv

PATHS = [("torch", None), ("triton", "fast"), ("triton", "constant_memory")]
PATH_IDS = ["torch", "triton-fast", "triton-cm"]
VALUE_RTOL, VALUE_FLOOR = 1e-3, 1e-12
GRAD_RTOL, GRAD_FLOOR = 1e-2, 1e-12


def _opts(path, divergence, param=None, **kw):
    backend, mode = path
    opts = dict(backend=backend, **kw)
    if mode is not None:
        opts["mode"] = mode
    if mode == "constant_memory":
        opts["chunk_V"] = 32  # several vocab chunks, the last one ragged
    if divergence in PARAM_NAME:
        opts[PARAM_NAME[divergence]] = 0.3 if param is None else param
    return opts


def _param(divergence, param=None):
    return (0.3 if param is None else param) if divergence in PARAM_NAME else 0.0


def _reference(divergence, param, xs, xt, temperature):
    """float64 per-row values and d(sum of rows)/d xs of identity-head logits."""
    x = xs.double().requires_grad_()
    lp = torch.log_softmax(xt.double() / temperature, -1)
    lq = torch.log_softmax(x / temperature, -1)
    rows = dv.elementwise(divergence, lp, lq, param)[0].sum(-1)
    (g,) = torch.autograd.grad(rows.sum(), x)
    return rows.detach(), g


def _run(divergence, path, xs, xt, temperature, param=None):
    eye = torch.eye(xs.shape[1])
    x = xs.clone().requires_grad_()
    rows = LOSS_FNS[divergence](
        x, xt, eye, eye, temperature=temperature, reduction="none", **_opts(path, divergence, param)
    )
    rows.sum().backward()
    return rows.detach(), x.grad


def _check(divergence, path, xs, xt, temperature, param=None):
    got, g = _run(divergence, path, xs, xt, temperature, param)
    ref, rg = _reference(divergence, _param(divergence, param), xs, xt, temperature)
    assert (got >= 0).all(), f"negative value: {got.tolist()}"
    err = (got.double() - ref).abs()
    assert (err <= VALUE_RTOL * ref.abs() + VALUE_FLOOR).all(), f"values {got.tolist()} vs float64 {ref.tolist()}"
    g_err = (g.double() - rg).norm(dim=-1)
    bound = GRAD_RTOL * rg.norm(dim=-1) + GRAD_FLOOR
    assert (g_err <= bound).all(), f"row gradient errors {(g_err / rg.norm(dim=-1)).tolist()}"


# ------------------------------------------------------------------------------------------------
# the examples of the report


@pytest.mark.parametrize("path", PATHS, ids=PATH_IDS)
def test_reported_examples(path):
    eye = torch.eye(4)
    xt = torch.tensor([[15.0, 0, 0, 0]])
    xs = torch.tensor([[15.0, 0.5, 0, 0]])
    tvd = nb.tvd(xs, xt, eye, eye, **_opts(path, "tvd"))
    assert abs(float(tvd) - 1.98445059823e-07) < 1e-3 * 1.98445e-07
    skew = nb.skew_kl(xs, xt, eye, eye, **_opts(path, "skew_kl", 0.1))
    assert abs(float(skew) - 3.79291106432e-08) < 1e-3 * 3.793e-08
    x = xs.clone().requires_grad_()
    nb.forward_kl(x, xt, eye, eye, **_opts(path, "forward_kl")).backward()
    ref = torch.tensor([[-1.98444938e-07, 1.98445060e-07, -6.0704768e-14, -6.0704768e-14]], dtype=torch.float64)
    assert float((x.grad.double() - ref).norm() / ref.norm()) < 1e-3
    assert abs(float(x.grad.double().sum())) < 1e-12  # a row's gradient sums to zero


@pytest.mark.parametrize("path", PATHS, ids=PATH_IDS)
@pytest.mark.parametrize("divergence", DIVERGENCES)
def test_reported_example_every_divergence(path, divergence):
    xt = torch.tensor([[15.0, 0, 0, 0], [0, 0, 12.0, 1.0]])
    xs = torch.tensor([[15.0, 0.5, 0, 0], [0.1, 0, 12.0, 0.9]])
    _check(divergence, path, xs, xt, 1.0)


# ------------------------------------------------------------------------------------------------
# property test: gaps of 10-20 nats, T in [0.25, 2], student close to and far from the teacher

TEMPERATURES = [0.25, 0.5, 0.75, 1.0, 1.5, 2.0]
STUDENTS = ["close", "shifted", "same_top", "other_top", "equal"]


def _confident_rows(seed, vocab, gaps, students, noise):
    """Teacher rows with one logit `gap` above all others; students per `students` (one per row)."""
    g = torch.Generator().manual_seed(seed)
    rows = len(students)
    xt = torch.empty(rows, vocab)
    xs = torch.empty(rows, vocab)
    for i, (gap, kind) in enumerate(zip(gaps, students)):
        top = int(torch.randint(vocab, (1,), generator=g))
        base = float(torch.rand((), generator=g)) * 20 - 5
        t = base - gap - torch.rand(vocab, generator=g).mul(3.0)
        t[top] = base
        if kind == "close":
            s = t + noise * torch.randn(vocab, generator=g)
        elif kind == "shifted":  # a large per-row shift: the log-sum-exps differ, the distributions barely
            s = t + 7.0 + noise * torch.randn(vocab, generator=g)
        elif kind == "equal":
            s = t.clone()
        else:
            other = top if kind == "same_top" else (top + 1 + int(torch.randint(vocab - 1, (1,), generator=g))) % vocab
            s = base - (gap * 0.7 + 2.0) - torch.rand(vocab, generator=g).mul(4.0)
            s[other] = base + 1.0
        xt[i], xs[i] = t, s
    return xs, xt


def _property(divergence, path, seed, vocab, gaps, students, noise, temperature, param):
    xs, xt = _confident_rows(seed, vocab, gaps, students, noise)
    _check(divergence, path, xs, xt, temperature, param)


_row_case = dict(
    seed=st.integers(0, 2**31 - 1),
    vocab=st.integers(4, 80),
    gaps=st.lists(st.floats(10.0, 20.0), min_size=5, max_size=5),
    students=st.permutations(STUDENTS),
    noise=st.sampled_from([1e-2, 3e-2, 0.1, 0.3]),
    temperature=st.sampled_from(TEMPERATURES),
    param=st.sampled_from([0.1, 0.5, 0.9]),
)


@pytest.mark.parametrize("divergence", DIVERGENCES)
@given(**_row_case)
def test_confident_rows_torch(divergence, seed, vocab, gaps, students, noise, temperature, param):
    _property(divergence, PATHS[0], seed, vocab, gaps, students, noise, temperature, param)


@pytest.mark.parametrize("path", PATHS[1:], ids=PATH_IDS[1:])
@pytest.mark.parametrize("divergence", DIVERGENCES)
@given(**_row_case)
def test_confident_rows_triton(path, divergence, seed, vocab, gaps, students, noise, temperature, param):
    _property(divergence, path, seed, vocab, gaps, students, noise, temperature, param)


@pytest.mark.parametrize("path", PATHS, ids=PATH_IDS)
@pytest.mark.parametrize("divergence", DIVERGENCES)
def test_cold_temperature_small_gap(path, divergence):
    """A 4-nat logit gap at T = 0.25 is a 16-nat tempered gap: the same regime."""
    xt = torch.tensor([[4.0, 0.0, 0.3, -1.0, 0.0, 0.1], [0.0, 0.0, 0.0, 0.0, 4.0, 0.0]])
    xs = torch.tensor([[4.0, 0.2, 0.3, -1.0, 0.0, 0.1], [0.0, -0.1, 0.05, 0.0, 4.0, 0.02]])
    _check(divergence, path, xs, xt, 0.25)


@pytest.mark.parametrize("path", PATHS, ids=PATH_IDS)
@pytest.mark.parametrize("divergence", DIVERGENCES)
def test_ties_at_the_top_are_not_confident(path, divergence):
    """Two equal maxima: the tail counts the second one (tail >= 1), and the row is an ordinary one."""
    xt = torch.tensor([[9.0, 9.0, 0.0, -2.0, 1.0], [3.0, 0.0, 3.0, 3.0, -1.0]])
    xs = torch.tensor([[9.0, 8.0, 0.5, -2.0, 1.0], [3.0, 0.5, 2.9, 3.0, -1.0]])
    _check(divergence, path, xs, xt, 1.0)


# ------------------------------------------------------------------------------------------------
# top-k KD over the stored ids (normalize="topk"): the student renormalized over the support


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("divergence", DIVERGENCES)
def test_topk_support_confident_rows(backend, divergence):
    """topk_kl(normalize="topk") on confident rows (10-20 nats from the top to the other stored ids): the
    student's top log-probability over the support is -log1p(tail), not s - lse rounded to 0, and its
    gradient there is v (1 - q) - q sum of the others, not two numbers near 1 subtracted (values were 3%
    off, gradients 260%)."""
    from nitrobrew.topk.reference import reference_topk_loss

    g = torch.Generator().manual_seed(0)
    vocab, rows = 48, 6
    xt = -10.0 - 10.0 * torch.rand(rows, vocab, generator=g)
    top = torch.randint(vocab, (rows,), generator=g)
    xt[torch.arange(rows), top] = 0.0
    xs = xt + 0.3 * torch.randn(rows, vocab, generator=g)
    xs[torch.arange(rows), top] = 0.0
    xs[1] = xt[1] + 1e-2 * torch.randn(vocab, generator=g)  # close to the teacher
    lp, ids = torch.log_softmax(xt.double(), -1).topk(4, -1)
    lp = lp.float()
    eye = torch.eye(vocab)
    param = _param(divergence)
    opts = {PARAM_NAME[divergence]: param} if divergence in PARAM_NAME else {}
    x = xs.clone().requires_grad_()
    got = nb.topk_kl(
        x, eye, ids, lp, normalize="topk", divergence=divergence, reduction="none", backend=backend, **opts
    )
    got.sum().backward()
    x64 = xs.double().requires_grad_()
    ref = reference_topk_loss(
        x64, eye.double(), ids, lp.double(), normalize="topk", divergence=divergence, param=param, reduction="none"
    )
    ref.sum().backward()
    err = (got.double() - ref.detach()).abs()
    assert (err <= VALUE_RTOL * ref.detach().abs() + VALUE_FLOOR).all(), f"values {got.tolist()} vs {ref.tolist()}"
    g_err = (x.grad.double() - x64.grad).norm(dim=-1)
    assert (g_err <= GRAD_RTOL * x64.grad.norm(dim=-1) + GRAD_FLOOR).all(), (g_err / x64.grad.norm(dim=-1)).tolist()


# ------------------------------------------------------------------------------------------------
# top-k KD with the student normalized over the whole vocabulary (normalize="full")

# every path of normalize="full": the chunked PyTorch path over three vocab chunks, the Triton fast mode in
# row blocks of 4, the constant-memory mode
TOPK_FULL_PATHS = {
    "torch": dict(backend="torch", chunk_V=16),
    "triton-fast": dict(backend="triton", mode="fast", memory_budget=4 * 48 * 4),
    "triton-cm": dict(backend="triton", mode="constant_memory"),
}
# forward_kl against the teacher as stored, and every divergence with the tail bucket
TOPK_FULL_CASES = [("forward_kl", False)] + [(d, True) for d in DIVERGENCES]


def topk_full_rows(vocab=48, k=4):
    """Confident teacher rows (10-20 nats from the top to the others: p_top = 1 - 2e-9 at 20) and students:
    noisy, close, shifted, sharper than the teacher, confident at another stored id, confident outside the
    stored ids (the tail bucket holds its top), and a row with padding entries."""
    g = torch.Generator().manual_seed(0)
    gaps = torch.tensor([10.0, 16.0, 12.0, 18.0, 14.0, 20.0, 11.0])
    rows = gaps.numel()
    xt = -gaps[:, None] - 5.0 * torch.rand(rows, vocab, generator=g)
    top = torch.randint(vocab, (rows,), generator=g)
    xt[torch.arange(rows), top] = 0.0
    xs = xt + 0.3 * torch.randn(rows, vocab, generator=g)
    xs[torch.arange(rows), top] = 0.0
    xs[1] = xt[1] + 1e-2 * torch.randn(vocab, generator=g)  # close to the teacher
    xs[2] = xt[2] + 5.0 + 0.3 * torch.randn(vocab, generator=g)  # a per-row shift: the lse's differ
    xs[3] = 1.5 * xt[3] + 0.3 * torch.randn(vocab, generator=g)  # sharper than the teacher
    lp, ids = torch.log_softmax(xt.double(), -1).topk(k, -1)
    lp = lp.float()
    xs[4, ids[4, 1]] = 12.0  # the student's top at another stored id
    outside = [j for j in range(vocab) if j not in ids[5].tolist()][0]
    xs[5, outside] = 12.0  # the student's top outside the stored ids
    lp[6, 2:] = float("-inf")  # padding entries
    ids[6, 2:] = 0
    return xs, ids, lp


def topk_full_check(divergence, tail, block=slice(None), **opts):
    """topk_kl(normalize="full") on the rows of topk_full_rows against the float64 reference: per-row
    values and gradients (identity head: the logits are the hidden states; block: the rows of the head
    this rank holds, with a process_group)."""
    from nitrobrew.topk.reference import reference_topk_loss

    xs, ids, lp = topk_full_rows()
    eye = torch.eye(xs.shape[1])
    param = _param(divergence)
    extra = {PARAM_NAME[divergence]: param} if divergence in PARAM_NAME else {}
    x = xs.clone().requires_grad_()
    head = eye[block].clone()
    got = nb.topk_kl(x, head, ids, lp, divergence=divergence, tail=tail, reduction="none", **extra, **opts)
    got.sum().backward()
    x64 = xs.double().requires_grad_()
    ref = reference_topk_loss(
        x64, eye.double(), ids, lp.double(), divergence=divergence, param=param, tail=tail, reduction="none"
    )
    ref.sum().backward()
    ref = ref.detach()
    # with the tail both sides are distributions: never negative; forward_kl against the teacher's
    # sub-distribution as stored may be, where the float64 value is
    assert ((got >= 0) | (ref < 0)).all(), f"negative value: {got.tolist()} vs float64 {ref.tolist()}"
    err = (got.double() - ref).abs()
    assert (err <= VALUE_RTOL * ref.abs() + VALUE_FLOOR).all(), f"values {got.tolist()} vs float64 {ref.tolist()}"
    g_err = (x.grad.double() - x64.grad).norm(dim=-1)
    bound = GRAD_RTOL * x64.grad.norm(dim=-1) + GRAD_FLOOR
    assert (g_err <= bound).all(), f"row gradient errors {(g_err / x64.grad.norm(dim=-1)).tolist()}"


@pytest.mark.parametrize("path", list(TOPK_FULL_PATHS))
@pytest.mark.parametrize("divergence,tail", TOPK_FULL_CASES)
def test_topk_full_confident_rows(path, divergence, tail):
    """topk_kl(normalize="full") on confident rows: the student's vocabulary-wide normalizer is split as
    (max, tail), so its log-probability at the top id is -log1p(tail), not s - lse rounded to 0, and the
    gradient there is v (1 - q) - q sum of the others (also where the tail bucket holds the student's top)."""
    topk_full_check(divergence, tail, **TOPK_FULL_PATHS[path])


def test_topk_full_confident_rows_vocab_parallel(tmp_path):
    """The same through the vocab-parallel path (process_group=, a group of one: its merge of the
    statistics and its backward)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        group = dist.new_group([0])
        for divergence, tail in TOPK_FULL_CASES:
            topk_full_check(divergence, tail, process_group=group, chunk_V=16)
    finally:
        dist.destroy_process_group()
