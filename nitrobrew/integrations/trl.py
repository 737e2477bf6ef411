"""nitrobrew's loss inside TRL's own trainers (``pip install 'nitrobrew[trl]'``).

Two subclasses that replace TRL's loss by nitrobrew's and keep everything else of TRL (the data
collators and chat data, on-policy generation with ``lmbda`` / ``seq_kd`` or vLLM, PEFT, DeepSpeed
and FSDP set-up, logging, checkpoints):

- ``NitrobrewGKDTrainer`` (``trl.experimental.gkd.GKDTrainer``): ``compute_loss`` runs both models
  to their final hidden states and computes the divergence from them and the LM heads, chunk by
  chunk (``nitrobrew.hf.distill_loss``): no [tokens, vocab] logits, fp32 accumulation, exact.
- ``NitrobrewDistillationTrainer`` (``trl.DistillationTrainer``): ``_compute_loss`` takes TRL's own
  hidden states of the completion positions and computes the loss with ``nitrobrew.hidden_loss``.

Both follow TRL's conventions: ``beta`` picks the generalized JSD (0: forward KL, 1: reverse KL,
else JSD with the mixture (1 - beta) p_student + beta p_teacher, nitrobrew's ``jsd(beta)``), the
positions are those TRL counts, and the summed loss is divided by ``num_items_in_batch`` as TRL
divides it (by the batch's own count when it is None). GKD's ``temperature`` is its sampling
temperature: its loss runs at T = 1, as TRL's does; DistillationTrainer's ``temperature`` is both.

``NitrobrewLoss`` (the ``nitrobrew=`` argument of either trainer) adds what TRL does not have: any
of nitrobrew's divergences (``divergence="tvd"``, ``"skew_kl"`` with ``alpha`` ...), a hard-label
cross-entropy fused into the same pass (``ce_weight``), a loss temperature of its own with the T^2
factor (``scale_t2``), and ``chunk_V`` / ``backend``.

``generalized_jsd_loss`` is TRL's function of the same name (same signature and reductions) for
logits you already hold, computed by nitrobrew.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import NamedTuple, Optional, Tuple, Union

import torch

from .. import divergences as dv
from ..core.ops import compute_dtype, linear_logits, softcap_
from ..hf.loss import distill_loss
from ..hf.model import IGNORE_INDEX, lm_head
from ..hf.wrapping import is_wrapped
from ..hidden.api import hidden_loss

__all__ = ["NitrobrewLoss", "distillation_loss", "generalized_jsd_loss"]  # and the two trainers, built on first use

# rows x vocab floats of one no-grad slab for the logged student entropy (16 MiB)
_ENTROPY_SLAB = 1 << 22


@dataclass
class NitrobrewLoss:
    """What nitrobrew's loss adds to a TRL trainer's (defaults: TRL's loss, computed by nitrobrew).

    divergence: None follows TRL's ``beta`` (``jsd(beta)``: 0 is forward KL, 1 reverse KL); or one
        of ``nitrobrew.divergences.NAMES`` (``beta`` then feeds ``jsd``, ``alpha`` the skew ones).
    alpha: the skew divergences' parameter.
    ce_weight: weight of the hard-label cross-entropy on the same positions (at T = 1), fused into
        the divergence's pass over the vocabulary. TRL has none: 0.
    temperature: the loss temperature; None keeps TRL's (GKD: 1.0, its ``temperature`` samples;
        DistillationTrainer: ``args.temperature``).
    scale_t2: multiply the divergence by T^2 (TRL does not).
    chunk_V, backend: ``hidden_loss``'s vocabulary chunk and backend ("auto", "torch", "triton").
    log_entropy: DistillationTrainer logs the student's mean entropy as TRL does (one more no-grad
        pass over the head); False skips it (the metric then reads 0).
    """

    divergence: Optional[str] = None
    alpha: float = 0.1
    ce_weight: float = 0.0
    temperature: Optional[float] = None
    scale_t2: bool = False
    chunk_V: Optional[int] = None
    backend: str = "auto"
    log_entropy: bool = True

    def __post_init__(self):
        if self.divergence is not None and self.divergence not in dv.NAMES:
            raise ValueError(f"divergence must be None (TRL's beta rule) or one of {dv.NAMES}, got {self.divergence!r}")
        for name in ("alpha", "ce_weight"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
        t = self.temperature
        if t is not None and (
            isinstance(t, bool) or not isinstance(t, (int, float)) or not (math.isfinite(t) and t > 0)
        ):
            raise ValueError(f"temperature must be None or a finite number > 0, got {t!r}")

    def resolve(self, beta: float):
        """(divergence, beta) for TRL's beta."""
        if self.divergence is None:
            return dv.canonical("jsd", float(beta))[0], float(beta)
        return self.divergence, float(beta)


def _loss_args(value) -> NitrobrewLoss:
    if value is None:
        return NitrobrewLoss()
    if isinstance(value, NitrobrewLoss):
        return value
    if isinstance(value, dict):
        return NitrobrewLoss(**value)
    raise TypeError(f"nitrobrew must be a NitrobrewLoss, a dict of its fields or None, got {type(value).__name__}")


def _no_autocast(device: torch.device):
    # the loss casts its operands itself and accumulates in fp32; autocast must not re-cast them
    if device.type in ("cpu", "cuda"):
        return torch.autocast(device_type=device.type, enabled=False)
    return contextlib.nullcontext()


def _normalized(total: torch.Tensor, count: torch.Tensor, num_items_in_batch) -> torch.Tensor:
    """TRL's reduction: sum / num_items_in_batch, or the mean over this batch's counted positions."""
    if num_items_in_batch is None:
        return total / count.clamp(min=1)
    if isinstance(num_items_in_batch, torch.Tensor):
        num_items_in_batch = num_items_in_batch.to(total.device)
    return total / num_items_in_batch


def generalized_jsd_loss(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    labels: Optional[torch.Tensor] = None,
    beta: float = 0.5,
    temperature: float = 1.0,
    reduction: str = "batchmean",
    num_items_in_batch: Optional[Union[int, torch.Tensor]] = None,
) -> torch.Tensor:
    """TRL's ``GKDTrainer.generalized_jsd_loss`` (same arguments, same value), computed by nitrobrew
    from logits already formed ([..., V]; positions with label -100 do not count)."""
    if student_logits.shape != teacher_logits.shape:
        raise ValueError(
            f"student_logits {tuple(student_logits.shape)} and teacher_logits {tuple(teacher_logits.shape)} differ"
        )
    if reduction not in ("batchmean", "sum", "mean", "none"):
        raise ValueError(f"reduction must be one of batchmean, sum, mean, none; got {reduction!r}")
    V = student_logits.shape[-1]
    xs, xt = student_logits.reshape(-1, V), teacher_logits.reshape(-1, V)
    keep = None if labels is None else labels.reshape(-1) != IGNORE_INDEX
    if keep is not None:
        xs, xt = xs[keep], xt[keep]
    eye = torch.eye(V, dtype=xs.dtype, device=xs.device)  # logits x I = the logits, exactly
    div, beta = dv.canonical("jsd", float(beta))
    with _no_autocast(xs.device):
        rows = hidden_loss(xs, xt, eye, eye, divergence=div, beta=beta, temperature=temperature, reduction="none")
    # TRL's "none" reduction returns the per-entry terms; nitrobrew's are per row (summed over the vocabulary)
    if num_items_in_batch is not None:
        return _normalized(rows.sum(), rows.new_tensor(rows.shape[0]), num_items_in_batch)
    if reduction == "batchmean":
        return rows.sum() / max(rows.shape[0], 1)
    if reduction == "sum":
        return rows.sum()
    if reduction == "mean":
        return rows.sum() / max(rows.numel() * V, 1)
    return rows


# ------------------------------------------------------------------------------------- trainers


def _trl():
    try:
        import trl
    except ImportError as err:
        raise ImportError("nitrobrew.integrations.trl needs TRL: pip install 'nitrobrew[trl]'") from err
    return trl


def _gkd_trainer_class():
    _trl()
    import warnings

    with warnings.catch_warnings():  # TRL's notice that experimental APIs may change: known, once is enough
        warnings.simplefilter("ignore")
        from trl.experimental.gkd import GKDTrainer

    class NitrobrewGKDTrainer(GKDTrainer):
        """``trl.experimental.gkd.GKDTrainer`` whose loss is nitrobrew's (see the module docstring).

        Takes GKDTrainer's arguments and ``nitrobrew`` (a ``NitrobrewLoss``, a dict of its fields,
        or None for TRL's loss computed by nitrobrew)."""

        def __init__(self, *args, nitrobrew: Union[NitrobrewLoss, dict, None] = None, **kwargs):
            self.nitrobrew = _loss_args(nitrobrew)
            super().__init__(*args, **kwargs)

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            a = self.nitrobrew
            labels = inputs["labels"]
            # TRL's positions: logits at i predict labels[i + 1]; labels of -100 do not count
            targets = torch.full_like(labels, IGNORE_INDEX)
            targets[:, :-1] = labels[:, 1:]
            self.teacher_model.eval()
            divergence, beta = a.resolve(self.beta)
            out = distill_loss(
                model,
                self.teacher_model,
                inputs["input_ids"],
                inputs["attention_mask"],
                targets=targets,
                divergence=divergence,
                beta=beta,
                alpha=a.alpha,
                temperature=1.0 if a.temperature is None else a.temperature,
                scale_t2=a.scale_t2,
                ce_weight=a.ce_weight,
                chunk_V=a.chunk_V,
                backend=a.backend,
                num_items_in_batch=num_items_in_batch,  # sum / num_items_in_batch, else this batch's mean
                through_forward=is_wrapped(model),
            )
            loss = out.loss
            return (loss, {"loss": loss}) if return_outputs else loss

    return NitrobrewGKDTrainer


def _entropy_sum(x, head: "_Head", temperature: float) -> torch.Tensor:
    """Sum over rows of the student's entropy at the loss temperature, H = lse - sum p z (no grad; fp32
    logits slab by slab, rows x vocab floats of at most ``_ENTROPY_SLAB``)."""
    acc = compute_dtype(x.dtype)
    total = torch.zeros((), dtype=acc, device=x.device)
    step = max(1, _ENTROPY_SLAB // max(head.weight.shape[0], 1))
    with torch.no_grad():
        for i in range(0, x.shape[0], step):
            z = softcap_(linear_logits(x[i : i + step], head.weight, head.bias, acc), head.softcap).div_(temperature)
            lse = torch.logsumexp(z, -1, keepdim=True)
            total += lse.sum() - torch.exp(z - lse).mul_(z).sum()
    return total


class _Head(NamedTuple):
    """An LM head as the loss takes it: plain tensors in the hidden states' dtype, the scale folded in."""

    weight: torch.Tensor
    bias: Optional[torch.Tensor]
    softcap: Optional[float]


def _plain_head(head, dtype: torch.dtype) -> Tuple[_Head, float]:
    """(head with plain tensors in ``dtype``, its logit scale). FSDP2: one gather of each head (TRL does
    the same), then plain tensors."""
    w, b = (t.full_tensor() if type(t).__name__ == "DTensor" else t for t in (head.weight, head.bias))
    return _Head(w.to(dtype), None if b is None else b.to(dtype), head.softcap), head.scale


def distillation_loss(
    hs: torch.Tensor,
    ht: torch.Tensor,
    head_s,
    head_t,
    loss_mask: torch.Tensor,
    *,
    labels: torch.Tensor,
    beta: float,
    temperature: float,
    options: Optional[NitrobrewLoss] = None,
    num_items_in_batch=None,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``trl.DistillationTrainer``'s loss, by nitrobrew: (loss, entropy sum, counted positions), as TRL's
    ``_chunked_divergence_loss`` returns them.

    hs, ht: the student's / teacher's final hidden states of the completion positions ([B, C, Ds] / [B, C,
    Dt]); head_s, head_t: ``nitrobrew.hf.model.LMHead`` of each (weight, bias, scale, softcap); loss_mask
    [B, C]: the positions that count (nonzero); labels [B, C]: the completion ids (the CE targets when
    ``options.ce_weight`` > 0). ``beta`` and ``temperature`` are TRL's (``options`` may override them);
    the summed loss is divided by ``num_items_in_batch``, else by the counted positions."""
    a = _loss_args(options)
    device = head_s.weight.device
    if head_t.weight.device != device:
        raise ValueError(
            f"the student's LM head is on {device}, the teacher's on {head_t.weight.device}: place both on one device"
        )
    valid = loss_mask.to(device).reshape(-1) != 0
    # only the counted positions are projected (TRL projects every position on a CPU)
    xs = hs.to(device).reshape(-1, hs.shape[-1])[valid]
    xt = ht.to(device).reshape(-1, ht.shape[-1])[valid]
    ws, scale_s = _plain_head(head_s, xs.dtype)
    wt, scale_t = _plain_head(head_t, xt.dtype)
    bs, bt = ws.bias, wt.bias
    if scale_s != 1.0:
        xs, bs = xs * scale_s, None if bs is None else bs * scale_s
    if scale_t != 1.0:
        xt, bt = xt * scale_t, None if bt is None else bt * scale_t
    temperature = temperature if a.temperature is None else a.temperature
    divergence, beta = a.resolve(beta)
    with _no_autocast(device):
        parts = hidden_loss(
            xs,
            xt,
            ws.weight,
            wt.weight,
            divergence=divergence,
            beta=beta,
            alpha=a.alpha,
            labels=labels.to(device).reshape(-1)[valid],
            temperature=temperature,
            scale_t2=a.scale_t2,
            ce_weight=a.ce_weight,
            reduction="sum",
            bs=bs,
            bt=bt,
            softcap_s=ws.softcap,
            softcap_t=wt.softcap,
            chunk_V=a.chunk_V,
            backend=a.backend,
            return_parts=True,
        )
    n_valid = valid.sum()
    loss = _normalized(parts.loss, n_valid, num_items_in_batch)
    if a.log_entropy:
        entropy = _entropy_sum(xs.detach(), _Head(ws.weight.detach(), bs, ws.softcap), temperature)
    else:
        entropy = torch.zeros((), device=device)
    return loss, entropy, n_valid


def _distillation_trainer_class():
    trl = _trl()

    class NitrobrewDistillationTrainer(trl.DistillationTrainer):
        """``trl.DistillationTrainer`` whose loss is nitrobrew's (see the module docstring).

        Takes DistillationTrainer's arguments and ``nitrobrew`` (a ``NitrobrewLoss``, a dict of
        its fields, or None for TRL's loss computed by nitrobrew)."""

        def __init__(self, *args, nitrobrew: Union[NitrobrewLoss, dict, None] = None, **kwargs):
            self.nitrobrew = _loss_args(nitrobrew)
            super().__init__(*args, **kwargs)

        def _compute_loss(self, unwrapped_student, inputs, num_items_in_batch):
            input_ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
            attention_mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
            loss_mask = inputs["completion_mask"]
            if "tool_mask" in inputs:
                loss_mask = loss_mask * inputs["tool_mask"]
            model_inputs = dict(
                input_ids=input_ids,
                attention_mask=attention_mask,
                logits_to_keep=inputs["completion_ids"].size(1),
                **{k: inputs[k] for k in _MULTIMODAL_KEYS if k in inputs},
            )
            # TRL's own hidden states of the completion positions ([B, C, H]), student and teacher
            hs = self._get_last_hidden_state(unwrapped_student, **model_inputs)
            self.teacher_model.eval()
            unwrapped_teacher = self.accelerator.unwrap_model(self.teacher_model)
            with torch.no_grad():
                ht = self._forward_redirection(
                    self.teacher_model,
                    unwrapped_teacher,
                    self._get_last_hidden_state,
                    unwrapped_teacher,
                    **model_inputs,
                )
            return distillation_loss(
                hs,
                ht,
                lm_head(unwrapped_student),
                lm_head(unwrapped_teacher),
                loss_mask,
                labels=inputs["completion_ids"],
                beta=self.beta,
                temperature=self.temperature,
                options=self.nitrobrew,
                num_items_in_batch=num_items_in_batch,
            )

    return NitrobrewDistillationTrainer


# the multimodal (VLM) fields TRL's generation splits into each micro-batch and its trainer hands on
_MULTIMODAL_KEYS = (
    "pixel_values",
    "image_grid_thw",
    "pixel_attention_mask",
    "spatial_shapes",
    "image_sizes",
    "token_type_ids",
    "mm_token_type_ids",
    "image_position_ids",
)


_BUILDERS = {
    "NitrobrewGKDTrainer": _gkd_trainer_class,
    "NitrobrewDistillationTrainer": _distillation_trainer_class,
}
_BUILT: dict = {}


def __getattr__(name):
    # the subclasses need TRL: built on first use, so that this module imports without it
    if name in _BUILDERS:
        if name not in _BUILT:
            _BUILT[name] = _BUILDERS[name]()
            _BUILT[name].__module__ = __name__
        return _BUILT[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
