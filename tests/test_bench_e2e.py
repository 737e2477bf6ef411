"""benchmarks/e2e_step.py --small and benchmarks/gpu_bench_regimes.sh on CPU: they run, write what
they say, skip the baselines that are not installed, and fail loudly."""

import csv
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

pytest.importorskip("transformers")
import e2e_step  # noqa: E402

TINY = ["--small", "--seq-len", "16", "--fit-lens", "32", "--steps", "1", "--warmup", "1"]


def test_e2e_step_error_exits_nonzero(tmp_path, monkeypatch):
    def broken(method, student, teacher):
        def fn(ids):
            raise RuntimeError("boom")

        return fn

    monkeypatch.setattr(e2e_step, "loss_fn", broken)
    assert e2e_step.main([*TINY, "--methods", "nitrobrew", "--out", str(tmp_path)]) == 1
    row = next(csv.DictReader(open(tmp_path / "e2e_step.csv")))
    assert row["note"].startswith("error: RuntimeError: boom")


def test_gpu_script_cpu_path(tmp_path):
    out = tmp_path / "out"
    env = {**os.environ, "PYTHON": sys.executable, "CUDA_VISIBLE_DEVICES": ""}
    env.pop("TRITON_INTERPRET", None)
    res = subprocess.run(
        ["bash", os.path.join(ROOT, "benchmarks", "gpu_bench_regimes.sh"), str(out)],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    log = (out / "log.txt").read_text() if (out / "log.txt").exists() else ""
    assert res.returncode == 0, res.stdout + log[-3000:]
    files = sorted(os.listdir(out))
    assert len(files) <= 8 and all((out / f).is_file() for f in files)
    assert {"hidden.csv", "topk.csv", "attention.csv", "e2e_step.csv", "bench.md", "log.txt"} <= set(files)
    for name in ("hidden.csv", "topk.csv"):
        rows = list(csv.DictReader(open(out / name)))
        assert [r for r in rows if r["regime"] == "lm"] and [r for r in rows if r["regime"] == "peaked"]
        assert all(r["commit"] for r in rows)
    md = (out / "bench.md").read_text()
    assert "nitrobrew bench hidden" in md and "nitrobrew bench topk" in md and "attention_kl benchmark" in md
    assert "Whole distillation step" in md and "| nitrobrew |" in md and "longest sequence that fits" in md
    # the whole step: every method a row, the baselines not installed here a note, not a crash
    rows = {r["method"]: r for r in csv.DictReader(open(out / "e2e_step.csv"))}
    assert list(rows) == list(e2e_step.METHODS)
    for m in ("nitrobrew", "hf-logits"):
        r = rows[m]
        assert float(r["tokens_per_s"]) > 0 and float(r["step_ms"]) > 0 and float(r["above_resident_gib"]) > 0
        assert r["max_seq_fit"] == "32" and r["seq_len"] == "16" and r["commit"] and r["device"]
    assert rows["nitrobrew"]["baseline"].startswith("nitrobrew ")
    assert rows["hf-logits"]["baseline"].startswith("transformers ")
    for m in ("trl-gkd", "liger-jsd"):
        r = rows[m]
        assert r["tokens_per_s"] == "" if r["note"].startswith("skipped") else float(r["tokens_per_s"]) > 0
    if "matplotlib" in sys.modules or __import__("importlib").util.find_spec("matplotlib"):
        assert (out / "e2e_step.png").stat().st_size > 1000
