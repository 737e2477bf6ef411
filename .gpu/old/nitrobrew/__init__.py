"""nitrobrew: exact, fast, memory-lean knowledge-distillation losses for LLMs."""

__version__ = "0.1.0"

# name -> the module that defines it. Loaded on first use: `import nitrobrew` (and the console
# script's --version / --help) does not import torch until a loss is asked for.
_HIDDEN = (
    "DistillLoss",
    "DistillOutput",
    "ForwardKLLoss",
    "JSDLoss",
    "ReverseKLLoss",
    "SkewKLLoss",
    "SkewReverseKLLoss",
    "TVDLoss",
    "forward_kl",
    "hidden_loss",
    "jsd",
    "reverse_kl",
    "skew_kl",
    "skew_reverse_kl",
    "tvd",
)
_LAZY = {**{name: "hidden" for name in _HIDDEN}, "attention_kl": "attention", "topk_kl": "topk"}


def __getattr__(name):
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'nitrobrew' has no attribute {name!r}")


def __dir__():
    return sorted([*globals(), *_LAZY])


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
