"""Shared helpers for the hidden-state loss tests (any backend).

- ``make_case``: random inputs in the regimes the tests need (realistic logit spreads, a
  "close" student, [N, D] or [B, T, D] rows, Ds != Dt, padded heads, biases, ignored rows).
- ``check_against_reference``: run one loss on one backend and compare the value and the
  gradients of xs, ws (and bs) with the float64 reference computed from the same input values.
- ``pairwise``: a small deterministic covering array, so that every pair of option values is
  tested once without running the whole cross product.

A Triton test reuses all of it with ``check_against_reference(backend="triton", ...)``.
"""

from __future__ import annotations

import inspect
import itertools
import math
import random
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import torch

import nitrobrew as nb
from nitrobrew import divergences as dv
from nitrobrew.hidden import reference_loss

DIVERGENCES = dv.NAMES
LOSS_FNS = {name: getattr(nb, name) for name in DIVERGENCES}
# The option that carries each divergence's parameter (from the registry), and the default its
# function declares (tests check it against the registry's documented one).
PARAM_NAME = {d.name: d.param for d in dv.REGISTRY.values() if d.param is not None}
DEFAULT_PARAM = {name: inspect.signature(LOSS_FNS[name]).parameters[opt].default for name, opt in PARAM_NAME.items()}
_SIG = inspect.signature(nb.hidden_loss).parameters
IGNORE = _SIG["ignore_index"].default

# Standard deviation of the generated logits: they span tens of units across a vocabulary
# (docs/design.md §7: `rand`-like inputs with a tiny spread hide the bugs that matter); std 8 at T=0.5.
SPREAD = 4.0
# Relative perturbation of the "close" student (student = teacher + small noise).
CLOSE_NOISE = 0.01
# fp32/bf16 results may be off by this many fp32 ulps of the largest logit, at gradient scale.
FLOOR_ULPS = 4.0

# Options of the loss that are not options of the reference (backend/implementation choices).
_IMPL_ONLY = ("backend", "chunk_V", "mode", "memory_budget", "grad_filter", "return_parts")


@dataclass(frozen=True)
class Tol:
    """Allowed error, elementwise: |a - e| <= atol + atol_frac * max|e| + rtol * |e|."""

    rtol: float
    atol_frac: float
    atol: float = 0.0


# Per input dtype: (value, gradient) tolerances. float32 and bf16 compute in fp32 (bf16 logits
# are never rounded), so their values agree with float64 to fp32 accuracy; bf16 gradients are
# returned in bf16 (2^-9 relative rounding of each entry). Saturated rows (a peaked student far
# from the teacher, logits/T reaching +-30) are where fp32 loses most: there a nearly vanishing
# gradient is a difference of terms as large as the logits, and the PyTorch path, which
# subtracts separately rounded log-sum-exps, is up to ~100x less accurate than a naive fp32
# log_softmax. `check_against_reference` adds `fp32_floors` for that; the absolute floors here
# serve direct uses of TOLERANCES.
TOLERANCES: Dict[torch.dtype, Tuple[Tol, Tol]] = {
    torch.float64: (Tol(1e-9, 1e-10, 1e-12), Tol(1e-9, 1e-10, 1e-12)),
    torch.float32: (Tol(1e-4, 2e-5, 5e-6), Tol(1e-3, 5e-4, 2e-5)),
    torch.bfloat16: (Tol(1e-4, 2e-5, 5e-6), Tol(8e-3, 1e-3, 2e-5)),
}


def result_dtype(input_dtype: torch.dtype) -> torch.dtype:
    """Documented result dtype: float32, float64 for float64 inputs (CONTRIBUTING, docs/design.md §2)."""
    return torch.float64 if input_dtype == torch.float64 else torch.float32


@dataclass
class Case:
    """One set of inputs; xs, ws and bs are leaves that require grad."""

    xs: torch.Tensor
    xt: torch.Tensor
    ws: torch.Tensor
    wt: torch.Tensor
    bs: Optional[torch.Tensor] = None
    bt: Optional[torch.Tensor] = None
    labels: Optional[torch.Tensor] = None
    vocab_size: Optional[int] = None
    ignore_index: int = IGNORE

    @property
    def lead(self) -> torch.Size:
        return self.xs.shape[:-1]

    @property
    def vocab(self) -> int:
        return self.vocab_size if self.vocab_size is not None else self.ws.shape[0]

    def counted(self) -> int:
        """Rows that count (label != ignore_index)."""
        if self.labels is None:
            return math.prod(self.lead)
        return int((self.labels != self.ignore_index).sum())

    def kwargs(self) -> dict:
        """The loss options this case implies (labels, biases, vocab_size)."""
        out = {"labels": self.labels, "bs": self.bs, "bt": self.bt}
        if self.vocab_size is not None:
            out["vocab_size"] = self.vocab_size
        if self.ignore_index != IGNORE:
            out["ignore_index"] = self.ignore_index
        return out

    def student_leaves(self) -> List[torch.Tensor]:
        return [t for t in (self.xs, self.ws, self.bs) if t is not None]


def make_labels(
    lead: Sequence[int], vocab: int, mode, gen: torch.Generator, ignore_index: int = IGNORE
) -> Optional[torch.Tensor]:
    """None, "some" (about a third ignored, at least one counted and one ignored when possible),
    "all" (every row ignored), "none_ignored" (labels everywhere), or a tensor (used as is)."""
    if mode is None or isinstance(mode, torch.Tensor):
        return mode
    n = math.prod(lead)
    labels = torch.randint(0, vocab, (n,), generator=gen)
    if mode == "some":
        drop = torch.rand(n, generator=gen) < 0.35
        if n >= 2:
            drop[0], drop[-1] = True, False
        labels[drop] = ignore_index
    elif mode == "all":
        labels[:] = ignore_index
    elif mode != "none_ignored":
        raise ValueError(f"unknown labels mode {mode!r}")
    return labels.reshape(tuple(lead))


def make_case(
    *,
    shape: Sequence[int] = (7,),
    ds: int = 16,
    dt: Optional[int] = None,
    vocab: int = 37,
    pad_s: int = 0,
    pad_t: int = 0,
    dtype: torch.dtype = torch.float32,
    teacher_dtype: Optional[torch.dtype] = None,
    bias: bool = False,
    labels=None,
    close: bool = False,
    noise: float = CLOSE_NOISE,
    spread: float = SPREAD,
    seed: int = 0,
    ignore_index: int = IGNORE,
    device: str = "cpu",
) -> Case:
    """Random inputs with logits of standard deviation `spread` (randn, never rand or zeros).

    shape: leading shape of the rows ((N,) or (B, T)). ds/dt: hidden sizes (dt defaults to ds).
    vocab: vocabulary size compared; pad_s/pad_t extra head rows (then vocab_size=vocab is set).
    close: student = teacher + `noise`-relative perturbation (needs ds == dt).
    The values are drawn in float64 and rounded once to `dtype`; the reference uses the rounded
    values, so any remaining difference is the implementation's.
    """
    dt = ds if dt is None else dt
    gen = torch.Generator().manual_seed(seed)
    f64 = torch.float64

    def randn(*size):
        return torch.randn(*size, generator=gen, dtype=f64)

    lead = tuple(shape)
    xt = randn(*lead, dt)
    wt = randn(vocab + pad_t, dt) * (spread / math.sqrt(dt))
    bt = randn(vocab + pad_t) * (spread / 2) if bias else None
    if close:
        if ds != dt or pad_s != pad_t:
            raise ValueError("a close case needs ds == dt and equal heads")
        xs = xt + noise * randn(*lead, ds)
        ws = wt + noise * randn(*wt.shape) * (spread / math.sqrt(ds))
        bs = None if bt is None else bt + noise * randn(*bt.shape) * spread
    else:
        xs = randn(*lead, ds)
        ws = randn(vocab + pad_s, ds) * (spread / math.sqrt(ds))
        bs = randn(vocab + pad_s) * (spread / 2) if bias else None
    tdt = dtype if teacher_dtype is None else teacher_dtype

    def student(t):
        return None if t is None else t.to(device=device, dtype=dtype).requires_grad_()

    def teacher(t):
        return None if t is None else t.to(device=device, dtype=tdt)

    lab = make_labels(lead, vocab, labels, gen, ignore_index)
    return Case(
        xs=student(xs),
        xt=teacher(xt),
        ws=student(ws),
        wt=teacher(wt),
        bs=student(bs),
        bt=teacher(bt),
        labels=None if lab is None else lab.to(device),
        vocab_size=vocab if (pad_s or pad_t) else None,
        ignore_index=ignore_index,
    )


def run_loss(case: Case, divergence: str = "forward_kl", backend: str = "torch", **options):
    """The public function of `divergence` on `case`; options override the case's kwargs."""
    return LOSS_FNS[divergence](case.xs, case.xt, case.ws, case.wt, backend=backend, **{**case.kwargs(), **options})


def run_reference(case: Case, divergence: str = "forward_kl", **options):
    """float64 reference on the same values; returns (value, float64 student leaves)."""
    opts = {**case.kwargs(), **options}
    for k in _IMPL_ONLY:
        opts.pop(k, None)
    param_name = PARAM_NAME.get(divergence)
    param = opts.pop(param_name, DEFAULT_PARAM.get(divergence, 0.0)) if param_name else 0.0
    opts.pop("beta", None)
    opts.pop("alpha", None)

    def leaf(t):
        return None if t is None else t.detach().to(torch.float64).requires_grad_()

    def const(t):
        return None if t is None else t.detach().to(torch.float64)

    xs, ws = leaf(case.xs), leaf(case.ws)
    opts["bs"], opts["bt"] = leaf(opts.get("bs")), const(opts.get("bt"))
    value = reference_loss(xs, const(case.xt), ws, const(case.wt), divergence=divergence, param=param, **opts)
    return value, [t for t in (xs, ws, opts["bs"]) if t is not None]


def fp32_floors(case: Case, up: torch.Tensor, **options) -> List[float]:
    """Absolute error floors [value, xs, ws, bs] of any fp32 computation of the case.

    FLOOR_ULPS x 2^-23 x L x S, with L the largest |logit| / T (log-sum-exps and log-ratios
    are that large, and rounded at that scale) and S what the value or gradient would be if
    every row's logit gradient had l1-norm 2 (its bound for the KL family): a bug is off by
    O(S), fp32 rounding by O(eps L S). Typical cases give floors far below their gradients;
    saturated rows (a gradient that nearly vanishes) get the absolute error they truly have.
    """
    opts = {**case.kwargs(), **options}
    T = opts.get("temperature", 1.0)
    reduction = opts.get("reduction", "mean")
    V, f64 = case.vocab, torch.float64
    xs = case.xs.detach().reshape(-1, case.xs.shape[-1]).to(f64)
    xt = case.xt.detach().reshape(-1, case.xt.shape[-1]).to(f64)
    ws, wt = case.ws.detach()[:V].to(f64), case.wt.detach()[:V].to(f64)
    z, t = xs @ ws.t(), xt @ wt.t()
    if opts.get("bs") is not None:
        z = z + opts["bs"].detach()[:V].to(f64)
    if opts.get("bt") is not None:
        t = t + opts["bt"].detach()[:V].to(f64)
    logits = torch.cat([z.flatten(), t.flatten()])
    logits = logits[torch.isfinite(logits)]
    L = 1.0 + (logits.abs().max().item() / T if logits.numel() else 0.0)
    labels = opts.get("labels")
    mask = (
        torch.ones(xs.shape[0], dtype=f64)
        if labels is None
        else (labels.reshape(-1) != opts.get("ignore_index", IGNORE)).to(f64)
    )
    count = max(mask.sum().item(), 1.0)
    per_row = up.abs().reshape(-1) if reduction == "none" else up.abs().expand(xs.shape[0])
    per_row = per_row * mask / (count if reduction == "mean" else 1.0)
    weight = (
        abs(opts.get("kd_weight", 1.0)) * (T**2 if opts.get("scale_t2") else 1.0) + abs(opts.get("ce_weight", 0.0)) * T
    )  # the CE's logits are not divided by T
    logit_grad = 2 * weight * per_row / T
    value = weight * (1.0 if reduction != "sum" else count)
    xs_size = (logit_grad.max().item() if logit_grad.numel() else 0.0) * (ws.abs().max().item() if V else 0.0)
    ws_size = (logit_grad * xs.abs().amax(-1)).sum().item()
    bs_size = logit_grad.sum().item()
    return [FLOOR_ULPS * 2.0**-23 * L * s for s in (value, xs_size, ws_size, bs_size)]


def tiny_kl_case() -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """fp32 (xs, ws, wt), teacher head = student head + 1% noise: a KL of ~3e-5 nats per row over 4099
    entries. As a difference of two ~5-nat log-sum-exps, fp32 rounding of the two sums alone gives
    ~2e-2 relative error; formed from log1p(sum p expm1(s - t)) it stays ~1e-4."""
    g = torch.Generator().manual_seed(0)
    n, d, vocab = 6, 32, 4099
    xs = torch.randn(n, d, generator=g)
    ws = torch.randn(vocab, d, generator=g) * (3 / d**0.5)
    wt = ws + torch.randn(vocab, d, generator=g) * (0.01 / d**0.5)
    return xs, ws, wt


def tiny_kl_rel_err(divergence: str, rows: torch.Tensor, xs, ws, wt) -> float:
    """Largest per-row relative error of `rows` (reduction="none") against float64 on tiny_kl_case's data."""
    ref = LOSS_FNS[divergence](xs.double(), xs.double(), ws.double(), wt.double(), backend="torch", reduction="none")
    assert float(ref.max()) < 1e-4
    return float(((rows.double() - ref).abs() / ref).max())


def upstream_grad(value: torch.Tensor, seed: int = 0) -> torch.Tensor:
    """A random upstream gradient shaped like `value` (never all ones), float64."""
    gen = torch.Generator().manual_seed(10_000 + seed)
    if value.dim() == 0:
        return torch.tensor(0.75, dtype=torch.float64)
    return torch.randn(value.shape, generator=gen, dtype=torch.float64)


def assert_close(actual: torch.Tensor, expected: torch.Tensor, tol: Tol, what: str, slack: float = 0.0) -> float:
    """Elementwise |a - e| <= slack + tol.atol + tol.atol_frac * max|e| + tol.rtol * |e|; returns the
    worst ratio of error to allowance (<= 1)."""
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    a = actual.detach().to(torch.float64)
    e = expected.detach().to(torch.float64)
    assert torch.isfinite(a).all(), f"{what}: non-finite values {a}"
    if e.numel() == 0:
        return 0.0
    scale = e.abs().max().item()
    bound = slack + tol.atol + tol.atol_frac * scale + tol.rtol * e.abs() + 1e-300
    err = (a - e).abs()
    ratio = (err / bound).max().item()
    if ratio > 1.0:
        worst = int((err / bound).argmax())
        raise AssertionError(
            f"{what}: error {ratio:.3g}x the tolerance {tol} (max |e| = {scale:.3g}; worst entry "
            f"{a.flatten()[worst].item():.9g} vs {e.flatten()[worst].item():.9g})"
        )
    return ratio


def rel_norm_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """||a - e|| / ||e|| in float64."""
    a, e = actual.detach().double(), expected.detach().double()
    return ((a - e).norm() / e.norm().clamp_min(1e-300)).item()


@dataclass
class Checked:
    """What `check_against_reference` computed, for further assertions by the caller."""

    case: Case
    out: object  # what the loss returned (a tensor or a DistillOutput)
    loss: torch.Tensor
    grads: List[torch.Tensor]  # of xs, ws (, bs)
    ref: torch.Tensor
    ref_grads: List[torch.Tensor]
    errors: Dict[str, float] = field(default_factory=dict)


def check_against_reference(
    backend: str = "torch",
    dtype: torch.dtype = torch.float32,
    *,
    divergence: str = "forward_kl",
    case: Optional[Case] = None,
    shape: Sequence[int] = (7,),
    ds: int = 16,
    dt: Optional[int] = None,
    vocab: int = 37,
    pad_s: int = 0,
    pad_t: int = 0,
    bias: bool = False,
    labels=None,
    close: bool = False,
    spread: float = SPREAD,
    seed: int = 0,
    tol: Optional[Tuple[Tol, Tol]] = None,
    **options,
) -> Checked:
    """Run `divergence` on `backend` and compare value and student gradients with float64.

    Inputs come from `case`, or from ``make_case`` with the given regime arguments. `options` are
    the loss's keyword options (temperature, reduction, chunk_V, beta/alpha, kd_weight, ce_weight,
    scale_t2, return_parts, vocab_size, ...). The upstream gradient is random (a random tensor
    for reduction="none"). Also asserted: result and gradient dtypes, the leading shape for
    "none", finiteness, exactly zero loss and gradients when no row counts, and exactly zero
    gradients of head rows beyond vocab_size.

    Besides `tol` (default: TOLERANCES[dtype]), an fp32/bf16 result may be off by the
    ``fp32_floors`` of the case: in saturated rows (a peaked student far from the teacher) a
    gradient that nearly vanishes is a difference of terms as large as the logits.
    """
    if case is None:
        case = make_case(
            shape=shape,
            ds=ds,
            dt=dt,
            vocab=vocab,
            pad_s=pad_s,
            pad_t=pad_t,
            dtype=dtype,
            bias=bias,
            labels=labels,
            close=close,
            spread=spread,
            seed=seed,
        )
    value_tol, grad_tol = tol or TOLERANCES[dtype]
    out = run_loss(case, divergence, backend, **options)
    loss = out.loss if options.get("return_parts") else out
    ref, ref_leaves = run_reference(case, divergence, **options)
    reduction = options.get("reduction", "mean")
    up = upstream_grad(ref, seed)
    ref_grads = list(torch.autograd.grad(ref, ref_leaves, grad_outputs=up, allow_unused=True))
    slack = [0.0] * 4 if dtype == torch.float64 else fp32_floors(case, up, **options)  # value, xs, ws, bs

    expect_shape = tuple(case.lead) if reduction == "none" else ()
    assert tuple(loss.shape) == expect_shape, f"loss shape {tuple(loss.shape)} != {expect_shape}"
    assert loss.dtype == result_dtype(dtype), f"loss dtype {loss.dtype}, documented {result_dtype(dtype)}"
    errors = {"value": assert_close(loss, ref, value_tol, f"{divergence} value", slack[0])}

    leaves = case.student_leaves()
    grads = list(torch.autograd.grad(loss, leaves, grad_outputs=up.to(loss.dtype), allow_unused=True))
    for name, leaf, g, rg, sl in zip(("xs", "ws", "bs"), leaves, grads, ref_grads, slack[1:]):
        assert g is not None, f"no gradient for {name}"
        assert g.dtype == leaf.dtype and g.shape == leaf.shape, f"{name} grad {g.dtype} {tuple(g.shape)}"
        rg = torch.zeros_like(g, dtype=torch.float64) if rg is None else rg
        errors[name] = assert_close(g, rg, grad_tol, f"{divergence} grad {name}", sl)
        if case.counted() == 0:
            assert (g == 0).all(), f"{name} grad not exactly zero with no counted row"
        if name in ("ws", "bs") and g.shape[0] > case.vocab:
            assert (g[case.vocab :] == 0).all(), f"{name} grad nonzero beyond vocab_size"
    if case.counted() == 0:
        assert (loss == 0).all(), f"loss {loss} with no counted row"
    return Checked(case, out, loss, grads, ref, ref_grads, errors)


def pairwise(factors: Dict[str, Sequence], seed: int = 0, tries: int = 30) -> List[dict]:
    """A covering array of strength 2: every pair of values of two factors appears in some row.

    Greedy (AETG-style) with a fixed seed, so the selection and the test ids are stable.
    """
    names = list(factors)
    sizes = [len(factors[n]) for n in names]

    def pair(k, v, m, w):
        return (k, v, m, w) if k < m else (m, w, k, v)

    def pairs_of(row):
        return {pair(k, row[k], m, row[m]) for k, m in itertools.combinations(range(len(names)), 2)}

    uncovered = {
        (k, v, m, w)
        for k, m in itertools.combinations(range(len(names)), 2)
        for v in range(sizes[k])
        for w in range(sizes[m])
    }
    rng = random.Random(seed)
    rows: List[dict] = []
    while uncovered:
        best: Optional[dict] = None
        for _ in range(tries):
            a, i, b, j = rng.choice(sorted(uncovered))
            row = {a: i, b: j}
            rest = [k for k in range(len(names)) if k not in row]
            rng.shuffle(rest)
            for k in rest:
                row[k] = max(
                    range(sizes[k]),
                    key=lambda v: (sum(pair(k, v, m, w) in uncovered for m, w in row.items()), rng.random()),
                )
            if best is None or len(pairs_of(row) & uncovered) > len(pairs_of(best) & uncovered):
                best = row
        uncovered -= pairs_of(best)
        rows.append({names[k]: factors[names[k]][best[k]] for k in range(len(names))})
    return rows
