"""The top-k pipeline as a tool: each test here failed on the pipeline before it was hardened
(rehashing, vocabulary, locking, validation, schema, data checks, file modes, CLI errors,
demo checkpoints), plus scale-out, export/import and verification."""

import json
import os
import random
import stat

import pytest
import torch

from cli_helpers import cli_args
from nitrobrew.cli import main as cli_main
from nitrobrew.teacher import store as store_mod
from nitrobrew.teacher.data import TopKDataset
from nitrobrew.teacher.extract import Teacher, extract_topk
from nitrobrew.teacher.store import StoreError, TopKStore, TopKWriter
from teacher_helpers import flip_bits, interrupted
from tiny_models import causal_lm

pytest.importorskip("safetensors")
K, T = 4, 1.0


def _write_store(path, n_shards=10, per=8, k=K, dtype="float32", seed=0, **kw):
    """A synthetic store (no model): n_shards shards of `per` sequences."""
    g = torch.Generator().manual_seed(seed)
    n = n_shards * per
    w = TopKWriter(
        str(path),
        model="synthetic",
        k=k,
        temperature=T,
        vocab_size=50,
        head_rows=50,
        num_sequences=n,
        sequences_per_shard=per,
        logprob_dtype=dtype,
        **kw,
    )
    for j in range(n_shards):
        toks, ids, lps = [], [], []
        for _ in range(per):
            L = int(torch.randint(1, 7, (1,), generator=g))
            toks.append(torch.randint(0, 50, (L,), generator=g))
            ids.append(
                torch.stack([torch.randperm(50, generator=g)[:k] for _ in range(L - 1)])
                if L > 1
                else torch.zeros(0, k, dtype=torch.long)
            )
            lps.append(torch.randn(L - 1, k, generator=g).abs().neg().sort(1, descending=True).values - 0.1)
        w.write_shard(j, toks, ids, lps)
    man = w.finish()
    getattr(w, "close", lambda: None)()  # (the writer had no lock to release before there was one)
    return man


def _tiny_teacher(vocab=30, d=8, seed=0):
    """A deterministic toy teacher: embedding + causal running mean + head."""
    g = torch.Generator().manual_seed(seed)
    emb, head = torch.randn(vocab, d, generator=g), torch.randn(vocab, d, generator=g) * 3

    def hidden(ids, mask):
        x = emb[ids] * mask[..., None]
        return x.cumsum(1) / torch.arange(1, ids.shape[1] + 1)[None, :, None]

    return Teacher(hidden, head, None, "toy", vocab)


def _seqs(n=11, vocab=30, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randint(0, vocab, (int(torch.randint(1, 9, (1,), generator=g)),), generator=g).tolist() for _ in range(n)
    ]


def _files(path):
    return {f: open(os.path.join(path, f), "rb").read() for f in sorted(os.listdir(path)) if not f.startswith(".")}


# ------------------------------------------------------------------------------------ defect 1


def test_shuffled_reads_hash_each_shard_once(tmp_path, monkeypatch):
    _write_store(tmp_path / "s")
    calls = []
    real = store_mod.sha256_file
    monkeypatch.setattr(store_mod, "sha256_file", lambda p, *a: calls.append(p) or real(p, *a))
    ds = TopKDataset(str(tmp_path / "s"))
    order = list(range(len(ds)))
    random.Random(0).shuffle(order)
    for i in order:
        assert ds[i]["topk_ids"].shape[1] == K
    assert len(calls) == 10 and len(set(calls)) == 10  # once per shard, however often it is reopened
    assert len(ds.store._open) <= ds.store.max_open_shards
    # the most recently used shards stay open: a shard used again at once is not reopened
    store = TopKStore(str(tmp_path / "s"), max_open_shards=2)
    for i in (0, 8, 0, 16, 0):  # shards 0, 1, 0, 2, 0
        store[i]
    assert list(store._open) == [2, 0]


# ------------------------------------------------------------------------------------ defect 2


def _llama_without_tokenizer(tmp_path):
    pytest.importorskip("transformers")
    d = tmp_path / "llama"
    model = causal_lm("Llama", vocab=97, hidden=32, layers=1, intermediate_size=48, positions=64, head_scale=1.0)
    model.save_pretrained(d)
    # a converted checkpoint: a tokenizer config without the vocabulary files (its tokenizer has 3 tokens)
    (d / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "LlamaTokenizer"}))
    return str(d)


def _jsonl(path, seqs):
    path.write_text("".join(json.dumps({"input_ids": s}) + "\n" for s in seqs))
    return str(path)


def test_vocabulary_from_the_model_not_an_empty_tokenizer(tmp_path, capsys):
    mdir = _llama_without_tokenizer(tmp_path)
    data = _jsonl(tmp_path / "d.jsonl", _seqs(5, vocab=97))
    out = str(tmp_path / "s")
    assert cli_main(cli_args("topk-extract", model=mdir, data=data, out=out, k=64, device="cpu", no_progress=True)) == 0
    assert "vocabulary: 97 (config.vocab_size" in capsys.readouterr().out
    man = TopKStore(out).manifest
    assert (man["vocab_size"], man["k"]) == (97, 64)
    # K above the vocabulary is refused before anything is loaded or written
    assert cli_main(cli_args("topk-extract", model=mdir, data=data, out=tmp_path / "s2", k=98, device="cpu")) == 2
    assert "--k 98 is larger than the vocabulary (97" in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "s2")


# ------------------------------------------------------------------------------------ defect 3


def test_a_second_extraction_into_the_same_store_fails_at_once(tmp_path, capsys):
    out = str(tmp_path / "s")
    teacher, seqs = _tiny_teacher(), _seqs()
    holder = TopKWriter(
        out,
        model="toy",
        k=K,
        temperature=T,
        vocab_size=30,
        head_rows=30,
        num_sequences=len(seqs),
        sequences_per_shard=4,
    )
    with pytest.raises(StoreError, match="another extraction is writing into"):
        extract_topk(teacher, seqs, out, k=K, sequences_per_shard=4)
    with pytest.raises(StoreError, match="another extraction is writing into"):
        extract_topk(teacher, seqs, out, k=2, sequences_per_shard=4)
    holder.close()
    man = extract_topk(teacher, seqs, out, k=K, sequences_per_shard=4)  # free again once released
    assert man["complete"]
    # another process holding the store: the CLI says so in one line and exits 2
    import subprocess
    import sys

    code = (
        "import sys, time; from nitrobrew.teacher.store import TopKWriter; "
        "w = TopKWriter(sys.argv[1], model='x', k=2, temperature=1.0, vocab_size=97, head_rows=97, "
        "num_sequences=1); print('locked', flush=True); time.sleep(60)"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.getcwd()] + sys.path))
    other = subprocess.Popen(
        [sys.executable, "-c", code, str(tmp_path / "c")], stdout=subprocess.PIPE, env=env, text=True
    )
    try:
        assert other.stdout.readline().strip() == "locked"
        mdir = _llama_without_tokenizer(tmp_path)
        data = _jsonl(tmp_path / "d.jsonl", _seqs(3, vocab=97))
        capsys.readouterr()
        assert cli_main(cli_args("topk-extract", model=mdir, data=data, out=tmp_path / "c", k=2, device="cpu")) == 2
        err = capsys.readouterr().err
        assert "another extraction is writing into" in err and len(err.strip().splitlines()) == 1
    finally:
        other.kill()
        other.wait()


# ------------------------------------------------------------------------------------ defect 4


@pytest.mark.parametrize(
    "bad",
    [
        dict(k=0),
        dict(k=True),
        dict(k=31),
        dict(temperature=0.0),
        dict(temperature=float("nan")),
        dict(temperature=float("inf")),
        dict(temperature=-1.0),
        dict(logprob_dtype="int8"),
        dict(sequences_per_shard=0),
        dict(batch_tokens=0),
    ],
)
def test_rejected_arguments_write_nothing(tmp_path, bad):
    out = tmp_path / "s"
    with pytest.raises(ValueError):
        extract_topk(_tiny_teacher(), _seqs(), str(out), **dict(dict(k=K, temperature=T), **bad))
    assert not out.exists()
    assert extract_topk(_tiny_teacher(), _seqs(), str(out), k=K, temperature=T)["complete"]  # the corrected run


def test_boolean_token_ids_are_refused(tmp_path, capsys):
    with pytest.raises(ValueError, match="sequence 1: token ids must be ints"):
        extract_topk(_tiny_teacher(), [[1, 2], [True, 3]], str(tmp_path / "s"), k=K)
    assert not (tmp_path / "s").exists()
    mdir = _llama_without_tokenizer(tmp_path)
    data = tmp_path / "d.jsonl"
    data.write_text('{"input_ids": [1, 2, 3]}\n{"input_ids": [1, true, 3]}\n')
    for flags in (["--temperature", "inf"], ["--temperature", "0"], ["--k", "0"], ["--k", "-1"]):
        with pytest.raises(SystemExit):
            cli_main(["topk-extract", "--model", mdir, "--data", str(data), "--out", str(tmp_path / "c")] + flags)
    assert cli_main(["topk-extract", "--model", mdir, "--data", str(data), "--out", str(tmp_path / "c")]) == 2
    assert "d.jsonl:2: input_ids must be a list of ints" in capsys.readouterr().err
    assert not (tmp_path / "c").exists()


# ------------------------------------------------------------------------------------ defect 5


def _edit(man, path, value):
    obj = man
    for key in path[:-1]:
        obj = obj[key]
    if value is KeyError:
        del obj[path[-1]]
    else:
        obj[path[-1]] = value


@pytest.mark.parametrize(
    "path,value,match",
    [
        (("k",), "8", "field 'k' must be int"),
        (("k",), KeyError, "lacks the field 'k'"),
        (("shards",), {"0": 1}, "field 'shards' must be list"),
        (("shards", 0), 5, r"shards\[0\] must be a JSON object"),
        (("shards", 0, "sha256"), KeyError, r"shards\[0\] lacks the field 'sha256'"),
        (("shards", 1, "index"), 0, "shard 0 is listed twice"),
        (("shards", 0, "index"), 99, "index 99, outside"),
        (("shards", 0, "file"), "../../etc/passwd", "file must be 'shard-00000.safetensors'"),
        (("shards", 1, "first_sequence"), 3, r"must hold sequences \[8, 16\)"),
        (("shards",), "DROP1", r"marked complete but lacks shards \[1\]"),
        (("k",), 51, r"k 51 must be in \[1, vocab_size = 50\]"),
        (("temperature",), None, "field 'temperature' must be float"),
        (("num_rows",), 3, "num_rows 3 is not the sum"),
    ],
)
def test_malformed_manifests_raise_store_errors(tmp_path, path, value, match):
    _write_store(tmp_path / "s", n_shards=3)
    mpath = tmp_path / "s" / "manifest.json"
    man = json.loads(mpath.read_text())
    if value == "DROP1":
        del man["shards"][1]
    else:
        _edit(man, path, value)
    mpath.write_text(json.dumps(man))
    with pytest.raises(StoreError, match=match):
        TopKStore(str(tmp_path / "s"))
    mpath.write_text("[1, 2]")
    with pytest.raises(StoreError, match="not a nitrobrew-topk manifest"):
        TopKStore(str(tmp_path / "s"))


# ------------------------------------------------------------------------------------ defects 6 and 8


def test_bad_data_is_found_first_and_named_by_line(tmp_path, capsys, monkeypatch):
    transformers = pytest.importorskip("transformers")
    mdir = _llama_without_tokenizer(tmp_path)
    seqs = _seqs(9, vocab=97)
    seqs[6] = [1, 2, 97, 3]  # line 7, in the third shard of 3
    data = _jsonl(tmp_path / "d.jsonl", seqs)
    loads = []
    real = transformers.AutoModelForCausalLM.from_pretrained
    monkeypatch.setattr(
        transformers.AutoModelForCausalLM,
        "from_pretrained",
        classmethod(lambda cls, *a, **kw: loads.append(a) or real(*a, **kw)),
    )
    out = tmp_path / "s"
    capsys.readouterr()
    flags = dict(model=mdir, out=out, k=4, sequences_per_shard=3, device="cpu")
    assert cli_main(cli_args("topk-extract", data=data, **flags)) == 2
    err = capsys.readouterr().err
    assert "d.jsonl:7: token id 97 is outside [0, 97)" in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err  # one clear line
    assert not out.exists() and not loads  # nothing written, no model loaded
    # the API names the sequence, also before writing anything
    with pytest.raises(ValueError, match="sequence 6: token id 97"):
        extract_topk(_tiny_teacher(vocab=97), seqs, str(out), k=4, sequences_per_shard=3)
    assert not out.exists()
    # other input errors: one line each, before the model loads
    (tmp_path / "d.csv").write_text("1,2\n")
    (tmp_path / "e.jsonl").write_text('{"input_ids": [1, 2]}\n{"input_ids": [1, 2}\n')
    for data_arg, msg in (
        (str(tmp_path / "missing.jsonl"), "does not exist"),
        (str(tmp_path / "missing_folder") + "/", "does not exist"),  # a path, not a Hub name
        (str(tmp_path / "d.csv"), "unknown"),
        (str(tmp_path / "e.jsonl"), "e.jsonl:2: not valid JSON"),
    ):
        assert cli_main(cli_args("topk-extract", data=data_arg, **flags)) == 2
        err = capsys.readouterr().err
        assert msg in err and len(err.strip().splitlines()) == 1
    assert cli_main(["topk-extract", "--model", str(tmp_path / "nope"), "--data", data, "--out", str(out)]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert not loads


# ------------------------------------------------------------------------------------ defect 7


def test_files_respect_the_umask(tmp_path):
    old = os.umask(0o022)
    try:
        _write_store(tmp_path / "s", n_shards=1)
        from nitrobrew.demo.checkpoint import save_checkpoint

        save_checkpoint(str(tmp_path / "ck.safetensors"), torch.nn.Linear(2, 2), None, {"step": 1})
    finally:
        os.umask(old)
    for f in ("s/manifest.json", "s/shard-00000.safetensors", "ck.safetensors"):
        assert stat.S_IMODE(os.stat(tmp_path / f).st_mode) == 0o644, f


# ------------------------------------------------------------------------------------ defect 9


def test_demo_checkpoints_are_checksummed(tmp_path):
    from nitrobrew.demo import checkpoint as ck
    from nitrobrew.demo.checkpoint import load_checkpoint, read_record, save_checkpoint

    CheckpointError = getattr(ck, "CheckpointError", ValueError)

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    path = str(tmp_path / "ck.safetensors")
    save_checkpoint(path, model, opt, {"step": 1})
    fresh = torch.nn.Linear(4, 3)
    assert load_checkpoint(path, fresh, torch.optim.AdamW(fresh.parameters())) == {"step": 1}
    assert torch.equal(fresh.weight, model.weight)
    raw = flip_bits(path, -5, mask=0x01)  # one bit of the last tensor
    with pytest.raises(CheckpointError, match="ck.safetensors is corrupted: its sha256"):
        load_checkpoint(path, torch.nn.Linear(4, 3))
    open(path, "wb").write(bytes(raw[:40]))  # a header cut short
    with pytest.raises(CheckpointError, match="ck.safetensors is corrupted or not a nitrobrew checkpoint"):
        load_checkpoint(path, torch.nn.Linear(4, 3))
    with pytest.raises(CheckpointError, match="ck.safetensors"):
        read_record(path)


@pytest.mark.parametrize(
    "flag", [["--batch-size", "0"], ["--student-steps", "-1"], ["--lr", "nan"], ["--threads", "0"], ["--vocab", "x"]]
)
def test_demo_size_flags_are_validated(flag, capsys):
    with pytest.raises(SystemExit) as info:
        cli_main(["demo", "--preset", "tiny", "--out", "/nonexistent/never"] + flag)
    assert info.value.code == 2
    assert flag[0] in capsys.readouterr().err


# ------------------------------------------------------------------------------------ scale-out


def test_shards_in_parts_reproduce_the_single_process_store(tmp_path):
    teacher, seqs = _tiny_teacher(), _seqs(23)
    sizes = dict(sequences_per_shard=4, batch_tokens=16)
    kw = dict(k=K, temperature=1.3, logprob_dtype="bfloat16", source={"path": "corpus"}, **sizes)
    single = extract_topk(teacher, seqs, str(tmp_path / "one"), **kw)
    assert single["complete"] and len(single["shards"]) == 6
    # part 1 of 2 first: the store is not complete until part 0 has run too
    p1 = extract_topk(teacher, seqs, str(tmp_path / "two"), num_parts=2, part=1, **kw)
    assert p1["num_parts"] == 2 and [s["index"] for s in p1["shards"]] == [1, 3, 5]
    with pytest.raises(StoreError, match="manifest.json is missing"):
        TopKStore(str(tmp_path / "two"))
    p0 = extract_topk(teacher, seqs, str(tmp_path / "two"), num_parts=2, part=0, **kw)
    assert p0["complete"] and "num_parts" not in p0
    assert _files(tmp_path / "one") == _files(tmp_path / "two")  # bit-identical, manifest included
    # three parts, the last one resumed after an interruption
    extract_topk(teacher, seqs, str(tmp_path / "three"), num_parts=3, part=2, **kw)
    extract_topk(teacher, seqs, str(tmp_path / "three"), num_parts=3, part=0, **kw)
    with pytest.raises(KeyboardInterrupt):
        extract_topk(interrupted(teacher, at_call=2), seqs, str(tmp_path / "three"), num_parts=3, part=1, **kw)
    extract_topk(teacher, seqs, str(tmp_path / "three"), num_parts=3, part=1, **kw)
    assert _files(tmp_path / "one") == _files(tmp_path / "three")
    # a part run into a complete store has nothing to do; another split is refused while parts exist
    assert extract_topk(teacher, seqs, str(tmp_path / "two"), num_parts=2, part=1, **kw)["extracted_tokens"] == 0
    extract_topk(teacher, seqs, str(tmp_path / "four"), num_parts=2, part=0, **kw)
    with pytest.raises(StoreError, match="another number of shards"):
        extract_topk(teacher, seqs, str(tmp_path / "four"), num_parts=3, part=0, **kw)
    with pytest.raises(StoreError, match="holds the parts of an extraction"):
        extract_topk(teacher, seqs, str(tmp_path / "four"), **kw)


def test_cli_shards_and_torchrun_environment(tmp_path, capsys, monkeypatch):
    mdir = _llama_without_tokenizer(tmp_path)
    data = _jsonl(tmp_path / "d.jsonl", _seqs(7, vocab=97))
    flags = dict(k=4, sequences_per_shard=2, logprob_dtype="float16", id_dtype="uint16", device="cpu", no_progress=True)
    base = cli_args("topk-extract", model=mdir, data=data, **flags)
    assert cli_main(base + ["--out", str(tmp_path / "one")]) == 0
    assert cli_main(base + ["--out", str(tmp_path / "two"), "--num-shards", "2", "--shard-index", "1"]) == 0
    assert "complete once every part has run" in capsys.readouterr().out
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    assert cli_main(base + ["--out", str(tmp_path / "two")]) == 0
    assert "wrote" in capsys.readouterr().out
    assert _files(tmp_path / "one") == _files(tmp_path / "two")
    assert cli_main(base + ["--out", str(tmp_path / "x"), "--num-shards", "2", "--shard-index", "2"]) == 2


# ------------------------------------------------------------------------------------ verify, export, import


def test_verify_command(tmp_path, capsys):
    _write_store(tmp_path / "s", n_shards=3)
    assert cli_main(["topk-verify", str(tmp_path / "s")]) == 0
    assert "ok: 3 shards" in capsys.readouterr().out
    flip_bits(tmp_path / "s" / "shard-00002.safetensors", -2)
    assert cli_main(["topk-verify", str(tmp_path / "s"), "--quiet"]) == 1
    err = capsys.readouterr().err
    assert "shard-00002.safetensors is corrupted" in err and "Traceback" not in err
    assert cli_main(["topk-verify", str(tmp_path / "nowhere")]) == 1


def test_version(capsys):
    from nitrobrew import __version__

    with pytest.raises(SystemExit) as info:
        cli_main(["--version"])
    assert info.value.code == 0 and capsys.readouterr().out.strip() == f"nitrobrew {__version__}"


@pytest.mark.parametrize(
    "dtype,ids", [("float32", "int32"), ("bfloat16", "int32"), ("float16", "uint16"), ("uint8", "uint24")]
)
def test_export_import_round_trip_is_bit_exact(tmp_path, dtype, ids):
    pytest.importorskip("pyarrow")
    _write_store(tmp_path / "s", n_shards=3, dtype=dtype, id_dtype=ids)
    codes = ["--logprob-codes"] if dtype == "uint8" else []  # a uint8 store's exact bytes need its codes
    assert cli_main(["topk-export", str(tmp_path / "s"), str(tmp_path / "pq")] + codes) == 0
    files = sorted(os.listdir(tmp_path / "pq" / "data"))
    assert files == [f"train-{j:05d}-of-00003.parquet" for j in range(3)]
    assert cli_main(["topk-import", str(tmp_path / "pq"), str(tmp_path / "back")]) == 0
    assert _files(tmp_path / "s") == _files(tmp_path / "back")
    # the layout: one row per sequence, K entries per position, the last position masked
    import pyarrow.parquet as pq

    table = pq.read_table(tmp_path / "pq" / "data" / files[0]).to_pylist()
    item = TopKStore(str(tmp_path / "s"))[0]
    row = table[0]
    L = len(row["input_ids"])
    assert row["input_ids"] == item["input_ids"].tolist() and len(row["target_token_ids"]) == L
    assert row["target_token_ids"][: L - 1] == item["topk_ids"].tolist()
    assert row["target_logprobs"][: L - 1] == item["topk_logprobs"].tolist()
    assert row["target_mask"][-1] == [0] * K and all(m == [1] * K for m in row["target_mask"][: L - 1])


def test_import_foreign_parquet_and_datasets_reads_the_export(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    rows = [
        {
            "input_ids": [5, 6, 7],
            "target_token_ids": [[1, 2], [3, 4], [0, 0]],
            "target_logprobs": [[-0.5, -1.0], [-0.125, -3.0], [0.0, 0.0]],
            "target_mask": [[1, 1], [1, 0], [0, 0]],
        }
    ]
    (tmp_path / "foreign").mkdir()
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "foreign" / "x.parquet")
    with pytest.raises(ValueError, match="pass --temperature"):
        from nitrobrew.teacher.interop import import_store

        import_store(str(tmp_path / "foreign"), str(tmp_path / "s"))
    assert (
        cli_main(
            ["topk-import", str(tmp_path / "foreign"), str(tmp_path / "s"), "--temperature", "1", "--vocab-size", "10"]
        )
        == 0
    )
    item = TopKStore(str(tmp_path / "s"))[0]
    assert item["topk_ids"].tolist() == [[1, 2], [3, 0]]
    assert item["topk_logprobs"].tolist() == [[-0.5, -1.0], [-0.125, float("-inf")]]
    assert cli_main(["topk-verify", str(tmp_path / "s")]) == 0
    datasets = pytest.importorskip("datasets")
    _write_store(tmp_path / "st", n_shards=2)
    cli_main(["topk-export", str(tmp_path / "st"), str(tmp_path / "pq")])
    ds = datasets.load_dataset("parquet", data_dir=str(tmp_path / "pq" / "data"), split="train")
    assert len(ds) == 16 and set(ds.column_names) >= {"input_ids", "target_token_ids", "target_logprobs", "target_mask"}


# ------------------------------------------------------------------------------------ inputs


def _word_tokenizer(tmp_path):
    """A tiny word-level tokenizer with a chat template, saved as a model's would be (no downloads)."""
    pytest.importorskip("transformers")
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<unk>", "<s>", "user", "assistant", ":", "hello", "world", "how", "are", "you", "fine", "\n"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>")
    fast.chat_template = "{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} {% endfor %}"
    d = tmp_path / "tok"
    fast.save_pretrained(d)
    return str(d), words


def test_text_chat_and_datasets_inputs(tmp_path, capsys):
    from nitrobrew.teacher.inputs import open_corpus, read_all

    tdir, words = _word_tokenizer(tmp_path)
    from nitrobrew.teacher.extract import load_tokenizer

    tok = load_tokenizer(tdir)
    ids = {w: i for i, w in enumerate(words)}
    f = tmp_path / "t.jsonl"
    f.write_text(
        json.dumps({"text": "hello world"})
        + "\n"
        + json.dumps(
            {"messages": [{"role": "user", "content": "how are you"}, {"role": "assistant", "content": "fine"}]}
        )
        + "\n"
    )
    with pytest.raises(ValueError, match="t.jsonl:2: a chat \\(messages\\) needs --chat-template"):
        read_all(open_corpus(str(f), tokenizer=tok))
    with pytest.raises(ValueError, match="t.jsonl:1: text needs a tokenizer"):
        read_all(open_corpus(str(f)))
    got = read_all(open_corpus(str(f), tokenizer=tok, chat_template=True))
    assert got[0][-2:] == [ids["hello"], ids["world"]]
    assert got[1] == [ids[w] for w in "user : how are you assistant : fine".split()]
    # a datasets folder (save_to_disk) and a parquet file, streamed
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_dict({"input_ids": [[1, 2, 3], [4, 5]]}).save_to_disk(str(tmp_path / "ds"))
    assert read_all(open_corpus(str(tmp_path / "ds"))) == [[1, 2, 3], [4, 5]]
    datasets.Dataset.from_dict({"text": ["hello", "how are you"]}).to_parquet(str(tmp_path / "t.parquet"))
    assert read_all(open_corpus(str(tmp_path / "t.parquet"), tokenizer=tok))[1][-3:] == [7, 8, 9]
    # end to end: text through the CLI with --tokenizer; the manifest names the tokenizer
    mdir = _llama_without_tokenizer(tmp_path)
    out = str(tmp_path / "s")
    flags = dict(chat_template=True, out=out, k=4, device="cpu", no_progress=True)
    assert cli_main(cli_args("topk-extract", model=mdir, tokenizer=tdir, data=f, **flags)) == 0
    man = TopKStore(out).manifest
    assert man["source"]["chat_template"] is True and man["num_sequences"] == 2
    assert man["source"]["tokenizer"] == tdir
    assert TopKStore(out)[1]["input_ids"].tolist() == got[1]


def test_progress_bar_reports_tokens(tmp_path, capsys):
    pytest.importorskip("tqdm")
    logs = []
    man = extract_topk(
        _tiny_teacher(), _seqs(9), str(tmp_path / "s"), k=K, sequences_per_shard=4, progress=True, log=logs.append
    )
    err = capsys.readouterr().err
    assert "tok/s" in err and f"{man['extracted_tokens']}" in logs[-1] and "ETA" in logs[-1]


def test_uint8_logprobs_error_bound(tmp_path):
    from nitrobrew.teacher.store import dequantize_logprobs, quantize_logprobs

    g = torch.Generator().manual_seed(0)
    lp = torch.log_softmax(torch.randn(300, 500, generator=g) * 6, -1).topk(32, -1).values
    lp[0, -3:] = float("-inf")  # padding entries survive
    code, scale = quantize_logprobs(lp)
    back = dequantize_logprobs(code, scale)
    assert code.dtype == torch.uint8 and scale.shape == (300, 2)
    assert torch.equal(back[:, 0], lp[:, 0]) and torch.isinf(back[0, -3:]).all()
    depth = (lp[:, :1] - lp).nan_to_num(0.0, posinf=0.0, neginf=0.0)
    bound = scale[:, 1:] * depth.sqrt() + 1e-5 * (1 + depth)  # half a step in sqrt(depth), plus rounding
    assert ((back - lp).abs().nan_to_num(0.0) <= bound).all()
    assert (back[:, 1:] <= back[:, :-1]).all()  # still sorted
    man = _write_store(tmp_path / "s", n_shards=2, k=32, dtype="uint8")
    ref = _write_store(tmp_path / "f", n_shards=2, k=32, dtype="float32")
    a, b = TopKStore(str(tmp_path / "s")), TopKStore(str(tmp_path / "f"))
    assert sum(s["bytes"] for s in man["shards"]) < 0.75 * sum(s["bytes"] for s in ref["shards"])  # 5K + 8 vs 8K
    for i in range(len(a)):
        assert torch.equal(a[i]["topk_ids"], b[i]["topk_ids"])
        torch.testing.assert_close(a[i]["topk_logprobs"], b[i]["topk_logprobs"], rtol=0, atol=0.05)
    assert cli_main(["topk-verify", str(tmp_path / "s"), "--quiet"]) == 0


def test_hub_id_from_the_local_cache(tmp_path, monkeypatch, capsys):
    hub = pytest.importorskip("huggingface_hub")
    from nitrobrew.teacher.extract import resolve_model

    snap = tmp_path / "hub" / "models--acme--tiny" / "snapshots" / "0123abcd"
    snap.parent.mkdir(parents=True)
    os.rename(_llama_without_tokenizer(tmp_path), snap)
    (tmp_path / "hub" / "models--acme--tiny" / "refs").mkdir()
    (tmp_path / "hub" / "models--acme--tiny" / "refs" / "main").write_text("0123abcd")
    monkeypatch.setattr(hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert os.path.samefile(resolve_model("acme/tiny"), snap)
    with pytest.raises(FileNotFoundError, match="nor in the local Hugging Face cache"):
        resolve_model("acme/absent")
    data = _jsonl(tmp_path / "d.jsonl", _seqs(3, vocab=97))
    flags = dict(out=tmp_path / "s", k=4, device="cpu", no_progress=True)
    assert cli_main(cli_args("topk-extract", model="acme/tiny", data=data, **flags)) == 0


def test_datasets_folder_of_files_streamed_and_shard_flags(tmp_path, capsys):
    pytest.importorskip("datasets")
    from nitrobrew.teacher.inputs import open_corpus, read_all

    (tmp_path / "folder").mkdir()
    _jsonl(tmp_path / "folder" / "a.jsonl", [[1, 2], [3]])
    assert read_all(open_corpus(str(tmp_path / "folder"))) == [[1, 2], [3]]
    mdir = _llama_without_tokenizer(tmp_path)
    flags = dict(out=tmp_path / "s", k=4, device="cpu", no_progress=True)
    argv = cli_args("topk-extract", model=mdir, data=tmp_path / "folder", **flags)
    assert cli_main(argv + ["--num-shards", "2"]) == 2  # which part is this process?
    assert "needs --shard-index" in capsys.readouterr().err
    assert cli_main(argv) == 0
    assert TopKStore(str(tmp_path / "s")).manifest["source"] == {"dataset": str(tmp_path / "folder"), "split": "train"}
    assert cli_main(["topk-export", str(tmp_path / "s"), str(tmp_path / "pq")]) == 0
    assert cli_main(["topk-import", str(tmp_path / "pq"), str(tmp_path / "s")]) == 2  # never over a store
    assert "not empty" in capsys.readouterr().err


@pytest.mark.parametrize("id_dtype,nbytes", [("uint16", 2), ("uint24", 3)])
def test_packed_ids(tmp_path, id_dtype, nbytes):
    from nitrobrew.teacher.store import pack_ids, unpack_ids

    ids = torch.tensor([[0, 1, 255, 256], [65535, 40000, 7, 9]])
    if id_dtype == "uint24":
        ids[1, 0] = (1 << 24) - 1
    packed = pack_ids(ids, id_dtype)
    assert packed.dtype == torch.uint8 and packed.shape == (2, 4, nbytes)
    assert torch.equal(unpack_ids(packed), ids)
    _write_store(tmp_path / "p", n_shards=2, id_dtype=id_dtype)
    _write_store(tmp_path / "f", n_shards=2)
    a, b = TopKStore(str(tmp_path / "p")), TopKStore(str(tmp_path / "f"))
    for i in range(len(a)):
        assert torch.equal(a[i]["topk_ids"], b[i]["topk_ids"])
        assert torch.equal(a[i]["topk_logprobs"], b[i]["topk_logprobs"])
    assert cli_main(["topk-verify", str(tmp_path / "p"), "--quiet"]) == 0
    too_wide = dict(vocab_size=70000, head_rows=70000, id_dtype="uint16")  # ids up to 69999 in two bytes
    with pytest.raises(ValueError, match="id_dtype must be one of"):
        TopKWriter(str(tmp_path / "x"), model="m", k=2, temperature=1.0, num_sequences=1, **too_wide)
    assert not (tmp_path / "x").exists()


def test_teacher_is_bfloat16_on_cuda_by_default():
    from nitrobrew.teacher.extract import teacher_dtype

    assert teacher_dtype("cuda") == teacher_dtype("cuda:3") == "bfloat16"
    assert teacher_dtype("cpu") == "saved" and teacher_dtype("cuda", "float32") == "float32"
