"""`nitrobrew bench topk` at CPU sizes: runs, writes its CSV, and its methods agree with float64."""

import csv

import pytest

from cli_helpers import cli_args
from nitrobrew.cli import main as cli_main

# The bench's tiny CPU sizes: one sequence length, one K, one timed run, 8 rows against float64.
TINY = dict(vocab=300, seq_lens=16, d_model=16, ks=4, reps=1, warmup=0, ref_rows=8)


def bench_topk(**options):
    return cli_args("bench", "topk", **{**TINY, **options})


def test_bench_topk_cpu(tmp_path, capsys):
    out = tmp_path / "topk.csv"
    assert cli_main(bench_topk(seq_lens=(16, 32), csv=out)) == 0
    rows = list(csv.DictReader(open(out)))
    assert {r["method"] for r in rows} == {"torch-full K=4", "torch-topk K=4"}
    assert {int(r["N"]) for r in rows} == {16, 32}
    assert {r["regime"] for r in rows} == {"lm"}  # the default regime
    for r in rows:
        assert r["baseline"].startswith("nitrobrew ") and "normalize=" in r["baseline"]
        assert float(r["ms"]) > 0 and float(r["peak_mib"]) >= 0
        if r["N"] == "16":
            assert float(r["rel_err"]) < 1e-4
    assert "torch-topk K=4" in capsys.readouterr().out


def test_bench_topk_extract_only(tmp_path):
    pytest.importorskip("transformers")
    out = tmp_path / "e.csv"
    assert cli_main(cli_args("bench", "topk", extract_only=True, vocab=300, ks=4, reps=2, csv=out)) == 0
    rows = list(csv.DictReader(open(out)))
    assert [r["method"] for r in rows][0] == "teacher forward + logits"
    assert all(float(r["tokens_per_s"]) > 0 for r in rows)
    assert "ids agree 1.0000" in rows[-1]["note"]


def test_bench_topk_triton_methods_under_the_interpreter(tmp_path):
    """The Triton methods at CPU sizes (TRITON_INTERPRET=1): their errors against float64, and each
    top-k row's ratio to the full row of its K."""
    from nitrobrew.core import checks as ck

    if not ck.interpreter_enabled():
        pytest.skip("needs TRITON_INTERPRET=1 (make test sets it)")
    out = tmp_path / "topk.csv"
    assert cli_main(bench_topk(device="cpu", methods=("full", "full-64m", "topk"), csv=out)) == 0
    rows = {r["method"]: r for r in csv.DictReader(open(out))}
    assert set(rows) == {"full K=4", "full-64m K=4", "topk K=4"}
    assert all(r["note"].split(":")[0] not in ("skipped", "error") for r in rows.values())
    assert all(float(r["rel_err"]) < 1e-4 for r in rows.values())
    ratio = float(rows["full K=4"]["ms"]) / float(rows["topk K=4"]["ms"])
    assert float(rows["topk K=4"]["full_over_topk"]) == pytest.approx(ratio)


def test_bench_topk_regimes_and_baselines(tmp_path, capsys):
    """Every regime named runs every method on the same tensors; rows that cannot run here (CCE needs
    CUDA, the Triton methods need CUDA or the interpreter) are notes and the exit status stays 0."""
    out = tmp_path / "topk.csv"
    regimes = ("lm", "flat", "spread", "peaked")
    methods = ("floor", "cce", "cce-exact", "torch-full", "topk-graph")
    assert cli_main(bench_topk(device="cpu", regimes=regimes, methods=methods, csv=out)) == 0
    rows = list(csv.DictReader(open(out)))
    assert [r["regime"] for r in rows[::5]] == ["lm", "flat", "spread", "peaked"]
    ent = {r["regime"]: float(r["teacher_entropy"]) for r in rows}
    assert ent["flat"] > ent["lm"] > ent["peaked"]
    by = {(r["regime"], r["method"]): r for r in rows}
    for g in ent:
        assert float(by[g, "torch-full K=4"]["rel_err"]) < 1e-4
        assert by[g, "cce"]["note"].startswith("skipped: ") and by[g, "cce"]["ms"] == ""
        assert "linear_cross_entropy, defaults" in by[g, "cce"]["baseline"]
        assert "filter_eps=None" in by[g, "cce-exact"]["baseline"]
        assert by[g, "topk-graph K=4"]["note"].startswith("skipped: ")


def test_bench_topk_failure_exits_nonzero(tmp_path, monkeypatch):
    from nitrobrew.bench import topk as tb

    def broken(method, *a):
        raise RuntimeError("boom")

    monkeypatch.setattr(tb, "_step", broken)
    assert cli_main(bench_topk(ref_rows=0)) == 1
