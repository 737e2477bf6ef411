"""A/B of a normalize="topk" fwd+bwd step, run once per source tree (PYTHONPATH): bench-style wall (three
medians of 30, CUDA events, synchronized before each call), host time of a step, a loop of 30 steps
without syncs between them (per step), and the step replayed from a CUDA graph. Usage: python ab_host.py TAG."""
import sys, time, statistics, traceback
import torch
import nitrobrew
from nitrobrew.topk import topk_kl
from nitrobrew.bench.common import time_ms
from nitrobrew.bench.topk import make_inputs
dev = torch.device("cuda")
tag = sys.argv[1]
for N, K in ((4096, 64), (4096, 256), (16384, 64)):
    xs, ws, ids, lp, labels = make_inputs(N, 152064, 3584, K, torch.bfloat16, dev, 0)
    def step():
        x = xs.detach().requires_grad_(); w = ws.detach().requires_grad_()
        topk_kl(x, w, ids, lp, normalize="topk", backend="triton").backward()
    wall = [time_ms(step, dev, warmup=3, reps=30) for _ in range(3)]
    hs = []
    for _ in range(30):
        torch.cuda.synchronize(); t0 = time.perf_counter(); step(); hs.append((time.perf_counter() - t0) * 1e3)
    torch.cuda.synchronize()
    # back-to-back steps without a sync between them (a training loop), per step
    torch.cuda.synchronize(); t0 = time.perf_counter()
    for _ in range(30): step()
    torch.cuda.synchronize(); loop = (time.perf_counter() - t0) / 30 * 1e3
    gms = float("nan")
    try:
        x = xs.detach().requires_grad_(); w = ws.detach().requires_grad_()
        s = torch.cuda.Stream(); s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(3):
                torch.autograd.grad(topk_kl(x, w, ids, lp, normalize="topk", backend="triton"), [x, w])
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = torch.autograd.grad(topk_kl(x, w, ids, lp, normalize="topk", backend="triton"), [x, w])
        gms = time_ms(graph.replay, dev, warmup=3, reps=30)
        del graph, out
    except Exception:
        traceback.print_exc()
    print(f"{tag} N={N} K={K}: wall {' '.join(f'{w:.3f}' for w in wall)} ms | host {statistics.median(hs):.3f} | "
          f"loop {loop:.3f} | graph {gms:.3f}", flush=True)
    del xs, ws, ids, lp
    torch.cuda.empty_cache()
