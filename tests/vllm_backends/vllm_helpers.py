"""Tiny models on disk (the ``model_dirs`` fixture) and the transformers reference for the vLLM backend
tests (``make test-vllm``).

The student: a Qwen2 with 2 layers, hidden 128, 4 heads (vLLM's CPU attention needs a head size >= 32) and a
vocabulary of 256, initialized wide enough that greedy decoding has clear winners (no near-ties for two
implementations to break differently).
"""

from __future__ import annotations

import json
import os

import pytest
import torch

VOCAB = 256
EOS = 1
PAD = 0
MAX_LEN = 128


def tiny_model(seed: int):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=MAX_LEN,
        tie_word_embeddings=False,
        initializer_range=0.15,
        eos_token_id=EOS,
        bos_token_id=PAD,
        pad_token_id=PAD,
    )
    return Qwen2ForCausalLM(config).eval()


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory):
    """(student dir, teacher dir, on-policy data .jsonl): prompts of 6-9 tokens, labels -100 on them."""
    root = tmp_path_factory.mktemp("vllm_models")
    dirs = []
    for name, seed in (("student", 0), ("teacher", 1)):
        path = root / name
        tiny_model(seed).save_pretrained(path)
        dirs.append(str(path))
    gen = torch.Generator().manual_seed(5)
    data = root / "prompts.jsonl"
    with open(data, "w") as f:
        for i in range(16):
            n = 6 + i % 4
            ids = torch.randint(2, VOCAB, (n + 4,), generator=gen).tolist()
            f.write(json.dumps({"input_ids": ids, "labels": [-100] * n + ids[n:]}) + "\n")
    return dirs[0], dirs[1], str(data)


def load(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12], [200, 3, 77, 41, 9, 120, 33]]


def left_padded(prompts=PROMPTS):
    """[B, P] prompt ids left-padded with PAD, and their mask."""
    width = max(map(len, prompts))
    ids = torch.full((len(prompts), width), PAD, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, p in enumerate(prompts):
        ids[b, width - len(p) :] = torch.tensor(p)
        mask[b, width - len(p) :] = 1
    return ids, mask


@torch.no_grad()
def hf_greedy(model, max_new_tokens: int, eos=EOS, prompts=PROMPTS):
    """transformers' greedy completion of each prompt alone (no padding), cut after the first EOS."""
    rows = []
    for p in prompts:
        out = model.generate(
            input_ids=torch.tensor([p]),
            attention_mask=torch.ones(1, len(p), dtype=torch.long),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=eos,
            pad_token_id=PAD,
        )[0, len(p) :].tolist()
        if eos in out:
            out = out[: out.index(eos) + 1]
        rows.append(out)
    return rows


def counted_rows(completions):
    """Each row's counted tokens (mask 1) of a ``Completions``."""
    return [row[mask.bool()].tolist() for row, mask in zip(completions.ids.cpu(), completions.mask.cpu())]


@torch.no_grad()
def perturb(model, seed: int, scale: float = 0.05):
    """Move every weight, as an optimizer step would (a different model: different greedy completions)."""
    gen = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.add_(torch.randn(p.shape, generator=gen) * scale * p.abs().mean())


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
