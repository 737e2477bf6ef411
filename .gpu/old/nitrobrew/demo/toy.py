"""`nitrobrew demo toy`: the two classic pictures of what each divergence does, with nitrobrew's losses.

1. Modes: fit one Gaussian to a two-mode target by minimizing each divergence. Forward KL
   (mean-seeking) spreads over both modes; reverse KL (mode-seeking) locks onto one; JSD sits in
   between. The "head" is the fixed feature matrix [x, x^2] of a grid of V points and the student's
   "hidden state" is the Gaussian's natural parameters, so the logits are exactly its log-density.
2. Rank: a softmax-regression student (a learnable head over 16 fixed features) chases a fixed
   teacher whose logits have rank r. With r <= 16 the teacher lies in the student's reach and every
   divergence drives the distance to 0; with r > 16 it does not, and each divergence settles on its
   own compromise. The distance plotted is the total variation to the teacher, the same yardstick
   for every training divergence.
"""

from __future__ import annotations

import math
import os
from typing import Dict, List

import torch

from .. import hidden_loss, tvd
from ..core.atomic_io import atomic_write_text
from .progress import Progress

DIVERGENCES = ("forward_kl", "reverse_kl", "jsd")
COLORS = {"forward_kl": "tab:blue", "reverse_kl": "tab:red", "jsd": "tab:green", "tvd": "tab:purple"}


def two_modes(steps: int = 400, V: int = 241, progress: bool = True) -> Dict:
    """Fit N(mu, sigma^2) to 0.6 N(2.2, 0.6^2) + 0.4 N(-2.2, 0.6^2) on a grid of V points."""
    x = torch.linspace(-6.0, 6.0, V, dtype=torch.float64)
    target = 0.6 * torch.exp(-((x - 2.2) ** 2) / (2 * 0.36)) + 0.4 * torch.exp(-((x + 2.2) ** 2) / (2 * 0.36))
    xt, wt = torch.ones(1, 1, dtype=torch.float64), target.log()[:, None]  # teacher logits = log p
    ws = torch.stack([x, x * x], 1)  # student logits = ws @ xs
    fits = {}
    with Progress(steps * len(DIVERGENCES), "toy: one Gaussian vs two modes", enabled=progress) as bar:
        for div in DIVERGENCES:
            # Start between the modes, a little toward the heavier one, about as wide as the gap.
            mu = torch.tensor(0.5, dtype=torch.float64, requires_grad=True)
            log_sigma = torch.tensor(0.0, dtype=torch.float64, requires_grad=True)
            opt = torch.optim.Adam([mu, log_sigma], lr=0.03)
            for _ in range(steps):
                inv_var = torch.exp(-2 * log_sigma)
                xs = torch.stack([mu * inv_var, -0.5 * inv_var])[None]  # natural parameters
                loss = hidden_loss(xs, xt, ws, wt, divergence=div)
                opt.zero_grad()
                loss.backward()
                opt.step()
                bar.update(1)
            fits[div] = {
                "mu": float(mu.detach()),
                "sigma": float(log_sigma.detach().exp()),
                "loss": float(loss.detach()),
            }
    return {"x": x, "target": target / target.sum(), "fits": fits}


def rank_chase(
    ranks=(4, 16, 64),
    features: int = 16,
    V: int = 64,
    N: int = 512,
    steps: int = 300,
    divergences=DIVERGENCES + ("tvd",),
    progress: bool = True,
    seed: int = 0,
) -> Dict:
    """TVD(teacher, student) over steps, for each training divergence and teacher rank."""
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(N, max(max(ranks), features), generator=g)
    curves: Dict[int, Dict[str, List[float]]] = {}
    with Progress(
        steps * len(ranks) * len(divergences), "toy: softmax regression vs teacher rank", enabled=progress
    ) as bar:
        for r in ranks:
            xt = X[:, :r].contiguous()
            wt = torch.randn(V, r, generator=g) * (3.0 / math.sqrt(r))  # logits of std ~3
            xs = X[:, :features].contiguous()
            curves[r] = {}
            for div in divergences:
                ws = torch.zeros(V, features, requires_grad=True)
                opt = torch.optim.Adam([ws], lr=0.05)
                dist = []
                for _ in range(steps):
                    loss = hidden_loss(xs, xt, ws, wt, divergence=div)
                    opt.zero_grad()
                    loss.backward()
                    opt.step()
                    with torch.no_grad():
                        dist.append(float(tvd(xs, xt, ws, wt)))
                    bar.update(1)
                curves[r][div] = dist
    return {"ranks": list(ranks), "features": features, "curves": curves}


def plot_modes(res: Dict, path: str) -> None:
    import matplotlib.pyplot as plt

    x = res["x"].numpy()
    fig, ax = plt.subplots(figsize=(7.5, 4.2))
    ax.fill_between(x, res["target"].numpy(), color="lightgray", label="target p (two modes)")
    dx = float(res["x"][1] - res["x"][0])
    styles = {"forward_kl": "-", "reverse_kl": "-", "jsd": "--"}
    for div, f in res["fits"].items():
        q = torch.exp(-((res["x"] - f["mu"]) ** 2) / (2 * f["sigma"] ** 2))
        ax.plot(
            x,
            (q / q.sum()).numpy(),
            color=COLORS[div],
            lw=2,
            ls=styles.get(div, "-"),
            label=f"{div}: mu={f['mu']:+.2f}, sigma={f['sigma']:.2f}",
        )
    ax.set_xlabel("x")
    ax.set_ylabel(f"probability per bin (width {dx:.2f})")
    ax.set_title(
        "One Gaussian fitted to two modes\nforward KL covers both (mean-seeking), reverse KL picks one (mode-seeking)",
        fontsize=9,
    )
    ax.legend(fontsize=8)
    fig.tight_layout()
    _save(fig, path)


def plot_rank(res: Dict, path: str) -> None:
    import matplotlib.pyplot as plt

    ranks = res["ranks"]
    fig, axes = plt.subplots(1, len(ranks), figsize=(4.2 * len(ranks), 3.8))
    for ax, r in zip(axes, ranks):
        for div, dist in res["curves"][r].items():
            ax.plot(range(1, len(dist) + 1), dist, color=COLORS[div], lw=1.6, label=f"trained with {div}")
        reach = "in reach" if r <= res["features"] else "out of reach"
        ax.set_title(f"teacher rank {r} ({reach} of a {res['features']}-feature student)", fontsize=9)
        if r <= res["features"]:
            ax.set_yscale("log")  # in reach: distances fall by orders of magnitude
        ax.set_xlabel("step")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel("TVD(teacher, student), mean over inputs")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    _save(fig, path)


def _save(fig, path: str) -> None:
    import matplotlib.pyplot as plt

    tmp = f"{path}.tmp{os.getpid()}.png"
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    os.replace(tmp, path)


def run_toy(out: str, progress: bool = True, mode_steps: int = 400, rank_steps: int = 300) -> Dict:
    os.makedirs(out, exist_ok=True)
    modes = two_modes(steps=mode_steps, progress=progress)
    ranks = rank_chase(steps=rank_steps, progress=progress)
    lines = ["| fitted by | mu | sigma |", "|---|---|---|"]
    lines += [f"| {d} | {f['mu']:+.3f} | {f['sigma']:.3f} |" for d, f in modes["fits"].items()]
    lines += [
        "",
        "Target: 0.6 N(+2.2, 0.6^2) + 0.4 N(-2.2, 0.6^2).",
        "",
        "| teacher rank | "
        + " | ".join(f"TVD after {rank_steps} steps, trained with {d}" for d in ranks["curves"][ranks["ranks"][0]])
        + " |",
        "|---|" + "---|" * len(ranks["curves"][ranks["ranks"][0]]),
    ]
    for r in ranks["ranks"]:
        lines.append(f"| {r} | " + " | ".join(f"{c[-1]:.2e}" for c in ranks["curves"][r].values()) + " |")
    text = "\n".join(lines) + "\n"
    print()
    print(text)
    paths = {"table": os.path.join(out, "demo_toy.md")}
    atomic_write_text(paths["table"], text)
    try:
        import matplotlib

        matplotlib.use("Agg")
    except ImportError:
        print("matplotlib not installed: no plots (pip install nitrobrew[plot])")
    else:
        paths["modes"] = os.path.join(out, "demo_toy_modes.png")
        paths["rank"] = os.path.join(out, "demo_toy_rank.png")
        plot_modes(modes, paths["modes"])
        plot_rank(ranks, paths["rank"])
    print("wrote " + ", ".join(paths.values()))
    return {
        "modes": modes["fits"],
        "ranks": {r: {d: c[-1] for d, c in v.items()} for r, v in ranks["curves"].items()},
        "paths": paths,
    }
