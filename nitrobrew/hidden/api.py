"""Public hidden-state distillation losses: validation, backend dispatch, reduction."""

from __future__ import annotations

from typing import Any, Mapping, Optional, Tuple, Union

import torch
from typing_extensions import TypedDict, Unpack

from .. import divergences as dv
from ..core import checks as ck
from ..core.outputs import DistillOutput
from ..core.reduction import IGNORE_INDEX, reduce_rows
from .custom_op import compiled_distill
from .validation import HiddenCall, validate

Tensor = torch.Tensor


class HiddenOptions(TypedDict, total=False):
    """The options of the six losses, once (their defaults: ``hidden_loss``'s signature; their meaning: the
    docstrings). ``tests/test_architecture.py`` checks that it lists exactly ``hidden_loss``'s options."""

    labels: Optional[Tensor]
    ignore_index: int
    temperature: float
    reduction: str
    chunk_V: Optional[int]
    vocab_size: Optional[int]
    bs: Optional[Tensor]
    bt: Optional[Tensor]
    kd_weight: float
    ce_weight: float
    scale_t2: bool
    backend: str
    mode: Optional[str]
    memory_budget: Optional[int]
    grad_filter: Union[bool, float]
    softcap_s: Optional[float]
    softcap_t: Optional[float]
    return_parts: bool
    process_group: Any


def hidden_loss(
    xs: torch.Tensor,
    xt: torch.Tensor,
    ws: torch.Tensor,
    wt: torch.Tensor,
    *,
    divergence: str = "forward_kl",
    labels: Optional[torch.Tensor] = None,
    ignore_index: int = IGNORE_INDEX,
    temperature: float = 1.0,
    reduction: str = "mean",
    chunk_V: Optional[int] = None,
    vocab_size: Optional[int] = None,
    bs: Optional[torch.Tensor] = None,
    bt: Optional[torch.Tensor] = None,
    kd_weight: float = 1.0,
    ce_weight: float = 0.0,
    scale_t2: bool = False,
    backend: str = "auto",
    mode: Optional[str] = None,
    memory_budget: Optional[int] = None,
    grad_filter: Union[bool, float] = False,
    softcap_s: Optional[float] = None,
    softcap_t: Optional[float] = None,
    return_parts: bool = False,
    process_group=None,
    **params: float,
):
    """Divergence between teacher and student next-token distributions, from hidden states.

    See the per-divergence functions (``forward_kl`` ...) for the meaning of each option; ``params``: the
    divergence's parameter by its keyword (``beta`` for jsd, ``alpha`` for the skews; ranges and defaults
    in ``divergences.PARAMS``).
    """
    if process_group is not None or any(ck.is_dtensor(t) for t in (xs, xt, ws, wt, bs, bt)):
        from ..parallel.dtensor import unwrap

        xs, xt, ws, wt, bs, bt, labels, process_group = unwrap(
            xs=xs, xt=xt, ws=ws, wt=wt, bs=bs, bt=bt, labels=labels, process_group=process_group
        )
    options: HiddenOptions = dict(  # the options once: checked by validate, handed on as they are
        labels=labels,
        ignore_index=ignore_index,
        temperature=temperature,
        reduction=reduction,
        chunk_V=chunk_V,
        vocab_size=vocab_size,
        bs=bs,
        bt=bt,
        kd_weight=kd_weight,
        ce_weight=ce_weight,
        scale_t2=scale_t2,
        backend=backend,
        mode=mode,
        memory_budget=memory_budget,
        grad_filter=grad_filter,
        softcap_s=softcap_s,
        softcap_t=softcap_t,
        return_parts=return_parts,
        process_group=process_group,
    )
    if process_group is not None:  # vocab-parallel heads
        from .vocab_parallel import vocab_parallel_hidden

        return vocab_parallel_hidden(xs, xt, ws, wt, divergence=divergence, params=params, options=options)
    call = validate(xs, xt, ws, wt, divergence=divergence, params=params, options=options)
    out = _run(call)
    total, kd, ce = (r.reshape(call.lead) for r in out) if call.reduction == "none" else out
    if return_parts:
        return DistillOutput(total, kd, ce)
    return total


def _run(call: HiddenCall) -> Tuple[Tensor, Tensor, Tensor]:
    """(total, kd, ce) reduced (per row for "none") from the path the checked call names."""
    if torch.compiler.is_compiling():
        # one registered op with a registered backward: the traced step keeps a single graph
        return compiled_distill(call)
    ops = call.ops
    if call.impl == "triton":
        # the Triton path reduces inside its autograd Function (it forms gradients in the forward)
        from .triton_function import triton_distill

        return triton_distill(
            xs=ops.xs,
            xt=ops.xt,
            ws=ops.ws,
            wt=ops.wt,
            bs=ops.bs,
            bt=ops.bt,
            labels=call.labels,
            mask=call.mask,
            cfg=call.cfg,
            reduction=call.reduction,
            mode=call.mode,
            memory_budget=call.memory_budget,
        )
    from .chunked import chunked_rows

    rows = chunked_rows(ops, labels=call.labels, mask=call.mask, cfg=call.cfg)
    total, kd, ce = (reduce_rows(r, call.mask, call.reduction, call.lead) for r in rows)
    return total, kd, ce


_COMMON_DOC = """
    Args:
        xs: student hidden states [..., Ds] (gradient flows here).
        xt: teacher hidden states [..., Dt], same leading shape (treated as constant).
        ws: student LM head [V, Ds] (gradient flows here). wt: teacher LM head [V, Dt].
        labels: optional int tensor of the leading shape; rows equal to ``ignore_index`` do
            not count. Also the targets of the hard-label cross-entropy when ``ce_weight != 0``.
        temperature: logits are divided by it; the value is the divergence of the tempered
            distributions (no silent T^2; ``scale_t2=True`` multiplies the divergence by T^2).
        reduction: "mean" over counted rows, "sum", or "none" (float32 per row, 0 at ignored rows).
        chunk_V: vocab chunk size (None = automatic). On CUDA with the Triton backend, giving
            it selects the constant-memory kernels.
        vocab_size: use the first ``vocab_size`` rows of both heads (padded heads); without it
            differing vocab sizes raise.
        bs, bt: optional logit biases [V].
        kd_weight, ce_weight: loss = kd_weight * divergence + ce_weight * CE(labels) with the
            CE at temperature 1, computed in the same pass.
        backend: "auto" (Triton on CUDA, PyTorch elsewhere), "torch" or "triton".
        mode, memory_budget: Triton only: "fast" (token-chunked, default) or
            "constant_memory"; memory_budget in bytes for the fast mode's logit slabs.
        softcap_s, softcap_t: final-logit softcapping (Gemma 2/3) of the student's / teacher's
            logits, z -> c * tanh(z / c) before the temperature and the softmax (the CE term
            uses the capped student logits too); gradients flow through the cap. None = off.
        grad_filter: True (threshold finfo(dtype).eps / 2, 2^-8 for bf16) or a threshold in
            (0, 1): vocab entries whose logit gradient is below threshold x its row's largest
            entry, in every row of a block, skip the dX/dW products (those entries are dropped;
            faster on peaked distributions in the fast mode). The Triton path needs no host sync;
            the PyTorch path syncs once per slab, so not inside a CUDA graph capture there.
            Default False: exact gradients.
        return_parts: return ``DistillOutput(loss, kd, ce)`` instead of the loss alone: ``kd``
            is the divergence and ``ce`` the cross-entropy, each reduced like the loss and
            without weights (detached), so loss = kd_weight * [T^2] * kd + ce_weight * ce.
        process_group: vocab-parallel (tensor-parallel) heads: ws, wt (bs, bt) hold this rank's
            contiguous block of the vocabulary, xs/xt/labels (global ids) the same rows on every
            rank; the result is the full-vocabulary loss on every rank, communicating per-row
            statistics only (PyTorch path). DTensor heads sharded Shard(0) need no group.
            See docs/parallel.md.

    Returns:
        the loss in float32 (float64 for float64 inputs): a scalar, or the leading shape with
        reduction="none".
"""


def _doc(name: str) -> str:
    d = dv.REGISTRY[name]
    spec = None if d.param is None else dv.PARAMS[d.param]
    param = (
        ""
        if spec is None
        else f"\n    {spec.name}: {spec.help}, in [{spec.low:g}, {spec.high:g}], default {spec.default}.\n"
    )
    return d.summary + "\n" + param + _COMMON_DOC


OPTION_NAMES = frozenset(HiddenOptions.__annotations__)


def _check_options(fn: str, options: Mapping[str, Any]) -> None:
    # hidden_loss takes every divergence's parameter by keyword; a named loss takes its own only
    for name in options:
        if name not in OPTION_NAMES:
            raise TypeError(f"{fn}() got an unexpected keyword argument {name!r}")


# The six losses, written out (one docstring body, from the registry). Options are keyword-only.


def forward_kl(xs: Tensor, xt: Tensor, ws: Tensor, wt: Tensor, **options: Unpack[HiddenOptions]):
    _check_options("forward_kl", options)
    return hidden_loss(xs=xs, xt=xt, ws=ws, wt=wt, divergence="forward_kl", **options)


def reverse_kl(xs: Tensor, xt: Tensor, ws: Tensor, wt: Tensor, **options: Unpack[HiddenOptions]):
    _check_options("reverse_kl", options)
    return hidden_loss(xs=xs, xt=xt, ws=ws, wt=wt, divergence="reverse_kl", **options)


def jsd(
    xs: Tensor,
    xt: Tensor,
    ws: Tensor,
    wt: Tensor,
    *,
    beta: float = dv.default("beta"),
    **options: Unpack[HiddenOptions],
):
    _check_options("jsd", options)
    return hidden_loss(xs=xs, xt=xt, ws=ws, wt=wt, divergence="jsd", beta=beta, **options)


def tvd(xs: Tensor, xt: Tensor, ws: Tensor, wt: Tensor, **options: Unpack[HiddenOptions]):
    _check_options("tvd", options)
    return hidden_loss(xs=xs, xt=xt, ws=ws, wt=wt, divergence="tvd", **options)


def skew_kl(
    xs: Tensor,
    xt: Tensor,
    ws: Tensor,
    wt: Tensor,
    *,
    alpha: float = dv.default("alpha"),
    **options: Unpack[HiddenOptions],
):
    _check_options("skew_kl", options)
    return hidden_loss(xs=xs, xt=xt, ws=ws, wt=wt, divergence="skew_kl", alpha=alpha, **options)


def skew_reverse_kl(
    xs: Tensor,
    xt: Tensor,
    ws: Tensor,
    wt: Tensor,
    *,
    alpha: float = dv.default("alpha"),
    **options: Unpack[HiddenOptions],
):
    _check_options("skew_reverse_kl", options)
    return hidden_loss(xs=xs, xt=xt, ws=ws, wt=wt, divergence="skew_reverse_kl", alpha=alpha, **options)


LOSSES = {f.__name__: f for f in (forward_kl, reverse_kl, jsd, tvd, skew_kl, skew_reverse_kl)}
if set(LOSSES) != set(dv.NAMES):  # a divergence added to the registry needs its function here
    raise ImportError(f"hidden.api writes out {sorted(LOSSES)}, the registry has {sorted(dv.NAMES)}")
for _name, _fn in LOSSES.items():
    _fn.__doc__ = _doc(_name)
