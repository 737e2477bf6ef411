"""Sustained vs rested clocks: the 4-GEMM floor, a fast-mode forward_kl fwd+bwd and its no-grad forward at N=4096 (V=152064,
Ds=3584, Dt=5120, bf16), timed back to back and with 0.3 s pauses before each call; then one profiled step (kernel
span and busy time). Usage: python clock_check.py (output: clock_check.txt)."""
import torch, nitrobrew as nb, json, time, statistics, subprocess
from torch.profiler import profile, ProfilerActivity
from nitrobrew.bench.hidden import make_data
from nitrobrew.bench.common import time_ms
from nitrobrew.bench import baselines as bl
dev = torch.device("cuda")
d = make_data("random", 4096, 152064, 3584, 5120, torch.bfloat16, dev, 0)
x = d.xs.detach().clone().requires_grad_(); w = d.ws.detach().clone().requires_grad_()
def step():
    return torch.autograd.grad(nb.forward_kl(x, d.xt, w, d.wt, backend="triton"), [x, w])
def fwd_only():
    with torch.no_grad():
        return nb.forward_kl(x, d.xt, w, d.wt, backend="triton")
g = torch.randn(4096, 152064, device=dev, dtype=torch.bfloat16)
floor = lambda: bl.gemm_floor(x.detach(), d.xt, w.detach(), d.wt, g)
def ev_each(fn, reps=7, pause=0.0):
    out = []
    for _ in range(reps):
        torch.cuda.synchronize(); time.sleep(pause)
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); fn(); b.record(); torch.cuda.synchronize(); out.append(a.elapsed_time(b))
    return statistics.median(out), min(out)
for _ in range(3): step(); floor()
for name, fn in (("floor", floor), ("step", step), ("fwd no-grad", fwd_only)):
    print(name, "back-to-back", ev_each(fn), "with 0.3 s pauses", ev_each(fn, pause=0.3), flush=True)
print(subprocess.run(["nvidia-smi", "--query-gpu=clocks.sm,clocks.max.sm,power.draw,power.limit,temperature.gpu", "--format=csv"], capture_output=True, text=True).stdout)
with profile(activities=[ProfilerActivity.CUDA]) as prof:
    step(); torch.cuda.synchronize()
prof.export_chrome_trace("/tmp/trace.json")
ev = json.load(open("/tmp/trace.json"))["traceEvents"]
k = sorted([e for e in ev if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")], key=lambda e: e["ts"])
print("profiled step: span us", k[-1]["ts"] + k[-1]["dur"] - k[0]["ts"], "busy us", sum(e["dur"] for e in k))
