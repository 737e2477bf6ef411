"""The Qwen2-shaped models of the end-to-end benchmarks, built from configs: random weights, no downloads.

A shape is (layers, hidden size, attention heads, key/value heads, MLP size). ``STUDENT_1P5B`` is
Qwen2-1.5B's and ``TEACHER_7B`` Qwen2-7B's, both with Qwen2's vocabulary (``QWEN2_VOCAB``) and an untied
head; ``qwen2_model`` makes one in its dtype directly on the device (no float32 copy of a 7B model).
"""

from __future__ import annotations

from typing import Tuple

import torch

Shape = Tuple[int, int, int, int, int]
STUDENT_1P5B: Shape = (28, 1536, 12, 2, 8960)
TEACHER_7B: Shape = (28, 3584, 28, 4, 18944)
QWEN2_VOCAB = 152064


def qwen2_config(shape: Shape, vocab: int, *, max_positions: int, use_cache: bool = True, attn: str = "sdpa"):
    """A ``transformers.Qwen2Config`` of the shape (untied head)."""
    import transformers

    layers, width, heads, kv, mlp = shape
    cfg = transformers.Qwen2Config(
        vocab_size=vocab,
        hidden_size=width,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        intermediate_size=mlp,
        max_position_embeddings=max_positions,
        tie_word_embeddings=False,
        use_cache=use_cache,
    )
    cfg._attn_implementation = attn
    return cfg


def qwen2_model(
    shape: Shape,
    vocab: int,
    dtype: torch.dtype,
    device,
    seed: int,
    *,
    max_positions: int,
    use_cache: bool = True,
    attn: str = "sdpa",
):
    """A ``Qwen2ForCausalLM`` of the shape with transformers' random initialization under ``seed``, its
    weights made in ``dtype`` on ``device``."""
    import transformers

    cfg = qwen2_config(shape, vocab, max_positions=max_positions, use_cache=use_cache, attn=attn)
    torch.manual_seed(seed)
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = transformers.Qwen2ForCausalLM(cfg)
    finally:
        torch.set_default_dtype(old)
    return model
