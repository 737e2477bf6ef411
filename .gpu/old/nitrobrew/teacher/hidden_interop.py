"""Export a hidden store to parquet in the Hugging Face ``datasets`` layout, and import it back.

``export_hidden(STORE, DIR)`` writes (docs/teacher_store.md, "parquet layout")::

    DIR/data/train-{j:05d}-of-{n:05d}.parquet   one file per store shard, one row per sequence
    DIR/head.safetensors                        the teacher's head, as in the store
    DIR/nitrobrew_hidden.json                   the store's header, and the sha256 of every file above

``datasets.load_dataset("parquet", data_dir=DIR + "/data")`` reads the rows: ``input_ids``
list<int32> [L], ``prompt_length`` int32, ``hidden_start`` int32 (``max(P - 1, 0)``: the first
stored position), ``teacher_hidden`` list<fixed_size_list<T, Dt>> [L - 1 - hidden_start] (T:
float32; for bfloat16 the raw bits as uint16; for fp8 the e4m3 codes as uint8) and, for fp8,
``teacher_hidden_scale`` list<float32>. ``import_hidden(DIR, STORE)`` checks every file's sha256
against ``nitrobrew_hidden.json`` before it reads anything, rebuilds the store shard by shard and
checks each rebuilt shard's sha256 against the original's: the store comes back bit for bit.
"""

from __future__ import annotations

import io
import json
import os
from typing import Dict, List

import numpy as np
import torch

from ..core.atomic_io import atomic_write_bytes, atomic_write_text
from .hidden_store import FP8, HEAD_FILE, HEADER_KEYS, HiddenStore, HiddenWriter, read_manifest
from .store import StoreError, _safetensors, sha256_file

INDEX = "nitrobrew_hidden.json"
# how each stored dtype travels in parquet: (arrow element type, the torch dtype of its bits)
# (arrow element type, numpy dtype of the bits, torch dtype of the same bits)
_BITS = {
    "float32": ("float32", np.float32, torch.float32),
    "bfloat16": ("uint16", np.uint16, torch.int16),
    FP8: ("uint8", np.uint8, torch.uint8),
}
_STORED = {"float32": torch.float32, "bfloat16": torch.bfloat16, FP8: torch.float8_e4m3fn}


def _pyarrow():
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError as err:
        raise ImportError("parquet export and import need pyarrow: pip install 'nitrobrew[interop]'") from err
    return pa, pq


def _file(j: int, n: int) -> str:
    return os.path.join("data", f"train-{j:05d}-of-{n:05d}.parquet")


def export_hidden(store_dir: str, out_dir: str, log=None) -> List[str]:
    """Write the store as parquet (see the module docstring); returns the files written."""
    pa, pq = _pyarrow()
    store = HiddenStore(store_dir)  # checks the manifest and, as shards are read, their checksums
    man = store.manifest
    dtype, D = man["hidden_dtype"], man["hidden_size"]
    arrow_type, np_bits, bits = _BITS[dtype]
    os.makedirs(os.path.join(out_dir, "data"), exist_ok=True)
    store.head()  # checks the head's sha256 before it is copied
    with open(os.path.join(store_dir, HEAD_FILE), "rb") as f:
        atomic_write_bytes(os.path.join(out_dir, HEAD_FILE), f.read())
    files, n = {}, len(store.shards)
    for j, info in enumerate(store.shards):
        items = [store[i] for i in range(info["first_sequence"], info["first_sequence"] + info["sequences"])]
        rows = pa.list_(pa.list_(getattr(pa, arrow_type)(), D))
        hidden = [it["hidden"].contiguous().view(bits).numpy().view(np_bits).reshape(-1, D) for it in items]
        cols = {
            "input_ids": pa.array([it["input_ids"].numpy().astype(np.int32) for it in items], pa.list_(pa.int32())),
            "prompt_length": pa.array([it["prompt_length"] for it in items], pa.int32()),
            "hidden_start": pa.array([max(it["prompt_length"] - 1, 0) for it in items], pa.int32()),
            "teacher_hidden": pa.array([list(h) for h in hidden], rows),
        }
        if dtype == FP8:
            cols["teacher_hidden_scale"] = pa.array(
                [it["hidden_scale"].numpy() for it in items], pa.list_(pa.float32())
            )
        table = pa.table(cols).replace_schema_metadata({b"nitrobrew_hidden_shard": str(info["index"]).encode()})
        buf = io.BytesIO()
        pq.write_table(table, buf)
        name = _file(j, n)
        atomic_write_bytes(os.path.join(out_dir, name), buf.getvalue())
        files[name] = {"sha256": sha256_file(os.path.join(out_dir, name)), "store_shard_sha256": info["sha256"]}
        if log:
            log(f"{name}: {info['sequences']} sequences, {info['rows']} rows")
    header = {k: man[k] for k in HEADER_KEYS + ("head_bias",)}
    index = {
        "format": "nitrobrew-hidden-parquet",
        "version": 1,
        "header": header,
        "head": {"file": HEAD_FILE, "sha256": man["head_sha256"]},
        "files": files,
    }
    atomic_write_text(os.path.join(out_dir, INDEX), json.dumps(index, indent=1, sort_keys=True) + "\n")
    return [os.path.join(out_dir, f) for f in files] + [os.path.join(out_dir, HEAD_FILE)]


def _read_index(src: str) -> Dict:
    path = os.path.join(src, INDEX)
    if not os.path.exists(path):
        raise StoreError(f"{src!r} is not an exported hidden store: {INDEX} is missing")
    try:
        with open(path) as f:
            index = json.load(f)
    except ValueError as err:
        raise StoreError(f"{path} is not valid JSON ({err})") from None
    if not isinstance(index, dict) or index.get("format") != "nitrobrew-hidden-parquet":
        raise StoreError(f"{path} is not a nitrobrew-hidden-parquet index")
    return index


def import_hidden(src: str, store_dir: str, resume: bool = True, log=None) -> Dict:
    """Rebuild the hidden store exported into `src` at `store_dir`; every checksum is checked first."""
    pa, pq = _pyarrow()
    index = _read_index(src)
    header = index["header"]
    for name, want in [(index["head"]["file"], index["head"]["sha256"])] + [
        (f, v["sha256"]) for f, v in sorted(index["files"].items())
    ]:
        path = os.path.join(src, name)
        if os.path.normpath(name).startswith("..") or os.path.isabs(name):
            raise StoreError(f"{INDEX} names a file outside {src!r}: {name!r}")
        if not os.path.exists(path):
            raise StoreError(f"{path} is missing")
        if sha256_file(path) != want:
            raise StoreError(f"{path} is corrupted: its sha256 does not match {INDEX}")
    head = _safetensors().load_file(os.path.join(src, index["head"]["file"]))
    dtype, D = header["hidden_dtype"], header["hidden_size"]
    _, np_bits, bits = _BITS[dtype]
    with HiddenWriter(
        store_dir,
        model=header["model"],
        revision=header["revision"],
        weight=head["weight"],
        bias=head.get("bias"),
        vocab_size=header["vocab_size"],
        num_sequences=header["num_sequences"],
        hidden_dtype=dtype,
        logit_scale=header["logit_scale"],
        softcap=header["final_logit_softcapping"],
        sequences_per_shard=header["sequences_per_shard"],
        source=header["source"],
        resume=resume,
    ) as writer:
        if writer.header["head_sha256"] != header["head_sha256"]:
            raise StoreError(f"{src}: the head does not hash to the header's head_sha256")
        for name, meta in sorted(index["files"].items()):
            table = pq.read_table(os.path.join(src, name))
            j = int(table.schema.metadata[b"nitrobrew_hidden_shard"])
            if writer.done(j):
                continue
            ids = [torch.tensor(x, dtype=torch.int32) for x in table.column("input_ids").to_pylist()]
            plen = table.column("prompt_length").to_pylist()
            rows = []
            for chunk in table.column("teacher_hidden").to_pylist():
                arr = np.asarray(chunk, dtype=np_bits).reshape(-1, D)
                rows.append(torch.from_numpy(arr.view(torch.empty((), dtype=bits).numpy().dtype)).view(_STORED[dtype]))
            scales = None
            if dtype == FP8:
                scales = [
                    torch.tensor(s, dtype=torch.float32) for s in table.column("teacher_hidden_scale").to_pylist()
                ]
            writer.write_shard(j, ids, rows, plen, scales=scales, sha256=meta["store_shard_sha256"])
            if log:
                log(f"{name}: shard {j} rebuilt")
        man = writer.finish()
    read_manifest(store_dir)
    return man
