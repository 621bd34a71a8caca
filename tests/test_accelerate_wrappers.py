"""Accelerate's wrappers, only where they do something: calling torch directly where Accelerate's optimizer wrapper and
backward() would only call torch changes nothing but time (``always_use_accelerate_wrappers`` keeps them)."""

from __future__ import annotations

import functools

import torch
from accelerate.optimizer import AcceleratedOptimizer
from conftest import make_mlp, regression_dataset

from pytorch_accel_trainer import Trainer


class WrappedTrainer(Trainer):
    always_use_accelerate_wrappers = True


def _run(trainer_class, optimizer_cls):
    model = make_mlp()
    trainer = trainer_class(model, torch.nn.MSELoss(), optimizer_cls(model.parameters()), callbacks=())
    trainer.train(
        regression_dataset(30),
        num_epochs=3,
        eval_dataset=regression_dataset(10, seed=1),
        per_device_batch_size=4,
        gradient_accumulation_steps=3,
        gradient_clip_norm=0.5,
        create_scheduler_fn=functools.partial(torch.optim.lr_scheduler.StepLR, step_size=2, gamma=0.5),
    )
    return trainer


def test_plain_torch_step_equals_wrappers():
    """Calling torch directly is bitwise identical to Accelerate's wrappers, with SGD and AdamW."""
    for optimizer_cls in (
        functools.partial(torch.optim.SGD, lr=0.05, momentum=0.9),
        functools.partial(torch.optim.AdamW, lr=0.01),
    ):
        fast, wrapped = _run(Trainer, optimizer_cls), _run(WrappedTrainer, optimizer_cls)
        assert not isinstance(fast.optimizer, AcceleratedOptimizer)
        assert isinstance(wrapped.optimizer, AcceleratedOptimizer)
        for a, b in zip(fast.get_model().parameters(), wrapped.get_model().parameters()):
            assert torch.equal(a, b)
        assert fast.run_history.get_metric_values("train_loss_epoch") == wrapped.run_history.get_metric_values(
            "train_loss_epoch"
        )
        assert fast.scheduler.state_dict() == wrapped.scheduler.state_dict()
        assert str(fast.optimizer.state_dict()) == str(wrapped.optimizer.state_dict())
