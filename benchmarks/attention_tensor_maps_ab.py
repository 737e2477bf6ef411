"""A/B in one process: Gluon launches that keep the TMA descriptors' tensor maps
(``core.launch.KEEP_TENSOR_MAPS``) against launches whose launcher encodes them every time.

B = 1, H = 32, D = 128, bf16, causal, forward KL through the API, Gluon forward and backward: the forward
alone and fwd+bwd (gradients to the student's q and k), each beside SDPA's default; the variants alternate
within rounds. Both variants must give the same bits (checked first, on more cases). Needs an sm90 GPU:

    python benchmarks/attention_tensor_maps_ab.py [--ns 1024 2048 4096 8192 16384] [--rounds 5] [--reps 15]
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F
from attention_small_n import measure, print_ratios

import nitrobrew as nb
from nitrobrew.core import launch as launch_mod
from nitrobrew.environment import environment

CACHES = {True: {}, False: {}}
GLUON = {"fwd_kernel": "gluon", "bwd_kernel": "gluon"}
LABEL = {True: "maps kept", False: "maps per launch"}


def variant(keep: bool, fn):
    def run():
        launch_mod.KEEP_TENSOR_MAPS = keep
        launch_mod._CACHE = CACHES[keep]
        return fn()

    return run


def same_bits(dev) -> None:
    """Loss and gradients with maps kept against maps per launch, bit for bit."""
    g = torch.Generator(device="cpu").manual_seed(0)
    cases = [  # name, N, student heads (q, kv), teacher heads (q, kv), Ds, Dt, causal
        ("causal", 4096, (32, 32), (32, 32), 128, 128, True),
        ("N = 4000 (a partial block)", 4000, (32, 32), (32, 32), 128, 128, True),
        ("GQA 32/8", 4096, (32, 8), (32, 8), 128, 128, True),
        ("not causal, N = 3000", 3000, (8, 8), (8, 8), 128, 128, False),
        ("Ds 64, Dt 128", 4096, (32, 32), (32, 32), 64, 128, True),
    ]
    for name, n, (hs, hks), (ht, hkt), ds, dt, causal in cases:

        def r(*shape):
            return (torch.randn(*shape, generator=g) * 1.5).to(dev, torch.bfloat16)

        q_s, k_s, q_t, k_t = r(1, hs, n, ds), r(1, hks, n, ds), r(1, ht, n, dt), r(1, hkt, n, dt)
        out = {}
        for keep in (True, False):
            qs, ks = q_s.clone().requires_grad_(True), k_s.clone().requires_grad_(True)
            for _ in range(2):  # the first launch of a key is the JIT one
                qs.grad = ks.grad = None
                loss = variant(keep, lambda: nb.attention_kl(qs, ks, q_t, k_t, is_causal=causal, block_config=GLUON))()
                loss.backward()
            out[keep] = (loss.detach().clone(), qs.grad.clone(), ks.grad.clone())
        same = all(torch.equal(a, b) for a, b in zip(out[True], out[False]))
        kept = sum(isinstance(e[0], launch_mod._KeptMapsRun) for e in CACHES[True].values())
        print(f"- {name}: same bits: {same}; kept-map launchers: {kept} of {len(CACHES[True])}")
    print()
    sys.stdout.flush()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ns", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--reps", type=int, default=15)
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU")
        return 2
    env = environment()
    print(f"device: {env.get('device')}, torch {torch.__version__}, triton {env.get('triton')}\n")
    dev = torch.device("cuda")
    same_bits(dev)
    g = torch.Generator(device="cpu").manual_seed(1)
    for n in args.ns:
        q_s, k_s, q_t, k_t, v = (
            (torch.randn(1, 32, n, 128, generator=g) * 1.5).to(dev, torch.bfloat16) for _ in "12345"
        )
        qs, ks = q_s.clone().requires_grad_(True), k_s.clone().requires_grad_(True)
        qv, kv, vv = (t.clone().requires_grad_(True) for t in (q_s, k_s, v))

        def forward():
            with torch.no_grad():
                nb.attention_kl(q_s, k_s, q_t, k_t, is_causal=True, block_config=GLUON)

        def step():
            nb.attention_kl(qs, ks, q_t, k_t, is_causal=True, block_config=GLUON).backward()

        def sdpa_forward():
            with torch.no_grad():
                F.scaled_dot_product_attention(q_s, k_s, v, is_causal=True)

        def sdpa_step():
            F.scaled_dot_product_attention(qv, kv, vv, is_causal=True).sum().backward()

        for what, fn, ref, ref_fn in (
            ("forward", forward, "SDPA default forward", sdpa_forward),
            ("fwd+bwd", step, "SDPA default fwd+bwd", sdpa_step),
        ):
            fns = {LABEL[keep]: variant(keep, fn) for keep in (True, False)}
            fns[ref] = ref_fn
            med = measure(fns, args.rounds, args.reps, loop_calls=10)
            print_ratios(f"N = {n}: Gluon {what} through the API (ms, medians of {args.rounds} rounds)",
                         "variant", med, ref)  # fmt: skip
            kept, per = med[LABEL[True]], med[LABEL[False]]
            r = " / ".join(f"{kept[c] / per[c]:.3f}" for c in ("wall", "host", "kernels", "loop"))
            print(f"- maps kept ÷ maps per launch (wall / host / kernels / loop): {r}\n")
            sys.stdout.flush()
        del q_s, k_s, q_t, k_t, v, qs, ks, qv, kv, vv
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
