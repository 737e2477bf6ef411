"""A heartbeat watchdog across ranks: a rank that dies stops every other rank, with a clear error, in bounded time.

Without it, the ranks left behind when one is killed (kill -9, the OOM killer, a lost host) wait in
their next collective until the process-group timeout (NCCL: 10 min by default, 30 min under
transformers' ``ddp_timeout``) unless a launcher's agent (torchrun, ``accelerate launch``) ends them.
Each rank here bumps a counter in the process group's store every ``interval_s`` from a background
thread and watches the others' counters; when one has not moved for ``timeout_s`` (or the store
itself has been unreachable that long) the rank prints one line naming the silent rank and exits
with status ``EXIT_PEER_LOST``. The thread runs beside the training loop, so a busy rank (a long
kernel, a checkpoint write) keeps beating; only a dead or frozen process falls silent. A rank that
finishes marks itself done first, so the others do not take its exit for a death.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from typing import Dict, Optional

EXIT_PEER_LOST = 75
ENV_TIMEOUT = "NITROBREW_RANK_TIMEOUT"
DEFAULT_TIMEOUT_S = 120.0


def timeout_from_env(default: float = DEFAULT_TIMEOUT_S) -> float:
    """NITROBREW_RANK_TIMEOUT in seconds (0 turns the watchdog off); a bad value raises ValueError."""
    raw = os.environ.get(ENV_TIMEOUT)
    if raw is None or raw.strip() == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{ENV_TIMEOUT} must be a number of seconds (0: off), got {raw!r}") from None
    if value < 0:
        raise ValueError(f"{ENV_TIMEOUT} must be >= 0 seconds (0: off), got {raw!r}")
    return value


class RankWatchdog:
    """Heartbeats of every rank of the default process group through its store (see the module doc).

    ``start()`` once all ranks are up (each rank calls it), ``stop()`` when this rank is done. On a
    lost rank: one line on stderr, then ``os._exit(EXIT_PEER_LOST)`` (collectives in flight cannot be
    interrupted from Python; ending the process is what bounds the wait)."""

    def __init__(self, timeout_s: float = DEFAULT_TIMEOUT_S, interval_s: Optional[float] = None, store=None):
        import torch.distributed as dist

        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.timeout_s = float(timeout_s)
        self.interval_s = float(interval_s) if interval_s else max(0.05, min(5.0, self.timeout_s / 10))
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.store = store if store is not None else dist.distributed_c10d._get_default_store()
        self._stop = threading.Event()
        self._threads = []
        self._last_ok = time.monotonic()
        self.prefix = ""

    def _key(self, rank: int, what: str = "beat") -> str:
        return f"{self.prefix}/{rank}/{what}"

    def start(self) -> "RankWatchdog":
        # One generation per start on every rank (train() may run more than once in a process group).
        gen = self.store.add(f"nitrobrew/watchdog/starts/{self.rank}", 1)
        self.prefix = f"nitrobrew/watchdog/{gen}"
        self.store.add(self._key(self.rank), 1)
        self._last_ok = time.monotonic()
        for target in (self._beat, self._guard):
            t = threading.Thread(target=target, name=f"nitrobrew-{target.__name__.strip('_')}", daemon=True)
            t.start()
            self._threads.append(t)
        return self

    def stop(self) -> None:
        """This rank is done: end the threads, then mark it so. The threads are waited for (a beat takes
        one store call): one still inside a store call while the process exits can abort it."""
        if self._stop.is_set():
            return
        self._stop.set()
        for t in self._threads:
            t.join(timeout=self.interval_s + 5.0)  # bounded: a store call to a lost host may block
        try:
            self.store.set(self._key(self.rank, "done"), "1")
        except Exception:  # noqa: BLE001 - the store may be gone at shutdown
            pass

    def _beat(self) -> None:
        seen: Dict[int, int] = {}
        last_move = {r: time.monotonic() for r in range(self.world) if r != self.rank}
        while not self._stop.wait(self.interval_s):
            try:
                self.store.add(self._key(self.rank), 1)
                now = time.monotonic()
                for r in list(last_move):
                    count = self.store.add(self._key(r), 0)
                    if count != seen.get(r):
                        seen[r], last_move[r] = count, now
                    elif now - last_move[r] > self.timeout_s:
                        if self.store.check([self._key(r, "done")]):
                            del last_move[r]  # finished, not dead
                            continue
                        self._fail(f"rank {r} of {self.world} sent no heartbeat for {now - last_move[r]:.0f} s")
                self._last_ok = now
            except Exception as e:  # noqa: BLE001 - the store host may be the lost rank
                if time.monotonic() - self._last_ok > self.timeout_s:
                    self._fail(f"the process group's store has been unreachable for over {self.timeout_s:.0f} s ({e})")

    def _guard(self) -> None:
        # A store call that blocks (its host gone) stops _beat itself: bound that too.
        while not self._stop.wait(self.interval_s):
            if time.monotonic() - self._last_ok > 2 * self.timeout_s + self.interval_s:
                self._fail(f"the process group's store has not answered for over {2 * self.timeout_s:.0f} s")

    def _fail(self, why: str) -> None:
        if self._stop.is_set():
            return
        print(
            f"nitrobrew: {why} (killed, out of memory or hung): stopping rank {self.rank} "
            f"(exit {EXIT_PEER_LOST}); resume from the last checkpoint",
            file=sys.stderr,
            flush=True,
        )
        os._exit(EXIT_PEER_LOST)


def trainer_callback(timeout_s: Optional[float] = None):
    """A transformers ``TrainerCallback`` that runs a ``RankWatchdog`` during ``train()`` (None when
    the timeout is 0 or torch.distributed is not initialized with more than one rank)."""
    import torch.distributed as dist
    from transformers import TrainerCallback

    timeout = timeout_from_env() if timeout_s is None else timeout_s
    if timeout <= 0 or not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return None

    class RankWatchdogCallback(TrainerCallback):
        def __init__(self):
            self.watchdog = None

        def on_train_begin(self, args, state, control, **kwargs):
            try:
                self.watchdog = RankWatchdog(timeout).start()
            except (RuntimeError, AttributeError) as e:  # no store this process group exposes
                import warnings

                warnings.warn(
                    f"nitrobrew: no rank watchdog ({e}); a lost rank may leave the others waiting", stacklevel=2
                )

        def on_train_end(self, args, state, control, **kwargs):
            if self.watchdog is not None:
                self.watchdog.stop()
                self.watchdog = None

    return RankWatchdogCallback()
