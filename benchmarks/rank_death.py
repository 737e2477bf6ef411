"""A rank killed mid-run: every rank stops in bounded time with a clear error, and the run resumes.

Three launches of `nitrobrew train` under real torchrun (P processes, DDP; tiny models written to a
temporary directory, no downloads):

  A  the whole run (--steps optimizer steps, a checkpoint every --save-steps)
  B  the same run; once a checkpoint is complete, rank P-1 is killed with SIGKILL. Measured: the
     time from the kill until torchrun has returned (every rank stopped), its exit status, and the
     error lines (torchrun's failure summary; nitrobrew's watchdog line where it got there first)
  C  B's run resumed with --resume_from_checkpoint (its latest complete checkpoint) to the end

C's per-step losses must equal A's on the steps after the checkpoint (same data order, optimizer,
scheduler and RNG states; eager attention, whose backward is deterministic on CUDA where SDPA's
memory-efficient kernel adds with atomics). Writes rank_death.md to --out; exit status 0 when the stop was bounded
(--bound seconds) and the curves agree.

    python benchmarks/rank_death.py --out benchmarks/results/parallel --device cuda    # 2 GPUs, NCCL
    python benchmarks/rank_death.py --out /tmp/rd --device cpu                          # gloo
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
V = 61

CONFIG = """\
student: {root}/student
teacher: {root}/teacher
data: {root}/data.jsonl
output_dir: {out}
attn_implementation: eager
max_steps: {steps}
per_device_train_batch_size: 2
learning_rate: 1.0e-2
lr_scheduler_type: cosine
warmup_steps: 2
divergence: forward_kl
ce_weight: 0.1
logging_steps: 1
save_strategy: steps
save_steps: {save_steps}
report_to: none
seed: 7
data_seed: 7
dataloader_num_workers: 0
ddp_timeout: 1800
{device}
"""


def write_inputs(root: str) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    small = dict(vocab_size=V, num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)
    LlamaForCausalLM(
        LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=2, tie_word_embeddings=False, **small)
    ).save_pretrained(os.path.join(root, "student"))
    torch.manual_seed(1)
    Qwen2ForCausalLM(Qwen2Config(hidden_size=24, intermediate_size=48, num_hidden_layers=1, **small)).save_pretrained(
        os.path.join(root, "teacher")
    )
    g = torch.Generator().manual_seed(0)
    with open(os.path.join(root, "data.jsonl"), "w") as f:
        for i in range(512):
            n = 8 + i % 13
            f.write(json.dumps({"input_ids": torch.randint(0, V, (n,), generator=g).tolist()}) + "\n")


def launch(cfg: str, nproc: int, log: str, extra=(), env=None):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--monitor-interval", "1"]
    cmd += ["-m", "nitrobrew.cli", "train", cfg, *extra]
    out = open(log, "w")
    return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, env=env, start_new_session=True)


def losses(out_dir: str):
    path = os.path.join(out_dir, "trainer_state.json")
    if not os.path.exists(path):
        return {}
    return {h["step"]: h["loss"] for h in json.load(open(path))["log_history"] if "loss" in h}


def complete_checkpoints(out_dir: str, nproc: int = 1):
    """The checkpoints whose every file is there: trainer_state.json (written by rank 0 last) and, with
    several processes, each rank's own RNG state (a rank killed while the others save leaves its file out)."""
    found = []
    for name in os.listdir(out_dir) if os.path.isdir(out_dir) else []:
        path = os.path.join(out_dir, name)
        need = ["trainer_state.json"] + ([f"rng_state_{r}.pth" for r in range(nproc)] if nproc > 1 else [])
        if name.startswith("checkpoint-") and all(os.path.exists(os.path.join(path, f)) for f in need):
            found.append((int(name.split("-")[1]), path))
    return sorted(found)


def worker_pids(proc, rank: int):
    import psutil

    pids = []
    for child in psutil.Process(proc.pid).children(recursive=True):
        try:
            if child.environ().get("RANK") == str(rank) and "nitrobrew.cli" in " ".join(child.cmdline()):
                pids.append(child.pid)
        except psutil.Error:
            pass
    return pids


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--save-steps", type=int, default=5)
    p.add_argument("--bound", type=float, default=60.0, help="seconds allowed from the kill to every rank stopped")
    p.add_argument("--watchdog", type=float, default=20.0, help="NITROBREW_RANK_TIMEOUT for the runs (seconds)")
    p.add_argument("--run-timeout", type=float, default=240.0)
    p.add_argument(
        "--curve-rtol",
        type=float,
        default=None,
        help="largest |loss C - loss A| / max(1, |loss A|) counted as the same curve (default 1e-4 on CPU, "
        "1e-3 on CUDA, where reductions may be ordered differently run to run)",
    )
    args = p.parse_args(argv)
    rtol = args.curve_rtol if args.curve_rtol is not None else (1e-4 if args.device == "cpu" else 1e-3)
    device = "use_cpu: true\nddp_backend: gloo" if args.device == "cpu" else "ddp_backend: nccl"
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.update(
        NITROBREW_RANK_TIMEOUT=str(args.watchdog),
        OMP_NUM_THREADS="1",
        NCCL_NVLS_ENABLE="0",
        TORCH_SYMM_MEM_DISABLE_MULTICAST="1",
        NVSHMEM_DISABLE_NVLS="1",
    )
    victim = args.nproc - 1
    report, ok = [], True
    with tempfile.TemporaryDirectory() as root:
        write_inputs(root)
        cfgs = {}
        for run in ("A", "B"):
            cfgs[run] = os.path.join(root, f"{run}.yaml")
            with open(cfgs[run], "w") as f:
                f.write(
                    CONFIG.format(
                        root=root,
                        out=os.path.join(root, run),
                        steps=args.steps,
                        save_steps=args.save_steps,
                        device=device,
                    )
                )
        # A: the whole run
        a = launch(cfgs["A"], args.nproc, os.path.join(root, "A.log"), env=env)
        rc_a = a.wait(args.run_timeout)
        curve_a = losses(os.path.join(root, "A"))
        report.append(f"A (whole run): exit {rc_a}, {len(curve_a)} logged steps")
        ok &= rc_a == 0 and len(curve_a) == args.steps

        # B: kill one rank once a checkpoint is complete
        b = launch(cfgs["B"], args.nproc, os.path.join(root, "B.log"), env=env)
        deadline = time.monotonic() + args.run_timeout
        killed_at = None
        while time.monotonic() < deadline and b.poll() is None:
            if complete_checkpoints(os.path.join(root, "B"), args.nproc):
                pids = worker_pids(b, victim)
                if pids:
                    for pid in pids:
                        os.kill(pid, signal.SIGKILL)
                    killed_at = time.monotonic()
                    break
            time.sleep(0.02)
        if killed_at is None:
            report.append(
                f"B: the run ended (exit {b.poll()}) before a rank could be killed after a complete "
                "checkpoint (raise --steps or --save-steps)"
            )
            ok = False
            b.wait(args.run_timeout)
        else:
            try:
                rc_b = b.wait(args.bound)
                stopped = time.monotonic() - killed_at
            except subprocess.TimeoutExpired:
                rc_b, stopped = None, None
                os.killpg(b.pid, signal.SIGKILL)
                b.wait()
            text = open(os.path.join(root, "B.log")).read()
            lines = [
                ln.strip()
                for ln in text.splitlines()
                if "nitrobrew:" in ln or "Signal 9" in ln or "SIGKILL" in ln or "exitcode" in ln or "ChildFailed" in ln
            ]
            ckpts = complete_checkpoints(os.path.join(root, "B"), args.nproc)
            report.append(
                f"B (rank {victim} killed with SIGKILL after checkpoint-{ckpts[0][0] if ckpts else '?'} was complete): "
                + (
                    f"every rank stopped {stopped:.1f} s after the kill, torchrun exit {rc_b}"
                    if stopped is not None
                    else f"NOT stopped within {args.bound:.0f} s (killed by the driver)"
                )
            )
            report.append("B error lines:\n\n```\n" + "\n".join(dict.fromkeys(lines)) + "\n```")
            ok &= stopped is not None and rc_b != 0

            # C: resume from B's latest complete checkpoint
            step0, ckpt = ckpts[-1]
            c = launch(
                cfgs["B"],
                args.nproc,
                os.path.join(root, "C.log"),
                extra=["--resume_from_checkpoint", ckpt],
                env=env,
            )
            rc_c = c.wait(args.run_timeout)
            curve_c = losses(os.path.join(root, "B"))
            after = [s for s in sorted(curve_a) if s > step0]
            diffs = [abs(curve_c.get(s, float("nan")) - curve_a[s]) for s in after]
            worst = max(diffs) if diffs else float("nan")
            same = bool(diffs) and all(d <= rtol * max(1.0, abs(curve_a[s])) for d, s in zip(diffs, after))
            report.append(
                f"C (resumed from checkpoint-{step0}): exit {rc_c}, steps {after[0] if after else '-'}-"
                f"{after[-1] if after else '-'} logged {sum(s in curve_c for s in after)}/{len(after)}, "
                f"largest |loss C - loss A| {worst:.2e} (tolerance {rtol:g} relative): "
                f"{'same curve' if same else 'DIFFERENT curve'}"
            )
            ok &= rc_c == 0 and same
            report.append(
                "| step | loss A (whole run) | loss C (resumed) |\n|---|---|---|\n"
                + "\n".join(f"| {s} | {curve_a[s]:.6f} | {curve_c.get(s, float('nan')):.6f} |" for s in after[:12])
            )
        if not ok:  # the logs' tails go into the report: the temporary directory goes away
            for run in ("A", "B", "C"):
                path = os.path.join(root, f"{run}.log")
                if os.path.exists(path):
                    text = open(path).read().splitlines()
                    said = [ln for ln in text if ln.startswith("nitrobrew")]  # the ranks' own error lines
                    tail = "\n".join(said + ["..."] + text[-40:])
                    report.append(f"{run}.log (error lines, then the last 40 lines):\n\n```\n{tail}\n```")
    import torch

    head = (
        f"# A rank killed mid-run ({args.nproc} processes, {args.device}, torchrun, DDP)\n\n"
        f"`python benchmarks/rank_death.py {' '.join(sys.argv[1:] if argv is None else argv)}`\n\n"
        f"torch {torch.__version__}, NITROBREW_RANK_TIMEOUT={args.watchdog:g} s, {args.steps} steps, "
        f"a checkpoint every {args.save_steps}.\n\n"
    )
    text = head + "\n\n".join(report) + f"\n\nVerdict: {'PASS' if ok else 'FAIL'}\n"
    print(text)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"rank_death_{args.device}.md"), "w") as f:
        f.write(text)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
