"""Attention-distillation KL: teacher vs student attention distributions, per query row.

``attention_kl`` streams over key tiles (no [B, H, Nq, Nk] map), with a PyTorch path
(``chunked``), Triton kernels (``kernels_fwd``, ``kernels_bwd``) and a materializing float64
reference (``reference``). See docs/attention.md.
"""

from .api import attention_kl
from .reference import reference_attention_kl

__all__ = ["attention_kl", "reference_attention_kl"]
