"""The demo's outputs: a markdown table, results.json and a PNG of the curves."""

from __future__ import annotations

import json
import os
from typing import Dict, Optional

from ..core.atomic_io import atomic_write_text

NAMES = {
    "teacher": "teacher",
    "hard_labels": "student: hard labels (CE)",
    "forward_kl": "student: forward KL",
    "reverse_kl": "student: reverse KL",
    "jsd": "student: JSD (beta 0.5)",
    "topk": "student: top-k store, forward KL",
    "on_policy_reverse_kl": "student: on-policy, reverse KL on student samples",
    "on_policy_jsd": "student: on-policy, JSD (beta 0.5) on student samples",
    "offline_hidden_reverse_kl": "student: offline on-policy, reverse KL from a hidden store",
    "offline_topk": "student: offline on-policy, forward KL from a top-k store",
}

STORES = {"offline_hidden_reverse_kl": "hidden store (bf16 rows)", "offline_topk": "top-k store"}


def _fmt(value: Optional[float], spec: str) -> str:
    return "-" if value is None else format(value, spec)


def table(results: Dict) -> str:
    """Markdown table of the final held-out metrics of every model."""
    cfg, src, runs = results["config"], results["source"], results["runs"]
    hard = runs.get("hard_labels", {}).get("kl")
    lines = [
        "| model | params | KL to source (nats/token) | KL vs hard labels | held-out perplexity | top-1 accuracy "
        "| peak MiB (one step) | train time (s) | of which generation (s) |",
        "|---|---|---|---|---|---|---|---|---|",
        f"| source (the true distribution) | - | 0 | - | {src['ppl']:.3f} | {src['acc']:.3f} | - | - | - |",
    ]
    for name, r in runs.items():
        vs = "-"
        if hard and name not in ("teacher", "hard_labels"):
            vs = f"{100 * (r['kl'] - hard) / hard:+.0f}%"
        lines.append(
            f"| {NAMES.get(name, name)} | {r['params'] / 1e6:.2f}M | {r['kl']:.4f} | {vs} | {r['ppl']:.3f} "
            f"| {r['acc']:.3f} | {_fmt(r['peak_mib'], '.1f')} | {r['train_seconds']:.1f} "
            f"| {_fmt(r.get('gen_seconds'), '.1f')} |"
        )
    stored = [(n, r) for n, r in runs.items() if r.get("store_bytes_per_position") is not None]
    if stored:
        first = stored[0][1]
        lines += [
            "",
            "Offline on-policy students: the initial student completed each training sequence's prompt once "
            f"({first['rollout_seconds']:.1f} s), the teacher scored the completions once into the stores "
            f"({first['extract_seconds']:.1f} s for both); the students train from the stores without the teacher "
            "(stale samples: they are the initial student's, not the current one's). Store size per counted "
            "position: "
            + ", ".join(f"{STORES.get(n, n)} {r['store_bytes_per_position']:.0f} bytes" for n, r in stored)
            + f" (top-k: K={cfg['topk']} ids and log-probs; its prompt rows are stored, not counted).",
        ]
    env = results["environment"]
    lines += [
        "",
        f"Held-out: {cfg['test_sequences']} sequences of {cfg['seq_len']} tokens from the source. Teacher "
        f"{cfg['teacher_layers']}x{cfg['teacher_hidden']} trained {cfg['teacher_steps']} steps on hard labels; "
        f"students {cfg['student_layers']}x{cfg['student_hidden']}, {cfg['student_steps']} steps each, same "
        f"initialization and batches ({cfg['batch_size']} x {cfg['seq_len']} tokens), temperature "
        f"{cfg['temperature']}; the top-k store keeps K={cfg['topk']} ids per position"
        f"{' plus a tail bucket' if cfg.get('topk_tail') else ''}. On-policy students: the student completes "
        f"each training sequence's first {cfg.get('prompt_len', '?')} tokens itself (sampling at temperature 1, "
        "a fresh sample every step) and the teacher scores the student's own tokens; only generated tokens count. "
        "Peak MiB: one training step (teacher forward included) "
        "above the resident weights and optimizer state. Train time: optimizer steps (teacher forwards and "
        "generation included; evaluation and the memory-tracked step excluded). "
        f"Device: {results['device']} ({env['device']}, torch threads: {results.get('threads', '?')}), "
        f"torch {env['torch']}, commit {env['commit']}.",
    ]
    return "\n".join(lines) + "\n"


def plot_curves(results: Dict, path: str) -> Optional[str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot (pip install nitrobrew[plot])")
        return None
    runs, src, cfg = results["runs"], results["source"], results["config"]
    fig, (ax_kl, ax_ppl) = plt.subplots(1, 2, figsize=(12, 4.6))
    for name, r in runs.items():
        if name == "teacher":
            continue
        steps = [p["step"] for p in r["curve"]]
        ax_kl.plot(steps, [p["kl"] for p in r["curve"]], label=NAMES[name].replace("student: ", ""), lw=1.6)
        ax_ppl.plot(steps, [p["ppl"] for p in r["curve"]], label=NAMES[name].replace("student: ", ""), lw=1.6)
    if "teacher" in runs:
        for ax, key in ((ax_kl, "kl"), (ax_ppl, "ppl")):
            ax.axhline(runs["teacher"][key], color="black", ls="--", lw=1, label="teacher (final)")
    ax_ppl.axhline(src["ppl"], color="gray", ls=":", lw=1.2, label="source (floor)")
    ax_kl.set_yscale("log")
    ax_kl.set_ylabel("KL(source || model), nats/token (held-out)")
    ax_ppl.set_ylabel("held-out perplexity")
    # Zoom on the last two thirds of training, where the students separate.
    late = [
        p["ppl"] for n, r in runs.items() if n != "teacher" for p in r["curve"] if p["step"] >= cfg["student_steps"] / 3
    ]
    if late:
        ax_ppl.set_ylim(src["ppl"] * 0.99, max(late) * 1.01)
    for ax in (ax_kl, ax_ppl):
        ax.set_xlabel("student step")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(
        f"nitrobrew demo: distilling a {cfg['teacher_layers']}x{cfg['teacher_hidden']} teacher into "
        f"{cfg['student_layers']}x{cfg['student_hidden']} students, {cfg['student_steps']} steps each "
        f"(same data), on a language with a known source",
        fontsize=10,
    )
    fig.tight_layout()
    tmp = f"{path}.tmp{os.getpid()}.png"
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    os.replace(tmp, path)
    return path


def write_report(results: Dict, out: str, plot: bool = True) -> Dict[str, str]:
    """Write OUT/demo_results.md, OUT/results.json and OUT/demo_curves.png; print the table."""
    text = table(results)
    paths = {"table": os.path.join(out, "demo_results.md"), "json": os.path.join(out, "results.json")}
    atomic_write_text(paths["table"], text)
    atomic_write_text(paths["json"], json.dumps(results, indent=1) + "\n")
    if plot:
        png = plot_curves(results, os.path.join(out, "demo_curves.png"))
        if png:
            paths["plot"] = png
    print()
    print(text)
    print("wrote " + ", ".join(paths.values()))
    return paths
