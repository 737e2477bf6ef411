"""The benches' input regimes, their labels, and what every bench must do on any install: run
without Triton, record nitrobrew's own commit, fail loudly."""

import math
import os
import subprocess
import sys

import pytest
import torch

from cli_helpers import cli_args, one_line_exit_2
from nitrobrew.bench import common
from nitrobrew.bench import regimes as rg
from nitrobrew.cli import main

CPU = torch.device("cpu")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = dict(device="cpu", reps=1, warmup=0)  # the benches' CPU runs: one timed repetition, no warm-up


def test_parse_names_aliases_and_errors(capsys):
    assert rg.parse(["lm", "flat", "lm", "random"]) == ["lm", "flat", "spread"]
    assert rg.parse(["all"]) == list(rg.REGIMES)
    with pytest.raises(ValueError, match="unknown regime 'zipf'"):
        rg.parse(["zipf"])
    for argv in (
        ["bench", "--regimes", "zipf"],
        ["bench", "topk", "--regimes", "zipf"],
        ["bench", "attention", "--regimes", "zipf"],
    ):
        assert "unknown regime 'zipf'" in one_line_exit_2(argv + ["--device", "cpu"], capsys)


@pytest.mark.parametrize(
    "ds,dt,regimes", [(24, 40, ("flat", "spread", "lm", "peaked", "close")), (40, 24, ("flat", "spread"))]
)
def test_hidden_regimes_have_their_entropies(ds, dt, regimes):
    V, n = 16384, 64
    ent, kl = {}, {}
    for g in regimes:
        d = rg.make_hidden(g, n, V, ds, dt, torch.float32, CPU, seed=2)
        assert d.xs.shape == (n, ds) and d.ws.shape == (V, ds) and d.xt.shape == (n, dt) and d.wt.shape == (V, dt)
        assert d.xs.requires_grad and d.ws.requires_grad and not d.xt.requires_grad
        t, s = d.xt @ d.wt.t(), (d.xs @ d.ws.t()).detach()
        assert d.entropy == pytest.approx(float(rg.mean_entropy(t.double())), rel=1e-6)
        lp, lq = torch.log_softmax(t, -1), torch.log_softmax(s, -1)
        ent[g], kl[g] = d.entropy, float((lp.exp() * (lp - lq)).sum(-1).mean())
        if g in ("flat", "spread"):  # the stated logit spread, whatever Ds and Dt
            std = rg.FLAT_STD if g == "flat" else rg.SPREAD_STD
            assert float(t.std()) == pytest.approx(std, rel=0.1)
    assert ent["flat"] > math.log(V) - 0.2 > ent["spread"]
    if len(regimes) == 2:
        return
    assert 3.0 < ent["lm"] < 6.0 and ent["lm"] == pytest.approx(rg.LM_ENTROPY, abs=0.3)
    assert ent["peaked"] == pytest.approx(2.0, abs=0.2) and ent["close"] == pytest.approx(2.0, abs=0.2)
    assert kl["close"] < 0.01 < kl["flat"] < kl["peaked"]  # student ~ teacher only in close


def test_real_regime_is_a_decoder_run():
    pytest.importorskip("transformers")
    d = rg.make_hidden("real", 48, 256, 32, 64, torch.float32, CPU, seed=0)
    assert d.regime == "real" and d.xs.shape == (48, 32) and d.xt.shape == (48, 64) and d.wt.shape == (256, 64)
    assert torch.isfinite(d.xs).all() and 0 < d.entropy <= math.log(256)
    # final hidden states come out of the decoder's RMSNorm: rows of norm ~ sqrt(D)
    assert float(d.xt.norm(dim=-1).mean()) == pytest.approx(8.0, rel=0.2)


def _no_triton(*words, **options):
    """Run the CLI (`cli_args(*words, **options)`) in a fresh process where `import triton` fails, as on a CPU
    install without it."""
    argv = cli_args(*words, **options)
    code = f"import sys; sys.modules['triton'] = None\nfrom nitrobrew.cli import main\nsys.exit(main({argv!r}))"
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    env.pop("TRITON_INTERPRET", None)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)


def test_benches_run_without_triton(tmp_path):
    out = tmp_path / "t.csv"
    topk = dict(vocab=200, seq_lens=16, d_model=8, ks=4, ref_rows=4, regimes=("lm", "peaked"), csv=out)
    res = _no_triton("bench", "topk", **TINY, **topk, methods=("torch-full", "torch-topk", "full", "topk"))
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    assert "ModuleNotFoundError" not in res.stdout + res.stderr
    import csv

    rows = {(r["regime"], r["method"]): r for r in csv.DictReader(open(out))}
    for g in ("lm", "peaked"):
        assert float(rows[g, "torch-full K=4"]["ms"]) > 0 and float(rows[g, "torch-topk K=4"]["ms"]) > 0
        assert rows[g, "full K=4"]["note"].startswith("skipped: Triton not installed")
    res = _no_triton("bench", **TINY, vocab=128, d_models=(8, 8), seq_lens=16, ref_rows=4, methods=("torch", "fast"))
    assert res.returncode == 0 and "skipped: Triton not installed" in res.stdout, res.stdout[-2000:] + res.stderr
    attention = dict(seq_lens=32, heads=1, head_dim=8, accuracy_n=16, methods=("nitrobrew", "sdpa"))
    res = _no_triton("bench", "attention", **TINY, **attention)
    assert res.returncode == 0 and "fwd+bwd / SDPA default" in res.stdout, res.stdout[-2000:] + res.stderr


def test_commit_is_nitrobrews_not_the_working_directorys(tmp_path, monkeypatch):
    monkeypatch.delenv("NITROBREW_COMMIT", raising=False)
    repo = tmp_path / "other"
    repo.mkdir()
    git = ["git", "-c", "user.name=x", "-c", "user.email=x@x", "-c", "commit.gpgsign=false"]
    subprocess.run(git + ["init", "-q"], cwd=repo, check=True)
    subprocess.run(git + ["commit", "-q", "--allow-empty", "-m", "x"], cwd=repo, check=True)
    other = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=repo, capture_output=True, text=True
    ).stdout.strip()
    monkeypatch.chdir(repo)
    commit = common.environment()["commit"]
    assert other and not commit.startswith(other)
    pkg = os.path.dirname(os.path.abspath(common.__file__))
    ours = subprocess.run(["git", "-C", pkg, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    if ours.returncode == 0 and os.path.exists(os.path.join(ROOT, ".git")):
        assert commit.startswith(ours.stdout.strip())
    # outside any git tree: the installed version, said as such
    from nitrobrew import environment as env

    monkeypatch.setattr(env, "_git", lambda *a: "")
    assert env.nitrobrew_commit() == f"release {env.nitrobrew_version()} (no git tree)"
    monkeypatch.setenv("NITROBREW_COMMIT", "abc1234")  # a copy of the tree without .git
    assert common.environment()["commit"] == "abc1234"


def test_demo_regime_reads_a_demo_run(tmp_path, monkeypatch):
    """The trained-model regime: a demo run's teacher and student checkpoints on its held-out data."""
    pytest.importorskip("transformers")
    pytest.importorskip("safetensors")
    import dataclasses
    import json

    from nitrobrew.demo.checkpoint import save_checkpoint
    from nitrobrew.demo.lm import config_from, make_model

    run = tmp_path / "demo"
    monkeypatch.setenv(rg.DEMO_RUN_ENV, str(run))
    with pytest.raises(rg.RegimeUnavailable, match="finished `nitrobrew demo` run"):
        rg.make_hidden("demo", 40, 0, 0, 0, torch.float32, CPU, 0)
    cfg = config_from("tiny", methods=["forward_kl"])
    (run / "checkpoints").mkdir(parents=True)
    (run / "config.json").write_text(json.dumps(dataclasses.asdict(cfg)))
    teacher = make_model(cfg, cfg.teacher_hidden, cfg.teacher_layers, 1, CPU)
    student = make_model(cfg, cfg.student_hidden, cfg.student_layers, 2, CPU)
    save_checkpoint(str(run / "checkpoints" / "teacher.safetensors"), teacher, None, {"done": True})
    with pytest.raises(rg.RegimeUnavailable, match="no finished teacher and student"):
        rg.make_hidden("demo", 40, 0, 0, 0, torch.float32, CPU, 0)
    save_checkpoint(str(run / "checkpoints" / "forward_kl.safetensors"), student, None, {"done": True})
    d = rg.make_hidden("demo", 40, 999, 8, 8, torch.float32, CPU, 0)  # the bench's V, Ds, Dt give way
    assert d.xs.shape == (40, cfg.student_hidden) and d.xt.shape == (40, cfg.teacher_hidden)
    assert d.ws.shape == (cfg.vocab, cfg.student_hidden) and d.wt.shape == (cfg.vocab, cfg.teacher_hidden)
    assert torch.equal(d.wt, teacher.lm_head.weight.detach())
    assert 0 < d.entropy < math.log(cfg.vocab)
    path = tmp_path / "h.csv"
    argv = cli_args("bench", **TINY, seq_lens=40, methods=("naive", "torch"), ref_rows=8, regimes="demo", csv=path)
    assert main(argv) == 0
    import csv

    rows = list(csv.DictReader(open(path)))
    assert {(r["regime"], r["V"], r["Ds"], r["Dt"]) for r in rows} == {
        ("demo", str(cfg.vocab), str(cfg.student_hidden), str(cfg.teacher_hidden))
    }
    assert all(float(r["rel_err"]) < 1e-4 for r in rows)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["bench", "--d-models", "1", "8"], "--d-models must be an integer >= 2"),
        (["bench", "--seq-lens", "0"], "--seq-lens must be an integer >= 1"),
        (["bench", "topk", "--ks", "0"], "--ks must be an integer >= 1"),
        (["bench", "topk", "--vocab", "1"], "--vocab must be an integer >= 2"),
        (["bench", "attention", "--heads", "4", "--kv-heads", "3"], "--kv-heads 3 must divide --heads 4"),
        (["bench", "attention", "--seq-lens", "-8"], "--seq-lens must be an integer >= 1"),
    ],
)
def test_bad_sizes_are_one_line_before_any_work(argv, message, capsys):
    assert message in one_line_exit_2(argv + ["--device", "cpu"], capsys)


def test_plots_draw_one_curve_per_method_and_regime(tmp_path):
    pytest.importorskip("matplotlib")
    rows = [
        common.Row("topk", m, {"regime": g, "N": n}, ms=1.0 + n / 64, peak_mib=1.0)
        for g in ("lm", "flat")
        for m in ("a", "b")
        for n in (16, 32)
    ]
    labels = {r.method for r in common.per_regime(rows)}
    assert labels == {"a [lm]", "b [lm]", "a [flat]", "b [flat]"}
    one = [r for r in rows if r.size["regime"] == "lm"]
    assert common.per_regime(one) == one
    png = tmp_path / "p.png"
    assert common.plot(str(png), common.per_regime(rows), "N", "t") and png.stat().st_size > 1000
