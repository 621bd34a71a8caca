"""FSDP2 (2 gloo processes on the CPU) and DeepSpeed (1 process) train like DDP / a plain run, and export plain weights;
DeepSpeed ZeRO 1, 2 and 3 training states resume bit for bit (``tests/scripts/deepspeed_states.py``, one launch).

Accelerate 1.15 never selects FSDP on a CPU, so ``tests/scripts/fsdp_train.py`` switches its state to FSDP after
creating it; everything after that (sharding, clipping, state dicts) is Accelerate's and torch's real FSDP2 code.
``docs/fsdp_deepspeed.md`` says what this covers and what needs a GPU (``benchmarks/gpu_checks/fsdp_check.py``).
The DeepSpeed runs are forked from the warm DeepSpeed launcher (``deepspeed_launcher`` of tests/conftest.py) with the
environment ``accelerate launch --use_deepspeed --zero_stage 2`` gives; tests/test_warm_launch.py compares it with the
real launch's.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess

import pytest
import torch
from conftest import deepspeed_environment, deepspeed_launcher, launcher
from torch import nn

from pytorch_accel_trainer.state.training_state import verify_folder

SCRIPT = pathlib.Path(__file__).parent / "scripts" / "fsdp_train.py"
DEEPSPEED_STATES_SCRIPT = pathlib.Path(__file__).parent / "scripts" / "deepspeed_states.py"
TIMEOUT_S = 240


def _launch(output: pathlib.Path, mode: str, launcher: list) -> dict:
    env = deepspeed_environment() if mode == "deepspeed" else {**os.environ, "OMP_NUM_THREADS": "1"}
    if mode in ("fsdp2", "ddp", "plugin_on_cpu"):
        env["ACCELERATE_USE_CPU"] = "1"
    output.mkdir(parents=True)
    completed = subprocess.run(
        [*launcher, str(SCRIPT), str(output), mode], env=env, capture_output=True, text=True, timeout=TIMEOUT_S
    )
    assert completed.returncode == 0, completed.stderr[-4000:]
    return json.loads((output / "result.json").read_text())


def _plain_mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))


@pytest.fixture(scope="module")
def fsdp_and_ddp_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("fsdp")
    fsdp = _launch(root / "fsdp2", "fsdp2", launcher(2))
    ddp = _launch(root / "ddp", "ddp", launcher(2))
    return root, fsdp, ddp


@pytest.mark.distributed
@pytest.mark.slow
def test_fsdp2_trains_like_ddp(fsdp_and_ddp_runs):
    """FSDP2 trains like DDP, with gradient clipping."""
    _, fsdp, ddp = fsdp_and_ddp_runs

    assert fsdp["distributed_type"] == "FSDP" and fsdp["parameter_types"] == ["DTensor"]  # really sharded
    assert ddp["distributed_type"] == "MULTI_CPU"
    assert fsdp["train_loss"][-1] < fsdp["train_loss"][0] / 1.5
    assert fsdp["train_loss"] == pytest.approx(ddp["train_loss"], rel=1e-5)
    torch.testing.assert_close(torch.tensor(fsdp["parameters"]), torch.tensor(ddp["parameters"]), rtol=1e-5, atol=1e-6)
    assert fsdp["gradient_norm_type"] == "Tensor"  # not a DTensor: loggable like any norm
    # a second train() re-prepares the sharded model; gradient_clip_value alone; then evaluate()
    torch.testing.assert_close(
        torch.tensor(fsdp["second_run_parameters"]), torch.tensor(ddp["second_run_parameters"]), rtol=1e-5, atol=1e-6
    )
    assert fsdp["evaluation_loss"] == pytest.approx(ddp["evaluation_loss"], rel=1e-5)
    # a Trainer without optimizer evaluates the exported checkpoint (FSDP2 cannot shard a model without one)
    assert fsdp["evaluator_loss"] == pytest.approx(ddp["evaluator_loss"], rel=1e-5)


@pytest.mark.distributed
@pytest.mark.slow
def test_fsdp2_checkpoint_is_plain(fsdp_and_ddp_runs):
    """An FSDP2 checkpoint loads into a plain model, with full shapes."""
    root, fsdp, _ = fsdp_and_ddp_runs
    checkpoint = torch.load(root / "fsdp2" / "model.pt", weights_only=True)
    plain = _plain_mlp()

    state = checkpoint["model_state_dict"]
    assert {name: tuple(tensor.shape) for name, tensor in state.items()} == {
        name: tuple(tensor.shape) for name, tensor in plain.state_dict().items()
    }
    assert all(type(tensor) is torch.Tensor for tensor in state.values())
    plain.load_state_dict(state)  # strict: no module. / _fsdp_wrapped_module. prefixes
    flat = torch.cat([state[name].flatten() for name in sorted(state)])
    torch.testing.assert_close(flat, torch.tensor(fsdp["parameters"]), rtol=0, atol=0)
    optimizer = torch.optim.SGD(plain.parameters(), lr=0.05, momentum=0.9)
    optimizer.load_state_dict(checkpoint["optimizer_state_dict"])  # torch's plain format, full momentum buffers
    assert [tuple(optimizer.state[p]["momentum_buffer"].shape) for p in plain.parameters()] == [
        tuple(p.shape) for p in plain.parameters()
    ]
    from safetensors.torch import load_model

    load_model(_plain_mlp(), str(root / "fsdp2" / "weights.safetensors"))  # strict
    # loading the exported checkpoint back into the shards changes nothing, also right after an evaluation
    assert fsdp["parameters_after_load"] == fsdp["parameters"]
    assert fsdp["parameters_loaded_after_evaluation"] == fsdp["parameters"]


@pytest.mark.distributed
@pytest.mark.slow
def test_fsdp2_resume_equals_uninterrupted(fsdp_and_ddp_runs):
    """An FSDP2 training-state resume equals the uninterrupted run."""
    root, fsdp, ddp = fsdp_and_ddp_runs
    # bit for bit, from mid-epoch 2; the resumed run has an eval set, so the state loads after the check of the first
    # evaluation batch (a forward pass after which FSDP2 leaves the root's parameters unsharded)
    assert fsdp["resumed_parameters"] == fsdp["parameters"]
    assert ddp["resumed_parameters"] == ddp["parameters"]
    (state,) = [path for path in (root / "fsdp2" / "states").iterdir() if path.name.startswith("checkpoint-")]
    from pytorch_accel_trainer.state.consolidate import full_weights

    # each process wrote its own shard; made whole on one process, the full weights load into a plain model (strict)
    assert verify_folder(state).manifest["world_size"] == 2
    assert {"__0_0.distcp", "__1_0.distcp"} <= {path.name for path in state.iterdir()}
    weights = full_weights(state)
    assert all(type(tensor) is torch.Tensor for tensor in weights.values())
    _plain_mlp().load_state_dict(weights)


@pytest.mark.distributed
@pytest.mark.slow
def test_fsdp_on_cpu_falls_back_to_ddp(tmp_path):
    """An FSDP plugin on the CPU falls back to DDP, and says so."""
    result = _launch(tmp_path / "plugin", "plugin_on_cpu", launcher(2))
    assert result["distributed_type"] == "MULTI_CPU"
    assert len(result["warnings"]) == 1 and "Accelerate runs FSDP only on GPUs" in result["warnings"][0]


@pytest.mark.distributed
@pytest.mark.slow
def test_deepspeed_steps_once_per_update(tmp_path):
    """DeepSpeed steps once per update, and refuses what it would ignore."""
    deepspeed_launch = deepspeed_launcher(1, "--use_deepspeed", "--zero_stage", "2")
    deepspeed = _launch(tmp_path / "deepspeed", "deepspeed", deepspeed_launch)
    plain = _launch(tmp_path / "plain", "plain", launcher(1))  # the reference: one plain process, no DeepSpeed

    for ds_run, plain_run in zip(deepspeed["runs"], plain["runs"], strict=True):  # accumulation 1, then 2 (8 = 4 x 2)
        assert ds_run["distributed_type"] == "DEEPSPEED"
        assert ds_run["deepspeed_steps"] == ds_run["updates"] == plain_run["updates"] == 8
        assert ds_run["train_loss"] == pytest.approx(plain_run["train_loss"], rel=1e-5)
        torch.testing.assert_close(
            torch.tensor(ds_run["parameters"]), torch.tensor(plain_run["parameters"]), rtol=1e-5, atol=1e-6
        )
    errors = deepspeed["errors"]
    assert (
        "gradient_clipping=1.0" in errors["clip_norm_unset"] and "gradient_clip_norm=None" in errors["clip_norm_unset"]
    )
    assert "gradient_clip_value=0.5 cannot be applied under DeepSpeed" in errors["clip_value"]
    assert "save_optimizer=False" in errors["checkpoint_with_optimizer"]
    assert "prepares its model and optimizer once" in errors["second_train"]


def _launch_deepspeed_states(output: pathlib.Path, num_processes: int, stages: str) -> dict:
    output.mkdir(parents=True)
    completed = subprocess.run(
        [*deepspeed_launcher(num_processes, "--use_deepspeed", "--zero_stage", "2"), str(DEEPSPEED_STATES_SCRIPT)]
        + [str(output), stages],
        env=deepspeed_environment(),
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    assert completed.returncode == 0, completed.stderr[-4000:]
    return json.loads((output / "result.json").read_text())


@pytest.mark.distributed
@pytest.mark.slow
def test_deepspeed_training_states_resume_bit_for_bit(tmp_path):
    """ZeRO 1, 2 and 3 on one process (one launch), ZeRO 2 and 3 on two over gloo (another): a run resumed from a
    state saved after 3 of 8 updates ends with the uninterrupted run's weights, bit for bit; consolidate gives the
    live weights; a damaged file and another ZeRO stage are refused; a background save is written at once, warned
    once; two processes train what one does."""
    one = _launch_deepspeed_states(tmp_path / "one", 1, "1,2,3")
    two = _launch_deepspeed_states(tmp_path / "two", 2, "2,3")
    assert (one.pop("num_processes"), two.pop("num_processes")) == (1, 2)

    for count, result in ((1, one), (2, two)):
        for stage, run in result.items():
            assert run["resume_bit_equal"], (count, stage, run["resume_max_difference"])
            assert run["consolidated_bit_equal"], (count, stage)
            assert run["consolidated_names"] == ["0.bias", "0.weight", "2.bias", "2.weight"]
            damaged = f"zero_pp_rank_{count - 1}_mp_rank_00_optim_states.pt: its XXH3-128 does not match"
            assert damaged in run["damaged_error"]
            assert run["background_states"] == 1
            model_files = ["mp_rank_00_model_states.pt"] if stage != "3" else []
            model_files += [f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt" for rank in range(count) if stage == "3"]
            optimizer_files = [f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt" for rank in range(count)]
            assert set(model_files + optimizer_files + ["manifest.json", "trainer_state.pt"]) <= set(run["files"])
        first, *later = sorted(result)
        assert result[first]["other_stage_error"] is None  # the first stage of a launch has no earlier state
        for stage in later:
            error, earlier = result[stage]["other_stage_error"], int(stage) - 1
            assert f"saved under DeepSpeed ZeRO stage {earlier} on {count} process(es)" in error
            assert f"this run uses ZeRO stage {stage} on {count}" in error and "ds_to_universal" in error
        warned = [message for run in result.values() for message in run["background_warnings"]]
        assert len(warned) == 1 and "written synchronously" in warned[0]  # once per process
    for stage in ("2", "3"):  # the same global batches of 8: the same training, up to summation order
        torch.testing.assert_close(torch.tensor(two[stage]["weights"]), torch.tensor(one[stage]["weights"]))
