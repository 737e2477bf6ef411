"""attention_kl's TMA-descriptor forward against its pointer forward and SDPA's default backend.

One GPU, one process: (1) the TMA forward against the pointer forward (max abs difference of the KL
and both lse's) and against float64; (2) a sweep of the TMA forward's tiles and warp
specialization (forward alone, causal); (3) the table: forward and fwd+bwd of the pointer
forward, the TMA forward (best swept setting) and SDPA default (cuDNN on Hopper); B = 1, H = 32,
D = 128, bf16, causal, N = 2048 ... 16384, one GQA case (8 kv heads) and one non-causal case.
The backward is the same for both forwards. CUDA-event medians.

    python benchmarks/attention_fwd_tma.py > fwd_tma.md
"""
import os
import subprocess

import torch
import torch.nn.functional as F
import triton

import nitrobrew as nb
from nitrobrew.attention.common import AttnSpec
from nitrobrew.attention.kernels_fwd import DEFAULT_CONFIGS, attn_kl_fwd_kernel, attn_kl_fwd_tma_kernel
from nitrobrew.attention.triton_function import Side, triton_forward
from nitrobrew.bench.common import time_ms

DEV = torch.device("cuda")
OLD = {"fwd_tma": False}
# (BM, BN, warps, stages, warp-specialized, rotated, scale folded): see attn_kl_fwd_tma_kernel. An
# earlier sweep of the plain loop: (128, 64, 8, 2/4), (128, 128, 8, 2) without warp specialization
# and (64, 64, 4, 3) were slower, (128, 64, 4, 3) with it failed to compile (Triton 3.6).
SWEEP = [(128, 64, 8, 3, False, False, False), (128, 128, 8, 2, True, False, False),
         (128, 64, 8, 3, False, True, False), (128, 64, 8, 2, False, True, False),
         (128, 128, 8, 2, False, True, False), (128, 64, 8, 3, True, True, False),
         (128, 64, 8, 3, False, False, True), (128, 64, 8, 3, False, True, True),
         (128, 128, 8, 2, True, False, True), (128, 64, 8, 2, False, True, True),
         (128, 64, 8, 3, True, True, True), (128, 128, 8, 2, False, False, True)]


def ms(fn, reps=20):
    return time_ms(fn, DEV, warmup=3, reps=reps)


def inputs(N, H=32, Hkv=32, D=128, seed=0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    q, qt, v = (torch.randn(1, H, N, D, device=DEV, dtype=torch.bfloat16, generator=g) for _ in range(3))
    k, kt = (torch.randn(1, Hkv, N, D, device=DEV, dtype=torch.bfloat16, generator=g) for _ in range(2))
    return q, k, qt, kt, v


def kl_f64(qx, kx, qy, ky, sx, sy, causal):
    """Per-row KL(softmax x || softmax y) in float64 (natural units)."""
    G = qx.shape[1] // kx.shape[1]
    x = (qx.double() @ kx.double().repeat_interleave(G, 1).transpose(-1, -2)) * sx
    y = (qy.double() @ ky.double().repeat_interleave(qy.shape[1] // ky.shape[1], 1).transpose(-1, -2)) * sy
    if causal:
        m = torch.ones(x.shape[-2:], dtype=torch.bool, device=x.device).triu(1)
        x, y = x.masked_fill(m, float("-inf")), y.masked_fill(m, float("-inf"))
    lx, ly = torch.logsumexp(x, -1, keepdim=True), torch.logsumexp(y, -1, keepdim=True)
    p = torch.exp(x - lx)
    return (p * torch.where(p > 0, (x - lx) - (y - ly), 0)).sum(-1)


def check(tma_cfg):
    print("## TMA forward vs pointer forward (max abs difference of KL, lse_x, lse_y) and vs float64\n")
    print("| case | KL | lse_x | lse_y | KL vs float64 |\n|---|---|---|---|---|")
    cases = [("causal N=2048", 2048, 32, 32, 128, True), ("non-causal N=2048", 2048, 32, 32, 128, False),
             ("causal N=1000 (tail blocks)", 1000, 8, 8, 128, True), ("GQA 32/8 N=2048", 2048, 32, 8, 128, True),
             ("D=64 N=1536", 1536, 8, 8, 64, True), ("causal N=512 H=4", 512, 4, 4, 128, True)]
    for name, N, H, Hkv, D, causal in cases:
        q, k, qt, kt, _ = inputs(N, H, Hkv, D, seed=N + H)
        spec = AttnSpec(causal, 0, D ** -0.5, D ** -0.5, "forward")
        X, Y = Side(qt, kt, spec.scale_t), Side(q, k, spec.scale_s)
        a = triton_forward(X, Y, None, spec, tma=False)
        b = triton_forward(X, Y, None, spec, cfg={"fwd_tma": tma_cfg}, tma=True)
        d = [float((u - w).abs().max()) for u, w in zip(a, b)]
        ref = f"{float((b[0].double() - kl_f64(qt, kt, q, k, spec.scale_t, spec.scale_s, causal)).abs().max()):.1e}" \
            if N <= 512 else "-"
        print(f"| {name} | {d[0]:.1e} | {d[1]:.1e} | {d[2]:.1e} | {ref} |", flush=True)


def compiled(kernel):
    """id -> compiled kernel, for every specialization of kernel compiled so far (Triton 3.x cache)."""
    try:
        return {id(v): v for cache in kernel.device_caches.values() for v in cache[0].values()}
    except Exception:
        return {}


def regs(kernel, before):
    """Registers and spills of the kernels compiled since `before`."""
    new = [k for i, k in compiled(kernel).items() if i not in before]
    return ", ".join(f"{getattr(k, 'n_regs', '?')}/{getattr(k, 'n_spills', '?')}" for k in new) or "?"


def fwd_ms(q, k, qt, kt, cfg, causal=True):
    return ms(lambda: nb.attention_kl(q, k, qt, kt, is_causal=causal, block_config=cfg))


def fwd_bwd_ms(q, k, qt, kt, cfg, causal=True):
    qs, ks = q.detach().requires_grad_(), k.detach().requires_grad_()
    return ms(lambda: nb.attention_kl(qs, ks, qt, kt, is_causal=causal, block_config=cfg).backward())


def sdpa_ms(q, k, v, causal=True):
    gqa = q.shape[1] != k.shape[1]
    f = ms(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa))
    qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
    fb = ms(lambda: F.scaled_dot_product_attention(qg, kg, vg, is_causal=causal, enable_gqa=gqa).sum().backward())
    return f, fb


def main():
    commit = os.environ.get("CODE_COMMIT")  # the code's commit when it runs from a copy
    try:
        commit = commit or subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    except OSError:
        commit = "?"
    print(f"# attention_kl TMA forward, {torch.cuda.get_device_name()}, torch {torch.__version__}, "
          f"triton {triton.__version__}, git {commit or '?'}\n")
    default = DEFAULT_CONFIGS["fwd_tma"]
    check(default)

    print("\n## Sweep: forward alone, causal (ms); TMA config = (BM, BN, warps, stages, warp-specialized, "
          "rotated, scale folded)\n")
    Ns = (2048, 4096, 8192, 16384)
    data = {N: inputs(N) for N in Ns}
    print("| config | " + " | ".join(f"N={N}" for N in Ns) + " | max abs diff KL vs pointer (N=2048) | regs/spills |\n"
          "|---|" + "---|" * (len(Ns) + 2))
    before = compiled(attn_kl_fwd_kernel)
    old = [fwd_ms(*data[N][:4], OLD) for N in Ns]
    print("| pointer forward (128, 64, 8, 3) | " + " | ".join(f"{t:.3f}" for t in old) + f" | - | "
          f"{regs(attn_kl_fwd_kernel, before)} |", flush=True)
    ref = nb.attention_kl(*data[2048][:4], is_causal=True, reduction="none", block_config=OLD)
    best, best_score = default, None
    for cfg in SWEEP:
        try:
            before = compiled(attn_kl_fwd_tma_kernel)
            t = [fwd_ms(*data[N][:4], {"fwd_tma": cfg}) for N in Ns]
            out = nb.attention_kl(*data[2048][:4], is_causal=True, reduction="none", block_config={"fwd_tma": cfg})
        except Exception as err:  # a setting the compiler refuses is a result too
            print(f"| {cfg} | failed: {type(err).__name__}: {str(err).splitlines()[0][:100]} |", flush=True)
            continue
        score = sum(a / b for a, b in zip(t, old))
        if best_score is None or score < best_score:
            best, best_score = cfg, score
        print(f"| {cfg} | " + " | ".join(f"{x:.3f}" for x in t) + f" | {float((out - ref).abs().max()):.1e} | "
              f"{regs(attn_kl_fwd_tma_kernel, before)} |", flush=True)
    print(f"\nBest TMA setting (sum of time ratios to the pointer forward): {best}; library default: {default}\n")
    if best != default:
        check(best)

    print("\n## attention_kl vs SDPA default (ms; ratio = ÷ SDPA)\n")
    print("| case | pointer fwd | TMA fwd | SDPA fwd | pointer ÷ SDPA | TMA ÷ SDPA | pointer fwd+bwd | TMA fwd+bwd | "
          "SDPA fwd+bwd | pointer ÷ SDPA | TMA ÷ SDPA |\n|---|" + "---|" * 10)
    cases = [(f"causal N={N}", data[N], True) for N in Ns]
    cases += [("causal GQA 32/8 N=8192", inputs(8192, 32, 8), True), ("non-causal N=4096", data[4096], False)]
    new = {"fwd_tma": best}
    for name, (q, k, qt, kt, v), causal in cases:
        fo, fn = fwd_ms(q, k, qt, kt, OLD, causal), fwd_ms(q, k, qt, kt, new, causal)
        bo, bn = fwd_bwd_ms(q, k, qt, kt, OLD, causal), fwd_bwd_ms(q, k, qt, kt, new, causal)
        sf, sb = sdpa_ms(q, k, v, causal)
        print(f"| {name} | {fo:.3f} | {fn:.3f} | {sf:.3f} | {fo / sf:.2f} | {fn / sf:.2f} | {bo:.3f} | {bn:.3f} | "
              f"{sb:.3f} | {bo / sb:.2f} | {bn / sb:.2f} |", flush=True)


if __name__ == "__main__":
    main()
