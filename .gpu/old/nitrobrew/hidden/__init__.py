"""Hidden-state distillation losses: reference, chunked PyTorch and Triton implementations."""

from ..core.outputs import DistillOutput
from .api import forward_kl, hidden_loss, jsd, reverse_kl, skew_kl, skew_reverse_kl, tvd
from .modules import DistillLoss, ForwardKLLoss, JSDLoss, ReverseKLLoss, SkewKLLoss, SkewReverseKLLoss, TVDLoss
from .reference import reference_loss

__all__ = [
    "DistillOutput",
    "forward_kl",
    "reverse_kl",
    "jsd",
    "tvd",
    "skew_kl",
    "skew_reverse_kl",
    "hidden_loss",
    "reference_loss",
    "DistillLoss",
    "ForwardKLLoss",
    "ReverseKLLoss",
    "JSDLoss",
    "TVDLoss",
    "SkewKLLoss",
    "SkewReverseKLLoss",
]
