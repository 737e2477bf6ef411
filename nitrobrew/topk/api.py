"""Public top-k KD loss: validation, backend dispatch, reduction."""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from ..core import checks as ck
from ..core.outputs import DistillOutput
from ..core.reduction import IGNORE_INDEX, reduce_rows
from .validation import TopKCall, TopKInputs, TopKOptions, safe_ids, validate


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
    tail: bool = False,
    labels: Optional[torch.Tensor] = None,
    ignore_index: int = IGNORE_INDEX,
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
    **params: float,
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
    if process_group is not None or any(ck.is_dtensor(t) for t in (xs, ws, bs, topk_ids, topk_logprobs)):
        from ..parallel.dtensor import unwrap

        xs, _, ws, _, bs, _, labels, process_group = unwrap(
            xs=xs, xt=None, ws=ws, wt=None, bs=bs, bt=None, labels=labels, process_group=process_group
        )
        topk_ids, topk_logprobs = ck.local_tensor(topk_ids), ck.local_tensor(topk_logprobs)
    options = TopKOptions(
        normalize=normalize,
        divergence=divergence,
        tail=tail,
        temperature=temperature,
        teacher_temperature=teacher_temperature,
        reduction=reduction,
        chunk_V=chunk_V,
        kd_weight=kd_weight,
        ce_weight=ce_weight,
        scale_t2=scale_t2,
        ignore_index=ignore_index,
        backend=backend,
        mode=mode,
        memory_budget=memory_budget,
        softcap_s=softcap_s,
    )
    inputs = TopKInputs(xs=xs, ws=ws, ids=topk_ids, lp=topk_logprobs, bs=bs, labels=labels)
    if process_group is not None:  # a vocab-parallel head
        from .vocab_parallel import vocab_parallel_topk

        return vocab_parallel_topk(inputs, options, params, group=process_group, return_parts=return_parts)
    call = validate(inputs, options, params)
    out = _dispatch(call)
    total, kd, ce = (r.reshape(call.rows.lead) for r in out) if call.reduction == "none" else out
    if return_parts:
        return DistillOutput(total, kd, ce)
    return total


def _dispatch(call: TopKCall) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(total, kd, ce) reduced, flat for "none", from the path that fits the checked call: the Triton
    support kernels (normalize="topk"), the Triton fast or constant-memory mode, or the PyTorch chunked
    rows. ``call.check`` reads the stored data's checks (one device sync) right before the first kernel."""
    rows, cfg, mode = call.rows, call.cfg, call.mode
    x, lp, mask = rows.x, rows.lp, rows.mask
    # float64 and an empty batch take the PyTorch path; so does the softcap outside the fast mode
    fused = call.impl == "triton" and x.dtype != torch.float64 and x.shape[0] > 0
    fused = fused and (cfg.softcap_s is None or (cfg.full and mode != "constant_memory"))
    if fused and not cfg.full:
        # the K gathered rows are all it touches; the stored data's checks are read right before its
        # first kernel (their sync then idles the device for the launch alone)
        from .triton_support import support_topk

        return support_topk(
            xs=x,
            ws=call.ws,
            bs=call.bs,
            ids=rows.ids,
            lp=lp,
            mask=mask,
            cfg=cfg,
            reduction=call.reduction,
            check=call.check,
        )
    call.check()
    ids = safe_ids(rows.ids, lp)
    if fused and mode != "constant_memory":
        # the fast mode reduces inside its autograd Function (it forms gradients in the forward)
        from .triton_fast import fast_topk

        return fast_topk(
            xs=x,
            ws=call.ws,
            bs=call.bs,
            ids=ids,
            lp=lp,
            labels=rows.ce_labels,
            mask=mask,
            cfg=cfg,
            reduction=call.reduction,
            memory_budget=call.memory_budget,
        )
    if fused:
        from .triton_cm import constant_memory_rows as rows_fn
    else:
        from .chunked import chunked_rows as rows_fn
    per_row = rows_fn(xs=x, ws=call.ws, bs=call.bs, ids=ids, lp=lp, labels=rows.ce_labels, mask=mask, cfg=cfg)
    total, kd, ce = (reduce_rows(r, mask, call.reduction, rows.lead) for r in per_row)
    return total, kd, ce
