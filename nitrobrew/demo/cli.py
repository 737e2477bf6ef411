"""`nitrobrew demo [lm|toy]`: distill a small causal LM end to end, or draw the toy pictures.

nitrobrew demo                     # under ten minutes on 2 CPU cores; artifacts in runs/demo
nitrobrew demo --resume            # continue an interrupted run from its checkpoints
nitrobrew demo --device cuda --preset large
nitrobrew demo --student-steps 600 --teacher-hidden 192   # any DemoConfig field as a flag
nitrobrew demo toy                 # mode-seeking vs mean-seeking, and the rank picture
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from dataclasses import fields

import torch

from .lm import METHODS, PRESETS, DemoConfig

_SKIP = ("methods",)
_ZERO_OK = ("warmup", "seed")  # sizes that may be 0; every other size must be > 0
_AT_LEAST = {"seq_len": 2}  # a sequence of one token has no next token to predict


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.description = __doc__.splitlines()[0]
    p.add_argument(
        "what",
        nargs="?",
        choices=["lm", "toy"],
        default="lm",
        help="lm (default): teacher, students, table and curves; toy: the divergence pictures",
    )
    p.add_argument("--out", default=None, help="artifact directory (default runs/demo, runs/demo-toy for toy)")
    p.add_argument("--device", default="cpu", help="cpu (default), cuda, cuda:1, ...")
    p.add_argument(
        "--preset",
        choices=sorted(PRESETS),
        default="default",
        help="sizes: tiny (seconds), default (under 10 min on 2 CPU cores), large (a GPU)",
    )
    p.add_argument("--resume", action="store_true", help="continue from the checkpoints in --out")
    p.add_argument(
        "--methods", default=None, help=f"comma-separated students to train (default: all of {','.join(METHODS)})"
    )
    p.add_argument(
        "--threads", type=_number(int, zero_ok=False), default=None, help="torch CPU threads (default: torch's choice)"
    )
    p.add_argument("--no-plot", action="store_true", help="skip the PNG")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    sizes = p.add_argument_group("sizes (override the preset; any DemoConfig field)")
    for f in fields(DemoConfig):
        if f.name in _SKIP:
            continue
        kind = type(f.default)
        check = _boolean if kind is bool else _number(kind, zero_ok=f.name in _ZERO_OK, at_least=_AT_LEAST.get(f.name))
        sizes.add_argument(
            "--" + f.name.replace("_", "-"), type=check, default=None, dest=f.name, metavar=kind.__name__.upper()
        )


def _number(kind, zero_ok: bool, at_least=None):
    """argparse type: a finite number of `kind`, > 0 (>= 0 for the fields where 0 means none; >=
    `at_least` where given)."""

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {kind.__name__}, got {text!r}") from None
        if not math.isfinite(value) or value < 0 or (value == 0 and not zero_ok):
            raise argparse.ArgumentTypeError(f"must be {'>= 0' if zero_ok else '> 0'}, got {text!r}")
        if at_least is not None and value < at_least:
            raise argparse.ArgumentTypeError(f"must be >= {at_least}, got {text!r}")
        return value

    parse.__name__ = kind.__name__  # argparse names the type in its messages
    return parse


def _boolean(text: str) -> bool:
    value = text.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def _saved_config_problem(out: str):
    """Why OUT/config.json cannot be resumed from (None when it can, or when there is none)."""
    path = os.path.join(out, "config.json")
    if not os.path.exists(path):
        return None
    try:
        with open(path) as f:
            saved = json.load(f)
    except (OSError, UnicodeDecodeError, ValueError) as err:
        return f"{path} is not a readable JSON file ({' '.join(str(err).split())}): remove it, or use another --out"
    if not isinstance(saved, dict):
        return f"{path} holds a {type(saved).__name__}, not the run's settings: remove it, or use another --out"
    return None


def run(args: argparse.Namespace) -> int:
    if args.threads:
        torch.set_num_threads(args.threads)
    elif torch.get_num_threads() > 1 and hasattr(os, "getloadavg") and os.getloadavg()[0] >= 1.0:
        print(
            f"note: other processes keep this machine busy (load average {os.getloadavg()[0]:.1f}); torch's "
            f"{torch.get_num_threads()} threads slow down badly when they share cores with them: "
            "--threads 1 is steadier",
            file=sys.stderr,
        )
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print(f"--device {args.device}: CUDA is not available on this machine", file=sys.stderr)
        return 2
    if args.what == "toy":
        from .toy import run_toy

        run_toy(args.out or "runs/demo-toy", progress=not args.quiet)
        return 0
    from .checkpoint import CheckpointError
    from .lm import config_from, run_demo

    overrides = {f.name: getattr(args, f.name) for f in fields(DemoConfig) if f.name not in _SKIP}
    if args.methods:
        methods = [m.strip() for m in args.methods.split(",") if m.strip()]
        unknown = [m for m in methods if m not in METHODS]
        if unknown:
            print(f"--methods: unknown {unknown}; choose from {', '.join(METHODS)}", file=sys.stderr)
            return 2
        overrides["methods"] = methods
    cfg = config_from(args.preset, **overrides)
    out = args.out or "runs/demo"
    problem = _saved_config_problem(out) if args.resume else None
    if problem:
        print(f"nitrobrew demo: --resume: {problem}", file=sys.stderr)
        return 2
    try:
        run_demo(cfg, out, device=args.device, resume=args.resume, progress=not args.quiet, plot=not args.no_plot)
    except KeyboardInterrupt:
        print(
            f"\ninterrupted: `nitrobrew demo --resume --out {out}` (same flags) continues from the last checkpoint",
            file=sys.stderr,
        )
        return 130
    except CheckpointError as err:  # one line, naming the file; the run's other checkpoints stay usable
        print(f"nitrobrew demo: {err}", file=sys.stderr)
        return 2
    return 0
