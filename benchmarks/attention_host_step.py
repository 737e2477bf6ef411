"""Host time of one attention-KL fwd+bwd step through the API at small N, by part, against SDPA's.

B = 1, H = 32, D = 128, bf16, causal, forward KL, gradients to the student's q and k. For each N:

- the step's wall / host / kernel / loop time (``attention_small_n.measure``) for the API's default
  kernels, the Gluon and the Triton kernels with the gradients formed in the forward and in the backward
  (``block_config["grads_in_forward"]``; same bits checked, and the step's peak memory), SDPA's default
  fwd+bwd, and two references that launch no
  attention kernel: an autograd Function returning ``q.sum() * 0``-shaped work (``null Function``) and
  ``(q * 1).sum().backward()`` (``plain autograd``);
- the host time by function (perf_counter wrappers, nested: a function's time includes its callees');
- a cProfile of the step, by own time.

Needs an sm90 GPU:

    python benchmarks/attention_host_step.py [--ns 2048 4096 8192] [--rounds 3]
"""

from __future__ import annotations

import argparse
import collections
import sys

import torch
import torch.nn.functional as F
from attention_small_n import host_profile, host_us_per_step, measure, print_ratios, timer

import nitrobrew as nb
from nitrobrew.attention import api
from nitrobrew.attention import triton_function as tfn
from nitrobrew.environment import environment


class NullKL(torch.autograd.Function):
    """The autograd cost of the loss's Function with no kernel of its own: one scalar out, gradients
    of the inputs' shapes back (uninitialized: nothing is launched)."""

    @staticmethod
    def forward(ctx, q, k):
        ctx.save_for_backward(q, k)
        return q.new_empty((), dtype=torch.float32)

    @staticmethod
    def backward(ctx, g):
        q, k = ctx.saved_tensors
        return torch.empty_like(q), torch.empty_like(k)


PARTS = [
    (api, "_validate"),
    (api, "_gluon_kernels"),
    (api, "key_mask"),
    (tfn.TritonAttentionKL, "forward"),
    (tfn, "triton_forward"),
    (tfn.TritonAttentionKL, "backward"),
    (tfn, "triton_backward"),
]


def breakdown(step, steps: int = 200) -> dict:
    """us per step of each function in PARTS while running step() (synchronized between steps)."""
    acc: dict = collections.defaultdict(float)
    saved = [(owner, name, owner.__dict__[name]) for owner, name in PARTS]
    timed = timer(acc)
    for owner, name, f in saved:
        inner = f.__func__ if isinstance(f, staticmethod) else f
        wrapped = timed(name, inner)
        setattr(owner, name, staticmethod(wrapped) if isinstance(f, staticmethod) else wrapped)
    try:
        step_us = host_us_per_step(step, acc, steps, warmup=5)
    finally:
        for owner, name, f in saved:
            setattr(owner, name, f)
    out = {k: v / steps * 1e6 for k, v in acc.items()}
    out["step"] = step_us
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ns", type=int, nargs="+", default=[2048, 4096, 8192])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--max-step-n", type=int, default=8192, help="the fwd+bwd tables up to this N")
    p.add_argument("--steps-only", action="store_true", help="no forward table")
    p.add_argument("--profile", action="store_true", help="also a cProfile of the default step at each N")
    args = p.parse_args()
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        print("needs an sm90 GPU (the Gluon kernels); nothing measured")
        return 0
    dev = torch.device("cuda")
    print(f"# attention-KL fwd+bwd step: host time by part\n\n{environment()}\n")
    g = torch.Generator(device="cpu").manual_seed(0)
    for n in args.ns:
        q_s, k_s, q_t, k_t = ((torch.randn(1, 32, n, 128, generator=g) * 1.5).to(dev, torch.bfloat16) for _ in range(4))
        v = torch.randn_like(q_s)
        qs, ks = q_s.clone().requires_grad_(True), k_s.clone().requires_grad_(True)
        qv, kv, vv = (t.clone().requires_grad_(True) for t in (q_s, k_s, v))

        def step(cfg):
            return lambda: nb.attention_kl(qs, ks, q_t, k_t, is_causal=True, block_config=cfg).backward()

        gluon, triton = {"fwd_kernel": "gluon", "bwd_kernel": "gluon"}, {"fwd_kernel": "triton", "bwd_kernel": "triton"}
        steps = {
            "API default": step(None),
            "Gluon, grads in forward": step({**gluon, "grads_in_forward": True}),
            "Gluon, grads in backward": step({**gluon, "grads_in_forward": False}),
            "Triton, grads in forward": step({**triton, "grads_in_forward": True}),
            "Triton, grads in backward": step({**triton, "grads_in_forward": False}),
            "SDPA default fwd+bwd": lambda: F.scaled_dot_product_attention(qv, kv, vv, is_causal=True).sum().backward(),
            "null Function": lambda: NullKL.apply(qs, ks).backward(),
            "plain autograd": lambda: (qs * 1).sum().backward(),
        }
        same, peak = {}, {}
        for label in ("Gluon", "Triton"):
            got = []
            for where in ("forward", "backward"):
                qs.grad = ks.grad = None
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
                steps[f"{label}, grads in {where}"]()
                torch.cuda.synchronize()
                peak[f"{label}, grads in {where}"] = (torch.cuda.max_memory_allocated() - base) / 2**20
                got.append((qs.grad.clone(), ks.grad.clone()))
            same[label] = all(torch.equal(a, b) for a, b in zip(*got))
        qs.grad = ks.grad = None
        print(f"N = {n}: gradients formed in the forward give the backward's bits: {same}; peak MiB above the "
              f"inputs in one step: " + ", ".join(f"{k} {v:.0f}" for k, v in peak.items()) + "\n")  # fmt: skip
        with torch.no_grad():
            fwd = (
                {}
                if args.steps_only
                else {
                    "API forward, no graph": lambda: nb.attention_kl(q_s, k_s, q_t, k_t, is_causal=True),
                    "API forward, Gluon, no graph": lambda: nb.attention_kl(
                        q_s, k_s, q_t, k_t, is_causal=True, block_config=gluon
                    ),
                    "SDPA default forward": lambda: F.scaled_dot_product_attention(q_s, k_s, v, is_causal=True),
                }
            )
            if fwd:
                med = measure(fwd, args.rounds, args.reps, loop_calls=20)
                print_ratios(f"N = {n}: forward, no_grad (ms)", "forward", med, "SDPA default forward")
                print()
        if n > args.max_step_n:
            continue
        med = measure(steps, args.rounds, args.reps, loop_calls=10)
        print_ratios(f"N = {n}: fwd+bwd (ms)", "fwd+bwd", med, "SDPA default fwd+bwd")
        print(f"\n### N = {n}: host time by function, us a step (nested)\n")
        cols = ["step"] + [name for _, name in PARTS]
        print("| kernels | " + " | ".join(cols) + " |")
        print("|---" * (len(cols) + 1) + "|")
        for label in ("Gluon, grads in forward", "Gluon, grads in backward"):
            us = breakdown(steps[label])
            print(f"| {label} | " + " | ".join(f"{us.get(c, 0.0):.0f}" for c in cols) + " |")
        print()
        if args.profile:
            host_profile(f"Gluon, grads in forward, N = {n}", steps["Gluon, grads in forward"])
        sys.stdout.flush()
        del q_s, k_s, q_t, k_t, v, qs, ks, qv, kv, vv
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
