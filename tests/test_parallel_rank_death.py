"""A lost rank: every rank stops in bounded time with a clear error, and the run resumes on the same curve.

- The watchdog alone (2 gloo processes, no launcher agent): rank 1 is frozen with SIGSTOP, so its
  sockets stay open and rank 0 would wait in its all-reduce until the process-group timeout (600 s
  here); the watchdog ends rank 0 within seconds, naming rank 1. Without the watchdog it hangs.
- Real torchrun with `nitrobrew train` (benchmarks/rank_death.py): rank 1 killed with SIGKILL after a
  checkpoint; torchrun returns promptly with a failure naming the signal; --resume_from_checkpoint
  reproduces the uninterrupted run's losses step for step.
"""

import os
import signal
import socket
import subprocess
import sys
import textwrap
import time

import pytest

dist = pytest.importorskip("torch.distributed")
if not dist.is_available():
    pytest.skip("torch built without distributed", allow_module_level=True)

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")

WORKER = textwrap.dedent(
    """
    import datetime, os, sys, time
    import torch, torch.distributed as dist
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=600))
    if os.environ["WATCHDOG"] == "1":
        from nitrobrew.parallel.watchdog import RankWatchdog
        RankWatchdog(timeout_s=3.0, interval_s=0.2).start()
    print("ready", flush=True)
    t = torch.ones(4)
    while True:
        dist.all_reduce(t)
        time.sleep(0.05)
    """
)


def _spawn_pair(watchdog: bool):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in range(2):
        env = dict(
            os.environ,
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            RANK=str(rank),
            WORLD_SIZE="2",
            WATCHDOG="1" if watchdog else "0",
            PYTHONPATH=ROOT,
            OMP_NUM_THREADS="1",
        )
        procs.append(
            subprocess.Popen(
                [sys.executable, "-c", WORKER], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
            )
        )
    for p in procs:
        assert p.stdout.readline().strip() == "ready"
    return procs


@pytest.mark.parametrize("watchdog", [True, False])
def test_frozen_rank_stops_the_others(watchdog):
    from nitrobrew.parallel.watchdog import EXIT_PEER_LOST

    procs = _spawn_pair(watchdog)
    try:
        time.sleep(1.0)
        procs[1].send_signal(signal.SIGSTOP)  # hung: alive, silent, sockets open
        t0 = time.monotonic()
        try:
            rc = procs[0].wait(12)
        except subprocess.TimeoutExpired:
            rc = None
        waited = time.monotonic() - t0
        err = procs[0].stderr.read() if rc is not None else ""
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
    if watchdog:
        assert rc == EXIT_PEER_LOST, (rc, err)
        assert "rank 1 of 2 sent no heartbeat" in err and "stopping rank 0" in err, err
        assert waited < 15, waited
    else:  # what the watchdog is for: the survivor still waits in its all-reduce
        assert rc is None


FINISHER = textwrap.dedent(
    """
    import os, time
    import torch.distributed as dist
    from nitrobrew.parallel.watchdog import RankWatchdog
    dist.init_process_group("gloo")
    dog = RankWatchdog(timeout_s=2.0, interval_s=0.1).start()
    print("ready", flush=True)
    if dist.get_rank() == 1:
        dog.stop()  # done: exits at once, long before rank 0
        os._exit(0)
    time.sleep(6.0)  # three timeouts without rank 1's heartbeat
    dog.stop()
    print("finished", flush=True)
    os._exit(0)
    """
)


def test_a_rank_that_finishes_is_not_taken_for_dead():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in range(2):
        env = dict(
            os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2", PYTHONPATH=ROOT
        )
        procs.append(
            subprocess.Popen(
                [sys.executable, "-c", FINISHER], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
            )
        )
    try:
        out, err = procs[0].communicate(timeout=60)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
    assert procs[0].returncode == 0 and "finished" in out, (procs[0].returncode, err)


def test_timeout_from_env(monkeypatch):
    from nitrobrew.parallel.watchdog import DEFAULT_TIMEOUT_S, timeout_from_env

    monkeypatch.delenv("NITROBREW_RANK_TIMEOUT", raising=False)
    assert timeout_from_env() == DEFAULT_TIMEOUT_S
    monkeypatch.setenv("NITROBREW_RANK_TIMEOUT", "0")
    assert timeout_from_env() == 0
    monkeypatch.setenv("NITROBREW_RANK_TIMEOUT", "soon")
    with pytest.raises(ValueError, match="NITROBREW_RANK_TIMEOUT"):
        timeout_from_env()


def test_killed_rank_under_torchrun_then_resume(tmp_path):
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    pytest.importorskip("yaml")
    pytest.importorskip("datasets")
    pytest.importorskip("psutil")
    cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "rank_death.py"), "--out", str(tmp_path)]
    cmd += ["--steps", "40", "--save-steps", "5", "--bound", "60"]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=ROOT)
    report = (tmp_path / "rank_death_cpu.md").read_text() if (tmp_path / "rank_death_cpu.md").exists() else ""
    assert run.returncode == 0, report + run.stdout[-4000:] + run.stderr[-2000:]
    assert "every rank stopped" in report and "same curve" in report and "Signal 9" in report, report


def test_watchdog_rejects_a_zero_timeout():
    from nitrobrew.parallel.watchdog import RankWatchdog

    with pytest.raises(ValueError, match="timeout_s"):
        RankWatchdog(timeout_s=0, store=object())


def test_stop_waits_for_the_watchdog_threads(tmp_path):
    """stop() returns once the heartbeat threads have ended: a beat still inside a store call while the
    process exits could abort it (a resumed run's rank 0 ended with SIGABRT after its last step)."""
    import torch.distributed as dist

    from nitrobrew.parallel.watchdog import RankWatchdog

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        dog = RankWatchdog(timeout_s=2.0, interval_s=0.05).start()
        time.sleep(0.3)
        dog.stop()
        assert dog._threads and not any(t.is_alive() for t in dog._threads)
    finally:
        dist.destroy_process_group()
