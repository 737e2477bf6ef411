"""The automatic vocab chunk: by cache size on a CPU, by a 64 MiB slab on a GPU."""

import torch

from nitrobrew.core.online import _cache_bytes, auto_chunk_v


def test_cpu_chunk_keeps_the_slab_in_cache():
    budget = 2 * _cache_bytes()
    for rows, vocab in ((256, 65536), (64, 152064), (4096, 32000), (8, 65536)):
        chunk = auto_chunk_v(rows, vocab, device="cpu")
        assert chunk == vocab or chunk == 256 or rows * chunk * 4 <= budget < rows * 2 * chunk * 4, (rows, chunk)
    assert auto_chunk_v(256, 65536, device=torch.device("cpu")) < 65536  # was the whole vocabulary
    assert auto_chunk_v(3, 100, device="cpu") == 100


def test_gpu_chunk_is_unchanged():
    assert auto_chunk_v(256, 65536, device="cuda") == 65536
    assert auto_chunk_v(4096, 152064, device="cuda") == 4096


def test_callers_choose_the_chunk_by_the_tensors_device(monkeypatch, tmp_path):
    """On a GPU host a CPU tensor's chunk follows the cache rule: every caller passes its tensors' device
    (without it, auto_chunk_v takes a machine with CUDA for a GPU and sizes the slab for the GPU)."""
    import importlib
    from functools import partial

    import torch.distributed as dist

    import nitrobrew as nb
    from nitrobrew.core import online
    from nitrobrew.hidden import custom_op

    rows, vocab, dim = 8, 1000, 6
    monkeypatch.setattr(online, "_cache_bytes", lambda: 4096)  # a 2048-element slab: 256 columns for 8 rows
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    cpu, gpu = auto_chunk_v(rows, vocab, device="cpu"), auto_chunk_v(rows, vocab, device="cuda")
    assert (cpu, gpu) == (256, vocab)
    chunks = []

    def spy(*args, _caller, **kwargs):
        chunk = auto_chunk_v(*args, **kwargs)
        chunks.append((_caller, chunk))
        return chunk

    for name in ("hidden.chunked", "hidden.custom_op", "topk.chunked", "topk.vocab_parallel"):
        monkeypatch.setattr(importlib.import_module(f"nitrobrew.{name}"), "auto_chunk_v", partial(spy, _caller=name))

    g = torch.Generator().manual_seed(0)
    xs = torch.randn(rows, dim, generator=g, requires_grad=True)
    ws = torch.randn(vocab, dim, generator=g, requires_grad=True)
    xt, wt = torch.randn(rows, dim, generator=g), torch.randn(vocab, dim, generator=g)
    ids = torch.stack([torch.randperm(vocab, generator=g)[:4] for _ in range(rows)])
    lp = torch.log_softmax(torch.randn(rows, vocab, generator=g), -1).gather(1, ids)
    nb.forward_kl(xs, xt, ws, wt, backend="torch").backward()  # hidden/chunked.py: forward and backward
    nb.topk_kl(xs, ws, ids, lp, backend="torch").backward()  # topk/chunked.py: vocab_pass and backward_range
    # the custom op (what torch.compile traces), forward and backward, called eagerly
    mask = torch.ones(rows)
    scalars = dict(divergence="forward_kl", param=0.5, temperature=1.0, kd_weight=1.0, ce_weight=0.0)
    scalars.update(chunk_V=-1, filter_eps=-1.0, softcap_s=-1.0, softcap_t=-1.0, impl="torch", reduction="sum")
    scalars.update(mode="", memory_budget=-1)
    out = custom_op.hidden_distill(
        xs=xs, xt=xt, ws=ws, wt=wt, bs=None, bt=None, labels=None, mask=mask, need_grad=True, **scalars
    )
    custom_op.hidden_distill_backward(
        grad_total=torch.ones(()),
        stats=out[3],
        xs=xs,
        xt=xt,
        ws=ws,
        wt=wt,
        bs=None,
        bt=None,
        labels=None,
        mask=mask,
        **scalars,
    )
    # the vocab-parallel forms over a group of one (hidden: hidden/chunked.py TorchLocal)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        group = dist.new_group([0])
        nb.topk_kl(xs, ws, ids, lp, backend="torch", process_group=group).backward()
        nb.forward_kl(xs, xt, ws, wt, backend="torch", process_group=group).backward()
    finally:
        dist.destroy_process_group()
    callers = {name for name, _ in chunks}
    assert callers == {"hidden.chunked", "hidden.custom_op", "topk.chunked", "topk.vocab_parallel"}, callers
    assert all(chunk == cpu for _, chunk in chunks), chunks
