"""`nitrobrew bench attention`: attention_kl against PyTorch SDPA and naive baselines.

For each N in --seq-lens (B = --batch, H = --heads, head dim D = --head-dim, causal unless
--no-causal), one process, the same bf16 inputs for every method (docs/design.md §8):

  nitrobrew       attention_kl (Triton on GPU), forward + backward, gradients to q_s and k_s
  nitrobrew-fwd   its forward alone (no autograd state)
  sdpa            PyTorch SDPA with its default backend selection (on an H200 with torch 2.11:
                  cuDNN attention), forward + backward of ONE attention of the same shape (q, k,
                  v; gradients to all three): the reference speed. The kernels it dispatched to
                  are recorded (profiler) in the baseline column and the environment
  sdpa-fwd        its forward alone
  sdpa-flash      the same under sdpa_kernel(SDPBackend.FLASH_ATTENTION) (FlashAttention-2)
  sdpa-flash-fwd  its forward alone
  naive           materialized PyTorch: both [B, H, N, N] score maps, log_softmax, KL; autograd
  compile         the same under torch.compile (dynamic shapes: one compilation for all N)
  torch           attention_kl's PyTorch backend (key-chunked; the CPU default)

ms = median of CUDA-event timings after warm-up; MiB = peak memory above the inputs and their
gradients; TFLOP/s counts model FLOPs with U = 2 B H N^2 D (halved when causal): SDPA forward 2U
(QK^T, PV), SDPA fwd+bwd 7U; nitrobrew forward 2U (two score GEMMs), fwd+bwd 8U (forward 2U,
dq kernel 2U recompute + 1U, dk kernel 2U recompute + 1U).

--check runs a battery of GPU correctness cases (compiled kernels, not the interpreter) against
the float64 reference; --tune sweeps Triton tile configs at --tune-n and uses the best; --warm
compiles every kernel variant the run needs in parallel processes first. Accuracy rows compare
losses and gradients at --accuracy-n with the float64 reference (spread and close inputs).

--regimes (default spread; nitrobrew.bench.regimes: flat, spread, peaked, close; lm and real
have no score-map form and are skipped with a note) give the inputs; every method runs on the same
tensors of each regime, each row carries the teacher's measured mean row entropy. The exit status
is 1 when a method or a check failed.
"""

from __future__ import annotations

import argparse
import gc
import os
import time
import traceback
from typing import Callable, Dict, List, Optional, Tuple

import torch

from . import regimes as rg
from .common import (
    Row,
    check_sizes,
    cuda_device,
    environment,
    failed,
    is_oom,
    nitrobrew_version,
    peak_mib,
    per_regime,
    plot,
    print_table,
    rel_err,
    time_ms,
    triton_unavailable,
    write_csv,
)

GPU_DEFAULTS = dict(
    seq_lens=[2048, 4096, 8192, 16384, 65536, 131072],
    heads=32,
    head_dim=128,
    batch=1,
    dtype="bfloat16",
    reps=5,
    warmup=2,
    accuracy_n=1024,
)
CPU_DEFAULTS = dict(
    seq_lens=[256, 512], heads=4, head_dim=32, batch=1, dtype="float32", reps=3, warmup=1, accuracy_n=128
)
METHODS = (
    "nitrobrew",
    "nitrobrew-fwd",
    "sdpa",
    "sdpa-fwd",
    "sdpa-flash",
    "sdpa-flash-fwd",
    "naive",
    "compile",
    "torch",
)
SDPA = {"sdpa": None, "sdpa-fwd": None, "sdpa-flash": "FLASH_ATTENTION", "sdpa-flash-fwd": "FLASH_ATTENTION"}
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}

# Hopper candidates (BM, BN, num_warps, num_stages), pre-screened offline for register spills
# (ptxas via triton.compile for sm_90): the sweep times them on the device and keeps the best.
TUNE = {
    "fwd": [(128, 64, 8, 2), (128, 64, 8, 3), (128, 128, 8, 2), (64, 64, 4, 3), (64, 128, 4, 2)],
    "dq": [(128, 64, 8, 2), (128, 64, 8, 3), (64, 64, 4, 3), (64, 32, 4, 3), (64, 64, 4, 2)],
    "dk": [(32, 128, 8, 2), (64, 128, 8, 2), (32, 64, 4, 3), (64, 64, 4, 3), (32, 128, 8, 3)],
}
SIGMA = 1.5  # input std: score std ~ SIGMA^2 = 2.25 (ranges of about +-10 units)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.description = __doc__.split("\n\n")[0]
    p.add_argument("--seq-lens", type=int, nargs="+", default=None, metavar="N", help="sequence lengths N = Nq = Nk")
    p.add_argument("--heads", type=int, default=None, help="query heads H")
    p.add_argument("--kv-heads", type=int, default=None, help="kv heads of both sides (default: H, no GQA)")
    p.add_argument("--head-dim", type=int, default=None, help="head dim D of both sides")
    p.add_argument("--batch", type=int, default=None)
    p.add_argument("--dtype", default=None, choices=sorted(DTYPES))
    p.add_argument("--device", default="auto", help="auto (cuda if available), cuda, cpu")
    p.add_argument(
        "--methods",
        nargs="+",
        default=None,
        choices=METHODS,
        help="default: all but torch on GPU; nitrobrew(-fwd) (torch backend), sdpa(-fwd), naive on CPU",
    )
    p.add_argument("--no-causal", action="store_true")
    p.add_argument("--direction", default="forward", choices=["forward", "reverse"])
    p.add_argument("--teacher-grad", action="store_true", help="also give gradients to the teacher's q and k")
    p.add_argument("--reps", type=int, default=None)
    p.add_argument("--warmup", type=int, default=None)
    p.add_argument("--accuracy-n", type=int, default=None, help="N of the float64 accuracy check (0: skip)")
    p.add_argument("--check", action="store_true", help="GPU correctness battery against float64 first")
    p.add_argument("--tune", action="store_true", help="sweep Triton tile configs at --tune-n, use the best")
    p.add_argument("--tune-n", type=int, default=8192)
    p.add_argument("--warm", action="store_true", help="compile all kernel variants in parallel processes first")
    p.add_argument(
        "--regimes",
        nargs="+",
        default=["spread"],
        metavar="REGIME",
        help="input regimes (%s, or all; lm and real are skipped here; default spread)"
        % " ".join(rg.ATTENTION_REGIMES),
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--csv", default=None, help="write the rows here")
    p.add_argument("--plot", default=None, help="draw time and memory against N here (PNG)")
    p.add_argument("--md", default=None, help="write a markdown summary (ratios) here")


# ----------------------------------------------------------------------------------------- inputs


def make_inputs(B, H, Hkv, N, D, dtype, dev, seed=0, close=False):
    g = torch.Generator(device="cpu").manual_seed(seed)

    def rnd(*shape):
        return (torch.randn(*shape, generator=g) * SIGMA).to(dev, dtype)

    q_t, k_t = rnd(B, H, N, D), rnd(B, Hkv, N, D)
    if close:
        q_s = (q_t.float() + 0.1 * rnd(B, H, N, D).float() / SIGMA).to(dtype)
        k_s = (k_t.float() + 0.1 * rnd(B, Hkv, N, D).float() / SIGMA).to(dtype)
    else:
        q_s, k_s = rnd(B, H, N, D), rnd(B, Hkv, N, D)
    return q_s, k_s, q_t, k_t


def naive_kl(q_s, k_s, q_t, k_t, causal: bool, direction: str = "forward"):
    """What one writes first: both score maps materialized, log_softmax, KL, mean over rows."""
    G_s, G_t = q_s.shape[1] // k_s.shape[1], q_t.shape[1] // k_t.shape[1]
    k_s = k_s.repeat_interleave(G_s, 1) if G_s > 1 else k_s
    k_t = k_t.repeat_interleave(G_t, 1) if G_t > 1 else k_t
    b = (q_s @ k_s.transpose(-1, -2)).float() * q_s.shape[-1] ** -0.5
    a = (q_t @ k_t.transpose(-1, -2)).float() * q_t.shape[-1] ** -0.5
    if causal:
        N, M = a.shape[-2:]
        mask = torch.ones(N, M, dtype=torch.bool, device=a.device).triu(1)
        a = a.masked_fill(mask, float("-inf"))
        b = b.masked_fill(mask, float("-inf"))
    lp, lq = torch.log_softmax(a, -1), torch.log_softmax(b, -1)
    if direction == "reverse":
        lp, lq = lq, lp
    p = lp.exp()
    return torch.where(p > 0, p * (lp - lq), torch.zeros_like(p)).sum(-1).mean()


# ----------------------------------------------------------------------------------------- checks

CHECK_CASES = [
    dict(name="bf16 causal fwd-KL D128 N=384", B=1, H=4, Nq=384, D=128),
    dict(name="bf16 causal reverse D128 N=1000 (odd tiles)", B=2, H=2, Nq=1000, D=128, direction="reverse"),
    dict(name="bf16 non-causal kpm Nq=200 Nk=333", B=2, H=2, Nq=200, Nk=333, D=64, causal=False, kpm=True),
    dict(
        name="bf16 GQA 2/1 Ds=64 Dt=128 teacher grads", B=1, H=4, Nq=300, D=64, Dt=128, hkv_s=2, hkv_t=1, teacher=True
    ),
    dict(
        name="bf16 GQA same grouping teacher grads reverse",
        B=1,
        H=4,
        Nq=256,
        D=64,
        hkv_s=2,
        hkv_t=2,
        teacher=True,
        direction="reverse",
    ),
    dict(name="fp32 causal D64 (ieee dots)", B=1, H=2, Nq=300, D=64, dtype="float32", tol=(1e-5, 1e-4)),
    dict(
        name="fp16 D96 causal bottom-right Nq=100 Nk=300", B=1, H=2, Nq=100, Nk=300, D=96, dtype="float16", offset=200
    ),
    dict(name="bf16 lse_t given, kpm, causal", B=2, H=2, Nq=256, D=128, lse=True, kpm=True),
    dict(name="bf16 close case D128", B=1, H=4, Nq=512, D=128, close=True),
    dict(name="bf16 D256", B=1, H=2, Nq=300, D=256),
]


def _check_case(case: Dict) -> Dict:
    """One GPU correctness case against the float64 reference (run in its own process)."""
    from ..attention import attention_kl, reference_attention_kl

    out = dict(name=case["name"])
    try:
        dev = torch.device(os.environ.get("NITROBREW_BENCH_DEVICE", "cuda"))
        dtype = DTYPES[case.get("dtype", "bfloat16")]
        B, H, Nq = case["B"], case["H"], case["Nq"]
        Nk = case.get("Nk", Nq)
        Ds, Dt = case["D"], case.get("Dt", case["D"])
        g = torch.Generator().manual_seed(1)
        hs, ht = case.get("hkv_s", H), case.get("hkv_t", H)
        q_t = torch.randn(B, H, Nq, Dt, generator=g) * 2
        k_t = torch.randn(B, ht, Nk, Dt, generator=g) * 2
        if case.get("close"):
            q_s = q_t + 0.05 * torch.randn(B, H, Nq, Ds, generator=g)
            k_s = k_t + 0.05 * torch.randn(B, hs, Nk, Ds, generator=g)
        else:
            q_s = torch.randn(B, H, Nq, Ds, generator=g) * 2
            k_s = torch.randn(B, hs, Nk, Ds, generator=g) * 2
        ins = [t.to(dev, dtype) for t in (q_s, k_s, q_t, k_t)]
        teacher = case.get("teacher", False)
        kw = dict(
            is_causal=case.get("causal", True),
            causal_offset=case.get("offset", 0),
            direction=case.get("direction", "forward"),
            temperature=1.3,
        )
        if case.get("kpm"):
            kpm = torch.rand(B, Nk, generator=g) > 0.3
            kpm[-1, : Nk // 2] = False
            kw["key_padding_mask"] = kpm.to(dev)
        lse = None
        if case.get("lse"):
            a = (ins[2].double() @ ins[3].double().transpose(-1, -2)) * (Dt**-0.5 / 1.3)
            vis = torch.ones(Nq, Nk, dtype=torch.bool, device=dev).tril(kw["causal_offset"])
            if "key_padding_mask" in kw:
                vis = vis[None, None] & kw["key_padding_mask"][:, None, None, :]
            lse = torch.logsumexp(a.masked_fill(~vis, float("-inf")), -1).float()
        mine = [t.clone().requires_grad_(i < 2 or teacher) for i, t in enumerate(ins)]
        ref = [t.double().requires_grad_(i < 2 or teacher) for i, t in enumerate(ins)]
        w = torch.rand(B, H, Nq, device=dev) + 0.5
        lm = attention_kl(*mine, reduction="none", backend="triton", lse_t=lse, **kw)
        lr = reference_attention_kl(*ref, reduction="none", **kw)
        (lm * w).sum().backward()
        (lr * w.double()).sum().backward()
        if dev.type == "cuda":
            torch.cuda.synchronize()
        out["loss_err"] = rel_err(lm, lr)
        errs = [rel_err(a.grad, b.grad) for a, b in zip(mine, ref) if b.grad is not None]
        out["grad_err"] = max(errs)
        out["finite"] = bool(torch.isfinite(lm).all()) and all(
            bool(torch.isfinite(a.grad).all()) for a in mine if a.grad is not None
        )
        tv, tg = case.get("tol", (1e-3, 2e-2))
        out["ok"] = out["finite"] and out["loss_err"] <= tv and out["grad_err"] <= tg
    except Exception as err:  # reported, not raised: the battery goes on
        out["ok"] = False
        out["error"] = f"{type(err).__name__}: {err}"[:500]
    return out


def _warm_case(task: Tuple) -> str:
    """Compile one (fwd, dq, dk) config triple (or the compiled naive baseline) on tiny inputs
    with the same specialization as the timed runs, filling the on-disk caches."""
    try:
        kind, cfg, B, H, Hkv, D, dtype_name, causal, direction = task
        dev = torch.device(os.environ.get("NITROBREW_BENCH_DEVICE", "cuda"))
        dtype = DTYPES[dtype_name]
        N = 256
        ins = [t.requires_grad_(i < 2) for i, t in enumerate(make_inputs(B, H, Hkv, N, D, dtype=dtype, dev=dev))]
        if kind == "compile":
            fn = torch.compile(naive_kl, dynamic=True)
            fn(*ins, causal, direction).backward()
            fn2 = make_inputs(B, H, Hkv, 512, D, dtype=dtype, dev=dev)
            fn(*[t.requires_grad_(i < 2) for i, t in enumerate(fn2)], causal, direction).backward()
        else:
            from ..attention import attention_kl

            attention_kl(*ins, is_causal=causal, direction=direction, backend="triton", block_config=cfg).backward()
            with torch.no_grad():
                attention_kl(*ins, is_causal=causal, direction=direction, backend="triton", block_config=cfg)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        return f"warm {kind} {cfg}: ok"
    except Exception as err:
        return f"warm {kind}: {type(err).__name__}: {str(err)[:300]}"


def _parallel(checks: List[Dict], warm: List[Tuple]) -> Tuple[List[Dict], List[str]]:
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    n = max(1, min(len(checks) + len(warm), (os.cpu_count() or 2)))
    with ctx.Pool(n) as pool:
        rc = pool.map_async(_check_case, checks, chunksize=1) if checks else None
        rw = pool.map_async(_warm_case, warm, chunksize=1) if warm else None
        res_c = rc.get() if rc else []
        res_w = rw.get() if rw else []
    return res_c, res_w


# ----------------------------------------------------------------------------------------- timing


def _timed(fn: Callable[[], object], dev, warmup: int, reps: int) -> float:
    """Median ms; long calls (> 150 ms) get one warm-up and 3 repetitions."""
    t0 = time.perf_counter()
    fn()
    if dev.type == "cuda":
        torch.cuda.synchronize()
    once = (time.perf_counter() - t0) * 1e3
    if once > 150:
        return time_ms(fn, dev, warmup=0, reps=3)
    return time_ms(fn, dev, warmup=max(0, warmup - 1), reps=reps)


def _grad_mib(tensors) -> float:
    return sum(t.numel() * t.element_size() for t in tensors) / 2**20


def _measure(
    step: Callable[[], None], params: List[torch.Tensor], dev, warmup, reps, grads: bool = True
) -> Tuple[float, float]:
    """(ms, MiB above the inputs and, when the step makes them, their gradients) of one step."""

    def run():
        for p in params:
            p.grad = None
        step()

    ms = _timed(run, dev, warmup, reps)
    for p in params:
        p.grad = None
    mib = peak_mib(run, dev) - (_grad_mib([p for p in params if p.requires_grad]) if grads else 0.0)
    for p in params:
        p.grad = None
    return ms, max(mib, 0.0)


def _flops(B, H, N, D, causal: bool) -> float:
    return 2.0 * B * H * N * N * D * (0.5 if causal else 1.0)


def tune(args, dev, dtype, B, H, Hkv, D, causal) -> Tuple[Dict, List[Row]]:
    """Time each candidate tile config of each kernel at N = --tune-n; return the best."""
    from ..attention.common import AttnSpec
    from ..attention.triton_function import Side, triton_backward, triton_forward

    N = args.tune_n
    q_s, k_s, q_t, k_t = make_inputs(B, H, Hkv, N, D, dtype=dtype, dev=dev, seed=args.seed)
    scale = D**-0.5
    spec = AttnSpec(is_causal=causal, causal_offset=0, scale_s=scale, scale_t=scale, direction="forward")
    X, Y = Side(q_t, k_t, scale), Side(q_s, k_s, scale)
    rows, best = [], {}
    kl, lsx, lsy = triton_forward(X, Y, None, spec)
    g = torch.full_like(kl, 1.0 / kl.numel())
    U = _flops(B, H, N, D, causal)
    for kind, work in (("fwd", 2 * U), ("dq", 3 * U), ("dk", 3 * U)):
        for cfg in TUNE[kind]:
            c = {kind: cfg}
            if kind == "fwd":
                fn = lambda c=c: triton_forward(X, Y, None, spec, cfg=c)  # noqa: E731
            else:
                need = dict(qx=False, kx=False, qy=kind == "dq", ky=kind == "dk")
                fn = lambda c=c, need=need: triton_backward(  # noqa: E731
                    X, Y, None, spec, lsx, lsy=lsy, kl=kl, g=g, need=need, cfg=c
                )
            row = Row("tune", f"{kind} {cfg}", dict(N=N, B=B, H=H, D=D))
            try:
                row.ms = time_ms(fn, dev, warmup=2, reps=10)
                row.extra["tflops"] = work / row.ms / 1e9
            except Exception as err:
                row.note = f"failed: {type(err).__name__}: {str(err)[:120]}"
            rows.append(row)
            print(f"  tune {kind} {cfg}: {row.ms} ms {row.note}", flush=True)
            if row.ms is not None and (kind not in best or row.ms < best[kind][1]):
                best[kind] = (cfg, row.ms)
    cfg = {k: v[0] for k, v in best.items()}
    print(f"best tile configs: {cfg}", flush=True)
    return cfg, rows


def accuracy(args, dev, dtype, B, H, Hkv, D, causal, methods, cfg) -> List[Row]:
    """Loss and gradient errors against float64 at N = --accuracy-n (random and close inputs)."""
    from ..attention import attention_kl, reference_attention_kl

    N = args.accuracy_n
    rows = []
    for kind in ("spread", "close"):
        ins = rg.make_attention(kind, B, H, Hkv, N, D=D, dtype=dtype, dev=dev, seed=args.seed + 1, causal=causal)[0]
        ref = [t.double().requires_grad_(i < 2) for i, t in enumerate(ins)]
        lr = reference_attention_kl(*ref, is_causal=causal, direction=args.direction)
        lr.backward()
        cands = {"nitrobrew": lambda *a: attention_kl(*a, is_causal=causal, direction=args.direction, block_config=cfg)}
        if "torch" in methods or dev.type != "cuda":
            cands["torch"] = lambda *a: attention_kl(*a, is_causal=causal, direction=args.direction, backend="torch")
        if "naive" in methods:
            cands["naive"] = lambda *a: naive_kl(*a, causal, args.direction)
        for name, fn in cands.items():
            mine = [t.clone().requires_grad_(i < 2) for i, t in enumerate(ins)]
            row = Row("accuracy", f"{name} ({kind})", dict(N=N, B=B, H=H, D=D))
            try:
                loss = fn(*mine)
                loss.backward()
                row.rel_err = rel_err(loss, lr)
                row.extra["loss_rel_err"] = row.rel_err
                row.extra["grad_q_rel_err"] = rel_err(mine[0].grad, ref[0].grad)
                row.extra["grad_k_rel_err"] = rel_err(mine[1].grad, ref[1].grad)
                row.extra["loss_f64"] = float(lr.detach())
            except Exception as err:
                row.note = "OOM" if is_oom(err) else f"failed: {type(err).__name__}"
            rows.append(row)
            print(
                f"  accuracy {row.method}: loss {row.extra.get('loss_rel_err')}, dq {row.extra.get('grad_q_rel_err')}, "
                f"dk {row.extra.get('grad_k_rel_err')} {row.note}",
                flush=True,
            )
            del mine
        del ref, ins
        gc.collect()
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def sdpa_kernels(call: Callable[[], None], dev) -> str:
    """What SDPA dispatched to in call(): the aten op and, on CUDA, the attention kernels' names
    (torch profiler)."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    try:
        with profile(activities=acts) as prof:
            call()
            if dev.type == "cuda":
                torch.cuda.synchronize()
    except Exception as err:  # the profiler is a label: never a reason to fail the bench
        return f"unknown ({type(err).__name__})"
    names = list(dict.fromkeys(e.name for e in prof.events()))
    ops = [
        n
        for n in names
        if n.startswith("aten::_scaled_dot_product")
        or n.startswith("aten::_flash_attention")
        or n.startswith("aten::_efficient_attention")
        or n.startswith("aten::_cudnn_attention")
    ]
    keys = ("fmha", "flash", "attention", "sdpa", "cudnn", "attn")
    kernels = [
        n
        for n in names
        if not n.startswith(("aten::", "autograd::", "torch::"))
        and "Backward" not in n
        and any(k in n.lower() for k in keys)
    ]
    text = " + ".join(ops[:2]) or "?"
    if kernels:
        text += "; kernels: " + ", ".join(k[:90] for k in kernels[:3])
    return text


def _sdpa_ctx(backend: Optional[str]):
    from contextlib import nullcontext

    if backend is None:
        return nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel(getattr(SDPBackend, backend))


def run_speed(args, dev, dtype, B, H, Hkv, D, causal, methods, cfg, env) -> List[Row]:
    rows: List[Row] = []
    compiled = torch.compile(naive_kl, dynamic=True) if "compile" in methods else None
    for regime in rg.parse(args.regimes):
        for N in args.seq_lens:
            try:
                ins, ent = rg.make_attention(
                    regime, B, H, Hkv, N, D=D, dtype=dtype, dev=dev, seed=args.seed, causal=causal
                )
            except rg.RegimeUnavailable as err:
                print(f"regime {regime}: skipped ({err})", flush=True)
                rows.append(Row("attention", "-", dict(regime=regime), note=f"skipped: {err}"))
                break
            print(f"regime {regime}: teacher mean row entropy {ent:.2f} nats (N={N})", flush=True)
            rows += _speed_at(
                args,
                dev,
                dtype,
                B,
                H,
                Hkv=Hkv,
                D=D,
                N=N,
                causal=causal,
                methods=methods,
                cfg=cfg,
                env=env,
                regime=regime,
                ent=ent,
                ins=ins,
                compiled=compiled,
                done=rows,
            )
    return rows


def _speed_at(
    args, dev, dtype, B, H, Hkv, D, N, causal, methods, cfg, env, regime, ent, ins, compiled, done: List[Row]
) -> List[Row]:
    import torch.nn.functional as F

    from ..attention import attention_kl

    out: List[Row] = []
    tg = args.teacher_grad
    size = dict(regime=regime, N=N, B=B, H=H, D=D)
    U = _flops(B, H, N, D, causal)
    ins = [t.requires_grad_(i < 2 or tg) for i, t in enumerate(ins)]
    v = torch.randn(B, Hkv, N, D, device=dev, dtype=dtype).requires_grad_()
    dout = torch.randn(B, H, N, D, device=dev, dtype=dtype)
    stats_mib = 5 * B * H * N * 4 / 2**20  # kl, lse_x, lse_y, upstream g, returned rows (float32)
    tv = torch.__version__
    for method in methods:
        row = Row("attention", method, dict(size), extra={"teacher_entropy": ent})
        backend = "torch" if (method == "torch" or dev.type != "cuda") else "auto"
        if method.startswith("nitrobrew") or method == "torch":
            row.baseline = f"nitrobrew {nitrobrew_version()} attention_kl(backend={backend!r})"
        elif method in ("naive", "compile"):
            row.baseline = f"torch {tv} " + ("eager" if method == "naive" else "torch.compile(dynamic=True)")

        def ours(bk=backend):
            attention_kl(*ins, is_causal=causal, direction=args.direction, backend=bk, block_config=cfg).backward()

        def ours_fwd(bk=backend):
            with torch.no_grad():
                attention_kl(*ins, is_causal=causal, direction=args.direction, backend=bk, block_config=cfg)

        def sdpa(fwd_only=False):  # called inside _sdpa_ctx: selecting the backend is not timed
            if fwd_only:
                with torch.no_grad():
                    F.scaled_dot_product_attention(ins[0], ins[1], v, is_causal=causal, enable_gqa=Hkv != H)
            else:
                o = F.scaled_dot_product_attention(ins[0], ins[1], v, is_causal=causal, enable_gqa=Hkv != H)
                o.backward(dout)

        try:
            if method in ("nitrobrew", "nitrobrew-fwd") and dev.type == "cuda" and triton_unavailable(dev):
                row.note = triton_unavailable(dev)
            elif method in ("nitrobrew", "torch"):
                if method == "torch" and dev.type == "cuda" and N > 8192:
                    row.note = "skipped (key-chunked PyTorch path: slow at this N)"
                else:
                    row.ms, row.peak_mib = _measure(ours, ins, dev, args.warmup, args.reps)
                    row.extra["tflops"] = (8 + 2 * tg) * U / row.ms / 1e9
                    row.extra["stats_mib"] = stats_mib
            elif method == "nitrobrew-fwd":
                row.ms, row.peak_mib = _measure(ours_fwd, ins, dev, args.warmup, args.reps, grads=False)
                row.extra["tflops"] = 2 * U / row.ms / 1e9
            elif method in SDPA:
                params = [ins[0], ins[1], v]
                fwd_only = method.endswith("-fwd")
                with _sdpa_ctx(SDPA[method]):  # entered once, as a training loop would
                    row.ms, row.peak_mib = _measure(
                        lambda: sdpa(fwd_only), params, dev, args.warmup, args.reps, grads=not fwd_only
                    )
                    kern = sdpa_kernels(lambda: sdpa(fwd_only), dev)
                for p in params:
                    p.grad = None
                which = "default backend" if SDPA[method] is None else f"sdpa_kernel({SDPA[method]})"
                row.baseline = f"torch {tv} SDPA {which}: {kern}"
                if SDPA[method] is None:
                    env["sdpa_default" + ("_fwd" if fwd_only else "")] = kern
                row.extra["tflops"] = (2 if fwd_only else 7) * U / row.ms / 1e9
            elif method in ("naive", "compile"):
                need = 6 * B * H * N * N * 4  # two fp32 maps, their log-softmaxes and gradients
                free = torch.cuda.mem_get_info()[0] if dev.type == "cuda" else None
                if free is not None and need > 2 * free:
                    row.note = f"OOM (needs ~{need / 2**30:.0f} GiB, not run)"
                else:
                    fn = compiled if method == "compile" else naive_kl

                    def step(fn=fn):
                        fn(*ins, causal, args.direction).backward()

                    row.ms, row.peak_mib = _measure(step, ins, dev, args.warmup, args.reps)
        except Exception as err:
            if is_oom(err):
                row.note = "OOM"
            else:
                row.note = f"failed: {type(err).__name__}: {str(err)[:100]}"
                traceback.print_exc()
            row.ms = row.peak_mib = None
        for t in ins + [v]:
            t.grad = None
        gc.collect()
        if dev.type == "cuda":
            torch.cuda.empty_cache()
        out.append(row)
        tf = row.extra.get("tflops")
        print(
            f"  {method:14s} {regime} N={N:6d}: {_fmt(row.ms)} ms  {_fmt(row.peak_mib)} MiB"
            f"{'' if tf is None else f'  {tf:.0f} TFLOP/s'}  {row.note}",
            flush=True,
        )
        if args.csv:
            write_csv(args.csv, done + out, env)
    return out


def _fmt(x: Optional[float]) -> str:
    return "-" if x is None else f"{x:.2f}"


def ratios(rows: List[Row]) -> List[Dict]:
    """Per (regime, N): nitrobrew vs SDPA default and flash (fwd+bwd, fwd), naive/compile vs nitrobrew."""
    speed = [r for r in rows if r.mode == "attention" and "N" in r.size]
    by = {(r.size.get("regime"), r.size["N"], r.method): r for r in speed}
    out = []
    for regime, N in dict.fromkeys((r.size.get("regime"), r.size["N"]) for r in speed):

        def ms(m):
            r = by.get((regime, N, m))
            return None if r is None else r.ms

        def div(a, b):
            return None if (a is None or b is None) else a / b

        nb = by.get((regime, N, "nitrobrew"))
        ent = next(r.extra.get("teacher_entropy") for r in speed if (r.size.get("regime"), r.size["N"]) == (regime, N))
        out.append(
            dict(
                regime=regime,
                N=N,
                entropy=ent,
                nb=ms("nitrobrew"),
                nb_fwd=ms("nitrobrew-fwd"),
                sdpa=ms("sdpa"),
                sdpa_fwd=ms("sdpa-fwd"),
                flash=ms("sdpa-flash"),
                flash_fwd=ms("sdpa-flash-fwd"),
                naive=ms("naive"),
                compile=ms("compile"),
                fb_vs_sdpa=div(ms("nitrobrew"), ms("sdpa")),
                fwd_vs_sdpa=div(ms("nitrobrew-fwd"), ms("sdpa-fwd")),
                fb_vs_flash=div(ms("nitrobrew"), ms("sdpa-flash")),
                fwd_vs_flash=div(ms("nitrobrew-fwd"), ms("sdpa-flash-fwd")),
                naive_vs_nb=div(ms("naive"), ms("nitrobrew")),
                compile_vs_nb=div(ms("compile"), ms("nitrobrew")),
                nb_mib=nb.peak_mib if nb else None,
                stats_mib=nb.extra.get("stats_mib") if nb else None,
                notes={m: by[(regime, N, m)].note for m in METHODS if (regime, N, m) in by and by[(regime, N, m)].note},
            )
        )
    return out


def markdown(rows: List[Row], env: Dict[str, str], args, cfg, checks) -> str:
    lines = [
        f"# attention_kl benchmark ({env.get('device')})",
        "",
        f"torch {env.get('torch')}, triton {env.get('triton')}, nitrobrew {env.get('nitrobrew')}, "
        f"commit {env.get('commit')}; "
        f"B={args.batch}, H={args.heads}, D={args.head_dim}, {args.dtype}, "
        f"{'non-causal' if args.no_causal else 'causal'}, direction={args.direction}; tiles {cfg}",
        "",
        f"SDPA default backend dispatched to: {env.get('sdpa_default', '-')} (forward alone: "
        f"{env.get('sdpa_default_fwd', '-')}). Ratios are nitrobrew / SDPA (above 1: nitrobrew slower).",
        "",
        "| regime (teacher row entropy) | N | nitrobrew fwd+bwd ms | SDPA default fwd+bwd ms | ratio | "
        "SDPA flash fwd+bwd ms | ratio | nitrobrew fwd ms | SDPA default fwd ms | ratio | SDPA flash fwd ms | "
        "ratio | naive ms (x nitrobrew) | compile ms (x nitrobrew) | nitrobrew extra MiB (per-row stats MiB) |",
        "|" + "---|" * 15,
    ]

    def f(x, p=2):
        return "-" if x is None else f"{x:.{p}f}"

    for r in ratios(rows):
        naive = r["notes"].get("naive") or f"{f(r['naive'])} ({f(r['naive_vs_nb'], 1)}x)"
        comp = r["notes"].get("compile") or f"{f(r['compile'])} ({f(r['compile_vs_nb'], 1)}x)"
        lines.append(
            f"| {rg.entropy_label(r['regime'], r['entropy'])} | {r['N']} | {f(r['nb'])} | {f(r['sdpa'])} | "
            f"{f(r['fb_vs_sdpa'])} | {f(r['flash'])} | {f(r['fb_vs_flash'])} | {f(r['nb_fwd'])} | "
            f"{f(r['sdpa_fwd'])} | {f(r['fwd_vs_sdpa'])} | {f(r['flash_fwd'])} | {f(r['fwd_vs_flash'])} | "
            f"{naive} | {comp} | {f(r['nb_mib'], 1)} ({f(r['stats_mib'], 1)}) |"
        )
    acc = [r for r in rows if r.mode == "accuracy"]
    if acc:
        lines += [
            "",
            "Accuracy vs float64 (relative error, norm):",
            "",
            "| method | N | loss | dq_s | dk_s |",
            "|---|---|---|---|---|",
        ]
        for r in acc:
            lines.append(
                f"| {r.method} | {r.size['N']} | {r.extra.get('loss_rel_err', '-'):.2e} | "
                f"{r.extra.get('grad_q_rel_err', float('nan')):.2e} | "
                f"{r.extra.get('grad_k_rel_err', float('nan')):.2e} |"
                if r.rel_err is not None
                else f"| {r.method} | {r.size['N']} | {r.note} | | |"
            )
    tune_rows = [r for r in rows if r.mode == "tune"]
    if tune_rows:
        lines += ["", f"Tile sweep at N={args.tune_n} (ms, model TFLOP/s):", ""]
        lines += [
            f"- {r.method}: {_fmt(r.ms)} ms"
            f"{'' if 'tflops' not in r.extra else ' (%.0f TFLOP/s)' % r.extra['tflops']} {r.note}"
            for r in tune_rows
        ]
    if checks:
        lines += ["", "GPU correctness battery (compiled kernels vs float64):", ""]
        for c in checks:
            lines.append(
                f"- {'PASS' if c.get('ok') else 'FAIL'} {c['name']}: loss {c.get('loss_err', '-')}, "
                f"grads {c.get('grad_err', '-')} {c.get('error', '')}"
            )
    return "\n".join(lines) + "\n"


def run(args) -> int:
    t0 = time.time()
    try:
        args.regimes = rg.parse(args.regimes)
    except ValueError as err:
        raise SystemExit(f"nitrobrew bench: {err}") from None
    dev = cuda_device(args.device)
    d = GPU_DEFAULTS if dev.type == "cuda" else CPU_DEFAULTS
    for k, v in d.items():
        if getattr(args, k, None) is None:
            setattr(args, k, v)
    check_sizes(
        "nitrobrew bench attention",
        seq_lens=(args.seq_lens, 1),
        heads=(args.heads, 1),
        head_dim=(args.head_dim, 1),
        batch=(args.batch, 1),
        reps=(args.reps, 1),
        warmup=(args.warmup, 0),
        accuracy_n=(args.accuracy_n, 0),
        kv_heads=(args.kv_heads or args.heads, 1),
    )
    if args.heads % (args.kv_heads or args.heads):
        raise SystemExit(f"nitrobrew bench attention: --kv-heads {args.kv_heads} must divide --heads {args.heads}")
    dtype = DTYPES[args.dtype]
    B, H, D = args.batch, args.heads, args.head_dim
    Hkv = args.kv_heads or H
    causal = not args.no_causal
    if args.methods:
        methods = list(args.methods)
    elif dev.type == "cuda":
        methods = ["nitrobrew", "nitrobrew-fwd", "sdpa", "sdpa-fwd", "sdpa-flash", "sdpa-flash-fwd", "naive", "compile"]
    else:
        methods = ["nitrobrew", "nitrobrew-fwd", "sdpa", "sdpa-fwd", "sdpa-flash", "sdpa-flash-fwd", "naive"]
    env = environment()
    print("env: " + ", ".join(f"{k}={v}" for k, v in env.items()), flush=True)
    for path in (args.csv, args.plot, args.md):
        if path:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    rows: List[Row] = []
    checks: List[Dict] = []
    cfg: Optional[Dict] = None
    if dev.type == "cuda" and (args.check or args.warm):
        warm = []
        if args.warm:
            n = max(len(v) for v in TUNE.values()) if args.tune else 1
            for i in range(n):
                triple = {k: TUNE[k][min(i, len(TUNE[k]) - 1)] for k in TUNE}
                warm.append(("triton", triple, B, H, Hkv, D, args.dtype, causal, args.direction))
            if "compile" in methods:
                warm.append(("compile", None, B, H, Hkv, D, args.dtype, causal, args.direction))
        t1 = time.time()
        checks, warmed = _parallel(CHECK_CASES if args.check else [], warm)
        for line in warmed:
            print("  " + line, flush=True)
        for c in checks:
            print(
                f"  check {'PASS' if c.get('ok') else 'FAIL'} {c['name']}: loss {c.get('loss_err')}, "
                f"grads {c.get('grad_err')} {c.get('error', '')}",
                flush=True,
            )
        print(f"parallel checks / compile warm-up: {time.time() - t1:.1f} s", flush=True)
    if dev.type == "cuda" and args.tune:
        cfg, tune_rows = tune(args, dev, dtype, B, H, Hkv=Hkv, D=D, causal=causal)
        rows += tune_rows
    if args.accuracy_n:
        rows += accuracy(args, dev, dtype, B, H, Hkv=Hkv, D=D, causal=causal, methods=methods, cfg=cfg)
    rows += run_speed(args, dev, dtype, B, H, Hkv=Hkv, D=D, causal=causal, methods=methods, cfg=cfg, env=env)
    print_table([r for r in rows if r.mode == "attention"], ["regime", "N", "B", "H", "D"])
    print(f"SDPA default backend: {env.get('sdpa_default', '-')}")
    for r in ratios(rows):
        print(
            f"{r['regime']} N={r['N']}: fwd+bwd / SDPA default = {_fmt(r['fb_vs_sdpa'])} (/ flash "
            f"{_fmt(r['fb_vs_flash'])}), fwd / SDPA default fwd = {_fmt(r['fwd_vs_sdpa'])} (/ flash "
            f"{_fmt(r['fwd_vs_flash'])}), naive / nitrobrew = {_fmt(r['naive_vs_nb'])}, "
            f"compile / nitrobrew = {_fmt(r['compile_vs_nb'])}"
        )
    if args.csv:
        write_csv(args.csv, rows, env)
        print(f"wrote {args.csv}")
    if args.md:
        with open(args.md, "w") as f:
            f.write(markdown(rows, env, args, cfg, checks))
        print(f"wrote {args.md}")
    if args.plot:
        speed = [r for r in rows if r.mode == "attention" and r.ms is not None]
        if speed:
            plot(
                args.plot,
                per_regime(speed),
                "N",
                f"attention_kl vs baselines, {env.get('device')}, B={B} H={H} D={D} "
                f"{args.dtype} {'causal' if causal else 'non-causal'}",
            )
    print(f"bench attention: {time.time() - t0:.1f} s")
    bad = failed(rows)
    for r in bad:
        print(f"FAILED: {r.method} at N={r.size.get('N')} ({r.size.get('regime')}): {r.note}")
    return 1 if bad or any(not c.get("ok") for c in checks) else 0
