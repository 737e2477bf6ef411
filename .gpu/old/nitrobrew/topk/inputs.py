"""Moved to ``nitrobrew.teacher.inputs`` (the offline-teacher pipeline); this path goes in the next release."""

import warnings

from ..teacher.inputs import *  # noqa: F401,F403

warnings.warn(
    "nitrobrew.topk.inputs moved to nitrobrew.teacher.inputs; the old path goes in the next release",
    DeprecationWarning,
    stacklevel=2,
)
