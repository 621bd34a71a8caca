"""Two real processes (gloo on CPU) train exactly like one process with the same global batch."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess

import pytest
import torch
from conftest import CPU_PROCESSES_ENV, launcher, real_launcher, torchrun_with_warm_processes

SCRIPT = pathlib.Path(__file__).parent / "scripts" / "distributed_train.py"


def _launch(tmp_path, name, num_processes, per_device_batch_size, env):
    """A real launch of its own (what accelerate launch does is tested), in the environment ``env`` (the other tests
    read the scenarios' shared launches)."""
    output = tmp_path / f"{name}.json"
    completed = subprocess.run(
        [*real_launcher(num_processes), str(SCRIPT), str(output), str(per_device_batch_size), "1"],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    return json.loads(output.read_text())


@pytest.fixture
def single(one_process_scenarios) -> dict:
    """The one-process run with batch 8 (the global batch of 2 processes x 4) that several tests compare with."""
    return one_process_scenarios.read_json("train_samples")


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.scenarios("train_samples", "train_samples_accumulated")
def test_two_processes_equal_one(single, one_process_scenarios, two_process_scenarios):
    """Two processes equal one process with the same global batch."""
    accumulated = one_process_scenarios.read_json("train_samples_accumulated")  # 1 process x 4 x 2 steps
    double = two_process_scenarios.read_json("train_samples")  # 2 processes x 4

    assert double["num_processes"] == 2 and double["ranks_agree"]
    assert single["updates"] == accumulated["updates"] == double["updates"] == 12
    for other in (accumulated, double):
        torch.testing.assert_close(
            torch.tensor(other["parameters"]), torch.tensor(single["parameters"]), rtol=1e-5, atol=1e-6
        )
        assert other["train_loss"] == pytest.approx(single["train_loss"], rel=1e-5)
        assert other["eval_loss"] == pytest.approx(single["eval_loss"], rel=1e-5)
    stdout, stderr = (two_process_scenarios.printed("train_samples", stream) for stream in ("stdout", "stderr"))
    assert stdout.count("Training 3 epochs") == 1 and stdout.count("Finished 3 epochs") == 1  # once
    assert stdout.count("train_loss_epoch:") == 3
    assert stderr.count("/3:   0%") == 3  # one bar per epoch (training and evaluation), on one process
    # written once, by the main process
    checkpoint = torch.load(two_process_scenarios.folder("train_samples") / "result.json.pt", weights_only=True)
    assert not any(key.startswith("module.") for key in checkpoint["model_state_dict"])


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.scenarios("train_tokens", "train_tokens_accumulated", "train_tokens_unweighted")
def test_token_losses_independent_of_split(one_process_scenarios, two_process_scenarios):
    """num_items_in_batch: each micro-batch's mean over its tokens is weighted by its tokens, over accumulation
    steps and processes, so 1 x 8, 1 x 4 x 2 and 2 x 4 make the same updates and log the same token means."""
    single = one_process_scenarios.read_json("train_tokens")
    accumulated = one_process_scenarios.read_json("train_tokens_accumulated")
    double = two_process_scenarios.read_json("train_tokens")
    assert double["num_processes"] == 2 and double["ranks_agree"]
    for other in (accumulated, double):
        torch.testing.assert_close(
            torch.tensor(other["parameters"]), torch.tensor(single["parameters"]), rtol=1e-5, atol=1e-6
        )
        assert other["train_loss"] == pytest.approx(single["train_loss"], rel=1e-5)
        assert other["eval_loss"] == pytest.approx(single["eval_loss"], rel=1e-5)
    # without num_items_in_batch the micro-batch means are averaged as equals: the split changes the training
    unweighted = one_process_scenarios.read_json("train_tokens_unweighted")  # 1 process x 4 x 2 steps
    assert not torch.allclose(torch.tensor(unweighted["parameters"]), torch.tensor(single["parameters"]), rtol=1e-4)


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.scenarios("train_samples")
@pytest.mark.parametrize("launcher", ["accelerate", "torchrun"])
def test_launch_without_gpus_is_one_job(tmp_path, launcher, single):
    """A multi-process launch without GPUs is one job, even without use_cpu. Accelerate alone would run two independent
    trainings here: the trainer runs one 2-process job on gloo."""
    env = {key: value for key, value in CPU_PROCESSES_ENV.items() if key != "ACCELERATE_USE_CPU"}
    if launcher == "accelerate":
        double = _launch(tmp_path, "double", 2, per_device_batch_size=4, env=env)
    else:  # torchrun's agent, whose processes are forked warm with the environment it gives them
        output = tmp_path / "torchrun.json"
        command = [*torchrun_with_warm_processes("--standalone", "--nproc_per_node", "2"), str(SCRIPT)]
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
    completed = subprocess.run([*launcher(1), "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert completed.returncode != 0
    assert (
        "RuntimeError: The launcher started 2 processes, but Accelerate was set up before the trainer was created"
        in completed.stderr
    )
    assert "Set ACCELERATE_USE_CPU=1" in completed.stderr
