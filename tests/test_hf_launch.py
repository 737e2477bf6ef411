"""`nitrobrew train` launched as users launch it: torchrun and accelerate on a machine without a GPU
train together (data parallel over gloo) or refuse in one line; never several lone copies writing
one output_dir. Real launchers, tiny models, 2 processes."""

import json
import os
import shutil
import socket
import subprocess
import sys

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")
pytest.importorskip("yaml")
pytest.importorskip("datasets")
from nitrobrew.hf.train_cli import parse  # noqa: E402
from test_hf_trainer import save_run  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the launch checks of a machine without a GPU")


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    root = save_run(tmp_path_factory.mktemp("launch"), lengths=(6, 9, 5, 7, 8, 6, 5, 9), prompt_tokens=None)
    (root / "cfg.yaml").write_text(
        "student: student\nteacher: teacher\ndata: data.jsonl\noutput_dir: out\nmax_steps: 2\n"
        "per_device_train_batch_size: 2\nlogging_steps: 1\nsave_strategy: 'no'\nreport_to: none\n"
    )
    return root


def launch(run_dir, launcher, *extra):
    shutil.rmtree(run_dir / "out", ignore_errors=True)
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    cmd = [*launcher, "-m", "nitrobrew.cli", "train", "cfg.yaml", *extra]
    return subprocess.run(cmd, cwd=run_dir, env=env, capture_output=True, text=True, timeout=600)


def free_port() -> int:
    """A port nothing listens on now: the launches of tests running side by side (pytest -n) must not meet."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun():
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port())]


def test_torchrun_on_cpu_trains_data_parallel(run_dir):
    done = launch(run_dir, torchrun())
    assert done.returncode == 0, done.stderr[-3000:]
    history = json.load(open(run_dir / "out" / "trainer_state.json"))["log_history"]
    # 8 rows, 2 per process and step: 2 processes see them all in 2 steps (one process alone: epoch 0.5)
    assert [h["epoch"] for h in history if "loss" in h] == [0.5, 1.0]
    assert (run_dir / "out" / "model.safetensors").exists()


def test_torchrun_that_would_train_apart_is_refused(run_dir):
    done = launch(run_dir, torchrun(), "--use_cpu", "false")
    assert done.returncode != 0
    ours = [line for line in done.stderr.splitlines() if line.startswith("nitrobrew train: ")]
    assert len(ours) == 1 and "launched as 2 processes, but they would train apart" in ours[0], done.stderr[-3000:]
    assert not (run_dir / "out").exists()


def test_accelerate_fsdp2_config_on_cpu_is_refused(run_dir):
    launcher = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        os.path.join(ROOT, "examples", "accelerate_fsdp2.yaml"),
        "--num_processes",
        "2",
        "--main_process_port",
        str(free_port()),
    ]
    done = launch(run_dir, launcher)
    assert done.returncode != 0
    ours = [line for line in done.stderr.splitlines() if line.startswith("nitrobrew train: ")]
    assert len(ours) == 1 and "FSDP plugin needs GPUs" in ours[0], done.stderr[-3000:]
    assert not (run_dir / "out").exists()


@pytest.mark.parametrize("generation", [["--lmbda", "0.5"], ["--seq_kd", "true"]])
def test_packing_with_generation_is_refused_at_parse_time(run_dir, generation):
    with pytest.raises(ValueError, match="packing: true with lmbda > 0 or seq_kd"):
        parse(str(run_dir / "cfg.yaml"), ["--packing", "true", *generation])


def test_fsdp2_plain_loop_example_runs_under_torchrun(tmp_path):
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    for extra in ([], ["--shard-teacher", "--apart"]):
        cmd = [*torchrun(), os.path.join(ROOT, "examples", "fsdp2_plain_loop.py"), "--steps", "2", *extra]
        done = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        steps = [line for line in done.stdout.splitlines() if line.startswith("step ")]
        assert len(steps) == 2 and all("(2 ranks)" in line for line in steps), done.stdout
