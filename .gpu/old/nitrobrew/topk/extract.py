"""Moved to ``nitrobrew.teacher.extract`` (the offline-teacher pipeline); this path goes in the next release."""

import warnings

from ..teacher.extract import *  # noqa: F401,F403

warnings.warn(
    "nitrobrew.topk.extract moved to nitrobrew.teacher.extract; the old path goes in the next release",
    DeprecationWarning,
    stacklevel=2,
)
