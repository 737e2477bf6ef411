"""benchmarks/teacher_store.py --tiny runs on the CPU and writes its table."""

from __future__ import annotations

import importlib.util
import os

import pytest

pytest.importorskip("safetensors")
pytest.importorskip("transformers")


def test_teacher_store_benchmark_tiny(tmp_path):
    path = os.path.join(os.path.dirname(__file__), os.pardir, "benchmarks", "teacher_store.py")
    spec = importlib.util.spec_from_file_location("teacher_store_bench", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench.main(["--tiny", "--out", str(tmp_path), "--lens", "32", "--steps", "1"]) == 0
    text = (tmp_path / "teacher_store.md").read_text()
    for section in ("Bytes per position", "Extraction throughput", "Training step", "idle fraction", "fp8 rows"):
        assert section in text
    assert "| hidden | Dt=5120 | bfloat16 | 10240 |" in text
    assert (tmp_path / "teacher_store.csv").exists()
