"""A decision taken on one process only ends every process the same way, within seconds: no hang."""

from __future__ import annotations

import json
import pathlib
import subprocess
import time

import pytest
from conftest import CPU_PROCESSES_ENV, launcher

SCRIPT = pathlib.Path(__file__).parent / "scripts" / "distributed_decisions.py"


def _launch(tmp_path, modes):
    output = tmp_path / "decisions"
    started = time.monotonic()
    completed = subprocess.run(
        [*launcher(2), str(SCRIPT), modes, str(output)],
        env=CPU_PROCESSES_ENV,
        capture_output=True,
        text=True,
        timeout=240,
    )
    elapsed = time.monotonic() - started
    ranks = [
        json.loads(pathlib.Path(f"{output}.rank{r}").read_text())
        for r in range(2)
        if pathlib.Path(f"{output}.rank{r}").exists()
    ]
    return completed, ranks, elapsed


@pytest.mark.distributed
@pytest.mark.slow
def test_one_process_decision_ends_all(tmp_path):
    """A decision on one process ends every process at the same step."""
    completed, ranks, _ = _launch(tmp_path, "stop_step,stop_epoch,max_steps,tiny,nan")
    assert completed.returncode == 0, completed.stderr[-3000:]
    first, second = ranks
    for mode in first:
        assert first[mode]["num_processes"] == 2
        for key in ("updates", "epochs", "eval_losses", "train_losses", "stop_reason"):  # the same result everywhere
            assert first[mode][key] == second[mode][key], (mode, key)
        assert json.dumps(first[mode]["parameters"]) == json.dumps(second[mode]["parameters"]), mode  # nan-safe
    # StopTrainingError raised by a callback on rank 1 during the 6th update window: that update is made, then both stop
    assert (
        first["stop_step"]["updates"] == 6
        and first["stop_step"]["stop_reason"] == "stop asked on rank 1 (on process 1)"
    )
    # the epoch it cut short, 2 updates in, is recorded and counted
    assert first["stop_step"]["epochs"] == 3 and len(first["stop_step"]["train_losses"]) == 2
    # raised on rank 0 only, at the end of the second training epoch: both skip its evaluation and stop
    assert first["stop_epoch"]["updates"] == 8 and len(first["stop_epoch"]["eval_losses"]) == 1
    assert first["max_steps"]["updates"] == 7
    assert first["tiny"]["updates"] == 3  # one sample, two processes: no empty shard, no hang
    assert first["nan"]["updates"] == 6  # a NaN loss on rank 1 only stops both at the next check
    assert completed.stdout.count("stop asked on rank 1") == 1  # printed once, by the main process


@pytest.mark.distributed
@pytest.mark.slow
def test_one_process_exception_ends_job(tmp_path):
    """An exception on one process ends the whole job quickly."""
    completed, ranks, elapsed = _launch(tmp_path, "error")
    assert completed.returncode != 0 and ranks == []
    assert "RuntimeError: boom on rank 1" in completed.stderr
    assert elapsed < 90  # the launcher stops rank 0 as soon as rank 1 fails; gloo's own timeout is 30 minutes
