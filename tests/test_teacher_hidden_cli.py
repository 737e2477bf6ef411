"""``nitrobrew teacher-export`` / ``teacher-import``: round trip, refusals that write nothing, one-line errors;
and the store commands' ``--help`` without torch."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("safetensors")
pytest.importorskip("pyarrow")

from nitrobrew.cli import main as cli_main  # noqa: E402
from nitrobrew.teacher.extract import Teacher, extract_hidden  # noqa: E402
from nitrobrew.teacher.store import sha256_file  # noqa: E402

V, D = 30, 8
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _teacher():
    g = torch.Generator().manual_seed(0)
    emb, head, bias = torch.randn(V, D, generator=g), torch.randn(V, D, generator=g), torch.randn(V, generator=g)

    def hidden(ids, mask):
        x = emb[ids] * mask[..., None]
        return x.cumsum(1) / torch.arange(1, ids.shape[1] + 1)[None, :, None]

    return Teacher(hidden, head, bias, "toy", V)


def _seqs(n=9):
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, V, (int(torch.randint(1, 9, (1,), generator=g)),), generator=g).tolist() for _ in range(n)]


def _store(path, dtype="bfloat16"):
    seqs = _seqs()
    plen = [min(2, len(s)) for s in seqs]
    extract_hidden(_teacher(), seqs, str(path), hidden_dtype=dtype, prompt_lengths=plen, sequences_per_shard=4)
    return str(path)


def _files(path):
    """Every file under `path` (dot files too: a lock or a partial directory is something written)."""
    out = {}
    for root, _, names in os.walk(path):
        for n in names:
            full = os.path.join(root, n)
            out[os.path.relpath(full, path)] = open(full, "rb").read()
    return out


def _one_line_error(capsys, command):
    err = capsys.readouterr().err
    assert err.startswith(f"nitrobrew {command}: error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    return err


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "fp8"])
def test_round_trip_through_the_cli_is_bit_exact(tmp_path, dtype, capsys):
    store = _store(tmp_path / "s", dtype)
    assert cli_main(["teacher-export", store, str(tmp_path / "pq")]) == 0
    assert "wrote 3 parquet files" in capsys.readouterr().out
    assert sorted(os.listdir(tmp_path / "pq")) == ["data", "head.safetensors", "nitrobrew_hidden.json"]
    # into a directory whose parents do not exist yet
    assert cli_main(["teacher-import", str(tmp_path / "pq"), str(tmp_path / "a" / "b" / "back")]) == 0
    assert "wrote" in capsys.readouterr().out
    original = {k: v for k, v in _files(store).items() if not k.startswith(".")}
    back = _files(tmp_path / "a" / "b" / "back")
    assert {k: v for k, v in back.items() if not k.startswith(".")} == original
    assert sorted(os.listdir(tmp_path / "a" / "b")) == ["back"]  # no partial directory left beside it
    assert cli_main(["teacher-verify", str(tmp_path / "a" / "b" / "back"), "--quiet"]) == 0


def test_the_console_script_round_trip(tmp_path):
    store = _store(tmp_path / "s")
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    for argv in (["teacher-export", store, str(tmp_path / "pq")], ["teacher-import", str(tmp_path / "pq"), "back"]):
        done = subprocess.run(
            [sys.executable, "-m", "nitrobrew.cli", *argv], cwd=tmp_path, env=env, capture_output=True, text=True
        )
        assert done.returncode == 0, done.stderr
    assert {k: v for k, v in _files(tmp_path / "back").items() if not k.startswith(".")} == {
        k: v for k, v in _files(store).items() if not k.startswith(".")
    }


def test_a_flipped_byte_is_refused_and_nothing_is_written(tmp_path, capsys):
    store = _store(tmp_path / "s")
    assert cli_main(["teacher-export", store, str(tmp_path / "pq")]) == 0
    victim = sorted((tmp_path / "pq" / "data").iterdir())[1]
    raw = bytearray(victim.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    victim.write_bytes(bytes(raw))
    capsys.readouterr()
    assert cli_main(["teacher-import", str(tmp_path / "pq"), str(tmp_path / "again")]) == 2
    assert "is corrupted: its sha256 does not match" in _one_line_error(capsys, "teacher-import")
    assert sorted(os.listdir(tmp_path)) == ["pq", "s"]
    # an empty directory given as the store stays empty
    (tmp_path / "empty").mkdir()
    assert cli_main(["teacher-import", str(tmp_path / "pq"), str(tmp_path / "empty")]) == 2
    _one_line_error(capsys, "teacher-import")
    assert os.listdir(tmp_path / "empty") == []


def test_a_refusal_after_writing_began_removes_everything(tmp_path, capsys):
    """The index is edited to match a changed file: the file checks pass, the rebuilt shard's sha256
    does not, after the head, the lock, the manifest and earlier shards were written."""
    store = _store(tmp_path / "s")
    assert cli_main(["teacher-export", store, str(tmp_path / "pq")]) == 0
    table_path = sorted((tmp_path / "pq" / "data").iterdir())[-1]
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pq.read_table(table_path)
    ids = [[(t + 1) % V for t in row] for row in table.column("input_ids").to_pylist()]
    table = table.set_column(0, "input_ids", pa.array(ids, table.schema.field("input_ids").type))
    pq.write_table(table, table_path)
    index_path = tmp_path / "pq" / "nitrobrew_hidden.json"
    index = json.loads(index_path.read_text())
    index["files"][os.path.relpath(table_path, tmp_path / "pq")]["sha256"] = sha256_file(str(table_path))
    index_path.write_text(json.dumps(index))
    capsys.readouterr()
    assert cli_main(["teacher-import", str(tmp_path / "pq"), str(tmp_path / "new" / "store")]) == 2
    assert "the data changed after export" in _one_line_error(capsys, "teacher-import")
    assert sorted(os.listdir(tmp_path)) == ["pq", "s"]  # no store, no parent, no partial directory


def test_bad_arguments_and_targets(tmp_path, capsys):
    store = _store(tmp_path / "s")
    with pytest.raises(SystemExit) as e:
        cli_main(["teacher-export", store])
    assert e.value.code == 2
    assert "the following arguments are required: out" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        cli_main(["teacher-import", "a", "b", "--bogus"])
    assert e.value.code == 2
    assert "unrecognized arguments: --bogus" in capsys.readouterr().err
    # not a store, a non-empty target, not an export: one line each, nothing written
    assert cli_main(["teacher-export", str(tmp_path / "nowhere"), str(tmp_path / "pq")]) == 2
    _one_line_error(capsys, "teacher-export")
    assert cli_main(["teacher-export", store, store]) == 2
    assert "is not empty" in _one_line_error(capsys, "teacher-export")
    assert cli_main(["teacher-import", store, str(tmp_path / "back")]) == 2
    assert "is not an exported hidden store" in _one_line_error(capsys, "teacher-import")
    assert cli_main(["teacher-export", store, str(tmp_path / "pq")]) == 0
    index_path = tmp_path / "pq" / "nitrobrew_hidden.json"
    index = json.loads(index_path.read_text())
    del index["header"]
    index_path.write_text(json.dumps(index))
    capsys.readouterr()
    assert cli_main(["teacher-import", str(tmp_path / "pq"), str(tmp_path / "back")]) == 2
    assert "is malformed: it lacks 'header'" in _one_line_error(capsys, "teacher-import")
    assert sorted(os.listdir(tmp_path)) == ["pq", "s"]


@pytest.mark.parametrize("command", ["topk-verify", "teacher-verify", "teacher-export", "teacher-import"])
def test_store_command_help_does_not_import_torch(command):
    code = (
        "import sys, contextlib, io\n"
        "from nitrobrew.cli import main\n"
        "with contextlib.redirect_stdout(io.StringIO()) as out:\n"
        "    try:\n"
        f"        main([{command!r}, '--help'])\n"
        "    except SystemExit:\n"
        "        pass\n"
        "assert 'usage' in out.getvalue()\n"
        "print('torch' in sys.modules)\n"
    )
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False", out
