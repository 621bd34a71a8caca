"""Issue 14, part 2: mistakes that used to train nothing or fail late each get one clear error before the first step.

Each error names the value received, the problem and the fix; each test runs a tiny real model.
"""

from __future__ import annotations

import random
import re

import numpy as np
import pytest
import torch
from conftest import RecordingCallback, linear_dataset, make_linear, make_trainer, regression_dataset
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

from pytorch_accel_trainer import Trainer, TrainerPlaceholderValues
from pytorch_accel_trainer.callbacks import PrintProgressCallback, TrainerCallback


def _parameters(model: nn.Module) -> list:
    return [parameter.detach().clone() for parameter in model.parameters()]


def _unchanged(before: list, model: nn.Module) -> bool:
    return all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def _make_mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))


# 1. An optimizer that does not hold the model's trainable parameters ------------------------------------------------


def test_an_optimizer_over_another_model_is_refused_before_any_step():
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


def test_an_optimizer_missing_some_trainable_parameters_is_refused_with_their_names():
    model = _make_mlp()
    trainer = Trainer(model, nn.MSELoss(), torch.optim.SGD(model[2].parameters(), lr=0.1), callbacks=())
    with pytest.raises(
        ValueError,
        match=r"optimizer=SGD holds 2 of the model's 4 trainable parameters: 2 would get gradients but never be "
        r"updated \(0.weight, 0.bias\).*or freeze the parameters you do not want to train",
    ):
        trainer.train(regression_dataset(8), num_epochs=1, per_device_batch_size=4)


def test_frozen_parameters_may_be_left_out_and_extra_parameters_may_be_held():
    model, extra = _make_mlp(), nn.Linear(3, 3)  # extra: a second model's parameters, as a GAN subclass holds
    model[0].requires_grad_(False)
    frozen, head = _parameters(model[0]), _parameters(model[2])
    optimizer = torch.optim.SGD([*model[2].parameters(), *extra.parameters()], lr=0.1)
    Trainer(model, nn.MSELoss(), optimizer, callbacks=()).train(
        regression_dataset(8), num_epochs=1, per_device_batch_size=4
    )
    assert _unchanged(frozen, model[0]) and not _unchanged(head, model[2])


# 2. A callback that would never be called --------------------------------------------------------------------------


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
def test_a_function_or_an_object_without_events_is_refused_as_a_callback(callback, message):
    with pytest.raises(TypeError, match=message):
        make_trainer(make_linear(), callbacks=[PrintProgressCallback, callback])


def test_an_object_whose_only_on_method_is_no_event_is_not_a_callback():
    # on_something would be a custom event of a TrainerCallback (issue 23); an object with no trainer event at all
    # is refused as no callback
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
def test_a_single_callback_where_a_list_is_expected_is_refused(callbacks, message):
    with pytest.raises(TypeError, match=message):
        make_trainer(make_linear(), callbacks=callbacks)


# 3. A DataLoader where a dataset is expected: used as it is, and the arguments it would ignore refused ---------------


@pytest.mark.parametrize("argument", ["train_dataset", "eval_dataset"])
def test_dataloader_arguments_beside_a_dataloader_are_refused_with_the_fix(argument):
    datasets = {"train_dataset": linear_dataset(8), "eval_dataset": linear_dataset(8)}
    datasets[argument] = DataLoader(datasets[argument], batch_size=4)
    kwargs_name = argument.replace("dataset", "dataloader_kwargs")
    with pytest.raises(
        ValueError,
        match=rf"{argument} is a DataLoader, which is used as it is, so {kwargs_name}=\{{'num_workers': 2\}} would be "
        rf"ignored: build the DataLoader with these arguments, or pass {argument}=your_dataloader.dataset",
    ):
        make_trainer(make_linear()).train(**datasets, num_epochs=1, **{kwargs_name: {"num_workers": 2}})


def test_a_batch_size_that_contradicts_the_dataloader_is_refused_with_the_fix():
    with pytest.raises(
        ValueError,
        match=r"train_dataset is a DataLoader of batch size 4, but per_device_batch_size=16: the DataLoader's batch "
        r"size is used. Leave per_device_batch_size out, or build the DataLoader with batch_size=16.",
    ):
        make_trainer(make_linear()).train(
            DataLoader(linear_dataset(8), batch_size=4), num_epochs=1, per_device_batch_size=16
        )


def test_a_collate_fn_no_dataloader_would_use_is_refused_but_one_for_a_dataset_beside_a_dataloader_is_used():
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


def test_a_dataloader_over_an_empty_dataset_is_refused():
    with pytest.raises(ValueError, match=r"train_dataset is empty"):
        make_trainer(make_linear()).train(DataLoader(linear_dataset(0)), num_epochs=1)


# 4. save_training_state before any train() -------------------------------------------------------------------------


def test_save_training_state_before_any_train_says_to_train_first_or_save_weights(tmp_path):
    trainer = make_trainer(make_linear())
    with pytest.raises(
        RuntimeError,
        match=r"this trainer has not run train\(\) yet. Call it during or after train\(\); to save the weights alone, "
        r"use save_checkpoint\(save_path\) or save_weights\(save_path\)",
    ):
        trainer.save_training_state(tmp_path / "states")
    assert not (tmp_path / "states").exists()


# 5. A loss class, and a loss cut off from the model ----------------------------------------------------------------


def test_a_loss_class_instead_of_an_instance_is_refused_at_construction():
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


class DetachedLossTrainer(Trainer):
    def calculate_train_batch_loss(self, batch):
        output = super().calculate_train_batch_loss(batch)
        return {**output, "loss": output["loss"].detach()}


def test_a_detached_loss_is_refused_at_the_first_backward_with_the_hook_named():
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


def test_a_fully_frozen_model_is_named_as_the_reason_the_loss_has_no_gradient():
    model = make_linear().requires_grad_(False)
    trainer = make_trainer(model)
    with pytest.raises(ValueError, match=r"the model has no trainable parameter \(each has requires_grad=False\)"):
        trainer.train(linear_dataset(8), num_epochs=1, per_device_batch_size=4)


# 6. An eval set that does not fit the model ------------------------------------------------------------------------


def test_an_eval_set_that_does_not_fit_the_model_fails_before_the_first_training_step():
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


def test_the_first_eval_batch_check_changes_nothing_a_run_with_it_equals_one_without_bit_for_bit():
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


# 7. A collate_fn that returns None ---------------------------------------------------------------------------------


def collate_without_return(samples):
    torch.utils.data.default_collate(samples)  # the return statement is missing


def test_a_collate_fn_returning_none_is_named_at_the_first_batch():
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


# 8. A seed that is not an int --------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", ["42", 4.2, True, np.int64(42)])
def test_a_seed_that_is_not_an_int_is_refused_at_construction(seed):
    with pytest.raises(
        TypeError, match=re.escape(f"seed={seed!r} is a {type(seed).__name__}, not an int: pass a whole")
    ):
        make_trainer(make_linear(), seed=seed)


def test_a_seed_out_of_numpys_range_is_refused():
    with pytest.raises(ValueError, match=r"seed=-1 is out of range: numpy takes seeds from 0 to 2\*\*32 - 1"):
        make_trainer(make_linear(), seed=-1)


# 9. A misspelt placeholder -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["NUM_EPOCH", "num_epochs"])
def test_a_misspelt_placeholder_lists_the_placeholders_and_suggests_the_closest(name):
    with pytest.raises(
        AttributeError,
        match=rf"TrainerPlaceholderValues has no placeholder '{name}' \(did you mean "
        r"TrainerPlaceholderValues.NUM_EPOCHS\?\)\. The placeholders are: NUM_EPOCHS, NUM_UPDATE_STEPS_PER_EPOCH, ",
    ):
        getattr(TrainerPlaceholderValues, name)
    assert not hasattr(TrainerPlaceholderValues, "_not_an_attribute")  # internals keep the plain error


def test_create_accelerator_accepts_cpu_true_from_code():
    """``create_accelerator(cpu=True)`` used to raise TypeError (``cpu`` passed twice to Accelerator)."""
    from pytorch_accel_trainer.parallel.distributed import create_accelerator

    accelerator = create_accelerator(cpu=True)
    assert accelerator.device.type == "cpu"


def test_cpu_true_after_the_process_was_set_up_on_a_gpu_names_the_device_not_the_precision(monkeypatch):
    """On a GPU machine, a Trainer(cpu=True) after one on the GPU: Accelerate refuses the CPU (it fixes the device once
    per process), and the error used to speak of the mixed precision. The GPU is faked by this process's recorded
    device; Accelerate's own check refuses it."""
    from accelerate.state import PartialState

    from pytorch_accel_trainer.parallel.distributed import create_accelerator

    make_trainer(make_linear())  # the process is set up (on the CPU here)
    monkeypatch.setitem(PartialState._shared_state, "device", torch.device("meta"))  # as if on a GPU
    with pytest.raises(ValueError) as raised:
        create_accelerator(cpu=True)
    assert str(raised.value) == (
        "Trainer(cpu=True) asks for the CPU, but Accelerate already set this process up on meta, and cannot change the "
        "device once set. Make the first Trainer (or Accelerator) of the process the one with cpu=True, or run the "
        "whole script on the CPU (`accelerate launch --cpu script.py`, or ACCELERATE_USE_CPU=1)."
    )


def test_a_dataloader_without_batch_size_or_with_a_distributed_sampler_and_an_iterator_are_refused_with_the_fix():
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
