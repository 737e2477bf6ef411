"""On-disk store of a teacher's final hidden states: exact offline distillation over the whole vocabulary.

A hidden store keeps, per counted position, the teacher's final hidden state (after its final
norm, before its head), and once per store everything that turns it into the teacher's logits:
the head's weight and bias, ``logit_scale``, ``final_logit_softcapping`` and the vocabulary used.
``logits = softcap(logit_scale * (h @ weight.T + bias))[:vocab_size]``, exactly the live teacher's.
Layout of a store directory (docs/teacher_store.md)::

    manifest.json                 header + list of completed shards (sizes, sha256)
    head.safetensors              "weight" [head_rows, D] (and "bias" [head_rows]), the teacher's dtype
    shard-00000.safetensors       sequences [0, S)
    shard-00001.safetensors       sequences [S, 2S) ...

Shard j holds the sequences [j * S, (j + 1) * S) as:

- ``input_ids`` int32 [tokens] and ``seq_offsets`` int64 [n + 1], as in the top-k store;
- ``prompt_lengths`` int32 [n]: positions before ``max(P - 1, 0)`` are not stored (a rollout's
  prompt: only the positions that predict completion tokens count);
- ``row_offsets`` int64 [n + 1]: sequence i's rows are ``hidden[row_offsets[i]:row_offsets[i+1]]``;
- ``hidden`` [rows, D]: float32, bfloat16, or float8_e4m3fn with ``hidden_scale`` float32 [rows]
  (``h ~ hidden * hidden_scale``, one scale per row: the row's max |h| / 448).

Alignment: a sequence of L tokens with prompt length P has rows for the positions
``start = max(P - 1, 0), ..., L - 2``; the row of position i is the teacher's state that predicts
token i + 1. The last position is not stored.

Writes, resuming, the lock, sharded extraction over processes and the checksums are the top-k
store's (``store.ShardWriter``); the head file is written once, atomically, and its sha256 is in
the header (a resume with another teacher is refused).
"""

from __future__ import annotations

import hashlib
import math
import os
from typing import Dict, List, Optional, Sequence

import torch

from ..core.atomic_io import atomic_write_bytes
from . import store
from .store import (
    MANIFEST,
    ManifestFormat,
    ShardInfo,
    ShardReader,
    ShardWriter,
    StoreError,
    _is_int,
    _safetensors,
    row_start,
)

FORMAT = "nitrobrew-hidden"
VERSION = 1
HEAD_FILE = "head.safetensors"
HIDDEN_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "fp8": torch.float8_e4m3fn}
HEAD_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
FP8 = "fp8"
FP8_MAX = 448.0  # the largest finite float8_e4m3fn
ALIGNMENT = (
    "a sequence of L tokens with prompt length P has rows for positions max(P - 1, 0) .. L - 2; the row of "
    "position i is the teacher's final hidden state that predicts token i + 1"
)
# header fields that must agree when an extraction resumes into an existing store
HEADER_KEYS = (
    "model",
    "revision",
    "hidden_dtype",
    "hidden_size",
    "vocab_size",
    "head_rows",
    "head_dtype",
    "head_sha256",
    "logit_scale",
    "final_logit_softcapping",
    "sequences_per_shard",
    "source",
    "num_sequences",
)
_HEADER_SCHEMA = {
    "model": str,
    "revision": str,
    "hidden_dtype": str,
    "hidden_size": int,
    "vocab_size": int,
    "head_rows": int,
    "head_dtype": str,
    "head_sha256": str,
    "head_bias": bool,
    "logit_scale": float,
    "sequences_per_shard": int,
    "num_sequences": int,
    "source": dict,
    "shards": list,
    "complete": bool,
}


# ------------------------------------------------------------------------------------------- fp8


def quantize_fp8(h: torch.Tensor):
    """(float8_e4m3fn codes [R, D], float32 scales [R]) with ``h ~ codes * scale``.

    One scale per row, ``max |h| / 448``: the row's largest entry maps to the format's largest,
    so the relative error of an entry is at most 2^-4 (3 mantissa bits, rounding to nearest) down to
    ``2^-6 * scale`` (the smallest normal), below which the error is at most ``2^-10 * scale``.
    """
    h = h.float()
    amax = h.abs().amax(1) if h.shape[1] else torch.zeros(h.shape[0], device=h.device)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    codes = (h / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return codes, scale.contiguous()


def dequantize_fp8(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """h ~ codes * scale, in `dtype` (the product is formed in float32, rounded once)."""
    return (codes.float() * scale.float().unsqueeze(-1)).to(dtype)


def bytes_per_position(hidden_size: int, hidden_dtype: str) -> int:
    """Stored bytes of one position's row (the offsets and tokens add ~12 bytes per sequence)."""
    return {"float32": 4, "bfloat16": 2, FP8: 1}[hidden_dtype] * hidden_size + (4 if hidden_dtype == FP8 else 0)


# ------------------------------------------------------------------------------------------ head


def head_file_bytes(weight: torch.Tensor, bias: Optional[torch.Tensor]) -> bytes:
    """The head as safetensors bytes (fixed for given tensors: the sha256 names the head)."""
    tensors = {"weight": weight.detach().contiguous().cpu()}
    if bias is not None:
        tensors["bias"] = bias.detach().contiguous().cpu()
    return _safetensors().save(tensors, metadata={"format": f"{FORMAT} head"})


def check_header(
    hidden_dtype: str,
    hidden_size,
    vocab_size,
    head_rows,
    head_dtype: str,
    logit_scale,
    softcap,
    sequences_per_shard,
    num_sequences,
) -> None:
    """ValueError for settings a hidden store cannot hold (before anything is written)."""
    if hidden_dtype not in HIDDEN_DTYPES:
        raise ValueError(f"hidden dtype must be one of {sorted(HIDDEN_DTYPES)}, got {hidden_dtype!r}")
    if not (_is_int(hidden_size) and hidden_size > 0):
        raise ValueError(f"the head's width must be a positive int, got {hidden_size!r}")
    if not (_is_int(vocab_size) and _is_int(head_rows) and 0 < vocab_size <= head_rows):
        raise ValueError(f"vocab_size must be an int in [1, {head_rows}] (the head's rows), got {vocab_size!r}")
    if head_dtype not in HEAD_DTYPES:
        raise ValueError(f"the head's dtype must be one of {sorted(HEAD_DTYPES)}, got {head_dtype!r}")
    for name, value in (("logit_scale", logit_scale), ("final_logit_softcapping", softcap)):
        if value is None and name != "logit_scale":
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not (math.isfinite(value) and value > 0):
            raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
    if not (_is_int(sequences_per_shard) and sequences_per_shard > 0):
        raise ValueError(f"sequences_per_shard must be a positive int, got {sequences_per_shard!r}")
    if not (_is_int(num_sequences) and num_sequences >= 0):
        raise ValueError(f"num_sequences must be an int >= 0, got {num_sequences!r}")


def _check_manifest_header(man: Dict, where: str) -> None:
    try:
        check_header(
            man["hidden_dtype"],
            man["hidden_size"],
            man["vocab_size"],
            man["head_rows"],
            man["head_dtype"],
            logit_scale=man["logit_scale"],
            softcap=man.get("final_logit_softcapping"),
            sequences_per_shard=man["sequences_per_shard"],
            num_sequences=man["num_sequences"],
        )
    except ValueError as err:
        raise StoreError(f"{where}: {err}") from None
    if len(man["head_sha256"]) != 64:
        raise StoreError(f"{where}: head_sha256 is malformed")


HIDDEN_MANIFEST = ManifestFormat(
    name=FORMAT,
    version=VERSION,
    kind="hidden-state store",
    header_schema=_HEADER_SCHEMA,
    check_header=_check_manifest_header,
    alignment=ALIGNMENT,
)


def read_manifest(path: str, name: str = MANIFEST) -> Dict:
    """The hidden store's manifest (``store.read_manifest``: read and checked)."""
    return store.read_manifest(path, name, fmt=HIDDEN_MANIFEST)


store_format = store.manifest_format  # the format a directory's manifest names (None: no manifest)


def verify_head(path: str, man: Dict) -> None:
    """StoreError when the head file is missing or is not the head the manifest names."""
    fpath = os.path.join(path, HEAD_FILE)
    if not os.path.exists(fpath):
        raise StoreError(f"the head {fpath} is missing")
    from .store import sha256_file

    digest = sha256_file(fpath)
    if digest != man["head_sha256"]:
        raise StoreError(
            f"the head {fpath} is corrupted or another teacher's: sha256 {digest[:16]}... does not match the "
            f"manifest's {man['head_sha256'][:16]}..."
        )


class HiddenWriter(ShardWriter):
    """Writes a hidden store (``ShardWriter``: lock, resume, parts, atomic shards) and its head.

    ``weight`` [head_rows, D] and ``bias`` are the teacher's head as it computes (its dtype is kept);
    ``vocab_size`` the real vocabulary (padded head rows beyond it are never compared).
    """

    header_keys = HEADER_KEYS
    manifest_format = HIDDEN_MANIFEST

    def __init__(
        self,
        path: str,
        *,
        model: str,
        weight: torch.Tensor,
        bias: Optional[torch.Tensor],
        vocab_size: int,
        num_sequences: int,
        hidden_dtype: str = "bfloat16",
        logit_scale: float = 1.0,
        softcap: Optional[float] = None,
        revision: str = "",
        sequences_per_shard: int = 64,
        source: Optional[Dict] = None,
        resume: bool = True,
        num_parts: int = 1,
        part: int = 0,
        lock=None,
    ):
        if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
            raise ValueError(f"the head's weight must be a 2-D tensor, got {getattr(weight, 'shape', weight)!r}")
        head_dtype = next((k for k, v in HEAD_DTYPES.items() if v == weight.dtype), str(weight.dtype))
        check_header(
            hidden_dtype,
            int(weight.shape[1]),
            vocab_size,
            int(weight.shape[0]),
            head_dtype,
            logit_scale=logit_scale,
            softcap=softcap,
            sequences_per_shard=sequences_per_shard,
            num_sequences=num_sequences,
        )
        if bias is not None and tuple(bias.shape) != (weight.shape[0],):
            raise ValueError(f"the head's bias must be [{weight.shape[0]}], got {tuple(bias.shape)}")
        self._head = head_file_bytes(weight, None if bias is None else bias.to(weight.dtype))
        header = {
            "model": model,
            "revision": revision or "",
            "hidden_dtype": hidden_dtype,
            "hidden_size": int(weight.shape[1]),
            "vocab_size": int(vocab_size),
            "head_rows": int(weight.shape[0]),
            "head_dtype": head_dtype,
            "head_bias": bias is not None,
            "head_sha256": hashlib.sha256(self._head).hexdigest(),
            "logit_scale": float(logit_scale),
            "final_logit_softcapping": None if softcap is None else float(softcap),
            "sequences_per_shard": sequences_per_shard,
            "source": source or {},
            "num_sequences": int(num_sequences),
        }
        self._open_store(path, header, resume=resume, num_parts=num_parts, part=part, lock=lock)
        try:
            if self.num_parts == 1:
                self._write_head()
            else:
                with self._store_lock():
                    self._write_head()
        except BaseException:
            self.close()
            raise

    def _write_head(self) -> None:
        fpath = os.path.join(self.path, HEAD_FILE)
        if os.path.exists(fpath):
            try:
                verify_head(self.path, self.header)
                return
            except StoreError:
                pass
        atomic_write_bytes(fpath, self._head)

    def write_shard(
        self,
        index: int,
        input_ids: Sequence[torch.Tensor],
        hidden: Sequence[torch.Tensor],
        prompt_lengths: Optional[Sequence[int]] = None,
        scales: Optional[Sequence[torch.Tensor]] = None,
        sha256: Optional[str] = None,
    ) -> ShardInfo:
        """Write shard `index`: per sequence its tokens, its prompt length (0 if None) and its rows
        [L - 1 - max(P - 1, 0), D]. An fp8 store quantizes float rows; `scales` (with the codes as
        `hidden`) writes already quantized rows as they are (an import). `sha256`: the digest the shard
        must have (an import rebuilds the source's bytes); StoreError, and nothing written, if not."""
        self.check_index(index)
        first, last = self.shard_range(index)
        prompt_lengths = [0] * len(input_ids) if prompt_lengths is None else [int(p) for p in prompt_lengths]
        if not len(input_ids) == len(hidden) == len(prompt_lengths) == last - first:
            raise ValueError(
                f"shard {index} holds sequences [{first}, {last}): got {len(input_ids)} sequences, "
                f"{len(hidden)} hidden blocks and {len(prompt_lengths)} prompt lengths"
            )
        D = self.header["hidden_size"]
        for i, (t, h, p) in enumerate(zip(input_ids, hidden, prompt_lengths)):
            L = int(t.numel())
            if not 0 <= p <= L:
                raise ValueError(f"sequence {first + i}: prompt length {p} outside [0, {L}]")
            rows = max(L - 1 - row_start(p), 0)
            if tuple(h.shape) != (rows, D):
                raise ValueError(
                    f"sequence {first + i} has {L} tokens and a prompt of {p}: its hidden block must be "
                    f"({rows}, {D}), got {tuple(h.shape)}"
                )
        dtype = self.header["hidden_dtype"]
        rows_all = torch.cat([h.cpu() for h in hidden]) if hidden else torch.zeros(0, D)
        tensors = {
            "input_ids": torch.cat([t.reshape(-1).to(torch.int32).cpu() for t in input_ids])
            if input_ids
            else torch.zeros(0, dtype=torch.int32),
            "seq_offsets": _offsets([int(t.numel()) for t in input_ids]),
            "prompt_lengths": torch.tensor(prompt_lengths, dtype=torch.int32),
            "row_offsets": _offsets([int(h.shape[0]) for h in hidden]),
        }
        if dtype == FP8:
            if scales is None:
                tensors["hidden"], tensors["hidden_scale"] = quantize_fp8(rows_all)
            else:
                tensors["hidden"] = rows_all.to(torch.float8_e4m3fn)
                tensors["hidden_scale"] = torch.cat([s.float().cpu() for s in scales]) if scales else torch.zeros(0)
        else:
            tensors["hidden"] = rows_all.to(HIDDEN_DTYPES[dtype])
        tensors = {k: v.contiguous() for k, v in tensors.items()}
        data = _safetensors().save(tensors, metadata={"format": f"{FORMAT} shard {index}"})
        rows, tokens = int(tensors["hidden"].shape[0]), int(tensors["input_ids"].numel())
        return self._commit(index, data, rows, tokens, sha256=sha256)


def _offsets(sizes: List[int]) -> torch.Tensor:
    return torch.cumsum(torch.tensor([0] + sizes, dtype=torch.int64), 0)


class HiddenStore(ShardReader):
    """Reads a hidden store: ``store[i]`` is sequence i as a dict of ``input_ids`` [L] (int64),
    ``prompt_length`` (int), ``hidden`` [rows, D] in the stored dtype (fp8 codes stay fp8: half the
    bytes to move; ``hidden_scale`` [rows] float32 with them), sliced from the memory-mapped shard.

    Each shard's size and sha256 are checked the first time this process opens it (``verify``),
    and the head's when it is loaded; ``nitrobrew teacher-verify STORE`` checks everything up front.
    """

    manifest_format = HIDDEN_MANIFEST
    small_tensors = ("input_ids", "seq_offsets", "prompt_lengths", "row_offsets")

    @property
    def hidden_dtype(self) -> str:
        return self.manifest["hidden_dtype"]

    def head(self, device="cpu", dtype: Optional[torch.dtype] = None):
        """The teacher's head as ``nitrobrew.hf.model.LMHead`` (weight, bias, logit scale, softcap), on
        `device`, its sha256 checked against the manifest."""
        from ..hf.model import LMHead

        verify_head(self.path, self.manifest)
        st = _safetensors()
        tensors = st.load_file(os.path.join(self.path, HEAD_FILE), device="cpu")
        D, rows = self.manifest["hidden_size"], self.manifest["head_rows"]
        if "weight" not in tensors or tuple(tensors["weight"].shape) != (rows, D):
            raise StoreError(f"{os.path.join(self.path, HEAD_FILE)}: weight must be [{rows}, {D}]")
        if self.manifest["head_bias"] != ("bias" in tensors):
            raise StoreError(f"{os.path.join(self.path, HEAD_FILE)}: its bias does not match the manifest")
        w = tensors["weight"].to(device=device, dtype=dtype or tensors["weight"].dtype)
        b = tensors.get("bias")
        b = None if b is None else b.to(device=device, dtype=w.dtype)
        return LMHead(w, b, self.manifest["logit_scale"], self.manifest.get("final_logit_softcapping"))

    def _tensor_names(self) -> tuple:
        return self.small_tensors + ("hidden",) + (("hidden_scale",) if self.hidden_dtype == FP8 else ())

    def _check_shard(self, fpath: str, info: Dict, small: Dict[str, torch.Tensor], handle) -> None:
        shape = list(handle.get_slice("hidden").get_shape())
        want = [info["rows"], self.manifest["hidden_size"]]
        if shape != want or small["seq_offsets"].numel() != info["sequences"] + 1:
            raise StoreError(f"shard {fpath} does not match the manifest: hidden {shape}, expected {want}")

    def __getitem__(self, i: int) -> Dict:
        small, handle, local, input_ids, (r0, r1) = self._locate(i)
        item = {
            "input_ids": input_ids,
            "prompt_length": int(small["prompt_lengths"][local]),
            "hidden": handle.get_slice("hidden")[r0:r1],
        }
        if self.hidden_dtype == FP8:
            item["hidden_scale"] = handle.get_slice("hidden_scale")[r0:r1]
        return item
