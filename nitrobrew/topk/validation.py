"""Checks of topk_kl's inputs (before any kernel runs) and of the stored teacher data, once per call, and the
checked call they give (``TopKCall``), shared by the single-process API and the vocab-parallel path (so that
neither imports the other's entry point)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Mapping, NamedTuple, Optional

import torch

from ..core import checks as ck
from ..core.reduction import IGNORE_INDEX, row_weights
from .rowmath import TopKConfig

NORMALIZE = ("full", "topk")
Tensor = torch.Tensor


class TopKInputs(NamedTuple):
    """``topk_kl``'s tensors as given (DTensors already unwrapped)."""

    xs: Tensor
    ws: Tensor
    ids: Tensor
    lp: Tensor
    bs: Optional[Tensor] = None
    labels: Optional[Tensor] = None


class TopKOptions(NamedTuple):
    """``topk_kl``'s options as given: checked once by ``validate``, then turned into the ``TopKConfig``
    the paths trust (``config``)."""

    normalize: str = "full"
    divergence: str = "forward_kl"
    tail: bool = False
    temperature: float = 1.0
    teacher_temperature: Optional[float] = None
    reduction: str = "mean"
    chunk_V: Optional[int] = None
    kd_weight: float = 1.0
    ce_weight: float = 0.0
    scale_t2: bool = False
    ignore_index: int = IGNORE_INDEX
    backend: str = "auto"
    mode: Optional[str] = None
    memory_budget: Optional[int] = None
    softcap_s: Optional[float] = None

    def config(self, divergence: str, param: float) -> TopKConfig:
        """The checked options as the paths' config (canonical divergence and parameter; T^2 folded in)."""
        return TopKConfig(
            divergence=divergence,
            param=param,
            normalize=self.normalize,
            tail=bool(self.tail),
            temperature=float(self.temperature),
            kd_weight=float(self.kd_weight) * (self.temperature**2 if self.scale_t2 else 1.0),
            ce_weight=float(self.ce_weight),
            chunk_V=self.chunk_V,
            softcap_s=None if self.softcap_s is None else float(self.softcap_s),
        )


class TopKRows(NamedTuple):
    """The inputs as flat rows: hidden rows [N, D] (rows that do not count zeroed), ids and log-probs
    [N, K] as stored, the counted-row mask, the CE targets (-1 where not counted; None without CE) and
    the leading shape."""

    x: Tensor
    ids: Tensor
    lp: Tensor
    mask: Tensor
    ce_labels: Optional[Tensor]
    lead: torch.Size


@dataclass(frozen=True)
class TopKCall:
    """One ``topk_kl`` call, checked: only ``validate`` builds it, and the paths trust it."""

    rows: TopKRows
    ws: Tensor
    bs: Optional[Tensor]
    cfg: TopKConfig
    impl: str  # the backend resolved: "triton" or "torch"
    reduction: str
    mode: Optional[str]
    memory_budget: Optional[int]
    check: Callable[[], None]  # reads the stored data's checks and raises (one device sync): call it late


def validate(
    inputs: TopKInputs, options: TopKOptions, params: Mapping[str, float], *, id_ranges: bool = True
) -> TopKCall:
    """Every check of a call, once, before any kernel runs (id_ranges=False: the vocab-parallel path
    checks ids and labels against the global vocabulary). The checks of the stored data's values are
    launched here; the call's ``check`` reads them."""
    name, param = ck.divergence_param(options.divergence, params)
    check_inputs(inputs, options, id_ranges=id_ranges)
    impl = ck.backend_for(options.backend, inputs.xs.device)  # the name was checked with the options
    lp = inputs.lp
    capturing = lp.is_cuda and torch.cuda.is_current_stream_capturing()
    check = no_check
    if lp.numel() and not torch.compiler.is_compiling() and not capturing:
        check = stored_check(inputs.ids, lp, inputs.ws.shape[0] if id_ranges else None, impl)
    cfg = options.config(name, param)
    return TopKCall(
        rows=flat_rows(inputs, ignore_index=options.ignore_index, with_ce=cfg.with_ce),
        ws=inputs.ws,
        bs=inputs.bs,
        cfg=cfg,
        impl=impl,
        reduction=options.reduction,
        mode=options.mode,
        memory_budget=options.memory_budget,
        check=check,
    )


def check_inputs(inputs: TopKInputs, options: TopKOptions, *, id_ranges: bool = True) -> None:
    """The checks of the tensors and options (all but the stored data's values)."""
    xs, ws, ids, lp, bs, labels = inputs
    o = options
    for name, t in (("xs", xs), ("ws", ws), ("topk_ids", ids), ("topk_logprobs", lp)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    ck.check_float("xs", xs)
    ck.check_float("ws", ws)
    ck.check_float("topk_logprobs", lp)
    if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
        raise TypeError(f"topk_ids must be an integer tensor, got {ids.dtype}")
    ck.check_same_device(xs=xs, ws=ws, bs=bs, topk_ids=ids, topk_logprobs=lp, labels=labels)
    ck.check_same_dtype(xs=xs, ws=ws, bs=bs)
    if xs.dim() < 1:
        raise ValueError("xs must have a hidden dimension [..., D]")
    if ws.dim() != 2 or ws.shape[1] != xs.shape[-1]:
        raise ValueError(
            f"ws must be a [V, D] head with D = {xs.shape[-1]} (xs {tuple(xs.shape)}), got {tuple(ws.shape)}"
        )
    if bs is not None and tuple(bs.shape) != (ws.shape[0],):
        raise ValueError(f"bs must have shape ({ws.shape[0]},), got {tuple(bs.shape)}")
    if tuple(ids.shape) != tuple(lp.shape):
        raise ValueError(f"topk_ids {tuple(ids.shape)} and topk_logprobs {tuple(lp.shape)} must have the same shape")
    if ids.dim() < 1 or ids.shape[-1] < 1:
        raise ValueError(f"topk_ids must be [..., K] with K >= 1, got {tuple(ids.shape)}")
    if tuple(ids.shape[:-1]) != tuple(xs.shape[:-1]):
        raise ValueError(
            f"topk_ids/topk_logprobs leading shape {tuple(ids.shape[:-1])} must equal xs's leading shape "
            f"{tuple(xs.shape[:-1])} (one stored teacher row per student position)"
        )
    if o.normalize not in NORMALIZE:
        raise ValueError(f"normalize must be one of {NORMALIZE}, got {o.normalize!r}")
    if o.tail and o.normalize != "full":
        raise ValueError("tail=True needs normalize='full': renormalized over the K ids, the student has no tail")
    if o.divergence != "forward_kl" and o.normalize == "full" and not o.tail:
        raise ValueError(
            f"{o.divergence} over the top-k support compares distributions: use normalize='topk' (both sides "
            "renormalized over the K ids) or normalize='full' with tail=True (K ids + one tail bucket)"
        )
    ck.check_temperature(o.temperature)
    ck.check_softcap("softcap_s", o.softcap_s)
    if xs.shape[-1] == 0:
        raise ValueError(f"xs has hidden size 0 (shape {tuple(xs.shape)}): the head needs at least one feature")
    if o.teacher_temperature is not None:
        ck.check_temperature(o.teacher_temperature)
        if o.teacher_temperature != o.temperature:
            raise ValueError(
                f"the stored log-probs were taken at temperature {o.teacher_temperature} but the student is "
                f"tempered at {o.temperature}: stored top-k log-probs cannot be re-tempered exactly; extract "
                "them again at the distillation temperature (or pass the same value)"
            )
    ck.check_reduction(o.reduction)
    ck.check_chunk("chunk_V", o.chunk_V)
    ck.check_backend(o.backend)
    ck.check_mode(o.mode, o.memory_budget)
    ck.check_labels(labels, xs.shape[:-1])
    for name, wgt in (("kd_weight", o.kd_weight), ("ce_weight", o.ce_weight)):
        if not (isinstance(wgt, (int, float)) and math.isfinite(wgt)):
            raise ValueError(f"{name} must be a finite number, got {wgt!r}")
    if o.ce_weight != 0:
        if o.normalize != "full":
            raise ValueError(
                "ce_weight != 0 needs normalize='full': the hard-label CE needs the student's "
                "log-sum-exp over the whole vocabulary"
            )
        if labels is None:
            raise ValueError("ce_weight != 0 needs labels (the hard targets of each row)")
        if id_ranges:
            ck.check_ids_in_range("labels", labels, ws.shape[0], o.ignore_index)


def flat_rows(inputs: TopKInputs, *, ignore_index: int, with_ce: bool) -> TopKRows:
    """The checked inputs as flat rows (``TopKRows``)."""
    xs, labels, K = inputs.xs, inputs.labels, inputs.ids.shape[-1]
    x = xs.reshape(-1, xs.shape[-1])
    flat_labels = None if labels is None else labels.reshape(-1)
    mask = row_weights(flat_labels, ignore_index, x.shape[0], xs.device)
    if flat_labels is not None:
        # rows that do not count are zeroed (as the hidden losses do): dW sums over rows, 0 * NaN is NaN
        x = torch.where(mask[:, None] > 0, x, torch.zeros((), dtype=x.dtype, device=x.device))
    ce_labels = None
    if with_ce and flat_labels is not None:  # labels are checked present for ce_weight != 0
        ce_labels = torch.where(mask > 0, flat_labels, torch.full_like(flat_labels, -1)).long()
    return TopKRows(
        x=x,
        ids=inputs.ids.reshape(-1, K),
        lp=inputs.lp.reshape(-1, K),
        mask=mask,
        ce_labels=ce_labels,
        lead=xs.shape[:-1],
    )


def no_check() -> None:
    return None


def lse_tolerance(lp: torch.Tensor) -> float:
    """How far above 0 a row's logsumexp of stored log-probs may lie: 1e-3, plus the rounding of
    16-bit storage (each log-prob rounded to its dtype's precision, summed over up to log K nats)."""
    K = lp.shape[-1]
    return 1e-3 + (torch.finfo(lp.dtype).eps * math.log(max(K, 2)) if lp.element_size() < 4 else 0.0)


def stored_check(ids, lp, V: Optional[int], impl: str) -> Callable[[], None]:
    """Launch the checks of the stored data (NaN/+inf log-probs; with V, ids outside [0, V) at finite
    entries; ids repeated within a row; rows that are not a sub-distribution) and return the call that
    reads their flags (one device sync) and raises. The caller reads them as late as it can, right
    before the loss's first kernel, so the sync leaves the device idle only for that launch."""
    tol = lse_tolerance(lp)
    if impl == "triton":
        from .kernels_checks import launch_stored_flags

        flags = launch_stored_flags(ids, lp, V, tol)
    else:
        finite = torch.isfinite(lp)
        bad = [(torch.isnan(lp) | (lp == float("inf"))).any()]
        bad.append(
            (finite & ((ids < 0) | (ids >= V))).any()
            if V is not None
            else torch.zeros((), dtype=torch.bool, device=lp.device)
        )
        # padding entries get distinct negative stand-ins, so only valid ids can collide
        K = lp.shape[-1]
        stand_in = -1 - torch.arange(K, device=lp.device)
        sorted_ids = torch.where(finite, ids.long(), stand_in).sort(dim=-1).values
        bad.append((sorted_ids[..., 1:] == sorted_ids[..., :-1]).any())
        bad.append((torch.logsumexp(torch.where(finite, lp.float(), float("-inf")), dim=-1) > tol).any())
        flags = torch.stack(bad)

    def raise_if_bad() -> None:
        bad_lp, bad_ids, dup, over = flags.tolist()
        if bad_lp:
            raise ValueError("topk_logprobs holds NaN or +inf; padding entries must be -inf")
        if bad_ids:  # the detailed message costs more syncs: only on failure
            ck.check_ids_in_range("topk_ids (at entries whose log-prob is finite)", ids[torch.isfinite(lp)], V)
        if dup:
            raise ValueError(
                "topk_ids repeats an id within a row (at entries whose log-prob is finite): each row's "
                "valid ids must be distinct (mark unused slots with log-prob -inf)"
            )
        if over:
            raise ValueError(
                f"topk_logprobs are not a sub-distribution: a row's probabilities sum to more than 1 "
                f"(logsumexp over its K entries > {tol:.2g}); store log-probs (log_softmax over the "
                "whole vocabulary), not logits"
            )

    return raise_if_bad


def safe_ids(topk_ids: torch.Tensor, lp: torch.Tensor) -> torch.Tensor:
    """[N, K] int64 ids with 0 at padding entries (which may hold any id)."""
    ids = topk_ids.reshape(lp.shape).long()
    return torch.where(torch.isfinite(lp), ids, torch.zeros((), dtype=torch.long, device=lp.device))
