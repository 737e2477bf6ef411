"""``nitrobrew rollout``: a model's completions of a prompt set, written once as a dataset.

Offline on-policy distillation (docs/teacher_store.md): the student (or the SFT-initialized
student) completes the prompts once; ``nitrobrew teacher-extract`` then scores the completions
(prompt positions are neither stored nor counted), and the student trains from the store for one
or more epochs without a teacher. The completions are the student's at the start: they go stale as
the student learns (a live on-policy run samples from the current student).

Layout of a rollout directory::

    manifest.json                 header (model, revision, sampling settings) + completed shards
    shard-00000.parquet           prompts [0, S): one row per prompt
    ...

Each parquet shard (a ``datasets`` parquet dataset: ``load_dataset("parquet", data_files=...)``) has
the columns ``prompt_ids``, ``completion_ids`` (the generated tokens up to and including the first
EOS; nothing after it), ``completion_mask`` (1 per kept completion token), ``input_ids`` (prompt +
completion) and ``prompt_length``. Shards are written atomically and resumed like a teacher store's
(``store.ShardWriter``: lock, sha256 per shard, ``--num-shards/--shard-index``, torchrun); shard j is
generated under the seed ``seed * 1000003 + j``, so a resumed or split run writes the same rows.
"""

from __future__ import annotations

import argparse
import io
import math
import os
import sys
import time
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from . import store
from .inputs import Corpus, open_corpus
from .store import (
    MANIFEST,
    ManifestFormat,
    ShardWriter,
    StoreError,
    _is_int,
    lock_store,
    manifest_format,
    sha256_file,
    verify_shard,
)

FORMAT = "nitrobrew-rollouts"
VERSION = 1
HEADER_KEYS = ("model", "revision", "sampling", "sequences_per_shard", "source", "num_sequences", "seed")
_HEADER_SCHEMA = {
    "model": str,
    "revision": str,
    "sampling": dict,
    "seed": int,
    "sequences_per_shard": int,
    "num_sequences": int,
    "source": dict,
    "shards": list,
    "complete": bool,
}
COLUMNS = ("prompt_ids", "completion_ids", "completion_mask", "input_ids", "prompt_length")


def _pyarrow():
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError as err:  # pragma: no cover - pyarrow is in the interop extra
        raise ImportError("rollouts are parquet: pip install 'nitrobrew[interop]'") from err
    return pa, pq


def shard_file(index: int) -> str:
    return f"shard-{index:05d}.parquet"


ROLLOUT_MANIFEST = ManifestFormat(
    name=FORMAT, version=VERSION, kind="rollout set", header_schema=_HEADER_SCHEMA, shard_file=shard_file
)


def read_manifest(path: str, name: str = MANIFEST) -> Dict:
    """A rollout set's manifest (``store.read_manifest``: read and checked)."""
    return store.read_manifest(path, name, fmt=ROLLOUT_MANIFEST)


def is_rollouts(path: str) -> bool:
    """Whether `path` is a rollout directory (its manifest names the format)."""
    return manifest_format(path) == FORMAT


class RolloutWriter(ShardWriter):
    """Rollout shards (parquet) with the teacher store's guarantees (``store.ShardWriter``)."""

    header_keys = HEADER_KEYS
    manifest_format = ROLLOUT_MANIFEST

    def __init__(
        self,
        path: str,
        *,
        model: str,
        revision: str,
        sampling: Dict,
        seed: int,
        num_sequences: int,
        sequences_per_shard: int = 256,
        source: Optional[Dict] = None,
        resume: bool = True,
        num_parts: int = 1,
        part: int = 0,
        lock=None,
    ):
        if not (_is_int(sequences_per_shard) and sequences_per_shard > 0):
            raise ValueError(f"sequences_per_shard must be a positive int, got {sequences_per_shard!r}")
        header = {
            "model": model,
            "revision": revision or "",
            "sampling": dict(sampling),
            "seed": int(seed),
            "sequences_per_shard": sequences_per_shard,
            "source": source or {},
            "num_sequences": int(num_sequences),
        }
        self._open_store(path, header, resume=resume, num_parts=num_parts, part=part, lock=lock)

    def write_shard(self, index: int, prompts: Sequence[List[int]], completions: Sequence[List[int]]):
        self.check_index(index)
        first, last = self.shard_range(index)
        if not len(prompts) == len(completions) == last - first:
            raise ValueError(
                f"shard {index} holds prompts [{first}, {last}): got {len(prompts)} and {len(completions)}"
            )
        pa, pq = _pyarrow()
        ints = pa.list_(pa.int32())
        table = pa.table(
            {
                "prompt_ids": pa.array([list(p) for p in prompts], type=ints),
                "completion_ids": pa.array([list(c) for c in completions], type=ints),
                "completion_mask": pa.array([[1] * len(c) for c in completions], type=pa.list_(pa.int8())),
                "input_ids": pa.array([list(p) + list(c) for p, c in zip(prompts, completions)], type=ints),
                "prompt_length": pa.array([len(p) for p in prompts], type=pa.int32()),
            }
        )
        buf = io.BytesIO()
        pq.write_table(table, buf)
        data = buf.getvalue()
        tokens = sum(len(p) + len(c) for p, c in zip(prompts, completions))
        return self._commit(index, data, sum(len(c) for c in completions), tokens)


def read_rollouts(path: str, verify: bool = True) -> Tuple[List[List[int]], List[int], Dict]:
    """(input_ids per sequence, prompt lengths, manifest) of a complete rollout set."""
    man = read_manifest(path)
    if not man["complete"]:
        raise StoreError(f"rollout set {path!r} is incomplete: run the same `nitrobrew rollout` again to finish it")
    _, pq = _pyarrow()
    seqs: List[List[int]] = []
    plen: List[int] = []
    for info in man["shards"]:
        if verify:
            verify_shard(path, info)
        table = pq.read_table(os.path.join(path, info["file"]), columns=["input_ids", "prompt_length"])
        if table.num_rows != info["sequences"]:
            raise StoreError(f"{info['file']}: {table.num_rows} rows, the manifest says {info['sequences']}")
        seqs += table.column("input_ids").to_pylist()
        plen += table.column("prompt_length").to_pylist()
    return seqs, plen, man


def rollout_corpus(path: str) -> Tuple[Corpus, List[int], Dict]:
    """(corpus of prompt + completion ids, prompt lengths, source record) of a rollout set."""
    seqs, plen, man = read_rollouts(path)
    corpus = Corpus.from_sequences(seqs)
    corpus.description = f"rollouts {path} ({man['model']})"
    source = {
        "rollouts": os.path.abspath(path),
        "manifest_sha256": sha256_file(os.path.join(path, MANIFEST)),
        "model": man["model"],
        "revision": man["revision"],
    }
    return corpus, plen, source


# ------------------------------------------------------------------------------------ generating


def generate_rollouts(
    model,
    prompts: Sequence[List[int]],
    out_dir: str,
    *,
    sampling,
    seed: int = 0,
    batch_size: int = 16,
    sequences_per_shard: int = 256,
    model_name: str = "model",
    revision: str = "",
    source: Optional[Dict] = None,
    resume: bool = True,
    num_parts: int = 1,
    part: int = 0,
    lock=None,
    log=None,
    backend: str = "auto",
) -> Dict:
    """Complete `prompts` with `model` (``make_generator(backend, model)``) into a rollout set.

    Prompts are left-padded in batches of `batch_size`; each completion keeps its tokens up to and
    including the first EOS. Shard j draws from the seed ``seed * 1000003 + j``. Returns the manifest."""
    from ..hf.generation import make_generator

    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size <= 0:
        raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
    for i, p in enumerate(prompts):
        if not p:
            raise ValueError(f"prompt {i} is empty: a completion needs at least one prompt token")
    settings = {
        k: getattr(sampling, k)
        for k in ("max_new_tokens", "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "eos_token_id")
    }
    try:
        writer = RolloutWriter(
            out_dir,
            model=model_name,
            revision=revision,
            sampling=settings,
            seed=seed,
            num_sequences=len(prompts),
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
    engine = make_generator(backend, model)
    device = next(model.parameters()).device
    eos = set(sampling.eos_list())
    try:
        for j in range(writer.num_shards):
            if not writer.owns(j) or writer.done(j):
                continue
            a, b = writer.shard_range(j)
            completions: List[List[int]] = []
            t0 = time.perf_counter()
            devices = [device] if device.type == "cuda" else []
            with torch.random.fork_rng(devices=devices):
                torch.manual_seed(seed * 1_000_003 + j)
                for c0 in range(a, b, batch_size):
                    group = prompts[c0 : min(c0 + batch_size, b)]
                    P = max(len(p) for p in group)
                    ids = torch.full((len(group), P), sampling.pad_token_id, dtype=torch.long)
                    mask = torch.zeros(len(group), P, dtype=torch.long)
                    for i, p in enumerate(group):  # left padding: every prompt ends at column P - 1
                        ids[i, P - len(p) :] = torch.tensor(p, dtype=torch.long)
                        mask[i, P - len(p) :] = 1
                    out = engine.generate(ids.to(device), mask.to(device), sampling)
                    for row, keep in zip(out.ids.cpu().tolist(), out.mask.cpu().tolist()):
                        comp = [t for t, k in zip(row, keep) if k]
                        n = next((i + 1 for i, t in enumerate(comp) if t in eos), len(comp))
                        completions.append(comp[:n])
            writer.write_shard(j, prompts[a:b], completions)
            if log:
                toks = sum(len(c) for c in completions)
                log(f"shard {j}: prompts [{a}, {b}) completed, {toks} tokens in {time.perf_counter() - t0:.1f} s")
        return dict(writer.finish())
    finally:
        writer.close()


# ------------------------------------------------------------------------------------------- CLI


def add_arguments(p: argparse.ArgumentParser) -> None:
    from .extract import _nonneg_int, _positive_int

    p.description = __doc__.splitlines()[0]
    p.add_argument("--model", required=True, help="the model that completes the prompts (a local directory)")
    p.add_argument(
        "--prompts",
        required=True,
        help="prompts: .jsonl / .parquet / .arrow with input_ids (or text / messages with the model's tokenizer)",
    )
    p.add_argument("--out", required=True, help="output directory (resumed if it exists)")
    p.add_argument("--field", default=None, help="the prompt field (default: input_ids, else messages, else text)")
    p.add_argument("--chat-template", action="store_true", help="tokenize `messages` with the chat template")
    p.add_argument("--max-new-tokens", type=_positive_int, default=256)
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (0: greedy; default 1)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=_nonneg_int, default=0)
    p.add_argument("--seed", type=_nonneg_int, default=0)
    p.add_argument("--batch-size", type=_positive_int, default=16, help="prompts per generate call")
    p.add_argument("--sequences-per-shard", type=_positive_int, default=256)
    p.add_argument("--num-shards", type=_positive_int, default=None, help="default: WORLD_SIZE under torchrun, else 1")
    p.add_argument("--shard-index", type=_nonneg_int, default=None, help="default: RANK under torchrun, else 0")
    p.add_argument("--device", default=None, help="default: cuda (cuda:LOCAL_RANK under torchrun) if available")
    p.add_argument("--no-resume", action="store_true", help="start over instead of resuming")


def _fail(msg: str) -> int:
    print(f"nitrobrew rollout: error: {msg}", file=sys.stderr)
    return 2


def run(args: argparse.Namespace) -> int:
    try:
        return _run(args)
    except KeyboardInterrupt:
        print(f"\ninterrupted: run the same command again to resume into {args.out}", file=sys.stderr)
        return 130
    except (StoreError, ValueError, TypeError, OSError, ImportError) as err:
        return _fail(str(err).splitlines()[0] if str(err) else type(err).__name__)


def _run(args: argparse.Namespace) -> int:
    from ..hf.generation import Sampling
    from .extract import load_config, load_tokenizer, resolve_model

    env = os.environ
    parts = args.num_shards or int(env.get("WORLD_SIZE", 1))
    if args.shard_index is None and parts > 1 and "RANK" not in env:
        return _fail(f"--num-shards {parts} needs --shard-index (this process's index in [0, {parts}))")
    part = args.shard_index if args.shard_index is not None else int(env.get("RANK", 0))
    if not 0 <= part < parts:
        return _fail(f"--shard-index {part} must be in [0, {parts}) (--num-shards)")
    if not (math.isfinite(args.temperature) and args.temperature >= 0):
        return _fail(f"--temperature must be finite and >= 0, got {args.temperature}")
    if not 0 < args.top_p <= 1:
        return _fail(f"--top-p must be in (0, 1], got {args.top_p}")
    device = args.device or (f"cuda:{env.get('LOCAL_RANK', 0)}" if torch.cuda.is_available() else "cpu")
    if str(device).startswith("cuda") and not torch.cuda.is_available():
        return _fail(f"--device {device}: CUDA is not available on this machine")
    model_dir = resolve_model(args.model)
    cfg = load_config(model_dir)
    rows = int(getattr(cfg, "vocab_size", 0) or 0)
    if rows <= 0:
        return _fail(f"{model_dir!r}: config.json has no vocab_size")
    tok = load_tokenizer(model_dir)
    corpus = open_corpus(args.prompts, tokenizer=tok, chat_template=args.chat_template, field=args.field)
    corpus.check(rows, args.sequences_per_shard)
    prompts = [ids for _, ids in corpus.records()]
    eos = getattr(cfg, "eos_token_id", None)
    pad = getattr(cfg, "pad_token_id", None)
    pad = pad if isinstance(pad, int) else (eos if isinstance(eos, int) else (eos or [0])[0])
    sampling = Sampling(
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        eos_token_id=eos,
        pad_token_id=int(pad),
    )
    source = {"path": os.path.abspath(corpus.path), "sha256": sha256_file(corpus.path)} if corpus.path else {}
    lock = lock_store(args.out, parts, part)
    try:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True).to(device).eval()
    except BaseException:
        lock.release()
        raise
    man = generate_rollouts(
        model,
        prompts,
        args.out,
        sampling=sampling,
        seed=args.seed,
        batch_size=args.batch_size,
        sequences_per_shard=args.sequences_per_shard,
        model_name=os.path.abspath(model_dir),
        revision=str(getattr(cfg, "_commit_hash", None) or ""),
        source=source,
        resume=not args.no_resume,
        num_parts=parts,
        part=part,
        lock=lock,
        log=print,
    )
    if not man.get("complete"):
        print(f"part {part} of {parts} done; {args.out} is complete once every part has run")
        return 0
    print(
        f"wrote {args.out}: {man['num_sequences']} prompts, {man['num_rows']} completion tokens, "
        f"{man['num_tokens']} tokens in all"
    )
    return 0
