"""``DistillationTrainer``: a transformers.Trainer that distills a teacher into the student.

The student runs to its final hidden states, the frozen teacher too (under no_grad), and the
loss comes from ``nitrobrew.hidden_loss`` (or ``topk_kl`` from a stored top-k dataset) without
[tokens, vocab] logits. The loss is a sum over counted positions divided by the number of
counted positions in the whole gradient-accumulation window (``num_items_in_batch``), so that
accumulated gradients equal those of one large batch.
"""
from __future__ import annotations

import inspect
import math
import warnings
from dataclasses import dataclass, field
from typing import Optional, Union

import torch
from torch import nn
from transformers import Trainer, TrainingArguments

from .. import _checks as ck
from .loss import DIVERGENCES, distill_loss
from .model import IGNORE_INDEX, check_head, count_targets, is_wrapped, labels_from_inputs, unwrap

_PASSES_NUM_ITEMS = "num_items_in_batch" in inspect.signature(Trainer.compute_loss).parameters


@dataclass
class DistillationArguments(TrainingArguments):
    """TrainingArguments plus the distillation objective.

    loss = kd_weight * D(teacher || student) [* T^2 if scale_t2] + ce_weight * CE(labels), summed
    over counted positions and divided by their number in the accumulation window.
    """

    divergence: str = field(default="forward_kl", metadata={"help": "forward_kl, reverse_kl, jsd, tvd, skew_kl, "
                                                                    "skew_reverse_kl, or topk (stored dataset)"})
    temperature: float = field(default=1.0, metadata={"help": "logits / T in the divergence"})
    scale_t2: bool = field(default=False, metadata={"help": "multiply the divergence by T^2 (Hinton)"})
    kd_weight: float = field(default=1.0, metadata={"help": "weight of the divergence"})
    ce_weight: float = field(default=0.0, metadata={"help": "weight of the hard-label CE (default 0: none)"})
    beta: float = field(default=0.5, metadata={"help": "jsd mixture weight (0 = forward_kl, 1 = reverse_kl)"})
    alpha: float = field(default=0.1, metadata={"help": "skew_kl / skew_reverse_kl mixture weight"})
    vocab_size: Optional[int] = field(default=None, metadata={"help": "compare the first N vocab entries "
                                                                      "(padded heads)"})
    teacher_bf16: bool = field(default=False, metadata={"help": "load / cast the teacher to bfloat16"})
    topk_normalize: str = field(default="full", metadata={"help": "topk: 'full' or 'topk' normalization"})
    topk_tail: bool = field(default=False, metadata={"help": "topk: add the tail bucket"})
    chunk_v: Optional[int] = field(default=None, metadata={"help": "vocab chunk of the loss (None = auto)"})
    check_heads: bool = field(default=True, metadata={"help": "on the first batch, verify hidden @ head == "
                                                              "model(...).logits for student and teacher"})
    # Top-k columns (and any other extra column) must reach compute_loss.
    remove_unused_columns: bool = field(default=False, metadata={"help": "drop dataset columns the model's "
                                                                         "forward does not take"})

    def __post_init__(self):
        super().__post_init__()
        if self.divergence not in DIVERGENCES:
            raise ValueError(f"divergence must be one of {DIVERGENCES}, got {self.divergence!r}")
        ck.check_temperature(self.temperature)
        ck.check_unit_interval("beta", self.beta)
        ck.check_unit_interval("alpha", self.alpha)
        for name in ("kd_weight", "ce_weight"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
        if self.kd_weight == 0 and self.ce_weight == 0:
            raise ValueError("kd_weight and ce_weight are both 0: nothing to train")
        if self.vocab_size is not None and not (isinstance(self.vocab_size, int) and self.vocab_size > 0):
            raise ValueError(f"vocab_size must be a positive int or None, got {self.vocab_size!r}")
        if self.topk_normalize not in ("full", "topk"):
            raise ValueError(f"topk_normalize must be 'full' or 'topk', got {self.topk_normalize!r}")
        ck.check_chunk("chunk_v", self.chunk_v)


def _load_teacher(teacher: Union[str, nn.Module], bf16: bool) -> nn.Module:
    if isinstance(teacher, str):
        import transformers
        from packaging.version import Version
        from transformers import AutoModelForCausalLM

        key = "dtype" if Version(transformers.__version__) >= Version("4.56") else "torch_dtype"
        return AutoModelForCausalLM.from_pretrained(teacher, **{key: torch.bfloat16 if bf16 else "auto"})
    if not isinstance(teacher, nn.Module):
        raise TypeError(f"teacher_model must be a model or a path / hub name, got {type(teacher).__name__}")
    return teacher.to(torch.bfloat16) if bf16 else teacher


class DistillationTrainer(Trainer):
    """Trainer whose loss distills ``teacher_model`` into ``model``.

    Args:
        model: the student (a transformers causal LM, optionally PEFT-wrapped).
        teacher_model: a causal LM with the same tokenizer, or its path / hub name; frozen, put in
            eval mode and moved to the training device. Not needed for ``divergence="topk"``,
            where the dataset is a ``nitrobrew.topk.data.TopKDataset`` and the collator a
            ``TopKCollator``: batches carry ``topk_ids`` and ``topk_logprobs`` [B, N, K] and
            labels already shifted.
        args: ``DistillationArguments``.
        Everything else as for ``transformers.Trainer``. Batches need ``input_ids`` and
        optionally ``attention_mask`` and ``labels`` (per token, -100 = ignored; default: the
        input ids with -100 at padding).

    Logs ``kd_loss`` and ``ce_loss`` (the two terms, normalized like the loss) next to ``loss``.
    """

    def __init__(self, model=None, teacher_model=None, args: Optional[DistillationArguments] = None, **kwargs):
        if not isinstance(args, DistillationArguments):
            raise TypeError("DistillationTrainer needs args=DistillationArguments(...)")
        if teacher_model is None and args.divergence != "topk":
            raise ValueError(f"divergence={args.divergence!r} needs a teacher_model")
        super().__init__(model=model, args=args, **kwargs)
        self.teacher = None
        if teacher_model is not None:
            teacher = _load_teacher(teacher_model, args.teacher_bf16)
            teacher.requires_grad_(False)
            teacher.eval()
            if getattr(teacher, "hf_device_map", None) is None:  # placed by the user otherwise
                teacher.to(self.args.device)
            self.teacher = teacher
        # Older Trainers only pass num_items_in_batch (and skip their 1/GA scaling) for models
        # that "accept loss kwargs"; our compute_loss does.
        self.model_accepts_loss_kwargs = True
        # A top-k dataset (nitrobrew.topk.data.TopKDataset) records its extraction temperature.
        self._store_temperature = getattr(self.train_dataset, "temperature", None)
        if args.divergence == "topk" and self._store_temperature not in (None, args.temperature):
            raise ValueError(f"the top-k store was extracted at temperature {self._store_temperature}, but "
                             f"temperature={args.temperature}: extract it again at the distillation temperature")
        self._heads_checked = not args.check_heads
        self._kd_sum = self._ce_sum = None
        self._logged_step = 0
        if not _PASSES_NUM_ITEMS:
            warnings.warn("this transformers version does not pass num_items_in_batch to compute_loss: the loss "
                          "is a mean per micro-batch (exact under gradient accumulation only with equal token "
                          "counts); upgrade transformers", stacklevel=2)

    # -- the global token count of each accumulation window ------------------------------------
    def get_batch_samples(self, epoch_iterator, num_batches, *args, **kwargs):
        batch_samples, _ = super().get_batch_samples(epoch_iterator, num_batches, *args, **kwargs)
        count = torch.zeros((), dtype=torch.long, device=self.args.device)
        for batch in batch_samples:
            labels = self._labels(batch)
            if "targets" in labels:
                count += (labels["targets"] != IGNORE_INDEX).sum().to(count.device)
            else:
                given = labels["labels"]
                if given is None:
                    given = labels_from_inputs(batch["input_ids"], batch.get("attention_mask"))
                count += count_targets(given, batch.get("attention_mask")).to(count.device)
        if getattr(self.args, "average_tokens_across_devices", False) and self.args.world_size > 1:
            count = self.accelerator.gather(count).sum()
        return batch_samples, count

    def _labels(self, batch):
        # Top-k batches (nitrobrew.topk.data.TopKCollator) carry labels already shifted.
        if self.args.divergence == "topk":
            return {"targets": batch["labels"]} if batch.get("labels") is not None else {"labels": None}
        return {"labels": batch.get("labels")}

    # -- the loss ---------------------------------------------------------------------------------
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None, **kwargs):
        a = self.args
        if not self._heads_checked:
            self._check_heads(model, inputs)
        out = distill_loss(
            model, self.teacher, inputs["input_ids"], inputs.get("attention_mask"), **self._labels(inputs),
            divergence=a.divergence, temperature=a.temperature, scale_t2=a.scale_t2, kd_weight=a.kd_weight,
            ce_weight=a.ce_weight, beta=a.beta, alpha=a.alpha, vocab_size=a.vocab_size,
            num_items_in_batch=num_items_in_batch, topk_ids=inputs.get("topk_ids"),
            topk_logprobs=inputs.get("topk_logprobs"), topk_normalize=a.topk_normalize, topk_tail=a.topk_tail,
            teacher_temperature=self._store_temperature,
            chunk_V=a.chunk_v, through_forward=is_wrapped(model),
        )
        loss = out.loss
        if num_items_in_batch is not None and getattr(a, "average_tokens_across_devices", False):
            # The count is global; data-parallel gradients are averaged over processes.
            loss = loss * self.accelerator.num_processes
        # training_step divides an unscaled (per-micro-batch mean) loss by the accumulation steps.
        self.loss_is_scaled_for_ga = num_items_in_batch is not None
        if model.training:
            kd, ce = out.kd.detach(), out.ce.detach()
            self._kd_sum = kd if self._kd_sum is None else self._kd_sum + kd
            self._ce_sum = ce if self._ce_sum is None else self._ce_sum + ce
        if return_outputs:
            return loss, {"kd_loss": out.kd.detach(), "ce_loss": out.ce.detach()}
        return loss

    def _check_heads(self, model, inputs) -> None:
        ids, mask = inputs["input_ids"][:1], inputs.get("attention_mask")
        mask = None if mask is None else mask[:1]
        for who in (model, self.teacher):
            if who is not None:
                check_head(unwrap(who), ids, mask)
        self._heads_checked = True

    def log(self, logs, *args, **kwargs):
        if "loss" in logs and self._kd_sum is not None:
            steps = max(self.state.global_step - self._logged_step, 1)
            logs["kd_loss"] = round(float(self._kd_sum) / steps, 6)
            logs["ce_loss"] = round(float(self._ce_sum) / steps, 6)
            self._kd_sum = self._ce_sum = None
            self._logged_step = self.state.global_step
        return super().log(logs, *args, **kwargs)
