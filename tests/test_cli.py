"""The console script: argument errors are one line and exit 2 for every command; the top-level
flags import no torch."""

import subprocess
import sys

import pytest

from cli_helpers import one_line_exit_2
from nitrobrew.cli import COMMANDS


@pytest.mark.parametrize(
    "argv, says",
    [
        (["topk-extract", "--teacher", "t", "--data", "d", "--out", "o", "--k", "0"], "--k"),
        (["topk-extract", "--teacher", "t", "--data", "d", "--out", "o", "--temperature", "0"], "--temperature"),
        (["demo", "--batch-size", "0"], "--batch-size"),
        (["demo", "--seq-len", "x"], "--seq-len"),
        (["no-such-command"], "invalid choice"),
        ([], "required"),
        (["train"], "required: config"),
    ],
)
def test_argument_errors_are_one_line(argv, says, capsys):
    err = one_line_exit_2(argv, capsys)
    assert says in err and err.startswith("nitrobrew"), err


@pytest.mark.parametrize("command", sorted(set(COMMANDS) - {"train"}))
def test_every_command_reports_an_unknown_flag_in_one_line(command, capsys):
    pytest.importorskip("safetensors")
    err = one_line_exit_2([command, "--no-such-flag"], capsys)
    assert err.startswith(f"nitrobrew {command}: error: "), err  # (or a missing positional first)


def test_version_and_help_import_no_torch():
    code = (
        "import sys, contextlib, io\n"
        "from nitrobrew.cli import main\n"
        "for argv in (['--version'], ['--help']):\n"
        "    with contextlib.redirect_stdout(io.StringIO()):\n"
        "        try:\n"
        "            main(argv)\n"
        "        except SystemExit:\n"
        "            pass\n"
        "print('torch' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_the_package_still_exports_its_losses():
    import nitrobrew

    assert callable(nitrobrew.forward_kl) and callable(nitrobrew.topk_kl) and "jsd" in dir(nitrobrew)
    with pytest.raises(AttributeError):
        nitrobrew.no_such_name  # noqa: B018


def test_readme_topk_snippet_follows_the_advice():
    """The README's topk_kl example keeps the tail with the full normalization (without it, and without
    a CE term, the student learns to put no mass outside the stored ids)."""
    import os
    import re

    readme = open(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md")).read()
    calls = re.findall(r"topk_kl\((.*?)\n\)", readme, flags=re.S)
    assert calls
    for call in calls:
        if 'normalize="full"' in call and "ce_weight" not in call:
            assert "tail=True" in call, call


def test_a_store_command_does_not_import_the_losses():
    """topk-verify's parser loads the store code alone, not the loss families (sympy via torch.fx)."""
    code = (
        "import sys, contextlib, io\n"
        "from nitrobrew.cli import main\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        "    try:\n"
        "        main(['topk-verify', '--help'])\n"
        "    except SystemExit:\n"
        "        pass\n"
        "print(sorted(m for m in ('nitrobrew.hidden', 'nitrobrew.topk', 'transformers') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", out
