"""The offline teacher: what a teacher says about a corpus, extracted once and stored for training.

- ``extract``: ``nitrobrew topk-extract`` / ``extract_topk`` (the teacher's forward over a corpus, the
  streaming top-k scan of ``kernels_scan``); corpora are read by ``inputs``.
- ``store``: the sharded safetensors store with its JSON manifest, lock and checksums.
- ``verify``: ``nitrobrew topk-verify``. ``interop``: ``topk-export`` / ``topk-import`` (parquet).
- ``data``: the dataset and collator that turn a store into batches for ``nitrobrew.topk_kl``.

The losses never import this package.
"""
