"""attention_kl's argument checks (every message) and API-level behaviour."""

import pytest
import torch

import nitrobrew
from attention_helpers import make_inputs, one_thread  # noqa: F401
from nitrobrew import attention_kl
from nitrobrew.core.checks import interpreter_enabled


def _ins(**kw):
    return make_inputs(B=2, H=4, Nq=6, Ds=8, Dt=8, **kw)


def test_lazy_export():
    assert nitrobrew.attention_kl is attention_kl


BAD_CALLS = [
    (lambda q, k, qt, kt: attention_kl(q.numpy(), k, qt, kt, is_causal=True), TypeError, "q_s must be a torch.Tensor"),
    (lambda q, k, qt, kt: attention_kl(q, k.long(), qt, kt, is_causal=True), TypeError, "k_s must be a floating-point"),
    (lambda q, k, qt, kt: attention_kl(q[0], k, qt, kt, is_causal=True), ValueError, "q_s must be 4-D"),
    (
        lambda q, k, qt, kt: attention_kl(q, k, qt, kt.to("meta"), is_causal=True),
        ValueError,
        "all tensors must be on one device",
    ),
    (lambda q, k, qt, kt: attention_kl(q, k.double(), qt, kt, is_causal=True), TypeError, "must share one dtype"),
    (lambda q, k, qt, kt: attention_kl(q, k, qt, kt, is_causal=1), TypeError, "is_causal must be a bool"),
    (
        lambda q, k, qt, kt: attention_kl(q, k, qt, kt, causal_offset=1.0, is_causal=True),
        TypeError,
        "causal_offset must be an int",
    ),
    (
        lambda q, k, qt, kt: attention_kl(q, k, qt, kt, direction="both", is_causal=True),
        ValueError,
        "direction must be one of",
    ),
    (
        lambda q, k, qt, kt: attention_kl(q, k, qt, kt, target="mean", is_causal=True),
        ValueError,
        "target must be one of",
    ),
    (
        lambda q, k, qt, kt: attention_kl(q, k, qt, kt, reduction="avg", is_causal=True),
        ValueError,
        "reduction must be one of",
    ),
    (
        lambda q, k, qt, kt: attention_kl(q, k, qt, kt, backend="cuda", is_causal=True),
        ValueError,
        "backend must be one of",
    ),
    (
        lambda q, k, qt, kt: attention_kl(q, k, qt, kt, temperature=0.0, is_causal=True),
        ValueError,
        "temperature must be",
    ),
    (
        lambda q, k, qt, kt: attention_kl(q, k, qt, kt, temperature=-1.0, is_causal=True),
        ValueError,
        "temperature must be",
    ),
    (
        lambda q, k, qt, kt: attention_kl(q, k, qt, kt, temperature=float("nan"), is_causal=True),
        ValueError,
        "temperature must be",
    ),
    (
        lambda q, k, qt, kt: attention_kl(q, k, qt, kt, scale_s=0.0, is_causal=True),
        ValueError,
        "scale_s must be None or",
    ),
    (
        lambda q, k, qt, kt: attention_kl(q, k, qt, kt, scale_t=float("inf"), is_causal=True),
        ValueError,
        "scale_t must be None or",
    ),
    (
        lambda q, k, qt, kt: attention_kl(q, k, qt, kt, chunk_size=0, is_causal=True),
        ValueError,
        "chunk_size must be a positive",
    ),
    (
        lambda q, k, qt, kt: attention_kl(q, k[:, :3], qt, kt, is_causal=True),
        ValueError,
        "k_s has 3 kv heads, which must divide",
    ),
    (
        lambda q, k, qt, kt: attention_kl(q, k[..., :4], qt, kt, is_causal=True),
        ValueError,
        "k_s head_dim 4 != its queries' head_dim 8",
    ),
    (
        lambda q, k, qt, kt: attention_kl(q, k[:1], qt, kt, is_causal=True),
        ValueError,
        "k_s batch 1 != its queries' batch 2",
    ),
    (lambda q, k, qt, kt: attention_kl(q, k, qt[:, :, :5], kt, is_causal=True), ValueError, "score grids differ"),
    (lambda q, k, qt, kt: attention_kl(q, k, qt, kt[:, :, :5], is_causal=True), ValueError, "score grids differ"),
    (
        lambda q, k, qt, kt: attention_kl(q, k, qt[:, :2], kt[:, :2], is_causal=True),
        ValueError,
        "the score grids [B, H, Nq, Nk] must match",
    ),
    (
        lambda q, k, qt, kt: attention_kl(q[:, :3], k[:, :3], qt, kt, target="head_mean", is_causal=True),
        ValueError,
        "to be a multiple of the student's 3",
    ),
    (
        lambda q, k, qt, kt: attention_kl(q, k, qt, kt, key_padding_mask=torch.ones(2, 6), is_causal=True),
        TypeError,
        "key_padding_mask must be a bool",
    ),
    (
        lambda q, k, qt, kt: attention_kl(
            q, k, qt, kt, key_padding_mask=torch.ones(2, 5, dtype=torch.bool), is_causal=True
        ),
        ValueError,
        "key_padding_mask must have shape (B, Nk) = (2, 6)",
    ),
    (
        lambda q, k, qt, kt: attention_kl(q, k, qt, kt, kv_lengths=torch.ones(2), is_causal=True),
        TypeError,
        "kv_lengths must be an integer",
    ),
    (
        lambda q, k, qt, kt: attention_kl(q, k, qt, kt, kv_lengths=torch.ones(3, dtype=torch.long), is_causal=True),
        ValueError,
        "kv_lengths must have shape (B,)",
    ),
    (
        lambda q, k, qt, kt: attention_kl(q, k, qt, kt, kv_lengths=torch.tensor([2, 7]), is_causal=True),
        ValueError,
        "kv_lengths must lie in [0, Nk=6]",
    ),
    (
        lambda q, k, qt, kt: attention_kl(q, k, qt, kt, query_mask=torch.ones(2, 6, dtype=torch.long), is_causal=True),
        TypeError,
        "query_mask must be a bool",
    ),
    (
        lambda q, k, qt, kt: attention_kl(q, k, qt, kt, query_mask=torch.ones(2, 7, dtype=torch.bool), is_causal=True),
        ValueError,
        "query_mask must have shape (B, Nq)",
    ),
    (
        lambda q, k, qt, kt: attention_kl(q, k, qt, kt, lse_t=torch.zeros(2, 4, 6, dtype=torch.long), is_causal=True),
        TypeError,
        "lse_t must be a floating-point",
    ),
    (
        lambda q, k, qt, kt: attention_kl(q, k, qt, kt, lse_t=torch.zeros(2, 4, 5), is_causal=True),
        ValueError,
        "lse_t must have shape (B, H_teacher, Nq) = (2, 4, 6)",
    ),
    (
        lambda q, k, qt, kt: attention_kl(
            q[:, :2], k[:, :2], qt.requires_grad_(), kt, target="head_mean", is_causal=True
        ),
        ValueError,
        "gives no teacher gradients",
    ),
    (
        lambda q, k, qt, kt: attention_kl(
            q[:, :2], k[:, :2], qt, kt, target="head_mean", backend="triton", is_causal=True
        ),
        ValueError,
        "supports target='per_head' only",
    ),
    (
        lambda q, k, qt, kt: attention_kl(q.double(), k.double(), qt, kt, backend="triton", is_causal=True),
        TypeError,
        "use backend='torch' for float64",
    ),
]


@pytest.mark.parametrize("call,exc,msg", BAD_CALLS, ids=[c[2][:40] for c in BAD_CALLS])
def test_errors(call, exc, msg):
    with pytest.raises(exc) as info:
        call(*_ins())
    assert msg in str(info.value)


@pytest.mark.skipif(interpreter_enabled(), reason="the interpreter makes CPU Triton legal")
def test_triton_on_cpu_needs_interpreter():
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        attention_kl(*_ins(), backend="triton", is_causal=True)


def test_auto_backend_on_cpu_is_torch_and_float64():
    ins = [t.double() for t in _ins()]
    out = attention_kl(*ins, is_causal=True)
    assert out.dtype == torch.float64


def test_empty_inputs_give_zero_and_zero_grads():
    q_s, k_s, q_t, k_t = make_inputs(B=1, H=2, Nq=4, Ds=8, Dt=8)
    ins = [q_s.requires_grad_(), k_s[:, :, :0].clone().requires_grad_(), q_t, k_t[:, :, :0]]
    loss = attention_kl(*ins, is_causal=False)
    loss.backward()
    assert float(loss.detach()) == 0.0 and (ins[0].grad == 0).all()


def test_nonnegative_and_zero_on_identical():
    q, k, qt, kt = make_inputs(B=1, H=2, Nq=12, Ds=8, Dt=8, seed=3)
    rows = attention_kl(q, k, qt, kt, reduction="none", backend="torch", is_causal=True)
    assert (rows >= -1e-6).all()
    assert float(attention_kl(q, k, q, k, backend="torch", is_causal=True).abs()) < 1e-6


def test_reverse_is_forward_with_roles_swapped():
    q, k, qt, kt = make_inputs(B=1, H=2, Nq=12, Ds=8, Dt=16, seed=4)
    a = attention_kl(q, k, qt, kt, direction="reverse", reduction="none", backend="torch", is_causal=True)
    b = attention_kl(qt, kt, q, k, direction="forward", reduction="none", backend="torch", is_causal=True)
    assert torch.allclose(a, b, atol=1e-6)


def test_temperature_is_score_division_no_t2():
    q, k, qt, kt = make_inputs(B=1, H=2, Nq=10, Ds=8, Dt=8, seed=5)
    a = attention_kl(q, k, qt, kt, temperature=2.0, backend="torch", is_causal=True)
    b = attention_kl(q, k, qt, kt, scale_s=8**-0.5 / 2, scale_t=8**-0.5 / 2, backend="torch", is_causal=True)
    assert torch.allclose(a, b, rtol=1e-6)
