"""The experimental Gluon (Hopper) kernels of attention KL (forward, dq, dk): the selectors everywhere,
exactness on sm90.

On a machine without an sm90 GPU or Gluon only the selector tests run (the Gluon path must never be
taken there, whatever is asked); on an H100/H200 the forward's rows are compared with the Triton
forward's and the loss and gradients with the float64 reference."""

from __future__ import annotations

import os

import pytest
import torch

from attention_helpers import make_inputs, rel
from nitrobrew.attention import api as attn_api
from nitrobrew.attention import attention_kl, reference_attention_kl
from nitrobrew.attention import kernels_gluon as kg
from nitrobrew.attention import kernels_gluon_bwd as kgb
from nitrobrew.attention.common import AttnSpec


def _sm90() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


needs_sm90 = pytest.mark.skipif(
    not (kg.HAVE_GLUON and _sm90()) or os.environ.get("TRITON_INTERPRET") == "1",
    reason="the Gluon forward runs on sm90 only (not under the interpreter)",
)


needs_gluon = pytest.mark.skipif(not kg.HAVE_GLUON, reason="Gluon is not in this Triton")


@needs_gluon
def test_descriptors_are_kept_without_their_tensors(monkeypatch):
    """_desc builds a descriptor once per (address, shape, strides, rows, dtype), keeps the address and
    dtype but not the tensor (its memory is freed as usual), and starts over when full."""
    import gc
    import weakref

    monkeypatch.setattr(kg, "_DESCRIPTORS", {})
    t = torch.zeros(1, 2, 64, 32, dtype=torch.bfloat16)
    d = kg._desc(t, 16)
    assert kg._desc(t, 16) is d
    assert kg._desc(t, 32) is not d and kg._desc(t.view(2, 1, 64, 32), 16) is not d
    assert d.base.data_ptr() == t.data_ptr() and d.base.dtype == torch.bfloat16
    assert list(d.shape) == [128, 32] and list(d.strides) == [32, 1] and list(d.block_shape) == [16, 32]
    alive = weakref.ref(t)
    del t
    gc.collect()
    assert alive() is None  # the cache did not keep the tensor
    monkeypatch.setattr(kg, "_MAX_DESCRIPTORS", 3)
    kept = [torch.zeros(1, 1, 16, 32, dtype=torch.bfloat16) for _ in range(4)]
    for x in kept:
        kg._desc(x, 16)
    assert len(kg._DESCRIPTORS) == 1  # cleared at the fourth


def test_enabled_by_config_environment_or_size(monkeypatch):
    monkeypatch.delenv(kg.ENV_SWITCH, raising=False)
    monkeypatch.setattr(kg, "TRITON_VERSION", "3.6.0")
    monkeypatch.setattr(kg, "FAILED", False)
    assert not kg.gluon_forward_enabled(None, kg.AUTO_MIN_ROWS - 1)
    assert kg.gluon_forward_enabled(None, kg.AUTO_MIN_ROWS)  # measured faster from there on
    assert kg.gluon_forward_enabled({"fwd_kernel": "gluon"}, 16)
    assert not kg.gluon_forward_enabled({"fwd_kernel": "triton"}, 1 << 20)
    monkeypatch.setenv(kg.ENV_SWITCH, "1")
    assert kg.gluon_forward_enabled(None, 16)
    assert not kg.gluon_forward_enabled({"fwd_kernel": "triton"}, 16)
    monkeypatch.setenv(kg.ENV_SWITCH, "0")
    assert not kg.gluon_forward_enabled({}, 1 << 20)
    monkeypatch.delenv(kg.ENV_SWITCH)
    monkeypatch.setattr(kg, "TRITON_VERSION", "3.9.0")  # not the release it was measured with
    assert not kg.gluon_forward_enabled(None, 1 << 20)


def test_backward_enabled_by_config_environment_or_size(monkeypatch):
    monkeypatch.delenv(kg.ENV_SWITCH, raising=False)
    monkeypatch.setattr(kg, "TRITON_VERSION", "3.6.0")
    monkeypatch.setattr(kgb, "FAILED", False)
    assert not kgb.gluon_backward_enabled(None, kgb.AUTO_MIN_ROWS - 1)
    assert kgb.gluon_backward_enabled(None, kgb.AUTO_MIN_ROWS)
    assert kgb.gluon_backward_enabled({"bwd_kernel": "gluon"}, 16)
    assert not kgb.gluon_backward_enabled({"bwd_kernel": "triton", "fwd_kernel": "gluon"}, 1 << 20)
    monkeypatch.setenv(kg.ENV_SWITCH, "0")
    assert not kgb.gluon_backward_enabled(None, 1 << 20)
    monkeypatch.delenv(kg.ENV_SWITCH)
    monkeypatch.setattr(kg, "TRITON_VERSION", "3.9.0")
    assert not kgb.gluon_backward_enabled(None, 1 << 20)
    monkeypatch.setattr(kg, "TRITON_VERSION", "3.6.0")
    with pytest.warns(UserWarning, match="Gluon attention backward failed"):
        kgb.note_failure(RuntimeError("no such builtin"))
    assert not kgb.gluon_backward_enabled(None, 1 << 20)


def test_a_failed_launch_warns_once_and_stops_the_automatic_choice(monkeypatch):
    monkeypatch.delenv(kg.ENV_SWITCH, raising=False)
    monkeypatch.setattr(kg, "TRITON_VERSION", "3.6.0")
    monkeypatch.setattr(kg, "FAILED", False)
    with pytest.warns(UserWarning, match="Gluon attention forward failed"):
        kg.note_failure(RuntimeError("no such builtin"))
    assert not kg.gluon_forward_enabled(None, 1 << 20)
    kg.note_failure(RuntimeError("again"))  # no second warning (pytest's filter would turn it into an error)


def test_unsupported_cases_fall_back():
    q_s, k_s, q_t, k_t = make_inputs(B=1, H=2, Nq=8, Ds=16, Dt=16, dtype=torch.bfloat16)
    # CPU tensors: never the Gluon path
    assert not kg.gluon_forward_supported(q_t, k_t, q_s, k_s, kpm=None, is_causal=True, causal_offset=0)
    spec = AttnSpec(
        is_causal=True, causal_offset=0, scale_s=0.25, scale_t=0.25, direction="forward", target="per_head", chunk=None
    )
    cfg = attn_api._gluon_kernels({"fwd_kernel": "gluon"}, q_s, k_s, q_t, k_t, kpm=None, spec=spec)
    assert cfg["fwd_kernel"] == "triton"
    assert attn_api._gluon_kernels({"fwd_kernel": "triton"}, q_s, k_s, q_t, k_t, kpm=None, spec=spec) == {
        "fwd_kernel": "triton"
    }


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="Triton interpreter leg")
def test_asking_for_gluon_off_sm90_gives_the_triton_result():
    ins = make_inputs(B=1, H=2, Nq=21, Ds=16, Dt=32, dtype=torch.float32)
    a = attention_kl(*ins, is_causal=True, backend="triton", block_config={"fwd_kernel": "gluon"})
    b = attention_kl(*ins, is_causal=True, backend="triton")
    assert torch.equal(a, b)


# ------------------------------------------------------------------ sm90 only

CASES = [
    # (B, H, hkv_s, hkv_t, Nq, Nk, Ds, Dt, causal, offset, dtype)
    (1, 2, 2, 2, 256, 256, 128, 128, True, 0, torch.bfloat16),
    (2, 3, 3, 3, 1000, 1000, 64, 64, True, 0, torch.bfloat16),  # N not a multiple of the tiles
    (1, 4, 4, 4, 333, 333, 128, 128, False, 0, torch.bfloat16),
    (1, 8, 2, 4, 517, 517, 64, 128, True, 0, torch.bfloat16),  # GQA, each side its own, head dims differ
    (1, 8, 2, 2, 517, 517, 64, 128, True, 0, torch.bfloat16),  # GQA 4 on both sides: the Gluon dk's head loop
    (1, 2, 2, 2, 200, 461, 32, 128, True, 261, torch.float16),  # Nk > Nq, bottom-right aligned
    (1, 2, 1, 2, 300, 300, 16, 64, True, 37, torch.bfloat16),  # causal offset, small head dim
    (2, 2, 2, 2, 64, 64, 128, 128, True, 0, torch.bfloat16),  # one query block
]


# both Gluon kernels, asked for by name (unasked, the size picks: kernels_gluon.WS_MIN_ROWS)
GLUON_KERNELS = {
    "warp_specialized": {"fwd_kernel": "gluon", "fwd_gluon": kg.WARP_SPECIALIZED},
    "one_warpgroup": {"fwd_kernel": "gluon", "fwd_gluon": kg.ONE_WARPGROUP},
}


def _cuda_inputs(case, seed=0):
    B, H, hs, ht, Nq, Nk, Ds, Dt, _, _, dtype = case
    ins = make_inputs(B=B, H=H, Nq=Nq, Nk=Nk, Ds=Ds, Dt=Dt, hkv_s=hs, hkv_t=ht, dtype=torch.float32, seed=seed)
    return [t.to(device="cuda", dtype=dtype) for t in ins]


@needs_sm90
@pytest.mark.parametrize("kernel", list(GLUON_KERNELS))
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("direction", ["forward", "reverse"])
def test_rows_match_the_triton_forward(case, direction, kernel):
    q_s, k_s, q_t, k_t = _cuda_inputs(case)
    causal, off = case[8], case[9]
    kw = dict(is_causal=causal, causal_offset=off, direction=direction, reduction="none", backend="triton")
    with torch.no_grad():
        ref = attention_kl(q_s, k_s, q_t, k_t, block_config={"fwd_kernel": "triton"}, **kw)
        got = attention_kl(q_s, k_s, q_t, k_t, block_config=GLUON_KERNELS[kernel], **kw)
    assert kg.gluon_forward_supported(q_t, k_t, q_s, k_s, kpm=None, is_causal=causal, causal_offset=off)
    # the same math (the scale inside the exponents' FMAs); the MMA may sum a row's products in another order
    assert (got - ref).abs().max().item() <= 1e-5 * max(1.0, ref.abs().max().item())


@needs_sm90
@pytest.mark.parametrize("kernel", list(GLUON_KERNELS))
@pytest.mark.parametrize("case", CASES[:5])
def test_loss_and_gradients_against_float64(case, kernel):
    q_s, k_s, q_t, k_t = _cuda_inputs(case, seed=1)
    causal, off = case[8], case[9]
    ins = [t.clone().requires_grad_(True) for t in (q_s, k_s)] + [q_t, k_t]
    out = attention_kl(*ins, is_causal=causal, causal_offset=off, block_config=GLUON_KERNELS[kernel])
    out.backward()
    ref_ins = [t.detach().double().requires_grad_(i < 2) for i, t in enumerate((q_s, k_s, q_t, k_t))]
    ref = reference_attention_kl(*ref_ins, is_causal=causal, causal_offset=off)
    ref.backward()
    assert rel(out, ref) <= 1e-5
    for i in range(2):  # dS rounded to 16 bits before the dq/dk products, as in FlashAttention
        assert rel(ins[i].grad, ref_ins[i].grad) <= 2e-2


@needs_sm90
@pytest.mark.parametrize("kernel", list(GLUON_KERNELS))
def test_teacher_lse_given(kernel):
    case = CASES[1]
    q_s, k_s, q_t, k_t = _cuda_inputs(case, seed=2)
    scale = q_t.shape[-1] ** -0.5
    kt = k_t.repeat_interleave(q_t.shape[1] // k_t.shape[1], 1)
    s = (q_t.double() @ kt.double().transpose(-1, -2)) * scale
    s = s.masked_fill(torch.ones_like(s, dtype=torch.bool).triu(1), float("-inf"))
    lse_t = torch.logsumexp(s, -1).float()
    kw = dict(is_causal=True, reduction="none", backend="triton", lse_t=lse_t)
    with torch.no_grad():
        ref = attention_kl(q_s, k_s, q_t, k_t, **kw)
        got = attention_kl(q_s, k_s, q_t, k_t, block_config=GLUON_KERNELS[kernel], **kw)
    assert (got - ref).abs().max().item() <= 1e-5 * max(1.0, ref.abs().max().item())


@needs_sm90
def test_key_padding_mask_and_fp32_stay_on_triton():
    q_s, k_s, q_t, k_t = _cuda_inputs(CASES[0])
    kpm = torch.ones(1, 256, dtype=torch.bool, device="cuda")
    assert not kg.gluon_forward_supported(q_t, k_t, q_s, k_s, kpm=kpm, is_causal=True, causal_offset=0)
    assert not kg.gluon_forward_supported(
        q_t.float(), k_t.float(), q_s.float(), k_s.float(), kpm=None, is_causal=True, causal_offset=0
    )
    assert not kg.gluon_forward_supported(q_t, k_t, q_s, k_s, kpm=None, is_causal=True, causal_offset=-1)
    assert not kg.gluon_forward_supported(q_t.transpose(1, 2), k_t, q_s, k_s, kpm=None, is_causal=True, causal_offset=0)


@needs_sm90
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("direction", ["forward", "reverse"])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_gluon_backward_matches_the_triton_backward(case, direction, reduction):
    q_s, k_s, q_t, k_t = _cuda_inputs(case, seed=4)
    causal, off = case[8], case[9]
    weights = torch.rand(q_s.shape[:3], device="cuda") + 0.5  # per-row upstream gradients
    grads = {}
    for bwd in ("triton", "gluon"):
        ins = [t.clone().requires_grad_(True) for t in (q_s, k_s)]
        out = attention_kl(
            *ins, q_t, k_t, is_causal=causal, causal_offset=off, direction=direction, reduction=reduction,
            backend="triton", block_config={"fwd_kernel": "triton", "bwd_kernel": bwd},
        )  # fmt: skip
        (out if reduction == "mean" else (out * weights).sum()).backward()
        grads[bwd] = [t.grad for t in ins]
    for ref, got in zip(grads["triton"], grads["gluon"]):
        assert torch.isfinite(got).all()
        assert rel(got, ref) <= 1e-3  # dS rounded to 16 bits in both; the MMAs sum in another order


@needs_sm90
def test_gluon_backward_with_both_sides_trainable_falls_back_where_it_must():
    case = CASES[3]  # GQA grouped differently on the two sides: dk of both on the Triton kernel
    q_s, k_s, q_t, k_t = _cuda_inputs(case, seed=5)
    grads = {}
    for bwd in ("triton", "gluon"):
        ins = [t.clone().requires_grad_(True) for t in (q_s, k_s, q_t, k_t)]
        attention_kl(*ins, is_causal=True, block_config={"bwd_kernel": bwd}).backward()
        grads[bwd] = [t.grad for t in ins]
    for ref, got in zip(grads["triton"], grads["gluon"]):
        assert rel(got, ref) <= 1e-3


@needs_sm90
@pytest.mark.parametrize("case", CASES[:6])
def test_gluon_backward_against_float64(case):
    q_s, k_s, q_t, k_t = _cuda_inputs(case, seed=6)
    causal, off = case[8], case[9]
    ins = [t.clone().requires_grad_(True) for t in (q_s, k_s)] + [q_t, k_t]
    cfg = {"fwd_kernel": "gluon", "bwd_kernel": "gluon"}
    attention_kl(*ins, is_causal=causal, causal_offset=off, block_config=cfg).backward()
    ref_ins = [t.detach().double().requires_grad_(i < 2) for i, t in enumerate((q_s, k_s, q_t, k_t))]
    reference_attention_kl(*ref_ins, is_causal=causal, causal_offset=off).backward()
    for i in range(2):
        assert rel(ins[i].grad, ref_ins[i].grad) <= 2e-2


def test_the_gluon_forward_compiles_for_sm90_with_the_installed_triton():
    """The Gluon builtins it calls exist in this Triton (Triton 3.9 removed
    tma.async_copy_global_to_shared): compiled for sm90 offline, in a process outside the interpreter."""
    import subprocess
    import sys

    if not kg.HAVE_GLUON:
        pytest.skip("this Triton has no Gluon")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = os.path.join(os.path.dirname(__file__), "gluon_offline_compile.py")
    done = subprocess.run([sys.executable, script], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "cubin bytes" in done.stdout
    assert "dk cubin bytes" in done.stdout


@needs_sm90
def test_the_gluon_launches_keep_their_tensor_maps_on_this_triton(monkeypatch):
    """On the Triton the kernels were tested with, core.launch recognizes the launcher's descriptor wrapper
    (else every launch encodes its tensor maps again: correct, but the host time this avoids comes back)."""
    from nitrobrew.core import launch as launch_mod

    monkeypatch.setattr(launch_mod, "_CACHE", {})
    monkeypatch.setattr(launch_mod, "KEEP_TENSOR_MAPS", True)
    q_s, k_s, q_t, k_t = _cuda_inputs(CASES[0], seed=7)
    cfg = {"fwd_kernel": "gluon", "bwd_kernel": "gluon"}
    ins = [t.clone().requires_grad_(True) for t in (q_s, k_s)]
    for _ in range(2):
        attention_kl(*ins, q_t, k_t, is_causal=True, block_config=cfg).backward()
    runs = [entry[0] for entry in launch_mod._CACHE.values()]
    kept = [r for r in runs if isinstance(r, launch_mod._KeptMapsRun)]
    if not kg.TRITON_VERSION.startswith(kg.TESTED_TRITON):
        pytest.skip("another Triton: its launcher may have another form")
    assert len(kept) >= 3  # the forward, dq and dk kernels


@needs_sm90
@pytest.mark.parametrize("kernels", ["gluon", "triton"])
@pytest.mark.parametrize("case", [(32, 32, 128, 128), (32, 8, 128, 128), (32, 32, 64, 128)])
def test_grads_formed_in_the_forward_give_the_backwards_bits(kernels, case):
    H, hkv, Ds, Dt = case
    ins = [t.cuda() for t in make_inputs(B=1, H=H, Nq=1000, Ds=Ds, Dt=Dt, hkv_s=hkv, hkv_t=hkv, dtype=torch.bfloat16)]
    got = {}
    for now in (True, False):
        for upstream in (1.0, 0.5):
            qs, ks = (t.clone().requires_grad_() for t in ins[:2])
            cfg = {"fwd_kernel": kernels, "bwd_kernel": kernels, "grads_in_forward": now}
            loss = attention_kl(qs, ks, *ins[2:], is_causal=True, block_config=cfg)
            (loss * upstream).backward()
            got[now, upstream] = (loss.detach(), qs.grad, ks.grad)
    for upstream in (1.0, 0.5):
        assert all(torch.equal(a, b) for a, b in zip(got[True, upstream], got[False, upstream]))


@needs_sm90
def test_grads_formed_in_the_forward_under_cuda_graph_capture(monkeypatch):
    # the unit upstream gradient made inside a capture is filled only on replay: it must not be kept for
    # calls outside the graph
    from nitrobrew.attention import triton_function as tfn

    ins = [t.cuda() for t in make_inputs(B=1, H=4, Nq=700, Ds=64, Dt=64, dtype=torch.bfloat16, seed=5)]
    qs, ks = (t.clone().requires_grad_() for t in ins[:2])
    cfg = {"fwd_kernel": "gluon", "bwd_kernel": "gluon", "grads_in_forward": True}

    def step():
        qs.grad = ks.grad = None
        attention_kl(qs, ks, *ins[2:], is_causal=True, block_config=cfg).backward()
        return qs.grad, ks.grad

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile and warm up outside the capture
        want = [g.clone() for g in step()]
    torch.cuda.current_stream().wait_stream(side)
    monkeypatch.setattr(tfn, "_UNIT", {})
    graph = torch.cuda.CUDAGraph()
    qs.grad = ks.grad = None
    with torch.cuda.graph(graph):
        attention_kl(qs, ks, *ins[2:], is_causal=True, block_config=cfg).backward()
    assert tfn._UNIT == {}
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(qs.grad, want[0]) and torch.equal(ks.grad, want[1])
    again = step()  # eager, after the capture
    assert torch.equal(again[0], want[0]) and torch.equal(again[1], want[1])
