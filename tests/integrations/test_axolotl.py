"""The Axolotl plugin under Axolotl's own config parsing, collators, loss and trainer (run with Axolotl
installed: `make test-axolotl`). A tiny Qwen2 model and a word-level tokenizer are built here, and the
KD data is a nitrobrew store exported with `topk-export` (no downloads)."""

import os

import pytest
import torch

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
os.environ.setdefault("AXOLOTL_DO_NOT_TRACK", "1")  # no telemetry from a test
os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytest.importorskip("axolotl")
datasets = pytest.importorskip("datasets")

from axolotl.integrations.kd.collator import DataCollatorForKD  # noqa: E402
from axolotl.integrations.kd.kernels.liger import LigerFusedLinearKLTopKLogprobLoss  # noqa: E402
from axolotl.utils.config import normalize_config, prepare_plugins, validate_config  # noqa: E402
from axolotl.utils.dict import DictDefault  # noqa: E402

from nitrobrew.cli import main as cli_main  # noqa: E402
from nitrobrew.integrations import axolotl as nbax  # noqa: E402
from nitrobrew.teacher.store import TopKWriter  # noqa: E402

PLUGINS = ["nitrobrew.integrations.axolotl.NitrobrewKDPlugin", "axolotl.integrations.kd.KDPlugin"]
VOCAB, K = 50, 4  # the synthetic store's vocabulary and top-k


def _write_store(path, n_shards=2, per=8, seed=0):
    """A store of a teacher's real top-k log-probs (log_softmax over the vocabulary, then top-k)."""
    g = torch.Generator().manual_seed(seed)
    w = TopKWriter(
        str(path),
        model="synthetic",
        k=K,
        temperature=1.0,
        vocab_size=VOCAB,
        head_rows=VOCAB,
        num_sequences=n_shards * per,
        sequences_per_shard=per,
    )
    for j in range(n_shards):
        toks, ids, lps = [], [], []
        for _ in range(per):
            L = int(torch.randint(2, 9, (1,), generator=g))
            toks.append(torch.randint(3, VOCAB, (L,), generator=g))
            top = torch.log_softmax(3 * torch.randn(L - 1, VOCAB, generator=g), -1).topk(K, -1)
            ids.append(top.indices)
            lps.append(top.values)
        w.write_shard(j, toks, ids, lps)
    w.finish()
    w.close()


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    """A tiny model + tokenizer directory and a nitrobrew store exported to parquet."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    d = tmp_path_factory.mktemp("axolotl")
    words = ["<pad>", "<eos>", "<unk>"] + [f"w{i}" for i in range(VOCAB - 3)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>", eos_token="<eos>")
    torch.manual_seed(0)
    cfg = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        tie_word_embeddings=False,
        pad_token_id=0,
        eos_token_id=1,
    )
    model = Qwen2ForCausalLM(cfg)
    with torch.no_grad():
        model.lm_head.weight.mul_(20.0)
    model.save_pretrained(d / "model")
    fast.save_pretrained(d / "model")
    _write_store(d / "store")
    assert cli_main(["topk-export", str(d / "store"), str(d / "pq")]) == 0
    return d


def _raw(work, **extra):
    return DictDefault(
        {
            "base_model": str(work / "model"),
            "plugins": list(PLUGINS),
            "kd_trainer": True,
            "kd_alpha": 1.0,
            "kd_ce_alpha": 0.1,
            "kd_temperature": 1.0,
            "datasets": [{"path": str(work / "pq"), "ds_type": "parquet", "type": None}],
            "micro_batch_size": 2,
            "gradient_accumulation_steps": 1,
            "num_epochs": 1,
            "max_steps": 2,
            "learning_rate": 1e-3,
            "sequence_len": 64,
            "output_dir": str(work / "out"),
            "optimizer": "adamw_torch",
            "lr_scheduler": "constant",
            "save_strategy": "no",
            "dataset_prepared_path": str(work / "prepared"),
            "dataset_num_proc": 1,
            "bf16": False,
            "fp16": False,
            **extra,
        }
    )


def _parsed(raw):
    prepare_plugins(raw)
    cfg = validate_config(raw)
    normalize_config(cfg)
    return cfg


def test_config_parsing_picks_the_plugin_and_checks_its_keys(work):
    from axolotl.integrations.base import PluginManager

    cfg = _parsed(_raw(work, nitrobrew_kd_chunk_v=16, nitrobrew_kd_backend="torch"))
    assert cfg.nitrobrew_kd_chunk_v == 16 and cfg.nitrobrew_kd_backend == "torch" and cfg.kd_alpha == 1.0
    manager = PluginManager.get_instance()
    assert manager.get_trainer_cls(cfg) is nbax.NitrobrewKDTrainer  # listed first: its trainer wins
    collator, _ = manager.get_collator_cls_and_kwargs(cfg)
    assert collator is DataCollatorForKD  # Axolotl's own
    assert manager.get_training_args(cfg)["nitrobrew_kd_chunk_v"] == 16
    for bad, match in (
        ({"nitrobrew_kd_backend": "gpu"}, "nitrobrew_kd_backend must be one of"),
        ({"nitrobrew_kd_divergence": "kl"}, "nitrobrew_kd_divergence must be one of"),
        ({"nitrobrew_kd_chunk_v": 0}, "nitrobrew_kd_chunk_v must be a positive int"),
    ):
        with pytest.raises(ValueError, match=match):
            _parsed(_raw(work, **bad))


def _collated(work, n=4):
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast.from_pretrained(work / "model")
    rows = datasets.load_dataset("parquet", data_dir=str(work / "pq" / "data"), split="train")
    rows = [rows[i] for i in range(n)]
    for r in rows:  # the export's first-token labels: nothing predicts them
        assert r["labels"][0] == -100
    return DataCollatorForKD(tokenizer=tok, return_tensors="pt", padding="longest")(rows)


def _model(work):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(work / "model", dtype=torch.float32)


def _axolotl_loss(model, batch, kd_alpha, kd_ce_alpha, temperature, normalize_topk):
    """Axolotl's AxolotlKDTrainer.compute_loss, step for step, with its own loss function."""
    fn = LigerFusedLinearKLTopKLogprobLoss(
        kd_ce_alpha,
        kd_alpha,
        temperature,
        0.0,
        compute_ce_loss=bool(kd_ce_alpha),
        normalize_topk=normalize_topk,
        compiled=False,  # the same function uncompiled (no C++ toolchain needed on CPU)
    )
    n = (batch["labels"] != -100).sum().item()
    out = model(
        input_ids=batch["input_ids"],
        attention_mask=batch["attention_mask"],
        output_hidden_states=True,
        return_dict=True,
        logits_to_keep=1,
    )
    h = out.hidden_states[-1].to(model.lm_head.weight.dtype)
    loss = fn(
        model.lm_head.weight,
        h,
        batch["target_token_ids"],
        batch["target_logprobs"],
        batch["target_mask"],
        true_labels=batch["labels"],
    )
    return loss / n


@pytest.mark.parametrize(
    "kd_alpha,kd_ce_alpha,temperature,normalize_topk",
    [(1.0, 0.0, 1.0, False), (1.0, 0.1, 2.0, False), (0.5, 0.5, 1.0, True)],
)
def test_loss_equals_axolotls_on_its_collated_batch(work, kd_alpha, kd_ce_alpha, temperature, normalize_topk):
    batch = _collated(work)
    assert batch["target_token_ids"].shape[:2] == batch["input_ids"].shape
    model = _model(work)
    ref = _axolotl_loss(model, batch, kd_alpha, kd_ce_alpha, temperature, normalize_topk)
    ref.backward()
    ref_grads = [p.grad.clone() for p in model.parameters()]

    def ours(kd_weight):
        model.zero_grad()
        h = model(
            input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], output_hidden_states=True
        ).hidden_states[-1]
        loss = (
            nbax.kd_loss_sum(
                h,
                model.lm_head.weight,
                batch["labels"],
                batch["target_token_ids"],
                batch["target_logprobs"],
                batch["target_mask"],
                kd_alpha=kd_weight,
                kd_ce_alpha=kd_ce_alpha,
                temperature=temperature,
                normalize_topk=normalize_topk,
            )
            / (batch["labels"] != -100).sum()
        )
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters()]

    value, grads = ours(kd_alpha)
    torch.testing.assert_close(value, ref.detach().float(), rtol=1e-5, atol=1e-6)
    if temperature != 1.0:
        # Axolotl's backward leaves out the T^2 its loss value carries: its gradient is that of
        # kd_alpha * KD + kd_ce_alpha * CE. nitrobrew's is the gradient of the value it returns.
        _, grads = ours(kd_alpha / temperature**2)
    for a, b in zip(grads, ref_grads):  # fp32 rounding of the tensor's largest terms (as test_trl.py's)
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6 * max(1.0, b.abs().max().item()))


def test_two_training_steps_through_axolotl(work):
    """Axolotl's own pipeline on CPU: datasets loaded from the export, the trainer built by its
    builder (the plugin's), two optimizer steps; then the trainer's loss against Axolotl's."""
    from axolotl.cli.config import plugin_set_cfg
    from axolotl.common.datasets import load_datasets
    from axolotl.train import train

    cfg = _parsed(_raw(work))
    plugin_set_cfg(cfg)
    meta = load_datasets(cfg=cfg)
    model, _, trainer = train(cfg=cfg, dataset_meta=meta)
    assert isinstance(trainer, nbax.NitrobrewKDTrainer)
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert trainer.state.global_step == 2 and losses and all(torch.isfinite(torch.tensor(losses)))
    batch = _collated(work)
    model = trainer.model.float()
    ours = trainer.compute_loss(model, dict(batch))
    ref = _axolotl_loss(model, batch, 1.0, 0.1, 1.0, False)
    torch.testing.assert_close(ours, ref.float(), rtol=1e-5, atol=1e-6)


def test_a_configured_teacher_gives_the_hidden_state_loss(work):
    """nitrobrew_kd_teacher: the KD term from the teacher's hidden states (nitrobrew.hf.distill_loss)."""
    from axolotl.cli.config import plugin_set_cfg
    from axolotl.common.datasets import load_datasets
    from axolotl.train import train

    from nitrobrew.hf import distill_loss

    cfg = _parsed(_raw(work, nitrobrew_kd_teacher=str(work / "model"), max_steps=1, output_dir=str(work / "out2")))
    plugin_set_cfg(cfg)
    _, _, trainer = train(cfg=cfg, dataset_meta=load_datasets(cfg=cfg))
    assert trainer.nitrobrew_teacher is not None and trainer.state.global_step == 1
    batch = _collated(work)
    model = trainer.model.float()
    ours = trainer.compute_loss(model, dict(batch))
    want = distill_loss(
        model,
        trainer.nitrobrew_teacher,
        batch["input_ids"],
        batch["attention_mask"],
        batch["labels"],
        temperature=1.0,
        scale_t2=True,
        kd_weight=1.0,
        ce_weight=0.1,
        num_items_in_batch=(batch["labels"] != -100).sum().item(),
    ).loss
    torch.testing.assert_close(ours, want)
