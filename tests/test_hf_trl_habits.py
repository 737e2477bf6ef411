"""The habits a TRL user brings: beta, temperature, chat data, LoRA, dropout, the teacher's dtype,
generation settings and logged completions, as `nitrobrew train` and DistillationArguments read them."""

import json
import warnings

import pytest
import torch
from torch import nn

pytest.importorskip("transformers")
pytest.importorskip("accelerate")
pytest.importorskip("yaml")
pytest.importorskip("datasets")
from nitrobrew.cli import main  # noqa: E402
from nitrobrew.hf import DistillationArguments, DistillationTrainer  # noqa: E402
from nitrobrew.hf.train_cli import DataArguments, PadCollator, build, check_prompts_apart, load_data, parse  # noqa: E402
from test_hf_trainer import V, args, sequences, student_model, teacher_model  # noqa: E402


@pytest.mark.parametrize(
    "given, divergence, beta",
    [
        ({}, "forward_kl", 0.5),
        ({"beta": 0.3}, "jsd", 0.3),  # TRL's GKD rule: beta means the generalized JSD
        ({"beta": 0.0}, "forward_kl", 0.0),  # its endpoints are the two KLs
        ({"beta": 1.0}, "reverse_kl", 1.0),
        ({"beta": 0.3, "divergence": "jsd"}, "jsd", 0.3),
    ],
)
def test_beta_without_divergence_follows_trl(tmp_path, given, divergence, beta):
    a = args(tmp_path, **given)
    assert (a.divergence, a.beta) == (divergence, beta)


def test_beta_with_another_divergence_warns(tmp_path):
    with pytest.warns(UserWarning, match="beta=0.3 is used by divergence='jsd' only"):
        args(tmp_path, divergence="tvd", beta=0.3)


def test_loss_temperature_with_generation_warns(tmp_path):
    with pytest.warns(UserWarning, match="generation_temperature"):
        a = args(tmp_path, temperature=2.0, lmbda=0.5)
    assert (a.temperature, a.generation_temperature) == (2.0, 0.9)
    with pytest.warns(UserWarning, match="generation_temperature"):
        args(tmp_path, temperature=2.0, seq_kd=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        args(tmp_path, temperature=2.0, lmbda=0.5, generation_temperature=0.7)
        args(tmp_path, temperature=2.0)
        assert args(tmp_path, lmbda=0.5).temperature == 1.0


def test_ce_with_lmbda_warns(tmp_path):
    with pytest.warns(UserWarning, match="CE term trains the student on its own samples"):
        args(tmp_path, ce_weight=0.1, lmbda=0.5)


def chat_tokenizer(path):
    pytest.importorskip("tokenizers")
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {f"w{i}": i for i in range(V - 6)}
    words.update({"<u>": V - 6, "<a>": V - 5, "<s>": V - 4, "<e>": V - 3})
    tok = Tokenizer(models.WordLevel(words, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    template = (
        "{% for m in messages %}{% if m['role'] == 'user' %}<u> {{ m['content'] }} <e> "
        "{% elif m['role'] == 'system' %}<s> {{ m['content'] }} <e> "
        "{% else %}<a> {{ m['content'] }} <e> {% endif %}{% endfor %}"
        "{% if add_generation_prompt %}<a> {% endif %}"
    )
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<e>", pad_token="w0", chat_template=template)
    fast.save_pretrained(path)
    return fast


CHAT = [
    {"role": "system", "content": "w1"},
    {"role": "user", "content": "w5 w6"},
    {"role": "assistant", "content": "w7 w8"},
    {"role": "user", "content": "w9"},
    {"role": "assistant", "content": "w10"},
]


def test_chat_data_counts_the_assistant_turns_only(tmp_path):
    chat_tokenizer(tmp_path / "tok")
    s, u, a, e = V - 4, V - 6, V - 5, V - 3
    with open(tmp_path / "chat.jsonl", "w") as f:
        f.write(json.dumps({"messages": CHAT}) + "\n")
        f.write(json.dumps({"messages": CHAT[:3]}) + "\n")
    ds = load_data(DataArguments(data=str(tmp_path / "chat.jsonl"), chat_template=True), str(tmp_path / "tok"))
    assert ds[0]["input_ids"] == [s, 1, e, u, 5, 6, e, a, 7, 8, e, u, 9, e, a, 10, e]
    x = -100
    assert ds[0]["labels"] == [x, x, x, x, x, x, x, x, 7, 8, e, x, x, x, x, 10, e]
    assert ds[1]["labels"][-3:] == [7, 8, e] and ds[1]["labels"][:-3] == [x] * 8
    # TRL's prompt / completion layout: both columns hold messages
    with open(tmp_path / "pc.jsonl", "w") as f:
        f.write(json.dumps({"prompt": CHAT[:2], "completion": CHAT[2:3]}) + "\n")
    pc = load_data(
        DataArguments(
            data=str(tmp_path / "pc.jsonl"), chat_template=True, prompt_field="prompt", text_field="completion"
        ),
        str(tmp_path / "tok"),
    )
    assert pc[0] == ds[1]
    with open(tmp_path / "no_reply.jsonl", "w") as f:
        f.write(json.dumps({"messages": CHAT[:2]}) + "\n")
    with pytest.raises(ValueError, match="row 0: no assistant message"):
        load_data(DataArguments(data=str(tmp_path / "no_reply.jsonl"), chat_template=True), str(tmp_path / "tok"))


def test_a_prompt_already_in_the_text_is_refused(tmp_path):
    chat_tokenizer(tmp_path / "tok")
    with open(tmp_path / "d.jsonl", "w") as f:
        f.write(json.dumps({"prompt": "w5 w6", "text": "w7 w8"}) + "\n")
        f.write(json.dumps({"prompt": "w5 w6", "text": "w5 w6 w7 w8"}) + "\n")
    with pytest.raises(ValueError, match="row 1: 'text' already starts with its 'prompt'"):
        load_data(
            DataArguments(data=str(tmp_path / "d.jsonl"), text_field="text", prompt_field="prompt"),
            str(tmp_path / "tok"),
        )


def test_a_text_that_only_shares_the_prompts_first_letters_is_kept():
    # "w5" / "w55 w6": the completion starts with the prompt's characters but not with its words
    check_prompts_apart(["w5", "a"], ["w55 w6", "and then"], "prompt", "text", "d.jsonl")
    with pytest.raises(ValueError, match="row 1: 'text' already starts with its 'prompt'"):
        check_prompts_apart(["w5", "Q: 2+2="], ["w55", "Q: 2+2=4"], "prompt", "text", "d.jsonl")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    student_model().save_pretrained(root / "student")
    teacher_model().save_pretrained(root / "teacher")
    return root


def test_chat_lora_teacher_dtype_from_a_yaml(models, tmp_path):
    """One `nitrobrew train` run: chat data, LoRA adapters from the peft mapping, a bfloat16 teacher."""
    pytest.importorskip("peft")
    chat_tokenizer(tmp_path / "tok")
    with open(tmp_path / "chat.jsonl", "w") as f:
        for _ in range(2):
            f.write(json.dumps({"messages": CHAT}) + "\n")
    (tmp_path / "cfg.yaml").write_text(
        f"student: {models / 'student'}\nteacher: {models / 'teacher'}\ntokenizer: {tmp_path / 'tok'}\n"
        f"data: {tmp_path / 'chat.jsonl'}\nchat_template: true\noutput_dir: {tmp_path / 'out'}\n"
        "peft: {r: 4, alpha: 8, dropout: 0.1, target_modules: [q_proj, v_proj]}\n"
        "teacher_model_init_kwargs: {dtype: bfloat16}\n"
        "max_steps: 1\nper_device_train_batch_size: 2\nreport_to: none\nuse_cpu: true\nsave_strategy: 'no'\n"
    )
    model_args, data_args, train_args = parse(str(tmp_path / "cfg.yaml"), [])
    trainer = build(model_args, data_args, train_args)
    trainable = [n for n, p in trainer.model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    assert trainer.teacher.dtype == torch.bfloat16
    dropouts = [m for m in trainer.model.modules() if isinstance(m, nn.Dropout)]
    assert dropouts and all(m.p == 0 for m in dropouts)  # the LoRA dropout too (disable_dropout)
    assert main(["train", str(tmp_path / "cfg.yaml"), "--teacher_dtype", "float32"]) == 0
    assert (tmp_path / "out" / "adapter_config.json").exists()


def test_dropout_is_disabled_by_default(tmp_path):
    student = student_model()
    student.extra = nn.Dropout(0.3)
    DistillationTrainer(model=student, teacher_model=teacher_model(), args=args(tmp_path))
    assert student.extra.p == 0
    student.extra = nn.Dropout(0.3)
    DistillationTrainer(model=student, teacher_model=teacher_model(), args=args(tmp_path, disable_dropout=False))
    assert student.extra.p == 0.3


@pytest.mark.parametrize(
    "bad, match",
    [
        (dict(generation_kwargs={"temperature": 0.5}), "generation_kwargs: unknown"),
        (dict(generation_kwargs="[1]"), "generation_kwargs must be a mapping"),
        (dict(teacher_model_init_kwargs="{nope"), "teacher_model_init_kwargs must be a mapping"),
    ],
)
def test_mapping_errors(tmp_path, bad, match):
    with pytest.raises(ValueError, match=match):
        args(tmp_path, **bad)


def test_generation_kwargs_reach_generation_and_completions_are_logged(tmp_path):
    """repetition_penalty (a generation_kwargs key) bans repeats in greedy completions; each
    logging step appends one completion to completions.jsonl."""
    a = args(
        tmp_path,
        lmbda=1.0,
        max_new_tokens=8,
        generation_temperature=0.0,
        generation_kwargs='{"repetition_penalty": 1000000.0}',
        log_completions=True,
        max_steps=2,
    )
    data = sequences([6, 6])
    for row in data:
        row["labels"] = [-100] * 3 + row["input_ids"][3:]
    trainer = DistillationTrainer(
        model=student_model(), teacher_model=teacher_model(), args=a, train_dataset=data, data_collator=PadCollator()
    )
    trainer.train()
    logged = [json.loads(line) for line in open(tmp_path / "completions.jsonl")]
    assert [r["step"] for r in logged] == [1, 2]
    for r in logged:
        assert len(r["prompt_ids"]) == 3 and 1 <= len(r["completion_ids"]) <= 8
        seen = r["prompt_ids"] + r["completion_ids"]
        assert len(set(r["completion_ids"])) == len(r["completion_ids"])
        assert not set(r["completion_ids"]) & set(r["prompt_ids"]), seen


def test_generation_progress_shows_on_the_step_bar(tmp_path, capsys):
    data = sequences([6, 6])
    for row in data:
        row["labels"] = [-100] * 3 + row["input_ids"][3:]
    a = args(tmp_path, lmbda=1.0, max_new_tokens=4, disable_tqdm=False, max_steps=1)
    DistillationTrainer(
        model=student_model(), teacher_model=teacher_model(), args=a, train_dataset=data, data_collator=PadCollator()
    ).train()
    err = capsys.readouterr().err
    assert "generating 1 completion (student) ..." in err and "tokens/s" in err, err[-2000:]


@pytest.mark.parametrize("ce_on_policy", [True, False])
def test_ce_on_policy_batches_can_be_skipped(tmp_path, ce_on_policy):
    data = sequences([6, 6])
    for row in data:
        row["labels"] = [-100] * 3 + row["input_ids"][3:]
    a = args(tmp_path, lmbda=1.0, max_new_tokens=4, ce_weight=0.5, ce_on_policy=ce_on_policy, max_steps=2)
    trainer = DistillationTrainer(
        model=student_model(), teacher_model=teacher_model(), args=a, train_dataset=data, data_collator=PadCollator()
    )
    trainer.train()
    logged = [h for h in trainer.state.log_history if "ce_loss" in h]
    assert len(logged) == 2 and all(h["kd_loss"] > 0 for h in logged)
    assert all((h["ce_loss"] > 0) == ce_on_policy for h in logged), logged


def test_argument_warnings_point_at_the_callers_line():
    with pytest.warns(UserWarning) as record:
        DistillationArguments(output_dir="out", divergence="forward_kl", beta=0.5, ce_weight=0.1, lmbda=0.5)
        DistillationArguments(output_dir="out", temperature=2.0, lmbda=0.5)
    assert len(record) == 3 and {w.filename for w in record} == {__file__}, [
        (w.filename, str(w.message)) for w in record
    ]
