"""Skipping or retrying updates whose gradients are not finite."""

from __future__ import annotations

import functools
import math

import torch
from conftest import RecordingCallback, make_mlp, regression_dataset
from torch import nn

from pytorch_accel_trainer import DEFAULT_CALLBACKS, Trainer
from pytorch_accel_trainer.callbacks import TrainerCallback
from pytorch_accel_trainer.callbacks.non_finite import SkipNonFiniteStepsCallback


class NaNOnCalls(Trainer):
    """Returns a NaN loss on the given calls of calculate_train_batch_loss (counted from 0)."""

    nan_calls: set = set()

    def calculate_train_batch_loss(self, batch):
        output = super().calculate_train_batch_loss(batch)
        self.calls = getattr(self, "calls", -1) + 1
        if self.calls in self.nan_calls:
            output["loss"] = output["loss"] * float("nan")
        return output


class Snapshots(TrainerCallback):
    def __init__(self):
        self.states = []

    def on_train_step_start(self, trainer, **kwargs):
        self.states.append(
            (
                [p.detach().clone() for p in trainer.model.parameters()],
                str(trainer.optimizer.state_dict()),
                trainer.scheduler.state_dict()["last_epoch"],
            )
        )


def _train(nan_calls, callbacks, **kwargs):
    model = make_mlp()
    trainer_class = type("T", (NaNOnCalls,), {"nan_calls": set(nan_calls)})
    trainer = trainer_class(model, nn.MSELoss(), torch.optim.AdamW(model.parameters(), lr=0.01), callbacks=callbacks)
    trainer.train(
        regression_dataset(16),
        num_epochs=2,
        per_device_batch_size=2,
        create_scheduler_fn=functools.partial(torch.optim.lr_scheduler.StepLR, step_size=1, gamma=0.9),
        **kwargs,
    )
    return trainer


def test_non_finite_update_is_skipped():
    """A skipped update leaves the weights, the optimizer and the scheduler untouched."""
    snapshots = Snapshots()
    trainer = _train({3}, [SkipNonFiniteStepsCallback(), snapshots, *DEFAULT_CALLBACKS])
    before, after = snapshots.states[3], snapshots.states[4]
    assert all(torch.equal(a, b) for a, b in zip(before[0], after[0]))
    assert before[1] == after[1] and before[2] == after[2]
    assert trainer.num_update_steps_completed == 15
    assert trainer.run_history.get_metric_values("non_finite_steps_skipped") == [1, 0]
    assert all(math.isfinite(loss) for loss in trainer.run_history.get_metric_values("train_loss_epoch"))
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())


def test_too_many_consecutive_skips_stop_the_run():
    recorder = RecordingCallback()
    trainer = _train(set(range(2, 100)), [SkipNonFiniteStepsCallback(max_consecutive_skips=3), recorder])
    assert trainer.num_update_steps_completed == 2
    assert recorder.events.count("on_train_step_start") == 5
    assert recorder.events[-2:] == ["on_stop_training_error", "on_training_run_end"]


def test_a_retry_that_succeeds_makes_the_update():
    trainer = _train({3}, [SkipNonFiniteStepsCallback(max_retries=1)])
    assert trainer.num_update_steps_completed == 16
    assert trainer.run_history.get_metric_values("non_finite_steps_skipped") == [0, 0]
    assert trainer.calls == 16  # one batch ran twice


def test_without_callback_nan_spreads():
    """Without the callback the NaN spreads, and TerminateOnNaNCallback stops the run."""
    trainer = _train({3}, [*DEFAULT_CALLBACKS[:1], *DEFAULT_CALLBACKS[2:]])  # no TerminateOnNaN
    assert not all(torch.isfinite(p).all() for p in trainer.model.parameters())


def test_bad_policy_arguments_are_refused():
    import pytest

    with pytest.raises(
        ValueError, match=r"max_consecutive_skips is 0; pass a positive whole number of skipped updates"
    ):
        SkipNonFiniteStepsCallback(max_consecutive_skips=0)
    with pytest.raises(ValueError, match=r"max_retries=-1 is not valid"):
        SkipNonFiniteStepsCallback(max_retries=-1)


def test_retried_step_fires_events_once():
    recorder = RecordingCallback()
    trainer = _train({3}, [SkipNonFiniteStepsCallback(max_retries=1), recorder])
    assert trainer.calls == 16  # batch 3 ran twice
    assert recorder.events.count("on_train_step_end") == recorder.events.count("on_train_step_start") == 16
    assert recorder.events.count("on_optimizer_step_end") == 16


def test_retry_through_a_pytorch_accelerated_override_fires_events_once():
    """A retry through an override written as pytorch-accelerated's ``(batch, step)`` fires no event and counts no
    sample again: its super() call finds the retry in the run state."""

    class Override(NaNOnCalls):
        nan_calls = {3}

        def _perform_forward_and_backward_passes(self, batch, step):
            super()._perform_forward_and_backward_passes(batch, step)

    recorder, model = RecordingCallback(), make_mlp()
    callbacks = [SkipNonFiniteStepsCallback(max_retries=1), recorder]
    trainer = Override(model, nn.MSELoss(), torch.optim.AdamW(model.parameters(), lr=0.01), callbacks=callbacks)
    trainer.train(regression_dataset(16), num_epochs=2, per_device_batch_size=2)
    assert trainer.calls == 16  # batch 3 ran twice
    assert recorder.events.count("on_train_step_end") == 16 and int(trainer.run_state.samples_seen) == 32


def test_retry_reruns_the_whole_window():
    """Under accumulation a retry reruns the whole window and ends where a clean run ends."""
    recorder = RecordingCallback()
    retried = _train({3}, [SkipNonFiniteStepsCallback(max_retries=1), recorder], gradient_accumulation_steps=2)
    clean = _train(set(), [], gradient_accumulation_steps=2)
    assert retried.calls + 1 == 16 + 2  # calls counts from 0; the window of batches 2 and 3 ran twice
    assert retried.num_update_steps_completed == clean.num_update_steps_completed == 8
    assert retried.run_history.get_metric_values("non_finite_steps_skipped") == [0, 0]
    for retried_parameter, clean_parameter in zip(retried.model.parameters(), clean.model.parameters()):
        assert torch.equal(retried_parameter, clean_parameter)  # no dropout: the rerun window gives the same update
    assert retried.run_history.get_metric_values("train_loss_epoch") == clean.run_history.get_metric_values(
        "train_loss_epoch"
    )
    assert recorder.events.count("on_train_step_end") == 16 and recorder.events.count("on_optimizer_step_end") == 8


def test_exhausted_retries_skip_the_window():
    """Under accumulation a window still non-finite after its retries is skipped."""
    trainer = _train({3, 5, 7}, [SkipNonFiniteStepsCallback(max_retries=2)], gradient_accumulation_steps=2)
    assert trainer.calls + 1 == 16 + 4  # batches 2 and 3 again (call 5: NaN), then again (call 7: NaN): skipped
    assert trainer.num_update_steps_completed == 7
    assert trainer.run_history.get_metric_values("non_finite_steps_skipped") == [1, 0]
    assert trainer.run_state.non_finite_policy is None  # the policy (and the batches it kept) ends with the run
