"""The hidden-state losses inside ``torch.compile``: one graph, no breaks, the same numbers.

Under compilation the loss is the registered op ``nitrobrew::hidden_distill`` (with its own
backward op); these tests compile a small training step with ``fullgraph=True`` (any graph break
fails), check that the op is in the graph, and compare loss and gradients with eager execution,
for the PyTorch backend and for the Triton kernels under the interpreter.
"""

from __future__ import annotations

import os

import pytest
import torch

import nitrobrew as nb
from nitrobrew.hidden import custom_op

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
IMPLS = ["torch"] + (["triton"] if INTERPRET else [])
V, N, DS, DT = 301, 23, 24, 40

CASES = {
    "mean": dict(),
    "none": dict(reduction="none"),
    "ce_bias_chunked": dict(chunk_V=64, ce_weight=0.3, with_labels=True, with_bias=True),
    "jsd_sum_T": dict(divergence="jsd", beta=0.3, reduction="sum", temperature=2.0),
    "tvd_small_budget": dict(divergence="tvd", memory_budget=8 * V * 5, with_labels=True),
    "grad_filter": dict(grad_filter=0.05, memory_budget=8 * V * 5, with_labels=True, ce_weight=0.5),
    # the named losses forward their options (HiddenOptions) to hidden_loss inside the one graph
    "named_jsd": dict(loss="jsd", beta=0.3, with_labels=True, ce_weight=0.2, reduction="sum"),
    "named_forward_kl": dict(loss="forward_kl", with_bias=True, chunk_V=64),
}


def _inputs(impl, seed=0):
    g = torch.Generator().manual_seed(seed)
    dt = torch.bfloat16 if impl == "triton" else torch.float32
    lin = torch.nn.Linear(DS, DS).to(dt)
    h = torch.randn(N, DS, generator=g).to(dt)
    xt = torch.randn(N, DT, generator=g).to(dt)
    ws = (torch.randn(V, DS, generator=g) * 0.5).to(dt).requires_grad_()
    wt = (torch.randn(V, DT, generator=g) * 0.5).to(dt)
    bs = torch.randn(V, generator=g).to(dt).requires_grad_()
    labels = torch.randint(0, V, (N,), generator=g)
    labels[::4] = -100
    return lin, h, xt, ws, wt, bs, labels


def _step_and_params(impl, case):
    opts = dict(CASES[case])
    with_labels, with_bias = opts.pop("with_labels", False), opts.pop("with_bias", False)
    lin, h, xt, ws, wt, bs, labels = _inputs(impl)
    if with_labels:
        opts["labels"] = labels
    if with_bias:
        opts["bs"] = bs
    loss_fn = getattr(nb, opts.pop("loss")) if "loss" in opts else nb.hidden_loss

    def step():
        loss = loss_fn(lin(h), xt, ws, wt, backend=impl, **opts)
        return loss.sum() if loss.dim() else loss

    params = [lin.weight, lin.bias, ws] + ([bs] if with_bias else [])
    return step, params


def _run(step, params):
    for p in params:
        p.grad = None
    loss = step()
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in params]


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("impl", IMPLS)
def test_compiled_step_is_one_graph_with_eager_numbers(impl, case):
    torch._dynamo.reset()
    step, params = _step_and_params(impl, case)
    loss_eager, grads_eager = _run(step, params)
    graphs = []

    def record(gm, example_inputs):
        graphs.append(gm)
        return gm

    loss_c, grads_c = _run(torch.compile(step, backend=record, fullgraph=True), params)
    assert len(graphs) == 1
    assert "nitrobrew.hidden_distill" in graphs[0].code
    torch.testing.assert_close(loss_c, loss_eager, rtol=1e-6, atol=1e-6)
    for a, b in zip(grads_c, grads_eager):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("impl", IMPLS)
def test_aot_autograd_and_inductor_match_eager(impl):
    for backend in ("aot_eager", "inductor"):
        torch._dynamo.reset()
        step, params = _step_and_params(impl, "ce_bias_chunked")
        loss_eager, grads_eager = _run(step, params)
        loss_c, grads_c = _run(torch.compile(step, backend=backend, fullgraph=True), params)
        torch.testing.assert_close(loss_c, loss_eager, rtol=1e-5, atol=1e-5)
        for a, b in zip(grads_c, grads_eager):
            torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-4)


@pytest.mark.parametrize("impl", IMPLS)
def test_compiled_labels_out_of_range_raise(impl):
    torch._dynamo.reset()
    lin, h, xt, ws, wt, _, labels = _inputs(impl)
    labels[1] = V + 3
    step = torch.compile(
        lambda: nb.forward_kl(lin(h), xt, ws, wt, labels=labels, ce_weight=1.0, backend=impl),
        backend="aot_eager",
        fullgraph=True,
    )
    with pytest.raises(ValueError, match="labels must lie in"):
        step()


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_opcheck(impl, reduction):
    _, h, xt, ws, wt, bs, labels = _inputs(impl)
    xs = h.clone().requires_grad_()
    mask = (labels != -100).float()
    ce_labels = torch.where(labels == -100, -1, labels)
    args = (
        xs,
        xt,
        ws,
        wt,
        bs,
        None,
        ce_labels,
        mask,
        "jsd",
        0.4,
        1.5,
        1.0,
        0.5,
        64,
        -1.0,
        -1.0,
        -1.0,
        impl,
        reduction,
        "",
        -1,
        True,
    )
    torch.library.opcheck(
        custom_op.hidden_distill, args, test_utils=("test_schema", "test_faketensor", "test_autograd_registration")
    )


def test_option_names_follow_the_schemas():
    """The one list of scalar arguments (custom_op._OPTION_NAMES, the fake kernel and the autograd context read
    the positional values by it) is what both ops' schemas take after their tensors."""
    tensors = {"grad_total", "stats", "xs", "xt", "ws", "wt", "bs", "bt", "labels", "mask"}

    def scalars(op):
        return tuple(a.name for a in op.default._schema.arguments if a.name not in tensors)

    assert scalars(torch.ops.nitrobrew.hidden_distill) == (*custom_op._OPTION_NAMES, "need_grad")
    assert scalars(torch.ops.nitrobrew.hidden_distill_backward) == custom_op._OPTION_NAMES
    assert custom_op._OPTION_NAMES[: len(custom_op._CFG_NAMES)] == custom_op._CFG_NAMES


@pytest.mark.parametrize("name", sorted(nb.hidden.api.LOSSES))
def test_named_losses_pass_every_argument_on(monkeypatch, name):
    """Each of the six functions hands every one of its parameters (its own and the shared HiddenOptions)
    to hidden_loss, under its own name."""
    import inspect

    from nitrobrew.hidden import api

    fn = api.LOSSES[name]
    own = [p.name for p in inspect.signature(fn).parameters.values() if p.kind is not p.VAR_KEYWORD]
    params = own + sorted(api.OPTION_NAMES)
    got = {}
    monkeypatch.setattr(api, "hidden_loss", lambda **kw: got.update(kw))
    sent = {p: object() for p in params}
    fn(**sent)
    assert set(got) == set(params) | {"divergence"}
    assert all(got[p] is sent[p] for p in params) and got["divergence"] == name


@pytest.mark.skipif(not INTERPRET, reason="the Triton kernels on the CPU need TRITON_INTERPRET=1")
@pytest.mark.parametrize("threads", [1, 2])
def test_triton_bf16_step_with_one_thread(threads):
    """Under `pytest -n 2` every worker runs torch on one thread (conftest.py), and there a CPU bf16 matmul
    read the spare half of the padded rows the Triton fast mode writes its gradient slab into: dX came
    out NaN in eager and compiled steps alike (the NaN of this file's compiled-step test under xdist)."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        step, params = _step_and_params("triton", "mean")
        loss, grads = _run(step, params)
    finally:
        torch.set_num_threads(before)
    assert torch.isfinite(loss) and all(bool(torch.isfinite(g).all()) for g in grads)
