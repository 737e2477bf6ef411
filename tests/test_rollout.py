"""`nitrobrew rollout`, and the offline on-policy workflow end to end: rollout -> teacher-extract -> train."""

from __future__ import annotations

import json
import os

import pytest
import torch

pytest.importorskip("safetensors")
pytest.importorskip("pyarrow")
transformers = pytest.importorskip("transformers")

from nitrobrew.cli import main as cli_main  # noqa: E402
from nitrobrew.hf.generation import Sampling  # noqa: E402
from nitrobrew.teacher.rollout import generate_rollouts, read_rollouts  # noqa: E402
from nitrobrew.teacher.store import StoreError  # noqa: E402

VOCAB, EOS = 53, 7


def _qwen2(path, seed, hidden=32):
    cfg = transformers.Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=hidden,
        intermediate_size=40,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        eos_token_id=EOS,
        pad_token_id=0,
    )
    torch.manual_seed(seed)
    model = transformers.Qwen2ForCausalLM(cfg)
    with torch.no_grad():  # make EOS likely enough that some completions stop early
        model.lm_head.bias = None
        model.lm_head.weight[EOS] *= 4
    model.save_pretrained(path)
    return str(path)


def _prompts(n=7, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(8, VOCAB, (int(L),), generator=g).tolist() for L in torch.randint(1, 6, (n,), generator=g)]


def _files(path):
    return {f: open(os.path.join(path, f), "rb").read() for f in sorted(os.listdir(path)) if not f.startswith(".")}


def test_rollouts_are_reproducible_resumable_and_split(tmp_path):
    model = transformers.AutoModelForCausalLM.from_pretrained(_qwen2(tmp_path / "m", 0)).eval()
    prompts = _prompts()
    sampling = Sampling(max_new_tokens=6, temperature=1.0, eos_token_id=EOS, pad_token_id=0)
    kw = dict(sampling=sampling, seed=3, batch_size=3, sequences_per_shard=3, model_name="m")
    man = generate_rollouts(model, prompts, str(tmp_path / "one"), **kw)
    assert man["complete"] and man["sampling"]["max_new_tokens"] == 6 and man["seed"] == 3
    seqs, plen, _ = read_rollouts(str(tmp_path / "one"))
    assert plen == [len(p) for p in prompts]
    for s, p in zip(seqs, prompts):
        comp = s[len(p) :]
        assert s[: len(p)] == p and 1 <= len(comp) <= 6
        assert EOS not in comp[:-1]  # nothing after the first EOS
    datasets = pytest.importorskip("datasets")
    rows = datasets.load_dataset("parquet", data_files=str(tmp_path / "one" / "shard-*.parquet"), split="train")
    assert rows["prompt_ids"] == prompts and all(
        sum(m) == len(c) for m, c in zip(rows["completion_mask"], rows["completion_ids"])
    )
    # two parts give the same files; a corrupted shard is generated again, identically
    generate_rollouts(model, prompts, str(tmp_path / "two"), num_parts=2, part=1, **kw)
    generate_rollouts(model, prompts, str(tmp_path / "two"), num_parts=2, part=0, **kw)
    assert _files(tmp_path / "one") == _files(tmp_path / "two")
    shard = tmp_path / "two" / "shard-00001.parquet"
    shard.write_bytes(shard.read_bytes()[:-5])
    with pytest.raises(StoreError, match="truncated or corrupted"):
        read_rollouts(str(tmp_path / "two"))
    with pytest.warns(RuntimeWarning, match="extracted again"):
        generate_rollouts(model, prompts, str(tmp_path / "two"), **kw)
    assert _files(tmp_path / "one") == _files(tmp_path / "two")
    # another seed is not resumed into this set
    with pytest.raises(StoreError, match="its seed is 3"):
        generate_rollouts(model, prompts, str(tmp_path / "one"), **dict(kw, seed=4))
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        generate_rollouts(model, [[9], []], str(tmp_path / "bad"), **kw)
    assert not (tmp_path / "bad").exists()


def test_rollout_extract_train_end_to_end(tmp_path, capsys):
    pytest.importorskip("accelerate")
    yaml = pytest.importorskip("yaml")
    student = _qwen2(tmp_path / "student", 0, hidden=24)
    teacher = _qwen2(tmp_path / "teacher", 1)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"input_ids": p}) + "\n" for p in _prompts(6)))
    roll = str(tmp_path / "rollouts")
    base = ["--model", student, "--prompts", str(prompts), "--out", roll, "--device", "cpu"]
    assert cli_main(["rollout", *base, "--max-new-tokens", "5", "--sequences-per-shard", "4", "--seed", "1"]) == 0
    assert "wrote" in capsys.readouterr().out
    assert cli_main(["rollout", *base, "--top-p", "0"]) == 2  # one line, exit 2
    assert "--top-p must be in (0, 1]" in capsys.readouterr().err
    seqs, plen, _ = read_rollouts(roll)
    store = str(tmp_path / "store")
    extract = ["teacher-extract", "--model", teacher, "--data", roll, "--out", store, "--device", "cpu"]
    assert cli_main(extract + ["--no-progress", "--dtype", "float32"]) == 0
    assert cli_main(["teacher-verify", store, "--quiet"]) == 0
    man = json.loads(open(os.path.join(store, "manifest.json")).read())
    # prompt positions are neither stored nor counted: one row per completion token
    assert man["num_rows"] == sum(len(s) - p for s, p in zip(seqs, plen))
    assert man["source"]["rollouts"] == os.path.abspath(roll)
    # a top-k store over the same rollouts stores the prompt's rows, but they do not count
    from nitrobrew.teacher.data import TopKCollator, TopKDataset

    topk = str(tmp_path / "topk")
    assert cli_main(extract[:-3] + [topk, "--device", "cpu", "--no-progress", "--kind", "topk", "--k", "4"]) == 0
    ds = TopKDataset(topk)
    batch = TopKCollator()([ds[i] for i in range(len(ds))])
    assert int((batch["labels"] != -100).sum()) == man["num_rows"]
    assert ds[0]["topk_ids"].shape[0] == len(seqs[0]) - 1
    config = {
        "student": student,
        "data": store,
        "divergence": "reverse_kl",
        "temperature": 1.0,
        "output_dir": str(tmp_path / "run"),
        "num_train_epochs": 2,
        "per_device_train_batch_size": 3,
        "learning_rate": 1e-2,
        "logging_steps": 1,
        "report_to": "none",
        "use_cpu": True,
        "save_strategy": "no",
    }
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(config))
    assert cli_main(["train", str(tmp_path / "c.yaml")]) == 0, capsys.readouterr().err
    state = json.loads((tmp_path / "run" / "trainer_state.json").read_text())
    kd = [h["kd_loss"] for h in state["log_history"] if "kd_loss" in h]
    assert state["global_step"] == 4 and len(kd) == 4 and kd[-1] < kd[0]  # two epochs of two steps; it learns
