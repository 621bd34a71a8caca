"""LimitBatchesCallback, its environment variable, and DataLoaderSlice."""

from __future__ import annotations

import pytest
from conftest import RecordingCallback, StreamDataset, linear_dataset, make_linear, make_trainer

from pytorch_accel_trainer import Trainer
from pytorch_accel_trainer.callbacks import (
    LIMIT_BATCHES_ENV_VAR,
    CallbackHandler,
    DataLoaderSlice,
    LimitBatchesCallback,
    with_limit_batches_from_env,
)


def test_limits_epochs_restores_dataloaders():
    """Limits training and evaluation epochs, and restores the DataLoaders."""
    recorder = RecordingCallback()
    trainer = make_trainer(make_linear(), callbacks=[LimitBatchesCallback(3), recorder])
    trainer.train(linear_dataset(64), num_epochs=2, eval_dataset=linear_dataset(32), per_device_batch_size=4)
    assert recorder.events.count("on_train_step_start") == 6 and recorder.events.count("on_eval_step_start") == 6
    assert trainer.num_update_steps_completed == 6
    assert not isinstance(trainer._train_dataloader, DataLoaderSlice) and len(trainer._train_dataloader) == 16
    trainer.evaluate(linear_dataset(32), per_device_batch_size=4)
    assert recorder.events.count("on_eval_step_start") == 9


def test_partial_window_at_limit_is_stepped():
    """A partial accumulation window at the limit is stepped."""
    trainer = make_trainer(make_linear(), callbacks=[LimitBatchesCallback(5)])
    trainer.train(linear_dataset(64), num_epochs=1, per_device_batch_size=4, gradient_accumulation_steps=2)
    assert trainer.num_update_steps_completed == 3  # windows of 2, 2 and 1: the limit is the epoch's length


def test_a_dataset_without_length_is_limited_too():
    recorder = RecordingCallback()
    trainer = make_trainer(make_linear(), callbacks=[LimitBatchesCallback(2), recorder])
    trainer.train(StreamDataset(linear_dataset(32)), num_epochs=None, per_device_batch_size=4, max_num_train_steps=6)
    assert recorder.events.count("on_train_epoch_start") == 3


class EnvTrainer(Trainer):
    """The trainer with the one-line change that reads PT_ACC_LIMIT_BATCHES."""

    def _create_callback_handler(self):
        return CallbackHandler(with_limit_batches_from_env(self._callbacks))


def test_environment_variable_adds_callback(monkeypatch):
    monkeypatch.setenv(LIMIT_BATCHES_ENV_VAR, "2")
    recorder = RecordingCallback()
    trainer = make_trainer(make_linear(), callbacks=[recorder], trainer_class=EnvTrainer)
    trainer.train(linear_dataset(64), num_epochs=1, per_device_batch_size=4)
    assert recorder.events.count("on_train_step_start") == 2
    assert trainer.callback_handler.callback_list == [
        "LimitBatchesCallback",
        "RecordingCallback",
    ]  # first, as pytorch-accelerated


def test_environment_variable_adds_once(monkeypatch):
    """The environment variable adds nothing when unset, empty, or the callback is already there."""
    monkeypatch.delenv(LIMIT_BATCHES_ENV_VAR, raising=False)
    assert with_limit_batches_from_env([RecordingCallback]) == [RecordingCallback]
    monkeypatch.setenv(LIMIT_BATCHES_ENV_VAR, "")
    assert with_limit_batches_from_env(()) == []
    monkeypatch.setenv(LIMIT_BATCHES_ENV_VAR, "4")
    existing = LimitBatchesCallback(7)
    assert with_limit_batches_from_env([existing]) == [existing]


@pytest.mark.parametrize("value", ["two", "0", "-3", "1.5"])
def test_invalid_environment_variable(monkeypatch, value):
    """An invalid environment variable is an error."""
    monkeypatch.setenv(LIMIT_BATCHES_ENV_VAR, value)
    with pytest.raises(
        ValueError, match=f"The environment variable PT_ACC_LIMIT_BATCHES is '{value}', not a positive whole number"
    ):
        with_limit_batches_from_env([])


def test_num_batches_must_be_positive():
    with pytest.raises(ValueError, match="num_batches is 0; pass a positive whole number of batches"):
        LimitBatchesCallback(0)


def test_dataloader_slice():
    """DataLoaderSlice follows its switch and forwards attributes."""
    batches = list(range(10))
    active = {"on": True}
    sliced = DataLoaderSlice(batches, 3, is_active=lambda: active["on"])
    assert (list(sliced), len(sliced)) == ([0, 1, 2], 3)
    active["on"] = False
    assert (list(sliced), len(sliced)) == (batches, 10)
    assert sliced.count(4) == 1  # any other attribute is the wrapped object's
    with pytest.raises(TypeError):
        len(DataLoaderSlice(iter(batches), 3))  # no length to know
