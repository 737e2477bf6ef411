"""nitrobrew's loss inside TRL's own trainers, against TRL's loss (run with TRL installed: `make test-trl`).

Tiny Qwen2 models and a word-level tokenizer are built here (no downloads)."""

import os
import warnings

import pytest
import torch

pytest.importorskip("trl")
transformers = pytest.importorskip("transformers")
datasets = pytest.importorskip("datasets")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM  # noqa: E402
from trl import DistillationConfig, DistillationTrainer  # noqa: E402

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from trl.experimental.gkd import GKDConfig, GKDTrainer  # noqa: E402

from nitrobrew.core.memory import TensorMemoryTracker  # noqa: E402
from nitrobrew.integrations import trl as nbtrl  # noqa: E402

WORDS = ["<pad>", "<eos>", "<unk>", "user", "assistant", ":", "\n"] + [f"w{i}" for i in range(40)]


def _assert_grads_close(a, b):
    """Gradients equal to fp32 rounding: an entry far below its tensor's largest one comes out of fp32 sums of
    terms of that size, so its rounding is of that size (the tied head's 5e-3 beside 22), and how large
    depends on the CPU's BLAS kernels."""
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6 * max(1.0, b.abs().max().item()))


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return _tokenizer(tmp_path_factory.mktemp("tok"))


def _tokenizer(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>", eos_token="<eos>")
    fast.chat_template = (
        "{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} <eos> {% endfor %}"
        "{% if add_generation_prompt %}assistant : {% endif %}"
    )
    fast.padding_side = "left"
    fast.save_pretrained(tmp_path / "tok")
    return PreTrainedTokenizerFast.from_pretrained(tmp_path / "tok")


def _model(vocab=64, hidden=16, layers=1, seed=0):
    torch.manual_seed(seed)
    cfg = Qwen2Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=128,
        tie_word_embeddings=False,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=1,
    )
    m = Qwen2ForCausalLM(cfg).float()
    with torch.no_grad():  # logits of a realistic spread, not ~0
        m.lm_head.weight.mul_(40.0)
    m.generation_config.pad_token_id, m.generation_config.eos_token_id = 0, 1
    return m


def _chat_rows(n=8, seed=0):
    g = torch.Generator().manual_seed(seed)

    def words(k):
        return " ".join(f"w{int(i)}" for i in torch.randint(0, 40, (k,), generator=g))

    return [
        {
            "messages": [
                {"role": "user", "content": words(int(torch.randint(2, 6, (1,), generator=g)))},
                {"role": "assistant", "content": words(int(torch.randint(2, 7, (1,), generator=g)))},
            ]
        }
        for _ in range(n)
    ]


# ------------------------------------------------------------------ TRL's own generalized_jsd_loss


def _trl_inputs():
    """TRL's test inputs for generalized_jsd_loss: randn (2, 3, 5) logits, seed 42."""
    torch.manual_seed(42)
    s, t = torch.randn(2, 3, 5), torch.randn(2, 3, 5)
    return s, t, torch.tensor([[-100, 1, 2], [3, 4, -100]])


@pytest.mark.parametrize("beta,value", [(0.0, 1.044224), (0.5, 0.217018), (1.0, 1.079232)])
def test_generalized_jsd_loss_equals_trls(beta, value):
    s, t, labels = _trl_inputs()
    ref = GKDTrainer.generalized_jsd_loss(s, t, labels=labels, beta=beta)
    assert abs(ref.item() - value) < 1e-6  # the inputs are TRL's
    ss, s2 = s.clone().requires_grad_(), s.clone().requires_grad_()
    ours = nbtrl.generalized_jsd_loss(ss, t, labels=labels, beta=beta)
    torch.testing.assert_close(ours, ref, rtol=1e-6, atol=1e-7)
    ours.backward()
    GKDTrainer.generalized_jsd_loss(s2, t, labels=labels, beta=beta).backward()
    torch.testing.assert_close(ss.grad, s2.grad, rtol=1e-5, atol=1e-7)
    for kw in ({"num_items_in_batch": 7}, {"reduction": "sum"}, {"temperature": 2.0}, {"reduction": "mean"}):
        torch.testing.assert_close(
            nbtrl.generalized_jsd_loss(s, t, labels=labels, beta=beta, **kw),
            GKDTrainer.generalized_jsd_loss(s, t, labels=labels, beta=beta, **kw),
            rtol=1e-6,
            atol=1e-7,
        )


def test_loss_options_are_checked():
    with pytest.raises(ValueError, match="divergence must be None"):
        nbtrl.NitrobrewLoss(divergence="kl")
    with pytest.raises(ValueError, match="ce_weight must be a finite number"):
        nbtrl.NitrobrewLoss(ce_weight=-1)
    with pytest.raises(ValueError, match="temperature must be None or a finite number > 0"):
        nbtrl.NitrobrewLoss(temperature=0)
    with pytest.raises(TypeError, match="nitrobrew must be a NitrobrewLoss"):
        nbtrl._loss_args(3)
    assert nbtrl.NitrobrewLoss().resolve(0.0) == ("forward_kl", 0.0)
    assert nbtrl.NitrobrewLoss().resolve(1.0) == ("reverse_kl", 1.0)
    assert nbtrl.NitrobrewLoss().resolve(0.3) == ("jsd", 0.3)


# -------------------------------------------------------------------------------------- GKD


def _gkd(tmp_path, cls, tok, beta=0.5, lmbda=0.0, vocab=64, **kw):
    args = GKDConfig(
        output_dir=str(tmp_path / cls.__name__),
        per_device_train_batch_size=4,
        max_steps=2,
        learning_rate=1e-3,
        lmbda=lmbda,
        beta=beta,
        max_new_tokens=4,
        max_length=64,
        report_to=[],
        save_strategy="no",
        logging_steps=1,
        use_cpu=True,
        seed=0,
        bf16=False,
    )
    return cls(
        model=_model(vocab, seed=0),
        teacher_model=_model(vocab, seed=1),
        args=args,
        processing_class=tok,
        train_dataset=datasets.Dataset.from_list(_chat_rows()),
        **kw,
    )


def test_gkd_loss_equals_trls(tmp_path, tok):
    ref = _gkd(tmp_path, GKDTrainer, tok)
    ours = _gkd(tmp_path, nbtrl.NitrobrewGKDTrainer, tok)
    batch = ref.data_collator(_chat_rows(4, seed=3))
    assert (batch["labels"] != -100).sum() < batch["attention_mask"].sum()  # the prompts do not count
    for beta, n in ((0.0, None), (0.5, None), (1.0, None), (0.5, torch.tensor(11)), (0.0, torch.tensor(7))):
        ref.beta = ours.beta = beta
        losses, grads = [], []
        for tr in (ref, ours):
            tr.model.zero_grad()
            loss = tr.compute_loss(tr.model, dict(batch), num_items_in_batch=n)
            loss.backward()
            losses.append(loss.detach())
            grads.append([p.grad.clone() for p in tr.model.parameters()])
        torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=1e-6)
        for a, b in zip(grads[1], grads[0]):
            _assert_grads_close(a, b)


def test_gkd_two_steps_on_and_off_policy(tmp_path, tok):
    params = []
    for cls in (GKDTrainer, nbtrl.NitrobrewGKDTrainer):  # off-policy: the same batches, the same steps
        tr = _gkd(tmp_path, cls, tok, beta=0.5, lmbda=0.0)
        tr.train()
        params.append(torch.cat([p.detach().reshape(-1) for p in tr.model.parameters()]))
        assert tr.state.global_step == 2
    torch.testing.assert_close(params[1], params[0], rtol=1e-4, atol=1e-5)
    tr = _gkd(tmp_path, nbtrl.NitrobrewGKDTrainer, tok, lmbda=1.0, nitrobrew={"ce_weight": 0.1})  # on-policy
    tr.train()
    losses = [h["loss"] for h in tr.state.log_history if "loss" in h]
    assert tr.state.global_step == 2 and len(losses) == 2 and all(torch.isfinite(torch.tensor(losses)))


def test_gkd_other_divergences_and_ce(tmp_path, tok):
    from nitrobrew.hf import distill_loss

    for opts in (
        {"divergence": "tvd"},
        {"divergence": "skew_kl", "alpha": 0.2},
        {"ce_weight": 0.5, "temperature": 2.0},
    ):
        tr = _gkd(tmp_path, nbtrl.NitrobrewGKDTrainer, tok, nitrobrew=opts)
        batch = tr.data_collator(_chat_rows(4, seed=5))
        loss = tr.compute_loss(tr.model, dict(batch))
        targets = torch.full_like(batch["labels"], -100)
        targets[:, :-1] = batch["labels"][:, 1:]
        want = distill_loss(
            tr.model,
            tr.teacher_model,
            batch["input_ids"],
            batch["attention_mask"],
            targets=targets,
            divergence=opts.get("divergence", "jsd"),
            alpha=opts.get("alpha", 0.1),
            temperature=opts.get("temperature", 1.0),
            ce_weight=opts.get("ce_weight", 0.0),
        ).loss
        torch.testing.assert_close(loss, want)


# ----------------------------------------------------------------------------- Distillation


def _distill(tmp_path, cls, tok, beta=1.0, vocab=64, **kw):
    args = DistillationConfig(
        output_dir=str(tmp_path / cls.__name__),
        per_device_train_batch_size=4,
        max_steps=2,
        learning_rate=1e-3,
        beta=beta,
        max_completion_length=4,
        use_vllm=False,
        report_to=[],
        save_strategy="no",
        logging_steps=1,
        use_cpu=True,
        seed=0,
        bf16=False,
    )
    rows = [{"prompt": r["messages"][:1]} for r in _chat_rows()]
    return cls(
        model=_model(vocab, seed=0),
        teacher_model=_model(vocab, seed=1),
        args=args,
        processing_class=tok,
        train_dataset=datasets.Dataset.from_list(rows),
        **kw,
    )


def _completion_batch(B=3, P=4, C=5, vocab=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    prompt_mask = torch.ones(B, P, dtype=torch.long)
    prompt_mask[0, :2] = 0  # left padding
    completion_mask = torch.ones(B, C, dtype=torch.long)
    completion_mask[1, 3:] = 0  # stopped early
    return {
        "prompt_ids": torch.randint(2, vocab, (B, P), generator=g),
        "prompt_mask": prompt_mask,
        "completion_ids": torch.randint(2, vocab, (B, C), generator=g),
        "completion_mask": completion_mask,
    }


def test_distillation_loss_equals_trls(tmp_path, tok):
    ref = _distill(tmp_path, DistillationTrainer, tok)
    ours = _distill(tmp_path, nbtrl.NitrobrewDistillationTrainer, tok)
    batch = _completion_batch()
    for beta, n in ((0.0, None), (0.5, None), (1.0, None), (1.0, torch.tensor(9.0)), (0.5, torch.tensor(9.0))):
        ref.beta = ours.beta = beta
        outs, grads = [], []
        for tr in (ref, ours):
            tr.model.zero_grad()
            loss, entropy, n_valid = tr._compute_loss(tr.model, batch, n)
            loss.backward()
            outs.append((loss.detach(), entropy, n_valid))
            grads.append([p.grad.clone() for p in tr.model.parameters() if p.grad is not None])
        for a, b in zip(outs[1], outs[0]):
            torch.testing.assert_close(a.float(), b.float(), rtol=1e-5, atol=1e-5)
        assert len(grads[0]) == len(grads[1])
        for a, b in zip(grads[1], grads[0]):
            _assert_grads_close(a, b)


def test_distillation_two_steps(tmp_path, tok):
    for cls in (DistillationTrainer, nbtrl.NitrobrewDistillationTrainer):
        tr = _distill(tmp_path, cls, tok)
        tr.train()
        losses = [h["loss"] for h in tr.state.log_history if "loss" in h]
        assert tr.state.global_step == 2 and len(losses) == 2 and all(torch.isfinite(torch.tensor(losses)))


# --------------------------------------------------------------------------------- memory


def _growth(tr, batch) -> int:
    """Peak bytes of tensors created by one loss + backward (the models' parameters excluded)."""

    def step():
        loss = tr.compute_loss(tr.model, dict(batch))
        loss.backward()

    tr.model.zero_grad()
    with TensorMemoryTracker() as tracker:
        step()
    return tracker.peak


def test_memory_growth_is_lower_at_a_large_vocabulary(tmp_path, tok):
    V = 32768
    ref = _gkd(tmp_path, GKDTrainer, tok, vocab=V)
    ours = _gkd(tmp_path, nbtrl.NitrobrewGKDTrainer, tok, vocab=V, nitrobrew={"chunk_V": 4096})
    batch = ref.data_collator(_chat_rows(4, seed=7))
    trl_bytes, nb_bytes = _growth(ref, batch), _growth(ours, batch)
    rows = batch["input_ids"].numel()
    assert trl_bytes > 4 * rows * V * 4  # TRL forms several [rows, V] fp32 tensors
    assert nb_bytes * 3 < trl_bytes, (nb_bytes, trl_bytes)


def test_distillation_memory_growth_is_lower_at_a_large_vocabulary(tmp_path, tok):
    # TRL's DistillationTrainer already projects the heads tile by tile ([rows, 32768] fp32 slabs of each model):
    # nitrobrew's step must still create less (cache-sized vocabulary chunks, the entropy in 16 MiB slabs)
    V = 65536
    ref = _distill(tmp_path, DistillationTrainer, tok, beta=0.5, vocab=V)
    ours = _distill(tmp_path, nbtrl.NitrobrewDistillationTrainer, tok, beta=0.5, vocab=V)
    batch = _completion_batch(B=4, P=8, C=64, vocab=V, seed=2)
    trl_bytes, nb_bytes = _growth(ref, batch), _growth(ours, batch)
    rows = batch["completion_mask"].sum().item()
    assert trl_bytes > 2 * rows * 32768 * 4  # TRL's two fp32 tiles
    assert nb_bytes * 2 < trl_bytes, (nb_bytes, trl_bytes)


def test_distillation_loss_equals_trls_function_with_bias_scale_softcap():
    # the function behind NitrobrewDistillationTrainer against TRL's own, on heads that Qwen2 does not exercise:
    # biases, a logit scale, a final softcap, a temperature, and teacher / student of different widths
    from trl.trainer.distillation_trainer import _chunked_divergence_loss

    from nitrobrew.hf.model import LMHead

    g = torch.Generator().manual_seed(4)
    B, C, Ds, Dt, V = 2, 5, 8, 12, 97
    hs = torch.randn(B, C, Ds, generator=g, dtype=torch.float64).float().requires_grad_()
    ht = torch.randn(B, C, Dt, generator=g)
    ws = (3 * torch.randn(V, Ds, generator=g)).requires_grad_()
    bs = torch.randn(V, generator=g).requires_grad_()
    wt, bt = 3 * torch.randn(V, Dt, generator=g), torch.randn(V, generator=g)
    mask = torch.ones(B, C, dtype=torch.long)
    mask[1, 3:] = 0
    labels = torch.randint(0, V, (B, C), generator=g)
    for beta, n in ((0.0, None), (0.5, torch.tensor(11.0)), (1.0, None)):
        outs, grads = [], []
        for ours in (False, True):
            for t in (hs, ws, bs):
                t.grad = None
            if ours:
                out = nbtrl.distillation_loss(
                    hs,
                    ht,
                    LMHead(ws, bs, 0.5, 20.0),
                    LMHead(wt, bt, 1.5, 30.0),
                    mask,
                    labels=labels,
                    beta=beta,
                    temperature=2.0,
                    num_items_in_batch=n,
                )
            else:
                out = _chunked_divergence_loss(
                    hs,
                    ht,
                    ws,
                    wt,
                    mask,
                    beta=beta,
                    num_items_in_batch=n,
                    student_lm_head_bias=bs,
                    teacher_lm_head_bias=bt,
                    student_logit_scale=0.5,
                    teacher_logit_scale=1.5,
                    student_final_logit_softcapping=20.0,
                    teacher_final_logit_softcapping=30.0,
                    temperature=2.0,
                )
            out[0].backward()
            outs.append([o.detach().float() for o in out])
            grads.append([t.grad.clone() for t in (hs, ws, bs)])
        for a, b in zip(outs[1], outs[0]):  # loss, entropy sum, counted positions
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        for a, b in zip(grads[1], grads[0]):
            _assert_grads_close(a, b)


def test_peft_lora_inside_both_trainers(tmp_path, tok):
    # TRL wraps the student in a LoRA PeftModel (peft_config): nitrobrew's loss reads the heads through it and
    # trains the adapters as TRL's loss does (same values and adapter gradients, then two steps)
    peft = pytest.importorskip("peft")

    def lora():
        return peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")

    cases = (
        (_gkd, GKDTrainer, nbtrl.NitrobrewGKDTrainer, lambda tr: tr.data_collator(_chat_rows(4, seed=9))),
        (_distill, DistillationTrainer, nbtrl.NitrobrewDistillationTrainer, lambda tr: _completion_batch(seed=9)),
    )
    for make, ref_cls, our_cls, batch_of in cases:
        ref, ours = make(tmp_path, ref_cls, tok, peft_config=lora()), make(tmp_path, our_cls, tok, peft_config=lora())
        assert isinstance(ours.model, peft.PeftModel)
        batch = batch_of(ref)
        losses, grads = [], []
        for tr in (ref, ours):
            tr.model.zero_grad()
            loss = tr.compute_loss(tr.model, dict(batch))
            loss.backward()
            losses.append(loss.detach())
            grads.append({n: p.grad.clone() for n, p in tr.model.named_parameters() if p.requires_grad})
        torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=1e-6)
        assert grads[0].keys() == grads[1].keys() and all("lora_" in n for n in grads[1])
        for name in grads[0]:
            _assert_grads_close(grads[1][name], grads[0][name])
        ours.train()
        assert ours.state.global_step == 2
