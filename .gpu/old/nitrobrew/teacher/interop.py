"""Export a top-k store to parquet in the Hugging Face ``datasets`` layout, and import it back.

``nitrobrew topk-export STORE DIR`` writes ``DIR/data/train-{j:05d}-of-{n:05d}.parquet``, one file
per store shard (``datasets.load_dataset("parquet", data_dir=DIR)`` or ``load_dataset(DIR)`` reads
it; it can be pushed to the Hub as it is). One row per sequence of L tokens:

- ``input_ids`` list<int32> [L], ``attention_mask`` list<int8> [L] (ones), ``labels`` list<int32> [L]
  (the ids, -100 at the first token: a causal LM's trainer shifts them, and under sample packing the
  last token of one sequence must not be trained to predict the first of the next);
- ``target_token_ids`` list<fixed_size_list<int32, K>> [L], ``target_logprobs``
  list<fixed_size_list<float32, K>> [L], ``target_mask`` list<fixed_size_list<int8, K>> [L]: the
  columns Axolotl's KD plugin reads. Position i holds the teacher's top-k over token i + 1 (its
  output at position i, the store's row i); the last position has no target inside the sequence:
  mask 0, id 0, log-prob -inf.

Log-probs are written as float32 whatever the store's dtype (float16 and bfloat16 widen exactly; a
uint8 store's dequantized values). ``--logprob-codes`` adds a uint8 store's codes and scales as
two more columns (``nitrobrew_logprob_codes``, ``nitrobrew_logprob_scale``), which an import needs
to rebuild the same bytes; Axolotl's collators cannot batch them, so they are off by default.

Each file's schema metadata (``nitrobrew_topk``) carries the store's header, the sha256 of the
store shard it came from and a sha256 of its own decoded columns; its pages carry CRCs. ``nitrobrew
topk-import DIR STORE`` checks all three (a changed byte is refused, never imported) and every
value (ids in the vocabulary and distinct within a row, log-probs <= 0 and not NaN, sorted), then
rebuilds the same store bit for bit (same shards, same manifest). Data from elsewhere (no such
metadata) needs ``--temperature`` and ``--vocab-size``; its masked entries become padding entries
(id 0, log-prob -inf, which the loss ignores) and its rows are sorted by log-prob. A refused
import leaves nothing behind.

The store's temperature lives in the metadata only: ``topk-export`` prints the Axolotl settings
that match it (``kd_temperature``; Axolotl's KD term carries T², nitrobrew's ``scale_t2=True``).
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import io
import json
import os
import shutil
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
    read_manifest,
    unpack_ids,
)

META_KEY = b"nitrobrew_topk"
COLUMNS = ("input_ids", "attention_mask", "labels", "target_token_ids", "target_logprobs", "target_mask")
CODE_COLUMNS = ("nitrobrew_logprob_codes", "nitrobrew_logprob_scale")
# the dtype of each column's values in the content checksum (what the export writes)
_DIGEST_DTYPES = {
    "input_ids": np.int32,
    "attention_mask": np.int8,
    "labels": np.int32,
    "target_token_ids": np.int32,
    "target_logprobs": np.float32,
    "target_mask": np.int8,
    "nitrobrew_logprob_codes": np.uint8,
    "nitrobrew_logprob_scale": np.float32,
}
IGNORE_INDEX = -100  # the label of a position that no loss trains (Hugging Face's convention)
# a top-1 log-prob is max - logsumexp, which rounding may leave a hair above 0 (as topk-verify)
_LOGPROB_SLACK = 1e-4


class _ContentDigest:
    """sha256 of a file's columns as decoded: the sequence lengths, then each column's values in a
    fixed dtype, whatever the batches they are read in."""

    def __init__(self, columns):
        self.columns = [c for c in _DIGEST_DTYPES if c in columns]
        self.lengths = hashlib.sha256()
        self.values = {c: hashlib.sha256() for c in self.columns}

    def update(self, lengths: np.ndarray, values: Dict[str, np.ndarray]) -> None:
        self.lengths.update(np.ascontiguousarray(lengths, dtype="<i8").tobytes())
        for c in self.columns:
            self.values[c].update(np.ascontiguousarray(values[c]).astype(_DIGEST_DTYPES[c], copy=False).tobytes())

    def hexdigest(self) -> str:
        h = hashlib.sha256(self.lengths.digest())
        for c in self.columns:
            h.update(c.encode() + self.values[c].digest())
        return h.hexdigest()


def _pyarrow():
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError as err:
        raise ImportError("parquet export and import need pyarrow: pip install 'nitrobrew[interop]'") from err
    return pa, pq


def _shard_table(tensors: Dict[str, torch.Tensor], header: Dict, index: int, sha256: str, codes: bool = False):
    """One store shard as an Arrow table of one row per sequence; `codes` adds a uint8 store's codes."""
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
        code = torch.full((P, K), 255, dtype=torch.uint8)
        scale = torch.zeros(P, 2)
        code[real], scale[real] = tensors["topk_logprobs"], tensors["topk_lp_scale"]
    else:
        lp[real] = tensors["topk_logprobs"].float()
    mask[real] = 1
    tokens = tensors["input_ids"].numpy()
    labels = tokens.copy()
    labels[so[:-1][lengths > 0].numpy()] = IGNORE_INDEX  # each sequence's first token predicts nothing
    values = {
        "input_ids": tokens,
        "attention_mask": np.ones(P, dtype=np.int8),
        "labels": labels,
        "target_token_ids": ids.numpy(),
        "target_logprobs": lp.numpy(),
        "target_mask": mask.numpy(),
    }
    if quantized and codes:  # the codes themselves, so that an import rebuilds the same bytes
        values["nitrobrew_logprob_codes"], values["nitrobrew_logprob_scale"] = code.numpy(), scale.numpy()
    offsets = pa.array(so.to(torch.int32).numpy())  # per-shard token counts fit int32
    cols = {}
    for name, v in values.items():
        flat = pa.array(v.reshape(-1))
        if v.ndim == 2:  # K (or 2) entries per position
            flat = pa.FixedSizeListArray.from_arrays(flat, v.shape[1])
        cols[name] = pa.ListArray.from_arrays(offsets, flat)
    digest = _ContentDigest(values)
    digest.update(lengths.numpy(), values)
    meta = dict(header, shard=index, shard_sha256=sha256, content_sha256=digest.hexdigest())
    return pa.table(cols).replace_schema_metadata({META_KEY: json.dumps(meta, sort_keys=True).encode()})


def axolotl_settings(temperature: float) -> str:
    """The Axolotl KD settings that read an export of a store at `temperature` as it was meant."""
    return (
        f"Axolotl: kd_temperature: {temperature:g} (the store's log-probs are at T = {temperature:g}; "
        "Axolotl uses them as stored and divides the student's logits by kd_temperature); its KD term "
        "is multiplied by kd_temperature^2, which is nitrobrew's topk_kl(..., scale_t2=True)"
    )


def export_store(store_dir: str, out_dir: str, log=None, codes: bool = False) -> List[str]:
    """Write the store at store_dir as parquet files under out_dir/data; returns their paths.

    `codes`: also write a uint8 store's codes and scales (an import then rebuilds its exact bytes;
    Axolotl's collators cannot batch these columns)."""
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
        table = _shard_table(tensors, header, info["index"], info["sha256"], codes=codes)
        pq.write_table(table, buf, write_page_checksum=True)  # a CRC per page, checked on import
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


def _file_meta(path: str) -> Optional[Dict]:
    _, pq = _pyarrow()
    raw = (pq.read_schema(path).metadata or {}).get(META_KEY)
    if raw is None:
        return None
    try:
        meta = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{path}: its nitrobrew_topk metadata is not valid JSON ({err})") from None
    missing = [k for k in HEADER_KEYS if k not in meta] if isinstance(meta, dict) else list(HEADER_KEYS)
    if missing:
        raise ValueError(f"{path}: its nitrobrew_topk metadata lacks {missing}")
    return meta


def _sequences(files: List[str], metas: List[Optional[Dict]]) -> Iterator[Tuple]:
    """(where, input_ids [L], ids [L - 1, K], log-probs [L - 1, K] float32, None or the uint8 codes
    and scales of a quantized store) per row of the files. A file whose metadata carries a content
    checksum is checked against it once read (before its last row is handed on)."""
    _, pq = _pyarrow()
    for path, meta in zip(files, metas):
        pf = pq.ParquetFile(path, page_checksum_verification=True)
        names = pf.schema_arrow.names
        missing = [c for c in ("input_ids", "target_token_ids", "target_logprobs") if c not in names]
        if missing:
            raise ValueError(f"{path}: lacks the columns {missing} (has {names})")
        expected = (meta or {}).get("content_sha256")
        cols = ["input_ids"] + [
            c for c in ("target_token_ids", "target_logprobs", "target_mask") + CODE_COLUMNS if c in names
        ]
        checked = [c for c in ("attention_mask", "labels") if c in names] if expected else []
        digest = _ContentDigest(cols + checked)
        row = 0
        held = None  # the last row waits for the file's checksum
        for batch in pf.iter_batches(columns=cols + checked, batch_size=1024):
            where = f"{path}: rows {row}-{row + batch.num_rows - 1}"
            so, tok = _flat(batch.column("input_ids"), 1, where)
            P = int(so[-1])
            flat = {"input_ids": tok}
            for c in cols[1:] + checked:
                depth = 1 if c in checked else 2
                offs, vals = _flat(batch.column(c), depth, where)
                if not np.array_equal(offs, so) or (depth == 1 and vals.size != P):
                    raise ValueError(f"{where}: {c} must have one entry per token position")
                if depth == 2 and (P == 0 and vals.size or P and vals.size % P):
                    raise ValueError(f"{where}: {c} must have one row of K entries per token position")
                flat[c] = vals.reshape(P, -1) if depth == 2 and P else vals
            if expected:
                digest.update(np.diff(so), flat)
            ids = torch.from_numpy(flat["target_token_ids"].astype(np.int64))
            lp = torch.from_numpy(flat["target_logprobs"].astype(np.float32))
            if "target_mask" in flat:
                m = torch.from_numpy(flat["target_mask"].astype(bool))
                ids, lp = torch.where(m, ids, 0), torch.where(m, lp, float("-inf"))
            tok = torch.from_numpy(tok.astype(np.int64))
            codes = scale = None
            if all(c in flat for c in CODE_COLUMNS):
                codes = torch.from_numpy(flat[CODE_COLUMNS[0]].astype(np.uint8))
                scale = torch.from_numpy(flat[CODE_COLUMNS[1]].astype(np.float32)).reshape(-1, 2)
            for i in range(batch.num_rows):
                a, b = int(so[i]), int(so[i + 1])
                last = max(b - 1, a)  # the last position has no target inside the sequence
                q = None if codes is None else (codes[a:last], scale[a:last])
                if held is not None:
                    yield held
                held = (f"{path}: row {row}", tok[a:b], ids[a:last], lp[a:last], q)
                row += 1
        if expected and digest.hexdigest() != expected:
            raise ValueError(
                f"{path} is corrupted: its contents do not match the sha256 written at export "
                f"({digest.hexdigest()[:16]}... vs {expected[:16]}...)"
            )
        if held is not None:
            yield held


def _check_values(where: str, tok: torch.Tensor, ids: torch.Tensor, lp: torch.Tensor, header: Dict, sort: bool):
    """The checks topk-verify makes of a stored row, made before it is written; returns (ids, lp),
    sorted by decreasing log-prob when `sort` (data from elsewhere)."""
    V, rows = header["vocab_size"], header["head_rows"]
    if tok.numel() and (tok.min() < 0 or tok.max() >= rows):
        raise ValueError(f"{where}: input ids outside [0, {rows}) (the teacher's vocabulary)")
    if not ids.numel():
        return ids, lp
    if ids.min() < 0 or ids.max() >= V:
        bad = int(ids[(ids < 0) | (ids >= V)][0])
        raise ValueError(f"{where}: target id {bad} outside [0, {V}) (the vocabulary)")
    if torch.isnan(lp).any() or (lp > _LOGPROB_SLACK).any():
        bad = float(lp[torch.isnan(lp) | (lp > _LOGPROB_SLACK)][0])
        raise ValueError(f"{where}: log-prob {bad:.6g} (log-probs must be <= 0, finite or -inf for padding)")
    pad = lp == float("-inf")  # padding entries may repeat their id
    srt = torch.where(pad, -1 - torch.arange(ids.shape[1]), ids).sort(1).values
    if (srt[:, 1:] == srt[:, :-1]).any():
        r = int((srt[:, 1:] == srt[:, :-1]).any(1).nonzero()[0])
        raise ValueError(f"{where}: position {r} repeats a target id ({ids[r].tolist()[:8]})")
    if sort:
        order = lp.sort(dim=1, descending=True, stable=True).indices
        ids, lp = ids.gather(1, order), lp.gather(1, order)
    elif (lp[:, 1:] > lp[:, :-1]).any():
        raise ValueError(f"{where}: log-probs are not sorted in decreasing order")
    return ids, lp


def _remove_partial(out_dir: str, created: bool) -> None:
    """Undo a refused import: the directory was new or empty, so everything in it is the import's."""
    if not os.path.isdir(out_dir):
        return
    for name in os.listdir(out_dir):
        path = os.path.join(out_dir, name)
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)
        else:
            os.unlink(path)
    if created:
        os.rmdir(out_dir)


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
    """Build a store at out_dir from parquet files (a file, or a directory searched recursively).

    Every value is checked as ``topk-verify`` would, an export's checksums are checked, and a
    refused import removes what it wrote (out_dir is left as it was: absent, or empty)."""
    _, pq = _pyarrow()
    if os.path.exists(out_dir) and os.listdir(out_dir):
        raise FileExistsError(f"{out_dir!r} exists and is not empty: import into a new directory")
    files = _parquet_files(src)
    metas = [_file_meta(f) for f in files]
    num_rows = sum(pq.ParquetFile(f).metadata.num_rows for f in files)
    given = {
        "temperature": temperature,
        "vocab_size": vocab_size,
        "sequences_per_shard": sequences_per_shard,
        "logprob_dtype": logprob_dtype,
        "model": model,
    }
    exported = all(m is not None for m in metas)
    if exported:
        header = {k: metas[0][k] for k in HEADER_KEYS}
        if any({k: h[k] for k in HEADER_KEYS} != header for h in metas):
            raise ValueError(f"the parquet files under {src!r} come from different stores")
        clash = {k: v for k, v in given.items() if v is not None and v != header[k]}
        if clash:
            raise ValueError(f"{src!r} was exported from a store whose settings differ from {clash}")
        if [m.get("shard") for m in metas] != list(range(len(files))):
            raise ValueError(
                f"{src!r} must hold one export's files, each once, in order: their shards are "
                f"{[m.get('shard') for m in metas]}"
            )
    else:
        if temperature is None or vocab_size is None:
            raise ValueError(
                f"{src!r} was not exported by nitrobrew: pass --temperature (the log-probs' temperature) "
                "and --vocab-size"
            )
        first = next(_sequences(files[:1], [None]), None)
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
    quantized = header["logprob_dtype"] == QUANTIZED
    # the codes travel (or the store is not uint8): the rebuilt shards are the source's, byte for byte
    raw = quantized and exported and all(c in pq.read_schema(f).names for f in files for c in CODE_COLUMNS)
    exact = exported and (raw or not quantized)
    shard_sha = {m["shard"]: m.get("shard_sha256") for m in metas} if exact else {}
    created = not os.path.exists(out_dir)
    writer = TopKWriter(out_dir, resume=False, **header)  # takes the lock: from here on, out_dir is ours
    try:
        group: List[Tuple] = []
        j = 0

        def flush(j, group):
            toks, ids, lps, qs = zip(*group)
            expect = shard_sha.get(j)
            if raw:  # the stored codes and scales, as they were
                writer.write_shard(j, toks, ids, [q[0] for q in qs], quantized=[q[1] for q in qs], sha256=expect)
            else:
                writer.write_shard(j, toks, ids, lps, sha256=expect)
            if log:
                log(f"shard {j} written")

        for where, tok, ids, lp, q in _sequences(files, metas):
            rows = max(tok.numel() - 1, 0)
            if rows and ids.shape != (rows, K):
                raise ValueError(f"{where}: target rows are {tuple(ids.shape)}, expected ({rows}, {K})")
            ids, lp = ids.reshape(rows, K), lp.reshape(rows, K)
            if raw:
                if q is None:
                    raise ValueError(f"{where}: a uint8 store's export lacks its nitrobrew_logprob_codes column")
                q = (q[0].reshape(rows, K), q[1].reshape(rows, 2))
                if not torch.isfinite(q[1]).all() or (q[1][:, 1] < 0).any():
                    raise ValueError(f"{where}: nitrobrew_logprob_scale must be finite with a step >= 0")
                _check_values(where, tok, ids, dequantize_logprobs(*q), header, sort=False)
            else:
                ids, lp = _check_values(where, tok, ids, lp, header, sort=not exported)
            group.append((tok, ids, lp, q))
            if len(group) == S:
                flush(j, group)
                group, j = [], j + 1
        if group:
            flush(j, group)
        man = writer.finish()
    except BaseException:
        writer.close()
        _remove_partial(out_dir, created)
        raise
    writer.close()
    return man


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
        p.add_argument(
            "--logprob-codes",
            action="store_true",
            help="a uint8 store: also write its codes and scales (an import rebuilds the same bytes; "
            "Axolotl's collators cannot batch these columns)",
        )
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
            paths = export_store(args.store, args.out, codes=args.logprob_codes)
            print(f"wrote {len(paths)} parquet files under {os.path.join(args.out, 'data')}")
            print(axolotl_settings(read_manifest(args.store)["temperature"]))
    except Exception as err:
        # pyarrow's own errors (a file it cannot decode) are one line too
        if not isinstance(err, (StoreError, ValueError, OSError, ImportError)) and not type(err).__module__.startswith(
            "pyarrow"
        ):
            raise
        name = "topk-import" if args._importing else "topk-export"
        print(f"nitrobrew {name}: error: {str(err).splitlines()[0]}", file=sys.stderr)
        return 2
    return 0
