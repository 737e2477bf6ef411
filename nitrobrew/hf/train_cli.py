"""`nitrobrew train config.yaml [--key value ...]`: DistillationTrainer from a config file.

    nitrobrew train distill.yaml
    nitrobrew train distill.yaml --max_steps 100 --divergence reverse_kl --lmbda 0.5
    torchrun --nproc_per_node 8 -m nitrobrew.cli train distill.yaml
    accelerate launch --config_file fsdp2.yaml -m nitrobrew.cli train distill.yaml
    nitrobrew train distill.yaml --help      # every key

The YAML holds ``ModelArguments``, ``DataArguments`` and every field of ``DistillationArguments``
(itself every field of ``transformers.TrainingArguments``), each under its own name; ``--key
value`` after the file overrides it. Parsing is ``transformers.HfArgumentParser``'s.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from dataclasses import dataclass, field, fields
from typing import Dict, List, Optional, Union

import torch

from .model import IGNORE_INDEX


@dataclass
class ModelArguments:
    student: str = field(metadata={"help": "the student: a path or hub name (AutoModelForCausalLM)"})
    teacher: Optional[str] = field(
        default=None, metadata={"help": "the teacher: a path or hub name (not needed for divergence: topk)"}
    )
    tokenizer: Optional[str] = field(
        default=None, metadata={"help": "tokenizer for text data (default: the student's)"}
    )
    attn_implementation: Optional[str] = field(
        default=None, metadata={"help": "sdpa, eager, flash_attention_2 (both models; default: theirs)"}
    )
    student_dtype: str = field(default="auto", metadata={"help": "auto, float32 or bfloat16"})
    teacher_dtype: str = field(
        default="auto", metadata={"help": "auto, float32 or bfloat16 (teacher_model_init_kwargs may say more)"}
    )
    peft: Optional[Union[dict, str]] = field(
        default=None,
        metadata={
            "help": "train LoRA adapters on the student: {r, alpha, dropout, target_modules, ...} (peft's LoraConfig; "
            "alpha and dropout are lora_alpha and lora_dropout)"
        },
    )
    # vLLM engines of the student's completions (generation_backend: vllm / vllm-server; docs/hf.md).
    vllm_server_url: Optional[str] = field(default=None, metadata={"help": "vllm-server: the server's URL"})
    vllm_gpu_memory_utilization: float = field(default=0.3, metadata={"help": "vllm: its share of GPU memory"})
    vllm_kv_cache_memory_bytes: Optional[int] = field(
        default=None, metadata={"help": "vllm: KV cache bytes (overrides the share; CPU default 256 MiB)"}
    )
    vllm_max_model_len: Optional[int] = field(default=None, metadata={"help": "vllm: longest prompt + completion"})
    vllm_sync_every: int = field(default=1, metadata={"help": "vllm backends: load the weights every N steps"})


@dataclass
class DataArguments:
    data: str = field(
        metadata={
            "help": "a local .jsonl / .json / .parquet file, a datasets name or path, or (for "
            "divergence: topk) a nitrobrew top-k store directory"
        }
    )
    data_config: Optional[str] = field(default=None, metadata={"help": "datasets configuration name"})
    data_split: str = field(default="train", metadata={"help": "datasets split"})
    text_field: Optional[str] = field(
        default=None, metadata={"help": "tokenize this text column (default: the data has input_ids, and maybe labels)"}
    )
    prompt_field: Optional[str] = field(
        default=None,
        metadata={
            "help": "a prompt text column put before text_field (which then holds the completion only); its "
            "tokens do not count"
        },
    )
    chat_template: bool = field(
        default=False,
        metadata={
            "help": "text_field (default 'messages') holds chats, rendered with the tokenizer's chat template; "
            "only the assistant turns count"
        },
    )
    max_length: Optional[int] = field(default=None, metadata={"help": "truncate sequences to this many tokens"})
    packing: bool = field(
        default=False,
        metadata={"help": "pack sequences into rows without padding (DataCollatorWithFlattening; position_ids)"},
    )

    def __post_init__(self):
        if self.max_length is not None and not (
            isinstance(self.max_length, int) and not isinstance(self.max_length, bool) and self.max_length > 0
        ):
            raise ValueError(f"max_length must be a positive int (or unset: no truncation), got {self.max_length!r}")


def yaml_argv(config: Dict) -> List[str]:
    """A config mapping as ``--key value`` arguments (lists as several values, mappings as JSON)."""
    argv = []
    for key, value in config.items():
        if value is None:
            continue
        if isinstance(value, bool):
            argv += [f"--{key}", str(value).lower()]
        elif isinstance(value, (list, tuple)):
            if value:  # an empty list: the field's default (write report_to: none, not [])
                argv += [f"--{key}", *map(str, value)]
        elif isinstance(value, dict):
            argv += [f"--{key}", json.dumps(value)]
        else:
            argv += [f"--{key}", str(value)]
    return argv


def load_yaml(path: str) -> Dict:
    """The top-level mapping of a YAML file; a key given twice is an error (YAML would keep the last)."""
    import yaml

    class UniqueKeyLoader(yaml.SafeLoader):
        def construct_mapping(self, node, deep=False):
            seen = set()
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=deep)
                if key in seen:
                    raise ValueError(f"{path}: key {key!r} is given twice (line {key_node.start_mark.line + 1})")
                seen.add(key)
            return super().construct_mapping(node, deep=deep)

    if not os.path.isfile(path):
        raise FileNotFoundError(f"no config file {path!r}")
    with open(path) as f:
        try:
            config = yaml.load(f, Loader=UniqueKeyLoader) or {}
        except yaml.YAMLError as err:
            raise ValueError(f"{path}: not valid YAML ({' '.join(str(err).split())})") from None
    if not isinstance(config, dict):
        raise ValueError(f"{path}: expected a mapping of keys to values at the top level")
    return config


def _field_kinds(dataclass_types) -> Dict[str, str]:
    """key -> 'list', 'dict' or 'scalar': what a YAML value of that key may be."""
    import typing

    kinds = {}
    for cls in dataclass_types:
        hints = typing.get_type_hints(cls)
        for f in fields(cls):
            hint = hints.get(f.name, f.type)
            args = [a for a in typing.get_args(hint) if a is not type(None)] or [hint]
            origins = {typing.get_origin(a) or a for a in args}
            if origins & {list, tuple, List}:
                kinds[f.name] = "list"
            elif origins & {dict, Dict}:
                kinds[f.name] = "dict"
            elif str in origins and len(origins) > 1:  # Union[str, dict, ...] (fsdp_config, report_to)
                kinds[f.name] = "any"
            else:
                kinds[f.name] = "scalar"
    return kinds


def check_value_shapes(config: Dict, dataclass_types, where: str) -> None:
    """A list or mapping given for a key that takes one value, named (argparse would report it as
    unused arguments, far from the key)."""
    kinds = _field_kinds(dataclass_types)
    for key, value in config.items():
        kind = kinds.get(key)
        if kind is None or kind == "any" or value is None:
            continue  # unknown keys are reported by the parser
        if isinstance(value, (list, tuple)) and kind != "list":
            raise TypeError(f"{where}: {key} takes one value, got a list {value!r}")
        if isinstance(value, dict) and kind not in ("dict", "list"):
            raise TypeError(f"{where}: {key} takes one value, got a mapping {value!r}")


def _parser(dataclass_types):
    from transformers import HfArgumentParser

    class Parser(HfArgumentParser):
        def error(self, message):  # one line from run(), not argparse's usage block and exit
            message = " ".join(str(message).split())
            required = "the following arguments are required: "
            if message.startswith(required):
                keys = [k.lstrip("-") for k in message[len(required) :].split(", ")]
                message = f"missing {', '.join(keys)}: set {' and '.join(k + ':' for k in keys)} in the config"
            raise ValueError(message)

    parser = Parser(dataclass_types, prog="nitrobrew train CONFIG")
    parser.exit_on_error = False
    return parser


def parse(config_path: Optional[str], overrides: List[str]):
    """(ModelArguments, DataArguments, DistillationArguments) from the YAML file and the overrides."""
    try:
        import transformers  # noqa: F401
    except ImportError as err:
        raise ImportError("needs transformers: pip install 'nitrobrew[hf]'") from err

    from .trainer import DistillationArguments

    types = (ModelArguments, DataArguments, DistillationArguments)
    parser = _parser(types)
    if any(a in ("-h", "--help") for a in overrides):
        parser.print_help()
        raise SystemExit(0)
    argv, config = [], {}
    if config_path:
        config = load_yaml(config_path)
        check_value_shapes(config, types, config_path)
        argv = yaml_argv(config)
    argv += list(overrides)
    if launched_processes() > 1 and not torch.cuda.is_available() and "use_cpu" not in config:
        if "--use_cpu" not in overrides:
            # Several processes and no GPU: data parallel over gloo, as transformers does with use_cpu
            # (without it each process would train alone and all would write one output_dir).
            argv += ["--use_cpu", "true"]
    model_args, data_args, train_args = parser.parse_args_into_dataclasses(args=argv)
    check_launch(train_args, data_args)
    return model_args, data_args, train_args


def launched_processes() -> int:
    """How many processes the launcher (torchrun, accelerate launch) started: WORLD_SIZE."""
    try:
        return int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        return 1


def check_launch(train_args, data_args) -> None:
    """Settings refused before anything loads: several launched processes that would not train
    together; on-policy generation with packed rows."""
    world = launched_processes()
    fsdp_plugin = os.environ.get("ACCELERATE_USE_FSDP", "false").lower() in ("1", "true")
    if fsdp_plugin and not torch.cuda.is_available():
        raise ValueError(
            "accelerate's FSDP plugin needs GPUs, and this machine has none (accelerate would train plain data "
            "parallel instead): launch with torchrun --nproc_per_node N -m nitrobrew.cli train CONFIG, data "
            "parallel over gloo, or run the FSDP2 config on GPUs"
        )
    if world > 1 and train_args.world_size != world:
        raise ValueError(
            f"launched as {world} processes, but they would train apart (each alone, writing one output_dir): "
            f"transformers sees a world of {train_args.world_size}"
            + (
                " (use_cpu: false on a machine without a GPU: set use_cpu: true)"
                if not torch.cuda.is_available()
                else ""
            )
        )
    if data_args.packing and (train_args.lmbda > 0 or train_args.seq_kd):
        raise ValueError(
            "packing: true with lmbda > 0 or seq_kd: generation needs one prompt per row (do not pack, or set "
            "lmbda: 0 and seq_kd: false)"
        )


_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[\w.-]+)?")


def looks_local(path: str) -> bool:
    """Whether a model / data name can only be a local path (not a hub repo id)."""
    return (
        os.path.isabs(path)
        or path.startswith((".", "~"))
        or (os.sep != "/" and os.sep in path)
        or not _REPO_ID.fullmatch(path)
    )


def check_paths(model_args: "ModelArguments", data_args: "DataArguments") -> None:
    """Local paths that do not exist, named by their key (before anything loads or is written)."""
    for key, path in (
        ("student", model_args.student),
        ("teacher", model_args.teacher),
        ("tokenizer", model_args.tokenizer),
    ):
        if path is not None and looks_local(path) and not os.path.isdir(os.path.expanduser(path)):
            what = "is a file, not a model directory" if os.path.isfile(path) else "no such model directory"
            raise FileNotFoundError(f"{key}: {what}: {path}")
    if looks_local(data_args.data) and not os.path.exists(os.path.expanduser(data_args.data)):
        raise FileNotFoundError(f"data: no such file or directory: {data_args.data}")


def _load_model(path: str, attn: Optional[str], dtype: str, init_kwargs: Optional[dict] = None, who="student"):
    from transformers import AutoModelForCausalLM

    from .trainer import model_init_kwargs

    if dtype not in ("auto", "float32", "bfloat16"):
        raise ValueError(f"{who}_dtype must be one of auto, float32, bfloat16, got {dtype!r}")
    kw = model_init_kwargs({"dtype": dtype, **(init_kwargs or {})})
    if attn:
        kw.setdefault("attn_implementation", attn)
    return AutoModelForCausalLM.from_pretrained(path, **kw)


# the short names of the peft mapping -> LoraConfig's
_LORA_NAMES = {"alpha": "lora_alpha", "dropout": "lora_dropout"}


def lora_config(config):
    """peft's LoraConfig from the ``peft`` mapping (checked before any model loads)."""
    from .trainer import _mapping

    config = _mapping("peft", config)
    try:
        from peft import LoraConfig
    except ImportError as err:
        raise ImportError("peft: needs the peft package: pip install peft") from err
    kwargs = {_LORA_NAMES.get(k, k): v for k, v in config.items()}
    kwargs.setdefault("task_type", "CAUSAL_LM")
    try:
        return LoraConfig(**kwargs)
    except TypeError as err:
        raise ValueError(f"peft: {' '.join(str(err).split())} (keys are LoraConfig's: r, alpha, ...)") from None


def with_lora(student, config):
    """The student with LoRA adapters (peft) as the ``peft`` mapping (or a LoraConfig) describes."""
    from peft import get_peft_model

    lora = config if type(config).__name__ == "LoraConfig" else lora_config(config)
    return get_peft_model(student, lora)


def _is_blank(path: str) -> bool:
    with open(path, "rb") as f:
        return all(not chunk.strip() for chunk in iter(lambda: f.read(1 << 20), b""))


def load_data(data: DataArguments, tokenizer_path: str):
    """A datasets.Dataset with input_ids (and labels where a prompt does not count)."""
    try:
        import datasets
    except ImportError as err:
        raise ImportError("nitrobrew train reads data with `datasets`: pip install 'nitrobrew[hf]'") from err
    path = data.data
    ext = os.path.splitext(path)[1].lower()
    if os.path.isfile(path):
        kinds = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}
        if ext not in kinds:
            raise ValueError(f"data {path!r}: expected a .jsonl, .json or .parquet file")
        if kinds[ext] == "json" and _is_blank(path):
            raise ValueError(f"data {path!r} is empty (no rows)")
        try:
            ds = datasets.load_dataset(kinds[ext], data_files=path, split="train")
        except StopIteration:  # datasets' reading of an empty file
            raise ValueError(f"data {path!r} is empty (no rows)") from None
        except ValueError as err:
            if "corresponds to no data" in str(err):  # a file of blank lines
                raise ValueError(f"data {path!r} is empty (no rows)") from None
            raise
    elif os.path.isdir(path) and os.path.exists(os.path.join(path, "dataset_info.json")):
        ds = datasets.load_from_disk(path)
    else:
        ds = datasets.load_dataset(path, data.data_config, split=data.data_split)
    if len(ds) == 0:
        raise ValueError(f"data {path!r} is empty (no rows)")
    text_field = data.text_field or ("messages" if data.chat_template else None)
    if text_field is None:
        if "input_ids" not in ds.column_names:
            raise ValueError(
                f"data {path!r} has no input_ids column (columns: {ds.column_names}): set text_field "
                "to tokenize a text column"
            )
        keep = [c for c in ("input_ids", "labels") if c in ds.column_names]
    else:
        from transformers import AutoTokenizer

        for name in (text_field, data.prompt_field):
            if name is not None and name not in ds.column_names:
                raise ValueError(f"data {path!r} has no column {name!r} (columns: {ds.column_names})")
        try:
            tok = AutoTokenizer.from_pretrained(tokenizer_path)
        except (OSError, ValueError) as err:  # transformers' message spans lines and names no key
            raise ValueError(
                f"text_field needs a tokenizer: none loads from {tokenizer_path!r} (set tokenizer: "
                f"PATH): {' '.join(str(err).split())}"
            ) from None

        if data.chat_template:
            if getattr(tok, "chat_template", None) is None:
                raise ValueError(
                    f"chat_template: true, but the tokenizer of {tokenizer_path!r} has no chat template (set "
                    "tokenizer: to one that has)"
                )
            ds = ds.map(
                lambda row, i: chat_example(tok, _chat_of(row, text_field, data.prompt_field), f"{path} row {i}"),
                with_indices=True,
                remove_columns=ds.column_names,
            )
            return _truncated(ds.select_columns(["input_ids", "labels"]), data.max_length)
        if data.prompt_field is not None:
            check_prompts_apart(ds[data.prompt_field], ds[text_field], data.prompt_field, text_field, path)

        def encode(row):
            ids = tok(row[text_field], add_special_tokens=data.prompt_field is None)["input_ids"]
            n_prompt = 0
            if data.prompt_field is not None:
                prompt = tok(row[data.prompt_field])["input_ids"]
                ids, n_prompt = prompt + ids, len(prompt)
            if tok.eos_token_id is not None:
                ids = ids + [tok.eos_token_id]
            return {"input_ids": ids, "labels": [IGNORE_INDEX] * n_prompt + ids[n_prompt:]}

        ds = ds.map(encode, remove_columns=ds.column_names)
        keep = ["input_ids", "labels"]
    return _truncated(ds.select_columns(keep), data.max_length)


def _truncated(ds, max_length: Optional[int]):
    if not max_length:
        return ds
    return ds.map(lambda row: {k: row[k][:max_length] for k in ds.column_names})


def check_prompts_apart(prompts, texts, prompt_field: str, text_field: str, where: str) -> None:
    """prompt_field is put before text_field: a text that already starts with its prompt would hold
    it twice. The prompt must end at a word boundary of the text: "and ..." does not repeat the prompt "a"."""
    for i, (prompt, text) in enumerate(zip(prompts, texts)):
        if not (isinstance(prompt, str) and isinstance(text, str) and prompt.strip() and text.startswith(prompt)):
            continue
        splits_a_word = len(text) > len(prompt) and prompt[-1].isalnum() and text[len(prompt)].isalnum()
        if not splits_a_word:
            raise ValueError(
                f"data {where!r} row {i}: {text_field!r} already starts with its {prompt_field!r} ({prompt[:40]!r}), "
                f"which prompt_field puts before it: the prompt would appear twice. {text_field!r} should hold the "
                "completion only (or drop prompt_field)"
            )


def _chat_of(row, text_field: str, prompt_field: Optional[str]):
    """A chat: the messages column, or (prompt / completion layout) the prompt's messages then the
    completion's."""
    messages = row[text_field]
    if prompt_field is not None:
        messages = list(row[prompt_field]) + list(messages)
    return messages


def _template_ids(tok, messages, **kw) -> List[int]:
    out = tok.apply_chat_template(messages, tokenize=True, **kw)
    if isinstance(out, dict) or hasattr(out, "keys"):  # recent transformers return a BatchEncoding
        out = out["input_ids"]
    return list(out)


def chat_example(tok, messages, where: str) -> Dict[str, List[int]]:
    """A chat through the tokenizer's template: input_ids, and labels that count the assistant turns
    alone (each turn's tokens after its header, up to and with its end-of-turn; everything else -100),
    as TRL's chat collators mask."""
    if not (isinstance(messages, list) and messages and all(isinstance(m, dict) for m in messages)):
        raise ValueError(f"{where}: expected a list of messages ({{role, content}} mappings), got {messages!r:.80}")
    if any("role" not in m or "content" not in m for m in messages):
        raise ValueError(f"{where}: every message needs a role and a content")
    ids = _template_ids(tok, messages)
    labels = [IGNORE_INDEX] * len(ids)
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        header = _template_ids(tok, messages[:i], add_generation_prompt=True) if i else []
        upto = _template_ids(tok, messages[: i + 1])
        if upto[: len(header)] != header or ids[: len(upto)] != upto:
            raise ValueError(
                f"{where}: the chat template does not render a conversation's first turns as a prefix of the "
                "whole, so assistant turns cannot be told apart: tokenize the data yourself (input_ids, labels)"
            )
        labels[len(header) : len(upto)] = ids[len(header) : len(upto)]
    if all(label == IGNORE_INDEX for label in labels):
        raise ValueError(f"{where}: no assistant message, nothing to learn from")
    return {"input_ids": ids, "labels": labels}


class PadCollator:
    """Right padding: input_ids (pad id), attention_mask, labels (given, or the ids; -100 at padding)."""

    def __init__(self, pad_token_id: int = 0):
        self.pad_token_id = pad_token_id

    def __call__(self, items):
        N = max(len(it["input_ids"]) for it in items)
        ids = torch.full((len(items), N), self.pad_token_id, dtype=torch.long)
        labels = torch.full_like(ids, IGNORE_INDEX)
        mask = torch.zeros_like(ids)
        for b, it in enumerate(items):
            n = len(it["input_ids"])
            ids[b, :n] = torch.as_tensor(it["input_ids"])
            given = it.get("labels")
            labels[b, :n] = torch.as_tensor(it["input_ids"] if given is None else given)
            mask[b, :n] = 1
        return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def is_hidden_store(path: str) -> bool:
    """Whether `path` is a hidden-state store: the teacher itself (its rows and head), no teacher key."""
    from ..teacher import hidden_store as hs

    return os.path.isdir(path) and hs.store_format(path) == hs.FORMAT


def build_dataset(model_args: ModelArguments, data_args: DataArguments, args):
    """The training dataset: a hidden store, a top-k store (divergence: topk) or rows of input_ids / labels."""
    if is_hidden_store(data_args.data):
        from ..teacher.hidden_data import HiddenDataset

        if data_args.packing:
            raise ValueError("packing: true is not available for a hidden store (its collator pads)")
        return HiddenDataset(data_args.data)
    if args.divergence == "topk":
        from ..teacher.data import TopKDataset

        if data_args.packing:
            raise ValueError("packing: true is not available for a top-k store (its collator pads)")
        return TopKDataset(data_args.data)
    return load_data(data_args, model_args.tokenizer or model_args.student)


def build_collator(data_args: DataArguments, args, student):
    if is_hidden_store(data_args.data):
        from ..teacher.hidden_data import HiddenCollator

        return HiddenCollator()
    if args.divergence == "topk":
        from ..teacher.data import TopKCollator

        return TopKCollator()
    if data_args.packing:
        from transformers import DataCollatorWithFlattening

        return DataCollatorWithFlattening()
    pad = getattr(student.config, "pad_token_id", None)
    return PadCollator(0 if pad is None else int(pad))


def build(model_args: ModelArguments, data_args: DataArguments, args):
    """The DistillationTrainer the three argument groups describe. What can be checked without the
    models is checked first (paths, the teacher key, the data), so that a bad config fails in
    seconds and writes nothing."""
    from .trainer import DistillationTrainer

    check_paths(model_args, data_args)
    if model_args.teacher is None and args.divergence != "topk" and not is_hidden_store(data_args.data):
        raise ValueError(f"divergence {args.divergence!r} needs a teacher (the teacher key, or data: a hidden store)")
    lora = None if model_args.peft is None else lora_config(model_args.peft)
    dataset = build_dataset(model_args, data_args, args)
    student = _load_model(model_args.student, model_args.attn_implementation, model_args.student_dtype)
    if lora is not None:
        student = with_lora(student, lora)
    teacher = None
    if model_args.teacher is not None:
        teacher = _load_model(
            model_args.teacher,
            model_args.attn_implementation,
            model_args.teacher_dtype,
            init_kwargs=args.teacher_model_init_kwargs,
        )
    return DistillationTrainer(
        model=student,
        teacher_model=teacher,
        args=args,
        train_dataset=dataset,
        data_collator=build_collator(data_args, args, student),
        generator=_generator(model_args, student, args),
    )


def _generator(m: ModelArguments, student, args):
    """The student's vLLM engine where the backend is one (else None: the trainer's default)."""
    from .generation import BACKENDS, VLLM_BACKENDS, make_generator
    from .generation.vllm_engine import vllm_importable

    backend = args.generation_backend
    if backend not in BACKENDS:
        raise ValueError(f"generation_backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    if backend == "auto":
        # Decided for the device the trainer will put the student on (it is still on the CPU here); under
        # FSDP or asynchronous rollouts "auto" stays in process.
        on_cuda = args.device.type == "cuda" and not args.fsdp and not args.generation_async
        backend = "vllm" if on_cuda and vllm_importable() else "in process"
    if backend not in VLLM_BACKENDS or not (args.lmbda > 0):
        return None
    if backend == "vllm-server":
        return make_generator(backend, student, base_url=m.vllm_server_url, sync_every=m.vllm_sync_every)
    return make_generator(
        backend,
        student,
        gpu_memory_utilization=m.vllm_gpu_memory_utilization,
        kv_cache_memory_bytes=m.vllm_kv_cache_memory_bytes,
        max_model_len=m.vllm_max_model_len,
        sync_every=m.vllm_sync_every,
        seed=args.seed,
    )


# --------------------------------------------------------------------------- the console command


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.description = __doc__.splitlines()[0]
    p.add_argument("config", help="YAML file of keys (see docs/hf.md); '-' for none")
    rest = p.add_argument("overrides", nargs=argparse.REMAINDER, help="--key value pairs that override the file")
    rest.required = False  # may be empty: a missing config names the config alone


def _resume_from(value):
    """--resume_from_checkpoint: a checkpoint directory, or true / last for output_dir's latest one."""
    if isinstance(value, str) and value.strip().lower() in ("true", "last"):
        return True
    return value or None


def run(args: argparse.Namespace) -> int:
    training = False
    try:
        model_args, data_args, train_args = parse(None if args.config == "-" else args.config, args.overrides)
        trainer = build(model_args, data_args, train_args)
        training = True
        trainer.train(resume_from_checkpoint=_resume_from(train_args.resume_from_checkpoint))
        trainer.save_model()
        trainer.save_state()  # trainer_state.json: the log history
    except (ValueError, TypeError, OSError, ImportError, KeyError, argparse.ArgumentError) as err:
        rank = os.environ.get("RANK", "0")
        # a bad config or set-up fails alike on every launched process: one line, from the first; an error
        # while training may be one rank's own (a checkpoint file it cannot read): that rank says so
        if rank == "0" or training:
            who = "nitrobrew train" if rank == "0" else f"nitrobrew train (rank {rank})"
            print(f"{who}: {' '.join(str(err).split())}", file=sys.stderr)
        return 2
    return 0
