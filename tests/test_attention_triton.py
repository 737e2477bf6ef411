"""Triton attention-KL kernels (forward, dq, dk) against the float64 reference.

Runs under Triton's CPU interpreter (TRITON_INTERPRET=1, as in CI) at small odd shapes: sequence
lengths that are not multiples of the 16-wide interpreter tiles, grouped-query attention with
different groupings per side, different head dims, causal and not, padding masks, bf16.
"""

import pytest
import torch

from attention_helpers import compare, make_inputs, one_thread, rel  # noqa: F401
from nitrobrew import attention_kl
from nitrobrew.core.checks import interpreter_enabled, triton_available

pytestmark = pytest.mark.skipif(
    not (triton_available() and interpreter_enabled()), reason="needs triton with TRITON_INTERPRET=1"
)


@pytest.mark.parametrize("direction", ["forward", "reverse"])
@pytest.mark.parametrize("is_causal", [True, False])
def test_gqa_odd_shapes_teacher_grads(direction, is_causal):
    ins = make_inputs(B=2, H=4, Nq=21, Ds=16, Dt=24, hkv_s=2, hkv_t=1, seed=1)
    compare(ins, backend="triton", direction=direction, is_causal=is_causal, teacher_grad=True, temperature=1.7)


@pytest.mark.parametrize("direction", ["forward", "reverse"])
def test_same_grouping_both_dk_in_one_pass(direction):
    ins = make_inputs(B=1, H=4, Nq=19, Ds=16, Dt=20, hkv_s=2, hkv_t=2, seed=2)
    compare(ins, backend="triton", direction=direction, teacher_grad=True, reduction="none")


def test_padding_mask_query_mask_nq_ne_nk():
    ins = make_inputs(B=3, H=2, Nq=13, Nk=19, Ds=16, Dt=16, seed=3)
    g = torch.Generator().manual_seed(3)
    kpm = torch.rand(3, 19, generator=g) > 0.3
    kpm[1] = False
    qm = torch.ones(3, 13, dtype=torch.bool)
    qm[0, 7:] = False
    for is_causal in (False, True):
        compare(
            ins,
            backend="triton",
            is_causal=is_causal,
            key_padding_mask=kpm,
            query_mask=qm,
            reduction="sum",
            teacher_grad=True,
        )


@pytest.mark.parametrize("Nq,Nk,off", [(9, 23, 0), (23, 9, 0), (9, 23, 14), (17, 17, -5)])
def test_causal_alignment_and_offset(Nq, Nk, off):
    ins = make_inputs(B=1, H=2, Nq=Nq, Nk=Nk, Ds=16, Dt=16, seed=Nq + Nk)
    compare(ins, backend="triton", causal_offset=off, reduction="none")


def test_bf16_and_fp16():
    ins = make_inputs(B=1, H=2, Nq=33, Ds=32, Dt=16, hkv_t=1, dtype=torch.bfloat16, seed=4)
    out, ref = compare(ins, backend="triton", rtol_val=1e-4, rtol_grad=2e-2)
    assert out.dtype == torch.float32
    ins = make_inputs(B=1, H=2, Nq=20, Ds=16, Dt=16, dtype=torch.float16, sigma=1.5, seed=5)
    compare(ins, backend="triton", direction="reverse", rtol_val=1e-4, rtol_grad=2e-2)


def test_lse_t_and_close_case():
    ins = make_inputs(B=1, H=2, Nq=18, Ds=16, Dt=16, close=True, seed=6)
    q_t, k_t = ins[2].double(), ins[3].double()
    s = (q_t @ k_t.transpose(-1, -2)) / 4.0
    s = s.masked_fill(torch.ones(18, 18, dtype=torch.bool).triu(1), float("-inf"))
    lse = torch.logsumexp(s, -1).float()
    for direction in ("forward", "reverse"):
        out, ref = compare(
            ins, backend="triton", direction=direction, lse_t=lse, rtol_val=1e-4, rtol_grad=1e-3, teacher_grad=True
        )
    assert float(ref.detach()) < 1e-2


def test_even_tiles_and_block_override_match_torch():
    """Sizes that are multiples of the tiles (the unmasked fast path) and larger tiles."""
    ins = make_inputs(B=1, H=2, Nq=64, Ds=16, Dt=32, seed=7)
    a = attention_kl(
        *ins,
        backend="triton",
        reduction="none",
        block_config={"fwd": (32, 16, 4, 1), "dq": (16, 32, 4, 1), "dk": (32, 16, 4, 1)},
        is_causal=True,
    )
    b = attention_kl(*ins, backend="torch", reduction="none", is_causal=True)
    assert rel(a, b) < 1e-5
    compare(ins, backend="triton", block_config={"fwd": (32, 16, 4, 1), "dq": (16, 32, 4, 1), "dk": (32, 16, 4, 1)})


def test_fully_masked_and_strided_inputs():
    B, N, H, D = 2, 14, 2, 16
    g = torch.Generator().manual_seed(8)
    # [B, N, H, D] storage viewed as SDPA's [B, H, N, D]: non-contiguous heads, contiguous last dim
    q_s, k_s, q_t, k_t = (torch.randn(B, N, H, D, generator=g).mul(2).transpose(1, 2) for _ in range(4))
    kpm = torch.ones(B, N, dtype=torch.bool)
    kpm[1] = False
    ins = [t.requires_grad_() for t in (q_s, k_s, q_t, k_t)]
    rows = attention_kl(*ins, backend="triton", key_padding_mask=kpm, reduction="none", is_causal=False)
    assert (rows[1] == 0).all() and (rows[0] > 0).all()
    rows.sum().backward()
    for t in ins:
        assert torch.isfinite(t.grad).all()
        assert (t.grad[1] == 0).all()
    compare([t.detach() for t in ins], backend="triton", key_padding_mask=kpm, teacher_grad=True)
