"""The exactness contract on a GPU (the CI runs it on CPU, with the Triton interpreter): every case of
tests/test_exactness.py that has a CUDA form, on CUDA tensors with the compiled kernels, against float64.

    python benchmarks/exactness_gpu_check.py > exactness_gpu.md
"""

import math

import torch

import nitrobrew as nb
from nitrobrew.bench.common import rel_err
from nitrobrew.hidden import reference_loss
from nitrobrew.topk.reference import reference_topk_loss

DEV = torch.device("cuda")
rows = []


def check(name, ok, detail=""):
    rows.append((name, "ok" if ok else "FAILED", detail))


g = torch.Generator(device=DEV).manual_seed(0)
modes = {"fast": {}, "constant_memory": {"chunk_V": 4096}}
V, D = 32768, 256
# one side underflows: a -inf mask, a 200-nat gap, a cold temperature; every divergence, both modes
for side in ("teacher", "student"):
    for gap in (200.0, math.inf):
        for T in (0.25, 1.0):
            xs = torch.randn(64, D, device=DEV, generator=g)
            ws = torch.randn(V, D, device=DEV, generator=g) * (3 / D**0.5)
            wt = ws + torch.randn(V, D, device=DEV, generator=g) * (0.3 / D**0.5)
            bias = torch.zeros(V, device=DEV)
            bias[torch.randperm(V, device=DEV, generator=g)[:500]] = -gap * T
            bs, bt = (bias, None) if side == "student" else (None, bias)
            for name in ("forward_kl", "reverse_kl", "jsd", "tvd", "skew_kl", "skew_reverse_kl"):
                exact = reference_loss(
                    xs.double(),
                    xs.double(),
                    ws.double(),
                    wt.double(),
                    divergence=name,
                    param=0.3 if name in ("jsd", "skew_kl", "skew_reverse_kl") else 0.0,
                    bs=None if bs is None else bs.double(),
                    bt=None if bt is None else bt.double(),
                    temperature=T,
                    reduction="none",
                )
                if not bool(torch.isfinite(exact).all()):
                    continue
                kw = {"beta": 0.3} if name == "jsd" else ({"alpha": 0.3} if "skew" in name else {})
                # the fp32 floor: the same loss materialized in float32 (fp32 logits, fp32 log_softmax)
                floor = reference_loss(
                    xs,
                    xs,
                    ws,
                    wt,
                    divergence=name,
                    bs=bs,
                    bt=bt,
                    temperature=T,
                    param=0.3 if kw else 0.0,
                    reduction="none",
                    dtype=torch.float32,
                )
                f_err = float((floor.double() - exact).abs().max())
                for mode, extra in modes.items():
                    got = getattr(nb, name)(
                        xs, xs, ws, wt, bs=bs, bt=bt, temperature=T, reduction="none", mode=mode, **extra, **kw
                    )
                    err = float((got.double() - exact).abs().max())
                    scale = float(exact.abs().max())
                    check(
                        f"{name} {mode} {side} gap {gap} T {T}",
                        err <= max(4 * f_err, 1e-5 * scale),
                        f"max abs err {err:.1e} (fp32 materialized: {f_err:.1e}; largest row {scale:.2g})",
                    )
# the close regime with a little mass underflowing on the other side
xs = torch.randn(32, D, device=DEV, generator=g)
ws = torch.randn(V, D, device=DEV, generator=g) * (3 / D**0.5)
wt = ws + torch.randn(V, D, device=DEV, generator=g) * (0.01 * 3 / D**0.5)
bias = torch.zeros(V, device=DEV)
bias[17] = -300.0
for name, (bs, bt) in (("forward_kl", (None, bias)), ("reverse_kl", (bias, None))):
    exact = reference_loss(
        xs.double(),
        xs.double(),
        ws.double(),
        wt.double(),
        divergence=name,
        bs=None if bs is None else bs.double(),
        bt=None if bt is None else bt.double(),
        reduction="none",
    )
    for mode, extra in modes.items():
        got = getattr(nb, name)(xs, xs, ws, wt, bs=bs, bt=bt, reduction="none", mode=mode, **extra)
        err = float(((got.double() - exact).abs() / exact).max())
        check(
            f"{name} {mode} close + 1 entry 300 nats down (KL ~{float(exact.mean()):.1e})",
            err < 2e-3,
            f"max rel err {err:.1e}",
        )
# softcap, bf16, CE, every mode
xs = (torch.randn(128, D, device=DEV, generator=g) * 3).bfloat16().requires_grad_()
xt = (torch.randn(128, D, device=DEV, generator=g) * 3).bfloat16()
ws = torch.randn(V, D, device=DEV, generator=g).bfloat16().requires_grad_()
wt = torch.randn(V, D, device=DEV, generator=g).bfloat16()
labels = torch.randint(0, V, (128,), device=DEV, generator=g)
for mode, extra in modes.items():
    kw = dict(softcap_s=30.0, softcap_t=20.0, temperature=1.5, labels=labels, ce_weight=0.3)
    got = nb.jsd(xs, xt, ws, wt, mode=mode, **extra, **kw)
    ref = reference_loss(xs, xt, ws, wt, divergence="jsd", param=0.5, **kw)
    gg = torch.autograd.grad(got, (xs, ws))
    rg = torch.autograd.grad(ref, (xs, ws))
    errs = [abs(float(got) - float(ref)) / float(ref)] + [rel_err(a, b) for a, b in zip(gg, rg)]
    check(
        f"jsd softcap bf16 {mode}",
        errs[0] < 1e-5 and max(errs[1:]) < 1e-2,
        "loss / dX / dW rel err " + " / ".join(f"{e:.1e}" for e in errs),
    )
lp, ids = torch.log_softmax(torch.randn(128, V, device=DEV, generator=g) * 3, -1).topk(64, -1)
got = nb.topk_kl(xs, ws, ids, lp, softcap_s=30.0, temperature=1.5)
ref = reference_topk_loss(xs, ws, ids, lp, softcap_s=30.0, temperature=1.5)
check("topk_kl softcap bf16 fast", abs(float(got) - float(ref)) / float(ref) < 1e-5)
# NaN, empty batch, retain_graph, double backward, mixed dtypes, stored-data refusals
x = torch.randn(8, D, device=DEV, generator=g)
w = torch.randn(V, D, device=DEV, generator=g)
xn = x.clone()
xn[3, 0] = float("nan")
for name in ("forward_kl", "jsd", "tvd"):
    check(f"NaN counted row -> NaN ({name})", bool(torch.isnan(getattr(nb, name)(x, xn, w, w))))
lab = torch.tensor([0, 1, 2, -100, 4, 5, 6, 7], device=DEV)
xg = x.clone().requires_grad_()
loss = nb.forward_kl(xg, xn, w, w, labels=lab)
loss.backward()
check("NaN in an ignored row does not leak", bool(torch.isfinite(loss)) and bool(torch.isfinite(xg.grad).all()))
e = torch.zeros(0, D, device=DEV, requires_grad=True)
le = nb.forward_kl(e, torch.zeros(0, D, device=DEV), w, w)
le.backward()
check("empty batch: loss 0", float(le) == 0.0)
xg = x.clone().requires_grad_()
loss = nb.forward_kl(xg, x, w, w)
loss.backward(retain_graph=True)
try:
    loss.backward()
    check("retain_graph second backward refused (fast mode)", False)
except RuntimeError as err:
    check("retain_graph second backward refused (fast mode)", "second backward" in str(err))
try:
    torch.autograd.grad(nb.forward_kl(xg, x, w, w), xg, create_graph=True)
    check("double backward refused", False)
except RuntimeError as err:
    check("double backward refused", "double backward" in str(err))
got = nb.forward_kl(x.bfloat16(), x * 2, w.bfloat16(), w)
ref = reference_loss(x.bfloat16().double(), (x * 2).double(), w.bfloat16().double(), w.double())
rounded = reference_loss(
    x.bfloat16().double(), (x * 2).bfloat16().double(), w.bfloat16().double(), w.bfloat16().double()
)
check(
    "float32 teacher with a bf16 student: not rounded",
    abs(float(got) - float(ref)) < 0.1 * abs(float(rounded) - float(ref)),
    f"{float(got):.6f}; exact {float(ref):.6f}; teacher rounded to bf16 {float(rounded):.6f}",
)
dup = ids.clone()
dup[5, 7] = dup[5, 2]
for bad, what, text in ((dup, "repeated id", "repeats an id"), (None, "not a sub-distribution", "sub-distribution")):
    try:
        nb.topk_kl(xs, ws, ids if bad is None else bad, lp if bad is not None else torch.log_softmax(lp, -1) + 0.01)
        check(f"topk refuses a {what}", False)
    except ValueError as err:
        check(f"topk refuses a {what}", text in str(err))

print(f"# Exactness on {torch.cuda.get_device_name()} (torch {torch.__version__})\n")
print("| case | result | detail |\n|---|---|---|")
for r in rows:
    print(f"| {r[0]} | {r[1]} | {r[2]} |")
failed = [r for r in rows if r[1] != "ok"]
print(f"\n{len(rows) - len(failed)} passed, {len(failed)} failed")
raise SystemExit(1 if failed else 0)
