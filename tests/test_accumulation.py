"""Gradient accumulation, clipping and schedulers give what one large batch would."""

from __future__ import annotations

import functools

import pytest
import torch
from conftest import StreamDataset, make_mlp, regression_dataset

from pytorch_accel_trainer import Trainer, TrainerPlaceholderValues


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
def test_batch_8_equals_batch_2_with_accumulation_4_including_a_partial_window(shuffle):
    dataset = regression_dataset(20)  # 8 + 8 + 4: the last window has 2 micro-batches, not 4
    kwargs = {"train_dataloader_kwargs": {"shuffle": shuffle}}
    reference, reference_losses, _ = _train_mlp(dataset, batch_size=8, accumulation=1, **kwargs)
    accumulated, accumulated_losses, trainer = _train_mlp(dataset, batch_size=2, accumulation=4, **kwargs)
    assert trainer.num_update_steps_completed == 9
    torch.testing.assert_close(accumulated, reference, rtol=1e-5, atol=1e-6)
    assert accumulated_losses == pytest.approx(reference_losses, rel=1e-5)


def test_logged_loss_is_not_divided_by_the_accumulation_count():
    dataset = regression_dataset(20)
    _, losses, trainer = _train_mlp(
        dataset, batch_size=2, accumulation=4, num_epochs=1, optimizer_cls=lambda p, lr: torch.optim.SGD(p, lr=0.0)
    )
    x, y = dataset.tensors
    expected = torch.nn.functional.mse_loss(trainer.get_model()(x), y).item()  # lr 0: the model never changed
    assert losses == [pytest.approx(expected, rel=1e-5)]


def test_a_stream_without_len_accumulates_its_partial_last_window_correctly():
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
def test_clipping_runs_once_per_update_on_the_accumulated_gradients(clip):
    dataset = regression_dataset(16)
    kwargs = {"train_dataloader_kwargs": {"shuffle": False}, **clip}
    reference, _, _ = _train_mlp(dataset, batch_size=8, accumulation=1, **kwargs)
    accumulated, _, _ = _train_mlp(dataset, batch_size=2, accumulation=4, **kwargs)
    unclipped, _, _ = _train_mlp(dataset, batch_size=8, accumulation=1, train_dataloader_kwargs={"shuffle": False})
    torch.testing.assert_close(accumulated, reference, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(unclipped, reference)  # the clip was active


def test_one_cycle_placeholders_span_the_run_exactly_with_accumulation_and_a_partial_batch():
    # 21 samples, batch 2: 11 micro-batches (the last holds 1 sample) -> 3 updates per epoch with accumulation 4.
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


def test_placeholder_arithmetic_reaches_the_factory():
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
