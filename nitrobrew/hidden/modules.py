"""nn.Module wrappers for people who configure losses as modules."""
from __future__ import annotations

import inspect

import torch

from . import api
from .api import hidden_loss


class DistillLoss(torch.nn.Module):
    """Holds a divergence and its options; ``forward(xs, xt, ws, wt, labels=None)``."""

    divergence = "forward_kl"

    def __init__(self, **options):
        super().__init__()
        # the options of this divergence's function only: e.g. JSDLoss(alpha=...) is a TypeError
        allowed = set(inspect.signature(getattr(api, self.divergence)).parameters) - {"xs", "xt", "ws", "wt"}
        unknown = sorted(set(options) - allowed)
        if unknown:
            raise TypeError(f"{type(self).__name__} got unexpected options {unknown}")
        self.options = options

    def forward(self, xs, xt, ws, wt, labels=None, **overrides):
        return hidden_loss(xs, xt, ws, wt, divergence=self.divergence, labels=labels,
                           **{**self.options, **overrides})

    def extra_repr(self) -> str:
        return ", ".join(f"{k}={v!r}" for k, v in self.options.items())


def _module(divergence: str) -> type:
    name = "".join(p.capitalize() for p in divergence.split("_")).replace("Kl", "KL").replace("Jsd", "JSD").replace("Tvd", "TVD") + "Loss"
    return type(name, (DistillLoss,), {"divergence": divergence, "__doc__": f"Module form of nitrobrew.{divergence}."})


ForwardKLLoss = _module("forward_kl")
ReverseKLLoss = _module("reverse_kl")
JSDLoss = _module("jsd")
TVDLoss = _module("tvd")
SkewKLLoss = _module("skew_kl")
SkewReverseKLLoss = _module("skew_reverse_kl")
