"""Timing, memory and reporting helpers shared by every benchmark mode (docs/design.md §8 protocol)."""

from __future__ import annotations

import csv
import os
import statistics
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence

import torch

from ..core.memory import peak_mib  # noqa: F401  (re-exported for the harnesses)
from ..environment import environment, nitrobrew_commit, nitrobrew_version, package_version  # noqa: F401


@dataclass
class Row:
    """One measured method at one problem size."""

    mode: str
    method: str
    size: Dict[str, int]
    ms: Optional[float] = None
    peak_mib: Optional[float] = None
    rel_err: Optional[float] = None
    note: str = ""
    extra: Dict[str, float] = field(default_factory=dict)
    baseline: str = ""  # what ran: package, version, configuration


FAILED = ("error", "failed")  # notes of rows whose method broke (not skipped, not out of memory)


def failed(rows: List[Row]) -> List[Row]:
    """Rows whose method raised: a bench with any exits non-zero."""
    return [r for r in rows if r.note.split(":")[0].strip().lower() in FAILED]


def check_sizes(prog: str, **limits) -> None:
    """Refuse bad sizes before any work, as one line: name=(value or list, smallest allowed)."""
    for name, (value, least) in limits.items():
        for v in value if isinstance(value, (list, tuple)) else [value]:
            if isinstance(v, bool) or not isinstance(v, int) or v < least:
                raise SystemExit(f"{prog}: --{name.replace('_', '-')} must be an integer >= {least}, got {v!r}")


def cuda_device(spec: str) -> torch.device:
    """--device: auto (cuda if available), cuda, cpu; one clear line when CUDA is asked for and absent."""
    dev = torch.device("cuda" if spec == "auto" and torch.cuda.is_available() else ("cpu" if spec == "auto" else spec))
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device visible")
    return dev


def triton_unavailable(device: torch.device) -> Optional[str]:
    """Why nitrobrew's Triton kernels cannot run here (None: they can)."""
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception:
        return "skipped: Triton not installed (pip install triton; the torch methods run without it)"
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        return "skipped: Triton kernels need CUDA (or TRITON_INTERPRET=1 on CPU)"
    return None


def time_ms(fn: Callable[[], object], device: torch.device, warmup: int = 2, reps: int = 5) -> float:
    """Median wall time of fn() in ms: CUDA events on GPU, perf_counter on CPU, after warm-up."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def host_ms(fn: Callable[[], object], reps: int = 20) -> float:
    """Median host time of one call of fn in ms (no synchronization inside it; the GPU is idle at each
    call's start): the time to enqueue its work."""
    out = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1e3)
    torch.cuda.synchronize()
    return statistics.median(out)


def loop_ms(fn: Callable[[], object], calls: int = 20) -> float:
    """Device time per call of `calls` calls of fn back to back, in ms (CUDA events around the block): the
    host's time is hidden where the kernels take longer."""
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / calls


def is_oom(err: BaseException) -> bool:
    return isinstance(err, torch.OutOfMemoryError) or "out of memory" in str(err).lower()


def print_table(rows: List[Row], columns: List[str]) -> str:
    """Fixed-width table of rows; returns the text it printed."""
    lines = []
    header = columns + ["method", "ms", "peak MiB", "rel err", "note"]
    body = []
    for r in rows:
        body.append(
            [str(r.size.get(c, "")) for c in columns]
            + [
                r.method,
                "-" if r.ms is None else f"{r.ms:.2f}",
                "-" if r.peak_mib is None else f"{r.peak_mib:.1f}",
                "-" if r.rel_err is None else f"{r.rel_err:.1e}",
                r.note,
            ]
        )
    widths = [max(len(h), *(len(b[i]) for b in body)) if body else len(h) for i, h in enumerate(header)]
    fmt = "  ".join("{:<%d}" % w for w in widths)
    lines.append(fmt.format(*header))
    lines.append(fmt.format(*("-" * w for w in widths)))
    lines.extend(fmt.format(*b) for b in body)
    text = "\n".join(lines)
    print(text)
    return text


def write_csv(path: str, rows: List[Row], env: Dict[str, str]) -> None:
    size_keys = sorted({k for r in rows for k in r.size})
    extra_keys = sorted({k for r in rows for k in r.extra})
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(
            ["mode", "method", *size_keys, "ms", "peak_mib", "rel_err", *extra_keys, "note", "baseline", *sorted(env)]
        )
        for r in rows:
            w.writerow(
                [
                    r.mode,
                    r.method,
                    *(r.size.get(k, "") for k in size_keys),
                    r.ms,
                    r.peak_mib,
                    r.rel_err,
                    *(r.extra.get(k, "") for k in extra_keys),
                    r.note,
                    r.baseline,
                    *(env[k] for k in sorted(env)),
                ]
            )


def write_markdown(
    path: str, title: str, rows: List[Row], columns: List[str], env: Dict[str, str], extras: Sequence[str] = ()
) -> None:
    """One markdown table of rows (size columns, method, ms, peak MiB, error, extras, baseline),
    headed by the environment line (device, versions, commit)."""

    def f(v, fmt):
        return "-" if v is None or v == "" else (format(v, fmt) if isinstance(v, float) else str(v))

    head = columns + ["method", "ms", "peak MiB", "rel err", *extras, "note", "baseline"]
    lines = [
        f"## {title}",
        "",
        ", ".join(f"{k} {v}" for k, v in sorted(env.items())),
        "",
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
    ]
    for r in rows:
        cells = [str(r.size.get(c, "")) for c in columns] + [
            r.method,
            f(r.ms, ".2f"),
            f(r.peak_mib, ".1f"),
            f(r.rel_err, ".1e"),
            *(f(r.extra.get(e), ".2f" if e == "teacher_entropy" else ".3g") for e in extras),
            r.note.replace("|", "/"),
            r.baseline.replace("|", "/"),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    with open(path, "w") as fh:
        fh.write("\n".join(lines) + "\n")


def per_regime(rows: List[Row]) -> List[Row]:
    """Rows for a plot: with several regimes, one curve per method and regime."""
    if len({r.size.get("regime") for r in rows}) <= 1:
        return rows
    return [Row(r.mode, f"{r.method} [{r.size.get('regime')}]", r.size, r.ms, r.peak_mib) for r in rows]


def plot(path: str, rows: List[Row], x_key: str, title: str) -> Optional[str]:
    """Time and peak memory against x_key per method, as one PNG (needs matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot (pip install nitrobrew[plot])")
        return None
    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(11, 4.2))
    for method in dict.fromkeys(r.method for r in rows):
        pts = sorted((r.size[x_key], r.ms, r.peak_mib) for r in rows if r.method == method and r.ms is not None)
        if not pts:
            continue
        xs = [p[0] for p in pts]
        ax_t.plot(xs, [p[1] for p in pts], marker="o", label=method)
        ax_m.plot(xs, [max(p[2] or 0.0, 1e-3) for p in pts], marker="o", label=method)
    for ax, label in ((ax_t, "fwd+bwd time (ms)"), (ax_m, "peak memory above inputs (MiB)")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel(x_key)
        ax.set_ylabel(label)
        ax.grid(True, which="both", alpha=0.3)
    ax_t.legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| in float64."""
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    return float((a - b).norm() / b.norm().clamp_min(1e-300))
