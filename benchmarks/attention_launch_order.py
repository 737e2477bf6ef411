"""Launch order of the attention-KL kernels: how many heads a launch section holds (kernels_tiles.program_grid),
same kernels, same process.

The GPU starts a grid's programs in order of their index. Every kernel takes a head's longest causal
blocks first; the programs go in sections of S heads, block by block across the section's heads.
S = 1 (head by head, the order before sections): the last heads' longest blocks start near the end of the
launch and run on alone. S = every head: the launch ends on short programs, but all heads' keys are read
over the same time. The default takes as many heads as fit kernels_tiles.L2_SECTION_BYTES of streamed
rows. Forward kernels alone (Triton, Gluon one-warpgroup, Gluon warp-specialized) and the API's fwd+bwd
(Triton forward and backward; the default selection; Gluon forward and backward) at each S, interleaved
over rounds, with SDPA's default forward and fwd+bwd beside them; the rows and gradients of every S
compared bit for bit. B = 1, H = 32, D = 128, bf16, causal, forward KL. CUDA-event medians. Needs an sm90
GPU for the Gluon kernels:

    python benchmarks/attention_launch_order.py [--ns 2048 4096 8192 16384 32768] [--rounds 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
import torch.nn.functional as F

import nitrobrew as nb
from nitrobrew.attention import kernels_gluon as kg
from nitrobrew.attention import kernels_tiles as kt
from nitrobrew.attention.common import AttnSpec
from nitrobrew.attention.triton_function import Side, triton_forward
from nitrobrew.bench.common import time_ms
from nitrobrew.environment import environment

DEFAULT_L2_BYTES = kt.L2_SECTION_BYTES
SECTIONS = (1, 2, 4, 8, 16, 32)


def set_section(heads: int, head_bytes: int) -> None:
    """Sections of `heads` heads (0: the default rule) for heads streaming head_bytes each."""
    kt.L2_SECTION_BYTES = heads * head_bytes if heads else DEFAULT_L2_BYTES


def inputs(n: int, kv_heads: int, dev):
    """q_s, k_s, q_t, k_t: 32 query heads, kv_heads key heads on both sides."""
    g = torch.Generator(device="cpu").manual_seed(0)
    return [
        (torch.randn(1, heads, n, 128, generator=g) * 1.5).to(dev, torch.bfloat16)
        for heads in (32, kv_heads, 32, kv_heads)
    ]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ns", type=int, nargs="+", default=[2048, 4096, 8192, 16384, 32768])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--fb-max-n", type=int, default=32768, help="fwd+bwd up to this N")
    ap.add_argument("--kv-heads", type=int, default=32, help="key heads of both sides (grouped-query below 32)")
    args = ap.parse_args()
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0) or not kg.HAVE_GLUON:
        print("needs an sm90 GPU (H100/H200) and Triton with Gluon: nothing to measure here")
        return 0
    dev = torch.device("cuda")
    t0 = time.time()
    print(f"# attention_kl launch order, {torch.cuda.get_device_name()}, {args.kv_heads} kv heads\n")
    print(", ".join(f"{k} {v}" for k, v in environment().items()) + "\n")
    fwd_cfgs = {
        "Triton": {"fwd_kernel": "triton"},
        "Gluon 1-WG": {"fwd_kernel": "gluon", "fwd_gluon": kg.ONE_WARPGROUP},
        "Gluon WS": {"fwd_kernel": "gluon", "fwd_gluon": kg.WARP_SPECIALIZED},
    }
    fb_cfgs = {
        "Triton": {"fwd_kernel": "triton", "bwd_kernel": "triton"},
        "default": None,
        "Gluon": {"fwd_kernel": "gluon", "bwd_kernel": "gluon"},
    }
    cols = " | ".join(f"S={k}" for k in SECTIONS)
    print(
        f"| N | kernel | default S | ms at {cols} | default ÷ S=1 | default ÷ best | ÷ SDPA: default / S=1 "
        "| max abs diff over S |"
    )
    print("|---|---|---|" + "---|" * len(SECTIONS) + "---|---|---|---|")
    ok = True
    for n in args.ns:
        q_s, k_s, q_t, k_t = inputs(n, args.kv_heads, dev)
        # S counts query heads of the forward and dq kernels (keys of both sides over the query heads that
        # share them); the dk kernel's sections hold kv heads, streaming their query heads' queries
        head_bytes = kt.key_bytes_per_query_head(k_s, k_t, 32)
        rule = kt.program_grid(1, 32, head_bytes)[1]  # the default sections' heads
        sections = sorted(set(SECTIONS) | {rule})
        st = Side(q_t, k_t, 128**-0.5)
        ss = Side(q_s, k_s, 128**-0.5)
        spec = AttnSpec(is_causal=True, causal_offset=0, scale_s=128**-0.5, scale_t=128**-0.5, direction="forward")
        v = torch.randn_like(k_s)
        qs, ks = q_s.clone().requires_grad_(True), k_s.clone().requires_grad_(True)
        qv, kv, vv = (t.clone().requires_grad_(True) for t in (q_s, k_s, v))
        reps = args.reps if n <= 16384 else 3
        gqa = args.kv_heads != 32
        do_fb = n <= args.fb_max_n

        def fwd(cfg):
            return triton_forward(st, ss, None, spec, cfg=cfg)

        def sdpa_fb():
            F.scaled_dot_product_attention(qv, kv, vv, is_causal=True, enable_gqa=gqa).sum().backward()

        def fb(cfg):
            qs.grad = ks.grad = None
            nb.attention_kl(qs, ks, q_t, k_t, is_causal=True, block_config=cfg).backward()

        # exactness: the same rows and gradients at every S
        diffs = {}
        for name, cfg in fwd_cfgs.items():
            outs = []
            for sec in sections:
                set_section(sec, head_bytes)
                outs.append(fwd(cfg)[0].clone())
            diffs["fwd " + name] = max((o - outs[0]).abs().max().item() for o in outs)
        if do_fb:
            for name, cfg in fb_cfgs.items():
                grads = []
                for sec in sections:
                    set_section(sec, head_bytes)
                    fb(cfg)
                    grads.append(torch.cat([qs.grad.flatten(), ks.grad.flatten()]))
                diffs["fwd+bwd " + name] = max((g - grads[0]).abs().max().item() for g in grads)
        times = {}
        for _ in range(args.rounds):  # interleaved: clock drift falls on every variant alike
            for name, cfg in fwd_cfgs.items():
                for sec in sections:
                    set_section(sec, head_bytes)
                    times.setdefault(("fwd " + name, sec), []).append(time_ms(lambda: fwd(cfg), dev, 2, reps))
            with torch.no_grad():
                times.setdefault(("fwd SDPA", 0), []).append(
                    time_ms(
                        lambda: F.scaled_dot_product_attention(q_s, k_s, v, is_causal=True, enable_gqa=gqa),
                        dev,
                        2,
                        reps,
                    )
                )
            if do_fb:
                for name, cfg in fb_cfgs.items():
                    for sec in sections:
                        set_section(sec, head_bytes)
                        times.setdefault(("fwd+bwd " + name, sec), []).append(time_ms(lambda: fb(cfg), dev, 2, reps))
                times.setdefault(("fwd+bwd SDPA", 0), []).append(time_ms(sdpa_fb, dev, 2, reps))
        set_section(0, head_bytes)
        med = {k: statistics.median(t) for k, t in times.items()}
        for kind in ("fwd", "fwd+bwd"):
            if kind == "fwd+bwd" and not do_fb:
                continue
            sdpa = med[(f"{kind} SDPA", 0)]
            for name in fwd_cfgs if kind == "fwd" else fb_cfgs:
                key = f"{kind} {name}"
                ms = {sec: med[(key, sec)] for sec in sections}
                d, one, best = ms[rule], ms[1], min(ms.values())
                ok &= diffs[key] == 0.0
                print(
                    f"| {n} | {key} | {rule} | " + " | ".join(f"{ms[k]:.3f}" for k in SECTIONS)
                    + f" | {d / one:.3f} | {d / best:.3f} | {d / sdpa:.2f} / {one / sdpa:.2f} | {diffs[key]:.1e} |"
                )  # fmt: skip
            print(f"| {n} | {kind} SDPA default | | {sdpa:.3f} |" + " |" * (len(SECTIONS) + 3))
        sys.stdout.flush()
        del q_s, k_s, q_t, k_t, v, qs, ks, qv, kv, vv
        torch.cuda.empty_cache()
    print(f"\nwall {time.time() - t0:.0f} s; the same bits at every S: {ok}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
