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


if triton_available():
    import triton
    import triton.language as tl

    from nitrobrew.attention import kernels_tiles as kt

    @triton.jit
    def launch_ids_kernel(OUT, n_rows, heads_per_section, BR: tl.constexpr, LAST_FIRST: tl.constexpr):
        """Writes (block, head) of each program as the attention kernels take them."""
        block, head = kt.program_ids(n_rows, heads_per_section, BR, LAST_FIRST)
        pid = tl.program_id(0)
        tl.store(OUT + 2 * pid, block)
        tl.store(OUT + 2 * pid + 1, head)


def _launch_pairs(n_rows, block_rows, heads, streamed_bytes, last_first):
    """(block, head) of each program of kernels_tiles.program_grid's launch, in launch order."""
    blocks = triton.cdiv(n_rows, block_rows)
    grid, section = kt.program_grid(blocks, heads, streamed_bytes)
    out = torch.full((2 * grid[0],), -1, dtype=torch.int32)
    launch_ids_kernel[grid](out, n_rows, section, BR=block_rows, LAST_FIRST=last_first)
    return [tuple(p) for p in out.view(-1, 2).tolist()], section, blocks


@pytest.mark.parametrize(
    "n_rows,block_rows,heads,section_heads", [(1000, 64, 5, 5), (64, 64, 3, 1), (300, 16, 7, 3), (129, 64, 32, 32)]
)
@pytest.mark.parametrize("last_first", [True, False])
def test_launch_sections_run_every_block_once_longest_first(
    n_rows, block_rows, heads, section_heads, last_first, monkeypatch
):
    """Every (block, head) exactly once; within a section of heads, block by block (the first block the
    longest when last_first), the sections one after the other; a last section that is partial."""
    monkeypatch.setattr(kt, "L2_SECTION_BYTES", section_heads * 1000)
    pairs, section, blocks = _launch_pairs(n_rows, block_rows, heads, 1000, last_first)
    assert section == section_heads
    assert sorted(pairs) == [(b, h) for b in range(blocks) for h in range(heads)]
    expected = []
    for first in range(0, heads, section):
        for i in range(blocks):
            b = blocks - 1 - i if last_first else i
            expected += [(b, h) for h in range(first, min(heads, first + section))]
    assert pairs == expected


def test_launch_section_size_from_the_l2_budget():
    mib = 2**20
    assert kt.program_grid(10, 32, 1 * mib) == ((320,), 32)  # N = 2048, D = 128, bf16, both sides
    assert kt.program_grid(10, 32, 4 * mib) == ((320,), 8)
    assert kt.program_grid(10, 32, 16 * mib) == ((320,), 2)
    assert kt.program_grid(10, 32, 64 * mib) == ((320,), 1)  # more than the budget: head by head
    assert kt.program_grid(10, 3, 1) == ((30,), 3)  # never more than the heads
    # grouped-query keys count once per kv head: 4 query heads a kv head fit 4x the heads a section
    k = torch.empty(1, 32, 8192, 128, dtype=torch.bfloat16)
    k_gqa = torch.empty(1, 8, 8192, 128, dtype=torch.bfloat16)
    assert kt.key_bytes_per_query_head(k, k, 32) == 4 * mib
    assert kt.key_bytes_per_query_head(k_gqa, k_gqa, 32) == mib
    assert kt.key_bytes_per_query_head(k_gqa, k[:, :, :, :64], 32) == mib // 2 + mib
    # the dk kernels' sections hold kv heads, each streaming the queries of its 4 query heads
    assert kt.query_bytes_per_kv_head(k, k, 8) == 4 * 4 * mib
    assert kt.query_bytes_per_kv_head(k, k, 32) == 4 * mib


@pytest.mark.parametrize("section_bytes", [1, 10**12])
def test_results_do_not_depend_on_the_launch_order(section_bytes, monkeypatch):
    """Head by head and all heads in one section: the same loss and gradients, bit for bit, as the
    default sections (GQA, causal offset, odd N)."""
    ins = make_inputs(B=2, H=4, Nq=37, Ds=16, Dt=24, hkv_s=2, hkv_t=1, seed=5)

    def run():
        x = [t.clone().requires_grad_(i < 2) for i, t in enumerate(ins)]
        out = attention_kl(*x, is_causal=True, causal_offset=3, reduction="none", backend="triton")
        out.sum().backward()
        return out.detach(), x[0].grad, x[1].grad

    monkeypatch.setattr(kt, "L2_SECTION_BYTES", 4 * 37 * (16 + 24) * 4)  # sections of 4 of the 8 heads
    base = run()
    monkeypatch.setattr(kt, "L2_SECTION_BYTES", section_bytes)
    for a, b in zip(base, run()):
        assert torch.equal(a, b)


def _grads(ins, upstream, cfg, *, reduction="mean", teacher_grad=False, calls=1, **kw):
    """Gradients of upstream * attention_kl (backward `calls` times through one graph), of every input that
    requires grad."""
    xs = [t.clone().requires_grad_(i < 2 or teacher_grad) for i, t in enumerate(ins)]
    loss = attention_kl(*xs, backend="triton", is_causal=True, reduction=reduction, block_config=cfg, **kw)
    out = []
    for c in range(calls):
        out.append(torch.autograd.grad(loss * upstream, [t for t in xs if t.requires_grad], retain_graph=c < calls - 1))
    return loss, out


def _count_backward_launches(monkeypatch):
    from nitrobrew.attention import triton_function as tfn

    calls = []
    real = tfn.triton_backward

    def counted(*a, **k):
        calls.append(1)
        return real(*a, **k)

    monkeypatch.setattr(tfn, "triton_backward", counted)
    return calls


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("teacher_grad", [False, True])
def test_grads_formed_in_the_forward_match_the_backward(reduction, teacher_grad):
    # the backward's kernels for an upstream gradient of 1, then one product: the same bits as the backward
    # at 1 and 0.5 (exact products); elsewhere as close to float64 (the backward rounds g * dS to bf16 before
    # its GEMMs, the forward's path dS, so the two differ by bf16 roundings); a NaN upstream spreads either way
    from nitrobrew.attention import reference_attention_kl

    ins = make_inputs(B=1, H=2, Nq=21, Ds=16, Dt=24, hkv_t=1, dtype=torch.bfloat16, seed=11)
    kw = dict(reduction=reduction, teacher_grad=teacher_grad)
    for upstream in (1.0, 0.5, 0.3, float("nan")):
        loss_now, (now,) = _grads(ins, upstream, {"grads_in_forward": True}, **kw)
        loss_later, (later,) = _grads(ins, upstream, {"grads_in_forward": False}, **kw)
        assert torch.equal(loss_now, loss_later)
        assert len(now) == (4 if teacher_grad else 2)
        if upstream != upstream:
            assert all(torch.isnan(t).all() for t in now + later)
        elif upstream in (1.0, 0.5):
            assert all(torch.equal(a, b) for a, b in zip(now, later))
        else:
            xs = [t.double().requires_grad_(i < 2 or teacher_grad) for i, t in enumerate(ins)]
            ref = reference_attention_kl(*xs, is_causal=True, reduction=reduction)
            exact = torch.autograd.grad(ref * upstream, [t for t in xs if t.requires_grad])
            for a, b, r in zip(now, later, exact):
                assert rel(a, r) < 2e-2 and rel(b, r) < 2e-2


def test_grads_formed_in_the_forward_second_backward_and_double_backward(monkeypatch):
    ins = make_inputs(B=1, H=2, Nq=17, Ds=16, Dt=16, seed=12)
    calls = _count_backward_launches(monkeypatch)
    _, (first, second) = _grads(ins, 0.7, {"grads_in_forward": True}, calls=2)
    assert len(calls) == 2  # the forward's, then the second backward's (retain_graph) runs the kernels again
    for a, b in zip(first, second):
        assert rel(a, b) < 1e-5  # float32: the product before or after the GEMMs
    xs = [t.clone().requires_grad_(i < 2) for i, t in enumerate(ins)]
    loss = attention_kl(*xs, backend="triton", is_causal=True, block_config={"grads_in_forward": True})
    with pytest.raises(RuntimeError, match="double backward"):
        torch.autograd.grad(loss, xs[:2], create_graph=True)


def test_grads_formed_in_the_forward_only_when_asked_and_a_backward_can_come(monkeypatch):
    ins = make_inputs(B=1, H=2, Nq=17, Ds=16, Dt=16, seed=13)
    calls = _count_backward_launches(monkeypatch)
    xs = [t.clone().requires_grad_(i < 2) for i, t in enumerate(ins)]
    now = {"grads_in_forward": True}
    with torch.no_grad():
        attention_kl(*xs, backend="triton", is_causal=True, block_config=now)
    with torch.inference_mode():
        attention_kl(*xs, backend="triton", is_causal=True, block_config=now)
    attention_kl(*ins, backend="triton", is_causal=True, block_config=now)  # nothing requires grad
    attention_kl(*xs, backend="triton", is_causal=True, reduction="none", block_config=now)  # per-row upstream
    loss = attention_kl(*xs, backend="triton", is_causal=True)  # the default: in the backward
    assert calls == []
    loss.backward()
    assert len(calls) == 1
    xs[0].grad = xs[1].grad = None
    loss = attention_kl(*xs, backend="triton", is_causal=True, block_config=now)
    assert len(calls) == 2
    loss.backward()
    assert len(calls) == 2 and xs[0].grad is not None and xs[2].grad is None
