"""Triton top-k kernels under the interpreter (TRITON_INTERPRET=1) at small odd shapes."""
import pytest
import torch

from nitrobrew import _checks as ck

if not ck.triton_available() or not ck.interpreter_enabled():
    pytest.skip("needs triton with TRITON_INTERPRET=1 (make test sets it)", allow_module_level=True)

from nitrobrew.hidden.chunked import Online  # noqa: E402
from nitrobrew.topk import reference_topk_loss, topk_kl  # noqa: E402
from nitrobrew.topk import chunked as tc  # noqa: E402
from nitrobrew.topk import triton_dispatch as td  # noqa: E402
from nitrobrew.topk.rowmath import TopKConfig  # noqa: E402

N, D, V, K = 13, 24, 53, 5


def make(dtype=torch.float32, seed=0, close=False):
    g = torch.Generator().manual_seed(seed)
    xs = torch.randn(N, D, generator=g).to(dtype)
    ws = (torch.randn(V, D, generator=g) * 1.5).to(dtype)
    bs = torch.randn(V, generator=g).to(dtype)
    t = (xs.double() @ ws.double().t() + 0.3 * torch.randn(N, V, generator=g, dtype=torch.float64)) if close \
        else torch.randn(N, V, generator=g, dtype=torch.float64) * 5
    lp, ids = torch.log_softmax(t, -1).topk(K, -1)
    lp = lp.clone()
    lp[2, 3:] = float("-inf")
    ids[2, 3:] = 10**6
    lp[5] = float("-inf")
    labels = torch.randint(0, V, (N,), generator=g)
    labels[1] = -100
    return xs.requires_grad_(), ws.requires_grad_(), bs.requires_grad_(), ids, lp.float(), labels


def _rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


CASES = [
    dict(normalize="full"),
    dict(normalize="full", tail=True, temperature=2.0, ce_weight=0.5, bias=True),
    dict(normalize="full", ce_weight=1.0, bias=True, reduction="none"),
    dict(normalize="full", divergence="jsd", beta=0.3, tail=True, temperature=0.7, ce_weight=0.2),
    dict(normalize="topk"),
    dict(normalize="topk", divergence="reverse_kl", temperature=1.5, bias=True),
    dict(normalize="topk", divergence="jsd", reduction="none"),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_triton_matches_reference(case):
    case = dict(case)
    bias = case.pop("bias", False)
    xs, ws, bs, ids, lp, labels = make(close=case.get("normalize") == "full")
    case["bs"] = bs if bias else None
    out = topk_kl(xs, ws, ids, lp, labels=labels, backend="triton", **case)
    param = case.pop("beta", 0.5)
    ref = reference_topk_loss(xs, ws, ids, lp, labels=labels, param=param, **case)
    torch.testing.assert_close(out.double(), ref, rtol=2e-5, atol=1e-6)
    up = torch.randn_like(ref) if ref.dim() else torch.ones(())
    ts = [xs, ws] + ([bs] if bias else [])
    for a, b in zip(torch.autograd.grad(out, ts, up.to(out.dtype)), torch.autograd.grad(ref, ts, up.double())):
        assert _rel(a, b) < 1e-4


def test_triton_native_accumulation_and_no_head_grad(monkeypatch):
    xs, ws, bs, ids, lp, labels = make(seed=1)
    ref = reference_topk_loss(xs, ws, ids, lp)
    gx_ref, gw_ref = torch.autograd.grad(ref, [xs, ws])
    monkeypatch.setattr(td, "GRAD_ACCUM", "native")
    out = topk_kl(xs, ws, ids, lp, backend="triton")
    gx, gw = torch.autograd.grad(out, [xs, ws])
    assert _rel(gx, gx_ref) < 1e-4 and _rel(gw, gw_ref) < 1e-4
    out = topk_kl(xs, ws.detach(), ids, lp, backend="triton")
    gx2, = torch.autograd.grad(out, [xs])
    assert _rel(gx2, gx_ref) < 1e-4


def test_triton_bf16_inputs():
    xs, ws, bs, ids, lp, labels = make(dtype=torch.bfloat16, seed=2)
    for norm in ("full", "topk"):
        out = topk_kl(xs, ws, ids, lp, normalize=norm, backend="triton")
        ref = reference_topk_loss(xs, ws, ids, lp, normalize=norm)
        assert out.dtype == torch.float32
        assert abs(out.item() - ref.item()) <= 1e-4 * max(1.0, abs(ref.item()))
        gx, gw = torch.autograd.grad(out, [xs, ws])
        rx, rw = torch.autograd.grad(ref, [xs, ws])
        assert gx.dtype == torch.bfloat16 and _rel(gx, rx) < 2e-2 and _rel(gw, rw) < 2e-2


def test_vocab_range_pieces_merge_to_the_whole():
    """Per-range statistics (as a vocab-parallel wrapper computes them) merge to the full result,
    for both backends' pieces."""
    xs, ws, bs, ids, lp, labels = make(seed=3)
    x, w, b = xs.detach(), ws.detach(), bs.detach()
    cfg = TopKConfig("forward_kl", 0.0, "full", True, 1.3, 1.0, 0.0)
    valid = torch.isfinite(lp)
    safe = torch.where(valid, ids, 0)
    whole = tc.vocab_pass(x, w, b, None, tc.Entries.build(safe, valid), cfg, chunk=8)
    cuts = [0, 17, 30, V]
    parts = [tc.vocab_pass(x, w[lo:hi], b[lo:hi], None, tc.Entries.build(safe, valid), cfg, lo=lo, chunk=8)
             for lo, hi in zip(cuts, cuts[1:])]
    merged = tc.merge_states([p.s for p in parts])
    torch.testing.assert_close(merged.lse(), whole.s.lse())
    torch.testing.assert_close(sum(p.z_ids for p in parts), whole.z_ids)
    # Triton pieces: lse per range as Online(lse, 1), logits at the ids of each range
    tl_parts = [td.lse_range(x, w[lo:hi].contiguous(), b[lo:hi].contiguous(), 1.3, False)[0]
                for lo, hi in zip(cuts, cuts[1:])]
    ones = torch.ones(N)
    merged_t = tc.merge_states([Online(p, ones) for p in tl_parts])
    torch.testing.assert_close(merged_t.lse(), whole.s.lse(), rtol=1e-5, atol=1e-5)
    z = sum(td.gather_logits(x, w[lo:hi].contiguous(), b[lo:hi].contiguous(), safe, lo=lo)
            for lo, hi in zip(cuts, cuts[1:]))
    torch.testing.assert_close(torch.where(valid, z, 0).reshape(-1), whole.z_ids, rtol=1e-5, atol=1e-5)


def test_triton_memory_has_no_vocab_wide_rows_tensor():
    """No [rows, V] tensor: the largest allocation is the (fp32) dW accumulator [V, D]."""
    from nitrobrew._memory import TensorMemoryTracker

    g = torch.Generator().manual_seed(5)
    n, d, v = 24, 8, 130
    xs = torch.randn(n, d, generator=g).requires_grad_()
    ws = torch.randn(v, d, generator=g).requires_grad_()
    lp, ids = torch.log_softmax(torch.randn(n, v, generator=g) * 3, -1).topk(K, -1)
    for norm in ("full", "topk"):
        with TensorMemoryTracker() as tr:
            out = topk_kl(xs, ws, ids, lp, normalize=norm, backend="triton")
            out.backward()
        assert tr.largest <= v * d * 4 < n * v * 4, (norm, tr.largest_shape)
