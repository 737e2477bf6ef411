"""`nitrobrew demo` pieces: the source language, checkpoints, progress, and the toy pictures."""

import itertools
import os
import sys

import pytest
import torch

from nitrobrew.demo.checkpoint import load_checkpoint, read_record, save_checkpoint
from nitrobrew.demo.progress import Progress
from nitrobrew.demo.source import HMMSource

# ------------------------------------------------------------------------------- the source language


def test_next_token_probs_match_brute_force():
    """The forward algorithm against summing over every hidden path, in float64."""
    src = HMMSource.make(vocab=5, states=3, successors=2, words_per_state=3, seed=3)
    tokens = src.sample(6, 4, seed=4)
    got = src.next_token_probs(tokens)

    def joint(seq):
        total = 0.0
        for path in itertools.product(range(3), repeat=len(seq)):
            p = src.initial[path[0]] * src.emissions[path[0], seq[0]]
            for a, b, w in zip(path, path[1:], seq[1:]):
                p = p * src.transitions[a, b] * src.emissions[b, w]
            total += p
        return total

    for n in range(tokens.shape[0]):
        seq = tokens[n].tolist()
        for t in range(len(seq) - 1):
            want = torch.stack([joint(seq[: t + 1] + [v]) for v in range(5)]) / joint(seq[: t + 1])
            torch.testing.assert_close(got[n, t], want, rtol=1e-10, atol=1e-12)


def test_samples_follow_the_exact_conditionals():
    """E[1{x_t+1 = v}] = E[p(v | prefix)]: sampler and forward algorithm agree."""
    src = HMMSource.make(vocab=12, states=5, seed=1)
    tokens = src.sample(40000, 8, seed=2)
    probs = src.next_token_probs(tokens)
    empirical = torch.nn.functional.one_hot(tokens[:, 1:], 12).double().mean((0, 1))
    torch.testing.assert_close(empirical, probs.mean((0, 1)), rtol=0, atol=3e-3)  # ~3 standard errors
    assert torch.equal(tokens, src.sample(40000, 8, seed=2))  # deterministic in the seed
    assert (src.emissions.sum(0) > 0).all()  # every word can be said


# ------------------------------------------------------------------------------------- checkpoints


def _model():
    torch.manual_seed(0)
    emb = torch.nn.Embedding(7, 5)
    model = torch.nn.Sequential(emb, torch.nn.Linear(5, 7))
    model[1].weight = emb.weight  # tied, like the demo's models
    return model


def test_checkpoint_roundtrip_is_bit_exact(tmp_path):
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(3):
        model(torch.randint(0, 7, (4,))).square().mean().backward()
        opt.step()
        opt.zero_grad()
    path = str(tmp_path / "a.safetensors")
    save_checkpoint(path, model, opt, {"step": 3, "curve": [{"kl": 0.5}]})
    assert os.listdir(tmp_path) == ["a.safetensors"]  # no temporary file left behind
    other = _model()
    with torch.no_grad():
        for p in other.parameters():
            p.normal_()
    opt2 = torch.optim.AdamW(other.parameters(), lr=1e-2)
    record = load_checkpoint(path, other, opt2)
    assert record == {"step": 3, "curve": [{"kl": 0.5}]} == read_record(path)
    for a, b in zip(model.state_dict().values(), other.state_dict().values()):
        assert torch.equal(a, b)
    assert other[1].weight is other[0].weight
    for s1, s2 in zip(opt.state.values(), opt2.state.values()):
        for key in s1:
            assert torch.equal(torch.as_tensor(s1[key]), torch.as_tensor(s2[key]))
    assert opt2.param_groups[0]["lr"] == 1e-2


def test_interrupted_write_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    import nitrobrew.demo.checkpoint as ck

    model = _model()
    path = str(tmp_path / "a.safetensors")
    save_checkpoint(path, model, None, {"step": 1})

    def crash(fd):  # killed after the new bytes were written, before the rename
        raise KeyboardInterrupt

    monkeypatch.setattr(ck.os, "fsync", crash)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(path, model, None, {"step": 2})
    monkeypatch.undo()
    assert read_record(path) == {"step": 1}
    assert os.listdir(tmp_path) == ["a.safetensors"]  # the partial file was removed


def test_progress_without_tqdm(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "tqdm", None)
    monkeypatch.setitem(sys.modules, "tqdm.auto", None)
    with Progress(20, "work") as bar:
        for _ in range(20):
            bar.update(1, loss=0.5)
    out = capsys.readouterr().out
    assert "work: 0/20" in out and "work: 20/20" in out and "loss=0.5" in out


# ---------------------------------------------------------------------------------------- the toy


def test_toy_modes_forward_covers_reverse_picks():
    from nitrobrew.demo.toy import two_modes

    fits = two_modes(steps=300, progress=False)["fits"]
    assert abs(fits["forward_kl"]["mu"] - 0.44) < 0.3 and fits["forward_kl"]["sigma"] > 2.0
    assert abs(fits["reverse_kl"]["mu"] - 2.2) < 0.1 and abs(fits["reverse_kl"]["sigma"] - 0.6) < 0.1


def test_toy_rank_and_outputs(tmp_path):
    from nitrobrew.demo.toy import rank_chase, run_toy

    pytest.importorskip("matplotlib")

    res = rank_chase(ranks=(3, 12), features=6, V=16, N=64, steps=150, progress=False)
    for div, dist in res["curves"][3].items():
        assert dist[-1] < 0.1 * dist[0], div  # in reach: the distance collapses
    for div, dist in res["curves"][12].items():
        assert dist[-1] > 0.1, div  # out of reach: it cannot
    paths = run_toy(str(tmp_path), progress=False, mode_steps=20, rank_steps=5)["paths"]
    for key in ("table", "modes", "rank"):
        assert os.path.getsize(paths[key]) > 100


def test_demo_cli_reports_a_corrupted_checkpoint_in_one_line(monkeypatch, capsys, tmp_path):
    """A corrupted checkpoint met by `nitrobrew demo --resume` is one line naming the file, exit 2."""
    from nitrobrew import cli
    from nitrobrew.demo import lm
    from nitrobrew.demo.checkpoint import CheckpointError

    def corrupted(*_args, **_kwargs):
        raise CheckpointError(f"checkpoint {tmp_path}/teacher.safetensors is corrupted: its sha256 does not match")

    monkeypatch.setattr(lm, "run_demo", corrupted)
    assert cli.main(["demo", "--preset", "tiny", "--out", str(tmp_path), "--resume", "--threads", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("nitrobrew demo: checkpoint") and "teacher.safetensors" in err[-1]
    assert not any("Traceback" in line for line in err)
