"""Memory claims of the PyTorch path, measured with TensorMemoryTracker on CPU.

The chunked losses never hold a [rows, V] tensor: working memory is O(rows * chunk_V), plus the
[V, D] head gradient. D is tiny here so that the head gradient is itself far below rows * V.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hidden_cases import DIVERGENCES, make_case, run_loss, run_reference, upstream_grad
from nitrobrew.core.memory import TensorMemoryTracker

N, D, V, CHUNK = 128, 4, 4096, 64
F32_BYTES = 4
ROWS_X_V = N * V * F32_BYTES  # one fp32 [rows, V] slab: 2 MiB
SLAB = N * CHUNK * F32_BYTES  # one fp32 [rows, chunk_V] slab: 32 KiB
# Allowance: a bounded number of chunk slabs live at once (logits of both heads, log-probs,
# the divergence's elementwise terms, the gradient chunk), the [V, D] head gradient and the [V]
# bias gradient (kept twice: the gradient and its accumulation), and per-row vectors.
MAX_SLABS = 16


def lean_bound(rows: int, vocab: int, dim: int, chunk: int) -> int:
    return MAX_SLABS * rows * chunk * F32_BYTES + 2 * vocab * (dim + 1) * F32_BYTES + 64 * rows * 8


def assert_lean(tracker: TensorMemoryTracker, rows: int, vocab: int, dim: int, chunk: int, what: str) -> None:
    """The memory claim: no [rows, V]-sized tensor, live bytes O(rows * chunk + V * D)."""
    assert tracker.largest <= rows * vocab * F32_BYTES // 16, (
        f"{what}: largest tensor {tracker.largest} B {tracker.largest_shape} vs rows x V = {rows * vocab * 4} B"
    )
    bound = lean_bound(rows, vocab, dim, chunk)
    assert tracker.peak <= bound, f"{what}: peak live {tracker.peak} B > O(rows*chunk + V*D) bound {bound} B"


def _measure(case, divergence, **options):
    """Tracked forward, then tracked backward (separately: the backward must be lean on its own)."""
    with TensorMemoryTracker() as fwd:
        loss = run_loss(case, divergence, "torch", **options)
    up = upstream_grad(loss).to(loss.dtype)
    with TensorMemoryTracker() as bwd:
        grads = torch.autograd.grad(loss, case.student_leaves(), up)
    assert all(torch.isfinite(g).all() for g in grads)
    return fwd, bwd


@pytest.mark.parametrize("divergence", DIVERGENCES)
def test_chunked_forward_and_backward_are_lean(divergence):
    case = make_case(shape=(N,), ds=D, dt=D + 2, vocab=V, bias=True, labels="some", seed=1)
    fwd, bwd = _measure(case, divergence, chunk_V=CHUNK, ce_weight=0.5, temperature=2.0, reduction="none")
    assert V * D * F32_BYTES * 16 <= ROWS_X_V * 2  # the [V, D] gradient is itself far below rows x V
    assert_lean(fwd, N, V, D, CHUNK, f"{divergence} forward")
    assert_lean(bwd, N, V, D, CHUNK, f"{divergence} backward")
    # the forward keeps nothing of size V at all
    assert fwd.largest <= max(SLAB, N * 64), fwd.largest_shape


def test_peak_follows_chunk_not_vocab():
    """Forward peak is independent of V; it grows with chunk_V (so the tracker measures the slabs)."""

    def fwd_peak(vocab, chunk):
        case = make_case(shape=(N,), ds=D, vocab=vocab, bias=True, labels="some", seed=2)
        return _measure(case, "jsd", chunk_V=chunk)[0].peak

    small, large = fwd_peak(V, CHUNK), fwd_peak(2 * V, CHUNK)
    assert large <= small * 1.05 + 1024, (small, large)
    assert fwd_peak(V, 4 * CHUNK) >= 3 * small


def test_bf16_inputs_are_lean():
    case = make_case(shape=(N,), ds=D, vocab=V, dtype=torch.bfloat16, labels="some", seed=3)
    fwd, bwd = _measure(case, "reverse_kl", chunk_V=CHUNK)
    assert_lean(fwd, N, V, D, CHUNK, "bf16 forward")
    assert_lean(bwd, N, V, D, CHUNK, "bf16 backward")


def _naive_forward_kl(case):
    s = case.xs @ case.ws.t() + case.bs
    t = case.xt @ case.wt.t() + case.bt
    return F.kl_div(F.log_softmax(s, -1), F.log_softmax(t, -1), log_target=True, reduction="batchmean")


def test_tracker_catches_a_naive_materialization():
    """The same assertions fail on a materializing implementation, in its forward and in its
    backward alone: the test above can fail."""
    case = make_case(shape=(N,), ds=D, vocab=V, bias=True, seed=4)
    with TensorMemoryTracker() as fwd:
        loss = _naive_forward_kl(case)
    assert fwd.largest >= ROWS_X_V and fwd.largest_shape == (N, V)
    with pytest.raises(AssertionError, match="largest tensor"):
        assert_lean(fwd, N, V, D, CHUNK, "naive forward")
    with TensorMemoryTracker() as bwd:
        torch.autograd.grad(loss, case.student_leaves())
    assert bwd.largest >= ROWS_X_V
    with pytest.raises(AssertionError, match="largest tensor"):
        assert_lean(bwd, N, V, D, CHUNK, "naive backward")
    # a peak made of many chunk-sized tensors kept alive is caught too
    with TensorMemoryTracker() as kept:
        slabs = [torch.empty(N, CHUNK) for _ in range(V // CHUNK)]
    assert kept.largest == SLAB and kept.peak >= ROWS_X_V
    with pytest.raises(AssertionError, match="peak live"):
        assert_lean(kept, N, V, D, CHUNK, "kept slabs")
    del slabs
    # and the float64 reference materializes, as documented
    with TensorMemoryTracker() as ref:
        run_reference(case, "forward_kl")
    assert ref.largest >= N * V * 8
