"""attention_kl's PyTorch path (key-chunked autograd Function) against the float64 reference."""

import math

import pytest
import torch
import torch.nn.functional as F

from attention_helpers import compare, make_inputs, one_thread, rel  # noqa: F401
from nitrobrew import attention_kl
from nitrobrew.attention import reference_attention_kl
from nitrobrew.core.memory import TensorMemoryTracker


@pytest.mark.parametrize("direction", ["forward", "reverse"])
@pytest.mark.parametrize("is_causal", [True, False])
def test_values_and_grads(direction, is_causal):
    ins = make_inputs(B=2, H=4, Nq=21, Ds=16, Dt=24, hkv_s=2, hkv_t=1)
    compare(ins, backend="torch", chunk_size=8, direction=direction, is_causal=is_causal, teacher_grad=True)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_reductions_with_masks(reduction):
    ins = make_inputs(B=3, H=2, Nq=13, Nk=17, Ds=8, Dt=8, seed=1)
    kpm = torch.rand(3, 17, generator=torch.Generator().manual_seed(3)) > 0.3
    kpm[1] = False  # batch 1: every row fully masked
    qm = torch.ones(3, 13, dtype=torch.bool)
    qm[2, 5:] = False
    compare(
        ins,
        backend="torch",
        chunk_size=5,
        reduction=reduction,
        is_causal=False,
        key_padding_mask=kpm,
        query_mask=qm,
        teacher_grad=True,
    )


def test_causal_nq_ne_nk_top_left_and_offset():
    for Nq, Nk, off in [(9, 20, 0), (20, 9, 0), (9, 20, 11), (12, 12, -3)]:
        ins = make_inputs(B=1, H=2, Nq=Nq, Nk=Nk, Ds=8, Dt=8, seed=Nq + Nk)
        compare(ins, backend="torch", chunk_size=4, is_causal=True, causal_offset=off, teacher_grad=True)


@pytest.mark.parametrize("Nq,Nk", [(7, 12), (12, 7)])
def test_causal_alignment_is_sdpa(Nq, Nk):
    """is_causal follows SDPA (top-left aligned): compare with SDPA's own attention weights."""
    q_s, k_s, q_t, k_t = make_inputs(B=1, H=2, Nq=Nq, Nk=Nk, Ds=8, Dt=8, dtype=torch.float64, seed=Nq)
    eye = torch.eye(Nk, dtype=torch.float64).expand(1, 2, Nk, Nk)
    P = F.scaled_dot_product_attention(q_t, k_t, eye, is_causal=True)  # rows = attention weights
    Q = F.scaled_dot_product_attention(q_s, k_s, eye, is_causal=True)
    expected = torch.where(P > 0, P * (P.log() - Q.log()), torch.zeros_like(P)).sum(-1)
    got = attention_kl(q_s, k_s, q_t, k_t, backend="torch", is_causal=True, reduction="none")
    assert torch.allclose(got, expected, atol=1e-10)


def test_kv_lengths_equal_padding_mask():
    ins = make_inputs(B=3, H=2, Nq=11, Ds=8, Dt=8, seed=4)
    lengths = torch.tensor([11, 4, 0])
    kpm = torch.arange(11)[None, :] < lengths[:, None]
    a = attention_kl(*ins, backend="torch", kv_lengths=lengths, reduction="none", is_causal=True)
    b = attention_kl(*ins, backend="torch", key_padding_mask=kpm, reduction="none", is_causal=True)
    assert torch.equal(a, b)
    assert (a[2] == 0).all()


def test_fully_masked_rows_zero_and_no_nan():
    ins = [t.requires_grad_() for t in make_inputs(B=1, H=2, Nq=6, Ds=8, Dt=8)]
    kpm = torch.zeros(1, 6, dtype=torch.bool)
    loss = attention_kl(*ins, backend="torch", key_padding_mask=kpm, is_causal=True)
    loss.backward()
    assert float(loss.detach()) == 0.0
    assert all(t.grad is not None and (t.grad == 0).all() for t in ins[:2])
    # negative causal offset: the first rows see nothing
    ins = [t.detach().requires_grad_() for t in ins]
    rows = attention_kl(*ins, backend="torch", causal_offset=-2, reduction="none", is_causal=True)
    assert (rows[..., :3] == 0).all() and (rows[..., 3:] > 0).all()  # row 2 sees one key: KL 0
    rows.sum().backward()
    assert torch.isfinite(ins[0].grad).all()


def test_temperature_scales_and_close_case():
    ins = make_inputs(B=1, H=2, Nq=16, Ds=16, Dt=16, close=True, seed=5)
    out, ref = compare(
        ins, backend="torch", chunk_size=4, temperature=2.5, scale_s=0.3, scale_t=0.2, rtol_val=1e-4, rtol_grad=1e-3
    )
    ins = make_inputs(B=1, H=2, Nq=16, Ds=16, Dt=16, close=True, seed=6)
    out, ref = compare(ins, backend="torch", chunk_size=4, rtol_val=1e-4, rtol_grad=1e-3)
    assert 0 < float(ref.detach()) < 1e-2  # really the "close" regime


def test_shifted_scores_no_cancellation():
    """Teacher scores = student scores + a large per-row shift: KL is exactly 0 (softmax shift
    invariance); the centred accumulation keeps it tiny instead of rounding noise of O(shift)."""
    q, k, _, _ = make_inputs(B=1, H=2, Nq=32, Ds=16, Dt=16, seed=7)
    # append a constant-key coordinate: q_t . k_t = q . k + 300 * c_i for every key
    q_t = torch.cat([q, 300 * torch.rand(1, 2, 32, 1)], -1)
    k_t = torch.cat([k, torch.ones(1, 2, 32, 1)], -1)
    rows = attention_kl(q, k, q_t, k_t, backend="torch", scale_s=0.25, scale_t=0.25, reduction="none", is_causal=True)
    assert rows.abs().max() < 1e-4


def test_lse_t_input():
    ins = make_inputs(B=2, H=2, Nq=12, Ds=8, Dt=8, seed=8)
    q_t, k_t = ins[2].double(), ins[3].double()
    s = (q_t @ k_t.transpose(-1, -2)) / math.sqrt(8) / 1.5
    s = s.masked_fill(torch.ones(12, 12, dtype=torch.bool).triu(1), float("-inf"))
    lse = torch.logsumexp(s, -1).float()
    for direction in ("forward", "reverse"):
        compare(ins, backend="torch", chunk_size=4, temperature=1.5, direction=direction, lse_t=lse)
        # slightly off lse: still exact (the kernel renormalizes), gradients too
        compare(ins, backend="torch", chunk_size=4, temperature=1.5, direction=direction, lse_t=lse + 0.3)


@pytest.mark.parametrize("direction", ["forward", "reverse"])
def test_head_mean_target(direction):
    B, Hs, Ht, N = 2, 2, 6, 13
    g = torch.Generator().manual_seed(9)
    q_s = torch.randn(B, Hs, N, 8, generator=g) * 2
    k_s = torch.randn(B, 1, N, 8, generator=g) * 2
    q_t = torch.randn(B, Ht, N, 16, generator=g) * 2
    k_t = torch.randn(B, 2, N, 16, generator=g) * 2
    kpm = torch.ones(B, N, dtype=torch.bool)
    kpm[1, 3] = False
    compare(
        [q_s, k_s, q_t, k_t],
        backend="torch",
        chunk_size=4,
        target="head_mean",
        direction=direction,
        key_padding_mask=kpm,
    )
    # with the exact per-head teacher lse supplied
    s = (q_t.double() @ k_t.double().repeat_interleave(3, 1).transpose(-1, -2)) / 4.0
    vis = torch.ones(N, N, dtype=torch.bool).tril()[None, None] & kpm[:, None, None, :]
    lse = torch.logsumexp(s.masked_fill(~vis, float("-inf")), -1)
    compare(
        [q_s, k_s, q_t, k_t],
        backend="torch",
        chunk_size=4,
        target="head_mean",
        direction=direction,
        key_padding_mask=kpm,
        lse_t=lse.float(),
    )


def test_reference_matches_kl_div():
    """The reference itself against torch's kl_div on explicit masked softmaxes."""
    q_s, k_s, q_t, k_t = make_inputs(B=1, H=3, Nq=9, Ds=8, Dt=12, dtype=torch.float64, seed=10)
    mask = torch.ones(9, 9, dtype=torch.bool).tril()
    a = (q_t @ k_t.transpose(-1, -2) / math.sqrt(12)).masked_fill(~mask, float("-inf"))
    b = (q_s @ k_s.transpose(-1, -2) / math.sqrt(8)).masked_fill(~mask, float("-inf"))
    p, logq = torch.softmax(a, -1), torch.log_softmax(b, -1)
    expected = torch.where(p > 0, p * (torch.log(p) - logq), torch.zeros_like(p)).sum(-1)
    got = reference_attention_kl(q_s, k_s, q_t, k_t, reduction="none", is_causal=True)
    assert torch.allclose(got, expected, atol=1e-12)


def test_float64_path_and_dtype():
    ins = make_inputs(B=1, H=2, Nq=10, Ds=8, Dt=8, dtype=torch.float64)
    out, ref = compare(ins, backend="torch", chunk_size=3, rtol_val=1e-12, rtol_grad=1e-10)
    assert out.dtype == torch.float64


def test_bf16_inputs_torch():
    ins = make_inputs(B=1, H=2, Nq=24, Ds=16, Dt=16, dtype=torch.bfloat16, seed=11)
    out, _ = compare(ins, backend="torch", chunk_size=8, rtol_val=1e-5, rtol_grad=1e-2)
    assert out.dtype == torch.float32
    ins[0].grad = None


def test_memory_no_score_map():
    """The chunked path never holds an [Nq, Nk]-sized tensor: peak memory ~ B*H*Nq*chunk."""
    B, H, N, D, chunk = 1, 1, 512, 16, 16
    q_s, k_s, q_t, k_t = (t.requires_grad_(i < 2) for i, t in enumerate(make_inputs(B=B, H=H, Nq=N, Ds=D, Dt=D)))
    with TensorMemoryTracker() as tr:
        loss = attention_kl(q_s, k_s, q_t, k_t, backend="torch", chunk_size=chunk, is_causal=False)
        loss.backward()
    full_map = B * H * N * N * 4
    tile = B * H * N * chunk * 4
    inputs = B * H * N * D * 4
    assert tr.largest <= max(tile, inputs), (tr.largest, tr.largest_shape)
    # peak: a dozen tiles plus gradients / accumulators of input size, far below one score map
    assert tr.peak <= 16 * tile + 8 * inputs, (tr.peak, tile)
    assert tr.peak < full_map / 2


def test_rows_counted_in_mean():
    ins = make_inputs(B=2, H=2, Nq=8, Ds=8, Dt=8, seed=12)
    kpm = torch.ones(2, 8, dtype=torch.bool)
    kpm[1] = False
    rows = attention_kl(*ins, backend="torch", key_padding_mask=kpm, reduction="none", is_causal=True)
    mean = attention_kl(*ins, backend="torch", key_padding_mask=kpm, is_causal=True)
    assert torch.allclose(mean, rows.sum() / (1 * 2 * 8))
    assert (
        rel(attention_kl(*ins, backend="torch", key_padding_mask=kpm, reduction="sum", is_causal=True), rows.sum())
        < 1e-6
    )
