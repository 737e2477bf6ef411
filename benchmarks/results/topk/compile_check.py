"""topk_kl inside a torch.compile(d) step on the GPU (inductor): graph count and breaks (torch._dynamo.explain), loss and
gradients against the eager step. Usage: python compile_check.py (output: compile_check.txt)."""
import torch
from nitrobrew.topk import topk_kl
from nitrobrew.bench.topk import make_inputs
dev = torch.device("cuda")
xs, ws, ids, lp, labels = make_inputs(2048, 152064, 1024, 64, torch.bfloat16, dev, 0)
lin = torch.nn.Linear(1024, 1024, device=dev, dtype=torch.bfloat16)
w = ws.detach().requires_grad_()
for norm in ("topk", "full"):
    def step():
        return topk_kl(torch.tanh(lin(xs)), w, ids, lp, normalize=norm, labels=labels) * 2.0 + w.float().square().mean()
    e = step(); ge = torch.autograd.grad(e, [lin.weight, w])
    ex = torch._dynamo.explain(step)()
    torch._dynamo.reset()
    cstep = torch.compile(step)
    for _ in range(2):
        c = cstep(); gc = torch.autograd.grad(c, [lin.weight, w])
    rel = [float((a.float() - b.float()).norm() / b.float().norm()) for a, b in zip(gc, ge)]
    print(f"compile {norm}: graphs {ex.graph_count} breaks {ex.graph_break_count} loss {float(c):.6f} vs {float(e):.6f} grads rel {rel}", flush=True)
