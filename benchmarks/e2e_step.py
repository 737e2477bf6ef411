"""One whole distillation training step, the number users feel: teacher forward, student forward
+ backward with gradient checkpointing, AdamW step, per loss implementation.

Default (GPU): a 7B-shaped teacher (Qwen2 layout, 28 layers of 3584, 28 heads / 4 kv heads, MLP
18944) and a 1.5B-shaped student (28 x 1536, 12 / 2 heads, MLP 8960), vocabulary 152064, random
weights (HF's initialization; no pretrained weights are needed or used), bf16 weights and AdamW
state, SDPA attention, batch 1. Methods, all forward KL(teacher || student) over every position:

  nitrobrew   nitrobrew.hf.distill_loss: both decoders to their final hidden states, the loss
              from hidden states and heads (no [tokens, vocab] logits)
  hf-logits   the models' own logits (model(ids).logits, teacher under no_grad), fp32
              log_softmax, F.kl_div: what one writes with plain transformers
  trl-gkd     TRL's GKDTrainer.generalized_jsd_loss(student_logits, teacher_logits, beta=0) on the
              same logits (skipped with a note if trl is not importable)
  liger-jsd   Liger-Kernel's fused-linear JSD (LigerFusedLinearJSD, jsd_beta=0 = forward KL) on the
              final hidden states and heads (CUDA; skipped with a note if not importable)

Measured per method in one process: tokens/s and step time at --seq-len (median of --steps after
--warmup), peak memory of a step (max allocated, and above the resident weights, gradients and
optimizer state), and the longest sequence of --fit-lens (batch 1) whose step fits in memory.
Writes e2e_step.csv, e2e_step.md and e2e_step.png (with matplotlib) into --out.

  python benchmarks/e2e_step.py --out DIR                 # GPU, real shapes
  python benchmarks/e2e_step.py --small --out DIR         # CPU, tiny shapes (CI)
"""

from __future__ import annotations

import argparse
import csv
import gc
import os
import statistics
import sys
import time
from typing import Callable, Dict, List, Optional

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

from nitrobrew.bench.models import QWEN2_VOCAB, STUDENT_1P5B, TEACHER_7B, qwen2_model  # noqa: E402

METHODS = ("nitrobrew", "hf-logits", "trl-gkd", "liger-jsd")
REAL = dict(
    vocab=QWEN2_VOCAB,
    teacher=TEACHER_7B,
    student=STUDENT_1P5B,
    dtype="bfloat16",
    seq_len=4096,
    fit_lens=[8192, 16384, 32768, 65536, 131072],
    steps=5,
    warmup=2,
)
SMALL = dict(
    vocab=512,
    teacher=(2, 64, 4, 2, 128),
    student=(2, 32, 2, 1, 64),
    dtype="float32",
    seq_len=64,
    fit_lens=[128],
    steps=2,
    warmup=1,
)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--small", action="store_true", help="tiny models on CPU (CI); default: real shapes on CUDA")
    p.add_argument("--out", default="e2e-results", help="folder for e2e_step.csv / .md / .png")
    p.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS))
    p.add_argument("--seq-len", type=int, default=None, help="tokens of the timed steps (batch 1)")
    p.add_argument(
        "--fit-lens",
        type=int,
        nargs="*",
        default=None,
        metavar="N",
        help="sequence lengths tried, ascending, for the longest that fits (empty: skip)",
    )
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--warmup", type=int, default=None)
    p.add_argument("--teacher-layers", type=int, default=None, help="override the teacher's depth")
    p.add_argument("--student-layers", type=int, default=None, help="override the student's depth")
    p.add_argument(
        "--fit-time-limit",
        type=float,
        default=60.0,
        help="stop a method's fit search after a step slower than this (s)",
    )
    p.add_argument("--device", default=None, help="default: cuda, or cpu with --small")
    return p.parse_args(argv)


# ---------------------------------------------------------------- models


def build(shape, vocab: int, dtype, dev, seed: int):
    return qwen2_model(shape, vocab, dtype, dev, seed, max_positions=1 << 18, use_cache=False)


# ---------------------------------------------------------------- losses


def _kl_rows(s_logits: torch.Tensor, t_logits: torch.Tensor) -> torch.Tensor:
    lq = torch.log_softmax(s_logits.float(), -1)
    lp = torch.log_softmax(t_logits.float(), -1)
    return F.kl_div(lq, lp, reduction="batchmean", log_target=True)


def trl_gkd_loss() -> Callable:
    """TRL's generalized JSD (beta=0: KL(teacher || student)), wherever this TRL version keeps it."""
    try:
        from trl import GKDTrainer
    except Exception:
        from trl.experimental.gkd import GKDTrainer
    return GKDTrainer.generalized_jsd_loss


def unavailable(method: str, dev) -> Optional[str]:
    if method == "trl-gkd":
        try:
            trl_gkd_loss()
        except Exception as err:
            return f"skipped: trl not importable ({type(err).__name__}: {str(err)[:80]})"
    if method == "liger-jsd":
        sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        from nitrobrew.bench import baselines as bl

        why = bl.liger_unavailable(dev, fused=True)
        if why:
            return f"skipped: {why}"
    return None


def baseline(method: str) -> str:
    from nitrobrew.bench.common import nitrobrew_version, package_version

    return {
        "nitrobrew": f"nitrobrew {nitrobrew_version()} hf.distill_loss(divergence='forward_kl')",
        "hf-logits": f"transformers {package_version('transformers')} logits + torch {torch.__version__} "
        "fp32 log_softmax, F.kl_div",
        "trl-gkd": f"trl {package_version('trl')} GKDTrainer.generalized_jsd_loss(beta=0) on HF logits",
        "liger-jsd": f"liger-kernel {package_version('liger-kernel')} LigerFusedLinearJSD(jsd_beta=0)",
    }[method]


def loss_fn(method: str, student, teacher) -> Callable[[torch.Tensor], torch.Tensor]:
    """ids [1, N] -> scalar loss of one batch (KL over positions 0..N-2, predicting tokens 1..N-1)."""
    from nitrobrew.hf import distill_loss, final_hidden_states

    if method == "nitrobrew":
        return lambda ids: distill_loss(student, teacher, ids, divergence="forward_kl").loss
    if method in ("hf-logits", "trl-gkd"):
        gkd = trl_gkd_loss() if method == "trl-gkd" else None

        def logits_loss(ids):
            with torch.no_grad():
                t = teacher(input_ids=ids, use_cache=False).logits[:, :-1]
            s = student(input_ids=ids, use_cache=False).logits[:, :-1]
            if gkd is not None:
                return gkd(s, t, beta=0.0)
            return _kl_rows(s.reshape(-1, s.shape[-1]), t.reshape(-1, t.shape[-1]))

        return logits_loss
    if method == "liger-jsd":
        from nitrobrew.bench import baselines as bl

        def liger_loss(ids):
            with torch.no_grad():
                ht = final_hidden_states(teacher, ids)[:, :-1]
            hs = final_hidden_states(student, ids)[:, :-1]
            return bl.liger_fused(
                hs.reshape(-1, hs.shape[-1]),
                ht.reshape(-1, ht.shape[-1]),
                student.lm_head.weight,
                teacher.lm_head.weight,
            )

        return liger_loss
    raise KeyError(method)


# ---------------------------------------------------------------- measuring


def is_oom(err: BaseException) -> bool:
    return isinstance(err, torch.OutOfMemoryError) or "out of memory" in str(err).lower()


def sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize()


def free(dev):
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()


def allocated(dev) -> int:
    return torch.cuda.memory_allocated() if dev.type == "cuda" else 0


def measure(method: str, student, teacher, opt, args, cfg, dev, vocab: int) -> Dict:
    row = dict(method=method, seq_len=cfg["seq_len"], baseline=baseline(method), note="")
    why = unavailable(method, dev)
    if why:
        row["note"] = why
        return row
    fn = loss_fn(method, student, teacher)
    gen = torch.Generator(device="cpu").manual_seed(0)

    def step(n: int) -> float:
        ids = torch.randint(0, vocab, (1, n), generator=gen).to(dev)
        sync(dev)
        t0 = time.perf_counter()
        loss = fn(ids)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync(dev)
        if not torch.isfinite(loss.detach()):
            raise FloatingPointError(f"loss is {float(loss)}")
        return time.perf_counter() - t0

    err = None
    try:
        for _ in range(max(1, cfg["warmup"])):  # the first also allocates AdamW's state
            step(cfg["seq_len"])
        free(dev)
        resident = allocated(dev)
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
            times = [step(cfg["seq_len"]) for _ in range(max(1, cfg["steps"]))]
            peak = torch.cuda.max_memory_allocated()
            row.update(
                peak_gib=peak / 2**30, above_resident_gib=(peak - resident) / 2**30, resident_gib=resident / 2**30
            )
        else:  # CPU: tensors made during the steps (weights and optimizer state already exist)
            from nitrobrew.core.memory import TensorMemoryTracker

            times = [step(cfg["seq_len"])]
            with TensorMemoryTracker() as tracker:
                step(cfg["seq_len"])
            times += [step(cfg["seq_len"]) for _ in range(max(0, cfg["steps"] - 1))]
            row.update(above_resident_gib=tracker.peak / 2**30)
        ms = statistics.median(times) * 1e3
        row.update(step_ms=ms, tokens_per_s=cfg["seq_len"] / (ms / 1e3))
    except Exception as e:  # noqa: BLE001 - reported in the row
        err = e
    if err is not None:
        opt.zero_grad(set_to_none=True)
        row["note"] = "OOM" if is_oom(err) else f"error: {type(err).__name__}: {str(err)[:150]}"
        err = None
        free(dev)
        return row
    fit, first_oom = None, None
    for n in args_fit_lens(cfg):
        try:
            took = step(n)
            fit = n
        except Exception as e:  # noqa: BLE001
            if not is_oom(e):
                row["note"] = f"error at {n}: {type(e).__name__}: {str(e)[:120]}"
            first_oom = n
        opt.zero_grad(set_to_none=True)
        free(dev)
        if first_oom is not None:
            break
        if took > args.fit_time_limit:
            row["note"] = (row["note"] + f"; fit search stopped after {n} ({took:.0f} s a step)").lstrip("; ")
            break
    if cfg["fit_lens"]:
        row["max_seq_fit"] = max(fit or 0, cfg["seq_len"])
        row["first_oom"] = first_oom if first_oom is not None else ""
        if first_oom is None and fit == cfg["fit_lens"][-1]:
            row["note"] = (row["note"] + "; longest tried").lstrip("; ")
    return row


def args_fit_lens(cfg) -> List[int]:
    return sorted(n for n in cfg["fit_lens"] if n > cfg["seq_len"])


# ---------------------------------------------------------------- output


COLUMNS = [
    "method",
    "seq_len",
    "tokens_per_s",
    "step_ms",
    "peak_gib",
    "above_resident_gib",
    "resident_gib",
    "max_seq_fit",
    "first_oom",
    "note",
    "baseline",
]


def write(rows: List[Dict], env: Dict[str, str], cfg, out: str) -> List[str]:
    os.makedirs(out, exist_ok=True)
    paths = [os.path.join(out, "e2e_step.csv"), os.path.join(out, "e2e_step.md")]
    with open(paths[0], "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(COLUMNS + sorted(env))
        for r in rows:
            w.writerow([r.get(c, "") for c in COLUMNS] + [env[k] for k in sorted(env)])

    def fmt(v, p):
        return "-" if v in (None, "") else (f"{v:.{p}f}" if isinstance(v, float) else str(v))

    t, s = cfg["teacher"], cfg["student"]
    lines = [
        "## Whole distillation step",
        "",
        f"Teacher {t[0]} x {t[1]} ({t[2]}/{t[3]} heads, MLP {t[4]}), student {s[0]} x {s[1]} "
        f"({s[2]}/{s[3]} heads, MLP {s[4]}), vocabulary {cfg['vocab']}, random weights, {cfg['dtype']}, "
        "AdamW on the student, "
        f"gradient checkpointing, batch 1; forward KL over every position. "
        + ", ".join(f"{k} {v}" for k, v in sorted(env.items()))
        + ".",
        "",
        f"| method | tokens/s at {cfg['seq_len']} | step ms | peak GiB | GiB above resident | longest sequence "
        "that fits (first OOM) | note | baseline |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        fit = "-" if "max_seq_fit" not in r else f"{r['max_seq_fit']} ({r.get('first_oom') or '-'})"
        lines.append(
            f"| {r['method']} | {fmt(r.get('tokens_per_s'), 0)} | {fmt(r.get('step_ms'), 1)} | "
            f"{fmt(r.get('peak_gib'), 1)} | {fmt(r.get('above_resident_gib'), 1)} | {fit} | "
            f"{r.get('note', '')} | {r['baseline']} |"
        )
    with open(paths[1], "w") as f:
        f.write("\n".join(lines) + "\n")
    png = plot(rows, cfg, os.path.join(out, "e2e_step.png"))
    return paths + ([png] if png else [])


def plot(rows, cfg, path) -> Optional[str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot")
        return None
    ran = [r for r in rows if r.get("tokens_per_s")]
    if not ran:
        return None
    names = [r["method"] for r in ran]
    mem = "peak_gib" if any(r.get("peak_gib") for r in ran) else "above_resident_gib"
    panels = [
        ("tokens_per_s", f"tokens/s at {cfg['seq_len']} tokens"),
        (mem, mem.replace("_", " ")),
        ("max_seq_fit", "longest sequence that fits"),
    ]
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.6))
    for ax, (key, label) in zip(axes, panels):
        vals = [float(r.get(key) or 0) for r in ran]
        ax.bar(names, vals, color=["tab:green" if n == "nitrobrew" else "tab:gray" for n in names])
        ax.set_title(label, fontsize=9)
        ax.tick_params(axis="x", labelsize=8, rotation=20)
    fig.suptitle(
        f"distillation step, teacher {cfg['teacher'][0]}x{cfg['teacher'][1]}, student "
        f"{cfg['student'][0]}x{cfg['student'][1]}, V={cfg['vocab']}",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv=None) -> int:
    args = parse_args(argv)
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from nitrobrew.bench.common import environment, package_version

    cfg = dict(SMALL if args.small else REAL)
    for key in ("seq_len", "fit_lens", "steps", "warmup"):
        if getattr(args, key) is not None:
            cfg[key] = getattr(args, key)
    if args.teacher_layers:
        cfg["teacher"] = (args.teacher_layers, *cfg["teacher"][1:])
    if args.student_layers:
        cfg["student"] = (args.student_layers, *cfg["student"][1:])
    dev = torch.device(args.device or ("cpu" if args.small else "cuda"))
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("e2e_step: no CUDA device (use --small for the CPU mode)")
    dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[cfg["dtype"]]
    env = environment()
    env["transformers"] = package_version("transformers")
    print("env: " + ", ".join(f"{k}={v}" for k, v in env.items()), flush=True)
    t0 = time.time()
    teacher = build(cfg["teacher"], cfg["vocab"], dtype, dev, seed=1).eval().requires_grad_(False)
    student = build(cfg["student"], cfg["vocab"], dtype, dev, seed=2).train()
    if hasattr(student, "activation_checkpointing_enable"):  # transformers >= 5.x name
        student.activation_checkpointing_enable({"use_reentrant": False})
    else:
        student.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    opt = torch.optim.AdamW(student.parameters(), lr=1e-6)
    print(f"models built in {time.time() - t0:.1f} s", flush=True)
    rows = []
    for method in args.methods:
        t1 = time.time()
        row = measure(method, student, teacher, opt, args, cfg, dev, cfg["vocab"])
        rows.append(row)
        print(
            f"  {method}: {row.get('tokens_per_s', 0):.0f} tokens/s, step {row.get('step_ms', 0):.1f} ms, "
            f"peak {row.get('peak_gib', 0):.2f} GiB, fits {row.get('max_seq_fit', '-')} "
            f"[{row['note']}] ({time.time() - t1:.0f} s)",
            flush=True,
        )
        free(dev)
        paths = write(rows, env, cfg, args.out)  # after each method: a run cut short keeps its rows
    for path in paths:
        print(f"wrote {path}")
    bad = [r for r in rows if r["note"].startswith("error")]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
