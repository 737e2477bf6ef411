"""``nitrobrew teacher-verify STORE``: check a whole hidden-state (or top-k) store before a long run.

For a hidden store: the manifest's schema, the head file's sha256 and shapes, every shard's size and
sha256, and its contents (tensor names, dtypes and shapes, offsets against the manifest's counts,
rows against the prompt lengths, finite values, positive fp8 scales, token ids in the head's rows).
A top-k store is handed to ``topk-verify``'s checks. Prints one line per problem, exits 1 if any.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Callable, Dict, List, Optional

# torch and the store code (which imports torch) are imported where they are used, so that
# `nitrobrew teacher-verify --help` and a bad argument answer without loading torch.


def _check_contents(path: str, info: Dict, man: Dict) -> List[str]:
    import torch
    from safetensors import safe_open

    from .hidden_store import FP8, HIDDEN_DTYPES, row_start

    fpath = os.path.join(path, info["file"])
    want = {
        "input_ids": torch.int32,
        "seq_offsets": torch.int64,
        "prompt_lengths": torch.int32,
        "row_offsets": torch.int64,
        "hidden": HIDDEN_DTYPES[man["hidden_dtype"]],
    }
    if man["hidden_dtype"] == FP8:
        want["hidden_scale"] = torch.float32
    with safe_open(fpath, framework="pt") as f:
        names = set(f.keys())
        if names != set(want):
            return [f"{fpath}: tensors {sorted(names)}, expected {sorted(want)}"]
        t = {n: f.get_tensor(n) for n in want}
    bad = [f"{n} is {t[n].dtype}, expected {d}" for n, d in want.items() if t[n].dtype != d]
    if bad:
        return [f"{fpath}: " + "; ".join(bad)]
    n, D = info["sequences"], man["hidden_size"]
    so, ro, plen, h = t["seq_offsets"], t["row_offsets"], t["prompt_lengths"], t["hidden"]
    if so.shape != (n + 1,) or ro.shape != (n + 1,) or plen.shape != (n,) or h.dim() != 2 or h.shape[1] != D:
        return [f"{fpath}: shapes {[tuple(x.shape) for x in t.values()]} do not fit {n} sequences of width {D}"]
    lengths = so.diff()
    if (plen < 0).any() or (plen.long() > lengths).any():
        return [f"{fpath}: a prompt length is negative or longer than its sequence"]
    starts = torch.tensor([row_start(p) for p in plen.tolist()], dtype=torch.int64)
    if so[0] != 0 or ro[0] != 0 or not torch.equal(ro.diff(), (lengths - 1 - starts).clamp(min=0)):
        return [f"{fpath}: offsets are inconsistent (L tokens with prompt P must have L - 1 - max(P - 1, 0) rows)"]
    out = []
    if so[-1] != t["input_ids"].numel() or so[-1] != info["tokens"]:
        out.append(f"{fpath}: {t['input_ids'].numel()} tokens, offsets say {int(so[-1])}, manifest {info['tokens']}")
    if ro[-1] != h.shape[0] or h.shape[0] != info["rows"]:
        out.append(f"{fpath}: {h.shape[0]} rows, offsets say {int(ro[-1])}, manifest {info['rows']}")
    if h.numel() and not torch.isfinite(h.float()).all():
        out.append(f"{fpath}: hidden states hold NaN or infinite values")
    if man["hidden_dtype"] == FP8:
        s = t["hidden_scale"]
        if s.shape != (h.shape[0],) or not (torch.isfinite(s).all() and (s > 0).all()):
            out.append(f"{fpath}: hidden_scale must be [{h.shape[0]}], finite and > 0")
    tok = t["input_ids"]
    if tok.numel() and (tok.min() < 0 or tok.max() >= man["head_rows"]):
        out.append(f"{fpath}: input ids outside [0, {man['head_rows']})")
    return out


def verify_hidden_store(path: str, log: Optional[Callable[[str], None]] = None) -> List[str]:
    """Every problem of the hidden store at `path` (empty list: all good)."""
    from .hidden_store import HEAD_FILE, HiddenStore, read_manifest
    from .store import StoreError, verify_shard

    try:
        man = read_manifest(path)
    except StoreError as err:
        return [str(err)]
    problems = [] if man["complete"] else [f"{path}: the store is incomplete ({len(man['shards'])} shards written)"]
    try:
        HiddenStore(path, verify=False, allow_incomplete=True).head()
        if log:
            log(f"{HEAD_FILE}: ok")
    except StoreError as err:
        problems.append(str(err))
    except Exception as err:
        problems.append(f"{os.path.join(path, HEAD_FILE)}: cannot be read ({err})")
    for info in man["shards"]:
        try:
            verify_shard(path, info)
            found = _check_contents(path, info, man)
        except StoreError as err:
            found = [str(err)]
        except Exception as err:
            found = [f"{os.path.join(path, info['file'])}: cannot be read ({err})"]
        problems += found
        if log:
            log(f"{info['file']}: {'ok' if not found else 'FAILED'}")
    return problems


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.description = __doc__.splitlines()[0]
    p.add_argument("store", help="the store directory")
    p.add_argument("--quiet", action="store_true", help="print problems only")


def run(args: argparse.Namespace) -> int:
    from .hidden_store import FORMAT, read_manifest, store_format
    from .store import _safetensors

    try:
        _safetensors()
    except ImportError as err:
        print(f"nitrobrew teacher-verify: error: {err}", file=sys.stderr)
        return 2
    fmt = store_format(args.store)
    if fmt is None:
        print(
            f"nitrobrew teacher-verify: {args.store!r} is not a teacher store: no readable manifest.json",
            file=sys.stderr,
        )
        return 1
    if fmt != FORMAT:  # a top-k store (topk-verify names a foreign format)
        from . import verify

        return verify.run(args)
    problems = verify_hidden_store(args.store, log=None if args.quiet else print)
    for line in problems:
        print(f"nitrobrew teacher-verify: {line}", file=sys.stderr)
    if problems:
        return 1
    man = read_manifest(args.store)
    size = sum(s["bytes"] for s in man["shards"])
    rows = max(man.get("num_rows", 0), 1)
    print(
        f"{args.store}: ok: {len(man['shards'])} shards, {man['num_sequences']} sequences, {man.get('num_rows', 0)} "
        f"rows of width {man['hidden_size']} in {man['hidden_dtype']}, {size} bytes ({size / rows:.1f} "
        f"bytes/position), head {man['head_rows']} x {man['hidden_size']} ({man['head_dtype']})"
    )
    return 0
