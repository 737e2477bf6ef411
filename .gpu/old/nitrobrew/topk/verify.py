"""Moved to ``nitrobrew.teacher.verify`` (the offline-teacher pipeline); this path goes in the next release."""

import warnings

from ..teacher.verify import *  # noqa: F401,F403

warnings.warn(
    "nitrobrew.topk.verify moved to nitrobrew.teacher.verify; the old path goes in the next release",
    DeprecationWarning,
    stacklevel=2,
)
