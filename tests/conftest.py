"""Shared pytest configuration.

BACKENDS: the implementations that every test taking a ``backend`` argument runs against
(parametrized automatically below unless the test parametrizes ``backend`` itself).
"""

from __future__ import annotations

import os

import torch
from hypothesis import HealthCheck, settings

BACKENDS = ["torch"]

# Property tests: no per-example deadline (CPU speed varies), few examples (CI budget). The CI
# profile draws the same examples every run (a CI result is reproducible); the local soak
# HYPOTHESIS_PROFILE=nitrobrew-long draws 20 times more, fresh ones each run.
for _name, _examples, _fixed in (("nitrobrew", 25, True), ("nitrobrew-long", 500, False)):
    settings.register_profile(
        _name,
        deadline=None,
        max_examples=_examples,
        print_blob=True,
        derandomize=_fixed,
        suppress_health_check=[HealthCheck.too_slow],
    )
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "nitrobrew"))

# CI runs `pytest -n 2` on 2 cores: one intra-op thread per worker avoids oversubscription.
_workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
torch.set_num_threads(max(1, (os.cpu_count() or 1) // _workers))


def pytest_generate_tests(metafunc):
    if "backend" not in metafunc.fixturenames:
        return
    for marker in metafunc.definition.iter_markers("parametrize"):
        names = marker.args[0]
        names = [n.strip() for n in names.split(",")] if isinstance(names, str) else list(names)
        if "backend" in names:
            return
    metafunc.parametrize("backend", BACKENDS)
