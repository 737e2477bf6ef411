"""Public attention-distillation KL: validation, backend dispatch, reduction."""

from __future__ import annotations

import math
from typing import Optional

import torch

from ..core import checks as ck
from .common import DIRECTIONS, TARGETS, AttnSpec, effective_scales, key_mask, row_weights

_TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _check_tensor(name: str, t) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    ck.check_float(name, t)
    if t.dim() != 4:
        raise ValueError(f"{name} must be 4-D [B, heads, seq, head_dim] (SDPA layout), got shape {tuple(t.shape)}")


def _check_scale(name: str, value) -> None:
    if value is None:
        return
    if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be None or a finite number > 0, got {value!r}")


def _validate(
    q_s,
    k_s,
    q_t,
    k_t,
    *,
    is_causal,
    causal_offset,
    scale_s,
    scale_t,
    temperature,
    direction,
    reduction,
    target,
    key_padding_mask,
    kv_lengths,
    query_mask,
    lse_t,
    backend,
    chunk_size,
):
    for name, t in (("q_s", q_s), ("k_s", k_s), ("q_t", q_t), ("k_t", k_t)):
        _check_tensor(name, t)
    ck.check_same_device(
        q_s=q_s,
        k_s=k_s,
        q_t=q_t,
        k_t=k_t,
        key_padding_mask=key_padding_mask,
        kv_lengths=kv_lengths,
        query_mask=query_mask,
        lse_t=lse_t,
    )
    ck.check_same_dtype(q_s=q_s, k_s=k_s)
    ck.check_same_dtype(q_t=q_t, k_t=k_t)
    if not isinstance(is_causal, bool):
        raise TypeError(f"is_causal must be a bool, got {type(is_causal).__name__}")
    if not isinstance(causal_offset, int) or isinstance(causal_offset, bool):
        raise TypeError(f"causal_offset must be an int, got {causal_offset!r}")
    if direction not in DIRECTIONS:
        raise ValueError(f"direction must be one of {DIRECTIONS}, got {direction!r}")
    if target not in TARGETS:
        raise ValueError(f"target must be one of {TARGETS}, got {target!r}")
    ck.check_reduction(reduction)
    ck.check_backend(backend)
    ck.check_temperature(temperature)
    _check_scale("scale_s", scale_s)
    _check_scale("scale_t", scale_t)
    ck.check_chunk("chunk_size", chunk_size)

    B, Hs, Nq, Ds = q_s.shape
    Bt, Ht, Nqt, Dt = q_t.shape
    for name, k, q in (("k_s", k_s, q_s), ("k_t", k_t, q_t)):
        if k.shape[0] != q.shape[0]:
            raise ValueError(f"{name} batch {k.shape[0]} != its queries' batch {q.shape[0]}")
        if k.shape[-1] != q.shape[-1]:
            raise ValueError(f"{name} head_dim {k.shape[-1]} != its queries' head_dim {q.shape[-1]}")
        if k.shape[1] == 0 or q.shape[1] % k.shape[1] != 0:
            raise ValueError(
                f"{name} has {k.shape[1]} kv heads, which must divide the {q.shape[1]} query heads "
                "(grouped-query attention)"
            )
    if (B, Nq) != (Bt, Nqt) or k_s.shape[2] != k_t.shape[2]:
        raise ValueError(
            f"score grids differ: student [B={B}, Nq={Nq}, Nk={k_s.shape[2]}] vs teacher "
            f"[B={Bt}, Nq={Nqt}, Nk={k_t.shape[2]}]; batch, query and key lengths must match"
        )
    if target == "per_head" and Ht != Hs:
        raise ValueError(
            f"student has {Hs} query heads and teacher {Ht}: the score grids [B, H, Nq, Nk] must match "
            "(use target='head_mean' to distill groups of teacher heads into one student head)"
        )
    if target == "head_mean" and (Hs == 0 or Ht % Hs != 0):
        raise ValueError(f"target='head_mean' needs the teacher's {Ht} heads to be a multiple of the student's {Hs}")
    Nk = k_s.shape[2]
    if key_padding_mask is not None:
        if key_padding_mask.dtype != torch.bool:
            raise TypeError(f"key_padding_mask must be a bool tensor (True = keep), got {key_padding_mask.dtype}")
        if tuple(key_padding_mask.shape) != (B, Nk):
            raise ValueError(
                f"key_padding_mask must have shape (B, Nk) = {(B, Nk)}, got {tuple(key_padding_mask.shape)}"
            )
    if kv_lengths is not None:
        if kv_lengths.dtype.is_floating_point or kv_lengths.dtype == torch.bool:
            raise TypeError(f"kv_lengths must be an integer tensor, got {kv_lengths.dtype}")
        if tuple(kv_lengths.shape) != (B,):
            raise ValueError(f"kv_lengths must have shape (B,) = {(B,)}, got {tuple(kv_lengths.shape)}")
        if kv_lengths.numel() and not torch.compiler.is_compiling():
            lo, hi = int(kv_lengths.min()), int(kv_lengths.max())
            if lo < 0 or hi > Nk:
                raise ValueError(f"kv_lengths must lie in [0, Nk={Nk}], found values in [{lo}, {hi}]")
    if query_mask is not None:
        if query_mask.dtype != torch.bool:
            raise TypeError(f"query_mask must be a bool tensor (True = row counts), got {query_mask.dtype}")
        if tuple(query_mask.shape) != (B, Nq):
            raise ValueError(f"query_mask must have shape (B, Nq) = {(B, Nq)}, got {tuple(query_mask.shape)}")
    if lse_t is not None:
        if not isinstance(lse_t, torch.Tensor) or not lse_t.is_floating_point():
            raise TypeError("lse_t must be a floating-point tensor [B, H_teacher, Nq]")
        if tuple(lse_t.shape) != (B, Ht, Nq):
            raise ValueError(f"lse_t must have shape (B, H_teacher, Nq) = {(B, Ht, Nq)}, got {tuple(lse_t.shape)}")
    teacher_grad = q_t.requires_grad or k_t.requires_grad
    if target == "head_mean" and teacher_grad and torch.is_grad_enabled():
        raise ValueError("target='head_mean' gives no teacher gradients: detach q_t and k_t")
    if backend == "triton":
        if target != "per_head":
            raise ValueError("backend='triton' supports target='per_head' only; use backend='torch' or 'auto'")
        for name, t in (("q_s", q_s), ("q_t", q_t)):
            if t.dtype not in _TRITON_DTYPES:
                raise TypeError(
                    f"backend='triton' takes float16/bfloat16/float32 inputs, got {name} {t.dtype} "
                    "(use backend='torch' for float64)"
                )


def _pick_backend(backend: str, q_s, q_t, target: str) -> str:
    if backend == "auto":
        if target != "per_head" or q_s.dtype not in _TRITON_DTYPES or q_t.dtype not in _TRITON_DTYPES:
            return "torch"
    return ck.resolve_backend(backend, q_s.device)


def _gluon_kernels(cfg: Optional[dict], q_s, k_s, q_t, k_t, *, kpm, spec: AttnSpec) -> Optional[dict]:
    """The Triton path's kernels on Hopper: the Gluon forward (``kernels_gluon.py``) and dq / dk kernels
    (``kernels_gluon_bwd.py``) where they are asked for (``block_config={"fwd_kernel": "gluon"}``,
    ``{"bwd_kernel": "gluon"}``, NITROBREW_ATTN_GLUON=1) or measured faster, and support the case; else
    the Triton ones. The choice travels in the block config."""
    from .kernels_gluon import gluon_forward_enabled, gluon_forward_supported
    from .kernels_gluon_bwd import gluon_backward_enabled

    n = q_s.shape[2]
    fwd, bwd = gluon_forward_enabled(cfg, n), gluon_backward_enabled(cfg, n)
    if not (fwd or bwd):
        return cfg
    use = gluon_forward_supported(
        q_t, k_t, q_s, k_s, kpm=kpm, is_causal=spec.is_causal, causal_offset=spec.causal_offset
    )
    return {
        **(cfg or {}),
        "fwd_kernel": "gluon" if use and fwd else "triton",
        "bwd_kernel": "gluon" if use and bwd else "triton",
    }


def attention_kl(
    q_s: torch.Tensor,
    k_s: torch.Tensor,
    q_t: torch.Tensor,
    k_t: torch.Tensor,
    *,
    is_causal: bool,
    causal_offset: int = 0,
    scale_s: Optional[float] = None,
    scale_t: Optional[float] = None,
    temperature: float = 1.0,
    direction: str = "forward",
    reduction: str = "mean",
    key_padding_mask: Optional[torch.Tensor] = None,
    kv_lengths: Optional[torch.Tensor] = None,
    query_mask: Optional[torch.Tensor] = None,
    lse_t: Optional[torch.Tensor] = None,
    target: str = "per_head",
    backend: str = "auto",
    chunk_size: Optional[int] = None,
    block_config: Optional[dict] = None,
) -> torch.Tensor:
    """KL divergence between teacher and student attention distributions, per (batch, head, query).

    Never builds a [B, H, Nq, Nk] map: one streaming pass over key tiles (online per-row
    statistics), and a backward that recomputes the score tiles (FlashAttention-2 style).

    Args:
        q_s, k_s: student queries [B, H, Nq, Ds] and keys [B, Hkv_s, Nk, Ds] (SDPA layout;
            grouped-query attention when Hkv_s divides H). Gradients flow to both.
        q_t, k_t: teacher queries [B, H, Nq, Dt] and keys [B, Hkv_t, Nk, Dt]. Head dims and
            kv-head counts may differ from the student's; the score grid [B, H, Nq, Nk] must
            match. Gradients flow to them too when they require grad (target="per_head").
        is_causal: mask key j for query i unless j <= i + causal_offset. causal_offset=0 is
            SDPA's ``is_causal`` (top-left aligned when Nq != Nk); Nk - Nq is flash-attn's
            bottom-right alignment (queries at the end of the keys).
        scale_s, scale_t: softmax scales (default 1/sqrt(head_dim) of that side).
        temperature: both score maps are divided by it (no T^2 factor is applied).
        direction: "forward" = KL(P_teacher || P_student) (default), "reverse" = KL(P_s || P_t).
        reduction: "mean" over counted rows (B * H * rows that see a key and pass query_mask),
            "sum", or "none" (float32 [B, H, Nq], 0 at rows that do not count).
        key_padding_mask: bool [B, Nk], True = keep the key. kv_lengths: int [B], keys >= length
            are masked (combined with key_padding_mask when both are given).
        query_mask: bool [B, Nq], True = the row counts (padded queries: False).
        lse_t: optional teacher log-sum-exp [B, H_teacher, Nq], natural log, of the teacher's
            scores as the loss uses them: logsumexp_j(scale_t * q_t.k_t[j] / temperature) over
            the visible keys. With temperature=1 and the same scale and mask this is exactly
            what a flash-attention forward returns (flash-attn's ``softmax_lse``, SDPA's
            logsumexp). It replaces the teacher's running max (a fixed shift), the kernel still
            normalizes, so the per_head result stays exact if lse_t is slightly off; a value far
            below the true lse (e.g. taken at another temperature) can overflow. For
            target="head_mean" it must be exact per teacher head (it weights the mixture).
            Treated as a constant (no gradient).
        target: "per_head" (default) or "head_mean": student head h against the mean of the
            attention of teacher heads [h*G, (h+1)*G), G = H_teacher / H_student (with one
            student head: the head-averaged teacher attention that sparse-attention indexers
            are trained on). PyTorch backend; no teacher gradients.
        backend: "auto" (Triton on CUDA for fp16/bf16/fp32 per_head, else PyTorch), "torch",
            "triton" (on CPU only under TRITON_INTERPRET=1).
        chunk_size: key chunk of the PyTorch path (None = automatic).
        block_config: Triton tile settings override (see ``kernels_fwd.DEFAULT_CONFIGS``); its
            "fwd_kernel": "gluon" / "triton" picks the forward kernel on sm90 (default: the Gluon
            one, ``kernels_gluon.py``, from Nq = 4096 on), "fwd_gluon": which Gluon kernel,
            "warp_specialized" (the default from Nq = 8192 on) or "one_warpgroup" (below), or the
            one-warpgroup kernel's tiles (BM, BN, num_warps, stages); "bwd_kernel": "gluon" /
            "triton" picks the dq and dk kernels on sm90 (default: the warp-specialized Gluon ones,
            ``kernels_gluon_bwd.py``, from Nq = 4096 on, for one side's gradients; both sides', or
            kv heads grouped differently on the two sides for dk, run the Triton ones);
            "grads_in_forward": True forms a scalar reduction's input gradients in the forward, and
            the backward only scales them by the upstream gradient (default False). It saves the
            device's wait for the host between the loss's forward and its backward where one follows
            the other directly in a host-bound step (a lone fwd+bwd at N = 4096: 0.91x the time), at the
            cost of holding the gradients from the forward on; in a model that adds a loss per layer it
            buys nothing.

    Returns:
        float32 loss (float64 when an input is float64 on the PyTorch path).
    """
    _validate(
        q_s,
        k_s,
        q_t,
        k_t,
        is_causal=is_causal,
        causal_offset=causal_offset,
        scale_s=scale_s,
        scale_t=scale_t,
        temperature=temperature,
        direction=direction,
        reduction=reduction,
        target=target,
        key_padding_mask=key_padding_mask,
        kv_lengths=kv_lengths,
        query_mask=query_mask,
        lse_t=lse_t,
        backend=backend,
        chunk_size=chunk_size,
    )
    impl = _pick_backend(backend, q_s, q_t, target)
    B, H, Nq, _ = q_s.shape
    Nk = k_s.shape[2]
    ss, st = effective_scales(q_s, q_t, scale_s, scale_t, temperature)
    spec = AttnSpec(
        is_causal=is_causal,
        causal_offset=causal_offset if is_causal else 0,
        scale_s=ss,
        scale_t=st,
        direction=direction,
        target=target,
        chunk=chunk_size,
    )
    kpm = key_mask(key_padding_mask, kv_lengths, B, Nk, q_s.device)
    every_row = kpm is None and query_mask is None and Nk > 0 and (not is_causal or spec.causal_offset >= 0)
    if impl == "triton":
        block_config = _gluon_kernels(block_config, q_s, k_s, q_t, k_t, kpm=kpm, spec=spec)
    if impl == "triton" and every_row and reduction != "none" and B * H * Nq > 0:
        # every row sees a key and counts: the reduction is a known scale, done inside the Function
        from .triton_function import triton_total

        return triton_total(
            q_s=q_s, k_s=k_s, q_t=q_t, k_t=k_t, lse_t=lse_t, spec=spec, cfg=block_config, reduce=reduction
        )
    w = row_weights(
        Nq=Nq,
        Nk=Nk,
        spec_causal=is_causal,
        causal_offset=spec.causal_offset,
        kpm=kpm,
        query_mask=query_mask,
        B=B,
        device=q_s.device,
    )
    if kpm is not None or query_mask is not None or (is_causal and spec.causal_offset < 0):
        # query rows that do not count are zeroed before any product: a NaN there would reach dk (and
        # the key projection) through 0 * NaN in dS^T Q even though the row's weight is 0
        keep = w[:, None, :, None] > 0
        q_s = torch.where(keep, q_s, torch.zeros((), dtype=q_s.dtype, device=q_s.device))
        q_t = torch.where(keep, q_t, torch.zeros((), dtype=q_t.dtype, device=q_t.device))
    if B * H * Nq == 0 or Nk == 0:
        rows = torch.zeros((B, H, Nq), dtype=torch.float32, device=q_s.device)
        rows = rows + 0.0 * (q_s.sum() + k_s.sum()).float()  # keeps the graph: zero gradients
    elif impl == "triton":
        from .triton_function import attention_rows

        rows = attention_rows(q_s=q_s, k_s=k_s, q_t=q_t, k_t=k_t, lse_t=lse_t, kpm=kpm, spec=spec, cfg=block_config)
    else:
        from .chunked import chunked_rows

        rows = chunked_rows(q_s=q_s, k_s=k_s, q_t=q_t, k_t=k_t, lse_t=lse_t, kpm=kpm, spec=spec)
    rows = rows * w.to(rows.dtype)[:, None, :]
    if reduction == "none":
        return rows
    total = rows.sum()
    if reduction == "sum":
        return total
    return total / (w.sum() * H).clamp_min(1.0).to(rows.dtype)
