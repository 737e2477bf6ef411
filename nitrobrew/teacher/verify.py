"""``nitrobrew topk-verify STORE``: check a whole top-k store before a long training run.

Reading a store checks each shard's size and sha256 the first time a process opens it; this
command checks everything up front, shard by shard: the manifest's schema, every shard's size and
sha256, and its contents (tensor names, dtypes and shapes, the offsets against the manifest's
counts, ids in the vocabulary and distinct within a row, log-probs <= 0, not NaN, and sorted).
Prints one line per problem and exits 1 if there is any.

The walk over a store and the command's report are shared with ``teacher-verify``
(``check_store``, ``report``); each format brings its manifest reader and its shard checks.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Callable, Dict, List, Optional, Tuple

# torch and the store code (which imports torch) are imported where they are used, so that
# `nitrobrew topk-verify --help` and a bad argument answer without loading torch.

# a top-1 log-prob is max - logsumexp, which rounding may leave a hair above 0
_LOGPROB_SLACK = 1e-4

Log = Optional[Callable[[str], None]]


# ------------------------------------------------------------------------- shared by the formats


def read_shard(fpath: str, want: Dict) -> Tuple[Optional[Dict], List[str]]:
    """(the shard's tensors, []) when it holds exactly the tensors of `want` (name -> dtype), else
    (None, the problem)."""
    from safetensors import safe_open

    with safe_open(fpath, framework="pt") as f:
        names = set(f.keys())
        if names != set(want):
            return None, [f"{fpath}: tensors {sorted(names)}, expected {sorted(want)}"]
        t = {n: f.get_tensor(n) for n in want}
    bad = [f"{n} is {t[n].dtype}, expected {d}" for n, d in want.items() if t[n].dtype != d]
    if bad:
        return None, [f"{fpath}: " + "; ".join(bad)]
    return t, []


def count_problems(fpath: str, info: Dict, t: Dict, rows: int) -> List[str]:
    """The shard's tokens and `rows` against its offsets and its manifest entry."""
    so, ro, out = t["seq_offsets"], t["row_offsets"], []
    if so[-1] != t["input_ids"].numel() or so[-1] != info["tokens"]:
        out.append(f"{fpath}: {t['input_ids'].numel()} tokens, offsets say {int(so[-1])}, manifest {info['tokens']}")
    if ro[-1] != rows or rows != info["rows"]:
        out.append(f"{fpath}: {rows} rows, offsets say {int(ro[-1])}, manifest {info['rows']}")
    return out


def token_problems(fpath: str, t: Dict, man: Dict) -> List[str]:
    """Input ids outside the head's rows."""
    tok = t["input_ids"]
    if tok.numel() and (tok.min() < 0 or tok.max() >= man["head_rows"]):
        return [f"{fpath}: input ids outside [0, {man['head_rows']})"]
    return []


def check_store(
    path: str,
    read: Callable[[str], Dict],
    check_shard: Callable[[str, Dict, Dict], List[str]],
    log: Log = None,
    check_more: Optional[Callable[[str, Dict, Log], List[str]]] = None,
) -> List[str]:
    """Every problem of the store at `path`: its manifest (`read`), whether it is complete,
    `check_more` (the hidden store's head), then each shard's size, sha256 and `check_shard`."""
    from .store import StoreError, verify_shard

    try:
        man = read(path)
    except StoreError as err:
        return [str(err)]
    problems = [] if man["complete"] else [f"{path}: the store is incomplete ({len(man['shards'])} shards written)"]
    if check_more is not None:
        problems += check_more(path, man, log)
    for info in man["shards"]:
        try:
            verify_shard(path, info)
            found = check_shard(path, info, man)
        except StoreError as err:
            found = [str(err)]
        except Exception as err:  # an unreadable file: name it
            found = [f"{os.path.join(path, info['file'])}: cannot be read ({err})"]
        problems += found
        if log:
            log(f"{info['file']}: {'ok' if not found else 'FAILED'}")
    return problems


def safetensors_missing(command: str) -> bool:
    """Print why the command cannot run without safetensors (a missing package is not a corrupted shard)."""
    from .store import _safetensors

    try:
        _safetensors()
    except ImportError as err:
        print(f"nitrobrew {command}: error: {err}", file=sys.stderr)
        return True
    return False


def report(
    args: argparse.Namespace,
    command: str,
    verify: Callable[..., List[str]],
    read: Callable[[str], Dict],
    describe: Callable[[Dict, str], str],
) -> int:
    """Run `verify` on ``args.store``: each problem on stderr (exit 1), else one line naming the
    shards, sequences and rows, then ``describe(manifest, bytes)`` (exit 0)."""
    problems = verify(args.store, log=None if args.quiet else print)
    for line in problems:
        print(f"nitrobrew {command}: {line}", file=sys.stderr)
    if problems:
        return 1
    man = read(args.store)
    size = sum(s["bytes"] for s in man["shards"])
    rows = max(man.get("num_rows", 0), 1)
    footprint = f"{size} bytes ({size / rows:.1f} bytes/position)"
    print(
        f"{args.store}: ok: {len(man['shards'])} shards, {man['num_sequences']} sequences, {man.get('num_rows', 0)} "
        f"rows{describe(man, footprint)}"
    )
    return 0


def add_arguments(p: argparse.ArgumentParser, description: Optional[str] = None) -> None:
    p.description = description or __doc__.splitlines()[0]
    p.add_argument("store", help="the store directory")
    p.add_argument("--quiet", action="store_true", help="print problems only")


# ---------------------------------------------------------------------------------- the top-k store


def _check_contents(path: str, info: Dict, man: Dict) -> List[str]:
    import torch

    from .store import ID_DTYPES, LOGPROB_DTYPES, QUANTIZED, dequantize_logprobs, unpack_ids

    fpath = os.path.join(path, info["file"])
    packed = man["id_dtype"] != "int32"
    want_dtypes = {
        "input_ids": torch.int32,
        "seq_offsets": torch.int64,
        "row_offsets": torch.int64,
        "topk_ids": torch.uint8 if packed else torch.int32,
        "topk_logprobs": LOGPROB_DTYPES[man["logprob_dtype"]],
    }
    if man["logprob_dtype"] == QUANTIZED:
        want_dtypes["topk_lp_scale"] = torch.float32
    t, bad = read_shard(fpath, want_dtypes)
    if t is None:
        return bad
    K, V, n = man["k"], man["vocab_size"], info["sequences"]
    if packed and (t["topk_ids"].dim() != 3 or t["topk_ids"].shape[2] != ID_DTYPES[man["id_dtype"]][0]):
        return [f"{fpath}: topk_ids {tuple(t['topk_ids'].shape)} are not packed as {man['id_dtype']}"]
    so, ro, ids, lp = t["seq_offsets"], t["row_offsets"], unpack_ids(t["topk_ids"]), t["topk_logprobs"].float()
    if man["logprob_dtype"] == QUANTIZED:
        if t["topk_lp_scale"].shape != (ids.shape[0], 2):
            return [f"{fpath}: topk_lp_scale is {tuple(t['topk_lp_scale'].shape)}, expected ({ids.shape[0]}, 2)"]
        lp = dequantize_logprobs(t["topk_logprobs"], t["topk_lp_scale"])
    if so.shape != (n + 1,) or ro.shape != (n + 1,) or ids.dim() != 2 or ids.shape[1] != K or ids.shape != lp.shape:
        return [f"{fpath}: shapes {[tuple(x.shape) for x in t.values()]} do not fit {n} sequences of K = {K}"]
    lengths, rows = so.diff(), ro.diff()
    if so[0] != 0 or ro[0] != 0 or (lengths < 0).any() or not torch.equal(rows, (lengths - 1).clamp(min=0)):
        return [f"{fpath}: offsets are inconsistent (each sequence of L tokens must have L - 1 rows)"]
    out = count_problems(fpath, info, t, ids.shape[0])
    if ids.numel():
        if ids.min() < 0 or ids.max() >= V:  # padding ids too: the store writes 0
            out.append(f"{fpath}: top-k ids outside [0, {V})")
        pad = lp == float("-inf")  # padding entries may repeat their id
        srt = torch.where(pad, -1 - torch.arange(K), ids).sort(1).values
        if (srt[:, 1:] == srt[:, :-1]).any():
            out.append(f"{fpath}: a row repeats an id")
        if torch.isnan(lp).any() or (lp > _LOGPROB_SLACK).any():  # -inf: a padding entry
            out.append(f"{fpath}: log-probs must be <= 0 and not NaN")
        elif (lp[:, 1:] > lp[:, :-1]).any():
            out.append(f"{fpath}: log-probs are not sorted in decreasing order")
    return out + token_problems(fpath, t, man)


def verify_store(path: str, log: Log = None) -> List[str]:
    """Every problem of the store at `path` (empty list: all good)."""
    from .store import read_manifest

    return check_store(path, read_manifest, _check_contents, log)


def _describe(man: Dict, footprint: str) -> str:
    return f", K = {man['k']}, {man['logprob_dtype']} log-probs, {footprint}"


def run(args: argparse.Namespace) -> int:
    from .store import read_manifest

    if safetensors_missing("topk-verify"):
        return 2
    return report(args, "topk-verify", verify_store, read_manifest, _describe)
