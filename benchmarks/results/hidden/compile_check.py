"""GPU check of the hidden-state losses inside torch.compile and CUDA graphs (one call).

A training step (Linear(Ds, Ds) on the student's hidden states, then the loss, then backward)
at V=152064, Ds=3584, Dt=5120, N=4096, bf16, in each setting: eager; torch.compile (inductor,
fullgraph=True: any graph break fails); torch.compile mode="reduce-overhead" (inductor's CUDA
graphs); and a CUDA graph captured by hand around eager forward+backward. For each: the number of
graphs and breaks (dynamo's explain), loss and gradient relative differences to eager, and the
median step time. grad_filter inside a capture must raise its documented error.
Usage: compile_check.py OUT.md
"""
import gc
import sys

import torch

import nitrobrew as nb
from nitrobrew.bench.common import environment, time_ms

V, DS, DT, N = 152064, 3584, 5120, 4096


def rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def main(path):
    dev = torch.device("cuda")
    torch.manual_seed(0)
    bf = torch.bfloat16
    lin = torch.nn.Linear(DS, DS, device=dev, dtype=bf)
    h = torch.randn(N, DS, device=dev, dtype=bf)
    xt = torch.randn(N, DT, device=dev, dtype=bf)
    ws = (torch.randn(V, DS, device=dev) * (3 / DS**0.5)).to(bf).requires_grad_()
    wt = (torch.randn(V, DT, device=dev) * (3 / DT**0.5)).to(bf)
    params = [lin.weight, lin.bias, ws]
    settings = [("fast, mean", dict()), ("constant memory, mean", dict(chunk_V=8192)),
                ("fast, reduction=none (summed)", dict(reduction="none"))]
    lines = [f"environment: {environment()}", "",
             "| loss options | setting | graphs | breaks | loss rel diff | grad rel diff (max of 3) | step ms |",
             "|---|---|---|---|---|---|---|"]

    for label, kw in settings:
        def loss_fn():
            out = nb.forward_kl(lin(h), xt, ws, wt, **kw)
            return out.sum() if out.dim() else out

        def step(fn=loss_fn):
            for p in params:
                p.grad = None
            loss = fn()
            loss.backward()
            return loss

        ref_loss = step().detach().clone()
        ref_grads = [p.grad.clone() for p in params]
        ms = time_ms(step, dev, warmup=2, reps=7)
        lines.append(f"| {label} | eager | - | - | 0 | 0 | {ms:.2f} |")
        # no autograd graph of an earlier setting may stay alive (compiled ones included): the capture's
        # warm-up must create fresh gradient accumulators on its own stream
        torch._dynamo.reset()
        gc.collect()
        torch.cuda.synchronize()
        # hand-captured CUDA graph of eager forward + backward
        try:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(2):
                    step()
            torch.cuda.current_stream().wait_stream(side)
            for p in params:
                p.grad = None
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                static_loss = loss_fn()
                static_loss.backward()
            graph.replay()
            torch.cuda.synchronize()
            err = max(rel(p.grad, b) for p, b in zip(params, ref_grads))
            ms = time_ms(graph.replay, dev, warmup=2, reps=7)
            lines.append(f"| {label} | CUDA graph (eager capture) | - | - | {rel(static_loss, ref_loss):.1e} | "
                         f"{err:.1e} | {ms:.2f} |")
            del graph
        except Exception as e:
            lines.append(f"| {label} | CUDA graph (eager capture) | - | - | FAILED: {type(e).__name__}: "
                         f"{str(e)[:150]} | | |")
        print(lines[-1], flush=True)

        explain = torch._dynamo.explain(loss_fn)()
        for mode in ("default", "reduce-overhead"):
            torch._dynamo.reset()
            try:
                cfn = torch.compile(loss_fn, fullgraph=True, mode=mode)
                loss = step(cfn).detach().clone()
                grads = [p.grad.clone() for p in params]
                ms = time_ms(lambda: step(cfn), dev, warmup=2, reps=7)
                err = max(rel(a, b) for a, b in zip(grads, ref_grads))
                skips = sum(torch._dynamo.utils.counters["inductor"].get(k, 0) for k in ("cudagraph_skips",))
                note = f" (cudagraph skips: {skips})" if mode == "reduce-overhead" else ""
                lines.append(f"| {label} | compile {mode}{note} | {explain.graph_count} | {explain.graph_break_count} | "
                             f"{rel(loss, ref_loss):.1e} | {err:.1e} | {ms:.2f} |")
            except Exception as e:  # report and go on
                lines.append(f"| {label} | compile {mode} | {explain.graph_count} | {explain.graph_break_count} | "
                             f"FAILED: {type(e).__name__}: {str(e)[:150]} | | |")
            print(lines[-1], flush=True)
    # grad_filter inside a capture: the documented error, before any kernel runs
    torch._dynamo.reset()
    try:
        graph = torch.cuda.CUDAGraph()
        for p in params:
            p.grad = None
        with torch.cuda.graph(graph):
            nb.forward_kl(lin(h), xt, ws, wt, grad_filter=True).backward()
        result = "no error (unexpected)"
    except RuntimeError as e:
        result = f"RuntimeError: {str(e)[:120]}"
    lines += ["", f"grad_filter inside a CUDA graph capture: {result}"]
    open(path, "w").write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main(sys.argv[1])
