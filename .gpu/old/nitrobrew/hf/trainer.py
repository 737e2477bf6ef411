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
import time
import warnings
from dataclasses import dataclass, field
from typing import Optional, Union

import torch
from torch import nn
from transformers import Trainer, TrainerCallback, TrainingArguments

from .. import divergences as dv
from ..core import checks as ck
from .loss import DIVERGENCES, distill_loss
from .model import IGNORE_INDEX, check_head, is_fsdp2, is_wrapped, labels_from_inputs, shift_labels, unwrap
from .onpolicy import assemble, generation_request, on_policy_batch, prompts_of
from .packing import VARLEN_KEYS, document_targets, is_packed
from .schedules import SCHEDULES, scheduled

_PASSES_NUM_ITEMS = "num_items_in_batch" in inspect.signature(Trainer.compute_loss).parameters
# on_policy_batch's sampling settings beyond temperature, top_p and top_k
GENERATION_KWARGS = ("min_p", "repetition_penalty")


@dataclass
class DistillationArguments(TrainingArguments):
    """TrainingArguments plus the distillation objective.

    loss = kd_weight * D(teacher || student) [* T^2 if scale_t2] + ce_weight * CE(labels), summed
    over counted positions and divided by their number in the accumulation window.
    """

    divergence: Optional[str] = field(
        default=None,
        metadata={
            "help": "forward_kl, reverse_kl, jsd, tvd, skew_kl, skew_reverse_kl, or topk (stored dataset); default "
            "forward_kl, or with beta given TRL's rule: jsd(beta), forward_kl at beta 0, reverse_kl at beta 1"
        },
    )
    temperature: Optional[float] = field(
        default=None,
        metadata={
            "help": "logits / T in the divergence (default 1; the loss temperature, not the sampling temperature "
            "of TRL's GKDConfig: that is generation_temperature)"
        },
    )
    scale_t2: bool = field(default=False, metadata={"help": "multiply the divergence by T^2 (Hinton)"})
    kd_weight: float = field(default=1.0, metadata={"help": "weight of the divergence"})
    ce_weight: float = field(default=0.0, metadata={"help": "weight of the hard-label CE (default 0: none)"})
    beta: Optional[float] = field(
        default=None, metadata={"help": dv.PARAMS["beta"].help + "; given without divergence: TRL's rule"}
    )
    alpha: float = field(default=dv.default("alpha"), metadata={"help": dv.PARAMS["alpha"].help})
    vocab_size: Optional[int] = field(
        default=None, metadata={"help": "compare the first N vocab entries (padded heads)"}
    )
    teacher_bf16: bool = field(default=False, metadata={"help": "load / cast the teacher to bfloat16"})
    topk_normalize: str = field(default="full", metadata={"help": "topk: 'full' or 'topk' normalization"})
    topk_tail: Optional[bool] = field(
        default=None,
        metadata={
            "help": "topk: add the tail bucket (default: with topk_normalize='full'); off, the student learns to put "
            "no mass outside the stored ids"
        },
    )
    chunk_v: Optional[int] = field(default=None, metadata={"help": "vocab chunk of the loss (None = auto)"})
    check_heads: bool = field(
        default=True,
        metadata={"help": "on the first batch, verify hidden @ head == model(...).logits for student and teacher"},
    )
    # On-policy / sequence-level distillation (GKD; TRL's names).
    lmbda: float = field(
        default=0.0,
        metadata={
            "help": "probability that a batch is replaced by the student's own "
            "completions of its prompts (0: never, 1: on-policy)"
        },
    )
    seq_kd: bool = field(
        default=False,
        metadata={
            "help": "train on the teacher's completions of the prompts "
            "(sequence-level KD) when the batch is not on-policy"
        },
    )
    max_new_tokens: int = field(default=128, metadata={"help": "tokens generated per prompt"})
    generation_temperature: Optional[float] = field(
        default=None, metadata={"help": "sampling temperature (default 0.9; 0: greedy)"}
    )
    generation_kwargs: Optional[Union[dict, str]] = field(
        default=None,
        metadata={"help": f"more sampling settings for on-policy / seq_kd generation: {', '.join(GENERATION_KWARGS)}"},
    )
    log_completions: bool = field(
        default=False,
        metadata={"help": "at each logging step, append a generated completion to OUTPUT_DIR/completions.jsonl"},
    )
    disable_dropout: bool = field(
        default=True, metadata={"help": "set the student's and teacher's dropout modules to p = 0 (as TRL)"}
    )
    teacher_model_init_kwargs: Optional[Union[dict, str]] = field(
        default=None,
        metadata={"help": "from_pretrained keyword arguments for a teacher given by name (dtype: 'bfloat16', ...)"},
    )
    top_p: float = field(default=1.0, metadata={"help": "nucleus sampling (1: off)"})
    top_k: int = field(default=0, metadata={"help": "top-k sampling (0: off)"})
    generation_backend: str = field(
        default="auto",
        metadata={
            "help": "engine of on-policy / seq_kd generation: auto (static on CUDA, else hf), static (static "
            "KV cache, compiled decode), hf (dynamic cache), or one registered in nitrobrew.hf.generation"
        },
    )
    num_generations: int = field(
        default=1, metadata={"help": "completions per prompt (a micro-batch of b prompts trains on b * this rows)"}
    )
    generation_sleep: bool = field(
        default=False,
        metadata={
            "help": "free the engine's memory (the static engine's KV caches) after each window's generation, "
            "at the cost of allocating it again (and re-recording CUDA graphs) at the next"
        },
    )
    generation_async: bool = field(
        default=False,
        metadata={
            "help": "generate the student's completions of the next windows in a background thread, with a "
            "copy of the student synced after each optimizer step, while this window trains"
        },
    )
    generation_device: Optional[str] = field(
        default=None, metadata={"help": "device of the generating copy (e.g. cuda:1; default: the training device)"}
    )
    max_staleness: int = field(
        default=1,
        metadata={
            "help": "asynchronous generation: optimizer steps the generating weights may lag (0: synchronous); "
            "keep 1 for reverse_kl"
        },
    )
    # Schedules over training (constant, linear or cosine from the value to its *_end).
    temperature_schedule: str = field(default="constant", metadata={"help": "constant, linear or cosine"})
    temperature_end: Optional[float] = field(default=None, metadata={"help": "temperature at the last step"})
    kd_weight_schedule: str = field(default="constant", metadata={"help": "constant, linear or cosine"})
    kd_weight_end: Optional[float] = field(default=None, metadata={"help": "kd_weight at the last step"})
    ce_weight_schedule: str = field(default="constant", metadata={"help": "constant, linear or cosine"})
    ce_weight_end: Optional[float] = field(default=None, metadata={"help": "ce_weight at the last step"})
    # Top-k columns (and any other extra column) must reach compute_loss.
    remove_unused_columns: bool = field(
        default=False, metadata={"help": "drop dataset columns the model's forward does not take"}
    )

    def __post_init__(self):
        super().__post_init__()
        self._resolve_trl_defaults()
        if self.divergence not in DIVERGENCES:
            raise ValueError(f"divergence must be one of {DIVERGENCES}, got {self.divergence!r}")
        ck.check_temperature(self.temperature)
        ck.check_unit_interval("beta", self.beta)
        ck.check_unit_interval("alpha", self.alpha)
        for name in ("kd_weight", "ce_weight"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
        for name in ("temperature", "kd_weight", "ce_weight"):
            kind, end = getattr(self, name + "_schedule"), getattr(self, name + "_end")
            if kind not in SCHEDULES:
                raise ValueError(f"{name}_schedule must be one of {SCHEDULES}, got {kind!r}")
            if kind != "constant" and end is None:
                raise ValueError(f"{name}_schedule={kind!r} needs {name}_end (the value at the last step)")
            if end is not None and not (
                isinstance(end, (int, float)) and math.isfinite(end) and end >= 0 and (name != "temperature" or end > 0)
            ):
                raise ValueError(
                    f"{name}_end must be a finite number {'> 0' if name == 'temperature' else '>= 0'}, got {end!r}"
                )
        if self.kd_weight == 0 and self.ce_weight == 0 and not (self.kd_weight_end or self.ce_weight_end):
            raise ValueError("kd_weight and ce_weight are both 0: nothing to train")
        ck.check_unit_interval("lmbda", self.lmbda)
        if not (isinstance(self.max_new_tokens, int) and self.max_new_tokens > 0):
            raise ValueError(f"max_new_tokens must be a positive int, got {self.max_new_tokens!r}")
        if not (math.isfinite(self.generation_temperature) and self.generation_temperature >= 0):
            raise ValueError(f"generation_temperature must be >= 0, got {self.generation_temperature!r}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not (isinstance(self.top_k, int) and self.top_k >= 0):
            raise ValueError(f"top_k must be an int >= 0, got {self.top_k!r}")
        from .generation import BACKENDS

        if self.generation_backend not in BACKENDS:
            raise ValueError(
                f"generation_backend must be one of {', '.join(BACKENDS)}, got {self.generation_backend!r}"
            )
        if (
            isinstance(self.num_generations, bool)
            or not isinstance(self.num_generations, int)
            or self.num_generations < 1
        ):
            raise ValueError(f"num_generations must be an int >= 1, got {self.num_generations!r}")
        if self.divergence == "topk" and (self.lmbda > 0 or self.seq_kd):
            raise ValueError(
                "divergence='topk' scores the stored dataset's tokens only: on-policy (lmbda > 0) "
                "and seq_kd need a live teacher"
            )
        if self.divergence == "topk" and self.temperature_schedule != "constant":
            raise ValueError(
                "divergence='topk': the store was extracted at one temperature; it cannot follow a temperature schedule"
            )
        if self.vocab_size is not None and not (isinstance(self.vocab_size, int) and self.vocab_size > 0):
            raise ValueError(f"vocab_size must be a positive int or None, got {self.vocab_size!r}")
        if self.topk_normalize not in ("full", "topk"):
            raise ValueError(f"topk_normalize must be 'full' or 'topk', got {self.topk_normalize!r}")
        ck.check_chunk("chunk_v", self.chunk_v)
        if self.topk_tail is None:  # the tail needs the full normalization
            self.topk_tail = self.topk_normalize == "full"
        self.generation_kwargs = _mapping("generation_kwargs", self.generation_kwargs)
        unknown = sorted(set(self.generation_kwargs) - set(GENERATION_KWARGS))
        if unknown:
            raise ValueError(
                f"generation_kwargs: unknown {unknown}; it takes {', '.join(GENERATION_KWARGS)} (temperature, top_p, "
                "top_k and max_new_tokens are keys of their own: generation_temperature, top_p, top_k, max_new_tokens)"
            )
        self.teacher_model_init_kwargs = _mapping("teacher_model_init_kwargs", self.teacher_model_init_kwargs)
        if self.ce_weight > 0 and self.lmbda > 0:
            warnings.warn(
                f"ce_weight={self.ce_weight} with lmbda={self.lmbda}: on on-policy batches the CE term trains the "
                "student on its own samples (labels are its completions), not on the data",
                stacklevel=2,
            )

    def _resolve_trl_defaults(self) -> None:
        """Unset keys take their defaults here, where what was given is still known (TRL's habits)."""
        given = {name: getattr(self, name) is not None for name in ("divergence", "beta", "temperature")}
        if self.beta is not None:
            ck.check_unit_interval("beta", self.beta)
        if self.divergence is None:
            # TRL's GKD rule: beta picks the generalized JSD, whose endpoints are the two KLs.
            beta = self.beta
            self.divergence = "forward_kl" if beta is None or beta == 0 else "reverse_kl" if beta == 1 else "jsd"
        elif given["beta"] and self.divergence in DIVERGENCES and self.divergence != "jsd":
            warnings.warn(
                f"beta={self.beta} is used by divergence='jsd' only; divergence={self.divergence!r} ignores it",
                stacklevel=3,
            )
        self.beta = dv.default("beta") if self.beta is None else self.beta
        self.temperature = 1.0 if self.temperature is None else self.temperature
        if given["temperature"] and self.generation_temperature is None and (self.lmbda > 0 or self.seq_kd):
            warnings.warn(
                f"temperature={self.temperature} is the loss temperature here; generation samples at "
                "generation_temperature (default 0.9), which is what GKDConfig's temperature means: set "
                "generation_temperature to choose it",
                stacklevel=3,
            )
        self.generation_temperature = 0.9 if self.generation_temperature is None else self.generation_temperature


def _mapping(name: str, value) -> dict:
    """A mapping given as a dict or (from the command line) as JSON text."""
    if value is None:
        return {}
    if isinstance(value, str):
        import json

        try:
            value = json.loads(value)
        except ValueError:
            raise ValueError(f"{name} must be a mapping (JSON text on the command line), got {value!r}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{name} must be a mapping, got {value!r}")
    return dict(value)


_DTYPES = {"auto": "auto", "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def model_init_kwargs(kwargs: Optional[dict], name: str = "teacher_model_init_kwargs") -> dict:
    """from_pretrained keyword arguments, with a dtype named by text ('bfloat16') as a torch dtype and
    under the key this transformers version reads (dtype, formerly torch_dtype)."""
    import transformers
    from packaging.version import Version

    kwargs = dict(kwargs or {})
    key = "dtype" if Version(transformers.__version__) >= Version("4.56") else "torch_dtype"
    if "dtype" in kwargs and "torch_dtype" in kwargs:
        raise ValueError(f"{name}: give dtype or torch_dtype, not both")
    dtype = kwargs.pop("dtype", kwargs.pop("torch_dtype", None))
    if isinstance(dtype, str):
        if dtype.removeprefix("torch.") not in _DTYPES:
            raise ValueError(f"{name}: dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
        dtype = _DTYPES[dtype.removeprefix("torch.")]
    if dtype is not None:
        kwargs[key] = dtype
    return kwargs


def disable_dropout(model: nn.Module) -> None:
    """p = 0 in every dropout module (TRL's disable_dropout_in_model)."""
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0


def _load_teacher(teacher: Union[str, nn.Module], bf16: bool, init_kwargs: Optional[dict] = None) -> nn.Module:
    if isinstance(teacher, str):
        from transformers import AutoModelForCausalLM

        kwargs = model_init_kwargs({"dtype": "bfloat16" if bf16 else "auto", **(init_kwargs or {})})
        return AutoModelForCausalLM.from_pretrained(teacher, **kwargs)
    if not isinstance(teacher, nn.Module):
        raise TypeError(f"teacher_model must be a model or a path / hub name, got {type(teacher).__name__}")
    return teacher.to(torch.bfloat16) if bf16 else teacher


def check_sharding(deepspeed_plugin=None, fsdp_plugin=None) -> None:
    """Refuse the setups that partition the LM head into flat shards nitrobrew.hf cannot read."""
    if deepspeed_plugin is not None and getattr(deepspeed_plugin, "zero_stage", 0) == 3:
        raise ValueError(
            "DeepSpeed ZeRO-3 partitions the LM head, which nitrobrew.hf reads directly: use "
            "ZeRO-2 (or 1), or FSDP2 (accelerate's FSDP plugin with fsdp_version 2)"
        )
    if fsdp_plugin is not None and getattr(fsdp_plugin, "fsdp_version", 1) != 2:
        raise ValueError(
            "FSDP (version 1) flattens the LM head into shards nitrobrew.hf cannot read: use "
            "FSDP2 (fsdp_version 2 in the accelerate config / fsdp_config)"
        )


class GenerationProgress:
    """On-policy / seq_kd generation on the training bar (transformers' ProgressCallback), so that a step
    that spends most of its time generating says so: "generating 8 completions (student) ..." while it runs, then the
    tokens generated and tokens/s. Nothing without a bar (disable_tqdm, other processes)."""

    def __init__(self, trainer: Trainer):
        self.bar = None
        for callback in trainer.callback_handler.callbacks:
            if getattr(callback, "training_bar", None) is not None:
                self.bar = callback.training_bar

    def start(self, who: str, rows: int) -> None:
        if self.bar is not None:
            plural = "s" if rows != 1 else ""
            self.bar.set_postfix_str(f"generating {rows} completion{plural} ({who}) ...", refresh=True)

    def end(self, gen) -> None:
        if self.bar is not None:
            tokens = int(gen.n_generated.sum())
            rate = tokens / gen.seconds if gen.seconds > 0 else float("inf")
            self.bar.set_postfix_str(f"generated {tokens} tokens in {gen.seconds:.1f} s, {rate:.0f} tokens/s")


class _SyncRollouts(TrainerCallback):
    """Asynchronous generation: the generating copy takes the student's weights after each optimizer step."""

    def __init__(self, trainer):
        self.trainer = trainer

    def on_step_end(self, args, state, control, **kwargs):
        if self.trainer._rollouts is not None:
            self.trainer._rollouts.sync_weights(self.trainer.model)

    def on_train_end(self, args, state, control, **kwargs):
        if self.trainer._rollouts is not None:
            self.trainer._rollouts.close()
            self.trainer._rollouts = None


class DistillationTrainer(Trainer):
    """Trainer whose loss distills ``teacher_model`` into ``model``.

    Args:
        model: the student (a transformers causal LM, optionally PEFT-wrapped).
        teacher_model: a causal LM with the same tokenizer, or its path / hub name; frozen, put in
            eval mode and moved to the training device. Not needed for ``divergence="topk"``,
            where the dataset is a ``nitrobrew.teacher.data.TopKDataset`` and the collator a
            ``TopKCollator``: batches carry ``topk_ids`` and ``topk_logprobs`` [B, N, K] and
            labels already shifted.
        args: ``DistillationArguments``.
        generate_fn: an external generator for on-policy / seq_kd batches (see
            ``nitrobrew.hf.onpolicy.GenerateFn``); default: ``generate`` of the unwrapped model.
        generator: an engine of ``nitrobrew.hf.generation`` (e.g. ``make_generator("vllm", model)``) for the
            student's completions; it gets the student's weights (``sync_weights``) after optimizer steps. If
            it loses its server, a checkpoint is saved before the error is raised (resume from it).
        Everything else as for ``transformers.Trainer``. Batches need ``input_ids`` and
        optionally ``attention_mask``, ``labels`` (per token, -100 = ignored; default: the
        input ids with -100 at padding), ``position_ids`` and flash-attention varlen kwargs
        (packed batches, ``DataCollatorWithFlattening``), and for on-policy batches ``prompts``
        / ``prompt_attention_mask`` (else labels -100 on each row's prompt).

    Logs ``kd_loss`` and ``ce_loss`` (the two terms, normalized like the loss), the scheduled
    ``temperature`` / ``kd_weight`` / ``ce_weight``, and with generation ``gen_len`` (counted
    tokens per completion), ``gen_tokens`` (counted tokens generated per optimizer step),
    ``gen_seconds`` (generation time per optimizer step), ``gen_decode_ms`` (per decode step),
    ``gen_fraction`` (the share of the steps' wall time spent generating), ``gen_compiles`` (graphs
    the engine compiled) and ``gen_recompiles`` (of those, for shapes it had compiled before: none
    expected).
    """

    def __init__(
        self,
        model=None,
        teacher_model=None,
        args: Optional[DistillationArguments] = None,
        generate_fn=None,
        generator=None,
        **kwargs,
    ):
        if not isinstance(args, DistillationArguments):
            raise TypeError("DistillationTrainer needs args=DistillationArguments(...)")
        # A hidden store (nitrobrew.teacher.hidden_data.HiddenDataset) is the teacher: its rows and its head.
        stored = hasattr(kwargs.get("train_dataset"), "load_head")
        if teacher_model is None and args.divergence != "topk" and not stored:
            raise ValueError(
                f"divergence={args.divergence!r} needs a teacher_model (or a hidden store as train_dataset)"
            )
        if stored and (teacher_model is not None or args.divergence == "topk" or args.lmbda > 0 or args.seq_kd):
            raise ValueError(
                "a hidden store is the teacher: no teacher_model, a hidden-state divergence, and no live generation "
                "(lmbda = 0, seq_kd = False: write rollouts with `nitrobrew rollout` and extract them instead)"
            )
        super().__init__(model=model, args=args, **kwargs)
        # the stored teacher's head, loaded once on the training device
        self.teacher_head = self.train_dataset.load_head(self.args.device) if stored else None
        # the store's vocabulary (padded head rows excluded) is the default vocab_size of its loss
        self._store_vocab = self.train_dataset.vocab_size if stored else None
        self._check_sharding()
        if getattr(self, "is_fsdp_enabled", False):  # a decoder wrapped apart: sharded here, before accelerate
            from .fsdp import shard_for_accelerate

            self.model = self.model_wrapped = shard_for_accelerate(self.accelerator, self.model)
        from ..parallel.watchdog import trainer_callback

        watchdog = trainer_callback()  # a lost rank stops the others (NITROBREW_RANK_TIMEOUT, 0: off)
        if watchdog is not None:
            self.add_callback(watchdog)
        self.teacher = None
        if teacher_model is not None:
            teacher = _load_teacher(teacher_model, args.teacher_bf16, args.teacher_model_init_kwargs)
            teacher.requires_grad_(False)
            teacher.eval()
            # Placed by the user otherwise (a device map, or a teacher sharded with fully_shard).
            if getattr(teacher, "hf_device_map", None) is None and not is_fsdp2(teacher):
                teacher.to(self.args.device)
            self.teacher = teacher
        if args.disable_dropout:
            for who in (self.model, self.teacher):
                if who is not None:
                    disable_dropout(who)
        self._last_generation = None  # for log_completions
        self.generate_fn = generate_fn
        self.generator = generator  # the student's engine, if given (e.g. vLLM), synced per optimizer step
        self._synced_step = 0
        self._generators = {}
        self._window_start = None
        self._rollouts, self._rollouts_epoch, self._ahead = None, None, []
        self.add_callback(_SyncRollouts(self))
        # Older Trainers only pass num_items_in_batch (and skip their 1/GA scaling) for models
        # that "accept loss kwargs"; our compute_loss does.
        self.model_accepts_loss_kwargs = True
        # A top-k dataset (nitrobrew.teacher.data.TopKDataset) records its extraction temperature.
        self._store_temperature = getattr(self.train_dataset, "temperature", None)
        if args.divergence == "topk" and self._store_temperature not in (None, args.temperature):
            raise ValueError(
                f"the top-k store was extracted at temperature {self._store_temperature}, but "
                f"temperature={args.temperature}: extract it again at the distillation temperature"
            )
        if args.divergence == "topk" and not args.topk_tail and args.ce_weight == 0:
            warnings.warn(
                "divergence='topk' with topk_tail=False and ce_weight=0: the student learns to put no "
                "mass outside the stored ids (set topk_tail=True or a CE weight)",
                stacklevel=2,
            )
        self._heads_checked = not args.check_heads
        self._sums, self._schedule = {}, {}
        self._logged_step = 0
        if not _PASSES_NUM_ITEMS:
            warnings.warn(
                "this transformers version does not pass num_items_in_batch to compute_loss: the loss "
                "is a mean per micro-batch (exact under gradient accumulation only with equal token "
                "counts); upgrade transformers",
                stacklevel=2,
            )

    def _check_sharding(self) -> None:
        state = self.accelerator.state
        check_sharding(
            getattr(state, "deepspeed_plugin", None) if getattr(self, "is_deepspeed_enabled", False) else None,
            getattr(state, "fsdp_plugin", None) if getattr(self, "is_fsdp_enabled", False) else None,
        )

    # -- on-policy / sequence-level batches -------------------------------------------------------
    def generator_for(self, who):
        """The engine that completes prompts with ``who`` (the student, or the teacher for seq_kd), made once."""
        key = "student" if who is self.model else "teacher"
        gen = self.generator if key == "student" and self.generator is not None else self._generators.get(key)
        if gen is None:
            from .generation import VLLM_BACKENDS, auto_backend, make_generator

            backend = self.args.generation_backend
            if key == "teacher" and (backend in VLLM_BACKENDS or backend == "auto"):
                backend = auto_backend(who, vllm=False)  # vLLM engines hold the student; the teacher's stay here
            gen = make_generator(backend, who, generate_fn=self.generate_fn)
            self._generators[key] = gen
        if key == "student" and self._synced_step != self.state.global_step:
            gen.sync_weights(self.model)  # the optimizer stepped since the engine last saw the student
            self._synced_step = self.state.global_step
        return gen

    def _who(self, index: int):
        """Which model completes micro-batch ``index``: the student (on-policy), the teacher (seq_kd) or none."""
        a = self.args
        if not (a.seq_kd or a.lmbda > 0):
            return None
        # Drawn from the seed and the micro-batch index: reproducible, and the global RNG is untouched.
        draw = float(torch.rand((), generator=torch.Generator().manual_seed(a.seed * 1_000_003 + index)))
        # On-policy wins over seq_kd (as in TRL, where the student's completions replace the teacher's).
        return self.model if draw < a.lmbda else self.teacher if a.seq_kd else None

    def _window_prompts(self, batches, first: int, who):
        """(micro-batch indices, rows each, prompt ids, prompt mask) of what ``who`` completes in the window
        (each prompt ``num_generations`` times), or None."""
        a = self.args
        picked = [i for i in range(len(batches)) if (w := self._who(first + i)) is not None and w is who]
        if not picked:
            return None
        prompts, masks = [], []
        for i in picked:
            if is_packed(batches[i].get("position_ids")):
                raise ValueError(
                    "on-policy / seq_kd with packed batches: generation needs one prompt per row "
                    "(do not pack, or set lmbda=0 and seq_kd=False)"
                )
            p, m = prompts_of(batches[i])
            prompts.append(p)
            masks.append(torch.ones_like(p) if m is None else m)
        rows = [p.shape[0] * a.num_generations for p in prompts]
        width = max(p.shape[1] for p in prompts)
        ids = torch.cat([nn.functional.pad(p, (0, width - p.shape[1])) for p in prompts])
        mask = torch.cat([nn.functional.pad(m, (0, width - m.shape[1])) for m in masks])
        if a.num_generations > 1:
            ids, mask = ids.repeat_interleave(a.num_generations, 0), mask.repeat_interleave(a.num_generations, 0)
        return picked, rows, ids, mask

    def _sampling(self, seed: int) -> dict:
        a = self.args
        return dict(
            max_new_tokens=a.max_new_tokens,
            temperature=a.generation_temperature,
            top_p=a.top_p,
            top_k=a.top_k,
            seed=seed,
            **a.generation_kwargs,
        )

    def _put_back(self, out, picked, rows, gen) -> None:
        """Split a window's generated batch back into its micro-batches (in ``out``) and log it."""
        self._last_generation = gen
        self._add("gen_rows", torch.tensor(float(gen.n_generated.numel())))
        self._add("gen_tokens", gen.n_generated.float().sum())
        self._add("gen_seconds", torch.tensor(gen.seconds))
        self._add("gen_decode_steps", torch.tensor(float(gen.decode_steps)))
        self._add("gen_compiles", torch.tensor(float(gen.compiles)))
        self._add("gen_recompiles", torch.tensor(float(gen.recompiles)))
        start = 0
        for i, n in zip(picked, rows):
            part = slice(start, start + n)
            start += n
            keep = int(gen.attention_mask[part].sum(1).max())
            out[i] = {
                "input_ids": gen.input_ids[part, :keep],
                "attention_mask": gen.attention_mask[part, :keep],
                "labels": gen.labels[part, :keep],
            }

    def _generate_window(self, batches, first: int, student: bool = True):
        """The window's micro-batches, those drawn for generation replaced by completions of their prompts.

        All the prompts one model completes in the window go to its engine in one call (the hardware wants
        large batches; TRL's ``generation_batch_size``), each ``num_generations`` times, and the completions
        are split back into their micro-batches (a micro-batch of b prompts becomes b * num_generations rows).
        """
        out = list(batches)
        for who in (self.model, self.teacher) if student else (self.teacher,):
            request = self._window_prompts(batches, first, who)
            if request is None:
                continue
            picked, rows, ids, mask = request
            shown = GenerationProgress(self)
            shown.start("student" if who is self.model else "teacher", ids.shape[0])
            gen = on_policy_batch(
                who,
                ids,
                mask,
                generator=self.generator_for(who),
                **self._sampling(self.args.seed * 1_000_003 + first + picked[0]),
            )
            shown.end(gen)
            if self.args.generation_sleep:
                self.generator_for(who).sleep()
            self._put_back(out, picked, rows, gen)
        return out

    # -- asynchronous generation ----------------------------------------------------------------
    def _start_rollouts(self) -> None:
        import copy

        from .generation import make_generator
        from .generation.async_rollouts import AsyncRollouts

        a = self.args
        if a.generation_backend == "vllm" or getattr(self.generator, "name", None) == "vllm":
            raise ValueError(
                "generation_async with generation_backend 'vllm' (in this process) is not supported: use "
                "vllm-server (a server on other GPUs) or generation_async: false"
            )
        if self.generator is not None:  # an engine with weights of its own (a vLLM server): synced per step
            engine = self.generator
        else:
            student = unwrap(self.model)
            device = torch.device(a.generation_device) if a.generation_device else next(student.parameters()).device
            replica = copy.deepcopy(student).to(device).requires_grad_(False)
            # The static engine also runs uncompiled on a CPU; it draws from a generator of its own, so the
            # thread neither reads nor moves the training's RNG.
            auto = a.generation_backend == "auto" and self.generate_fn is None
            engine = make_generator("static" if auto else a.generation_backend, replica, generate_fn=self.generate_fn)
        if not getattr(engine, "seeds_itself", False):
            warnings.warn(
                f"generation_async with the {engine.name!r} engine: its sampling draws from the process's RNG in "
                "a background thread, so runs do not repeat exactly (the static engine's do)",
                stacklevel=2,
            )
        self._rollouts = AsyncRollouts(engine, staleness=a.max_staleness)
        self._rollouts_start = self.state.global_step

    def _async_window(self, epoch_iterator, num_batches, *args, **kwargs):
        """This window's micro-batches (the student's completions from the background thread), after queueing
        the prompts of the next ``max_staleness`` windows."""
        a = self.args
        if self._rollouts is None:
            self._start_rollouts()
        if self._rollouts_epoch is not epoch_iterator:  # a new epoch: nothing read ahead from it yet
            self._rollouts_epoch, self._ahead, self._epoch_done = epoch_iterator, [], False
        while len(self._ahead) <= a.max_staleness and not self._epoch_done:
            batches, _ = super().get_batch_samples(epoch_iterator, num_batches, *args, **kwargs)
            if not batches:
                self._epoch_done = True
                break
            window = self.state.global_step + len(self._ahead)
            first = window * num_batches
            request = self._window_prompts(batches, first, self.model)
            job = None
            if request is not None:
                picked, rows, ids, mask = request
                engine_model = getattr(self._rollouts.engine, "model", None) or self.model
                ids, mask, sampling = generation_request(
                    engine_model, ids, mask, **self._sampling(a.seed * 1_000_003 + first + picked[0])
                )
                job = (picked, rows, ids, mask, sampling.pad_token_id)
                job += (self._rollouts.submit(ids, mask, sampling, window=window - self._rollouts_start),)
            self._ahead.append((batches, first, job))
        if not self._ahead:
            return []
        batches, first, job = self._ahead.pop(0)
        out = self._generate_window(batches, first, student=False)  # seq_kd: the teacher, here and now
        if job is not None:
            picked, rows, ids, mask, pad, j = job
            done = self._rollouts.result(j)
            device = self.args.device
            self._put_back(out, picked, rows, assemble(ids.to(device), mask.to(device), done, pad))
            self._add("gen_lag", torch.tensor(float(self._rollouts.version - done.weight_version)))
            self._add("gen_windows", torch.tensor(1.0))
        return out

    # -- the global token count of each accumulation window ------------------------------------
    def get_batch_samples(self, epoch_iterator, num_batches, *args, **kwargs):
        self._clock()  # the previous window's wall time ends here
        # Generated batches replace their sources before the count: the normalizer stays exact.
        # Which batches are generated, and how: a function of the seed and the micro-batch's index.
        try:
            if self.args.generation_async:
                batch_samples = self._async_window(epoch_iterator, num_batches, *args, **kwargs)
            else:
                batch_samples, _ = super().get_batch_samples(epoch_iterator, num_batches, *args, **kwargs)
                batch_samples = self._generate_window(batch_samples, self.state.global_step * num_batches)
        except (ConnectionError, RuntimeError) as err:
            # A generation server went away (raised here, or by the rollout thread): keep what was trained,
            # resumable, then stop.
            if isinstance(err, ConnectionError) or isinstance(err.__cause__, ConnectionError):
                self._save_checkpoint(self.model, trial=None)
            raise
        count = torch.zeros((), dtype=torch.long, device=self.args.device)
        for batch in batch_samples:
            count += (self._targets(batch) != IGNORE_INDEX).sum().to(count.device)
        if getattr(self.args, "average_tokens_across_devices", False) and self.args.world_size > 1:
            count = self.accelerator.gather(count).sum()
        return batch_samples, count

    def _labels(self, batch):
        # Top-k and hidden-store batches (TopKCollator, HiddenCollator) carry labels already shifted.
        if self.args.divergence == "topk" or "teacher_hidden" in batch:
            return {"targets": batch["labels"]} if batch.get("labels") is not None else {"labels": None}
        return {"labels": batch.get("labels")}

    def _targets(self, batch) -> torch.Tensor:
        """Per-position targets of a batch, as distill_loss counts them."""
        labels, mask = self._labels(batch), batch.get("attention_mask")
        if "targets" in labels:
            target = labels["targets"]
        else:
            given = labels["labels"]
            if given is None:
                given = labels_from_inputs(batch["input_ids"], mask)
            target = shift_labels(given, mask)
        position_ids = batch.get("position_ids")
        return document_targets(target, position_ids)  # broadcast (and checked) there

    def current(self, name: str) -> float:
        """The scheduled value of temperature, kd_weight or ce_weight at this optimizer step."""
        a = self.args
        return scheduled(
            getattr(a, name),
            getattr(a, name + "_end"),
            getattr(a, name + "_schedule"),
            self.state.global_step,
            self.state.max_steps,
        )

    # -- the loss ---------------------------------------------------------------------------------
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None, **kwargs):
        a = self.args
        packing = {k: inputs[k] for k in ("position_ids", *VARLEN_KEYS) if inputs.get(k) is not None}
        if not self._heads_checked:
            self._check_heads(model, inputs, packing)
        temperature, kd_weight, ce_weight = (self.current(n) for n in ("temperature", "kd_weight", "ce_weight"))
        if model.training:
            self._schedule = {"temperature": temperature, "kd_weight": kd_weight, "ce_weight": ce_weight}
        out = distill_loss(
            model,
            self.teacher,
            inputs["input_ids"],
            inputs.get("attention_mask"),
            **self._labels(inputs),
            divergence=a.divergence,
            temperature=temperature,
            scale_t2=a.scale_t2,
            kd_weight=kd_weight,
            ce_weight=ce_weight,
            beta=a.beta,
            alpha=a.alpha,
            vocab_size=a.vocab_size if a.vocab_size is not None else self._store_vocab,
            num_items_in_batch=num_items_in_batch,
            topk_ids=inputs.get("topk_ids"),
            topk_logprobs=inputs.get("topk_logprobs"),
            topk_normalize=a.topk_normalize,
            topk_tail=a.topk_tail,
            teacher_temperature=self._store_temperature,
            chunk_V=a.chunk_v,
            through_forward=is_wrapped(model),
            teacher_hidden=inputs.get("teacher_hidden"),
            teacher_hidden_scale=inputs.get("teacher_hidden_scale"),
            teacher_head=self.teacher_head if "teacher_hidden" in inputs else None,
            **packing,
        )
        loss = out.loss
        if num_items_in_batch is not None and getattr(a, "average_tokens_across_devices", False):
            # The count is global; data-parallel gradients are averaged over processes.
            loss = loss * self.accelerator.num_processes
        # training_step divides an unscaled (per-micro-batch mean) loss by the accumulation steps.
        self.loss_is_scaled_for_ga = num_items_in_batch is not None
        if model.training:
            self._add("kd_loss", out.kd.detach())
            self._add("ce_loss", out.ce.detach())
        if return_outputs:
            return loss, {"kd_loss": out.kd.detach(), "ce_loss": out.ce.detach()}
        return loss

    def _add(self, key, value):
        value = value.detach().float().cpu() if isinstance(value, torch.Tensor) else value
        self._sums[key] = value if key not in self._sums else self._sums[key] + value

    def _check_heads(self, model, inputs, packing) -> None:
        ids, mask = inputs["input_ids"][:1], inputs.get("attention_mask")
        mask = None if mask is None else mask[:1]
        if "position_ids" in packing:
            packing = {"position_ids": packing["position_ids"][:1]}  # the varlen kwargs describe the whole batch
        from .fsdp import head_is_sharded_apart

        for who in (model, self.teacher):
            # A head kept sharded by FSDP2 has no full logits to compare with (and the root's forward
            # must not run before the decoder's): not checked.
            if who is not None and not head_is_sharded_apart(who):
                check_head(unwrap(who), ids, mask, **packing)
        self._heads_checked = True

    _LOGGED = (
        "kd_loss",
        "ce_loss",
        "gen_rows",
        "gen_tokens",
        "gen_seconds",
        "gen_decode_steps",
        "gen_compiles",
        "gen_recompiles",
        "gen_lag",
        "gen_windows",
        "step_seconds",
    )

    def _clock(self) -> None:
        """Add the wall time since the last call to ``step_seconds`` (windows and logs split the time)."""
        now = time.perf_counter()
        if self._window_start is not None:
            self._add("step_seconds", torch.tensor(now - self._window_start))
        self._window_start = now

    def _summed_over_processes(self):
        """The logged sums of every process (training logs are written on every process, together)."""
        vec = torch.stack([torch.as_tensor(self._sums.get(k, 0.0), dtype=torch.float64) for k in self._LOGGED])
        n = self.accelerator.num_processes
        if n > 1:
            vec = self.accelerator.reduce(vec.to(self.args.device), reduction="sum").cpu()
        sums = dict(zip(self._LOGGED, vec.tolist()))
        # With a global token count each process holds its share of the mean (they add up);
        # otherwise each holds a mean of its own, and so does the generation time.
        shares = getattr(self.args, "average_tokens_across_devices", False) and _PASSES_NUM_ITEMS
        for key in ("kd_loss", "ce_loss") if not shares else ():
            sums[key] /= n
        for key in ("gen_seconds", "gen_decode_steps", "step_seconds"):
            sums[key] /= n
        return sums

    def log(self, logs, *args, **kwargs):
        if "loss" in logs:
            steps = max(self.state.global_step - self._logged_step, 1)
            self._clock()
            sums = self._summed_over_processes()
            if "kd_loss" in self._sums or self.accelerator.num_processes > 1:
                logs["kd_loss"] = round(sums["kd_loss"] / steps, 6)
                logs["ce_loss"] = round(sums["ce_loss"] / steps, 6)
            if sums["gen_rows"] > 0:
                logs["gen_len"] = round(sums["gen_tokens"] / sums["gen_rows"], 3)
                logs["gen_tokens"] = round(sums["gen_tokens"] / steps, 1)
                logs["gen_seconds"] = round(sums["gen_seconds"] / steps, 4)
                logs["gen_decode_ms"] = round(1e3 * sums["gen_seconds"] / max(sums["gen_decode_steps"], 1), 3)
                logs["gen_fraction"] = round(min(sums["gen_seconds"] / max(sums["step_seconds"], 1e-9), 1.0), 4)
                logs["gen_compiles"] = int(sums["gen_compiles"])
                logs["gen_recompiles"] = int(sums["gen_recompiles"])
            if sums["gen_windows"] > 0:
                logs["gen_staleness"] = round(sums["gen_lag"] / sums["gen_windows"], 3)
            self._sums = {}
            self._logged_step = self.state.global_step
        if "loss" in logs and self._schedule:  # the values the last optimizer step used
            logs.update({k: round(v, 6) for k, v in self._schedule.items()})
        if "loss" in logs and self.args.log_completions and self._last_generation is not None:
            self._write_completion(self._last_generation)
            self._last_generation = None
        return super().log(logs, *args, **kwargs)

    def _write_completion(self, gen) -> None:
        """The first row of the last generated batch, appended to OUTPUT_DIR/completions.jsonl (main
        process): its prompt and completion, as text where the trainer has a tokenizer."""
        if not self.is_world_process_zero():
            return
        import json
        import os

        ids, counted = gen.input_ids[0], gen.labels[0] != IGNORE_INDEX
        keep = gen.attention_mask[0] != 0
        prompt = ids[keep & ~counted].tolist()
        # labels are shifted by one inside the loss; here they mark the completion's own tokens
        completion = ids[keep & counted].tolist()
        record = {"step": self.state.global_step, "prompt_ids": prompt, "completion_ids": completion}
        tok = getattr(self, "processing_class", None) or getattr(self, "tokenizer", None)
        if tok is not None and hasattr(tok, "decode"):
            record["prompt"] = tok.decode(prompt, skip_special_tokens=True)
            record["completion"] = tok.decode(completion, skip_special_tokens=True)
        os.makedirs(self.args.output_dir, exist_ok=True)
        with open(os.path.join(self.args.output_dir, "completions.jsonl"), "a") as f:
            f.write(json.dumps(record) + "\n")
