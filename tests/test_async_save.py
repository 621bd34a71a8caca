"""Asynchronous training-state saves: the same state as a synchronous save, written in the background."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import assert_bitwise_equal, regression_dataset
from test_resume_processes import _interrupted_then_resumed, _launch
from test_training_state import Crash, CrashAt, _final_state, _run
from torch import nn

from pytorch_accel_trainer import Trainer
from pytorch_accel_trainer.callbacks import StopTrainingError, TrainerCallback
from pytorch_accel_trainer.errors import CheckpointError
from pytorch_accel_trainer.state import async_save, files
from pytorch_accel_trainer.state.files import MANIFEST_NAME
from pytorch_accel_trainer.state.shards import METADATA_FILE, read_metadata
from pytorch_accel_trainer.state.training_state import find_resumable_state, list_complete_states, verify_folder


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return _final_state(_run(tmp_path_factory.mktemp("reference")))


def _state_files(folder):
    """The bytes of every file of a state but its manifest and DCP's metadata of a sharded state (which records a
    save's own id and folder: compared by :func:`_shards_layout`)."""
    return {
        path.name: path.read_bytes() for path in folder.iterdir() if path.name not in (MANIFEST_NAME, METADATA_FILE)
    }


def _shards_layout(folder):
    """What DCP's metadata says of the shards: each tensor's name, shape, dtype and chunks, and where its bytes lie."""
    metadata = read_metadata(folder)
    return metadata.state_dict_metadata, metadata.storage_data, metadata.planner_data


def _manifest_without_metadata(state):
    files = {name: entry for name, entry in state.manifest["files"].items() if name != METADATA_FILE}
    return {**state.manifest, "run_id": None, "files": files}  # two runs


@pytest.mark.parametrize("layout", ["one_file", "sharded"])
def test_async_save_equals_sync_save(tmp_path, request, reference, layout):
    """An asynchronous save writes the same state as a synchronous one, of either layout."""
    if layout == "sharded":
        request.getfixturevalue("sharded_layout")
    synchronous = _run(tmp_path / "sync", num_epochs=1)
    asynchronous = _run(tmp_path / "async", num_epochs=1, asynchronous=True)
    assert not async_save.saver.pending  # the end of train() waited for the last one
    assert_bitwise_equal(_final_state(asynchronous), _final_state(synchronous))
    sync_states, async_states = list_complete_states(tmp_path / "sync"), list_complete_states(tmp_path / "async")
    assert [state.folder.name for state in sync_states] == [state.folder.name for state in async_states]
    for sync_state, async_state in zip(sync_states, async_states):
        verify_folder(async_state.folder)
        assert async_state.layout == layout
        assert _manifest_without_metadata(async_state) == _manifest_without_metadata(sync_state)
        # same files, sizes and XXH3-128: the same bytes, and the same shards layout
        assert _state_files(async_state.folder) == _state_files(sync_state.folder)
        if layout == "sharded":
            assert _shards_layout(async_state.folder) == _shards_layout(sync_state.folder)


def test_crash_then_async_resume_is_bitwise(tmp_path, reference):
    """A crash then an asynchronous resume is bitwise equal to an uninterrupted run."""
    with pytest.raises(Crash):
        _run(tmp_path, crash=CrashAt("train_step", epoch=2, step=4), asynchronous=True)
    async_save.saver.wait()  # what a process exit does
    resumed = _run(tmp_path, asynchronous=True)
    assert_bitwise_equal(_final_state(resumed), reference)


@pytest.mark.parametrize(
    "point",
    ["write:shards", "hash:parts.pt", "manifest", "rename", "sharded:write:shards", "sharded:hash:__0_0.distcp"],
)
def test_background_failure_raised_next_save(tmp_path, request, reference, monkeypatch, point):
    """A failure in the background is raised at the next save, and leaves the last good state (``sharded:``: of a
    sharded state)."""
    if point.startswith("sharded:"):
        request.getfixturevalue("sharded_layout")
        point = point.removeprefix("sharded:")
    failed = []

    def fail(name):  # once, in the background thread, when earlier states exist that it must not damage
        if name == point and not failed and len(list_complete_states(tmp_path)) >= 4:
            failed.append(name)
            raise Crash(name)

    monkeypatch.setattr(files, "crash_point", fail)
    with pytest.raises(
        CheckpointError,
        match=r"The asynchronous save of a training state failed \(Crash: .*\); the states saved before it are intact",
    ) as raised:
        _run(tmp_path, max_checkpoints=4, asynchronous=True)
    assert failed == [point] and isinstance(raised.value.__cause__, Crash)
    assert not async_save.saver.pending
    assert all(verify_folder(state.folder) for state in list_complete_states(tmp_path))
    assert find_resumable_state(tmp_path) is not None
    monkeypatch.setattr(files, "crash_point", lambda name: None)
    resumed = _run(tmp_path, max_checkpoints=4, asynchronous=True)
    assert_bitwise_equal(_final_state(resumed), reference)


@pytest.mark.slow
@pytest.mark.distributed
def test_two_process_async_save_resumes_bitwise(tmp_path):
    """Background saves of two processes, each writing its own shard: both killed while writing the shards of a
    state, the run resumes from the last complete one, bit for bit (FSDP2 and S3: test_sharded_state.py)."""
    config = {"accumulation": 1, "shuffle": True, "asynchronous": True}
    resumed, reference, states, stopped = _interrupted_then_resumed(
        tmp_path,
        config,
        {"crash_at": "write:shards", "crash_on_hit": 5},
        2,
        expected_codes=tuple(range(1, 256)) + (-9,),
    )
    assert "Saving training state" in stopped.stdout and "in the background" in stopped.stdout
    assert_bitwise_equal(resumed, reference)
    saved = list_complete_states(states)
    assert saved and all(verify_folder(state.folder) for state in saved)
    for state in saved:
        assert state.manifest["world_size"] == 2
        assert {"__0_0.distcp", "__1_0.distcp", "rank_00000.pt", "rank_00001.pt"} <= set(state.manifest["files"])


def test_last_save_failure_raised_at_return(tmp_path, monkeypatch):
    """A failure of the last background save is raised as train() returns."""
    manifests = []

    def fail_the_last(name):  # the 11th and last save of the epoch (11 updates, one save each, none at the end)
        if name == "manifest":
            manifests.append(name)
            if len(manifests) == 11:
                raise Crash(name)

    monkeypatch.setattr(files, "crash_point", fail_the_last)
    with pytest.raises(CheckpointError, match=r"The asynchronous save of a training state failed"):
        _run(tmp_path, num_epochs=1, save_every_n_epochs=None, save_at_end=False, asynchronous=True)
    assert len(manifests) == 11 and not async_save.saver.pending
    assert len(list_complete_states(tmp_path)) == 10  # the ten before it are intact


def test_host_buffers_reused_then_freed(tmp_path):
    """Host buffers are reused by the next save, and freed as the run ends."""
    from pytorch_accel_trainer.state.async_save import HostBuffers, host_buffers

    buffers, source = HostBuffers(), {"model/w": torch.arange(6.0)}
    first = buffers.stage(source)[0]["model/w"]
    source["model/w"] += 1  # training changes the original in place: the copy keeps the saved values
    assert torch.equal(first, torch.arange(6.0))
    second = buffers.stage(source)[0]["model/w"]
    assert second.data_ptr() == first.data_ptr() and torch.equal(second, torch.arange(1.0, 7.0))  # no new allocation
    assert buffers.stage({"model/w": torch.zeros(3)})[0]["model/w"].shape == (3,)  # another shape: new buffers
    _run(tmp_path, num_epochs=1, asynchronous=True)
    assert host_buffers._buffers is None  # the copies of the run's saves are freed when it ends


# ------------------------------------------------------------------------------------------------
# Inside a run: the parameters and optimizer state copied beside the next forward and backward passes
# ------------------------------------------------------------------------------------------------


class _SaveAfter(TrainerCallback):
    """Asks for a state after each update (``asynchronous`` or not); with ``stop_after``, stops the run as that
    update's state is taken."""

    def __init__(self, folder, asynchronous, stop_after=None):
        self.folder, self.asynchronous, self.stop_after = folder, asynchronous, stop_after

    def on_optimizer_step_end(self, trainer, num_update_steps_completed=0, **kwargs):
        trainer.save_training_state(self.folder, asynchronous=self.asynchronous)
        if num_update_steps_completed == self.stop_after:
            raise StopTrainingError("stop here")


class _ChangesWeightInPlace(TrainerCallback):
    """Scales the first layer's weight in place (as a hand-written weight decay would) at ``on_train_step_start``
    of every step: the loop has waited for a save's copy before that event."""

    def on_train_step_start(self, trainer, **kwargs):
        with torch.no_grad():
            trainer.get_model()[0].weight.mul_(0.999)


class _ChangesWeightInForward(Trainer):
    """Changes the first layer's weight in place in the forward pass of the step after update ``after``: between a
    save and the next update, where an asynchronous save copies it."""

    after = 3

    def calculate_train_batch_loss(self, batch, batch_idx=None):
        if self.num_update_steps_completed == self.after:
            with torch.no_grad():
                self.get_model()[0].weight.add_(0.0)  # the values stay; the version counter moves
        return super().calculate_train_batch_loss(batch, batch_idx)


def _run_with_buffers(folder, asynchronous, trainer_class=Trainer, callbacks=(), stop_after=None, accumulation=1):
    """Six updates of a model whose forward pass changes its buffers (batch norm), a state saved after each
    (``accumulation``: micro-batches per update, each window's forward and backward passes all beside the copy)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 16), nn.BatchNorm1d(16), nn.Tanh(), nn.Linear(16, 1))
    callbacks = [_SaveAfter(folder, asynchronous, stop_after), *callbacks]
    trainer = trainer_class(model, nn.MSELoss(), torch.optim.AdamW(model.parameters(), lr=0.01), callbacks=callbacks)
    trainer.train(
        regression_dataset(24 * accumulation),
        num_epochs=1,
        per_device_batch_size=4,
        gradient_accumulation_steps=accumulation,
    )
    return trainer


def _states_bytes(folder):
    return {state.folder.name: _state_files(state.folder) for state in list_complete_states(folder)}


@pytest.mark.parametrize(
    "case", ["buffers", "accumulation", "weights changed at on_train_step_start", "stopped as it saves"]
)
def test_async_save_in_a_run_holds_the_values_of_its_update(tmp_path, case):
    """An asynchronous save inside a run copies the parameters and optimizer state beside the next forward and
    backward passes, yet writes the bytes a synchronous save writes: buffers that the next forward pass changes are
    copied before it, a window of several micro-batches runs beside the copy, a callback's in-place change at
    ``on_train_step_start`` waits for the copy, and a run stopped as a state is taken still writes it whole."""
    options = {
        "buffers": {},
        "accumulation": {"accumulation": 3},
        "weights changed at on_train_step_start": {"callbacks": [_ChangesWeightInPlace()]},
        "stopped as it saves": {"stop_after": 4},
    }[case]
    synchronous = _run_with_buffers(tmp_path / "sync", False, **options)
    asynchronous = _run_with_buffers(tmp_path / "async", True, **options)
    assert not async_save.saver.pending
    assert_bitwise_equal(_final_state(asynchronous), _final_state(synchronous))
    saved = _states_bytes(tmp_path / "async")
    assert len(saved) == (4 if case == "stopped as it saves" else 6)
    assert saved == _states_bytes(tmp_path / "sync")


def test_async_save_in_a_run_fails_when_its_weights_change_before_the_next_update(tmp_path):
    """A parameter changed in place between an asynchronous save and the next update (here in the forward pass) fails
    that save at the update, before the optimizer steps: the error names the tensor and the fix, the states before it
    are intact, and the state being taken is never sealed. A synchronous save of the same run is no error."""
    with pytest.raises(
        CheckpointError, match=r"'model/0\.weight' was changed in place between the asynchronous"
    ) as raised:
        _run_with_buffers(tmp_path / "async", True, trainer_class=_ChangesWeightInForward)
    message = str(raised.value)
    assert "asynchronous=False" in message and "optimizer_step()" in message
    assert not async_save.saver.pending
    states = list_complete_states(tmp_path / "async")
    assert [state.manifest["num_update_steps_completed"] for state in states] == [1, 2]
    assert all(verify_folder(state.folder) for state in states)
    trainer = _run_with_buffers(tmp_path / "sync", False, trainer_class=_ChangesWeightInForward)
    assert trainer.num_update_steps_completed == 6


class _RaisesInForward(Trainer):
    """Raises in the forward pass of the step after update 3, when an asynchronous save of update 3 is copying."""

    def calculate_train_batch_loss(self, batch, batch_idx=None):
        if self.num_update_steps_completed == 3:
            raise RuntimeError("the user's forward failed")
        return super().calculate_train_batch_loss(batch, batch_idx)


def test_a_run_that_raises_beside_an_async_save_still_writes_it(tmp_path):
    """A run that raises while an asynchronous save copies beside its forward pass raises its own error, once the
    save under way is written whole: no event or update came to wait for the copy, the end of the run did."""
    with pytest.raises(RuntimeError, match="the user's forward failed"):
        _run_with_buffers(tmp_path, True, trainer_class=_RaisesInForward)
    assert not async_save.saver.pending
    states = list_complete_states(tmp_path)
    assert [state.manifest["num_update_steps_completed"] for state in states] == [1, 2, 3]
    assert all(verify_folder(state.folder) for state in states)


@pytest.mark.distributed
def test_two_processes_fail_together_when_one_changes_a_weight_beside_an_async_save(tmp_path):
    """Only process 1 changes a weight between an asynchronous save and the next update: both processes raise at that
    update, process 0 naming process 1 and the tensor, and neither seals the state."""
    out = tmp_path / "raised"
    launched = _launch({"weight_changed_out": str(out), "save_dir": str(tmp_path / "states")}, 2)
    assert launched.returncode == 0, launched.stderr[-3000:]
    reports = [json.loads(Path(f"{out}.{rank}.json").read_text()) for rank in range(2)]
    assert [report["updates"] for report in reports] == [3, 3]
    for report in reports:
        assert report["raised"].startswith("CheckpointError: The asynchronous save of a training state failed")
        assert "'model/0.weight' was changed in place between the asynchronous save" in report["raised"]
    assert "Process 1 could not write its copy of the training state" in reports[0]["raised"]
    states = list_complete_states(tmp_path / "states")
    assert [state.manifest["num_update_steps_completed"] for state in states] == [1, 2]
