"""Named input regimes shared by every benchmark (design §6: a speed claim names its regime).

Some baselines' speed depends on the data (cut-cross-entropy skips gradient blocks of tiny
probability; a gradient filter drops columns); nitrobrew's exact paths do not. Every bench
therefore runs each of its methods on the same tensors of each named regime and labels the rows
with the teacher's measured mean entropy (nats).

Hidden-state / top-k regimes (teacher logits t = xt wt^T, student logits s = xs ws^T):

  flat     logits ~ N(0, 0.5^2): near uniform (entropy close to log V)
  spread   logits ~ N(0, 3^2), spanning ~30 units (the previous benches' "random" inputs)
  lm       LM-like: a unigram Zipf log-frequency term plus a Gaussian context term, scaled so
           the teacher's mean entropy is 5.5 nats (LLM next-token distributions: 3-6 nats)
  peaked   the same construction at 2 nats: one or a few dominant tokens per row
  close    the peaked teacher; student = teacher + logit noise of std 0.05 (a nearly
           distilled student: logits rounded to bf16 before the softmax give wrong gradients)
  real     final hidden states and LM heads of randomly initialized Qwen2-shaped decoders
           (2 layers at the bench's widths and vocabulary, HF's initialization) fed random token
           ids; no pretrained weights are assumed offline (needs transformers)
  demo     trained models: the teacher and a distilled student of a finished `nitrobrew demo`
           run (the folder in $NITROBREW_DEMO_RUN, default runs/demo) on its held-out
           sequences; the demo's vocabulary and widths replace the bench's V, Ds and Dt, and N
           is at most its held-out tokens

In flat, spread, lm and peaked the student's logits are the teacher's plus Gaussian noise (std
0.25, 1, 1, 1 logit units). Teacher and student share a latent space (heads A P, hidden states
h P with P of orthonormal rows), so Ds != Dt gives exactly the logits above.

Attention regimes (score maps; lm and real have no score-map form and are skipped there):
flat (score std 0.5), spread (score std 3), peaked (teacher scores scaled for 2 nats of mean
row entropy), close (spread teacher; student q, k = teacher's + noise).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from typing import Iterable, List, Optional, Sequence, Tuple

import torch

REGIMES = ("flat", "spread", "lm", "peaked", "close", "real", "demo")
ATTENTION_REGIMES = ("flat", "spread", "peaked", "close")
ALIASES = {"random": "spread"}

FLAT_STD = 0.5
SPREAD_STD = 3.0
LM_ENTROPY = 5.5  # nats, target mean teacher entropy of "lm"
PEAKED_ENTROPY = 2.0  # nats, "peaked" and "close"
ZIPF_SLOPE = 1.1
STUDENT_NOISE = {"flat": 0.25, "spread": 1.0, "lm": 1.0, "peaked": 1.0, "close": 0.05}
REAL_LAYERS = 2


class RegimeUnavailable(RuntimeError):
    """A regime that cannot be built here (a missing optional dependency)."""


def parse(names: Iterable[str], allowed: Sequence[str] = REGIMES) -> List[str]:
    """Regime names in order, aliases resolved, 'all' expanded; ValueError names the bad one."""
    out: List[str] = []
    for name in names:
        if name == "all":
            out.extend(allowed)
            continue
        name = ALIASES.get(name, name)
        if name not in REGIMES:
            raise ValueError(f"unknown regime {name!r}; choose from {', '.join(REGIMES)} or all")
        out.append(name)
    return list(dict.fromkeys(out))


# ---------------------------------------------------------------- hidden states and heads


@dataclass
class Data:
    xs: torch.Tensor  # [N, Ds], requires grad
    xt: torch.Tensor  # [N, Dt]
    ws: torch.Tensor  # [V, Ds], requires grad
    wt: torch.Tensor  # [V, Dt]
    labels: torch.Tensor  # [N] int64, random ids (Liger's API, CCE)
    regime: str
    entropy: float = float("nan")  # teacher's mean entropy, nats, on the first rows


def _randn(shape, gen, device, dtype=torch.float32):
    return torch.randn(*shape, generator=gen, device=device, dtype=dtype)


def _orthonormal_rows(r: int, d: int, gen, device) -> torch.Tensor:
    """[r, d] with orthonormal rows (r <= d)."""
    q, _ = torch.linalg.qr(_randn((d, r), gen, device))
    return q.t().contiguous()


def mean_entropy(logits: torch.Tensor) -> torch.Tensor:
    lp = torch.log_softmax(logits, dim=-1)
    return -(lp.exp() * lp).sum(-1).mean()


def teacher_entropy(xt: torch.Tensor, wt: torch.Tensor, rows: int = 256) -> float:
    """Mean entropy (nats) of softmax(xt wt^T) over the first `rows` rows, float64."""
    # fp32 logits (no float64 copy of a large head), float64 softmax
    t = xt[:rows].detach().float() @ wt.detach().float().t()
    return float(mean_entropy(t.double()))


def _calibrate(base: torch.Tensor, gauss: torch.Tensor, target: float) -> float:
    """Scale c of the context term giving mean entropy `target` of base + c gauss (bisection on
    log c; entropy falls as c grows). A target above what the base alone reaches gives c ~ 0."""
    lo, hi = -6.0, 4.0
    for _ in range(24):  # log c to 6e-7: far below what the entropy label shows
        mid = 0.5 * (lo + hi)
        if float(mean_entropy(base + math.exp(mid) * gauss)) > target:
            lo = mid
        else:
            hi = mid
    return math.exp(0.5 * (lo + hi))


def make_hidden(
    regime: str,
    n: int,
    vocab: int,
    ds: int,
    dt: int,
    dtype: torch.dtype,
    device: torch.device,
    seed: int,
    calib_rows: int = 256,
) -> Data:
    """Inputs of one regime (module doc); random normal everywhere, never zeros."""
    regime = ALIASES.get(regime, regime)
    if regime == "real":
        return _real_hidden(n, vocab, ds, dt, dtype, device=device, seed=seed)
    if regime == "demo":
        return demo_hidden(n, dtype, device, seed)
    if regime not in STUDENT_NOISE:
        raise ValueError(f"unknown regime {regime!r}; choose from {', '.join(REGIMES)}")
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    # Shared latent: t = h A^T, s = hs A^T exactly, whatever Ds and Dt, through heads A P
    # (P with orthonormal rows) and hidden states h P. Column 0 carries the unigram prior.
    r = min(ds, dt)
    if r < 2:
        raise ValueError("the regimes need hidden sizes of at least 2")
    a = _randn((vocab, r), gen, device) / math.sqrt(r - 1)  # context logits ~ N(0, |h|^2 / (r-1))
    h = _randn((n, r), gen, device)
    kappa = 4.0
    h[:, 0] = kappa
    if regime in ("lm", "peaked", "close"):
        rank = torch.randperm(vocab, generator=gen, device=device).float() + 1.0
        prior = -ZIPF_SLOPE * torch.log(rank)
        a[:, 0] = (prior - prior.mean()) / kappa
        target = LM_ENTROPY if regime == "lm" else PEAKED_ENTROPY
        rows = h[:calib_rows]
        scale = _calibrate(rows[:, :1] @ a[:, :1].t(), rows[:, 1:] @ a[:, 1:].t(), target)
    else:
        a[:, 0] = 0.0
        scale = FLAT_STD if regime == "flat" else SPREAD_STD
    h[:, 1:] *= scale
    hs = h.clone()
    hs[:, 1:] += STUDENT_NOISE[regime] * _randn((n, r - 1), gen, device)
    pt, ps = _orthonormal_rows(r, dt, gen, device), _orthonormal_rows(r, ds, gen, device)
    xt, wt = (h @ pt).to(dtype), (a @ pt).to(dtype)
    xs, ws = (hs @ ps).to(dtype), (a @ ps).to(dtype)
    del a, h, hs, pt, ps
    labels = torch.randint(0, vocab, (n,), generator=gen, device=device)
    return Data(
        xs=xs.requires_grad_(),
        xt=xt,
        ws=ws.requires_grad_(),
        wt=wt,
        labels=labels,
        regime=regime,
        entropy=teacher_entropy(xt, wt, calib_rows),
    )


def _qwen2_config(d: int, vocab: int):
    import transformers

    head_dim = next(h for h in (128, 64, 32, 16, 8, 4, 2, 1) if d % h == 0 and d // h >= 1)
    heads = d // head_dim
    kv = next(k for k in (4, 2, 1) if heads % k == 0)
    return transformers.Qwen2Config(
        vocab_size=vocab,
        hidden_size=d,
        intermediate_size=(16 * d) // 3,
        num_hidden_layers=REAL_LAYERS,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        max_position_embeddings=1 << 17,
        tie_word_embeddings=False,
    )


@torch.no_grad()
def decoder_states(
    d: int, vocab: int, ids: torch.Tensor, dtype, device, seed: int
) -> Tuple[torch.Tensor, torch.Tensor]:
    """(final hidden states [N, d], LM head [V, d]) of a randomly initialized Qwen2-shaped decoder."""
    try:
        import transformers
    except ImportError as err:
        raise RegimeUnavailable("regime real needs transformers (pip install nitrobrew[hf])") from err
    torch.manual_seed(seed)
    with torch.device(device):
        model = transformers.Qwen2ForCausalLM(_qwen2_config(d, vocab)).to(dtype).eval()
    seq = min(ids.numel(), 4096)
    rows = [model.model(input_ids=chunk.view(1, -1), use_cache=False).last_hidden_state[0] for chunk in ids.split(seq)]
    head = model.lm_head.weight.detach().clone()
    del model
    return torch.cat(rows), head


def _real_hidden(n, vocab, ds, dt, dtype, device, seed) -> Data:
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    ids = torch.randint(0, vocab, (n,), generator=gen, device=device)
    xt, wt = decoder_states(dt, vocab, ids, dtype, device, seed=seed)
    xs, ws = decoder_states(ds, vocab, ids, dtype, device, seed=seed + 1)
    labels = torch.roll(ids, -1)  # the next token: what a CE term would use
    return Data(
        xs=xs.requires_grad_(),
        xt=xt,
        ws=ws.requires_grad_(),
        wt=wt,
        labels=labels,
        regime="real",
        entropy=teacher_entropy(xt, wt),
    )


DEMO_RUN_ENV = "NITROBREW_DEMO_RUN"
DEMO_STUDENTS = ("forward_kl", "reverse_kl", "jsd", "topk", "hard_labels")


@torch.no_grad()
def demo_hidden(n: int, dtype, device, seed: int = 0, run: Optional[str] = None) -> Data:
    """Hidden states and heads of a finished demo run's teacher and first distilled student on
    its held-out sequences (first n positions)."""
    run = run or os.environ.get(DEMO_RUN_ENV) or os.path.join("runs", "demo")
    cfg_path = os.path.join(run, "config.json")
    ckpt = os.path.join(run, "checkpoints")
    if not os.path.exists(cfg_path):
        raise RegimeUnavailable(
            f"regime demo needs a finished `nitrobrew demo` run: none in {run!r} "
            f"(run `nitrobrew demo --out DIR` and set {DEMO_RUN_ENV}=DIR)"
        )
    try:
        from ..demo.checkpoint import load_checkpoint, read_record
        from ..demo.lm import DemoConfig, make_data, make_model
        from ..hf import final_hidden_states
    except ImportError as err:
        raise RegimeUnavailable(f"regime demo needs transformers and safetensors ({err})") from err
    with open(cfg_path) as f:
        saved = json.load(f)
    cfg = DemoConfig(**{**saved, "methods": tuple(saved.get("methods", ()))})
    done = lambda name: (read_record(os.path.join(ckpt, f"{name}.safetensors")) or {}).get("done")  # noqa: E731
    student = next((m for m in DEMO_STUDENTS if done(m)), None)
    if not done("teacher") or student is None:
        raise RegimeUnavailable(f"regime demo: the run in {run!r} has no finished teacher and student")

    def load(name, hidden, layers):
        model = make_model(cfg, hidden, layers, 0, device)
        load_checkpoint(os.path.join(ckpt, f"{name}.safetensors"), model, device=str(device))
        return model.eval()

    teacher = load("teacher", cfg.teacher_hidden, cfg.teacher_layers)
    stud = load(student, cfg.student_hidden, cfg.student_layers)
    test = make_data(cfg).test.to(device)
    ids = test[: max(1, -(-n // test.shape[1]))]
    xt = final_hidden_states(teacher, ids).reshape(-1, cfg.teacher_hidden)[:n].to(dtype)
    xs = final_hidden_states(stud, ids).reshape(-1, cfg.student_hidden)[:n].to(dtype)
    wt = teacher.lm_head.weight.detach().to(dtype).clone()
    ws = stud.lm_head.weight.detach().to(dtype).clone()
    labels = torch.roll(ids.reshape(-1), -1)[: xs.shape[0]]
    del teacher, stud
    return Data(
        xs=xs.requires_grad_(),
        xt=xt,
        ws=ws.requires_grad_(),
        wt=wt,
        labels=labels,
        regime="demo",
        entropy=teacher_entropy(xt, wt),
    )


# ---------------------------------------------------------------- attention score maps


def _row_entropy(q: torch.Tensor, k: torch.Tensor, causal: bool, rows: int = 64) -> float:
    """Mean entropy of softmax(q k^T / sqrt(D)) over the last `rows` query rows of head 0."""
    n, d = q.shape[-2], q.shape[-1]
    qr = q[0, 0, -rows:].double()
    s = qr @ k[0, 0].double().t() * d**-0.5
    if causal:
        i = torch.arange(n - qr.shape[0], n, device=q.device)[:, None]
        s = s.masked_fill(torch.arange(n, device=q.device)[None, :] > i, float("-inf"))
    lp = torch.log_softmax(s, -1)
    return float(-(lp.exp() * lp.nan_to_num(0.0)).sum(-1).mean())


def make_attention(
    regime: str, B: int, H: int, Hkv: int, N: int, D: int, dtype, dev, seed: int = 0, causal: bool = True
) -> Tuple[List[torch.Tensor], float]:
    """([q_s, k_s, q_t, k_t], teacher's mean row entropy) of one attention regime.

    q, k ~ N(0, sigma^2) give scores of std sigma^2 (q.k / sqrt(D)); peaked scales the queries
    until the teacher's rows have 2 nats."""
    regime = ALIASES.get(regime, regime)
    if regime not in ATTENTION_REGIMES:
        raise RegimeUnavailable(f"regime {regime} has no score-map form (attention: {', '.join(ATTENTION_REGIMES)})")
    g = torch.Generator(device=dev).manual_seed(seed)  # on the device: 10^8-element inputs at real N
    std = FLAT_STD if regime == "flat" else SPREAD_STD

    default_sigma = math.sqrt(std)

    def rnd(*shape, sigma=None):
        return torch.randn(*shape, generator=g, device=dev, dtype=torch.float32) * (
            default_sigma if sigma is None else sigma
        )

    q_t, k_t = rnd(B, H, N, D), rnd(B, Hkv, N, D)
    if regime == "close":
        q_s = q_t + 0.1 * rnd(B, H, N, D, sigma=1.0)
        k_s = k_t + 0.1 * rnd(B, Hkv, N, D, sigma=1.0)
    else:
        q_s, k_s = rnd(B, H, N, D), rnd(B, Hkv, N, D)
    if regime == "peaked":
        lo, hi = -3.0, 4.0
        for _ in range(24):
            mid = 0.5 * (lo + hi)
            if _row_entropy(q_t * math.exp(mid), k_t, causal) > PEAKED_ENTROPY:
                lo = mid
            else:
                hi = mid
        c = math.exp(0.5 * (lo + hi))
        q_t, q_s = q_t * c, q_s * c
    ins = [t.to(dtype) for t in (q_s, k_s, q_t, k_t)]
    return ins, _row_entropy(ins[2], ins[3], causal)


def entropy_label(regime: str, entropy: Optional[float]) -> str:
    return regime if entropy is None or math.isnan(entropy) else f"{regime} ({entropy:.1f} nats)"
