"""Exact resume, crash-safe writes and verified loads of training states (in one process, fast)."""

from __future__ import annotations

import functools
import json
import os
import pickle

import pytest
import torch
from conftest import assert_bitwise_equal, regression_dataset
from torch import nn

from pytorch_accel_trainer import Trainer, training_state
from pytorch_accel_trainer.callbacks import SaveTrainingStateCallback, StopTrainingError, TrainerCallback
from pytorch_accel_trainer.state.files import CHECKSUM, file_digest
from pytorch_accel_trainer.state.training_state import (
    MANIFEST_NAME,
    CheckpointError,
    find_resumable_state,
    list_complete_states,
    verify_folder,
)


class Crash(Exception):
    """Stands for the process dying at a chosen point."""


class CrashAt(TrainerCallback):
    def __init__(self, event, epoch, step=0):
        self.event, self.epoch, self.step, self.eval_steps = event, epoch, step, 0

    def on_train_step_end(self, trainer, step, **kwargs):
        if self.event == "train_step" and (trainer.run_history.current_epoch, step) == (self.epoch, self.step):
            raise Crash()

    def on_eval_epoch_start(self, trainer, **kwargs):
        self.eval_steps = 0

    def on_eval_step_end(self, trainer, **kwargs):
        if self.event == "eval_step" and (trainer.run_history.current_epoch, self.eval_steps) == (
            self.epoch,
            self.step,
        ):
            raise Crash()
        self.eval_steps += 1


def _run(
    save_dir,
    crash=None,
    accumulation=1,
    shuffle=True,
    scheduler=True,
    num_epochs=3,
    size=22,
    batch_size=2,
    **callback_kwargs,
):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 16), nn.Dropout(0.2), nn.Tanh(), nn.Linear(16, 1))
    callbacks = [SaveTrainingStateCallback(save_dir, **{"save_every_n_steps": 1, **callback_kwargs})]
    if crash is not None:
        callbacks.append(crash)
    trainer = Trainer(model, nn.MSELoss(), torch.optim.AdamW(model.parameters(), lr=0.01), callbacks=callbacks)
    trainer.train(
        regression_dataset(size),
        num_epochs=num_epochs,
        eval_dataset=regression_dataset(6, seed=1),
        per_device_batch_size=batch_size,
        gradient_accumulation_steps=accumulation,
        create_scheduler_fn=functools.partial(torch.optim.lr_scheduler.StepLR, step_size=2, gamma=0.8)
        if scheduler
        else None,
        train_dataloader_kwargs={"shuffle": shuffle},
        resume_from=save_dir,
    )
    return trainer


def _final_state(trainer):
    return {
        "model": trainer.get_model().state_dict(),
        "optimizer": trainer.optimizer.state_dict(),
        "scheduler": trainer.scheduler.state_dict() if trainer.scheduler is not None else None,
        "history": trainer.run_history.state_dict(),
    }


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    cache = {}

    def reference(**config):
        key = json.dumps(config, sort_keys=True)
        if key not in cache:
            folder = tmp_path_factory.mktemp("reference")
            cache[key] = _final_state(_run(folder, **config))
        return cache[key]

    return reference


CRASHES = [
    ({"accumulation": 1}, CrashAt("train_step", epoch=2, step=4)),
    ({"accumulation": 3}, CrashAt("train_step", epoch=2, step=4)),  # inside an accumulation window
    ({"accumulation": 3, "shuffle": False}, CrashAt("train_step", epoch=1, step=1)),
    ({"accumulation": 1, "scheduler": False}, CrashAt("eval_step", epoch=2, step=1)),  # during evaluation
    ({"accumulation": 3}, CrashAt("train_step", epoch=3, step=10)),  # the last, partial window
]


@pytest.mark.parametrize(("config", "crash"), CRASHES, ids=lambda value: getattr(value, "event", str(value)))
def test_crash_then_resume_is_bitwise_equal_to_an_uninterrupted_run(tmp_path, references, config, crash):
    with pytest.raises(Crash):
        _run(tmp_path, crash=crash, **config)
    resumed = _run(tmp_path, **config)
    assert_bitwise_equal(_final_state(resumed), references(**config))


def test_resume_continues_the_epoch_and_adds_no_epoch(tmp_path):
    with pytest.raises(Crash):
        _run(tmp_path, crash=CrashAt("train_step", epoch=2, step=6))
    resumed = _run(tmp_path)
    assert resumed.run_history.current_epoch == 4  # three epochs in all
    assert len(resumed.run_history.get_metric_values("train_loss_epoch")) == 3
    assert resumed.num_update_steps_completed == 33


@pytest.mark.parametrize(
    "point",
    [
        "write:rank_00000.pt",
        "write:model.safetensors",
        "write:optimizer.pt",
        "write:scheduler.pt",
        "write:trainer_state.pt",
        "hash:model.safetensors",
        "manifest",
        "rename",
        "latest",
        "prune:step_5",
    ],
)
def test_a_crash_at_any_point_of_a_save_leaves_a_loadable_state_and_resumes_exactly(
    tmp_path, references, monkeypatch, point
):
    crashed = []

    def crash(name):  # once, when earlier states exist that the crash must not damage
        if name == point and not crashed and len(list_complete_states(tmp_path)) >= 4:
            crashed.append(name)
            raise Crash(name)

    monkeypatch.setattr(training_state, "_crash_point", crash)
    with pytest.raises(Crash):
        _run(tmp_path, max_checkpoints=4)
    assert crashed == [point]
    newest = find_resumable_state(tmp_path)
    assert newest is not None and verify_folder(newest.folder)
    assert all(verify_folder(state.folder) for state in list_complete_states(tmp_path))
    monkeypatch.setattr(training_state, "_crash_point", lambda name: None)
    resumed = _run(tmp_path, max_checkpoints=4)
    assert_bitwise_equal(_final_state(resumed), references())


def _saved_state(tmp_path, **config):
    _run(tmp_path, num_epochs=1, **config)
    return find_resumable_state(tmp_path).folder


def damage_file(path, damage: str) -> None:
    """Flip one bit in the middle of ``path`` (``"flip"``), or cut it in half (``"truncate"``)."""
    data = bytearray(path.read_bytes())
    if damage == "flip":
        data[len(data) // 2] ^= 0x01
    else:
        data = data[: len(data) // 2]
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(
    "name", ["model.safetensors", "optimizer.pt", "scheduler.pt", "trainer_state.pt", "rank_00000.pt"]
)
@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_a_flipped_byte_or_a_truncation_is_detected_naming_the_file(tmp_path, name, damage):
    folder = _saved_state(tmp_path, max_checkpoints=1)
    damage_file(folder / name, damage)
    with pytest.raises(CheckpointError, match=rf"{name}: .*(XXH3-128 does not match|truncated)"):
        verify_folder(folder)
    with pytest.raises(
        CheckpointError, match=rf"none can be resumed, so the run was not restarted from scratch:\n.*{name}"
    ):
        _run(tmp_path, num_epochs=2)


@pytest.mark.filterwarnings("ignore:Detected pickle protocol")
def test_a_hostile_pickle_is_never_executed_even_with_a_forged_manifest(tmp_path):
    folder = _saved_state(tmp_path, max_checkpoints=1)
    marker = tmp_path / "pwned"

    class Hostile:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    (folder / "optimizer.pt").write_bytes(pickle.dumps(Hostile()))
    manifest = json.loads((folder / MANIFEST_NAME).read_text())
    size, digest = file_digest(folder / "optimizer.pt")
    manifest["files"]["optimizer.pt"] = {"size": size, CHECKSUM: digest}
    (folder / MANIFEST_NAME).write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="only pickle can rebuild; refused"):
        _run(tmp_path, num_epochs=2)
    assert not marker.exists()


def test_empty_missing_and_damaged_folders(tmp_path, capsys):
    model = nn.Linear(4, 1)
    trainer = Trainer(model, nn.MSELoss(), torch.optim.SGD(model.parameters(), lr=0.1), callbacks=())
    trainer.train(regression_dataset(4), num_epochs=1, resume_from=tmp_path / "absent")  # a preemptible job's start
    assert "absent' does not exist yet: starting a new run" in capsys.readouterr().out
    empty = tmp_path / "empty"
    _run(empty, num_epochs=1)
    assert "holds no training state yet: starting a new run" in capsys.readouterr().out
    for folder in list(empty.iterdir()):
        if folder.is_dir():
            (folder / MANIFEST_NAME).write_text("{not json")
    with pytest.raises(CheckpointError, match="damaged manifest"):
        _run(empty, num_epochs=2)


def test_a_changed_setup_is_refused_with_each_difference_unless_allowed(tmp_path):
    _run(tmp_path, num_epochs=1)
    with pytest.raises(
        CheckpointError,
        match=(
            r"(?s)gradient_accumulation_steps: saved 1, now 2.*per_device_batch_size: saved 2, now 4"
            r".*train_dataset_length: saved 22, now 20.*allow_resume_changes=True"
        ),
    ):
        _run(tmp_path, num_epochs=2, accumulation=2, batch_size=4, size=20)
    model = nn.Linear(4, 1)
    trainer = Trainer(model, nn.MSELoss(), torch.optim.SGD(model.parameters(), lr=0.1), callbacks=())
    with pytest.raises(CheckpointError, match="model.safetensors does not fit this model"):
        trainer.train(
            regression_dataset(22),
            num_epochs=2,
            per_device_batch_size=2,
            resume_from=tmp_path,
            allow_resume_changes=True,
        )


def test_allowing_changes_resumes_with_another_batch_size(tmp_path):
    _run(tmp_path, num_epochs=1)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 16), nn.Dropout(0.2), nn.Tanh(), nn.Linear(16, 1))
    trainer = Trainer(model, nn.MSELoss(), torch.optim.AdamW(model.parameters(), lr=0.01), callbacks=())
    trainer.train(
        regression_dataset(22),
        num_epochs=2,
        per_device_batch_size=4,
        resume_from=tmp_path,
        allow_resume_changes=True,
        create_scheduler_fn=functools.partial(torch.optim.lr_scheduler.StepLR, step_size=2, gamma=0.8),
    )
    assert trainer.num_update_steps_completed == 11 + 6
    assert len(trainer.run_history.get_metric_values("train_loss_epoch")) == 2


def test_rolling_permanent_and_best_states_are_kept_as_asked(tmp_path):
    _run(
        tmp_path,
        num_epochs=3,
        save_every_n_steps=2,
        max_checkpoints=2,
        keep_every_n_steps=10,
        watch_metric="eval_loss_epoch",
    )
    states = list_complete_states(tmp_path)
    kinds = {state.folder.name: state.kinds for state in states}
    rolling = [name for name, k in kinds.items() if "rolling" in k and "permanent" not in k and "best" not in k]
    assert len(rolling) <= 2
    assert {"step_10", "step_20", "step_30"} <= set(kinds)  # named as pytorch-accelerated's callback names them
    assert sum("best" in k for k in kinds.values()) == 1
    assert (tmp_path / "latest").read_text().strip() == states[-1].folder.name


def test_names_continue_across_a_resume_and_nothing_is_overwritten(tmp_path):
    with pytest.raises(Crash):
        _run(tmp_path, crash=CrashAt("train_step", epoch=2, step=2))
    names_before = {p.name: p.stat().st_mtime_ns for p in tmp_path.iterdir() if p.is_dir()}
    _run(tmp_path)
    after = {p.name: p.stat().st_mtime_ns for p in tmp_path.iterdir() if p.is_dir()}
    for name, mtime in names_before.items():
        assert name not in after or after[name] == mtime


def test_a_save_asked_inside_an_accumulation_window_is_taken_when_it_closes(tmp_path):
    class SaveMidWindow(TrainerCallback):
        def on_train_step_end(self, trainer, step, **kwargs):
            if trainer.run_history.current_epoch == 1 and step == 4:  # window of steps 3, 4, 5
                assert trainer.save_training_state(tmp_path / "manual") is None

    (tmp_path / "manual").mkdir()
    _run(tmp_path / "auto", crash=SaveMidWindow(), accumulation=3, num_epochs=1)
    (state,) = list_complete_states(tmp_path / "manual")
    assert state.manifest["num_update_steps_completed"] == 2
    assert state.manifest["position"] == {"loop_epoch": 0, "batches_seen": 6, "rng_restore_point": "after_iterator"}


def test_a_step_save_due_at_an_update_that_stops_the_run_is_written_once(tmp_path):
    class StopAfter(TrainerCallback):
        def on_optimizer_step_end(self, trainer, num_update_steps_completed, **kwargs):
            if num_update_steps_completed == 15:  # inside the second epoch (11 updates per epoch)
                raise StopTrainingError("stopped by a callback")

    stopped = _run(tmp_path, crash=StopAfter(), save_every_n_steps=5, save_every_n_epochs=None, save_at_end=True)
    assert stopped.num_update_steps_completed == 15
    names = [state.folder.name for state in list_complete_states(tmp_path)]
    assert sorted(names) == ["final", "step_10", "step_15", "step_5"]  # none lost, none twice; final as the run ends
    position = list_complete_states(tmp_path)[-1].manifest["position"]
    assert position == {"loop_epoch": 1, "batches_seen": 4, "rng_restore_point": "after_iterator"}  # the next batch


def test_resuming_skips_by_sampler_offset_without_loading_skipped_samples(tmp_path):
    loaded = []

    class CountingDataset(torch.utils.data.Dataset):
        def __init__(self):
            self.inner = regression_dataset(200)

        def __len__(self):
            return len(self.inner)

        def __getitem__(self, index):
            loaded.append(index)
            return self.inner[index]

    def run(crash=None):
        torch.manual_seed(0)
        model = nn.Linear(4, 1)
        callbacks = [SaveTrainingStateCallback(tmp_path, save_every_n_steps=1, max_checkpoints=1)] + (
            [crash] if crash else []
        )
        trainer = Trainer(model, nn.MSELoss(), torch.optim.SGD(model.parameters(), lr=0.01), callbacks=callbacks)
        trainer.train(CountingDataset(), num_epochs=1, per_device_batch_size=2, resume_from=tmp_path)

    with pytest.raises(Crash):
        run(CrashAt("train_step", epoch=1, step=90))
    loaded.clear()
    run()
    assert len(loaded) == 200 - 2 * 90  # only the batches not trained on yet are loaded


@pytest.mark.exhaustive
@pytest.mark.parametrize("shuffle", [True, False])
@pytest.mark.parametrize("accumulation", [1, 2, 3])
@pytest.mark.parametrize("scheduler", [True, False])
@pytest.mark.parametrize(
    "crash",
    [
        ("train_step", 1, 0),
        ("train_step", 1, 5),
        ("train_step", 2, 1),
        ("train_step", 2, 10),
        ("eval_step", 1, 0),
        ("eval_step", 3, 2),
        ("train_step", 3, 7),
    ],
)
def test_exhaustive_resume_matrix(tmp_path, references, shuffle, accumulation, scheduler, crash):
    config = {"shuffle": shuffle, "accumulation": accumulation, "scheduler": scheduler}
    with pytest.raises(Crash):
        _run(tmp_path, crash=CrashAt(*crash), **config)
    assert_bitwise_equal(_final_state(_run(tmp_path, **config)), references(**config))


def test_a_resumed_epoch_starts_its_progress_bar_at_the_saved_step(tmp_path):
    from pytorch_accel_trainer.callbacks import ProgressBarCallback

    class BarStart(TrainerCallback):
        def __init__(self, bar):
            self.bar, self.starts = bar, []

        def on_train_epoch_start(self, trainer, **kwargs):
            self.starts.append((trainer.run_history.current_epoch, trainer.epoch_first_step, self.bar.pbar.n))

    with pytest.raises(Crash):
        _run(tmp_path, crash=CrashAt("train_step", epoch=2, step=6))
    bar = ProgressBarCallback()
    spy = BarStart(bar)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 16), nn.Dropout(0.2), nn.Tanh(), nn.Linear(16, 1))
    trainer = Trainer(model, nn.MSELoss(), torch.optim.AdamW(model.parameters(), lr=0.01), callbacks=[bar, spy])
    trainer.train(
        regression_dataset(22),
        num_epochs=3,
        eval_dataset=regression_dataset(6, seed=1),
        per_device_batch_size=2,
        create_scheduler_fn=functools.partial(torch.optim.lr_scheduler.StepLR, step_size=2, gamma=0.8),
        resume_from=tmp_path,
    )
    assert spy.starts == [(2, 6, 6), (3, 0, 0)]


def test_bad_save_intervals_are_refused_with_the_fix(tmp_path):
    with pytest.raises(
        ValueError,
        match=r"save_every_n_steps is 0; pass a positive whole number of updates, e.g. save_every_n_steps=100",
    ):
        SaveTrainingStateCallback(tmp_path, save_every_n_steps=0)
    with pytest.raises(
        ValueError, match=r"max_checkpoints is -1; pass a positive whole number of states, e.g. max_checkpoints=3"
    ):
        SaveTrainingStateCallback(tmp_path, max_checkpoints=-1)
