"""FSDP2 (fully_shard) over 2 CPU processes (gloo): the same gradients as one process on the whole batch.

The student's layers and root are sharded; the teacher replicated or sharded the same way. Two
layouts: the head in the root's unit (the root forward gathers it and keeps it until the
backward: the loss reads a full head), and the decoder sharded apart from the head (the head
is never gathered: rows are gathered and the loss is vocab-parallel over the rank's block).
"""

import copy
import os

import pytest
import torch

from gloo_ranks import run_ranks

pytest.importorskip("transformers")
dist = pytest.importorskip("torch.distributed")
if not dist.is_available():
    pytest.skip("torch built without distributed", allow_module_level=True)

WORLD = 2


def models(teacher_tied=True):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    student = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=61,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            tie_word_embeddings=False,
        )
    )
    torch.manual_seed(1)
    teacher = Qwen2ForCausalLM(
        Qwen2Config(
            vocab_size=61,
            hidden_size=24,
            intermediate_size=48,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            tie_word_embeddings=teacher_tied,
        )
    )
    for m in (student, teacher):
        with torch.no_grad():
            m.get_output_embeddings().weight.mul_(8.0)
    return student, teacher.eval().requires_grad_(False)


def batch():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 61, (4, 9), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 6:] = 0
    mask[2, 3:] = 0  # rank 1 counts fewer tokens than rank 0
    return ids, mask


def shard(model, mesh, apart=False):
    """fully_shard each layer and the root; apart: the decoder too, so the head is alone at the root."""
    from torch.distributed.fsdp import fully_shard

    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    if apart:
        fully_shard(model.model, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def plain_loop(rank, shard_teacher, apart=False, teacher_apart=False):
    from torch.distributed.device_mesh import init_device_mesh

    from nitrobrew.hf import count_targets, distill_loss, labels_from_inputs

    # An untied teacher whose decoder is sharded apart keeps its head sharded too (a tied one cannot).
    student, teacher = models(teacher_tied=not teacher_apart)
    ref_s, ref_t = copy.deepcopy(student), copy.deepcopy(teacher)
    mesh = init_device_mesh("cpu", (WORLD,))
    shard(student, mesh, apart)
    if shard_teacher:
        shard(teacher, mesh, teacher_apart)
    ids, mask = batch()
    rows = slice(2 * rank, 2 * rank + 2)
    count = count_targets(labels_from_inputs(ids[rows], mask[rows]), mask[rows])
    dist.all_reduce(count)  # the global number of counted positions
    out = distill_loss(
        student, teacher, ids[rows], mask[rows], divergence="jsd", ce_weight=0.3, num_items_in_batch=count
    )
    (out.loss * WORLD).backward()  # FSDP averages the gradients over ranks
    from nitrobrew.hf.fsdp import head_is_sharded_apart

    assert head_is_sharded_apart(teacher) == teacher_apart
    if apart:  # the vocab-parallel layout: the head was never gathered
        assert head_is_sharded_apart(student) and type(student.lm_head.weight).__name__ == "DTensor"
        assert student.lm_head.weight.to_local().shape[0] == (31 if rank == 0 else 30)
    ref = distill_loss(ref_s, ref_t, ids, mask, divergence="jsd", ce_weight=0.3)
    ref.loss.backward()
    total = out.loss.detach().clone()
    dist.all_reduce(total)
    torch.testing.assert_close(total, ref.loss.detach(), rtol=1e-5, atol=1e-6)
    for (n, p), (_, q) in zip(student.named_parameters(), ref_s.named_parameters()):
        torch.testing.assert_close(p.grad.full_tensor(), q.grad, rtol=1e-4, atol=1e-6, msg=n)


def trainer_loss(rank, tmp, apart=False):
    """DistillationTrainer.compute_loss on a fully_shard-ed student (accelerate's FSDP2 plugin path:
    test_hf_fsdp_accelerate.py, and benchmarks/hf_fsdp2_trainer.py on GPUs)."""
    from torch.distributed.device_mesh import init_device_mesh

    from nitrobrew.hf import DistillationArguments, DistillationTrainer, distill_loss
    from test_hf_trainer import collate, sequences

    student, teacher = models()
    ref_s = copy.deepcopy(student)
    shard(student, init_device_mesh("cpu", (WORLD,)), apart)
    args = DistillationArguments(output_dir=tmp, report_to="none", use_cpu=True, divergence="reverse_kl", ce_weight=0.2)
    trainer = DistillationTrainer(
        model=student,
        teacher_model=teacher,
        args=args,
        data_collator=collate,
        train_dataset=sequences([9, 4, 7, 6], seed=3),
    )
    b = collate(sequences([9, 4, 7, 6], seed=3))
    mine = {k: v[2 * rank : 2 * rank + 2] for k, v in b.items()}
    _, count = trainer.get_batch_samples(iter([mine]), 1, None)  # gathered over the processes
    student.train()
    trainer.compute_loss(student, mine, num_items_in_batch=count).backward()
    ref = distill_loss(
        ref_s, teacher, b["input_ids"], b["attention_mask"], b["labels"], divergence="reverse_kl", ce_weight=0.2
    )
    ref.loss.backward()
    assert int(count) == int(ref.n_tokens)
    for (n, p), (_, q) in zip(student.named_parameters(), ref_s.named_parameters()):
        torch.testing.assert_close(p.grad.full_tensor(), q.grad, rtol=1e-4, atol=1e-6, msg=n)


def cases(rank, outdir):
    return [
        ("teacher replicated", lambda: plain_loop(rank, False)),
        ("teacher sharded", lambda: plain_loop(rank, True)),
        ("head sharded (vocab-parallel), teacher replicated", lambda: plain_loop(rank, False, True)),
        ("head sharded (vocab-parallel), teacher too", lambda: plain_loop(rank, True, True, True)),
        ("student's head gathered, teacher's sharded", lambda: plain_loop(rank, True, False, True)),
        ("trainer's loss", lambda: trainer_loss(rank, os.path.join(outdir, "run"))),
        ("trainer's loss, head sharded", lambda: trainer_loss(rank, os.path.join(outdir, "run2"), True)),
    ]


def test_fsdp2_gradients_equal_one_process():
    run_ranks(cases, world=WORLD, timeout=120)
