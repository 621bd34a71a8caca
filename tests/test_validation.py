"""Bad input gets one clear error, before any training step runs."""

from __future__ import annotations

import pytest
import torch
from conftest import linear_dataset, make_linear, make_trainer
from torch.utils.data import TensorDataset

from pytorch_accel_trainer import Trainer


def _train(trainer=None, **overrides):
    trainer = trainer or make_trainer(make_linear())
    arguments = {"train_dataset": linear_dataset(8), "num_epochs": 1, "per_device_batch_size": 4, **overrides}
    trainer.train(**arguments)
    return trainer


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"num_epochs": 0}, r"num_epochs=0 is not valid: it must be a positive integer or None"),
        ({"num_epochs": -2}, r"num_epochs=-2 is not valid"),
        ({"num_epochs": 1.5}, r"num_epochs=1.5 is not valid"),
        ({"per_device_batch_size": 0}, r"per_device_batch_size=0 is not valid: it must be a positive integer"),
        ({"gradient_accumulation_steps": 0}, r"gradient_accumulation_steps=0 is not valid"),
        ({"max_num_train_steps": 0}, r"max_num_train_steps=0 is not valid"),
        ({"num_epochs": None}, r"num_epochs and max_num_train_steps are both None"),
        ({"gradient_clip_norm": -1.0}, r"gradient_clip_norm=-1.0 is not valid"),
        ({"gradient_clip_value": 0}, r"gradient_clip_value=0 is not valid"),
        ({"train_dataset": TensorDataset(torch.zeros(0, 1), torch.zeros(0, 1))}, r"train_dataset is empty"),
        ({"train_dataset": None}, r"train_dataset is None"),
        ({"eval_dataset": TensorDataset(torch.zeros(0, 1), torch.zeros(0, 1))}, r"eval_dataset is empty"),
        ({"train_dataloader_kwargs": ["shuffle"]}, r"train_dataloader_kwargs=\['shuffle'\] is not valid"),
    ],
)
def test_invalid_train_arguments_are_refused_before_any_step(overrides, message):
    model = make_linear()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises((ValueError, TypeError), match=message):
        _train(make_trainer(model), **overrides)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_a_scheduler_instance_is_refused_with_the_fix():
    model = make_linear()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1)
    trainer = Trainer(model, torch.nn.MSELoss(), optimizer, callbacks=())
    with pytest.raises(TypeError, match=r"received a scheduler instance \(StepLR\).*functools.partial"):
        _train(trainer, create_scheduler_fn=scheduler)
    with pytest.raises(TypeError, match=r"create_scheduler_fn=3 is not callable"):
        _train(trainer, create_scheduler_fn=3)


class _BadLossTrainer(Trainer):
    def __init__(self, batch_output_fn, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.batch_output_fn = batch_output_fn

    def calculate_train_batch_loss(self, batch):
        output = super().calculate_train_batch_loss(batch)
        return self.batch_output_fn(output)


@pytest.mark.parametrize(
    ("batch_output_fn", "error", "message"),
    [
        (
            lambda out: {**out, "loss": out["loss"].expand(3)},
            ValueError,
            r"returned a loss of shape \(3,\); the trainer needs a scalar",
        ),
        (lambda out: {k: v for k, v in out.items() if k != "loss"}, ValueError, r"missing \['loss'\]"),
        (lambda out: out["loss"], TypeError, r"calculate_train_batch_loss returned Tensor; it must return a dict"),
        (lambda out: {**out, "loss": 1.0}, TypeError, r"returned a loss of type float"),
    ],
)
def test_a_bad_batch_output_is_refused_at_the_first_step(batch_output_fn, error, message):
    model = make_linear()
    trainer = _BadLossTrainer(
        batch_output_fn, model, torch.nn.MSELoss(), torch.optim.SGD(model.parameters(), lr=0.1), callbacks=()
    )
    with pytest.raises(error, match=message):
        _train(trainer)
    assert trainer.num_update_steps_completed == 0


def test_no_batch_on_this_process_is_an_error():
    with pytest.raises(ValueError, match="The training dataloader has no batches"):
        _train(train_dataloader_kwargs={"drop_last": True}, per_device_batch_size=16)


def test_model_must_be_a_module_and_training_needs_an_optimizer():
    trainer = Trainer("model", torch.nn.MSELoss(), None, callbacks=())  # as in pytorch-accelerated: checked when used
    with pytest.raises(TypeError, match="model is a str; pass a torch.nn.Module"):
        trainer.evaluate(linear_dataset(4))
    trainer = Trainer(make_linear(), torch.nn.MSELoss(), None, callbacks=())
    with pytest.raises(ValueError, match=r"no optimizer \(optimizer=None\)"):
        _train(trainer)
    trainer.evaluate(linear_dataset(4))  # evaluation needs no optimizer
    assert trainer.run_history.get_metric_names() == {"evaluation_loss"}


def test_evaluate_refuses_an_empty_dataset():
    trainer = make_trainer(make_linear())
    with pytest.raises(ValueError, match="dataset is empty"):
        trainer.evaluate(TensorDataset(torch.zeros(0, 1), torch.zeros(0, 1)))
