"""Tiny randomly initialized Hugging Face causal LMs for the tests (no downloads)."""

from __future__ import annotations

import torch


def causal_lm(
    arch: str,
    *,
    vocab: int,
    hidden: int,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    positions: int | None = None,
    tie: bool | None = None,
    seed: int = 0,
    head_scale: float = 8.0,
    **config,
):
    """A ``<arch>ForCausalLM`` ("Llama", "Qwen2", ...) from ``torch.manual_seed(seed)``, its intermediate size
    2 * hidden unless ``config`` says otherwise; ``positions`` (max_position_embeddings) and ``tie``
    (tie_word_embeddings) keep the config's defaults where None. The head (tied embeddings with it) is
    multiplied by ``head_scale``: a fresh init gives near-uniform next-token distributions, trained models spread
    their logits over several units."""
    import transformers

    torch.manual_seed(seed)
    config.setdefault("intermediate_size", 2 * hidden)
    if positions is not None:
        config["max_position_embeddings"] = positions
    if tie is not None:
        config["tie_word_embeddings"] = tie
    cfg = getattr(transformers, f"{arch}Config")(
        vocab_size=vocab,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        **config,
    )
    model = getattr(transformers, f"{arch}ForCausalLM")(cfg)
    if head_scale != 1.0:
        with torch.no_grad():
            model.get_output_embeddings().weight.mul_(head_scale)
    return model


def scale_logits(model, factor: float):
    """Make ``model(...)`` return its logits times ``factor``: a logit transform that its head does not carry."""
    forward = model.forward

    def scaled(*args, **kwargs):
        out = forward(*args, **kwargs)
        out.logits = out.logits * factor
        return out

    model.forward = scaled
    return model
