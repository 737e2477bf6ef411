"""Static cost of the hidden-state row kernels: compile them for sm_90 on the CPU (ptxas ships with
Triton) and count the SASS instructions of each kernel's inner loop per logit pair, with the registers
a thread needs, for this tree and an old copy of the package (--old-root: the folder holding its
`nitrobrew/`). The row passes are bound by instructions once they issue more than ~45 a logit pair
(a statistics pass reads 8 bytes; the gradient pass, 10 bytes, ~55), so the counts predict where a
change costs time. Launch settings as the launchers pick them; pointers, strides and the row length
16-divisible, as at V = 152064.

    python benchmarks/row_kernel_sass.py --old-root .gpu/old [--main-root DIR] [--out PATH]

--main-root: a third tree (e.g. `git archive` of main before this change) shown between the two.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from collections import Counter

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DIVS = ("forward_kl", "reverse_kl", "jsd", "tvd", "skew_kl", "skew_reverse_kl")
DIV16 = (
    "z_ptr",
    "t_ptr",
    "g_ptr",
    "stride_z",
    "stride_t",
    "stride_g",
    "n_cols",
    "state_ptr",
    "rowvals_ptr",
    "kd_scale_ptr",
    "ce_scale_ptr",
    "labels_ptr",
    "rowmax_ptr",
    "chunk_max_ptr",
)
SIGNATURE = {  # every argument either kernel may take
    "z_ptr": "*fp32",
    "t_ptr": "*fp32",
    "g_ptr": "*bf16",
    "stride_z": "i32",
    "stride_t": "i32",
    "stride_g": "i32",
    "state_ptr": "*fp32",
    "rowvals_ptr": "*fp32",
    "kd_scale_ptr": "*fp32",
    "ce_scale_ptr": "*fp32",
    "labels_ptr": "*i64",
    "rowmax_ptr": "*fp32",
    "chunk_max_ptr": "*fp32",
    "stride_cm": "i32",
    "n_cols": "i32",
    "col_offset": "i32",
    "inv_temp": "fp32",
    "param": "fp32",
    "log_a": "fp32",
    "log_1ma": "fp32",
    "inv_cap": "fp32",
}


class _Cfg:  # what the launchers read of a LossConfig
    def __init__(self, divergence):
        self.divergence, self.param, self.temperature = divergence, 0.5, 1.0
        self.with_ce, self.softcap_s, self.chunk_V, self.filter_eps = False, None, None, None


def _launch_settings(kern, launcher, cfg, pass_no=None):
    """The constexprs and num_warps the launcher passes, caught by a stand-in launch at V = 152064 (the
    statistics as the single-process fast mode launches them)."""
    import inspect

    seen = {}
    extra = {"centred": False} if "centred" in inspect.signature(launcher).parameters else {}

    def fake(kernel, grid, *args, **kw):
        seen.update(kw)

    import torch

    saved = kern.launch
    kern.launch = fake
    try:
        z = torch.empty(1, 152064)
        if pass_no is None:
            launcher(z, z, z, torch.empty(1, 16), z[0], z[0], None, 0, cfg)
        else:
            launcher(z, z, torch.empty(1, 16), None, 0, cfg, pass_no, **extra)
    finally:
        kern.launch = saved
    return seen


def _counts(cubin: bytes, elems: int):
    import triton

    tools = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(cubin)
    sass = subprocess.run([os.path.join(tools, "cuobjdump"), "-sass", f.name], capture_output=True, text=True).stdout
    res = subprocess.run(
        [os.path.join(tools, "cuobjdump"), "-res-usage", f.name], capture_output=True, text=True
    ).stdout
    os.unlink(f.name)
    lines = [ln for ln in sass.splitlines() if re.match(r"\s+/\*[0-9a-f]{4,}\*/\s", ln)]
    addr = [int(re.match(r"\s+/\*([0-9a-f]+)\*/", ln).group(1), 16) for ln in lines]
    ops = [re.sub(r"^\s+/\*[0-9a-f]{4,}\*/\s+(@!?U?P\w+\s+)?", "", ln).split()[0].split(".")[0] for ln in lines]
    body = ops
    for i, ln in enumerate(lines):  # the inner loop: the longest backward branch
        m = re.search(r"BRA\s+(?:`\(\.L_x_\d+\)\s*)?0x([0-9a-f]+)", ln)
        if m and int(m.group(1), 16) < addr[i] and int(m.group(1), 16) in addr:
            j = addr.index(int(m.group(1), 16))
            if body is ops or i - j + 1 > len(body):
                body = ops[j : i + 1]
    c = Counter(body)
    return {
        "instr": round(len(body) / elems, 1),
        "mufu": round(c.get("MUFU", 0) / elems, 1),
        "regs": int(re.search(r"REG:(\d+)", res).group(1)),
        "local": int(re.search(r"LOCAL:(\d+)", res).group(1)),
    }


def measure(root: str) -> dict:
    """Per divergence and pass: instructions and MUFU ops per logit pair, registers a thread."""
    os.environ.pop("TRITON_INTERPRET", None)
    sys.path.insert(0, root)
    import inspect

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from nitrobrew import divergences as dv
    from nitrobrew.hidden import kernels as kern

    target = GPUTarget("cuda", 90, 32)
    out = {}
    for div in DIVS:
        cfg = _Cfg(div)
        passes = [("pass 1", kern.hidden_stats_kernel, 1), ("grad", kern.hidden_grad_kernel, None)]
        if div not in dv.ONE_PASS:
            passes.insert(1, ("pass 2", kern.hidden_stats_kernel, 2))
        for label, fn, pass_no in passes:
            launcher = kern.launch_grad if pass_no is None else kern.launch_stats
            seen = _launch_settings(kern, launcher, cfg, pass_no)
            block, warps = seen["BLOCK_V"], seen["num_warps"]
            names = list(inspect.signature(fn.fn).parameters)
            sig = {k: ("constexpr" if k.isupper() else SIGNATURE[k]) for k in names}
            const = {k: seen[k] for k in names if k.isupper()}
            attrs = {(names.index(k),): [["tt.divisibility", 16]] for k in DIV16 if k in names}
            src = ASTSource(fn=fn, signature=sig, constexprs=const, attrs=attrs)
            k = triton.compile(src, target=target, options={"num_warps": warps})
            row = _counts(k.asm["cubin"], block // (32 * warps))
            row["tile"] = f"{block} x {warps}"
            out[f"{div} {label}"] = row
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--old-root", required=True, help="the folder holding the old nitrobrew/ package")
    p.add_argument("--main-root", help="the folder holding a third nitrobrew/ package, shown as 'main'")
    p.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "exactness", "row_kernel_sass.md"))
    p.add_argument("--root", help=argparse.SUPPRESS)  # one tree, in a subprocess: prints JSON
    args = p.parse_args()
    if args.root:
        print(json.dumps(measure(args.root)))
        return 0
    env = dict(os.environ, TRITON_DEFAULT_FP_FUSION="1")
    trees = [("old", args.old_root)] + ([("main", args.main_root)] if args.main_root else []) + [("new", ROOT)]
    tables = {}
    for label, root in trees:
        run = subprocess.run(
            [sys.executable, __file__, "--old-root", args.old_root, "--root", os.path.abspath(root)],
            capture_output=True,
            text=True,
            env=env,
            check=True,
        )
        tables[label] = json.loads(run.stdout.strip().splitlines()[-1])
    import triton

    labels = [t[0] for t in trees]
    head = " | ".join(f"{k} {lab}" for k in ("instr", "MUFU", "regs", "tile") for lab in labels)
    lines = [
        "# Row kernels: SASS instructions per logit pair (sm_90, compiled on the CPU)",
        "",
        f"`benchmarks/row_kernel_sass.py`, Triton {triton.__version__}, ptxas of that Triton; "
        + ", ".join(f"{lab}: `{root}`" for lab, root in trees)
        + ". Inner loop of each kernel, per logit pair; MUFU: special-function ops (exp); registers a thread;",
        "the tile (columns x warps) as the launcher picks it.",
        "",
        f"| kernel | {head} |",
        "|---" * (1 + 4 * len(labels)) + "|",
    ]
    for key in tables["new"]:
        cells = [tables[lab].get(key, {}) for lab in labels]
        vals = [str(c.get(k, "")) for k in ("instr", "mufu", "regs", "tile") for c in cells]
        lines.append(f"| {key} | " + " | ".join(vals) + " |")
    text = "\n".join(lines) + "\n"
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        f.write(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
