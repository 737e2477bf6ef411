"""An Axolotl plugin whose KD loss is nitrobrew's (``pip install 'nitrobrew[axolotl]'``).

In an Axolotl YAML, list it before Axolotl's own KD plugin (the first plugin that names a trainer
wins; Axolotl's supplies the KD arguments, datasets and collators, read as they are)::

    plugins:
      - nitrobrew.integrations.axolotl.NitrobrewKDPlugin
      - axolotl.integrations.kd.KDPlugin
    kd_trainer: true
    kd_alpha: 1.0
    kd_ce_alpha: 0.1
    kd_temperature: 1.0

``NitrobrewKDTrainer`` is Axolotl's ``AxolotlKDTrainer`` with its ``compute_loss`` replaced: the
student runs to its final hidden states (``logits_to_keep=1``, as Axolotl does) and the loss is
``kd_alpha * T^2 * KD + kd_ce_alpha * CE`` summed over the batch and divided by
``num_items_in_batch``, as Axolotl's, with the KD term from ``nitrobrew.topk_kl``: the stored
teacher log-probs at position i against the student's tempered log-probs at position i (no
shift), over the entries ``target_mask`` keeps; the CE on the shifted labels at T = 1, fused into
the same pass over the vocabulary when both terms count the same positions. ``kd_beta`` 0 (the
default) is forward KL as Axolotl's; 1 and values between map to nitrobrew's reverse KL and
jsd(beta), which compare normalized distributions (the top-k renormalized with
``kd_normalize_topk``, else top-k plus one tail bucket); Axolotl's own sums over the unnormalized
support are not divergences, so these differ from Axolotl's values.

With ``nitrobrew_kd_teacher`` (a model directory) the KD term is computed from the teacher's
hidden states instead, over the whole vocabulary (``nitrobrew.hf.distill_loss``; divergence
``nitrobrew_kd_divergence``, default forward KL): no stored top-k is needed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from .. import divergences as dv
from ..hf.loss import distill_loss
from ..hf.model import IGNORE_INDEX, lm_head
from ..hf.wrapping import is_wrapped
from ..topk import topk_kl

try:
    from axolotl.integrations.base import BasePlugin
    from axolotl.integrations.kd.trainer import AxolotlKDTrainer
    from pydantic import BaseModel, field_validator
except ImportError as err:  # pragma: no cover - the module is only imported by Axolotl
    raise ImportError("nitrobrew.integrations.axolotl needs Axolotl: pip install 'nitrobrew[axolotl]'") from err

__all__ = ["NitrobrewKDArgs", "NitrobrewKDTrainingArgsMixin", "NitrobrewKDPlugin", "NitrobrewKDTrainer"]

_BACKENDS = ("auto", "torch", "triton")


class NitrobrewKDArgs(BaseModel):
    """The plugin's keys in an Axolotl YAML (Axolotl's ``kd_*`` keys keep their meaning)."""

    nitrobrew_kd_teacher: Optional[str] = None  # a teacher model directory: the hidden-state loss
    nitrobrew_kd_divergence: Optional[str] = None  # with a teacher: one of nitrobrew's divergences
    nitrobrew_kd_chunk_v: Optional[int] = None
    nitrobrew_kd_backend: str = "auto"

    @field_validator("nitrobrew_kd_divergence")
    @classmethod
    def _divergence(cls, value):
        if value is not None and value not in dv.NAMES:
            raise ValueError(f"nitrobrew_kd_divergence must be one of {dv.NAMES}, got {value!r}")
        return value

    @field_validator("nitrobrew_kd_backend")
    @classmethod
    def _backend(cls, value):
        if value not in _BACKENDS:
            raise ValueError(f"nitrobrew_kd_backend must be one of {_BACKENDS}, got {value!r}")
        return value

    @field_validator("nitrobrew_kd_chunk_v")
    @classmethod
    def _chunk(cls, value):
        if value is not None and value <= 0:
            raise ValueError(f"nitrobrew_kd_chunk_v must be a positive int, got {value!r}")
        return value


@dataclass
class NitrobrewKDTrainingArgsMixin:
    """The plugin's settings as fields of Axolotl's training arguments."""

    nitrobrew_kd_teacher: Optional[str] = field(default=None)
    nitrobrew_kd_divergence: Optional[str] = field(default=None)
    nitrobrew_kd_chunk_v: Optional[int] = field(default=None)
    nitrobrew_kd_backend: str = field(default="auto")


def _topk_divergence(beta: float):
    """Axolotl's kd_beta as one of topk_kl's divergences."""
    if not beta:
        return "forward_kl", 0.5
    if beta == 1.0:
        return "reverse_kl", 0.5
    return "jsd", float(beta)


def kd_loss_sum(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    target_token_ids: torch.Tensor,
    target_logprobs: torch.Tensor,
    target_mask: torch.Tensor,
    *,
    kd_alpha: float,
    kd_ce_alpha: float,
    temperature: float,
    beta: float = 0.0,
    normalize_topk: bool = False,
    bias: Optional[torch.Tensor] = None,
    softcap: Optional[float] = None,
    chunk_V: Optional[int] = None,
    backend: str = "auto",
) -> torch.Tensor:
    """Axolotl's KD loss before its division by num_items_in_batch, computed by ``topk_kl``:
    ``kd_alpha * T^2 * KD + kd_ce_alpha * CE`` summed over the batch.

    hidden [B, N, D] and the targets [B, N, K] line up position by position (row i of the targets
    is the teacher over token i + 1); labels [B, N] are per token (the CE shifts them)."""
    D, K = hidden.shape[-1], target_token_ids.shape[-1]
    x = hidden.reshape(-1, D)
    keep = target_mask.reshape(-1, K).bool()
    ids = torch.where(keep, target_token_ids.reshape(-1, K).long(), 0)
    lp = torch.where(keep, target_logprobs.reshape(-1, K).float(), float("-inf"))
    shifted = torch.nn.functional.pad(labels, (0, 1), value=IGNORE_INDEX)[:, 1:].reshape(-1)
    kd_rows = keep.any(-1)
    ce_rows = shifted != IGNORE_INDEX
    divergence, jsd_beta = _topk_divergence(beta)
    normalize = "topk" if normalize_topk else "full"
    tail = divergence != "forward_kl" and not normalize_topk  # a divergence of distributions needs the tail
    common = dict(temperature=temperature, bs=bias, softcap_s=softcap, chunk_V=chunk_V, backend=backend)
    total = x.new_zeros((), dtype=torch.float32)
    fused = kd_alpha and kd_ce_alpha and normalize == "full" and torch.equal(kd_rows, ce_rows)
    if kd_alpha:
        rows = kd_rows
        total = total + topk_kl(
            x[rows],
            weight,
            ids[rows],
            lp[rows],
            labels=shifted[rows] if fused else None,
            normalize=normalize,
            divergence=divergence,
            beta=jsd_beta,
            tail=tail,
            kd_weight=kd_alpha,
            ce_weight=kd_ce_alpha if fused else 0.0,
            scale_t2=True,  # Axolotl's T^2
            reduction="sum",
            **common,
        )
    if kd_ce_alpha and not fused:  # the CE alone, on its own positions
        rows = ce_rows
        total = total + topk_kl(
            x[rows],
            weight,
            ids[rows],
            lp[rows],
            labels=shifted[rows],
            kd_weight=0.0,
            ce_weight=kd_ce_alpha,
            reduction="sum",
            **common,
        )
    return total


class NitrobrewKDTrainer(AxolotlKDTrainer):
    """Axolotl's KD trainer with nitrobrew's loss (see the module docstring)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.nitrobrew_teacher = None
        path = getattr(self.args, "nitrobrew_kd_teacher", None)
        if path:
            from transformers import AutoModelForCausalLM

            model = self.accelerator.unwrap_model(self.model)
            teacher = AutoModelForCausalLM.from_pretrained(path, dtype=next(model.parameters()).dtype)
            teacher.to(next(model.parameters()).device).eval().requires_grad_(False)
            self.nitrobrew_teacher = teacher

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        a = self.args
        inputs = dict(inputs)
        if self.nitrobrew_teacher is not None:
            return self._teacher_loss(model, inputs, return_outputs, num_items_in_batch)
        missing = [k for k in ("labels", "target_token_ids", "target_logprobs", "target_mask") if k not in inputs]
        if missing:
            raise KeyError(f"KD batch missing required keys: {missing}")
        if num_items_in_batch is None:
            num_items_in_batch = (inputs["labels"] != IGNORE_INDEX).sum().item()
        labels = inputs.pop("labels")
        ids, lp, mask = (inputs.pop(k) for k in ("target_token_ids", "target_logprobs", "target_mask"))
        inputs.pop("num_items_in_batch", None)
        inputs.update(output_hidden_states=True, return_dict=True, logits_to_keep=1)
        outputs = model(**inputs)
        head = lm_head(model)
        hidden = outputs.hidden_states[-1].to(head.weight.dtype)
        if head.scale != 1.0:
            hidden = hidden * head.scale
        bias = None if head.bias is None else head.bias * head.scale
        with torch.autocast(device_type=hidden.device.type, enabled=False):
            loss = kd_loss_sum(
                hidden,
                head.weight,
                labels,
                ids,
                lp,
                target_mask=mask,
                kd_alpha=float(a.kd_alpha or 0.0),
                kd_ce_alpha=float(a.kd_ce_alpha or 0.0),
                temperature=float(a.kd_temperature or 1.0),
                beta=float(a.kd_beta or 0.0),
                normalize_topk=bool(a.kd_normalize_topk),
                bias=bias,
                softcap=head.softcap,
                chunk_V=getattr(a, "nitrobrew_kd_chunk_v", None),
                backend=getattr(a, "nitrobrew_kd_backend", "auto") or "auto",
            )
        if num_items_in_batch is not None and num_items_in_batch > 0:
            loss = loss / num_items_in_batch
        return (loss, outputs) if return_outputs else loss

    def _teacher_loss(self, model, inputs, return_outputs, num_items_in_batch):
        """The hidden-state loss against the configured teacher (no stored top-k)."""
        a = self.args
        for k in ("target_token_ids", "target_logprobs", "target_mask", "num_items_in_batch"):
            inputs.pop(k, None)
        labels = inputs.get("labels")
        mask = inputs.get("attention_mask")
        if num_items_in_batch is None and labels is not None:
            num_items_in_batch = (labels != IGNORE_INDEX).sum().item()
        divergence = getattr(a, "nitrobrew_kd_divergence", None) or _topk_divergence(a.kd_beta or 0.0)[0]
        out = distill_loss(
            model,
            self.nitrobrew_teacher,
            inputs["input_ids"],
            None if mask is None else (mask != 0).long(),
            labels,
            divergence=divergence,
            beta=_topk_divergence(a.kd_beta or 0.0)[1],
            temperature=float(a.kd_temperature or 1.0),
            scale_t2=True,
            kd_weight=float(a.kd_alpha or 0.0),
            ce_weight=float(a.kd_ce_alpha or 0.0),
            num_items_in_batch=num_items_in_batch,
            chunk_V=getattr(a, "nitrobrew_kd_chunk_v", None),
            backend=getattr(a, "nitrobrew_kd_backend", "auto") or "auto",
            through_forward=is_wrapped(model),
            position_ids=inputs.get("position_ids"),
        )
        return (out.loss, {"loss": out.loss}) if return_outputs else out.loss


class NitrobrewKDPlugin(BasePlugin):
    """Axolotl plugin: nitrobrew's loss for Axolotl's KD trainer (list it before ``KDPlugin``)."""

    def get_input_args(self):
        return "nitrobrew.integrations.axolotl.NitrobrewKDArgs"

    def get_training_args_mixin(self):
        return "nitrobrew.integrations.axolotl.NitrobrewKDTrainingArgsMixin"

    def get_training_args(self, cfg):
        return {
            "nitrobrew_kd_teacher": cfg.nitrobrew_kd_teacher,
            "nitrobrew_kd_divergence": cfg.nitrobrew_kd_divergence,
            "nitrobrew_kd_chunk_v": cfg.nitrobrew_kd_chunk_v,
            "nitrobrew_kd_backend": cfg.nitrobrew_kd_backend or "auto",
        }

    def get_trainer_cls(self, cfg):
        return NitrobrewKDTrainer if cfg.kd_trainer else None
