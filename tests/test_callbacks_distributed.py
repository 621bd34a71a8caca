"""Callbacks that decide or gather, on two real processes (gloo on CPU): every rank agrees, nobody hangs."""

from __future__ import annotations

import csv
import json
import pathlib
import subprocess

import pytest
from conftest import CPU_PROCESSES_ENV, launcher

SCRIPT = pathlib.Path(__file__).parent / "scripts" / "distributed_callbacks.py"


def _run(tmp_path, name, command, per_device_batch_size):
    output, tracking = tmp_path / f"{name}.json", tmp_path / f"{name}_runs"
    completed = subprocess.run(
        [*command, str(SCRIPT), str(output), str(per_device_batch_size), str(tracking)],
        env=CPU_PROCESSES_ENV,
        capture_output=True,
        text=True,
        timeout=240,
    )  # a rank waiting forever on the other would hit the timeout
    assert completed.returncode == 0, completed.stderr[-3000:]
    with open(tracking / "run" / "metrics.csv") as handle:
        rows = list(csv.DictReader(handle))
    return json.loads(output.read_text()), rows


@pytest.mark.distributed
@pytest.mark.slow
def test_two_processes_stop_together(tmp_path):
    """Two processes stop together, and compute the single-process metrics."""
    single, single_rows = _run(tmp_path, "single", launcher(1), per_device_batch_size=8)
    double, double_rows = _run(tmp_path, "double", launcher(2), per_device_batch_size=4)

    assert double["num_processes"] == 2
    first, second = double["epochs_by_rank"]
    assert first == second < 30  # early stopping stopped both ranks at the same epoch
    common = min(len(single["mse"]), len(double["mse"]))
    assert double["mse"][:common] == pytest.approx(single["mse"][:common], rel=1e-5)  # gathered over both ranks
    assert double["mse"] == pytest.approx(double["eval_loss"], rel=1e-5)

    epoch_rows = [row for row in double_rows if row["name"] == "train_loss_epoch"]
    assert len(epoch_rows) == first  # written once, by the main process only
    assert len(single_rows) > 0

    assert single["sync_batch_norm_error"] is None and single["batch_norm_types"] == ["BatchNorm1d"]
    assert "torch's SyncBatchNorm only runs on accelerators" in double["sync_batch_norm_error"]
