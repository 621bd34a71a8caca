"""train(max_time=...): the forms a time budget takes, the refused ones, and where a run it stops saves."""

from __future__ import annotations

import datetime
import time

import pytest
from conftest import linear_dataset, make_linear, make_trainer

from pytorch_accel_trainer.callbacks import TrainerCallback
from pytorch_accel_trainer.state.training_state import list_complete_states
from pytorch_accel_trainer.validation import max_time_seconds


@pytest.mark.parametrize(
    ("max_time", "seconds"),
    [
        (90, 90.0),
        (0.5, 0.5),
        ("00:12:00:00", 43200.0),
        ("01:00:00:30", 86430.0),
        (datetime.timedelta(hours=1, minutes=30), 5400.0),
        ({"hours": 11, "minutes": 50}, 42600.0),
        (None, None),
    ],
)
def test_budget_as_seconds_text_or_timedelta(max_time, seconds):
    assert max_time_seconds(max_time) == seconds


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"max_time": "1h"}, ValueError, r"max_time='1h' is not a time budget longer than 0 s: pass seconds"),
        ({"max_time": "12:00:00"}, ValueError, r"max_time='12:00:00' is not .*'DD:HH:MM:SS'"),
        ({"max_time": 0}, ValueError, r"max_time=0 is not a time budget longer than 0 s"),
        ({"max_time": -5.0}, ValueError, r"max_time=-5.0 is not"),
        ({"max_time": float("inf")}, ValueError, r"max_time=inf is not"),
        ({"max_time": {"hourz": 1}}, ValueError, r"max_time=\{'hourz': 1\} is not .*a dict of its arguments"),
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
