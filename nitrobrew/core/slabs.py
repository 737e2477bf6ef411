"""The slab plumbing the loss families share: logits of a vocab range (softcapped in place), their
gradient fed into dX/dW/db, gradient buffers, and gradients formed in the forward and handed to the
backward once (fast modes with a scalar reduction)."""

from __future__ import annotations

from typing import Optional

import torch

from . import checks as ck
from .ops import linear_logits, mm_acc, mm_acc_add, softcap_

Tensor = torch.Tensor
F32 = torch.float32


def chunk_logits(
    x: Tensor, w: Tensor, b: Optional[Tensor], lo: int, hi: int, acc, softcap: Optional[float] = None
) -> Tensor:
    """Logits of the head rows [lo, hi) in `acc`, softcapped when softcap is given."""
    return softcap_(linear_logits(x, w[lo:hi], None if b is None else b[lo:hi], acc), softcap)


def gather_label_logit(z: Tensor, labels: Optional[Tensor], lo: int, hi: int) -> Tensor:
    """z[row, label - lo] where the label falls in [lo, hi), else 0."""
    if labels is None:
        return torch.zeros(z.shape[0], dtype=z.dtype, device=z.device)
    inside = (labels >= lo) & (labels < hi)
    col = torch.where(inside, labels - lo, torch.zeros_like(labels))
    picked = z.gather(1, col[:, None]).squeeze(1)
    return torch.where(inside, picked, torch.zeros_like(picked))


def head_grads_from_chunk(g, xs_acc, ws, c0: int, c1: int, dx, dw, db) -> None:
    """Feed the logit-gradient chunk g [N, c1 - c0] into dX (accumulated) and the chunk's dW, db rows."""
    dx += g @ ws[c0:c1].to(g.dtype)
    if dw is not None:
        dw[c0:c1] = (g.t() @ xs_acc).to(dw.dtype)
    if db is not None:
        db[c0:c1] = g.sum(0).to(db.dtype)


def accumulate_dw(dw: torch.Tensor, g: torch.Tensor, xs: torch.Tensor, first: bool) -> None:
    """dw += g^T xs; the first block writes dw instead (no zero-fill pass over the head)."""
    if dw.dtype == g.dtype:
        torch.mm(g.t(), xs, out=dw) if first else dw.addmm_(g.t(), xs)
    elif first:
        dw.copy_(mm_acc(g.t(), xs, dw.dtype))
    else:
        mm_acc_add(dw, g.t(), xs)


def keep_for_backward(ctx, cfg, plan, grads, state, saved) -> None:
    """What a fast mode's backward needs: the gradients formed in the forward (grads, when not None),
    or the inputs (saved) and the row state to form them again."""
    ctx.cfg, ctx.plan, ctx.precompute = cfg, plan, grads is not None
    if grads is not None:
        ctx.grads = grads
        ctx.save_for_backward()
    else:
        ctx.state = state
        ctx.save_for_backward(*saved)


def scale_by_upstream(grads, upstream: torch.Tensor):
    """Each gradient in `grads` (None kept) times the upstream gradient, unless that is exactly 1
    (``loss.backward()``): in place, as the buffers are the loss's own (a copy of dW would add [V, Ds]
    to the peak). On CUDA (and under Triton's interpreter) one kernel launch for all of them reads the
    upstream gradient on the device and returns at once when it is 1, so the backward does not wait for
    the device; on the CPU the host reads it. Under compilation the product is always taken, out of place."""
    if torch.compiler.is_compiling():
        return tuple(None if g is None else g * _factor(upstream, g) for g in grads)
    one = None
    by_kernel = []
    for g in grads:
        flat = None if g is None else _storage_span(g)
        if flat is not None and (g.is_cuda or ck.interpreter_enabled()) and ck.triton_available():
            by_kernel.append(flat)
        elif g is not None:
            if g.is_cuda and torch.cuda.is_current_stream_capturing():
                g.mul_(_factor(upstream, g))
            else:
                one = bool(upstream == 1) if one is None else one
                if not one:
                    g.mul_(_factor(upstream, g))
    if by_kernel:
        from . import kernels  # Triton is optional: imported only where a kernel runs

        # one launch a device and precision (the product in fp64 for fp64 gradients only), four tensors a launch
        for device, fp64 in dict.fromkeys((t.device, t.dtype == torch.float64) for t in by_kernel):
            group = [t for t in by_kernel if t.device == device and (t.dtype == torch.float64) == fp64]
            up = upstream.detach().reshape(1).to(device=device)
            for k in range(0, len(group), kernels.MAX_SCALED):
                kernels.launch_scale_all(group[k : k + kernels.MAX_SCALED], up)
    return tuple(grads)


def _storage_span(g: torch.Tensor) -> Optional[torch.Tensor]:
    """A 1-D view of the storage a dense tensor covers (contiguous or permuted: every element once),
    else None."""
    if g.is_contiguous() or g.numel() == 0:
        return g.reshape(-1)
    expected = 1
    for stride, size in sorted((st, sz) for sz, st in zip(g.shape, g.stride()) if sz != 1):
        if stride != expected:
            return None
        expected *= size
    return g.as_strided((g.numel(),), (1,))


def _factor(upstream: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """The upstream gradient in fp32 (fp64 for fp64 gradients): the product is rounded once, as the kernel's."""
    return upstream.to(device=g.device, dtype=torch.promote_types(g.dtype, F32))


def take_precomputed_grads(ctx, grad_total):
    """(dx, dw, db) formed in the forward (ctx.grads), times the upstream gradient (`scale_by_upstream`).
    The context's reference is dropped so autograd can take the buffers as .grad without a copy."""
    if ctx.grads is None:
        raise RuntimeError(
            "nitrobrew: this loss formed its gradients in the forward (Triton fast mode, scalar reduction) and "
            "handed them out in the first backward; a second backward through the same graph (retain_graph=True) "
            "is not supported. Compute the loss again, or use mode='constant_memory' or backend='torch'."
        )
    grads = ctx.grads
    ctx.grads = None
    return scale_by_upstream(grads, grad_total)


def alloc_grads(xs, ws, bs, dw_fp32: bool, need_x: bool = True, need_w: bool = True):
    """Gradient buffers (None where not needed): dX in xs's dtype, dW in fp32 or the head's dtype, db fp32."""
    dx = torch.empty_like(xs) if need_x else None
    dw = torch.empty(ws.shape, dtype=F32 if dw_fp32 else ws.dtype, device=ws.device) if need_w else None
    db = torch.zeros(bs.shape, dtype=F32, device=bs.device) if (need_w and bs is not None) else None
    return dx, dw, db


def finish_grads(dx, dw, db, ws, bs):
    """The buffers of ``alloc_grads`` in the dtypes of the head and bias."""
    return dx, None if dw is None else dw.to(ws.dtype), None if db is None else db.to(bs.dtype)
