"""Where the attention-KL forward's time goes at small N: kernels against host time, and launches.

B = 1, H = 32, D = 128, bf16, causal, forward KL. For each N and each forward (the Triton kernel; the Gluon
one-warpgroup and warp-specialized kernels) and SDPA's default forward:

- wall: one call from a synchronized start, CUDA events (the protocol of the target table), median;
- host: the host time to enqueue one call (no synchronization inside), median;
- kernels: the device time of the call's kernels (torch.profiler), per call;
- loop: calls back to back, per call (the host hidden behind the kernels where they are longer).

Each nitrobrew variant runs its launches two ways in the same process: "now" (``core.launch``'s direct
launch for every kernel, the inline launch key, TMA descriptors kept between calls) and "before" (as the
code was before them: the Gluon kernels through Triton's JIT launch with descriptors and layouts built on
every call, the Triton kernels' direct launch keyed one ``_spec`` call an argument). Variants alternate
over rounds. Then the API's fwd+bwd (the default kernels, the Gluon forward and backward, the Triton
ones, and the mixes) the same way. Both ways must give the same bits (checked). Needs an sm90 GPU:

    python benchmarks/attention_small_n.py [--ns 2048 3072 4096 6144 8192] [--rounds 3] [--reps 15]
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import io
import pstats
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

import nitrobrew as nb
from nitrobrew.attention import kernels_gluon as kg
from nitrobrew.attention import kernels_gluon_bwd as kgb
from nitrobrew.attention.common import AttnSpec
from nitrobrew.attention.triton_function import Side, triton_forward
from nitrobrew.bench.common import host_ms, loop_ms, time_ms
from nitrobrew.core import launch as launch_mod
from nitrobrew.environment import environment


def kernel_ms(fn, calls: int = 5) -> float:
    """Device time of fn's kernels (and memsets / copies) per call."""
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    total_us = sum(e.self_device_time_total for e in prof.key_averages())
    return total_us / calls / 1e3


def measure(fns: dict, rounds: int, reps: int, loop_calls: int, host: bool = True, kernels: bool = True) -> dict:
    """Medians over rounds (the variants alternate within each) of wall, host (if asked), kernels (if asked:
    a profiled pass of 5 calls) and loop time of each variant, in ms."""
    parts = ("wall",) + (("host",) if host else ()) + (("kernels",) if kernels else ()) + ("loop",)
    res = {k: {c: [] for c in parts} for k in fns}
    for fn in fns.values():
        fn(), fn()
    dev = torch.device("cuda")
    for _ in range(rounds):
        for k, fn in fns.items():
            res[k]["wall"].append(time_ms(fn, dev, warmup=1, reps=reps))
            if host:
                res[k]["host"].append(host_ms(fn, reps))
            if kernels:
                res[k]["kernels"].append(kernel_ms(fn))
            res[k]["loop"].append(loop_ms(fn, calls=loop_calls))
    return {k: {c: statistics.median(x) for c, x in r.items()} for k, r in res.items()}


def print_ratios(title: str, what: str, med: dict, ref: str) -> None:
    """A table of measure()'s medians, wall and loop time also as ratios to variant `ref`."""
    sd, sl = med[ref]["wall"], med[ref]["loop"]
    print(f"## {title}\n")
    print(f"| {what} | wall | ÷ SDPA wall | host | kernels | loop, per call | ÷ SDPA loop |")
    print("|---|---|---|---|---|---|---|")
    for k, m in med.items():
        print(
            f"| {k} | {m['wall']:.3f} | {m['wall'] / sd:.2f} | {m['host']:.3f} | {m['kernels']:.3f} "
            f"| {m['loop']:.3f} | {m['loop'] / sl:.2f} |"
        )
    sys.stdout.flush()


def host_profile(name: str, fn, calls: int = 200) -> None:
    """cProfile of calls to fn (synchronized between calls, outside the profile): the host's own time."""
    fn(), fn()
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    for _ in range(calls):
        prof.enable()
        fn()
        prof.disable()
        torch.cuda.synchronize()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(22)
    print(f"### host profile: {name}, {calls} calls\n\n```\n{buf.getvalue().strip()}\n```\n")


NEW_KEY, NEW_DESC, GLUON_LAUNCH = launch_mod._arg_key, kg._desc, kg.launch


def per_argument_key(args):
    """The launch key before _arg_key: one _spec call an argument."""
    return tuple(map(launch_mod._spec, args))


def built_desc(t, rows):
    """A descriptor built on every call, as before descriptors were kept."""
    d = t.shape[-1]
    flat = t.view(-1, d)
    gl = kg.gl
    layout = gl.NVMMASharedLayout.get_default_for([rows, d], gl.bfloat16 if t.dtype == torch.bfloat16 else gl.float16)
    return kg.TensorDescriptor(flat, list(flat.shape), list(flat.stride()), [rows, d], layout)


def jit_launch(kernel, grid, *args, **kwargs):
    kernel[grid](*args, **kwargs)


def launched(mode: str, fn):
    """fn with its launches as they are now ("now") or as they were ("before"; the module docstring)."""

    def run():
        before = mode == "before"
        launch_mod._arg_key = per_argument_key if before else NEW_KEY
        kg._desc = built_desc if before else NEW_DESC
        kg.launch = kgb.launch = jit_launch if before else GLUON_LAUNCH
        return fn()

    return run


def timer(acc: dict):
    """timed(label, f): f wrapped to add its host time (perf_counter) to acc[label]."""

    def timed(label, f):
        def w(*a, **k):
            t0 = time.perf_counter()
            try:
                return f(*a, **k)
            finally:
                acc[label] += time.perf_counter() - t0

        return w

    return timed


def host_us_per_step(step, acc: dict, steps: int, warmup: int = 3) -> float:
    """Host time of step() in us, from synchronized starts after warm-up; acc (the timers') is cleared after
    the warm-up, so it holds the timed steps' totals."""
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    acc.clear()
    total = 0.0
    for _ in range(steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        step()
        total += time.perf_counter() - t0
    torch.cuda.synchronize()
    return total / steps * 1e6


def host_breakdown(n: int, dev, steps: int = 100) -> None:
    """Host time of one API fwd+bwd step by the functions it goes through (perf_counter wrappers around
    them; nested: a function's time includes its callees'), at N = n, both ways and for both kernel sets."""
    from nitrobrew.attention import api, kernels_bwd, kernels_fwd
    from nitrobrew.attention import triton_function as tfn

    acc: dict = collections.defaultdict(float)
    timed = timer(acc)

    g = torch.Generator(device="cpu").manual_seed(0)
    q_s, k_s, q_t, k_t = ((torch.randn(1, 32, n, 128, generator=g) * 1.5).to(dev, torch.bfloat16) for _ in range(4))
    qs, ks = q_s.clone().requires_grad_(True), k_s.clone().requires_grad_(True)
    saved = [(m, name, getattr(m, name)) for m, name in (
        (api, "_validate"), (tfn, "triton_forward"), (tfn, "triton_backward"), (kg, "launch_fwd_gluon"),
        (kgb, "launch_bwd_gluon"), (kernels_fwd, "launch"), (kernels_bwd, "launch"),
    )]  # fmt: skip
    for m, name, f in saved:
        setattr(m, name, timed(name if name != "launch" else "launch (Triton kernels)", f))
    print(f"## Host time of one API fwd+bwd step, N = {n}, by function (us a step, {steps} steps)\n")
    print("| kernels, launches | step | validation | forward | backward | Gluon fwd launcher | Gluon bwd launchers "
          "| TMA descriptors | launch keys | Triton-kernel launches |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, cfg in (("Triton", {"fwd_kernel": "triton", "bwd_kernel": "triton"}),
                      ("Gluon", {"fwd_kernel": "gluon", "bwd_kernel": "gluon"})):  # fmt: skip
        for mode in ("now", "before"):

            def step(cfg=cfg):
                nb.attention_kl(qs, ks, q_t, k_t, is_causal=True, block_config=cfg).backward()

            launched(mode, lambda: None)()  # the mode's launch functions, then timers around two of them
            kg._desc, launch_mod._arg_key = timed("desc", kg._desc), timed("key", launch_mod._arg_key)
            step_us = host_us_per_step(step, acc, steps)
            us = {k: v / steps * 1e6 for k, v in acc.items()}
            cols = ["_validate", "triton_forward", "triton_backward", "launch_fwd_gluon", "launch_bwd_gluon", "desc",
                    "key", "launch (Triton kernels)"]  # fmt: skip
            cells = " | ".join(f"{us.get(c, 0):.0f}" for c in cols)
            print(f"| {name}, {mode} | {step_us:.0f} | {cells} |")
    for m, name, f in saved:
        setattr(m, name, f)
    launched("now", lambda: None)()
    print()


CASES = [
    # (name, kv heads student / teacher, Ds, Dt, direction)
    ("GQA 32/8 both sides", 8, 8, 128, 128, "forward"),
    ("GQA 32/8 (s) 32/4 (t)", 8, 4, 128, 128, "forward"),
    ("Ds=64, Dt=128", 32, 32, 64, 128, "forward"),
    ("reverse KL", 32, 32, 128, 128, "reverse"),
]


def case_table(dev, ns, rounds: int, reps: int) -> None:
    """The API's fwd+bwd on other cases (grouped-query attention, head dims, reverse KL): the default
    kernels against the Triton and the Gluon ones; SDPA's default on the student's shapes beside them."""
    print("## Other cases: API fwd+bwd (ms: wall / kernels / loop)\n")
    print(
        "| case | N | default | Triton fwd + bwd | Gluon fwd + bwd | SDPA default "
        "| default ÷ Triton: wall / kernels / loop |"
    )
    print("|---|---|---|---|---|---|---|")
    g = torch.Generator(device="cpu").manual_seed(0)
    for n in ns:
        for name, hs, ht, ds, dt, direction in CASES:

            def r(*shape):
                return (torch.randn(*shape, generator=g) * 1.5).to(dev, torch.bfloat16)

            q_s, k_s, q_t, k_t = r(1, 32, n, ds), r(1, hs, n, ds), r(1, 32, n, dt), r(1, ht, n, dt)
            qs, ks = q_s.clone().requires_grad_(True), k_s.clone().requires_grad_(True)
            qv, kv, vv = (t.clone().requires_grad_(True) for t in (q_s, k_s, torch.randn_like(k_s)))

            def step(cfg):
                return lambda: nb.attention_kl(
                    qs, ks, q_t, k_t, is_causal=True, direction=direction, block_config=cfg
                ).backward()

            fns = {
                "default": step(None),
                "triton": step({"fwd_kernel": "triton", "bwd_kernel": "triton"}),
                "gluon": step({"fwd_kernel": "gluon", "bwd_kernel": "gluon"}),
                "sdpa": lambda: (
                    F.scaled_dot_product_attention(qv, kv, vv, is_causal=True, enable_gqa=hs != 32).sum().backward()
                ),
            }
            m = measure(fns, rounds, reps, loop_calls=10, host=False)
            cell = {k: f"{v['wall']:.3f} / {v['kernels']:.3f} / {v['loop']:.3f}" for k, v in m.items()}
            ratio = " / ".join(f"{m['default'][c] / m['triton'][c]:.2f}" for c in ("wall", "kernels", "loop"))
            print(
                f"| {name} | {n} | {cell['default']} | {cell['triton']} | {cell['gluon']} | {cell['sdpa']} | {ratio} |"
            )
            sys.stdout.flush()
    print()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ns", type=int, nargs="+", default=[2048, 3072, 4096, 6144, 8192])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--host-profile", action="store_true", help="cProfile of the forwards at the first N, then stop")
    p.add_argument("--host-breakdown", action="store_true", help="host time of a fwd+bwd step by function, first")
    p.add_argument("--cases", action="store_true", help="only the other cases (GQA, head dims, reverse KL) at --ns")
    args = p.parse_args()
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        print("needs an sm90 GPU (the Gluon kernels); nothing measured")
        return 0
    dev = torch.device("cuda")

    print(f"# attention-KL forward at small N\n\n{environment()}\n")
    if args.cases:
        case_table(dev, args.ns, args.rounds, args.reps)
        return 0
    if args.host_breakdown:
        for n in args.ns[:2]:
            host_breakdown(n, dev)
    g = torch.Generator(device="cpu").manual_seed(0)
    for n in args.ns:
        q_s, k_s, q_t, k_t = ((torch.randn(1, 32, n, 128, generator=g) * 1.5).to(dev, torch.bfloat16) for _ in range(4))
        X, Y = Side(q_t, k_t, 128**-0.5), Side(q_s, k_s, 128**-0.5)
        spec = AttnSpec(is_causal=True, causal_offset=0, scale_s=128**-0.5, scale_t=128**-0.5, direction="forward")
        v = torch.randn_like(q_s)
        cfgs = {
            "Triton": None,
            "Gluon 1-WG": {"fwd_kernel": "gluon", "fwd_gluon": kg.ONE_WARPGROUP},
            "Gluon WS": {"fwd_kernel": "gluon", "fwd_gluon": kg.WARP_SPECIALIZED},
        }
        fns = {}
        for name, cfg in cfgs.items():
            for mode in ("now", "before"):
                fns[f"{name}, {mode}"] = launched(mode, lambda cfg=cfg: triton_forward(X, Y, None, spec, cfg=cfg))

        def sdpa():
            with torch.no_grad():
                return F.scaled_dot_product_attention(q_s, k_s, v, is_causal=True)

        fns["SDPA default"] = sdpa
        if args.host_profile:
            for k in ("Triton, now", "Gluon WS, now", "Gluon 1-WG, now", "SDPA default"):
                host_profile(f"{k}, N = {n}", fns[k])
            with torch.no_grad():
                host_profile(
                    "API forward (default kernels, no_grad)",
                    lambda: nb.attention_kl(q_s, k_s, q_t, k_t, is_causal=True),
                )
            return 0
        same = {}
        for name, cfg in cfgs.items():
            if cfg:
                a = launched("before", lambda: triton_forward(X, Y, None, spec, cfg=cfg))()
                for _ in range(2):  # the first direct call of a key goes through the JIT launch
                    b = launched("now", lambda: triton_forward(X, Y, None, spec, cfg=cfg))()
                same[name] = all(torch.equal(x, y) for x, y in zip(a, b))
        med = measure(fns, args.rounds, args.reps, loop_calls=20)
        print_ratios(f"N = {n}: forward (ms, medians over {args.rounds} rounds)", "forward", med, "SDPA default")
        print(f"\nthe launches now give the bits of the launches before: {same}\n")
        sys.stdout.flush()

        qs, ks = q_s.clone().requires_grad_(True), k_s.clone().requires_grad_(True)
        qv, kv, vv = (t.clone().requires_grad_(True) for t in (q_s, k_s, v))

        def step(cfg):
            return lambda: nb.attention_kl(qs, ks, q_t, k_t, is_causal=True, block_config=cfg).backward()

        steps = {}
        for name, cfg in (
            ("API default", None),
            ("Gluon fwd + bwd", {"fwd_kernel": "gluon", "bwd_kernel": "gluon"}),
            ("Triton fwd + bwd", {"fwd_kernel": "triton", "bwd_kernel": "triton"}),
            ("Gluon fwd + Triton bwd", {"fwd_kernel": "gluon", "bwd_kernel": "triton"}),
            ("Triton fwd + Gluon bwd", {"fwd_kernel": "triton", "bwd_kernel": "gluon"}),
        ):
            for mode in ("now", "before"):
                steps[f"{name}, {mode}"] = launched(mode, step(cfg))
        steps["SDPA default fwd+bwd"] = lambda: (
            F.scaled_dot_product_attention(qv, kv, vv, is_causal=True).sum().backward()
        )
        med = measure(steps, args.rounds, args.reps, loop_calls=10)
        print_ratios(f"N = {n}: fwd+bwd through the API (ms)", "fwd+bwd", med, "SDPA default fwd+bwd")
        print()
        del q_s, k_s, q_t, k_t, v, qs, ks, qv, kv, vv
        torch.cuda.empty_cache()
    launched("now", lambda: None)()
    return 0


if __name__ == "__main__":
    sys.exit(main())
