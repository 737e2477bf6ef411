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
