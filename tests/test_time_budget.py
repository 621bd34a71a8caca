"""train(max_time=...): the forms a time budget takes, the refused ones, and where a run it stops saves."""

from __future__ import annotations

import datetime
import os
import re
import time

import pytest
from conftest import linear_dataset, make_linear, make_trainer

from pytorch_accel_trainer.callbacks import TrainerCallback
from pytorch_accel_trainer.run_config import max_time_seconds
from pytorch_accel_trainer.state.training_state import list_complete_states


@pytest.mark.parametrize(
    ("max_time", "seconds"),
    [
        (90, 90.0),
        (0.5, 0.5),
        ("00:12:00:00", 43200.0),
        ("01:00:00:30", 86430.0),
        ("1:00:00:00", 86400.0),  # as the command line and a config file read it
        ("12:00:00", 43200.0),  # HH:MM:SS, the days left out
        (" 1 : 30 : 00 ", 5400.0),
        (datetime.timedelta(hours=1, minutes=30), 5400.0),
        ({"hours": 11, "minutes": 50}, 42600.0),
        (datetime.timedelta.max, datetime.timedelta.max.total_seconds()),  # the longest budget taken
        (None, None),
    ],
)
def test_budget_as_seconds_text_or_timedelta(max_time, seconds):
    assert max_time_seconds(max_time) == seconds


@pytest.mark.parametrize("max_time", ["99999999999:00:00:00", 1e300, {"days": 10**10}])
def test_too_long_budget_names_the_limit(max_time):
    """A budget past timedelta's range, in every form (1e300 seconds included), is refused past the same limit with
    a ValueError naming the value, not an OverflowError naming nothing."""
    trainer = make_trainer(make_linear())
    with pytest.raises(
        ValueError,
        match=rf"max_time={re.escape(repr(max_time))} is longer than the longest time budget taken, 999999999 days "
        r"\(datetime.timedelta.max\)",
    ):
        trainer.train(linear_dataset(8), num_epochs=1, per_device_batch_size=4, max_time=max_time)
    assert trainer.num_update_steps_completed == 0


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"max_time": "1h"}, ValueError, r"max_time='1h' is not a time budget longer than 0 s: pass seconds"),
        ({"max_time": "12:00"}, ValueError, r"max_time='12:00' is not .*'DD:HH:MM:SS' or 'HH:MM:SS'"),
        ({"max_time": "1:2:3:4:5"}, ValueError, r"max_time='1:2:3:4:5' is not a time budget"),
        ({"max_time": "²:00:00"}, ValueError, r"max_time='²:00:00' is not a time budget"),
        ({"max_time": 0}, ValueError, r"max_time=0 is not a time budget longer than 0 s"),
        ({"max_time": -5.0}, ValueError, r"max_time=-5.0 is not"),
        ({"max_time": float("inf")}, ValueError, r"max_time=inf is not"),
        ({"max_time": {"hourz": 1}}, ValueError, r"max_time=\{'hourz': 1\} is not .*a dict of its arguments"),
        ({"max_time": {"hours": float("nan")}}, ValueError, r"max_time=\{'hours': nan\} is not a time budget"),
        ({"max_time": True}, TypeError, r"max_time=True is a bool: pass seconds"),
        ({"max_time_save_dir": "states"}, ValueError, r"max_time_save_dir='states' .* but max_time is None"),
    ],
)
def test_bad_budget_is_refused_before_work(kwargs, error, message):
    trainer = make_trainer(make_linear())
    with pytest.raises(error, match=message):
        trainer.train(linear_dataset(8), num_epochs=1, per_device_batch_size=4, **kwargs)
    assert trainer.num_update_steps_completed == 0


class UpdatesTakeTime(TrainerCallback):
    def on_optimizer_step_end(self, trainer, **kwargs):
        time.sleep(0.05)


def test_without_save_callback_uses_save_dir(tmp_path, capsys):
    """Without a save callback the state goes to max_time_save_dir, and the stop line says so."""
    trainer = make_trainer(make_linear(), callbacks=[UpdatesTakeTime()])
    result = trainer.train(
        linear_dataset(64), num_epochs=3, per_device_batch_size=2, max_time=0.4, max_time_save_dir=tmp_path / "budget"
    )
    assert result.stopped_early and 0 < result.num_update_steps < 96
    (state,) = list_complete_states(tmp_path / "budget")
    assert state.manifest["num_update_steps_completed"] == result.num_update_steps
    assert f"resume_from={str(tmp_path / 'budget')!r}" in capsys.readouterr().out


def test_nowhere_to_save_says_how_to_keep():
    """Without anywhere to save, the stop line says how to keep the state."""
    trainer = make_trainer(make_linear(), callbacks=[UpdatesTakeTime()])
    result = trainer.train(linear_dataset(64), num_epochs=3, per_device_batch_size=2, max_time=0.3)
    assert result.stopped_early
    assert "no training state is saved: attach a SaveTrainingStateCallback or pass max_time_save_dir" in (
        result.stop_reason
    )


def test_the_first_save_fits_in_the_budget(tmp_path, monkeypatch):
    """Before any save is timed, the budget keeps time for the save at the stop, estimated by the save folder's
    probe as the run starts, so that a run on a slow disk does not overrun its budget by that save."""
    synced, real_fsync = [], os.fsync

    def slow_fsync(descriptor):  # a slow network disk: each file synced costs a quarter of a second
        synced.append(descriptor)
        time.sleep(0.25)
        real_fsync(descriptor)

    monkeypatch.setattr(os, "fsync", slow_fsync)
    trainer = make_trainer(make_linear(), callbacks=[UpdatesTakeTime()])
    started = time.monotonic()
    result = trainer.train(
        linear_dataset(64), num_epochs=50, per_device_batch_size=2, max_time=6, max_time_save_dir=tmp_path / "slow"
    )
    wall = time.monotonic() - started
    assert result.stopped_early and result.num_update_steps > 1 and len(synced) >= 6  # it trained, then saved
    (state,) = list_complete_states(tmp_path / "slow")
    assert state.manifest["num_update_steps_completed"] == result.num_update_steps
    assert wall < 6, f"the run took {wall:.1f} s, past its budget of 6 s"


class CountsBatches(TrainerCallback):
    def __init__(self):
        self.batches = 0

    def on_train_step_start(self, trainer, **kwargs):
        self.batches += 1


def test_an_unwritable_destination_is_found_before_the_first_batch(tmp_path):
    """A time budget's folder or a checkpoint's folder that cannot be written is an OSError naming it before the
    first batch, not at the first save (the time budget's: at the run's very end)."""
    from pytorch_accel_trainer.callbacks import SaveBestModelCallback

    (tmp_path / "notes.txt").write_text("a file, where a folder is needed")
    blocked = tmp_path / "notes.txt" / "states"
    counter = CountsBatches()
    trainer = make_trainer(make_linear(), callbacks=[counter])
    with pytest.raises(
        OSError, match=r"'.*notes.txt/states' \(train\(max_time_save_dir=...\)\) cannot be written .*is a file"
    ):
        trainer.train(linear_dataset(8), num_epochs=1, per_device_batch_size=2, max_time=60, max_time_save_dir=blocked)
    best = SaveBestModelCallback(save_path=blocked / "best.pt", watch_metric="train_loss_epoch")
    trainer = make_trainer(make_linear(), callbacks=[counter, best])
    with pytest.raises(OSError, match=r"\(the folder of SaveBestModelCallback\(save_path=...\)\) cannot be written"):
        trainer.train(linear_dataset(8), num_epochs=1, per_device_batch_size=2)
    assert counter.batches == 0 and (tmp_path / "notes.txt").is_file()


class SavesEveryEpoch(TrainerCallback):
    """A user's own saving callback: it declares its folder, and gets the built-in callbacks' checks."""

    def __init__(self, folder, holds):
        self.folder, self.holds = folder, holds

    def writes_to(self):
        from pytorch_accel_trainer.callbacks import Destination

        return (Destination(self.folder, self.holds, "SavesEveryEpoch(folder=...)"),)


def test_a_users_callback_declares_its_folder_and_is_checked_before_the_first_batch(tmp_path):
    from types import SimpleNamespace

    from pytorch_accel_trainer.callbacks import CHECKPOINTS, TRAINING_STATES
    from pytorch_accel_trainer.loop.destinations import validate_stores_reach_every_process

    (tmp_path / "notes.txt").write_text("a file, where a folder is needed")
    counter = CountsBatches()
    saver = SavesEveryEpoch(tmp_path / "notes.txt" / "exports", CHECKPOINTS)
    trainer = make_trainer(make_linear(), callbacks=[counter, saver])
    with pytest.raises(OSError, match=r"notes.txt/exports' \(SavesEveryEpoch\(folder=...\)\) cannot be written"):
        trainer.train(linear_dataset(8), num_epochs=1, per_device_batch_size=2)
    assert counter.batches == 0
    options = SimpleNamespace(max_time_save_dir=None, resume_from=None)
    with pytest.raises(
        ValueError, match=r"'memory://bucket/states' \(SavesEveryEpoch\(folder=...\)\) is fsspec's in-memory store"
    ):
        validate_stores_reach_every_process([SavesEveryEpoch("memory://bucket/states", TRAINING_STATES)], options, 2)
    validate_stores_reach_every_process([SavesEveryEpoch("memory://bucket/exports", CHECKPOINTS)], options, 2)


def test_the_time_budget_saves_in_the_folder_of_training_states_a_users_callback_declares(tmp_path):
    from types import SimpleNamespace

    from pytorch_accel_trainer.callbacks import CHECKPOINTS, TRAINING_STATES
    from pytorch_accel_trainer.loop.time_budget import create_time_budget

    options = SimpleNamespace(max_time=60, max_time_save_dir=None)
    callbacks = [
        SavesEveryEpoch(tmp_path / "exports", CHECKPOINTS),
        SavesEveryEpoch(tmp_path / "states", TRAINING_STATES),
    ]
    assert create_time_budget(options, callbacks, measures=False).save_dir == tmp_path / "states"
    assert create_time_budget(options, callbacks[:1], measures=False).save_dir is None


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into any folder, whatever its mode")
def test_a_folder_without_write_permission_is_found_before_the_first_batch(tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    counter = CountsBatches()
    trainer = make_trainer(make_linear(), callbacks=[counter])
    with pytest.raises(OSError, match=r"locked/states' \(train\(max_time_save_dir=...\)\) cannot be written"):
        trainer.train(
            linear_dataset(8), num_epochs=1, per_device_batch_size=2, max_time=60, max_time_save_dir=locked / "states"
        )
    assert counter.batches == 0
