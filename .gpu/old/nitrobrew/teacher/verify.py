"""``nitrobrew topk-verify STORE``: check a whole top-k store before a long training run.

Reading a store checks each shard's size and sha256 the first time a process opens it; this
command checks everything up front, shard by shard: the manifest's schema, every shard's size and
sha256, and its contents (tensor names, dtypes and shapes, the offsets against the manifest's
counts, ids in the vocabulary and distinct within a row, log-probs <= 0, not NaN, and sorted).
Prints one line per problem and exits 1 if there is any.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Callable, Dict, List, Optional

import torch

from .store import (
    ID_DTYPES,
    LOGPROB_DTYPES,
    QUANTIZED,
    StoreError,
    _safetensors,
    dequantize_logprobs,
    read_manifest,
    unpack_ids,
    verify_shard,
)

# a top-1 log-prob is max - logsumexp, which rounding may leave a hair above 0
_LOGPROB_SLACK = 1e-4


def _check_contents(path: str, info: Dict, man: Dict) -> List[str]:
    from safetensors import safe_open

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
    with safe_open(fpath, framework="pt") as f:
        names = set(f.keys())
        if names != set(want_dtypes):
            return [f"{fpath}: tensors {sorted(names)}, expected {sorted(want_dtypes)}"]
        t = {n: f.get_tensor(n) for n in want_dtypes}
    bad = [f"{n} is {t[n].dtype}, expected {d}" for n, d in want_dtypes.items() if t[n].dtype != d]
    if bad:
        return [f"{fpath}: " + "; ".join(bad)]
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
    out = []
    if so[-1] != t["input_ids"].numel() or so[-1] != info["tokens"]:
        out.append(f"{fpath}: {t['input_ids'].numel()} tokens, offsets say {int(so[-1])}, manifest {info['tokens']}")
    if ro[-1] != ids.shape[0] or ro[-1] != info["rows"]:
        out.append(f"{fpath}: {ids.shape[0]} rows, offsets say {int(ro[-1])}, manifest {info['rows']}")
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
    tok = t["input_ids"]
    if tok.numel() and (tok.min() < 0 or tok.max() >= man["head_rows"]):
        out.append(f"{fpath}: input ids outside [0, {man['head_rows']})")
    return out


def verify_store(path: str, log: Optional[Callable[[str], None]] = None) -> List[str]:
    """Every problem of the store at `path` (empty list: all good)."""
    try:
        man = read_manifest(path)
    except StoreError as err:
        return [str(err)]
    problems = [] if man["complete"] else [f"{path}: the store is incomplete ({len(man['shards'])} shards written)"]
    for info in man["shards"]:
        try:
            verify_shard(path, info)
            found = _check_contents(path, info, man)
        except StoreError as err:
            found = [str(err)]
        except Exception as err:  # an unreadable file: name it
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
    try:
        _safetensors()  # a missing package is not a corrupted shard
    except ImportError as err:
        print(f"nitrobrew topk-verify: error: {err}", file=sys.stderr)
        return 2
    problems = verify_store(args.store, log=None if args.quiet else print)
    for line in problems:
        print(f"nitrobrew topk-verify: {line}", file=sys.stderr)
    if problems:
        return 1
    man = read_manifest(args.store)
    size = sum(s["bytes"] for s in man["shards"])
    rows = max(man.get("num_rows", 0), 1)
    print(
        f"{args.store}: ok: {len(man['shards'])} shards, {man['num_sequences']} sequences, {man.get('num_rows', 0)} "
        f"rows, K = {man['k']}, {man['logprob_dtype']} log-probs, {size} bytes ({size / rows:.1f} bytes/position)"
    )
    return 0
