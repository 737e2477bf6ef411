"""Gradient filtering (``grad_filter``): exactly the documented columns are dropped, nothing else.

The expectation is built in float64 from the reference's logit gradient G: per slab (a block of
rows x a vocab chunk, as the backend plans them) the columns with some |G_ij| > eps * (row i's
largest |G_ij'| in the slab) are kept, the others zeroed, unless more than half are kept (then
the slab is not filtered); then
dX = G' W, dW = G'^T X, db = G summed (the bias gradient is never filtered). The threshold is
large (eps = 0.05) so that the dropped part is far above the tolerance: a filter that drops
nothing, or the wrong columns, fails.
"""

from __future__ import annotations

import os

import pytest
import torch

import nitrobrew as nb
from nitrobrew.hidden import grad_filter as gf
from nitrobrew.hidden import kernels_filter as kf
from nitrobrew.hidden import reference_loss

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
V, N, DS, DT = 301, 13, 24, 17
EPS = 0.05
# backend, options, rows per block, vocab chunk (as the plans choose them for these budgets)
SETUPS = {
    "torch": ("torch", dict(chunk_V=80), N, 80),
    "triton-fast": ("triton", dict(mode="fast", memory_budget=8 * V * 5), 5, V),
    "triton-const": ("triton", dict(chunk_V=80, memory_budget=2 * (8 * 80 + 4 * DS)), 2, 80),
}
CASES = {
    "fkl_mean": dict(divergence="forward_kl"),
    "jsd_sum_T": dict(divergence="jsd", beta=0.3, reduction="sum", temperature=1.7),
    "rkl_ce_bias": dict(divergence="reverse_kl", ce_weight=0.5, bias=True),
}


def _inputs(seed: int, bias: bool):
    g = torch.Generator().manual_seed(seed)
    xs = torch.randn(N, DS, generator=g)
    xt = torch.randn(N, DT, generator=g)
    ws = torch.randn(V, DS, generator=g) * (8.0 / DS**0.5)  # logits of std 8: peaked rows
    wt = torch.randn(V, DT, generator=g) * (8.0 / DT**0.5)
    bs = torch.randn(V, generator=g) if bias else None
    labels = torch.randint(0, V, (N,), generator=g)
    labels[::4] = -100
    return xs, xt, ws, wt, bs, labels


def _expected(xs, xt, ws, wt, bs, labels, opts, rows: int, chunk: int, skipped=None):
    """(dX, dW, db) of the filtered gradient, and how many slabs were filtered. skipped[block][chunk]:
    tiles the constant-memory backward skipped (zero), as it reported them."""
    d = torch.float64
    ref_opts = dict(opts)
    ref_opts["param"] = ref_opts.pop("beta", 0.0)
    z = xs.to(d) @ ws.to(d).t() + (0.0 if bs is None else bs.to(d))
    t = xt.to(d) @ wt.to(d).t()
    eye = torch.eye(N, dtype=d)
    zt = z.t().clone().requires_grad_()  # the reference with identity hidden states: its head is the logits
    reference_loss(eye, eye, zt, t.t(), labels=labels, **ref_opts).backward()
    grad = zt.grad.t()
    keep = torch.ones_like(grad)
    filtered = 0
    for r0 in range(0, N, rows):
        for c0 in range(0, V, chunk):
            blk = grad[r0 : r0 + rows, c0 : c0 + chunk]
            if skipped is not None:  # the tile rule alone
                if skipped[r0 // rows][c0 // chunk]:
                    keep[r0 : r0 + rows, c0 : c0 + chunk] = 0.0
                    filtered += 1
                continue
            active = (blk.abs() > EPS * blk.abs().amax(1, keepdim=True)).any(0)
            if 2 * int(active.sum()) <= active.numel():
                keep[r0 : r0 + rows, c0 : c0 + chunk] = active.to(d)
                filtered += 1
    kept = grad * keep
    return (kept @ ws.to(d), kept.t() @ xs.to(d), grad.sum(0)), (grad @ ws.to(d), grad.t() @ xs.to(d)), filtered


def _spy_tiles(monkeypatch):
    """The skip masks the constant-memory backward computes (appended per backward)."""
    seen = []

    def spy(*args, f=gf.negligible_tiles, **kwargs):
        out = f(*args, **kwargs)
        seen.append(out)
        return out

    monkeypatch.setattr(gf, "negligible_tiles", spy)
    return seen


def _rel(a, b):
    return float((a.double() - b).norm() / b.norm())


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("setup", list(SETUPS))
def test_filtered_gradients_drop_exactly_the_small_columns(monkeypatch, setup, case):
    backend, impl_opts, rows, chunk = SETUPS[setup]
    if backend == "triton" and not INTERPRET:
        pytest.skip("needs TRITON_INTERPRET=1 on CPU")
    opts = dict(CASES[case])
    bias = opts.pop("bias", False)
    xs, xt, ws, wt, bs, labels = _inputs(3, bias)
    xs_, ws_ = xs.clone().requires_grad_(), ws.clone().requires_grad_()
    bs_ = None if bs is None else bs.clone().requires_grad_()
    skipped = _spy_tiles(monkeypatch)
    loss = nb.hidden_loss(
        xs_, xt, ws_, wt, bs=bs_, labels=labels, backend=backend, grad_filter=EPS, **opts, **impl_opts
    )
    loss.backward()
    (dx_e, dw_e, db_e), (dx_full, dw_full), filtered = _expected(
        xs, xt, ws, wt, bs, labels, opts, rows, chunk, skipped[0] if skipped else None
    )
    assert filtered > 0  # the case exercises the filter
    if setup == "triton-const" and case == "fkl_mean":
        assert any(any(b) for b in skipped[0])  # whole tiles skipped, not only columns
    for got, exp, full in ((xs_.grad, dx_e, dx_full), (ws_.grad, dw_e, dw_full)):
        assert _rel(got, exp) < 1e-4
        assert _rel(full.float(), exp) > 1e-3  # the dropped part is far above the tolerance
    if bias:
        assert _rel(bs_.grad, db_e) < 1e-4


@pytest.mark.parametrize("setup", list(SETUPS))
def test_tiny_threshold_changes_nothing(setup):
    backend, impl_opts, _, _ = SETUPS[setup]
    if backend == "triton" and not INTERPRET:
        pytest.skip("needs TRITON_INTERPRET=1 on CPU")
    xs, xt, ws, wt, _, labels = _inputs(4, False)
    grads = []
    for grad_filter in (False, 1e-30):
        xs_, ws_ = xs.clone().requires_grad_(), ws.clone().requires_grad_()
        nb.jsd(xs_, xt, ws_, wt, labels=labels, backend=backend, grad_filter=grad_filter, **impl_opts).backward()
        grads.append((xs_.grad, ws_.grad))
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def test_default_threshold_follows_the_dtype():
    assert gf.resolve_eps(True, torch.bfloat16) == 2.0**-8
    assert gf.resolve_eps(True, torch.float16) == 2.0**-11
    assert gf.resolve_eps(False, torch.bfloat16) is None
    assert gf.resolve_eps(1e-3, torch.float32) == 1e-3


@pytest.mark.parametrize("bad", [-1.0, 0.0, 1.0, 2.5, "yes", float("nan")])
def test_bad_grad_filter_raises(bad):
    xs, xt, ws, wt, _, _ = _inputs(5, False)
    with pytest.raises(ValueError, match="grad_filter"):
        nb.forward_kl(xs, xt, ws, wt, grad_filter=bad)


@pytest.mark.parametrize("fraction", [None, 0.02, 0.3, 1.0])
def test_every_product_path_drops_the_same_columns(monkeypatch, fraction):
    """The Triton backend's capacity (a speed choice from earlier slabs) never changes the result:
    dense products (None, 1.0), compacted products plus the device-side overflow (0.02: capacity
    below the active count), compacted products alone (0.3)."""
    if not INTERPRET:
        pytest.skip("needs TRITON_INTERPRET=1 on CPU")
    backend, impl_opts, rows, chunk = SETUPS["triton-fast"]
    monkeypatch.setattr(gf, "CAP_STEP", 16)
    monkeypatch.setattr(gf.ActiveFractions, "record", lambda self, count, n_cols: None)
    monkeypatch.setattr(gf, "PIECE", 8)  # several products per slab
    monkeypatch.setattr(kf, "FILTER_ROWS", 2)  # several row groups flag (and count) one column
    monkeypatch.setattr(kf, "FILTER_BLOCK_R", 2)
    gf._FRACTIONS.clear()
    gf.fractions_for(torch.device("cpu"), V, EPS).fraction = fraction
    compacted = []
    monkeypatch.setattr(gf, "active_first", lambda active, f=gf.active_first: compacted.append(1) or f(active))
    xs, xt, ws, wt, bs, labels = _inputs(6, True)
    opts = dict(divergence="forward_kl", ce_weight=0.5)
    (dx_e, dw_e, db_e), _full, _n = _expected(xs, xt, ws, wt, bs, labels, opts, rows, chunk)
    xs_, ws_, bs_ = (a.clone().requires_grad_() for a in (xs, ws, bs))
    nb.hidden_loss(
        xs_, xt, ws_, wt, bs=bs_, labels=labels, backend=backend, grad_filter=EPS, **opts, **impl_opts
    ).backward()
    gf._FRACTIONS.clear()
    assert bool(compacted) == (fraction is not None and fraction < 0.5)  # the path the case names
    for got, exp in ((xs_.grad, dx_e), (ws_.grad, dw_e), (bs_.grad, db_e)):
        assert _rel(got, exp) < 1e-4


def test_capacity_follows_the_active_fraction():
    f = gf.ActiveFractions()
    assert f.capacity(100_000) == 100_000  # nothing known: dense
    f.record(torch.tensor([10_000]), 100_000)
    cap = f.capacity(100_000)
    assert 10_000 * gf.HEADROOM <= cap < 10_000 * gf.HEADROOM + gf.CAP_STEP + 1
    f.record(torch.tensor([45_000]), 100_000)
    assert f.capacity(100_000) < 100_000  # up to half active: compacted, padded past half
    f.record(torch.tensor([60_000]), 100_000)
    assert f.capacity(100_000) == 100_000  # over half (unfiltered slabs): dense
    for _ in range(gf.RECENT - 1):
        f.record(torch.tensor([0]), 100_000)
    assert f.fraction == 0.6  # the largest of the last RECENT
    f.record(torch.tensor([0]), 100_000)
    assert f.fraction == 0.0


def test_an_unfiltered_slab_stays_whole_when_a_small_capacity_was_expected(monkeypatch):
    """Earlier slabs were sparse (small capacity), this one has more than half its columns active:
    the device-side products cover every column, as without the filter."""
    if not INTERPRET:
        pytest.skip("needs TRITON_INTERPRET=1 on CPU")
    backend, impl_opts, _, _ = SETUPS["triton-fast"]
    monkeypatch.setattr(gf, "CAP_STEP", 16)
    monkeypatch.setattr(gf.ActiveFractions, "record", lambda self, count, n_cols: None)
    monkeypatch.setattr(kf, "OVERFLOW_DW_PROGRAMS", 2)  # each program walks several column blocks
    xs, xt, ws, wt, _, labels = _inputs(7, False)
    grads = []
    for grad_filter, fraction in ((False, None), (1e-6, 0.02)):  # 60-88% of columns active
        gf._FRACTIONS.clear()
        gf.fractions_for(torch.device("cpu"), V, 1e-6).fraction = fraction
        xs_, ws_ = xs.clone().requires_grad_(), ws.clone().requires_grad_()
        nb.forward_kl(xs_, xt, ws_, wt, backend=backend, grad_filter=grad_filter, **impl_opts).backward()
        grads.append((xs_.grad, ws_.grad))
    gf._FRACTIONS.clear()
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def _spy_tile_args(monkeypatch):
    seen = []

    def spy(*args, f=gf.negligible_tiles, **kwargs):
        out = f(*args, **kwargs)
        seen.append((args, out))
        return out

    monkeypatch.setattr(gf, "negligible_tiles", spy)
    return seen


def test_skipped_tiles_hold_only_negligible_entries(monkeypatch):
    """Constant-memory tile skipping: the per-chunk maxima are the tempered logits' maxima, and every
    entry of a skipped tile is at most eps x its row's largest |g| over the whole vocabulary."""
    if not INTERPRET:
        pytest.skip("needs TRITON_INTERPRET=1 on CPU")
    backend, impl_opts, rows, chunk = SETUPS["triton-const"]
    seen = _spy_tile_args(monkeypatch)
    xs, xt, ws, wt, _, labels = _inputs(8, False)
    T = 1.7
    xs_ = xs.clone().requires_grad_()
    nb.forward_kl(
        xs_, xt, ws, wt, labels=labels, temperature=T, backend=backend, grad_filter=EPS, **impl_opts
    ).backward()
    (chunk_max, *_rest), skipped = seen[0]
    d = torch.float64
    s, t = (xs.to(d) @ ws.to(d).t()) / T, (xt.to(d) @ wt.to(d).t()) / T
    counted = labels != -100  # (ignored rows enter the kernels zeroed)
    for ci, c0 in enumerate(range(0, V, chunk)):
        for side, logits in ((0, s), (1, t)):
            torch.testing.assert_close(
                chunk_max[counted, ci, side].double(), logits[counted, c0 : c0 + chunk].amax(1), rtol=1e-5, atol=1e-5
            )
    g = (s.softmax(1) - t.softmax(1)).abs()  # |g| up to the row's positive factor
    n_skipped = 0
    for bi, r0 in enumerate(range(0, N, rows)):
        for ci, c0 in enumerate(range(0, V, chunk)):
            if not skipped[bi][ci]:
                continue
            n_skipped += 1
            blk = g[r0 : r0 + rows, c0 : c0 + chunk][counted[r0 : r0 + rows]]
            assert (blk <= EPS * g[r0 : r0 + rows][counted[r0 : r0 + rows]].amax(1, keepdim=True)).all()
    assert n_skipped > 0


@pytest.mark.parametrize(
    "opts", [dict(divergence="reverse_kl"), dict(ce_weight=0.5), dict(softcap_s=5.0), dict(bias=True)]
)
def test_no_tile_skipping_where_the_bounds_do_not_hold(monkeypatch, opts):
    if not INTERPRET:
        pytest.skip("needs TRITON_INTERPRET=1 on CPU")
    backend, impl_opts, _, _ = SETUPS["triton-const"]
    seen = _spy_tile_args(monkeypatch)
    opts = dict(opts)
    xs, xt, ws, wt, bs, labels = _inputs(9, opts.pop("bias", False))
    nb.hidden_loss(
        xs.clone().requires_grad_(),
        xt,
        ws,
        wt,
        bs=bs,
        labels=labels,
        backend=backend,
        grad_filter=EPS,
        **opts,
        **impl_opts,
    ).backward()
    assert seen == []
