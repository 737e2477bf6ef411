"""NaN in rows that do not count never reaches a gradient (docs/design.md §1: rows whose label is
ignore_index, padded queries). The hidden-state losses zero such student rows before any product;
top-k KD and the attention KL must do the same, on both backends (Triton interpreted on CPU)."""

from __future__ import annotations

import pytest
import torch

import nitrobrew as nb

BACKENDS2 = ["torch", "triton"]


def _topk_case(nan_row: int = 2):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 8, generator=g)
    x[nan_row] = float("nan")
    w = torch.randn(20, 8, generator=g)
    lp, ids = torch.log_softmax(torch.randn(6, 20, generator=g), -1).topk(4, -1)
    return x, w, ids, lp


@pytest.mark.parametrize("backend", BACKENDS2)
@pytest.mark.parametrize(
    "opts",
    [{}, {"normalize": "topk"}, {"tail": True}, {"ce_weight": 0.5}, {"mode": "constant_memory"}],
    ids=["full", "topk", "tail", "ce", "cm"],
)
def test_topk_nan_in_an_ignored_row(backend, opts):
    """The reported case: a student row whose label is ignore_index holds NaN."""
    x, w, ids, lp = _topk_case()
    x.requires_grad_()
    w.requires_grad_()
    labels = torch.tensor([1, 2, -100, 4, 5, -100])
    loss = nb.topk_kl(x, w, ids, lp, labels=labels, backend=backend, **opts)
    loss.backward()
    assert torch.isfinite(loss)
    assert torch.isfinite(x.grad).all() and torch.isfinite(w.grad).all()
    assert (x.grad[2] == 0).all()
    # the counted rows' gradients are those of the same call without the ignored rows
    keep = labels != -100
    x2, w2 = x.detach()[keep].clone().requires_grad_(), w.detach().clone().requires_grad_()
    ref = nb.topk_kl(x2, w2, ids[keep], lp[keep], labels=labels[keep], backend=backend, **opts)
    ref.backward()
    torch.testing.assert_close(loss.detach(), ref.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(x.grad[keep], x2.grad, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(w.grad, w2.grad, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("backend", BACKENDS2)
def test_topk_nan_in_a_counted_row_gives_nan(backend):
    x, w, ids, lp = _topk_case()
    loss = nb.topk_kl(x, w, ids, lp, labels=torch.tensor([1, 2, 3, 4, 5, -100]), backend=backend)
    assert torch.isnan(loss)


def _attention_inputs():
    g = torch.Generator().manual_seed(0)
    return [torch.randn(2, 2, 9, 8, generator=g) for _ in range(4)]


@pytest.mark.parametrize("backend", BACKENDS2)
@pytest.mark.parametrize("how", ["key_padding_mask", "kv_lengths", "query_mask", "causal_offset"])
def test_attention_nan_in_a_row_that_does_not_count(backend, how):
    """A padded sequence (every key masked), a padded query (query_mask) or a query that sees no key
    (causal_offset < 0): a NaN in its query reaches neither dq nor dk."""
    q, k, qt, kt = _attention_inputs()
    kw = {}
    if how == "key_padding_mask":
        kpm = torch.ones(2, 9, dtype=torch.bool)
        kpm[1] = False
        kw["key_padding_mask"], bad = kpm, (1, 0, 3)
    elif how == "kv_lengths":
        kw["kv_lengths"], bad = torch.tensor([9, 0]), (1, 1, 2)
    elif how == "query_mask":
        qm = torch.ones(2, 9, dtype=torch.bool)
        qm[1, 4] = False
        kw["query_mask"], bad = qm, (1, 0, 4)
    else:
        kw["causal_offset"], bad = -2, (0, 1, 1)
    q[bad] = float("nan")
    qt[bad] = float("nan")
    q.requires_grad_()
    k.requires_grad_()
    loss = nb.attention_kl(q, k, qt, kt, is_causal=True, backend=backend, **kw)
    loss.backward()
    assert torch.isfinite(loss)
    assert torch.isfinite(q.grad).all() and torch.isfinite(k.grad).all()
    assert (q.grad[bad] == 0).all()
    # the gradients equal those of the same inputs with the NaN replaced by any finite value
    q2 = q.detach().clone()
    q2[bad] = 0.0
    qt2 = qt.clone()
    qt2[bad] = 0.0
    q2.requires_grad_()
    k2 = k.detach().clone().requires_grad_()
    ref = nb.attention_kl(q2, k2, qt2, kt, is_causal=True, backend=backend, **kw)
    ref.backward()
    torch.testing.assert_close(loss.detach(), ref.detach())
    torch.testing.assert_close(k.grad, k2.grad)
    torch.testing.assert_close(q.grad, q2.grad)
