"""Streams (``IterableDataset``) that resume where they stopped, read by every process, and ``memory://`` refused on
several processes (tests/scripts/stream_run.py).

Each run trains a stream three ways: uninterrupted, stopped after some updates inside its first epoch (a training
state saved as it stops), and resumed from that state by a new trainer; the resumed run must end with the weights of
the uninterrupted one, bit for bit, and its stream must produce only what was not trained on (with workers, plus at
most the one round they prefetch as Accelerate builds the dataloader).
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import NamedTuple

import pytest
import torch
from conftest import CPU_PROCESSES_ENV, launcher
from torch.utils.data import IterableDataset

from pytorch_accel_trainer import Trainer
from pytorch_accel_trainer.callbacks import SaveTrainingStateCallback, TrainerCallback
from pytorch_accel_trainer.errors import StopTrainingError

SCRIPT = Path(__file__).parent / "scripts" / "stream_run.py"
BATCH = 4
#: num_workers * prefetch_factor batches: Accelerate asks the StatefulDataLoader for its state as it builds it, which
#: starts the workers once; a resume's state replaces them, and what they prefetched meanwhile (up to this many
#: samples, fewer when they were slow to start) is thrown away.
PREFETCHED = 2 * 2 * BATCH


def _assert_produced_once(produced: int, left: int, workers: int) -> None:
    """A resumed stream produced the ``left`` samples it had left, once, and with workers at most their first
    prefetch besides: never the samples trained before the stop (those would be ``left + 124``)."""
    assert left <= produced <= left + (PREFETCHED if workers else 0), (produced, left)


#: The split stream's training states, the last taken 3 updates into its epoch of 8 (2 processes), then resumed from.
SPLIT_STATES = ("--split", "dataset", "--samples", "64", "--epochs", "1")
#: ... resumed with the default stream_split
DEFAULT_SPLIT = (*SPLIT_STATES, "--resume-split", "main_process", "--modes", "resumed")

#: The runs the tests below read, by name, in one launch for each number of processes, one after the other, each
#: with its own folder (runs named ``folder:run`` share ``folder``) and its warnings shown as in a process of its own.
#: A test that asserts a line is absent reads a run that comes before those that write it.
TWO_PROCESS_RUNS = {
    "split-0-workers": ("--split", "dataset", "--workers", "0"),
    "split-2-workers": ("--split", "dataset", "--workers", "2"),
    "uneven": ("--split", "dataset", "--uneven", "8"),
    "main-process-reads": (),
    "split-states:stopped": (*SPLIT_STATES, "--stop-after", "3", "--modes", "stopped"),
    "split-states:default-split": DEFAULT_SPLIT,
    "split-states:default-split-allowed": (*DEFAULT_SPLIT, "--allow-changes"),
    "memory-store": ("--memory-store",),
    "unsplit": ("--split", "dataset", "--unsplit", "--samples", "64", "--epochs", "1"),
    "hf-split-by-node": ("--hf-split-by-node",),
}
WORKERS_CHANGED = ("--samples", "64", "--stop-after", "3", "--epochs", "1")
#: ... and on 1 process, after those of 2 (it resumes the split stream's states)
ONE_PROCESS_RUNS = {
    "position-0-workers": ("--workers", "0", "--stop-after", "30", "--epochs", "1"),
    "position-2-workers": ("--workers", "2", "--stop-after", "30", "--epochs", "1"),
    "position-2-epochs": ("--workers", "2", "--stop-after", "30", "--epochs", "2"),
    "plain": ("--plain", "--stop-after", "30"),
    "workers-2-then-0": (*WORKERS_CHANGED, "--workers", "2", "--resume-workers", "0"),
    "workers-0-then-2": (*WORKERS_CHANGED, "--workers", "0", "--resume-workers", "2"),
    "split-states:other-processes": (*SPLIT_STATES, "--modes", "resumed", "--allow-changes"),
}


class Run(NamedTuple):
    """What a run of stream_run.py printed: its ``REPORT`` and ``REFUSED`` lines (by rank) and its whole output."""

    folder: Path
    reports: list
    refusals: list
    output: str

    def reported(self, processes: int) -> list:
        assert len(self.reports) == processes, self.output[-4000:]
        return self.reports

    def refused(self, processes: int) -> list:
        assert len(self.refusals) == processes, self.output[-4000:]
        return self.refusals


def _sections(text: str, first: str) -> dict:
    """The lines after each ``RUN name`` line of ``text``, by name (those before the first such line: ``first``'s)."""
    sections: dict = {first: ""}
    name = first
    for line in text.splitlines(keepends=True):
        if line.startswith("RUN "):
            name = line.removeprefix("RUN ").strip()
            sections[name] = sections.get(name, "")
        else:
            sections[name] += line
    return sections


def _launch(folder: Path, processes: int, runs: dict, timeout: int = 240) -> dict:
    """The runs of ``runs`` (name: stream_run.py's options after OUT), one after the other in one launch on
    ``processes`` processes, by name."""
    folders = {name: folder / name.split(":")[0] for name in runs}
    for run_folder in folders.values():
        run_folder.mkdir(exist_ok=True)
    command = [[name, [str(folders[name]), *args]] for name, args in runs.items()]
    result = subprocess.run(
        [*launcher(processes), str(SCRIPT), "--runs", json.dumps(command)],
        env=CPU_PROCESSES_ENV,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    first = next(iter(runs))
    stdout, stderr = _sections(result.stdout, first), _sections(result.stderr, first)
    assert list(stdout) == list(stderr) == [*runs, "end"], (result.stdout + result.stderr)[-4000:]

    def lines(name: str, start: str) -> list:
        found = [json.loads(line.split(" ", 1)[1]) for line in stdout[name].splitlines() if line.startswith(start)]
        return sorted(found, key=lambda line: line["rank"])

    return {
        name: Run(folders[name], lines(name, "REPORT "), lines(name, "REFUSED "), stdout[name] + stderr[name])
        for name in runs
    }


@pytest.fixture(scope="module")
def runs_folder(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("streams")


@pytest.fixture(scope="module")
def two_process_runs(runs_folder) -> dict:
    return _launch(runs_folder, 2, TWO_PROCESS_RUNS)


@pytest.fixture(scope="module")
def one_process_runs(runs_folder, two_process_runs) -> dict:
    return _launch(runs_folder, 1, ONE_PROCESS_RUNS)


def _assert_same_weights(folder: Path) -> None:
    uninterrupted = torch.load(folder / "uninterrupted.pt")
    resumed = torch.load(folder / "resumed.pt")
    for name, tensor in uninterrupted.items():
        assert torch.equal(tensor, resumed[name]), name


@pytest.mark.slow
@pytest.mark.parametrize("workers", [0, 2])
def test_a_stream_that_keeps_its_position_resumes_without_reading_again(one_process_runs, workers):
    """Stopped at 30 of the epoch's 100 updates (the stop asked for in the 31st step lands after it: 124 samples
    trained), the resumed stream produces the 276 samples left (and, with 2 workers, their prefetch as the dataloader
    is built), at most 64 before its first new update."""
    run = one_process_runs[f"position-{workers}-workers"]
    (report,) = run.reported(1)
    _assert_same_weights(run.folder)
    trained_before = report["stopped"]["updates"] * BATCH
    _assert_produced_once(report["resumed"]["produced"], 400 - trained_before, workers)
    assert report["resumed"]["before_first_update"] <= 64
    assert "produced again" not in run.output and "Replaying" not in run.output


@pytest.mark.slow
def test_a_stream_that_keeps_its_position_resumes_across_epochs_with_workers(one_process_runs):
    """Two epochs with 2 persistent workers: the second epoch after the resume reads the stream from its start."""
    run = one_process_runs["position-2-epochs"]
    (report,) = run.reported(1)
    _assert_same_weights(run.folder)
    _assert_produced_once(report["resumed"]["produced"], 800 - report["stopped"]["updates"] * BATCH, workers=2)


@pytest.mark.slow
def test_a_plain_stream_is_replayed_and_says_so(one_process_runs):
    """A stream without state_dict is produced again up to the saved position: one line says how much and how to
    avoid it, and the replay shows a progress bar."""
    run = one_process_runs["plain"]
    (report,), output = run.reported(1), run.output
    _assert_same_weights(run.folder)
    updates = report["stopped"]["updates"]
    assert f"cannot say where it is: its first {updates} batches ({updates * BATCH} samples over 1 process)" in output
    assert "state_dict() and load_state_dict()" in output
    assert "Replaying the stream" in output
    assert f"(after {updates} optimizer updates) at epoch 1, {updates} batches in, run " in output  # where it goes on
    assert report["resumed"]["produced"] == 800


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("workers", [0, 2])
def test_each_process_reads_its_own_part_of_a_stream_that_splits_itself(two_process_runs, workers):
    """stream_split="dataset" on 2 processes: each produces half of the samples, and the resume reads nothing again
    on either (but the workers' first prefetch)."""
    run = two_process_runs[f"split-{workers}-workers"]
    _assert_same_weights(run.folder)
    for report in run.reported(2):
        assert report["uninterrupted"]["produced"] == 400  # half of the 800 samples of 2 epochs
        left = 400 - report["stopped"]["updates"] * BATCH
        _assert_produced_once(report["resumed"]["produced"], left, workers)
    assert "produced again" not in run.output


@pytest.mark.slow
@pytest.mark.distributed
def test_parts_of_different_lengths_end_the_epoch_together(two_process_runs):
    """Process 1's part is 8 samples (2 batches) shorter: every epoch ends with it, on both processes, with a warning
    on process 0 that names what was left; no process waits for the other, and the resume is still exact."""
    run = two_process_runs["uneven"]
    _assert_same_weights(run.folder)
    assert [report["uninterrupted"]["updates"] for report in run.reported(2)] == [98, 98]  # 49 a process an epoch
    assert "Process 0's part of the training stream still had batches" in run.output


@pytest.mark.slow
@pytest.mark.distributed
def test_a_stream_the_main_process_reads_for_all_is_replayed_and_names_the_switch(two_process_runs):
    """By default the main process reads a stream for every process (Accelerate's dispatching): a resume replays it,
    and says that a stream split by process with stream_split='dataset' would not."""
    run = two_process_runs["main-process-reads"]
    _assert_same_weights(run.folder)
    reports = run.reported(2)
    assert reports[0]["uninterrupted"]["produced"] == 800 and reports[1]["uninterrupted"]["produced"] == 0
    assert "the main process reads for every process" in run.output and "stream_split='dataset'" in run.output


@pytest.mark.slow
@pytest.mark.distributed
def test_memory_store_is_refused_on_several_processes_before_the_first_batch(two_process_runs):
    for refusal in two_process_runs["memory-store"].refused(2):
        assert "'memory://bucket/states'" in refusal["error"] and "lives inside one process" in refusal["error"]
        assert refusal["produced"] == 0


@pytest.mark.slow
@pytest.mark.parametrize(("saved", "resumed"), [(2, 0), (0, 2)])
def test_a_stream_resumed_with_another_number_of_workers_is_refused_by_name(one_process_runs, saved, resumed):
    """Each worker keeps its place in its own share of the stream: a state taken inside an epoch with 2 workers
    cannot go on with none (nor the reverse); the resume says so by name, before the first batch (the workers of the
    resumed run only prefetch their first round as the dataloader is built)."""
    (refusal,) = one_process_runs[f"workers-{saved}-then-{resumed}"].refused(1)
    assert f"with num_workers={saved}, and this run's training dataloader has num_workers={resumed}" in refusal["error"]
    assert f"train_dataloader_kwargs={{'num_workers': {saved}}}" in refusal["error"]
    assert refusal["produced"] <= (PREFETCHED if resumed else 0)


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("processes", [1, 3])
def test_a_split_stream_resumed_on_another_number_of_processes_is_refused_before_the_first_batch(
    runs_folder, one_process_runs, processes
):
    """Each process's part of the stream, and its place there, depend on the number of processes: even with
    allow_resume_changes, the resume is refused before the stream produces a sample, saying how to resume instead
    (and nothing that it does not do)."""
    name = "split-states:other-processes"
    run = one_process_runs[name] if processes == 1 else _launch(runs_folder, 3, {name: ONE_PROCESS_RUNS[name]})[name]
    for refusal in run.refused(processes):
        assert (
            f"into an epoch of the training stream by 2 process(es), and this run has {processes}:" in refusal["error"]
        )
        assert "Resume on 2 process(es), or resume from a state taken at an epoch's end" in refusal["error"]
        assert refusal["produced"] == 0


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("allow_changes", [False, True])
def test_a_split_stream_resumed_with_the_default_stream_split_names_stream_split(two_process_runs, allow_changes):
    """A state of stream_split="dataset" resumed with the default "main_process" on the same processes: the
    refusal names stream_split and the value to pass, not the number of processes or the batch size."""
    run = two_process_runs["split-states:default-split" + ("-allowed" if allow_changes else "")]
    for refusal in run.refused(2):
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
def test_stream_split_dataset_on_a_stream_that_does_not_split_itself_is_refused_at_its_first_batch(two_process_runs):
    """With stream_split="dataset", a stream that gives every process the same samples would train each twice: the
    first batches, the same on both processes, stop the run before its first step, naming stream_split."""
    for refusal in two_process_runs["unsplit"].refused(2):
        assert "their first batches are the same: the stream does not split itself" in refusal["error"]
        assert "stream_split at 'main_process'" in refusal["error"]
        assert refusal["produced"] <= 2 * 4  # the first batch, and the one the loop reads ahead


@pytest.mark.slow
@pytest.mark.distributed
def test_a_hugging_face_stream_split_by_node_is_refused_on_the_default_stream_split(two_process_runs):
    """split_dataset_by_node gives each process its own part: on the default "main_process" the main process would
    read its part alone and send it to both (32 of 64 samples trained); the run is refused as it starts, naming the
    value to pass."""
    for refusal in two_process_runs["hf-split-by-node"].refused(2):
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
