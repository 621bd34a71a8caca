"""The callback protocol and the default callbacks, on tiny real runs; other trainers' event names are refused
naming the event to use here."""

from __future__ import annotations

import inspect
import math

import pytest
import torch
from conftest import RecordingCallback, linear_dataset, make_linear, make_trainer
from torch import nn

import pytorch_accel_trainer.callbacks as callbacks_module
from pytorch_accel_trainer import DEFAULT_CALLBACKS, Trainer
from pytorch_accel_trainer.callbacks import (
    EVENTS,
    CallbackHandler,
    CallbackMethodNotImplementedError,
    LogMetricsCallback,
    MoveModulesToDeviceCallback,
    NonFiniteLossError,
    PrintMetricsCallback,
    PrintProgressCallback,
    ProgressBarCallback,
    StopTrainingError,
    TerminateOnNaNCallback,
    TrainerCallback,
    get_default_callbacks,
)
from pytorch_accel_trainer.callbacks.base import FASTAI_EVENT_NAMES, FOREIGN_EVENT_NAMES

#: The public names pytorch-accelerated 0.1.61 defines in its callbacks.py (its classes, functions and module
#: constants, read from its AST), and the names it imports that its users import from there (ModelEma).
PEER_CALLBACKS_NAMES = (
    "logger",
    "get_default_callbacks",
    "StopTrainingError",
    "CallbackMethodNotImplementedError",
    "TrainerCallback",
    "CallbackHandler",
    "LogMetricsCallback",
    "ProgressBarCallback",
    "PrintProgressCallback",
    "SaveBestModelCallback",
    "EarlyStoppingCallback",
    "TerminateOnNaNCallback",
    "MoveModulesToDeviceCallback",
    "LimitBatchesCallback",
    "ModelEmaCallback",
    "ConvertSyncBatchNormCallback",
    "StepBasedEvaluationCallback",
    "LimitEvalStepsCallback",
    "SaveTrainingStateCallback",
    "WSDCheckpointCallback",
    "ModelEma",
)

HOOKS_WITH_EVENTS = (
    "training_run_start",
    "train_epoch_start",
    "train_epoch_end",
    "eval_epoch_start",
    "eval_epoch_end",
    "training_run_epoch_end",
    "training_run_end",
    "evaluation_run_start",
    "evaluation_run_end",
)


def test_events_have_no_ops_and_hook_twins():
    """Every event has a documented no-op, and every hook its on_ twin."""
    for event in EVENTS:
        method = getattr(TrainerCallback, event)
        assert method.__doc__ and method(TrainerCallback(), trainer=None, batch=None, batch_output=None) is None
    for hook in HOOKS_WITH_EVENTS:
        assert hasattr(Trainer, hook) and f"on_{hook}" in EVENTS
    trainer_source = inspect.getsource(Trainer)  # the loop fires every event itself
    fired = {event for event in EVENTS if f'"{event}"' in trainer_source}
    assert fired == set(EVENTS)


def test_peer_callback_names_exist():
    """Every name of pytorch-accelerated's callbacks.py is here."""
    missing = [name for name in PEER_CALLBACKS_NAMES if not hasattr(callbacks_module, name)]
    assert not missing
    assert set(PEER_CALLBACKS_NAMES) - {"logger"} <= set(callbacks_module.__all__)


def test_get_default_callbacks():
    """get_default_callbacks() is the trainer's default, with or without the progress bar."""
    assert get_default_callbacks() == get_default_callbacks(progress_bar=True) == DEFAULT_CALLBACKS
    assert get_default_callbacks(progress_bar=False) == tuple(
        cb for cb in DEFAULT_CALLBACKS if cb is not ProgressBarCallback
    )


def test_events_take_peer_call_forms():
    """Peer tests call events by hand with only some arguments, e.g. on_train_step_end(trainer, step=0)."""
    callback = TrainerCallback()
    for event in EVENTS:
        assert getattr(callback, event)(None) is None
    assert callback.on_train_step_end(None, step=0) is None and callback.on_eval_step_end(None, batch=(1, 2)) is None
    trainer = make_trainer(make_linear(), callbacks=[])
    trainer.train(linear_dataset(8), num_epochs=1, per_device_batch_size=4)
    bar = ProgressBarCallback()
    bar.on_training_run_start(trainer)
    bar.on_train_epoch_start(trainer)
    bar.on_train_step_end(trainer, step=0)  # pytorch-accelerated's bar takes (trainer, **kwargs)
    assert bar.pbar.n == 1
    bar.on_train_epoch_end(trainer)


def test_missing_callback_attribute_error():
    """A missing callback attribute is a CallbackMethodNotImplementedError."""
    callback = TrainerCallback()
    with pytest.raises(
        CallbackMethodNotImplementedError, match="'TrainerCallback' object has no attribute 'on_my_event'"
    ):
        callback.on_my_event(None)
    assert issubclass(CallbackMethodNotImplementedError, AttributeError)
    assert not hasattr(callback, "verify_train_batch") and getattr(callback, "verify_train_batch", None) is None


def test_module_callback_keeps_attributes():
    """A callback that is also an nn.Module keeps its module attributes."""

    class ModuleCallback(TrainerCallback, nn.Module):
        def __init__(self):
            nn.Module.__init__(self)
            self.scale = nn.Parameter(torch.ones(1))  # kept by nn.Module, found by its __getattr__

    callback = ModuleCallback()
    assert callback.scale.shape == (1,)
    with pytest.raises(CallbackMethodNotImplementedError):
        _ = callback.missing


def test_custom_event_reaches_its_handlers():
    """A custom event reaches the callbacks that handle it."""
    calls = []

    class Verify(TrainerCallback):
        def verify_train_batch(self, trainer, xb, yb):
            calls.append((trainer, xb, yb))

    handler = CallbackHandler([Verify, RecordingCallback])  # RecordingCallback has no verify_train_batch: skipped
    handler.call_event("verify_train_batch", trainer="trainer", xb=1, yb=2)
    assert calls == [("trainer", 1, 2)]


def test_unhandled_undeclared_event_is_no_op():
    """An undeclared event that no callback handles does nothing, as in pytorch-accelerated."""
    handler = CallbackHandler([RecordingCallback])
    handler.call_event("verify_train_batch", trainer=None)  # nobody handles it: nothing happens
    handler.register_events("verify_train_batch")
    handler.call_event("verify_train_batch", trainer=None)


def test_custom_on_event_needs_no_declaration():
    """An on_-prefixed custom event needs no declaration; declaring it lists it."""
    seen = []

    class OnMyEvent(TrainerCallback):
        def on_my_event(self, trainer, value, **kwargs):
            seen.append(value)

    CallbackHandler([OnMyEvent]).call_event("on_my_event", None, value=2)
    handler = CallbackHandler([OnMyEvent, RecordingCallback], events=["on_my_event"])
    handler.call_event("on_my_event", None, value=3)
    assert seen == [2, 3] and handler.events == (*EVENTS, "on_my_event")
    with pytest.raises(ValueError, match="Custom callback event '_private' is not a method name"):
        handler.register_events("_private")


def test_every_callback_ends_the_run(caplog):
    """Every callback ends its run, even when an earlier one raised."""

    class Fails(TrainerCallback):
        def __init__(self, message):
            self.message = message

        def on_training_run_end(self, trainer, **kwargs):
            raise RuntimeError(self.message)

    class FailsToo(Fails):
        pass

    recorder = RecordingCallback()
    handler = CallbackHandler([Fails("first"), FailsToo("second"), recorder])
    with pytest.raises(RuntimeError, match="first"):
        handler.call_event("on_training_run_end", None)
    assert recorder.events == ["on_training_run_end"] and "second" in caplog.text
    with pytest.raises(RuntimeError, match="first"):  # other events stop at the first error, as before
        CallbackHandler([Fails("first"), recorder]).call_event("on_training_run_end", None)


def test_an_unknown_event_is_an_error():
    handler = CallbackHandler([RecordingCallback])
    with pytest.raises(
        ValueError, match=r"Unknown callback event 'on_train_epoch_ends' \(did you mean 'on_train_epoch_end'\?\)"
    ):
        handler.call_event("on_train_epoch_ends", None)


def test_a_typo_in_a_callback_method_is_an_error():
    class Typo(TrainerCallback):
        def on_train_epcoh_end(self, trainer, **kwargs):
            pass

    with pytest.raises(
        ValueError,
        match=r"defines 'on_train_epcoh_end' \(did you mean 'on_train_epoch_end'\?\), which is not a callback event",
    ):
        make_trainer(make_linear(), callbacks=[Typo])


# Other trainers' event names (Lightning, Keras, Dream Trainer, fastai): refused or warned about, naming ours ----------


class DreamCallback(TrainerCallback):
    """Dream Trainer's (and Lightning's) callback, as its docs write it."""

    def on_train_batch_end(self, trainer, outputs, batch, batch_idx):
        pass


class KerasCallback(TrainerCallback):
    def on_epoch_end(self, trainer, **kwargs):
        pass


def test_foreign_event_name_is_refused():
    """A callback method with another trainer's event name is refused, naming the event to use here."""
    lightning = r"'on_train_batch_end', which is Lightning's.*here the event is 'on_train_step_end'"
    with pytest.raises(ValueError, match=lightning):
        make_trainer(make_linear(), callbacks=[DreamCallback()])
    keras = r"'on_epoch_end', which is Keras's.*here the event is 'on_training_run_epoch_end'"
    with pytest.raises(ValueError, match=keras):
        make_trainer(make_linear(), callbacks=[KerasCallback])

    class Backward(TrainerCallback):
        def on_after_backward(self, trainer):
            pass

    with pytest.raises(ValueError, match=r"does not fire \(no event: override the trainer's backward_step hook\)"):
        make_trainer(make_linear(), callbacks=[Backward])


def test_declared_foreign_name_is_fired():
    """A custom event with a foreign name is allowed once declared, and fired."""

    class FiresEpochEnd(Trainer):
        callback_events = ("on_epoch_end",)

        def training_run_epoch_end(self):
            self.callback_handler.call_event("on_epoch_end", self)

    class Counts(TrainerCallback):
        calls = 0

        def on_epoch_end(self, trainer, **kwargs):
            Counts.calls += 1

    trainer = make_trainer(make_linear(), callbacks=[Counts()], trainer_class=FiresEpochEnd)
    trainer.train(linear_dataset(8), num_epochs=2, per_device_batch_size=4)
    assert Counts.calls == 2


def test_foreign_name_outside_the_table_is_a_custom_event():
    """Another trainer's less common event name (not in the table) is a custom event: accepted, and named in the
    warning at the end of a run that never fired it."""

    class TestBatchEnd(TrainerCallback):
        def on_test_batch_end(self, trainer, **kwargs):
            pass

    assert "on_test_batch_end" not in FOREIGN_EVENT_NAMES
    trainer = make_trainer(make_linear(), callbacks=[TestBatchEnd()])
    with pytest.warns(UserWarning, match=r"'on_test_batch_end', which is not a trainer event and was never called"):
        trainer.train(linear_dataset(8), num_epochs=1, per_device_batch_size=4)


def test_fastai_event_name_warns():
    class FastaiStyle(TrainerCallback):
        def after_batch(self):
            pass

    fastai = r"'after_batch', which is fastai's name.*here the event is 'on_train_step_end'"
    with pytest.warns(UserWarning, match=fastai):
        make_trainer(make_linear(), callbacks=[FastaiStyle()])


def test_foreign_names_map_to_events():
    """Every foreign name maps to an event or says what to do, and none is one of ours."""
    for name, (whose, here) in FOREIGN_EVENT_NAMES.items():
        assert name not in EVENTS and whose.endswith("'s")
        assert here in EVENTS or here.startswith("no event: "), name
    assert set(FASTAI_EVENT_NAMES.values()) <= set(EVENTS)


def test_duplicate_callback_classes_are_refused():
    with pytest.raises(ValueError, match="A RecordingCallback is already registered"):
        CallbackHandler([RecordingCallback, RecordingCallback()])


def test_callbacks_called_in_order_removable():
    """Callbacks are called in order, and can be removed."""
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


def test_default_callbacks_print(capsys):
    """The default callbacks print progress and metrics."""
    assert DEFAULT_CALLBACKS == (
        MoveModulesToDeviceCallback,
        TerminateOnNaNCallback,
        PrintProgressCallback,
        ProgressBarCallback,
        LogMetricsCallback,
    )
    assert PrintMetricsCallback is LogMetricsCallback
    trainer = make_trainer(make_linear(), callbacks=DEFAULT_CALLBACKS)
    trainer.train(linear_dataset(8), num_epochs=2, eval_dataset=linear_dataset(4), per_device_batch_size=4)
    captured = capsys.readouterr()
    assert captured.out.startswith(
        "Model Linear · 2 parameters, 2 trainable · 0.000 MiB · float32 weights\n"
        "Training 2 epochs of 2 updates, batches of 4 (1 process, cpu)\nepoch 1/2 · "
    )
    assert captured.out.count("train_loss_epoch: ") == 2 and captured.out.count("eval_loss_epoch: ") == 2
    assert "\nFinished 2 epochs in " in captured.out and len(captured.out.splitlines()) == 5
    assert "epoch 2/2:   0%" in captured.err and "/3 " in captured.err  # one bar per epoch: 2 training + 1 eval batches


def test_log_metrics_can_be_redirected():
    logged = []

    class Collect(LogMetricsCallback):
        def log_metrics(self, trainer, metrics):
            logged.append(metrics)

    trainer = make_trainer(make_linear(), callbacks=[Collect])
    trainer.train(linear_dataset(4), num_epochs=1, eval_dataset=linear_dataset(4), per_device_batch_size=4)
    assert [set(metrics) for metrics in logged] == [{"train_loss_epoch"}, {"eval_loss_epoch"}]


def test_move_modules_to_device():
    """MoveModulesToDeviceCallback moves extra modules, but not the model."""
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
    trainer = WithMetricModule(
        model, nn.MSELoss(), torch.optim.SGD(model.parameters(), lr=0.1), callbacks=[MoveModulesToDeviceCallback]
    )
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


def test_terminate_on_nan_stops_at_next_check():
    """TerminateOnNaNCallback stops at the next check, and the run ends cleanly."""
    callback = TerminateOnNaNCallback(check_every_n_steps=5, raise_on_nan=False)
    recorder = RecordingCallback()
    model = make_linear()
    trainer = _NaNAfter(
        model, nn.MSELoss(), torch.optim.SGD(model.parameters(), lr=0.1), callbacks=[callback, recorder]
    )
    trainer.train(linear_dataset(40), num_epochs=3, per_device_batch_size=2)
    assert callback.triggered and callback.error.steps == (0, 4)
    assert recorder.events.count("on_train_step_start") == 5  # the NaN at step 4 is seen at the step-5 check
    assert recorder.events[-2:] == ["on_stop_training_error", "on_training_run_end"]
    make_trainer(make_linear(), callbacks=[callback]).train(linear_dataset(4), num_epochs=1, per_device_batch_size=2)
    assert not callback.triggered and callback.error is None  # reset by the next run


def test_diverging_run_raises_non_finite_error(capsys):
    """A diverging run raises NonFiniteLossError once every callback has ended it."""
    recorder = RecordingCallback()
    trainer = make_trainer(
        make_linear(),
        lr=3.0,
        callbacks=[TerminateOnNaNCallback(check_every_n_steps=8), PrintProgressCallback, recorder],
    )
    with pytest.raises(NonFiniteLossError) as raised:
        trainer.train(linear_dataset(64), num_epochs=20, per_device_batch_size=2)  # lr 3 on y = 2x + 3 diverges
    error = raised.value
    assert isinstance(error, RuntimeError) and not isinstance(error, StopTrainingError)
    assert error.metric == "train_loss_epoch" and not math.isfinite(error.value)
    assert error.epoch == 1 and error.steps[1] - error.steps[0] == 7 and (error.steps[1] + 1) % 8 == 0
    assert str(error).startswith(
        f"The loss recorded as 'train_loss_epoch' became {error.value} in epoch 1, between steps"
    )
    assert recorder.events[-2:] == ["on_stop_training_error", "on_training_run_end"]  # after TerminateOnNaN's
    assert "Finished 0 epochs in " in capsys.readouterr().out


def test_a_diverged_evaluation_raises_it_too():
    class NaNEval(Trainer):
        def calculate_eval_batch_loss(self, batch):
            output = super().calculate_eval_batch_loss(batch)
            return {**output, "loss": output["loss"] * float("inf")}

    model = make_linear()
    trainer = NaNEval(
        model, nn.MSELoss(), torch.optim.SGD(model.parameters(), lr=0.1), callbacks=[TerminateOnNaNCallback]
    )
    with pytest.raises(NonFiniteLossError, match="'eval_loss_epoch' became inf in epoch 1, between steps 0 and 1"):
        trainer.train(linear_dataset(8), num_epochs=1, eval_dataset=linear_dataset(8), per_device_batch_size=4)
    with pytest.raises(NonFiniteLossError, match="'evaluation_loss' became inf in epoch 1"):
        trainer.evaluate(linear_dataset(8), per_device_batch_size=4)


def test_check_for_nan_after_batch():
    """check_for_nan_after_batch checks one batch at once."""
    callback = TerminateOnNaNCallback()
    callback.check_for_nan_after_batch({"loss": torch.tensor(1.0)}, step="training")
    with pytest.raises(StopTrainingError, match="Stopping training due to NaN loss in validation step"):
        callback.check_for_nan_after_batch({"loss": torch.tensor(float("nan"))}, step="validation")
    assert callback.triggered and callback.error.metric == "eval_loss_epoch"


def test_terminate_on_nan_spares_finite_run():
    """TerminateOnNaNCallback leaves a finite run alone."""
    callback = TerminateOnNaNCallback(check_every_n_steps=1)
    trainer = make_trainer(make_linear(), callbacks=[callback])
    trainer.train(linear_dataset(8), num_epochs=2, eval_dataset=linear_dataset(4), per_device_batch_size=2)
    assert not callback.triggered and math.isfinite(trainer.run_history.get_latest_metric("eval_loss_epoch"))
