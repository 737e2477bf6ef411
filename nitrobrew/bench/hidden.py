"""`nitrobrew bench` / `nitrobrew bench hidden`: the hidden-state losses against their baselines.

For each N in --seq-lens (V = --vocab, Ds, Dt = --d-models), one process, the same inputs for
every method (docs/design.md §8): forward_kl fwd+bwd (gradients to xs and ws) of

  gemm floor            the four bare GEMMs (s, t, dX = G ws, dW = G^T xs), the speed floor
  naive                 both logit sets materialized in the input dtype (as an lm_head returns
                        them), upcast to fp32 for log_softmax, F.kl_div, autograd
  naive+compile         the same under torch.compile (compile time excluded: first call)
  liger chunked         liger-kernel LigerFusedLinearJSDLoss, beta=0 (= forward KL)
  liger fused           liger-kernel LigerFusedLinearJSD, jsd_beta=0 (= forward KL)
  cce (student CE only) cut-cross-entropy linear_cross_entropy of the student, random labels
  nitrobrew torch       nitrobrew.hidden_loss(backend="torch") (vocab-chunked PyTorch)
  nitrobrew fast        nitrobrew.hidden_loss(backend="triton", mode="fast")
  nitrobrew const-mem   nitrobrew.hidden_loss(backend="triton", mode="constant_memory")
  ... + filter          the same two with grad_filter=True (not in the default set: its gain
                        depends on the data; measure it with --regimes lm flat spread peaked)

Columns: ms = median fwd+bwd wall time (CUDA events; perf_counter on CPU) after warm-up;
x floor = ms / the gemm floor's ms at the same N; peak MiB = peak allocated memory during one
fwd+bwd minus what was allocated before it (inputs and their gradients already allocated;
CUDA allocator stats on GPU, live-tensor tracking on CPU); err loss / err dX / err dW = relative
error of the method run on the first --ref-rows rows of the same inputs against float64
autograd of the same (dtype-rounded) inputs: |L - L64| / |L64| for the loss, Frobenius
||G - G64|| / ||G64|| for dX and dW (rel_err in the CSV is the largest of the three); for cce
the reference is the student's float64 cross-entropy. first s = wall time of the method's first
call, the slower of the first on the accuracy rows and the first on all N rows (so it includes
torch.compile / Triton autotuning). vs fkl = ms / the same method's forward_kl
ms (the "other divergences within 1.15x" check, --divergences all).

--regimes (default lm) names the input regimes (nitrobrew.bench.regimes: flat spread lm peaked
close real demo, or all); every method runs on the same tensors of each, and each row carries the
regime and the teacher's measured mean entropy. baseline = the package, version and
configuration of what ran. The exit status is 1 when a method failed (not skipped, not OOM).
"""

from __future__ import annotations

import argparse
import gc
import importlib
import math
import os
import time
import traceback
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

import torch

from .. import divergences as dv
from . import baselines as bl
from . import regimes as rg
from .common import (
    Row,
    check_sizes,
    environment,
    failed,
    is_oom,
    nitrobrew_version,
    package_version,
    peak_mib,
    per_regime,
    plot,
    time_ms,
    triton_unavailable,
    write_csv,
    write_markdown,
)

METHODS: Dict[str, str] = {
    "floor": "gemm floor",
    "naive": "naive",
    "compile": "naive+compile",
    "liger-chunked": "liger chunked",
    "liger-fused": "liger fused",
    "cce": "cce (student CE only)",
    "torch": "nitrobrew torch",
    "fast": "nitrobrew fast",
    "const-mem": "nitrobrew const-mem",
    "fast-filter": "nitrobrew fast + filter",
    "const-filter": "nitrobrew const-mem + filter",
}
NITROBREW = ("torch", "fast", "const-mem", "fast-filter", "const-filter")
OPT_IN = ("fast-filter", "const-filter")  # run only when named in --methods
DIVERGENCES = dv.NAMES
# each divergence's parameter at its documented default (the registry's)
PARAMS = {d.name: d.default for d in dv.REGISTRY.values() if d.param is not None}
REGIMES = rg.REGIMES
DTYPES = {
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "float32": torch.float32,
    "fp32": torch.float32,
}

GPU_DEFAULTS = dict(
    vocab=152064, seq_lens=[1024, 4096, 8192, 16384], d_models=[3584, 5120], dtype="bfloat16", reps=10, warmup=3
)
CPU_DEFAULTS = dict(vocab=8192, seq_lens=[128, 512], d_models=[128, 192], dtype="float32", reps=3, warmup=1)

PEAKED_ENTROPY = rg.PEAKED_ENTROPY


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.description = __doc__.split("\n\n")[0]
    p.epilog = "Defaults depend on the device: GPU %s; CPU %s." % (
        _fmt_defaults(GPU_DEFAULTS),
        _fmt_defaults(CPU_DEFAULTS),
    )
    p.add_argument("--vocab", type=int, default=None, help="vocabulary size V")
    p.add_argument(
        "--seq-lens", type=int, nargs="+", default=None, metavar="N", help="numbers of rows (tokens) N to measure"
    )
    p.add_argument(
        "--d-models", type=int, nargs=2, default=None, metavar=("DS", "DT"), help="student and teacher hidden sizes"
    )
    p.add_argument(
        "--divergences",
        nargs="+",
        default=["forward_kl"],
        metavar="DIV",
        help="divergences for the nitrobrew methods ('all' = all six; baselines run forward_kl only)",
    )
    p.add_argument(
        "--regimes",
        nargs="+",
        default=["lm"],
        metavar="REGIME",
        help="input regimes, each timed and checked on the same tensors for every method: "
        "%s, or all (default lm)" % " ".join(REGIMES),
    )
    p.add_argument(
        "--methods",
        nargs="+",
        default=None,
        choices=list(METHODS),
        metavar="METHOD",
        help="subset of: " + ", ".join(METHODS),
    )
    p.add_argument("--csv", default=None, metavar="PATH", help="write every row as CSV")
    p.add_argument("--md", default=None, metavar="PATH", help="write the rows as a markdown table")
    p.add_argument(
        "--plot", default=None, metavar="PATH", help="PNG of time and memory vs N per method (needs matplotlib)"
    )
    p.add_argument("--device", default="auto", help="auto (cuda if available), cuda, cpu")
    p.add_argument(
        "--dtype", default=None, choices=sorted(DTYPES), help="input dtype (bfloat16 on GPU, float32 on CPU)"
    )
    p.add_argument("--reps", type=int, default=None, help="timed repetitions (median)")
    p.add_argument("--warmup", type=int, default=None, help="untimed calls before timing")
    p.add_argument("--ref-rows", type=int, default=256, help="rows of the float64 accuracy check (0: skip it)")
    p.add_argument(
        "--chunk-v", type=int, default=None, help="chunk_V passed to the nitrobrew methods (default: automatic)"
    )
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument(
        "--grad-filter",
        type=float,
        default=None,
        metavar="EPS",
        help="threshold of the *-filter methods (default: the dtype's, 2^-8 for bf16)",
    )
    p.add_argument("--seed", type=int, default=0)


def _fmt_defaults(d: dict) -> str:
    return "V=%d, N %s, d-models %s, %s, reps %d, warmup %d" % (
        d["vocab"],
        " ".join(map(str, d["seq_lens"])),
        " ".join(map(str, d["d_models"])),
        d["dtype"],
        d["reps"],
        d["warmup"],
    )


# ---------------------------------------------------------------- data

Data = rg.Data
make_data = rg.make_hidden


def teacher_entropy(d: Data, rows: int) -> float:
    """Mean entropy (nats) of the teacher's distribution over the first `rows` rows, float64."""
    return rg.teacher_entropy(d.xt, d.wt, rows)


# ---------------------------------------------------------------- methods


def _nitro_call(key: str, chunk_v: Optional[int], filter_eps: Optional[float] = None):
    import nitrobrew

    backend, mode = {
        "torch": ("torch", None),
        "fast": ("triton", "fast"),
        "fast-filter": ("triton", "fast"),
        "const-mem": ("triton", "constant_memory"),
        "const-filter": ("triton", "constant_memory"),
    }[key]
    grad_filter = (filter_eps or True) if key in ("fast-filter", "const-filter") else False

    def call(xs, xt, ws, wt, labels, divergence, temperature):
        entry = dv.REGISTRY[divergence]
        kw = {} if entry.param is None else {entry.param: PARAMS[divergence]}
        return nitrobrew.hidden_loss(
            xs,
            xt,
            ws,
            wt,
            divergence=divergence,
            temperature=temperature,
            backend=backend,
            mode=mode,
            chunk_V=chunk_v,
            grad_filter=grad_filter,
            **kw,
        )

    return call


def _loss_fn(key: str, chunk_v: Optional[int], device: torch.device, filter_eps: Optional[float] = None):
    """(xs, xt, ws, wt, labels, divergence, temperature) -> scalar loss, for every loss method."""
    if key in NITROBREW:
        return _nitro_call(key, chunk_v, filter_eps)
    if key == "naive":
        return lambda xs, xt, ws, wt, labels, divergence, temperature: bl.naive_loss(
            xs, xt, ws, wt, divergence=divergence, param=PARAMS.get(divergence, 0.0), temperature=temperature
        )
    if key == "compile":
        fn = bl.naive_compiled()
        return lambda xs, xt, ws, wt, labels, divergence, temperature: fn(
            xs, xt, ws, wt, divergence=divergence, param=PARAMS.get(divergence, 0.0), temperature=temperature
        )
    if key == "liger-chunked":
        compiled = device.type == "cuda"
        return lambda xs, xt, ws, wt, labels, divergence, temperature: bl.liger_chunked(
            xs, xt, ws, wt, labels, temperature=temperature, compiled=compiled
        )
    if key == "liger-fused":
        return lambda xs, xt, ws, wt, labels, divergence, temperature: bl.liger_fused(xs, xt, ws, wt, temperature)
    if key == "cce":
        return lambda xs, xt, ws, wt, labels, divergence, temperature: bl.cce_student_ce(xs, ws, labels)
    raise KeyError(key)


def unavailable(key: str, device: torch.device, explicit: bool) -> Optional[str]:
    """Why a method is skipped here (None: run it)."""
    if key == "compile":
        if device.type != "cuda" and not explicit:
            return "skipped on CPU (slow to compile; --methods compile forces it)"
        return bl.compile_unavailable(device)
    if key in ("liger-chunked", "liger-fused"):
        return bl.liger_unavailable(device, fused=key == "liger-fused")
    if key == "cce":
        return bl.cce_unavailable(device)
    if key in ("fast", "const-mem", "fast-filter", "const-filter"):
        why = triton_unavailable(device)
        if why:
            return why
        if device.type != "cuda" and not explicit:
            return "skipped on CPU (interpreted Triton is slow; --methods fast/const-mem forces it)"
        try:
            importlib.import_module("nitrobrew.hidden.triton_function")
        except Exception as err:
            return f"skipped: triton backend not available ({type(err).__name__}: {err})"[:160]
    return None


def supports(key: str, divergence: str) -> bool:
    return key in NITROBREW or divergence == "forward_kl"


# ---------------------------------------------------------------- accuracy


@dataclass
class Reference:
    loss: float
    dx: torch.Tensor
    dw: torch.Tensor


def reference(d: Data, rows: int, divergence: str, temperature: float, ce: bool = False) -> Reference:
    """float64 autograd of the loss on the first `rows` rows (the same rounded inputs)."""
    from ..hidden.reference import reference_loss

    xs = d.xs[:rows].detach().double().requires_grad_()
    ws = d.ws.detach().double().requires_grad_()
    if ce:
        loss = bl.ce_reference(xs, ws, d.labels[:rows])
    else:
        loss = reference_loss(
            xs,
            d.xt[:rows].detach().double(),
            ws,
            d.wt.detach().double(),
            divergence=divergence,
            param=PARAMS.get(divergence, 0.0),
            temperature=temperature,
        )
    loss.backward()
    # Kept while the methods run: a big head's float64 gradient goes down to float32 (rounding
    # 6e-8 relative, far below any error measured) so that it takes less of the device.
    dw = ws.grad if ws.grad.numel() * 8 <= 2**28 else ws.grad.float()
    return Reference(float(loss.detach()), xs.grad, dw)


def _rel(a: torch.Tensor, ref: torch.Tensor, block: int = 4096) -> float:
    """||a - ref|| / ||ref|| in float64, on a's device, in row blocks (no full float64 copy)."""
    num = den = 0.0
    for r0 in range(0, ref.shape[0], block):
        r = ref[r0 : r0 + block]
        num += float((a[r0 : r0 + block].double() - r).pow(2).sum())
        den += float(r.pow(2).sum())
    return math.sqrt(num) / max(math.sqrt(den), 1e-300)


def accuracy(fn, d: Data, rows: int, divergence: str, temperature: float, ref: Reference) -> Dict[str, float]:
    """Run fn on the first `rows` rows (fresh leaves; ws's grad set aside) and compare."""
    xs = d.xs[:rows].detach().requires_grad_()
    saved = d.ws.grad
    d.ws.grad = None
    try:
        loss = fn(xs, d.xt[:rows], d.ws, d.wt, d.labels[:rows], divergence=divergence, temperature=temperature)
        loss.backward()
        val = float(loss.detach())
        out = {
            "loss": val,
            "err_loss": abs(val - ref.loss) / max(abs(ref.loss), 1e-300),
            "err_dx": _rel(xs.grad, ref.dx),
            "err_dw": _rel(d.ws.grad, ref.dw),
        }
    finally:
        d.ws.grad = saved
    if not all(math.isfinite(v) for v in out.values()):
        out = {k: (v if math.isfinite(v) else float("nan")) for k, v in out.items()}
    return out


# ---------------------------------------------------------------- the run


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _describe(err: BaseException) -> str:
    if is_oom(err):
        return "OOM"
    if isinstance(err, (NotImplementedError, ImportError)):
        return f"skipped: {type(err).__name__}: {err}"[:160]
    return f"error: {type(err).__name__}: {err}".replace("\n", " ")[:160]


def _resolve(args) -> Tuple[torch.device, dict]:
    dev = args.device
    if dev == "auto":
        dev = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(dev)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device visible")
    defaults = GPU_DEFAULTS if device.type == "cuda" else CPU_DEFAULTS
    cfg = {k: getattr(args, k) if getattr(args, k) is not None else v for k, v in defaults.items()}
    check_sizes(
        "nitrobrew bench",
        vocab=(cfg["vocab"], 2),
        seq_lens=(cfg["seq_lens"], 1),
        d_models=(cfg["d_models"], 2),
        reps=(cfg["reps"], 1),
        warmup=(cfg["warmup"], 0),
        ref_rows=(args.ref_rows, 0),
    )
    return device, cfg


def _divergences(names: List[str]) -> List[str]:
    if "all" in names:
        return list(DIVERGENCES)
    for n in names:
        if n not in DIVERGENCES:
            raise SystemExit(f"unknown divergence {n!r}; choose from {', '.join(DIVERGENCES)} or all")
    return list(dict.fromkeys(names))


def _regimes(names: List[str]) -> List[str]:
    try:
        return rg.parse(names)
    except ValueError as err:
        raise SystemExit(f"nitrobrew bench: {err}") from None


def baseline(key: str, device: torch.device, filter_eps: Optional[float] = None) -> str:
    """Package, version and configuration of a method, recorded with its rows."""
    tv = torch.__version__
    if key in NITROBREW:
        how = {
            "torch": "hidden_loss(backend='torch')",
            "fast": "hidden_loss(mode='fast')",
            "const-mem": "hidden_loss(mode='constant_memory')",
            "fast-filter": f"hidden_loss(mode='fast', grad_filter={filter_eps or True})",
            "const-filter": f"hidden_loss(mode='constant_memory', grad_filter={filter_eps or True})",
        }[key]
        return f"nitrobrew {nitrobrew_version()} {how}"
    if key == "floor":
        return f"torch {tv} matmul (4 GEMMs)"
    if key == "naive":
        return f"torch {tv} eager: logits, fp32 log_softmax, F.kl_div"
    if key == "compile":
        return f"torch {tv} torch.compile(naive, dynamic=False), default mode"
    lk = package_version("liger-kernel")
    if key == "liger-chunked":
        return (
            f"liger-kernel {lk} LigerFusedLinearJSDLoss(beta=0, weight_soft_loss=1, chunk_size=1024, "
            f"compiled={device.type == 'cuda'})"
        )
    if key == "liger-fused":
        return f"liger-kernel {lk} LigerFusedLinearJSD(jsd_beta=0)"
    if key == "cce":
        return f"cut-cross-entropy {package_version('cut-cross-entropy')} linear_cross_entropy, defaults"
    return ""


def run(args) -> int:
    try:
        return _run(args)
    finally:
        gc.unfreeze()


def _freeze_imports() -> None:
    """Import what the measurements would import lazily, then move every object alive now out
    of the collector's view: the many gc.collect() calls between measurements (memory
    accounting) then skip the ~10^5 objects of torch, sympy and triton (0.25 s each)."""
    for name in ("torch._dynamo", "triton", "nitrobrew.hidden.reference"):
        try:
            importlib.import_module(name)
        except Exception:
            pass
    gc.collect()
    gc.freeze()


def _run(args) -> int:
    device, cfg = _resolve(args)
    dtype = DTYPES[cfg["dtype"]]
    vocab, seq_lens, (ds, dt) = cfg["vocab"], cfg["seq_lens"], cfg["d_models"]
    reps, warmup = max(1, cfg["reps"]), max(0, cfg["warmup"])
    divs = _divergences(args.divergences)
    regimes = _regimes(args.regimes)
    explicit = args.methods is not None
    keys = list(dict.fromkeys(args.methods)) if explicit else [k for k in METHODS if k not in OPT_IN]
    T = float(args.temperature)

    env = environment()
    env["liger_kernel"], env["cut_cross_entropy"] = bl.liger_versions()
    env["dtype"] = str(dtype).replace("torch.", "")
    print("nitrobrew bench hidden: " + ", ".join(f"{k}={v}" for k, v in sorted(env.items())))
    print(
        f"V={vocab} Ds={ds} Dt={dt} N={seq_lens} divergences={divs} methods={keys} "
        f"reps={reps} warmup={warmup} ref_rows={args.ref_rows} regimes={regimes}",
        flush=True,
    )

    skip = {k: unavailable(k, device, explicit) for k in keys}
    _freeze_imports()
    rows: List[Row] = []

    def flush_csv():
        if args.csv:
            write_csv(args.csv, rows, env)

    def measure_size(rows, data, n, regime, flush_csv):
        n = data.xs.shape[0]  # the demo regime brings its own sizes
        ref_rows = min(args.ref_rows, n)
        size_base = {"regime": regime, "N": n, "V": data.ws.shape[0], "Ds": data.xs.shape[1], "Dt": data.xt.shape[1]}
        floor_ms = None
        fkl_ms: Dict[str, float] = {}
        for div in divs:
            size = {**size_base, "divergence": div}
            refs: Dict[bool, Optional[Reference]] = {}
            for key in keys:
                if not supports(key, div):
                    continue
                if key == "floor" and div != divs[0]:
                    continue
                row = Row(
                    mode="hidden",
                    method=METHODS[key],
                    size=dict(size),
                    extra={"teacher_entropy": data.entropy},
                    baseline=baseline(key, device, args.grad_filter),
                )
                rows.append(row)
                if skip[key]:
                    row.note = skip[key]
                    _report(row)
                    continue
                try:
                    if key == "floor":
                        _time_floor(row, data, device, dtype, warmup=warmup, reps=reps)
                        floor_ms = row.ms
                        row.size["divergence"] = "-"
                    else:
                        fn = _loss_fn(key, args.chunk_v, device, args.grad_filter)
                        acc_s = 0.0
                        if ref_rows > 0:
                            ce = key == "cce"
                            if ce not in refs:
                                refs[ce] = reference(data, ref_rows, div, T, ce=ce)
                                _free(device)
                            t0 = time.perf_counter()
                            acc = accuracy(fn, data, ref_rows, div, T, ref=refs[ce])
                            acc_s = time.perf_counter() - t0
                            row.extra.update(acc)
                            row.rel_err = max(acc["err_loss"], acc["err_dx"], acc["err_dw"])
                            _free(device)
                        _time_loss(row, fn, data, div, T, device=device, warmup=warmup, reps=reps)
                        row.extra["first_s"] = max(row.extra["first_s"], acc_s)
                        if key == "cce":
                            row.note = (row.note + "; " if row.note else "") + "student CE only, not KD"
                except Exception as err:  # keep measuring the others
                    row.note = _describe(err)
                    if not is_oom(err) and os.environ.get("NITROBREW_BENCH_DEBUG"):
                        traceback.print_exc()
                finally:
                    data.xs.grad = None
                    data.ws.grad = None
                    _free(device)
                if row.ms is not None and floor_ms:
                    row.extra["x_floor"] = row.ms / floor_ms
                if row.ms is not None and key in NITROBREW:
                    if div == "forward_kl":
                        fkl_ms[key] = row.ms
                    if key in fkl_ms:
                        row.extra["vs_fkl"] = row.ms / fkl_ms[key]
                _report(row)
                flush_csv()
            refs.clear()

    for regime in regimes:
        for n in seq_lens:
            _free(device)
            try:
                data = make_data(regime, n, vocab, ds, dt, dtype=dtype, device=device, seed=args.seed)
            except rg.RegimeUnavailable as err:
                print(f"regime {regime}: skipped ({err})", flush=True)
                rows.append(Row(mode="hidden", method="-", size={"N": n, "regime": regime}, note=f"skipped: {err}"))
                break
            print(f"regime {regime}: mean teacher entropy {data.entropy:.2f} nats (V={vocab}, N={n})", flush=True)
            measure_size(rows, data, n, regime, flush_csv)
            del data
            _free(device)

    print()
    print_hidden_table(rows, show_vs_fkl=len(divs) > 1)
    if len(divs) > 1:
        print_divergence_check(rows)
    print(
        "\nms: median fwd+bwd; x floor: ms / gemm floor ms; peak MiB: above inputs+grads; "
        f"err: relative error on the first {args.ref_rows} rows vs float64 autograd of the same "
        "inputs (loss |dL|/|L|, dX and dW Frobenius)"
    )
    if args.csv:
        write_csv(args.csv, rows, env)
        print(f"wrote {args.csv}")
    if args.md:
        write_markdown(
            args.md,
            f"nitrobrew bench hidden: V={vocab} Ds={ds} Dt={dt}",
            rows,
            ["regime", "N", "divergence"],
            env,
            extras=("teacher_entropy", "x_floor"),
        )
        print(f"wrote {args.md}")
    if args.plot:
        pts = [r for r in rows if r.size.get("divergence") in ("forward_kl", "-") and r.ms is not None]
        pts = per_regime(pts)
        out = plot(
            args.plot,
            pts,
            "N",
            f"hidden-state loss fwd+bwd, V={vocab} Ds={ds} Dt={dt} {env['dtype']}, "
            f"{env['device']}, torch {env['torch']}, commit {env['commit']}",
        )
        if out:
            print(f"wrote {out}")
    bad = failed(rows)
    for r in bad:
        print(f"FAILED: {r.method} at N={r.size.get('N')} ({r.size.get('regime')}): {r.note}")
    return 1 if bad else 0


def _time_floor(row: Row, d: Data, device, dtype, warmup: int, reps: int) -> None:
    n, vocab = d.xs.shape[0], d.ws.shape[0]
    elem = torch.empty((), dtype=dtype).element_size()
    chunk = bl.floor_chunk_rows(n, vocab, elem, device)
    gen = torch.Generator(device=device)
    gen.manual_seed(1234)
    g = torch.randn(chunk, vocab, generator=gen, device=device, dtype=dtype)
    xs, ws = d.xs.detach(), d.ws.detach()

    def fn():
        bl.gemm_floor(xs, d.xt, ws, d.wt, g)

    _measure(row, fn, device, warmup, reps)
    if chunk < n:
        row.note = f"row-chunked by {chunk} (the [N, V] tensors do not fit)"
    del g


def _time_loss(row: Row, fn, d: Data, div: str, T: float, device, warmup: int, reps: int) -> None:
    d.xs.grad = torch.zeros_like(d.xs)  # gradients allocated before, as the protocol says
    d.ws.grad = torch.zeros_like(d.ws)

    def step():
        # The gradients are released and produced afresh by the call: peak memory above the
        # inputs and their (allocated) gradients counts only what the method needs besides them.
        d.xs.grad = None
        d.ws.grad = None
        fn(d.xs, d.xt, d.ws, d.wt, d.labels, divergence=div, temperature=T).backward()

    _measure(row, step, device, warmup, reps)


def _measure(row: Row, fn: Callable[[], object], device, warmup: int, reps: int) -> None:
    """First call timed apart (compilation, autotuning) and counted as one warm-up call."""
    _sync(device)
    t0 = time.perf_counter()
    fn()
    _sync(device)
    row.extra["first_s"] = time.perf_counter() - t0
    row.ms = time_ms(fn, device, warmup=max(0, warmup - 1), reps=reps)
    row.peak_mib = peak_mib(fn, device)


# ---------------------------------------------------------------- printing


def _f(v: Optional[float], fmt: str) -> str:
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, fmt)


def _report(row: Row) -> None:
    s = row.size
    parts = [f"{s.get('regime')} N={s.get('N')}", f"{s.get('divergence')}", f"{row.method}:"]
    if row.ms is not None:
        parts.append(f"{row.ms:.2f} ms")
        if "x_floor" in row.extra:
            parts.append(f"({row.extra['x_floor']:.2f}x floor)")
        parts.append(f"peak {_f(row.peak_mib, '.1f')} MiB")
    if row.rel_err is not None:
        parts.append(f"err {row.rel_err:.1e}")
    if row.note:
        parts.append(f"[{row.note}]")
    print("  " + " ".join(parts), flush=True)


def _table(header: List[str], body: List[List[str]]) -> str:
    widths = [max(len(h), *(len(b[i]) for b in body)) if body else len(h) for i, h in enumerate(header)]
    fmt = "  ".join("{:<%d}" % w for w in widths)
    lines = [fmt.format(*header), fmt.format(*("-" * w for w in widths))]
    lines += [fmt.format(*b).rstrip() for b in body]
    text = "\n".join(lines)
    print(text)
    return text


def print_hidden_table(rows: List[Row], show_vs_fkl: bool = False) -> str:
    header = [
        "regime",
        "H_t",
        "N",
        "V",
        "Ds",
        "Dt",
        "divergence",
        "method",
        "ms",
        "x floor",
        "peak MiB",
        "err loss",
        "err dX",
        "err dW",
        "first s",
    ]
    if show_vs_fkl:
        header.append("vs fkl")
    header.append("note")
    body = []
    for r in rows:
        e = r.extra
        line = (
            [str(r.size.get("regime", "")), _f(e.get("teacher_entropy"), ".2f")]
            + [str(r.size.get(k, "")) for k in ("N", "V", "Ds", "Dt", "divergence")]
            + [
                r.method,
                _f(r.ms, ".2f"),
                _f(e.get("x_floor"), ".2f"),
                _f(r.peak_mib, ".1f"),
                _f(e.get("err_loss"), ".1e"),
                _f(e.get("err_dx"), ".1e"),
                _f(e.get("err_dw"), ".1e"),
                _f(e.get("first_s"), ".1f"),
            ]
        )
        if show_vs_fkl:
            line.append(_f(e.get("vs_fkl"), ".2f"))
        line.append(r.note)
        body.append(line)
    return _table(header, body)


def print_divergence_check(rows: List[Row], limit: float = 1.15) -> None:
    worst: Dict[str, Tuple[float, str]] = {}
    for r in rows:
        v = r.extra.get("vs_fkl")
        if v is not None and r.size.get("divergence") != "forward_kl":
            tag = f"{r.size['divergence']} at N={r.size['N']} ({r.size.get('regime')})"
            if r.method not in worst or v > worst[r.method][0]:
                worst[r.method] = (v, tag)
    for method, (v, tag) in worst.items():
        verdict = "ok" if v <= limit else "OVER"
        print(f"other divergences vs forward_kl, {method}: worst {v:.2f}x ({tag}) -> {verdict} (limit {limit}x)")
