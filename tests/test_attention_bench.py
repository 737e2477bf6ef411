"""`nitrobrew bench attention` on CPU at tiny sizes: runs, prints, writes CSV and markdown."""
import csv

from attention_helpers import one_thread  # noqa: F401
from nitrobrew.cli import main


def test_bench_attention_cpu(tmp_path, capsys):
    out_csv, out_md = tmp_path / "a.csv", tmp_path / "a.md"
    rc = main(["bench", "attention", "--device", "cpu", "--seq-lens", "48", "96", "--heads", "2",
               "--head-dim", "16", "--accuracy-n", "32", "--reps", "1", "--warmup", "0",
               "--csv", str(out_csv), "--md", str(out_md)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "fwd+bwd / SDPA" in text and "nitrobrew" in text
    rows = list(csv.DictReader(open(out_csv)))
    methods = {(r["mode"], r["method"]) for r in rows}
    assert ("attention", "nitrobrew") in methods and ("attention", "sdpa") in methods
    assert any(m == "accuracy" for m, _ in methods)
    speed = [r for r in rows if r["mode"] == "attention"]
    assert all(r["ms"] not in ("", "None") for r in speed)
    acc = [r for r in rows if r["mode"] == "accuracy" and r["method"].startswith("nitrobrew")]
    assert all(float(r["loss_rel_err"]) < 1e-4 for r in acc)
    assert "| N |" in out_md.read_text()
