"""The run state: one place for a run's counters and requests, created by each train(); the event after each update."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import (
    RecordingCallback,
    StreamDataset,
    linear_dataset,
    make_linear,
    make_mlp,
    make_trainer,
    regression_dataset,
)
from torch import nn

from pytorch_accel_trainer.callbacks import StopTrainingError, TrainerCallback
from pytorch_accel_trainer.loop.run_state import RunState
from pytorch_accel_trainer.run_config import TrainOptions


class UpdateLog(TrainerCallback):
    """Records each on_optimizer_step_end: its keyword arguments and the state the trainer shows at that moment."""

    def __init__(self):
        self.updates = []

    def on_optimizer_step_end(self, trainer, step, num_update_steps_completed, **kwargs):
        gradients_zeroed = all(p.grad is None or not p.grad.any() for p in trainer.model.parameters())
        self.updates.append((trainer.run_state.epoch, step, num_update_steps_completed, gradients_zeroed))


@pytest.mark.parametrize("accumulation, expected_steps", [(1, [0, 1, 2, 3, 4]), (2, [1, 3, 4]), (4, [3, 4])])
def test_optimizer_step_end_once_per_window(accumulation, expected_steps):
    """on_optimizer_step_end fires once per window, with its step and update count."""
    log = UpdateLog()
    trainer = make_trainer(make_linear(), callbacks=[log])
    trainer.train(linear_dataset(10), num_epochs=2, per_device_batch_size=2, gradient_accumulation_steps=accumulation)
    per_epoch = len(expected_steps)
    assert [update[1] for update in log.updates] == expected_steps * 2  # the last batch closes a partial window
    assert [update[2] for update in log.updates] == list(range(1, 2 * per_epoch + 1))
    assert [update[0] for update in log.updates] == [0] * per_epoch + [1] * per_epoch
    assert all(update[3] for update in log.updates)  # it fires after optimizer_zero_grad
    assert trainer.num_update_steps_completed == 2 * per_epoch


def test_optimizer_step_end_limit_and_stop():
    """on_optimizer_step_end stops at the step limit; a stop raised in it ends the run after that update."""
    log = UpdateLog()
    trainer = make_trainer(make_linear(), callbacks=[log])
    trainer.train(linear_dataset(40), num_epochs=None, max_num_train_steps=7, per_device_batch_size=4)
    assert [update[2] for update in log.updates] == list(range(1, 8))

    class StopAtThree(TrainerCallback):
        def on_optimizer_step_end(self, trainer, num_update_steps_completed, **kwargs):
            if num_update_steps_completed == 3:
                raise StopTrainingError("three is enough")

    recorder = RecordingCallback()
    trainer = make_trainer(make_linear(), callbacks=[StopAtThree(), recorder])
    trainer.train(linear_dataset(40), num_epochs=2, per_device_batch_size=4)
    assert trainer.num_update_steps_completed == 3
    assert recorder.events.count("on_train_step_start") == 3  # no batch runs after the update that asked
    assert recorder.events[-2:] == ["on_stop_training_error", "on_training_run_end"]


def test_each_train_creates_a_new_run_state():
    """Each train() creates a new run state, holding its validated options."""
    trainer = make_trainer(make_mlp())
    before = trainer.run_state
    assert isinstance(before, RunState) and before.options is None and trainer.num_update_steps_completed == 0
    trainer.train(regression_dataset(8), num_epochs=2, per_device_batch_size=4, gradient_accumulation_steps=2)
    first = trainer.run_state
    assert first is not before and first.options.gradient_accumulation_steps == 2 and first.options.num_epochs == 2
    assert (first.num_update_steps_completed, first.epoch, first.in_training_run) == (2, 2, False)
    assert first.save_requests == {} and first.stop_request is None and first.resume is None
    trainer.evaluate(regression_dataset(4))
    assert trainer.run_state is first and trainer.num_update_steps_completed == 2  # an evaluation is not a run
    trainer.train(regression_dataset(8), num_epochs=1, per_device_batch_size=8)
    assert trainer.run_state is not first and trainer.num_update_steps_completed == 1
    with pytest.raises(dataclasses.FrozenInstanceError):
        trainer.run_state.options.num_epochs = 5


def test_train_options_validated_on_creation():
    """Train options are validated when created, with the fix in the message."""
    assert TrainOptions(num_epochs=3).per_device_batch_size == 8  # train()'s defaults
    with pytest.raises(ValueError, match=r"gradient_accumulation_steps=0 is not valid: it must be a positive integer"):
        TrainOptions(num_epochs=1, gradient_accumulation_steps=0)
    with pytest.raises(ValueError, match=r"num_epochs and max_num_train_steps are both None"):
        TrainOptions(num_epochs=None)


def test_save_position_is_the_next_batch():
    """A save's position is the next batch inside an epoch, or the next epoch between epochs."""
    state = RunState(epoch=3)
    assert (state.position(5).loop_epoch, state.position(5).batches_seen, state.position(5).rng_restore_point) == (
        3,
        5,
        "after_iterator",
    )
    assert (state.position(None).batches_seen, state.position(None).rng_restore_point) == (0, "before_iterator")


def test_extra_eval_epoch_restores_everything():
    """An extra eval epoch evaluates other weights with other callbacks, and restores everything."""

    class Extra(TrainerCallback):
        def __init__(self):
            self.losses = []

        def on_train_epoch_end(self, trainer, **kwargs):
            other = make_linear(seed=1)
            inner = RecordingCallback()
            trainer.model.train()
            handler, model = trainer.callback_handler, trainer.model
            trainer.run_extra_eval_epoch(model=other, callbacks=[inner], metric_name_prefix="other_")
            assert trainer.callback_handler is handler and trainer.model is model and model.training
            assert inner.events[0] == "on_eval_epoch_start" and inner.events[-1] == "on_eval_epoch_end"
            self.losses.append(trainer.run_history.get_latest_metric("other_eval_loss_epoch"))

    extra = Extra()
    trainer = make_trainer(make_linear(), callbacks=[extra])
    data = linear_dataset(8)
    trainer.train(data, num_epochs=2, eval_dataset=data, per_device_batch_size=4)
    other = make_linear(seed=1)
    x, y = data.tensors
    expected = nn.functional.mse_loss(other(x), y).item()
    assert extra.losses == pytest.approx([expected, expected])
    assert len(trainer.run_history.get_metric_values("eval_loss_epoch")) == 2  # the epoch's own are apart
    assert getattr(trainer.run_history, "metric_name_prefix", "") == ""


def test_dataloader_aliases_for_peer_scripts():
    """_train_dataloader and _eval_dataloader keep pytorch-accelerated scripts working."""
    trainer = make_trainer(make_linear())
    trainer.train(StreamDataset(linear_dataset(8)), num_epochs=1, per_device_batch_size=4)
    assert trainer._train_dataloader is trainer.train_dataloader is not None
    replacement = [(torch.zeros(1, 1), torch.zeros(1, 1))]
    trainer._eval_dataloader = replacement
    assert trainer.eval_dataloader is replacement


def test_extra_eval_epoch_without_eval_data():
    class Extra(TrainerCallback):
        def on_train_epoch_end(self, trainer, **kwargs):
            trainer.run_extra_eval_epoch(metric_name_prefix="other_")

    trainer = make_trainer(make_linear(), callbacks=[Extra()])
    with pytest.raises(ValueError, match=r"run_extra_eval_epoch\(\) evaluates on the eval_dataset of the training run"):
        trainer.train(linear_dataset(8), num_epochs=1, per_device_batch_size=4)


def test_extra_eval_epoch_on_other_device():
    # on a GPU, a module left on the CPU; here, on the CPU, a module on the meta device
    """An extra eval epoch of a model on another device is a clear error that changes nothing."""

    class Extra(TrainerCallback):
        def on_train_epoch_end(self, trainer, **kwargs):
            handler, model = trainer.callback_handler, trainer.model
            with pytest.raises(ValueError) as raised:
                trainer.run_extra_eval_epoch(model=make_linear(seed=1).to("meta"), metric_name_prefix="other_")
            self.message = str(raised.value)
            assert trainer.callback_handler is handler and trainer.model is model

    extra = Extra()
    trainer = make_trainer(make_linear(), callbacks=[extra])
    data = linear_dataset(8)
    trainer.train(data, num_epochs=1, eval_dataset=data, per_device_batch_size=4)
    assert extra.message == (
        "run_extra_eval_epoch(model=...) has parameters on meta, but this run's batches are on cpu: move the module to "
        "the trainer's device first (module.to(trainer.device))."
    )
    assert trainer.run_history.get_metric_names() == {"train_loss_epoch", "eval_loss_epoch"}
