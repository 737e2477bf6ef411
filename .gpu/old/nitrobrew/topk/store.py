"""Moved to ``nitrobrew.teacher.store`` (the offline-teacher pipeline); this path goes in the next release."""

import warnings

from ..teacher.store import *  # noqa: F401,F403

warnings.warn(
    "nitrobrew.topk.store moved to nitrobrew.teacher.store; the old path goes in the next release",
    DeprecationWarning,
    stacklevel=2,
)
