"""Confident rows on a GPU (docs/design.md §2.6): accuracy against float64 in the random, peaked, close
and confident regimes, and a same-process A/B of the fast mode's speed against the package as it was
before the change (main at 016d9ba, loaded from `git archive` into a temporary package
`nitrobrew_main`; --old-ref picks another commit, --old-dir a copy of an old nitrobrew/ folder).

    python benchmarks/confident_rows_gpu.py [--old-ref 016d9ba] [--old-dir DIR] [--out PATH] [--tiny]

Accuracy: every divergence, fast and constant-memory modes, fp32 inputs, per-row values (max relative
error, 1e-12 absolute floor; the smallest value, which must not be negative) and the row gradients of
dX (max relative error over rows) against float64. "confident": identity heads (logits exact in
float32), V = D = 4096, teacher rows with a 10-20 nat gap, T in {0.25, 1, 2}, students close to and
far from the teacher. random / peaked / close: nitrobrew.bench.regimes' spread / peaked / close at
V = 152064 (N = 64 rows).

Speed: forward_kl and jsd (the target: within 2%, ratio <= 1.02), tvd and skew_kl, fast mode fwd+bwd,
bf16, V = 152064, Ds = 3584, Dt = 5120, N = 4096: three alternating rounds of 5 timed calls each (CUDA
events after warm-up), the median; new / old. Writes benchmarks/results/exactness/confident_rows.md (device, versions,
commit). --tiny runs everything at toy sizes (CPU included, Triton interpreted) to check the script.
"""

from __future__ import annotations

import argparse
import importlib
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

import torch

import nitrobrew as nb
from nitrobrew import divergences as dv
from nitrobrew.bench.common import time_ms
from nitrobrew.bench.regimes import make_hidden
from nitrobrew.environment import environment
from nitrobrew.hidden import reference_loss

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OLD_REF = "016d9ba"  # main before the confident-rows change
ROUNDS = 5
PARAM = {"jsd": ("beta", 0.5), "skew_kl": ("alpha", 0.1), "skew_reverse_kl": ("alpha", 0.1)}


def load_old(ref: str, old_dir: str | None, name: str = "nitrobrew_main"):
    """The package of git ref `ref` (or a copy of it in old_dir) importable as `name`."""
    tmp = tempfile.mkdtemp(prefix="nb_ab_")
    dst = os.path.join(tmp, name)
    if old_dir:
        shutil.copytree(old_dir, dst)
    else:
        tar = subprocess.run(["git", "-C", ROOT, "archive", ref, "nitrobrew"], check=True, capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", tmp], input=tar, check=True)
        os.rename(os.path.join(tmp, "nitrobrew"), dst)
    op = os.path.join(dst, "hidden", "custom_op.py")  # the custom ops' names must not clash
    if os.path.exists(op):
        with open(op) as f:
            text = f.read()
        with open(op, "w") as f:
            f.write(text.replace("nitrobrew::", f"{name}::"))
    sys.path.insert(0, tmp)
    return importlib.import_module(name)


def _opts(name, mode, chunk):
    opts = {"backend": "triton", "mode": mode}
    if mode == "constant_memory":
        opts["chunk_V"] = chunk
    if name in PARAM:
        opts[PARAM[name][0]] = PARAM[name][1]
    return opts


def confident_inputs(n, vocab, temperature, dev, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    gap = 10.0 + 10.0 * torch.rand(n, 1, generator=g)
    top = torch.randint(vocab, (n,), generator=g)
    xt = -gap - 3.0 * torch.rand(n, vocab, generator=g)
    xt[torch.arange(n), top] = 0.0
    xt = xt + 20.0 * torch.rand(n, 1, generator=g) - 5.0
    kind = torch.arange(n) % 4
    noise = torch.randn(n, vocab, generator=g)
    xs = xt + 0.01 * noise  # close
    xs[kind == 1] = (xt + 7.0 + 0.03 * noise)[kind == 1]  # shifted
    far = xt.amax(1, keepdim=True) - 12.0 - 4.0 * torch.rand(n, vocab, generator=g)
    other = (top + 1 + torch.randint(vocab - 1, (n,), generator=g)) % vocab
    far[torch.arange(n), other] = xt.amax(1) + 1.0
    xs[kind == 2] = far[kind == 2]  # confident elsewhere
    xs[kind == 3] = xt[kind == 3] + 0.3 * noise[kind == 3]  # same top, looser
    return xs.to(dev), xt.to(dev), temperature


def accuracy_rows(name, mode, xs, xt, ws, wt, temperature, chunk):
    """(max relative value error, smallest value, max relative row-gradient error) against float64."""
    x = xs.detach().clone().requires_grad_()
    opts = _opts(name, mode, chunk)
    rows = getattr(nb, name)(x, xt, ws, wt, temperature=temperature, reduction="none", **opts)
    rows.sum().backward()
    x64 = xs.detach().double().requires_grad_()
    param = PARAM.get(name, (None, 0.0))[1]
    ref = reference_loss(
        x64,
        xt.double(),
        ws.double(),
        wt.double(),
        divergence=name,
        param=param,
        temperature=temperature,
        reduction="none",
    )
    ref.sum().backward()
    err = (rows.double() - ref.detach()).abs() / (ref.detach().abs() + 1e-9)  # 1e-3 of it: the 1e-12 floor
    g_err = (x.grad.double() - x64.grad).norm(dim=-1) / x64.grad.norm(dim=-1).clamp_min(1e-10)
    return float(err.max()), float(rows.min()), float(g_err.max())


def accuracy(dev, tiny):
    torch.backends.cuda.matmul.allow_tf32 = False  # identity heads: logits exact in float32
    out = []
    vocab = 96 if tiny else 4096
    eye = torch.eye(vocab, device=dev)
    chunk = 32 if tiny else 1024
    for temperature in (0.25, 1.0, 2.0):
        xs, xt, T = confident_inputs(8 if tiny else 64, vocab, temperature, dev)
        for name in dv.NAMES:
            for mode in ("fast", "constant_memory"):
                v, lo, g = accuracy_rows(name, mode, xs, xt, eye, eye, T, chunk)
                out.append((f"confident T={T}", name, mode, v, lo, g))
    big_v = 512 if tiny else 152064
    d = 32 if tiny else 1024
    for regime in ("spread", "peaked", "close"):
        data = make_hidden(regime, 8 if tiny else 64, big_v, d, d, torch.float32, dev, seed=0)
        for name in dv.NAMES:
            for mode in ("fast", "constant_memory"):
                v, lo, g = accuracy_rows(
                    name, mode, data.xs.detach(), data.xt, data.ws.detach(), data.wt, 1.0, 64 if tiny else 16384
                )
                label = "random" if regime == "spread" else regime
                out.append((label, name, mode, v, lo, g))
    return out


def speed(old, dev, tiny, before=None, reverse=False):
    v, ds, dt, n = (512, 64, 80, 64) if tiny else (152064, 3584, 5120, 4096)
    g = torch.Generator(device=dev).manual_seed(0)
    dtype = torch.float32 if tiny else torch.bfloat16
    xs = torch.randn(n, ds, device=dev, generator=g, dtype=dtype)
    xt = torch.randn(n, dt, device=dev, generator=g, dtype=dtype)
    ws = (torch.randn(v, ds, device=dev, generator=g) * (3 / ds**0.5)).to(dtype)
    wt = (torch.randn(v, dt, device=dev, generator=g) * (3 / dt**0.5)).to(dtype)
    out = []
    pkgs = [("old", old)] + ([("before", before)] if before is not None else []) + [("new", nb)]
    order = pkgs[::-1] if reverse else pkgs  # the order within a round (a position effect shows as a change)
    for name in ("forward_kl", "reverse_kl", "jsd", "tvd", "skew_kl", "skew_reverse_kl"):
        times: dict = {label: [] for label, _ in pkgs}
        for _ in range(ROUNDS):
            for label, pkg in order:
                fn = getattr(pkg, name)

                def step():
                    x, w = xs.detach().requires_grad_(), ws.detach().requires_grad_()
                    loss = fn(x, xt, w, wt, backend="triton", mode="fast")
                    loss.backward()

                times[label].append(time_ms(step, dev, warmup=1 if tiny else 2, reps=1 if tiny else 5))
        med = {label: statistics.median(ts) for label, ts in times.items()}
        out.append((name, med))
    return out, (v, ds, dt, n, str(dtype).replace("torch.", ""))


def speed_topk(pkgs, dev, tiny):
    """topk_kl(normalize="full") fwd+bwd, fast and constant-memory, with and without the tail bucket, per
    package (the top-k rows' split normalizer: a package without it is the baseline)."""
    v, ds, n, k = (512, 64, 64, 8) if tiny else (152064, 3584, 4096, 64)
    g = torch.Generator(device=dev).manual_seed(1)
    dtype = torch.float32 if tiny else torch.bfloat16
    xs = torch.randn(n, ds, device=dev, generator=g, dtype=dtype)
    ws = (torch.randn(v, ds, device=dev, generator=g) * (3 / ds**0.5)).to(dtype)
    lp, ids = torch.log_softmax(torch.randn(n, v, device=dev, generator=g) * 3, -1).topk(k, -1)
    out = []
    for mode in ("fast", "constant_memory"):
        for tail in (False, True):
            times: dict = {label: [] for label, _ in pkgs}
            for _ in range(ROUNDS):
                for label, pkg in pkgs:

                    def step():
                        x, w = xs.detach().requires_grad_(), ws.detach().requires_grad_()
                        pkg.topk_kl(x, w, ids, lp, normalize="full", tail=tail, backend="triton", mode=mode).backward()

                    times[label].append(time_ms(step, dev, warmup=1 if tiny else 2, reps=1 if tiny else 5))
            out.append(
                (f"topk full {mode}{' tail' if tail else ''}", {lb: statistics.median(ts) for lb, ts in times.items()})
            )
    return out, (v, ds, n, k)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--old-ref", default=OLD_REF)
    p.add_argument("--old-dir", default=None, help="a copy of the old nitrobrew/ package instead of git archive")
    p.add_argument("--before-dir", default=None, help="a third package (e.g. main before a change), timed too")
    p.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "exactness", "confident_rows.md"))
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--topk", action="store_true", help="also time topk_kl(normalize='full') against the baseline")
    p.add_argument("--speed-only", action="store_true", help="leave out the accuracy table")
    p.add_argument("--reverse", action="store_true", help="time the packages new first within each round")
    args = p.parse_args()
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if dev.type != "cuda" and not args.tiny:
        print("needs a CUDA GPU (or --tiny with TRITON_INTERPRET=1)", file=sys.stderr)
        return 2
    old = load_old(args.old_ref, args.old_dir)
    before = load_old("", args.before_dir, "nitrobrew_before") if args.before_dir else None
    env = environment()
    lines = ["# Confident rows: accuracy against float64 and the fast mode's speed", ""]
    lines += [f"- {k}: {v}" for k, v in env.items()]
    lines += [f"- old: `{args.old_ref}` (same process, package `nitrobrew_main`)", ""]
    if before is not None:
        lines += [f"- before: `{args.before_dir}` (same process, package `nitrobrew_before`)", ""]
    rows, shape = speed(old, dev, args.tiny, before, args.reverse)
    labels = list(rows[0][1])
    lines += [
        f"## Speed, fast mode fwd+bwd (V, Ds, Dt, N = {shape[:4]}, {shape[4]}; median of {ROUNDS} rounds x 5 calls)",
        "",
        "| loss | "
        + " | ".join(f"{lb} ms" for lb in labels)
        + " | "
        + " | ".join(f"{lb} / old" for lb in labels[1:])
        + " |",
        "|---" * (2 * len(labels)) + "|",
    ]
    for n, med in rows:
        cells = [f"{med[lb]:.2f}" for lb in labels] + [f"{med[lb] / med['old']:.3f}" for lb in labels[1:]]
        lines.append(f"| {n} | " + " | ".join(cells) + " |")
    print("\n".join(lines), flush=True)
    if args.topk:  # the top-k rows' change is measured against the package before it (or old)
        base = [("before", before)] if before is not None else [("old", old)]
        trows, tshape = speed_topk(base + [("new", nb)], dev, args.tiny)
        lines += [
            "",
            f'## Top-k normalize="full", fwd+bwd (V, Ds, N, K = {tshape}; median of {ROUNDS} rounds x 5 calls)',
            "",
            f"| loss | {base[0][0]} ms | new ms | new / {base[0][0]} |",
            "|---|---|---|---|",
        ]
        for n, med in trows:
            lines.append(f"| {n} | {med[base[0][0]]:.2f} | {med['new']:.2f} | {med['new'] / med[base[0][0]]:.3f} |")
        print("\n".join(lines[-len(trows) - 4 :]), flush=True)
    if args.speed_only:
        text = "\n".join(lines) + "\n"
        os.makedirs(os.path.dirname(args.out), exist_ok=True)
        with open(args.out, "w") as f:
            f.write(text)
        return 0
    lines += [
        "",
        "## Accuracy against float64 (fp32 inputs)",
        "",
        "value error: max over rows of |v - ref| / (|ref| + 1e-9) (the 1e-12 floor at the 1e-3 target);",
        "min value: must be >= 0; gradient error: max over rows of the relative error of the row's dX.",
        "",
        "| regime | divergence | mode | value error | min value | gradient error |",
        "|---|---|---|---|---|---|",
    ]
    for regime, name, mode, v, lo, g in accuracy(dev, args.tiny):
        lines.append(f"| {regime} | {name} | {mode} | {v:.1e} | {lo:.1e} | {g:.1e} |")
        print(lines[-1], flush=True)
    text = "\n".join(lines) + "\n"
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        f.write(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
