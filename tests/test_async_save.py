"""Asynchronous training-state saves: the same state as a synchronous save, written in the background."""

from __future__ import annotations

import pytest
import torch
from conftest import assert_bitwise_equal
from test_resume_processes import _interrupted_then_resumed
from test_training_state import Crash, CrashAt, _final_state, _run

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
    first = buffers.stage(source)["model/w"]
    source["model/w"] += 1  # training changes the original in place: the copy keeps the saved values
    assert torch.equal(first, torch.arange(6.0))
    second = buffers.stage(source)["model/w"]
    assert second.data_ptr() == first.data_ptr() and torch.equal(second, torch.arange(1.0, 7.0))  # no new allocation
    assert buffers.stage({"model/w": torch.zeros(3)})["model/w"].shape == (3,)  # another shape: new buffers
    _run(tmp_path, num_epochs=1, asynchronous=True)
    assert host_buffers._buffers is None  # the copies of the run's saves are freed when it ends
