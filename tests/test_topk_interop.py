"""The store's import boundary (``topk-import``) and what ``topk-export`` writes for other trainers."""

import json
import os

import pytest
import torch

from nitrobrew.cli import main as cli_main
from nitrobrew.teacher.store import TopKStore
from test_topk_pipeline import _files, _write_store

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")


def _export(tmp_path, *extra, dtype="float32"):
    _write_store(tmp_path / "store", n_shards=3, dtype=dtype)
    assert cli_main(["topk-export", str(tmp_path / "store"), str(tmp_path / "pq"), *extra]) == 0
    return tmp_path / "pq" / "data" / "train-00000-of-00003.parquet"


def _refused(capsys, argv, out):
    """The import exits 2 with one line and leaves `out` as it was (absent, or an empty directory)."""
    existed = os.path.isdir(out)
    assert cli_main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("nitrobrew topk-import: error: "), err
    assert os.listdir(out) == [] if existed else not os.path.exists(out)
    return err[0]


def _flip(path, pos, bit=0x40):
    raw = bytearray(path.read_bytes())
    raw[pos] ^= bit
    path.write_bytes(bytes(raw))


def test_a_flipped_byte_in_an_export_is_refused(tmp_path, capsys):
    """The issue's commands: one flipped byte in the middle of an exported file is never imported."""
    f = _export(tmp_path)
    _flip(f, len(f.read_bytes()) // 2)
    _refused(capsys, ["topk-import", str(tmp_path / "pq"), str(tmp_path / "store2")], str(tmp_path / "store2"))


def test_no_flipped_byte_launders_into_a_store(tmp_path, capsys):
    """Any byte of a file flipped: the import is refused, or (a byte nothing reads) rebuilds the source store."""
    f = _export(tmp_path)
    clean = f.read_bytes()
    source = _files(tmp_path / "store")
    for n, pos in enumerate(range(0, len(clean), max(len(clean) // 40, 1))):
        f.write_bytes(clean)
        _flip(f, pos)
        out = tmp_path / f"back{n}"
        if cli_main(["topk-import", str(tmp_path / "pq"), str(out)]) == 0:
            assert _files(out) == source, f"byte {pos} of {len(clean)} changed the imported store"
        else:
            assert not out.exists()
        capsys.readouterr()


def _rewrite(path, edit):
    """Rewrite an exported file with `edit(rows)` applied, keeping its metadata (a hand edit)."""
    table = pq.read_table(path)
    rows = table.to_pylist()
    edit(rows)
    pq.write_table(pa.Table.from_pylist(rows, schema=table.schema), path)


def test_an_edited_export_is_refused_by_its_checksum(tmp_path, capsys):
    f = _export(tmp_path)

    def nudge(rows):
        rows[0]["target_logprobs"][0][0] = rows[0]["target_logprobs"][0][0] + 3e-5

    _rewrite(f, nudge)
    line = _refused(capsys, ["topk-import", str(tmp_path / "pq"), str(tmp_path / "s2")], str(tmp_path / "s2"))
    assert "corrupted" in line and "sha256" in line


def _foreign(path, lp0=-0.5, ids0=(1, 2)):
    rows = [
        {
            "input_ids": [5, 6, 7],
            "target_token_ids": [list(ids0), [3, 4], [0, 0]],
            "target_logprobs": [[lp0, -1.0], [-0.125, -3.0], [0.0, 0.0]],
            "target_mask": [[1, 1], [1, 1], [0, 0]],
        }
    ]
    os.makedirs(path, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), os.path.join(path, "x.parquet"))


@pytest.mark.parametrize(
    "lp0,ids0,match",
    [
        (0.7, (1, 2), "log-prob 0.7"),
        (float("nan"), (1, 2), "log-prob nan"),
        (float("inf"), (1, 2), "log-prob inf"),
        (-0.5, (3, 3), "repeats a target id"),
        (-0.5, (1, 10), "target id 10 outside"),
        (-0.5, (-1, 2), "target id -1 outside"),
    ],
)
def test_bad_values_are_refused_and_a_corrected_import_into_the_same_dir_works(tmp_path, capsys, lp0, ids0, match):
    argv = ["topk-import", str(tmp_path / "in"), str(tmp_path / "s"), "--temperature", "1", "--vocab-size", "10"]
    _foreign(tmp_path / "in", lp0=lp0, ids0=ids0)
    assert match in _refused(capsys, argv, str(tmp_path / "s"))
    os.makedirs(tmp_path / "s")  # an empty directory is left empty, no .lock, no manifest
    _refused(capsys, argv, str(tmp_path / "s"))
    _foreign(tmp_path / "in")  # corrected
    assert cli_main(argv) == 0
    assert cli_main(["topk-verify", str(tmp_path / "s"), "--quiet"]) == 0


def test_foreign_rows_are_sorted_and_unsorted_exports_refused(tmp_path, capsys):
    _foreign(tmp_path / "in", lp0=-2.0)  # [-2.0, -1.0]: out of order
    argv = ["topk-import", str(tmp_path / "in"), str(tmp_path / "s"), "--temperature", "1", "--vocab-size", "10"]
    assert cli_main(argv) == 0
    item = TopKStore(str(tmp_path / "s"))[0]
    assert item["topk_ids"][0].tolist() == [2, 1] and item["topk_logprobs"][0].tolist() == [-1.0, -2.0]
    assert cli_main(["topk-verify", str(tmp_path / "s"), "--quiet"]) == 0


def test_files_of_another_export_or_a_missing_file_are_refused(tmp_path, capsys):
    _export(tmp_path)
    os.unlink(tmp_path / "pq" / "data" / "train-00001-of-00003.parquet")
    line = _refused(capsys, ["topk-import", str(tmp_path / "pq"), str(tmp_path / "s2")], str(tmp_path / "s2"))
    assert "in order" in line


def test_export_labels_mask_each_sequences_first_token(tmp_path, capsys):
    f = _export(tmp_path)
    out = capsys.readouterr().out
    assert "kd_temperature: 1 " in out and "scale_t2=True" in out  # the store's temperature
    rows = pq.read_table(f).to_pylist()
    store = TopKStore(str(tmp_path / "store"))
    for i, row in enumerate(rows):
        ids = store[i]["input_ids"].tolist()
        assert row["input_ids"] == ids
        assert row["labels"] == ([-100] + ids[1:] if ids else [])


def test_uint8_export_is_decoded_by_default(tmp_path, capsys):
    """Axolotl's collators batch every column: a uint8 store exports plain float32 log-probs."""
    f = _export(tmp_path, dtype="uint8")
    assert set(pq.read_schema(f).names) == {
        "input_ids",
        "attention_mask",
        "labels",
        "target_token_ids",
        "target_logprobs",
        "target_mask",
    }
    meta = json.loads(pq.read_schema(f).metadata[b"nitrobrew_topk"])
    assert meta["logprob_dtype"] == "uint8"
    assert cli_main(["topk-import", str(tmp_path / "pq"), str(tmp_path / "back")]) == 0
    a, b = TopKStore(str(tmp_path / "store")), TopKStore(str(tmp_path / "back"))
    for i in range(len(a)):
        assert torch.equal(a[i]["topk_ids"], b[i]["topk_ids"])
        torch.testing.assert_close(a[i]["topk_logprobs"], b[i]["topk_logprobs"], rtol=1e-5, atol=1e-5)
    assert cli_main(["topk-export", str(tmp_path / "store"), str(tmp_path / "pq2"), "--logprob-codes"]) == 0
    names = pq.read_schema(tmp_path / "pq2" / "data" / "train-00000-of-00003.parquet").names
    assert {"nitrobrew_logprob_codes", "nitrobrew_logprob_scale"} <= set(names)
