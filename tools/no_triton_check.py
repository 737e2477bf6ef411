"""The core install works without Triton: import, every loss on CPU with backward, and a compiled
training step with .backward(); none of it imports the benchmark harness.

Run by `make test` in a second virtualenv that has torch (CPU) and `pip install .` only (no triton,
no extras): the PyTorch paths must never import a module that imports triton. Prints one line per
check and a closing "N passed, N failed"; exits non-zero on any failure or if triton is importable.
"""

from __future__ import annotations

import importlib.util
import logging
import sys
import traceback
from types import SimpleNamespace

import torch
from torch import nn

torch.manual_seed(0)
logging.getLogger("torch._dynamo").setLevel(logging.ERROR)  # topk_kl's known graph break is not news here
N, D, V, K = 6, 8, 40, 5
RESULTS = []


def check(name):
    def run(fn):
        try:
            fn()
            RESULTS.append((name, None))
        except Exception:  # report every failing check, not only the first
            RESULTS.append((name, traceback.format_exc()))
        return fn

    return run


def hidden_inputs():
    xs = torch.randn(N, D, requires_grad=True)
    ws = (torch.randn(V, D) * 0.5).requires_grad_()
    return xs, torch.randn(N, D), ws, torch.randn(V, D) * 0.5


def backward_ok(loss, *leaves):
    loss.backward()
    for t in leaves:
        assert t.grad is not None and torch.isfinite(t.grad).all(), "missing or non-finite gradient"


@check("import nitrobrew (triton not installed)")
def _():
    assert importlib.util.find_spec("triton") is None, "triton is installed: this check needs an env without it"
    import nitrobrew

    # a script's own folder (tools/) heads sys.path, not the repository root: this is the installed copy
    assert "site-packages" in nitrobrew.__file__, f"nitrobrew imported from {nitrobrew.__file__}"


for _name, _opts in (
    ("forward_kl", {}),
    ("reverse_kl", {}),
    ("jsd", {"beta": 0.3}),
    ("tvd", {}),
    ("skew_kl", {"alpha": 0.2}),
    ("skew_reverse_kl", {"alpha": 0.2}),
):

    @check(f"{_name} on CPU, backward")
    def _(name=_name, opts=_opts):
        import nitrobrew

        xs, xt, ws, wt = hidden_inputs()
        backward_ok(getattr(nitrobrew, name)(xs, xt, ws, wt, **opts), xs, ws)


@check("attention_kl on CPU, backward")
def _():
    import nitrobrew

    q_s, k_s = (torch.randn(1, 2, 7, 4, requires_grad=True) for _ in range(2))
    q_t, k_t = torch.randn(1, 2, 7, 4), torch.randn(1, 2, 7, 4)
    backward_ok(nitrobrew.attention_kl(q_s, k_s, q_t, k_t, is_causal=True), q_s, k_s)


@check("topk_kl on CPU, backward (normalize full and topk)")
def _():
    import nitrobrew

    for normalize in ("full", "topk"):
        xs, _, ws, _ = hidden_inputs()
        ids = torch.stack([torch.randperm(V)[:K] for _ in range(N)])
        logprobs = torch.log_softmax(torch.randn(N, K), -1)
        backward_ok(nitrobrew.topk_kl(xs, ws, ids, logprobs, normalize=normalize), xs, ws)


class TinyLM(nn.Module):
    """The conventions nitrobrew.hf relies on (get_decoder, get_output_embeddings), without transformers."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(V, D)
        self.head = nn.Linear(D, V, bias=False)

    def get_decoder(self):
        return _Decoder(self.embed)

    def get_output_embeddings(self):
        return self.head


class _Decoder(nn.Module):
    def __init__(self, embed):
        super().__init__()
        self.embed = embed

    def forward(self, input_ids, attention_mask=None, use_cache=False, return_dict=True):
        return SimpleNamespace(last_hidden_state=torch.tanh(self.embed(input_ids)))


@check("distill_loss on a tiny LM, backward")
def _():
    from nitrobrew.hf import distill_loss

    student, teacher = TinyLM(), TinyLM()
    ids = torch.randint(0, V, (2, 9))
    out = distill_loss(student, teacher, ids, ce_weight=0.5)
    backward_ok(out.loss, student.embed.weight, student.head.weight)


@check("torch.compile'd training step with .backward()")
def _():
    import nitrobrew

    student = nn.Linear(D, D)
    ws = nn.Parameter(torch.randn(V, D) * 0.5)
    h, xt, wt = torch.randn(N, D), torch.randn(N, D), torch.randn(V, D) * 0.5
    opt = torch.optim.SGD([*student.parameters(), ws], lr=0.1)

    @torch.compile(fullgraph=True)
    def loss_fn(h):
        return nitrobrew.forward_kl(student(h), xt, ws, wt, temperature=2.0)

    for _ in range(2):  # the registered backward runs inside the compiled backward graph
        opt.zero_grad()
        loss = loss_fn(h)
        loss.backward()
        assert ws.grad is not None and torch.isfinite(ws.grad).all(), "no finite gradient from the compiled step"
        opt.step()
    eager = nitrobrew.forward_kl(student(h), xt, ws, wt, temperature=2.0)
    assert torch.allclose(loss_fn(h), eager, rtol=1e-5, atol=1e-6), "compiled and eager losses differ"


@check("torch.compile'd topk_kl and attention_kl, backward")
def _():
    import nitrobrew

    xs, _, ws, _ = hidden_inputs()
    ids = torch.stack([torch.randperm(V)[:K] for _ in range(N)])
    logprobs = torch.log_softmax(torch.randn(N, K), -1)
    backward_ok(torch.compile(nitrobrew.topk_kl)(xs, ws, ids, logprobs), xs, ws)
    q_s, k_s = (torch.randn(1, 2, 7, 4, requires_grad=True) for _ in range(2))
    q_t, k_t = torch.randn(1, 2, 7, 4), torch.randn(1, 2, 7, 4)
    backward_ok(torch.compile(nitrobrew.attention_kl)(q_s, k_s, q_t, k_t, is_causal=True), q_s, k_s)


@check("no loss imported the benchmark harness (nitrobrew.bench)")
def _():
    loaded = sorted(m for m in sys.modules if m == "nitrobrew.bench" or m.startswith("nitrobrew.bench."))
    assert not loaded, f"imported by the losses: {loaded}"


def main() -> int:
    failed = [(n, tb) for n, tb in RESULTS if tb is not None]
    for name, tb in RESULTS:
        print(("FAIL " if tb else "ok   ") + name)
        if tb:
            print(tb)
    print(f"no-triton: {len(RESULTS) - len(failed)} passed, {len(failed)} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
