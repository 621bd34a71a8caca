"""Training states of the ParallelismConfig layouts through ``examples/parallel_layouts.py`` (docs/scaling.md,
"Layouts"; issue 46's "Done when"): a tiny Llama on 4 CPU processes, 8 updates of 4 samples.

- ``dp_shard 2 x tp 2`` stopped after 4 updates and resumed ends with the uninterrupted run's weights, bit for bit,
  the two parts' samples those of the uninterrupted run, none twice;
- the same stopped state resumed with ``--dp-shard 4 --allow-changes``: every remaining sample once; without
  ``--allow-changes``, refused naming the layout and the flag;
- ``dp_replicate 2 x dp_shard 2`` resumed from the state its uninterrupted run saved after 4 updates: bit for bit;
- ``consolidate`` of the stopped 2-D state (no process group): the stopped run's weights.

One module-scoped fixture makes the 7 launches (the warm launcher: about 2 min on 2 cores); the tests read them.
DeepSpeed ZeRO 2 and 3 on one process run with DeepSpeed installed aside
(``sh tests/scripts/install_deepspeed_aside.sh``, which the README's test command runs), under torchrun's environment
forked from the warm DeepSpeed launcher (``deepspeed_launcher(1)`` of tests/conftest.py).
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import shutil
import subprocess

import pytest
import torch
from conftest import deepspeed_environment, deepspeed_launcher, launcher

pytest.importorskip("transformers.distributed", reason="transformers 5 applies a Llama's plan to an existing model")

EXAMPLE = pathlib.Path(__file__).resolve().parent.parent / "examples" / "parallel_layouts.py"
STEPS, STOP = 8, 4
SAMPLES = list(range(STEPS * 4))
TIMEOUT_S = 300
RESULT_MARK = "LAYOUT_RESULT "


def _run(processes: int, *arguments, command=None, check: bool = True, env=None) -> subprocess.CompletedProcess:
    env = {**(os.environ if env is None else env), "ACCELERATE_USE_CPU": "1", "OMP_NUM_THREADS": "1"}
    start = command if command is not None else launcher(processes)
    completed = subprocess.run(
        [*start, str(EXAMPLE), "--steps", str(STEPS), *map(str, arguments)],
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    if check:
        assert completed.returncode == 0, completed.stderr[-4000:]
    return completed


def _result(completed: subprocess.CompletedProcess) -> dict:
    lines = [line for line in completed.stdout.splitlines() if line.startswith(RESULT_MARK)]
    assert len(lines) == 1, completed.stdout[-2000:]  # the main process alone prints it
    return json.loads(lines[0][len(RESULT_MARK) :])


def _state_after_four_updates(save_dir: pathlib.Path, copy: pathlib.Path) -> pathlib.Path:
    """A folder holding only the state ``save_dir``'s run saved after 4 updates (``step_4``), to resume from."""
    copy.mkdir()
    shutil.copytree(save_dir / f"step_{STOP}", copy / f"step_{STOP}")
    return copy


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """``{name: LAYOUT_RESULT}`` of each launch, and ``stopped_state``: the stopped 2-D state's folder."""
    folder = tmp_path_factory.mktemp("layout_states")
    fsdp_tp, hsdp = ("--dp-shard", 2, "--tp", 2), ("--dp-replicate", 2, "--dp-shard", 2)
    stopped, changed = folder / "stopped", folder / "changed"
    results = {
        "uninterrupted": _result(_run(4, *fsdp_tp)),
        "stopped": _result(_run(4, *fsdp_tp, "--save-dir", stopped, "--stop-after", STOP)),
    }
    shutil.copytree(stopped, changed)
    results["resumed"] = _result(_run(4, *fsdp_tp, "--save-dir", stopped, "--resume"))
    refused = _run(4, "--dp-shard", 4, "--save-dir", changed, "--resume", check=False)
    results["refused"] = {"returncode": refused.returncode, "stderr": refused.stderr}
    dp_shard_4 = _run(4, "--dp-shard", 4, "--save-dir", changed, "--resume", "--allow-changes")
    results["dp_shard_4"], results["dp_shard_4_stdout"] = _result(dp_shard_4), dp_shard_4.stdout
    results["hsdp"] = _result(_run(4, *hsdp, "--save-dir", folder / "hsdp", "--save-every", STOP))
    hsdp_state = _state_after_four_updates(folder / "hsdp", folder / "hsdp_resumed")
    results["hsdp_resumed"] = _result(_run(4, *hsdp, "--save-dir", hsdp_state, "--resume"))
    results["stopped_state"] = folder / "changed" / "final"  # untouched by the refused launch
    return results


def _weights_sha256(weights: dict) -> str:
    digest = hashlib.sha256()  # as the example hashes them
    for name in sorted(weights):
        digest.update(name.encode())
        digest.update(weights[name].to(torch.float32).contiguous().numpy().tobytes())
    return digest.hexdigest()


pytestmark = [pytest.mark.distributed, pytest.mark.slow, pytest.mark.timeout(900)]


def test_fsdp_by_tp_stopped_and_resumed_is_bit_for_bit(runs):
    uninterrupted, stopped, resumed = runs["uninterrupted"], runs["stopped"], runs["resumed"]
    assert resumed["weights_sha256"] == uninterrupted["weights_sha256"]
    assert stopped["weights_sha256"] != uninterrupted["weights_sha256"]
    assert sorted(uninterrupted["samples"]) == SAMPLES  # one entry per sample per data-parallel group
    assert len(stopped["samples"]) == STOP * 4
    assert sorted(stopped["samples"] + resumed["samples"]) == SAMPLES  # none twice


def test_fsdp_by_tp_state_resumes_on_dp_shard_4_with_every_remaining_sample_once(runs):
    remaining = sorted(set(SAMPLES) - set(runs["stopped"]["samples"]))
    assert sorted(runs["dp_shard_4"]["samples"]) == remaining
    said = "The state was saved by 4 process(es) with the layout dp_shard 2 x tp 2 and resumes on 4 with the layout "
    assert f"{said}dp_shard 4: the model and optimizer are resharded" in runs["dp_shard_4_stdout"]


def test_another_layout_is_refused_without_allow_changes(runs):
    refused = runs["refused"]
    assert refused["returncode"] != 0
    assert (
        "layout: saved {'dp_replicate': 1, 'dp_shard': 2, 'tp': 2, 'cp': 1}, now {'dp_replicate': 1, "
        in (refused["stderr"])
    )
    assert "allow_resume_changes=True" in refused["stderr"]


def test_hsdp_resumed_is_bit_for_bit(runs):
    assert runs["hsdp_resumed"]["weights_sha256"] == runs["hsdp"]["weights_sha256"]
    remaining = sorted(runs["hsdp_resumed"]["samples"])
    assert len(remaining) == (STEPS - STOP) * 4 and set(remaining) < set(runs["hsdp"]["samples"])


def test_consolidate_reads_a_two_dimensional_state_without_a_process_group(runs):
    from pytorch_accel_trainer.state.consolidate import full_weights

    assert _weights_sha256(full_weights(runs["stopped_state"])) == runs["stopped"]["weights_sha256"]


@pytest.mark.parametrize("stage", [2, 3])
def test_deepspeed_stopped_and_resumed_is_bit_for_bit(tmp_path, stage):
    """One process, DeepSpeed from its side folder (``deepspeed_environment``)."""
    env = deepspeed_environment()
    one_process = deepspeed_launcher(1)  # as torchrun --nproc_per_node 1, forked from the DeepSpeed server
    layout = ("--deepspeed-stage", stage)
    uninterrupted = _result(
        _run(1, *layout, "--save-dir", tmp_path / "run", "--save-every", STOP, command=one_process, env=env)
    )
    state = _state_after_four_updates(tmp_path / "run", tmp_path / "resumed")
    resumed = _result(_run(1, *layout, "--save-dir", state, "--resume", command=one_process, env=env))
    assert resumed["weights_sha256"] == uninterrupted["weights_sha256"]
    assert len(resumed["samples"]) == (STEPS - STOP) * 4
