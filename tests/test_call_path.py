"""One pass of argument checks per call: the public entries validate into a checked call (``HiddenCall``,
``TopKCall``) that the paths below trust, and a call without a process group or a DTensor never enters the
distributed branch (``parallel/``, the families' ``vocab_parallel.py``)."""

from __future__ import annotations

import os
import re
import sys

import pytest
import torch

import nitrobrew as nb

PKG = os.path.dirname(nb.__file__)
# every argument check of the loss path; not is_dtensor (the entry's routing) nor check_not_capturing (the
# capture state, read again where the backward syncs: it may change between the two)
CHECK = re.compile(r"^(?!check_not_capturing)(_?check|_?validate|resolve_backend|backend_for|divergence_param)")
N, D, V, K = 7, 8, 40, 5


def _key(value):
    if isinstance(value, torch.Tensor):
        return ("tensor", id(value))
    if isinstance(value, (list, tuple)):
        return tuple(_key(v) for v in value)
    if isinstance(value, dict):
        return tuple((k, _key(v)) for k, v in value.items())
    return (type(value).__name__, repr(value)[:200])


def _trace(fn):
    """Run fn; return the checks it called (function, its arguments) and the package files it visited."""
    checks, files = [], set()

    def profile(frame, event, arg):
        if event != "call" or not frame.f_code.co_filename.startswith(PKG):
            return
        code = frame.f_code
        files.add(os.path.relpath(code.co_filename, PKG))
        if CHECK.match(code.co_name):
            n = code.co_argcount + code.co_kwonlyargcount + bool(code.co_flags & 4) + bool(code.co_flags & 8)
            args = tuple((a, _key(frame.f_locals.get(a))) for a in code.co_varnames[:n])
            checks.append((f"{os.path.relpath(code.co_filename, PKG)}:{code.co_name}", args))

    fn()  # lazy imports are not part of the call
    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return checks, files


def _hidden_inputs():
    g = torch.Generator().manual_seed(0)
    xs = torch.randn(N, D, generator=g, requires_grad=True)
    ws = (torch.randn(V, D, generator=g) * 3).requires_grad_()
    labels = torch.randint(0, V, (N,), generator=g)
    labels[1] = -100
    return xs, torch.randn(N, D, generator=g), ws, torch.randn(V, D, generator=g) * 3, labels


def _topk_inputs():
    xs, _, ws, _, labels = _hidden_inputs()
    g = torch.Generator().manual_seed(1)
    ids = torch.stack([torch.randperm(V, generator=g)[:K] for _ in range(N)])
    lp = torch.log_softmax(torch.randn(N, V, generator=g) * 3, -1).gather(1, ids)
    return xs, ws, ids, lp, labels


def _hidden_call(**opts):
    xs, xt, ws, wt, labels = _hidden_inputs()
    return lambda: nb.forward_kl(xs, xt, ws, wt, labels=labels, **opts).backward()


def _topk_call(**opts):
    xs, ws, ids, lp, labels = _topk_inputs()
    return lambda: nb.topk_kl(xs, ws, ids, lp, labels=labels, **opts).backward()


CALLS = {
    "forward_kl": _hidden_call(backend="torch"),
    "forward_kl_ce_bias_softcap": _hidden_call(
        backend="torch", ce_weight=0.5, bs=torch.zeros(V), softcap_s=30.0, grad_filter=True
    ),
    "hidden_jsd": lambda: nb.hidden_loss(*_hidden_inputs()[:4], divergence="jsd", beta=0.3, backend="auto").backward(),
    "topk_full_ce": _topk_call(backend="torch", ce_weight=0.5),
    "topk_renormalized": _topk_call(backend="auto", normalize="topk", divergence="jsd"),
    "topk_tail": _topk_call(backend="torch", divergence="reverse_kl", tail=True),
}
if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
    CALLS["forward_kl_triton"] = _hidden_call(backend="triton", ce_weight=0.5)
    CALLS["topk_triton"] = _topk_call(backend="triton")


@pytest.mark.parametrize("name", list(CALLS))
def test_each_argument_is_checked_once_and_no_distributed_code_runs(name):
    checks, files = _trace(CALLS[name])
    seen, again = set(), []
    for c in checks:
        if c in seen:
            again.append(c[0])
        seen.add(c)
    assert not again, f"checked twice in one call: {sorted(again)}"
    family = "topk" if name.startswith("topk") else "hidden"
    assert sum(f.endswith(":validate") for f, _ in checks) == 1, [f for f, _ in checks]
    assert any(f == f"{family}/validation.py:validate" for f, _ in checks)
    distributed = sorted(f for f in files if f.startswith("parallel/") or f.endswith("vocab_parallel.py"))
    assert not distributed, distributed


def test_the_paths_receive_the_checked_call(monkeypatch):
    """The dispatch below the entry takes the bundle ``validate`` built, not loose arguments to re-check."""
    from nitrobrew.hidden import api as hidden_api
    from nitrobrew.hidden.validation import HiddenCall
    from nitrobrew.topk import api as topk_api
    from nitrobrew.topk.validation import TopKCall

    got = []
    run, dispatch = hidden_api._run, topk_api._dispatch
    monkeypatch.setattr(hidden_api, "_run", lambda call: got.append(call) or run(call))
    monkeypatch.setattr(topk_api, "_dispatch", lambda call: got.append(call) or dispatch(call))
    CALLS["forward_kl"]()
    CALLS["topk_full_ce"]()
    assert [type(c) for c in got] == [HiddenCall, TopKCall]
    hidden, topk = got
    assert hidden.impl == "torch" and hidden.ops.xs.shape == (N, D) and hidden.mask.shape == (N,)
    assert topk.impl == "torch" and topk.rows.x.shape == (N, D) and topk.cfg.with_ce
    with pytest.raises(AttributeError):  # frozen: what was checked stays what runs
        hidden.impl = "triton"


def test_vocab_parallel_takes_the_checked_options(monkeypatch, tmp_path):
    """topk_kl(process_group=...) builds its options once, and the vocab-parallel path validates that same
    bundle (not a copy rebuilt from it)."""
    import torch.distributed as dist

    from nitrobrew.topk import api as topk_api
    from nitrobrew.topk import vocab_parallel

    built, checked = [], []
    options, validate = topk_api.TopKOptions, vocab_parallel.validate
    monkeypatch.setattr(topk_api, "TopKOptions", lambda **kw: built.append(options(**kw)) or built[-1])
    monkeypatch.setattr(
        vocab_parallel, "validate", lambda inputs, o, *a, **kw: checked.append(o) or validate(inputs, o, *a, **kw)
    )
    xs, ws, ids, lp, labels = _topk_inputs()
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        nb.topk_kl(xs, ws, ids, lp, labels=labels, backend="torch", process_group=dist.new_group([0])).backward()
    finally:
        dist.destroy_process_group()
    assert len(built) == 1 and len(checked) == 1 and checked[0] is built[0], (built, checked)
