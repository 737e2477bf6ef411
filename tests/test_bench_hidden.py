"""`nitrobrew bench hidden` at tiny sizes on CPU: CSV columns, agreement with the reference,
the regimes' construction, skipped and failing methods."""

import csv
import math

import pytest
import torch

from cli_helpers import one_line_exit_2
from nitrobrew.bench import baselines as bl
from nitrobrew.bench import hidden as hb
from nitrobrew.cli import main

TINY = [
    "--device",
    "cpu",
    "--vocab",
    "384",
    "--d-models",
    "24",
    "40",
    "--reps",
    "1",
    "--warmup",
    "1",
    "--ref-rows",
    "32",
]


def _run(tmp_path, *extra):
    path = tmp_path / "bench.csv"
    assert main(["bench", *TINY, "--csv", str(path), *extra]) == 0
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def _f(row, key):
    return float(row[key])


def test_csv_columns_and_naive_agrees_with_nitrobrew(tmp_path, capsys):
    rows = _run(tmp_path, "--seq-lens", "40", "72", "--methods", "floor", "naive", "torch", "liger-fused")
    expected = {
        "mode",
        "method",
        "regime",
        "N",
        "V",
        "Ds",
        "Dt",
        "divergence",
        "ms",
        "peak_mib",
        "rel_err",
        "err_loss",
        "err_dx",
        "err_dw",
        "x_floor",
        "first_s",
        "loss",
        "teacher_entropy",
        "note",
        "baseline",
        "device",
        "torch",
        "triton",
        "nitrobrew",
        "commit",
        "dtype",
        "liger_kernel",
        "cut_cross_entropy",
    }
    assert expected <= set(rows[0]), expected - set(rows[0])
    by = {(r["method"], int(r["N"])): r for r in rows}
    assert set(by) == {(m, n) for m in ("gemm floor", "naive", "nitrobrew torch", "liger fused") for n in (40, 72)}
    for n in (40, 72):
        floor, naive, nb = by["gemm floor", n], by["naive", n], by["nitrobrew torch", n]
        assert floor["divergence"] == "-" and _f(floor, "x_floor") == pytest.approx(1.0)
        for r in (floor, naive, nb):
            assert _f(r, "ms") > 0 and _f(r, "peak_mib") > 0 and r["note"] == ""
            assert r["V"] == "384" and r["Ds"] == "24" and r["Dt"] == "40" and r["dtype"] == "float32"
        for r in (naive, nb):
            assert r["divergence"] == "forward_kl" and r["mode"] == "hidden"
            assert _f(r, "rel_err") < 1e-4, r
            assert _f(r, "rel_err") == max(_f(r, k) for k in ("err_loss", "err_dx", "err_dw"))
            assert _f(r, "x_floor") == pytest.approx(_f(r, "ms") / _f(floor, "ms"))
            assert _f(r, "loss") > 0.1  # lm regime (the default): student = teacher + logit noise of std 1
            assert r["regime"] == "lm" and 3.0 < _f(r, "teacher_entropy") < 6.0
        assert _f(naive, "loss") == pytest.approx(_f(nb, "loss"), rel=1e-5)
        # a baseline that cannot run here is a row with a note, not a crash
        assert by["liger fused", n]["ms"] == "" and by["liger fused", n]["note"]
        assert by["naive", n]["baseline"].startswith("torch ") and "eager" in by["naive", n]["baseline"]
        assert by["nitrobrew torch", n]["baseline"].startswith("nitrobrew ")
        assert by["liger fused", n]["baseline"].startswith("liger-kernel ")  # with its version ("absent" here)
    out = capsys.readouterr().out
    assert "x floor" in out and "nitrobrew torch" in out and "commit=" in out


def test_all_divergences_and_ratio_column(tmp_path, capsys):
    rows = _run(tmp_path, "--seq-lens", "48", "--methods", "naive", "torch", "--divergences", "all")
    nb = {r["divergence"]: r for r in rows if r["method"] == "nitrobrew torch"}
    assert set(nb) == set(hb.DIVERGENCES)
    assert _f(nb["forward_kl"], "vs_fkl") == pytest.approx(1.0)
    for div, r in nb.items():
        assert _f(r, "rel_err") < 1e-3, (div, r)
        assert _f(r, "vs_fkl") == pytest.approx(_f(r, "ms") / _f(nb["forward_kl"], "ms"))
    # baselines measure forward_kl only
    assert [r["divergence"] for r in rows if r["method"] == "naive"] == ["forward_kl"]
    assert "other divergences vs forward_kl" in capsys.readouterr().out


def test_regimes_time_every_method_on_the_same_tensors(tmp_path, capsys):
    rows = _run(
        tmp_path, "--seq-lens", "32", "--methods", "naive", "torch", "--regimes", "lm", "flat", "spread", "peaked"
    )
    assert [r["regime"] for r in rows] == [g for g in ("lm", "flat", "spread", "peaked") for _ in (0, 1)]
    by = {(r["regime"], r["method"]): r for r in rows}
    ent = {g: _f(by[g, "naive"], "teacher_entropy") for g in ("lm", "flat", "spread", "peaked")}
    assert ent["flat"] > ent["lm"] > ent["peaked"] and ent["flat"] > ent["spread"]
    assert 3.0 < ent["lm"] < 6.0 and ent["peaked"] == pytest.approx(2.0, abs=0.2)
    for g in ent:
        naive, nb = by[g, "naive"], by[g, "nitrobrew torch"]
        assert _f(naive, "ms") > 0 and _f(nb, "ms") > 0 and _f(nb, "rel_err") < 1e-3
        assert nb["teacher_entropy"] == naive["teacher_entropy"]
        assert _f(naive, "loss") == pytest.approx(_f(nb, "loss"), rel=1e-5)  # same tensors
    assert "mean teacher entropy" in capsys.readouterr().out


def test_close_regime_breaks_bf16_logits_but_not_nitrobrew():
    """The 'close' data must be the case where logits rounded to bf16 before the softmax fail."""
    d = hb.make_data("close", 64, 1024, 32, 48, torch.bfloat16, torch.device("cpu"), seed=3)
    ref = hb.reference(d, 64, "forward_kl", 1.0)
    naive = hb.accuracy(hb._loss_fn("naive", None, d.xs.device), d, 64, "forward_kl", 1.0, ref)
    nb = hb.accuracy(hb._loss_fn("torch", None, d.xs.device), d, 64, "forward_kl", 1.0, ref)
    assert nb["err_dx"] < 1e-2 and nb["err_dw"] < 1e-2 and nb["err_loss"] < 1e-3
    assert naive["err_dx"] > 10 * nb["err_dx"] and naive["err_loss"] > 1e-2
    # and student and teacher really are close: a small KL
    assert 0 < ref.loss < 0.05


def test_peaked_entropy_is_calibrated():
    d = hb.make_data("peaked", 96, 2048, 40, 24, torch.float32, torch.device("cpu"), seed=5)
    assert hb.teacher_entropy(d, 96) == pytest.approx(hb.PEAKED_ENTROPY, abs=0.3)
    assert d.xs.shape == (96, 40) and d.ws.shape == (2048, 40) and d.xt.shape == (96, 24)
    assert d.xs.requires_grad and d.ws.requires_grad and not d.xt.requires_grad


def test_error_columns_catch_a_wrong_loss():
    d = hb.make_data("random", 32, 256, 16, 24, torch.float32, torch.device("cpu"), seed=1)
    ref = hb.reference(d, 32, "forward_kl", 1.0)

    def wrong(xs, xt, ws, wt, labels, divergence, temperature):  # the KL the wrong way round
        return bl.naive_loss(xs, xt, ws, wt, "reverse_kl", 0.0, temperature)

    assert hb.accuracy(wrong, d, 32, "forward_kl", 1.0, ref)["err_dx"] > 0.1


def test_oom_and_errors_become_notes(tmp_path, monkeypatch):
    real = hb._loss_fn

    def fake(key, chunk_v, device, *rest):
        if key == "naive":

            def oom(*a, **k):
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 9 GiB")

            return oom
        return real(key, chunk_v, device, *rest)

    monkeypatch.setattr(hb, "_loss_fn", fake)
    rows = _run(tmp_path, "--seq-lens", "24", "--methods", "naive", "torch")
    by = {r["method"]: r for r in rows}
    assert by["naive"]["note"] == "OOM" and by["naive"]["ms"] == ""
    assert _f(by["nitrobrew torch"], "ms") > 0


def test_a_failing_method_makes_the_exit_status_nonzero(tmp_path, monkeypatch, capsys):
    real = hb._loss_fn

    def fake(key, chunk_v, device, *rest):
        if key == "naive":

            def broken(*a, **k):
                raise RuntimeError("boom")

            return broken
        return real(key, chunk_v, device, *rest)

    monkeypatch.setattr(hb, "_loss_fn", fake)
    path = tmp_path / "b.csv"
    assert main(["bench", *TINY, "--seq-lens", "24", "--methods", "naive", "torch", "--csv", str(path)]) == 1
    by = {r["method"]: r for r in csv.DictReader(open(path))}
    assert by["naive"]["note"].startswith("error: RuntimeError: boom")
    assert _f(by["nitrobrew torch"], "ms") > 0  # the others still ran
    assert "FAILED: naive" in capsys.readouterr().out


def test_gemm_floor_row_chunks():
    g = torch.Generator().manual_seed(0)
    xs, xt = torch.randn(10, 8, generator=g), torch.randn(10, 12, generator=g)
    ws, wt = torch.randn(64, 8, generator=g), torch.randn(64, 12, generator=g)
    bl.gemm_floor(xs, xt, ws, wt, torch.randn(4, 64, generator=g))  # 3 row chunks
    bl.gemm_floor(xs, xt, ws, wt, torch.randn(16, 64, generator=g))  # one shot
    assert bl.floor_chunk_rows(1 << 20, 1 << 20, 2, torch.device("cpu")) < 1 << 20
    c = bl.floor_chunk_rows(1 << 20, 1 << 20, 2, torch.device("cpu"))
    assert c & (c - 1) == 0 and 3 * c * (1 << 20) * 2 <= 4 * 2**30


def test_bad_arguments(capsys):
    assert "unknown divergence 'kl'" in one_line_exit_2(["bench", *TINY, "--divergences", "kl"], capsys)
    assert "unknown regime 'nope'" in one_line_exit_2(["bench", *TINY, "--regimes", "nope"], capsys)
    assert "--methods" in one_line_exit_2(["bench", *TINY, "--methods", "nope"], capsys)


def test_plot(tmp_path):
    pytest.importorskip("matplotlib")
    png = tmp_path / "b.png"
    _run(tmp_path, "--seq-lens", "16", "32", "--methods", "floor", "naive", "--plot", str(png))
    assert png.stat().st_size > 1000 and not math.isnan(png.stat().st_size)
