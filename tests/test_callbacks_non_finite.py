"""SkipNonFiniteStepsCallback when an update's retries run out: skip the update, stop the run, or raise (as
mini.trainer raises) once every callback has ended the run; the TrainResult says which. Skipping and retrying
themselves: tests/test_non_finite.py."""

from __future__ import annotations

import pytest
import torch
from conftest import linear_dataset, make_linear, make_trainer

from pytorch_accel_trainer import Trainer
from pytorch_accel_trainer.callbacks import NonFiniteGradientsError, SkipNonFiniteStepsCallback, TrainerCallback
from pytorch_accel_trainer.errors import StopTrainingError


class MiniTrainerStyle(Trainer):
    """A NaN loss on batch 2 of the first epoch, whatever the retries (a bad sample, not a transient overflow)."""

    def calculate_train_batch_loss(self, batch, batch_idx):
        output = super().calculate_train_batch_loss(batch)
        if batch_idx == 2 and self.run_state.epoch == 0:
            output["loss"] = output["loss"] * float("nan")
        return output


class StopEvents(TrainerCallback):
    def __init__(self):
        self.events = []

    def on_stop_training_error(self, trainer, **kwargs):
        self.events.append("stop")

    def on_training_run_end(self, trainer, **kwargs):
        self.events.append("run_end")


def test_exhausted_retries_can_raise(capsys):
    """on_exhausted='raise' raises NonFiniteGradientsError once every callback has ended the run."""
    events = StopEvents()
    callbacks = [SkipNonFiniteStepsCallback(max_retries=3, on_exhausted="raise"), events]
    trainer = make_trainer(make_linear(), callbacks=callbacks, trainer_class=MiniTrainerStyle)
    before = [parameter.clone() for parameter in trainer.model.parameters()]
    with pytest.raises(NonFiniteGradientsError, match=r"update 3 \(epoch 1, batch 2\) were not finite after 3 retries"):
        trainer.train(linear_dataset(32), num_epochs=2, per_device_batch_size=4)
    assert isinstance(NonFiniteGradientsError("x"), RuntimeError)  # mini.trainer raises a RuntimeError
    assert events.events == ["stop", "run_end"]  # every callback ended the run first
    assert trainer.num_update_steps_completed == 2 and all(torch.isfinite(p).all() for p in trainer.model.parameters())
    assert not all(torch.equal(a, b) for a, b in zip(before, trainer.model.parameters()))
    assert "on_exhausted='raise'" in capsys.readouterr().out


def test_exhausted_retries_stop_or_skip(capsys):
    """Exhausted retries stop the run or skip the update, and the TrainResult says which."""
    with pytest.raises(ValueError, match=r"max_consecutive_skips=1 counts skipped updates.*on_exhausted='stop'"):
        SkipNonFiniteStepsCallback(max_consecutive_skips=1, on_exhausted="stop")
    stopped = make_trainer(
        make_linear(), callbacks=[SkipNonFiniteStepsCallback(on_exhausted="stop")], trainer_class=MiniTrainerStyle
    )
    result = stopped.train(linear_dataset(32), num_epochs=2, per_device_batch_size=4)
    assert result.stopped_early and result.num_update_steps == 2 and result.non_finite_updates_skipped == 1
    assert "were not finite after 0 retries (on_exhausted='stop')" in result.stop_reason
    skipped = make_trainer(
        make_linear(), callbacks=[SkipNonFiniteStepsCallback(max_retries=2)], trainer_class=MiniTrainerStyle
    )
    result = skipped.train(linear_dataset(32), num_epochs=2, per_device_batch_size=4)
    assert not result.stopped_early and result.stop_reason is None
    assert result.non_finite_updates_skipped == 1 and result.num_update_steps == 15
    assert "Skipped 1 optimizer update whose gradients were not finite" in capsys.readouterr().out


def test_on_exhausted_is_checked():
    """on_exhausted is checked, and the trainer's own skip_non_finite_steps takes it too."""
    with pytest.raises(ValueError, match=r"on_exhausted='error' is not valid: choose between 'skip'"):
        SkipNonFiniteStepsCallback(on_exhausted="error")

    class RaisesOnExhaustion(MiniTrainerStyle):
        def training_run_start(self):
            self.skip_non_finite_steps(max_retries=1, on_exhausted="raise")

    trainer = make_trainer(make_linear(), trainer_class=RaisesOnExhaustion)
    with pytest.raises(NonFiniteGradientsError):
        trainer.train(linear_dataset(32), num_epochs=1, per_device_batch_size=4)
    assert not issubclass(NonFiniteGradientsError, StopTrainingError)
