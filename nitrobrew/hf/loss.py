"""One distillation loss for a batch of a causal LM: the piece the Trainer and plain loops share."""

from __future__ import annotations

import contextlib
from typing import NamedTuple, Optional, Union

import torch
from torch import nn

from .. import divergences as dv
from ..hidden.api import hidden_loss
from .fsdp import gather_rows, head_block, head_is_sharded_apart
from .fsdp import layout as fsdp_layout
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


def _no_autocast(device: torch.device):
    # The loss casts its operands itself and accumulates in fp32; autocast must not re-cast them.
    if device.type in ("cpu", "cuda"):
        return torch.autocast(device_type=device.type, enabled=False)
    return contextlib.nullcontext()


def _rows(hidden: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    return hidden.reshape(-1, hidden.shape[-1])[keep]


def _head_operands(model: nn.Module, like: torch.Tensor, rows: torch.Tensor, head=None):
    """(hidden rows, head weight, bias, final-logit softcap or None) in one dtype, with a post-head
    logit scale folded in (the cap applies after it, as in the model). `head`: an ``LMHead`` given
    instead of the model's (a stored teacher's)."""
    head = lm_head(model) if head is None else head
    w = head.weight.to(device=like.device, dtype=like.dtype)
    b = None if head.bias is None else head.bias.to(device=like.device, dtype=like.dtype)
    if head.scale != 1.0:
        rows = rows * head.scale
        b = None if b is None else b * head.scale
    return rows, w, b, head.softcap


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
    beta: float = 0.5,
    alpha: float = 0.1,
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
    **varlen,
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
        divergence: one of forward_kl, reverse_kl, jsd (beta), tvd, skew_kl, skew_reverse_kl
            (alpha), or "topk" (needs topk_ids / topk_logprobs).
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
        **varlen: the flash-attention varlen kwargs of a packed batch (``cu_seq_lens_q``,
            ``cu_seq_lens_k``, ``max_length_q``, ``max_length_k``), passed to both models.

    Returns:
        ``LMDistillOutput(loss, kd, ce, n_tokens)``.
    """
    if divergence not in DIVERGENCES:
        raise ValueError(f"divergence must be one of {DIVERGENCES}, got {divergence!r}")
    if divergence == "topk" and (topk_ids is None or topk_logprobs is None):
        raise ValueError("divergence='topk' needs topk_ids and topk_logprobs (from a top-k store)")
    stored = _check_stored_teacher(teacher, teacher_hidden, teacher_hidden_scale, teacher_head, input_ids, divergence)
    if divergence != "topk" and teacher is None and not stored and kd_weight != 0:
        raise ValueError(f"divergence={divergence!r} needs a teacher model (or kd_weight=0 for CE only)")
    if targets is None:
        target = shift_labels(
            labels_from_inputs(input_ids, attention_mask) if labels is None else labels, attention_mask
        )
    elif labels is not None:
        raise ValueError("pass labels (per token) or targets (already shifted), not both")
    elif tuple(targets.shape) != tuple(input_ids.shape):
        raise ValueError(f"targets {tuple(targets.shape)} must have the shape of input_ids {tuple(input_ids.shape)}")
    else:
        target = targets
    target = document_targets(target, position_ids)
    keep = (target != IGNORE_INDEX).reshape(-1)
    rows_labels = target.reshape(-1)[keep]
    n_tokens = keep.sum()

    # Built before any forward: an input that cannot be honoured raises first.
    s_inputs = model_inputs(student, input_ids, attention_mask, position_ids, **varlen)
    t_inputs = None if teacher is None else model_inputs(teacher, input_ids, attention_mask, position_ids, **varlen)
    # FSDP2: the root forward gathers the parameters (the head included) and keeps them until the
    # backward; with the decoder sharded apart from the head, the head stays sharded (fsdp.py).
    sharded_head = head_is_sharded_apart(student)
    if sharded_head and divergence == "topk":
        raise ValueError(
            "divergence='topk' with an FSDP2 head sharded apart from the decoder is not supported: "
            "shard the decoder and the head in one unit (the root)"
        )
    hs = final_hidden_states(
        student, input_ids, through_forward=(through_forward or is_fsdp2(student)) and not sharded_head, **s_inputs
    )
    xs, ws, bs, cap_s = _head_operands(student, hs, _rows(hs, keep))
    group, world = None, 1
    if sharded_head:
        lay = fsdp_layout(ws)
        group, world = lay.group, lay.world
        xs = gather_rows(xs, group, scale=world)  # FSDP averages the decoder's gradients over ranks
        rows_labels = gather_rows(rows_labels, group)
        ws = ws.to_local()
        bs = bs.to_local() if bs is not None and type(bs).__name__ == "DTensor" else bs
    options = dict(
        labels=rows_labels,
        temperature=temperature,
        scale_t2=scale_t2,
        kd_weight=kd_weight,
        ce_weight=ce_weight,
        beta=beta,
        alpha=alpha,
        reduction="sum",
        bs=bs,
        chunk_V=chunk_V,
        backend=backend,
        softcap_s=cap_s,
        return_parts=True,
        process_group=group,
    )
    if divergence == "topk":
        ids, lp = (t.to(xs.device).reshape(-1, t.shape[-1])[keep] for t in (topk_ids, topk_logprobs))
        if vocab_size is not None:  # a padded student head: the first vocab_size rows are the vocabulary
            options.update(bs=None if bs is None else bs[:vocab_size])
            ws = ws[:vocab_size]
        from ..topk import topk_kl

        with _no_autocast(xs.device):
            parts = topk_kl(
                xs,
                ws,
                ids,
                lp.float(),
                normalize=topk_normalize,
                tail=topk_tail,
                teacher_temperature=teacher_temperature,
                **options,
            )
    else:
        ce_only = (teacher is None and not stored) or kd_weight == 0
        if ce_only:  # no teacher forward: a constant teacher of width 1, weighted 0
            xt = xs.new_zeros(xs.shape[0], 1).detach()
            wt, bt, cap_t = ws.new_zeros(ws.shape[0], 1).detach(), None, None
        else:
            with torch.no_grad():
                if stored:
                    apart = False
                    xt, wt, bt, cap_t = _stored_operands(teacher_hidden, teacher_hidden_scale, teacher_head, keep, xs)
                else:
                    apart = head_is_sharded_apart(teacher)
                    ht = final_hidden_states(
                        teacher, input_ids, through_forward=is_fsdp2(teacher) and not apart, **t_inputs
                    ).to(xs.device)
                    xt, wt, bt, cap_t = _head_operands(teacher, ht, _rows(ht, keep))
                if sharded_head:  # all ranks' teacher rows, this rank's block of the teacher's head
                    xt = gather_rows(xt, group)
                    wt, bt = head_block(wt, bt, lay)
                elif apart:  # a teacher head kept sharded, a student head whole: gather the teacher's
                    wt, bt = (None if t is None else t.full_tensor() for t in (wt, bt))
        with _no_autocast(xs.device):
            parts = hidden_loss(
                xs, xt, ws, wt, divergence=divergence, vocab_size=vocab_size, bt=bt, softcap_t=cap_t, **options
            )
        if ce_only:  # the divergence to the stand-in teacher means nothing: report 0
            parts = parts._replace(kd=torch.zeros_like(parts.kd))
    if sharded_head:  # the loss covers all ranks' rows: count them, and report 1/world of it
        n_all = n_tokens.clone()
        torch.distributed.all_reduce(n_all, group=group)
        parts = parts._replace(**{k: getattr(parts, k) / world for k in ("loss", "kd", "ce")})
    if num_items_in_batch is None:
        denom = (n_all if sharded_head else n_tokens).clamp_min(1)
    elif isinstance(num_items_in_batch, torch.Tensor):
        denom = num_items_in_batch.to(parts.loss.device).clamp_min(1)
    else:
        denom = max(num_items_in_batch, 1)
    return LMDistillOutput(parts.loss / denom, parts.kd / denom, parts.ce / denom, n_tokens)


def _check_stored_teacher(teacher, hidden, scale, head, input_ids, divergence) -> bool:
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


def _stored_operands(hidden, scale, head, keep, xs):
    """The stored teacher's (rows, weight, bias, softcap) at the counted positions, on the student's device."""
    flat = hidden.to(xs.device, non_blocking=True).reshape(-1, hidden.shape[-1])
    if scale is not None:  # the codes' bytes are indexed (not every device indexes float8 tensors)
        rows = flat.view(torch.uint8)[keep].view(flat.dtype)
    else:
        rows = flat[keep]
    if scale is not None:  # fp8 codes times their row scale, rounded once into the head's dtype
        s = scale.to(xs.device, non_blocking=True).reshape(-1)[keep].float()
        rows = (rows.float() * s[:, None]).to(head.weight.dtype)
    return _head_operands(None, rows, rows, head=head)
