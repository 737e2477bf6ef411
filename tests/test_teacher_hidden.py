"""The hidden-state teacher store: format, extraction, resume, parts, lock, checks, verify, fp8."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("safetensors")

from nitrobrew.cli import main as cli_main  # noqa: E402
from nitrobrew.teacher.extract import Teacher, extract_hidden  # noqa: E402
from nitrobrew.teacher.hidden_store import (  # noqa: E402
    HiddenStore,
    HiddenWriter,
    dequantize_fp8,
    quantize_fp8,
)
from nitrobrew.teacher.store import StoreError  # noqa: E402

V, D = 30, 8


def _tiny_teacher(seed=0, bias=False):
    """A deterministic toy teacher: embedding + causal running mean + head."""
    g = torch.Generator().manual_seed(seed)
    emb, head = torch.randn(V, D, generator=g), torch.randn(V, D, generator=g) * 3
    b = torch.randn(V, generator=g) if bias else None

    def hidden(ids, mask):
        x = emb[ids] * mask[..., None]
        return x.cumsum(1) / torch.arange(1, ids.shape[1] + 1)[None, :, None]

    return Teacher(hidden, head, b, "toy", V)


def _seqs(n=11, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, V, (int(torch.randint(1, 9, (1,), generator=g)),), generator=g).tolist() for _ in range(n)]


def _files(path):
    return {f: open(os.path.join(path, f), "rb").read() for f in sorted(os.listdir(path)) if not f.startswith(".")}


def _live_rows(teacher, s, start=0):
    ids = torch.tensor([s])
    return teacher.hidden_fn(ids, torch.ones_like(ids))[0, start : len(s) - 1]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_rows_are_the_teachers_hidden_states(tmp_path, dtype):
    teacher, seqs = _tiny_teacher(bias=True), _seqs()
    man = extract_hidden(teacher, seqs, str(tmp_path / "s"), hidden_dtype=dtype, sequences_per_shard=4, batch_tokens=16)
    assert man["complete"] and man["num_rows"] == sum(max(len(s) - 1, 0) for s in seqs)
    store = HiddenStore(str(tmp_path / "s"))
    for i, s in enumerate(seqs):
        item = store[i]
        assert item["input_ids"].tolist() == s and item["prompt_length"] == 0
        want = _live_rows(teacher, s).to(getattr(torch, dtype))
        assert item["hidden"].dtype == want.dtype and torch.equal(item["hidden"], want)
    head = store.head()
    assert torch.equal(head.weight, teacher.weight) and torch.equal(head.bias, teacher.bias)
    assert head.scale == 1.0 and head.softcap is None and store.vocab_size == V


def test_prompt_positions_are_not_stored(tmp_path):
    teacher, seqs = _tiny_teacher(), _seqs(6)
    plen = [min(3, len(s)) for s in seqs]
    extract_hidden(teacher, seqs, str(tmp_path / "s"), hidden_dtype="float32", prompt_lengths=plen)
    store = HiddenStore(str(tmp_path / "s"))
    for i, s in enumerate(seqs):
        start = max(plen[i] - 1, 0)
        assert torch.equal(store[i]["hidden"], _live_rows(teacher, s, start)) and store[i]["prompt_length"] == plen[i]
    with pytest.raises(ValueError, match="prompt lengths for a corpus"):
        extract_hidden(teacher, seqs, str(tmp_path / "t"), prompt_lengths=plen[:-1])
    assert not (tmp_path / "t").exists()


def test_fp8_round_trip_error_bound():
    g = torch.Generator().manual_seed(0)
    h = torch.randn(64, 96, generator=g) * torch.logspace(-3, 2, 64)[:, None]
    h[3] = 0.0  # a zero row: scale 1, exact
    h[5, :10] = 1e-6  # entries far below the row's largest: subnormal codes
    codes, scale = quantize_fp8(h)
    assert codes.dtype == torch.float8_e4m3fn and scale.dtype == torch.float32 and scale.shape == (64,)
    back = dequantize_fp8(codes, scale)
    err = (back - h).abs()
    bound = torch.maximum(h.abs() * 2.0**-4, scale[:, None] * 2.0**-10)
    assert (err <= bound * (1 + 1e-6)).all()
    assert torch.equal(back[3], h[3])
    assert torch.allclose(back.abs().amax(1), h.abs().amax(1), rtol=1e-6)  # the max is kept (to float rounding)
    # the bound is tight: a looser quantizer (2 mantissa bits) would break it
    assert (err > h.abs() * 2.0**-5).any()


def test_fp8_store_round_trip(tmp_path):
    teacher, seqs = _tiny_teacher(), _seqs()
    extract_hidden(teacher, seqs, str(tmp_path / "s"), hidden_dtype="fp8", sequences_per_shard=4)
    store = HiddenStore(str(tmp_path / "s"))
    for i, s in enumerate(seqs):
        item = store[i]
        live = _live_rows(teacher, s)
        assert item["hidden"].dtype == torch.float8_e4m3fn and item["hidden_scale"].shape == (live.shape[0],)
        back = dequantize_fp8(item["hidden"], item["hidden_scale"])
        bound = torch.maximum(live.abs() * 2.0**-4, item["hidden_scale"][:, None] * 2.0**-10)
        assert ((back - live).abs() <= bound * (1 + 1e-6)).all()


def test_kill_and_resume_reproduce_the_clean_store(tmp_path):
    teacher, seqs = _tiny_teacher(), _seqs(23)
    kw = dict(hidden_dtype="bfloat16", sequences_per_shard=4, batch_tokens=16, source={"path": "corpus"})
    clean = extract_hidden(teacher, seqs, str(tmp_path / "one"), **kw)
    calls = {"n": 0}

    def flaky(ids, mask):
        calls["n"] += 1
        if calls["n"] == 5:
            raise KeyboardInterrupt
        return teacher.hidden_fn(ids, mask)

    with pytest.raises(KeyboardInterrupt):
        extract_hidden(Teacher(flaky, teacher.weight, None, "toy", V), seqs, str(tmp_path / "two"), **kw)
    man = json.loads((tmp_path / "two" / "manifest.json").read_text())
    assert not man["complete"] and 0 < len(man["shards"]) < 6
    with pytest.raises(StoreError, match="incomplete"):
        HiddenStore(str(tmp_path / "two"))
    again = extract_hidden(teacher, seqs, str(tmp_path / "two"), **kw)
    assert again["extracted_tokens"] < clean["extracted_tokens"]
    assert _files(tmp_path / "one") == _files(tmp_path / "two")
    # another teacher (another head) is not resumed into this store
    with pytest.raises(StoreError, match="head_sha256"):
        extract_hidden(_tiny_teacher(seed=1), seqs, str(tmp_path / "two"), **kw)


def test_parts_reproduce_the_single_process_store(tmp_path):
    teacher, seqs = _tiny_teacher(), _seqs(23)
    kw = dict(hidden_dtype="fp8", sequences_per_shard=4, batch_tokens=16)
    extract_hidden(teacher, seqs, str(tmp_path / "one"), **kw)
    p1 = extract_hidden(teacher, seqs, str(tmp_path / "two"), num_parts=2, part=1, **kw)
    assert p1["num_parts"] == 2 and [s["index"] for s in p1["shards"]] == [1, 3, 5]
    assert extract_hidden(teacher, seqs, str(tmp_path / "two"), num_parts=2, part=0, **kw)["complete"]
    assert _files(tmp_path / "one") == _files(tmp_path / "two")


def test_corrupted_shard_and_head_are_detected(tmp_path, capsys):
    extract_hidden(_tiny_teacher(), _seqs(), str(tmp_path / "s"), sequences_per_shard=4)
    assert cli_main(["teacher-verify", str(tmp_path / "s")]) == 0
    assert "ok: 3 shards" in capsys.readouterr().out
    assert cli_main(["teacher-verify", str(tmp_path / "nowhere")]) == 1
    assert "is not a teacher store" in capsys.readouterr().err
    shard = tmp_path / "s" / "shard-00001.safetensors"
    raw = bytearray(shard.read_bytes())
    raw[-3] ^= 0xFF
    shard.write_bytes(bytes(raw))
    with pytest.raises(StoreError, match="shard-00001.safetensors is corrupted"):
        HiddenStore(str(tmp_path / "s"))[5]
    assert cli_main(["teacher-verify", str(tmp_path / "s"), "--quiet"]) == 1
    err = capsys.readouterr().err
    assert "shard-00001.safetensors is corrupted" in err and "Traceback" not in err
    head = tmp_path / "s" / "head.safetensors"
    raw = bytearray(head.read_bytes())
    raw[-1] ^= 0xFF
    head.write_bytes(bytes(raw))
    with pytest.raises(StoreError, match="head.safetensors is corrupted"):
        HiddenStore(str(tmp_path / "s")).head()
    # resuming re-extracts the corrupted shard and rewrites the head
    with pytest.warns(RuntimeWarning, match="extracted again"):
        extract_hidden(_tiny_teacher(), _seqs(), str(tmp_path / "s"), sequences_per_shard=4)
    assert cli_main(["teacher-verify", str(tmp_path / "s"), "--quiet"]) == 0


@pytest.mark.parametrize("fmt", ["hidden", "topk"])
def test_readers_name_a_shard_unlike_its_manifest(tmp_path, fmt):
    """Both stores' readers (store.ShardReader), the sha256 check off: a shard's tensors are checked on
    opening, and the shard is named."""
    from safetensors.torch import load_file, save_file

    from nitrobrew.teacher.extract import extract_topk
    from nitrobrew.teacher.store import TopKStore

    path = str(tmp_path / "s")
    if fmt == "hidden":
        extract_hidden(_tiny_teacher(), _seqs(), path, hidden_dtype="float32", sequences_per_shard=4)
        reader, rows = HiddenStore, "hidden"
    else:
        extract_topk(_tiny_teacher(), _seqs(), path, k=3, sequences_per_shard=4)
        reader, rows = TopKStore, "topk_ids"
    shard = os.path.join(path, "shard-00000.safetensors")
    good = load_file(shard)
    save_file({n: t for n, t in good.items() if n != rows}, shard)
    with pytest.raises(StoreError, match=f"shard-00000.safetensors lacks tensors \\['{rows}'\\]"):
        reader(path, verify=False)[0]
    save_file(dict(good, **{rows: good[rows][:-1].contiguous()}), shard)
    with pytest.raises(StoreError, match="shard-00000.safetensors does not match the manifest"):
        reader(path, verify=False)[0]
    with open(shard, "wb") as f:
        f.write(b"not a safetensors file")
    with pytest.raises(StoreError, match="shard-00000.safetensors cannot be read"):
        reader(path, verify=False)[0]
    assert reader(path, verify=False)[4]["input_ids"].tolist() == _seqs()[4]  # the other shards still read


def _rewrite_shard(path, tensors):
    """Replace shard 0 and record its new size and sha256: only the content checks can object."""
    from safetensors.torch import save_file

    from nitrobrew.teacher.store import sha256_file

    shard = os.path.join(path, "shard-00000.safetensors")
    save_file(tensors, shard)
    mpath = os.path.join(path, "manifest.json")
    man = json.loads(open(mpath).read())
    man["shards"][0].update(bytes=os.path.getsize(shard), sha256=sha256_file(shard))
    with open(mpath, "w") as f:
        json.dump(man, f)
    return shard


@pytest.mark.parametrize("fmt", ["hidden", "topk"])
def test_verify_reads_each_shards_contents(tmp_path, capsys, fmt):
    """teacher-verify / topk-verify (one walk over the shards, one report): a shard whose size and sha256
    match the manifest is still read, and each content problem is a line naming it."""
    from safetensors.torch import load_file

    from nitrobrew.teacher.extract import extract_topk
    from nitrobrew.teacher.hidden_verify import verify_hidden_store
    from nitrobrew.teacher.verify import verify_store

    path = str(tmp_path / "s")
    if fmt == "hidden":
        extract_hidden(_tiny_teacher(), _seqs(), path, hidden_dtype="float32", sequences_per_shard=4)
        command, verify, rows = "teacher-verify", verify_hidden_store, "hidden"
    else:
        extract_topk(_tiny_teacher(), _seqs(), path, k=3, sequences_per_shard=4)
        command, verify, rows = "topk-verify", verify_store, "topk_logprobs"
    assert cli_main([command, path]) == 0
    out = capsys.readouterr().out
    assert "shard-00002.safetensors: ok" in out and "ok: 3 shards, 11 sequences" in out
    if fmt == "hidden":
        assert (
            "head.safetensors: ok" in out and f"of width {D} in float32" in out and f"head {V} x {D} (float32)" in out
        )
    else:
        assert "K = 3, float32 log-probs" in out
    good = load_file(os.path.join(path, "shard-00000.safetensors"))
    shard = _rewrite_shard(path, dict(good, extra=torch.zeros(1)))
    assert verify(path) == [f"{shard}: tensors {sorted([*good, 'extra'])}, expected {sorted(good)}"]
    _rewrite_shard(path, dict(good, row_offsets=good["row_offsets"].int()))
    assert verify(path) == [f"{shard}: row_offsets is torch.int32, expected torch.int64"]
    ids = good["input_ids"].clone()
    ids[0] = V
    _rewrite_shard(path, dict(good, input_ids=torch.cat([ids, ids[:1]])))
    n = good["input_ids"].numel()
    assert verify(path) == [
        f"{shard}: {n + 1} tokens, offsets say {n}, manifest {n}",
        f"{shard}: input ids outside [0, {V})",
    ]
    bad = good[rows].clone()
    bad[0, 0] = float("nan")
    _rewrite_shard(path, dict(good, **{rows: bad}))
    nan = "hidden states hold NaN or infinite values" if fmt == "hidden" else "log-probs must be <= 0 and not NaN"
    assert verify(path) == [f"{shard}: {nan}"]
    assert cli_main([command, path, "--quiet"]) == 1
    assert f"nitrobrew {command}: {shard}: {nan}" in capsys.readouterr().err


def test_two_writers(tmp_path):
    out = str(tmp_path / "s")
    teacher, seqs = _tiny_teacher(), _seqs()
    holder = HiddenWriter(out, model="toy", weight=teacher.weight, bias=None, vocab_size=V, num_sequences=len(seqs))
    with pytest.raises(StoreError, match="another extraction is writing into"):
        extract_hidden(teacher, seqs, out)
    holder.close()
    assert extract_hidden(teacher, seqs, out)["complete"]
    code = (
        "import sys, time, torch; from nitrobrew.teacher.hidden_store import HiddenWriter; "
        "w = HiddenWriter(sys.argv[1], model='x', weight=torch.zeros(4, 2), bias=None, vocab_size=4, "
        "num_sequences=1, resume=False); print('locked', flush=True); time.sleep(60)"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.getcwd()] + sys.path))
    other = subprocess.Popen([sys.executable, "-c", code, out], stdout=subprocess.PIPE, env=env, text=True)
    try:
        assert other.stdout.readline().strip() == "locked"
        with pytest.raises(StoreError, match="another extraction is writing into"):
            extract_hidden(teacher, seqs, out)
    finally:
        other.stdout.close()
        other.kill()
        other.wait()


@pytest.mark.parametrize(
    "bad",
    [
        dict(hidden_dtype="float16"),
        dict(hidden_dtype="fp4"),
        dict(sequences_per_shard=0),
        dict(batch_tokens=0),
        dict(prompt_lengths=[1]),
    ],
)
def test_rejected_arguments_write_nothing(tmp_path, bad):
    out = tmp_path / "s"
    with pytest.raises(ValueError):
        extract_hidden(_tiny_teacher(), _seqs(), str(out), **bad)
    assert not out.exists()
    assert extract_hidden(_tiny_teacher(), _seqs(), str(out))["complete"]


# ------------------------------------------------------------------------------------ the CLI


def tiny_qwen2(path, vocab=97, hidden=32, seed=0, **extra):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.Qwen2Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=48,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=False,
        **extra,
    )
    torch.manual_seed(seed)
    transformers.Qwen2ForCausalLM(cfg).save_pretrained(path)
    return str(path)


def _jsonl(path, seqs):
    path.write_text("".join(json.dumps({"input_ids": s}) + "\n" for s in seqs))
    return str(path)


def test_cli_teacher_extract_and_verify(tmp_path, capsys):
    transformers = pytest.importorskip("transformers")
    mdir = tiny_qwen2(tmp_path / "qwen")
    seqs = [[int(t) for t in torch.randint(0, 97, (n,))] for n in (5, 9, 1, 7, 12)]
    data = _jsonl(tmp_path / "d.jsonl", seqs)
    base = ["teacher-extract", "--model", mdir, "--data", data, "--device", "cpu", "--no-progress"]
    assert cli_main(base + ["--out", str(tmp_path / "h"), "--dtype", "float32", "--sequences-per-shard", "2"]) == 0
    assert "hidden states (float32, D = 32)" in capsys.readouterr().out
    assert cli_main(["teacher-verify", str(tmp_path / "h")]) == 0
    store = HiddenStore(str(tmp_path / "h"))
    model = transformers.AutoModelForCausalLM.from_pretrained(mdir).eval()
    with torch.no_grad():
        out = model(torch.tensor([seqs[1]]), output_hidden_states=True)
        live = out.hidden_states[-1][0, :-1]  # after the final norm
        assert torch.allclose(store[1]["hidden"], live, atol=1e-5)
        logits = store[1]["hidden"] @ store.head().weight.T
        assert torch.allclose(logits, out.logits[0, :-1], atol=1e-4)
    # parts over two processes' worth of flags, the same bytes
    two = ["--out", str(tmp_path / "h2"), "--dtype", "float32", "--sequences-per-shard", "2", "--num-shards", "2"]
    assert cli_main(base + two + ["--shard-index", "0"]) == 0
    assert cli_main(base + two + ["--shard-index", "1"]) == 0
    assert _files(tmp_path / "h") == _files(tmp_path / "h2")
    # --kind topk is topk-extract's path; topk-extract keeps working
    assert cli_main(base + ["--out", str(tmp_path / "t1"), "--kind", "topk", "--k", "4"]) == 0
    assert cli_main(["topk-extract", *base[1:], "--out", str(tmp_path / "t2"), "--k", "4"]) == 0
    assert _files(tmp_path / "t1").keys() == _files(tmp_path / "t2").keys()
    assert cli_main(["teacher-verify", str(tmp_path / "t1")]) == 0
    capsys.readouterr()
    # one-line errors, exit 2, nothing written
    for extra, msg in (
        (["--kind", "topk", "--dtype", "fp8"], "--dtype sets the rows of --kind hidden"),
        (["--num-shards", "2"], "needs --shard-index"),
        (["--vocab-size", "98"], "--vocab-size must be"),
    ):
        assert cli_main(base + ["--out", str(tmp_path / "bad")] + extra) == 2
        err = capsys.readouterr().err
        assert msg in err and len(err.strip().splitlines()) == 1, err
        assert not (tmp_path / "bad").exists()
    with pytest.raises(SystemExit):
        cli_main(base + ["--out", str(tmp_path / "bad"), "--dtype", "float16"])
    assert not (tmp_path / "bad").exists()


def test_softcap_and_logit_scale_are_recorded(tmp_path):
    transformers = pytest.importorskip("transformers")
    from nitrobrew.teacher.extract import load_hf_teacher

    cfg = transformers.Gemma2Config(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=24,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        final_logit_softcapping=7.5,
    )
    torch.manual_seed(0)
    transformers.Gemma2ForCausalLM(cfg).save_pretrained(tmp_path / "g")
    teacher = load_hf_teacher(str(tmp_path / "g"), logit_transforms=True)
    extract_hidden(teacher, [[1, 2, 3, 4]], str(tmp_path / "s"), hidden_dtype="float32")
    head = HiddenStore(str(tmp_path / "s")).head()
    assert head.softcap == 7.5 and head.scale == 1.0
    with pytest.raises(NotImplementedError, match="final_logit_softcapping"):
        load_hf_teacher(str(tmp_path / "g"))  # the top-k scan does not apply it


# ------------------------------------------------------------------------------------ parquet


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "fp8"])
def test_export_import_round_trip_is_bit_exact(tmp_path, dtype):
    pytest.importorskip("pyarrow")
    from nitrobrew.teacher.hidden_interop import export_hidden, import_hidden

    teacher = _tiny_teacher(bias=True)
    seqs = _seqs(9)
    plen = [min(2, len(s)) for s in seqs]
    extract_hidden(teacher, seqs, str(tmp_path / "s"), hidden_dtype=dtype, prompt_lengths=plen, sequences_per_shard=4)
    export_hidden(str(tmp_path / "s"), str(tmp_path / "pq"))
    import_hidden(str(tmp_path / "pq"), str(tmp_path / "back"))
    assert _files(tmp_path / "s") == _files(tmp_path / "back")
    datasets = pytest.importorskip("datasets")
    rows = datasets.load_dataset("parquet", data_dir=str(tmp_path / "pq" / "data"), split="train")
    assert rows["input_ids"] == seqs and rows["prompt_length"] == plen
    # a changed byte in any exported file is found before anything is written
    victim = sorted((tmp_path / "pq" / "data").iterdir())[1]
    raw = bytearray(victim.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    victim.write_bytes(bytes(raw))
    with pytest.raises(StoreError, match="is corrupted: its sha256 does not match"):
        import_hidden(str(tmp_path / "pq"), str(tmp_path / "again"))
    assert not (tmp_path / "again").exists()


def test_progress_bar_names_the_hidden_states(tmp_path, capsys):
    pytest.importorskip("tqdm")
    extract_hidden(_tiny_teacher(), _seqs(5), str(tmp_path / "s"), sequences_per_shard=4, progress=True)
    err = capsys.readouterr().err
    assert "hidden:" in err and "top-k" not in err
