"""Run a test's cases on several CPU processes joined over gloo, and collect every rank's failures.

``run_ranks(cases, world, timeout)`` spawns `world` processes; each sets the torchrun environment
(MASTER_ADDR/PORT, RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE), optionally joins the gloo process
group, runs ``cases(rank, outdir)`` (a list of (name, no-argument function)) and writes its failures,
tracebacks included, to a file. The test fails with all of them at once, or with the ranks that hung
or crashed. `cases` must be a module-level function (the processes are spawned).
"""

import json
import multiprocessing
import os
import socket
import sys
import tempfile
import traceback
from typing import Callable, List, Tuple

import torch

Cases = Callable[[int, str], List[Tuple[str, Callable[[], None]]]]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(cases: Cases, rank: int, world: int, port: int, outdir: str, init_group: bool) -> None:
    import torch.distributed as dist

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the test modules import each other
    torch.set_num_threads(1)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
        OMP_NUM_THREADS="1",
    )
    failures = []
    try:
        if init_group:
            dist.init_process_group("gloo", rank=rank, world_size=world)
        for name, fn in cases(rank, outdir):
            try:
                fn()
            except Exception:
                failures.append(f"[rank {rank}] {name}: {traceback.format_exc(limit=-4)}")
        if init_group:
            dist.destroy_process_group()
    except Exception:
        failures.append(f"[rank {rank}] {traceback.format_exc()}")
    with open(os.path.join(outdir, f"{rank}.json"), "w") as f:
        json.dump(failures, f)


def run_ranks(cases: Cases, world: int = 2, timeout: float = 120, init_group: bool = True) -> None:
    """Run `cases` on `world` spawned ranks; assert that none failed, hung or crashed. `init_group`:
    join the gloo process group before the cases (off where the code under test joins it itself)."""
    port = _free_port()
    ctx = multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory() as outdir:
        procs = [
            ctx.Process(target=_rank, args=(cases, r, world, port, outdir, init_group), daemon=True)
            for r in range(world)
        ]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout)
            if p.is_alive():
                p.kill()
        failures = []
        for r in range(world):
            path = os.path.join(outdir, f"{r}.json")
            failures += json.load(open(path)) if os.path.exists(path) else [f"rank {r}: no result (hung or crashed)"]
    assert not failures, "\n".join(failures)
