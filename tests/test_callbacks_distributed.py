"""Callbacks that decide or gather, on two real processes (gloo on CPU): every rank agrees, nobody hangs."""

from __future__ import annotations

import csv

import pytest


def _results(launch):
    """What the main process wrote, and the rows of the run's metrics.csv (tests/scripts/distributed_callbacks.py)."""
    with open(launch.folder("callbacks_stop_together") / "runs" / "run" / "metrics.csv") as handle:
        rows = list(csv.DictReader(handle))
    return launch.read_json("callbacks_stop_together"), rows


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.scenarios("callbacks_stop_together")
def test_two_processes_stop_together(one_process_scenarios, two_process_scenarios):
    """Two processes stop together, and compute the single-process metrics (batches of 8 on one, 4 on each of two)."""
    single, single_rows = _results(one_process_scenarios)
    double, double_rows = _results(two_process_scenarios)

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
