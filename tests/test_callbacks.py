"""The callback protocol and the default callbacks, on tiny real runs."""

from __future__ import annotations

import inspect
import math

import pytest
import torch
from torch import nn

from conftest import RecordingCallback, linear_dataset, make_linear, make_trainer
from pytorch_accel_trainer import DEFAULT_CALLBACKS, Trainer
from pytorch_accel_trainer.callbacks import (
    EVENTS,
    CallbackHandler,
    LogMetricsCallback,
    MoveModulesToDeviceCallback,
    PrintMetricsCallback,
    PrintProgressCallback,
    ProgressBarCallback,
    TerminateOnNaNCallback,
    TrainerCallback,
)

HOOKS_WITH_EVENTS = (
    "training_run_start", "train_epoch_start", "train_epoch_end", "eval_epoch_start", "eval_epoch_end",
    "training_run_epoch_end", "training_run_end", "evaluation_run_start", "evaluation_run_end",
)  # fmt: skip


def test_every_event_has_a_documented_no_op_and_every_hook_its_on_twin():
    for event in EVENTS:
        method = getattr(TrainerCallback, event)
        assert method.__doc__ and method(TrainerCallback(), trainer=None, batch=None, batch_output=None) is None
    for hook in HOOKS_WITH_EVENTS:
        assert hasattr(Trainer, hook) and f"on_{hook}" in EVENTS
    trainer_source = inspect.getsource(Trainer)
    fired = {event for event in EVENTS if f'"{event}"' in trainer_source}
    assert fired == set(EVENTS)


def test_an_unknown_event_is_an_error():
    handler = CallbackHandler([RecordingCallback])
    with pytest.raises(ValueError, match=r"Unknown callback event 'on_train_epoch_ends' \(did you mean 'on_train_epoch_end'\?\)"):
        handler.call_event("on_train_epoch_ends", None)


def test_a_typo_in_a_callback_method_is_an_error():
    class Typo(TrainerCallback):
        def on_train_epcoh_end(self, trainer, **kwargs):
            pass

    with pytest.raises(ValueError, match=r"defines 'on_train_epcoh_end' \(did you mean 'on_train_epoch_end'\?\), which is not a callback event"):
        make_trainer(make_linear(), callbacks=[Typo])


def test_duplicate_callback_classes_are_refused():
    with pytest.raises(ValueError, match="A RecordingCallback is already registered"):
        CallbackHandler([RecordingCallback, RecordingCallback()])


def test_callbacks_are_called_in_order_and_can_be_removed():
    order = []

    class First(TrainerCallback):
        def on_train_epoch_start(self, trainer, **kwargs):
            order.append("first")

    class Second(TrainerCallback):
        def on_train_epoch_start(self, trainer, **kwargs):
            order.append("second")

    handler = CallbackHandler([First, Second])
    handler.call_event("on_train_epoch_start", None)
    handler.remove_callback(First)
    handler.call_event("on_train_epoch_start", None)
    assert order == ["first", "second", "second"]
    assert handler.callback_list == ["Second"]


def test_default_callbacks_print_progress_and_metrics(capsys):
    assert DEFAULT_CALLBACKS == (
        MoveModulesToDeviceCallback, TerminateOnNaNCallback, PrintProgressCallback, ProgressBarCallback, LogMetricsCallback,
    )  # fmt: skip
    assert PrintMetricsCallback is LogMetricsCallback
    trainer = make_trainer(make_linear(), callbacks=DEFAULT_CALLBACKS)
    trainer.train(linear_dataset(8), num_epochs=2, eval_dataset=linear_dataset(4), per_device_batch_size=4)
    captured = capsys.readouterr()
    assert "Starting training run" in captured.out and "Starting epoch 2" in captured.out
    assert captured.out.count("train_loss_epoch: ") == 2 and captured.out.count("eval_loss_epoch: ") == 2
    assert "Finishing training run" in captured.out
    assert "epoch 2 train: 100%" in captured.err and "2/2" in captured.err


def test_log_metrics_can_be_redirected():
    logged = []

    class Collect(LogMetricsCallback):
        def log_metrics(self, trainer, metrics):
            logged.append(metrics)

    trainer = make_trainer(make_linear(), callbacks=[Collect])
    trainer.train(linear_dataset(4), num_epochs=1, eval_dataset=linear_dataset(4), per_device_batch_size=4)
    assert [set(metrics) for metrics in logged] == [{"train_loss_epoch"}, {"eval_loss_epoch"}]


def test_move_modules_to_device_moves_extra_modules_but_not_the_model():
    moved = []

    class Spy(nn.Module):
        def to(self, *args, **kwargs):
            moved.append(args)
            return super().to(*args, **kwargs)

    class WithMetricModule(Trainer):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.metric_module = Spy()

    model = make_linear()
    trainer = WithMetricModule(model, nn.MSELoss(), torch.optim.SGD(model.parameters(), lr=0.1), callbacks=[MoveModulesToDeviceCallback])
    trainer.train(linear_dataset(4), num_epochs=1, per_device_batch_size=4)
    trainer.evaluate(linear_dataset(4))
    assert moved == [(trainer.device,), (trainer.device,)]


class _NaNAfter(Trainer):
    """Returns a NaN loss from training step ``nan_step`` on."""

    nan_step = 3

    def calculate_train_batch_loss(self, batch):
        output = super().calculate_train_batch_loss(batch)
        self._steps_seen = getattr(self, "_steps_seen", 0) + 1
        if self._steps_seen > self.nan_step:
            output["loss"] = output["loss"] * float("nan")
        return output


def test_terminate_on_nan_stops_at_the_next_check_and_the_run_ends_cleanly():
    callback = TerminateOnNaNCallback(check_every_n_steps=5, exit_on_nan=False)
    recorder = RecordingCallback()
    model = make_linear()
    trainer = _NaNAfter(model, nn.MSELoss(), torch.optim.SGD(model.parameters(), lr=0.1), callbacks=[callback, recorder])
    trainer.train(linear_dataset(40), num_epochs=3, per_device_batch_size=2)
    assert callback.triggered
    assert recorder.events.count("on_train_step_start") == 5  # the NaN at step 4 is seen at the step-5 check
    assert recorder.events[-2:] == ["on_stop_training_error", "on_training_run_end"]
    make_trainer(make_linear(), callbacks=[callback]).train(linear_dataset(4), num_epochs=1, per_device_batch_size=2)
    assert not callback.triggered  # reset by the next run


def test_terminate_on_nan_exits_by_default_like_pytorch_accelerated():
    model = make_linear()
    trainer = _NaNAfter(model, nn.MSELoss(), torch.optim.SGD(model.parameters(), lr=0.1), callbacks=[TerminateOnNaNCallback])
    with pytest.raises(SystemExit, match="Exiting due to NaN loss"):
        trainer.train(linear_dataset(8), num_epochs=1, per_device_batch_size=2)


def test_terminate_on_nan_leaves_a_finite_run_alone():
    callback = TerminateOnNaNCallback(check_every_n_steps=1)
    trainer = make_trainer(make_linear(), callbacks=[callback])
    trainer.train(linear_dataset(8), num_epochs=2, eval_dataset=linear_dataset(4), per_device_batch_size=2)
    assert not callback.triggered and math.isfinite(trainer.run_history.get_latest_metric("eval_loss_epoch"))
