"""A training state saved on 2 processes under FSDP2 in the middle of an epoch, resumed on 1 (the plain model), 2, 3
and 4 processes (FSDP2): every sample of the interrupted epoch is trained exactly once across the two runs
(tests/scripts/resize_run.py).

The first run (2 processes, batches of 4, 64 samples: 8 updates an epoch) stops after 3 updates of epoch 2, so the
2 x 3 x 4 = 24 samples that Accelerate's shuffled sampler puts first in epoch 2 are trained; the resume
(``allow_resume_changes=True``) trains the other 40, split between its processes. 40 samples fill whole rounds of
batches on 1 and 2 processes (10 and 5 rounds), but not on 3 or 4 (12 and 16 samples a round): there Accelerate's
``even_batches`` completes the last round with repeated samples, 8 of them on either (48 places for 40 samples), in
the last batch of a process. Those repeats are the only samples allowed twice. One launch per number of processes
(the first run, then one resume each); a resume on another number of processes first tries without
``allow_resume_changes``, which must be refused on every process alike.

And the other way: a state saved by one process (one file, the plain model) resumed on 2 processes, under FSDP2 (each
process takes its shard of the full tensors) and under DDP: the weights loaded bit for bit, and every remaining sample
of the interrupted epoch trained once.
"""

from __future__ import annotations

import collections
import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from conftest import CPU_PROCESSES_ENV, assert_bitwise_equal, launcher

from pytorch_accel_trainer.state.training_state import list_complete_states

SCRIPT = Path(__file__).parent / "scripts" / "resize_run.py"

NUM_SAMPLES = 64
PER_DEVICE_BATCH_SIZE = 4
SAVED_WORLD_SIZE = 2
STOP_AFTER_BATCHES = 3  # updates of epoch 2 before the stop, one batch each (the script's STOP_AFTER_BATCHES)
EPOCH = "2"  # the interrupted epoch, in the run history's count (from 1)
RESIZED = [1, 3, 4]

#: What a process says when it is asked to resume with another number of processes but the error is not the one that
#: names the change: a missing rank file, or the weights blamed.
MISLEADING = ("does not fit this model", "holds no state for process")


def _launch(folder: Path, phase: str, num_processes: int, parallel: str = "fsdp2") -> subprocess.CompletedProcess:
    command = [*launcher(num_processes), str(SCRIPT), str(folder), phase, str(num_processes), parallel]
    return subprocess.run(command, env=CPU_PROCESSES_ENV, capture_output=True, text=True, timeout=240)


def _errors(stderr: str) -> str:
    """The distinct error lines of ``stderr`` (each process's last traceback line), then its end."""
    lines = (re.sub(r"^\[rank\d+\]: ", "", line) for line in stderr.splitlines())
    errors = dict.fromkeys(line for line in lines if re.match(r"^[\w.]+(Error|Exception)\b", line))
    return "errors:\n" + "\n".join(errors) + f"\n--- end of stderr:\n{stderr[-3000:]}"


def _check_launch(completed: subprocess.CompletedProcess, what: str) -> None:
    if completed.returncode != 0:
        pytest.fail(f"{what} exited {completed.returncode}\n{_errors(completed.stderr)}", pytrace=False)


class Launch:
    """The folder one launch of the script wrote, and how it ended."""

    def __init__(self, folder: Path, num_processes: int, completed: subprocess.CompletedProcess):
        self.folder, self.num_processes, self.completed = folder, num_processes, completed

    def ids(self, phase: str) -> list:
        """Each process's ``{epoch: [[ids of a batch], ...]}``, by rank."""
        return [
            json.loads((self.folder / f"ids_{phase}_rank{rank}.json").read_text()) for rank in range(self.num_processes)
        ]

    def strict(self) -> list:
        """What the attempt without ``allow_resume_changes`` raised on each process, by rank."""
        paths = [self.folder / f"strict_rank{rank}.json" for rank in range(self.num_processes)]
        missing = [path.name for path in paths if not path.exists()]
        if missing:
            pytest.fail(
                f"no record of the attempt without allow_resume_changes on {missing}\n{_errors(self.completed.stderr)}",
                pytrace=False,
            )
        return [json.loads(path.read_text()) for path in paths]


@pytest.fixture(scope="module")
def first_run(tmp_path_factory) -> Launch:
    """The 2-process run stopped inside epoch 2 with its state in ``states/``, then an uninterrupted run's ids."""
    folder = tmp_path_factory.mktemp("first")
    completed = _launch(folder, "first", SAVED_WORLD_SIZE)
    _check_launch(completed, "the first run (2 processes)")
    return Launch(folder, SAVED_WORLD_SIZE, completed)


@pytest.fixture(scope="module")
def resumed(first_run, tmp_path_factory):
    """``resumed(n)``: the launch that resumed a copy of the first run's state on ``n`` processes (once per ``n``)."""
    launches: dict = {}

    def resume(num_processes: int) -> Launch:
        if num_processes not in launches:
            folder = tmp_path_factory.mktemp(f"resume-{num_processes}")
            shutil.copytree(first_run.folder / "states", folder / "states")
            launches[num_processes] = Launch(folder, num_processes, _launch(folder, "resume", num_processes))
        return launches[num_processes]

    return resume


def _flat(batches: list) -> list:
    return [sample for batch in batches for sample in batch]


def _trained_before_the_stop(first_run: Launch) -> list:
    return [sample for ids in first_run.ids("first") for sample in _flat(ids[EPOCH])]


@pytest.mark.slow
@pytest.mark.distributed
def test_first_run_stops_inside_epoch_two(first_run):
    """The script's premise: the stopped run trained epoch 1 whole and the first 3 batches of epoch 2 of each process,
    as the uninterrupted run did; the two processes' samples are distinct."""
    for stopped, reference in zip(first_run.ids("first"), first_run.ids("reference")):
        assert stopped["1"] == reference["1"]
        assert stopped[EPOCH] == reference[EPOCH][:STOP_AFTER_BATCHES]
        assert len(reference[EPOCH]) == NUM_SAMPLES // (SAVED_WORLD_SIZE * PER_DEVICE_BATCH_SIZE)
    before = _trained_before_the_stop(first_run)
    assert len(before) == len(set(before)) == SAVED_WORLD_SIZE * STOP_AFTER_BATCHES * PER_DEVICE_BATCH_SIZE
    assert sorted(_flat([batch for ids in first_run.ids("reference") for batch in ids[EPOCH]])) == list(
        range(NUM_SAMPLES)
    )
    (state,) = list_complete_states(first_run.folder / "states")
    shards = sorted(name for name in state.manifest["files"] if name.endswith(".distcp"))
    assert shards == ["__0_0.distcp", "__1_0.distcp"] and state.manifest["world_size"] == SAVED_WORLD_SIZE


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("num_processes", RESIZED)
def test_resume_on_other_process_count_trains_each_remaining_sample_once(first_run, resumed, num_processes):
    launch = resumed(num_processes)
    _check_launch(launch.completed, f"the resume on {num_processes} process(es)")
    assert "Resuming from" in launch.completed.stdout
    _assert_each_remaining_sample_trained_once(_trained_before_the_stop(first_run), launch.ids("resume"), num_processes)


def _assert_each_remaining_sample_trained_once(before: list, after_by_rank: list, num_processes: int) -> None:
    """``before``: the samples of epoch 2 trained before the stop; ``after_by_rank``: each resumed process's ids."""
    assert {epoch for ids in after_by_rank for epoch in ids} == {EPOCH}, "the resume trains the rest of epoch 2 only"
    after = [sample for ids in after_by_rank for sample in _flat(ids[EPOCH])]
    remaining = NUM_SAMPLES - len(before)
    # even_batches: the last round of batches is completed with repeated samples (8 on 3 or 4 processes, none on 1)
    padding = -remaining % (num_processes * PER_DEVICE_BATCH_SIZE)
    counts = collections.Counter(before + after)
    never = sorted(set(range(NUM_SAMPLES)) - set(counts))
    twice_before = sorted(sample for sample in set(before) if sample in after)
    assert not never, f"samples of epoch 2 never trained: {never}"
    assert set(counts) == set(range(NUM_SAMPLES))
    # the repeats are in each process's last batch only: everything else is trained once
    body = before + [sample for ids in after_by_rank for sample in _flat(ids[EPOCH][:-1])]
    repeated_in_body = sorted(sample for sample, count in collections.Counter(body).items() if count > 1)
    assert not repeated_in_body, (
        f"samples trained twice before the last batch of the resume: {repeated_in_body} "
        f"(trained before the stop and again after the resume: {twice_before})"
    )
    extra = len(before) + len(after) - NUM_SAMPLES
    assert 0 <= extra <= padding, (
        f"{extra} samples trained twice ({twice_before} before the stop and after the resume), but even_batches "
        f"repeats at most {padding} of the {remaining} remaining samples on {num_processes} process(es)"
    )
    if padding == 0:
        assert sorted(before + after) == list(range(NUM_SAMPLES))


@pytest.mark.slow
@pytest.mark.distributed
def test_resume_on_same_process_count_continues_the_epoch_in_order(first_run, resumed):
    """Nothing changed (2 -> 2, still with allow_resume_changes=True): each process trains the rest of its epoch 2
    as the uninterrupted run did, batch for batch."""
    launch = resumed(SAVED_WORLD_SIZE)
    _check_launch(launch.completed, "the resume on 2 processes")
    assert "Resuming from" in launch.completed.stdout
    for rank, (after, reference) in enumerate(zip(launch.ids("resume"), first_run.ids("reference"))):
        assert after == {EPOCH: reference[EPOCH][STOP_AFTER_BATCHES:]}, f"process {rank}"


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("num_processes", RESIZED)
def test_resume_on_other_process_count_needs_allow_resume_changes(resumed, num_processes):
    """Without allow_resume_changes, every process refuses with the same error, which names the setting that
    changed (world_size) and the way out (allow_resume_changes); no process blames the weights or its rank file."""
    launch = resumed(num_processes)
    records = launch.strict()
    trained = [rank for rank, record in enumerate(records) if not record["raised"]]
    assert not trained, f"processes {trained} resumed on {num_processes} process(es) without allow_resume_changes"
    assert len({(record["type"], record["message"]) for record in records}) == 1, records
    message = records[0]["message"]
    assert records[0]["type"] == "CheckpointError", records[0]
    assert "allow_resume_changes" in message and "world_size" in message, message
    assert not [phrase for phrase in MISLEADING if phrase in message], message
    assert "does not fit this model" not in launch.completed.stderr, _errors(launch.completed.stderr)


@pytest.fixture(scope="module")
def one_process_first_run(tmp_path_factory) -> Launch:
    """The run stopped inside epoch 2 on one process (the plain model), with its state in ``states/``."""
    folder = tmp_path_factory.mktemp("first-1")
    completed = _launch(folder, "first", 1)
    _check_launch(completed, "the first run (1 process)")
    return Launch(folder, 1, completed)


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("parallel", ["fsdp2", "ddp"])
def test_one_process_state_resumes_on_two_processes(one_process_first_run, tmp_path_factory, parallel):
    """A one-process state (its model and optimizer in one file) resumed on 2 processes: under FSDP2 each process
    takes its shard of the full tensors, under DDP all of them; the weights the resume starts from are the saved
    ones, bit for bit, and every remaining sample of the interrupted epoch is trained once."""
    (state,) = list_complete_states(one_process_first_run.folder / "states")
    assert state.layout == "one_file" and state.manifest["world_size"] == 1
    folder = tmp_path_factory.mktemp(f"resume-one-file-{parallel}")
    shutil.copytree(one_process_first_run.folder / "states", folder / "states")
    launch = Launch(folder, 2, _launch(folder, "resume", 2, parallel))
    _check_launch(launch.completed, f"the resume of a one-process state on 2 processes ({parallel})")
    assert "Resuming from" in launch.completed.stdout
    saved = torch.load(state.folder / "parts.pt", weights_only=True)["model"]
    assert_bitwise_equal(torch.load(folder / "loaded.pt", weights_only=True), saved)
    before = _trained_before_the_stop(one_process_first_run)
    _assert_each_remaining_sample_trained_once(before, launch.ids("resume"), 2)
    records = launch.strict()  # without allow_resume_changes: refused on both processes, naming the change
    assert all(record["raised"] and "world_size" in record["message"] for record in records), records
