"""Corpora for the top-k extraction, read as streams (never whole into Python lists).

A corpus yields ``(where, ids)``: ``where`` names the record in error messages (``data.jsonl:12``,
``data.parquet: row 7``, ``sequence 3``) and ``ids`` is its list of token ids. Sources:

- ``.jsonl`` / ``.json`` lines, ``.parquet``, ``.arrow`` files (pyarrow, read in record batches);
- a ``datasets`` name or local path: a directory written by ``Dataset.save_to_disk`` (memory-mapped),
  else ``load_dataset(name, split=..., streaming=True)`` (a folder of data files is streamed from
  disk, a Hub name from the Hub);
- a list of id lists (the Python API).

A record gives its ids by an ``input_ids`` list of ints; or, with a tokenizer, by ``text`` (a
string, tokenized with the tokenizer's special tokens) or by ``messages`` (a chat, through the
tokenizer's chat template: only when ``chat_template=True``). ``field`` picks a column by name.
The corpus is read twice: once to check every record (and count them) before anything is loaded
or written, once to extract.
"""

from __future__ import annotations

import json
import os
from typing import Callable, Iterator, List, Optional, Sequence, Tuple

Record = Tuple[str, List[int]]
FILE_SUFFIXES = (".jsonl", ".json", ".parquet", ".arrow", ".feather", ".ipc")


def _is_ids(ids) -> bool:
    return isinstance(ids, list) and all(type(t) is int for t in ids)  # bool is an int subclass: refused


class Corpus:
    """Re-iterable token sequences: ``records()`` yields ``(where, ids)`` in corpus order."""

    def __init__(
        self,
        records: Callable[[], Iterator[Record]],
        description: str,
        path: Optional[str] = None,
        tokenize: Optional["_Tokenize"] = None,
    ):
        self._records = records
        self.description = description
        self.path = path  # a local file, hashed into the store's manifest
        self._tokenize = tokenize

    @property
    def tokenized(self) -> bool:
        """Whether a record read so far was text or a chat (its ids depend on the tokenizer)."""
        return self._tokenize is not None and self._tokenize.used

    def records(self) -> Iterator[Record]:
        return self._records()

    @staticmethod
    def from_sequences(seqs: Sequence[Sequence[int]]) -> "Corpus":
        def gen():
            for i, s in enumerate(seqs):
                ids = s.tolist() if hasattr(s, "tolist") else list(s)
                if not _is_ids(ids):
                    raise ValueError(f"sequence {i}: token ids must be ints (not bools or floats), got {list(s)[:8]!r}")
                yield f"sequence {i}", ids

        return Corpus(gen, f"{len(seqs)} sequences")

    def check(self, bound: int, sequences_per_shard: int) -> Tuple[int, List[int]]:
        """Every record's ids in [0, bound) (ValueError naming the first bad record); returns the
        number of sequences and the tokens of each shard of `sequences_per_shard` sequences."""
        n, shard_tokens = 0, []
        for where, ids in self.records():
            if ids and (min(ids) < 0 or max(ids) >= bound):
                bad = next(t for t in ids if not 0 <= t < bound)
                raise ValueError(f"{where}: token id {bad} is outside [0, {bound}) (the teacher's vocabulary)")
            if n % sequences_per_shard == 0:
                shard_tokens.append(0)
            shard_tokens[-1] += len(ids)
            n += 1
        return n, shard_tokens


class _Tokenize:
    """A record (dict) to its ids: input_ids, else text / messages through the tokenizer."""

    def __init__(self, tokenizer=None, chat_template: bool = False, field: Optional[str] = None):
        self.tok, self.chat, self.field = tokenizer, chat_template, field
        self.used = False

    def __call__(self, rec, where: str) -> List[int]:
        if not isinstance(rec, dict):
            raise ValueError(f"{where}: expected a JSON object, got {type(rec).__name__}")
        field = self.field or next((f for f in ("input_ids", "messages", "text") if f in rec), None)
        if field is None or field not in rec:
            want = repr(field) if field else "input_ids, text or messages"
            raise ValueError(f"{where}: no {want} field (fields: {sorted(rec)[:8]})")
        value = rec[field]
        if isinstance(value, str):
            return self._text(value, where)
        if isinstance(value, list) and value and isinstance(value[0], dict):
            return self._chat(value, where)
        if not _is_ids(value):
            raise ValueError(f"{where}: {field} must be a list of ints (not bools or floats), a string or a chat")
        return value

    def _need_tokenizer(self, what: str, where: str):
        if self.tok is None:
            raise ValueError(f"{where}: {what} needs a tokenizer (--tokenizer, or one saved with the model)")

    def _text(self, text: str, where: str) -> List[int]:
        self._need_tokenizer("text", where)
        self.used = True
        return list(self.tok(text, add_special_tokens=True)["input_ids"])

    def _chat(self, messages, where: str) -> List[int]:
        if not self.chat:
            raise ValueError(f"{where}: a chat (messages) needs --chat-template")
        self._need_tokenizer("a chat", where)
        self.used = True
        out = self.tok.apply_chat_template(messages, tokenize=True)
        if isinstance(out, dict) or hasattr(out, "keys"):  # recent transformers return a BatchEncoding
            out = out["input_ids"]
        return list(out)


def _jsonl(path: str, to_ids: _Tokenize) -> Iterator[Record]:
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{n}"
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{where}: not valid JSON ({err})") from err
            yield where, to_ids(rec, where)


def _arrow_batches(path: str):
    try:
        import pyarrow as pa
    except ImportError as err:
        raise ImportError(f"reading {path!r} needs pyarrow (pip install pyarrow), or convert it to .jsonl") from err
    if path.lower().endswith(".parquet"):
        import pyarrow.parquet as pq

        yield from pq.ParquetFile(path).iter_batches(batch_size=1024)
        return
    with pa.memory_map(path) as src:
        try:
            reader = pa.ipc.open_file(src)
            batches = (reader.get_batch(i) for i in range(reader.num_record_batches))
        except pa.ArrowInvalid:
            src.seek(0)
            batches = iter(pa.ipc.open_stream(src))
        yield from batches


def _arrow(path: str, to_ids: _Tokenize) -> Iterator[Record]:
    n = 0
    for batch in _arrow_batches(path):
        for rec in batch.to_pylist():
            yield f"{path}: row {n}", to_ids(rec, f"{path}: row {n}")
            n += 1


def _datasets(name: str, split: str, to_ids: _Tokenize) -> Iterator[Record]:
    try:
        import datasets
    except ImportError as err:
        raise ImportError(f"reading the dataset {name!r} needs datasets: pip install datasets") from err
    if os.path.isdir(name) and (
        os.path.exists(os.path.join(name, "state.json")) or os.path.exists(os.path.join(name, "dataset_dict.json"))
    ):
        ds = datasets.load_from_disk(name)  # memory-mapped Arrow files
        if isinstance(ds, datasets.DatasetDict):
            ds = ds[split]
    else:
        ds = datasets.load_dataset(name, split=split, streaming=True)
    for n, rec in enumerate(ds):
        yield f"{name}[{split}]: row {n}", to_ids(rec, f"{name}[{split}]: row {n}")


def open_corpus(
    spec: str, tokenizer=None, chat_template: bool = False, field: Optional[str] = None, split: str = "train"
) -> Corpus:
    """The corpus named by `spec`: a .jsonl/.parquet/.arrow file, else a ``datasets`` path or name."""
    to_ids = _Tokenize(tokenizer, chat_template, field)
    lower = spec.lower()
    if lower.endswith(FILE_SUFFIXES):
        if not os.path.isfile(spec):
            raise FileNotFoundError(f"dataset {spec!r} does not exist")
        if lower.endswith((".jsonl", ".json")):
            return Corpus(lambda: _jsonl(spec, to_ids), spec, path=spec, tokenize=to_ids)
        return Corpus(lambda: _arrow(spec, to_ids), spec, path=spec, tokenize=to_ids)
    if os.path.isfile(spec):
        raise ValueError(f"unknown dataset format for {spec!r}: use .jsonl, .parquet or .arrow, or a datasets folder")
    return Corpus(lambda: _datasets(spec, split, to_ids), f"{spec}[{split}]", tokenize=to_ids)


def read_all(corpus: Corpus) -> List[List[int]]:
    return [ids for _, ids in corpus.records()]
