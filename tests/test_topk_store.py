"""Top-k extraction, storage and batching, on tiny randomly initialized Hugging Face models."""

import json
import os
import sys

import pytest
import torch

from cli_helpers import cli_args
from nitrobrew.cli import main as cli_main
from nitrobrew.core.memory import TensorMemoryTracker
from nitrobrew.teacher.data import TopKCollator, TopKDataset
from nitrobrew.teacher.extract import (
    Teacher,
    extract_topk,
    load_hf_teacher,
    load_sequences,
    streaming_topk,
    teacher_from_hf,
)
from nitrobrew.teacher.store import StoreError, TopKStore
from nitrobrew.topk import topk_kl
from teacher_helpers import flip_bits, interrupted
from tiny_models import causal_lm

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

K, T = 8, 1.5
SHAPE = dict(hidden=32, intermediate_size=48, positions=64)  # the teachers: 2 layers, 4 heads


def _saved(model, path):
    model.save_pretrained(path)
    return model, str(path)


def _llama(tmp_path, tie=False):
    # realistic logit spreads (a fresh init gives near-uniform distributions)
    model = causal_lm("Llama", vocab=97, **SHAPE, tie=tie, head_scale=1.0 if tie else 60.0)
    return _saved(model.eval(), tmp_path / "llama")


def _qwen_padded(tmp_path):
    """A teacher whose head has 128 rows for a 100-token vocabulary (tied embeddings)."""
    model = causal_lm("Qwen2", vocab=128, **SHAPE, tie=True, seed=1, head_scale=1.0).eval()
    with torch.no_grad():  # give the padded rows the largest logits: they must still be excluded
        model.get_output_embeddings().weight[100:] *= 8
    return _saved(model, tmp_path / "qwen")


def _corpus(tmp_path, vocab=97, n=7, seed=0):
    g = torch.Generator().manual_seed(seed)
    lengths = [5, 1, 9, 12, 3, 7, 2][:n]
    seqs = [torch.randint(0, vocab, (L,), generator=g).tolist() for L in lengths]
    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps({"input_ids": s}) + "\n" for s in seqs))
    return seqs, str(path)


def _direct(model, seq, vocab=None):
    with torch.no_grad():
        logits = model(torch.tensor([seq])).logits[0, :-1].double()
    if vocab is not None:
        logits = logits[:, :vocab]
    return torch.log_softmax(logits / T, -1).topk(K, -1)


def test_cli_extract_matches_direct_forward(tmp_path, capsys):
    model, mdir = _llama(tmp_path)
    seqs, data = _corpus(tmp_path)
    out = str(tmp_path / "store")
    flags = dict(k=K, temperature=T, sequences_per_shard=3, device="cpu", batch_tokens=20, chunk_v=13)
    assert cli_main(cli_args("topk-extract", model=mdir, data=data, out=out, **flags)) == 0
    assert "tokens/s" in capsys.readouterr().out
    store = TopKStore(out)
    man = store.manifest
    assert (man["k"], man["temperature"], man["vocab_size"], man["num_sequences"]) == (K, T, 97, len(seqs))
    assert len(man["shards"]) == 3 and man["complete"] and man["num_rows"] == sum(len(s) - 1 for s in seqs)
    for i, s in enumerate(seqs):
        item = store[i]
        assert item["input_ids"].tolist() == s
        assert item["topk_ids"].shape == (len(s) - 1, K)
        if len(s) < 2:
            continue
        # row i is the teacher's distribution over token i + 1 (its output at position i)
        lp, ids = _direct(model, s)
        assert torch.equal(item["topk_ids"], ids)
        torch.testing.assert_close(item["topk_logprobs"].double(), lp, rtol=0, atol=2e-5)


def test_padded_vocab_is_excluded(tmp_path):
    model, mdir = _qwen_padded(tmp_path)
    seqs, data = _corpus(tmp_path, vocab=100)
    teacher = load_hf_teacher(mdir, vocab_size=100)
    assert teacher.weight.shape[0] == 128 and teacher.vocab_size == 100
    man = extract_topk(teacher, seqs, str(tmp_path / "s"), k=K, temperature=T, sequences_per_shard=4)
    assert (man["vocab_size"], man["head_rows"]) == (100, 128)
    store = TopKStore(str(tmp_path / "s"))
    for i, s in enumerate(seqs):
        if len(s) < 2:
            continue
        item = store[i]
        assert int(item["topk_ids"].max()) < 100
        lp, ids = _direct(model, s, vocab=100)
        assert torch.equal(item["topk_ids"], ids)
        torch.testing.assert_close(item["topk_logprobs"].double(), lp, rtol=0, atol=2e-5)
    # without vocab_size the padded rows (largest logits here) would take the top of the list
    everything = teacher_from_hf(model, vocab_size=128)
    ids_all, _ = streaming_topk(
        everything.hidden_fn(torch.tensor([seqs[0]]), torch.ones(1, 5, dtype=torch.long))[0],
        everything.weight,
        None,
        K,
        T,
        128,
    )
    assert int(ids_all.max()) >= 100


def test_resume_after_interruption_and_corruption(tmp_path):
    model, mdir = _llama(tmp_path, tie=True)
    seqs, _ = _corpus(tmp_path)
    teacher = load_hf_teacher(mdir)
    out = str(tmp_path / "store")
    broken = interrupted(teacher, at_call=3)  # the extraction is killed in the middle of shard 2
    with pytest.raises(KeyboardInterrupt):
        extract_topk(broken, seqs, out, k=K, temperature=T, sequences_per_shard=2, batch_tokens=12)
    man = json.load(open(os.path.join(out, "manifest.json")))
    assert not man["complete"] and [s["index"] for s in man["shards"]] == [0]
    assert not [f for f in os.listdir(out) if f.startswith(".tmp-")]  # nothing half-written left behind
    with pytest.raises(StoreError, match="incomplete"):
        TopKStore(out)
    assert len(TopKStore(out, allow_incomplete=True)) == 2
    logs = []
    man = extract_topk(teacher, seqs, out, k=K, temperature=T, sequences_per_shard=2, batch_tokens=12, log=logs.append)
    assert man["complete"] and "shard 0: already written, skipped" in logs
    assert man["extracted_tokens"] == sum(len(s) for s in seqs[2:])
    fresh = str(tmp_path / "fresh")
    extract_topk(teacher, seqs, fresh, k=K, temperature=T, sequences_per_shard=2, batch_tokens=12)
    a, b = TopKStore(out), TopKStore(fresh)
    for i in range(len(seqs)):
        assert torch.equal(a[i]["topk_ids"], b[i]["topk_ids"])
        torch.testing.assert_close(a[i]["topk_logprobs"], b[i]["topk_logprobs"], rtol=0, atol=1e-6)
    # a resume with other settings is refused
    with pytest.raises(StoreError, match="its k is 8"):
        extract_topk(teacher, seqs, out, k=4, temperature=T, sequences_per_shard=2)
    # corruption and truncation are detected and name the shard
    shard = os.path.join(out, "shard-00001.safetensors")
    raw = flip_bits(shard, -3)
    with pytest.raises(StoreError, match="shard-00001.safetensors is corrupted"):
        TopKStore(out)[2]
    open(shard, "wb").write(bytes(raw[:100]))
    with pytest.raises(StoreError, match="shard-00001.safetensors is truncated"):
        TopKStore(out)[3]
    assert TopKStore(out)[0]["topk_ids"].shape == (4, K)  # the other shards still read
    # resuming re-extracts the damaged shard
    with pytest.warns(RuntimeWarning, match="shard-00001"):
        extract_topk(teacher, seqs, out, k=K, temperature=T, sequences_per_shard=2)
    assert torch.equal(TopKStore(out)[3]["topk_ids"], b[3]["topk_ids"])


def test_collator_alignment_with_the_loss(tmp_path):
    """The teacher distilled into itself through the store gives zero loss: any off-by-one
    between positions and stored rows would not."""
    model, mdir = _llama(tmp_path)
    seqs, data = _corpus(tmp_path)
    teacher = load_hf_teacher(mdir)
    out = str(tmp_path / "store")
    extract_topk(teacher, seqs, out, k=K, temperature=T, sequences_per_shard=3)
    ds = TopKDataset(out)
    assert (len(ds), ds.k, ds.temperature, ds.vocab_size) == (len(seqs), K, T, 97)
    batch = TopKCollator(pad_token_id=0)([ds[i] for i in range(len(ds))])
    B, L = batch["input_ids"].shape
    assert L == max(len(s) for s in seqs) and batch["topk_ids"].shape == (B, L, K)
    for b, s in enumerate(seqs):
        n = len(s)
        assert batch["labels"][b, : n - 1].tolist() == s[1:]
        assert (batch["labels"][b, max(n - 1, 0) :] == -100).all()
        assert torch.isinf(batch["topk_logprobs"][b, max(n - 1, 0) :]).all()
    with torch.no_grad():
        h = teacher.hidden_fn(batch["input_ids"], batch["attention_mask"])
    w = teacher.weight.detach()
    loss = topk_kl(
        h,
        w,
        batch["topk_ids"],
        batch["topk_logprobs"],
        labels=batch["labels"],
        temperature=T,
        teacher_temperature=ds.temperature,
        backend="torch",
    )
    assert abs(loss.item()) < 1e-4
    shifted = topk_kl(
        h[:, 1:],
        w,
        batch["topk_ids"][:, :-1],
        batch["topk_logprobs"][:, :-1],
        labels=batch["labels"][:, :-1],
        temperature=T,
        backend="torch",
    )
    assert shifted.item() > 0.1
    with pytest.raises(ValueError, match="must carry"):
        TopKCollator()(
            [
                {
                    "input_ids": torch.arange(4),
                    "topk_ids": torch.zeros(4, K, dtype=torch.long),
                    "topk_logprobs": torch.zeros(4, K),
                }
            ]
        )


def test_streaming_topk_exact_and_no_vocab_wide_tensor():
    g = torch.Generator().manual_seed(0)
    R, D, V = 37, 16, 3001
    h = torch.randn(R, D, generator=g)
    w = torch.randn(V, D, generator=g)
    b = torch.randn(V, generator=g)
    with TensorMemoryTracker() as tr:
        ids, lp = streaming_topk(h, w, b, 9, 0.8, vocab_size=2999, chunk=211)
    assert tr.largest < R * V * 4 / 4
    want_lp, want_ids = torch.log_softmax((h.double() @ w[:2999].double().t() + b[:2999].double()) / 0.8, -1).topk(9)
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(lp.double(), want_lp, rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match="k must be"):
        streaming_topk(h, w, None, 0)
    with pytest.raises(ValueError, match="vocab_size"):
        streaming_topk(h, w, None, 3, vocab_size=V + 1)


def test_load_sequences_errors_and_formats(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"input_ids": [1, 2]}\n{"tokens": [3]}\n')
    with pytest.raises(ValueError, match="bad.jsonl:2"):
        load_sequences(str(bad))
    (tmp_path / "d.csv").write_text("1,2\n")
    with pytest.raises(ValueError, match="unknown dataset format"):
        load_sequences(str(tmp_path / "d.csv"))
    with pytest.raises(FileNotFoundError):
        load_sequences(str(tmp_path / "missing.jsonl"))
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    table = pa.table({"input_ids": [[1, 2, 3], [4, 5]]})
    pq.write_table(table, tmp_path / "d.parquet")
    assert load_sequences(str(tmp_path / "d.parquet")) == [[1, 2, 3], [4, 5]]
    with pa.OSFile(str(tmp_path / "d.arrow"), "wb") as sink, pa.ipc.new_file(sink, table.schema) as wr:
        wr.write_table(table)
    assert load_sequences(str(tmp_path / "d.arrow")) == [[1, 2, 3], [4, 5]]


def test_writer_reader_and_extract_errors(tmp_path):
    from nitrobrew.teacher.store import TopKWriter

    kw = dict(model="m", k=2, temperature=1.0, vocab_size=10, head_rows=10, num_sequences=3)
    with pytest.raises(ValueError, match="logprob_dtype must be one of"):
        TopKWriter(str(tmp_path / "a"), logprob_dtype="int8", **kw)
    with pytest.raises(ValueError, match="sequences_per_shard must be a positive int"):
        TopKWriter(str(tmp_path / "a"), sequences_per_shard=0, **kw)
    w = TopKWriter(str(tmp_path / "b"), sequences_per_shard=2, **kw)
    with pytest.raises(ValueError, match=r"shard 0 holds sequences \[0, 2\)"):
        w.write_shard(0, [torch.arange(3)], [torch.zeros(2, 2)], [torch.zeros(2, 2)])
    with pytest.raises(ValueError, match=r"top-k blocks must be \(2, 2\)"):
        w.write_shard(
            0,
            [torch.arange(3), torch.arange(2)],
            [torch.zeros(3, 2), torch.zeros(1, 2)],
            [torch.zeros(3, 2), torch.zeros(1, 2)],
        )
    with pytest.raises(StoreError, match=r"shards \[0, 1\] are not written"):
        w.finish()
    with pytest.raises(StoreError, match="manifest.json is missing"):
        TopKStore(str(tmp_path / "nowhere"))
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "manifest.json").write_text('{"format": "other"}')
    with pytest.raises(StoreError, match="not a nitrobrew-topk manifest"):
        TopKStore(str(tmp_path / "c"))
    # the extraction refuses tokens outside the teacher's vocabulary and logit transforms
    teacher = Teacher(lambda ids, mask: torch.zeros(*ids.shape, 4), torch.randn(10, 4), None, "t", 10)
    with pytest.raises(ValueError, match=r"sequence 0: token id 30 is outside \[0, 10\)"):
        extract_topk(teacher, [[1, 2, 30]], str(tmp_path / "d"), k=2)
    model = causal_lm("Llama", vocab=16, hidden=8, layers=1, heads=2, kv_heads=1, intermediate_size=8, head_scale=1.0)
    model.config.final_logit_softcapping = 30.0
    with pytest.raises(NotImplementedError, match="final_logit_softcapping"):
        teacher_from_hf(model)
    with pytest.raises(ValueError, match="empty batch"):
        TopKCollator()([])


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET", "0") in ("", "0"), reason="needs TRITON_INTERPRET=1")
@pytest.mark.parametrize(
    "dtype,group,chunk,T",
    [(torch.bfloat16, 16, 211, 0.8), (torch.float32, 8, 500, 1.0), (torch.bfloat16, 32, 3001, 2.0)],
)
def test_streaming_topk_triton_scan_matches_float64(dtype, group, chunk, T):
    """The fused chunk pass (tempering, log-sum-exp, group maxima) at chunk ends that cut groups."""
    g = torch.Generator().manual_seed(1)
    R, D, V = 29, 24, 3001
    h = torch.randn(R, D, generator=g).to(dtype)
    w = (torch.randn(V, D, generator=g) * 0.6).to(dtype)
    b = torch.randn(V, generator=g).to(dtype)
    ids, lp = streaming_topk(h, w, b, 11, T, vocab_size=2999, chunk=chunk, backend="triton", group=group)
    want_lp, want_ids = torch.log_softmax((h.double() @ w[:2999].double().t() + b[:2999].double()) / T, -1).topk(11)
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(lp.double(), want_lp, rtol=0, atol=2e-5)
    ids_t, lp_t = streaming_topk(h, w, b, 11, T, vocab_size=2999, chunk=chunk, backend="torch", group=group)
    assert torch.equal(ids, ids_t)
    with pytest.raises(ValueError, match="power of 2"):
        streaming_topk(h, w, b, 11, group=12)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET", "0") in ("", "0"), reason="needs TRITON_INTERPRET=1")
def test_triton_scan_keeps_a_confident_rows_tail():
    """The scan kernel updates the state's tail (the mass outside the top entry) itself: a confident
    row's tail, 3 e^-15 + e^-18 (below float32's resolution at 1), keeps its digits, which l - 1 lost (4%
    off); ties at the top count as tail, across the chunks' merge too."""
    from nitrobrew.core.online import Online
    from nitrobrew.teacher.kernels_scan import launch_scan_chunk

    z = torch.tensor([[15.0, 0.0, 0.0, 0.0, -3.0], [0.0, 2.0, -1.0, 2.0, 0.5]])
    state = Online.empty(2, torch.float32, "cpu")
    for c0, c1 in ((0, 3), (3, 5)):
        launch_scan_chunk(z[:, c0:c1].contiguous(), state, 1.0, 2)
    x = z.double()
    tail = torch.exp(x - x.amax(-1, keepdim=True)).sum(-1) - 1.0
    assert torch.equal(state.m, z.amax(-1))
    assert float(((state.tail.double() - tail).abs() / tail).max()) < 1e-6


def test_verify_without_safetensors_names_the_extra(tmp_path, monkeypatch, capsys):
    """A missing package is one line naming the extra, never a shard reported as corrupted."""
    monkeypatch.setitem(sys.modules, "safetensors", None)  # `import safetensors` raises ImportError
    assert cli_main(["topk-verify", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "nitrobrew[store]" in err[0], err
