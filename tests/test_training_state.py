"""Exact resume, crash-safe writes and verified loads of training states (in one process, fast).

A run stopped inside an epoch (the step limit, a StopTrainingError, a signal, the time budget) and then extended
continues exactly: the state saved at the stop holds the next batch, and the resumed run ends bit for bit where an
uninterrupted run ends.
"""

from __future__ import annotations

import functools
import json
import math
import os
import pickle
import signal
import time

import pytest
import torch
from conftest import assert_bitwise_equal, regression_dataset
from torch import nn

from pytorch_accel_trainer import Trainer
from pytorch_accel_trainer.callbacks import SaveTrainingStateCallback, StopTrainingError, TrainerCallback
from pytorch_accel_trainer.errors import CheckpointError
from pytorch_accel_trainer.state import files
from pytorch_accel_trainer.state.files import CHECKSUM, MANIFEST_NAME, file_digest
from pytorch_accel_trainer.state.training_state import find_resumable_state, list_complete_states, verify_folder


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
def test_crash_then_resume_is_bitwise_equal(tmp_path, references, config, crash):
    """A crash then a resume is bitwise equal to an uninterrupted run."""
    with pytest.raises(Crash):
        _run(tmp_path, crash=crash, **config)
    resumed = _run(tmp_path, **config)
    assert_bitwise_equal(_final_state(resumed), references(**config))


def test_resume_continues_the_epoch(tmp_path):
    """A resume continues the epoch and adds no epoch."""
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
        "write:shards",
        "write:trainer_state.pt",
        "hash:parts.pt",
        "hash:trainer_state.pt",
        "manifest",
        "rename",
        "latest",
        "prune:step_5",
        "sharded:write:shards",
        "sharded:hash:.metadata",
        "sharded:hash:__0_0.distcp",
    ],
)
def test_crash_during_save_resumes_exactly(tmp_path, references, monkeypatch, request, point):
    """A crash at any point of a save leaves a loadable state, and resumes exactly (``sharded:``: of a sharded state,
    DCP's shards and metadata)."""
    if point.startswith("sharded:"):
        request.getfixturevalue("sharded_layout")
        point = point.removeprefix("sharded:")
    crashed = []

    def crash(name):  # once, when earlier states exist that the crash must not damage
        if name == point and not crashed and len(list_complete_states(tmp_path)) >= 4:
            crashed.append(name)
            raise Crash(name)

    monkeypatch.setattr(files, "crash_point", crash)
    with pytest.raises(Crash):
        _run(tmp_path, max_checkpoints=4)
    assert crashed == [point]
    newest = find_resumable_state(tmp_path)
    assert newest is not None and verify_folder(newest.folder)
    assert all(verify_folder(state.folder) for state in list_complete_states(tmp_path))
    monkeypatch.setattr(files, "crash_point", lambda name: None)
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


@pytest.mark.parametrize("name", ["parts.pt", "trainer_state.pt", "rank_00000.pt", "__0_0.distcp", ".metadata"])
@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_flipped_byte_or_truncation_detected(tmp_path, request, name, damage):
    """A damaged file of a state (of a one-file state; DCP's files of a sharded one) is named, and no state resumed."""
    if name in ("__0_0.distcp", ".metadata"):
        request.getfixturevalue("sharded_layout")
    folder = _saved_state(tmp_path, max_checkpoints=1)
    damage_file(folder / name, damage)
    with pytest.raises(CheckpointError, match=rf"{name}: .*(XXH3-128 does not match|truncated)"):
        verify_folder(folder)
    with pytest.raises(
        CheckpointError, match=rf"none can be resumed, so the run was not restarted from scratch:\n.*{name}"
    ):
        _run(tmp_path, num_epochs=2)


@pytest.mark.filterwarnings("ignore:Detected pickle protocol")
@pytest.mark.parametrize("name", ["parts.pt", "trainer_state.pt", "rank_00000.pt"])
def test_hostile_pickle_is_never_executed(tmp_path, name):
    """A hostile pickle in a torch file of the state is never executed, even with a forged manifest (DCP's files:
    test_state_folders.py)."""
    folder = _saved_state(tmp_path, max_checkpoints=1)
    marker = tmp_path / "pwned"

    class Hostile:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    if name == "parts.pt":  # read memory-mapped: a torch file's zip format, whose pickle names the payload
        torch.save(Hostile(), folder / name)
    else:
        (folder / name).write_bytes(pickle.dumps(Hostile()))
    manifest = json.loads((folder / MANIFEST_NAME).read_text())
    size, digest = file_digest(folder / name)
    manifest["files"][name] = {"size": size, CHECKSUM: digest}
    (folder / MANIFEST_NAME).write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="only pickle can rebuild; refused"):
        _run(tmp_path, num_epochs=2)
    assert not marker.exists()


@pytest.mark.parametrize("part, name", [("model", "0.bias"), ("optimizer", "0.bias")])
def test_parts_file_of_another_shape_is_refused_before_loading(tmp_path, part, name):
    """A one-file state whose parts file holds a tensor of another shape (its manifest forged to match) is refused by
    the fit check, naming the tensor, before anything is loaded into the live model and optimizer."""
    folder = _saved_state(tmp_path, max_checkpoints=1)
    saved = torch.load(folder / "parts.pt", weights_only=True)
    if part == "model":
        saved["model"][name] = torch.zeros(3)
        flat = f"model/{name}"
    else:
        saved["optimizer"]["state"][name]["exp_avg"] = torch.zeros(3)
        flat = f"optimizer/state/{name}/exp_avg"
    torch.save(saved, folder / "parts.pt")
    manifest = json.loads((folder / MANIFEST_NAME).read_text())
    size, digest = file_digest(folder / "parts.pt")
    manifest["files"]["parts.pt"] = {"size": size, CHECKSUM: digest}
    (folder / MANIFEST_NAME).write_text(json.dumps(manifest))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 16), nn.Dropout(0.2), nn.Tanh(), nn.Linear(16, 1))
    before = {key: value.clone() for key, value in model.state_dict().items()}
    trainer = Trainer(model, nn.MSELoss(), torch.optim.AdamW(model.parameters(), lr=0.01), callbacks=())
    with pytest.raises(
        CheckpointError,
        match=rf"does not fit this run's model, optimizer: other shapes \({flat}: saved \[3\], now \[16\]\)",
    ):
        trainer.load_training_state(folder)
    assert_bitwise_equal(model.state_dict(), before)  # nothing was loaded
    assert trainer.num_update_steps_completed == 0
    moments = [value for state in trainer.optimizer.state_dict()["state"].values() for value in state.values()]
    assert all(not value.any() for value in moments if value.dim() > 0)  # a fresh optimizer's zeros, none saved


@pytest.mark.parametrize(
    "generator, edit, problem",
    [
        ("torch", lambda rng: rng.update(torch=rng["torch"][:100]), r"RuntimeError: .*"),
        ("numpy", lambda rng: rng["numpy"].update(keys=rng["numpy"]["keys"][:10]), r"(Value|Index)Error: .*"),
        ("python", lambda rng: rng["python"].update(internal=rng["python"]["internal"][:3]), r"ValueError: .*"),
        ("missing", lambda rng: rng.pop("numpy"), r"KeyError: 'numpy'"),
    ],
)
def test_a_rank_file_whose_rng_state_cannot_be_restored_is_named(tmp_path, generator, edit, problem):
    """A rank file whose RNG state has the wrong size (with a manifest forged to match) is a CheckpointError naming
    the file before anything is loaded, not torch's error naming no file once the resumed run reaches its position."""
    folder = _saved_state(tmp_path, max_checkpoints=1)
    name = "rank_00000.pt"
    rank_state = torch.load(folder / name, weights_only=True)
    edit(rank_state["rng"])
    torch.save(rank_state, folder / name)
    manifest = json.loads((folder / MANIFEST_NAME).read_text())
    size, digest = file_digest(folder / name)
    manifest["files"][name] = {"size": size, CHECKSUM: digest}
    (folder / MANIFEST_NAME).write_text(json.dumps(manifest))
    with pytest.raises(
        CheckpointError,
        match=rf"{name}: its random generators' states cannot be restored \({problem}\); it was altered",
    ):
        _run(tmp_path, num_epochs=2)


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


def test_changed_setup_is_refused(tmp_path):
    """A changed setup is refused, naming each difference, unless allowed."""
    _run(tmp_path, num_epochs=1)
    with pytest.raises(
        CheckpointError,
        match=(
            r"(?s)gradient_accumulation_steps: saved 1, now 2.*per_device_batch_size: saved 2, now 4"
            r".*train_dataset_length: saved 22, now 20.*allow_resume_changes=True"
        ),
    ):
        _run(tmp_path, num_epochs=2, accumulation=2, batch_size=4, size=20)
    other_models = {  # other parameter names; the same names with other shapes
        r"not in the state: model/bias, model/weight.*not in this run: model/0\.bias": nn.Linear(4, 1),
        r"other shapes \(model/0\.bias: saved \[16\], now \[8\]; ": nn.Sequential(
            nn.Linear(4, 8), nn.Dropout(0.2), nn.Tanh(), nn.Linear(8, 1)
        ),
    }
    for misfit, model in other_models.items():
        trainer = Trainer(model, nn.MSELoss(), torch.optim.AdamW(model.parameters(), lr=0.01), callbacks=())
        with pytest.raises(CheckpointError, match=rf"final does not fit this run's model, optimizer: {misfit}"):
            trainer.train(
                regression_dataset(22),
                num_epochs=2,
                per_device_batch_size=2,
                resume_from=tmp_path,
                allow_resume_changes=True,
                create_scheduler_fn=functools.partial(torch.optim.lr_scheduler.StepLR, step_size=2, gamma=0.8),
            )


def test_allowed_change_of_batch_size(tmp_path):
    """Allowing changes resumes with another batch size."""
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


def test_rolling_permanent_and_best_states(tmp_path):
    """Rolling, permanent and best states are kept as asked."""
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


def test_names_continue_across_a_resume(tmp_path):
    """State names continue across a resume, and nothing is overwritten."""
    with pytest.raises(Crash):
        _run(tmp_path, crash=CrashAt("train_step", epoch=2, step=2))
    names_before = {p.name: p.stat().st_mtime_ns for p in tmp_path.iterdir() if p.is_dir()}
    _run(tmp_path)
    after = {p.name: p.stat().st_mtime_ns for p in tmp_path.iterdir() if p.is_dir()}
    for name, mtime in names_before.items():
        assert name not in after or after[name] == mtime


def test_save_inside_window_waits_for_close(tmp_path):
    """A save asked inside an accumulation window is taken when the window closes."""

    class SaveMidWindow(TrainerCallback):
        def on_train_step_end(self, trainer, step, **kwargs):
            if trainer.run_history.current_epoch == 1 and step == 4:  # window of steps 3, 4, 5
                assert trainer.save_training_state(tmp_path / "manual") is None

    (tmp_path / "manual").mkdir()
    _run(tmp_path / "auto", crash=SaveMidWindow(), accumulation=3, num_epochs=1)
    (state,) = list_complete_states(tmp_path / "manual")
    assert state.manifest["num_update_steps_completed"] == 2
    assert state.manifest["position"] == {
        "loop_epoch": 0,
        "batches_seen": 6,
        "epoch_samples": 12,  # 6 micro-batches of 2 samples, over every process
        "rng_restore_point": "after_iterator",
    }


def test_step_save_at_stop_is_written_once(tmp_path):
    """A step save due at the update that stops the run is written once."""

    class StopAfter(TrainerCallback):
        def on_optimizer_step_end(self, trainer, num_update_steps_completed, **kwargs):
            if num_update_steps_completed == 15:  # inside the second epoch (11 updates per epoch)
                raise StopTrainingError("stopped by a callback")

    stopped = _run(tmp_path, crash=StopAfter(), save_every_n_steps=5, save_every_n_epochs=None, save_at_end=True)
    assert stopped.num_update_steps_completed == 15
    names = [state.folder.name for state in list_complete_states(tmp_path)]
    assert sorted(names) == ["final", "step_10", "step_15", "step_5"]  # none lost, none twice; final as the run ends
    position = list_complete_states(tmp_path)[-1].manifest["position"]
    # the next batch
    assert position == {"loop_epoch": 1, "batches_seen": 4, "epoch_samples": 8, "rng_restore_point": "after_iterator"}


def test_resume_skips_by_sampler_offset(tmp_path):
    """Resuming skips by sampler offset, without loading the skipped samples."""
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


def test_resumed_bar_starts_at_saved_step(tmp_path):
    """A resumed epoch starts its progress bar at the saved step."""
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


def test_bad_save_intervals_are_refused(tmp_path):
    with pytest.raises(
        ValueError,
        match=r"save_every_n_steps is 0; pass a positive whole number of updates, e.g. save_every_n_steps=100",
    ):
        SaveTrainingStateCallback(tmp_path, save_every_n_steps=0)
    with pytest.raises(
        ValueError, match=r"max_checkpoints is -1; pass a positive whole number of states, e.g. max_checkpoints=3"
    ):
        SaveTrainingStateCallback(tmp_path, max_checkpoints=-1)


# ------------------------------------------------------------------------------------------------
# A run stopped inside an epoch, then extended: it resumes at the next batch, bit for bit
# ------------------------------------------------------------------------------------------------

#: 24 samples, batches of 2, windows of 2 micro-batches: 6 updates per epoch; the extended run ends inside epoch 3.
UPDATES_PER_EPOCH, TOTAL_UPDATES = 6, 15


class StopAtUpdate(TrainerCallback):
    """Stops the run after update ``update`` (a callback's ``StopTrainingError``)."""

    def __init__(self, update):
        self.update = update

    def on_optimizer_step_end(self, trainer, num_update_steps_completed, **kwargs):
        if num_update_steps_completed == self.update:
            raise StopTrainingError(f"stopped after update {self.update}")


class SlowUpdate(StopAtUpdate):
    """Update ``update`` takes more than a second: a time budget of a second is spent after it."""

    def on_optimizer_step_end(self, trainer, num_update_steps_completed, **kwargs):
        if num_update_steps_completed == self.update:
            time.sleep(1.1)


class SignalAtUpdate(StopAtUpdate):
    """Asks the run to save and exit after update ``update``, as SIGUSR1 from a cluster does."""

    def on_optimizer_step_end(self, trainer, num_update_steps_completed, **kwargs):
        if num_update_steps_completed == self.update:
            trainer.request_preemption(signal.SIGUSR1)


class StopAtEpochEnd(TrainerCallback):
    """Stops the run as its first epoch ends, after its evaluation (as early stopping does)."""

    def on_training_run_epoch_end(self, trainer, **kwargs):
        raise StopTrainingError("enough epochs")


def _run_with_limits(
    save_dir, max_num_train_steps=TOTAL_UPDATES, stop=None, resume=True, save_at_end=True, **train_kwargs
):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 16), nn.Dropout(0.2), nn.Tanh(), nn.Linear(16, 1))
    callbacks = [SaveTrainingStateCallback(save_dir, save_at_end=save_at_end)] + ([stop] if stop is not None else [])
    trainer = Trainer(model, nn.MSELoss(), torch.optim.AdamW(model.parameters(), lr=0.01), callbacks=callbacks)
    result = trainer.train(
        regression_dataset(24),
        num_epochs=5,
        eval_dataset=regression_dataset(6, seed=1),
        per_device_batch_size=2,
        gradient_accumulation_steps=2,
        max_num_train_steps=max_num_train_steps,
        create_scheduler_fn=functools.partial(torch.optim.lr_scheduler.StepLR, step_size=2, gamma=0.8),
        resume_from=save_dir if resume else None,
        **train_kwargs,
    )
    return trainer, result


def _end_state(trainer):
    return {
        "model": trainer.get_model().state_dict(),
        "optimizer": trainer.optimizer.state_dict(),
        "scheduler": trainer.scheduler.state_dict(),
        "updates": trainer.num_update_steps_completed,
        "epoch": trainer.run_history.current_epoch,
        "train_loss": trainer.run_history.get_latest_metric("train_loss_epoch"),
    }


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    trainer, _ = _run_with_limits(tmp_path_factory.mktemp("uninterrupted"), resume=False)
    return _end_state(trainer)


def _saved_position(save_dir):
    return list_complete_states(save_dir)[-1].manifest["position"]


def test_step_limit_then_higher_one_resumes(tmp_path, uninterrupted):
    """A step limit inside an epoch, then a higher one, continues exactly."""
    trainer, result = _run_with_limits(tmp_path, max_num_train_steps=4)
    assert result.num_update_steps == 4 and not result.stopped_early
    assert trainer.run_history.current_epoch == 2  # the cut-short epoch counts in the history, as pytorch-accelerated
    assert _saved_position(tmp_path) == {
        "loop_epoch": 0,
        "batches_seen": 8,
        "epoch_samples": 16,
        "rng_restore_point": "after_iterator",
    }
    resumed, _ = _run_with_limits(tmp_path)
    assert_bitwise_equal(_end_state(resumed), uninterrupted)


def test_stop_error_resumes_at_next_batch(tmp_path, uninterrupted):
    """A StopTrainingError inside an epoch resumes at the next batch."""
    _, result = _run_with_limits(tmp_path, stop=StopAtUpdate(9))
    assert result.num_update_steps == 9 and result.stopped_early and result.stop_reason == "stopped after update 9"
    assert _saved_position(tmp_path) == {
        "loop_epoch": 1,
        "batches_seen": 6,
        "epoch_samples": 12,
        "rng_restore_point": "after_iterator",
    }
    resumed, _ = _run_with_limits(tmp_path)
    assert_bitwise_equal(_end_state(resumed), uninterrupted)


@pytest.mark.parametrize("cause", ["StopTrainingError", "time budget"])
def test_a_stop_inside_an_epoch_records_its_loss(tmp_path, cause):
    """The epoch a callback's StopTrainingError or the time budget cuts short records its train_loss_epoch, over the
    batches trained, and counts in the history, as for a step limit."""
    if cause == "StopTrainingError":
        trainer, result = _run_with_limits(tmp_path, stop=StopAtUpdate(9), resume=False)  # 3 updates into epoch 2
    else:
        trainer, result = _run_with_limits(tmp_path, stop=SlowUpdate(9), resume=False, max_time=1.0)
    assert result.stopped_early and result.num_update_steps == 9  # inside epoch 2
    epochs_started = result.num_update_steps // UPDATES_PER_EPOCH + 1
    losses = trainer.run_history.get_metric_values("train_loss_epoch")
    assert len(losses) == epochs_started and all(math.isfinite(loss) for loss in losses)
    assert trainer.run_history.current_epoch == epochs_started + 1
    assert len(trainer.run_history.get_metric_values("eval_loss_epoch")) == epochs_started - 1  # no evaluation


def test_epoch_end_stop_resumes_next_epoch(tmp_path, uninterrupted):
    _run_with_limits(tmp_path, stop=StopAtEpochEnd())
    assert _saved_position(tmp_path) == {
        "loop_epoch": 1,
        "batches_seen": 0,
        "epoch_samples": 0,
        "rng_restore_point": "before_iterator",
    }
    resumed, _ = _run_with_limits(tmp_path)
    assert_bitwise_equal(_end_state(resumed), uninterrupted)


def test_signal_saves_next_batch_and_resumes(tmp_path, uninterrupted):
    """A signal inside an epoch saves the position of the next batch, and resumes exactly."""
    with pytest.raises(SystemExit) as exit_info:
        _run_with_limits(tmp_path, stop=SignalAtUpdate(8))
    assert exit_info.value.code == 128 + signal.SIGUSR1
    assert _saved_position(tmp_path) == {
        "loop_epoch": 1,
        "batches_seen": 4,
        "epoch_samples": 8,
        "rng_restore_point": "after_iterator",
    }
    resumed, _ = _run_with_limits(tmp_path)
    assert_bitwise_equal(_end_state(resumed), uninterrupted)


class SlowUpdates(TrainerCallback):
    """Makes each update take at least ``seconds``, and notes when each one ended."""

    def __init__(self, seconds):
        self.seconds, self.ended_at = seconds, []

    def on_optimizer_step_end(self, trainer, **kwargs):
        time.sleep(self.seconds)
        self.ended_at.append(time.monotonic())


def test_time_budget_stop_resumes_exactly(tmp_path, uninterrupted, capsys):
    """The time budget stops before it is spent, and the saved state resumes exactly."""
    slow = SlowUpdates(0.05)
    started = time.monotonic()
    _, result = _run_with_limits(tmp_path, stop=slow, max_time=0.6, save_at_end=False)
    assert 0 < result.num_update_steps < TOTAL_UPDATES and result.stopped_early
    assert slow.ended_at[-1] - started < 0.6  # no update ran past the budget
    assert result.stop_reason.startswith("Time budget max_time=0.6 (0.6 s) nearly spent")
    resume_line = f"to continue, run the same train(...) with resume_from={str(tmp_path)!r}"
    assert resume_line in result.stop_reason and resume_line in capsys.readouterr().out
    (state,) = list_complete_states(tmp_path)  # saved although save_at_end=False: the run can be continued
    assert state.folder.name == "final" and state.manifest["num_update_steps_completed"] == result.num_update_steps
    resumed, _ = _run_with_limits(tmp_path)
    assert_bitwise_equal(_end_state(resumed), uninterrupted)
