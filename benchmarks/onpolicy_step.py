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
2. The step, at B = 8 and 64 (prompts x completions of P + G tokens): on-policy (generation, extrapolated
   as above, with the fastest engine + the training step on the generated tokens) against the off-policy
   (teacher-forced) step on the same number of tokens (teacher forward, student forward + backward with
   gradient checkpointing, ``distill_loss(divergence="jsd")``, AdamW) and against an SFT step (CE only).
3. With two GPUs visible: asynchronous rollouts (the static engine on a copy of the student on cuda:1,
   staleness 1, training on cuda:0), the measured steady-state step time over ``--async-windows`` windows;
   ``--async-same-gpu`` also times the copy on the training GPU (its own stream, sharing the GPU).

vLLM cannot be installed on the lent GPUs (no package index there; its wheels pin another torch): its rows
say so; where it is installed, ``--backends hf static vllm`` measures it the same way.

  python benchmarks/onpolicy_step.py                     # CUDA, the shapes above (under 8 minutes, one H100)
  python benchmarks/onpolicy_step.py --profile           # also a torch.profiler table of decode steps
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
REAL = dict(
    vocab=152064,
    student=(28, 1536, 12, 2, 8960),
    teacher=(28, 3584, 28, 4, 18944),
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
    p.add_argument("--decode-batches", type=int, nargs="+", default=None)
    p.add_argument("--step-batches", type=int, nargs="+", default=None)
    p.add_argument("--decode-steps", type=int, default=None, help="decode steps timed per measurement")
    p.add_argument("--async-windows", type=int, default=3, help="windows timed with asynchronous rollouts")
    p.add_argument("--no-async", action="store_true", help="skip the two-GPU asynchronous variant")
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
    import transformers

    layers, width, heads, kv, mlp = shape
    cfg = transformers.Qwen2Config(
        vocab_size=vocab,
        hidden_size=width,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        intermediate_size=mlp,
        max_position_embeddings=8192,
        tie_word_embeddings=False,
    )
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(dev):
            model = transformers.Qwen2ForCausalLM(cfg)
    finally:
        torch.set_default_dtype(old)
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


def measure_steps(student, teacher, opt, cfg, dev, decode_rows) -> List[Dict]:
    rows = []
    for B in cfg["step_batches"]:
        row = dict(part="step", batch=B, note="")
        try:
            batch = training_batch(B, cfg, dev, seed=B)
            off = time_train(student, teacher, opt, batch, dev)
            sft = time_train(student, teacher, opt, batch, dev, sft=True)
            row.update(off_policy_s=off, sft_s=sft)
            # The fastest engine's extrapolated generation at this batch (decode rows of the same batch).
            gens = [r for r in decode_rows if r.get("batch") == B and r.get("gen_s_extrapolated")]
            if gens:
                best = min(gens, key=lambda r: r["gen_s_extrapolated"])
                on = best["gen_s_extrapolated"] + off
                row.update(
                    backend=best["backend"],
                    gen_s=best["gen_s_extrapolated"],
                    on_policy_s=on,
                    on_over_off=on / off,
                    on_over_sft=on / sft,
                    gen_fraction=best["gen_s_extrapolated"] / on,
                )
        except Exception as err:  # noqa: BLE001
            row["note"] = f"error: {type(err).__name__}: {str(err)[:160]}"
        free(dev)
        rows.append(row)
    return rows


# ---------------------------------------------------------------- 3. asynchronous rollouts


def measure_async(student, teacher, opt, cfg, windows: int, batch: int, gen_device: str = "cuda:1") -> Dict:
    """Training on cuda:0 while the static engine on a copy of the student on ``gen_device`` generates the next
    window (on cuda:0 itself: on a stream of its own, sharing the GPU with training)."""
    import copy

    from nitrobrew.hf.generation import Sampling, StaticCacheGenerator
    from nitrobrew.hf.generation.async_rollouts import AsyncRollouts
    from nitrobrew.hf.onpolicy import assemble

    row = dict(part="async", backend=f"static on {gen_device}", batch=batch, note="")
    dev0, dev1 = next(student.parameters()).device, torch.device(gen_device)
    P, G = cfg["prompt"], cfg["gen"]
    replica = copy.deepcopy(student).to(dev1).requires_grad_(False)
    engine = StaticCacheGenerator(replica)
    s = Sampling(max_new_tokens=G, temperature=1.0, pad_token_id=0, seed=0)
    windows_prompts = [prompts(batch, P, cfg["vocab"], dev1, seed=100 + k) for k in range(windows + 2)]
    # Warm-up on the copy at the timed shapes (compilation, CUDA graphs) before timing.
    engine.generate(*windows_prompts[0], s)
    times = []
    with AsyncRollouts(engine, staleness=1) as rollouts:
        ahead = 0
        for k in range(windows + 1):
            while ahead < min(k + 2, windows + 1):
                rollouts.submit(*windows_prompts[ahead], s)
                ahead += 1
            sync(dev0)
            t0 = time.perf_counter()
            c = rollouts.result(k)
            ids, mask = windows_prompts[k]
            b = assemble(ids.to(dev0), mask.to(dev0), c, 0)
            train_step(student, teacher, opt, (b.input_ids, b.attention_mask, b.labels))
            rollouts.sync_weights(student)
            sync(dev0)
            if k:  # window 0 waits for a whole generation: not the steady state
                times.append(time.perf_counter() - t0)
    row.update(on_policy_s=statistics.median(times), windows=len(times))
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
    "gen_s",
    "off_policy_s",
    "sft_s",
    "on_policy_s",
    "on_over_off",
    "on_over_sft",
    "gen_fraction",
    "windows",
    "note",
]


def fmt(v, p=2):
    return "-" if v in (None, "") else (f"{v:.{p}f}" if isinstance(v, float) else str(v))


def write(rows: List[Dict], env: Dict[str, str], cfg, bw, out: str, seconds: float) -> List[str]:
    os.makedirs(out, exist_ok=True)
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
        "",
        f"Decode: {cfg['decode_steps']} steps timed at the end of the context (prompts of P + G - "
        f"{cfg['decode_steps']}), the prefill subtracted; floor = (student weights + KV of P + G tokens per row) / "
        "HBM bandwidth; a generation of G tokens extrapolated as prefill(P) + G x ms/step; recompiles: graphs "
        "compiled after warm-up.",
        "",
        "| engine | B | ms / step | floor ms | x floor | new tokens/s | prefill(P) ms | generation of G (s) | "
        "graphs at warm-up | recompiles | note |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in (r for r in rows if r["part"] == "decode"):
        lines.append(
            f"| {r['backend']} | {r['batch']} | {fmt(r.get('ms_per_step'))} | {fmt(r.get('floor_ms'))} | "
            f"{fmt(r.get('x_floor'), 1)} | {fmt(r.get('tokens_per_s'), 0)} | {fmt(r.get('prefill_ms'), 1)} | "
            f"{fmt(r.get('gen_s_extrapolated'))} | {fmt(r.get('compiles_warmup'))} | {fmt(r.get('recompiles'))} | "
            f"{r.get('note', '')} |"
        )
    lines += [
        "",
        "Step: off-policy = teacher forward + student forward/backward (gradient checkpointing) + "
        "distill_loss(jsd) + AdamW on B rows of P + G tokens; SFT = CE only on the same rows; on-policy = the "
        "fastest engine's generation of G tokens (extrapolated) + the off-policy step; async = measured, "
        "generation on cuda:1 overlapped with training on cuda:0 (staleness 1).",
        "",
        "| B | engine | generation s | off-policy step s | SFT step s | on-policy step s | on / off | on / SFT | "
        "generating | note |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in (r for r in rows if r["part"] in ("step", "async")):
        lines.append(
            f"| {r['batch']} | {r.get('backend', '-')} | {fmt(r.get('gen_s'))} | {fmt(r.get('off_policy_s'))} | "
            f"{fmt(r.get('sft_s'))} | {fmt(r.get('on_policy_s'))} | {fmt(r.get('on_over_off'), 1)} | "
            f"{fmt(r.get('on_over_sft'), 1)} | {fmt(r.get('gen_fraction'))} | {r.get('note', '')} |"
        )
    lines += ["", f"Whole run: {seconds:.0f} s."]
    with open(paths[1], "w") as f:
        f.write("\n".join(lines) + "\n")
    return paths


def main(argv=None) -> int:
    args = parse_args(argv)
    sys.path.insert(0, ROOT)
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
    bw = hbm_bandwidth(name)
    print("env: " + ", ".join(f"{k}={v}" for k, v in env.items()), flush=True)
    print(f"HBM bandwidth: {bw / 1e12:.2f} TB/s ({name})" if bw else f"HBM bandwidth: unknown ({name})", flush=True)
    if args.tiny:
        torch.set_num_threads(min(2, torch.get_num_threads()))
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
    for B in cfg["decode_batches"]:
        for name_ in args.backends:
            profiled = args.profile and name_ == "static" and B == (64 if 64 in cfg["decode_batches"] else B)
            row = measure_decode(
                name_, student, B, cfg=cfg, dev=dev, floor_bw=bw, profile_dir=args.out if profiled else None
            )
            failed |= row["note"].startswith("error")
            rows.append(row)
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
    for row in measure_steps(student, teacher, opt, cfg=cfg, dev=dev, decode_rows=rows):
        failed |= row["note"].startswith("error")
        rows.append(row)
        print(
            f"step B={row['batch']}: on-policy {fmt(row.get('on_policy_s'))} s, off-policy "
            f"{fmt(row.get('off_policy_s'))} s, SFT {fmt(row.get('sft_s'))} s, on/off "
            f"{fmt(row.get('on_over_off'), 1)} {row['note']}",
            flush=True,
        )
    gen_devices = ["cpu"] if dev.type == "cpu" and not args.no_async else []  # the code path, on a CPU
    if dev.type == "cuda" and not args.no_async:
        gen_devices = (["cuda:1"] if torch.cuda.device_count() >= 2 else []) + (
            ["cuda:0"] if args.async_same_gpu else []
        )
        if torch.cuda.device_count() < 2:
            rows.append(dict(part="async", batch="-", note="not measured on a second GPU: one GPU visible"))
    for gen_device in gen_devices:
        B = 64 if 64 in cfg["step_batches"] else cfg["step_batches"][-1]
        try:
            row = measure_async(
                student, teacher, opt, cfg=cfg, windows=args.async_windows, batch=B, gen_device=gen_device
            )
            off = next((r.get("off_policy_s") for r in rows if r["part"] == "step" and r["batch"] == B), None)
            if off:
                row["on_over_off"] = row["on_policy_s"] / off
        except Exception as err:  # noqa: BLE001
            row = dict(part="async", batch=B, note=f"error: {type(err).__name__}: {str(err)[:160]}")
            failed = True
        rows.append(row)
        print(f"async B={B} ({gen_device}): step {fmt(row.get('on_policy_s'))} s {row['note']}", flush=True)
    for path in write(rows, env, cfg=cfg, bw=bw, out=args.out, seconds=time.perf_counter() - t_start):
        print("wrote " + path)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
