"""The on-policy distillation step, and the generation inside it, per generation engine.

Default (CUDA): a 1.5B-shaped student (Qwen2 layout, 28 x 1536, 12 / 2 heads, MLP 8960) and a 7B-shaped
teacher (28 x 3584, 28 / 4 heads, MLP 18944), vocabulary 152064, random weights built from configs (no
downloads), bf16, SDPA attention. Prompts of P = 256 tokens, completions of G = 512.

1. Decode, per engine (``nitrobrew.hf.generation``: hf = the dynamic cache, static = the static cache with
   the compiled decode step; vllm where importable) and batch size (8, 64, 256): ms per decode step against
   the physical floor (the student's weights plus the KV cache of P + G tokens per row, read once per step,
   over the device's HBM bandwidth), new tokens/s, and the graphs compiled after warm-up (none expected).
   To finish in minutes, ``--decode-steps`` steps (64) are timed at the end of the context (prompts of
   P + G - 64 tokens, so each timed step reads about the KV cache of P + G tokens, as the floor assumes), the
   prefill is timed apart (a 1-step call) and subtracted, and a full generation of G tokens is extrapolated
   as prefill(P) + G x (ms per step): an upper bound for the dynamic cache, whose early steps read less.
2. The step, at B = 8 and 64 (prompts x completions of P + G tokens): the off-policy (teacher-forced) step
   on the same number of tokens (teacher forward, student forward + backward with gradient checkpointing,
   ``distill_loss(divergence="jsd")``, AdamW), an SFT step (CE only), and the on-policy step: extrapolated
   (the fastest engine's generation, from part 1, + the off-policy step) and, with ``--sync-windows`` > 0,
   measured (the static engine on the training student generates G tokens, then the step trains on them).
3. Asynchronous rollouts, measured (``nitrobrew.hf.generation.AsyncRollouts``, staleness 1, as
   ``generation_async: true`` runs them): a copy of the student (``copy.deepcopy``, as the trainer makes it)
   with the static engine generates window k+1 in a background thread, on its own CUDA stream, while the
   student trains on window k; after each optimizer step the weights are copied into it. On the second GPU
   (cuda:1, when two are visible) and, with ``--async-same-gpu``, on the training GPU itself. The first window
   (compilation in the thread) is not timed; the step time is the median of ``--async-windows`` windows
   after it (each: waiting for the window's completions, the training step, and the weight sync, which
   waits for the next window's generation); also recorded: the weight copy alone (timed apart), the
   staleness of every window, the generation time per window and the peak memory of both devices.

vLLM cannot be installed on the lent GPUs (no package index there; its wheels pin another torch): its rows
say so; where it is installed, ``--backends hf static vllm`` measures it the same way.

  python benchmarks/onpolicy_step.py                     # CUDA, the shapes above (under 8 minutes, one H100)
  python benchmarks/onpolicy_step.py --profile           # also a torch.profiler table of decode steps
  python benchmarks/onpolicy_step.py --backends static --decode-batches --step-batches 64 \
      --sync-windows 2 --async-windows 4 --async-same-gpu  # 2 GPUs: sync vs async at B = 64 (~4 minutes)
  python benchmarks/onpolicy_step.py --tiny --out DIR    # CPU, tiny shapes, seconds (CI)

Writes onpolicy_step.md and onpolicy_step.csv (and profile_decode.txt) into --out
(default benchmarks/results/onpolicy).
"""

from __future__ import annotations

import argparse
import csv
import gc
import os
import statistics
import sys
import time
from typing import Dict, List, Optional

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # run from a checkout

from nitrobrew.bench.models import QWEN2_VOCAB, STUDENT_1P5B, TEACHER_7B, qwen2_model  # noqa: E402

REAL = dict(
    vocab=QWEN2_VOCAB,
    student=STUDENT_1P5B,
    teacher=TEACHER_7B,
    dtype="bfloat16",
    prompt=256,
    gen=512,
    decode_batches=[8, 64, 256],
    step_batches=[8, 64],
    decode_steps=64,
)
TINY = dict(
    vocab=512,
    student=(2, 32, 2, 1, 64),
    teacher=(2, 64, 4, 2, 128),
    dtype="float32",
    prompt=12,
    gen=16,
    decode_batches=[2, 4],
    step_batches=[2],
    decode_steps=4,
)
# HBM bandwidth (bytes/s) by device name; the first match wins.
HBM = (("H200", 4.8e12), ("H100 PCIe", 2.0e12), ("H100", 3.35e12), ("A100", 2.0e12), ("L40S", 0.864e12))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tiny", action="store_true", help="tiny models on CPU, seconds (CI)")
    p.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "onpolicy"))
    p.add_argument("--backends", nargs="+", default=["hf", "static", "vllm"], help="engines to measure")
    p.add_argument("--decode-batches", type=int, nargs="*", default=None, help="none: no decode table")
    p.add_argument("--step-batches", type=int, nargs="*", default=None, help="none: no step table")
    p.add_argument("--decode-steps", type=int, default=None, help="decode steps timed per measurement")
    p.add_argument("--step-repeats", type=int, default=None, help="timed repeats of the off-policy and SFT steps")
    p.add_argument(
        "--sync-windows", type=int, default=0, help="measured synchronous on-policy steps per batch (0: none)"
    )
    p.add_argument("--async-windows", type=int, default=3, help="windows timed with asynchronous rollouts")
    p.add_argument(
        "--async-batches", type=int, nargs="*", default=None, help="batches of the asynchronous variants (64)"
    )
    p.add_argument("--no-async", action="store_true", help="skip the asynchronous variants")
    p.add_argument(
        "--async-same-gpu",
        action="store_true",
        help="also time asynchronous rollouts with the generating copy on the training GPU (a compilation more)",
    )
    p.add_argument("--profile", action="store_true", help="write a torch.profiler table of decode steps")
    p.add_argument("--device", default=None)
    return p.parse_args(argv)


def hbm_bandwidth(name: str) -> Optional[float]:
    for key, bw in HBM:
        if key in name:
            return bw
    return None


def build(shape, vocab: int, dtype, dev, seed: int):
    model = qwen2_model(shape, vocab, dtype, dev, seed, max_positions=8192)
    model.generation_config.eos_token_id = None  # every row runs the full length
    model.generation_config.pad_token_id = 0
    return model


def sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def free(dev):
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()


def kv_bytes_per_token(model) -> int:
    c = model.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    return 2 * c.num_hidden_layers * c.num_key_value_heads * head_dim * model.dtype.itemsize


def weight_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def prompts(batch: int, length: int, vocab: int, dev, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, vocab, (batch, length), generator=g).to(dev)
    return ids, torch.ones_like(ids)


def make_engine(name: str, model):
    from nitrobrew.hf.generation import BACKENDS, make_generator

    if name.startswith("vllm"):
        from nitrobrew.hf.generation.vllm_engine import vllm_importable

        if not vllm_importable():
            return None, (
                "not measured: vLLM is not installed here (it cannot be installed on the lent GPU: no package "
                "index, and its wheels pin another torch); where it is, this script measures it"
            )
    if name not in BACKENDS:
        return None, f"not measured: no backend {name!r} in this nitrobrew"
    try:
        return make_generator(name, model), ""
    except ImportError as err:
        return None, f"not measured: {err}"


# ---------------------------------------------------------------- 1. decode


def time_generation(engine, ids, mask, steps: int, dev):
    from nitrobrew.hf.generation import Sampling

    s = Sampling(max_new_tokens=steps, temperature=1.0, pad_token_id=0, seed=0)
    sync(dev)
    t0 = time.perf_counter()
    out = engine.generate(ids, mask, s)
    sync(dev)
    return time.perf_counter() - t0, out


def measure_decode(name, student, batch, cfg, dev, floor_bw, profile_dir: Optional[str] = None) -> Dict:
    row = dict(part="decode", backend=name, batch=batch, note="")
    engine, why = make_engine(name, student)
    if engine is None:
        row["note"] = why
        return row
    P, G, n = cfg["prompt"], cfg["gen"], cfg["decode_steps"]
    ids, mask = prompts(batch, max(P + G - n, 1), cfg["vocab"], dev)
    short, smask = prompts(batch, P, cfg["vocab"], dev, seed=1)
    try:
        time_generation(engine, ids, mask, n, dev)  # warm-up: allocations, compilation, CUDA graphs
        time_generation(engine, ids, mask, 1, dev)
        compiled = getattr(engine, "compiles", 0)
        repeats = 3 if dev.type == "cpu" else 1  # CPU timings are noisy; a GPU's are not
        # The prefill (and one sampling), then the whole call: the difference is n - 1 decode steps.
        one = statistics.median(time_generation(engine, ids, mask, 1, dev)[0] for _ in range(repeats + 2))
        full = statistics.median(time_generation(engine, ids, mask, n, dev)[0] for _ in range(repeats))
        time_generation(engine, short, smask, 1, dev)  # its cache allocated
        prefill_p, _ = time_generation(engine, short, smask, 1, dev)  # the prefill of a P-token prompt
        ms = 1e3 * (full - one) / max(n - 1, 1)
        row.update(
            ms_per_step=ms,
            tokens_per_s=batch / (ms / 1e3),
            prefill_ms=1e3 * prefill_p,
            gen_s_extrapolated=prefill_p + G * ms / 1e3,
            compiles_warmup=compiled,
            recompiles=getattr(engine, "compiles", 0) - compiled,
        )
        if profile_dir:
            print("profile: " + profile_decode(engine, ids, mask, dev, profile_dir), flush=True)
        if floor_bw:
            floor = (weight_bytes(student) + batch * (P + G) * kv_bytes_per_token(student)) / floor_bw * 1e3
            row.update(floor_ms=floor, x_floor=ms / floor)
    except Exception as err:  # noqa: BLE001 - reported in the row
        row["note"] = ("OOM" if "out of memory" in str(err).lower() else "error") + f": {type(err).__name__}: "
        row["note"] += str(err)[:160]
    finally:
        if hasattr(engine, "sleep"):
            engine.sleep()
        del engine
        free(dev)
    return row


# ---------------------------------------------------------------- 2. the step


def training_batch(batch: int, cfg, dev, seed: int):
    """Prompts and completions of P + G tokens, only the completions counting (as on_policy_batch makes)."""
    P, G = cfg["prompt"], cfg["gen"]
    ids, mask = prompts(batch, P + G, cfg["vocab"], dev, seed)
    labels = ids.clone()
    labels[:, :P] = -100
    return ids, mask, labels


def train_step(student, teacher, opt, batch, sft: bool = False) -> None:
    from nitrobrew.hf import distill_loss

    ids, mask, labels = batch
    if sft:
        out = distill_loss(student, None, ids, mask, labels, kd_weight=0.0, ce_weight=1.0)
    else:
        out = distill_loss(student, teacher, ids, mask, labels, divergence="jsd")
    out.loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def time_train(student, teacher, opt, batch, dev, sft=False, repeats=1) -> float:
    train_step(student, teacher, opt, batch, sft)  # warm-up (and AdamW's state)
    times = []
    for _ in range(repeats):
        sync(dev)
        t0 = time.perf_counter()
        train_step(student, teacher, opt, batch, sft)
        sync(dev)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def error_note(err: BaseException) -> str:
    kind = "OOM" if "out of memory" in str(err).lower() else "error"
    return f"{kind}: {type(err).__name__}: {' '.join(str(err).split())[:200]}"


def measure_steps(student, teacher, opt, cfg, dev, decode_rows, repeats: int) -> List[Dict]:
    """The off-policy and SFT steps at each batch, and the on-policy step extrapolated from the decode rows."""
    rows = []
    for B in cfg["step_batches"]:
        batch = training_batch(B, cfg, dev, seed=B)
        for kind in ("off-policy", "SFT"):
            row = dict(part="step", kind=kind, batch=B, note="")
            try:
                row["step_s"] = time_train(student, teacher, opt, batch, dev, sft=kind == "SFT", repeats=repeats)
            except Exception as err:  # noqa: BLE001 - reported in the row
                row["note"] = error_note(err)
            rows.append(row)
        off = rows[-2].get("step_s")
        # The fastest engine's extrapolated generation at this batch (decode rows of the same batch).
        gens = [r for r in decode_rows if r.get("batch") == B and r.get("gen_s_extrapolated")]
        if gens and off:
            best = min(gens, key=lambda r: r["gen_s_extrapolated"])
            gen = best["gen_s_extrapolated"]
            rows.append(
                dict(
                    part="step",
                    kind="on-policy, extrapolated",
                    backend=best["backend"],
                    batch=B,
                    gen_s=gen,
                    train_s=off,
                    step_s=gen + off,
                    note="",
                )
            )
        del batch
        free(dev)
    return rows


def measure_sync(student, teacher, opt, cfg, dev, batch: int, windows: int, backend: str = "static") -> Dict:
    """The synchronous on-policy step, measured: the engine on the training student generates G tokens for
    the window's prompts, then the step trains on them (the first window compiles: not timed)."""
    from nitrobrew.hf.generation import Sampling
    from nitrobrew.hf.onpolicy import assemble

    row = dict(part="step", kind="on-policy, synchronous", backend=backend, batch=batch, note="")
    engine, why = make_engine(backend, student)
    if engine is None:
        row["note"] = why
        return row
    P, G = cfg["prompt"], cfg["gen"]
    s = Sampling(max_new_tokens=G, temperature=1.0, pad_token_id=0, seed=0)
    parts = []
    try:
        for k in range(windows + 1):
            ids, mask = prompts(batch, P, cfg["vocab"], dev, seed=200 + k)
            sync(dev)
            t0 = time.perf_counter()
            c = engine.generate(ids, mask, s)
            sync(dev)
            t1 = time.perf_counter()
            b = assemble(ids, mask, c, 0)
            train_step(student, teacher, opt, (b.input_ids, b.attention_mask, b.labels))
            sync(dev)
            if k:
                parts.append((time.perf_counter() - t0, t1 - t0, time.perf_counter() - t1))
        row.update(
            step_s=statistics.median(p[0] for p in parts),
            gen_s=statistics.median(p[1] for p in parts),
            train_s=statistics.median(p[2] for p in parts),
            windows=len(parts),
            window_steps=" ".join(f"{p[0]:.3f}" for p in parts),
            recompiles=getattr(engine, "recompiles", 0),
        )
    except Exception as err:  # noqa: BLE001 - reported in the row
        row["note"] = error_note(err)
    finally:
        engine.sleep()
        del engine
        free(dev)
    return row


# ---------------------------------------------------------------- 3. asynchronous rollouts


def measure_async(
    student, teacher, opt, cfg, windows: int, batch: int, gen_device: str, compile_mode: Optional[str] = None
) -> Dict:
    """Training on the student's device while the static engine on a copy of the student on ``gen_device``
    generates the next window in a background thread (on the training device itself: on a stream of its own,
    sharing the GPU with training). See the module docstring, part 3."""
    import copy

    from nitrobrew.hf.generation import Sampling, StaticCacheGenerator
    from nitrobrew.hf.generation.async_rollouts import AsyncRollouts
    from nitrobrew.hf.onpolicy import assemble

    dev0, dev1 = next(student.parameters()).device, torch.device(gen_device)
    same = dev1 == dev0 or (dev0.type == "cuda" and dev1.type == "cuda" and (dev1.index or 0) == dev0.index)
    where = f"static on {gen_device}" + (" (the training device)" if same else "")
    row = dict(part="step", kind="on-policy, async", backend=where, batch=batch, note="")
    if compile_mode:
        row["note"] = f"compile_mode {compile_mode!r} (no CUDA graphs)"
    P, G = cfg["prompt"], cfg["gen"]
    replica = copy.deepcopy(student).to(dev1).requires_grad_(False)  # as the trainer makes it
    engine = StaticCacheGenerator(replica, compile_mode=compile_mode)
    s = Sampling(max_new_tokens=G, temperature=1.0, pad_token_id=0, seed=0)
    devices = [dev0] if same else [dev0, dev1]

    def sync_all():
        for d in devices:
            sync(d)

    try:
        copies = []
        for _ in range(3):  # the weight copy alone (the first allocates nothing: in place)
            sync_all()
            t0 = time.perf_counter()
            engine.sync_weights(student)
            sync_all()
            copies.append(time.perf_counter() - t0)
        for d in devices:
            if d.type == "cuda":
                torch.cuda.reset_peak_memory_stats(d)
        window_prompts = [prompts(batch, P, cfg["vocab"], dev0, seed=100 + k) for k in range(windows + 1)]
        parts, lags = [], []
        with AsyncRollouts(engine, staleness=1) as rollouts:
            ahead = 0
            for k in range(windows + 1):
                while ahead < min(k + 2, windows + 1):  # window k + 1 is queued before window k trains
                    rollouts.submit(*window_prompts[ahead], s)
                    ahead += 1
                sync(dev0)
                t0 = time.perf_counter()
                c = rollouts.result(k, timeout=600)
                t1 = time.perf_counter()
                lags.append(rollouts.version - c.weight_version)
                ids, mask = window_prompts[k]
                b = assemble(ids, mask, c, 0)
                train_step(student, teacher, opt, (b.input_ids, b.attention_mask, b.labels))
                sync(dev0)
                t2 = time.perf_counter()
                rollouts.sync_weights(student)  # waits for window k + 1's generation, then copies the weights
                sync_all()
                t3 = time.perf_counter()
                if k:  # window 0 waits for a whole generation and the thread's compilation: not timed
                    parts.append((t3 - t0, t1 - t0, t2 - t1, t3 - t2, c.seconds))
        mem = {d: torch.cuda.max_memory_allocated(d) / 2**30 for d in devices if d.type == "cuda"}
        row.update(
            step_s=statistics.median(p[0] for p in parts),
            wait_s=statistics.median(p[1] for p in parts),
            train_s=statistics.median(p[2] for p in parts),
            sync_s=statistics.median(p[3] for p in parts),
            gen_s=statistics.median(p[4] for p in parts),
            copy_ms=1e3 * statistics.median(copies),
            staleness=" ".join(str(v) for v in lags),
            windows=len(parts),
            window_steps=" ".join(f"{p[0]:.3f}" for p in parts),
            recompiles=engine.recompiles,
            mem_train_gib=mem.get(dev0),
            mem_gen_gib=mem.get(dev1) if not same else None,
        )
    finally:
        del engine, replica
        free(dev1)
    return row


# ---------------------------------------------------------------- profile


def profile_decode(engine, ids, mask, dev, out_dir: str) -> str:
    """A torch.profiler table of a few decode steps of a warm engine, at the shapes it was timed at (its
    compiled graphs and CUDA graphs are reused: nothing compiles while profiled)."""
    from torch.profiler import ProfilerActivity, profile

    from nitrobrew.hf.generation import Sampling

    steps = 8
    s = Sampling(max_new_tokens=steps + 1, temperature=1.0, pad_token_id=0, seed=0)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    with profile(activities=activities) as prof:
        engine.generate(ids, mask, s)
        sync(dev)
    key = "self_cuda_time_total" if dev.type == "cuda" else "self_cpu_time_total"
    table = prof.key_averages().table(sort_by=key, row_limit=30)
    path = os.path.join(out_dir, "profile_decode.txt")
    with open(path, "w") as f:
        f.write(
            f"{engine.name} engine, batch {ids.shape[0]}, prompts of {ids.shape[1]}, {steps + 1} new tokens (a "
            f"prefill and {steps} decode steps: divide the decode kernels' totals by {steps}), sorted by {key}. "
            "With CUDA graphs the steps' kernels are launched by cudaGraphLaunch.\n\n" + table + "\n"
        )
    return path


# ---------------------------------------------------------------- output


COLUMNS = [
    "part",
    "kind",
    "backend",
    "batch",
    "ms_per_step",
    "floor_ms",
    "x_floor",
    "tokens_per_s",
    "prefill_ms",
    "gen_s_extrapolated",
    "compiles_warmup",
    "recompiles",
    "step_s",
    "gen_s",
    "train_s",
    "wait_s",
    "sync_s",
    "copy_ms",
    "staleness",
    "windows",
    "window_steps",
    "x_off",
    "x_sft",
    "mem_train_gib",
    "mem_gen_gib",
    "note",
]


def fmt(v, p=2):
    return "-" if v in (None, "") else (f"{v:.{p}f}" if isinstance(v, float) else str(v))


def add_ratios(rows: List[Dict]) -> None:
    """Each step row against the off-policy and SFT steps of its batch (measured in the same run)."""
    for r in rows:
        if r["part"] != "step" or not r.get("step_s"):
            continue
        for kind, key in (("off-policy", "x_off"), ("SFT", "x_sft")):
            base = next((b.get("step_s") for b in rows if b.get("kind") == kind and b["batch"] == r["batch"]), None)
            if base:
                r[key] = r["step_s"] / base


def write(rows: List[Dict], env: Dict[str, str], cfg, bw, out: str, seconds: float) -> List[str]:
    os.makedirs(out, exist_ok=True)
    add_ratios(rows)
    paths = [os.path.join(out, "onpolicy_step.csv"), os.path.join(out, "onpolicy_step.md")]
    with open(paths[0], "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(COLUMNS + sorted(env))
        for r in rows:
            w.writerow([r.get(c, "") for c in COLUMNS] + [env[k] for k in sorted(env)])
    s, t = cfg["student"], cfg["teacher"]
    lines = [
        "## On-policy step and decode, per generation engine",
        "",
        f"Student {s[0]} x {s[1]} ({s[2]}/{s[3]} heads, MLP {s[4]}), teacher {t[0]} x {t[1]} ({t[2]}/{t[3]} heads, "
        f"MLP {t[4]}), vocabulary {cfg['vocab']}, random weights, {cfg['dtype']}; prompts of P = {cfg['prompt']}, "
        f"completions of G = {cfg['gen']}. "
        + ", ".join(f"{k} {v}" for k, v in sorted(env.items()))
        + (f". HBM bandwidth taken as {bw / 1e12:.2f} TB/s." if bw else ". No HBM bandwidth known here: no floor."),
    ]
    decode = [r for r in rows if r["part"] == "decode"]
    if decode:
        lines += [
            "",
            f"Decode: {cfg['decode_steps']} steps timed at the end of the context (prompts of P + G - "
            f"{cfg['decode_steps']}), the prefill subtracted; floor = (student weights + KV of P + G tokens per row) "
            "/ HBM bandwidth; a generation of G tokens extrapolated as prefill(P) + G x ms/step; recompiles: graphs "
            "compiled after warm-up.",
            "",
            "| engine | B | ms / step | floor ms | x floor | new tokens/s | prefill(P) ms | generation of G (s) | "
            "graphs at warm-up | recompiles | note |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
        ]
    for r in decode:
        lines.append(
            f"| {r['backend']} | {r['batch']} | {fmt(r.get('ms_per_step'))} | {fmt(r.get('floor_ms'))} | "
            f"{fmt(r.get('x_floor'), 1)} | {fmt(r.get('tokens_per_s'), 0)} | {fmt(r.get('prefill_ms'), 1)} | "
            f"{fmt(r.get('gen_s_extrapolated'))} | {fmt(r.get('compiles_warmup'))} | {fmt(r.get('recompiles'))} | "
            f"{r.get('note', '')} |"
        )
    steps = [r for r in rows if r["part"] == "step"]
    if steps:
        lines += [
            "",
            "Step: off-policy = teacher forward + student forward/backward (gradient checkpointing) + "
            "distill_loss(jsd) + AdamW on B rows of P + G tokens (only the G completion tokens count); SFT = CE only "
            "on the same rows; on-policy, extrapolated = the fastest engine's generation of G tokens (decode table) + "
            "the off-policy step; on-policy, synchronous = measured: the static engine on the training student "
            "generates G tokens, then the step trains on them (median of the windows after the first); on-policy, "
            "async = measured, `AsyncRollouts` (staleness 1): a copy of the student generates window k+1 in a "
            "background thread on its own CUDA stream while window k trains, then the weights are copied into it; "
            "step = the median over the windows after the first of (waiting for the window's completions + the "
            "training step + the weight sync, which waits for the next window's generation). training s: the step "
            "on the generated tokens; weight copy: the copy into the generating copy alone, timed apart; staleness: "
            "optimizer steps between the weights that generated each window and those that trained on it (window 0 "
            "first); peak GiB: max allocated on the training / generating device during the windows.",
            "",
            "| B | step | engine | step s | generation s | training s | weight copy ms | staleness | windows | "
            "x off-policy | x SFT | peak GiB (train / gen) | note |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
    for r in steps:
        mem = "-"
        if r.get("mem_train_gib") is not None:
            mem = f"{r['mem_train_gib']:.1f}" + (
                f" / {r['mem_gen_gib']:.1f}" if r.get("mem_gen_gib") is not None else " (both)"
            )
        lines.append(
            f"| {r['batch']} | {r.get('kind', '-')} | {r.get('backend', '-')} | {fmt(r.get('step_s'), 3)} | "
            f"{fmt(r.get('gen_s'), 3)} | {fmt(r.get('train_s'), 3)} | {fmt(r.get('copy_ms'), 1)} | "
            f"{r.get('staleness') or '-'} | {fmt(r.get('windows'))} | {fmt(r.get('x_off'), 2)} | "
            f"{fmt(r.get('x_sft'), 2)} | {mem} | {r.get('note', '')} |"
        )
    lines += ["", f"Whole run: {seconds:.0f} s."]
    with open(paths[1], "w") as f:
        f.write("\n".join(lines) + "\n")
    return paths


def main(argv=None) -> int:
    args = parse_args(argv)
    from nitrobrew.environment import environment, package_version

    t_start = time.perf_counter()
    os.makedirs(args.out, exist_ok=True)
    cfg = dict(TINY if args.tiny else REAL)
    for key in ("decode_batches", "step_batches", "decode_steps"):
        if getattr(args, key) is not None:
            cfg[key] = getattr(args, key)
    dev = torch.device(args.device or ("cpu" if args.tiny else "cuda"))
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("onpolicy_step: no CUDA device (use --tiny for the CPU mode)")
    dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[cfg["dtype"]]
    env = environment()
    env["transformers"] = package_version("transformers")
    env["vllm"] = package_version("vllm")
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    if dev.type == "cuda" and torch.cuda.device_count() > 1:
        env["devices"] = f"{torch.cuda.device_count()} x {name}"
    bw = hbm_bandwidth(name)
    print("env: " + ", ".join(f"{k}={v}" for k, v in env.items()), flush=True)
    print(f"HBM bandwidth: {bw / 1e12:.2f} TB/s ({name})" if bw else f"HBM bandwidth: unknown ({name})", flush=True)
    if args.tiny:
        torch.set_num_threads(1)  # tiny ops: threads of one op wait on each other on a busy CPU
    student = build(cfg["student"], cfg["vocab"], dtype, dev, seed=0)
    teacher = build(cfg["teacher"], cfg["vocab"], dtype, dev, seed=1).requires_grad_(False).eval()
    if bw:
        print(
            f"floor per decode step: weights {weight_bytes(student) / 2**30:.2f} GiB "
            f"({weight_bytes(student) / bw * 1e3:.2f} ms) + KV {kv_bytes_per_token(student)} B/token x B x "
            f"{cfg['prompt'] + cfg['gen']} tokens",
            flush=True,
        )
    rows: List[Dict] = []
    failed = False

    def report(row):
        nonlocal failed
        failed |= row["note"].startswith("error")
        rows.append(row)
        # written after every row: a run cut short by a time limit keeps what it measured
        write(rows, env, cfg=cfg, bw=bw, out=args.out, seconds=time.perf_counter() - t_start)

    for B in cfg["decode_batches"]:
        for name_ in args.backends:
            profiled = args.profile and name_ == "static" and B == (64 if 64 in cfg["decode_batches"] else B)
            row = measure_decode(
                name_, student, B, cfg=cfg, dev=dev, floor_bw=bw, profile_dir=args.out if profiled else None
            )
            report(row)
            print(
                f"decode {name_:7s} B={B:4d}: {fmt(row.get('ms_per_step'))} ms/step "
                f"(floor {fmt(row.get('floor_ms'))}, x{fmt(row.get('x_floor'), 1)}), "
                f"{fmt(row.get('tokens_per_s'), 0)} tok/s, recompiles {fmt(row.get('recompiles'))} {row['note']}",
                flush=True,
            )
    enable = getattr(student, "activation_checkpointing_enable", None) or student.gradient_checkpointing_enable
    enable()
    student.config.use_cache = False
    student.train()
    opt = torch.optim.AdamW(student.parameters(), lr=1e-6)
    repeats = args.step_repeats or (2 if dev.type == "cuda" else 1)
    decode_rows = [r for r in rows if r["part"] == "decode"]
    for row in measure_steps(student, teacher, opt, cfg=cfg, dev=dev, decode_rows=decode_rows, repeats=repeats):
        report(row)
        print(f"step B={row['batch']} {row['kind']}: {fmt(row.get('step_s'), 3)} s {row['note']}", flush=True)
    engines = [b for b in args.backends if not b.startswith("vllm")]
    sync_engine = "static" if "static" in engines else (engines[0] if engines else None)
    if args.sync_windows > 0 and sync_engine:
        for B in cfg["step_batches"]:
            row = measure_sync(
                student, teacher, opt, cfg=cfg, dev=dev, batch=B, windows=args.sync_windows, backend=sync_engine
            )
            report(row)
            print(
                f"on-policy, synchronous B={B}: {fmt(row.get('step_s'), 3)} s (generation "
                f"{fmt(row.get('gen_s'), 3)} s) {row['note']}",
                flush=True,
            )
    gen_devices = [] if args.no_async else ["cpu"] if dev.type == "cpu" else []  # on a CPU: the code path
    if dev.type == "cuda" and not args.no_async:
        gen_devices = (["cuda:1"] if torch.cuda.device_count() >= 2 else []) + (
            [str(dev)] if args.async_same_gpu else []
        )
        if torch.cuda.device_count() < 2:
            report(dict(part="step", kind="on-policy, async", batch="-", note="not measured on a second GPU: one GPU"))
    batches = args.async_batches
    if batches is None:
        batches = [64 if 64 in cfg["step_batches"] else (cfg["step_batches"] or [64])[-1]]
    for B in batches:
        for gen_device in gen_devices:
            try:
                row = measure_async(
                    student, teacher, opt, cfg=cfg, windows=args.async_windows, batch=B, gen_device=gen_device
                )
            except Exception as err:  # noqa: BLE001 - reported in the row, then once more without CUDA graphs
                print(f"async B={B} ({gen_device}) failed: {error_note(err)}", flush=True)
                report(dict(part="step", kind="on-policy, async", backend=gen_device, batch=B, note=error_note(err)))
                if not gen_device.startswith("cuda"):
                    continue
                try:
                    row = measure_async(
                        student,
                        teacher,
                        opt,
                        cfg=cfg,
                        windows=args.async_windows,
                        batch=B,
                        gen_device=gen_device,
                        compile_mode="default",
                    )
                except Exception as err2:  # noqa: BLE001
                    row = dict(part="step", kind="on-policy, async", backend=gen_device, batch=B)
                    row["note"] = "without CUDA graphs: " + error_note(err2)
            report(row)
            print(
                f"on-policy, async B={B} ({gen_device}): {fmt(row.get('step_s'), 3)} s, generation "
                f"{fmt(row.get('gen_s'), 3)} s, copy {fmt(row.get('copy_ms'), 1)} ms, staleness "
                f"{row.get('staleness', '-')} {row['note']}",
                flush=True,
            )
    for path in write(rows, env, cfg=cfg, bw=bw, out=args.out, seconds=time.perf_counter() - t_start):
        print("wrote " + path)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
