"""TRL's loss against nitrobrew's, each inside TRL's own trainer, at a large vocabulary.

For each vocabulary, trainer (``trl.experimental.gkd.GKDTrainer`` and ``trl.DistillationTrainer``) and
``beta``, two trainers are built on the same Qwen2-shaped student and teacher (random weights, no
downloads): TRL's own, and nitrobrew's subclass (``nitrobrew.integrations.trl``). On the same batch each
runs its ``compute_loss`` and the backward, as TRL's training step does, the two alternating so that a
change of the machine's load hits both. Measured, per row:

- loss equality: |loss_nitrobrew - loss_trl| / |loss_trl|, and the largest difference of the student's
  head gradient relative to its largest entry;
- step time: compute_loss + backward (median on CUDA, minimum on CPU, where other jobs share the cores;
  CPU also gives the process's CPU time, less sensitive to them);
- the loss alone (DistillationTrainer): TRL's ``_chunked_divergence_loss`` against nitrobrew's
  ``distillation_loss`` on the same hidden states and heads, forward + backward;
- memory growth: the peak of the tensors a step (or the loss alone) creates (CUDA: max allocated above
  what was allocated before; CPU: ``TensorMemoryTracker``).

GKD runs off-policy here (``lmbda = 0``: a generated batch is a batch like any other to the loss);
DistillationTrainer's batch is a prompt + completion batch as its generation makes it.

  python benchmarks/trl_compare.py                          # GPU if there is one, else CPU
  python benchmarks/trl_compare.py --device cpu --threads 1 --vocabs 65536 152064
  python benchmarks/trl_compare.py --small                  # a tiny smoke run

Defaults: CPU, a tiny 1-layer model (hidden 64), 256 positions, V = 65536 and 152064; CUDA, a
Qwen2.5-1.5B-shaped student and a Qwen2.5-7B-shaped teacher (``--layers`` fewer to save time),
bf16, 4096 positions (4 sequences of 1024, half prompt), V = 152064.
Writes trl_compare<tag>.csv and .md into --out (default benchmarks/results/integrations).
"""

from __future__ import annotations

import argparse
import copy
import csv
import gc
import math
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
# (hidden, intermediate, attention heads, key/value heads, layers)
SHAPES = {
    "tiny": (64, 128, 2, 1, 1),
    "qwen2.5-0.5b": (896, 4864, 14, 2, 24),
    "qwen2.5-1.5b": (1536, 8960, 12, 2, 28),
    "qwen2.5-7b": (3584, 18944, 28, 4, 28),
}


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


def model(vocab: int, shape: str, layers, seed: int, dtype: torch.dtype, device: torch.device, max_len: int):
    """A Qwen2 model of the named shape with random weights, its head scaled to logits of a realistic
    spread (a standard deviation of ~5 nats, whatever the width)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    hidden, inter, heads, kv, n_layers = SHAPES[shape]
    torch.manual_seed(seed)
    cfg = Qwen2Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers or n_layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        max_position_embeddings=max(4096, max_len),
        tie_word_embeddings=False,
        pad_token_id=0,
        eos_token_id=1,
    )
    with torch.device(device):  # initialized where it runs (a 7B model in seconds on a GPU)
        m = Qwen2ForCausalLM(cfg)
    with torch.no_grad():
        m.lm_head.weight.mul_(40.0 * math.sqrt(64 / hidden))
    return m.to(device=device, dtype=dtype)


def build(kind: str, cls, student, teacher, tok, out: str, device: torch.device, nitrobrew=None):
    import datasets

    common = dict(
        output_dir=out,
        per_device_train_batch_size=2,
        max_steps=1,
        report_to=[],
        save_strategy="no",
        use_cpu=device.type == "cpu",
        bf16=device.type == "cuda" and student.dtype == torch.bfloat16,  # as a GPU user sets it
    )
    if kind == "gkd":
        from trl.experimental.gkd import GKDConfig

        args = GKDConfig(lmbda=0.0, max_new_tokens=4, max_length=8192, **common)
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


def timed(fn, device: torch.device):
    """(wall seconds, process CPU seconds, result) of one call."""
    if device.type == "cuda":
        torch.cuda.synchronize()
    w0, c0 = time.perf_counter(), time.process_time()
    out = fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - w0, time.process_time() - c0, out


def growth_mib(fn, device: torch.device, clear) -> float:
    """Peak MiB of the tensors one call creates (``clear`` first drops gradients left by earlier calls)."""
    clear()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        fn()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
    else:
        with TensorMemoryTracker() as tracker:
            fn()
        peak = tracker.peak
    clear()
    return peak / 2**20


def alternate(fns: dict, device: torch.device, steps: int, warmup: int) -> dict:
    """Each function's (wall, cpu) times over ``steps`` rounds that call them in turn, after ``warmup``."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    times = {name: ([], []) for name in fns}
    for _ in range(steps):
        for name, fn in fns.items():
            wall, cpu, _ = timed(fn, device)
            times[name][0].append(wall)
            times[name][1].append(cpu)
    return times


def loss_only(trainers: dict, inputs, beta: float, chunk_v, entropy: bool):
    """DistillationTrainer's loss alone, on the hidden states its models give: TRL's function and nitrobrew's,
    each a closure running forward + backward into the student's head and hidden states."""
    from trl.trainer.distillation_trainer import _chunked_divergence_loss

    from nitrobrew.hf.model import lm_head
    from nitrobrew.integrations.trl import NitrobrewLoss, distillation_loss

    tr = trainers["trl"]
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
    mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
    keep = inputs["completion_ids"].shape[1]
    with torch.no_grad():
        hs = tr._get_last_hidden_state(tr.model, ids, mask, keep).detach()
        ht = tr._get_last_hidden_state(tr.teacher_model, ids, mask, keep).detach()
    hs.requires_grad_(True)
    head_s, head_t = lm_head(tr.model), lm_head(tr.teacher_model)
    loss_mask = inputs["completion_mask"]
    options = NitrobrewLoss(chunk_V=chunk_v, log_entropy=entropy)

    def clear():
        hs.grad = None
        head_s.weight.grad = None

    def trl_loss():
        clear()
        out = _chunked_divergence_loss(hs, ht, head_s.weight, head_t.weight, loss_mask, beta=beta)
        out[0].backward()
        return out

    def nb_loss():
        clear()
        out = distillation_loss(
            hs,
            ht,
            head_s,
            head_t,
            loss_mask,
            labels=inputs["completion_ids"],
            beta=beta,
            temperature=1.0,
            options=options,
        )
        out[0].backward()
        return out

    return {"trl": trl_loss, "nitrobrew": nb_loss}, clear


def stat(values, device: torch.device) -> float:
    return statistics.median(values) if device.type == "cuda" else min(values)


def compare(kind, trainers, inputs, device, a, beta) -> dict:
    """One row: both trainers on one batch at one beta."""
    for tr in trainers.values():
        tr.beta = beta
    steps = {name: (lambda tr=tr: step(tr, inputs)) for name, tr in trainers.items()}
    times = alternate(steps, device, a.steps, a.warmup)
    losses, grads = {}, {}
    for name, tr in trainers.items():
        losses[name] = float(step(tr, inputs))
        grads[name] = tr.model.lm_head.weight.grad.detach().float().clone()

    def clear():
        for tr in trainers.values():
            tr.model.zero_grad(set_to_none=True)

    growth = {name: growth_mib(fn, device, clear) for name, fn in steps.items()}
    gt, gn = grads["trl"], grads["nitrobrew"]
    lt, ln = losses["trl"], losses["nitrobrew"]
    row = {
        "trainer": kind,
        "vocab": trainers["trl"].model.config.vocab_size,
        "beta": beta,
        "rows": a.rows,
        "loss_trl": lt,
        "loss_nitrobrew": ln,
        "loss_rel_diff": abs(ln - lt) / max(abs(lt), 1e-30),
        "head_grad_rel_diff": float((gn - gt).abs().max() / gt.abs().max().clamp_min(1e-30)),
    }
    del grads, gt, gn
    for name in ("trl", "nitrobrew"):
        row[f"step_ms_{name}"] = stat(times[name][0], device) * 1e3
        row[f"step_cpu_ms_{name}"] = min(times[name][1]) * 1e3
    row["step_speedup"] = row["step_ms_trl"] / row["step_ms_nitrobrew"]
    for name in ("trl", "nitrobrew"):
        row[f"growth_mib_{name}"] = growth[name]
    row["memory_ratio"] = growth["trl"] / max(growth["nitrobrew"], 1e-9)
    for name in ("trl", "nitrobrew"):
        row[f"loss_ms_{name}"] = row[f"loss_growth_mib_{name}"] = float("nan")
    row["loss_speedup"] = float("nan")
    if kind == "distillation":
        fns, clear_loss = loss_only(trainers, inputs, beta, a.chunk_v, not a.no_entropy)
        times = alternate(fns, device, a.steps, a.warmup)
        for name, fn in fns.items():
            row[f"loss_ms_{name}"] = stat(times[name][0], device) * 1e3
            row[f"loss_growth_mib_{name}"] = growth_mib(fn, device, clear_loss)
        row["loss_speedup"] = row["loss_ms_trl"] / row["loss_ms_nitrobrew"]
        del fns
    clear()
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--vocabs", type=int, nargs="+", default=None, help="default 65536 152064 (CPU), 152064 (CUDA)")
    p.add_argument("--student", choices=sorted(SHAPES), default=None, help="default tiny (CPU), qwen2.5-1.5b")
    p.add_argument("--teacher", choices=sorted(SHAPES), default=None, help="default tiny (CPU), qwen2.5-7b")
    p.add_argument("--layers", type=int, default=None, help="layers of both models (default: the shape's)")
    p.add_argument("--rows", type=int, default=None, help="token positions per batch (default 256 CPU, 4096 CUDA)")
    p.add_argument("--seq", type=int, default=None, help="sequence length (default 128 CPU, 1024 CUDA)")
    p.add_argument("--betas", type=float, nargs="+", default=[0.5, 1.0], help="TRL's beta (0.5 JSD, 1 reverse KL)")
    p.add_argument("--trainers", nargs="+", default=["gkd", "distillation"], choices=["gkd", "distillation"])
    p.add_argument("--steps", type=int, default=None, help="timed rounds (default 3 CPU, 10 CUDA)")
    p.add_argument("--warmup", type=int, default=None, help="default 1 CPU, 2 CUDA")
    p.add_argument("--device", default="auto")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16"], help="default float32 CPU, bf16 CUDA")
    p.add_argument("--chunk-v", type=int, default=None, help="nitrobrew's vocabulary chunk (default: automatic)")
    p.add_argument("--no-entropy", action="store_true", help="DistillationTrainer: skip the logged entropy pass")
    p.add_argument("--tag", default="", help="suffix of the output files (trl_compare<tag>.csv)")
    p.add_argument("--small", action="store_true", help="tiny sizes (a smoke run)")
    p.add_argument("--out", default=os.path.join("benchmarks", "results", "integrations"))
    a = p.parse_args(argv)
    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if a.device == "auto" else a.device)
    gpu = device.type == "cuda"
    if a.threads:
        torch.set_num_threads(a.threads)
    if a.small:
        a.vocabs, a.student, a.teacher, a.layers, a.rows, a.seq, a.steps, a.warmup = (
            [512],
            "tiny",
            "tiny",
            1,
            32,
            16,
            1,
            0,
        )
    vocabs = a.vocabs or ([152064] if gpu else [65536, 152064])
    a.student = a.student or ("qwen2.5-1.5b" if gpu else "tiny")
    a.teacher = a.teacher or ("qwen2.5-7b" if gpu else "tiny")
    a.rows = a.rows or (4096 if gpu else 256)
    a.seq = a.seq or (1024 if gpu else 128)
    a.steps = a.steps or (10 if gpu else 3)
    a.warmup = (2 if gpu else 1) if a.warmup is None else a.warmup
    dtype = getattr(torch, a.dtype or ("bfloat16" if gpu else "float32"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from trl import DistillationTrainer
        from trl.experimental.gkd import GKDTrainer

        from nitrobrew.integrations.trl import NitrobrewDistillationTrainer, NitrobrewGKDTrainer
    classes = {"gkd": GKDTrainer, "distillation": DistillationTrainer}
    ours = {"gkd": NitrobrewGKDTrainer, "distillation": NitrobrewDistillationTrainer}
    os.makedirs(a.out, exist_ok=True)
    results = []
    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        tok = tokenizer(os.path.join(tmp, "tok"))
        for V in vocabs:
            student = model(V, a.student, a.layers, 0, dtype, device, a.seq)
            teacher = model(V, a.teacher, a.layers, 1, dtype, device, a.seq).requires_grad_(False)
            for kind in a.trainers:
                inputs = batch(kind, a.rows, a.seq, V, device)
                options = {"chunk_V": a.chunk_v, "log_entropy": not a.no_entropy}
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    trainers = {
                        "trl": build(kind, classes[kind], copy.deepcopy(student), teacher, tok, tmp, device),
                        "nitrobrew": build(
                            kind, ours[kind], copy.deepcopy(student), teacher, tok, tmp, device, options
                        ),
                    }
                for beta in a.betas:
                    row = compare(kind, trainers, inputs, device, a, beta)
                    results.append(row)
                    print(_line(row), flush=True)
                del trainers
                gc.collect()
                if gpu:
                    torch.cuda.empty_cache()
            del student, teacher
    _write(results, a, device, dtype, time.perf_counter() - t_start)
    return 0


def _line(r) -> str:
    s = (
        f"{r['trainer']:12s} V={r['vocab']:6d} beta={r['beta']:.2f}: loss {r['loss_trl']:.6f} vs "
        f"{r['loss_nitrobrew']:.6f} (rel {r['loss_rel_diff']:.1e}, head grad {r['head_grad_rel_diff']:.1e}); step "
        f"{r['step_ms_trl']:.1f} vs {r['step_ms_nitrobrew']:.1f} ms ({r['step_speedup']:.2f}x); growth "
        f"{r['growth_mib_trl']:.0f} vs {r['growth_mib_nitrobrew']:.0f} MiB ({r['memory_ratio']:.1f}x)"
    )
    if r["trainer"] == "distillation":
        s += (
            f"; loss alone {r['loss_ms_trl']:.1f} vs {r['loss_ms_nitrobrew']:.1f} ms ({r['loss_speedup']:.2f}x), "
            f"{r['loss_growth_mib_trl']:.0f} vs {r['loss_growth_mib_nitrobrew']:.0f} MiB"
        )
    return s


def _write(results, a, device, dtype, seconds: float) -> None:
    env = environment()
    gpu = device.type == "cuda"
    with open(os.path.join(a.out, f"trl_compare{a.tag}.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(results[0]))
        w.writeheader()
        w.writerows(results)
    layers = f" ({a.layers} layers each)" if a.layers else ""
    lines = [
        "# TRL's loss vs nitrobrew's, inside TRL's trainers",
        "",
        f"Device: {env.get('device', device.type)}; torch {env.get('torch', torch.__version__)}; "
        f"transformers {_version('transformers')}; trl {_version('trl')}; nitrobrew commit {env.get('commit', '?')}"
        f"{'' if gpu else f'; {torch.get_num_threads()} CPU threads'}; the run took {seconds:.0f} s.",
        f"Qwen2-shaped student {a.student} and teacher {a.teacher}{layers} (random weights, {str(dtype)[6:]}), "
        f"{a.rows} positions per batch (sequences of {a.seq}, half prompt); step = compute_loss + backward, "
        f"{'median' if gpu else 'minimum'} of {a.steps} after {a.warmup} warm-up, the two trainers alternating; "
        f"loss alone = DistillationTrainer's loss function, forward + backward, on the models' hidden states; "
        f"growth = peak of the tensors one call creates ({'CUDA max allocated' if gpu else 'TensorMemoryTracker'}); "
        f"nitrobrew chunk_V {a.chunk_v or 'automatic'}, DistillationTrainer entropy logged: {not a.no_entropy}.",
        "",
        "| trainer | vocab | beta | loss TRL | loss nitrobrew | rel. diff | head grad rel. diff | step TRL (ms) "
        "| step nitrobrew (ms) | speed-up | growth TRL (MiB) | growth nitrobrew (MiB) | memory ratio "
        "| loss alone TRL (ms) | loss alone nitrobrew (ms) | speed-up | loss alone growth TRL / nitrobrew (MiB) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        alone = (
            "| | | | |"
            if r["trainer"] != "distillation"
            else f"| {r['loss_ms_trl']:.1f} | {r['loss_ms_nitrobrew']:.1f} | {r['loss_speedup']:.2f}x | "
            f"{r['loss_growth_mib_trl']:.0f} / {r['loss_growth_mib_nitrobrew']:.0f} |"
        )
        lines.append(
            f"| {r['trainer']} | {r['vocab']} | {r['beta']:g} | {r['loss_trl']:.6f} | {r['loss_nitrobrew']:.6f} | "
            f"{r['loss_rel_diff']:.1e} | {r['head_grad_rel_diff']:.1e} | {r['step_ms_trl']:.1f} | "
            f"{r['step_ms_nitrobrew']:.1f} | {r['step_speedup']:.2f}x | {r['growth_mib_trl']:.0f} | "
            f"{r['growth_mib_nitrobrew']:.0f} | {r['memory_ratio']:.1f}x " + alone
        )
    if not gpu:
        lines += [
            "",
            "CPU time of the step (process time, minimum): "
            + "; ".join(
                f"{r['trainer']} V={r['vocab']} beta={r['beta']:g}: TRL {r['step_cpu_ms_trl']:.0f} ms, "
                f"nitrobrew {r['step_cpu_ms_nitrobrew']:.0f} ms"
                for r in results
            )
            + ".",
        ]
    with open(os.path.join(a.out, f"trl_compare{a.tag}.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print(f"wrote {os.path.join(a.out, f'trl_compare{a.tag}.csv')} and trl_compare{a.tag}.md")


def _version(dist: str) -> str:
    from nitrobrew.environment import package_version

    return package_version(dist)


if __name__ == "__main__":
    sys.exit(main())
