"""Bad input to Trainer, train() and evaluate() gets one clear error, before any step changes a parameter.

Each error names the value received, the problem and the fix; each test runs a tiny real model. Sections: the
Trainer's arguments, callbacks, train()'s arguments, datasets and DataLoaders, what the batch-loss hooks return,
placeholders. Paths and files: tests/test_path_checks.py; the command line: tests/test_cli.py.
"""

from __future__ import annotations

import random
import re

import numpy as np
import pytest
import torch
from conftest import (
    RecordingCallback,
    StreamDataset,
    linear_dataset,
    make_linear,
    make_mlp,
    make_trainer,
    regression_dataset,
)
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

from pytorch_accel_trainer import Trainer, TrainerPlaceholderValues
from pytorch_accel_trainer.callbacks import (
    EarlyStoppingCallback,
    PrintProgressCallback,
    SaveTrainingStateCallback,
    TrainerCallback,
)


def _parameters(model: nn.Module) -> list:
    return [parameter.detach().clone() for parameter in model.parameters()]


def _unchanged(before: list, model: nn.Module) -> bool:
    return all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def _train(trainer=None, **overrides):
    trainer = trainer or make_trainer(make_linear())
    arguments = {"train_dataset": linear_dataset(8), "num_epochs": 1, "per_device_batch_size": 4, **overrides}
    trainer.train(**arguments)
    return trainer


# The Trainer's arguments -------------------------------------------------------------------------------------------


def test_model_type_and_missing_optimizer():
    """A model that is no nn.Module is refused where it is used; training needs an optimizer, evaluation does not."""
    trainer = Trainer("model", torch.nn.MSELoss(), None, callbacks=())  # as in pytorch-accelerated: checked when used
    with pytest.raises(TypeError, match="model is a str; pass a torch.nn.Module"):
        trainer.evaluate(linear_dataset(4))
    trainer = Trainer(make_linear(), torch.nn.MSELoss(), None, callbacks=())
    with pytest.raises(ValueError, match=r"no optimizer \(optimizer=None\)"):
        _train(trainer)
    trainer.evaluate(linear_dataset(4))  # evaluation needs no optimizer
    assert trainer.run_history.get_metric_names() == {"evaluation_loss"}


def test_loss_class_instead_of_instance():
    model = make_linear()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(
        TypeError,
        match=r"loss_func=nn.MSELoss is a class, not a loss function: pass an instance, "
        r"loss_func=nn.MSELoss\(\)",
    ):
        Trainer(model, nn.MSELoss, optimizer)
    trainer = Trainer(model, "mse", optimizer, callbacks=())  # a stand-in is refused where the trainer prepares it
    with pytest.raises(TypeError, match=r"loss_func='mse' is not callable"):
        trainer.train(linear_dataset(4), num_epochs=1)


@pytest.mark.parametrize("seed", ["42", 4.2, True, np.int64(42)])
def test_seed_must_be_an_int(seed):
    with pytest.raises(
        TypeError, match=re.escape(f"seed={seed!r} is a {type(seed).__name__}, not an int: pass a whole")
    ):
        make_trainer(make_linear(), seed=seed)


def test_seed_out_of_numpy_range():
    with pytest.raises(ValueError, match=r"seed=-1 is out of range: numpy takes seeds from 0 to 2\*\*32 - 1"):
        make_trainer(make_linear(), seed=-1)


# Callbacks ---------------------------------------------------------------------------------------------------------


def log_epoch(trainer):
    pass


class NoEvents:
    def on_something(self):  # not an event, but the class has none of the events either
        pass


class NotACallback:
    pass


class OneEvent(TrainerCallback):
    def on_train_epoch_end(self, trainer, **kwargs):
        pass


@pytest.mark.parametrize(
    ("callback", "message"),
    [
        (
            log_epoch,
            r"callbacks received the function log_epoch, which is not a callback and would never be called: "
            r"put its code in an event method of a TrainerCallback subclass",
        ),
        (
            NotACallback,
            r"NotACallback is not a callback: it has none of the TrainerCallback events.*Subclass "
            r"TrainerCallback",
        ),
        (NotACallback(), r"NotACallback\(\) is not a callback: it has none of the TrainerCallback events"),
    ],
)
def test_callback_without_events_is_refused(callback, message):
    """A function, or an object without any TrainerCallback event, is refused as a callback."""
    with pytest.raises(TypeError, match=message):
        make_trainer(make_linear(), callbacks=[PrintProgressCallback, callback])


def test_unknown_on_method_is_not_a_callback():
    # on_something would be a custom event of a TrainerCallback (tests/test_custom_events.py); an object with no
    # trainer event at all is refused as no callback
    with pytest.raises(TypeError, match=r"NoEvents is not a callback: it has none of the TrainerCallback events"):
        make_trainer(make_linear(), callbacks=[NoEvents])


@pytest.mark.parametrize(
    ("callbacks", "message"),
    [
        (
            OneEvent,
            r"callbacks=OneEvent is a single callback, not a list of them: pass callbacks=\[OneEvent\] \(or "
            r"callbacks=\[\*DEFAULT_CALLBACKS, OneEvent\]",
        ),
        (
            OneEvent(),
            r"callbacks=OneEvent\(\) is a single callback, not a list of them: pass callbacks=\[OneEvent\(\)\]",
        ),
        (log_epoch, r"callbacks=log_epoch is a function, not a list of callbacks"),
        (3, r"callbacks=3 is not a list of callbacks: pass a list of TrainerCallback classes or instances"),
    ],
)
def test_single_callback_instead_of_list(callbacks, message):
    with pytest.raises(TypeError, match=message):
        make_trainer(make_linear(), callbacks=callbacks)


def test_eval_metric_watchers_need_eval_set(tmp_path):
    """Callbacks watching eval_loss_epoch are refused before the first batch of a run without an eval_dataset."""
    model = make_mlp()
    before = _parameters(model)
    with pytest.raises(ValueError, match=r"EarlyStoppingCallback watches 'eval_loss_epoch', .* no eval_dataset"):
        make_trainer(model, callbacks=[EarlyStoppingCallback()]).train(
            regression_dataset(8), num_epochs=2, per_device_batch_size=2
        )
    with pytest.raises(ValueError, match=r"SaveTrainingStateCallback watches 'eval_loss_epoch'"):
        make_trainer(model, callbacks=[SaveTrainingStateCallback(tmp_path, watch_metric="eval_loss_epoch")]).train(
            regression_dataset(8), num_epochs=2, per_device_batch_size=2
        )
    assert _unchanged(before, model)  # nothing trained


# train()'s arguments -----------------------------------------------------------------------------------------------


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
def test_invalid_train_arguments(overrides, message):
    model = make_linear()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises((ValueError, TypeError), match=message):
        _train(make_trainer(model), **overrides)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_scheduler_instance_is_refused():
    model = make_linear()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1)
    trainer = Trainer(model, torch.nn.MSELoss(), optimizer, callbacks=())
    with pytest.raises(TypeError, match=r"received a scheduler instance \(StepLR\).*functools.partial"):
        _train(trainer, create_scheduler_fn=scheduler)
    with pytest.raises(TypeError, match=r"create_scheduler_fn=3 is not callable"):
        _train(trainer, create_scheduler_fn=3)


def test_optimizer_of_another_model():
    model = make_linear()
    before = _parameters(model)
    trainer = Trainer(model, nn.MSELoss(), torch.optim.SGD(make_linear(seed=1).parameters(), lr=0.1), callbacks=())
    with pytest.raises(
        ValueError,
        match=r"optimizer=SGD holds 0 of the model's 2 trainable parameters, so training would never change the "
        r"model.*Build the optimizer from model.parameters\(\) of the model you pass to Trainer",
    ):
        trainer.train(linear_dataset(8), num_epochs=1, per_device_batch_size=4)
    assert _unchanged(before, model) and trainer.num_update_steps_completed == 0


def test_optimizer_missing_parameters():
    """An optimizer missing some trainable parameters is refused, naming them."""
    model = make_mlp()
    trainer = Trainer(model, nn.MSELoss(), torch.optim.SGD(model[2].parameters(), lr=0.1), callbacks=())
    with pytest.raises(
        ValueError,
        match=r"optimizer=SGD holds 2 of the model's 4 trainable parameters: 2 would get gradients but never be "
        r"updated \(0.weight, 0.bias\).*or freeze the parameters you do not want to train",
    ):
        trainer.train(regression_dataset(8), num_epochs=1, per_device_batch_size=4)


def test_optimizer_may_skip_frozen_parameters():
    """Frozen parameters may be left out of the optimizer, and another model's parameters may be in it."""
    model, extra = make_mlp(), nn.Linear(3, 3)  # extra: a second model's parameters, as a GAN subclass holds
    model[0].requires_grad_(False)
    frozen, head = _parameters(model[0]), _parameters(model[2])
    optimizer = torch.optim.SGD([*model[2].parameters(), *extra.parameters()], lr=0.1)
    Trainer(model, nn.MSELoss(), optimizer, callbacks=()).train(
        regression_dataset(8), num_epochs=1, per_device_batch_size=4
    )
    assert _unchanged(frozen, model[0]) and not _unchanged(head, model[2])


def test_stream_without_step_limit_warns():
    """A dataset without a length and no max_num_train_steps is warned about as the run starts."""
    with pytest.warns(UserWarning, match=r"StreamDataset\) has no length.*an infinite stream trains forever.*max_num"):
        make_trainer(make_mlp()).train(StreamDataset(regression_dataset(4)), num_epochs=1, per_device_batch_size=2)


def test_no_batch_on_this_process():
    with pytest.raises(ValueError, match="The training dataloader has no batches"):
        _train(train_dataloader_kwargs={"drop_last": True}, per_device_batch_size=16)


# Datasets and DataLoaders ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("argument", ["train_dataset", "eval_dataset"])
def test_dataloader_kwargs_beside_dataloader(argument):
    """A DataLoader is used as it is: the DataLoader arguments it would ignore are refused with the fix."""
    datasets = {"train_dataset": linear_dataset(8), "eval_dataset": linear_dataset(8)}
    datasets[argument] = DataLoader(datasets[argument], batch_size=4)
    kwargs_name = argument.replace("dataset", "dataloader_kwargs")
    with pytest.raises(
        ValueError,
        match=rf"{argument} is a DataLoader, which is used as it is, so {kwargs_name}=\{{'num_workers': 2\}} would be "
        rf"ignored: build the DataLoader with these arguments, or pass {argument}=your_dataloader.dataset",
    ):
        make_trainer(make_linear()).train(**datasets, num_epochs=1, **{kwargs_name: {"num_workers": 2}})


def test_batch_size_contradicting_dataloader():
    with pytest.raises(
        ValueError,
        match=r"train_dataset is a DataLoader of batch size 4, but per_device_batch_size=16: the DataLoader's batch "
        r"size is used. Leave per_device_batch_size out, or build the DataLoader with batch_size=16.",
    ):
        make_trainer(make_linear()).train(
            DataLoader(linear_dataset(8), batch_size=4), num_epochs=1, per_device_batch_size=16
        )


def test_collate_fn_only_where_used():
    """A collate_fn no DataLoader would use is refused; one for a dataset beside a DataLoader is used."""
    collate = torch.utils.data.default_collate
    with pytest.raises(
        ValueError, match=r"collate_fn=.* would be ignored: train_dataset is a DataLoader, used as it is"
    ):
        make_trainer(make_linear()).train(DataLoader(linear_dataset(8), batch_size=4), num_epochs=1, collate_fn=collate)
    with pytest.raises(ValueError, match=r"collate_fn=.* would be ignored: dataset is a DataLoader"):
        make_trainer(make_linear()).evaluate(DataLoader(linear_dataset(8)), collate_fn=collate)
    calls = []
    trainer = make_trainer(make_linear())
    trainer.train(
        linear_dataset(8),
        num_epochs=1,
        eval_dataset=DataLoader(linear_dataset(8), batch_size=4),
        collate_fn=lambda samples: calls.append(len(samples)) or collate(samples),
    )
    assert calls and trainer.run_config.eval_per_device_batch_size == 4


def collate_without_return(samples):
    torch.utils.data.default_collate(samples)  # the return statement is missing


def test_collate_fn_returning_none():
    """A collate_fn that returns None is named at the first batch; one that is not callable at once."""
    model = make_linear()
    before = _parameters(model)
    trainer = make_trainer(model)
    with pytest.raises(
        TypeError,
        match=r"collate_fn=collate_without_return returned None for a list of 4 samples; "
        r"it must return the batch.*ends with a return statement",
    ):
        trainer.train(linear_dataset(8), num_epochs=1, per_device_batch_size=4, collate_fn=collate_without_return)
    assert _unchanged(before, model) and trainer.num_update_steps_completed == 0
    with pytest.raises(TypeError, match=r"collate_fn=3 is not callable"):
        trainer.train(linear_dataset(8), num_epochs=1, collate_fn=3)


def test_dataloader_over_empty_dataset():
    with pytest.raises(ValueError, match=r"train_dataset is empty"):
        make_trainer(make_linear()).train(DataLoader(linear_dataset(0)), num_epochs=1)


def test_unusable_dataloaders_and_iterators():
    """A DataLoader without a batch size or with a DistributedSampler, and an iterator, are refused with the fix."""
    dataset = linear_dataset(8)
    with pytest.raises(
        ValueError, match=r"train_dataset is a DataLoader without a batch size .* build it with batch_size="
    ):
        make_trainer(make_linear()).train(DataLoader(dataset, batch_size=None), num_epochs=1)
    sampler = torch.utils.data.DistributedSampler(dataset, num_replicas=2, rank=0)
    with pytest.raises(
        ValueError, match=r"eval_dataset is a DataLoader with a DistributedSampler, which Accelerate would shard"
    ):
        make_trainer(make_linear()).train(dataset, num_epochs=1, eval_dataset=DataLoader(dataset, sampler=sampler))
    with pytest.raises(
        TypeError, match=r"train_dataset is an iterator \(generator\).*override create_train_dataloader"
    ):
        make_trainer(make_linear()).train((sample for sample in dataset), num_epochs=1)


def test_tensors_instead_of_a_dataset():
    """A tuple or a dict of tensors is refused as a dataset, naming the fix (TensorDataset)."""
    model = make_mlp()
    before, trainer = _parameters(model), make_trainer(model)
    x, y = regression_dataset(8).tensors
    with pytest.raises(
        TypeError, match=r"train_dataset is a tuple of 2 tensors of 8 rows, not a dataset.*TensorDataset"
    ):
        trainer.train((x, y), num_epochs=1)
    with pytest.raises(TypeError, match=r"train_dataset is a dict of tensors \(x, y\), not a dataset"):
        trainer.train({"x": x, "y": y}, num_epochs=1)
    assert _unchanged(before, model)  # nothing trained


def test_eval_set_smaller_than_one_batch():
    """An eval DataLoader that drops its only, partial batch is refused before the first training batch."""
    model = make_mlp()
    before, trainer = _parameters(model), make_trainer(model)
    eval_loader = DataLoader(regression_dataset(3), batch_size=4, drop_last=True)
    with pytest.raises(ValueError, match=r"eval_dataset has 3 samples, fewer than one batch \(4\).*drop_last=True"):
        trainer.train(regression_dataset(8), num_epochs=2, eval_dataset=eval_loader, per_device_batch_size=2)
    assert _unchanged(before, model)  # nothing trained


def test_evaluate_refuses_empty_dataset():
    trainer = make_trainer(make_linear())
    with pytest.raises(ValueError, match="dataset is empty"):
        trainer.evaluate(TensorDataset(torch.zeros(0, 1), torch.zeros(0, 1)))


def test_eval_set_not_fitting_the_model():
    """An eval set the model cannot take fails before the first training step, naming its first batch."""
    model, recorder = make_linear(), RecordingCallback()
    before = _parameters(model)
    eval_dataset = TensorDataset(torch.randn(8, 2), torch.randn(8, 1))  # two features: the model takes one
    with pytest.raises(
        ValueError,
        match=r"eval_dataset \(TensorDataset of 8 samples\) does not fit the model: on its first batch \(tensor "
        r"shapes \[\(4, 2\), \(4, 1\)\]\), checked before training starts, calculate_eval_batch_loss raised "
        r"RuntimeError: mat1 and mat2 shapes cannot be multiplied",
    ):
        make_trainer(model, callbacks=[recorder]).train(
            linear_dataset(8), num_epochs=1, eval_dataset=eval_dataset, per_device_batch_size=4
        )
    assert recorder.events == ["on_init_end"] and _unchanged(before, model)


class NoisyDataset(Dataset):
    """Draws from torch, numpy and ``random`` on every read, like a random augmentation."""

    def __init__(self, dataset: TensorDataset):
        self.dataset = dataset

    def __len__(self):
        return len(self.dataset)

    def __getitem__(self, index):
        x, y = self.dataset[index]
        return x + 0.01 * torch.randn(x.shape) + 0.01 * float(np.random.rand()) + 0.01 * random.random(), y


class StateAtStart(TrainerCallback):
    """Records what the first-eval-batch check must leave as it was: RNG states and module modes."""

    def on_training_run_start(self, trainer, **kwargs):
        self.rng = (torch.get_rng_state(), np.random.get_state()[1].copy(), random.getstate())
        self.modes = [module.training for module in trainer.model.modules()]


class OwnEvalHookTrainer(Trainer):
    """Overrides calculate_eval_batch_loss (with the same result), which skips the first-eval-batch check."""

    def calculate_eval_batch_loss(self, batch):
        return super().calculate_eval_batch_loss(batch)


def test_eval_batch_check_changes_nothing():
    """A run with the first-eval-batch check equals one without it, bit for bit: RNG states, modes, events, weights."""

    def run(trainer_class):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.5), nn.Linear(8, 1))  # dropout: draws from torch's RNG
        model[1].eval()  # a module kept in eval mode (as ModelFreezer can) must stay so
        state, recorder = StateAtStart(), RecordingCallback()
        trainer = make_trainer(model, lr=0.01, callbacks=[state, recorder], trainer_class=trainer_class)
        eval_dataset = NoisyDataset(regression_dataset(8, seed=1))
        trainer.train(regression_dataset(16), num_epochs=2, eval_dataset=eval_dataset, per_device_batch_size=4)
        return trainer, state, recorder

    checked, checked_state, checked_events = run(Trainer)
    unchecked, unchecked_state, unchecked_events = run(OwnEvalHookTrainer)
    assert torch.equal(checked_state.rng[0], unchecked_state.rng[0])
    assert (
        np.array_equal(checked_state.rng[1], unchecked_state.rng[1]) and checked_state.rng[2] == unchecked_state.rng[2]
    )
    assert checked_state.modes == unchecked_state.modes and checked_state.modes[2] is False
    assert checked_events.events == unchecked_events.events
    assert all(torch.equal(a, b) for a, b in zip(checked.model.parameters(), unchecked.model.parameters()))
    assert all(torch.isfinite(parameter).all() for parameter in checked.model.parameters())
    for metric in ("train_loss_epoch", "eval_loss_epoch"):
        assert checked.run_history.get_metric_values(metric) == unchecked.run_history.get_metric_values(metric)


def _run_recording_forward_modes(eval_dataset, recorder, **options) -> list:
    """Train a one-epoch run (2 training batches, 1 evaluation batch) and return the mode of each forward pass."""
    model, modes = make_linear(), []
    model.register_forward_hook(lambda module, args, output: modes.append("train" if module.training else "eval"))
    trainer = make_trainer(model, callbacks=[recorder])
    trainer.train(linear_dataset(8), num_epochs=1, eval_dataset=eval_dataset, per_device_batch_size=4, **options)
    return modes


def test_first_eval_batch_check_is_on_by_default():
    """By default train() runs one extra forward pass, in eval mode, before the first training batch."""
    modes = _run_recording_forward_modes(linear_dataset(4), RecordingCallback())
    assert modes == ["eval", "train", "train", "eval"]  # the check, then the run's own passes


def test_first_eval_batch_check_switched_off_runs_no_extra_pass():
    """train(check_first_eval_batch=False) runs no extra forward pass: an eval set that does not fit the model then
    fails in the first evaluation epoch, after a training epoch."""
    modes = _run_recording_forward_modes(linear_dataset(4), RecordingCallback(), check_first_eval_batch=False)
    assert modes == ["train", "train", "eval"]
    recorder = RecordingCallback()
    mismatched = TensorDataset(torch.randn(4, 2), torch.randn(4, 1))  # two features: the model takes one
    with pytest.raises(RuntimeError, match="mat1 and mat2 shapes cannot be multiplied"):
        _run_recording_forward_modes(mismatched, recorder, check_first_eval_batch=False)
    assert "on_train_epoch_end" in recorder.events and "on_eval_epoch_end" not in recorder.events


def test_first_eval_batch_check_takes_a_bool():
    with pytest.raises(TypeError, match=r"check_first_eval_batch='no' is not valid: pass True .* or False"):
        make_trainer(make_linear()).train(linear_dataset(8), num_epochs=1, check_first_eval_batch="no")


# What the batch-loss hooks return ----------------------------------------------------------------------------------


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
            r"returned a loss of shape \(3,\); the trainer needs a scalar \(or one element\)",
        ),
        (lambda out: {k: v for k, v in out.items() if k != "loss"}, ValueError, r"missing \['loss'\]"),
        (lambda out: out["loss"], TypeError, r"calculate_train_batch_loss returned Tensor; it must return a dict"),
        (lambda out: {**out, "loss": 1.0}, TypeError, r"returned a loss of type float"),
    ],
)
def test_bad_batch_output_at_first_step(batch_output_fn, error, message):
    model = make_linear()
    trainer = _BadLossTrainer(
        batch_output_fn, model, torch.nn.MSELoss(), torch.optim.SGD(model.parameters(), lr=0.1), callbacks=()
    )
    with pytest.raises(error, match=message):
        _train(trainer)
    assert trainer.num_update_steps_completed == 0


def test_a_one_element_loss_trains_as_its_scalar():
    """A loss of shape (1,), as YOLOv7's training code returns it (``batch_size * loss``, pytorch-accelerated takes
    it), trains exactly as the same loss returned as a scalar, and callbacks see it as a scalar."""
    seen = []

    class SeeLoss(TrainerCallback):
        def on_train_step_end(self, trainer, batch_output, **kwargs):
            seen.append(batch_output["loss"].shape)

    weights = []
    for batch_output_fn in (lambda out: {**out, "loss": out["loss"].reshape(1)}, lambda out: out):
        model = make_linear()
        trainer = _BadLossTrainer(
            batch_output_fn,
            model,
            torch.nn.MSELoss(),
            torch.optim.SGD(model.parameters(), lr=0.1),
            callbacks=[SeeLoss()],
        )
        _train(trainer)
        weights.append(trainer.get_model().state_dict())
        assert trainer.num_update_steps_completed == 2
    assert all(torch.equal(weights[0][name], weights[1][name]) for name in weights[0])
    assert set(seen) == {torch.Size([])}


class DetachedLossTrainer(Trainer):
    def calculate_train_batch_loss(self, batch):
        output = super().calculate_train_batch_loss(batch)
        return {**output, "loss": output["loss"].detach()}


def test_detached_loss_names_the_hook():
    """A detached loss is refused at the first backward pass, naming the hook that returned it."""
    model = make_linear()
    before = _parameters(model)
    trainer = DetachedLossTrainer(model, nn.MSELoss(), torch.optim.SGD(model.parameters(), lr=0.1), callbacks=())
    with pytest.raises(
        ValueError,
        match=r"calculate_train_batch_loss returned a loss that does not require gradients \(requires_grad=False\), "
        r"so the backward pass cannot reach the model's 2 trainable parameters.*without \.detach\(\), \.item\(\)",
    ):
        trainer.train(linear_dataset(8), num_epochs=1, per_device_batch_size=4)
    assert _unchanged(before, model) and trainer.num_update_steps_completed == 0


def test_fully_frozen_model_is_named():
    """A model with no trainable parameter is named as the reason the loss has no gradient."""
    model = make_linear().requires_grad_(False)
    trainer = make_trainer(model)
    with pytest.raises(ValueError, match=r"the model has no trainable parameter \(each has requires_grad=False\)"):
        trainer.train(linear_dataset(8), num_epochs=1, per_device_batch_size=4)


class DictModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 1)

    def forward(self, x):
        return {"logits": self.linear(x)}


def test_dict_model_output_is_named():
    """A loss that fails on a model's dict output names the output's keys."""
    trainer = make_trainer(DictModel())
    with pytest.raises(TypeError, match=r"failed on the model's output, a dict with keys \['logits'\], not a tensor"):
        trainer.train(regression_dataset(8), num_epochs=1, per_device_batch_size=2)


# Placeholders ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["NUM_EPOCH", "num_epochs"])
def test_misspelt_placeholder_lists_choices(name):
    """A misspelt placeholder lists the placeholders and suggests the closest."""
    with pytest.raises(
        AttributeError,
        match=rf"TrainerPlaceholderValues has no placeholder '{name}' \(did you mean "
        r"TrainerPlaceholderValues.NUM_EPOCHS\?\)\. The placeholders are: NUM_EPOCHS, NUM_UPDATE_STEPS_PER_EPOCH, ",
    ):
        getattr(TrainerPlaceholderValues, name)
    assert not hasattr(TrainerPlaceholderValues, "_not_an_attribute")  # internals keep the plain error
