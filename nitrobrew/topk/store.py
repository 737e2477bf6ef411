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
- ``topk_ids`` int32 [rows, K], ``topk_logprobs`` [rows, K] (float32, float16 or bfloat16),
  sorted by decreasing log-prob.

Alignment: a sequence of L tokens has L - 1 rows, and row i is the teacher's distribution over
token i + 1 given tokens 0..i, i.e. the teacher's output at position i. The last position has no
target inside the sequence and is not stored. Log-probs are log-softmax(logits / T) over the
teacher's real vocabulary [0, vocab_size) (padded head rows excluded), T the recorded temperature.

Every write goes to a temporary file in the same directory and is moved into place with
``os.replace`` (shards first, then the manifest), so an interrupted extraction leaves only
complete shards listed; the manifest records each shard's byte size and sha256, which the reader
checks, naming the shard that is truncated or corrupted.
"""
from __future__ import annotations

import bisect
import hashlib
import json
import os
import warnings
from dataclasses import asdict, dataclass
from typing import Dict, List, Optional, Sequence

import torch

from .._io import atomic_write_bytes

FORMAT = "nitrobrew-topk"
VERSION = 1
MANIFEST = "manifest.json"
LOGPROB_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
ALIGNMENT = ("row i of a sequence of L tokens (0 <= i < L - 1) is the teacher's distribution over token i + 1; "
             "the last position is not stored")
# header fields that must agree when an extraction resumes into an existing store
HEADER_KEYS = ("model", "k", "temperature", "logprob_dtype", "vocab_size", "head_rows", "sequences_per_shard",
               "source", "num_sequences")


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


def read_manifest(path: str) -> Dict:
    mpath = os.path.join(path, MANIFEST)
    if not os.path.exists(mpath):
        raise StoreError(f"{path!r} is not a top-k store: {MANIFEST} is missing")
    try:
        with open(mpath) as f:
            man = json.load(f)
    except json.JSONDecodeError as err:
        raise StoreError(f"{mpath} is not valid JSON ({err})") from err
    if man.get("format") != FORMAT:
        raise StoreError(f"{mpath} is not a {FORMAT} manifest (format={man.get('format')!r})")
    if man.get("version") != VERSION:
        raise StoreError(f"{mpath} has format version {man.get('version')!r}; this nitrobrew reads {VERSION}")
    return man


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
        raise StoreError(f"shard {fpath} is corrupted: sha256 {digest[:16]}... does not match the manifest's "
                         f"{info['sha256'][:16]}...")


class TopKWriter:
    """Writes shards and the manifest; resumes an interrupted store (completed shards are kept)."""

    def __init__(self, path: str, *, model: str, k: int, temperature: float, vocab_size: int, head_rows: int,
                 num_sequences: int, logprob_dtype: str = "float32", sequences_per_shard: int = 1024,
                 source: Optional[Dict] = None, resume: bool = True):
        if logprob_dtype not in LOGPROB_DTYPES:
            raise ValueError(f"logprob_dtype must be one of {sorted(LOGPROB_DTYPES)}, got {logprob_dtype!r}")
        if not (isinstance(sequences_per_shard, int) and sequences_per_shard > 0):
            raise ValueError(f"sequences_per_shard must be a positive int, got {sequences_per_shard!r}")
        self.path = path
        os.makedirs(path, exist_ok=True)
        header = {
            "model": model, "k": int(k), "temperature": float(temperature), "logprob_dtype": logprob_dtype,
            "vocab_size": int(vocab_size), "head_rows": int(head_rows), "sequences_per_shard": sequences_per_shard,
            "source": source or {}, "num_sequences": int(num_sequences),
        }
        mpath = os.path.join(path, MANIFEST)
        if os.path.exists(mpath) and resume:
            man = read_manifest(path)
            for key in HEADER_KEYS:
                if man.get(key) != header[key]:
                    raise StoreError(
                        f"cannot resume into {path!r}: its {key} is {man.get(key)!r}, this extraction's is "
                        f"{header[key]!r} (use another output directory, or resume=False to start over)")
            kept = []
            for info in man["shards"]:
                try:
                    verify_shard(path, info)
                    kept.append(info)
                except StoreError as err:
                    warnings.warn(f"{err}; it will be extracted again", RuntimeWarning, stacklevel=2)
            man["shards"] = kept
            man["complete"] = False
        else:
            man = {"format": FORMAT, "version": VERSION, **header, "alignment": ALIGNMENT,
                   "id_dtype": "int32", "shards": [], "complete": False}
        self.manifest = man
        self._write_manifest()

    @property
    def num_shards(self) -> int:
        n, s = self.manifest["num_sequences"], self.manifest["sequences_per_shard"]
        return (n + s - 1) // s

    def done(self, index: int) -> bool:
        return any(info["index"] == index for info in self.manifest["shards"])

    def shard_range(self, index: int):
        s = self.manifest["sequences_per_shard"]
        return index * s, min((index + 1) * s, self.manifest["num_sequences"])

    def write_shard(self, index: int, input_ids: Sequence[torch.Tensor], topk_ids: Sequence[torch.Tensor],
                    topk_logprobs: Sequence[torch.Tensor]) -> ShardInfo:
        """Write shard `index` (its sequences' tokens, and rows: L - 1 per sequence of L tokens)."""
        first, last = self.shard_range(index)
        if len(input_ids) != last - first or len(topk_ids) != len(input_ids) or len(topk_logprobs) != len(input_ids):
            raise ValueError(f"shard {index} holds sequences [{first}, {last}): got {len(input_ids)} sequences, "
                             f"{len(topk_ids)} id blocks and {len(topk_logprobs)} log-prob blocks")
        K = self.manifest["k"]
        for i, (t, a, b) in enumerate(zip(input_ids, topk_ids, topk_logprobs)):
            rows = max(int(t.numel()) - 1, 0)
            if tuple(a.shape) != (rows, K) or tuple(b.shape) != (rows, K):
                raise ValueError(f"sequence {first + i} has {t.numel()} tokens: its top-k blocks must be "
                                 f"({rows}, {K}), got {tuple(a.shape)} and {tuple(b.shape)}")
        lp_dtype = LOGPROB_DTYPES[self.manifest["logprob_dtype"]]

        def offsets(parts):
            sizes = torch.tensor([0] + [int(p.shape[0]) for p in parts], dtype=torch.int64)
            return torch.cumsum(sizes, 0)

        tensors = {
            "input_ids": torch.cat([t.reshape(-1).to(torch.int32).cpu() for t in input_ids]) if input_ids
            else torch.zeros(0, dtype=torch.int32),
            "seq_offsets": offsets([t.reshape(-1) for t in input_ids]),
            "row_offsets": offsets(topk_ids),
            "topk_ids": torch.cat([a.to(torch.int32).cpu() for a in topk_ids]) if topk_ids
            else torch.zeros(0, K, dtype=torch.int32),
            "topk_logprobs": torch.cat([b.to(lp_dtype).cpu() for b in topk_logprobs]) if topk_logprobs
            else torch.zeros(0, K, dtype=lp_dtype),
        }
        tensors = {k: v.contiguous() for k, v in tensors.items()}
        data = _safetensors().save(tensors, metadata={"format": FORMAT, "shard": str(index)})
        name = shard_name(index)
        atomic_write_bytes(os.path.join(self.path, name), data)
        info = ShardInfo(index=index, file=name, first_sequence=first, sequences=last - first,
                         rows=int(tensors["topk_ids"].shape[0]), tokens=int(tensors["input_ids"].numel()),
                         bytes=len(data), sha256=hashlib.sha256(data).hexdigest())
        self.manifest["shards"] = sorted([s for s in self.manifest["shards"] if s["index"] != index] + [asdict(info)],
                                         key=lambda s: s["index"])
        self._write_manifest()
        return info

    def finish(self) -> Dict:
        have = {s["index"] for s in self.manifest["shards"]}
        missing = [i for i in range(self.num_shards) if i not in have]
        if missing:
            raise StoreError(f"cannot mark {self.path!r} complete: shards {missing[:8]} are not written")
        self.manifest["complete"] = True
        self.manifest["num_rows"] = sum(s["rows"] for s in self.manifest["shards"])
        self.manifest["num_tokens"] = sum(s["tokens"] for s in self.manifest["shards"])
        self._write_manifest()
        return self.manifest

    def _write_manifest(self) -> None:
        atomic_write_bytes(os.path.join(self.path, MANIFEST),
                            (json.dumps(self.manifest, indent=1, sort_keys=True) + "\n").encode())


class TopKStore:
    """Reads a store: ``store[i]`` is sequence i as a dict of ``input_ids`` [L] (int64),
    ``topk_ids`` [L - 1, K] (int64) and ``topk_logprobs`` [L - 1, K] (float32).

    With ``verify=True`` (default) each shard's size and sha256 are checked when it is first
    opened; a missing, truncated or corrupted shard raises StoreError naming it.
    """

    def __init__(self, path: str, verify: bool = True, allow_incomplete: bool = False):
        self.path = path
        self.manifest = read_manifest(path)
        self.verify = verify
        shards: List[Dict] = self.manifest["shards"]
        if not self.manifest.get("complete"):
            if not allow_incomplete:
                raise StoreError(f"store {path!r} is incomplete ({len(shards)} shards written): finish the "
                                 "extraction (it resumes), or pass allow_incomplete=True to read the written shards")
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
        self._open: Dict[int, tuple] = {}

    def __getstate__(self):  # open file handles stay in their process (DataLoader workers reopen)
        state = dict(self.__dict__)
        state["_open"] = {}
        return state

    @property
    def k(self) -> int:
        return self.manifest["k"]

    @property
    def temperature(self) -> float:
        return self.manifest["temperature"]

    @property
    def vocab_size(self) -> int:
        return self.manifest["vocab_size"]

    def __len__(self) -> int:
        return self._len

    def _shard(self, j: int):
        """(small tensors, lazy handle) of shard j; the top-k tensors are sliced from the file."""
        if j not in self._open:
            info = self.shards[j]
            if self.verify:
                verify_shard(self.path, info)
            fpath = os.path.join(self.path, info["file"])
            try:
                from safetensors import safe_open

                handle = safe_open(fpath, framework="pt")
                names = set(handle.keys())
                need = ("input_ids", "seq_offsets", "row_offsets", "topk_ids", "topk_logprobs")
                missing = [n for n in need if n not in names]
                if missing:
                    raise StoreError(f"shard {fpath} lacks tensors {missing}")
                small = {n: handle.get_tensor(n) for n in ("input_ids", "seq_offsets", "row_offsets")}
            except StoreError:
                raise
            except Exception as err:
                raise StoreError(f"shard {fpath} cannot be read ({err})") from err
            if len(self._open) >= 4:  # keep the most recent shards open
                self._open.pop(next(iter(self._open)))
            self._open[j] = (small, handle)
        return self._open[j]

    def __getitem__(self, i: int) -> Dict[str, torch.Tensor]:
        if i < 0:
            i += self._len
        if not 0 <= i < self._len:
            raise IndexError(f"sequence {i} out of range for a store of {self._len} sequences")
        j = bisect.bisect_right(self._starts, i) - 1
        small, handle = self._shard(j)
        local = i - self.shards[j]["first_sequence"]
        s0, s1 = int(small["seq_offsets"][local]), int(small["seq_offsets"][local + 1])
        r0, r1 = int(small["row_offsets"][local]), int(small["row_offsets"][local + 1])
        return {
            "input_ids": small["input_ids"][s0:s1].long(),
            "topk_ids": handle.get_slice("topk_ids")[r0:r1].long(),
            "topk_logprobs": handle.get_slice("topk_logprobs")[r0:r1].float(),
        }
