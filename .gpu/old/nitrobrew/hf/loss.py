"""One distillation loss for a batch of a causal LM: the piece the Trainer and plain loops share."""

from __future__ import annotations

import contextlib
from typing import Any, Dict, NamedTuple, Optional, Tuple, Union

import torch
from torch import nn

from .. import divergences as dv
from ..core.outputs import DistillOutput
from ..hidden.api import hidden_loss
from . import fsdp
from .model import IGNORE_INDEX, final_hidden_states, is_fsdp2, labels_from_inputs, lm_head, shift_labels
from .packing import document_targets, model_inputs

HIDDEN_DIVERGENCES = dv.NAMES
DIVERGENCES = HIDDEN_DIVERGENCES + ("topk",)


class LMDistillOutput(NamedTuple):
    """loss (differentiable); the unweighted divergence kd and cross-entropy ce (detached),
    normalized like the loss; n_tokens: the positions counted in this batch."""

    loss: torch.Tensor
    kd: torch.Tensor
    ce: torch.Tensor
    n_tokens: torch.Tensor


class Rows(NamedTuple):
    """One model's operands of the loss over the counted positions: hidden rows [n, D], head weight [V, D],
    bias [V] or None, final-logit softcap or None (a post-head logit scale folded in)."""

    x: torch.Tensor
    w: torch.Tensor
    b: Optional[torch.Tensor]
    softcap: Optional[float]


class Targets(NamedTuple):
    """The batch's targets: keep (bool [B * N]: the positions that count), labels (their targets), n_tokens."""

    keep: torch.Tensor
    labels: torch.Tensor
    n_tokens: torch.Tensor


def _no_autocast(device: torch.device):
    # The loss casts its operands itself and accumulates in fp32; autocast must not re-cast them.
    if device.type in ("cpu", "cuda"):
        return torch.autocast(device_type=device.type, enabled=False)
    return contextlib.nullcontext()


def _head_operands(model: nn.Module, hidden: torch.Tensor, keep: torch.Tensor) -> Rows:
    """The model's Rows at the kept positions of its final hidden states, in their dtype, with a post-head
    logit scale folded in (the cap applies after it, as in the model)."""
    rows = hidden.reshape(-1, hidden.shape[-1])[keep]
    head = lm_head(model)
    w = head.weight.to(device=hidden.device, dtype=hidden.dtype)
    b = None if head.bias is None else head.bias.to(device=hidden.device, dtype=hidden.dtype)
    if head.scale != 1.0:
        rows = rows * head.scale
        b = None if b is None else b * head.scale
    return Rows(rows, w, b, head.softcap)


def _check_request(divergence: str, teacher, kd_weight: float, topk_ids, topk_logprobs, stored: bool = False) -> None:
    if divergence not in dv.REGISTRY and divergence != "topk":
        raise ValueError(f"divergence must be one of {dv.NAMES + ('topk',)}, got {divergence!r}")
    if divergence == "topk" and (topk_ids is None or topk_logprobs is None):
        raise ValueError("divergence='topk' needs topk_ids and topk_logprobs (from a top-k store)")
    if divergence != "topk" and teacher is None and not stored and kd_weight != 0:
        raise ValueError(f"divergence={divergence!r} needs a teacher model (or kd_weight=0 for CE only)")


def batch_targets(
    input_ids: torch.Tensor,
    attention_mask: Optional[torch.Tensor],
    labels: Optional[torch.Tensor],
    targets: Optional[torch.Tensor],
    position_ids: Optional[torch.Tensor],
) -> Targets:
    """Per-position targets (labels shifted once, or targets already shifted), cut at document ends in a
    packed batch; the counted positions and their number."""
    if targets is None:
        per_token = labels_from_inputs(input_ids, attention_mask) if labels is None else labels
        target = shift_labels(per_token, attention_mask)
    elif labels is not None:
        raise ValueError("pass labels (per token) or targets (already shifted), not both")
    elif tuple(targets.shape) != tuple(input_ids.shape):
        raise ValueError(f"targets {tuple(targets.shape)} must have the shape of input_ids {tuple(input_ids.shape)}")
    else:
        target = targets
    target = document_targets(target, position_ids)
    keep = (target != IGNORE_INDEX).reshape(-1)
    return Targets(keep=keep, labels=target.reshape(-1)[keep], n_tokens=keep.sum())


def student_rows(
    student: nn.Module, input_ids: torch.Tensor, tg: Targets, *, through_forward: bool, inputs: Dict[str, Any]
) -> Tuple[Rows, torch.Tensor, Optional[fsdp.Layout]]:
    """(the student's Rows, their labels, the FSDP2 layout of a head sharded apart or None). FSDP2: the root
    forward gathers the parameters (the head included) and keeps them until the backward; with the decoder
    sharded apart from the head, the head stays sharded and the rows of all ranks are gathered (fsdp.py)."""
    sharded = fsdp.head_is_sharded_apart(student)
    hs = final_hidden_states(
        student, input_ids, through_forward=(through_forward or is_fsdp2(student)) and not sharded, **inputs
    )
    s = _head_operands(student, hs, tg.keep)
    if not sharded:
        return s, tg.labels, None
    x, labels, w, b, lay = fsdp.shard_student(s.x, tg.labels, s.w, s.b)
    return Rows(x, w, b, s.softcap), labels, lay


def teacher_rows(
    teacher: nn.Module,
    input_ids: torch.Tensor,
    keep: torch.Tensor,
    *,
    inputs: Dict[str, Any],
    device: torch.device,
    student_layout: Optional[fsdp.Layout],
) -> Rows:
    """The teacher's Rows (no gradient), laid out like the student's (fsdp.match_teacher)."""
    with torch.no_grad():
        apart = fsdp.head_is_sharded_apart(teacher)
        ht = final_hidden_states(teacher, input_ids, through_forward=is_fsdp2(teacher) and not apart, **inputs)
        t = _head_operands(teacher, ht.to(device), keep)
        x, w, b = fsdp.match_teacher(t.x, t.w, t.b, student_layout=student_layout, teacher_apart=apart)
    return Rows(x, w, b, t.softcap)


def check_stored_teacher(teacher, hidden, scale, head, input_ids: torch.Tensor, divergence: str) -> bool:
    """Whether the batch carries a stored teacher (``teacher_hidden``); ValueError if it is malformed."""
    if hidden is None:
        if scale is not None or head is not None:
            raise ValueError("teacher_hidden_scale / teacher_head need teacher_hidden (the stored rows)")
        return False
    if teacher is not None or divergence == "topk":
        raise ValueError("teacher_hidden replaces the teacher model: pass teacher=None, and a hidden-state divergence")
    if head is None or not hasattr(head, "weight"):
        raise ValueError("teacher_hidden needs teacher_head (the stored teacher's LMHead: dataset.load_head(device))")
    if (
        hidden.dim() != 3
        or tuple(hidden.shape[:2]) != tuple(input_ids.shape)
        or hidden.shape[2] != head.weight.shape[1]
    ):
        raise ValueError(
            f"teacher_hidden must be [B, N, Dt] = [{', '.join(map(str, input_ids.shape))}, {head.weight.shape[1]}], "
            f"got {tuple(hidden.shape)}"
        )
    fp8 = hidden.dtype == torch.float8_e4m3fn
    if fp8 != (scale is not None) or (fp8 and tuple(scale.shape) != tuple(input_ids.shape)):
        raise ValueError("fp8 teacher_hidden needs teacher_hidden_scale [B, N] (and only fp8 rows take one)")
    return True


def stored_teacher_rows(
    hidden: torch.Tensor,
    scale: Optional[torch.Tensor],
    head,
    keep: torch.Tensor,
    *,
    device: torch.device,
    student_layout: Optional[fsdp.Layout],
) -> Rows:
    """A stored teacher's Rows (``nitrobrew.teacher.hidden_data``): its hidden states at the kept positions
    and its head (an ``LMHead``), as ``teacher_rows`` makes them from a live teacher with the same states."""
    with torch.no_grad():
        flat = hidden.to(device, non_blocking=True).reshape(-1, hidden.shape[-1])
        if scale is not None:  # fp8: the codes' bytes are indexed (not every device indexes float8 tensors),
            rows = flat.view(torch.uint8)[keep].view(flat.dtype)  # then times their row scale, rounded once
            s = scale.to(device, non_blocking=True).reshape(-1)[keep].float()
            rows = (rows.float() * s[:, None]).to(head.weight.dtype)
        else:
            rows = flat[keep]
        w = head.weight.to(device=device, dtype=rows.dtype)
        b = None if head.bias is None else head.bias.to(device=device, dtype=rows.dtype)
        if head.scale != 1.0:
            rows = rows * head.scale
            b = None if b is None else b * head.scale
        x, w, b = fsdp.match_teacher(rows, w, b, student_layout=student_layout, teacher_apart=False)
    return Rows(x, w, b, head.softcap)


def _hidden_parts(s: Rows, t: Rows, divergence: str, options: Dict[str, Any]) -> DistillOutput:
    with _no_autocast(s.x.device):
        return hidden_loss(s.x, t.x, s.w, t.w, divergence=divergence, bs=s.b, bt=t.b, softcap_t=t.softcap, **options)


def _ce_only_parts(s: Rows, divergence: str, options: Dict[str, Any]) -> DistillOutput:
    # no teacher forward: a constant teacher of width 1, weighted 0; its divergence means nothing: report 0
    stand_in = Rows(s.x.new_zeros(s.x.shape[0], 1).detach(), s.w.new_zeros(s.w.shape[0], 1).detach(), None, None)
    parts = _hidden_parts(s, stand_in, divergence, options)
    return parts._replace(kd=torch.zeros_like(parts.kd))


def _topk_parts(
    s: Rows, topk_ids: torch.Tensor, topk_logprobs: torch.Tensor, keep: torch.Tensor, options: Dict[str, Any]
) -> DistillOutput:
    from ..topk import topk_kl

    ids, lp = (t.to(s.x.device).reshape(-1, t.shape[-1])[keep] for t in (topk_ids, topk_logprobs))
    w, b = s.w, s.b
    vocab_size = options.pop("vocab_size")
    if vocab_size is not None:  # a padded student head: the first vocab_size rows are the vocabulary
        w, b = w[:vocab_size], None if b is None else b[:vocab_size]
    with _no_autocast(s.x.device):
        return topk_kl(s.x, w, ids, lp.float(), bs=b, **options)


def _normalized(
    parts: DistillOutput,
    n_tokens: torch.Tensor,
    num_items_in_batch: Optional[Union[int, torch.Tensor]],
    lay: Optional[fsdp.Layout],
) -> LMDistillOutput:
    """The summed parts over the normalizer: num_items_in_batch, else the positions counted (all ranks'
    with a sharded head, whose loss is reported as 1/world of it: fsdp.over_ranks)."""
    counted = n_tokens
    if lay is not None:
        parts, counted = fsdp.over_ranks(parts, n_tokens, lay)
    denom: Union[int, torch.Tensor]
    if num_items_in_batch is None:
        denom = counted.clamp_min(1)
    elif isinstance(num_items_in_batch, torch.Tensor):
        denom = num_items_in_batch.to(parts.loss.device).clamp_min(1)
    else:
        denom = max(num_items_in_batch, 1)
    return LMDistillOutput(parts.loss / denom, parts.kd / denom, parts.ce / denom, n_tokens)


def distill_loss(
    student: nn.Module,
    teacher: Optional[nn.Module],
    input_ids: torch.Tensor,
    attention_mask: Optional[torch.Tensor] = None,
    labels: Optional[torch.Tensor] = None,
    *,
    targets: Optional[torch.Tensor] = None,
    divergence: str = "forward_kl",
    temperature: float = 1.0,
    scale_t2: bool = False,
    kd_weight: float = 1.0,
    ce_weight: float = 0.0,
    vocab_size: Optional[int] = None,
    num_items_in_batch: Optional[Union[int, torch.Tensor]] = None,
    topk_ids: Optional[torch.Tensor] = None,
    topk_logprobs: Optional[torch.Tensor] = None,
    topk_normalize: str = "full",
    topk_tail: bool = False,
    teacher_temperature: Optional[float] = None,
    chunk_V: Optional[int] = None,
    backend: str = "auto",
    through_forward: bool = False,
    position_ids: Optional[torch.Tensor] = None,
    teacher_hidden: Optional[torch.Tensor] = None,
    teacher_hidden_scale: Optional[torch.Tensor] = None,
    teacher_head=None,
    **kwargs,
) -> LMDistillOutput:
    """Distillation loss of a student causal LM against a teacher (or stored top-k) on one batch.

    ``loss = (kd_weight * D(teacher || student) + ce_weight * CE(labels)) summed over counted
    positions / normalizer``. Position i's hidden state predicts token i+1 (labels are shifted
    here, once); padding (``attention_mask == 0``) and labels equal to -100 do not count. No
    [tokens, vocab] logits are formed: both models run to their final hidden states and the
    divergence is computed chunk-wise from them and the LM heads (``nitrobrew.hidden_loss``).

    Args:
        student: a transformers causal LM (optionally PEFT-wrapped); gradients flow into it.
        teacher: a causal LM sharing the student's tokenizer, on the student's device, run under
            ``torch.no_grad()`` (put it in eval mode yourself). None with ``divergence="topk"``,
            or for CE only (``kd_weight=0``, where the teacher is not run at all).
        input_ids, attention_mask, labels: the batch ([B, N]); labels default to the input ids
            with -100 at padding, and are per token (not yet shifted), as HF collators make them.
        targets: instead of labels, per-position targets already shifted (``targets[b, i]`` is
            the token position i predicts, -100 where nothing counts), as
            ``nitrobrew.teacher.data.TopKCollator`` makes them under the name "labels".
        divergence: one of forward_kl, reverse_kl, jsd, tvd, skew_kl, skew_reverse_kl, or "topk"
            (needs topk_ids / topk_logprobs).
        temperature, scale_t2: logits / T for the divergence; ``scale_t2`` multiplies it by T^2.
        kd_weight, ce_weight: weights of the divergence and of the hard-label CE (at T = 1).
        vocab_size: compare the first vocab_size entries of both heads (padded heads).
        num_items_in_batch: the normalizer: the number of counted positions in the whole
            gradient-accumulation window (``count_targets`` summed over its micro-batches). None:
            this batch's own count (a mean over this batch).
        topk_ids, topk_logprobs: [B, N, K] stored teacher top-k per position (the row at position
            i describes token i+1), for divergence="topk"; topk_normalize and topk_tail are
            ``topk_kl``'s normalize and tail; teacher_temperature: the temperature the store
            was extracted at (a mismatch with ``temperature`` raises).
        chunk_V, backend: passed to the loss.
        through_forward: run the student through its own forward (see ``final_hidden_states``);
            always for a model under FSDP2 (``fully_shard``), student or teacher.
        position_ids: [B, N] (or [N]) positions; in a packed batch they restart at each document
            (``DataCollatorWithFlattening``): each model then attends within documents only (see
            ``nitrobrew.hf.packing``) and the last position of a document predicts nothing.
        teacher_hidden, teacher_hidden_scale, teacher_head: a stored teacher instead of a live one
            (``nitrobrew.teacher.hidden_data``; pass teacher=None): its final hidden states [B, N, Dt]
            (row i at position i; float32, bfloat16, or fp8 codes with their per-row scales [B, N]) and
            its head (``nitrobrew.hf.model.LMHead``: weight, bias, logit scale, softcap). Exact: the
            loss is the live teacher's with the same hidden states.
        **kwargs: the divergence's parameter by its keyword (``beta`` for jsd, ``alpha`` for the skews;
            ranges and defaults: ``divergences.PARAMS``), and the flash-attention varlen kwargs of a
            packed batch (``cu_seq_lens_q``, ``cu_seq_lens_k``, ``max_length_q``, ``max_length_k``),
            passed to both models.

    Returns:
        ``LMDistillOutput(loss, kd, ce, n_tokens)``.
    """
    stored = check_stored_teacher(
        teacher,
        hidden=teacher_hidden,
        scale=teacher_hidden_scale,
        head=teacher_head,
        input_ids=input_ids,
        divergence=divergence,
    )
    _check_request(divergence, teacher_head if stored else teacher, kd_weight, topk_ids, topk_logprobs)
    params = {k: v for k, v in kwargs.items() if k in dv.PARAMS}
    varlen = {k: v for k, v in kwargs.items() if k not in dv.PARAMS}
    tg = batch_targets(input_ids, attention_mask, labels, targets, position_ids)
    # Built before any forward: an input that cannot be honoured raises first.
    s_inputs = model_inputs(student, input_ids, attention_mask, position_ids, **varlen)
    t_inputs = None if teacher is None else model_inputs(teacher, input_ids, attention_mask, position_ids, **varlen)
    if divergence == "topk" and fsdp.head_is_sharded_apart(student):
        raise ValueError(
            "divergence='topk' with an FSDP2 head sharded apart from the decoder is not supported: "
            "shard the decoder and the head in one unit (the root)"
        )
    s, s_labels, lay = student_rows(student, input_ids, tg, through_forward=through_forward, inputs=s_inputs)
    options: Dict[str, Any] = dict(
        labels=s_labels,
        temperature=temperature,
        scale_t2=scale_t2,
        kd_weight=kd_weight,
        ce_weight=ce_weight,
        reduction="sum",
        vocab_size=vocab_size,
        chunk_V=chunk_V,
        backend=backend,
        softcap_s=s.softcap,
        return_parts=True,
        process_group=None if lay is None else lay.group,
        **params,
    )
    if divergence == "topk":
        assert topk_ids is not None and topk_logprobs is not None  # checked on entry
        options.update(normalize=topk_normalize, tail=topk_tail, teacher_temperature=teacher_temperature)
        parts = _topk_parts(s, topk_ids, topk_logprobs, tg.keep, options)
    elif stored and kd_weight != 0:  # a hidden-state store: the stored rows and head are the teacher's Rows
        assert teacher_hidden is not None  # checked on entry
        t = stored_teacher_rows(
            teacher_hidden, teacher_hidden_scale, teacher_head, tg.keep, device=s.x.device, student_layout=lay
        )
        parts = _hidden_parts(s, t, divergence, options)
    elif teacher is None or kd_weight == 0:
        parts = _ce_only_parts(s, divergence, options)
    else:
        assert t_inputs is not None  # built with the teacher
        t = teacher_rows(teacher, input_ids, tg.keep, inputs=t_inputs, device=s.x.device, student_layout=lay)
        parts = _hidden_parts(s, t, divergence, options)
    return _normalized(parts, tg.n_tokens, num_items_in_batch, lay)
