"""nitrobrew.hf helpers and distill_loss on tiny random transformers models (no downloads).

Every value is checked against the models' own ``model(...).logits`` (materialized) in float64.
"""

import math

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("transformers")

from nitrobrew.hf import (  # noqa: E402
    IGNORE_INDEX,
    check_head,
    count_targets,
    distill_loss,
    final_hidden_states,
    lm_head,
    shift_labels,
)
from tiny_models import causal_lm, scale_logits  # noqa: E402

V = 97


def llama(hidden=32, vocab=V, tie=False, seed=0):
    return causal_lm("Llama", vocab=vocab, hidden=hidden, seed=seed, positions=64, tie=tie)


def qwen2(hidden=48, vocab=V, seed=1):
    return causal_lm("Qwen2", vocab=vocab, hidden=hidden, seed=seed, positions=64, tie=True)


def batch(seed=0, B=3, N=11):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (B, N), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 7:] = 0  # right padding
    mask[2, :3] = 0  # left padding
    labels = ids.clone()
    labels[mask == 0] = IGNORE_INDEX
    labels[0, 4] = IGNORE_INDEX  # an ignored target inside a sequence
    return ids, mask, labels


def reference(
    student, teacher, ids, mask, labels, divergence, T=1.0, kd_weight=1.0, ce_weight=0.0, beta=0.5, vocab=None
):
    """float64, from materialized model(...).logits, with the shift written out explicitly."""
    ls = student(input_ids=ids, attention_mask=mask).logits.double()
    with torch.no_grad():
        lt = teacher(input_ids=ids, attention_mask=mask).logits.double()
    if vocab is not None:
        ls, lt = ls[..., :vocab], lt[..., :vocab]
    rows_s, rows_t, targets = [], [], []
    for b in range(ids.shape[0]):
        for i in range(ids.shape[1] - 1):
            if mask[b, i] and mask[b, i + 1] and labels[b, i + 1] != IGNORE_INDEX:
                rows_s.append(ls[b, i])
                rows_t.append(lt[b, i])
                targets.append(labels[b, i + 1])
    s, t, y = torch.stack(rows_s), torch.stack(rows_t), torch.stack(targets)
    lq, lp = (s / T).log_softmax(-1), (t / T).log_softmax(-1)
    if divergence == "forward_kl":
        kd = (lp.exp() * (lp - lq)).sum(-1)
    elif divergence == "reverse_kl":
        kd = (lq.exp() * (lq - lp)).sum(-1)
    else:
        m = torch.logaddexp(lp + math.log(beta), lq + math.log(1 - beta))
        kd = beta * (lp.exp() * (lp - m)).sum(-1) + (1 - beta) * (lq.exp() * (lq - m)).sum(-1)
    ce = F.cross_entropy(s, y, reduction="none")
    return (kd_weight * kd + ce_weight * ce).sum(), len(targets)


def check_against_reference(student, teacher, inputs, divergence, temperature, ce_weight):
    """distill_loss on ``inputs`` (ids, mask, labels) against the float64 reference: the loss and the student's
    gradients. Returns distill_loss's output and the reference's count of targets."""
    out = distill_loss(student, teacher, *inputs, divergence=divergence, temperature=temperature, ce_weight=ce_weight)
    out.loss.backward()
    grads = [p.grad.clone() for p in student.parameters()]
    student.zero_grad()
    ref_sum, n = reference(student, teacher, *inputs, divergence, T=temperature, ce_weight=ce_weight)
    (ref_sum / n).backward()
    torch.testing.assert_close(out.loss.double(), ref_sum.detach() / n, rtol=1e-5, atol=1e-6)
    for g, p in zip(grads, student.parameters()):
        torch.testing.assert_close(g, p.grad.float(), rtol=1e-4, atol=1e-6)
    return out, n


@pytest.mark.parametrize("make", [llama, lambda: llama(tie=True), qwen2], ids=["llama", "llama-tied", "qwen2"])
def test_hidden_states_and_head_reproduce_logits(make):
    model = make().eval()
    ids, mask, _ = batch()
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask).logits
        for through_forward in (False, True):
            h = final_hidden_states(model, ids, mask, through_forward=through_forward)
            head = lm_head(model)
            assert head.bias is None and head.scale == 1.0
            assert head.weight is model.get_output_embeddings().weight
            torch.testing.assert_close(h @ head.weight.T, logits, rtol=1e-5, atol=1e-5)
    assert check_head(model, ids, mask) < 1e-4


def test_tied_head_is_the_embedding():
    model = qwen2()
    assert lm_head(model).weight is model.get_input_embeddings().weight


def test_logit_scale_is_folded_in():
    special = dict(bos_token_id=0, eos_token_id=1, pad_token_id=2)
    model = causal_lm("Granite", vocab=V, hidden=32, layers=1, head_scale=1.0, logits_scaling=4.0, **special).eval()
    ids, mask, _ = batch()
    assert lm_head(model).scale == 0.25
    check_head(model, ids, mask)
    with torch.no_grad():
        h = final_hidden_states(model, ids, mask)
        torch.testing.assert_close(
            0.25 * (h @ lm_head(model).weight.T), model(input_ids=ids, attention_mask=mask).logits
        )


def gemma2(hidden=32, vocab=V, seed=5, cap=3.0):
    caps = dict(final_logit_softcapping=cap, attn_logit_softcapping=50.0, attn_implementation="eager")
    return causal_lm("Gemma2", vocab=vocab, hidden=hidden, heads=2, kv_heads=1, seed=seed, head_dim=16, **caps)


def test_final_logit_softcapping_is_applied():
    """Gemma-2-style models cap their logits (c tanh(z / c)): the head carries the cap, check_head accepts the
    model, and distill_loss equals the float64 loss from model(...).logits with the cap on both sides."""
    student, teacher = gemma2(seed=6, cap=3.0), gemma2(seed=7, cap=2.0).eval()
    ids, mask, labels = batch(seed=8)
    assert lm_head(student).softcap == 3.0
    check_head(student.eval(), ids, mask)
    student.train()
    check_against_reference(student, teacher, (ids, mask, labels), "jsd", temperature=2.0, ce_weight=0.3)
    uncapped = llama()
    assert lm_head(uncapped).softcap is None


def test_check_head_detects_unknown_logit_transform():
    model = scale_logits(llama().eval(), 2)
    ids, mask, _ = batch()
    with pytest.raises(ValueError, match="differ from model"):
        check_head(model, ids, mask)


def test_shift_labels():
    labels = torch.tensor([[5, 6, 7, 8, 9], [5, 6, 7, -100, -100]])
    mask = torch.tensor([[0, 1, 1, 1, 1], [1, 1, 1, 0, 0]])
    labels[0, 0] = IGNORE_INDEX
    got = shift_labels(labels, mask)
    # row 0: position 0 is left padding (ignored although its next token is real)
    assert got.tolist() == [[-100, 7, 8, 9, -100], [6, 7, -100, -100, -100]]
    assert shift_labels(labels).tolist() == [[6, 7, 8, 9, -100], [6, 7, -100, -100, -100]]
    assert int(count_targets(labels, mask)) == 5


def test_ce_matches_transformers_own_shifted_loss():
    """The alignment, against the model's own labels= loss (right padding, where HF's is right)."""
    model = llama()
    ids, mask, labels = batch()
    ids, mask, labels = ids[:2], mask[:2], labels[:2]
    ours = distill_loss(model, None, ids, mask, labels, kd_weight=0.0, ce_weight=1.0)
    theirs = model(input_ids=ids, attention_mask=mask, labels=labels).loss
    torch.testing.assert_close(ours.loss, theirs, rtol=1e-5, atol=1e-6)
    assert int(ours.n_tokens) == int((labels[:, 1:] != IGNORE_INDEX).sum())


@pytest.mark.parametrize("divergence", ["forward_kl", "reverse_kl", "jsd"])
@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_distill_loss_values_and_gradients(divergence, temperature):
    student, teacher = llama(seed=3), qwen2(seed=4).eval()
    out, n = check_against_reference(
        student, teacher, batch(seed=5), divergence, temperature=temperature, ce_weight=0.3
    )
    assert int(out.n_tokens) == n
    assert all(p.grad is None for p in teacher.parameters())


def test_each_term_and_normalizer():
    student, teacher = llama(seed=6), llama(hidden=48, seed=7).eval()
    ids, mask, labels = batch(seed=8)
    kd = distill_loss(student, teacher, ids, mask, labels, num_items_in_batch=40)
    ce = distill_loss(student, teacher, ids, mask, labels, kd_weight=0.0, ce_weight=1.0, num_items_in_batch=40)
    both = distill_loss(student, teacher, ids, mask, labels, kd_weight=0.7, ce_weight=0.2, num_items_in_batch=40)
    torch.testing.assert_close(both.loss, 0.7 * kd.loss + 0.2 * ce.loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(both.kd, kd.kd)  # the parts are the unweighted terms
    torch.testing.assert_close(both.ce, ce.ce)
    assert float(ce.kd) == 0.0  # CE only: the teacher is not run, no divergence reported
    ref_kd, n = reference(student, teacher, ids, mask, labels, "forward_kl")
    torch.testing.assert_close(kd.loss.double(), ref_kd.detach() / 40, rtol=1e-5, atol=1e-6)


def test_padded_teacher_vocab():
    student, teacher = llama(seed=9), llama(hidden=48, vocab=V + 7, seed=10).eval()
    ids, mask, labels = batch(seed=11)
    with pytest.raises(ValueError, match="vocab_size"):
        distill_loss(student, teacher, ids, mask, labels)
    out = distill_loss(student, teacher, ids, mask, labels, vocab_size=V)
    ref, n = reference(student, teacher, ids, mask, labels, "forward_kl", vocab=V)
    torch.testing.assert_close(out.loss.double(), ref.detach() / n, rtol=1e-5, atol=1e-6)


def test_no_counted_token_gives_zero_and_zero_grads():
    student, teacher = llama(seed=12), llama(hidden=48, seed=13).eval()
    ids, mask, labels = batch(seed=14)
    out = distill_loss(student, teacher, ids, mask, torch.full_like(labels, IGNORE_INDEX), ce_weight=1.0)
    out.loss.backward()
    assert float(out.loss) == 0.0 and int(out.n_tokens) == 0
    assert all(p.grad is None or (p.grad == 0).all() for p in student.parameters())


def test_bf16_autocast_and_bf16_teacher():
    student, teacher = llama(seed=15), llama(hidden=48, seed=16).eval()
    ids, mask, labels = batch(seed=17)
    ref = distill_loss(student, teacher, ids, mask, labels).loss
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = distill_loss(student, teacher.to(torch.bfloat16), ids, mask, labels).loss
    out.backward()
    assert out.dtype == torch.float32
    assert abs(float(out) - float(ref)) < 0.05 * float(ref)
    assert all(torch.isfinite(p.grad).all() for p in student.parameters())


def test_errors():
    student, teacher = llama(), llama(hidden=48).eval()
    ids, mask, labels = batch()
    with pytest.raises(ValueError, match="divergence must be one of"):
        distill_loss(student, teacher, ids, divergence="kl")
    with pytest.raises(ValueError, match="needs a teacher"):
        distill_loss(student, None, ids)
    with pytest.raises(ValueError, match="needs topk_ids"):
        distill_loss(student, None, ids, divergence="topk")


def test_peft_wrapped_student():
    peft = pytest.importorskip("peft")
    student, teacher = llama(seed=18), llama(hidden=48, seed=19).eval()
    ids, mask, labels = batch(seed=20)
    wrapped = peft.get_peft_model(
        student, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], modules_to_save=["lm_head"])
    )
    with torch.no_grad():  # make the adapters non-trivial
        for name, p in wrapped.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    check_head(wrapped, ids, mask)
    head = lm_head(wrapped)
    assert head.weight.requires_grad  # the trainable modules_to_save copy, not the frozen original
    out = distill_loss(wrapped, teacher, ids, mask, labels)
    out.loss.backward()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for n, p in wrapped.named_parameters() if "lora_" in n)
    lora_head = peft.get_peft_model(llama(seed=21), peft.LoraConfig(r=4, target_modules=["lm_head"]))
    with pytest.raises(TypeError, match="not a plain nn.Linear"):
        lm_head(lora_head)


def test_plain_pytorch_example_runs():
    import importlib.util
    import os

    path = os.path.join(os.path.dirname(__file__), "..", "examples", "plain_pytorch.py")
    spec = importlib.util.spec_from_file_location("plain_pytorch", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    kd = example.main(["--steps", "2", "--accum", "2", "--batch-size", "2", "--seq-len", "12"])
    assert math.isfinite(kd) and kd > 0
