"""nitrobrew.hf helpers and the demo: a bad argument is a clear error naming it, at the call."""

import json
import math

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")
from nitrobrew.hf import distill_loss  # noqa: E402
from nitrobrew.hf.packing import document_ids, document_targets, model_inputs  # noqa: E402
from nitrobrew.hf.schedules import scheduled  # noqa: E402
from test_hf_trainer import student_model, teacher_model  # noqa: E402


def test_position_ids_that_go_back_inside_a_document_are_refused():
    assert document_ids(torch.tensor([[0, 1, 2, 0, 1, 5, 6]])).tolist() == [[1, 1, 1, 2, 2, 3, 3]]
    for bad in ([[0, 1, 2, 1, 2]], [[0, 1, 1, 2]], [[3, 4, 2]]):
        with pytest.raises(ValueError, match="position_ids go from .* column"):
            document_ids(torch.tensor(bad))
    with pytest.raises(ValueError, match="position_ids go from 2 to 1 at row 1, column 3"):
        document_targets(torch.zeros(2, 5, dtype=torch.long), torch.tensor([[0, 1, 2, 3, 4], [0, 1, 2, 1, 2]]))


def test_position_ids_of_the_wrong_width_are_named():
    model = student_model()
    ids = torch.ones(2, 6, dtype=torch.long)
    with pytest.raises(ValueError, match=r"position_ids \(1, 5\) must have the shape of input_ids \(2, 6\)"):
        model_inputs(model, ids, None, torch.arange(5)[None])
    with pytest.raises(ValueError, match="position_ids .* must have the shape"):
        document_targets(torch.zeros(2, 6, dtype=torch.long), torch.arange(7)[None])
    with pytest.raises(ValueError, match="position_ids .* must have the shape"):
        distill_loss(model, teacher_model(), ids, position_ids=torch.arange(4)[None])


def test_an_empty_sequence_is_named():
    with pytest.raises(ValueError, match=r"input_ids must be a \[B, N\] tensor with B, N >= 1, got \(1, 0\)"):
        distill_loss(student_model(), teacher_model(), torch.ones(1, 0, dtype=torch.long))


def test_schedule_values_must_be_finite():
    assert scheduled(2.0, 1.0, "linear", 1, 2) == 1.5
    for start, end in ((2.0, math.nan), (math.inf, 1.0), (2.0, "1")):
        with pytest.raises(ValueError, match="scheduled: (start|end) must be a finite number"):
            scheduled(start, end, "linear", 1, 2)
    with pytest.raises(TypeError, match="scheduled: step must be an int"):
        scheduled(2.0, 1.0, "cosine", 0.5, 2)


def test_demo_resume_from_a_broken_config_and_a_one_token_sequence(tmp_path, capsys):
    pytest.importorskip("safetensors")
    from nitrobrew.cli import main

    (tmp_path / "config.json").write_text("{not json")
    assert main(["demo", "--resume", "--out", str(tmp_path), "--preset", "tiny", "--threads", "1"]) == 2
    (tmp_path / "config.json").write_text(json.dumps([1, 2]))
    assert main(["demo", "--resume", "--out", str(tmp_path), "--preset", "tiny", "--threads", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and all(line.startswith("nitrobrew demo: --resume: ") for line in err), err
    assert "config.json is not a readable JSON file" in err[0] and "holds a list" in err[1]
    with pytest.raises(SystemExit) as exit_:
        main(["demo", "--seq-len", "1", "--threads", "1"])
    assert exit_.value.code == 2
    assert "--seq-len: must be >= 2" in capsys.readouterr().err
