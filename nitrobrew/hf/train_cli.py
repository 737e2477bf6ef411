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
import sys
from dataclasses import dataclass, field
from typing import Dict, List, Optional

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
        default=None, metadata={"help": "a prompt text column put before text_field; its tokens do not count"}
    )
    max_length: Optional[int] = field(default=None, metadata={"help": "truncate sequences to this many tokens"})
    packing: bool = field(
        default=False,
        metadata={"help": "pack sequences into rows without padding (DataCollatorWithFlattening; position_ids)"},
    )


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


def parse(config_path: Optional[str], overrides: List[str]):
    """(ModelArguments, DataArguments, DistillationArguments) from the YAML file and the overrides."""
    try:
        from transformers import HfArgumentParser
    except ImportError as err:
        raise ImportError("needs transformers: pip install 'nitrobrew[hf]'") from err

    from .trainer import DistillationArguments

    parser = HfArgumentParser((ModelArguments, DataArguments, DistillationArguments), prog="nitrobrew train CONFIG")
    parser.exit_on_error = False  # one line from run(), not argparse's usage and exit
    if any(a in ("-h", "--help") for a in overrides):
        parser.print_help()
        raise SystemExit(0)
    argv = []
    if config_path:
        import yaml

        if not os.path.isfile(config_path):
            raise FileNotFoundError(f"no config file {config_path!r}")
        with open(config_path) as f:
            try:
                config = yaml.safe_load(f) or {}
            except yaml.YAMLError as err:
                raise ValueError(f"{config_path}: not valid YAML ({' '.join(str(err).split())})") from None
        if not isinstance(config, dict):
            raise ValueError(f"{config_path}: expected a mapping of keys to values at the top level")
        argv = yaml_argv(config)
    return parser.parse_args_into_dataclasses(args=argv + list(overrides))


def _load_model(path: str, attn: Optional[str], dtype: str):
    import transformers
    from packaging.version import Version
    from transformers import AutoModelForCausalLM

    dtypes = {"auto": "auto", "float32": torch.float32, "bfloat16": torch.bfloat16}
    if dtype not in dtypes:
        raise ValueError(f"student_dtype must be one of {sorted(dtypes)}, got {dtype!r}")
    key = "dtype" if Version(transformers.__version__) >= Version("4.56") else "torch_dtype"
    kw = {key: dtypes[dtype]}
    if attn:
        kw["attn_implementation"] = attn
    return AutoModelForCausalLM.from_pretrained(path, **kw)


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
        ds = datasets.load_dataset(kinds[ext], data_files=path, split="train")
    elif os.path.isdir(path) and os.path.exists(os.path.join(path, "dataset_info.json")):
        ds = datasets.load_from_disk(path)
    else:
        ds = datasets.load_dataset(path, data.data_config, split=data.data_split)
    if data.text_field is None:
        if "input_ids" not in ds.column_names:
            raise ValueError(
                f"data {path!r} has no input_ids column (columns: {ds.column_names}): set text_field "
                "to tokenize a text column"
            )
        keep = [c for c in ("input_ids", "labels") if c in ds.column_names]
    else:
        from transformers import AutoTokenizer

        for name in (data.text_field, data.prompt_field):
            if name is not None and name not in ds.column_names:
                raise ValueError(f"data {path!r} has no column {name!r} (columns: {ds.column_names})")
        try:
            tok = AutoTokenizer.from_pretrained(tokenizer_path)
        except (OSError, ValueError) as err:  # transformers' message spans lines and names no key
            raise ValueError(
                f"text_field needs a tokenizer: none loads from {tokenizer_path!r} (set tokenizer: "
                f"PATH): {' '.join(str(err).split())}"
            ) from None

        def encode(row):
            ids = tok(row[data.text_field], add_special_tokens=data.prompt_field is None)["input_ids"]
            n_prompt = 0
            if data.prompt_field is not None:
                prompt = tok(row[data.prompt_field])["input_ids"]
                ids, n_prompt = prompt + ids, len(prompt)
            if tok.eos_token_id is not None:
                ids = ids + [tok.eos_token_id]
            return {"input_ids": ids, "labels": [IGNORE_INDEX] * n_prompt + ids[n_prompt:]}

        ds = ds.map(encode, remove_columns=ds.column_names)
        keep = ["input_ids", "labels"]
    ds = ds.select_columns(keep)
    if data.max_length:
        ds = ds.map(lambda row: {k: row[k][: data.max_length] for k in keep})
    return ds


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


def build(model_args: ModelArguments, data_args: DataArguments, args):
    """The DistillationTrainer the three argument groups describe."""
    from .trainer import DistillationTrainer

    student = _load_model(model_args.student, model_args.attn_implementation, model_args.student_dtype)
    from ..teacher import hidden_store as hs

    hidden_store = os.path.isdir(data_args.data) and hs.store_format(data_args.data) == hs.FORMAT
    teacher = None
    if model_args.teacher is not None:
        teacher = _load_model(model_args.teacher, model_args.attn_implementation, "auto")
    elif args.divergence != "topk" and not hidden_store:
        raise ValueError(f"divergence {args.divergence!r} needs a teacher (the teacher key)")
    if hidden_store:  # the store is the teacher (its rows and head): DistillationTrainer refuses a teacher too
        from ..teacher.hidden_data import HiddenCollator, HiddenDataset

        if data_args.packing:
            raise ValueError("packing: true is not available for a hidden store (its collator pads)")
        dataset, collator = HiddenDataset(data_args.data), HiddenCollator()
    elif args.divergence == "topk":
        from ..teacher.data import TopKCollator, TopKDataset

        if data_args.packing:
            raise ValueError("packing: true is not available for a top-k store (its collator pads)")
        dataset, collator = TopKDataset(data_args.data), TopKCollator()
    else:
        dataset = load_data(data_args, model_args.tokenizer or model_args.student)
        if data_args.packing:
            from transformers import DataCollatorWithFlattening

            collator = DataCollatorWithFlattening()
        else:
            pad = getattr(student.config, "pad_token_id", None)
            collator = PadCollator(0 if pad is None else int(pad))
    return DistillationTrainer(
        model=student, teacher_model=teacher, args=args, train_dataset=dataset, data_collator=collator
    )


# --------------------------------------------------------------------------- the console command


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.description = __doc__.splitlines()[0]
    p.add_argument("config", help="YAML file of keys (see docs/hf.md); '-' for none")
    rest = p.add_argument("overrides", nargs=argparse.REMAINDER, help="--key value pairs that override the file")
    rest.required = False  # may be empty: a missing config names the config alone


def run(args: argparse.Namespace) -> int:
    try:
        model_args, data_args, train_args = parse(None if args.config == "-" else args.config, args.overrides)
        trainer = build(model_args, data_args, train_args)
        trainer.train()
        trainer.save_model()
        trainer.save_state()  # trainer_state.json: the log history
    except (ValueError, TypeError, OSError, ImportError, KeyError, argparse.ArgumentError) as err:
        print(f"nitrobrew train: {' '.join(str(err).split())}", file=sys.stderr)  # one line
        return 2
    return 0
