"""`nitrobrew bench attention` on CPU at tiny sizes: runs, prints, writes CSV and markdown."""

import csv

from attention_helpers import one_thread  # noqa: F401
from cli_helpers import cli_args
from nitrobrew.cli import main


def bench_attention(**options):
    """`nitrobrew bench attention` on CPU, one head of 8 and one timed run unless `options` say otherwise."""
    return cli_args("bench", "attention", **{**dict(device="cpu", heads=1, head_dim=8, reps=1, warmup=0), **options})


def test_bench_attention_cpu(tmp_path, capsys):
    out_csv, out_md = tmp_path / "a.csv", tmp_path / "a.md"
    rc = main(bench_attention(seq_lens=(48, 96), heads=2, head_dim=16, accuracy_n=32, csv=out_csv, md=out_md))
    assert rc == 0
    text = capsys.readouterr().out
    assert "fwd+bwd / SDPA default" in text and "nitrobrew" in text
    rows = list(csv.DictReader(open(out_csv)))
    methods = {(r["mode"], r["method"]) for r in rows}
    assert {("attention", m) for m in ("nitrobrew", "sdpa", "sdpa-flash", "sdpa-fwd", "sdpa-flash-fwd")} <= methods
    assert any(m == "accuracy" for m, _ in methods)
    speed = [r for r in rows if r["mode"] == "attention"]
    assert all(r["ms"] not in ("", "None") for r in speed)
    assert {r["regime"] for r in speed} == {"spread"}  # the default regime
    acc = [r for r in rows if r["mode"] == "accuracy" and r["method"].startswith("nitrobrew")]
    assert all(float(r["loss_rel_err"]) < 1e-4 for r in acc)
    assert "| N |" in out_md.read_text()


def test_bench_attention_regimes_and_sdpa_kernel(tmp_path, capsys):
    """--regimes: score-map regimes run every method on the same tensors, lm is a skipped row; the
    SDPA rows name their backend and the op the profiler saw it dispatch to."""
    out_csv, out_md = tmp_path / "a.csv", tmp_path / "a.md"
    methods, regimes = ("torch", "sdpa", "sdpa-flash"), ("lm", "flat", "spread", "peaked")
    rc = main(bench_attention(seq_lens=256, accuracy_n=0, methods=methods, regimes=regimes, csv=out_csv, md=out_md))
    assert rc == 0
    rows = list(csv.DictReader(open(out_csv)))
    assert rows[0]["regime"] == "lm" and rows[0]["note"].startswith("skipped: ") and rows[0]["ms"] == ""
    speed = [r for r in rows if r["ms"]]
    assert [r["regime"] for r in speed] == [g for g in ("flat", "spread", "peaked") for _ in range(3)]
    ent = {r["regime"]: float(r["teacher_entropy"]) for r in speed}
    assert ent["flat"] > ent["spread"] and abs(ent["peaked"] - 2.0) < 0.1
    sdpa = {r["method"]: r["baseline"] for r in speed if r["regime"] == "flat"}
    assert "SDPA default backend: aten::_scaled_dot_product" in sdpa["sdpa"]
    assert "sdpa_kernel(FLASH_ATTENTION)" in sdpa["sdpa-flash"]
    assert rows[0]["sdpa_default"].startswith("aten::_scaled_dot_product")
    md = out_md.read_text()
    assert "SDPA default backend dispatched to: aten::" in md and "| peaked (2.0 nats) | 256 |" in md


def test_bench_attention_failure_exits_nonzero(tmp_path, monkeypatch):
    from nitrobrew.bench import attention as ab

    def broken(*a, **k):
        raise RuntimeError("boom")

    monkeypatch.setattr(ab, "naive_kl", broken)
    out_csv = tmp_path / "a.csv"
    assert main(bench_attention(seq_lens=32, accuracy_n=0, methods=("naive", "sdpa"), csv=out_csv)) == 1
    by = {r["method"]: r for r in csv.DictReader(open(out_csv))}
    assert by["naive"]["note"].startswith("failed: RuntimeError") and by["sdpa"]["ms"]
