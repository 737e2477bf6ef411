"""`nitrobrew demo` end to end at the tiny preset (seconds): outputs, resume, CLI."""

import json
import os

import pytest
import torch

from cli_helpers import one_line_exit_2

pytest.importorskip("transformers")
from nitrobrew.cli import main  # noqa: E402
from nitrobrew.demo.lm import METHODS, Interrupted, batch_indices, config_from, lr_at, run_demo, topk_available  # noqa: E402


def test_batches_and_learning_rate_are_functions_of_the_step():
    cfg = config_from("tiny")
    per_epoch = cfg.train_sequences // cfg.batch_size
    epoch = torch.cat([batch_indices(cfg, s) for s in range(per_epoch)])
    assert sorted(epoch.tolist()) == list(range(cfg.train_sequences))  # an epoch sees every sequence once
    assert torch.equal(batch_indices(cfg, 5), batch_indices(cfg, 5))
    assert not torch.equal(batch_indices(cfg, 0), batch_indices(cfg, per_epoch))
    lrs = [lr_at(cfg, s, 100) for s in range(100)]
    assert lrs[0] < lrs[cfg.warmup - 1] == pytest.approx(cfg.lr) and lrs[-1] == pytest.approx(0.1 * cfg.lr, rel=0.01)


def test_tiny_demo_end_to_end(tmp_path):
    results = run_demo(config_from("tiny"), str(tmp_path), progress=False)
    expected = ["teacher"] + [m for m in METHODS if m != "topk" or topk_available()]
    assert list(results["runs"]) == expected
    for name, r in results["runs"].items():
        assert r["curve"][0]["step"] == 0 and r["curve"][-1]["step"] == (12 if name == "teacher" else 8)
        assert all(0 < p["kl"] < 10 and 1 < p["ppl"] < 100 and 0 <= p["acc"] <= 1 for p in r["curve"])
        assert r["peak_mib"] > 0 and r["train_seconds"] > 0
        assert r["curve"][-1]["kl"] < r["curve"][0]["kl"]  # every model learned something
    text = (tmp_path / "demo_results.md").read_text()
    assert text.count("| student:") == len(expected) - 1 and "| teacher |" in text and "| source" in text
    assert text.count("| student: on-policy") == 2
    for name in ("on_policy_reverse_kl", "on_policy_jsd"):  # generation time: a part of the train time
        r = results["runs"][name]
        assert 0 < r["gen_seconds"] < r["train_seconds"]
    assert json.loads((tmp_path / "results.json").read_text())["runs"].keys() == results["runs"].keys()
    assert (tmp_path / "demo_curves.png").stat().st_size > 10_000


def _final_weights(out):
    from safetensors.torch import load_file

    ck = os.path.join(out, "checkpoints")
    return {f: load_file(os.path.join(ck, f)) for f in sorted(os.listdir(ck))}


@pytest.mark.parametrize("stop_after", [7, 12 + 8 + 5], ids=["in-teacher", "in-second-student"])
def test_resume_ends_where_an_uninterrupted_run_ends(tmp_path, stop_after):
    """Killed between checkpoints (every 3 steps), resumed: same weights, optimizer state, curves.
    The second student is on-policy: its samples are functions of the step too."""
    cfg = config_from("tiny", methods=["hard_labels", "on_policy_jsd", "topk"])
    whole = run_demo(cfg, str(tmp_path / "whole"), progress=False, plot=False)
    with pytest.raises(Interrupted):
        run_demo(cfg, str(tmp_path / "cut"), progress=False, plot=False, stop_after=stop_after)
    resumed = run_demo(cfg, str(tmp_path / "cut"), resume=True, progress=False, plot=False)
    for name in whole["runs"]:
        assert resumed["runs"][name]["curve"] == whole["runs"][name]["curve"], name
    a, b = _final_weights(str(tmp_path / "whole")), _final_weights(str(tmp_path / "cut"))
    assert a.keys() == b.keys()
    for f in a:
        assert a[f].keys() == b[f].keys()
        for k in a[f]:
            assert torch.equal(a[f][k], b[f][k]), (f, k)


def test_resume_refuses_other_settings(tmp_path):
    cfg = config_from("tiny", methods=["hard_labels"])
    run_demo(cfg, str(tmp_path), progress=False, plot=False)
    with pytest.raises(SystemExit, match="other settings.*student_steps"):
        run_demo(
            config_from("tiny", methods=["hard_labels"], student_steps=9),
            str(tmp_path),
            resume=True,
            progress=False,
            plot=False,
        )


def test_cli(tmp_path, capsys):
    out = str(tmp_path / "cli")
    assert (
        main(
            [
                "demo",
                "--preset",
                "tiny",
                "--out",
                out,
                "--quiet",
                "--no-plot",
                "--methods",
                "hard_labels,jsd",
                "--student-steps",
                "4",
                "--threads",
                "1",
            ]
        )
        == 0
    )
    text = capsys.readouterr().out
    assert "student: JSD" in text and "student: forward KL" not in text
    assert json.load(open(os.path.join(out, "config.json")))["student_steps"] == 4
    assert main(["demo", "--methods", "bogus", "--out", out]) == 2
    with pytest.raises(SystemExit):  # argparse: a boolean flag takes true/false, nothing else
        main(["demo", "--topk-tail", "maybe", "--out", out])
    assert (
        main(
            [
                "demo",
                "--preset",
                "tiny",
                "--out",
                out,
                "--quiet",
                "--no-plot",
                "--methods",
                "topk",
                "--topk-tail",
                "false",
                "--student-steps",
                "2",
            ]
        )
        == 0
    )
    assert json.load(open(os.path.join(out, "config.json")))["topk_tail"] is False
    argv = ["demo", "--preset", "tiny", "--out", out, "--quiet", "--methods", "on_policy_jsd", "--prompt-len", "16"]
    assert "--prompt-len must be between 1 and seq_len - 1" in one_line_exit_2(argv, capsys)
    if not torch.cuda.is_available():
        assert main(["demo", "--device", "cuda", "--out", out]) == 2
