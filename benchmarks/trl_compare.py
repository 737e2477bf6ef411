"""TRL's loss against nitrobrew's, each inside TRL's own trainer, at a large vocabulary.

For each vocabulary and each trainer (``trl.experimental.gkd.GKDTrainer`` and ``trl.DistillationTrainer``)
two trainers are built on the same tiny Qwen2 student and teacher (random weights, no downloads; a
large vocabulary and a small hidden size, so that the loss is the step): TRL's own, and nitrobrew's
subclass (``nitrobrew.integrations.trl``). On the same batch each runs its ``compute_loss`` and the
backward, as TRL's training step does. Measured, per trainer and vocabulary:

- loss equality: |loss_nitrobrew - loss_trl| / |loss_trl|, and the largest relative difference of
  the student's head gradient;
- step time: median of --steps timed loss + backward calls after --warmup;
- memory growth: the peak of the tensors a step creates (CUDA: max allocated above the resident
  state; CPU: ``TensorMemoryTracker``).

GKD runs off-policy here (``lmbda = 0``: a generated batch is a batch like any other to the loss);
DistillationTrainer's batch is a prompt + completion batch as its generation makes it.

  python benchmarks/trl_compare.py                          # GPU if there is one, else CPU
  python benchmarks/trl_compare.py --vocabs 65536 152064 --device cpu --rows 256
  python benchmarks/trl_compare.py --small                  # a tiny smoke run (tests)

Writes trl_compare.csv and trl_compare.md into --out (default benchmarks/results/integrations).
"""

from __future__ import annotations

import argparse
import copy
import csv
import gc
import os
import statistics
import sys
import tempfile
import time
import warnings

import torch

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from nitrobrew.core.memory import TensorMemoryTracker  # noqa: E402
from nitrobrew.environment import environment  # noqa: E402

WORDS = ["<pad>", "<eos>", "<unk>", "user", "assistant", ":"] + [f"w{i}" for i in range(40)]


def tokenizer(path: str):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>", eos_token="<eos>")
    fast.chat_template = (
        "{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} <eos> {% endfor %}"
        "{% if add_generation_prompt %}assistant : {% endif %}"
    )
    fast.padding_side = "left"
    fast.save_pretrained(path)
    return PreTrainedTokenizerFast.from_pretrained(path)


def model(vocab: int, hidden: int, layers: int, seed: int, dtype: torch.dtype, device: torch.device):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen2Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=max(hidden // 32, 2),
        num_key_value_heads=1,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        pad_token_id=0,
        eos_token_id=1,
    )
    m = Qwen2ForCausalLM(cfg)
    with torch.no_grad():
        m.lm_head.weight.mul_(40.0)  # logits of a realistic spread
    return m.to(device=device, dtype=dtype)


def build(kind: str, cls, student, teacher, tok, out: str, device: torch.device, beta: float, nitrobrew=None):
    import datasets

    common = dict(
        output_dir=out,
        per_device_train_batch_size=2,
        max_steps=1,
        report_to=[],
        save_strategy="no",
        use_cpu=device.type == "cpu",
        bf16=False,
        beta=beta,
    )
    if kind == "gkd":
        from trl.experimental.gkd import GKDConfig

        args = GKDConfig(lmbda=0.0, max_new_tokens=4, max_length=4096, **common)
        rows = [{"messages": [{"role": "user", "content": "w1 w2"}, {"role": "assistant", "content": "w3"}]}] * 2
    else:
        from trl import DistillationConfig

        args = DistillationConfig(max_completion_length=4, use_vllm=False, **common)
        rows = [{"prompt": [{"role": "user", "content": "w1 w2"}]}] * 2
    extra = {} if nitrobrew is None else {"nitrobrew": nitrobrew}
    return cls(
        model=student,
        teacher_model=teacher,
        args=args,
        processing_class=tok,
        train_dataset=datasets.Dataset.from_list(rows),
        **extra,
    )


def batch(kind: str, rows: int, seq: int, vocab: int, device: torch.device, seed: int = 0):
    """One batch of rows // seq sequences of seq tokens, the first half of each a prompt."""
    g = torch.Generator().manual_seed(seed)
    B, P = max(rows // seq, 1), seq // 2
    ids = torch.randint(2, vocab, (B, seq), generator=g)
    if kind == "gkd":
        labels = ids.clone()
        labels[:, :P] = -100
        return {
            k: v.to(device) for k, v in dict(input_ids=ids, attention_mask=torch.ones_like(ids), labels=labels).items()
        }
    mask = torch.ones(B, seq - P, dtype=torch.long)
    mask[0, -2:] = 0  # one completion stopped early
    return {
        "prompt_ids": ids[:, :P].to(device),
        "prompt_mask": torch.ones(B, P, dtype=torch.long, device=device),
        "completion_ids": ids[:, P:].to(device),
        "completion_mask": mask.to(device),
    }


def step(trainer, inputs):
    trainer.model.zero_grad(set_to_none=True)
    loss = trainer.compute_loss(trainer.model, dict(inputs))
    loss.backward()
    return loss.detach()


def measure(trainer, inputs, device: torch.device, steps: int, warmup: int):
    for _ in range(warmup):
        loss = step(trainer, inputs)
    times = []
    for _ in range(steps):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss = step(trainer, inputs)
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    grad = trainer.model.lm_head.weight.grad.detach().float().clone()
    trainer.model.zero_grad(set_to_none=True)
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        step(trainer, inputs)
        torch.cuda.synchronize()
        growth = torch.cuda.max_memory_allocated() - base
    else:
        with TensorMemoryTracker() as tracker:
            step(trainer, inputs)
        growth = tracker.peak
    trainer.model.zero_grad(set_to_none=True)
    return float(loss), grad, statistics.median(times), growth / 2**20


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--vocabs", type=int, nargs="+", default=None, help="default 65536 152064")
    p.add_argument("--hidden", type=int, default=None, help="default 64 (CPU), 896 (GPU)")
    p.add_argument("--layers", type=int, default=1)
    p.add_argument("--rows", type=int, default=None, help="token positions per batch (default 256 CPU, 4096 GPU)")
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--beta", type=float, default=0.5)
    p.add_argument("--trainers", nargs="+", default=["gkd", "distillation"], choices=["gkd", "distillation"])
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--chunk-v", type=int, default=None, help="nitrobrew's vocabulary chunk (default: automatic)")
    p.add_argument("--no-entropy", action="store_true", help="DistillationTrainer: skip the logged entropy pass")
    p.add_argument("--tag", default="", help="suffix of the output files (trl_compare<tag>.csv)")
    p.add_argument("--small", action="store_true", help="tiny sizes (a smoke run)")
    p.add_argument("--out", default=os.path.join("benchmarks", "results", "integrations"))
    a = p.parse_args(argv)
    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if a.device == "auto" else a.device)
    gpu = device.type == "cuda"
    if a.small:
        a.vocabs, a.hidden, a.rows, a.seq, a.steps, a.warmup = [512], 16, 32, 16, 1, 0
    vocabs = a.vocabs or [65536, 152064]
    hidden = a.hidden or (896 if gpu else 64)
    rows = a.rows or (4096 if gpu else 256)
    dtype = getattr(torch, a.dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from trl import DistillationTrainer
        from trl.experimental.gkd import GKDTrainer

        from nitrobrew.integrations.trl import NitrobrewDistillationTrainer, NitrobrewGKDTrainer
    classes = {
        "gkd": (GKDTrainer, NitrobrewGKDTrainer),
        "distillation": (DistillationTrainer, NitrobrewDistillationTrainer),
    }
    os.makedirs(a.out, exist_ok=True)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        tok = tokenizer(os.path.join(tmp, "tok"))
        for V in vocabs:
            student = model(V, hidden, a.layers, 0, dtype, device)
            teacher = model(V, hidden, a.layers, 1, dtype, device)
            for kind in a.trainers:
                inputs = batch(kind, rows, a.seq, V, device)
                measured = {}
                for name, cls in zip(("trl", "nitrobrew"), classes[kind]):
                    options = None if name == "trl" else {"chunk_V": a.chunk_v, "log_entropy": not a.no_entropy}
                    trainer = build(kind, cls, copy.deepcopy(student), teacher, tok, tmp, device, a.beta, options)
                    measured[name] = measure(trainer, inputs, device, a.steps, a.warmup)
                    del trainer
                    gc.collect()
                (lt, gt, tt, mt), (ln, gn, tn, mn) = measured["trl"], measured["nitrobrew"]
                row = {
                    "trainer": kind,
                    "vocab": V,
                    "hidden": hidden,
                    "rows": rows,
                    "beta": a.beta,
                    "loss_trl": lt,
                    "loss_nitrobrew": ln,
                    "loss_rel_diff": abs(ln - lt) / max(abs(lt), 1e-30),
                    "head_grad_rel_diff": float((gn - gt).abs().max() / gt.abs().max().clamp_min(1e-30)),
                    "step_s_trl": tt,
                    "step_s_nitrobrew": tn,
                    "speedup": tt / tn,
                    "growth_mib_trl": mt,
                    "growth_mib_nitrobrew": mn,
                    "memory_ratio": mt / max(mn, 1e-9),
                }
                results.append(row)
                print(
                    f"{kind:12s} V={V:6d}: loss {lt:.6f} vs {ln:.6f} (rel {row['loss_rel_diff']:.1e}, head grad "
                    f"{row['head_grad_rel_diff']:.1e}); step {tt * 1e3:.0f} vs {tn * 1e3:.0f} ms "
                    f"({row['speedup']:.2f}x); growth {mt:.0f} vs {mn:.0f} MiB ({row['memory_ratio']:.1f}x)",
                    flush=True,
                )
            del student, teacher
    env = environment()
    with open(os.path.join(a.out, f"trl_compare{a.tag}.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(results[0]))
        w.writeheader()
        w.writerows(results)
    lines = [
        "# TRL's loss vs nitrobrew's, inside TRL's trainers",
        "",
        f"Device: {env.get('device', device.type)}; torch {env.get('torch', torch.__version__)}; "
        f"transformers {_version('transformers')}; trl {_version('trl')}; nitrobrew commit {env.get('commit', '?')}.",
        f"Tiny Qwen2 student and teacher ({a.layers} layer, hidden {hidden}, {a.dtype}), {rows} positions per "
        f"batch (sequences of {a.seq}, half prompt), beta = {a.beta}; step = compute_loss + backward, median of "
        f"{a.steps} after {a.warmup} warm-up; growth = peak of the tensors one step creates "
        f"({'CUDA max allocated' if gpu else 'TensorMemoryTracker'}); nitrobrew chunk_V "
        f"{a.chunk_v or 'automatic'}, DistillationTrainer entropy logged: {not a.no_entropy}.",
        "",
        "| trainer | vocab | loss TRL | loss nitrobrew | rel. diff | head grad rel. diff | step TRL (ms) "
        "| step nitrobrew (ms) | speed-up | growth TRL (MiB) | growth nitrobrew (MiB) | memory ratio |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(
            f"| {r['trainer']} | {r['vocab']} | {r['loss_trl']:.6f} | {r['loss_nitrobrew']:.6f} | "
            f"{r['loss_rel_diff']:.1e} | {r['head_grad_rel_diff']:.1e} | {r['step_s_trl'] * 1e3:.0f} | "
            f"{r['step_s_nitrobrew'] * 1e3:.0f} | {r['speedup']:.2f}x | {r['growth_mib_trl']:.0f} | "
            f"{r['growth_mib_nitrobrew']:.0f} | {r['memory_ratio']:.1f}x |"
        )
    with open(os.path.join(a.out, f"trl_compare{a.tag}.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print(f"wrote {os.path.join(a.out, f'trl_compare{a.tag}.csv')} and trl_compare{a.tag}.md")
    return 0


def _version(dist: str) -> str:
    from nitrobrew.environment import package_version

    return package_version(dist)


if __name__ == "__main__":
    sys.exit(main())
