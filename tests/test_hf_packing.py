"""Packed (padding-free) batches: packed == unpacked, through distill_loss and the trainer."""

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")
from transformers import DataCollatorWithFlattening  # noqa: E402

from nitrobrew.hf import IGNORE_INDEX, distill_loss  # noqa: E402
from nitrobrew.hf.packing import block_causal_mask, document_ids, document_targets, model_inputs  # noqa: E402
from test_hf_trainer import V, assert_grads_close, collate, sequences, sgd_step_gradient  # noqa: E402
from tiny_models import causal_lm  # noqa: E402

LENGTHS = (7, 5, 4)
SAME = dict(rtol=1e-5, atol=1e-6)  # packed and padded: the same rows, computed in other layouts


def model(hidden, impl, seed):
    shape = dict(heads=2, kv_heads=1, positions=32, tie=hidden == 24, attn_implementation=impl)
    return causal_lm("Llama", vocab=V, hidden=hidden, **shape, seed=seed)


def docs(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, V, (n,), generator=g) for n in LENGTHS]


def packed_and_padded(seed=0):
    d = docs(seed)
    packed = torch.cat(d)[None]
    position_ids = torch.cat([torch.arange(len(x)) for x in d])[None]
    padded = torch.zeros(len(d), max(LENGTHS), dtype=torch.long)
    mask = torch.zeros_like(padded)
    for b, x in enumerate(d):
        padded[b, : len(x)], mask[b, : len(x)] = x, 1
    return packed, position_ids, padded, mask


def test_document_ids_and_targets():
    pos = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2]])
    assert document_ids(pos).tolist() == [[1, 1, 1, 2, 2, 3, 3, 3]]
    target = torch.arange(10, 18)[None]
    assert document_targets(target, pos).tolist() == [[10, 11, -100, 13, -100, 15, 16, 17]]
    m = block_causal_mask(pos, None, torch.float32)[0, 0] == 0
    assert m[4].tolist() == [False, False, False, True, True, False, False, False]


def grads(m):
    return {n: p.grad.clone() for n, p in m.named_parameters()}


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
@pytest.mark.parametrize("divergence", ["forward_kl", "jsd"])
def test_packed_equals_unpacked(impl, divergence):
    packed, pos, padded, mask = packed_and_padded()
    teacher = model(24, impl, seed=1).eval()
    results = []
    for ids, kw in ((packed, dict(position_ids=pos)), (padded, dict(attention_mask=mask))):
        s = model(16, impl, seed=0)
        out = distill_loss(s, teacher, ids, divergence=divergence, ce_weight=0.5, **kw)
        out.loss.backward()
        results.append((out, grads(s)))
    (p, gp), (u, gu) = results
    assert int(p.n_tokens) == int(u.n_tokens) == sum(n - 1 for n in LENGTHS)
    for a, b in zip(p[:3], u[:3]):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    assert_grads_close(gp, gu, **SAME)
    # Without position_ids the documents see each other and the last token of one predicts the next.
    leaky = distill_loss(model(16, impl, seed=0), teacher, packed, divergence=divergence, ce_weight=0.5)
    assert int(leaky.n_tokens) == packed.shape[1] - 1 and abs(float(leaky.loss.detach()) - float(u.loss)) > 1e-3


def test_packed_topk_equals_unpacked():
    packed, pos, padded, mask = packed_and_padded(1)
    teacher, K = model(24, "sdpa", seed=2).eval(), 5

    def store(ids, attention_mask=None, position_ids=None):  # the teacher's top-k per position
        with torch.no_grad():  # (position_ids alone do not keep the documents apart under sdpa)
            lp = teacher(input_ids=ids, **model_inputs(teacher, ids, attention_mask, position_ids)).logits.log_softmax(
                -1
            )
        top = lp.topk(K, dim=-1)
        return top.indices, top.values

    results = []
    for ids, kw in ((packed, dict(position_ids=pos)), (padded, dict(attention_mask=mask))):
        ti, tl = store(ids, **kw)
        s = model(16, "sdpa", seed=0)
        out = distill_loss(s, None, ids, divergence="topk", topk_ids=ti, topk_logprobs=tl, topk_tail=True, **kw)
        out.loss.backward()
        results.append((out, grads(s)))
    (p, gp), (u, gu) = results
    assert int(p.n_tokens) == int(u.n_tokens)
    torch.testing.assert_close(p.loss, u.loss, rtol=1e-6, atol=1e-6)
    assert_grads_close(gp, gu, **SAME)


def test_unhonoured_inputs_raise():
    packed, pos, _, _ = packed_and_padded()
    s, t = model(16, "sdpa", seed=0), model(24, "sdpa", seed=1)
    t.config._attn_implementation = "flex_attention"
    with pytest.raises(ValueError, match="packed batch.*flex_attention"):
        distill_loss(s, t, packed, position_ids=pos)
    with pytest.raises(ValueError, match="without position_ids"):
        distill_loss(s, t, packed, cu_seq_lens_q=torch.tensor([0, 7, 12, 16], dtype=torch.int32))
    with pytest.raises(ValueError, match="unknown model inputs"):
        distill_loss(s, t, packed, position_ids=pos, seq_idx=pos)
    t.config._attn_implementation = "sdpa"
    distill_loss(s, t, packed, position_ids=pos)  # one row, not packed: position_ids pass through
    distill_loss(s, t, packed[:, :7], position_ids=pos[:, :7])


def test_trainer_packed_equals_padded(tmp_path):
    """DataCollatorWithFlattening (position_ids, no padding) == a padding collator, through the trainer."""
    data = sequences(LENGTHS, seed=3)
    got = {}
    for name, collator in (("packed", DataCollatorWithFlattening()), ("padded", collate)):
        student, teacher = model(16, "sdpa", seed=0), model(24, "sdpa", seed=1)
        step = dict(collator=collator, per_device_train_batch_size=3, ce_weight=0.3)
        got[name], _ = sgd_step_gradient(tmp_path / name, data, student, teacher, **step)
    batch = DataCollatorWithFlattening()(data)
    assert "position_ids" in batch and "attention_mask" not in batch and (batch["labels"] == IGNORE_INDEX).sum() == 3
    assert_grads_close(got["packed"], got["padded"], **SAME)


def test_trainer_topk_packed_equals_padded(tmp_path):
    """A stored top-k dataset, packed (one row, position_ids) or padded (TopKCollator): same step."""
    pytest.importorskip("safetensors")
    pytest.importorskip("nitrobrew.teacher.extract")
    from nitrobrew.teacher.data import TopKCollator
    from test_hf_topk import make_store

    dataset, _ = make_store(tmp_path / "store", LENGTHS)

    def packed(items):
        rows = [TopKCollator()([it]) for it in items]  # one item each: no padding
        batch = {k: torch.cat([r[k] for r in rows], 1) for k in rows[0] if k != "attention_mask"}
        batch["position_ids"] = torch.cat([torch.arange(r["input_ids"].shape[1]) for r in rows])[None]
        return batch

    got = {}
    for name, collator in (("packed", packed), ("padded", TopKCollator())):
        step = dict(collator=collator, per_device_train_batch_size=3, divergence="topk")
        got[name], _ = sgd_step_gradient(tmp_path / name, dataset, model(16, "sdpa", seed=0), None, **step)
    assert_grads_close(got["packed"], got["padded"], **SAME)


def test_flash_attention_gets_the_varlen_kwargs():
    """Flash attention splits on position_ids / cu_seq_lens itself: they pass through, no 4-D mask."""
    packed, pos, _, _ = packed_and_padded()
    m = model(16, "sdpa", seed=0)
    m.config._attn_implementation = "flash_attention_2"
    cu = torch.tensor([0, 7, 12, 16], dtype=torch.int32)
    got = model_inputs(m, packed, None, pos, cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=7, max_length_k=7)
    assert set(got) == {"position_ids", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k"}
    assert got["cu_seq_lens_q"] is cu and torch.equal(got["position_ids"], pos)
    with pytest.raises(ValueError, match="padding under flash attention"):
        model_inputs(m, packed, torch.cat([torch.ones(1, 15), torch.zeros(1, 1)], 1).long(), pos)
    m.config._attn_implementation = "sdpa"
    got = model_inputs(m, packed, None, pos, cu_seq_lens_q=cu)
    assert set(got) == {"attention_mask", "position_ids"} and got["attention_mask"].shape == (1, 1, 16, 16)
