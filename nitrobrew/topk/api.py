"""Public top-k KD loss: validation, backend dispatch, reduction."""
from __future__ import annotations

import math
from typing import Callable, Optional

import torch

from .. import _checks as ck
from ..hidden.api import DistillOutput
from .rowmath import TopKConfig

NORMALIZE = ("full", "topk")


def _validate(xs, ws, ids, lp, bs, labels, normalize, divergence, tail, temperature, teacher_temperature,
              reduction, chunk_V, kd_weight, ce_weight, ignore_index, backend, id_ranges: bool = True,
              mode=None, memory_budget=None, softcap_s=None) -> Callable[[], None]:
    """Every check before any kernel runs (id_ranges=False: the vocab-parallel path checks ids globally).
    The checks of the stored data's values are launched here; the returned call reads them and raises."""
    for name, t in (("xs", xs), ("ws", ws), ("topk_ids", ids), ("topk_logprobs", lp)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    ck.check_float("xs", xs)
    ck.check_float("ws", ws)
    ck.check_float("topk_logprobs", lp)
    if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
        raise TypeError(f"topk_ids must be an integer tensor, got {ids.dtype}")
    ck.check_same_device(xs=xs, ws=ws, bs=bs, topk_ids=ids, topk_logprobs=lp, labels=labels)
    ck.check_same_dtype(xs=xs, ws=ws, bs=bs)
    if xs.dim() < 1:
        raise ValueError("xs must have a hidden dimension [..., D]")
    if ws.dim() != 2 or ws.shape[1] != xs.shape[-1]:
        raise ValueError(f"ws must be a [V, D] head with D = {xs.shape[-1]} (xs {tuple(xs.shape)}), "
                         f"got {tuple(ws.shape)}")
    if bs is not None and tuple(bs.shape) != (ws.shape[0],):
        raise ValueError(f"bs must have shape ({ws.shape[0]},), got {tuple(bs.shape)}")
    if tuple(ids.shape) != tuple(lp.shape):
        raise ValueError(f"topk_ids {tuple(ids.shape)} and topk_logprobs {tuple(lp.shape)} must have the same shape")
    if ids.dim() < 1 or ids.shape[-1] < 1:
        raise ValueError(f"topk_ids must be [..., K] with K >= 1, got {tuple(ids.shape)}")
    if tuple(ids.shape[:-1]) != tuple(xs.shape[:-1]):
        raise ValueError(
            f"topk_ids/topk_logprobs leading shape {tuple(ids.shape[:-1])} must equal xs's leading shape "
            f"{tuple(xs.shape[:-1])} (one stored teacher row per student position)"
        )
    if normalize not in NORMALIZE:
        raise ValueError(f"normalize must be one of {NORMALIZE}, got {normalize!r}")
    if tail and normalize != "full":
        raise ValueError("tail=True needs normalize='full': renormalized over the K ids, the student has no tail")
    if divergence != "forward_kl" and normalize == "full" and not tail:
        raise ValueError(
            f"{divergence} over the top-k support compares distributions: use normalize='topk' (both sides "
            "renormalized over the K ids) or normalize='full' with tail=True (K ids + one tail bucket)"
        )
    ck.check_temperature(temperature)
    ck.check_softcap("softcap_s", softcap_s)
    if xs.shape[-1] == 0:
        raise ValueError(f"xs has hidden size 0 (shape {tuple(xs.shape)}): the head needs at least one feature")
    if teacher_temperature is not None:
        ck.check_temperature(teacher_temperature)
        if teacher_temperature != temperature:
            raise ValueError(
                f"the stored log-probs were taken at temperature {teacher_temperature} but the student is "
                f"tempered at {temperature}: stored top-k log-probs cannot be re-tempered exactly; extract "
                "them again at the distillation temperature (or pass the same value)"
            )
    ck.check_reduction(reduction)
    ck.check_chunk("chunk_V", chunk_V)
    ck.check_backend(backend)
    ck.check_mode(mode, memory_budget)
    ck.check_labels(labels, xs.shape[:-1])
    for name, wgt in (("kd_weight", kd_weight), ("ce_weight", ce_weight)):
        if not (isinstance(wgt, (int, float)) and math.isfinite(wgt)):
            raise ValueError(f"{name} must be a finite number, got {wgt!r}")
    if ce_weight != 0:
        if normalize != "full":
            raise ValueError("ce_weight != 0 needs normalize='full': the hard-label CE needs the student's "
                             "log-sum-exp over the whole vocabulary")
        if labels is None:
            raise ValueError("ce_weight != 0 needs labels (the hard targets of each row)")
        if id_ranges:
            ck.check_ids_in_range("labels", labels, ws.shape[0], ignore_index)
    capturing = lp.is_cuda and torch.cuda.is_current_stream_capturing()
    if lp.numel() and not torch.compiler.is_compiling() and not capturing:
        return _stored_check(ids, lp, ws.shape[0] if id_ranges else None, ck.resolve_backend(backend, lp.device))
    return _no_check


def _no_check() -> None:
    return None


def _lse_tolerance(lp: torch.Tensor) -> float:
    """How far above 0 a row's logsumexp of stored log-probs may lie: 1e-3, plus the rounding of
    16-bit storage (each log-prob rounded to its dtype's precision, summed over up to log K nats)."""
    K = lp.shape[-1]
    return 1e-3 + (torch.finfo(lp.dtype).eps * math.log(max(K, 2)) if lp.element_size() < 4 else 0.0)


def _stored_check(ids, lp, V: Optional[int], impl: str) -> Callable[[], None]:
    """Launch the checks of the stored data (NaN/+inf log-probs; with V, ids outside [0, V) at finite
    entries; ids repeated within a row; rows that are not a sub-distribution) and return the call that
    reads their flags (one device sync) and raises. The caller reads them as late as it can, right
    before the loss's first kernel, so the sync leaves the device idle only for that launch."""
    tol = _lse_tolerance(lp)
    if impl == "triton":
        from .triton_checks import stored_flags

        flags = stored_flags(ids, lp, V, tol)
    else:
        finite = torch.isfinite(lp)
        bad = [(torch.isnan(lp) | (lp == float("inf"))).any()]
        bad.append((finite & ((ids < 0) | (ids >= V))).any() if V is not None else torch.zeros((), dtype=torch.bool,
                                                                                              device=lp.device))
        # padding entries get distinct negative stand-ins, so only valid ids can collide
        K = lp.shape[-1]
        stand_in = -1 - torch.arange(K, device=lp.device)
        sorted_ids = torch.where(finite, ids.long(), stand_in).sort(dim=-1).values
        bad.append((sorted_ids[..., 1:] == sorted_ids[..., :-1]).any())
        bad.append((torch.logsumexp(torch.where(finite, lp.float(), float("-inf")), dim=-1) > tol).any())
        flags = torch.stack(bad)

    def raise_if_bad() -> None:
        bad_lp, bad_ids, dup, over = flags.tolist()
        if bad_lp:
            raise ValueError("topk_logprobs holds NaN or +inf; padding entries must be -inf")
        if bad_ids:  # the detailed message costs more syncs: only on failure
            ck.check_ids_in_range("topk_ids (at entries whose log-prob is finite)", ids[torch.isfinite(lp)], V)
        if dup:
            raise ValueError("topk_ids repeats an id within a row (at entries whose log-prob is finite): each row's "
                             "valid ids must be distinct (mark unused slots with log-prob -inf)")
        if over:
            raise ValueError(f"topk_logprobs are not a sub-distribution: a row's probabilities sum to more than 1 "
                             f"(logsumexp over its K entries > {tol:.2g}); store log-probs (log_softmax over the "
                             "whole vocabulary), not logits")

    return raise_if_bad


def _safe_ids(topk_ids: torch.Tensor, lp: torch.Tensor) -> torch.Tensor:
    """[N, K] int64 ids with 0 at padding entries (which may hold any id)."""
    ids = topk_ids.reshape(lp.shape).long()
    return torch.where(torch.isfinite(lp), ids, torch.zeros((), dtype=torch.long, device=lp.device))


# Under torch.compile the loss runs eagerly (one graph break around it), with all its checks: its paths
# are autograd Functions around host-side loops and Triton launches that Dynamo cannot trace.
@torch.compiler.disable
def topk_kl(
    xs: torch.Tensor,
    ws: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_logprobs: torch.Tensor,
    *,
    normalize: str = "full",
    divergence: str = "forward_kl",
    beta: float = 0.5,
    alpha: float = 0.1,
    tail: bool = False,
    labels: Optional[torch.Tensor] = None,
    ignore_index: int = -100,
    temperature: float = 1.0,
    teacher_temperature: Optional[float] = None,
    reduction: str = "mean",
    bs: Optional[torch.Tensor] = None,
    kd_weight: float = 1.0,
    ce_weight: float = 0.0,
    scale_t2: bool = False,
    chunk_V: Optional[int] = None,
    backend: str = "auto",
    mode: Optional[str] = None,
    memory_budget: Optional[int] = None,
    softcap_s: Optional[float] = None,
    return_parts: bool = False,
    process_group=None,
):
    """Distill from a teacher's stored top-k next-token log-probs, from the student's hidden states.

    Per row: ``D = sum_k p_k (log p_k - log q_k)`` (forward_kl) with ``p_k = exp(topk_logprobs)``
    as stored and ``q`` the student's tempered softmax at the K ids.

    Args:
        xs: student hidden states [..., D] (gradient flows here).
        ws: student LM head [V, D] (gradient flows here). bs: optional bias [V] (gradient too).
        topk_ids: [..., K] integer ids in [0, V) (same leading shape as xs); entries whose
            log-prob is -inf are padding and may hold any id.
        topk_logprobs: [..., K] the teacher's log-probs as stored; -inf marks padding entries,
            which contribute nothing. Ids must be distinct within a row.
        normalize: "full": log q_k = s_k - logsumexp over the whole vocabulary (one streaming pass
            over ws, never materialized); "topk": the student renormalized over the K ids (only
            those K rows of ws are read: no vocab-wide matmul).
        divergence: "forward_kl" (default; the teacher as stored), or "reverse_kl", "jsd" (beta),
            "tvd", "skew_kl", "skew_reverse_kl" (alpha), which compare distributions: with
            normalize="topk" both sides are renormalized over the valid ids; with
            normalize="full" they need tail=True.
        tail: add one bucket holding the mass outside the top-k on both sides: the teacher's
            1 - sum p_k (from the stored log-probs), the student's summed over the other ids of
            the vocabulary directly (exact however small); needs normalize="full". A row whose
            valid ids cover the whole vocabulary has no bucket.
        labels, ignore_index: rows whose label is ignore_index do not count; the labels are also
            the targets of the hard-label CE.
        temperature: divides the student's logits. The teacher's log-probs are used as stored:
            they already carry the temperature they were extracted at (the store records it).
            Pass it as ``teacher_temperature`` to have a mismatch raise.
        reduction: "mean" over counted rows, "sum", or "none" (per row, 0 at ignored rows).
        kd_weight, ce_weight: loss = kd_weight * D [* T^2 with scale_t2] + ce_weight * CE(labels)
            with the CE at temperature 1 over the full vocabulary (needs normalize="full").
        chunk_V: vocab chunk of the PyTorch backend (None = automatic).
        backend: "auto" (Triton on CUDA, PyTorch elsewhere), "torch" or "triton".
        mode, memory_budget: Triton, normalize="full" only. "fast" (default): rows in blocks whose fp32
            [rows, V] logit slab fits in memory_budget bytes (default 896 MiB), logits from cuBLAS, the
            gradient formed while the slab exists (three GEMMs in all). "constant_memory": fused
            kernels in the manner of cut-cross-entropy, no slab, O(rows * K) memory, slower.
        softcap_s: final-logit softcapping (Gemma 2/3) of the student's logits, z -> c tanh(z / c)
            before the temperature (the stored teacher log-probs carry the teacher's own cap); the
            gradient flows through the cap. Triton: the fast mode of normalize="full" applies it;
            normalize="topk" and the constant-memory mode then run on the PyTorch path. None = off.
        return_parts: return ``DistillOutput(loss, kd, ce)`` (kd and ce detached, reduced the same way).
        process_group: vocab-parallel head (normalize="full" only): ws (bs) hold this rank's contiguous
            block of the vocabulary, the other inputs are the same on every rank and ids are global;
            the loss over the whole vocabulary comes out on every rank (PyTorch path; docs/parallel.md).

    Returns:
        float32 loss (float64 for float64 inputs): a scalar, or the leading shape for "none".
    """
    if process_group is not None or type(ws).__name__ == "DTensor":
        from ..parallel.topk import parallel_topk_kl

        return parallel_topk_kl(
            xs, ws, topk_ids, topk_logprobs, process_group=process_group, normalize=normalize, divergence=divergence,
            beta=beta, alpha=alpha, tail=tail, labels=labels, ignore_index=ignore_index, temperature=temperature,
            teacher_temperature=teacher_temperature, reduction=reduction, bs=bs, kd_weight=kd_weight,
            ce_weight=ce_weight, scale_t2=scale_t2, chunk_V=chunk_V, backend=backend, softcap_s=softcap_s,
            return_parts=return_parts,
        )
    name, param = ck.divergence_param(divergence, beta, alpha)
    check_stored = _validate(xs, ws, topk_ids, topk_logprobs, bs, labels, normalize, divergence, tail,
                             temperature, teacher_temperature, reduction, chunk_V, kd_weight, ce_weight,
                             ignore_index, backend, mode=mode, memory_budget=memory_budget, softcap_s=softcap_s)
    impl = ck.resolve_backend(backend, xs.device)

    lead = xs.shape[:-1]
    K = topk_ids.shape[-1]
    x = xs.reshape(-1, xs.shape[-1])
    lp = topk_logprobs.reshape(-1, K)
    flat_labels = None if labels is None else labels.reshape(-1)
    mask = ck.row_weights(flat_labels, ignore_index, x.shape[0], xs.device)
    ce_labels = None
    if ce_weight != 0:
        ce_labels = torch.where(mask > 0, flat_labels, torch.full_like(flat_labels, -1)).long()
    cfg = TopKConfig(
        divergence=name,
        param=param,
        normalize=normalize,
        tail=bool(tail),
        temperature=float(temperature),
        kd_weight=float(kd_weight) * (temperature**2 if scale_t2 else 1.0),
        ce_weight=float(ce_weight),
        chunk_V=chunk_V,
        softcap_s=None if softcap_s is None else float(softcap_s),
    )
    # float64 and an empty batch take the PyTorch path; so does the softcap outside the fast mode
    fused = impl == "triton" and x.dtype != torch.float64 and x.shape[0] > 0
    fused = fused and (softcap_s is None or (cfg.full and mode != "constant_memory"))
    if fused and not cfg.full:
        # the K gathered rows are all it touches; the stored data's checks are read right before its
        # first kernel (their sync then idles the device for the launch alone)
        from .triton_support import support_topk

        out = support_topk(x, ws, bs, topk_ids.reshape(-1, K), lp, mask, cfg, reduction, check_stored)
        total, kd, ce = (r.reshape(lead) for r in out) if reduction == "none" else out
    elif fused and mode != "constant_memory":
        check_stored()
        # the fast mode reduces inside its autograd Function (it forms gradients in the forward)
        from .triton_fast import fast_topk

        out = fast_topk(x, ws, bs, _safe_ids(topk_ids, lp), lp, ce_labels, mask, cfg, reduction, memory_budget)
        total, kd, ce = (r.reshape(lead) for r in out) if reduction == "none" else out
    else:
        check_stored()
        ids = _safe_ids(topk_ids, lp)
        if fused:
            from .triton_dispatch import triton_rows as rows_fn
        else:
            from .chunked import chunked_rows as rows_fn
        rows = rows_fn(x, ws, bs, ids, lp, ce_labels, mask, cfg)
        total, kd, ce = (ck.reduce_rows(r, mask, reduction, lead) for r in rows)
    if return_parts:
        return DistillOutput(total, kd, ce)
    return total
