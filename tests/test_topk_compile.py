"""topk_kl inside ``torch.compile``: it runs eagerly (one graph break around it, not a storm), with
the same numbers as without compilation and its checks of the stored data."""

from __future__ import annotations

import os

import pytest
import torch

from nitrobrew.topk import topk_kl

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
IMPLS = ["torch"] + (["triton"] if INTERPRET else [])
N, D, V, K = 11, 16, 67, 5


def _inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    lin = torch.nn.Linear(D, D)
    h = torch.randn(N, D, generator=g)
    ws = (torch.randn(V, D, generator=g) * 0.7).requires_grad_()
    lp, ids = torch.log_softmax(torch.randn(N, V, generator=g, dtype=torch.float64) * 3, -1).topk(K, -1)
    labels = torch.randint(0, V, (N,), generator=g)
    labels[::3] = -100
    return lin, h, ws, ids, lp.float(), labels


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("normalize", ["full", "topk"])
def test_compiled_step_matches_eager_with_one_break(impl, normalize):
    lin, h, ws, ids, lp, labels = _inputs()

    def step():
        loss = topk_kl(torch.tanh(lin(h)), ws, ids, lp, normalize=normalize, labels=labels, backend=impl)
        return loss * 2.0 + ws.square().mean()

    params = [lin.weight, lin.bias, ws]
    eager = step()
    eager_grads = torch.autograd.grad(eager, params)
    explained = torch._dynamo.explain(step)()
    assert explained.graph_break_count == 1 and explained.graph_count == 2
    torch._dynamo.reset()
    compiled = torch.compile(step, backend="aot_eager")()
    for a, b in zip(torch.autograd.grad(compiled, params), eager_grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("impl", IMPLS)
def test_compiled_step_still_checks_the_stored_data(impl):
    lin, h, ws, ids, lp, labels = _inputs(1)
    bad = lp.clone()
    bad[2, 1] = float("nan")
    step = torch.compile(lambda: topk_kl(lin(h), ws, ids, bad, normalize="topk", backend=impl), backend="aot_eager")
    with pytest.raises(ValueError, match="NaN"):
        step()
