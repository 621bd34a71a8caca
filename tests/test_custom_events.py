"""Custom events as pytorch-accelerated users write them: an ``on_*`` method that no trainer event has, fired by a
Trainer subclass with ``callback_handler.call_event(name, ...)``, never declared."""

from __future__ import annotations

import warnings

import pytest
import torch
from conftest import linear_dataset, make_linear
from torch import nn

from pytorch_accel_trainer import Trainer
from pytorch_accel_trainer.callbacks import CallbackHandler, TrainerCallback


class CheckpointEveryUpdate(TrainerCallback):
    """As a public project's callbacks are written for pytorch-accelerated: custom events, one never fired."""

    def __init__(self):
        self.saves = 0
        self.debugged = 0

    def on_invoke_save_checkpoint(self, trainer, **kwargs):
        self.saves += 1

    def on_invoke_debug_parameters(self, trainer, **kwargs):  # the trainer below never fires it
        self.debugged += 1


class LogTrainLosses(TrainerCallback):
    def __init__(self):
        self.losses = []

    def on_invoke_log_train_losses(self, loss_value):  # a positional argument, and no trainer
        self.losses.append(loss_value)


class ProjectTrainer(Trainer):
    """Overrides the steps and fires its own events, with positional arguments."""

    def optimizer_step(self):
        super().optimizer_step()
        self.callback_handler.call_event("on_invoke_save_checkpoint", self)

    def scheduler_step(self):
        super().scheduler_step()
        self.callback_handler.call_event("on_invoke_log_train_losses", float(self.num_update_steps_completed))


def _trainer(trainer_class=ProjectTrainer, callbacks=None):
    model = make_linear()
    callbacks = [CheckpointEveryUpdate(), LogTrainLosses()] if callbacks is None else callbacks
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    return trainer_class(model, nn.MSELoss(), optimizer, callbacks=callbacks)


def test_undeclared_events_reach_callbacks():
    """Undeclared custom events fired from overridden steps reach their callbacks."""
    trainer = _trainer()
    with pytest.warns(UserWarning, match=r"on_invoke_debug_parameters.*never called") as caught:
        result = trainer.train(linear_dataset(32), num_epochs=2, per_device_batch_size=8)
    saver, logger = trainer.callback_handler.callbacks
    assert result.num_update_steps == 8
    assert saver.saves == 8 and saver.debugged == 0
    assert logger.losses == [float(n) for n in range(8)]  # positional arguments pass as they are
    never_called = [w for w in caught if "never called" in str(w.message)]
    assert len(never_called) == 1, [str(w.message) for w in never_called]  # one warning, naming the method
    assert "on_invoke_save_checkpoint" not in str(never_called[0].message)


def test_never_called_warning_once():
    """The never-called warning comes once per handler."""
    trainer = _trainer()
    with pytest.warns(UserWarning, match="on_invoke_debug_parameters"):
        trainer.train(linear_dataset(8), num_epochs=1, per_device_batch_size=8)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a second run of the same trainer: said already
        trainer.train(linear_dataset(8), num_epochs=1, per_device_batch_size=8)


def test_declaring_events_silences_warning():
    class DeclaringTrainer(ProjectTrainer):
        callback_events = ("on_invoke_save_checkpoint", "on_invoke_debug_parameters", "on_invoke_log_train_losses")

    trainer = _trainer(DeclaringTrainer)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        trainer.train(linear_dataset(8), num_epochs=1, per_device_batch_size=8)
    assert trainer.callback_handler.callbacks[0].saves == 1


@pytest.mark.parametrize(
    ("name", "suggestion"),
    [
        ("on_train_epoch_ends", "on_train_epoch_end"),  # a plural
        ("on_train_epochs_end", "on_train_epoch_end"),
        ("on_eval_step_ended", "on_eval_step_end"),  # a tense
        ("on_trian_step_end", "on_train_step_end"),  # a typo: two letters swapped
        ("on_training_run_starts", "on_training_run_start"),
        ("on_init_ended", "on_init_end"),
        ("on_evaluation_run_ending", "on_evaluation_run_end"),
    ],
)
def test_misspelt_event_method_is_refused(name, suggestion):
    """A misspelt trainer event is still refused, with the suggestion."""
    callback_class = type("Misspelt", (TrainerCallback,), {name: lambda self, trainer, **kwargs: None})
    with pytest.raises(ValueError, match=rf"'{name}'.*did you mean '{suggestion}'"):
        CallbackHandler([callback_class])
    with pytest.raises(ValueError, match=rf"did you mean '{suggestion}'"):
        _trainer(Trainer, callbacks=[callback_class])


def test_firing_misspelt_event_is_refused():
    """Firing a misspelt trainer event is refused; an unhandled custom event does nothing."""
    handler = CallbackHandler([CheckpointEveryUpdate()])
    with pytest.raises(ValueError, match=r"'on_train_epoch_ends'.*did you mean 'on_train_epoch_end'"):
        handler.call_event("on_train_epoch_ends", None)
    handler.call_event("on_something_nobody_handles", None, 1, key=2)  # as in pytorch-accelerated: nothing happens
