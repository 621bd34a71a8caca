"""Two real processes (gloo on CPU) train exactly like one process with the same global batch."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest
import torch
from conftest import CPU_PROCESSES_ENV, launcher

SCRIPT = pathlib.Path(__file__).parent / "scripts" / "distributed_train.py"


def _launch(tmp_path, name, num_processes, per_device_batch_size, accumulation=1, loss_kind="samples", env=None):
    output = tmp_path / f"{name}.json"
    completed = subprocess.run(
        [*launcher(num_processes), str(SCRIPT), str(output), str(per_device_batch_size), str(accumulation), loss_kind],
        env=env or CPU_PROCESSES_ENV,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    return json.loads(output.read_text()), completed


@pytest.fixture(scope="module")
def single(tmp_path_factory) -> dict:
    """The one-process run with batch 8 (the global batch of 2 processes x 4) that several tests compare with,
    launched once (pytest-xdist runs a file's tests on one test process: --dist loadfile in pyproject.toml)."""
    result, _ = _launch(tmp_path_factory.mktemp("single"), "single", 1, per_device_batch_size=8)
    return result


@pytest.mark.distributed
@pytest.mark.slow
def test_two_processes_equal_one(tmp_path, single):
    """Two processes equal one process with the same global batch."""
    accumulated, _ = _launch(tmp_path, "accumulated", 1, per_device_batch_size=4, accumulation=2)
    double, completed = _launch(tmp_path, "double", 2, per_device_batch_size=4)

    assert double["num_processes"] == 2 and double["ranks_agree"]
    assert single["updates"] == accumulated["updates"] == double["updates"] == 12
    for other in (accumulated, double):
        torch.testing.assert_close(
            torch.tensor(other["parameters"]), torch.tensor(single["parameters"]), rtol=1e-5, atol=1e-6
        )
        assert other["train_loss"] == pytest.approx(single["train_loss"], rel=1e-5)
        assert other["eval_loss"] == pytest.approx(single["eval_loss"], rel=1e-5)
    assert completed.stdout.count("Training 3 epochs") == 1 and completed.stdout.count("Finished 3 epochs") == 1  # once
    assert completed.stdout.count("train_loss_epoch:") == 3
    assert completed.stderr.count("/3:   0%") == 3  # one bar per epoch (training and evaluation), on one process
    checkpoint = torch.load(tmp_path / "double.json.pt", weights_only=True)  # written once, by the main process
    assert not any(key.startswith("module.") for key in checkpoint["model_state_dict"])


@pytest.mark.distributed
@pytest.mark.slow
def test_token_losses_independent_of_split(tmp_path):
    """num_items_in_batch: each micro-batch's mean over its tokens is weighted by its tokens, over accumulation
    steps and processes, so 1 x 8, 1 x 4 x 2 and 2 x 4 make the same updates and log the same token means."""
    single, _ = _launch(tmp_path, "single", 1, per_device_batch_size=8, loss_kind="tokens")
    accumulated, _ = _launch(tmp_path, "accumulated", 1, per_device_batch_size=4, accumulation=2, loss_kind="tokens")
    double, _ = _launch(tmp_path, "double", 2, per_device_batch_size=4, loss_kind="tokens")
    assert double["num_processes"] == 2 and double["ranks_agree"]
    for other in (accumulated, double):
        torch.testing.assert_close(
            torch.tensor(other["parameters"]), torch.tensor(single["parameters"]), rtol=1e-5, atol=1e-6
        )
        assert other["train_loss"] == pytest.approx(single["train_loss"], rel=1e-5)
        assert other["eval_loss"] == pytest.approx(single["eval_loss"], rel=1e-5)
    # without num_items_in_batch the micro-batch means are averaged as equals: the split changes the training
    unweighted, _ = _launch(
        tmp_path, "unweighted", 1, per_device_batch_size=4, accumulation=2, loss_kind="tokens_unweighted"
    )
    assert not torch.allclose(torch.tensor(unweighted["parameters"]), torch.tensor(single["parameters"]), rtol=1e-4)


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("launcher", ["accelerate", "torchrun"])
def test_launch_without_gpus_is_one_job(tmp_path, launcher, single):
    """A multi-process launch without GPUs is one job, even without use_cpu. Accelerate alone would run two independent
    trainings here: the trainer runs one 2-process job on gloo."""
    env = {key: value for key, value in os.environ.items() if key != "ACCELERATE_USE_CPU"}
    env["OMP_NUM_THREADS"] = "1"
    if launcher == "accelerate":
        double, _ = _launch(tmp_path, "double", 2, per_device_batch_size=4, env=env)
    else:
        output = tmp_path / "torchrun.json"
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(SCRIPT)]
        completed = subprocess.run(
            [*command, str(output), "4", "1"], env=env, capture_output=True, text=True, timeout=240
        )
        assert completed.returncode == 0, completed.stderr[-3000:]
        double = json.loads(output.read_text())
    assert double["num_processes"] == 2 and double["ranks_agree"]
    torch.testing.assert_close(
        torch.tensor(double["parameters"]), torch.tensor(single["parameters"]), rtol=1e-5, atol=1e-6
    )


def test_one_process_set_up_under_launch():
    """Accelerate set up for one process under a multi-process launch is a clear error. Accelerate was set up (here by a
    PartialState) before the launcher's variables were seen: it cannot change."""
    code = (
        "import os, torch\n"
        "from accelerate import PartialState\n"
        "PartialState()\n"  # set up for one process
        "os.environ['WORLD_SIZE'] = '2'\n"
        "from pytorch_accel_trainer import Trainer\n"
        "Trainer(torch.nn.Linear(1, 1), torch.nn.MSELoss(), None)\n"
    )
    env = {key: value for key, value in os.environ.items() if key not in ("ACCELERATE_USE_CPU", "WORLD_SIZE")}
    completed = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert completed.returncode != 0
    assert (
        "RuntimeError: The launcher started 2 processes, but Accelerate was set up before the trainer was created"
        in completed.stderr
    )
    assert "Set ACCELERATE_USE_CPU=1" in completed.stderr
