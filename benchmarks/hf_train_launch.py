"""`nitrobrew train` launched by `accelerate launch` (FSDP2 plugin) and by `torchrun`, on P GPUs.

    python benchmarks/hf_train_launch.py prepare DIR [--real | --small] [--steps N] [--length L]
    accelerate launch --config_file DIR/fsdp2_apart.yaml benchmarks/hf_train_launch.py train DIR/train.yaml \\
        --output_dir DIR/accelerate
    torchrun --nproc-per-node 2 benchmarks/hf_train_launch.py train DIR/train.yaml --output_dir DIR/torchrun \\
        --fsdp full_shard --fsdp_config DIR/fsdp_root.json
    python benchmarks/hf_train_launch.py report DIR OUT.md

``train`` is ``nitrobrew train`` itself (``nitrobrew.cli``, the same arguments) with a clock added to the
trainer (a ``TrainerCallback``): each rank writes OUTPUT_DIR/clock_rank{R}.json with the wall time and input
tokens (all ranks) at each optimizer step, and its GPU's peak memory (allocated and reserved) over training.
``python -m nitrobrew.cli train`` in its place trains the same; the report then has no steady-state rate.

Models (random weights, saved by ``prepare``; no downloads), forward KL + 0.1 CE, bf16, gradient
checkpointing, AdamW, batch 1 or 2 per GPU:
  --real     a Qwen2-1.5B-shaped student (28 x 1536, float32 master weights) and a Qwen2-7B-shaped teacher
             (28 x 3584, bf16), V = 152064, sequences of 4096 tokens, 200 steps, batch 1 per GPU
  default    Qwen2-shaped 12 x 896 student and 12 x 1536 teacher, V = 152064, 2048 tokens, 60 steps, batch 2
  --small    2-layer models, V = 515, 64 tokens, 4 steps (CPU, gloo: checks the scripts)
The accelerate run wraps the decoder apart from the head (the head stays sharded: vocab-parallel loss),
the torchrun run wraps layers + root (the head gathered with the root). The report reads each run's
trainer_state.json (steps, the loss curve) and clocks: tokens/s in the steady state (input tokens of all
ranks over the wall time of the steps after the first tenth, at most 20), the peak memory per GPU, the
first and last logged losses, and how far the two launches' loss curves are apart.
"""

from __future__ import annotations

import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # run from a checkout

PRESETS = {
    "small": dict(vocab=515, length=64, steps=4, batch=2, student=(2, 64, 2, 1, 128), teacher=(2, 96, 2, 1, 192)),
    "default": dict(
        vocab=152064, length=2048, steps=60, batch=2, student=(12, 896, 14, 2, 4864), teacher=(12, 1536, 12, 2, 8960)
    ),
}


def preset(name: str) -> dict:
    if name == "real":
        from nitrobrew.bench.models import QWEN2_VOCAB, STUDENT_1P5B, TEACHER_7B

        return dict(vocab=QWEN2_VOCAB, length=4096, steps=200, batch=1, student=STUDENT_1P5B, teacher=TEACHER_7B)
    return dict(PRESETS[name])


def prepare(root: str, name: str, steps=None, length=None) -> None:
    import torch

    from nitrobrew.bench.models import qwen2_model

    device = "cuda" if torch.cuda.is_available() else "cpu"
    p = preset(name)
    steps, length = steps or p["steps"], length or p["length"]
    V = p["vocab"]
    t0 = time.perf_counter()
    os.makedirs(root, exist_ok=True)
    for seed, who in enumerate(("student", "teacher")):
        model = qwen2_model(p[who], V, torch.bfloat16, device, seed, max_positions=max(4096, length))
        model.save_pretrained(os.path.join(root, who))
        del model
    world = max(torch.cuda.device_count(), 2) if device == "cuda" else 2
    g = torch.Generator().manual_seed(0)
    with open(os.path.join(root, "data.jsonl"), "w") as f:
        for _ in range(steps * world * p["batch"] + 8):
            f.write(json.dumps({"input_ids": torch.randint(0, V, (length,), generator=g).tolist()}) + "\n")
    bf16 = "false" if device == "cpu" else "true"
    with open(os.path.join(root, "train.yaml"), "w") as f:
        f.write(
            f"student: {root}/student\nteacher: {root}/teacher\ndata: {root}/data.jsonl\n"
            f"attn_implementation: sdpa\nstudent_dtype: float32\nmax_steps: {steps}\n"
            f"per_device_train_batch_size: {p['batch']}\nlearning_rate: 1.0e-5\ndivergence: forward_kl\n"
            f"ce_weight: 0.1\nbf16: {bf16}\ngradient_checkpointing: true\n"
            f'logging_steps: {10 if steps >= 50 else 1}\nsave_strategy: "no"\n'
            "report_to: none\nskip_memory_metrics: false\ninclude_num_input_tokens_seen: true\nseed: 0\n"
            + ("use_cpu: true\n" if device == "cpu" else "")
        )
    precision = "bf16" if device == "cuda" else '"no"'
    with open(os.path.join(root, "fsdp2_apart.yaml"), "w") as f:
        f.write(
            "compute_environment: LOCAL_MACHINE\ndistributed_type: FSDP\nnum_machines: 1\n"
            f"num_processes: {world}\n"
            f"mixed_precision: {precision}\nuse_cpu: {str(device == 'cpu').lower()}\n"
            "fsdp_config:\n  fsdp_version: 2\n  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP\n"
            "  fsdp_transformer_layer_cls_to_wrap: Qwen2DecoderLayer,Qwen2Model\n"
            "  fsdp_reshard_after_forward: true\n  fsdp_state_dict_type: SHARDED_STATE_DICT\n"
            "  fsdp_cpu_ram_efficient_loading: false\n  fsdp_activation_checkpointing: false\n"
        )
    with open(os.path.join(root, "fsdp_root.json"), "w") as f:
        json.dump({"version": 2, "transformer_layer_cls_to_wrap": ["Qwen2DecoderLayer"]}, f)
    with open(os.path.join(root, "preset.json"), "w") as f:
        json.dump(dict(p, name=name, steps=steps, length=length, world=world), f)
    print(f"prepared {name} in {root} ({time.perf_counter() - t0:.0f} s)", flush=True)


# ------------------------------------------------------------------------------------ train


def warm_steps(max_steps: int) -> int:
    """The steps left out of the steady state: the first tenth, at most 20."""
    return min(max(max_steps // 10, 1), 20)


def step_clock():
    """A TrainerCallback: per optimizer step the wall time and the input tokens seen (all ranks); the GPU's
    peak memory over training; written to OUTPUT_DIR/clock_rank{R}.json at the end. The device is synchronized
    at the two steps the steady state is measured between, nowhere else."""
    import torch
    from transformers import TrainerCallback

    class StepClock(TrainerCallback):
        def __init__(self):
            self.steps = []

        def on_train_begin(self, args, state, control, **kwargs):
            if torch.cuda.is_available():
                torch.cuda.reset_peak_memory_stats()
            self.start = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            if torch.cuda.is_available() and state.global_step in (warm_steps(state.max_steps), state.max_steps):
                torch.cuda.synchronize()  # the step's work is done: its end is its time
            self.steps.append((state.global_step, time.perf_counter() - self.start, state.num_input_tokens_seen))

        def on_train_end(self, args, state, control, **kwargs):
            rank = args.process_index
            out = dict(rank=rank, world=args.world_size, warm=warm_steps(state.max_steps), steps=self.steps)
            out["log_history"] = state.log_history  # the losses, should saving the model fail after this
            if torch.cuda.is_available():
                out.update(
                    device=torch.cuda.get_device_name(),
                    peak_allocated_gib=torch.cuda.max_memory_allocated() / 2**30,
                    peak_reserved_gib=torch.cuda.max_memory_reserved() / 2**30,
                )
            os.makedirs(args.output_dir, exist_ok=True)
            with open(os.path.join(args.output_dir, f"clock_rank{rank}.json"), "w") as f:
                json.dump(out, f)

    return StepClock()


def step_profiler(spec: str):
    """A TrainerCallback that runs torch.profiler over optimizer steps [start, start + count) (spec
    "START:COUNT", from HF_TRAIN_PROFILE) and writes each rank's kernel and operator tables to
    OUTPUT_DIR/profile_rank{R}.txt: where a step's time goes."""
    import torch
    from transformers import TrainerCallback

    start, count = (int(v) for v in spec.split(":"))

    class StepProfiler(TrainerCallback):
        prof = None
        t0 = 0.0

        def on_step_begin(self, args, state, control, **kwargs):
            if state.global_step == start and self.prof is None:
                acts = [torch.profiler.ProfilerActivity.CPU]
                if torch.cuda.is_available():
                    acts.append(torch.profiler.ProfilerActivity.CUDA)
                    torch.cuda.synchronize()
                self.prof = torch.profiler.profile(activities=acts)
                self.prof.__enter__()
                self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            if self.prof is not None and state.global_step == start + count:
                if torch.cuda.is_available():
                    torch.cuda.synchronize()
                wall = (time.perf_counter() - self.t0) / count
                self.prof.__exit__(None, None, None)
                ka = self.prof.key_averages()
                gpu = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
                # kernel time and host time per step (the events' self times; device kernels are leaves)
                dev = sum(getattr(e, "self_device_time_total", 0.0) for e in ka) / count / 1e3
                host = sum(e.self_cpu_time_total for e in ka) / count / 1e3
                head = f"steps {start}..{start + count - 1}: wall {wall * 1e3:.0f} ms/step (profiled); "
                head += f"self device time {dev:.0f} ms/step, self host time {host:.0f} ms/step\n\n"
                path = os.path.join(args.output_dir, f"profile_rank{args.process_index}.txt")
                os.makedirs(args.output_dir, exist_ok=True)
                with open(path, "w") as f:
                    f.write(head)
                    f.write(ka.table(sort_by=gpu, row_limit=30, max_name_column_width=60))
                    f.write("\n")
                    f.write(ka.table(sort_by="cpu_time_total", row_limit=25, max_name_column_width=60))
                self.prof = None

    return StepProfiler()


def train(argv) -> int:
    from nitrobrew import cli
    from nitrobrew.hf import train_cli

    build = train_cli.build

    def build_with_clock(*args, **kwargs):
        trainer = build(*args, **kwargs)
        trainer.add_callback(step_clock())
        if os.environ.get("HF_TRAIN_PROFILE"):
            trainer.add_callback(step_profiler(os.environ["HF_TRAIN_PROFILE"]))
        return trainer

    train_cli.build = build_with_clock
    return cli.main(["train", *argv])


# ------------------------------------------------------------------------------------ report


def steady_rate(clock):
    """Input tokens/s (all ranks) from the end of step ``warm`` to the end of the last: no start-up."""
    steps = clock["steps"]
    begin = next((s for s in steps if s[0] == clock["warm"]), None)
    if begin is None or len(steps) < 3:
        return None
    (_, t0, n0), (_, t1, n1) = begin, steps[-1]
    return (n1 - n0) / (t1 - t0) if t1 > t0 and n1 > n0 else None


def report(root: str, out: str) -> int:
    p = json.load(open(os.path.join(root, "preset.json"))) if os.path.exists(os.path.join(root, "preset.json")) else {}
    s, t = p.get("student", ("?",) * 5), p.get("teacher", ("?",) * 5)
    lines = [
        "# `nitrobrew train` under accelerate launch (FSDP2) and torchrun",
        "",
        f"Student {s[0]} x {s[1]}, teacher {t[0]} x {t[1]} (Qwen2-shaped, random weights), V = {p.get('vocab')}, "
        f"batch {p.get('batch')} x {p.get('length')} tokens per GPU, {p.get('world')} GPUs, {p.get('steps')} steps, "
        "forward KL + 0.1 CE, bf16 on GPUs (student: float32 master weights), gradient checkpointing, AdamW "
        "(benchmarks/hf_train_launch.py; the `train` command is `nitrobrew train` with a step clock).",
        "",
        "| launcher | layout | steps | loss first -> last | tokens/s steady (all GPUs) | tokens/s per GPU | "
        "training s | peak GiB per GPU (allocated / reserved) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    ok, curves = True, {}
    for run, layout in (
        ("accelerate", "FSDP2, decoder wrapped apart (head sharded)"),
        ("torchrun", "FSDP2, root-wrapped"),
    ):
        path = os.path.join(root, run, "trainer_state.json")
        folder = os.path.join(root, run)
        clocks = [
            json.load(open(os.path.join(folder, f)))
            for f in sorted(os.listdir(folder) if os.path.isdir(folder) else [])
            if f.startswith("clock_rank")
        ]
        if os.path.exists(path):
            state = json.load(open(path))
        elif clocks:  # trained, then failed before trainer_state.json (saving the model)
            state = dict(log_history=clocks[0]["log_history"], global_step=clocks[0]["steps"][-1][0])
            ok = False
        else:
            lines.append(f"| {run} | {layout} | - | - | - | - | - | - (no trainer_state.json: see its log) |")
            ok = False
            continue
        hist = state["log_history"]
        curves[run] = {h["step"]: h["loss"] for h in hist if "loss" in h}
        losses = list(curves[run].values())
        rate = steady_rate(clocks[0]) if clocks else None
        world = clocks[0]["world"] if clocks else p.get("world") or 1
        seconds = f"{clocks[0]['steps'][-1][1]:.0f}" if clocks and clocks[0]["steps"] else "-"
        mem = ", ".join(
            f"{c['peak_allocated_gib']:.1f} / {c['peak_reserved_gib']:.1f}" for c in clocks if "peak_allocated_gib" in c
        )
        if not mem:
            final = hist[-1]
            peak = final.get("train_mem_gpu_peaked_delta")
            mem = (
                "-"
                if peak is None
                else f"{(peak + (final.get('train_mem_gpu_alloc_delta') or 0)) / 2**30:.1f} (rank 0)"
            )
        first_last = f"{losses[0]:.4f} -> {losses[-1]:.4f}" if losses else "-"
        lines.append(
            f"| {run} | {layout} | {state.get('global_step')} | {first_last} | "
            f"{'-' if rate is None else f'{rate:.0f}'} | {'-' if rate is None else f'{rate / world:.0f}'} | "
            f"{seconds} | {mem or '-'} |"
        )
    if len(curves) == 2:
        a, b = curves["accelerate"], curves["torchrun"]
        common = sorted(set(a) & set(b))
        if common:
            worst = max(abs(a[k] - b[k]) / max(abs(b[k]), 1e-12) for k in common)
            lines += [
                "",
                f"Loss curves: {len(common)} logged steps in common, largest relative difference {worst:.2e} "
                f"(step {common[0]}: {a[common[0]]:.5f} / {b[common[0]]:.5f}; step {common[-1]}: "
                f"{a[common[-1]]:.5f} / {b[common[-1]]:.5f}).",
            ]
    text = "\n".join(lines) + "\n"
    print(text)
    with open(out, "w") as f:
        f.write(text)
    return 0 if ok else 1


def main(argv) -> int:
    if not argv or argv[0] not in ("prepare", "train", "report"):
        print(__doc__)
        return 2
    if argv[0] == "prepare":
        if len(argv) < 2 or argv[1].startswith("-"):  # `prepare --help` must not prepare a folder "--help"
            print(__doc__)
            return 0 if "-h" in argv or "--help" in argv else 2
        name = "real" if "--real" in argv else "small" if "--small" in argv else "default"

        def value(flag):
            return int(argv[argv.index(flag) + 1]) if flag in argv else None

        prepare(argv[1], name, steps=value("--steps"), length=value("--length"))
        return 0
    if argv[0] == "train":
        return train(argv[1:])
    return report(argv[1], argv[2])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
