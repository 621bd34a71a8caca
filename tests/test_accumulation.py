"""Gradient accumulation, clipping and schedulers give what one large batch would; a scheduler steps once per
optimizer update, or once per epoch with ``scheduler_interval='epoch'``."""

from __future__ import annotations

import functools
import math
import warnings

import pytest
import torch
from conftest import StreamDataset, make_mlp, make_trainer, regression_dataset

from pytorch_accel_trainer import Trainer, TrainerPlaceholderValues
from pytorch_accel_trainer.callbacks import TrainerCallback


def _train_mlp(
    dataset,
    batch_size,
    accumulation,
    num_epochs=3,
    optimizer_cls=torch.optim.SGD,
    trainer_class=Trainer,
    **train_kwargs,
):
    model = make_mlp()
    trainer = trainer_class(model, torch.nn.MSELoss(), optimizer_cls(model.parameters(), lr=0.05), callbacks=())
    trainer.train(
        dataset,
        num_epochs=num_epochs,
        per_device_batch_size=batch_size,
        gradient_accumulation_steps=accumulation,
        **train_kwargs,
    )
    parameters = torch.cat([p.detach().flatten() for p in model.parameters()])
    return parameters, trainer.run_history.get_metric_values("train_loss_epoch"), trainer


@pytest.mark.parametrize("shuffle", [False, True])
def test_batch_8_equals_2_x_accumulation_4(shuffle):
    """Batch 8 equals batch 2 with accumulation 4, a partial last window included."""
    dataset = regression_dataset(20)  # 8 + 8 + 4: the last window has 2 micro-batches, not 4
    kwargs = {"train_dataloader_kwargs": {"shuffle": shuffle}}
    reference, reference_losses, _ = _train_mlp(dataset, batch_size=8, accumulation=1, **kwargs)
    accumulated, accumulated_losses, trainer = _train_mlp(dataset, batch_size=2, accumulation=4, **kwargs)
    assert trainer.num_update_steps_completed == 9
    torch.testing.assert_close(accumulated, reference, rtol=1e-5, atol=1e-6)
    assert accumulated_losses == pytest.approx(reference_losses, rel=1e-5)


def test_logged_loss_is_not_divided():
    """The logged loss is not divided by the accumulation count."""
    dataset = regression_dataset(20)
    _, losses, trainer = _train_mlp(
        dataset, batch_size=2, accumulation=4, num_epochs=1, optimizer_cls=lambda p, lr: torch.optim.SGD(p, lr=0.0)
    )
    x, y = dataset.tensors
    expected = torch.nn.functional.mse_loss(trainer.get_model()(x), y).item()  # lr 0: the model never changed
    assert losses == [pytest.approx(expected, rel=1e-5)]


def test_stream_partial_last_window():
    """A stream without len accumulates its partial last window correctly."""
    dataset = regression_dataset(20)
    reference, reference_losses, _ = _train_mlp(
        dataset, batch_size=8, accumulation=1, train_dataloader_kwargs={"shuffle": False}
    )
    streamed, streamed_losses, _ = _train_mlp(StreamDataset(dataset), batch_size=2, accumulation=4)
    torch.testing.assert_close(streamed, reference, rtol=1e-5, atol=1e-6)
    assert streamed_losses == pytest.approx(reference_losses, rel=1e-5)


@pytest.mark.parametrize(
    "clip",
    [
        {"gradient_clip_norm": 0.05},
        {"gradient_clip_value": 0.01},
        {"gradient_clip_norm": 0.05, "gradient_clip_value": 0.002},
    ],
)
def test_clipping_once_per_update(clip):
    """Clipping runs once per update, on the accumulated gradients."""
    dataset = regression_dataset(16)
    kwargs = {"train_dataloader_kwargs": {"shuffle": False}, **clip}
    reference, _, _ = _train_mlp(dataset, batch_size=8, accumulation=1, **kwargs)
    accumulated, _, _ = _train_mlp(dataset, batch_size=2, accumulation=4, **kwargs)
    unclipped, _, _ = _train_mlp(dataset, batch_size=8, accumulation=1, train_dataloader_kwargs={"shuffle": False})
    torch.testing.assert_close(accumulated, reference, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(unclipped, reference)  # the clip was active


def test_one_cycle_spans_the_run_exactly():
    # 21 samples, batch 2: 11 micro-batches (the last holds 1 sample) -> 3 updates per epoch with accumulation 4.
    """One-cycle placeholders span the run exactly, with accumulation and a partial batch."""
    factory = functools.partial(
        torch.optim.lr_scheduler.OneCycleLR,
        max_lr=0.1,
        epochs=TrainerPlaceholderValues.NUM_EPOCHS,
        steps_per_epoch=TrainerPlaceholderValues.NUM_UPDATE_STEPS_PER_EPOCH,
    )
    learning_rates = []

    class LearningRateSpy(Trainer):
        def optimizer_step(self):
            learning_rates.append(self.optimizer.param_groups[0]["lr"])
            super().optimizer_step()

    _, _, trainer = _train_mlp(
        regression_dataset(21),
        batch_size=2,
        accumulation=4,
        num_epochs=3,
        create_scheduler_fn=factory,
        trainer_class=LearningRateSpy,
    )
    assert trainer.scheduler.total_steps == 9 and len(learning_rates) == 9
    assert max(learning_rates) == pytest.approx(0.1, rel=0.05)  # the peak is reached...
    assert learning_rates[-1] == pytest.approx(0.1 / 25 / 1e4, rel=1e-3)  # ...and the last update uses the final lr


def test_placeholders_reach_the_factory():
    """Placeholder arithmetic reaches the scheduler factory."""
    captured = {}

    def factory(optimizer, total, batches):
        captured.update(total=total, batches=batches)
        return torch.optim.lr_scheduler.ConstantLR(optimizer, factor=1.0)

    placeholders = TrainerPlaceholderValues
    create = functools.partial(
        factory,
        total=placeholders.NUM_EPOCHS * placeholders.NUM_UPDATE_STEPS_PER_EPOCH + 1,
        batches=placeholders.TRAIN_DATALOADER_LEN,
    )
    _train_mlp(regression_dataset(10), batch_size=4, accumulation=2, num_epochs=2, create_scheduler_fn=create)
    assert captured == {"total": 2 * 2 + 1, "batches": 3}


# Schedulers stepped per update or, with scheduler_interval='epoch', per epoch -----------------------------------------


class LearningRates(TrainerCallback):
    def __init__(self):
        self.rates = []

    def on_train_epoch_start(self, trainer, **kwargs):
        self.rates.append(trainer.optimizer.param_groups[0]["lr"])


def _rates(scheduler_interval, factory, num_epochs=4):
    rates = LearningRates()
    trainer = make_trainer(make_mlp(), lr=1.0, callbacks=[rates])
    trainer.train(
        regression_dataset(20),
        num_epochs=num_epochs,
        per_device_batch_size=4,
        create_scheduler_fn=factory,
        scheduler_interval=scheduler_interval,
    )
    return rates.rates, trainer


def test_epoch_interval_steps_once_per_epoch():
    rates, trainer = _rates("epoch", functools.partial(torch.optim.lr_scheduler.StepLR, step_size=1, gamma=0.5))
    assert rates == [1.0, 0.5, 0.25, 0.125]
    assert trainer.scheduler.last_epoch == 4
    rates, _ = _rates("step", functools.partial(torch.optim.lr_scheduler.StepLR, step_size=1, gamma=0.5))
    assert rates == [1.0, 0.5**5, 0.5**10, 0.5**15]  # the default: once per update, 5 updates per epoch


def test_cosine_over_epochs_per_update_warns():
    """A cosine over num_epochs stepped per update warns; scheduler_interval='epoch' follows it."""
    factory = functools.partial(torch.optim.lr_scheduler.CosineAnnealingLR, T_max=TrainerPlaceholderValues.NUM_EPOCHS)
    with pytest.warns(
        UserWarning,
        match=r"CosineAnnealingLR\(T_max=4\) equals num_epochs, but the scheduler steps after "
        r"each of the run's 20 optimizer updates.*scheduler_interval='epoch'",
    ):
        _rates("step", factory)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        rates, _ = _rates("epoch", factory)
    assert rates == pytest.approx(
        [(1 + math.cos(math.pi * epoch / 4)) / 2 for epoch in range(4)]
    )  # one cosine over the run


def test_bad_scheduler_interval_is_refused():
    """A bad scheduler_interval is refused with the choices."""
    with pytest.raises(ValueError, match=r"scheduler_interval='epochs' is not valid: pass 'step' .* or 'epoch'"):
        make_trainer(make_mlp()).train(regression_dataset(8), num_epochs=1, scheduler_interval="epochs")
