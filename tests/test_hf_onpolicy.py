"""On-policy / sequence-level distillation: on_policy_batch and the trainer's lmbda / seq_kd (tiny models)."""

import copy

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from nitrobrew.hf import IGNORE_INDEX, DistillationTrainer, distill_loss, on_policy_batch  # noqa: E402
from test_hf import reference  # noqa: E402
from test_hf_trainer import V, args, collate, save_run, sgd_step_gradient, teacher_model  # noqa: E402
from tiny_models import causal_lm  # noqa: E402

EOS, PAD = 3, 0


def student(seed=0):
    config = dict(positions=64, tie=False, eos_token_id=EOS, pad_token_id=PAD, bos_token_id=None)
    return causal_lm("Llama", vocab=V, hidden=16, layers=1, heads=2, kv_heads=1, seed=seed, **config)


def prompts(seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, V, (4, 6), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 4:] = 0  # right padding
    mask[2, :3] = 0  # left padding
    return ids, mask


def test_fixed_completions_count_generated_tokens_only():
    """External generator: prompt never counts, EOS does, everything after it does not."""
    ids, mask = prompts()
    completion = torch.tensor([[5, EOS, 7, 8], [6, 9, 10, 11], [EOS, 12, 13, 14], [15, 16, EOS, EOS]])

    def fixed(p, m, **options):
        assert options["max_new_tokens"] == 4 and options["eos_token_id"] == EOS
        assert bool((m[:, -1] == 1).all())  # prompts come left-padded: generation continues the last column
        return completion

    b = on_policy_batch(student(), ids, mask, max_new_tokens=4, generate_fn=fixed)
    assert b.n_generated.tolist() == [2, 4, 1, 3]
    for r in range(4):
        p = ids[r][mask[r] == 1].tolist()
        n = int(b.n_generated[r])
        row = p + completion[r, :n].tolist()
        assert b.input_ids[r, : len(row)].tolist() == row  # right-aligned: positions as in generation
        assert b.attention_mask[r].tolist() == [1] * len(row) + [0] * (b.input_ids.shape[1] - len(row))
        assert b.labels[r].tolist() == [IGNORE_INDEX] * len(p) + completion[r, :n].tolist() + [IGNORE_INDEX] * (
            b.input_ids.shape[1] - len(row)
        )
        assert bool((b.input_ids[r, len(row) :] == PAD).all())
    out = distill_loss(student(), teacher_model(), b.input_ids, b.attention_mask, b.labels)
    assert int(out.n_tokens) == int(b.n_generated.sum())


def test_generation_is_seeded_and_masks_after_eos():
    model = student()
    model.train()
    ids, mask = prompts(1)
    greedy = [on_policy_batch(model, ids, mask, max_new_tokens=6, temperature=0.0, eos_token_id=None) for _ in range(2)]
    assert torch.equal(greedy[0].input_ids, greedy[1].input_ids) and greedy[0].n_generated.tolist() == [6] * 4
    # An EOS the model often emits: its most frequent greedy token.
    eos = int(greedy[0].labels[greedy[0].labels != IGNORE_INDEX].mode().values)
    state = torch.get_rng_state()
    a = on_policy_batch(model, ids, mask, max_new_tokens=12, seed=5, eos_token_id=eos)
    assert torch.equal(torch.get_rng_state(), state)  # the global RNG is left as it was
    assert model.training  # mode restored
    b = on_policy_batch(model, ids, mask, max_new_tokens=12, seed=5, eos_token_id=eos)
    c = on_policy_batch(model, ids, mask, max_new_tokens=12, seed=6, eos_token_id=eos)
    assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.labels, b.labels)
    assert not torch.equal(a.input_ids, c.input_ids)
    cold = on_policy_batch(model, ids, mask, max_new_tokens=12, seed=5, eos_token_id=eos, temperature=0.2)
    assert cold.n_generated.min() < 12  # some row stopped at its EOS
    for g in (a, cold):
        for r in range(4):
            gen = g.labels[r][g.labels[r] != IGNORE_INDEX].tolist()
            assert len(gen) == int(g.n_generated[r])
            assert eos not in gen[:-1] and (gen[-1] == eos or len(gen) == 12)
            assert bool((g.input_ids[r][g.attention_mask[r] == 0] == PAD).all())


@pytest.mark.parametrize("divergence", ["reverse_kl", "jsd"])
def test_gradient_on_a_generated_batch_equals_float64(divergence):
    s, t = student(seed=2), teacher_model(seed=3)
    ids, mask = prompts(2)
    b = on_policy_batch(s, ids, mask, max_new_tokens=8, seed=1)
    out = distill_loss(s, t, b.input_ids, b.attention_mask, b.labels, divergence=divergence)
    out.loss.backward()
    s64, t64 = copy.deepcopy(student(seed=2)).double(), copy.deepcopy(t).double()
    total, count = reference(s64, t64, b.input_ids, b.attention_mask, b.labels, divergence)
    (total / count).backward()
    assert count == int(out.n_tokens) == int(b.n_generated.sum())
    torch.testing.assert_close(out.loss.double(), (total / count).detach(), rtol=1e-5, atol=1e-6)
    for (n, p), (_, q) in zip(s.named_parameters(), s64.named_parameters()):
        torch.testing.assert_close(p.grad, q.grad.float(), rtol=2e-4, atol=2e-6, msg=n)


def test_errors():
    ids, mask = prompts()
    with pytest.raises(ValueError, match="max_new_tokens"):
        on_policy_batch(student(), ids, mask, max_new_tokens=0)
    with pytest.raises(ValueError, match="top_p"):
        on_policy_batch(student(), ids, mask, top_p=0.0)
    with pytest.raises(ValueError, match="shape"):
        on_policy_batch(student(), ids, mask, max_new_tokens=2, generate_fn=lambda p, m, **o: p[:, :3])


def test_arguments_are_checked_at_the_call():
    """A bool for max_new_tokens, float completions, ids outside the vocabulary: refused naming the argument."""
    ids, mask = prompts()
    called = []

    def fixed(p, m, **o):
        called.append(1)
        return torch.full((p.shape[0], 2), 5)

    with pytest.raises(TypeError, match="max_new_tokens"):
        on_policy_batch(student(), ids, mask, max_new_tokens=True, generate_fn=fixed)
    assert not called  # refused before generating
    with pytest.raises(TypeError, match="generate_fn.*integers"):
        on_policy_batch(student(), ids, mask, max_new_tokens=2, generate_fn=lambda p, m, **o: torch.full((4, 2), 5.0))
    for bad in (V, V + 7, -1):
        with pytest.raises(ValueError, match="generate_fn.*outside the vocabulary"):
            on_policy_batch(
                student(), ids, mask, max_new_tokens=2, generate_fn=lambda p, m, bad=bad, **o: torch.full((4, 2), bad)
            )
    b = on_policy_batch(student(), ids, mask, max_new_tokens=2, generate_fn=lambda p, m, **o: torch.full((4, 2), V - 1))
    assert int(b.n_generated.sum()) == 8


# ------------------------------------------------------------------------------------------- trainer


def prompt_data(seed=0):
    """Items whose labels are -100 on the prompt (as a chat / instruction collator makes them)."""
    g = torch.Generator().manual_seed(seed)
    items = []
    for p, c in ((4, 3), (6, 2)):
        ids = torch.randint(4, V, (p + c,), generator=g).tolist()
        items.append({"input_ids": ids, "labels": [IGNORE_INDEX] * p + ids[p:]})
    return items


def train_once(tmp_path, model, teacher, **kw):
    return sgd_step_gradient(tmp_path, prompt_data(), model, teacher, per_device_train_batch_size=2, **kw)


def test_lmbda_zero_is_the_plain_trainer(tmp_path, monkeypatch):
    teacher = teacher_model(seed=4)
    plain, _ = train_once(tmp_path / "a", student(seed=5), teacher)
    model = student(seed=5)
    monkeypatch.setattr(type(model), "generate", lambda *a, **k: pytest.fail("generated with lmbda=0"))
    zero, trainer = train_once(tmp_path / "b", model, teacher, lmbda=0.0, max_new_tokens=4)
    for n in plain:
        assert torch.equal(plain[n], zero[n]), n
    assert not any("gen_len" in h for h in trainer.state.log_history)


def test_lmbda_one_trains_on_the_completions(tmp_path):
    """The trainer's on-policy step == the float64 gradient on the batch the generator returned."""
    teacher, made = teacher_model(seed=6), []

    def generator(p, m, **options):
        g = torch.Generator().manual_seed(options["seed"])
        completion = torch.randint(4, V, (p.shape[0], options["max_new_tokens"]), generator=g)
        completion[0, 2] = EOS
        made.append(
            on_policy_batch(
                student(), p, m, max_new_tokens=options["max_new_tokens"], generate_fn=lambda *a, **k: completion
            )
        )
        return completion

    got, trainer = train_once(
        tmp_path, student(seed=7), teacher, lmbda=1.0, max_new_tokens=5, divergence="reverse_kl", generate_fn=generator
    )
    b = made[0]
    assert b.n_generated.tolist() == [3, 5]
    s64, t64 = copy.deepcopy(student(seed=7)).double(), copy.deepcopy(teacher).double()
    total, count = reference(s64, t64, b.input_ids, b.attention_mask, b.labels, "reverse_kl")
    (total / count).backward()
    for n, p in s64.named_parameters():
        torch.testing.assert_close(got[n], p.grad.float(), rtol=2e-4, atol=2e-6, msg=n)
    logged = [h for h in trainer.state.log_history if "gen_len" in h][0]
    assert logged["gen_len"] == 4.0 and logged["gen_seconds"] >= 0 and "kd_loss" in logged


def test_seq_kd_generates_with_the_teacher(tmp_path):
    teacher, seen = teacher_model(seed=8), []
    teacher.generation_config.eos_token_id = EOS

    def generator(p, m, **options):
        assert options["model"] is teacher
        seen.append(p.clone())
        return torch.full((p.shape[0], 3), 9)

    train_once(tmp_path, student(seed=9), teacher, seq_kd=True, max_new_tokens=3, generate_fn=generator)
    assert len(seen) == 1 and seen[0].shape[0] == 2  # one generation (the teacher's), lmbda 0


def test_prompts_are_needed(tmp_path):
    data = [{"input_ids": [5, 6, 7, 8]}, {"input_ids": [9, 10, 11]}]
    trainer = DistillationTrainer(
        model=student(),
        teacher_model=teacher_model(),
        data_collator=lambda items: {"input_ids": torch.tensor([it["input_ids"][:3] for it in items])},
        args=args(tmp_path, per_device_train_batch_size=2, lmbda=1.0, max_new_tokens=2),
        train_dataset=data,
    )
    with pytest.raises(ValueError, match="need prompts"):
        trainer.train()


def window_data(n=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    items = []
    for i in range(n):
        p = 3 + i % 3
        ids = torch.randint(4, V, (p + 2,), generator=g).tolist()
        items.append({"input_ids": ids, "labels": [IGNORE_INDEX] * p + ids[p:]})
    return items


def record_inputs(trainer, key):
    """A list that gets inputs[key] of each micro-batch the trainer's compute_loss sees."""
    seen = []
    compute = trainer.compute_loss

    def spy(model, inputs, *a, **k):
        seen.append(inputs[key].clone())
        return compute(model, inputs, *a, **k)

    trainer.compute_loss = spy
    return seen


def test_one_generation_per_window(tmp_path):
    """Gradient accumulation of 2: both micro-batches' prompts go to the engine in one call, each prompt
    num_generations times, and come back split into their micro-batches."""
    calls = []

    def generator(p, m, **options):
        calls.append(p.clone())
        completion = torch.full((p.shape[0], options["max_new_tokens"]), 9)
        completion[::2, 1] = EOS  # every other completion stops after 2 tokens
        return completion

    trainer = DistillationTrainer(
        model=student(seed=11),
        teacher_model=teacher_model(seed=12),
        generate_fn=generator,
        args=args(
            tmp_path,
            per_device_train_batch_size=2,
            gradient_accumulation_steps=2,
            max_steps=1,
            lmbda=1.0,
            max_new_tokens=3,
            num_generations=2,
        ),
        train_dataset=window_data(),
        data_collator=collate,
    )
    seen = record_inputs(trainer, "labels")
    trainer.train()
    assert len(calls) == 1 and calls[0].shape[0] == 8  # 2 micro-batches x 2 prompts x 2 generations
    assert [s.shape[0] for s in seen] == [4, 4]
    counted = sum(int((s != IGNORE_INDEX).sum()) for s in seen)
    assert counted == 4 * 2 + 4 * 3  # 8 completions: half stop at their EOS (2 tokens), half run 3
    log = [h for h in trainer.state.log_history if "gen_tokens" in h][0]
    assert log["gen_tokens"] == counted and log["gen_len"] == counted / 8
    assert 0 <= log["gen_fraction"] <= 1 and log["gen_decode_ms"] >= 0 and log["gen_compiles"] == 0


def test_static_backend_trains_like_the_dynamic_cache(tmp_path):
    """generation_backend static and hf: the same greedy completions, the same update."""
    teacher = teacher_model(seed=13)
    got = {}
    for backend in ("hf", "static"):
        got[backend], trainer = train_once(
            tmp_path / backend,
            student(seed=14),
            teacher,
            lmbda=1.0,
            max_new_tokens=4,
            generation_temperature=0.0,
            generation_backend=backend,
        )
        assert trainer.generator_for(trainer.model).name == backend
    for n in got["hf"]:
        torch.testing.assert_close(got["static"][n], got["hf"][n], rtol=0, atol=0, msg=n)


def test_generation_arguments_are_checked(tmp_path):
    with pytest.raises(ValueError, match="generation_backend"):
        args(tmp_path, generation_backend="fast")
    with pytest.raises(ValueError, match="num_generations"):
        args(tmp_path, num_generations=0)


def async_run(tmp_path, **kw):
    trainer = DistillationTrainer(
        model=student(seed=15),
        teacher_model=teacher_model(seed=16),
        args=args(
            tmp_path,
            per_device_train_batch_size=2,
            gradient_accumulation_steps=2,
            max_steps=3,
            learning_rate=0.5,
            lmbda=1.0,
            max_new_tokens=4,
            generation_temperature=1.0,
            generation_backend="static",
            **kw,
        ),
        train_dataset=window_data(12),
        data_collator=collate,
    )
    calls = record_inputs(trainer, "input_ids")
    trainer.train()
    return calls, {n: p.detach().clone() for n, p in trainer.model.named_parameters()}, trainer


def test_async_generation_with_staleness_0_is_the_synchronous_run(tmp_path):
    sync_batches, sync_weights, _ = async_run(tmp_path / "sync")
    a_batches, a_weights, trainer = async_run(tmp_path / "async", generation_async=True, max_staleness=0)
    assert len(a_batches) == len(sync_batches) == 6
    assert all(torch.equal(x, y) for x, y in zip(a_batches, sync_batches))
    for n in sync_weights:
        torch.testing.assert_close(a_weights[n], sync_weights[n], rtol=0, atol=0, msg=n)
    assert trainer._rollouts is None  # closed at the end of training


def test_async_generation_staleness_1_is_deterministic(tmp_path):
    sync_batches, _, _ = async_run(tmp_path / "sync")
    a, wa, trainer = async_run(tmp_path / "a", generation_async=True, max_staleness=1)
    b, wb, _ = async_run(tmp_path / "b", generation_async=True, max_staleness=1)
    assert all(torch.equal(x, y) for x, y in zip(a, b)) and all(torch.equal(wa[n], wb[n]) for n in wa)
    # Windows 0 and 1 come from the initial weights: window 0 as in the synchronous run, window 1 not.
    assert torch.equal(a[0], sync_batches[0]) and not all(torch.equal(x, y) for x, y in zip(a[2:4], sync_batches[2:4]))
    lags = [h["gen_staleness"] for h in trainer.state.log_history if "gen_staleness" in h]
    assert lags == [0.0, 1.0, 1.0]


@pytest.mark.parametrize(
    "extra",
    [
        ["--generation_backend", "hf"],
        ["--generation_backend", "static", "--num_generations", "2"],
        ["--generation_backend", "auto", "--generation_async", "true", "--max_staleness", "1"],
    ],
)
def test_nitrobrew_train_on_policy_with_each_backend(tmp_path, extra):
    """`nitrobrew train` with an on-policy config runs with each in-process engine and logs generation."""
    import json

    pytest.importorskip("yaml")
    pytest.importorskip("datasets")
    from nitrobrew.cli import main
    from test_hf_train_cli import write_config

    save_run(tmp_path, low=4)
    path = write_config(tmp_path, "run")
    assert main(["train", str(path), "--lmbda", "1", *extra]) == 0
    history = [h for h in json.load(open(tmp_path / "run" / "trainer_state.json"))["log_history"] if "loss" in h]
    assert [h["step"] for h in history] == [1, 2]
    for h in history:
        assert h["gen_tokens"] > 0 and h["gen_decode_ms"] > 0 and 0 < h["gen_fraction"] <= 1
    if "--generation_async" in extra:
        assert [h["gen_staleness"] for h in history] == [0.0, 1.0]
