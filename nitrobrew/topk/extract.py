"""``nitrobrew topk-extract``: run a teacher once over a tokenized corpus and store its top-k.

For every position the teacher's final hidden state goes through a streaming top-k over vocab
chunks of the LM head: each chunk's logits (fp32 accumulation) update a running top-k (merge of
the current K best with the chunk's K best) and an online log-sum-exp; the [tokens, V] logits are
never materialized and the HF model's own logits are never computed (the decoder runs without
its head). Log-probs are ``logits / T - logsumexp(logits / T)`` over the real vocabulary
``[0, vocab_size)``: padded head rows (``head rows > vocab_size``, e.g. Qwen's 152064-row head
for a 151665-token tokenizer) are excluded from both the top-k and the normalizer.

Alignment: a sequence of L tokens gives L - 1 rows; row i is the distribution over token i + 1
(see ``nitrobrew.topk.store``).
"""
from __future__ import annotations

import argparse
import json
import os
import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence

import torch

from .. import _checks as ck
from .._ops import linear_logits
from ..core.online import Online, auto_chunk_v, spans
from .store import LOGPROB_DTYPES, TopKWriter, sha256_file

Tensor = torch.Tensor


# ----------------------------------------------------------------------------- the streaming top-k

GROUP = 16  # vocab entries per group of the grouped top-k (a power of 2)


def _group_max(z: Tensor, group: int) -> Tensor:
    """[R, ceil(C / group)]: the maximum of each run of `group` consecutive entries of z [R, C]."""
    R, C = z.shape
    pad = (-C) % group
    if pad:
        z = torch.nn.functional.pad(z, (0, pad), value=float("-inf"))
    return z.view(R, -1, group).amax(-1)


def _chunk_candidates(z: Tensor, gmax: Tensor, thresh: Tensor, k: int, group: int, scale: float):
    """The entries of chunk z [R, C] that can still enter a running top-k whose k-th best is thresh.

    Exact: the k largest entries of z lie in the k groups (of `group` consecutive entries) with the
    largest maxima gmax, and a group whose maximum is <= thresh holds nothing that beats the running
    top-k. So only min(k, groups above thresh) groups are gathered (one host sync per chunk for
    that count); torch.topk then runs on those few groups instead of the whole chunk.
    gmax is of the tempered logits z * scale. Returns (tempered values [R, c], column indices
    [R, c]; -inf past the chunk's end) or None when no row can improve.
    """
    R, C = z.shape
    need = int((gmax > thresh[:, None]).sum(1).max())
    if need == 0:
        return None
    kk = min(k, need, gmax.shape[1])
    gi = gmax.topk(kk, dim=1).indices                                   # [R, kk]
    cols = (gi[:, :, None] * group + torch.arange(group, device=z.device)).reshape(R, kk * group)
    vals = z.gather(1, cols.clamp(max=C - 1))
    if scale != 1.0:
        vals = vals * scale
    return torch.where(cols < C, vals, float("-inf")), cols


def _use_triton(hidden: Tensor, backend: str) -> bool:
    ck.check_backend(backend)  # float64 never takes the Triton pass, but a bad name still raises
    return hidden.dtype != torch.float64 and ck.resolve_backend(backend, hidden.device) == "triton"


def streaming_topk(hidden: Tensor, weight: Tensor, bias: Optional[Tensor], k: int, temperature: float = 1.0,
                   vocab_size: Optional[int] = None, chunk: Optional[int] = None, backend: str = "auto",
                   group: Optional[int] = None):
    """Top-k ids (int64) and log-probs (fp32) of softmax((hidden @ weight[:V].T + b) / T), [R, k] each.

    One pass over vocab chunks: online log-sum-exp plus a running top-k, merged with each chunk's
    candidates (see ``_chunk_candidates``); memory O(R * (chunk + k)), never [R, V]. With the Triton
    backend (default on CUDA) one kernel per chunk does the tempering, the log-sum-exp update and the
    group maxima in a single read of the chunk (``kernels_scan.py``).
    """
    V = weight.shape[0] if vocab_size is None else int(vocab_size)
    if not 0 < V <= weight.shape[0]:
        raise ValueError(f"vocab_size must be in [1, {weight.shape[0]}] (the head's rows), got {vocab_size!r}")
    if not (isinstance(k, int) and 0 < k <= V):
        raise ValueError(f"k must be an int in [1, {V}], got {k!r}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature!r}")
    group = group or GROUP
    if group & (group - 1):
        raise ValueError(f"group must be a power of 2, got {group}")
    triton_scan = _use_triton(hidden, backend)
    R = hidden.shape[0]
    acc = torch.float64 if hidden.dtype == torch.float64 else torch.float32
    # <= 1 GiB of fp32 logits per chunk: fewer top-k merges (H200, 16384 rows: 26 ms against 35 at 512 MiB)
    chunk = chunk or max(auto_chunk_v(R, V, budget_elems=1 << 28), k)
    best_v = torch.full((R, k), float("-inf"), dtype=acc, device=hidden.device)
    best_i = torch.zeros((R, k), dtype=torch.int64, device=hidden.device)
    state = Online.empty(R, acc, hidden.device)
    if triton_scan:
        from .kernels_scan import scan_chunk

    for c0, c1 in spans(V, chunk):
        z = linear_logits(hidden, weight[c0:c1], None if bias is None else bias[c0:c1], acc)
        if triton_scan:
            gmax, scale = scan_chunk(z, state, 1.0 / temperature, group), 1.0 / temperature
        else:
            if temperature != 1.0:
                z = z / temperature
            state.update(z)
            gmax, scale = _group_max(z, group), 1.0
        cand = _chunk_candidates(z, gmax, best_v[:, -1], k, group, scale)
        if cand is None:
            continue
        v, i = cand
        best_v, pos = torch.cat([best_v, v], 1).topk(k, dim=1)
        best_i = torch.cat([best_i, i + c0], 1).gather(1, pos)
    return best_i, (best_v - state.lse()[:, None]).to(torch.float32)


# ----------------------------------------------------------------------------------- the teacher

@dataclass
class Teacher:
    """Anything that maps (input_ids [B, L], attention_mask [B, L]) to final hidden states [B, L, D],
    plus its LM head (logits = hidden @ weight.T + bias)."""

    hidden_fn: Callable[[Tensor, Tensor], Tensor]
    weight: Tensor
    bias: Optional[Tensor] = None
    name: str = "custom"
    vocab_size: Optional[int] = None  # real vocabulary (<= head rows); None = all head rows

    @property
    def device(self) -> torch.device:
        return self.weight.device


def teacher_from_hf(model, name: str = "hf-model", vocab_size: Optional[int] = None) -> Teacher:
    """Wrap a transformers causal LM: its decoder (``model.base_model``) runs to the final hidden
    states without the head; the head weight is found whether tied to the embeddings or not."""
    cfg = model.config
    for attr in ("final_logit_softcapping", "logit_scale", "output_multiplier_scale"):
        if getattr(cfg, attr, None) not in (None, 1, 1.0):
            raise NotImplementedError(f"{type(model).__name__} transforms its logits ({attr}="
                                      f"{getattr(cfg, attr)}): not supported by the top-k extraction yet")
    head = model.get_output_embeddings()
    if head is None or not hasattr(head, "weight"):
        raise ValueError(f"{type(model).__name__} has no LM head (get_output_embeddings() is {head!r})")
    base = model.base_model
    if base is model:
        raise ValueError(f"cannot find the decoder of {type(model).__name__} (base_model is the model itself)")

    def hidden_fn(input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        out = base(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
        return out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]

    head_rows = head.weight.shape[0]
    if vocab_size is None:
        vocab_size = min(int(getattr(cfg, "vocab_size", head_rows) or head_rows), head_rows)
    return Teacher(hidden_fn, head.weight, getattr(head, "bias", None), name, vocab_size)


def load_hf_teacher(model_dir: str, device: str = "cpu", dtype: str = "auto",
                    vocab_size: Optional[int] = None) -> Teacher:
    """Load a local Hugging Face model directory (no downloads). Without vocab_size, the real
    vocabulary is the tokenizer's length when a tokenizer is saved there, else config.vocab_size."""
    try:
        from transformers import AutoModelForCausalLM
    except ImportError as err:
        raise ImportError("loading a Hugging Face teacher needs transformers: pip install 'nitrobrew[hf]'") from err
    if not os.path.isdir(model_dir):
        raise FileNotFoundError(f"model directory {model_dir!r} does not exist")
    import transformers

    torch_dtype = "auto" if dtype == "auto" else getattr(torch, dtype)
    major, minor = (int(x) for x in transformers.__version__.split(".")[:2])
    key = "dtype" if (major, minor) >= (4, 56) else "torch_dtype"  # renamed in transformers 4.56
    model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True, **{key: torch_dtype})
    model = model.to(device).eval()
    if vocab_size is None:
        try:
            from transformers import AutoTokenizer

            tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
            vocab_size = min(len(tok), model.get_output_embeddings().weight.shape[0])
        except Exception:
            vocab_size = None
    return teacher_from_hf(model, name=os.path.abspath(model_dir), vocab_size=vocab_size)


# ------------------------------------------------------------------------------------ the corpus

def load_sequences(path: str) -> List[List[int]]:
    """Token sequences from a .jsonl file of {"input_ids": [...]} lines, or a .parquet / .arrow
    file with an ``input_ids`` list column (needs pyarrow)."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"dataset {path!r} does not exist")
    lower = path.lower()
    if lower.endswith((".jsonl", ".json")):
        seqs = []
        with open(path) as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    rec = json.loads(line)
                    ids = rec["input_ids"]
                except (json.JSONDecodeError, KeyError, TypeError) as err:
                    raise ValueError(f"{path}:{n}: expected a JSON object with an 'input_ids' list ({err})") from err
                if not isinstance(ids, list) or not all(isinstance(t, int) for t in ids):
                    raise ValueError(f"{path}:{n}: input_ids must be a list of ints")
                seqs.append(ids)
        return seqs
    if lower.endswith((".parquet", ".arrow", ".feather", ".ipc")):
        try:
            import pyarrow as pa
        except ImportError as err:
            raise ImportError(f"reading {path!r} needs pyarrow (pip install pyarrow), or convert it to .jsonl") from err
        if lower.endswith(".parquet"):
            import pyarrow.parquet as pq

            table = pq.read_table(path, columns=["input_ids"])
        else:
            try:
                with pa.memory_map(path) as src:
                    table = pa.ipc.open_file(src).read_all()
            except pa.ArrowInvalid:
                with pa.memory_map(path) as src:
                    table = pa.ipc.open_stream(src).read_all()
        if "input_ids" not in table.column_names:
            raise ValueError(f"{path!r} has no 'input_ids' column (columns: {table.column_names})")
        return [list(map(int, x)) for x in table.column("input_ids").to_pylist()]
    raise ValueError(f"unknown dataset format for {path!r}: use .jsonl, .parquet or .arrow")


# -------------------------------------------------------------------------------- the extraction

def _batches(lengths: Sequence[int], batch_tokens: int):
    """Consecutive index ranges whose padded size (count * max length) stays within batch_tokens."""
    start, longest = 0, 0
    for i, n in enumerate(lengths):
        nl = max(longest, n)
        if i > start and nl * (i - start + 1) > batch_tokens:
            yield start, i
            start, nl = i, n
        longest = nl
    if start < len(lengths):
        yield start, len(lengths)


@torch.no_grad()
def teacher_topk(teacher: Teacher, seqs: Sequence[Sequence[int]], k: int, temperature: float = 1.0,
                 batch_tokens: int = 16384, chunk: Optional[int] = None, backend: str = "auto"):
    """Per sequence: (ids [L - 1, k] int64, log-probs [L - 1, k] fp32), on the CPU."""
    out_ids: List[Tensor] = []
    out_lp: List[Tensor] = []
    dev = teacher.device
    emb_rows = teacher.weight.shape[0]
    for b0, b1 in _batches([len(s) for s in seqs], batch_tokens):
        group = seqs[b0:b1]
        L = max(len(s) for s in group)
        if L < 2:
            for s in group:
                out_ids.append(torch.zeros(0, k, dtype=torch.int64))
                out_lp.append(torch.zeros(0, k, dtype=torch.float32))
            continue
        ids = torch.zeros(len(group), L, dtype=torch.long)
        mask = torch.zeros(len(group), L, dtype=torch.long)
        for i, s in enumerate(group):
            if s and (min(s) < 0 or max(s) >= emb_rows):
                raise ValueError(f"a sequence holds token ids outside [0, {emb_rows}) (the teacher's vocabulary)")
            ids[i, : len(s)] = torch.tensor(s, dtype=torch.long)
            mask[i, : len(s)] = 1
        hidden = teacher.hidden_fn(ids.to(dev), mask.to(dev))
        # rows 0..len-2 of each sequence, packed
        sel = [(i, max(len(s) - 1, 0)) for i, s in enumerate(group)]
        rows = torch.cat([hidden[i, :n] for i, n in sel]) if any(n for _, n in sel) else hidden[:0, 0]
        top_i, top_lp = streaming_topk(rows, teacher.weight, teacher.bias, k, temperature,
                                       teacher.vocab_size, chunk, backend)
        top_i, top_lp = top_i.cpu(), top_lp.cpu()
        r = 0
        for _, n in sel:
            out_ids.append(top_i[r:r + n])
            out_lp.append(top_lp[r:r + n])
            r += n
    return out_ids, out_lp


def extract_topk(teacher: Teacher, sequences: Sequence[Sequence[int]], out_dir: str, *, k: int = 64,
                 temperature: float = 1.0, logprob_dtype: str = "float32", sequences_per_shard: int = 1024,
                 batch_tokens: int = 16384, chunk: Optional[int] = None, source: Optional[Dict] = None,
                 resume: bool = True, log: Optional[Callable[[str], None]] = None) -> Dict:
    """Write the teacher's top-k over `sequences` into the store at out_dir; resumes by default.

    Returns the manifest plus "extract_seconds" and "extracted_tokens" for this call.
    """
    V = teacher.vocab_size or teacher.weight.shape[0]
    writer = TopKWriter(out_dir, model=teacher.name, k=k, temperature=temperature, vocab_size=V,
                        head_rows=teacher.weight.shape[0], num_sequences=len(sequences),
                        logprob_dtype=logprob_dtype, sequences_per_shard=sequences_per_shard,
                        source=source, resume=resume)
    t0, tokens = time.perf_counter(), 0
    for j in range(writer.num_shards):
        if writer.done(j):
            if log:
                log(f"shard {j}: already written, skipped")
            continue
        a, b = writer.shard_range(j)
        seqs = [list(s) for s in sequences[a:b]]
        ids, lp = teacher_topk(teacher, seqs, k, temperature, batch_tokens, chunk)
        writer.write_shard(j, [torch.tensor(s, dtype=torch.int32) for s in seqs], ids, lp)
        tokens += sum(len(s) for s in seqs)
        if log:
            log(f"shard {j}: sequences [{a}, {b}) written")
    man = dict(writer.finish())
    man["extract_seconds"] = time.perf_counter() - t0
    man["extracted_tokens"] = tokens
    return man


# ------------------------------------------------------------------------------------------- CLI

def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="local Hugging Face model directory (AutoModelForCausalLM)")
    p.add_argument("--data", required=True, help="tokenized corpus: .jsonl of {\"input_ids\": [...]}, .parquet or .arrow")
    p.add_argument("--out", required=True, help="output store directory (resumed if it exists)")
    p.add_argument("--k", type=int, default=64, help="entries kept per position (default 64)")
    p.add_argument("--temperature", type=float, default=1.0,
                   help="log-probs are log-softmax(logits / T); recorded in the manifest (default 1)")
    p.add_argument("--vocab-size", type=int, default=None,
                   help="real vocabulary: head rows beyond it (padding) are excluded (default: the tokenizer's "
                        "length if one is saved with the model, else config.vocab_size)")
    p.add_argument("--logprob-dtype", choices=sorted(LOGPROB_DTYPES), default="float32")
    p.add_argument("--sequences-per-shard", type=int, default=1024)
    p.add_argument("--batch-tokens", type=int, default=16384, help="padded tokens per teacher forward")
    p.add_argument("--chunk-v", type=int, default=None, help="vocab chunk of the streaming top-k (default: automatic)")
    p.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="teacher weights' dtype (default: as saved)")
    p.add_argument("--no-resume", action="store_true", help="start over instead of resuming an existing store")


def run(args: argparse.Namespace) -> int:
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    teacher = load_hf_teacher(args.model, device=device, dtype=args.dtype, vocab_size=args.vocab_size)
    seqs = load_sequences(args.data)
    source = {"path": os.path.abspath(args.data), "sha256": sha256_file(args.data)}
    man = extract_topk(teacher, seqs, args.out, k=args.k, temperature=args.temperature,
                       logprob_dtype=args.logprob_dtype, sequences_per_shard=args.sequences_per_shard,
                       batch_tokens=args.batch_tokens, chunk=args.chunk_v, source=source,
                       resume=not args.no_resume, log=print)
    secs = man["extract_seconds"]
    rate = man["extracted_tokens"] / secs if secs > 0 else float("nan")
    print(f"wrote {args.out}: {man['num_sequences']} sequences, {man['num_rows']} rows, K={man['k']}, "
          f"T={man['temperature']}, vocab {man['vocab_size']} of {man['head_rows']} head rows; "
          f"{man['extracted_tokens']} tokens this run in {secs:.1f} s ({rate:.0f} tokens/s)")
    return 0
