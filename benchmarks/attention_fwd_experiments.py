"""Experiments on attention_kl's forward kernel against SDPA's default backend (one GPU, one process).

Variants of the forward kernel are built from its source with one change each and swapped into the
launcher; the library itself is not changed. Forward alone and fwd+bwd, B = 1, H = 32, D = 128, causal,
bf16, CUDA-event medians.

    python benchmarks/attention_fwd_experiments.py > attention_fwd_experiments.md
"""

import importlib.util
import sys
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F

import nitrobrew as nb
from nitrobrew.attention import kernels_fwd
from nitrobrew.bench.common import time_ms

DEV = torch.device("cuda")
SRC = Path(kernels_fwd.__file__).read_text()
VARIANTS = {
    "baseline": [],
    "warp_specialize (full blocks)": [
        ("for start_n in range(0, n_full, BN):", "for start_n in tl.range(0, n_full, BN, warp_specialize=True):")
    ],
    "loop num_stages=4 (full blocks)": [
        ("for start_n in range(0, n_full, BN):", "for start_n in tl.range(0, n_full, BN, num_stages=4):")
    ],
    "loop flatten (full blocks)": [
        ("for start_n in range(0, n_full, BN):", "for start_n in tl.range(0, n_full, BN, flatten=True):")
    ],
}
# Attribution only (not a correct KL): what one piece of the forward costs, by removing it.
ATTRIBUTION = {
    "without the KL sum c (attribution)": [
        ("    c = ax * (c + lx * ((mx - mx_new) - (my - my_new))) + tl.sum(px * d, 1)\n", "")
    ],
    "one exp2 per score instead of two (attribution)": [
        (
            "    px, py = exp2_pair(sxm, sym, mx_new, my_new, False)\n",
            "    px, py = exp2_pair(sxm, sxm, mx_new, mx_new, False)\n",
        )
    ],
    "one score GEMM instead of two (attribution)": [
        ("    if X_FIXED:\n        mx_new = mx", "    sy = sx\n    sym = sxm\n    if X_FIXED:\n        mx_new = mx")
    ],
}
VARIANTS.update(ATTRIBUTION)
CONFIGS = [(128, 64, 8, 3), (128, 128, 8, 2), (64, 64, 4, 3), (128, 64, 4, 3)]


def load_variant(name, edits):
    src = SRC
    for a, b in edits:
        assert a in src, a
        src = src.replace(a, b)
    src = src.replace("from .._launch import", "from nitrobrew.core.launch import").replace(
        "from .kernels_tiles import", "from nitrobrew.attention.kernels_tiles import"
    )
    path = Path(tempfile.mkdtemp()) / f"variant_{abs(hash(name))}.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location(path.stem, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = mod
    spec.loader.exec_module(mod)
    return mod.attention_fwd_kernel


def median_ms(fn, reps=20):
    return time_ms(fn, DEV, warmup=3, reps=reps)


print(f"# attention_kl forward experiments, {torch.cuda.get_device_name()}, torch {torch.__version__}\n")
print(
    "| N | variant | tiles (BM, BN, warps, stages) | KL fwd ms | SDPA default fwd ms | ratio "
    "| KL fwd+bwd ms | SDPA fwd+bwd ms | ratio | max |KL - baseline| |"
)
print("|---|---|---|---|---|---|---|---|---|---|")
original = kernels_fwd.attention_fwd_kernel


def teacher_lse(qt, kt):
    """The teacher's causal log-sum-exp per row (natural log, softmax scale 1/sqrt(d)), as a flash forward
    returns it."""
    n = qt.shape[2]
    s = (qt.float() @ kt.float().transpose(-1, -2)) * qt.shape[-1] ** -0.5
    s.masked_fill_(torch.ones(n, n, dtype=torch.bool, device=qt.device).triu(1), float("-inf"))
    out = torch.logsumexp(s, -1)
    del s
    return out


for N in (4096, 8192):
    g = torch.Generator(device=DEV).manual_seed(0)
    q, k, v, qt, kt = (torch.randn(1, 32, N, 128, device=DEV, dtype=torch.bfloat16, generator=g) for _ in range(5))
    sd_f = median_ms(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True))
    qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))

    def sdpa_step():
        F.scaled_dot_product_attention(qg, kg, vg, is_causal=True).sum().backward()

    sd_fb = median_ms(sdpa_step)
    ref = None
    lse = teacher_lse(qt, kt)
    f = median_ms(lambda: nb.attention_kl(q, k, qt, kt, is_causal=True, lse_t=lse))
    qs0, ks0 = q.detach().requires_grad_(), k.detach().requires_grad_()

    def step_lse():
        nb.attention_kl(qs0, ks0, qt, kt, is_causal=True, lse_t=lse).backward()

    fb = median_ms(step_lse)
    print(
        f"| {N} | teacher lse given (lse_t=, the API's option) | default | {f:.3f} | {sd_f:.3f} | {f / sd_f:.2f} | "
        f"{fb:.3f} | {sd_fb:.3f} | {fb / sd_fb:.2f} | - |",
        flush=True,
    )
    for name, edits in VARIANTS.items():
        try:
            kernels_fwd.attention_fwd_kernel = original if not edits else load_variant(name, edits)
            for cfg in CONFIGS if name == "baseline" else CONFIGS[:1]:
                bc = {"fwd": cfg}
                with torch.no_grad():
                    out = nb.attention_kl(q, k, qt, kt, is_causal=True, reduction="none", block_config=bc)
                ref = out if ref is None else ref
                f = median_ms(lambda: nb.attention_kl(q, k, qt, kt, is_causal=True, block_config=bc))
                qs, ks = q.detach().requires_grad_(), k.detach().requires_grad_()

                def step():
                    nb.attention_kl(qs, ks, qt, kt, is_causal=True, block_config=bc).backward()

                fb = median_ms(step)
                diff = float((out - ref).abs().max()) if "attribution" not in name else float("nan")
                print(
                    f"| {N} | {name} | {cfg} | {f:.3f} | {sd_f:.3f} | {f / sd_f:.2f} | {fb:.3f} | {sd_fb:.3f} | "
                    f"{fb / sd_fb:.2f} | {diff:.1e} |",
                    flush=True,
                )
        except Exception as err:  # a variant the compiler refuses is a result too
            print(f"| {N} | {name} | - | failed: {type(err).__name__}: {str(err).splitlines()[0][:120]} |", flush=True)
        finally:
            kernels_fwd.attention_fwd_kernel = original
