"""Streams (``IterableDataset``) that resume where they stopped, read by every process, and ``memory://`` refused on
several processes (tests/scripts/stream_run.py).

Each launch trains a stream three ways: uninterrupted, stopped after some updates inside its first epoch (a training
state saved as it stops), and resumed from that state by a new trainer; the resumed run must end with the weights of
the uninterrupted one, bit for bit, and its stream must produce only what was not trained on (plus the batches in
flight: the one round workers prefetch when the dataloader is built).
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch
from conftest import CPU_PROCESSES_ENV, launcher
from torch.utils.data import IterableDataset

from pytorch_accel_trainer import Trainer

SCRIPT = Path(__file__).parent / "scripts" / "stream_run.py"
BATCH = 4
PREFETCHED = 2 * 2 * BATCH  # num_workers * prefetch_factor batches, produced once as the dataloader is built


def _launch(tmp_path: Path, processes: int, *args: str, timeout: int = 240) -> tuple[list, str]:
    result = subprocess.run(
        [*launcher(processes), str(SCRIPT), str(tmp_path), *args],
        env=CPU_PROCESSES_ENV,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    reports = [json.loads(line.split(" ", 1)[1]) for line in result.stdout.splitlines() if line.startswith("REPORT ")]
    assert len(reports) == processes, output[-4000:]
    return sorted(reports, key=lambda report: report["rank"]), output


def _assert_same_weights(tmp_path: Path) -> None:
    uninterrupted = torch.load(tmp_path / "uninterrupted.pt")
    resumed = torch.load(tmp_path / "resumed.pt")
    for name, tensor in uninterrupted.items():
        assert torch.equal(tensor, resumed[name]), name


@pytest.mark.slow
@pytest.mark.parametrize("workers", [0, 2])
def test_a_stream_that_keeps_its_position_resumes_without_reading_again(tmp_path, workers):
    """Stopped at 30 of the epoch's 100 updates (the stop asked for in the 31st step lands after it: 124 samples
    trained), the resumed stream produces the 276 samples left (and, with 2 workers, their prefetch as the dataloader
    is built), at most 64 before its first new update."""
    (report,), output = _launch(tmp_path, 1, "--workers", str(workers), "--stop-after", "30", "--epochs", "1")
    _assert_same_weights(tmp_path)
    trained_before = report["stopped"]["updates"] * BATCH
    assert report["resumed"]["produced"] == 400 - trained_before + (PREFETCHED if workers else 0)
    assert report["resumed"]["before_first_update"] <= 64
    assert "produced again" not in output and "Replaying" not in output


@pytest.mark.slow
def test_a_stream_that_keeps_its_position_resumes_across_epochs_with_workers(tmp_path):
    """Two epochs with 2 persistent workers: the second epoch after the resume reads the stream from its start."""
    (report,), _ = _launch(tmp_path, 1, "--workers", "2", "--stop-after", "30", "--epochs", "2")
    _assert_same_weights(tmp_path)
    assert report["resumed"]["produced"] == 800 - report["stopped"]["updates"] * BATCH + PREFETCHED


@pytest.mark.slow
def test_a_plain_stream_is_replayed_and_says_so(tmp_path):
    """A stream without state_dict is produced again up to the saved position: one line says how much and how to
    avoid it, and the replay shows a progress bar."""
    (report,), output = _launch(tmp_path, 1, "--plain", "--stop-after", "30")
    _assert_same_weights(tmp_path)
    updates = report["stopped"]["updates"]
    assert f"cannot say where it is: its first {updates} batches ({updates * BATCH} samples over 1 process)" in output
    assert "state_dict() and load_state_dict()" in output
    assert "Replaying the stream" in output
    assert f"(after {updates} optimizer updates) at epoch 1, {updates} batches in, run " in output  # where it goes on
    assert report["resumed"]["produced"] == 800


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("workers", [0, 2])
def test_each_process_reads_its_own_part_of_a_stream_that_splits_itself(tmp_path, workers):
    """stream_split="dataset" on 2 processes: each produces half of the samples, and the resume reads nothing again
    on either (but the workers' first prefetch)."""
    reports, output = _launch(tmp_path, 2, "--split", "dataset", "--workers", str(workers))
    _assert_same_weights(tmp_path)
    for report in reports:
        assert report["uninterrupted"]["produced"] == 400  # half of the 800 samples of 2 epochs
        left = 400 - report["stopped"]["updates"] * BATCH
        assert report["resumed"]["produced"] == left + (PREFETCHED if workers else 0)
    assert "produced again" not in output


@pytest.mark.slow
@pytest.mark.distributed
def test_parts_of_different_lengths_end_the_epoch_together(tmp_path):
    """Process 1's part is 8 samples (2 batches) shorter: every epoch ends with it, on both processes, with a warning
    on process 0 that names what was left; no process waits for the other, and the resume is still exact."""
    reports, output = _launch(tmp_path, 2, "--split", "dataset", "--uneven", "8")
    _assert_same_weights(tmp_path)
    assert [report["uninterrupted"]["updates"] for report in reports] == [98, 98]  # 49 a process an epoch
    assert "Process 0's part of the training stream still had batches" in output


@pytest.mark.slow
@pytest.mark.distributed
def test_a_stream_the_main_process_reads_for_all_is_replayed_and_names_the_switch(tmp_path):
    """By default the main process reads a stream for every process (Accelerate's dispatching): a resume replays it,
    and says that a stream split by process with stream_split='dataset' would not."""
    reports, output = _launch(tmp_path, 2)
    _assert_same_weights(tmp_path)
    assert reports[0]["uninterrupted"]["produced"] == 800 and reports[1]["uninterrupted"]["produced"] == 0
    assert "the main process reads for every process" in output and "stream_split='dataset'" in output


@pytest.mark.slow
@pytest.mark.distributed
def test_memory_store_is_refused_on_several_processes_before_the_first_batch(tmp_path):
    result = subprocess.run(
        [*launcher(2), str(SCRIPT), str(tmp_path), "--memory-store"],
        env=CPU_PROCESSES_ENV,
        capture_output=True,
        text=True,
        timeout=120,
    )
    refusals = [json.loads(line.split(" ", 1)[1]) for line in result.stdout.splitlines() if line.startswith("REFUSED")]
    assert len(refusals) == 2, result.stdout + result.stderr
    for refusal in refusals:
        assert "'memory://bucket/states'" in refusal["error"] and "lives inside one process" in refusal["error"]
        assert refusal["produced"] == 0


class _Numbers(IterableDataset):
    def __iter__(self):
        for index in range(8):
            yield torch.full((2,), float(index)), torch.zeros(1)


def test_stream_split_must_be_one_of_its_values():
    model = torch.nn.Linear(2, 1)
    trainer = Trainer(model, torch.nn.MSELoss(), torch.optim.SGD(model.parameters(), lr=0.1), callbacks=[])
    with pytest.raises(ValueError, match=r"stream_split='each' is not valid: pass 'main_process'.*or 'dataset'"):
        trainer.train(_Numbers(), num_epochs=1, stream_split="each")
