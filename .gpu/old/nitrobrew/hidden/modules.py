"""nn.Module forms of the hidden-state losses, for people who configure losses as modules."""

from __future__ import annotations

import inspect

import torch

from . import api


class DistillLoss(torch.nn.Module):
    """Holds a divergence and its options; ``forward(xs, xt, ws, wt, labels=None)``."""

    divergence = "forward_kl"

    def __init__(self, **options):
        super().__init__()
        # the options of this divergence's function only: e.g. JSDLoss(alpha=...) is a TypeError
        own = inspect.signature(api.LOSSES[self.divergence]).parameters.values()
        allowed = api.OPTION_NAMES | {p.name for p in own if p.kind is p.KEYWORD_ONLY}
        unknown = sorted(set(options) - allowed)
        if unknown:
            raise TypeError(f"{type(self).__name__} got unexpected options {unknown}")
        self.options = options

    def forward(self, xs, xt, ws, wt, labels=None, **overrides):
        return api.LOSSES[self.divergence](xs, xt, ws, wt, labels=labels, **{**self.options, **overrides})

    def extra_repr(self) -> str:
        return ", ".join(f"{k}={v!r}" for k, v in self.options.items())


class ForwardKLLoss(DistillLoss):
    """Module form of nitrobrew.forward_kl."""

    divergence = "forward_kl"


class ReverseKLLoss(DistillLoss):
    """Module form of nitrobrew.reverse_kl."""

    divergence = "reverse_kl"


class JSDLoss(DistillLoss):
    """Module form of nitrobrew.jsd."""

    divergence = "jsd"


class TVDLoss(DistillLoss):
    """Module form of nitrobrew.tvd."""

    divergence = "tvd"


class SkewKLLoss(DistillLoss):
    """Module form of nitrobrew.skew_kl."""

    divergence = "skew_kl"


class SkewReverseKLLoss(DistillLoss):
    """Module form of nitrobrew.skew_reverse_kl."""

    divergence = "skew_reverse_kl"
