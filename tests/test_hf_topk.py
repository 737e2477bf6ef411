"""divergence="topk": distill_loss and DistillationTrainer on a stored top-k dataset (nitrobrew.topk)."""

import copy

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("safetensors")
topk_extract = pytest.importorskip("nitrobrew.teacher.extract")
from nitrobrew.hf import DistillationArguments, DistillationTrainer, distill_loss  # noqa: E402
from nitrobrew.teacher.data import TopKCollator, TopKDataset  # noqa: E402
from test_hf_trainer import V, args, student_model, teacher_model  # noqa: E402

K = 5


def make_store(path, lengths, temperature=1.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    seqs = [torch.randint(0, V, (n,), generator=g).tolist() for n in lengths]
    teacher = teacher_model(seed=11).eval()
    topk_extract.extract_topk(topk_extract.teacher_from_hf(teacher), seqs, str(path), k=K, temperature=temperature)
    return TopKDataset(str(path)), seqs


def reference(student, dataset, T=1.0, tail=False):
    """float64: sum over stored rows of sum_k p_k (log p_k - log q_k), q the full softmax; / rows.
    tail: plus p_tail (log p_tail - log q_tail), the mass outside the stored ids on each side."""
    s64 = copy.deepcopy(student).double()
    total, rows = 0.0, 0
    for i in range(len(dataset)):
        item = dataset[i]
        logits = s64(input_ids=item["input_ids"][None]).logits[0, :-1] / T
        logq = logits.log_softmax(-1).gather(-1, item["topk_ids"])
        lp = item["topk_logprobs"].double()
        total = total + (lp.exp() * (lp - logq)).sum()
        if tail:
            p_tail, q_tail = 1 - lp.exp().sum(-1), 1 - logq.exp().sum(-1)
            total = total + (p_tail * (p_tail.log() - q_tail.log())).sum()
        rows += lp.shape[0]
    (total / rows).backward()
    return {n: p.grad.float() for n, p in s64.named_parameters()}


def test_distill_loss_from_a_store_batch(tmp_path):
    dataset, _ = make_store(tmp_path / "store", [9, 6, 12])
    batch = TopKCollator()([dataset[i] for i in range(3)])
    student = student_model(seed=2)
    out = distill_loss(
        student,
        None,
        batch["input_ids"],
        batch["attention_mask"],
        targets=batch["labels"],
        divergence="topk",
        topk_ids=batch["topk_ids"],
        topk_logprobs=batch["topk_logprobs"],
        teacher_temperature=dataset.temperature,
    )
    out.loss.backward()
    assert int(out.n_tokens) == 8 + 5 + 11
    want = reference(student_model(seed=2), dataset)
    for n, p in student.named_parameters():
        torch.testing.assert_close(p.grad, want[n], rtol=2e-4, atol=2e-6)
    with pytest.raises(ValueError, match="temperature"):
        distill_loss(
            student,
            None,
            batch["input_ids"],
            batch["attention_mask"],
            targets=batch["labels"],
            divergence="topk",
            topk_ids=batch["topk_ids"],
            topk_logprobs=batch["topk_logprobs"],
            temperature=2.0,
            teacher_temperature=dataset.temperature,
        )
    with pytest.raises(ValueError, match="not both"):
        distill_loss(
            student,
            None,
            batch["input_ids"],
            labels=batch["labels"],
            targets=batch["labels"],
            divergence="topk",
            topk_ids=batch["topk_ids"],
            topk_logprobs=batch["topk_logprobs"],
        )


def test_trainer_topk_accumulation_equals_one_big_batch(tmp_path):
    dataset, _ = make_store(tmp_path / "store", [14, 4])  # 13 and 3 stored rows
    got = {}
    for name, kw in (
        ("ga", dict(per_device_train_batch_size=1, gradient_accumulation_steps=2)),
        ("big", dict(per_device_train_batch_size=2)),
    ):
        student = student_model(seed=3)
        before = {n: p.detach().clone() for n, p in student.named_parameters()}
        trainer = DistillationTrainer(
            model=student,
            args=args(tmp_path / name, divergence="topk", **kw),
            train_dataset=dataset,
            data_collator=TopKCollator(),
        )
        trainer.train()
        got[name] = {n: before[n] - p.detach() for n, p in student.named_parameters()}
    want = reference(student_model(seed=3), dataset, tail=True)  # the trainer's default keeps the tail
    for n in want:
        torch.testing.assert_close(got["ga"][n], got["big"][n], rtol=2e-4, atol=2e-6)
        torch.testing.assert_close(got["ga"][n], want[n], rtol=2e-4, atol=2e-6)


def test_trainer_refuses_a_store_at_another_temperature(tmp_path):
    dataset, _ = make_store(tmp_path / "store", [6, 6], temperature=2.0)
    with pytest.raises(ValueError, match="extracted at temperature 2.0"):
        DistillationTrainer(
            model=student_model(),
            args=args(tmp_path, divergence="topk"),
            train_dataset=dataset,
            data_collator=TopKCollator(),
        )
    trainer = DistillationTrainer(
        model=student_model(),
        args=args(tmp_path, divergence="topk", temperature=2.0),
        train_dataset=dataset,
        data_collator=TopKCollator(),
    )
    trainer.train()
    assert isinstance(trainer.args, DistillationArguments)


def test_trainer_warns_without_tail_and_ce(tmp_path):
    dataset, _ = make_store(tmp_path / "store", [6, 6])
    with pytest.warns(UserWarning, match="no mass outside the stored ids"):
        DistillationTrainer(
            model=student_model(),
            args=args(tmp_path, divergence="topk", topk_tail=False),
            train_dataset=dataset,
            data_collator=TopKCollator(),
        )
