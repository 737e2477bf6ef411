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
from typing import Dict, List

from . import verify

# torch and the store code (which imports torch) are imported where they are used, so that
# `nitrobrew teacher-verify --help` and a bad argument answer without loading torch.


def _check_contents(path: str, info: Dict, man: Dict) -> List[str]:
    import torch

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
    t, bad = verify.read_shard(fpath, want)
    if t is None:
        return bad
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
    out = verify.count_problems(fpath, info, t, h.shape[0])
    if h.numel() and not torch.isfinite(h.float()).all():
        out.append(f"{fpath}: hidden states hold NaN or infinite values")
    if man["hidden_dtype"] == FP8:
        s = t["hidden_scale"]
        if s.shape != (h.shape[0],) or not (torch.isfinite(s).all() and (s > 0).all()):
            out.append(f"{fpath}: hidden_scale must be [{h.shape[0]}], finite and > 0")
    return out + verify.token_problems(fpath, t, man)


def _check_head(path: str, man: Dict, log: verify.Log) -> List[str]:
    from .hidden_store import HEAD_FILE, HiddenStore
    from .store import StoreError

    try:
        HiddenStore(path, verify=False, allow_incomplete=True).head()
        if log:
            log(f"{HEAD_FILE}: ok")
    except StoreError as err:
        return [str(err)]
    except Exception as err:
        return [f"{os.path.join(path, HEAD_FILE)}: cannot be read ({err})"]
    return []


def verify_hidden_store(path: str, log: verify.Log = None) -> List[str]:
    """Every problem of the hidden store at `path` (empty list: all good)."""
    from .hidden_store import read_manifest

    return verify.check_store(path, read_manifest, _check_contents, log, check_more=_check_head)


def add_arguments(p: argparse.ArgumentParser) -> None:
    verify.add_arguments(p, description=__doc__.splitlines()[0])


def _describe(man: Dict, footprint: str) -> str:
    return (
        f" of width {man['hidden_size']} in {man['hidden_dtype']}, {footprint}, head {man['head_rows']} x "
        f"{man['hidden_size']} ({man['head_dtype']})"
    )


def run(args: argparse.Namespace) -> int:
    from .hidden_store import FORMAT, read_manifest, store_format

    if verify.safetensors_missing("teacher-verify"):
        return 2
    fmt = store_format(args.store)
    if fmt is None:
        print(
            f"nitrobrew teacher-verify: {args.store!r} is not a teacher store: no readable manifest.json",
            file=sys.stderr,
        )
        return 1
    if fmt != FORMAT:  # a top-k store (topk-verify names a foreign format)
        return verify.run(args)
    return verify.report(args, "teacher-verify", verify_hidden_store, read_manifest, _describe)
