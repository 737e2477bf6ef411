"""Tensor operations shared by the loss families."""

from __future__ import annotations

from typing import Optional

import torch


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulation dtype: float64 stays float64, everything else computes in float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _has_out_dtype(op) -> bool:
    try:
        a = torch.zeros(1, 1, dtype=torch.bfloat16, device="meta")
        op(a)
        return True
    except Exception:
        return False


_MM_OUT_DTYPE = _has_out_dtype(lambda a: torch.mm(a, a, out_dtype=torch.float32))
# addmm with out_dtype has no meta kernel in some torch versions: found out on the first CUDA call
_addmm_out_dtype = [True]


def _cublas_f32_out(a: torch.Tensor, b: torch.Tensor, acc: torch.dtype) -> bool:
    """Whether cuBLAS can take 16-bit operands a, b to an fp32 result directly."""
    return (
        a.is_cuda
        and acc == torch.float32
        and a.dtype in (torch.bfloat16, torch.float16)
        and a.dtype == b.dtype
        and a.dim() == 2
        and b.dim() == 2
    )


def mm_acc(a: torch.Tensor, b: torch.Tensor, acc: torch.dtype) -> torch.Tensor:
    """a @ b with `acc` accumulation and output, without rounding the product to a's dtype.

    On CUDA, bf16/fp16 operands go through the tensor cores with an fp32 output (cuBLAS); on
    other devices, or where torch lacks ``out_dtype``, the operands are upcast first.
    """
    if a.dtype == acc and b.dtype == acc:
        return a @ b
    if _MM_OUT_DTYPE and _cublas_f32_out(a, b, acc):
        return torch.mm(a, b, out_dtype=torch.float32)
    return a.to(acc) @ b.to(acc)


def mm_acc_add(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """out += a @ b, accumulated in out's dtype. On CUDA, 16-bit operands into an fp32 `out` take
    one cuBLAS call with beta = 1: no product temporary, one read-modify-write of `out`."""
    if _addmm_out_dtype[0] and _cublas_f32_out(a, b, out.dtype):
        try:
            torch.addmm(out, a, b, out_dtype=torch.float32, out=out)
            return
        except torch.OutOfMemoryError:
            raise
        except (RuntimeError, TypeError, NotImplementedError):  # rejected at dispatch: nothing written
            _addmm_out_dtype[0] = False
    out += mm_acc(a, b, out.dtype)


def linear_logits(x: torch.Tensor, w: torch.Tensor, b: Optional[torch.Tensor], acc: torch.dtype) -> torch.Tensor:
    """x @ w.T (+ b) accumulated and returned in `acc` (not for use under autograd)."""
    z = mm_acc(x, w.t(), acc)
    if b is not None:
        z.add_(b.to(acc))  # z is a fresh product: add in place, no second slab
    return z


def softcap_(z: torch.Tensor, cap: Optional[float]) -> torch.Tensor:
    """Final-logit softcapping in place (Gemma 2/3): z -> cap * tanh(z / cap); no-op for cap None."""
    if cap is not None:
        z.div_(cap).tanh_().mul_(cap)
    return z


def softcap_grad_(g: torch.Tensor, capped: torch.Tensor, cap: Optional[float]) -> torch.Tensor:
    """g * d capped / d raw = g * (1 - (capped / cap)^2) in place; no-op for cap None."""
    if cap is not None:
        g.mul_(1.0 - (capped / cap).square())
    return g


def grad_needed(*tensors: Optional[torch.Tensor]) -> bool:
    """Whether autograd will want gradients for any of these tensors from the current call."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def kernel_operands(xs, xt, ws, wt, bt, labels):
    """(xs, xt, ws, wt, bt, labels) contiguous. Each side keeps its own dtype: the logit slabs are
    float32 whatever the inputs (a float32 teacher is never rounded to a bf16 student's dtype)."""
    xs, xt, ws, wt = (t.contiguous() for t in (xs, xt, ws, wt))
    return xs, xt, ws, wt, bt, None if labels is None else labels.contiguous()
