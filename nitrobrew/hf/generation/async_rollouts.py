"""Asynchronous rollouts: the completions of window k+1 generated while the trainer trains on window k.

``AsyncRollouts(engine, staleness=1)`` drives ``engine`` (a generator holding a copy of the student, on a
second GPU or on the training device) from a background thread. The trainer

1. ``submit``s the prompts of each window in order (window j), ahead of time: window j + staleness before
   it trains window j;
2. takes window j's completions with ``result(j)`` (they were generated with weight version
   max(0, j - staleness) at the oldest, at most ``staleness`` optimizer steps behind the weights that train
   on them; the version is recorded in each batch);
3. calls ``sync_weights(model)`` after each optimizer step: it waits until every submitted window that
   must be generated with the older weights is done, then copies the new weights into the engine's copy.

Which weights generate which window is therefore fixed by the order of the trainer's calls, not by timing:
with seeded sampling (an engine that ``seeds_itself``) the rollouts, and the training on them, are the same
from run to run.

On CUDA the thread generates on a stream of its own (it overlaps training on the same device, or runs on a
second one). The copy of new weights runs on the trainer's streams; the thread's stream waits for it (an
event) before the next generation reads them, and the thread synchronizes its stream before a window's
completions are handed over (they are then kept alive for the stream that takes them, ``record_stream``).

Staleness and the divergences. The completions of a window come from a policy up to ``staleness`` steps
older than the student that trains on them. Losses weighted by the teacher's distribution (forward KL, and
JSD / skew KL towards it) score every token by the teacher and are robust to it; student-weighted reverse
KL is an on-policy estimator whose samples should come from the current student, and it degrades as the
sampling policy lags (AsyncOPD reports forward KL robust at staleness, reverse KL not). Keep
``staleness=1`` (or 0: synchronous) for ``reverse_kl``.
"""

from __future__ import annotations

import contextlib
import queue
import threading
from typing import Dict, List, Optional

import torch

from .base import Completions, Sampling


def _parameters(engine):
    model = getattr(engine, "model", None)
    return model.parameters() if isinstance(model, torch.nn.Module) else iter(())


def _copy_done(device: Optional[torch.device], model: torch.nn.Module):
    """After a weight copy into an engine on ``device``: a CUDA event on that device's current stream (a copy
    from another GPU is ordered before it by the copy itself), for the thread's stream to wait on; a copy to
    the CPU from a CUDA model (asynchronous) is waited for here."""
    if device is None:
        return None
    if device.type == "cuda":
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(device))
        return event
    source = next(iter(model.parameters()), None)
    if source is not None and source.is_cuda:
        torch.cuda.current_stream(source.device).synchronize()
    return None


def _init_compile_thread_state() -> None:
    """Give this thread the per-thread state of torch.compile's CUDA-graph trees. Torch sets it up for the main
    thread and autograd's threads only; in any other thread a CUDA-graphed compiled call (the static engine's
    decode step) fails on torch <= 2.11 with a bare AssertionError."""
    try:
        from torch._inductor import cudagraph_trees
    except Exception:  # no inductor: nothing is compiled with CUDA graphs
        return
    local = getattr(cudagraph_trees, "local", None)
    if local is None or hasattr(local, "tree_manager_containers"):
        return
    init = getattr(cudagraph_trees, "_initialize_tls", None)
    if init is not None:
        init(local)
    else:
        import collections

        local.tree_manager_containers = {}
        local.tree_manager_locks = collections.defaultdict(threading.Lock)


class StalenessError(RuntimeError):
    """A window's completions are older than the staleness bound allows."""


class AsyncRollouts:
    """A background thread that completes the submitted windows with ``engine`` (see the module docstring).

    Args:
        engine: a generator with a model of its own (``StaticCacheGenerator`` or ``DynamicCacheGenerator``
            of a copy of the student; seeded sampling is deterministic with an engine that ``seeds_itself``).
        staleness: how many optimizer steps the generating weights may lag the training weights (0: none,
            each window is generated after the previous step, nothing overlaps).
    """

    def __init__(self, engine, *, staleness: int = 1):
        if isinstance(staleness, bool) or not isinstance(staleness, int) or staleness < 0:
            raise ValueError(f"staleness must be an int >= 0, got {staleness!r}")
        self.engine = engine
        self.staleness = staleness
        self.base = int(engine.weight_version)
        self.version = self.base  # the engine's weight version once the trainer's steps are synced
        self._submitted = 0
        self._results: Dict[int, object] = {}
        self._finished: set = set()
        self._windows: List[int] = []  # the window of each job
        self._stream = None
        self._weights_ready = None  # a CUDA event: the last weight copy into the engine's device is done
        self._jobs: "queue.Queue" = queue.Queue()
        self._cond = threading.Condition()
        self._engine_lock = threading.Lock()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="nitrobrew-rollouts", daemon=True)
        self._thread.start()

    # -- the trainer's side -----------------------------------------------------------------------
    def submit(
        self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, sampling: Sampling, window: Optional[int] = None
    ) -> int:
        """Queue the prompts (left-padded) of window ``window`` (the optimizer step that will train on them,
        counted from this object's creation; default: the next after the last submitted) for generation;
        returns the job's id for ``result``."""
        with self._cond:
            if self._closed:
                raise RuntimeError("AsyncRollouts is closed")
            j = self._submitted
            if window is None:
                window = self._windows[j - 1] + 1 if j else 0
            if j and window < self._windows[j - 1]:
                raise ValueError(f"windows are submitted in order: {window} after {self._windows[j - 1]}")
            self._windows.append(int(window))
            self._submitted += 1
        ready = None
        if prompt_ids.is_cuda:  # the prompts' kernels on the caller's stream come first
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(prompt_ids.device))
        self._jobs.put((j, prompt_ids, prompt_mask, sampling, ready))
        return j

    def result(self, j: int, timeout: Optional[float] = None) -> Completions:
        """Window ``j``'s completions (waits for them); an error of the thread is raised here."""
        with self._cond:
            if not 0 <= j < self._submitted:
                raise ValueError(f"window {j} was not submitted ({self._submitted} were)")
            if not self._cond.wait_for(lambda: j in self._results, timeout=timeout):
                raise TimeoutError(f"window {j} was not generated within {timeout} s")
            out = self._results.pop(j)
        if isinstance(out, BaseException):
            raise RuntimeError(f"generation of window {j} failed: {type(out).__name__}: {out}") from out
        if out.ids.is_cuda:  # made on the thread's stream, used on the caller's: keep them until it is done
            stream = torch.cuda.current_stream(out.ids.device)
            for t in (out.ids, out.mask, out.logprobs):
                if t is not None:
                    t.record_stream(stream)
        lag = self.version - out.weight_version
        if lag > self.staleness:
            raise StalenessError(
                f"window {j} was generated with weight version {out.weight_version}, {lag} optimizer steps "
                f"behind the trainer's {self.version} (staleness bound {self.staleness}): submit windows in "
                "order, before the steps that follow them"
            )
        return out

    def sync_weights(self, model: torch.nn.Module) -> None:
        """After an optimizer step: wait for the windows the older weights must generate, then copy ``model``."""
        with self._cond:
            new = self.version + 1
            # Window w is generated with version max(0, w - staleness): the submitted windows w < new + staleness
            # belong to older weights.
            self._cond.wait_for(lambda: self._generated_below(new - self.base + self.staleness) or self._closed)
        with self._engine_lock:
            self.engine.sync_weights(model)
            self._weights_ready = _copy_done(self._engine_device(), model)
        with self._cond:
            self.version = new
            self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._jobs.put(None)
        self._thread.join(timeout=60)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # -- the thread -------------------------------------------------------------------------------
    def _engine_device(self) -> Optional[torch.device]:
        p = next(iter(_parameters(self.engine)), None)
        return None if p is None else p.device

    def _side_stream(self, ids: torch.Tensor):
        """A CUDA stream of the thread's own, so that generation can overlap training on the same device."""
        device = self._engine_device() or ids.device
        if device.type != "cuda":
            return contextlib.nullcontext()
        if self._stream is None:
            self._stream = torch.cuda.Stream(device)
        return torch.cuda.stream(self._stream)

    def _generated_below(self, window: int) -> bool:
        return all(j in self._finished for j in range(self._submitted) if self._windows[j] < window)

    def _run(self) -> None:
        _init_compile_thread_state()
        while True:
            job = self._jobs.get()
            if job is None:
                return
            j, ids, mask, sampling, ready = job
            with self._cond:
                # Not before the weights it must be generated with (max(0, j - staleness)) are in.
                w = self._windows[j]
                self._cond.wait_for(lambda w=w: self.version - self.base >= w - self.staleness or self._closed)
                if self._closed:
                    return
            try:
                with self._engine_lock, self._side_stream(ids):
                    if ready is not None:
                        torch.cuda.current_stream(ids.device).wait_event(ready)
                    if self._stream is not None:
                        if self._weights_ready is not None:  # the copied weights are in before they are read
                            self._stream.wait_event(self._weights_ready)
                        out = self.engine.generate(ids, mask, sampling)
                        self._stream.synchronize()  # the completions are whole before the trainer takes them
                    else:
                        out = self.engine.generate(ids, mask, sampling)
            except BaseException as err:  # handed to the trainer by result()
                out = err
            with self._cond:
                self._results[j] = out
                self._finished.add(j)
                self._cond.notify_all()
