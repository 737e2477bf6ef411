"""GPU correctness check of the Triton top-k kernels against the float64 reference (one call).

Shapes share the benchmark's kernel specializations (multiples of 16) but cut row blocks and
vocab tiles (N = 528 rows, V = 5008) so the boundaries are exercised. Usage: benchmarks/topk_gpu_check.py OUT.md
"""

import sys
import time

import torch

from nitrobrew.teacher.extract import streaming_topk
from nitrobrew.topk import reference_topk_loss, topk_kl
from nitrobrew.topk import triton_cm as td


def rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def main(path):
    dev = torch.device("cuda")
    torch.manual_seed(0)
    N, D, V, K = 528, 256, 5008, 17
    xs = torch.randn(N, D, device=dev).bfloat16()
    ws = (torch.randn(V, D, device=dev) * (3.0 / D**0.5)).bfloat16()
    bs = torch.randn(V, device=dev).bfloat16()
    wt = (ws.float() + torch.randn(V, D, device=dev) * (1.0 / D**0.5)).bfloat16()
    ids, lp = streaming_topk(xs, wt, None, K)
    lp[3, 5:] = float("-inf")
    labels = torch.randint(0, V, (N,), device=dev)
    labels[7] = -100
    const = dict(mode="constant_memory")
    small = dict(memory_budget=V * 4 * 96)  # fast mode, 96-row blocks (528 rows: a partial last block)
    cases = [
        ("fast full fkl", dict(normalize="full"), "fp32"),
        ("fast full fkl 96-row blocks", dict(normalize="full", **small), "fp32"),
        (
            "fast full tail T=2 CE bias",
            dict(normalize="full", tail=True, temperature=2.0, ce_weight=0.5, labels=labels, bs=bs, **small),
            "fp32",
        ),
        (
            "fast full jsd tail CE T=1 none",
            dict(
                normalize="full",
                divergence="jsd",
                beta=0.5,
                tail=True,
                ce_weight=0.3,
                labels=labels,
                reduction="none",
                **small,
            ),
            "fp32",
        ),
        ("const full fkl fp32-acc", dict(normalize="full", **const), "fp32"),
        ("const full fkl native-acc", dict(normalize="full", **const), "native"),
        (
            "const full tail T=2 CE bias",
            dict(normalize="full", tail=True, temperature=2.0, ce_weight=0.5, labels=labels, bs=bs, **const),
            "fp32",
        ),
        ("topk rkl", dict(normalize="topk", divergence="reverse_kl"), "fp32"),
        ("topk fkl bias none", dict(normalize="topk", bs=bs, reduction="none"), "fp32"),
    ]
    lines = ["| case | loss rel err | dX rel err | dW rel err | db rel err | s |", "|---|---|---|---|---|---|"]
    for name, kw, acc in cases:
        t0 = time.time()
        try:
            ts = [xs.detach().requires_grad_(), ws.detach().requires_grad_()]
            has_b = kw.get("bs") is not None
            if has_b:
                ts.append(bs.detach().requires_grad_())
                kw = dict(kw, bs=ts[2])
            with td.grad_accumulation(acc):
                out = topk_kl(ts[0], ts[1], ids, lp, backend="triton", **kw)
            up = torch.randn_like(out) if out.dim() else torch.ones_like(out)
            g = torch.autograd.grad(out, ts, up)
            r = [t.detach().double().requires_grad_() for t in ts]
            rkw = dict(kw, bs=r[2]) if has_b else dict(kw)
            rkw = {k: v for k, v in rkw.items() if k not in ("mode", "memory_budget")}  # Triton-only options
            if "beta" in rkw:
                rkw["param"] = rkw.pop("beta")
            ref = reference_topk_loss(r[0], r[1], ids, lp, **rkw)
            gr = torch.autograd.grad(ref, r, up.double())
            errs = [rel(out.detach(), ref.detach())] + [rel(a, b) for a, b in zip(g, gr)]
            torch.cuda.synchronize()
            cells = [f"{e:.1e}" for e in errs] + (["-"] if not has_b else [])
            lines.append(f"| {name} | " + " | ".join(cells) + f" | {time.time() - t0:.1f} |")
        except Exception as err:  # report and go on
            lines.append(f"| {name} | error: {type(err).__name__}: {str(err)[:200]} | | | | |")
        print(lines[-1], flush=True)
    text = (
        f"GPU check ({torch.cuda.get_device_name()}, torch {torch.__version__}), bf16 inputs, "
        f"N={N} D={D} V={V} K={K}, float64 reference\n\n" + "\n".join(lines) + "\n"
    )
    open(path, "w").write(text)
    print(text)


if __name__ == "__main__":
    main(sys.argv[1])
