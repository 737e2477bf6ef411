"""The Triton backend of the hidden-state losses, run by Triton's interpreter on CPU tensors.

Small, odd shapes: vocab sizes that are not multiples of the block, several row chunks (a tiny
memory_budget), vocab chunks that do not divide V, ignored rows, bf16, extreme temperatures.
Both modes (fast, constant_memory) against the float64 reference.
"""

from __future__ import annotations

import os

import pytest
import torch

from hidden_cases import (
    DIVERGENCES,
    LOSS_FNS,
    TOLERANCES,
    Tol,
    check_against_reference,
    make_case,
    run_loss,
    tiny_kl_case,
    tiny_kl_rel_err,
)

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET", "0") in ("", "0"), reason="needs TRITON_INTERPRET=1 on CPU"
)

V = 301  # prime: never a multiple of a block or of a chunk
MODES = {
    # fast with a budget of 5 rows of slabs: 3 row chunks for 13 rows
    "fast": dict(mode="fast", memory_budget=8 * V * 5),
    # constant memory: 4 vocab chunks of 80 (the last 61 wide) and 2-row blocks
    "constant_memory": dict(chunk_V=80, memory_budget=2 * (8 * 80 + 4 * 24)),
}
# The gradient slab is rounded to the inputs' dtype before the dX/dW products (as cuBLAS needs
# bf16 operands): elementwise bf16 gradient error is then a few 2^-9 of the largest entry.
BF16_GRAD = Tol(3e-2, 6e-3, 1e-5)


def _tol(dtype):
    value, grad = TOLERANCES[dtype]
    return (value, BF16_GRAD) if dtype == torch.bfloat16 else (value, grad)


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("divergence", DIVERGENCES)
def test_every_divergence_both_modes(divergence, mode):
    check_against_reference(
        "triton",
        torch.float32,
        divergence=divergence,
        shape=(13,),
        ds=24,
        dt=17,
        vocab=V,
        labels="some",
        temperature=1.7,
        **MODES[mode],
    )


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize(
    "divergence,reduction,temperature",
    [
        ("forward_kl", "none", 0.05),
        ("reverse_kl", "sum", 20.0),
        ("jsd", "none", 1.0),
        ("skew_reverse_kl", "mean", 0.3),
        ("tvd", "none", 3.0),
    ],
)
def test_bf16_reductions_temperatures(divergence, reduction, temperature, mode):
    check_against_reference(
        "triton",
        torch.bfloat16,
        divergence=divergence,
        shape=(2, 5),
        ds=24,
        dt=24,
        vocab=V,
        labels="some",
        reduction=reduction,
        temperature=temperature,
        tol=_tol(torch.bfloat16),
        **MODES[mode],
    )


@pytest.mark.parametrize("mode", list(MODES))
def test_fused_ce_bias_padded_heads(mode):
    check_against_reference(
        "triton",
        torch.float32,
        divergence="jsd",
        shape=(11,),
        ds=24,
        dt=24,
        vocab=V,
        pad_s=3,
        pad_t=9,
        bias=True,
        labels="some",
        temperature=2.5,
        beta=0.3,
        kd_weight=0.6,
        ce_weight=0.4,
        scale_t2=True,
        **MODES[mode],
    )


@pytest.mark.parametrize("mode", list(MODES))
def test_close_student_bf16(mode):
    # student = teacher + small noise: where bf16-rounded logits would give wrong gradients
    check_against_reference(
        "triton",
        torch.bfloat16,
        divergence="forward_kl",
        shape=(9,),
        ds=24,
        vocab=V,
        close=True,
        tol=_tol(torch.bfloat16),
        **MODES[mode],
    )


@pytest.mark.parametrize("mode", list(MODES))
def test_all_rows_ignored_is_zero(mode):
    chk = check_against_reference(
        "triton",
        torch.float32,
        divergence="reverse_kl",
        shape=(6,),
        ds=24,
        vocab=V,
        labels="all",
        ce_weight=1.0,
        **MODES[mode],
    )
    assert chk.loss.item() == 0.0
    assert all((g == 0).all() for g in chk.grads)


def test_triton_matches_torch_backend_exactly_enough():
    case = make_case(shape=(8,), ds=24, vocab=V, labels="some", seed=3)
    a = run_loss(case, "skew_kl", "triton", reduction="none", **MODES["fast"])
    b = run_loss(case, "skew_kl", "torch", reduction="none", chunk_V=64)
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_bad_mode_and_budget_raise():
    case = make_case(shape=(4,), ds=8, vocab=V)
    with pytest.raises(ValueError, match="mode must be"):
        run_loss(case, "forward_kl", "triton", mode="fastest")
    with pytest.raises(ValueError, match="memory_budget must be"):
        run_loss(case, "forward_kl", "triton", memory_budget=-1)


def test_float64_inputs_take_the_float64_path():
    chk = check_against_reference("triton", torch.float64, divergence="tvd", shape=(5,), ds=8, vocab=V)
    assert chk.loss.dtype == torch.float64


@pytest.mark.parametrize(
    "impl",
    [
        dict(backend="triton", **MODES["fast"]),
        dict(backend="triton", **MODES["constant_memory"]),
        dict(backend="torch", chunk_V=1000),
    ],
    ids=["fast", "constant_memory", "torch"],
)
@pytest.mark.parametrize("divergence", ["forward_kl", "reverse_kl"])
def test_tiny_kl_of_close_distributions_keeps_its_digits(divergence, impl):
    xs, ws, wt = tiny_kl_case()
    got = LOSS_FNS[divergence](xs, xs, ws, wt, reduction="none", **impl)
    assert tiny_kl_rel_err(divergence, got, xs, ws, wt) < 1e-3


def _finish_rows(vocab: int = 96):
    """Logit rows (identity heads: exact in fp32) that reach every branch of hidden_finish_kernel: spread,
    confident (15-18 nat gaps), close, one side masked or 200 nats below (on half the row, or on a few
    entries: the close form with lost mass), ties at the top, a NaN row, a row with no finite entry."""
    g = torch.Generator().manual_seed(5)
    s = torch.randn(12, vocab, generator=g) * 2.0
    t = torch.randn(12, vocab, generator=g) * 2.0
    t[1], t[1, 3] = 0.0, 15.0  # confident teacher, student close and far
    s[1] = t[1] + 0.01 * torch.randn(vocab, generator=g)
    t[2], t[2, 7] = 0.0, 18.0
    s[2], s[2, 7] = 0.0, 17.0
    s[3] = t[3] + 1e-3 * torch.randn(vocab, generator=g)  # close
    t[4, vocab // 2 :] = float("-inf")  # the teacher masked on half the row
    s[5, 5:] -= 200.0  # the student underflows there
    s[6], t[6] = 0.0, 0.0  # uniform, ties everywhere
    s[7, 4] = float("nan")
    s[8], t[8] = float("-inf"), float("-inf")
    t[9] = s[9] + 3.0  # a shift: p = q
    for row in (10, 11):  # close, with a little of the other side's mass lost (the close form's b)
        s[row] = t[row] + 0.01 * torch.randn(vocab, generator=g)
    t[10, :3] = float("-inf")
    s[11, :3] -= 200.0
    return s, t


@pytest.mark.parametrize("with_ce", [False, True], ids=["kd", "ce"])
@pytest.mark.parametrize("divergence", DIVERGENCES)
def test_row_finish_kernel_matches_the_pytorch_finish(divergence, with_ce):
    """hidden_finish_kernel (the row math between the Triton passes) against chunked.row_norm and
    finish_stats on the same pass-1 state and second-pass sums, column by column, NaN where they say NaN."""
    from nitrobrew import divergences as dv
    from nitrobrew.hidden import kernels as tr
    from nitrobrew.hidden.chunked import finish_stats, row_norm
    from nitrobrew.hidden.config import LossConfig
    from nitrobrew.hidden.triton_function import _first_pass_from_state

    name, param = dv.canonical(divergence, 0.3)
    cfg = LossConfig.build(name, param, 1.5, 1.0, 0.5 if with_ce else 0.0, False, None)
    s, t = _finish_rows()
    z, tt = s.contiguous(), t.contiguous()
    labels = torch.arange(z.shape[0]) * 7 % z.shape[1]
    st = tr.new_state(z.shape[0], z.device)
    tr.launch_stats(z, tt, st, labels, 0, cfg, 1, centred=False)
    fp = _first_pass_from_state(st, cfg, centred=False)
    vals = torch.full((z.shape[0], int(tr.NROW)), 7.0)
    sums, normed = None, None
    if cfg.divergence not in dv.ONE_PASS:
        normed = row_norm(fp, False)
        tr.launch_finish(st, vals, cfg, final=False, centred=False)
        torch.testing.assert_close(vals[:, :6], normed[0].stacked().t(), rtol=1e-5, atol=1e-9, equal_nan=True)
        assert (vals[:, 6:10] == 0).all()
        tr.launch_stats(z, tt, vals, None, 0, cfg, 2)
        sums = tuple(vals[:, k].clone() for k in range(6, 10))
    want = finish_stats(fp, cfg, sums, normed)
    tr.launch_finish(st, vals, cfg, final=True, centred=False)
    got = tr.row_stats(vals, cfg)
    for field in ("lse_s", "lse_t", "lse_z", "sum_u", "kd", "ce", "v_rest"):
        a, b = getattr(got, field), getattr(want, field)
        if b is None and field == "v_rest":
            b = torch.zeros_like(a)
        if b is None:
            assert a is None, field
            continue
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-9, equal_nan=True, msg=field)
    torch.testing.assert_close(
        got.row_norm().stacked(), want.row_norm().stacked(), rtol=1e-5, atol=1e-9, equal_nan=True
    )


@pytest.mark.parametrize("with_ce", [False, True], ids=["kd", "ce"])
@pytest.mark.parametrize("divergence", DIVERGENCES)
def test_a_fresh_first_slab_writes_the_whole_state(divergence, with_ce):
    """launch_stats(fresh=True) on a state of NaN (it must not read it) leaves the state a new_state gets
    from the same slab, every column (those the pass does not keep included)."""
    from nitrobrew import divergences as dv
    from nitrobrew.hidden import kernels as tr
    from nitrobrew.hidden.config import LossConfig

    name, param = dv.canonical(divergence, 0.3)
    cfg = LossConfig.build(name, param, 1.5, 1.0, 0.5 if with_ce else 0.0, False, None)
    s, t = _finish_rows()
    labels = torch.arange(s.shape[0]) * 7 % s.shape[1]
    want = tr.new_state(s.shape[0], s.device)
    tr.launch_stats(s, t, want, labels, 0, cfg, 1, centred=False)
    got = torch.full_like(want, float("nan"))
    tr.launch_stats(s, t, got, labels, 0, cfg, 1, centred=False, fresh=True)
    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)
