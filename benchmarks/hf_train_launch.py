"""`nitrobrew train` launched by `accelerate launch` (FSDP2 plugin) and by `torchrun`, on P GPUs.

    python benchmarks/hf_train_launch.py prepare DIR [--small]   # models, data, configs (GPU if any)
    accelerate launch --config_file DIR/fsdp2_apart.yaml -m nitrobrew.cli train DIR/train.yaml \\
        --output_dir DIR/accelerate
    torchrun --nproc-per-node 2 -m nitrobrew.cli train DIR/train.yaml --output_dir DIR/torchrun \\
        --fsdp full_shard --fsdp_config DIR/fsdp_root.json
    python benchmarks/hf_train_launch.py report DIR OUT.md

Models: a Qwen2-shaped student (12 layers x 896, untied head) and teacher (12 layers x 1536),
V = 152064, random weights; sequences of --length tokens, forward KL + CE. The accelerate run
wraps the decoder apart from the head (the head stays sharded: vocab-parallel loss), the torchrun
run wraps layers + root (the head gathered with the root). The report reads each run's
trainer_state.json: steps, final loss, tokens/s (input tokens of all ranks / train runtime) and
the peak GPU memory rank 0 reached above its start (transformers' memory metrics).
"""

from __future__ import annotations

import json
import os
import sys


def prepare(root: str, small: bool) -> None:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    device = "cuda" if torch.cuda.is_available() else "cpu"
    V = 515 if small else 152064
    length = 64 if small else 2048
    steps = 4 if small else 60
    shapes = {
        "student": dict(
            hidden_size=64 if small else 896,
            intermediate_size=128 if small else 4864,
            heads=(2, 1) if small else (14, 2),
        ),
        "teacher": dict(
            hidden_size=96 if small else 1536,
            intermediate_size=192 if small else 8960,
            heads=(2, 1) if small else (12, 2),
        ),
    }
    os.makedirs(root, exist_ok=True)
    for seed, (name, s) in enumerate(shapes.items()):
        cfg = Qwen2Config(
            vocab_size=V,
            hidden_size=s["hidden_size"],
            intermediate_size=s["intermediate_size"],
            num_hidden_layers=2 if small else 12,
            num_attention_heads=s["heads"][0],
            num_key_value_heads=s["heads"][1],
            max_position_embeddings=max(4096, length),
            tie_word_embeddings=False,
        )
        torch.manual_seed(seed)
        old = torch.get_default_dtype()
        torch.set_default_dtype(torch.bfloat16)
        try:
            with torch.device(device):
                model = Qwen2ForCausalLM(cfg)
        finally:
            torch.set_default_dtype(old)
        model.save_pretrained(os.path.join(root, name))
        del model
    g = torch.Generator().manual_seed(0)
    with open(os.path.join(root, "data.jsonl"), "w") as f:
        for _ in range(steps * 2 * 8):
            f.write(json.dumps({"input_ids": torch.randint(0, V, (length,), generator=g).tolist()}) + "\n")
    bf16 = "false" if device == "cpu" else "true"
    with open(os.path.join(root, "train.yaml"), "w") as f:
        f.write(
            f"student: {root}/student\nteacher: {root}/teacher\ndata: {root}/data.jsonl\n"
            f"attn_implementation: sdpa\nstudent_dtype: float32\nmax_steps: {steps}\n"
            "per_device_train_batch_size: 2\nlearning_rate: 1.0e-5\ndivergence: forward_kl\nce_weight: 0.1\n"
            f'bf16: {bf16}\ngradient_checkpointing: true\nlogging_steps: 10\nsave_strategy: "no"\n'
            "report_to: none\nskip_memory_metrics: false\ninclude_num_input_tokens_seen: true\nseed: 0\n"
            + ("use_cpu: true\n" if device == "cpu" else "")
        )
    precision = "bf16" if device == "cuda" else '"no"'
    with open(os.path.join(root, "fsdp2_apart.yaml"), "w") as f:
        f.write(
            "compute_environment: LOCAL_MACHINE\ndistributed_type: FSDP\nnum_machines: 1\n"
            f"num_processes: {max(torch.cuda.device_count(), 2) if device == 'cuda' else 2}\n"
            f"mixed_precision: {precision}\nuse_cpu: {str(device == 'cpu').lower()}\n"
            "fsdp_config:\n  fsdp_version: 2\n  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP\n"
            "  fsdp_transformer_layer_cls_to_wrap: Qwen2DecoderLayer,Qwen2Model\n"
            "  fsdp_reshard_after_forward: true\n  fsdp_state_dict_type: SHARDED_STATE_DICT\n"
            "  fsdp_cpu_ram_efficient_loading: false\n  fsdp_activation_checkpointing: false\n"
        )
    with open(os.path.join(root, "fsdp_root.json"), "w") as f:
        json.dump({"version": 2, "transformer_layer_cls_to_wrap": ["Qwen2DecoderLayer"]}, f)


def report(root: str, out: str) -> int:
    lines = [
        "# `nitrobrew train` under accelerate launch (FSDP2) and torchrun",
        "",
        "Student 12 x 896, teacher 12 x 1536 (Qwen2-shaped, random), V = 152064, batch 2 x 2048 per GPU, "
        "forward KL + 0.1 CE, bf16, gradient checkpointing (benchmarks/hf_train_launch.py).",
        "",
        "| launcher | layout | steps | final loss | tokens/s (all GPUs) | peak GiB above start (rank 0) |",
        "|---|---|---|---|---|---|",
    ]
    ok = True
    for run, layout in (
        ("accelerate", "FSDP2, decoder wrapped apart (head sharded)"),
        ("torchrun", "FSDP2, root-wrapped"),
    ):
        path = os.path.join(root, run, "trainer_state.json")
        if not os.path.exists(path):
            lines.append(f"| {run} | {layout} | - | - | - | - (no trainer_state.json: see its log) |")
            ok = False
            continue
        hist = json.load(open(path))["log_history"]
        losses = [h["loss"] for h in hist if "loss" in h]
        final = hist[-1]
        runtime = final.get("train_runtime")
        tokens = json.load(open(path)).get("num_input_tokens_seen") or next(
            (h.get("num_input_tokens_seen") for h in reversed(hist) if h.get("num_input_tokens_seen")), None
        )
        tps = f"{tokens / runtime:.0f}" if tokens and runtime else "-"
        peak = final.get("train_mem_gpu_peaked_delta")
        alloc = final.get("train_mem_gpu_alloc_delta")
        mem = "-" if peak is None else f"{(peak + (alloc or 0)) / 2**30:.1f}"
        step = json.load(open(path)).get("global_step")
        lines.append(
            f"| {run} | {layout} | {step} | {losses[-1] if losses else final.get('train_loss', '-')} | {tps} | {mem} |"
        )
    text = "\n".join(lines) + "\n"
    print(text)
    with open(out, "w") as f:
        f.write(text)
    return 0 if ok else 1


if __name__ == "__main__":
    if sys.argv[1] == "prepare":
        prepare(sys.argv[2], "--small" in sys.argv)
        sys.exit(0)
    sys.exit(report(sys.argv[2], sys.argv[3]))
