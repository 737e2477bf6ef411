"""Distill a causal LM with nitrobrew in a plain PyTorch loop (no Trainer).

    python examples/plain_pytorch.py                     # tiny random models: seconds on a CPU
    python examples/plain_pytorch.py --teacher PATH --student PATH --device cuda   # your models

The whole recipe is four lines inside the loop:

1. count the positions that count in the accumulation window (``count_targets``),
2. ``distill_loss(student, teacher, input_ids, attention_mask, labels, num_items_in_batch=n)``
   per micro-batch: both models run to their final hidden states, the divergence is computed
   chunk-wise from them and the two LM heads, never as [tokens, vocab] logits,
3. ``loss.backward()``,
4. ``optimizer.step()``.

Dividing summed losses by the window's token count (not averaging per micro-batch) makes the
accumulated gradient equal to the gradient of one big batch, whatever the padding.
"""

from __future__ import annotations

import argparse

import torch

from nitrobrew.hf import count_targets, distill_loss


def tiny_models(vocab: int):
    """A random 4x128 teacher and 2x64 student (Llama architecture), built from configs."""
    from transformers import LlamaConfig, LlamaForCausalLM

    def make(hidden, layers, seed):
        torch.manual_seed(seed)
        return LlamaForCausalLM(
            LlamaConfig(
                vocab_size=vocab,
                hidden_size=hidden,
                intermediate_size=2 * hidden,
                num_hidden_layers=layers,
                num_attention_heads=4,
                num_key_value_heads=4,
                max_position_embeddings=256,
            )
        )

    return make(128, 4, 0), make(64, 2, 1)


def batches(vocab: int, batch_size: int, seq_len: int, seed: int = 0):
    """Endless right-padded batches of random-length token sequences, labels -100 at padding."""
    g = torch.Generator().manual_seed(seed)
    while True:
        ids = torch.randint(0, vocab, (batch_size, seq_len), generator=g)
        lengths = torch.randint(seq_len // 2, seq_len + 1, (batch_size,), generator=g)
        mask = (torch.arange(seq_len)[None] < lengths[:, None]).long()
        yield {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def main(argv=None) -> float:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--teacher", help="teacher model path or hub name (default: a tiny random model)")
    p.add_argument("--student", help="student model path or hub name (default: a tiny random model)")
    p.add_argument(
        "--divergence", default="forward_kl", help="forward_kl, reverse_kl, jsd, tvd, skew_kl, skew_reverse_kl"
    )
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--ce-weight", type=float, default=0.0, help="add hard-label cross-entropy (default 0)")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--accum", type=int, default=2, help="gradient-accumulation micro-batches per step")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--device", default="cpu")
    args = p.parse_args(argv)

    if args.teacher and args.student:
        from transformers import AutoModelForCausalLM

        teacher = AutoModelForCausalLM.from_pretrained(args.teacher, dtype=torch.bfloat16)
        student = AutoModelForCausalLM.from_pretrained(args.student)
    else:
        teacher, student = tiny_models(vocab=256)
    teacher.to(args.device).eval().requires_grad_(False)  # frozen; distill_loss runs it under no_grad
    student.to(args.device).train()
    vocab = student.get_output_embeddings().weight.shape[0]
    optimizer = torch.optim.AdamW(student.parameters(), lr=args.lr)
    data = batches(vocab, args.batch_size, args.seq_len)

    for step in range(args.steps):
        window = [{k: v.to(args.device) for k, v in next(data).items()} for _ in range(args.accum)]
        n_tokens = sum(count_targets(b["labels"], b["attention_mask"]) for b in window)
        kd = 0.0
        for b in window:
            out = distill_loss(
                student,
                teacher,
                b["input_ids"],
                b["attention_mask"],
                b["labels"],
                divergence=args.divergence,
                temperature=args.temperature,
                ce_weight=args.ce_weight,
                num_items_in_batch=n_tokens,
            )
            out.loss.backward()
            kd += float(out.kd)  # each part is already divided by the window's token count
        torch.nn.utils.clip_grad_norm_(student.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step % 5 == 0 or step == args.steps - 1:
            print(f"step {step:4d}: {args.divergence} {kd:.5f} nats/token over {int(n_tokens)} tokens")
    return kd


if __name__ == "__main__":
    main()
