"""Collectives used by the vocab-parallel losses, with a byte counter.

Every collective nitrobrew issues goes through ``all_reduce`` here so that ``count_comm()`` can
report exactly what one call communicated. Bytes are *payload* bytes: the size of the buffer this
rank hands to the collective (the "size" column of nccl-tests). A ring all-reduce moves about
``2 (P - 1) / P`` times that over each rank's links.
"""

from __future__ import annotations

import contextlib
import zlib
from dataclasses import dataclass, field
from typing import Dict, Iterator, List, Optional, Sequence

import torch
import torch.distributed as dist

Tensor = torch.Tensor


@dataclass
class CommStats:
    """What the collectives issued inside a ``count_comm()`` block sent (per rank)."""

    bytes: int = 0
    calls: int = 0
    by_op: Dict[str, int] = field(default_factory=dict)  # tag -> bytes

    def add(self, tag: str, nbytes: int) -> None:
        self.bytes += nbytes
        self.calls += 1
        self.by_op[tag] = self.by_op.get(tag, 0) + nbytes


_ACTIVE: List[CommStats] = []


@contextlib.contextmanager
def count_comm() -> Iterator[CommStats]:
    """Count the payload bytes of nitrobrew's collectives (forward and backward) in this block.

    >>> with count_comm() as c:
    ...     loss = nitrobrew.forward_kl(xs, xt, ws_shard, wt_shard, process_group=tp)
    ...     loss.backward()
    >>> c.bytes, c.calls, c.by_op
    """
    stats = CommStats()
    _ACTIVE.append(stats)
    try:
        yield stats
    finally:
        _ACTIVE.remove(stats)


def _record(tag: str, t: Tensor) -> None:
    n = t.numel() * t.element_size()
    for s in _ACTIVE:
        s.add(tag, n)


def all_reduce(t: Tensor, op: str, group, tag: str) -> Tensor:
    """In-place all-reduce of a contiguous tensor ("sum" or "max"); returns t."""
    _record(tag, t)
    with phase("dX all-reduce" if tag.startswith("bwd") else "exchange"):
        dist.all_reduce(t, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX, group=group)
    return t


class PhaseTimes:
    """Time per phase of the vocab-parallel losses on this rank (``time_phases()``): CUDA events on the
    current stream for CUDA tensors (read after one synchronize), wall time on CPU."""

    def __init__(self):
        self._spans: List[tuple] = []  # (name, start, end): events, or perf_counter seconds

    def ms(self) -> Dict[str, float]:
        """Milliseconds per phase name, summed over its spans (synchronizes CUDA once)."""
        if any(isinstance(a, torch.cuda.Event) for _, a, _ in self._spans):
            torch.cuda.synchronize()
        out: Dict[str, float] = {}
        for name, a, b in self._spans:
            dt = a.elapsed_time(b) if isinstance(a, torch.cuda.Event) else (b - a) * 1e3
            out[name] = out.get(name, 0.0) + dt
        return out


_PHASES: List[PhaseTimes] = []


@contextlib.contextmanager
def time_phases() -> Iterator[PhaseTimes]:
    """Time the phases of the vocab-parallel losses run in this block, on this rank: "local stats"
    (logit GEMMs and row-statistics kernels), "exchange" (the forward's collectives, waiting for the
    slowest rank included), "gradient pass" (gradient slabs and the dX / dW GEMMs), "dX all-reduce".
    Off (no events recorded) outside such a block."""
    times = PhaseTimes()
    _PHASES.append(times)
    try:
        yield times
    finally:
        _PHASES.remove(times)


@contextlib.contextmanager
def phase(name: str):
    """Mark a phase for ``time_phases()`` (a no-op when no block is active)."""
    if not _PHASES:
        yield
        return
    import time

    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    if cuda:
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
    else:
        a = time.perf_counter()
    try:
        yield
    finally:
        if cuda:
            b.record()
        else:
            b = time.perf_counter()
        for t in _PHASES:
            t._spans.append((name, a, b))


def group_rank_world(group) -> tuple:
    return dist.get_rank(group), dist.get_world_size(group)


def fingerprint(*parts) -> int:
    """A 31-bit checksum of options that must agree on every rank (process independent)."""
    return zlib.crc32(repr(parts).encode()) & 0x7FFFFFFF


def exchange_rows(values, group, device, tag: str = "layout") -> List[List[int]]:
    """All-gather a few int64 per rank (returned as a [world][k] list, in group rank order).

    Written as a SUM all-reduce of a [world, k] buffer whose row r only rank r fills: one small
    collective that every backend (gloo, nccl, mpi) supports for int64. One host sync.
    """
    rank, world = group_rank_world(group)
    row = torch.as_tensor(values, dtype=torch.int64).to(device)
    buf = torch.zeros(world, row.numel(), dtype=torch.int64, device=device)
    buf[rank] = row
    all_reduce(buf, "sum", group, tag)
    return buf.tolist()


def offsets_from_sizes(sizes: Sequence[int]) -> List[int]:
    out, acc = [], 0
    for s in sizes:
        out.append(acc)
        acc += s
    return out


def ranks_of(group) -> Optional[tuple]:
    try:
        return tuple(dist.get_process_group_ranks(group))
    except Exception:
        return None


def checked_exchange(group, device, fields: Sequence[str], local):
    """Run ``local()`` -> (result, int values for ``fields``) on every rank and exchange the values.

    A rank whose ``local()`` raises (bad input) still takes part in the one exchange, flagged, so
    that every rank raises together instead of leaving the others waiting in a collective: the
    failing rank re-raises its own error, the others a ValueError naming it. Returns (result,
    {field: [value of rank 0, rank 1, ...]}) in group rank order.
    """
    err: Optional[BaseException] = None
    result = None
    row = torch.zeros(len(fields) + 1, dtype=torch.int64, device=device)
    try:
        result, values = local()
        row[:-1] = torch.as_tensor(values, dtype=torch.int64).to(device)
    except (TypeError, ValueError, RuntimeError, NotImplementedError) as e:
        err = e
        row.zero_()
        row[-1] = 1
    table = exchange_rows(row, group, device)
    bad = [r for r, t in enumerate(table) if t[-1]]
    if bad:
        if err is not None:
            raise err
        raise ValueError(
            f"nitrobrew vocab-parallel loss: rank(s) {bad} of the process group rejected their inputs (see the "
            "error raised there); every rank raises so that none is left waiting in a collective"
        )
    return result, {f: [t[i] for t in table] for i, f in enumerate(fields)}


def comm_device(t, group):
    """Where the exchange buffers live: t's device, or the current CUDA device for NCCL."""
    nccl = "nccl" in str(dist.get_backend(group))
    if isinstance(t, torch.Tensor) and not (nccl and t.device.type == "cpu"):
        return t.device
    if nccl:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def require_initialized() -> None:
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("process_group= needs torch.distributed to be initialized (init_process_group)")


def ids_summary(ids: Optional[Tensor], valid: Optional[Tensor], upper_check: bool) -> Tensor:
    """int64 [min, max, hash] of integer ids (min/max over the valid ones when upper_check).

    The hash (position-weighted, process independent) lets ranks verify they hold the same rows.
    """
    if ids is None:
        return torch.tensor([0, -1, 0], dtype=torch.int64)
    dev = ids.device
    flat = ids.reshape(-1).long()
    keep = torch.ones_like(flat, dtype=torch.bool) if valid is None else valid.reshape(-1)
    pos = torch.arange(flat.numel(), device=dev, dtype=torch.int64) % 1021 + 1
    h = (torch.where(keep, flat % 1000003 + 1, torch.zeros_like(flat)) * pos).sum()
    big = torch.iinfo(torch.int64).max
    if upper_check and flat.numel():
        lo = torch.where(keep, flat, torch.full_like(flat, big)).min()
        hi = torch.where(keep, flat, torch.full_like(flat, -1)).max()
        lo = torch.where(lo == big, torch.zeros_like(lo), lo)
    else:
        lo = torch.zeros((), dtype=torch.int64, device=dev)
        hi = torch.full((), -1, dtype=torch.int64, device=dev)
    return torch.stack([lo, hi, h])


def same_everywhere(table: dict, field: str, msg: str) -> None:
    if len(set(table[field])) > 1:
        raise ValueError(f"nitrobrew vocab-parallel loss: {msg} (per rank: {table[field]})")


def merge_online(states, group, extra=(), kl_pairs=()) -> List[Tensor]:
    """Merge this rank's ``Online`` states (one per side, [N] each) with the other ranks': one MAX
    all-reduce of the running maxima, then one SUM all-reduce of every sum rescaled to the global max
    (l; the KLs' a, r and b) and of the `extra` tensors (summed as they are, returned in order).
    kl_pairs: (own, other) states of the KLs: where own's sums underflow on the global max, other's
    mass on this rank is lost to own's close-distribution sum r, so it moves to other's b first."""
    m = all_reduce(torch.stack([o.m for o in states]), "max", group, "fwd_max")
    for own, other in kl_pairs:
        if other.b is not None:
            m_own = m[next(i for i, o in enumerate(states) if o is own)]
            safe = torch.where(torch.isfinite(m_own), m_own, torch.zeros_like(m_own))
            other.b = torch.where(torch.exp(own.m - safe) == 0, other.l, other.b)
    for o, m_global in zip(states, m):
        o.rescale_to(m_global)
    fields = [(o, name) for o in states for name in ("l", "a", "r", "b") if getattr(o, name) is not None]
    parts = [getattr(o, name) for o, name in fields] + list(extra)
    flat = all_reduce(torch.cat([p.reshape(-1) for p in parts]), "sum", group, "fwd_sum")
    out, at = [], 0
    for p in parts:
        out.append(flat[at : at + p.numel()].view(p.shape))
        at += p.numel()
    for (o, name), v in zip(fields, out):
        setattr(o, name, v)
    return out[len(fields) :]


def fail(msg: str):
    """A vocab-parallel argument error, raised the same on every rank."""
    raise ValueError(f"nitrobrew vocab-parallel loss: {msg}")


def check_rows_agree(table: dict) -> None:
    """Every rank of the group must hold the same rows and call with the same options."""
    for key, what in (
        ("rows", "number of rows (tokens)"),
        ("ds", "student hidden size"),
        ("dt", "teacher hidden size"),
        ("k", "number of stored ids per row"),
    ):
        if key in table:
            same_everywhere(table, key, f"every rank of the group must hold the same rows; {what} differs")
    same_everywhere(
        table,
        "options",
        "ranks called the loss with different options (divergence, beta/alpha, "
        "temperature, weights, reduction, vocab_size, ignore_index, dtype, requires_grad of xs or "
        "presence of biases/labels, or the plan: backend, chunk_V, memory_budget)",
    )
    for key in ("label_hash", "ids_hash"):
        if key in table:
            same_everywhere(
                table,
                key,
                f"ranks hold different {'labels' if key == 'label_hash' else 'top-k ids'}: "
                "every rank of the vocab-parallel group needs the same rows (split the batch over a "
                "separate data-parallel group)",
            )


def check_label_range(table: dict, V: int, what: str = "labels", lo_f="label_min", hi_f="label_max") -> None:
    lo, hi = min(table[lo_f]), max(table[hi_f])
    if hi >= 0 and (lo < 0 or hi >= V):
        fail(
            f"{what} must lie in [0, {V}) (global ids{', or equal ignore_index' if what == 'labels' else ''}), "
            f"found values in [{lo}, {hi}]"
        )
