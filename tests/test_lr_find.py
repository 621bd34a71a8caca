"""Trainer.lr_find: the range test puts everything back bit for bit, and its suggestion is a good learning rate."""

from __future__ import annotations

import copy
import functools
import random

import numpy as np
import pytest
import torch
from conftest import (
    RecordingCallback,
    StreamDataset,
    assert_bitwise_equal,
    make_mlp,
    make_trainer,
    regression_dataset,
)
from torch import nn
from torch.utils.data import TensorDataset

from pytorch_accel_trainer import Trainer
from pytorch_accel_trainer.loop.lr_find import suggest_lr
from pytorch_accel_trainer.loop.trainer_parts import capture_rng_state


def dropout_trainer(callbacks=()) -> Trainer:
    """An MLP with dropout (so that the random state matters), Adam (so that the optimizer has state) and no seed
    (so that train() does not reseed)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Dropout(0.2), nn.Linear(16, 1))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    return Trainer(model, nn.MSELoss(), optimizer, callbacks=callbacks, seed=None)


SCHEDULER = functools.partial(torch.optim.lr_scheduler.StepLR, step_size=2, gamma=0.5)


def test_lr_find_puts_everything_back():
    """lr_find puts the model, optimizer, scheduler, random state and callbacks back, bit for bit."""
    recorder = RecordingCallback()
    trainer = dropout_trainer(callbacks=[recorder])
    trainer.train(regression_dataset(32), num_epochs=1, per_device_batch_size=8, create_scheduler_fn=SCHEDULER)
    trainer.model[2].eval()  # a module left in evaluation mode on purpose
    events, history = list(recorder.events), copy.deepcopy(trainer.run_history.to_dataframe())
    before = (
        copy.deepcopy(trainer.model.state_dict()),
        copy.deepcopy(trainer.optimizer.state_dict()),
        copy.deepcopy(trainer.scheduler.state_dict()),
        capture_rng_state(),
        [module.training for module in trainer.model.modules()],
    )
    result = trainer.lr_find(regression_dataset(64), num_steps=30, per_device_batch_size=8)
    assert len(result.lrs) == len(result.losses) > 1 and result.lrs[0] == pytest.approx(1e-7)
    after = (
        trainer.model.state_dict(),
        trainer.optimizer.state_dict(),
        trainer.scheduler.state_dict(),
        capture_rng_state(),
        [module.training for module in trainer.model.modules()],
    )
    assert_bitwise_equal(before, after)
    assert recorder.events == events  # no event fired
    assert trainer.run_history.to_dataframe().equals(history)


def test_train_after_lr_find_is_unchanged():
    """A train() after lr_find equals one without it."""

    def trained_weights(with_lr_find: bool) -> dict:
        trainer = dropout_trainer()
        torch.manual_seed(1), np.random.seed(1), random.seed(1)
        if with_lr_find:
            trainer.lr_find(regression_dataset(64), num_steps=20, per_device_batch_size=8)
        trainer.train(regression_dataset(32), num_epochs=2, per_device_batch_size=8)
        return trainer.model.state_dict()

    assert_bitwise_equal(trained_weights(True), trained_weights(False))


@pytest.mark.slow
def test_suggestion_near_grid_search_best():
    """The suggestion is within a factor of 3 of the best learning rate of a grid search. The grid search: SGD on a
    small MLP regression, 3 epochs of batches of 16, the learning rate of the lowest evaluation loss among 15 from 1e-3
    to 3. (The best learning rate of a longer training is larger: the steepest descent is a rate that trains fast from
    the start, not the largest that still converges.)"""
    train, evaluation = regression_dataset(256, 4), regression_dataset(256, 4, seed=1)

    def evaluation_loss(lr: float) -> float:
        trainer = make_trainer(make_mlp(), lr=lr)
        trainer.train(train, num_epochs=3, per_device_batch_size=16)
        loss = trainer.evaluate(evaluation, per_device_batch_size=256)["evaluation_loss"]
        return loss if np.isfinite(loss) else np.inf

    grid = np.logspace(-3, 0.5, 15)
    best = grid[int(np.argmin([evaluation_loss(lr) for lr in grid]))]
    result = make_trainer(make_mlp()).lr_find(train, start_lr=1e-4, end_lr=10, per_device_batch_size=16)
    assert result.diverged and len(result.lrs) < 100  # the sweep stopped on divergence
    assert best / 3 <= result.suggestion <= best * 3, (best, result.suggestion)


def test_suggestion_is_steepest_descent():
    """The suggestion is the steepest descent of the smoothed loss."""
    lrs = [10.0**exponent for exponent in range(-6, 1)]
    losses = [5.0, 5.0, 4.9, 4.0, 2.0, 1.5, 9.0]  # steepest between 1e-3 and 1e-2; the last point is left out
    assert suggest_lr(lrs, losses, skip_start=0, skip_end=1) == pytest.approx(1e-3)
    assert suggest_lr(lrs[:3], losses[:3], skip_start=0, skip_end=1) is not None
    assert suggest_lr(lrs[:2], losses[:2], skip_start=0, skip_end=1) is None  # too short to tell


def test_the_plot_is_written(tmp_path):
    pytest.importorskip("matplotlib")
    result = make_trainer(make_mlp()).lr_find(regression_dataset(64), num_steps=30)
    figure = result.plot(tmp_path / "lr_find.png")
    assert (tmp_path / "lr_find.png").stat().st_size > 0 and figure.axes[0].get_xscale() == "log"


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"start_lr": 1.0, "end_lr": 0.1}, "sweeps nothing"),
        ({"start_lr": 0.1, "end_lr": 0.1}, "sweeps nothing"),
        ({"end_lr": float("inf")}, r"end_lr=inf is not valid: lr_find\(\) needs a finite, positive learning rate"),
        ({"end_lr": float("nan")}, "end_lr=nan is not valid"),
        ({"start_lr": float("nan")}, "start_lr=nan is not valid"),
        ({"start_lr": float("inf"), "end_lr": float("inf")}, "start_lr=inf is not valid"),
        ({"start_lr": 0.0}, "start_lr=0.0 is not valid"),
        ({"end_lr": None}, "end_lr=None is not valid"),
        ({"num_steps": 1}, "too few"),
        ({"num_steps": 2}, "num_steps=2 is too few for a suggestion: pass at least 3"),
        ({"smoothing": float("nan")}, "smoothing=nan is not valid"),
        ({"smoothing": 1.0}, r"smoothing=1.0 is not valid"),
        ({"diverge_factor": 0.5}, "would stop at once"),
        ({"per_device_batch_size": 0}, "per_device_batch_size=0 is not valid"),
    ],
)
def test_bad_arguments_refused_before_a_step(arguments, message):
    trainer = make_trainer(make_mlp())
    weights = copy.deepcopy(trainer.model.state_dict())
    with pytest.raises(ValueError, match=message):
        trainer.lr_find(regression_dataset(8), **arguments)
    assert_bitwise_equal(weights, trainer.model.state_dict())


@pytest.mark.parametrize("method", ["lr_find", "predict"])
def test_refused_inside_a_training_run(method):
    """lr_find and predict are refused inside a training run."""
    from pytorch_accel_trainer.callbacks import TrainerCallback

    class Sneaky(TrainerCallback):
        def on_train_epoch_end(self, trainer, **kwargs):
            getattr(trainer, method)(regression_dataset(8))

    trainer = make_trainer(make_mlp(), callbacks=[Sneaky()])
    with pytest.raises(RuntimeError, match=rf"{method}\(\) was called inside a training run"):
        trainer.train(regression_dataset(8), num_epochs=1)


def test_evaluation_only_trainer_refused():
    """An evaluation-only trainer cannot run lr_find."""
    trainer = Trainer(make_mlp(), nn.MSELoss(), optimizer=None, callbacks=())
    with pytest.raises(ValueError, match="no optimizer"):
        trainer.lr_find(regression_dataset(8))


def test_a_loss_not_finite_from_the_first_step_is_an_error():
    """A loss that is NaN at the first step, before any update, is broken data or a broken model, not a divergence:
    one error naming the step, its learning rate and what to check; the trainer is put back as it was."""
    x = torch.randn(16, 4)
    broken = TensorDataset(x, torch.full((16, 1), float("nan")))
    trainer = make_trainer(make_mlp())
    weights = copy.deepcopy(trainer.model.state_dict())
    with pytest.raises(
        ValueError, match=r"the loss of the first step \(step 0, lr=1e-07\) is nan, computed before any"
    ):
        trainer.lr_find(broken, num_steps=10)
    assert_bitwise_equal(weights, trainer.model.state_dict())


def test_no_suggestion_when_the_loss_diverges_at_once():
    """The documented case of suggestion=None: the loss diverges at the second step (start_lr already too large)."""
    result = make_trainer(make_mlp()).lr_find(regression_dataset(32), start_lr=100.0, end_lr=1e6, num_steps=10)
    assert result.diverged and len(result.losses) == 2 and result.suggestion is None


def test_a_stream_of_no_sample_is_refused():
    with pytest.raises(ValueError, match=r"lr_find\(\) received data with no batch \(a stream that yields no sample"):
        make_trainer(make_mlp()).lr_find(StreamDataset(regression_dataset(0)), num_steps=10)
