"""Moved to ``nitrobrew.teacher.interop`` (the offline-teacher pipeline); this path goes in the next release."""

import warnings

from ..teacher.interop import *  # noqa: F401,F403

warnings.warn(
    "nitrobrew.topk.interop moved to nitrobrew.teacher.interop; the old path goes in the next release",
    DeprecationWarning,
    stacklevel=2,
)
