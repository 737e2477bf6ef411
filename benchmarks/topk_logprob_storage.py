"""Loss error and bytes per position of the store's log-prob dtypes (CPU, a few seconds).

Teacher and student logits come from low-rank heads (D = 64, V = 4096) at three spreads of the
teacher (entropies from about 0.3 to 5 nats) and two students (close to the teacher, and
unrelated); per row, the forward KL with the tail bucket (float64 reference loss) from the
top-64 log-probs stored as float32 is compared with the same log-probs stored as bfloat16,
float16 and uint8 (nitrobrew.teacher.store.quantize_logprobs).

    PYTHONPATH=. python benchmarks/topk_logprob_storage.py [--md OUT.md]
"""

import argparse
import sys

import torch

from nitrobrew.teacher.store import dequantize_logprobs, quantize_logprobs
from nitrobrew.topk.reference import reference_topk_loss

K, V, D, R = 64, 4096, 64, 2048


def stored(lp, dtype):
    if dtype == "uint8":
        return dequantize_logprobs(*quantize_logprobs(lp))
    return lp.to(getattr(torch, dtype)).float()


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--md", default=None)
    args = ap.parse_args(argv)
    g = torch.Generator().manual_seed(0)
    ws = torch.randn(V, D, generator=g, dtype=torch.float64) / D**0.5
    bytes_per = {"float32": 8 * K, "bfloat16": 6 * K, "float16": 6 * K, "uint8": 5 * K + 8}
    worst = {d: [0.0, 0.0, 0.0] for d in bytes_per}  # max |row error|, max row rel. error, max |mean error|
    cases = []
    for spread in (2.0, 6.0, 14.0):
        xt = torch.randn(R, D, generator=g, dtype=torch.float64) * spread
        lp_full = torch.log_softmax(xt @ ws.t(), -1)
        ent = -(lp_full.exp() * lp_full).sum(-1).mean().item()
        top_lp, top_ids = lp_full.topk(K, -1)
        top_lp = top_lp.float()
        for student, xs in (
            ("close", xt + 0.3 * torch.randn(R, D, generator=g, dtype=torch.float64)),
            ("unrelated", torch.randn(R, D, generator=g, dtype=torch.float64) * spread),
        ):
            ref = reference_topk_loss(xs, ws, top_ids, top_lp.double(), tail=True, reduction="none")
            row = [f"{spread:g} ({ent:.2f} nats)", student, f"{ref.mean().item():.4f}"]
            for dtype in ("bfloat16", "float16", "uint8"):
                got = reference_topk_loss(xs, ws, top_ids, stored(top_lp, dtype).double(), tail=True, reduction="none")
                err = (got - ref).abs()
                rel = (err / ref.abs().clamp(min=1e-12)).max().item()
                mean_err = (got.mean() - ref.mean()).abs().item()
                w = worst[dtype]
                w[0], w[1], w[2] = max(w[0], err.max().item()), max(w[1], rel), max(w[2], mean_err)
                row.append(f"{err.max().item():.1e} / {mean_err:.1e}")
            cases.append(row)
    lines = [
        "| teacher spread (entropy) | student | loss (float32) | bfloat16: max row / mean error | float16 | uint8 |",
        "|---|---|---|---|---|---|",
    ]
    lines += ["| " + " | ".join(r) + " |" for r in cases]
    lines += [
        "",
        "| log-probs | bytes / position at K = 64: int32 / uint24 / uint16 ids | max row error | "
        "max relative row error | max error of the mean |",
        "|---|---|---|---|---|",
    ]
    lp_bytes = {d: b - 4 * K for d, b in bytes_per.items()}
    lines += [
        f"| {d} | {lp + 4 * K} / {lp + 3 * K} / {lp + 2 * K} | {worst[d][0]:.1e} | {worst[d][1]:.1e} | "
        f"{worst[d][2]:.1e} |"
        for d, lp in lp_bytes.items()
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.md:
        open(args.md, "w").write(text)


if __name__ == "__main__":
    sys.exit(main())
