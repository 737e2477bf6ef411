"""normalize="full" fast mode at memory budgets of 128, 64 and 32 MiB against cut-cross-entropy (time, peak above inputs
and gradients, error on 128 rows at N = 4096). Usage: python budget_probe.py (output: budget_probe.txt)."""
import torch
from nitrobrew.topk import topk_kl
from nitrobrew.bench.common import time_ms, peak_mib
from nitrobrew.bench.topk import make_inputs, _fwd_bwd, _accuracy
from cut_cross_entropy import linear_cross_entropy
dev = torch.device("cuda")
for N in (4096, 16384):
    xs, ws, ids, lp, labels = make_inputs(N, 152064, 3584, 64, torch.bfloat16, dev, 0)
    grads = (xs.numel() + ws.numel()) * 2 / 2**20
    step = _fwd_bwd(lambda x, w: linear_cross_entropy(x, w, labels), xs, ws)
    cce = time_ms(step, dev, warmup=1, reps=3)
    print(f"N={N} cce {cce:.2f} ms above {peak_mib(step, dev) - grads:.1f} MiB", flush=True)
    for mib in (None, 128, 64, 32):
        b = None if mib is None else mib << 20
        step = _fwd_bwd(lambda x, w: topk_kl(x, w, ids, lp, normalize="full", backend="triton", memory_budget=b), xs, ws)
        ms = time_ms(step, dev, warmup=1, reps=3)
        above = peak_mib(step, dev) - grads
        err = ""
        if N == 4096:
            import nitrobrew.bench.topk as bt
            bt.METHOD_KWARGS["probe"] = dict(normalize="full", backend="triton", memory_budget=b)
            err = f"err {_accuracy('probe', xs, ws, ids, lp, labels, 128):.1e}"
        print(f"N={N} full budget {mib} MiB: {ms:.2f} ms ({ms / cce:.2f}x cce) above {above:.1f} MiB {err}", flush=True)
    del xs, ws, ids, lp, labels
    torch.cuda.empty_cache()
