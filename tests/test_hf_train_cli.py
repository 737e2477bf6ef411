"""`nitrobrew train config.yaml`: a 2-step run on tiny models saved to disk (no downloads)."""

import json

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")
pytest.importorskip("yaml")
pytest.importorskip("datasets")
from nitrobrew.cli import main  # noqa: E402
from nitrobrew.hf.train_cli import parse, yaml_argv  # noqa: E402
from test_hf_trainer import V, save_run  # noqa: E402

CONFIG = """\
student: {student}
teacher: {teacher}
data: {data}
packing: {packing}
attn_implementation: sdpa
output_dir: {out}
max_steps: 2
per_device_train_batch_size: 2
learning_rate: 1.0e-3
divergence: jsd
beta: 0.3
ce_weight: 0.1
temperature: 2.0
temperature_schedule: linear
temperature_end: 1.0
lmbda: 0.5
max_new_tokens: 3
logging_steps: 1
save_strategy: "no"
report_to: none
use_cpu: true
seed: 3
"""


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return save_run(tmp_path_factory.mktemp("train"))


def write_config(root, name, packing=False, **extra):
    text = CONFIG.format(
        student=root / "student",
        teacher=root / "teacher",
        data=root / "data.jsonl",
        packing=str(packing).lower(),
        out=root / name,
    )
    text += "".join(f"{k}: {v}\n" for k, v in extra.items())
    path = root / f"{name}.yaml"
    path.write_text(text)
    return path


@pytest.mark.parametrize("packing", [False, True])
def test_two_steps_from_a_yaml_file(files, packing, capsys):
    name = f"run-{packing}"
    path = write_config(files, name, packing=packing)
    overrides = ["--lmbda", "0" if packing else "1", "--kd_weight_schedule", "cosine", "--kd_weight_end", "0.5"]
    assert main(["train", str(path), *overrides]) == 0
    assert (files / name / "model.safetensors").exists() and (files / name / "config.json").exists()
    history = [h for h in json.load(open(files / name / "trainer_state.json"))["log_history"] if "loss" in h]
    assert [h["step"] for h in history] == [1, 2]
    assert [h["temperature"] for h in history] == [2.0, 1.5]  # linear from 2 to 1 over 2 steps
    assert [h["kd_weight"] for h in history] == [1.0, 0.75]  # cosine from 1 to 0.5: halfway at step 1
    assert all(h["kd_loss"] > 0 and h["ce_loss"] > 0 and h["ce_weight"] == 0.1 for h in history)
    assert all(("gen_len" in h) != packing for h in history)


def test_overrides_and_types(files):
    path = write_config(files, "parse")
    model_args, data_args, args = parse(str(path), ["--divergence", "reverse_kl", "--packing", "true", "--lmbda", "0"])
    assert (model_args.student, model_args.attn_implementation) == (str(files / "student"), "sdpa")
    assert data_args.packing is True and args.divergence == "reverse_kl" and args.beta == 0.3
    assert args.learning_rate == 1e-3 and args.max_steps == 2 and args.temperature_end == 1.0
    assert args.report_to in ([], ["none"], "none")
    assert yaml_argv({"a": True, "b": [1, 2], "c": {"x": 1}, "d": None}) == [
        "--a",
        "true",
        "--b",
        "1",
        "2",
        "--c",
        '{"x": 1}',
    ]


def test_errors_are_one_line(files, tmp_path, capsys):
    bad = write_config(files, "bad", divergence_typo=1)
    assert main(["train", str(bad)]) == 2
    assert main(["train", str(tmp_path / "missing.yaml")]) == 2
    assert main(["train", str(write_config(files, "div")), "--divergence", "kl"]) == 2
    (tmp_path / "broken.yaml").write_text("student: [\n")
    assert main(["train", str(tmp_path / "broken.yaml")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 4 and all(line.startswith("nitrobrew train: ") for line in err), err
    assert "divergence_typo" in err[0] and "missing.yaml" in err[1] and "divergence must be one of" in err[2]


def test_usage_names_the_command(files, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["train"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "required: config" in err and "overrides" not in err, err
    with pytest.raises(SystemExit):
        main(["train", str(write_config(files, "help")), "--help"])
    assert capsys.readouterr().out.startswith("usage: nitrobrew train CONFIG ")


def test_missing_packages_name_the_extra(files, monkeypatch, capsys):
    """Without transformers, `train` is one line naming the extra; a command that needs an optional
    package to load (the demo: safetensors) is one line, not a traceback."""
    import sys

    monkeypatch.setitem(sys.modules, "transformers", None)
    assert main(["train", str(write_config(files, "bare"))]) == 2
    monkeypatch.setitem(sys.modules, "safetensors", None)
    for mod in [m for m in sys.modules if m.startswith("nitrobrew.demo")]:
        monkeypatch.delitem(sys.modules, mod)
    with pytest.raises(SystemExit) as exit_:
        main(["demo", "toy"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "nitrobrew train: needs transformers: pip install 'nitrobrew[hf]'",
        "nitrobrew demo: error: needs safetensors: pip install 'nitrobrew[store]'",
    ], err


def test_the_trainer_without_transformers_names_the_extra(monkeypatch):
    import sys

    import nitrobrew.hf

    monkeypatch.setitem(sys.modules, "transformers", None)
    monkeypatch.delitem(sys.modules, "nitrobrew.hf.trainer", raising=False)
    monkeypatch.delattr(nitrobrew.hf, "trainer", raising=False)  # else `from . import trainer` finds it
    with pytest.raises(
        ModuleNotFoundError, match=r"DistillationTrainer needs transformers: pip install 'nitrobrew\[hf\]'"
    ):
        _ = nitrobrew.hf.DistillationTrainer


def test_text_data_with_prompts(tmp_path):
    """text_field / prompt_field: tokenized with the student's tokenizer, the prompt's tokens -100."""
    pytest.importorskip("tokenizers")
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from nitrobrew.hf.train_cli import DataArguments, load_data

    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(V)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="w2", pad_token="w0").save_pretrained(tmp_path / "tok")
    with open(tmp_path / "chat.jsonl", "w") as f:
        f.write(json.dumps({"prompt": "w5 w6", "text": "w7 w8 w9", "other": 1}) + "\n")
    ds = load_data(
        DataArguments(data=str(tmp_path / "chat.jsonl"), text_field="text", prompt_field="prompt", max_length=5),
        str(tmp_path / "tok"),
    )
    assert ds.column_names == ["input_ids", "labels"]
    assert ds[0] == {"input_ids": [5, 6, 7, 8, 9], "labels": [-100, -100, 7, 8, 9]}
    with pytest.raises(ValueError, match="no column 'body'"):
        load_data(DataArguments(data=str(tmp_path / "chat.jsonl"), text_field="body"), str(tmp_path / "tok"))
    with pytest.raises(ValueError, match="no input_ids column"):
        load_data(DataArguments(data=str(tmp_path / "chat.jsonl")), str(tmp_path / "tok"))
    from transformers import LlamaConfig

    LlamaConfig(vocab_size=V).save_pretrained(tmp_path / "no_tok")  # a model folder without a tokenizer
    with pytest.raises(ValueError, match="text_field needs a tokenizer: none loads from") as err:
        load_data(DataArguments(data=str(tmp_path / "chat.jsonl"), text_field="text"), str(tmp_path / "no_tok"))
    assert "\n" not in str(err.value)


def test_config_mistakes_are_one_line_and_write_nothing(files, tmp_path, capsys):
    """Each bad config: exit 2, one line naming the key or file, no output_dir."""
    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "blank.jsonl").write_text("\n\n")
    base = f"output_dir: {tmp_path / 'out'}\nreport_to: none\nuse_cpu: true\n"
    models = f"student: {files / 'student'}\nteacher: {files / 'teacher'}\n"
    cases = {
        "no_student_or_data": (base, "missing student, data"),
        "missing_student_dir": (
            base + f"student: {tmp_path / 'nonexistent' / 'student'}\nteacher: {files / 'teacher'}\n"
            f"data: {files / 'data.jsonl'}\n",
            "student: no such model directory",
        ),
        "missing_data_file": (base + models + f"data: {tmp_path / 'none.jsonl'}\n", "data: no such file"),
        "list_for_a_float": (base + models + f"data: {files / 'data.jsonl'}\nbeta: [1, 2]\n", "beta takes one value"),
        "empty_data": (base + models + f"data: {tmp_path / 'empty.jsonl'}\n", "is empty"),
        "blank_data": (base + models + f"data: {tmp_path / 'blank.jsonl'}\n", "is empty"),
        "negative_max_length": (base + models + f"data: {files / 'data.jsonl'}\nmax_length: -3\n", "max_length must"),
        "zero_max_length": (base + models + f"data: {files / 'data.jsonl'}\nmax_length: 0\n", "max_length must"),
        "unknown_lora_key": (
            base + models + f"data: {files / 'data.jsonl'}\npeft: {{r: 4, bogus: 1}}\n",
            "peft: LoraConfig",
        ),
        "duplicate_key": (
            base + models + f"data: {files / 'data.jsonl'}\nbeta: 0.2\nbeta: 0.7\n",
            "key 'beta' is given twice (line",
        ),
    }
    for name, (text, says) in cases.items():
        path = tmp_path / f"{name}.yaml"
        path.write_text(text)
        assert main(["train", str(path)]) == 2, name
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("nitrobrew train: ") and says in err[0], (name, err)
        assert not (tmp_path / "out").exists(), name


@pytest.mark.parametrize("rank", ["0", "1"])
def test_a_ranks_own_training_error_is_said_by_that_rank(files, monkeypatch, capsys, rank):
    """An error while training may be one process's alone (a checkpoint file only it reads): it says so in
    one line naming its rank, where before only rank 0 spoke and a failing rank 1 exited 2 in silence. A
    config mistake, alike on every rank, is still said once, by rank 0."""
    from nitrobrew.hf import train_cli

    class Failing:
        def train(self, resume_from_checkpoint=None):
            raise FileNotFoundError("checkpoint-10/rng_state_1.pth")

    config = str(write_config(files, f"rank{rank}"))
    monkeypatch.setenv("RANK", rank)
    monkeypatch.setattr(train_cli, "build", lambda *a, **k: Failing())
    assert main(["train", config, "--max_steps", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    who = "nitrobrew train" if rank == "0" else "nitrobrew train (rank 1)"
    assert err == [f"{who}: checkpoint-10/rng_state_1.pth"]
    monkeypatch.undo()
    monkeypatch.setenv("RANK", rank)
    assert main(["train", config, "--max_steps", "1", "--max_length", "-3"]) == 2  # a config mistake
    said = capsys.readouterr().err.strip().splitlines()
    assert len(said) == (1 if rank == "0" else 0)
