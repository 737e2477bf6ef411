"""DistillationTrainer through accelerate's FSDP2 plugin over 2 CPU processes (gloo): one SGD step
equals one process's gradient on the whole batch, in both layouts (the decoder wrapped apart from
the head, the head sharded apart; and the root-wrapped one), teacher replicated or sharded.

accelerate turns its FSDP plugin on for GPU process groups only; the trainer below flips only that
outcome (the distributed type and the plugin) after the accelerator is built, so the rest runs
accelerate's own code: ``prepare`` -> ``_prepare_fsdp2`` -> ``fsdp2_prepare_model`` -> ``fully_shard``
on CPU. With the decoder named in the wrap policy, that path failed inside ``fully_shard`` of the
input embeddings ("Invariant encountered: value was None") before nitrobrew sharded the model first.
"""

import copy
import os

import pytest
import torch

from gloo_ranks import run_ranks

pytest.importorskip("transformers")
pytest.importorskip("accelerate")
dist = pytest.importorskip("torch.distributed")
if not dist.is_available():
    pytest.skip("torch built without distributed", allow_module_level=True)

WORLD = 2
VARIANTS = (
    ("root-wrapped, teacher replicated", ["LlamaDecoderLayer"], False),
    ("head sharded apart, teacher replicated", ["LlamaDecoderLayer", "LlamaModel"], False),
    ("head sharded apart, teacher sharded", ["LlamaDecoderLayer", "LlamaModel"], True),
)


def cpu_fsdp2_trainer():
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    from nitrobrew.hf import DistillationTrainer

    class CpuFsdp2Trainer(DistillationTrainer):
        def create_accelerator_and_postprocess(self):
            super().create_accelerator_and_postprocess()
            state = self.accelerator.state
            state.distributed_type = DistributedType.FSDP
            state.fsdp_plugin = FullyShardedDataParallelPlugin(**self.args.fsdp_plugin_args)
            self.is_fsdp_enabled = True

    return CpuFsdp2Trainer


def one_step(rank, tmp, wrap, shard_teacher):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from nitrobrew.hf import DistillationArguments, distill_loss
    from nitrobrew.hf.fsdp import head_is_sharded_apart
    from test_hf_fsdp import models
    from test_hf_trainer import collate, sequences

    student, teacher = models()
    ref_s, ref_t = copy.deepcopy(student), copy.deepcopy(teacher)
    if shard_teacher:
        mesh = init_device_mesh("cpu", (WORLD,))
        for layer in teacher.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(teacher, mesh=mesh)
    data = sequences([9, 4, 7, 6], seed=3)
    args = DistillationArguments(
        output_dir=tmp,
        report_to="none",
        use_cpu=True,
        per_device_train_batch_size=2,
        max_steps=1,
        learning_rate=1.0,
        lr_scheduler_type="constant",
        optim="sgd",
        weight_decay=0.0,
        max_grad_norm=0.0,
        save_strategy="no",
        disable_tqdm=True,
        divergence="jsd",
        ce_weight=0.2,
        fsdp="full_shard",
        fsdp_config={"version": 2, "transformer_layer_cls_to_wrap": wrap},
        seed=0,
    )
    before = {n: p.detach().clone() for n, p in student.named_parameters()}
    trainer = cpu_fsdp2_trainer()(
        model=student, teacher_model=teacher, args=args, train_dataset=data, data_collator=collate
    )
    trainer.train()
    model = trainer.model
    assert type(model.lm_head.weight).__name__ == "DTensor"
    assert head_is_sharded_apart(model) == ("LlamaModel" in wrap)
    after = {n: p.full_tensor().detach() for n, p in model.named_parameters()}
    b = collate(data)
    ref = distill_loss(ref_s, ref_t, b["input_ids"], b["attention_mask"], b["labels"], divergence="jsd", ce_weight=0.2)
    ref.loss.backward()
    for n, q in ref_s.named_parameters():
        torch.testing.assert_close(before[n] - after[n], q.grad, rtol=1e-4, atol=1e-6, msg=n)


def cases(rank, outdir):
    return [
        (name, lambda i=i, wrap=wrap, shard=shard: one_step(rank, os.path.join(outdir, f"run{i}"), wrap, shard))
        for i, (name, wrap, shard) in enumerate(VARIANTS)
    ]


def test_trainer_under_accelerate_fsdp2_plugin():
    run_ranks(cases, world=WORLD, timeout=240, init_group=False)  # accelerate joins the process group
