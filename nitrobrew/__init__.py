"""nitrobrew: exact, fast, memory-lean knowledge-distillation losses for LLMs."""

from .hidden import (
    DistillLoss,
    DistillOutput,
    ForwardKLLoss,
    JSDLoss,
    ReverseKLLoss,
    SkewKLLoss,
    SkewReverseKLLoss,
    TVDLoss,
    forward_kl,
    hidden_loss,
    jsd,
    reverse_kl,
    skew_kl,
    skew_reverse_kl,
    tvd,
)

__version__ = "0.1.0"


def __getattr__(name):
    # Families that import optional pieces load on first use.
    if name == "attention_kl":
        from .attention import attention_kl

        return attention_kl
    if name == "topk_kl":
        from .topk import topk_kl

        return topk_kl
    raise AttributeError(f"module 'nitrobrew' has no attribute {name!r}")


__all__ = [
    "forward_kl",
    "reverse_kl",
    "jsd",
    "tvd",
    "skew_kl",
    "skew_reverse_kl",
    "hidden_loss",
    "DistillOutput",
    "DistillLoss",
    "ForwardKLLoss",
    "ReverseKLLoss",
    "JSDLoss",
    "TVDLoss",
    "SkewKLLoss",
    "SkewReverseKLLoss",
    "attention_kl",
    "topk_kl",
]
