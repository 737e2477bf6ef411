"""The `nitrobrew` console script.

Each command lives in its own module exposing ``add_arguments(parser)`` and ``run(args)``, named in
``COMMANDS`` below; a module is imported only when its command runs (optional extras stay
optional, and ``nitrobrew --version`` / ``--help`` import no torch). Argument errors are one line
and exit status 2 for every command: the parser's (``OneLineParser``), and a command's own checks that
end it with ``SystemExit("...")``.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import List, Optional

# command -> (module, one-line help)
COMMANDS = {
    "bench": ("nitrobrew.bench.hidden", "benchmark the hidden-state losses against baselines"),
    "bench-attention": ("nitrobrew.bench.attention", "benchmark attention_kl against baselines"),
    "bench-topk": ("nitrobrew.bench.topk", "benchmark topk_kl against baselines"),
    "demo": ("nitrobrew.demo.cli", "distill a small model end to end and report"),
    "topk-extract": ("nitrobrew.teacher.extract", "store a teacher's top-k log-probs over a corpus"),
    "topk-verify": ("nitrobrew.teacher.verify", "check every shard of a top-k store (checksums and contents)"),
    "topk-export": ("nitrobrew.teacher.interop", "export a top-k store to parquet (Hugging Face datasets layout)"),
    "topk-import": ("nitrobrew.teacher.interop", "import a top-k store from parquet (Hugging Face datasets layout)"),
    "teacher-extract": (
        "nitrobrew.teacher.hidden_extract",
        "store a teacher's final hidden states and head (or top-k) over a corpus or rollouts",
    ),
    "teacher-verify": ("nitrobrew.teacher.hidden_verify", "check every shard of a hidden-state or top-k store"),
    "teacher-export": (
        "nitrobrew.teacher.hidden_interop_cli",
        "export a hidden store to parquet (Hugging Face datasets layout)",
    ),
    "teacher-import": (
        "nitrobrew.teacher.hidden_interop_cli",
        "import a hidden store from parquet written by teacher-export (checksums checked)",
    ),
    "rollout": ("nitrobrew.teacher.rollout", "write a model's completions of a prompt set as a dataset"),
    "train": ("nitrobrew.hf.train_cli", "distill with DistillationTrainer from a YAML config"),
}
# `nitrobrew bench attention` is spelled as a mode of bench, too.
BENCH_MODES = {"hidden": "bench", "attention": "bench-attention", "topk": "bench-topk"}
# optional package -> the extra that installs it (pyproject.toml)
EXTRAS = {
    "transformers": "hf",
    "accelerate": "hf",
    "datasets": "hf",
    "yaml": "hf",
    "safetensors": "store",
    "pyarrow": "interop",
    "tqdm": "progress",
    "matplotlib": "plot",
    "triton": "triton",
}


class OneLineParser(argparse.ArgumentParser):
    """argparse, with an argument error reported as one line (no usage block) and exit status 2.

    Subparsers inherit the class, so every command's errors read ``nitrobrew CMD: error: ...``."""

    def error(self, message: str):
        message = " ".join(str(message).split())
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _normalize(argv: List[str]) -> List[str]:
    if len(argv) >= 2 and argv[0] == "bench" and argv[1] in BENCH_MODES:
        return [BENCH_MODES[argv[1]], *argv[2:]]
    return argv


def main(argv: Optional[List[str]] = None) -> int:
    argv = _normalize(list(sys.argv[1:] if argv is None else argv))
    parser = OneLineParser(prog="nitrobrew", description=__doc__.splitlines()[0])
    from . import __version__

    parser.add_argument("--version", action="version", version=f"nitrobrew {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    parsers = {}
    for name, (module, help_text) in COMMANDS.items():
        p = parsers[name] = sub.add_parser(name, help=help_text)
        p.set_defaults(_module=module)
        if argv and argv[0] == name:
            try:
                importlib.import_module(module).add_arguments(p)
            except ModuleNotFoundError as err:
                if err.name and err.name.startswith("nitrobrew"):
                    parser.error(f"command {name!r} is not available in this build ({err})")
                top = (err.name or "").split(".")[0]
                if top in EXTRAS:  # one line, not a traceback
                    print(
                        f"nitrobrew {name}: error: needs {top}: pip install 'nitrobrew[{EXTRAS[top]}]'", file=sys.stderr
                    )
                    raise SystemExit(2) from None
                raise
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # named by the command they were given to
        parsers[args.command].error(f"unrecognized arguments: {' '.join(unknown)}")
    try:
        return int(importlib.import_module(args._module).run(args) or 0)
    except SystemExit as err:
        if not isinstance(err.code, str):
            raise
        # a command's check of its arguments or set-up (`raise SystemExit("...")`, which Python would end
        # with status 1): one line named by the command, and status 2 like the parser's errors
        message = " ".join(err.code.split())
        if not message.startswith("nitrobrew"):
            spelled = {cmd: f"bench {mode}" for mode, cmd in BENCH_MODES.items() if cmd != "bench"}
            message = f"nitrobrew {spelled.get(args.command, args.command)}: {message}"
        print(message, file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    sys.exit(main())
