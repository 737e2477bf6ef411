"""Baselines that `nitrobrew bench hidden` measures nitrobrew against.

Every function takes the same flattened problem: student hidden ``xs`` [N, Ds] and head ``ws``
[V, Ds] (both require grad), teacher hidden ``xt`` [N, Dt] and head ``wt`` [V, Dt] (constants),
and returns a scalar loss (mean over rows) to call ``.backward()`` on. Optional third-party
baselines import lazily; ``*_unavailable()`` returns why one cannot run here (or None).

What each baseline is, and what its API needed (checked against the released packages):

- ``gemm_floor``: the four GEMMs every exact method must do (s = xs ws^T, t = xt wt^T,
  dX = G ws, dW = G^T xs with a random G of the logits' shape), bare, in the input dtype.
- ``naive_loss``: what a user writes: the LM heads' logits in the input dtype (as a model's
  ``lm_head`` returns them), upcast to fp32 for log_softmax, ``F.kl_div``, autograd. Both [N, V]
  logit sets (and their fp32 copies) are materialized.
- ``liger_chunked``: liger-kernel's ``LigerFusedLinearJSDLoss`` (liger_kernel.chunked_loss,
  0.8.5). Arguments are (student_input, student_weight, teacher_input, teacher_weight,
  true_labels): student first. Its JSD is TRL's convention, M = beta p + (1-beta) q,
  loss = beta KL(p||M) + (1-beta) KL(q||M); ``beta=0`` is special-cased to exactly
  F.kl_div(log q, log p) = KL(p||q), our forward_kl. The module's defaults mix in a hard-label CE
  (weight_hard_loss=0.5, weight_soft_loss=0.5), so we pass 0 and 1 (with weight_hard_loss=0 the
  CE is not computed at all). true_labels is required (rows equal to ignore_index are masked; the
  mean divides by the number of valid rows): we pass random ids, all valid. It chunks over rows
  (chunk_size=1024 rows, torch.compile'd per-chunk grad by default), computes the student's
  chunk logits and their log_softmax in the input dtype (bf16) and the gradients during the
  forward. Ds != Dt is allowed (two separate projections).
- ``liger_fused``: liger-kernel's ``LigerFusedLinearJSD`` (liger_kernel.transformers, 0.8.5),
  argument ``jsd_beta`` (not ``beta``), same student-first order, labels optional (None: every
  row counts). Same convention: its Triton JSD kernel special-cases beta == 0 as
  sum p (log p - log q) = forward KL. fp32 logits (GEMM with an fp32 output), row chunks sized
  ceil(N / ceil(V / Ds)) on Hopper, gradients computed in the forward. Ds != Dt is allowed
  ("hidden size H and H' can be different"). Needs CUDA (Triton kernels).
- ``cce_student_ce``: cut-cross-entropy's ``linear_cross_entropy(e, c, targets)`` (25.1.1) on
  the student alone with random labels: a single-distribution reference for how fast one fused
  linear + softmax loss can be. With its default filter_eps="auto" it skips gradient blocks whose
  probabilities are below eps(dtype)/32, so its time depends on the data (``bench topk`` also
  runs it with filter_eps=None). Not a distillation loss. Needs CUDA (Triton kernels).
"""

from __future__ import annotations

import importlib
from typing import Optional, Tuple

import torch
import torch.nn.functional as F

from .. import divergences as dv
from .common import package_version

# ---------------------------------------------------------------- GEMM floor


def floor_chunk_rows(n: int, vocab: int, elem: int, device: torch.device, fraction: float = 0.35) -> int:
    """Rows per chunk so that the three [C, V] GEMM outputs/operands (s, t, G) fit in memory."""
    need = 3 * n * vocab * elem
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        budget = fraction * free
    else:
        budget = 4 * 2**30
    if need <= budget:
        return n
    rows = max(1, int(budget // (3 * vocab * elem)))
    chunk = 1
    while chunk * 2 <= rows:
        chunk *= 2
    return chunk


def gemm_floor(xs: torch.Tensor, xt: torch.Tensor, ws: torch.Tensor, wt: torch.Tensor, g: torch.Tensor) -> None:
    """s = xs ws^T, t = xt wt^T, dX = G ws, dW = G^T xs: bare GEMMs, row-chunked by g.shape[0]."""
    n, chunk = xs.shape[0], g.shape[0]
    with torch.no_grad():
        if chunk >= n:
            s = xs @ ws.t()
            t = xt @ wt.t()
            dx = g[:n] @ ws
            dw = g[:n].t() @ xs
            del s, t, dx, dw
            return
        dw = torch.zeros_like(ws)
        for r0 in range(0, n, chunk):
            r1 = min(n, r0 + chunk)
            gc = g[: r1 - r0]
            s = xs[r0:r1] @ ws.t()
            t = xt[r0:r1] @ wt.t()
            dx = gc @ ws
            dw.addmm_(gc.t(), xs[r0:r1])
            del s, t, dx


# ---------------------------------------------------------------- naive PyTorch


def naive_loss(
    xs: torch.Tensor,
    xt: torch.Tensor,
    ws: torch.Tensor,
    wt: torch.Tensor,
    divergence: str = "forward_kl",
    param: float = 0.0,
    temperature: float = 1.0,
) -> torch.Tensor:
    """Materialize both logit sets, fp32 log_softmax, mean over rows of D(p || q); autograd."""
    s = (xs @ ws.t()).float() / temperature
    with torch.no_grad():
        t = (xt @ wt.t()).float() / temperature
    lq = torch.log_softmax(s, dim=-1)
    lp = torch.log_softmax(t, dim=-1)
    if divergence == "forward_kl":
        rows = F.kl_div(lq, lp, reduction="none", log_target=True).sum(-1)
    else:
        rows = dv.elementwise(divergence, lp, lq, param)[0].sum(-1)
    return rows.mean()


_COMPILED = {}
_MODULES = {}


def naive_compiled():
    """naive_loss under torch.compile (static shapes: one graph per problem size)."""
    # One graph per shape; dynamo's per-function recompile limit (8) covers the bench's sizes
    # (each N plus the accuracy rows). Global dynamo settings are left alone: Liger compiles too.
    if "naive" not in _COMPILED:
        _COMPILED["naive"] = torch.compile(naive_loss, dynamic=False)
    return _COMPILED["naive"]


def compile_unavailable(device: torch.device) -> Optional[str]:
    try:
        import torch._dynamo  # noqa: F401
        import torch._inductor  # noqa: F401
    except Exception as err:  # pragma: no cover - depends on the build
        return f"torch.compile unavailable ({err})"
    return None


# ---------------------------------------------------------------- Liger-Kernel


def _not_importable(dist: str, err: BaseException) -> str:
    if (
        isinstance(err, ModuleNotFoundError)
        and err.name
        and err.name.split(".")[0] in (dist.replace("-", "_"), "liger_kernel", "cut_cross_entropy")
    ):
        return f"{dist} not installed"
    return f"{dist} not importable ({type(err).__name__}: {err})"[:160]


def _import(name: str):
    return importlib.import_module(name)


def liger_unavailable(device: torch.device, fused: bool) -> Optional[str]:
    try:
        if fused:
            _import("liger_kernel.transformers.fused_linear_jsd")
        else:
            _import("liger_kernel.chunked_loss.jsd_loss")
    except Exception as err:
        return _not_importable("liger-kernel", err)
    if fused and device.type != "cuda":
        return "liger fused needs CUDA (Triton kernels)"
    return None


def liger_chunked(
    xs, xt, ws, wt, labels, temperature: float = 1.0, compiled: bool = True, chunk_size: int = 1024
) -> torch.Tensor:
    """LigerFusedLinearJSDLoss at beta=0 (forward KL(p||q)), distillation term only."""
    mod = _import("liger_kernel.chunked_loss.jsd_loss")
    key = ("liger_chunked", temperature, compiled, chunk_size)
    shape = (tuple(xs.shape), tuple(xt.shape))
    if compiled and _MODULES.get("liger_chunked_shape") not in (None, shape):
        # Liger's compiled chunk step keeps graphs specialized to the first problem size and
        # fails on the next one; start each size from a clean dynamo cache.
        torch._dynamo.reset()
        _MODULES.pop(key, None)
    _MODULES["liger_chunked_shape"] = shape
    if key not in _MODULES:
        _MODULES[key] = mod.LigerFusedLinearJSDLoss(
            weight_hard_loss=0.0,
            weight_soft_loss=1.0,
            beta=0.0,
            ignore_index=-100,
            temperature=temperature,
            compiled=compiled,
            chunk_size=chunk_size,
        )
    return _MODULES[key](xs, ws, xt, wt, labels)


def liger_fused(xs, xt, ws, wt, temperature: float = 1.0) -> torch.Tensor:
    """LigerFusedLinearJSD at jsd_beta=0 (forward KL(p||q)), no labels: every row counts."""
    mod = _import("liger_kernel.transformers.fused_linear_jsd")
    key = ("liger_fused", temperature)
    if key not in _MODULES:
        _MODULES[key] = mod.LigerFusedLinearJSD(jsd_beta=0.0, ignore_index=-100, temperature=temperature)
    return _MODULES[key](xs, ws, xt, wt, None)


# ---------------------------------------------------------------- Cut Cross-Entropy


def cce_unavailable(device: torch.device) -> Optional[str]:
    try:
        _import("cut_cross_entropy")
    except Exception as err:
        return _not_importable("cut-cross-entropy", err)
    if device.type != "cuda":
        return "cce needs CUDA (Triton kernels)"
    return None


def cce_student_ce(xs, ws, labels) -> torch.Tensor:
    """Student-only hard-label CE through CCE's fused linear cross-entropy (mean over rows)."""
    mod = _import("cut_cross_entropy")
    return mod.linear_cross_entropy(xs, ws, labels)


def ce_reference(xs: torch.Tensor, ws: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean hard-label cross-entropy of the student, in xs's dtype (float64 for the reference)."""
    z = xs @ ws.t()
    return (torch.logsumexp(z, -1) - z.gather(1, labels[:, None]).squeeze(1)).mean()


def liger_versions() -> Tuple[str, str]:
    return package_version("liger-kernel"), package_version("cut-cross-entropy")
