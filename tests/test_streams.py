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
from pytorch_accel_trainer.callbacks import SaveTrainingStateCallback, TrainerCallback
from pytorch_accel_trainer.errors import StopTrainingError

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


def _refusals(tmp_path: Path, processes: int, *args: str) -> list:
    """The errors of a launch of the script that every process refuses (``REFUSED`` lines), by rank."""
    result = subprocess.run(
        [*launcher(processes), str(SCRIPT), str(tmp_path), *args],
        env=CPU_PROCESSES_ENV,
        capture_output=True,
        text=True,
        timeout=240,
    )
    output = result.stdout + result.stderr
    refusals = [json.loads(line.split(" ", 1)[1]) for line in result.stdout.splitlines() if line.startswith("REFUSED")]
    assert len(refusals) == processes, output[-4000:]
    return sorted(refusals, key=lambda refusal: refusal["rank"])


@pytest.mark.slow
@pytest.mark.parametrize(("saved", "resumed"), [(2, 0), (0, 2)])
def test_a_stream_resumed_with_another_number_of_workers_is_refused_by_name(tmp_path, saved, resumed):
    """Each worker keeps its place in its own share of the stream: a state taken inside an epoch with 2 workers
    cannot go on with none (nor the reverse); the resume says so by name, before the first batch (the workers of the
    resumed run only prefetch their first round as the dataloader is built)."""
    args = ("--samples", "64", "--stop-after", "3", "--epochs", "1", "--workers", str(saved))
    (refusal,) = _refusals(tmp_path, 1, *args, "--resume-workers", str(resumed))
    assert f"with num_workers={saved}, and this run's training dataloader has num_workers={resumed}" in refusal["error"]
    assert f"train_dataloader_kwargs={{'num_workers': {saved}}}" in refusal["error"]
    assert refusal["produced"] <= (PREFETCHED if resumed else 0)


@pytest.fixture(scope="module")
def split_stream_states(tmp_path_factory):
    """The training states of a stream that splits itself on 2 processes (stream_split="dataset"), the last taken 3
    updates into its epoch of 8."""
    folder = tmp_path_factory.mktemp("split_stream")
    _launch(
        folder, 2, "--split", "dataset", "--samples", "64", "--stop-after", "3", "--epochs", "1", "--modes", "stopped"
    )
    return folder


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("processes", [1, 3])
def test_a_split_stream_resumed_on_another_number_of_processes_is_refused_before_the_first_batch(
    split_stream_states, processes
):
    """Each process's part of the stream, and its place there, depend on the number of processes: even with
    allow_resume_changes, the resume is refused before the stream produces a sample, saying how to resume instead
    (and nothing that it does not do)."""
    args = ("--split", "dataset", "--samples", "64", "--epochs", "1", "--modes", "resumed", "--allow-changes")
    for refusal in _refusals(split_stream_states, processes, *args):
        assert (
            f"into an epoch of the training stream by 2 process(es), and this run has {processes}:" in refusal["error"]
        )
        assert "Resume on 2 process(es), or resume from a state taken at an epoch's end" in refusal["error"]
        assert refusal["produced"] == 0


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("allow_changes", [False, True])
def test_a_split_stream_resumed_with_the_default_stream_split_names_stream_split(split_stream_states, allow_changes):
    """A state of stream_split="dataset" resumed with the default "main_process" on the same processes: the
    refusal names stream_split and the value to pass, not the number of processes or the batch size."""
    args = ["--split", "dataset", "--resume-split", "main_process", "--samples", "64", "--epochs", "1"]
    for refusal in _refusals(
        split_stream_states, 2, *args, "--modes", "resumed", *(["--allow-changes"] * allow_changes)
    ):
        error = refusal["error"]
        assert "stream_split" in error and "number of processes or the batch size" not in error
        if allow_changes:
            assert "with stream_split='dataset', and this run has stream_split='main_process'" in error
            assert "Pass train(..., stream_split='dataset')" in error
        else:
            assert "stream_split: saved 'dataset', now 'main_process'" in error
        assert refusal["produced"] == 0


@pytest.mark.slow
@pytest.mark.distributed
def test_stream_split_dataset_on_a_stream_that_does_not_split_itself_is_refused_at_its_first_batch(tmp_path):
    """With stream_split="dataset", a stream that gives every process the same samples would train each twice: the
    first batches, the same on both processes, stop the run before its first step, naming stream_split."""
    for refusal in _refusals(tmp_path, 2, "--split", "dataset", "--unsplit", "--samples", "64", "--epochs", "1"):
        assert "their first batches are the same: the stream does not split itself" in refusal["error"]
        assert "stream_split at 'main_process'" in refusal["error"]
        assert refusal["produced"] <= 2 * 4  # the first batch, and the one the loop reads ahead


@pytest.mark.slow
@pytest.mark.distributed
def test_a_hugging_face_stream_split_by_node_is_refused_on_the_default_stream_split(tmp_path):
    """split_dataset_by_node gives each process its own part: on the default "main_process" the main process would
    read its part alone and send it to both (32 of 64 samples trained); the run is refused as it starts, naming the
    value to pass."""
    for refusal in _refusals(tmp_path, 2, "--hf-split-by-node"):
        assert "a Hugging Face IterableDataset split by node (split_dataset_by_node, world_size=2)" in refusal["error"]
        assert "Pass train(..., stream_split='dataset')" in refusal["error"]
        assert refusal["produced"] == 0


class _Stop(TrainerCallback):
    def on_train_step_end(self, trainer, **kwargs):
        if trainer.run_state.num_update_steps_completed == 2:
            raise StopTrainingError("stopped by the test")


def _hf_numbers(shards):
    for shard in shards:
        for index in range(8):
            yield {"x": [float(shard * 8 + index)]}


def test_a_hugging_face_stream_shuffled_with_a_buffer_warns_at_a_resume_inside_an_epoch(tmp_path):
    """datasets keeps no shuffle buffer in a stream's state (its issue 7444): resumed 8 samples into an epoch of 32
    with a buffer of 16, the stream trains 16 of the 24 left. The resume warns, naming the buffer and what to do."""
    import datasets  # the test extra has it

    def run(resume: bool) -> list:
        stream = datasets.IterableDataset.from_generator(_hf_numbers, gen_kwargs={"shards": [0, 1, 2, 3]})
        seen: list = []

        class Recording(Trainer):
            def calculate_train_batch_loss(self, batch):
                seen.extend(batch["x"].flatten().tolist())
                return super().calculate_train_batch_loss((batch["x"], batch["x"]))

        model = torch.nn.Linear(1, 1)
        store = SaveTrainingStateCallback(tmp_path / "states", save_on_signals=())
        callbacks = [store] if resume else [store, _Stop()]
        trainer = Recording(model, torch.nn.MSELoss(), torch.optim.SGD(model.parameters(), lr=0.0), callbacks=callbacks)
        shuffled = stream.shuffle(seed=3, buffer_size=16).with_format("torch")
        trainer.train(
            shuffled, num_epochs=1, per_device_batch_size=4, resume_from=tmp_path / "states" if resume else None
        )
        return seen

    assert len(run(resume=False)) == 12  # the stop asked for after update 2 lands after update 3
    with pytest.warns(UserWarning, match=r"shuffled with a buffer \(buffer_size=16\).*up to 16 samples"):
        assert len(run(resume=True)) < 32 - 12


class _Numbers(IterableDataset):
    def __iter__(self):
        for index in range(8):
            yield torch.full((2,), float(index)), torch.zeros(1)


def test_stream_split_must_be_one_of_its_values():
    model = torch.nn.Linear(2, 1)
    trainer = Trainer(model, torch.nn.MSELoss(), torch.optim.SGD(model.parameters(), lr=0.1), callbacks=[])
    with pytest.raises(ValueError, match=r"stream_split='each' is not valid: pass 'main_process'.*or 'dataset'"):
        trainer.train(_Numbers(), num_epochs=1, stream_split="each")


class _Saying(_Numbers):
    """A stream of 8 samples whose state_dict() returns ``state``; counts the samples it produced."""

    def __init__(self, state):
        self.state, self.produced = state, 0

    def __iter__(self):
        for sample in super().__iter__():
            self.produced += 1
            yield sample

    def state_dict(self):
        return self.state

    def load_state_dict(self, state):
        pass


@pytest.mark.parametrize(
    ("state", "refused"),
    [
        (None, r"state_dict\(\) \(_Saying\) returned None, not a dict.*a forgotten return gives None"),
        ({"place": object()}, r"state_dict\(\) \(_Saying\)\['place'\] is a object, which cannot be loaded back"),
    ],
)
def test_a_stream_state_dict_a_training_state_could_not_keep_is_refused_as_the_run_starts(state, refused):
    """A stream's state_dict() that returns no dict (the resumed stream would start over) or a value that needs pickle
    (the first save would fail, after the updates since the start) is refused before the first batch."""
    model = torch.nn.Linear(2, 1)
    trainer = Trainer(model, torch.nn.MSELoss(), torch.optim.SGD(model.parameters(), lr=0.1), callbacks=[])
    stream = _Saying(state)
    with pytest.raises(TypeError, match=refused):
        trainer.train(stream, num_epochs=1, per_device_batch_size=2)
    assert stream.produced == 0
