"""Schedules of the distillation temperature and the KD / CE weights over training."""

from __future__ import annotations

import math
import numbers
from typing import Optional

SCHEDULES = ("constant", "linear", "cosine")


def scheduled(start: float, end: Optional[float], kind: str, step: int, total: int) -> float:
    """The value at ``step`` of ``total``: constant (start), linear or cosine from start to end.

    Cosine follows half a cosine wave (flat at both ends); past ``total`` the value stays at end.
    """
    if kind not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {kind!r}")
    for name, value in (("start", start), ("end", end)):
        if value is None and name == "end":
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ValueError(f"scheduled: {name} must be a finite number, got {value!r}")
    for name, value in (("step", step), ("total", total)):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise TypeError(f"scheduled: {name} must be an int, got {value!r}")
    if kind == "constant" or end is None or total <= 0:
        return start
    frac = min(max(step / total, 0.0), 1.0)
    if kind == "cosine":
        frac = 0.5 * (1 - math.cos(math.pi * frac))
    return start + (end - start) * frac
