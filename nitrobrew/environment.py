"""Where a result came from: device, versions and the commit of nitrobrew's own tree.

Recorded with every benchmark table and demo report (the applications share it; the losses never need it).
"""

from __future__ import annotations

import os
import platform
import subprocess
from typing import Dict, Sequence

import torch


def package_version(dist: str) -> str:
    try:
        from importlib.metadata import version

        return version(dist)
    except Exception:
        return "absent"


def environment() -> Dict[str, str]:
    """Device, versions and commit, recorded with every result table."""
    info = {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor() or "cpu",
    }
    try:
        import triton

        info["triton"] = triton.__version__
    except Exception:
        info["triton"] = "absent"
    info["nitrobrew"] = nitrobrew_version()
    info["commit"] = os.environ.get("NITROBREW_COMMIT", "") or nitrobrew_commit()
    return info


def _git(root: str, args: Sequence[str]) -> str:
    return subprocess.run(["git", "-C", root, *args], capture_output=True, text=True, timeout=5).stdout.strip()


def nitrobrew_commit() -> str:
    """The commit of nitrobrew's own source tree (not of the directory the user stands in):
    git in the package's directory, only when that repository's nitrobrew/ is this package;
    else the installed version. "+dirty": the package's files differ from the commit."""
    pkg = os.path.dirname(os.path.abspath(__file__))  # .../nitrobrew
    try:
        top = _git(pkg, ["rev-parse", "--show-toplevel"])
        if top and os.path.samefile(os.path.join(top, "nitrobrew"), pkg):
            head = _git(top, ["rev-parse", "--short", "HEAD"])
            if head:
                dirty = _git(top, ["status", "--porcelain", "--untracked-files=no", "--", "nitrobrew"])
                return head + ("+dirty" if dirty else "")
    except Exception:
        pass
    return f"release {nitrobrew_version()} (no git tree)"


def nitrobrew_version() -> str:
    from . import __version__

    return __version__
