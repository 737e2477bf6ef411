"""`nitrobrew demo`: distill a small causal LM end to end on a language with a known source.

1. Generate a corpus from a hidden Markov "language" (``source.HMMSource``) whose exact
   next-token distribution is known, so every model's KL divergence to the truth is measurable.
2. Train a teacher (a Llama-architecture transformers model) on hard labels.
3. Extract the teacher's top-k log-probs over the corpus into a store (``nitrobrew.topk``).
4. Train students (smaller, same initialization, same batches in the same order, same steps):
   hard labels only, then forward KL, reverse KL and JSD from the live teacher's hidden states
   (``nitrobrew.hf.distill_loss``), forward KL from the stored top-k, and two on-policy
   students: each batch's first ``prompt_len`` tokens are completed by the student itself
   (``nitrobrew.hf.on_policy_batch``) and the teacher scores the student's own tokens (reverse
   KL, and JSD as in GKD); and two offline on-policy students: the initial student's completions
   are written once (``nitrobrew rollout``), the teacher scores them once into a hidden store and
   a top-k store (``nitrobrew teacher-extract``), and the students train from the stores alone.
5. Report held-out perplexity, KL to the source, accuracy, peak memory and time, as a markdown
   table, a JSON file and a PNG of the curves.

Every stage writes atomic safetensors checkpoints; ``--resume`` continues an interrupted run
and ends exactly where an uninterrupted one ends (batches and learning rates are functions of
the step; model and optimizer state are restored bit for bit).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import time
from dataclasses import asdict, dataclass, fields
from typing import Callable, Dict, Optional, Tuple

import torch

from ..core.atomic_io import atomic_write_text
from ..core.memory import peak_mib
from ..environment import environment
from .checkpoint import load_checkpoint, save_checkpoint
from .progress import Progress
from .source import HMMSource

METHODS = (
    "hard_labels",
    "forward_kl",
    "reverse_kl",
    "jsd",
    "topk",
    "on_policy_reverse_kl",
    "on_policy_jsd",
    "offline_hidden_reverse_kl",
    "offline_topk",
)
LABELS = {
    "hard_labels": "hard labels (CE)",
    "forward_kl": "forward KL",
    "reverse_kl": "reverse KL",
    "jsd": "JSD (beta 0.5)",
    "topk": "top-k store, forward KL",
    "on_policy_reverse_kl": "on-policy, reverse KL on student samples",
    "on_policy_jsd": "on-policy, JSD (beta 0.5) on student samples",
    "offline_hidden_reverse_kl": "offline on-policy, reverse KL from a hidden store",
    "offline_topk": "offline on-policy, forward KL from a top-k store",
}
# Students trained from stores of the teacher's scores on rollouts of the initial student.
OFFLINE = ("offline_hidden_reverse_kl", "offline_topk")
ON_POLICY = {"on_policy_reverse_kl": "reverse_kl", "on_policy_jsd": "jsd"}
# Settings that may change between a run and its --resume (they add or drop whole stages).
RESUMABLE_CHANGES = ("methods",)


@dataclass
class DemoConfig:
    """Everything that decides the result (saved with the run; --resume needs the same)."""

    vocab: int = 64
    states: int = 16
    seq_len: int = 64
    train_sequences: int = 4096
    test_sequences: int = 256
    teacher_hidden: int = 128
    teacher_layers: int = 4
    teacher_steps: int = 600
    student_hidden: int = 64
    student_layers: int = 2
    student_steps: int = 300
    batch_size: int = 32
    lr: float = 3e-3
    warmup: int = 30
    temperature: float = 1.0
    topk: int = 16
    topk_tail: bool = True
    prompt_len: int = 16  # on-policy students: prompt tokens; the student generates the rest
    methods: Tuple[str, ...] = METHODS
    eval_every: int = 25
    checkpoint_every: int = 50
    seed: int = 0


PRESETS: Dict[str, Dict] = {
    # seconds on a CPU: what the tests run
    "tiny": dict(
        vocab=24,
        states=6,
        seq_len=16,
        train_sequences=128,
        test_sequences=16,
        teacher_hidden=32,
        teacher_layers=1,
        teacher_steps=12,
        student_hidden=16,
        student_layers=1,
        student_steps=8,
        batch_size=8,
        warmup=2,
        topk=6,
        eval_every=4,
        checkpoint_every=3,
        prompt_len=4,
    ),
    "default": {},  # under ten minutes on 2 CPU cores (468 s on one thread, eleven rows)
    # a GPU (or patience): a larger language, wider models, longer training
    "large": dict(
        vocab=512,
        states=64,
        seq_len=128,
        train_sequences=65536,
        test_sequences=1024,
        teacher_hidden=512,
        teacher_layers=8,
        teacher_steps=4000,
        student_hidden=256,
        student_layers=4,
        student_steps=2000,
        batch_size=64,
        lr=1e-3,
        warmup=100,
        topk=32,
        eval_every=100,
        checkpoint_every=250,
        prompt_len=32,
    ),
}


class Interrupted(RuntimeError):
    """Raised by the `stop_after` hook (tests use it to simulate a kill between checkpoints)."""


# ------------------------------------------------------------------------------------ the pieces


def require_transformers():
    try:
        import transformers  # noqa: F401
    except ImportError as err:
        raise SystemExit("the demo trains transformers models: pip install 'nitrobrew[hf]'") from err


def make_model(cfg: DemoConfig, hidden: int, layers: int, seed: int, device: torch.device):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=cfg.vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=max(hidden // 16, 1),
        num_key_value_heads=max(hidden // 16, 1),
        max_position_embeddings=cfg.seq_len,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    return LlamaForCausalLM(config).to(device)


@dataclass
class Data:
    source: HMMSource
    train: torch.Tensor  # [n, L] int64
    test: torch.Tensor  # [m, L]
    test_probs: torch.Tensor  # [m, L - 1, V] float64: the source's exact next-token distributions


def make_data(cfg: DemoConfig) -> Data:
    source = HMMSource.make(vocab=cfg.vocab, states=cfg.states, seed=cfg.seed)
    train = source.sample(cfg.train_sequences, cfg.seq_len, seed=cfg.seed + 1)
    test = source.sample(cfg.test_sequences, cfg.seq_len, seed=cfg.seed + 2)
    return Data(source, train, test, source.next_token_probs(test))


def batch_indices(cfg: DemoConfig, step: int) -> torch.Tensor:
    """The training sequences of `step`: epoch-wise permutations, a pure function of the step."""
    per_epoch = max(cfg.train_sequences // cfg.batch_size, 1)
    epoch, i = divmod(step, per_epoch)
    perm = torch.randperm(cfg.train_sequences, generator=torch.Generator().manual_seed(cfg.seed * 7919 + epoch))
    return perm[i * cfg.batch_size : (i + 1) * cfg.batch_size]


def lr_at(cfg: DemoConfig, step: int, steps: int) -> float:
    """Linear warm-up, then cosine decay to 10% of the peak."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    frac = (step - cfg.warmup) / max(steps - cfg.warmup, 1)
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))


def source_metrics(data: Data) -> Dict[str, float]:
    P, nxt = data.test_probs, data.test[:, 1:]
    logp = P.clamp_min(1e-300).log()
    return {
        "kl": 0.0,
        "ppl": float((-logp.gather(-1, nxt[..., None])).mean().exp()),
        "acc": float((P.argmax(-1) == nxt).double().mean()),
        "entropy": float(-(P * logp).sum(-1).mean()),
    }


@torch.no_grad()
def evaluate(model, data: Data, device: torch.device, batch: int = 64) -> Dict[str, float]:
    """Held-out KL(source || model) per token, perplexity and top-1 accuracy on sampled text."""
    was_training = model.training
    model.eval()
    kl = nll = correct = 0.0
    for i in range(0, data.test.shape[0], batch):
        ids = data.test[i : i + batch].to(device)
        logq = model(input_ids=ids).logits[:, :-1].double().log_softmax(-1).cpu()
        P, nxt = data.test_probs[i : i + batch], data.test[i : i + batch, 1:]
        kl += float((P * (P.clamp_min(1e-300).log() - logq)).sum(-1).sum())
        nll += float(-logq.gather(-1, nxt[..., None]).sum())
        correct += float((logq.argmax(-1) == nxt).sum())
    model.train(was_training)
    n = data.test_probs.shape[0] * data.test_probs.shape[1]
    return {"kl": kl / n, "ppl": math.exp(nll / n), "acc": correct / n}


# -------------------------------------------------------------------------------- one training run


class Runner:
    """Runs stages with checkpoints, progress bars and the interruption hook."""

    def __init__(
        self,
        cfg: DemoConfig,
        out: str,
        device: torch.device,
        resume: bool,
        progress: bool,
        stop_after: Optional[int] = None,
    ):
        self.cfg, self.out, self.device = cfg, out, device
        self.resume, self.progress = resume, progress
        self.stop_after, self.steps_done = stop_after, 0
        self.ckpt_dir = os.path.join(out, "checkpoints")
        os.makedirs(self.ckpt_dir, exist_ok=True)

    def ckpt(self, name: str) -> str:
        return os.path.join(self.ckpt_dir, f"{name}.safetensors")

    def train(
        self, name: str, model, steps: int, loss_fn: Callable[[torch.Tensor, int], torch.Tensor], data: Data, desc: str
    ) -> Dict:
        """Train `model` for `steps` (resuming from its checkpoint); returns its record.

        loss_fn may return (loss, stats): numbers added up in the record (timed steps only)."""
        cfg, device = self.cfg, self.device
        opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.98), weight_decay=0.0)
        path = self.ckpt(name)
        record = {"step": 0, "done": False, "train_seconds": 0.0, "peak_mib": None, "curve": []}
        if self.resume and os.path.exists(path):
            record = load_checkpoint(path, model, opt, device=str(device))
        if record["done"]:
            if self.progress:
                print(f"{desc}: done ({steps} steps, from its checkpoint)")
            return record
        if not record["curve"]:
            record["curve"].append({"step": 0, **evaluate(model, data, device)})
        model.train()
        with Progress(steps, desc, initial=record["step"], enabled=self.progress) as bar:
            for step in range(record["step"], steps):
                for group in opt.param_groups:
                    group["lr"] = lr_at(cfg, step, steps)

                stats = {}

                def one_step():
                    loss = loss_fn(batch_indices(cfg, step), step)
                    if isinstance(loss, tuple):
                        loss, more = loss
                        stats.update(more)
                    loss.backward()
                    opt.step()
                    opt.zero_grad(set_to_none=True)
                    return loss

                if record["peak_mib"] is None and step >= 1:
                    # Peak memory of one whole step above the resident weights and optimizer state
                    # (step 0 allocates the optimizer state, so measure the next one). The tracked
                    # step runs slower on the CPU: its time is not counted.
                    holder = {}
                    record["peak_mib"] = peak_mib(lambda: holder.setdefault("loss", one_step()), device)
                    loss = holder["loss"]
                else:
                    t0 = time.perf_counter()
                    loss = one_step()
                    if device.type == "cuda":
                        torch.cuda.synchronize()
                    record["train_seconds"] += time.perf_counter() - t0
                    for key, value in stats.items():
                        record[key] = record.get(key, 0.0) + value
                loss = float(loss.detach())
                done = step + 1
                if done % cfg.eval_every == 0 or done == steps:
                    point = {"step": done, **evaluate(model, data, device)}
                    record["curve"].append(point)
                    bar.update(1, loss=loss, kl_to_source=point["kl"])
                else:
                    bar.update(1, loss=loss)
                if done % cfg.checkpoint_every == 0 or done == steps:
                    record["step"], record["done"] = done, done == steps
                    save_checkpoint(path, model, opt, record)
                self.steps_done += 1
                if self.stop_after is not None and self.steps_done >= self.stop_after:
                    raise Interrupted(f"stopped after {self.steps_done} steps (at step {done} of {name})")
        return record


# --------------------------------------------------------------------------------------- the demo


def topk_available() -> bool:
    try:
        from ..teacher import data as _d  # noqa: F401
        from ..teacher import extract as _e  # noqa: F401
    except ImportError:
        return False
    return True


def extract_store(runner: Runner, teacher, data: Data) -> str:
    """The teacher's top-k over the training corpus, as a nitrobrew.topk store (resumable)."""
    from ..teacher.extract import extract_topk, teacher_from_hf

    cfg = runner.cfg
    path = os.path.join(runner.out, "topk_store")
    if not runner.resume and os.path.exists(path):
        shutil.rmtree(path)
    t0 = time.perf_counter()
    seqs = data.train.tolist()
    if runner.progress:
        print(f"extracting the teacher's top-{cfg.topk} over {len(seqs)} sequences into {path}")
    extract_topk(
        teacher_from_hf(teacher, name="nitrobrew-demo-teacher"),
        seqs,
        path,
        k=cfg.topk,
        temperature=cfg.temperature,
        sequences_per_shard=max(len(seqs) // 4, 1),
        source={"demo_config": _jsonable(cfg)},
        resume=runner.resume,
    )
    if runner.progress:
        print(f"  store written in {time.perf_counter() - t0:.1f} s")
    return path


def offline_stores(runner: Runner, teacher, student, data: Data) -> Dict:
    """Offline on-policy data: the initial student completes every training sequence's first
    ``prompt_len`` tokens once (``nitrobrew rollout``'s writer), then the teacher scores the completions
    into a hidden store (bf16 rows) and a top-k store. All resumable; returns paths and figures."""
    from ..hf.generation import Sampling
    from ..teacher.extract import extract_hidden, extract_topk, teacher_from_hf
    from ..teacher.rollout import generate_rollouts, read_rollouts

    cfg = runner.cfg
    paths = {k: os.path.join(runner.out, k) for k in ("rollouts", "hidden_store", "rollout_topk_store")}
    if not runner.resume:
        for path in paths.values():
            shutil.rmtree(path, ignore_errors=True)
    t0 = time.perf_counter()
    prompts = data.train[:, : cfg.prompt_len].tolist()
    if runner.progress:
        print(f"rolling out the initial student on {len(prompts)} prompts into {paths['rollouts']}")
    generate_rollouts(
        student,
        prompts,
        paths["rollouts"],
        sampling=Sampling(max_new_tokens=cfg.seq_len - cfg.prompt_len, temperature=1.0, pad_token_id=0),
        seed=cfg.seed,
        batch_size=256,
        sequences_per_shard=max(len(prompts) // 4, 1),
        model_name="nitrobrew-demo-student (initial)",
        resume=runner.resume,
    )
    t_roll = time.perf_counter() - t0
    seqs, plen, _ = read_rollouts(paths["rollouts"])
    wrapped = teacher_from_hf(teacher, name="nitrobrew-demo-teacher", logit_transforms=True)
    t0 = time.perf_counter()
    hidden = extract_hidden(
        wrapped,
        seqs,
        paths["hidden_store"],
        hidden_dtype="bfloat16",
        prompt_lengths=plen,
        sequences_per_shard=max(len(seqs) // 4, 1),
        source={"rollouts": os.path.abspath(paths["rollouts"])},
        resume=runner.resume,
    )
    topk = extract_topk(
        wrapped,
        seqs,
        paths["rollout_topk_store"],
        k=cfg.topk,
        temperature=cfg.temperature,
        sequences_per_shard=max(len(seqs) // 4, 1),
        source={"rollouts": os.path.abspath(paths["rollouts"])},  # TopKDataset reads the prompt lengths there
        resume=runner.resume,
    )
    t_extract = time.perf_counter() - t0
    # bytes per counted position: the top-k store also holds the prompt's rows, which are not counted
    counted = sum(len(s) - p for s, p in zip(seqs, plen))
    out = {
        "paths": paths,
        "rollout_seconds": t_roll,
        "extract_seconds": t_extract,
        "hidden_bytes": sum(s["bytes"] for s in hidden["shards"]) / max(counted, 1),
        "topk_bytes": sum(s["bytes"] for s in topk["shards"]) / max(counted, 1),
    }
    if runner.progress:
        print(
            f"  rollouts in {t_roll:.1f} s, stores in {t_extract:.1f} s: hidden {out['hidden_bytes']:.0f} "
            f"bytes/position, top-k {out['topk_bytes']:.0f} bytes/position"
        )
    return out


def run_demo(
    cfg: DemoConfig,
    out: str,
    device: str = "cpu",
    resume: bool = False,
    progress: bool = True,
    stop_after: Optional[int] = None,
    plot: bool = True,
) -> Dict:
    """The whole demo; returns the results (also written to OUT/results.json)."""
    require_transformers()
    from ..hf import distill_loss, on_policy_batch
    from ..hf.generation import make_generator

    dev = torch.device(device)
    methods = list(cfg.methods)
    if any(m in ON_POLICY or m in OFFLINE for m in methods) and not 0 < cfg.prompt_len < cfg.seq_len:
        raise SystemExit(f"--prompt-len must be between 1 and seq_len - 1 ({cfg.seq_len - 1}), got {cfg.prompt_len}")
    for name in ("topk",) + OFFLINE:
        if name in methods and not topk_available():
            print(f"the teacher stores are not available in this build: skipping the {name} student")
            methods.remove(name)
    os.makedirs(out, exist_ok=True)
    _check_or_save_config(cfg, out, resume)
    runner = Runner(cfg, out, dev, resume=resume, progress=progress, stop_after=stop_after)
    t_start = time.perf_counter()

    data = make_data(cfg)
    train_dev = data.train.to(dev)
    src = source_metrics(data)
    if progress:
        print(
            f"language: {cfg.vocab} words, {cfg.states} hidden states; {cfg.train_sequences} training "
            f"sequences of {cfg.seq_len} tokens; source entropy {src['entropy']:.3f} nats/token "
            f"(perplexity floor {src['ppl']:.2f})"
        )

    teacher = make_model(cfg, cfg.teacher_hidden, cfg.teacher_layers, cfg.seed + 10, dev)
    params = {"teacher": _params(teacher)}
    records = {
        "teacher": runner.train(
            "teacher",
            teacher,
            cfg.teacher_steps,
            lambda idx, step: distill_loss(teacher, None, train_dev[idx], kd_weight=0.0, ce_weight=1.0).loss,
            data=data,
            desc=f"teacher ({_params(teacher) / 1e6:.2f}M params)",
        )
    }
    teacher.eval().requires_grad_(False)

    # The students trained from a store: its dataset, its collator and the teacher's signal in a batch.
    stores: Dict[str, Tuple] = {}

    def from_topk(dataset):
        return lambda b: dict(
            divergence="topk",
            topk_ids=b["topk_ids"],
            topk_logprobs=b["topk_logprobs"],
            topk_tail=cfg.topk_tail,
            teacher_temperature=dataset.temperature,
        )

    if "topk" in methods:
        from ..teacher.data import TopKCollator, TopKDataset

        store = TopKDataset(extract_store(runner, teacher, data))
        stores["topk"] = (store, TopKCollator(), from_topk(store))
    offline = None
    if any(m in OFFLINE for m in methods):
        from ..teacher.data import TopKCollator, TopKDataset
        from ..teacher.hidden_data import HiddenCollator, HiddenDataset

        initial = make_model(cfg, cfg.student_hidden, cfg.student_layers, cfg.seed + 20, dev)  # the students' start
        offline = offline_stores(runner, teacher, initial, data)
        del initial
        hidden_store = HiddenDataset(offline["paths"]["hidden_store"])
        hidden_head = hidden_store.load_head(dev)  # once, on the device: no teacher model in these students' loop
        stores["offline_hidden_reverse_kl"] = (
            hidden_store,
            HiddenCollator(),
            lambda b: dict(teacher_hidden=b["teacher_hidden"], teacher_head=hidden_head, divergence="reverse_kl"),
        )
        rollout_topk = TopKDataset(offline["paths"]["rollout_topk_store"])  # the prompt's positions do not count
        stores["offline_topk"] = (rollout_topk, TopKCollator(), from_topk(rollout_topk))

    for method in methods:
        student = make_model(cfg, cfg.student_hidden, cfg.student_layers, cfg.seed + 20, dev)
        # The fast engine where it applies (the static cache on CUDA), the dynamic cache elsewhere.
        engine = make_generator("auto", student) if method in ON_POLICY else None

        def loss_fn(idx, step, method=method, student=student, engine=engine):
            if method == "hard_labels":
                return distill_loss(student, None, train_dev[idx], kd_weight=0.0, ce_weight=1.0).loss
            if method in stores:
                dataset, collate, signal = stores[method]
                b = {k: v.to(dev) for k, v in collate([dataset[int(i)] for i in idx]).items()}
                return distill_loss(
                    student,
                    None,
                    b["input_ids"],
                    b["attention_mask"],
                    targets=b["labels"],
                    temperature=cfg.temperature,
                    **signal(b),
                ).loss
            if method in ON_POLICY:
                # The student completes each sequence's first prompt_len tokens (seeded by the step:
                # --resume generates the same samples), the teacher scores the student's own tokens.
                prompts = train_dev[idx][:, : cfg.prompt_len]
                gen = on_policy_batch(
                    student,
                    prompts,
                    max_new_tokens=cfg.seq_len - cfg.prompt_len,
                    temperature=1.0,
                    eos_token_id=None,
                    pad_token_id=0,
                    seed=cfg.seed * 1_000_003 + step,
                    generator=engine,
                )
                out = distill_loss(
                    student,
                    teacher,
                    gen.input_ids,
                    gen.attention_mask,
                    gen.labels,
                    divergence=ON_POLICY[method],
                    temperature=cfg.temperature,
                )
                return out.loss, {"gen_seconds": gen.seconds}
            return distill_loss(student, teacher, train_dev[idx], divergence=method, temperature=cfg.temperature).loss

        params[method] = _params(student)
        records[method] = runner.train(
            method,
            student,
            cfg.student_steps,
            loss_fn,
            data=data,
            desc=f"student: {LABELS[method]} ({_params(student) / 1e6:.2f}M params)",
        )

    results = {
        "config": asdict(cfg),
        "source": src,
        "runs": {},
        "environment": environment(),
        "device": str(dev),
        "threads": torch.get_num_threads(),
        "wall_seconds_this_session": time.perf_counter() - t_start,
    }
    for name, rec in records.items():
        final = rec["curve"][-1]
        results["runs"][name] = {
            "kl": final["kl"],
            "ppl": final["ppl"],
            "acc": final["acc"],
            "peak_mib": rec["peak_mib"],
            "train_seconds": rec["train_seconds"],
            "gen_seconds": rec.get("gen_seconds"),
            "params": params[name],
            "curve": rec["curve"],
        }
        if name in OFFLINE and offline is not None:
            results["runs"][name]["store_bytes_per_position"] = offline[
                "hidden_bytes" if name == "offline_hidden_reverse_kl" else "topk_bytes"
            ]
            results["runs"][name]["rollout_seconds"] = offline["rollout_seconds"]
            results["runs"][name]["extract_seconds"] = offline["extract_seconds"]
    from .report import write_report

    write_report(results, out, plot=plot)
    if progress:
        print(f"demo finished in {time.perf_counter() - t_start:.0f} s (this session)")
    return results


def _params(model) -> int:
    return sum(p.numel() for p in model.parameters())


def _jsonable(cfg: DemoConfig) -> Dict:
    return json.loads(json.dumps(asdict(cfg)))


def _check_or_save_config(cfg: DemoConfig, out: str, resume: bool) -> None:
    path = os.path.join(out, "config.json")
    mine = _jsonable(cfg)
    if resume and os.path.exists(path):
        with open(path) as f:
            saved = json.load(f)
        diff = sorted(k for k in set(saved) | set(mine) if saved.get(k) != mine.get(k) and k not in RESUMABLE_CHANGES)
        if diff:
            raise SystemExit(
                f"--resume: the run in {out} was made with other settings ({', '.join(diff)}); "
                "use the same flags, or another --out"
            )
    if not resume:
        shutil.rmtree(os.path.join(out, "checkpoints"), ignore_errors=True)
    atomic_write_text(path, json.dumps(mine, indent=1) + "\n")


def config_from(preset: str, **overrides) -> DemoConfig:
    values = dict(PRESETS[preset])
    names = {f.name for f in fields(DemoConfig)}
    values.update({k: v for k, v in overrides.items() if v is not None and k in names})
    if "methods" in values:
        values["methods"] = tuple(values["methods"])
    return DemoConfig(**values)
