"""The docs follow the tree: every "design §N" reference resolves to a section of docs/design.md, and every
module of the package is named in CONTRIBUTING.md's layout and in docs/design.md's "where is what".

Run by `make lint` (so by `make test`); prints each problem and exits non-zero if there is one.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
REF = re.compile(r"design(?:\.md)?`?\s*§(\d+(?:\.\d+)?)")
WHOLE = ("nitrobrew/bench", "nitrobrew/demo")  # named as folders: outside the loss path


def tracked(*patterns: str) -> list:
    out = subprocess.run(["git", "ls-files", *patterns], cwd=ROOT, capture_output=True, text=True, check=True)
    return [ROOT / p for p in out.stdout.split()]


def sections(design: str) -> set:
    """Numbers of the sections and subsections: "## 2." -> "2", "### 2.4 ..." -> "2.4"."""
    return set(re.findall(r"^#{2,3} (\d+(?:\.\d+)?)\.? ", design, flags=re.M))


def main() -> int:
    design = (ROOT / "docs" / "design.md").read_text()
    known = sections(design)
    problems = []
    for path in tracked("*.py", "*.md"):
        for no, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if (
                "design" in line
                and "§" in line
                and not REF.search(line)
                and path.name != "design.md"
                and path != Path(__file__).resolve()
            ):
                problems.append(f"{path.relative_to(ROOT)}:{no}: a design reference this check cannot read")
            for number in REF.findall(line):
                if number not in known:
                    problems.append(
                        f"{path.relative_to(ROOT)}:{no}: design §{number} is not a section of docs/design.md"
                    )
    contributing = (ROOT / "CONTRIBUTING.md").read_text()
    where = design[design.index("## 11.") :]
    for module in tracked("nitrobrew/*.py", "nitrobrew/**/*.py"):
        if module.name == "__init__.py":
            continue
        for name, text in (("CONTRIBUTING.md", contributing), ("docs/design.md §11", where)):
            folder = str(module.parent.relative_to(ROOT))
            if module.name not in text and not (folder in WHOLE and f"{folder}/" in text):
                problems.append(f"{module.relative_to(ROOT)} is not named in {name}")
    for p in problems:
        print(p)
    print(f"docs check: {len(problems)} problem(s)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
