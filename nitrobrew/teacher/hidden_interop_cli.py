"""Export a hidden-state store to parquet (Hugging Face datasets layout), and import it back.

``nitrobrew teacher-export STORE DIR`` and ``nitrobrew teacher-import DIR STORE``, the commands of
``hidden_interop`` (docs/teacher_store.md, "parquet layout"). ``teacher-export``
writes ``DIR/data/*.parquet`` (Hugging Face ``datasets`` layout), ``DIR/head.safetensors`` and
``DIR/nitrobrew_hidden.json`` (the header and every file's sha256); ``teacher-import`` checks every
sha256 before it reads anything and rebuilds the store bit for bit. Both write into a new (or
empty) directory, and build it beside its final place first: the directory appears whole, and a
refused command leaves nothing behind (no lock, no partial manifest). Errors are one line, exit 2.
"""

from __future__ import annotations

import argparse
import os
import secrets
import shutil
import sys
from typing import Callable, List

# hidden_interop (torch, pyarrow) is imported by run(): `--help` and a bad argument load neither.


def _fresh_target(path: str) -> None:
    if os.path.lexists(path) and not os.path.isdir(path):
        raise FileExistsError(f"{path!r} exists and is not a directory")
    if os.path.isdir(path) and os.listdir(path):
        raise FileExistsError(f"{path!r} exists and is not empty: write into a new directory")


def _missing_parents(path: str) -> List[str]:
    """The directories above `path` that do not exist, outermost first."""
    missing = []
    parent = os.path.dirname(path)
    while parent and not os.path.exists(parent):
        missing.append(parent)
        parent = os.path.dirname(parent)
    return missing[::-1]


def build_into_new_dir(target: str, build: Callable[[str], object]):
    """``build(tmp)`` into a new directory beside `target`, then rename it to `target`; returns what
    build returns. `target` must be absent or an empty directory; if build (or the rename) fails,
    what was written is removed, along with any parent directory made for it."""
    target = os.path.abspath(target)
    _fresh_target(target)
    parents = _missing_parents(target)
    tmp = None
    try:
        for d in parents:
            os.mkdir(d)
        tmp = os.path.join(os.path.dirname(target), f".{os.path.basename(target)}.partial-{secrets.token_hex(4)}")
        os.mkdir(tmp)
        result = build(tmp)
        _fresh_target(target)  # another process may have written there meanwhile
        os.rename(tmp, target)  # replaces an empty directory, atomically
        return result
    except BaseException:
        if tmp is not None and os.path.isdir(tmp):
            shutil.rmtree(tmp)
        for d in reversed(parents):
            try:
                os.rmdir(d)
            except OSError:  # no longer empty: not ours alone
                break
        raise


def add_arguments(p: argparse.ArgumentParser) -> None:
    importing = p.prog.endswith("teacher-import")
    p.description = __doc__.splitlines()[0]
    if importing:
        p.add_argument("src", help="a directory written by teacher-export (holding nitrobrew_hidden.json)")
        p.add_argument("store", help="the new store directory (absent or empty)")
    else:
        p.add_argument("store", help="the hidden store directory")
        p.add_argument("out", help="a new directory for the parquet files (absent or empty)")
    p.set_defaults(_importing=importing)


def run(args: argparse.Namespace) -> int:
    name = "teacher-import" if args._importing else "teacher-export"
    from .hidden_interop import INDEX, export_hidden, import_hidden
    from .store import StoreError

    try:
        if args._importing:
            try:
                man = build_into_new_dir(args.store, lambda tmp: import_hidden(args.src, tmp, resume=False))
            except KeyError as err:  # an index with its keys edited away
                raise StoreError(f"{os.path.join(args.src, INDEX)} is malformed: it lacks {err}") from None
            print(
                f"wrote {args.store}: {len(man['shards'])} shards, {man['num_sequences']} sequences, "
                f"{man['num_rows']} rows of width {man['hidden_size']} in {man['hidden_dtype']}"
            )
        else:
            files = build_into_new_dir(args.out, lambda tmp: export_hidden(args.store, tmp))
            print(
                f"wrote {len(files) - 1} parquet files under {os.path.join(args.out, 'data')}, the head and "
                f"{os.path.join(args.out, INDEX)}"
            )
    except Exception as err:
        # pyarrow's own errors (a file it cannot decode) are one line too
        known = (StoreError, ValueError, OSError, ImportError)
        if not isinstance(err, known) and not type(err).__module__.startswith("pyarrow"):
            raise
        print(
            f"nitrobrew {name}: error: {str(err).splitlines()[0] if str(err) else type(err).__name__}", file=sys.stderr
        )
        return 2
    return 0
