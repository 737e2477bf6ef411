"""Moved to ``nitrobrew.teacher.data`` (the offline-teacher pipeline); this path goes in the next release."""

import warnings

from ..teacher.data import *  # noqa: F401,F403

warnings.warn(
    "nitrobrew.topk.data moved to nitrobrew.teacher.data; the old path goes in the next release",
    DeprecationWarning,
    stacklevel=2,
)
