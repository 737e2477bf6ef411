"""Per-rank memory of the vocab-parallel hidden-state loss: one pair of logit slabs at a time.

The fast vocab-parallel plan makes a student and a teacher slab per block of rows; the peak per rank
is one such pair, dW of the rank's block and the fp32 dX the ranks all-reduce (the single-process
fast mode holds one pair, dW of the whole head and dX). A finished block's slabs kept alive while the
next block's are made doubles the slab memory (1.5x a single GPU's peak at V = 152064). A process
group of one rank (gloo, in this process) runs the vocab-parallel code; each block's slabs must be
gone when the next block's are made. (The Triton interpreter keeps the storages of its last launch,
so allocation counts on CPU cannot tell this apart: the slabs' lifetimes are checked instead.)
"""

from __future__ import annotations

import weakref

import pytest
import torch
import torch.distributed as dist

import nitrobrew as nb
import nitrobrew.hidden.triton_function as tf
from nitrobrew.hidden.triton_function import make_plan

pytest.importorskip("triton")
N, V, DS, DT = 48, 200, 16, 24
ROWS = 16  # three blocks of rows


@pytest.fixture
def one_rank_group(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def test_vocab_parallel_keeps_one_slab_pair(one_rank_group, monkeypatch):
    g = torch.Generator().manual_seed(0)
    xs = torch.randn(N, DS, generator=g).requires_grad_()
    xt = torch.randn(N, DT, generator=g)
    ws = (torch.randn(V, DS, generator=g) * 2).requires_grad_()
    wt = torch.randn(V, DT, generator=g) * 2
    budget = 8 * V * ROWS
    assert make_plan(N, V, DS, xs.dtype, "fast", None, budget, "mean").row_chunk == ROWS

    made, alive = [], []
    slabs = tf._slabs

    def tracked_slabs(*args):
        alive.append(sum(r() is not None for r in made))  # earlier blocks' slabs still referenced
        out = slabs(*args)
        made.extend(weakref.ref(t) for t in out)
        return out

    monkeypatch.setattr(tf, "_slabs", tracked_slabs)
    loss = nb.hidden_loss(
        xs, xt, ws, wt, divergence="jsd", backend="triton", memory_budget=budget, process_group=one_rank_group
    )
    dx, dw = torch.autograd.grad(loss, [xs, ws])
    assert len(alive) == 3, alive  # the fused plan: one slab pair per block, none recomputed
    assert alive == [0, 0, 0], f"slabs of finished blocks alive when the next block's were made: {alive}"
    want = nb.hidden_loss(xs, xt, ws, wt, divergence="jsd", backend="torch")
    torch.testing.assert_close(loss, want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(dx, torch.autograd.grad(want, [xs])[0], rtol=1e-4, atol=1e-6)
    assert dw.shape == ws.shape
