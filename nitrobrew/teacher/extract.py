"""``nitrobrew topk-extract``: run a teacher once over a tokenized corpus and store its top-k.

For every position the teacher's final hidden state goes through a streaming top-k over vocab
chunks of the LM head: each chunk's logits (fp32 accumulation) update a running top-k (merge of
the current K best with the chunk's K best) and an online log-sum-exp; the [tokens, V] logits are
never materialized and the HF model's own logits are never computed (the decoder runs without
its head). Log-probs are ``logits / T - logsumexp(logits / T)`` over the real vocabulary
``[0, vocab_size)``: padded head rows (``head rows > vocab_size``, e.g. Qwen's 152064-row head
for a 151665-token tokenizer) are excluded from both the top-k and the normalizer.

Alignment: a sequence of L tokens gives L - 1 rows; row i is the distribution over token i + 1
(see ``nitrobrew.teacher.store``).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch

from ..core import checks as ck
from ..core.online import Online, auto_chunk_v, spans
from ..core.ops import linear_logits
from .inputs import Corpus, open_corpus, read_all
from .store import ID_DTYPES, LOGPROB_DTYPES, StoreError, TopKWriter, check_header, lock_store, sha256_file

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
    gi = gmax.topk(kk, dim=1).indices  # [R, kk]
    cols = (gi[:, :, None] * group + torch.arange(group, device=z.device)).reshape(R, kk * group)
    vals = z.gather(1, cols.clamp(max=C - 1))
    if scale != 1.0:
        vals = vals * scale
    return torch.where(cols < C, vals, float("-inf")), cols


def _use_triton(hidden: Tensor, backend: str) -> bool:
    ck.check_backend(backend)  # float64 never takes the Triton pass, but a bad name still raises
    return hidden.dtype != torch.float64 and ck.resolve_backend(backend, hidden.device) == "triton"


def streaming_topk(
    hidden: Tensor,
    weight: Tensor,
    bias: Optional[Tensor],
    k: int,
    temperature: float = 1.0,
    vocab_size: Optional[int] = None,
    chunk: Optional[int] = None,
    backend: str = "auto",
    group: Optional[int] = None,
):
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
        from .kernels_scan import launch_scan_chunk

    for c0, c1 in spans(V, chunk):
        z = linear_logits(hidden, weight[c0:c1], None if bias is None else bias[c0:c1], acc)
        if triton_scan:
            gmax, scale = launch_scan_chunk(z, state, 1.0 / temperature, group), 1.0 / temperature
        else:
            if temperature != 1.0:
                z = z / temperature
            state.update(z)
            gmax, scale = _group_max(z, group), 1.0
        cand = _chunk_candidates(z, gmax, best_v[:, -1], k, group=group, scale=scale)
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
    vocab_note: str = ""  # where vocab_size came from (printed before extracting)
    logit_scale: float = 1.0  # logits = softcap(logit_scale * (h @ weight.T + bias)), as the model computes them
    softcap: Optional[float] = None
    revision: str = ""  # the model's commit (Hub cache) where known

    @property
    def device(self) -> torch.device:
        return self.weight.device


def teacher_from_hf(
    model, name: str = "hf-model", vocab_size: Optional[int] = None, logit_transforms: bool = False
) -> Teacher:
    """Wrap a transformers causal LM: its decoder (``model.base_model``) runs to the final hidden
    states without the head; the head weight is found whether tied to the embeddings or not.

    `logit_transforms`: record a post-head logit scale and final softcap (a hidden store applies
    them in the loss); without it a model that transforms its logits is refused (the top-k scan
    does not apply them)."""
    cfg = model.config
    refused = ("output_multiplier_scale",)  # applied by no nitrobrew path
    if not logit_transforms:
        refused = ("final_logit_softcapping", "logit_scale") + refused
    for attr in refused:
        if getattr(cfg, attr, None) not in (None, 1, 1.0):
            raise NotImplementedError(
                f"{type(model).__name__} transforms its logits ({attr}="
                f"{getattr(cfg, attr)}): not supported by the top-k extraction yet"
            )
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
    teacher = Teacher(hidden_fn, head.weight, getattr(head, "bias", None), name, vocab_size)
    if logit_transforms:
        from ..hf.model import lm_head

        spec = lm_head(model)
        teacher.logit_scale, teacher.softcap = float(spec.scale), spec.softcap
    teacher.revision = str(getattr(cfg, "_commit_hash", None) or "")
    return teacher


# A head is padded by at most min(PAD_SLACK, rows / 8) rows beyond its tokenizer (Qwen2.5: 399 of 152064):
# a tokenizer whose length falls further below the head is not the model's (one saved without its
# vocabulary files has the length of its special tokens).
PAD_SLACK = 1024


def choose_vocab(
    head_rows: int,
    tokenizer_len: Optional[int] = None,
    override: Optional[int] = None,
    config_vocab: Optional[int] = None,
) -> Tuple[int, str]:
    """(real vocabulary, where it came from). --vocab-size if given; else the tokenizer's length
    when it agrees with the head (at most min(PAD_SLACK, rows / 8) padded rows); else config.vocab_size
    (<= head rows)."""
    if override is not None:
        if isinstance(override, bool) or not isinstance(override, int) or not 0 < override <= head_rows:
            raise ValueError(f"--vocab-size must be an int in [1, {head_rows}] (the head's rows), got {override!r}")
        return override, f"--vocab-size, of {head_rows} head rows"
    rows = min(int(config_vocab or head_rows), head_rows)
    if tokenizer_len is not None and rows - min(PAD_SLACK, rows // 8) <= tokenizer_len <= rows:
        return tokenizer_len, f"the tokenizer's length, of {head_rows} head rows"
    note = f"config.vocab_size, of {head_rows} head rows"
    if tokenizer_len is not None:
        note += f"; the tokenizer's length {tokenizer_len} does not fit the head and is ignored"
    return rows, note


def resolve_model(name: str) -> str:
    """A local model directory: `name` itself, or a Hub id whose files are in the local cache."""
    if os.path.isdir(name):
        return name
    if os.path.isabs(name) or name.startswith((".", "~")) or name.count("/") > 1:
        raise FileNotFoundError(f"model directory {name!r} does not exist")
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(name, local_files_only=True)
    except Exception:
        raise FileNotFoundError(
            f"model {name!r} is neither a directory nor in the local Hugging Face cache "
            "(nothing is downloaded: fetch it first, e.g. `hf download`)"
        ) from None


def load_config(model_dir: str):
    try:
        from transformers import AutoConfig
    except ImportError as err:
        raise ImportError("loading a Hugging Face teacher needs transformers: pip install 'nitrobrew[hf]'") from err
    try:
        return AutoConfig.from_pretrained(model_dir, local_files_only=True)
    except Exception as err:
        raise ValueError(f"{model_dir!r} has no readable model config ({str(err).splitlines()[0]})") from None


def load_tokenizer(path: str):
    """The tokenizer saved at `path`, or None when there is none (a model built from a config)."""
    try:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception:
        return None
    return tok if len(tok) > 1 else None  # an empty tokenizer (no vocabulary files) is no tokenizer


def teacher_dtype(device, dtype: str = "auto") -> str:
    """The teacher's weights dtype: "auto" is bfloat16 on CUDA (half the memory and the GEMMs' fast
    path; the top-k still accumulates in fp32) and the saved dtype ("saved") elsewhere."""
    if dtype == "auto":
        return "bfloat16" if str(device).startswith("cuda") else "saved"
    return dtype


def load_hf_teacher(
    model_dir: str,
    device: str = "cpu",
    dtype: str = "auto",
    vocab_size: Optional[int] = None,
    tokenizer=None,
    logit_transforms: bool = False,
) -> Teacher:
    """Load a local Hugging Face model directory, or a Hub id from the local cache (no downloads).

    dtype "auto": bfloat16 on CUDA, as saved elsewhere ("saved": as saved everywhere). Without
    vocab_size the real vocabulary is chosen by ``choose_vocab`` (the tokenizer saved with the
    model, or `tokenizer`, only when its length fits the head)."""
    try:
        from transformers import AutoModelForCausalLM
    except ImportError as err:
        raise ImportError("loading a Hugging Face teacher needs transformers: pip install 'nitrobrew[hf]'") from err
    model_dir = resolve_model(model_dir)
    import transformers

    dtype = teacher_dtype(device, dtype)
    torch_dtype = "auto" if dtype == "saved" else getattr(torch, dtype)
    major, minor = (int(x) for x in transformers.__version__.split(".")[:2])
    key = "dtype" if (major, minor) >= (4, 56) else "torch_dtype"  # renamed in transformers 4.56
    model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True, **{key: torch_dtype})
    model = model.to(device).eval()
    tok = tokenizer if tokenizer is not None else (None if vocab_size is not None else load_tokenizer(model_dir))
    head_rows = model.get_output_embeddings().weight.shape[0]
    V, note = choose_vocab(
        head_rows, None if tok is None else len(tok), vocab_size, getattr(model.config, "vocab_size", None)
    )
    teacher = teacher_from_hf(model, name=os.path.abspath(model_dir), vocab_size=V, logit_transforms=logit_transforms)
    teacher.vocab_note = note
    return teacher


# ------------------------------------------------------------------------------------ the corpus


def load_sequences(path: str) -> List[List[int]]:
    """Token sequences from a .jsonl file of {"input_ids": [...]} lines, or a .parquet / .arrow
    file with an ``input_ids`` list column (needs pyarrow). ``inputs.open_corpus`` streams instead."""
    if not os.path.isfile(path):
        if not os.path.exists(path):
            raise FileNotFoundError(f"dataset {path!r} does not exist")
    if not path.lower().endswith((".jsonl", ".json", ".parquet", ".arrow", ".feather", ".ipc")):
        raise ValueError(f"unknown dataset format for {path!r}: use .jsonl, .parquet or .arrow")
    return read_all(open_corpus(path, field="input_ids"))


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


def _teacher_states(teacher: Teacher, group: Sequence[Sequence[int]]) -> Tensor:
    """The teacher's final hidden states [B, L, D] of `group`, padded on the right to the longest, L."""
    emb_rows, L = teacher.weight.shape[0], max(len(s) for s in group)
    ids = torch.zeros(len(group), L, dtype=torch.long)
    mask = torch.zeros(len(group), L, dtype=torch.long)
    for i, s in enumerate(group):
        if s and (min(s) < 0 or max(s) >= emb_rows):
            raise ValueError(f"a sequence holds token ids outside [0, {emb_rows}) (the teacher's vocabulary)")
        ids[i, : len(s)] = torch.tensor(s, dtype=torch.long)
        mask[i, : len(s)] = 1
    return teacher.hidden_fn(ids.to(teacher.device), mask.to(teacher.device))


@torch.no_grad()
def teacher_topk(
    teacher: Teacher,
    seqs: Sequence[Sequence[int]],
    k: int,
    temperature: float = 1.0,
    batch_tokens: int = 16384,
    chunk: Optional[int] = None,
    backend: str = "auto",
    on_tokens: Optional[Callable[[int], None]] = None,
):
    """Per sequence: (ids [L - 1, k] int64, log-probs [L - 1, k] fp32), on the CPU."""
    out_ids: List[Tensor] = []
    out_lp: List[Tensor] = []
    for b0, b1 in _batches([len(s) for s in seqs], batch_tokens):
        group = seqs[b0:b1]
        L = max(len(s) for s in group)
        if L < 2:
            for _ in group:
                out_ids.append(torch.zeros(0, k, dtype=torch.int64))
                out_lp.append(torch.zeros(0, k, dtype=torch.float32))
            continue
        hidden = _teacher_states(teacher, group)
        # rows 0..len-2 of each sequence, packed
        sel = [(i, max(len(s) - 1, 0)) for i, s in enumerate(group)]
        rows = torch.cat([hidden[i, :n] for i, n in sel]) if any(n for _, n in sel) else hidden[:0, 0]
        top_i, top_lp = streaming_topk(
            rows,
            teacher.weight,
            teacher.bias,
            k,
            temperature,
            vocab_size=teacher.vocab_size,
            chunk=chunk,
            backend=backend,
        )
        top_i, top_lp = top_i.cpu(), top_lp.cpu()
        r = 0
        for _, n in sel:
            out_ids.append(top_i[r : r + n])
            out_lp.append(top_lp[r : r + n])
            r += n
        if on_tokens:
            on_tokens(sum(len(s) for s in group))
    return out_ids, out_lp


class _Progress:
    """Tokens done over the whole job: a tqdm bar (tokens/s, ETA) when asked and installed, else a
    line per shard through `log` with the same figures."""

    def __init__(self, total: int, bar: bool, log: Optional[Callable[[str], None]], desc: str = "top-k"):
        self.total, self.done, self.log, self.t0 = total, 0, log, time.perf_counter()
        self.bar = None
        if bar and total:
            try:
                from tqdm.auto import tqdm
            except ImportError:
                tqdm = None
            if tqdm is not None:
                self.bar = tqdm(total=total, unit="tok", unit_scale=True, desc=desc, file=sys.stderr, smoothing=0.1)

    def update(self, tokens: int) -> None:
        self.done += tokens
        if self.bar is not None:
            self.bar.update(tokens)

    def rate(self) -> str:
        secs = time.perf_counter() - self.t0
        rate = self.done / secs if secs > 0 else float("nan")
        eta = (self.total - self.done) / rate if rate > 0 else float("nan")
        return f"{rate:.0f} tokens/s, {self.done}/{self.total} tokens, ETA {eta:.0f} s"

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _shard_groups(records, per_shard: int):
    """(shard index, [ids...]) for consecutive runs of `per_shard` records."""
    group: List[List[int]] = []
    j = 0
    for _, ids in records:
        group.append(ids)
        if len(group) == per_shard:
            yield j, group
            group, j = [], j + 1
    if group:
        yield j, group


def check_sizes(batch_tokens, chunk) -> None:
    if isinstance(batch_tokens, bool) or not isinstance(batch_tokens, int) or batch_tokens <= 0:
        raise ValueError(f"batch_tokens must be a positive int, got {batch_tokens!r}")
    if chunk is not None and (isinstance(chunk, bool) or not isinstance(chunk, int) or chunk <= 0):
        raise ValueError(f"chunk must be a positive int or None, got {chunk!r}")


def extract_topk(
    teacher: Teacher,
    sequences: Union[Sequence[Sequence[int]], Corpus],
    out_dir: str,
    *,
    k: int = 64,
    temperature: float = 1.0,
    logprob_dtype: str = "float32",
    sequences_per_shard: int = 1024,
    batch_tokens: int = 16384,
    chunk: Optional[int] = None,
    source: Optional[Dict] = None,
    resume: bool = True,
    log: Optional[Callable[[str], None]] = None,
    num_parts: int = 1,
    part: int = 0,
    progress: bool = False,
    checked: Optional[Tuple[int, List[int]]] = None,
    lock=None,
    id_dtype: str = "int32",
) -> Dict:
    """Write the teacher's top-k over `sequences` (id lists, or an ``inputs.Corpus``) into the store
    at out_dir; resumes by default.

    Every argument and every record is checked before anything is written (a bad token id names its
    record). With ``num_parts = N, part = i`` this call extracts the store shards j with
    ``j % N == i``; the store is complete once all N parts have run (see ``TopKWriter``).
    `checked` is ``corpus.check(...)``'s result when the caller has already run it; `lock` the
    store's lock (``store.lock_store``) when the caller took it already (it is released here).
    Returns the manifest (the store's, or this part's while other parts are missing) plus
    "extract_seconds" and "extracted_tokens" for this call.
    """
    corpus = sequences if isinstance(sequences, Corpus) else Corpus.from_sequences(sequences)
    head_rows = teacher.weight.shape[0]
    V = teacher.vocab_size or head_rows
    try:
        check_header(
            k,
            temperature,
            V,
            head_rows,
            logprob_dtype,
            sequences_per_shard=sequences_per_shard,
            num_sequences=0,
            id_dtype=id_dtype,
        )
        check_sizes(batch_tokens, chunk)
        n, shard_tokens = checked or corpus.check(head_rows, sequences_per_shard)
        writer = TopKWriter(
            out_dir,
            model=teacher.name,
            k=k,
            temperature=temperature,
            vocab_size=V,
            head_rows=head_rows,
            num_sequences=n,
            logprob_dtype=logprob_dtype,
            sequences_per_shard=sequences_per_shard,
            source=source,
            resume=resume,
            num_parts=num_parts,
            part=part,
            lock=lock,
            id_dtype=id_dtype,
        )
    except BaseException:
        if lock is not None:
            lock.release()
        raise

    def score(seqs, a, b, on_tokens):
        ids, lp = teacher_topk(teacher, seqs, k, temperature, batch_tokens, chunk=chunk, on_tokens=on_tokens)
        return {"topk_ids": ids, "topk_logprobs": lp}

    return _extract_shards(
        writer, corpus, n=n, shard_tokens=shard_tokens, score=score, progress=progress, log=log, desc="top-k"
    )


def _extract_shards(
    writer,
    corpus: Corpus,
    *,
    n: int,
    shard_tokens: List[int],
    score: Callable,
    progress: bool,
    log: Optional[Callable[[str], None]],
    desc: str,
    overlap: bool = False,
) -> Dict:
    """The shard loop of both extractions: the writer's shards not yet written, in order, each scored by
    ``score(seqs, first, last, on_tokens)`` (the keyword arguments of the writer's ``write_shard``
    beside the tokens) and written; then the store (or this part) is finished and the writer closed.

    `overlap`: shards are serialized, hashed and written by one thread while the teacher scores the
    next one (one shard in flight, written in order), so that the store's bytes cost (almost) no
    teacher time. Returns the manifest plus "extract_seconds" and "extracted_tokens"."""
    from concurrent.futures import ThreadPoolExecutor

    bar = None
    pool = ThreadPoolExecutor(1, thread_name_prefix=f"{desc}-store-writer") if overlap else None
    pending = None

    def write(j, seqs, rows):
        a, b = writer.shard_range(j)
        writer.write_shard(j, [torch.tensor(s, dtype=torch.int32) for s in seqs], **rows)
        if log:
            log(f"shard {j}: sequences [{a}, {b}) written ({bar.rate()})")

    try:
        todo = {j for j in range(writer.num_shards) if writer.owns(j) and not writer.done(j)}
        bar = _Progress(sum(shard_tokens[j] for j in todo), progress, log, desc=desc)
        seen = 0
        for j, seqs in _shard_groups(corpus.records(), writer.header["sequences_per_shard"]) if todo else ():
            seen += len(seqs)
            if j not in todo:
                if log and writer.owns(j):
                    log(f"shard {j}: already written, skipped")
                continue
            a, b = writer.shard_range(j)
            if len(seqs) != b - a:
                raise StoreError(
                    f"the corpus changed while it was read: shard {j} has {len(seqs)} sequences, expected {b - a}"
                )
            rows = score(seqs, a, b, bar.update)
            if pool is None:
                write(j, seqs, rows)
                continue
            if pending is not None:
                pending.result()
            pending = pool.submit(write, j, seqs, rows)
        if pending is not None:
            pending.result()
            pending = None
        if todo and seen != n:
            raise StoreError(f"the corpus changed while it was read: {seen} sequences, {n} when checked")
        man = dict(writer.finish())
    finally:
        if pending is not None:  # an interruption: the shard in flight completes (or not) atomically
            try:
                pending.result()
            except BaseException:
                pass
        if pool is not None:
            pool.shutdown(wait=True)
        writer.close()
        if bar is not None:
            bar.close()
    man["extract_seconds"] = time.perf_counter() - bar.t0
    man["extracted_tokens"] = bar.done
    return man


# ------------------------------------------------------------------- the hidden-state extraction


@torch.no_grad()
def teacher_hidden(
    teacher: Teacher,
    seqs: Sequence[Sequence[int]],
    prompt_lengths: Optional[Sequence[int]] = None,
    hidden_dtype: str = "bfloat16",
    batch_tokens: int = 16384,
    on_tokens: Optional[Callable[[int], None]] = None,
):
    """Per sequence its stored rows on the CPU: the final hidden states of positions
    ``max(P - 1, 0) .. L - 2`` (P its prompt length), in the store's dtype; for fp8 the codes and,
    as a second list, the per-row scales (quantized on the teacher's device: a quarter of the
    float32 bytes cross to the host). Returns (rows, scales or None)."""
    from .hidden_store import FP8, HIDDEN_DTYPES, quantize_fp8, row_start

    out: List[Tensor] = []
    scales: Optional[List[Tensor]] = [] if hidden_dtype == FP8 else None
    D = teacher.weight.shape[1]
    starts = [row_start(p) for p in (prompt_lengths if prompt_lengths is not None else [0] * len(seqs))]
    for b0, b1 in _batches([len(s) for s in seqs], batch_tokens):
        group = seqs[b0:b1]
        sel = [(starts[b0 + i], max(len(s) - 1 - starts[b0 + i], 0)) for i, s in enumerate(group)]
        if not any(n for _, n in sel):
            for _ in group:
                out.append(torch.zeros(0, D, dtype=HIDDEN_DTYPES[hidden_dtype]))
                if scales is not None:
                    scales.append(torch.zeros(0))
            if on_tokens:
                on_tokens(sum(len(s) for s in group))
            continue
        hidden = _teacher_states(teacher, group)
        rows = torch.cat([hidden[i, a : a + n] for i, (a, n) in enumerate(sel)])
        if scales is not None:
            codes, scale = quantize_fp8(rows)
            codes, scale = codes.cpu(), scale.cpu()
        else:
            codes, scale = rows.to(HIDDEN_DTYPES[hidden_dtype]).cpu(), None
        r = 0
        for _, n in sel:
            out.append(codes[r : r + n])
            if scales is not None:
                scales.append(scale[r : r + n])
            r += n
        if on_tokens:
            on_tokens(sum(len(s) for s in group))
    return out, scales


def extract_hidden(
    teacher: Teacher,
    sequences: Union[Sequence[Sequence[int]], Corpus],
    out_dir: str,
    *,
    hidden_dtype: str = "bfloat16",
    prompt_lengths: Optional[Sequence[int]] = None,
    sequences_per_shard: int = 64,
    batch_tokens: int = 16384,
    source: Optional[Dict] = None,
    resume: bool = True,
    log: Optional[Callable[[str], None]] = None,
    num_parts: int = 1,
    part: int = 0,
    progress: bool = False,
    checked: Optional[Tuple[int, List[int]]] = None,
    lock=None,
) -> Dict:
    """Write the teacher's final hidden states over `sequences` into a hidden store at out_dir
    (``nitrobrew.teacher.hidden_store``), with its head; resumes by default.

    `prompt_lengths` (one per sequence, e.g. a rollout's prompts): positions before
    ``max(P - 1, 0)`` are neither stored nor counted. Everything else as ``extract_topk``: checks
    before any write, the lock, parts (``num_parts``, ``part``), atomic shards. Returns the
    manifest plus "extract_seconds" and "extracted_tokens" for this call."""
    from .hidden_store import HiddenWriter, check_header

    corpus = sequences if isinstance(sequences, Corpus) else Corpus.from_sequences(sequences)
    head_rows, D = teacher.weight.shape
    V = teacher.vocab_size or head_rows
    try:
        check_sizes(batch_tokens, None)
        check_header(
            hidden_dtype,
            D,
            V,
            head_rows,
            "float32",
            logit_scale=teacher.logit_scale,
            softcap=teacher.softcap,
            sequences_per_shard=sequences_per_shard,
            num_sequences=0,
        )
        n, shard_tokens = checked or corpus.check(head_rows, sequences_per_shard)
        if prompt_lengths is not None and len(prompt_lengths) != n:
            raise ValueError(f"{len(prompt_lengths)} prompt lengths for a corpus of {n} sequences")
        writer = HiddenWriter(
            out_dir,
            model=teacher.name,
            revision=teacher.revision,
            weight=teacher.weight,
            bias=teacher.bias,
            vocab_size=V,
            num_sequences=n,
            hidden_dtype=hidden_dtype,
            logit_scale=teacher.logit_scale,
            softcap=teacher.softcap,
            sequences_per_shard=sequences_per_shard,
            source=source,
            resume=resume,
            num_parts=num_parts,
            part=part,
            lock=lock,
        )
    except BaseException:
        if lock is not None:
            lock.release()
        raise

    def score(seqs, a, b, on_tokens):
        plen = None if prompt_lengths is None else [int(p) for p in prompt_lengths[a:b]]
        rows, scales = teacher_hidden(teacher, seqs, plen, hidden_dtype, batch_tokens, on_tokens=on_tokens)
        return {"hidden": rows, "prompt_lengths": plen, "scales": scales}

    return _extract_shards(
        writer,
        corpus,
        n=n,
        shard_tokens=shard_tokens,
        score=score,
        progress=progress,
        log=log,
        desc="hidden",
        overlap=True,
    )


# ------------------------------------------------------------------------------------------- CLI


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _nonneg_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}")
    return value


def _temperature(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be finite and > 0, got {text!r}")
    return value


def add_arguments(p: argparse.ArgumentParser, kinds: bool = False) -> None:
    """``topk-extract``'s options; with `kinds` those of ``teacher-extract`` (``--kind``, ``--dtype``
    of the stored rows, and the teacher weights' dtype as ``--teacher-dtype``)."""
    if kinds:
        p.add_argument(
            "--kind",
            choices=["hidden", "topk"],
            default="hidden",
            help="hidden: the final hidden states and the head (exact, any divergence; default); topk: top-k log-probs",
        )
        p.add_argument(
            "--dtype",
            dest="store_dtype",
            choices=["float32", "bfloat16", "fp8"],
            default=None,
            help="hidden rows: float32, bfloat16 (default) or fp8 (e4m3 with one float32 scale per row)",
        )
    p.add_argument(
        "--model",
        required=True,
        help="local Hugging Face model directory (AutoModelForCausalLM), or a Hub id already in the local cache",
    )
    p.add_argument(
        "--data",
        required=True,
        help="corpus: .jsonl lines, .parquet or .arrow with input_ids (or text / messages with a "
        "tokenizer), or a datasets folder or name (streamed)",
    )
    p.add_argument("--out", required=True, help="output store directory (resumed if it exists)")
    p.add_argument("--k", type=_positive_int, default=64, help="entries kept per position (default 64)")
    p.add_argument(
        "--temperature",
        type=_temperature,
        default=1.0,
        help="log-probs are log-softmax(logits / T); recorded in the manifest (default 1)",
    )
    p.add_argument(
        "--vocab-size",
        type=_positive_int,
        default=None,
        help="real vocabulary: head rows beyond it (padding) are excluded (default: the tokenizer's "
        "length when it fits the head, else config.vocab_size)",
    )
    p.add_argument("--tokenizer", default=None, help="tokenizer for text / chat records (default: the model's)")
    p.add_argument("--chat-template", action="store_true", help="tokenize `messages` records with the chat template")
    p.add_argument(
        "--field",
        default=None,
        help="the record field holding the ids, text or chat (default: input_ids, else messages, else text)",
    )
    p.add_argument("--split", default="train", help="split of a datasets corpus (default train)")
    p.add_argument(
        "--logprob-dtype",
        choices=sorted(LOGPROB_DTYPES),
        default="float32",
        help="float32 (default), float16, bfloat16, or uint8 codes with a per-row scale",
    )
    p.add_argument(
        "--id-dtype",
        choices=sorted(ID_DTYPES),
        default="int32",
        help="int32 (default), or ids packed into 2 bytes (uint16: vocabularies up to 65536) or 3 (uint24)",
    )
    p.add_argument(
        "--sequences-per-shard",
        type=_positive_int,
        default=None,
        help="sequences per store shard (default 1024 for top-k, 64 for hidden states: ~Dt * 2 bytes a position)",
    )
    p.add_argument("--batch-tokens", type=_positive_int, default=16384, help="padded tokens per teacher forward")
    p.add_argument(
        "--chunk-v", type=_positive_int, default=None, help="vocab chunk of the streaming top-k (default: automatic)"
    )
    p.add_argument(
        "--num-shards",
        type=_positive_int,
        default=None,
        help="split the job over N processes (default: WORLD_SIZE under torchrun, else 1); each "
        "extracts every N-th store shard into the same --out",
    )
    p.add_argument(
        "--shard-index",
        type=_nonneg_int,
        default=None,
        help="this process's index in [0, N) (default: RANK under torchrun, else 0)",
    )
    p.add_argument(
        "--device", default=None, help="default: cuda (cuda:LOCAL_RANK under torchrun) if available, else cpu"
    )
    p.add_argument(
        "--teacher-dtype" if kinds else "--dtype",
        dest="teacher_dtype",
        default="auto",
        choices=["auto", "saved", "float32", "bfloat16", "float16"],
        help="teacher weights' dtype (default auto: bfloat16 on CUDA, as saved on the CPU)",
    )
    p.add_argument("--no-resume", action="store_true", help="start over instead of resuming an existing store")
    p.add_argument("--no-progress", action="store_true", help="no progress bar (a line per shard instead)")


def _fail(msg: str, prog: str = "topk-extract") -> int:
    print(f"nitrobrew {prog}: error: {msg}", file=sys.stderr)
    return 2


def run(args: argparse.Namespace, prog: str = "topk-extract", open_data=None) -> int:
    """The command; `open_data(spec)` may claim a corpus: (Corpus, prompt lengths, source) or None."""
    try:
        return _run(args, prog, open_data)
    except KeyboardInterrupt:
        print(f"\ninterrupted: run the same command again to resume into {args.out}", file=sys.stderr)
        return 130
    except (StoreError, ValueError, OSError, ImportError, NotImplementedError) as err:
        return _fail(str(err).splitlines()[0] if str(err) else type(err).__name__, prog)


def _run(args: argparse.Namespace, prog: str = "topk-extract", open_data=None) -> int:
    kind = getattr(args, "kind", "topk")
    if kind == "topk" and getattr(args, "store_dtype", None) is not None:
        return _fail("--dtype sets the rows of --kind hidden; a top-k store takes --logprob-dtype", prog)
    store_dtype = getattr(args, "store_dtype", None) or "bfloat16"
    if args.sequences_per_shard is None:
        args.sequences_per_shard = 1024 if kind == "topk" else 64

    def fail(msg: str) -> int:
        return _fail(msg, prog)

    # 1. arguments, the model's config, the tokenizer and the whole corpus: all before any model loads
    env = os.environ
    parts = args.num_shards or int(env.get("WORLD_SIZE", 1))
    if args.shard_index is None and parts > 1 and "RANK" not in env:
        return fail(f"--num-shards {parts} needs --shard-index (this process's index in [0, {parts}))")
    part = args.shard_index if args.shard_index is not None else int(env.get("RANK", 0))
    if not 0 <= part < parts:
        return fail(f"--shard-index {part} must be in [0, {parts}) (--num-shards)")
    device = args.device or (f"cuda:{env.get('LOCAL_RANK', 0)}" if torch.cuda.is_available() else "cpu")
    if str(device).startswith("cuda") and not torch.cuda.is_available():
        return fail(f"--device {device}: CUDA is not available on this machine")
    model_dir = resolve_model(args.model)
    cfg = load_config(model_dir)
    rows = int(getattr(cfg, "vocab_size", 0) or 0)
    if rows <= 0:
        return fail(f"{model_dir!r}: config.json has no vocab_size")
    tok = load_tokenizer(args.tokenizer or model_dir)
    if args.tokenizer and tok is None:
        return fail(f"--tokenizer {args.tokenizer!r}: no tokenizer could be loaded from it")
    V, note = choose_vocab(rows, None if tok is None else len(tok), args.vocab_size)
    if kind == "topk":
        if args.k > V:
            return fail(f"--k {args.k} is larger than the vocabulary ({V}: {note})")
        check_header(
            args.k,
            args.temperature,
            V,
            rows,
            args.logprob_dtype,
            sequences_per_shard=args.sequences_per_shard,
            num_sequences=0,
            id_dtype=args.id_dtype,
        )
    else:
        from .hidden_store import check_header as check_hidden_header

        check_hidden_header(
            store_dtype,
            1,
            V,
            rows,
            "float32",
            logit_scale=1.0,
            softcap=None,
            sequences_per_shard=args.sequences_per_shard,
            num_sequences=0,
        )
    check_sizes(args.batch_tokens, args.chunk_v)
    claimed = open_data(args.data) if open_data is not None else None
    prompt_lengths = None
    if claimed is not None:  # rollouts: prompt positions are neither stored nor counted (a hidden store)
        corpus, prompt_lengths, source = claimed
    else:
        corpus = open_corpus(
            args.data, tokenizer=tok, chat_template=args.chat_template, field=args.field, split=args.split
        )
    checked = corpus.check(rows, args.sequences_per_shard)
    if prompt_lengths is not None:
        pass
    elif corpus.path:
        source = {"path": os.path.abspath(corpus.path), "sha256": sha256_file(corpus.path)}
    else:
        source = {"dataset": args.data, "split": args.split}
    if corpus.tokenized:  # the ids depend on the tokenizer: a resume must use the same one
        source["tokenizer"] = getattr(tok, "name_or_path", "") or ""
        source["chat_template"] = bool(args.chat_template)
    what = f"K = {args.k}, T = {args.temperature}" if kind == "topk" else f"hidden states in {store_dtype}"
    print(
        f"corpus: {corpus.description}: {checked[0]} sequences, {sum(checked[1])} tokens; vocabulary: {V} ({note}); "
        f"{what}" + (f"; part {part} of {parts}" if parts > 1 else ""),
        flush=True,
    )
    # 2. the store's lock (a concurrent run fails now, not after the teacher has loaded), the teacher,
    # then the extraction
    lock = lock_store(args.out, parts, part)
    try:
        teacher = load_hf_teacher(
            model_dir, device=device, dtype=args.teacher_dtype, vocab_size=V, logit_transforms=kind == "hidden"
        )
    except BaseException:
        lock.release()
        raise
    if kind == "hidden":
        man = extract_hidden(
            teacher,
            corpus,
            args.out,
            hidden_dtype=store_dtype,
            prompt_lengths=prompt_lengths,
            sequences_per_shard=args.sequences_per_shard,
            batch_tokens=args.batch_tokens,
            source=source,
            resume=not args.no_resume,
            log=print,
            num_parts=parts,
            part=part,
            progress=not args.no_progress,
            checked=checked,
            lock=lock,
        )
        return _report(args, man, part, parts, f"hidden states ({man['hidden_dtype']}, D = {man['hidden_size']})")
    man = extract_topk(
        teacher,
        corpus,
        args.out,
        k=args.k,
        temperature=args.temperature,
        logprob_dtype=args.logprob_dtype,
        sequences_per_shard=args.sequences_per_shard,
        batch_tokens=args.batch_tokens,
        chunk=args.chunk_v,
        source=source,
        resume=not args.no_resume,
        log=print,
        num_parts=parts,
        part=part,
        progress=not args.no_progress,
        checked=checked,
        lock=lock,
        id_dtype=args.id_dtype,
    )
    return _report(args, man, part, parts, f"K={man['k']}, T={man['temperature']}")


def _report(args, man: Dict, part: int, parts: int, what: str) -> int:
    secs = man["extract_seconds"]
    rate = man["extracted_tokens"] / secs if secs > 0 else float("nan")
    run_note = f"{man['extracted_tokens']} tokens this run in {secs:.1f} s ({rate:.0f} tokens/s)"
    if "num_parts" in man:
        print(f"part {part} of {parts} done ({run_note}); {args.out} is complete once every part has run")
        return 0
    print(
        f"wrote {args.out}: {man['num_sequences']} sequences, {man['num_rows']} rows, {what}, "
        f"vocab {man['vocab_size']} of {man['head_rows']} head rows; {run_note}"
    )
    return 0
