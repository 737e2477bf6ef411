"""normalize="topk": its dX and dW kernels one after the other vs concurrently on two streams (dX on the
side stream, or dW), from the same forward. Usage: python two_streams.py (output: two_streams.txt)."""
import torch
from nitrobrew.topk import triton_support as ts
from nitrobrew.topk.rowmath import TopKConfig
from nitrobrew.bench.common import time_ms
from nitrobrew.bench.topk import make_inputs
dev = torch.device("cuda")
cfg = TopKConfig("forward_kl", 0.0, "topk", False, 1.0, 1.0, 0.0)
side = torch.cuda.Stream()
for N, K in ((4096, 64), (16384, 64), (4096, 256)):
    xs, ws, ids, lp, labels = make_inputs(N, 152064, 3584, K, torch.bfloat16, dev, 0)
    mask = torch.ones(N, device=dev)
    scale = torch.full((1,), 1.0 / N, device=dev).as_strided((1,), (0,))
    kd, coef, key, counts = ts.support_forward(xs, ws, None, ids, lp, mask, cfg)
    def seq():
        dx = ts.support_dx(ws, key, coef, scale, xs.dtype)
        dw, db = ts.support_dw(xs, key, coef, scale, 152064, None, counts)
        return dx, dw
    def conc(dx_side):
        main = torch.cuda.current_stream()
        dx = torch.empty_like(xs)
        side.wait_stream(main)
        if dx_side:
            with torch.cuda.stream(side):
                dx = ts.support_dx(ws, key, coef, scale, xs.dtype)
            dw, db = ts.support_dw(xs, key, coef, scale, 152064, None, counts)
        else:
            dx = ts.support_dx(ws, key, coef, scale, xs.dtype)
            with torch.cuda.stream(side):
                dw, db = ts.support_dw(xs, key, coef, scale, 152064, None, counts)
        main.wait_stream(side)
        return dx, dw
    a = seq(); b = conc(True); c = conc(False)
    torch.cuda.synchronize()
    same = all(float((u.float() - v.float()).norm() / v.float().norm()) < 1e-3 for u, v in zip(b + c, a + a))
    t = [time_ms(f, dev, warmup=3, reps=20) for f in (seq, lambda: conc(True), lambda: conc(False))]
    t2 = [time_ms(f, dev, warmup=3, reps=20) for f in (seq, lambda: conc(True), lambda: conc(False))]
    print(f"N={N} K={K}: seq {t[0]:.3f}/{t2[0]:.3f}  dx-side {t[1]:.3f}/{t2[1]:.3f}  dw-side {t[2]:.3f}/{t2[2]:.3f}  same={same}", flush=True)
    del xs, ws, ids, lp
    torch.cuda.empty_cache()
