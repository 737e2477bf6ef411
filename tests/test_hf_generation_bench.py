"""benchmarks/onpolicy_step.py --tiny: runs on CPU in seconds and writes its table."""

import csv
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

pytest.importorskip("transformers")
import onpolicy_step  # noqa: E402


def test_tiny_run_writes_the_tables(tmp_path):
    argv = ["--tiny", "--out", str(tmp_path), "--decode-batches", "2", "--backends", "hf", "static", "vllm"]
    argv += ["--sync-windows", "1", "--async-windows", "2"]
    assert onpolicy_step.main([*argv, "--profile"]) == 0
    md = (tmp_path / "onpolicy_step.md").read_text()
    for text in ("| hf | 2 |", "| static | 2 |", "| vllm | 2 |", "not installed", "x off-policy", "commit"):
        assert text in md, text
    rows = list(csv.DictReader(open(tmp_path / "onpolicy_step.csv")))
    # three decode rows; off-policy, SFT, on-policy extrapolated and measured; the async row (a CPU thread)
    assert [r["part"] for r in rows] == ["decode"] * 3 + ["step"] * 5
    steps = {r["kind"]: r for r in rows[3:]}
    assert list(steps) == [
        "off-policy",
        "SFT",
        "on-policy, extrapolated",
        "on-policy, synchronous",
        "on-policy, async",
    ]
    async_row = steps["on-policy, async"]
    assert async_row["backend"] == "static on cpu (the training device)" and async_row["windows"] == "2"
    assert async_row["staleness"] == "0 1 1"  # window 0 with the first weights, then one step behind
    for kind in ("on-policy, synchronous", "on-policy, async"):
        assert float(steps[kind]["step_s"]) > 0 and float(steps[kind]["x_off"]) > 0, kind
    assert "| 2 | on-policy, async | static on cpu (the training device) |" in md
    assert "decode steps" in (tmp_path / "profile_decode.txt").read_text()


def test_decode_and_step_tables_can_be_skipped(tmp_path):
    argv = ["--tiny", "--out", str(tmp_path), "--decode-batches", "--step-batches", "--no-async"]
    assert onpolicy_step.main(argv) == 0
    assert list(csv.DictReader(open(tmp_path / "onpolicy_step.csv"))) == []


def test_floor_bandwidth_by_device_name():
    assert onpolicy_step.hbm_bandwidth("NVIDIA H100 80GB HBM3") == 3.35e12
    assert onpolicy_step.hbm_bandwidth("NVIDIA H200") == 4.8e12
    assert onpolicy_step.hbm_bandwidth("cpu") is None
