"""Asynchronous rollouts on CPU: two model copies, a background thread, the staleness bound, determinism."""

import copy
import threading

import pytest
import torch

pytest.importorskip("transformers")
from nitrobrew.hf import distill_loss  # noqa: E402
from nitrobrew.hf.generation import Sampling, StaticCacheGenerator  # noqa: E402
from nitrobrew.hf.generation.async_rollouts import AsyncRollouts, StalenessError  # noqa: E402
from nitrobrew.hf.onpolicy import assemble  # noqa: E402
from test_hf_generation import prompts, qwen2  # noqa: E402

WINDOWS = 4


def sampling(j):
    return Sampling(max_new_tokens=6, temperature=1.0, top_k=30, pad_token_id=0, seed=100 + j)


def train(staleness, seed=0):
    """A training loop that trains window k while the thread generates window k + staleness."""
    student, teacher = qwen2(seed), qwen2(seed + 1)
    engine = StaticCacheGenerator(copy.deepcopy(student), prompt_bucket=8, cache_bucket=16)
    opt = torch.optim.SGD(student.parameters(), lr=0.5)
    windows = [prompts(3, 5 + j % 3, seed=j) for j in range(WINDOWS)]
    snapshots, batches = [copy.deepcopy(student.state_dict())], []
    with AsyncRollouts(engine, staleness=staleness) as rollouts:
        ahead = 0
        for k in range(WINDOWS):
            while ahead < min(k + staleness + 1, WINDOWS):  # submit up to window k + staleness
                rollouts.submit(*windows[ahead], sampling(ahead))
                ahead += 1
            c = rollouts.result(k)
            assert k - c.weight_version <= staleness
            ids, mask = windows[k]
            b = assemble(*_left(ids, mask), c, 0)
            batches.append((c.weight_version, c.ids.clone()))
            loss = distill_loss(student, teacher, b.input_ids, b.attention_mask, b.labels, divergence="jsd").loss
            opt.zero_grad()
            loss.backward()
            opt.step()
            snapshots.append(copy.deepcopy(student.state_dict()))
            rollouts.sync_weights(student)
    return batches, snapshots, windows


def _left(ids, mask):
    from nitrobrew.hf.onpolicy import left_pad

    return left_pad(ids, mask, 0)


@pytest.mark.parametrize("staleness", [0, 1, 2])
def test_staleness_bound_and_exact_weights(staleness):
    batches, snapshots, windows = train(staleness)
    versions = [v for v, _ in batches]
    assert versions == [max(0, k - staleness) for k in range(WINDOWS)]
    # Each window's completions are exactly those of the student at its recorded version.
    for k, (v, ids) in enumerate(batches):
        model = qwen2(0)
        model.load_state_dict(snapshots[v])
        again = StaticCacheGenerator(model, prompt_bucket=8, cache_bucket=16).generate(*_left(*windows[k]), sampling(k))
        assert torch.equal(again.ids, ids), k


def test_deterministic_with_a_seed():
    a, sa, _ = train(1)
    b, sb, _ = train(1)
    assert all(va == vb and torch.equal(x, y) for (va, x), (vb, y) in zip(a, b))
    for n in sa[-1]:
        assert torch.equal(sa[-1][n], sb[-1][n]), n


def test_a_late_window_is_refused_and_errors_reach_the_trainer():
    student = qwen2(0)
    engine = StaticCacheGenerator(copy.deepcopy(student), prompt_bucket=8, cache_bucket=16)
    ids, mask = _left(*prompts())
    with AsyncRollouts(engine, staleness=0) as rollouts:
        rollouts.submit(ids, mask, sampling(0))
        rollouts.submit(ids, mask, sampling(1))
        rollouts.result(0)
        # Two steps synced while window 1 (generated with version 0) waited: older than the bound allows.
        rollouts.sync_weights(student)
        rollouts.sync_weights(student)
        with pytest.raises(StalenessError, match="staleness bound 0"):
            rollouts.result(1)
        bad = Sampling(max_new_tokens=3, temperature=0.0, pad_token_id=0)
        j = rollouts.submit(ids + 1000, mask, bad)  # ids outside the embedding
        with pytest.raises(RuntimeError, match=f"generation of window {j} failed"):
            rollouts.result(j, timeout=60)
    with pytest.raises(ValueError, match="staleness"):
        AsyncRollouts(engine, staleness=-1)


def test_rollout_thread_has_cuda_graph_tree_state():
    # torch <= 2.11 sets the CUDA-graph trees' per-thread state up in the main thread and autograd's threads
    # only: a CUDA-graphed compiled decode in the rollout thread failed with a bare AssertionError.
    from torch._inductor import cudagraph_trees

    from nitrobrew.hf.generation.async_rollouts import _init_compile_thread_state

    seen = {}

    def probe():
        seen["before"] = hasattr(cudagraph_trees.local, "tree_manager_containers")
        _init_compile_thread_state()
        seen["after"] = isinstance(getattr(cudagraph_trees.local, "tree_manager_containers", None), dict)

    t = threading.Thread(target=probe)
    t.start()
    t.join()
    assert seen == {"before": False, "after": True}
