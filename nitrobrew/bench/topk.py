"""`nitrobrew bench topk`: topk_kl against cut-cross-entropy and the GEMM floor; extraction speed.

For each N in --seq-lens (V = --vocab, D = --d-model) and K in --ks, one process, the same
inputs for every method (docs/design.md §8), fwd+bwd with gradients to xs and ws:

  gemm floor        the three bare GEMMs one exact vocab-wide loss needs (logits, dX = G ws,
                    dW = G^T xs), materialized, cuBLAS; independent of K
  cce               cut-cross-entropy linear_cross_entropy(xs, ws, random labels), its defaults
                    (its backward skips gradient blocks below filter_eps: its time depends on the
                    data); the same vocab-wide work as normalize="full"; independent of K
  cce-exact         the same with filter_eps=None (no skipped blocks: exact gradients)
  full              topk_kl(normalize="full"), the default fast mode: cuBLAS logit slabs of rows in
                    blocks (896 MiB of slab), Triton row passes, gradient formed in the forward
  full-256m         the same with memory_budget = 256 MiB (smaller row blocks)
  full-64m          the same with memory_budget = 64 MiB (blocks of ~110 rows: the fixed part of the
                    memory is then this budget, the rest O(N·K))
  full-const        mode="constant_memory": fused kernels, fp32 accumulation of dX/dW
  full-native       the same with dX/dW accumulated in the input dtype, as CCE does
  topk              topk_kl(normalize="topk"): K gathered rows of ws, no vocab-wide matmul
  topk-graph        the same fwd+bwd captured once in a CUDA graph and replayed: the device time
                    alone, without the host's launches and the stored data's checks (not run
                    under capture); its memory is the graph's pool, not reported
  torch full/topk   the PyTorch backend (the CPU methods)

peak MiB = peak allocated during one fwd+bwd above what was allocated before it; each step makes
its gradients anew, so it includes dX and dW (above_grads_mib subtracts them).
Inputs: --regimes (default lm; nitrobrew.bench.regimes: flat spread lm peaked close real demo, or all)
give the student's hidden states and head and the teacher's, whose top-k ids and log-probs are
taken by streaming top-k (no [N, V] tensor); every method runs on the same tensors of each regime
and each row carries the teacher's measured mean entropy and, for baselines, the package version
and configuration (baseline column). Methods that need Triton (or CUDA) are rows with a note where
they cannot run; the exit status is 1 when a method failed. x cce = ms / cce's ms at the
same N; full_over_topk = full's ms / topk's ms; GB/s = the bytes the top-k kernels move (the K rows of ws
twice, xs rows once per stored entry for dW, dW and dX written once) / time, against a measured
device-to-device copy. err = largest relative error (loss, dX, dW) on the first --ref-rows rows
against the float64 reference (at the first N only).

--extract measures `topk-extract`'s core on a random Qwen2-style model: tokens/s of the
teacher's own forward with logits (model(input_ids).logits), of the naive extraction (those
logits in fp32, log_softmax, torch.topk) and of the decoder + streaming top-k (on GPU also with
the PyTorch chunk pass in place of the fused Triton one), and the peak memory of each.
"""

from __future__ import annotations

import argparse
import gc
import os
import time
import traceback
from typing import Callable, Dict, List, Optional

import torch

from ..core.ops import mm_acc
from . import baselines as bl
from . import regimes as rg
from .common import (
    Row,
    check_sizes,
    cuda_device,
    environment,
    failed,
    is_oom,
    nitrobrew_version,
    package_version,
    peak_mib,
    per_regime,
    plot,
    print_table,
    rel_err,
    time_ms,
    triton_unavailable,
    write_csv,
    write_markdown,
)

GPU_DEFAULTS = dict(
    vocab=152064, seq_lens=[4096, 16384], d_model=3584, ks=[64, 256], dtype="bfloat16", reps=5, warmup=2
)
CPU_DEFAULTS = dict(vocab=4096, seq_lens=[128, 512], d_model=128, ks=[8, 32], dtype="float32", reps=3, warmup=1)
GPU_METHODS = [
    "floor",
    "cce",
    "cce-exact",
    "full",
    "full-256m",
    "full-64m",
    "full-const",
    "full-native",
    "topk",
    "topk-graph",
]
METHODS = (*GPU_METHODS, "torch-full", "torch-topk")
# topk_kl keyword arguments of each nitrobrew method
METHOD_KWARGS = {
    "full": dict(normalize="full", backend="triton"),
    "full-256m": dict(normalize="full", backend="triton", memory_budget=256 << 20),
    "full-64m": dict(normalize="full", backend="triton", memory_budget=64 << 20),
    "full-const": dict(normalize="full", backend="triton", mode="constant_memory"),
    "full-native": dict(normalize="full", backend="triton", mode="constant_memory"),
    "topk": dict(normalize="topk", backend="triton"),
    "topk-graph": dict(normalize="topk", backend="triton"),
    "torch-full": dict(normalize="full", backend="torch"),
    "torch-topk": dict(normalize="topk", backend="torch"),
}
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.description = __doc__.split("\n\n")[0]
    p.add_argument("--vocab", type=int, default=None, help="vocabulary size V")
    p.add_argument("--seq-lens", type=int, nargs="+", default=None, metavar="N", help="rows (tokens) N")
    p.add_argument("--d-model", type=int, default=None, help="student hidden size D")
    p.add_argument("--ks", type=int, nargs="+", default=None, metavar="K", help="stored entries per row")
    p.add_argument("--device", default="auto", help="auto (cuda if available), cuda, cpu")
    p.add_argument("--dtype", default=None, choices=sorted(DTYPES))
    p.add_argument(
        "--methods",
        nargs="+",
        default=None,
        choices=METHODS,
        help="default: all but the torch ones on GPU; torch-full torch-topk on CPU",
    )
    p.add_argument("--reps", type=int, default=None)
    p.add_argument("--warmup", type=int, default=None)
    p.add_argument("--ref-rows", type=int, default=128, help="rows of the float64 accuracy check (0: skip)")
    p.add_argument("--extract", action="store_true", help="also measure the extraction throughput")
    p.add_argument("--extract-only", action="store_true", help="measure the extraction throughput alone")
    p.add_argument("--csv", default=None, metavar="PATH")
    p.add_argument("--plot", default=None, metavar="PATH", help="PNG of time and memory vs N (needs matplotlib)")
    p.add_argument(
        "--regimes",
        nargs="+",
        default=["lm"],
        metavar="REGIME",
        help="input regimes (%s, or all; default lm)" % " ".join(rg.REGIMES),
    )
    p.add_argument("--md", default=None, metavar="PATH", help="write the rows as a markdown table")
    p.add_argument("--seed", type=int, default=0)


def _settings(args):
    dev = cuda_device(args.device)
    d = GPU_DEFAULTS if dev.type == "cuda" else CPU_DEFAULTS
    pick = lambda name: getattr(args, name) if getattr(args, name) is not None else d[name]  # noqa: E731
    check_sizes(
        "nitrobrew bench topk",
        vocab=(pick("vocab"), 2),
        seq_lens=(pick("seq_lens"), 1),
        d_model=(pick("d_model"), 2),
        ks=(pick("ks"), 1),
        reps=(pick("reps"), 1),
        warmup=(pick("warmup"), 0),
        ref_rows=(args.ref_rows, 0),
    )
    methods = args.methods or (GPU_METHODS if dev.type == "cuda" else ["torch-full", "torch-topk"])
    return (
        dev,
        pick("vocab"),
        pick("seq_lens"),
        pick("d_model"),
        pick("ks"),
        DTYPES[pick("dtype")],
        pick("reps"),
        pick("warmup"),
        methods,
    )


def make_inputs(N: int, V: int, D: int, K: int, dtype, dev, seed: int = 0, regime: str = "lm"):
    """Student hidden/head of one regime and the teacher's top-k (streaming, no [N, V]);
    returns (xs, ws, ids, lp, labels, teacher entropy)."""
    from ..teacher.extract import streaming_topk

    d = rg.make_hidden(regime, N, V, D, D, dtype=dtype, device=dev, seed=seed)
    if K >= d.ws.shape[0]:
        raise rg.RegimeUnavailable(f"K = {K} is not below the regime's vocabulary ({d.ws.shape[0]})")
    ids, lp = streaming_topk(d.xt, d.wt, None, K)
    return d.xs.detach(), d.ws.detach(), ids, lp, d.labels, d.entropy


TRITON_METHODS = tuple(m for m in METHODS if m not in ("floor", "cce", "cce-exact", "torch-full", "torch-topk"))


def unavailable(method: str, dev) -> Optional[str]:
    """Why a method cannot run here (None: it can)."""
    if method in ("cce", "cce-exact"):
        why = bl.cce_unavailable(dev)
        return None if why is None else f"skipped: {why}"
    if method in TRITON_METHODS:
        if method == "topk-graph" and dev.type != "cuda":
            return "skipped: CUDA graphs need CUDA"
        return triton_unavailable(dev)
    return None


def baseline(method: str) -> str:
    if method == "floor":
        return f"torch {torch.__version__} matmul (3 GEMMs)"
    if method.startswith("cce"):
        cfg = "filter_eps=None (exact)" if method == "cce-exact" else "defaults"
        return f"cut-cross-entropy {package_version('cut-cross-entropy')} linear_cross_entropy, {cfg}"
    kw = ", ".join(f"{k}={v!r}" for k, v in METHOD_KWARGS[method].items())
    return f"nitrobrew {nitrobrew_version()} topk_kl({kw})"


def _fwd_bwd(fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], xs, ws, accum: str = "fp32"):
    """One fwd+bwd; the gradients are new tensors each call (counted in the peak: see grads_mib)."""
    from contextlib import nullcontext

    def step():
        x = xs.detach().requires_grad_()
        w = ws.detach().requires_grad_()
        if accum == "fp32":  # the default: no Triton import (the torch methods run without it)
            ctx = nullcontext()
        else:
            from ..topk import triton_cm as td

            ctx = td.grad_accumulation(accum)
        with ctx:  # read by the backward: it must cover loss.backward()
            loss = fn(x, w)
            loss.backward()
        return loss.detach(), x.grad, w.grad

    return step


def _floor(xs, ws):
    """logits (fp32 out), G (input dtype), dX = G ws, dW = G^T xs."""

    def step():
        z = mm_acc(xs, ws.t(), torch.float32)
        g = z.to(xs.dtype)
        del z
        dx = g @ ws
        dw = g.t() @ xs
        return dx, dw

    return step


def _method_fn(method: str, ids, lp, labels):
    from ..topk import topk_kl

    if method in ("cce", "cce-exact"):
        from cut_cross_entropy import linear_cross_entropy

        if method == "cce-exact":
            return lambda x, w: linear_cross_entropy(x, w, labels, filter_eps=None)
        return lambda x, w: linear_cross_entropy(x, w, labels)
    kwargs = METHOD_KWARGS[method]
    return lambda x, w: topk_kl(x, w, ids, lp, **kwargs)


def _graph_step(fn, xs, ws):
    """fn's fwd+bwd captured in a CUDA graph (after warm-up on a side stream); the step replays it and
    returns the graph's static (loss, dX, dW)."""
    x = xs.detach().requires_grad_()
    w = ws.detach().requires_grad_()

    def fwd_bwd():
        loss = fn(x, w)
        return (loss.detach(), *torch.autograd.grad(loss, [x, w]))

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):  # compiles the kernels, fills the launch caches
            fwd_bwd()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fwd_bwd()

    def step():
        graph.replay()
        return out

    return step


def _step(method: str, xs, ws, ids, lp, labels):
    if method == "floor":
        return _floor(xs, ws)
    if method == "topk-graph":
        return _graph_step(_method_fn(method, ids, lp, labels), xs, ws)
    return _fwd_bwd(_method_fn(method, ids, lp, labels), xs, ws, "native" if method == "full-native" else "fp32")


def _accuracy(method, xs, ws, ids, lp, labels, rows: int) -> Optional[float]:
    """Largest relative error (loss, dX, dW) on the first `rows` rows against float64."""
    if rows <= 0 or method == "floor":
        return None
    from ..topk import reference_topk_loss

    x, i, p, lab = xs[:rows], ids[:rows], lp[:rows], labels[:rows]
    loss, dx, dw = _step(method, x, ws, i, p, labels=lab)()
    x64 = x.detach().double().requires_grad_()
    w64 = ws.detach().double().requires_grad_()
    if method.startswith("cce"):
        ref = torch.nn.functional.cross_entropy(x64 @ w64.t(), lab)
    else:
        ref = reference_topk_loss(x64, w64, i, p, normalize="topk" if "topk" in method else "full")
    ref.backward()
    r = float(ref.detach())
    errs = [abs(float(loss) - r) / max(abs(r), 1e-30), rel_err(dx, x64.grad), rel_err(dw, w64.grad)]
    del x64, w64
    return max(errs)


def copy_bandwidth(dev) -> Optional[float]:
    """Device-to-device copy, GB/s counting bytes read plus written."""
    if dev.type != "cuda":
        return None
    a = torch.empty(1 << 30, dtype=torch.uint8, device=dev)
    b = torch.empty_like(a)
    ms = time_ms(lambda: b.copy_(a), dev, warmup=3, reps=10)
    del a, b
    return 2 * (1 << 30) / (ms * 1e-3) / 1e9


def topk_bytes(N, V, D, K, esize) -> int:
    """HBM bytes normalize="topk" cannot avoid: the K rows of ws gathered per row twice (logits, dX),
    dW written, xs read and dX written, the [N, K] ids, log-probs, coefficients and keys. The x row of
    each entry that dW sums is not counted: N * D is small and those reads are served from L2."""
    return 2 * N * K * D * esize + V * D * esize + 2 * N * D * esize + N * K * 16


def _measure(row: Row, method, xs, ws, ids, lp, labels, dev, warmup, reps, ref_rows) -> None:
    step = None
    try:
        step = _step(method, xs, ws, ids, lp, labels=labels)
        row.ms = time_ms(step, dev, warmup=warmup, reps=reps)
        row.peak_mib = None if method == "topk-graph" else peak_mib(step, dev)
        # the step allocates dX and dW anew: report the peak above them too
        if row.peak_mib is not None and method != "floor":
            grads = (xs.numel() + ws.numel()) * xs.element_size() / 2**20
            row.extra["above_grads_mib"] = row.peak_mib - grads
        row.rel_err = _accuracy(method, xs, ws, ids, lp, labels=labels, rows=ref_rows)
    except Exception as err:  # one failing method must not stop the others
        row.ms = None
        row.note = ("OOM" if is_oom(err) else f"error: {type(err).__name__}: {err}")[:160]
        if not is_oom(err):
            traceback.print_exc()
    step = None  # a captured graph holds its memory pool until it goes
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()


def _ratios(row: Row, label, method, base, N, V, D, K, esize, bw) -> None:
    base[label] = row.ms
    for ref in ("cce", "cce-exact"):
        if ref in base and method not in ("floor", "cce", "cce-exact"):
            row.extra["x_" + ref.replace("-", "_")] = row.ms / base[ref]
    if "floor" in base and method != "floor":
        row.extra["x_floor"] = row.ms / base["floor"]
    if "topk" in method:
        full = base.get(label.replace("topk-graph", "full").replace("topk", "full"))
        if full:
            row.extra["full_over_topk"] = full / row.ms
        gbps = topk_bytes(N, V, D, K, esize) / (row.ms * 1e-3) / 1e9
        row.extra["GBps"] = gbps
        if bw:
            row.extra["bw_frac"] = gbps / bw


def run_loss(args, env: Dict[str, str]) -> List[Row]:
    dev, V, seq_lens, D, ks, dtype, reps, warmup, methods = _settings(args)
    rows: List[Row] = []
    bw = copy_bandwidth(dev)
    if bw:
        print(f"device-to-device copy: {bw:.0f} GB/s")
    once = ("floor", "cce", "cce-exact")  # independent of K: measured once per N
    for regime in rg.parse(args.regimes):
        for N in seq_lens:
            base: Dict[str, float] = {}
            for K in ks:
                try:
                    xs, ws, ids, lp, labels, ent = make_inputs(
                        N, V, D, K, dtype, dev=dev, seed=args.seed, regime=regime
                    )
                except rg.RegimeUnavailable as err:
                    rows.append(Row("topk", "-", {"regime": regime, "N": N}, note=f"skipped: {err}"))
                    print(f"regime {regime}: skipped ({err})", flush=True)
                    break
                print(f"regime {regime}: mean teacher entropy {ent:.2f} nats (N={N}, K={K})", flush=True)
                n, v, d = xs.shape[0], ws.shape[0], xs.shape[1]  # the demo regime brings its own sizes
                for method in methods:
                    if method in once and K != ks[0]:
                        continue
                    label = method if method in once else f"{method} K={K}"
                    size = {"regime": regime, "N": n, "K": K if method not in once else 0, "V": v, "D": d}
                    row = Row("topk", label, size, extra={"teacher_entropy": ent}, baseline=baseline(method))
                    why = unavailable(method, dev)
                    if why:
                        row.note = why
                    else:
                        _measure(
                            row,
                            method,
                            xs,
                            ws,
                            ids,
                            lp=lp,
                            labels=labels,
                            dev=dev,
                            warmup=warmup,
                            reps=reps,
                            ref_rows=args.ref_rows if N == seq_lens[0] else 0,  # accuracy: not N-dependent
                        )
                    if row.ms is not None:
                        _ratios(row, label, method, base, n, V=v, D=d, K=K, esize=xs.element_size(), bw=bw)
                    rows.append(row)
                    print(
                        f"  {label} {regime} N={N}: {row.ms} ms, {row.peak_mib} MiB, err {row.rel_err} {row.note}",
                        flush=True,
                    )
                    if args.csv:  # written as it goes: a run cut short keeps what it measured
                        write_csv(args.csv, rows, env)
                del xs, ws, ids, lp, labels
    for r in rows:
        r.note = " ".join([r.note] + [f"{k}={v:.3g}" for k, v in r.extra.items() if k != "teacher_entropy"]).strip()
    if bw:
        for r in rows:
            r.extra["copy_GBps"] = bw
    return rows


def run_extract(args) -> List[Row]:
    """Teacher forward with logits vs decoder + streaming top-k, on a random Qwen2-style model."""
    import transformers

    from ..teacher.extract import teacher_from_hf, teacher_topk

    dev, V, _, _, ks, dtype, reps, warmup, _ = _settings(args)
    gpu = dev.type == "cuda"
    cfg = transformers.Qwen2Config(
        vocab_size=V,
        hidden_size=1024 if gpu else 64,
        intermediate_size=2816 if gpu else 128,
        num_hidden_layers=8 if gpu else 2,
        num_attention_heads=16 if gpu else 4,
        num_key_value_heads=4 if gpu else 2,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
    )
    B, L = (16, 1024) if gpu else (4, 64)
    with torch.device(dev):
        model = transformers.Qwen2ForCausalLM(cfg).to(dtype).eval()
    teacher = teacher_from_hf(model, name="random-qwen2")
    ids = torch.randint(0, V, (B, L), device=dev)
    mask = torch.ones_like(ids)
    seqs = ids.tolist()
    tokens = B * L
    rows = []
    params = sum(p.numel() for p in model.parameters())
    size = {"N": tokens, "K": ks[0], "V": V, "D": cfg.hidden_size}

    @torch.no_grad()
    def with_logits():
        return model(input_ids=ids, attention_mask=mask, use_cache=False).logits

    @torch.no_grad()
    def naive_extract():  # what extraction looks like without nitrobrew: [N, V] logits, then top-k
        logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits.float()
        return torch.log_softmax(logits, -1).topk(ks[0], -1)

    @torch.no_grad()
    def hidden_only():
        return teacher.hidden_fn(ids, mask)

    def extract():
        return teacher_topk(teacher, seqs, ks[0], 1.0, batch_tokens=tokens)

    def extract_torch_scan():  # the same selection with PyTorch ops in place of the fused chunk pass
        return teacher_topk(teacher, seqs, ks[0], 1.0, batch_tokens=tokens, backend="torch")

    methods = [
        ("teacher forward + logits", with_logits),
        ("teacher forward (hidden only)", hidden_only),
        (f"naive top-{ks[0]} (logits, log_softmax, topk)", naive_extract),
    ]
    if gpu:
        methods.append((f"extract top-{ks[0]}, PyTorch chunk pass", extract_torch_scan))
    methods.append((f"extract top-{ks[0]} (hidden + streaming top-k)", extract))
    for name, fn in methods:
        row = Row("extract", name, dict(size))
        try:
            row.ms = time_ms(fn, dev, warmup=1, reps=max(2, reps // 2))
            row.peak_mib = peak_mib(fn, dev)
            row.extra["tokens_per_s"] = tokens / (row.ms * 1e-3)
        except Exception as err:
            row.note = ("OOM" if is_oom(err) else f"error: {type(err).__name__}: {err}")[:160]
            traceback.print_exc()
        rows.append(row)
    ref = rows[0].ms
    for r in rows:
        if r.ms and ref:
            r.extra["x_forward_with_logits"] = r.ms / ref
        r.note = " ".join(
            [r.note, f"params={params / 1e6:.0f}M"] + [f"{k}={v:.4g}" for k, v in r.extra.items()]
        ).strip()
    # alignment spot check: stored rows equal the top-k of the model's own logits
    with torch.no_grad():
        logits = model(input_ids=ids[:1, :64], use_cache=False).logits[0, :-1].float()
    lp_ref, id_ref = torch.log_softmax(logits, -1).topk(ks[0], -1)
    got_i, got_lp = teacher_topk(teacher, [seqs[0][:64]], ks[0])
    agree = float((got_i[0].to(dev) == id_ref).float().mean())
    err = float((got_lp[0].to(dev) - lp_ref).abs().max())
    rows[-1].note += f" alignment: ids agree {agree:.4f}, max |dlogprob| {err:.2e}"
    del model, teacher
    return rows


def run(args) -> int:
    t0 = time.time()
    try:
        args.regimes = rg.parse(args.regimes)
    except ValueError as err:
        raise SystemExit(f"nitrobrew bench: {err}") from None
    _settings(args)  # bad sizes: one line before any work
    env = environment()
    print("env: " + ", ".join(f"{k}={v}" for k, v in env.items()))
    if args.csv:
        os.makedirs(os.path.dirname(os.path.abspath(args.csv)), exist_ok=True)
    rows = [] if args.extract_only else run_loss(args, env)
    if rows:
        print_table(rows, ["regime", "N", "K", "V", "D"])
    if args.extract or args.extract_only:
        ext = run_extract(args)
        print_table(ext, ["N", "K", "V", "D"])
        rows += ext
    if args.csv:
        write_csv(args.csv, rows, env)
        print(f"wrote {args.csv}")
    if args.md:
        write_markdown(
            args.md, "nitrobrew bench topk", rows, ["regime", "N", "K", "V", "D"], env, extras=("teacher_entropy",)
        )
        print(f"wrote {args.md}")
    timed = [r for r in rows if r.mode == "topk" and r.ms is not None]
    if args.plot and timed:
        plot(
            args.plot,
            per_regime(timed),
            "N",
            f"topk_kl fwd+bwd, V={timed[0].size['V']}, D={timed[0].size['D']} ({env['device']})",
        )
    print(f"bench topk: {time.time() - t0:.1f} s")
    bad = failed(rows)
    for r in bad:
        print(f"FAILED: {r.method} at N={r.size.get('N')} ({r.size.get('regime')}): {r.note}")
    return 1 if bad else 0
