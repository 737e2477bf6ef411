"""The teacher stores measured: bytes per position, extraction throughput, and the training step.

1. Bytes per position (computed from the formats, checked against a small store written here) of a
   hidden store (float32, bfloat16, fp8) and of a top-k store (K = 64, every id and log-prob code)
   at Dt = 3584 and 5120, next to full logits (V = 152064, float32 and bfloat16).
2. Extraction throughput: ``extract_hidden`` (teacher forward, rows to the host, shards serialized,
   hashed and written atomically) against the teacher's prefill alone (the same forwards, nothing
   kept), tokens/s, on a 7B-shaped teacher (Qwen2 layout, 28 x 3584; --teacher-layers to cut it).
3. The training step at real shapes (Qwen2-1.5B-shaped student, 28 x 1536, bf16, gradient
   checkpointing, batch 1; a 7B-shaped teacher head 152064 x 3584) at L = 4096 and 16384, forward +
   backward: an SFT step with nitrobrew's fused CE (``distill_loss(kd_weight=0, ce_weight=1)``: the
   cut-cross-entropy-style CE, no logits), a step from a hidden store (bf16 and fp8 rows, forward KL
   + nothing else, the head resident on the device), and the offline top-k step (K = 64). Time
   (median of --steps after --warmup) and peak memory, each as a ratio to the SFT step.
4. The loader: steps fed by ``hidden_loader`` from a store on disk (workers, prefetch, pinned
   memory), the GPU's idle fraction = 1 - (sum of the steps' CUDA time) / wall time.
5. fp8's error against the live teacher (loss and student-gradient relative error) in the `lm`,
   `peaked` and `close` regimes of nitrobrew/bench/regimes.py at the real widths.

Random weights from configs, no downloads. Writes teacher_store.md and teacher_store.csv into --out.

  python benchmarks/teacher_store.py --out benchmarks/results/teacher_store     # CUDA, < 6 minutes on an H100
  python benchmarks/teacher_store.py --tiny --out /tmp/ts                        # CPU, seconds
"""

from __future__ import annotations

import argparse
import csv
import gc
import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from nitrobrew.bench.models import QWEN2_VOCAB, STUDENT_1P5B, TEACHER_7B, qwen2_model  # noqa: E402

REAL = dict(
    vocab=QWEN2_VOCAB,
    teacher=TEACHER_7B,
    student=STUDENT_1P5B,
    lens=[4096, 16384],
    extract_tokens=131072,
    extract_len=2048,
    steps=5,
    warmup=2,
    loader_len=4096,
    loader_steps=12,
    regime_rows=4096,
    k=64,
)
TINY = dict(
    vocab=320,
    teacher=(2, 64, 4, 2, 96),
    student=(2, 32, 2, 1, 64),
    lens=[48, 96],
    extract_tokens=512,
    extract_len=64,
    steps=2,
    warmup=1,
    loader_len=48,
    loader_steps=4,
    regime_rows=64,
    k=8,
)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tiny", action="store_true", help="tiny shapes on the CPU (CI)")
    p.add_argument("--out", default="benchmarks/results/teacher_store")
    p.add_argument("--teacher-layers", type=int, default=None, help="cut the extraction teacher's depth")
    p.add_argument("--student-layers", type=int, default=None)
    p.add_argument("--lens", type=int, nargs="+", default=None)
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--device", default=None)
    return p.parse_args(argv)


def build(shape, vocab, dtype, dev, seed):
    return qwen2_model(shape, vocab, dtype, dev, seed, max_positions=1 << 16, use_cache=False)


def sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def free(dev):
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()


# ----------------------------------------------------------------------------- 1. bytes


def bytes_rows(vocab, k):
    from nitrobrew.teacher.hidden_store import bytes_per_position

    rows = []
    for dt in (3584, 5120):
        full32, full16 = 4 * vocab, 2 * vocab
        for dtype in ("float32", "bfloat16", "fp8"):
            b = bytes_per_position(dt, dtype)
            rows.append(("hidden", f"Dt={dt}", dtype, b, full32 / b, full16 / b))
        for ids, ib in (("int32", 4), ("uint24", 3)):
            for lp, lb, extra in (("float32", 4, 0), ("bfloat16", 2, 0), ("uint8", 1, 8)):
                b = k * (ib + lb) + extra
                rows.append(("top-k", f"K={k}", f"ids {ids}, log-probs {lp}", b, full32 / b, full16 / b))
        rows.append(("full logits", f"V={vocab}", "float32", full32, 1.0, 0.5))
        rows.append(("full logits", f"V={vocab}", "bfloat16", full16, 2.0, 1.0))
    return rows


def measured_bytes(tmp, dev):
    """Bytes per position of small real stores (the formula's check): shard bytes / rows."""
    from nitrobrew.teacher.extract import Teacher, extract_hidden, extract_topk

    g = torch.Generator().manual_seed(0)
    D, V = 256, 1000
    w = torch.randn(V, D, generator=g)
    emb = torch.randn(V, D, generator=g)
    teacher = Teacher(lambda ids, mask: emb[ids], w, None, "probe", V)
    seqs = [torch.randint(0, V, (512,), generator=g).tolist() for _ in range(8)]
    out = {}
    for dtype in ("bfloat16", "fp8"):
        man = extract_hidden(teacher, seqs, os.path.join(tmp, f"h-{dtype}"), hidden_dtype=dtype)
        out[f"hidden {dtype}, Dt={D}"] = sum(s["bytes"] for s in man["shards"]) / man["num_rows"]
    man = extract_topk(teacher, seqs, os.path.join(tmp, "t"), k=64, logprob_dtype="uint8", id_dtype="uint16", chunk=256)
    out["top-k K=64 uint16 ids, uint8 log-probs"] = sum(s["bytes"] for s in man["shards"]) / man["num_rows"]
    return out


# ----------------------------------------------------------------------------- 2. extraction


def extraction(cfg, args, dev, tmp):
    from nitrobrew.teacher.extract import _batches, extract_hidden, teacher_from_hf

    shape = list(cfg["teacher"])
    if args.teacher_layers:
        shape[0] = args.teacher_layers
    dtype = torch.float32 if dev.type == "cpu" else torch.bfloat16
    model = build(shape, cfg["vocab"], dtype, dev, seed=1).eval()
    teacher = teacher_from_hf(model, "teacher-7b-shaped")
    g = torch.Generator().manual_seed(0)
    n = cfg["extract_tokens"] // cfg["extract_len"]
    seqs = [torch.randint(0, cfg["vocab"], (cfg["extract_len"],), generator=g).tolist() for _ in range(n)]
    batch_tokens = 16384 if dev.type == "cuda" else 256
    per_shard = max(1, n // 4)

    @torch.no_grad()
    def prefill():
        for b0, b1 in _batches([len(s) for s in seqs], batch_tokens):
            ids = torch.tensor(seqs[b0:b1], device=dev)
            teacher.hidden_fn(ids, torch.ones_like(ids))
        sync(dev)

    prefill()  # warm-up (kernels, allocator)
    t0 = time.perf_counter()
    prefill()
    t_prefill = time.perf_counter() - t0
    from nitrobrew.teacher.hidden_store import HiddenWriter

    # the head is written once per store (a 7B head: 1 GB): timed apart, it does not grow with the corpus
    t0 = time.perf_counter()
    HiddenWriter(
        os.path.join(tmp, "head-only"),
        model="t",
        weight=teacher.weight,
        bias=teacher.bias,
        vocab_size=cfg["vocab"],
        num_sequences=0,
    ).close()
    t_head = time.perf_counter() - t0
    rows = []
    for dtype_name in ("bfloat16", "fp8"):
        path = os.path.join(tmp, f"extract-{dtype_name}")
        t0 = time.perf_counter()
        extract_hidden(
            teacher, seqs, path, hidden_dtype=dtype_name, sequences_per_shard=per_shard, batch_tokens=batch_tokens
        )
        sync(dev)
        t_store = time.perf_counter() - t0
        tokens = n * cfg["extract_len"]
        rate = tokens / max(t_store - t_head, 1e-9)
        rows.append((dtype_name, tokens, tokens / t_prefill, tokens / t_store, rate, rate * t_prefill / tokens, t_head))
    del model, teacher
    free(dev)
    return rows, shape


# ----------------------------------------------------------------------------- 3. the step


def random_head(cfg, dev, dtype, seed=3):
    from nitrobrew.hf.model import LMHead

    g = torch.Generator(device=dev).manual_seed(seed)
    w = torch.randn(cfg["vocab"], cfg["teacher"][1], device=dev, dtype=dtype, generator=g) * 0.02
    return LMHead(w, None, 1.0, None)


def steps(cfg, args, dev):
    """Each variant allocates its own inputs (the stored rows, the head, the top-k) just before it runs
    and frees them after: its peak memory holds what it needs and nothing of the others."""
    from nitrobrew.hf import distill_loss
    from nitrobrew.teacher.hidden_store import quantize_fp8

    shape = list(cfg["student"])
    if args.student_layers:
        shape[0] = args.student_layers
    dtype = torch.float32 if dev.type == "cpu" else torch.bfloat16
    student = build(shape, cfg["vocab"], dtype, dev, seed=2)
    student.gradient_checkpointing_enable()
    student.config.use_cache = False
    student.train()
    Dt, V, k = cfg["teacher"][1], cfg["vocab"], cfg["k"]
    results = []
    for L in args.lens or cfg["lens"]:
        g = torch.Generator(device=dev).manual_seed(L)
        ids = torch.randint(0, V, (1, L), device=dev, generator=g)

        def sft():
            return lambda: distill_loss(student, None, ids, kd_weight=0.0, ce_weight=1.0)

        def hidden_bf16():
            head, xt = random_head(cfg, dev, dtype), torch.randn(1, L, Dt, device=dev, dtype=dtype, generator=g)
            return lambda: distill_loss(student, None, ids, teacher_hidden=xt, teacher_head=head)

        def hidden_fp8():
            head = random_head(cfg, dev, dtype)
            codes, scale = quantize_fp8(torch.randn(L, Dt, device=dev, dtype=dtype, generator=g))
            return lambda: distill_loss(
                student, None, ids, teacher_hidden=codes[None], teacher_hidden_scale=scale[None], teacher_head=head
            )

        def topk():
            start = torch.randint(0, V, (1, L, 1), device=dev, generator=g)
            topk_ids = (start + torch.arange(k, device=dev) * (V // k)) % V  # distinct ids per row
            topk_lp = torch.log_softmax(torch.randn(1, L, k, device=dev, generator=g) * 3, -1) - 0.5
            return lambda: distill_loss(student, None, ids, divergence="topk", topk_ids=topk_ids, topk_logprobs=topk_lp)

        variants = {
            "sft (fused CE)": sft,
            "hidden store bf16": hidden_bf16,
            "hidden store fp8": hidden_fp8,
            f"top-k store (K={k})": topk,
        }
        base_t = base_m = None
        for name, make in variants.items():
            times = []
            free(dev)
            if dev.type == "cuda":
                torch.cuda.reset_peak_memory_stats(dev)
            fn = make()
            for i in range(cfg["warmup"] + (args.steps or cfg["steps"])):
                student.zero_grad(set_to_none=True)
                sync(dev)
                t0 = time.perf_counter()
                fn().loss.backward()
                sync(dev)
                if i >= cfg["warmup"]:
                    times.append(time.perf_counter() - t0)
            del fn
            t = statistics.median(times)
            mem = torch.cuda.max_memory_allocated(dev) / 2**20 if dev.type == "cuda" else float("nan")
            if base_t is None:
                base_t, base_m = t, mem
            results.append((L, name, t * 1e3, t / base_t, mem, mem / base_m if base_m == base_m else float("nan")))
    student.zero_grad(set_to_none=True)
    return results, student, shape


# ----------------------------------------------------------------------------- 4. the loader


def loader_idle(cfg, dev, tmp, student, head):
    from nitrobrew.hf import distill_loss
    from nitrobrew.teacher.extract import Teacher, extract_hidden
    from nitrobrew.teacher.hidden_data import HiddenDataset, hidden_loader

    Dt, V, L = head.weight.shape[1], head.weight.shape[0], cfg["loader_len"]
    n = cfg["loader_steps"] + 2
    g = torch.Generator().manual_seed(4)
    seqs = [torch.randint(0, V, (L,), generator=g).tolist() for _ in range(n)]
    # a store of the real width written without a teacher model (rows: random, the bytes are what count)
    table = torch.randn(1024, Dt, generator=g)
    fake = Teacher(lambda ids, mask: table[ids.cpu() % 1024], head.weight.cpu(), None, "random-rows", V)
    path = os.path.join(tmp, "loader-store")
    extract_hidden(fake, seqs, path, hidden_dtype="bfloat16", sequences_per_shard=4, batch_tokens=4 * L)
    ds = HiddenDataset(path)
    loader = hidden_loader(ds, 1, num_workers=2, prefetch_factor=4, pin_memory=dev.type == "cuda", seed=0)
    busy = 0.0
    it = iter(loader)
    batch = next(it)  # the workers' start-up is not the steady state
    t_wall = time.perf_counter()
    count = 0
    for batch in it:
        batch = {k: v.to(dev, non_blocking=True) for k, v in batch.items()}
        student.zero_grad(set_to_none=True)
        if dev.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        else:
            t0 = time.perf_counter()
        out = distill_loss(
            student,
            None,
            batch["input_ids"],
            batch["attention_mask"],
            targets=batch["labels"],
            teacher_hidden=batch["teacher_hidden"].to(head.weight.dtype),
            teacher_head=head,
        )
        out.loss.backward()
        if dev.type == "cuda":
            end.record()
            end.synchronize()
            busy += start.elapsed_time(end) / 1e3
        else:
            busy += time.perf_counter() - t0
        count += 1
    sync(dev)
    wall = time.perf_counter() - t_wall
    del loader, it
    return dict(steps=count, wall=wall, busy=busy, idle=max(0.0, 1 - busy / wall), tokens=L)


# ----------------------------------------------------------------------------- 5. fp8 error


def fp8_errors(cfg, dev):
    from nitrobrew.bench.regimes import make_hidden
    from nitrobrew.hidden.api import hidden_loss
    from nitrobrew.teacher.hidden_store import dequantize_fp8, quantize_fp8

    rows = []
    V = cfg["vocab"] if dev.type == "cuda" else cfg["vocab"]
    for regime in ("lm", "peaked", "close"):
        d = make_hidden(regime, cfg["regime_rows"], V, cfg["student"][1], cfg["teacher"][1], torch.float32, dev, seed=0)
        xt8 = dequantize_fp8(*quantize_fp8(d.xt))
        res = {}
        for name, xt in (("live", d.xt), ("fp8", xt8)):
            xs = d.xs.detach().clone().requires_grad_(True)
            loss = hidden_loss(xs, xt, d.ws.detach(), d.wt, divergence="forward_kl")
            loss.backward()
            res[name] = (float(loss.detach()), xs.grad)
        err = abs(res["fp8"][0] - res["live"][0])
        grad = float((res["fp8"][1] - res["live"][1]).norm() / res["live"][1].norm())
        rows.append((regime, d.entropy, res["live"][0], res["fp8"][0], err, err / abs(res["live"][0]), grad))
        del d
        free(dev)
    return rows


# ----------------------------------------------------------------------------- report


def main(argv=None):
    args = parse_args(argv)
    cfg = TINY if args.tiny else REAL
    dev = torch.device(args.device or ("cpu" if args.tiny else "cuda"))
    if dev.type == "cuda" and not torch.cuda.is_available():
        print("teacher_store.py: error: CUDA is not available (use --tiny on the CPU)", file=sys.stderr)
        return 2
    from nitrobrew.environment import environment, package_version

    os.makedirs(args.out, exist_ok=True)
    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="teacher-store-bench-") as tmp:
        size_rows = bytes_rows(REAL["vocab"], REAL["k"])
        measured = measured_bytes(tmp, dev)
        print("bytes per position: done", flush=True)
        extract_rows, t_shape = extraction(cfg, args, dev, tmp)
        print(f"extraction: {extract_rows}", flush=True)
        step_rows, student, s_shape = steps(cfg, args, dev)
        head = random_head(cfg, dev, next(student.parameters()).dtype)
        print(f"steps: {step_rows}", flush=True)
        idle = loader_idle(cfg, dev, tmp, student, head)
        print(f"loader: {idle}", flush=True)
        del student, head
        free(dev)
        fp8_rows = fp8_errors(cfg, dev)
        print(f"fp8: {fp8_rows}", flush=True)
    total = time.perf_counter() - t_start
    env = environment()
    env["transformers"] = package_version("transformers")
    lines = [
        "# Teacher stores: bytes, extraction, training step",
        "",
        f"Command: `python benchmarks/teacher_store.py{' --tiny' if args.tiny else ''} --out {args.out}`"
        f" ({total:.0f} s). " + ", ".join(f"{k} {v}" for k, v in env.items()),
        "",
        "## Bytes per position",
        "",
        f"Computed from the formats (full logits at V = {REAL['vocab']}); the top-k rows at K = {REAL['k']}.",
        "",
        "| store | size | rows as | bytes / position | x smaller than fp32 logits | than bf16 logits |",
        "|---|---|---|---|---|---|",
    ]
    lines += [f"| {a} | {b} | {c} | {d} | {e:.1f} | {f:.1f} |" for a, b, c, d, e, f in size_rows]
    lines += ["", "Measured on small stores written here (shard bytes / rows, offsets and tokens included):", ""]
    lines += [f"- {k}: {v:.1f} bytes/position" for k, v in measured.items()]
    lines += [
        "",
        "## Extraction throughput",
        "",
        f"Teacher: Qwen2 layout {t_shape[0]} x {t_shape[1]} (random weights, "
        f"{'bf16' if dev.type == 'cuda' else 'fp32'}), {cfg['extract_tokens']} tokens in sequences of "
        f"{cfg['extract_len']}. Target: the store at >= 0.9x the prefill's tokens/s.",
        "",
        "| rows | tokens | prefill tokens/s | extract_hidden tokens/s (all) | without the head's one write "
        "| ratio to prefill | head write (s, once per store) |",
        "|---|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {a} | {b} | {c:.0f} | {d:.0f} | {e:.0f} | **{f:.3f}** | {g:.2f} |" for a, b, c, d, e, f, g in extract_rows
    ]
    lines += [
        "",
        "## Training step (forward + backward)",
        "",
        f"Student: Qwen2 layout {s_shape[0]} x {s_shape[1]} ({'bf16' if dev.type == 'cuda' else 'fp32'}, "
        f"gradient checkpointing), vocabulary {cfg['vocab']}; teacher head {cfg['vocab']} x {cfg['teacher'][1]}. "
        "SFT: nitrobrew's fused CE (ce only, no logits). Hidden store: forward KL from the stored rows and head "
        "(the rows resident on the device, as after the loader's copy). Targets: time <= 1.10x SFT, "
        "memory within 5%.",
        "",
        "| L | step | ms | x SFT | peak MiB | x SFT memory |",
        "|---|---|---|---|---|---|",
    ]
    lines += [f"| {a} | {b} | {c:.1f} | {d:.3f} | {e:.0f} | {f:.3f} |" for a, b, c, d, e, f in step_rows]
    lines += [
        "",
        "## Loader: GPU idle fraction",
        "",
        f"`hidden_loader` (2 workers, prefetch 4, pinned) over a bf16 store on disk, L = {idle['tokens']}, "
        f"batch 1, {idle['steps']} steps of the hidden-store step above: wall {idle['wall']:.2f} s, "
        f"steps' device time {idle['busy']:.2f} s, **idle fraction {idle['idle']:.3f}**.",
        "",
        "## fp8 rows against the live teacher",
        "",
        f"Regimes of nitrobrew/bench/regimes.py, {cfg['regime_rows']} rows, V = {cfg['vocab']}, "
        f"Ds = {cfg['student'][1]}, Dt = {cfg['teacher'][1]}, forward KL, float32 compute.",
        "",
        "| regime | teacher entropy | live loss | fp8 loss | abs. error | rel. error | grad rel. error |",
        "|---|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {a} | {b:.2f} | {c:.5f} | {d:.5f} | {e:.2e} | {f:.2e} | {g:.3f} |" for a, b, c, d, e, f, g in fp8_rows
    ]
    with open(os.path.join(args.out, "teacher_store.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    with open(os.path.join(args.out, "teacher_store.csv"), "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["section", "a", "b", "c", "d", "e", "f", "g"])
        for r in size_rows:
            w.writerow(["bytes", *r])
        for r in extract_rows:
            w.writerow(["extract", *r])
        for r in step_rows:
            w.writerow(["step", *r])
        w.writerow(["loader", idle["steps"], idle["wall"], idle["busy"], idle["idle"]])
        for r in fp8_rows:
            w.writerow(["fp8", *r])
    print(f"wrote {args.out}/teacher_store.md in {total:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
