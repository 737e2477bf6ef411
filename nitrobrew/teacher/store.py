"""On-disk store of a teacher's top-k next-token log-probs.

Layout of a store directory::

    manifest.json                 header + list of completed shards
    shard-00000.safetensors       sequences [0, S)
    shard-00001.safetensors       sequences [S, 2S) ...

Shard j holds the sequences [j * S, (j + 1) * S) of the corpus (S = ``sequences_per_shard``),
as five tensors:

- ``input_ids`` int32 [tokens]: the sequences' tokens, concatenated;
- ``seq_offsets`` int64 [n + 1]: sequence i's tokens are ``input_ids[seq_offsets[i]:seq_offsets[i+1]]``;
- ``row_offsets`` int64 [n + 1]: sequence i's rows are ``topk_*[row_offsets[i]:row_offsets[i+1]]``;
- ``topk_ids`` int32 [rows, K] (or uint8 [rows, K, 2 or 3], see ``pack_ids``), ``topk_logprobs``
  [rows, K] (float32, float16 or bfloat16; or
  uint8 codes with ``topk_lp_scale`` float32 [rows, 2], see ``quantize_logprobs``), sorted by
  decreasing log-prob.

Alignment: a sequence of L tokens has L - 1 rows, and row i is the teacher's distribution over
token i + 1 given tokens 0..i, i.e. the teacher's output at position i. The last position has no
target inside the sequence and is not stored. Log-probs are log-softmax(logits / T) over the
teacher's real vocabulary [0, vocab_size) (padded head rows excluded), T the recorded temperature.

Every write goes to a temporary file in the same directory and is moved into place with
``os.replace`` (shards first, then the manifest), so an interrupted extraction leaves only
complete shards listed; the manifest records each shard's byte size and sha256, which the reader
checks (once per process and shard), naming the shard that is truncated or corrupted. Files get
the umask's mode. A writer holds an exclusive lock on the store (``.lock``); an extraction split
over processes writes one part manifest per process, merged into ``manifest.json`` by the last
part (``TopKWriter``). The manifest is checked against a schema when read (``validate_manifest``).
"""

from __future__ import annotations

import bisect
import hashlib
import json
import math
import os
import warnings
from collections import OrderedDict
from dataclasses import asdict, dataclass
from typing import Callable, Dict, List, Optional, Sequence

import torch

from ..core.atomic_io import atomic_write_bytes

FORMAT = "nitrobrew-topk"
VERSION = 1
MANIFEST = "manifest.json"
LOGPROB_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "uint8": torch.uint8}
QUANTIZED = "uint8"  # codes + a per-row scale (see quantize_logprobs)
# top-k ids: int32 [rows, K], or packed little-endian into 2 or 3 bytes ([rows, K, n] uint8) when the
# vocabulary fits: the ids are most of a position's bytes
ID_DTYPES = {"int32": (4, 1 << 31), "uint16": (2, 1 << 16), "uint24": (3, 1 << 24)}
ALIGNMENT = (
    "row i of a sequence of L tokens (0 <= i < L - 1) is the teacher's distribution over token i + 1; "
    "the last position is not stored"
)
# header fields that must agree when an extraction resumes into an existing store
HEADER_KEYS = (
    "model",
    "k",
    "temperature",
    "logprob_dtype",
    "vocab_size",
    "head_rows",
    "sequences_per_shard",
    "source",
    "num_sequences",
    "id_dtype",
)


class StoreError(ValueError):
    """A store that cannot be read or resumed as it is (mismatch, missing, truncated, corrupted)."""


def _safetensors():
    try:
        import safetensors.torch as st
    except ImportError as err:  # pragma: no cover - safetensors is in the hf/store extras
        raise ImportError("the top-k store needs safetensors: pip install 'nitrobrew[store]'") from err
    return st


def sha256_file(path: str, block: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while True:
            chunk = f.read(block)
            if not chunk:
                break
            h.update(chunk)
    return h.hexdigest()


def shard_name(index: int) -> str:
    return f"shard-{index:05d}.safetensors"


def part_manifest_name(part: int, num_parts: int) -> str:
    return f"manifest.part-{part:05d}-of-{num_parts:05d}.json"


def row_start(prompt_length: int) -> int:
    """The first counted position of a sequence whose first `prompt_length` tokens are its prompt (a
    rollout's): only the positions that predict completion tokens count."""
    return max(int(prompt_length) - 1, 0)


def quantize_logprobs(lp: torch.Tensor):
    """uint8 codes [R, K] and a float32 scale [R, 2] = (top, step) with
    ``lp ~ top - (code * step)^2``; code 255 stands for -inf (a padding entry).

    Square-root spacing: a row's top log-prob is exact (code 0) and the resolution is finest where
    the mass is: at a distance x below the top the error is at most ``step * sqrt(x)`` (half a
    step in sqrt(x)), with ``step = sqrt(range) / 254``; uniform steps over a 12-nat range would
    err by 0.024 nats at the top entries too.
    """
    lp = lp.float()
    finite = torch.isfinite(lp)
    ninf = torch.tensor(float("-inf"))
    top = torch.where(finite, lp, ninf).amax(1) if lp.shape[1] else torch.zeros(lp.shape[0])
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    depth = torch.where(finite, (top[:, None] - lp).clamp(min=0), torch.zeros_like(lp)).sqrt()
    step = (depth.amax(1) if lp.shape[1] else torch.zeros(lp.shape[0])) / 254
    code = torch.where(step[:, None] > 0, depth / step[:, None].clamp(min=1e-30), torch.zeros_like(lp))
    code = torch.where(finite, code.round().clamp(0, 254), torch.full_like(lp, 255))
    return code.to(torch.uint8), torch.stack([top, step], 1).contiguous()


def pack_ids(ids: torch.Tensor, id_dtype: str) -> torch.Tensor:
    """[R, K] ids as stored: int32, or [R, K, n] uint8 (little-endian bytes) for uint16 / uint24."""
    if id_dtype == "int32":
        return ids.to(torch.int32)
    n = ID_DTYPES[id_dtype][0]
    ids = ids.to(torch.int64)
    return torch.stack([(ids >> (8 * b)) & 0xFF for b in range(n)], -1).to(torch.uint8)


def unpack_ids(stored: torch.Tensor) -> torch.Tensor:
    """int64 [R, K] from pack_ids' output."""
    if stored.dim() == 2:
        return stored.long()
    out = torch.zeros(stored.shape[:2], dtype=torch.int64)
    for b in range(stored.shape[2]):
        out |= stored[..., b].long() << (8 * b)
    return out


def dequantize_logprobs(code: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    scale = scale.float()
    lp = scale[:, :1] - (code.float() * scale[:, 1:]).square()
    return torch.where(code == 255, float("-inf"), lp)


@dataclass
class ShardInfo:
    index: int
    file: str
    first_sequence: int
    sequences: int
    rows: int
    tokens: int
    bytes: int
    sha256: str


# ------------------------------------------------------------------------------- manifest schema


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


_HEADER_SCHEMA = {
    "model": str,
    "k": int,
    "temperature": float,
    "logprob_dtype": str,
    "id_dtype": str,
    "vocab_size": int,
    "head_rows": int,
    "sequences_per_shard": int,
    "num_sequences": int,
    "source": dict,
    "shards": list,
    "complete": bool,
}
_SHARD_SCHEMA = {
    "index": int,
    "file": str,
    "first_sequence": int,
    "sequences": int,
    "rows": int,
    "tokens": int,
    "bytes": int,
    "sha256": str,
}


def _check_fields(obj, schema: Dict, where: str) -> None:
    if not isinstance(obj, dict):
        raise StoreError(f"{where} must be a JSON object, got {type(obj).__name__}")
    for key, kind in schema.items():
        if key not in obj:
            raise StoreError(f"{where} lacks the field {key!r}")
        value = obj[key]
        ok = (
            _is_int(value)
            if kind is int
            else (_is_int(value) or isinstance(value, float))
            if kind is float
            else isinstance(value, kind)
        )
        if not ok:
            raise StoreError(f"{where}: field {key!r} must be {kind.__name__}, got {value!r}")


def _check_topk_header(man: Dict, where: str) -> None:
    k, V, rows = man["k"], man["vocab_size"], man["head_rows"]
    if not 0 < V <= rows:
        raise StoreError(f"{where}: vocab_size {V} must be in [1, head_rows = {rows}]")
    if not 0 < k <= V:
        raise StoreError(f"{where}: k {k} must be in [1, vocab_size = {V}]")
    if not (math.isfinite(man["temperature"]) and man["temperature"] > 0):
        raise StoreError(f"{where}: temperature must be finite and > 0, got {man['temperature']!r}")
    if man["logprob_dtype"] not in LOGPROB_DTYPES:
        raise StoreError(f"{where}: logprob_dtype {man['logprob_dtype']!r} is not one of {sorted(LOGPROB_DTYPES)}")
    if man["id_dtype"] not in ID_DTYPES or V > ID_DTYPES[man["id_dtype"]][1]:
        raise StoreError(
            f"{where}: id_dtype {man['id_dtype']!r} cannot hold a vocabulary of {V} (one of {sorted(ID_DTYPES)})"
        )


@dataclass(frozen=True)
class ManifestFormat:
    """What sets one sharded format's manifest apart (the top-k store, the hidden store, a rollout set):
    its name and version, what it is called in messages, its header's schema and checks, its shards'
    file names, the alignment note it records, and whether a complete manifest's row and token totals
    are checked against its shards. Everything else about a manifest is read and checked once, here."""

    name: str
    version: int
    kind: str  # "top-k store": "'DIR' is not a top-k store"
    header_schema: Dict[str, type]
    check_header: Optional[Callable[[Dict, str], None]] = None  # raises StoreError
    shard_file: Callable[[int], str] = shard_name
    alignment: Optional[str] = None
    check_totals: bool = False

    def fresh(self, header: Dict) -> Dict:
        """A new manifest with `header` and no shards."""
        note = {} if self.alignment is None else {"alignment": self.alignment}
        return {"format": self.name, "version": self.version, **header, **note, "shards": [], "complete": False}


TOPK_MANIFEST = ManifestFormat(
    name=FORMAT,
    version=VERSION,
    kind="top-k store",
    header_schema=_HEADER_SCHEMA,
    check_header=_check_topk_header,
    alignment=ALIGNMENT,
    check_totals=True,
)


def validate_manifest(man, where: str, part: bool = False, fmt: ManifestFormat = TOPK_MANIFEST) -> None:
    """Raise StoreError naming the first problem of a manifest (fields, types, ranges, shard list)."""
    _check_fields(man, fmt.header_schema, where)
    if fmt.check_header is not None:
        fmt.check_header(man, where)
    S, n = man["sequences_per_shard"], man["num_sequences"]
    if S <= 0 or n < 0:
        raise StoreError(f"{where}: sequences_per_shard must be > 0 and num_sequences >= 0, got {S} and {n}")
    num_shards = (n + S - 1) // S
    seen = set()
    for pos, info in enumerate(man["shards"]):
        _check_fields(info, _SHARD_SCHEMA, f"{where}: shards[{pos}]")
        j = info["index"]
        if not 0 <= j < num_shards:
            raise StoreError(f"{where}: shards[{pos}] has index {j}, outside [0, {num_shards})")
        if j in seen:
            raise StoreError(f"{where}: shard {j} is listed twice")
        seen.add(j)
        name = fmt.shard_file(j)
        if info["file"] != name:  # also keeps a crafted manifest from naming files outside the store
            raise StoreError(f"{where}: shard {j}'s file must be {name!r}, got {info['file']!r}")
        first, count = j * S, min((j + 1) * S, n) - j * S
        if (info["first_sequence"], info["sequences"]) != (first, count):
            raise StoreError(
                f"{where}: shard {j} must hold sequences [{first}, {first + count}), the manifest says "
                f"[{info['first_sequence']}, {info['first_sequence'] + info['sequences']})"
            )
        if min(info["rows"], info["tokens"], info["bytes"]) < 0 or len(info["sha256"]) != 64:
            raise StoreError(f"{where}: shard {j} has a negative size or a malformed sha256")
    if man["complete"] and not part:
        missing = sorted(set(range(num_shards)) - seen)
        if missing:
            raise StoreError(f"{where} is marked complete but lacks shards {missing[:8]} of {num_shards}")
        for key, field in (("num_rows", "rows"), ("num_tokens", "tokens")) if fmt.check_totals else ():
            if key in man and man[key] != sum(s[field] for s in man["shards"]):
                raise StoreError(f"{where}: {key} {man[key]!r} is not the sum of its shards' {field}")
    if [s["index"] for s in man["shards"]] != sorted(seen):
        raise StoreError(f"{where}: shards must be listed by increasing index")


def read_manifest(path: str, name: str = MANIFEST, fmt: ManifestFormat = TOPK_MANIFEST) -> Dict:
    """The manifest `name` of the directory `path`, checked (``validate_manifest``) as one of `fmt`."""
    mpath = os.path.join(path, name)
    if not os.path.exists(mpath):
        raise StoreError(f"{path!r} is not a {fmt.kind}: {name} is missing")
    try:
        with open(mpath) as f:
            man = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise StoreError(f"{mpath} is not valid JSON ({err})") from err
    if not isinstance(man, dict) or man.get("format") != fmt.name:
        found = man.get("format") if isinstance(man, dict) else None
        raise StoreError(f"{mpath} is not a {fmt.name} manifest (format={found!r})")
    if man.get("version") != fmt.version:
        raise StoreError(f"{mpath} has format version {man.get('version')!r}; this nitrobrew reads {fmt.version}")
    validate_manifest(man, mpath, part=name != MANIFEST, fmt=fmt)
    return man


def manifest_format(path: str) -> Optional[str]:
    """The format named by the manifest of the directory `path` (None when there is none)."""
    try:
        with open(os.path.join(path, MANIFEST)) as f:
            man = json.load(f)
    except (OSError, ValueError):
        return None
    return man.get("format") if isinstance(man, dict) else None


def verify_shard(path: str, info: Dict) -> None:
    """Raise StoreError naming the shard if it is missing, truncated or corrupted."""
    fpath = os.path.join(path, info["file"])
    if not os.path.exists(fpath):
        raise StoreError(f"shard {info['file']} listed in {os.path.join(path, MANIFEST)} is missing")
    size = os.path.getsize(fpath)
    if size != info["bytes"]:
        raise StoreError(f"shard {fpath} is truncated or corrupted: {size} bytes, the manifest says {info['bytes']}")
    digest = sha256_file(fpath)
    if digest != info["sha256"]:
        raise StoreError(
            f"shard {fpath} is corrupted: sha256 {digest[:16]}... does not match the manifest's "
            f"{info['sha256'][:16]}..."
        )


class _Lock:
    """An exclusive, non-waiting lock on a file of the store (released when the process dies)."""

    def __init__(self, path: str, what: str, timeout: float = 0):
        from filelock import FileLock, Timeout  # a dependency of torch itself

        self._lock = FileLock(path, timeout=timeout)
        try:
            self._lock.acquire()
        except Timeout:
            raise StoreError(
                f"{what} (lock {path} is held); wait for it to finish, or use another output directory"
            ) from None

    def release(self) -> None:
        self._lock.release()


def lock_store(path: str, num_parts: int = 1, part: int = 0) -> _Lock:
    """The exclusive lock a writer of `path` (or of its part) holds; StoreError at once if another
    process holds it. Taken before a long setup (loading a teacher), then handed to TopKWriter."""
    os.makedirs(path, exist_ok=True)
    if num_parts == 1:
        return _Lock(os.path.join(path, ".lock"), f"another extraction is writing into {path!r}")
    return _Lock(
        os.path.join(path, f".lock-part-{part}-of-{num_parts}"),
        f"another extraction of part {part} of {num_parts} is writing into {path!r}",
    )


def check_header(
    k,
    temperature,
    vocab_size: int,
    head_rows: int,
    logprob_dtype: str,
    sequences_per_shard,
    num_sequences,
    id_dtype: str = "int32",
) -> None:
    """ValueError for settings a store cannot hold (before anything is written)."""
    if not (_is_int(vocab_size) and _is_int(head_rows) and 0 < vocab_size <= head_rows):
        raise ValueError(f"vocab_size must be an int in [1, {head_rows}] (the head's rows), got {vocab_size!r}")
    if not (_is_int(k) and 0 < k <= vocab_size):
        raise ValueError(f"k must be an int in [1, {vocab_size}] (the vocabulary), got {k!r}")
    if (
        isinstance(temperature, bool)
        or not isinstance(temperature, (int, float))
        or not (math.isfinite(temperature) and temperature > 0)
    ):
        raise ValueError(f"temperature must be a finite number > 0, got {temperature!r}")
    if logprob_dtype not in LOGPROB_DTYPES:
        raise ValueError(f"logprob_dtype must be one of {sorted(LOGPROB_DTYPES)}, got {logprob_dtype!r}")
    if id_dtype not in ID_DTYPES or vocab_size > ID_DTYPES[id_dtype][1]:
        fits = [d for d, (_, top) in ID_DTYPES.items() if vocab_size <= top]
        raise ValueError(f"id_dtype must be one of {fits} for a vocabulary of {vocab_size}, got {id_dtype!r}")
    if not (_is_int(sequences_per_shard) and sequences_per_shard > 0):
        raise ValueError(f"sequences_per_shard must be a positive int, got {sequences_per_shard!r}")
    if not (_is_int(num_sequences) and num_sequences >= 0):
        raise ValueError(f"num_sequences must be an int >= 0, got {num_sequences!r}")


class ShardWriter:
    """What every sharded store's writer shares: the lock, the manifest (single or per part), resuming
    (completed shards are kept after their checksums are checked), atomic shards and the merge of the
    parts. A store format subclasses it with its header check, its ``manifest_format`` and ``header_keys``
    and a ``write_shard`` that ends in ``_commit``."""

    header_keys: tuple = ()
    manifest_format: ManifestFormat = TOPK_MANIFEST

    def _open_store(self, path: str, header: Dict, resume: bool, num_parts: int, part: int, lock) -> None:
        if not (_is_int(num_parts) and num_parts > 0 and _is_int(part) and 0 <= part < num_parts):
            raise ValueError(f"part must be an int in [0, num_parts) and num_parts >= 1, got {part!r} of {num_parts!r}")
        self.path, self.num_parts, self.part = path, num_parts, part
        self.merged: Optional[Dict] = None  # the complete manifest.json, once there is one
        self.header = header
        os.makedirs(path, exist_ok=True)
        self._locks: List[_Lock] = []
        try:
            self._locks.append(lock or lock_store(path, num_parts, part))  # a lock given is adopted (released here)
            if num_parts == 1:
                self._name = MANIFEST
                self._start_single(resume)
            else:
                self._name = part_manifest_name(part, num_parts)
                with self._store_lock():
                    self._start_part(resume)
        except BaseException:
            self.close()
            raise

    # -- the format's hooks

    def _read(self, name: str) -> Dict:
        return read_manifest(self.path, name, fmt=self.manifest_format)

    def _fresh(self) -> Dict:
        return self.manifest_format.fresh(self.header)

    def _validate(self, man: Dict, where: str) -> None:
        validate_manifest(man, where, fmt=self.manifest_format)

    def shard_file(self, index: int) -> str:
        return self.manifest_format.shard_file(index)

    # -- starting

    def _resumable(self, name: str) -> Optional[Dict]:
        man = self._read(name)
        for key in self.header_keys:
            if man.get(key) != self.header[key]:
                raise StoreError(
                    f"cannot resume into {self.path!r}: its {key} is {man.get(key)!r}, this extraction's is "
                    f"{self.header[key]!r} (use another output directory, or --no-resume / resume=False to "
                    "start over)"
                )
        return man

    def _parts_present(self) -> List[str]:
        return sorted(f for f in os.listdir(self.path) if f.startswith("manifest.part-") and f.endswith(".json"))

    def _start_single(self, resume: bool) -> None:
        parts = self._parts_present()
        if resume and parts:
            raise StoreError(
                f"{self.path!r} holds the parts of an extraction in several processes ({parts[0]}, ...): "
                "finish them with the same --num-shards, or start over with --no-resume"
            )
        if not resume:
            for f in parts:
                os.unlink(os.path.join(self.path, f))
        man = None
        if resume and os.path.exists(os.path.join(self.path, MANIFEST)):
            man = self._resumable(MANIFEST)
            man["shards"] = self._verified(man["shards"])
            man["complete"] = False
            man.pop("num_rows", None), man.pop("num_tokens", None)
        self.manifest = man or self._fresh()
        self._write_manifest()

    def _start_part(self, resume: bool) -> None:
        mpath = os.path.join(self.path, MANIFEST)
        if os.path.exists(mpath) and not resume:
            os.unlink(mpath)  # starting over: the old store is no longer complete
        if os.path.exists(mpath) and resume:
            man = self._resumable(MANIFEST)
            if not man["complete"]:
                raise StoreError(
                    f"{self.path!r} holds an unfinished single-process extraction: finish it without "
                    "--num-shards, or start over with --no-resume"
                )
            self.merged = man  # every part is already in it: nothing to do
        other = [f for f in self._parts_present() if not f.endswith(f"-of-{self.num_parts:05d}.json")]
        if other:
            raise StoreError(
                f"{self.path!r} holds parts of an extraction in another number of shards ({other[0]}): "
                "use the same --num-shards, or another output directory"
            )
        man = None
        if resume and os.path.exists(os.path.join(self.path, self._name)):
            man = self._resumable(self._name)
            man["shards"] = self._verified(man["shards"])
            man["complete"] = False
        self.manifest = man or dict(self._fresh(), num_parts=self.num_parts, part=self.part)
        if self.merged is None:
            self._write_manifest()

    def _verified(self, shards: List[Dict]) -> List[Dict]:
        kept = []
        for info in shards:
            try:
                verify_shard(self.path, info)
                kept.append(info)
            except StoreError as err:
                warnings.warn(f"{err}; it will be extracted again", RuntimeWarning, stacklevel=4)
        return kept

    def _store_lock(self):
        writer = self

        class _Held:  # the store-wide lock, held briefly by a part (a single-process run holds it throughout)
            def __enter__(self):
                self.lock = _Lock(
                    os.path.join(writer.path, ".lock"),
                    f"a single-process extraction is writing into {writer.path!r}",
                    timeout=60,
                )

            def __exit__(self, *exc):
                self.lock.release()

        return _Held()

    # -- writing

    @property
    def num_shards(self) -> int:
        n, s = self.header["num_sequences"], self.header["sequences_per_shard"]
        return (n + s - 1) // s

    def owns(self, index: int) -> bool:
        return index % self.num_parts == self.part

    def done(self, index: int) -> bool:
        if self.merged is not None:
            return True
        return any(info["index"] == index for info in self.manifest["shards"])

    def shard_range(self, index: int):
        s = self.header["sequences_per_shard"]
        return index * s, min((index + 1) * s, self.header["num_sequences"])

    def _commit(self, index: int, data: bytes, rows: int, tokens: int, sha256: Optional[str] = None) -> ShardInfo:
        """Write shard `index`'s bytes atomically, then record it in the manifest. `sha256`: the digest
        the bytes must have (StoreError, and nothing written, if they do not)."""
        first, last = self.shard_range(index)
        digest = hashlib.sha256(data).hexdigest()
        if sha256 is not None and digest != sha256:
            raise StoreError(
                f"shard {index} as rebuilt has sha256 {digest[:16]}..., the source store's was {sha256[:16]}...: "
                "the data changed after export"
            )
        name = self.shard_file(index)
        atomic_write_bytes(os.path.join(self.path, name), data)
        info = ShardInfo(
            index=index,
            file=name,
            first_sequence=first,
            sequences=last - first,
            rows=rows,
            tokens=tokens,
            bytes=len(data),
            sha256=digest,
        )
        self.manifest["shards"] = sorted(
            [s for s in self.manifest["shards"] if s["index"] != index] + [asdict(info)], key=lambda s: s["index"]
        )
        self._write_manifest()
        return info

    def check_index(self, index: int) -> None:
        if not (_is_int(index) and 0 <= index < self.num_shards and self.owns(index)):
            raise ValueError(
                f"shard {index!r} is not one of this writer's (part {self.part} of {self.num_parts}, "
                f"{self.num_shards} shards)"
            )

    def finish(self) -> Dict:
        """Mark the store (or this part) complete; returns the manifest: the complete store's once
        every part is in (check ``.get("complete")``), else this part's."""
        if self.merged is not None:
            return self.merged
        have = {s["index"] for s in self.manifest["shards"]}
        missing = [i for i in range(self.num_shards) if self.owns(i) and i not in have]
        if missing:
            raise StoreError(f"cannot mark {self.path!r} complete: shards {missing[:8]} are not written")
        self.manifest["complete"] = True
        if self.num_parts == 1:
            self.merged = _completed(self.manifest)
            self.manifest = self.merged
            self._write_manifest()
            return self.merged
        self._write_manifest()
        with self._store_lock():
            return self._merge_parts()

    def _merge_parts(self) -> Dict:
        shards = []
        for p in range(self.num_parts):
            name = part_manifest_name(p, self.num_parts)
            if not os.path.exists(os.path.join(self.path, name)):
                return self.manifest  # another part is still running: the last one merges
            man = self._resumable(name)
            if not man["complete"]:
                return self.manifest
            shards += man["shards"]
        merged = _completed(dict(self._fresh(), shards=sorted(shards, key=lambda s: s["index"]), complete=True))
        self._validate(merged, os.path.join(self.path, MANIFEST))
        atomic_write_bytes(os.path.join(self.path, MANIFEST), _manifest_bytes(merged))
        for p in range(self.num_parts):
            os.unlink(os.path.join(self.path, part_manifest_name(p, self.num_parts)))
        self.merged = merged
        return merged

    def close(self) -> None:
        while self._locks:
            self._locks.pop().release()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _write_manifest(self) -> None:
        atomic_write_bytes(os.path.join(self.path, self._name), _manifest_bytes(self.manifest))


class TopKWriter(ShardWriter):
    """Writes shards and the manifest; resumes an interrupted store (completed shards are kept).

    The writer holds an exclusive lock on the store (``.lock``) until ``close()``: a second
    extraction into the same directory fails at once instead of interleaving its shards.

    Scale-out: with ``num_parts = N`` and ``part = i`` the writer owns the shards j with
    ``j % N == i`` and records them in its own manifest (``manifest.part-i-of-N.json``, lock
    ``.lock-part-i-of-N``); the part that finishes last (any order, any process or machine sharing
    the directory) merges the N part manifests into ``manifest.json``, the same file a
    single-process extraction writes, and removes them. Shards do not depend on which process
    wrote them, so the merged store is bit-identical to the single-process one.
    """

    header_keys = HEADER_KEYS

    def __init__(
        self,
        path: str,
        *,
        model: str,
        k: int,
        temperature: float,
        vocab_size: int,
        head_rows: int,
        num_sequences: int,
        logprob_dtype: str = "float32",
        sequences_per_shard: int = 1024,
        source: Optional[Dict] = None,
        resume: bool = True,
        num_parts: int = 1,
        part: int = 0,
        lock: Optional[_Lock] = None,
        id_dtype: str = "int32",
    ):
        check_header(
            k,
            temperature,
            vocab_size,
            head_rows,
            logprob_dtype,
            sequences_per_shard=sequences_per_shard,
            num_sequences=num_sequences,
            id_dtype=id_dtype,
        )
        header = {
            "model": model,
            "k": int(k),
            "temperature": float(temperature),
            "logprob_dtype": logprob_dtype,
            "vocab_size": int(vocab_size),
            "head_rows": int(head_rows),
            "sequences_per_shard": sequences_per_shard,
            "source": source or {},
            "num_sequences": int(num_sequences),
            "id_dtype": id_dtype,
        }
        self._open_store(path, header, resume=resume, num_parts=num_parts, part=part, lock=lock)

    def write_shard(
        self,
        index: int,
        input_ids: Sequence[torch.Tensor],
        topk_ids: Sequence[torch.Tensor],
        topk_logprobs: Sequence[torch.Tensor],
        quantized: Optional[Sequence[torch.Tensor]] = None,
        sha256: Optional[str] = None,
    ) -> ShardInfo:
        """Write shard `index` (its sequences' tokens, and rows: L - 1 per sequence of L tokens).

        A uint8 store quantizes the log-probs; `quantized` (its per-sequence scale blocks [rows, 2],
        with `topk_logprobs` then the codes) writes already quantized rows as they are (an import).
        `sha256`: the digest the shard must have (an import of an export rebuilds the source's
        bytes); StoreError, and nothing written, if it does not."""
        self.check_index(index)
        first, last = self.shard_range(index)
        if len(input_ids) != last - first or len(topk_ids) != len(input_ids) or len(topk_logprobs) != len(input_ids):
            raise ValueError(
                f"shard {index} holds sequences [{first}, {last}): got {len(input_ids)} sequences, "
                f"{len(topk_ids)} id blocks and {len(topk_logprobs)} log-prob blocks"
            )
        K = self.header["k"]
        for i, (t, a, b) in enumerate(zip(input_ids, topk_ids, topk_logprobs)):
            rows = max(int(t.numel()) - 1, 0)
            if tuple(a.shape) != (rows, K) or tuple(b.shape) != (rows, K):
                raise ValueError(
                    f"sequence {first + i} has {t.numel()} tokens: its top-k blocks must be "
                    f"({rows}, {K}), got {tuple(a.shape)} and {tuple(b.shape)}"
                )
        quantize = self.header["logprob_dtype"] == QUANTIZED
        lp_dtype = torch.float32 if quantize and quantized is None else LOGPROB_DTYPES[self.header["logprob_dtype"]]

        def offsets(parts):
            sizes = torch.tensor([0] + [int(p.shape[0]) for p in parts], dtype=torch.int64)
            return torch.cumsum(sizes, 0)

        tensors = {
            "input_ids": torch.cat([t.reshape(-1).to(torch.int32).cpu() for t in input_ids])
            if input_ids
            else torch.zeros(0, dtype=torch.int32),
            "seq_offsets": offsets([t.reshape(-1) for t in input_ids]),
            "row_offsets": offsets(topk_ids),
            "topk_ids": pack_ids(
                torch.cat([a.cpu() for a in topk_ids]) if topk_ids else torch.zeros(0, K, dtype=torch.int32),
                self.header["id_dtype"],
            ),
            "topk_logprobs": torch.cat([b.to(lp_dtype).cpu() for b in topk_logprobs])
            if topk_logprobs
            else torch.zeros(0, K, dtype=lp_dtype),
        }
        if quantize:
            if quantized is None:
                tensors["topk_logprobs"], tensors["topk_lp_scale"] = quantize_logprobs(tensors["topk_logprobs"])
            else:
                tensors["topk_lp_scale"] = (
                    torch.cat([q.float().cpu() for q in quantized]) if quantized else torch.zeros(0, 2)
                )
        tensors = {k: v.contiguous() for k, v in tensors.items()}
        # one metadata entry: safetensors writes a map's entries in no fixed order, and a shard's
        # bytes must not depend on the run that wrote it (parts reproduce the single-process store)
        data = _safetensors().save(tensors, metadata={"format": f"{FORMAT} shard {index}"})
        return self._commit(
            index, data, int(tensors["topk_ids"].shape[0]), int(tensors["input_ids"].numel()), sha256=sha256
        )


def _completed(man: Dict) -> Dict:
    man = dict(man, complete=True)
    man.pop("num_parts", None), man.pop("part", None)
    man["num_rows"] = sum(s["rows"] for s in man["shards"])
    man["num_tokens"] = sum(s["tokens"] for s in man["shards"])
    return man


def _manifest_bytes(man: Dict) -> bytes:
    return (json.dumps(man, indent=1, sort_keys=True) + "\n").encode()


class ShardReader:
    """What every sharded store's reader shares: the manifest (with ``allow_incomplete``, the leading run
    of written shards), the shard of sequence i, each shard's size and sha256 checked the first time
    this process opens it (``verify``), its tensors' presence, and the ``max_open_shards`` most recently
    used shards kept open, memory-mapped. A format subclasses it with its ``manifest_format``, the
    tensors a shard holds (``small_tensors`` are read whole when it opens), ``_check_shard`` and a
    ``__getitem__`` on ``_locate``."""

    manifest_format: ManifestFormat = TOPK_MANIFEST
    small_tensors: tuple = ("input_ids", "seq_offsets", "row_offsets")

    def __init__(self, path: str, verify: bool = True, allow_incomplete: bool = False, max_open_shards: int = 8):
        self.path = path
        self.manifest = read_manifest(path, fmt=self.manifest_format)
        self.verify = verify
        shards: List[Dict] = self.manifest["shards"]
        if not self.manifest["complete"]:
            if not allow_incomplete:
                raise StoreError(
                    f"store {path!r} is incomplete ({len(shards)} shards written): finish the "
                    "extraction (it resumes), or pass allow_incomplete=True to read the written shards"
                )
            # only the leading run of consecutive shards is addressable by sequence index
            run = []
            for i, s in enumerate(shards):
                if s["index"] != i:
                    break
                run.append(s)
            shards = run
        self.shards = shards
        self._starts = [s["first_sequence"] for s in shards]
        self._len = sum(s["sequences"] for s in shards)
        self.max_open_shards = max(1, int(max_open_shards))
        self._open: "OrderedDict[int, tuple]" = OrderedDict()  # least recently used first
        self._verified: set = set()  # shards whose sha256 this process has checked

    def __getstate__(self):  # open file handles stay in their process (DataLoader workers reopen)
        state = dict(self.__dict__)
        state["_open"] = OrderedDict()
        return state

    def __len__(self) -> int:
        return self._len

    @property
    def vocab_size(self) -> int:
        return self.manifest["vocab_size"]

    # -- the format's hooks

    def _tensor_names(self) -> tuple:
        """Every tensor a shard must hold."""
        return self.small_tensors

    def _check_shard(self, fpath: str, info: Dict, small: Dict[str, torch.Tensor], handle) -> None:
        """StoreError when the opened shard's shapes do not match its manifest entry."""

    # -- reading

    def _shard(self, j: int):
        """(small tensors, lazy handle) of shard j; the row tensors are sliced from the memory-mapped file.

        Each shard's sha256 is checked once per process (not on every reopen: a shuffled epoch
        reopens shards many times), and the most recently used ``max_open_shards`` stay open.
        """
        if j in self._open:
            self._open.move_to_end(j)
            return self._open[j]
        info = self.shards[j]
        if self.verify and j not in self._verified:
            verify_shard(self.path, info)
            self._verified.add(j)
        fpath = os.path.join(self.path, info["file"])
        try:
            from safetensors import safe_open

            handle = safe_open(fpath, framework="pt")
            names = set(handle.keys())
            missing = [n for n in self._tensor_names() if n not in names]
            if missing:
                raise StoreError(f"shard {fpath} lacks tensors {missing}")
            small = {n: handle.get_tensor(n) for n in self.small_tensors}
            self._check_shard(fpath, info, small, handle)
        except StoreError:
            raise
        except Exception as err:
            raise StoreError(f"shard {fpath} cannot be read ({err})") from err
        while len(self._open) >= self.max_open_shards:
            self._open.popitem(last=False)
        self._open[j] = (small, handle)
        return self._open[j]

    def _locate(self, i: int):
        """(small tensors, handle, index in the shard, input ids, rows [r0, r1)) of sequence i."""
        if i < 0:
            i += self._len
        if not 0 <= i < self._len:
            raise IndexError(f"sequence {i} out of range for a store of {self._len} sequences")
        j = bisect.bisect_right(self._starts, i) - 1
        small, handle = self._shard(j)
        local = i - self.shards[j]["first_sequence"]
        s0, s1 = int(small["seq_offsets"][local]), int(small["seq_offsets"][local + 1])
        r0, r1 = int(small["row_offsets"][local]), int(small["row_offsets"][local + 1])
        return small, handle, local, small["input_ids"][s0:s1].long(), (r0, r1)


class TopKStore(ShardReader):
    """Reads a store: ``store[i]`` is sequence i as a dict of ``input_ids`` [L] (int64),
    ``topk_ids`` [L - 1, K] (int64) and ``topk_logprobs`` [L - 1, K] (float32).

    With ``verify=True`` (default) each shard's size and sha256 are checked the first time this
    process opens it; a missing, truncated or corrupted shard raises StoreError naming it.
    ``nitrobrew topk-verify STORE`` checks a whole store up front.
    """

    @property
    def k(self) -> int:
        return self.manifest["k"]

    @property
    def temperature(self) -> float:
        return self.manifest["temperature"]

    def _tensor_names(self) -> tuple:
        scale = ("topk_lp_scale",) if self.manifest["logprob_dtype"] == QUANTIZED else ()
        return self.small_tensors + ("topk_ids", "topk_logprobs") + scale

    def _check_shard(self, fpath: str, info: Dict, small: Dict[str, torch.Tensor], handle) -> None:
        K = self.manifest["k"]
        shapes = [list(handle.get_slice(n).get_shape())[:2] for n in ("topk_ids", "topk_logprobs")]
        want = [info["rows"], K]
        if shapes != [want, want] or small["seq_offsets"].numel() != info["sequences"] + 1:
            raise StoreError(
                f"shard {fpath} does not match the manifest: top-k tensors {shapes}, expected {want} "
                f"(K = {K}), {small['seq_offsets'].numel() - 1} sequences, expected {info['sequences']}"
            )

    def __getitem__(self, i: int) -> Dict[str, torch.Tensor]:
        _, handle, _, input_ids, (r0, r1) = self._locate(i)
        return {
            "input_ids": input_ids,
            "topk_ids": unpack_ids(handle.get_slice("topk_ids")[r0:r1]),
            "topk_logprobs": self._logprobs(handle, r0, r1),
        }

    def _logprobs(self, handle, r0: int, r1: int) -> torch.Tensor:
        lp = handle.get_slice("topk_logprobs")[r0:r1]
        if self.manifest["logprob_dtype"] == QUANTIZED:
            return dequantize_logprobs(lp, handle.get_slice("topk_lp_scale")[r0:r1])
        return lp.float()
