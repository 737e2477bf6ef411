"""Export a top-k store to parquet in the Hugging Face ``datasets`` layout, and import it back.

``nitrobrew topk-export STORE DIR`` writes ``DIR/data/train-{j:05d}-of-{n:05d}.parquet``, one file
per store shard (``datasets.load_dataset("parquet", data_dir=DIR)`` or ``load_dataset(DIR)`` reads
it; it can be pushed to the Hub as it is). One row per sequence of L tokens:

- ``input_ids`` list<int32> [L], ``attention_mask`` list<int8> [L] (ones), ``labels`` list<int32> [L]
  (the ids: a causal LM's trainer shifts them);
- ``target_token_ids`` list<fixed_size_list<int32, K>> [L], ``target_logprobs``
  list<fixed_size_list<float32, K>> [L], ``target_mask`` list<fixed_size_list<int8, K>> [L]: the
  columns Axolotl's KD plugin reads. Position i holds the teacher's top-k over token i + 1 (its
  output at position i, the store's row i); the last position has no target inside the sequence:
  mask 0, id 0, log-prob -inf.

Log-probs are written as float32 whatever the store's dtype (float16 and bfloat16 widen exactly;
a uint8 store's dequantized values, plus its codes and scales in ``nitrobrew_logprob_codes`` and
``nitrobrew_logprob_scale``).
Each file's schema metadata (``nitrobrew_topk``) carries the store's header, so ``nitrobrew
topk-import DIR STORE`` rebuilds the same store bit for bit (same shards, same manifest). Data
from elsewhere (no such metadata) needs ``--temperature`` and ``--vocab-size``; its masked entries
become padding entries (id 0, log-prob -inf, which the loss ignores).
"""

from __future__ import annotations

import argparse
import glob
import io
import json
import os
import sys
from typing import Dict, Iterator, List, Optional, Tuple

import numpy as np
import torch

from ..core.atomic_io import atomic_write_bytes
from .store import (
    HEADER_KEYS,
    LOGPROB_DTYPES,
    QUANTIZED,
    StoreError,
    TopKStore,
    TopKWriter,
    dequantize_logprobs,
    unpack_ids,
)

META_KEY = b"nitrobrew_topk"
COLUMNS = ("input_ids", "attention_mask", "labels", "target_token_ids", "target_logprobs", "target_mask")


def _pyarrow():
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError as err:
        raise ImportError("parquet export and import need pyarrow: pip install 'nitrobrew[interop]'") from err
    return pa, pq


def _shard_table(tensors: Dict[str, torch.Tensor], header: Dict, index: int):
    """One store shard as an Arrow table of one row per sequence."""
    pa, _ = _pyarrow()
    K = header["k"]
    so = tensors["seq_offsets"]
    P = int(so[-1])
    real = torch.ones(P, dtype=torch.bool)
    lengths = so.diff()
    real[(so[1:] - 1)[lengths > 0]] = False  # each sequence's last position has no stored row
    ids = torch.zeros(P, K, dtype=torch.int32)
    lp = torch.full((P, K), float("-inf"), dtype=torch.float32)
    mask = torch.zeros(P, K, dtype=torch.int8)
    ids[real] = unpack_ids(tensors["topk_ids"]).to(torch.int32)
    quantized = header["logprob_dtype"] == QUANTIZED
    if quantized:
        lp[real] = dequantize_logprobs(tensors["topk_logprobs"], tensors["topk_lp_scale"])
        codes = torch.full((P, K), 255, dtype=torch.uint8)
        scale = torch.zeros(P, 2)
        codes[real], scale[real] = tensors["topk_logprobs"], tensors["topk_lp_scale"]
    else:
        lp[real] = tensors["topk_logprobs"].float()
    mask[real] = 1
    offsets = pa.array(so.to(torch.int32).numpy())  # per-shard token counts fit int32

    def per_position(values: np.ndarray, width: int = K):
        return pa.ListArray.from_arrays(offsets, pa.FixedSizeListArray.from_arrays(pa.array(values.reshape(-1)), width))

    tokens = tensors["input_ids"].numpy()
    cols = {
        "input_ids": pa.ListArray.from_arrays(offsets, pa.array(tokens)),
        "attention_mask": pa.ListArray.from_arrays(offsets, pa.array(np.ones(P, dtype=np.int8))),
        "labels": pa.ListArray.from_arrays(offsets, pa.array(tokens)),
        "target_token_ids": per_position(ids.numpy()),
        "target_logprobs": per_position(lp.numpy()),
        "target_mask": per_position(mask.numpy()),
    }
    if quantized:  # the codes themselves, so that an import rebuilds the same bytes
        cols["nitrobrew_logprob_codes"] = per_position(codes.numpy())
        cols["nitrobrew_logprob_scale"] = per_position(scale.numpy(), 2)
    meta = {META_KEY: json.dumps(dict(header, shard=index), sort_keys=True).encode()}
    return pa.table(cols).replace_schema_metadata(meta)


def export_store(store_dir: str, out_dir: str, log=None) -> List[str]:
    """Write the store at store_dir as parquet files under out_dir/data; returns their paths."""
    _, pq = _pyarrow()
    from safetensors.torch import load_file

    store = TopKStore(store_dir)  # complete, schema-checked
    man = store.manifest
    if os.path.exists(out_dir) and os.listdir(out_dir):
        raise FileExistsError(f"{out_dir!r} exists and is not empty: export into a new directory")
    header = {k: man[k] for k in HEADER_KEYS}
    n = len(store.shards)
    os.makedirs(os.path.join(out_dir, "data"), exist_ok=True)
    paths = []
    for j, info in enumerate(store.shards):
        store._shard(j)  # size and sha256 check
        tensors = load_file(os.path.join(store_dir, info["file"]))
        buf = io.BytesIO()
        pq.write_table(_shard_table(tensors, header, info["index"]), buf)
        path = os.path.join(out_dir, "data", f"train-{j:05d}-of-{n:05d}.parquet")
        atomic_write_bytes(path, buf.getvalue())
        paths.append(path)
        if log:
            log(f"{path}: {info['sequences']} sequences")
    return paths


def _parquet_files(src: str) -> List[str]:
    if os.path.isfile(src):
        return [src]
    files = sorted(glob.glob(os.path.join(src, "**", "*.parquet"), recursive=True))
    if not files:
        raise FileNotFoundError(f"no parquet files under {src!r}")
    return files


def _flat(col, depth: int, where: str):
    """(offsets [rows + 1] from 0, values) of a list column nested `depth` deep (the outer offsets)."""
    offs = col.offsets.to_numpy().astype(np.int64)
    vals = col.flatten()
    for _ in range(depth - 1):
        vals = vals.flatten()
    if vals.null_count:
        raise ValueError(f"{where}: null entries")
    return offs - offs[0], vals.to_numpy(zero_copy_only=False)


def _sequences(files: List[str]) -> Iterator[Tuple]:
    """(where, input_ids [L], ids [L - 1, K], log-probs [L - 1, K] float32, None or the uint8 codes
    and scales of a quantized store) per row of the files."""
    _, pq = _pyarrow()
    for path in files:
        pf = pq.ParquetFile(path)
        names = pf.schema_arrow.names
        missing = [c for c in ("input_ids", "target_token_ids", "target_logprobs") if c not in names]
        if missing:
            raise ValueError(f"{path}: lacks the columns {missing} (has {names})")
        cols = [
            c
            for c in (
                "input_ids",
                "target_token_ids",
                "target_logprobs",
                "target_mask",
                "nitrobrew_logprob_codes",
                "nitrobrew_logprob_scale",
            )
            if c in names
        ]
        row = 0
        for batch in pf.iter_batches(columns=cols, batch_size=1024):
            where = f"{path}: rows {row}-{row + batch.num_rows - 1}"
            so, tok = _flat(batch.column("input_ids"), 1, where)
            P = int(so[-1])
            flat = {}
            for c in cols[1:]:
                offs, vals = _flat(batch.column(c), 2, where)
                if not np.array_equal(offs, so) or P == 0 and vals.size or P and vals.size % P:
                    raise ValueError(f"{where}: {c} must have one row of K entries per token position")
                flat[c] = vals.reshape(P, -1) if P else vals.reshape(0, 0)
            ids = torch.from_numpy(flat["target_token_ids"].astype(np.int64))
            lp = torch.from_numpy(flat["target_logprobs"].astype(np.float32))
            if "target_mask" in flat:
                m = torch.from_numpy(flat["target_mask"].astype(bool))
                ids, lp = torch.where(m, ids, 0), torch.where(m, lp, float("-inf"))
            tok = torch.from_numpy(tok.astype(np.int32))
            codes = scale = None
            if "nitrobrew_logprob_codes" in flat and "nitrobrew_logprob_scale" in flat:
                codes = torch.from_numpy(flat["nitrobrew_logprob_codes"].astype(np.uint8))
                scale = torch.from_numpy(flat["nitrobrew_logprob_scale"].astype(np.float32)).reshape(-1, 2)
            for i in range(batch.num_rows):
                a, b = int(so[i]), int(so[i + 1])
                last = max(b - 1, a)  # the last position has no target inside the sequence
                q = None if codes is None else (codes[a:last], scale[a:last])
                yield f"{path}: row {row}", tok[a:b], ids[a:last], lp[a:last], q
                row += 1


def import_store(
    src: str,
    out_dir: str,
    *,
    temperature: Optional[float] = None,
    vocab_size: Optional[int] = None,
    sequences_per_shard: Optional[int] = None,
    logprob_dtype: Optional[str] = None,
    model: Optional[str] = None,
    log=None,
) -> Dict:
    """Build a store at out_dir from parquet files (a file, or a directory searched recursively)."""
    _, pq = _pyarrow()
    if os.path.exists(out_dir) and os.listdir(out_dir):
        raise FileExistsError(f"{out_dir!r} exists and is not empty: import into a new directory")
    files = _parquet_files(src)
    metas = [(pq.read_schema(f).metadata or {}).get(META_KEY) for f in files]
    num_rows = sum(pq.ParquetFile(f).metadata.num_rows for f in files)
    given = {
        "temperature": temperature,
        "vocab_size": vocab_size,
        "sequences_per_shard": sequences_per_shard,
        "logprob_dtype": logprob_dtype,
        "model": model,
    }
    if all(metas):
        heads = [json.loads(m) for m in metas]
        header = {k: heads[0][k] for k in HEADER_KEYS}
        if any({k: h[k] for k in HEADER_KEYS} != header for h in heads):
            raise ValueError(f"the parquet files under {src!r} come from different stores")
        clash = {k: v for k, v in given.items() if v is not None and v != header[k]}
        if clash:
            raise ValueError(f"{src!r} was exported from a store whose settings differ from {clash}")
    else:
        if temperature is None or vocab_size is None:
            raise ValueError(
                f"{src!r} was not exported by nitrobrew: pass --temperature (the log-probs' temperature) "
                "and --vocab-size"
            )
        first = next(_sequences(files[:1]), None)
        k = 1 if first is None else max(int(first[2].shape[-1]), 1)
        header = {
            "model": model or "imported",
            "k": k,
            "temperature": float(temperature),
            "logprob_dtype": logprob_dtype or "float32",
            "vocab_size": int(vocab_size),
            "head_rows": int(vocab_size),
            "sequences_per_shard": sequences_per_shard or 1024,
            "source": {"parquet": os.path.abspath(src)},
            "num_sequences": num_rows,
            "id_dtype": "int32",
        }
    if header["num_sequences"] != num_rows:
        raise ValueError(f"{src!r} holds {num_rows} sequences, its metadata says {header['num_sequences']}")
    K, S = header["k"], header["sequences_per_shard"]
    with TopKWriter(out_dir, resume=False, **header) as writer:
        group: List[Tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        j = 0
        raw = header["logprob_dtype"] == QUANTIZED and metas[0] is not None

        def flush(j, group):
            toks, ids, lps, qs = zip(*group)
            if raw:  # the stored codes and scales, as they were
                writer.write_shard(j, toks, ids, [q[0] for q in qs], quantized=[q[1] for q in qs])
            else:
                writer.write_shard(j, toks, ids, lps)
            if log:
                log(f"shard {j} written")

        for where, tok, ids, lp, q in _sequences(files):
            rows = max(tok.numel() - 1, 0)
            if rows and ids.shape != (rows, K):
                raise ValueError(f"{where}: target rows are {tuple(ids.shape)}, expected ({rows}, {K})")
            if ids.numel() and (ids.min() < 0 or ids.max() >= header["vocab_size"]):
                raise ValueError(f"{where}: target ids outside [0, {header['vocab_size']})")
            if raw and q is None:
                raise ValueError(f"{where}: a uint8 store's export lacks its nitrobrew_logprob_codes column")
            if raw:
                q = (q[0].reshape(rows, K), q[1].reshape(rows, 2))
            group.append((tok, ids.reshape(rows, K), lp.reshape(rows, K), q))
            if len(group) == S:
                flush(j, group)
                group, j = [], j + 1
        if group:
            flush(j, group)
        return writer.finish()


def add_arguments(p: argparse.ArgumentParser) -> None:
    importing = p.prog.endswith("topk-import")
    p.description = __doc__.splitlines()[0]
    if importing:
        p.add_argument("src", help="parquet file, or a directory of them (searched recursively)")
        p.add_argument("out", help="the new store directory")
        p.add_argument(
            "--temperature", type=float, default=None, help="data from elsewhere: the log-probs' temperature"
        )
        p.add_argument("--vocab-size", type=int, default=None, help="data from elsewhere: the vocabulary")
        p.add_argument("--sequences-per-shard", type=int, default=None, help="data from elsewhere (default 1024)")
        p.add_argument(
            "--logprob-dtype",
            choices=sorted(LOGPROB_DTYPES),
            default=None,
            help="data from elsewhere (default float32)",
        )
        p.add_argument("--model", default=None, help="data from elsewhere: the teacher's name")
    else:
        p.add_argument("store", help="the store directory")
        p.add_argument("out", help="a new directory for the parquet files")
    p.set_defaults(_importing=importing)


def run(args: argparse.Namespace) -> int:
    try:
        if args._importing:
            man = import_store(
                args.src,
                args.out,
                temperature=args.temperature,
                vocab_size=args.vocab_size,
                sequences_per_shard=args.sequences_per_shard,
                logprob_dtype=args.logprob_dtype,
                model=args.model,
            )
            print(f"wrote {args.out}: {man['num_sequences']} sequences, {man['num_rows']} rows, K = {man['k']}")
        else:
            paths = export_store(args.store, args.out)
            print(f"wrote {len(paths)} parquet files under {os.path.join(args.out, 'data')}")
    except (StoreError, ValueError, OSError, ImportError) as err:
        name = "topk-import" if args._importing else "topk-export"
        print(f"nitrobrew {name}: error: {str(err).splitlines()[0]}", file=sys.stderr)
        return 2
    return 0
