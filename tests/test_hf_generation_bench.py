"""benchmarks/onpolicy_step.py --tiny: runs on CPU in seconds and writes its table."""

import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

pytest.importorskip("transformers")
import onpolicy_step  # noqa: E402


def test_tiny_run_writes_the_tables(tmp_path):
    argv = ["--tiny", "--out", str(tmp_path), "--decode-batches", "2", "--backends", "hf", "static", "vllm"]
    assert onpolicy_step.main([*argv, "--profile"]) == 0
    md = (tmp_path / "onpolicy_step.md").read_text()
    for text in ("| hf | 2 |", "| static | 2 |", "| vllm | 2 |", "not installed", "on / off", "commit"):
        assert text in md, text
    rows = (tmp_path / "onpolicy_step.csv").read_text().splitlines()
    assert len(rows) == 1 + 3 + 1 + 1  # header, three decode rows, one step row, the async row (CPU thread)
    assert "| 2 | static on cpu |" in md
    assert "decode steps" in (tmp_path / "profile_decode.txt").read_text()


def test_floor_bandwidth_by_device_name():
    assert onpolicy_step.hbm_bandwidth("NVIDIA H100 80GB HBM3") == 3.35e12
    assert onpolicy_step.hbm_bandwidth("NVIDIA H200") == 4.8e12
    assert onpolicy_step.hbm_bandwidth("cpu") is None
