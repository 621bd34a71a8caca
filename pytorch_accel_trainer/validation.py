"""Checks of user input, run before any work starts; each error names the value, the problem and the fix."""

from __future__ import annotations

from collections.abc import Mapping
from numbers import Number
from typing import Any

import torch

from pytorch_accel_trainer.utils import dataset_length, is_mapping


def _validate_positive_int(name: str, value: Any, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        expected = "a positive integer or None" if allow_none else "a positive integer"
        raise ValueError(f"{name}={value!r} is not valid: it must be {expected}. Pass e.g. {name}=1.")


def _validate_positive_number(name: str, value: Any) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, Number) or not value > 0:
        raise ValueError(f"{name}={value!r} is not valid: it must be a positive number or None. Pass e.g. {name}=1.0.")


def _validate_dataset(name: str, dataset: Any) -> None:
    if dataset is None:
        raise ValueError(f"{name} is None: pass a dataset (a torch Dataset, or any object a DataLoader accepts).")
    if dataset_length(dataset) == 0:
        raise ValueError(f"{name} is empty (len({name}) == 0): pass a dataset with at least one sample.")


def _validate_dataloader_kwargs(name: str, kwargs: Any) -> None:
    if kwargs is not None and not isinstance(kwargs, Mapping):
        raise TypeError(f"{name}={kwargs!r} is not valid: it must be a dict of DataLoader arguments or None.")


def _validate_scheduler_factory(create_scheduler_fn: Any) -> None:
    if create_scheduler_fn is None:
        return
    if isinstance(create_scheduler_fn, torch.optim.lr_scheduler.LRScheduler) or hasattr(
        create_scheduler_fn, "get_last_lr"
    ):
        raise TypeError(
            f"create_scheduler_fn received a scheduler instance ({type(create_scheduler_fn).__name__}); it needs a "
            "factory that takes the optimizer, because the optimizer is only prepared when training starts. Pass "
            "e.g. functools.partial(torch.optim.lr_scheduler.StepLR, step_size=7) instead."
        )
    if not callable(create_scheduler_fn):
        raise TypeError(
            f"create_scheduler_fn={create_scheduler_fn!r} is not callable: pass a function that takes the optimizer "
            "and returns a scheduler, e.g. functools.partial(StepLR, step_size=7)."
        )


MIXED_PRECISION_CHOICES = ("no", "bf16", "fp16", "fp8")


def validate_constructor_options(mixed_precision: Any, torch_compile: Any) -> None:
    """Check the ``Trainer`` options that are not the model, loss, optimizer or callbacks."""
    if mixed_precision is not None and mixed_precision not in MIXED_PRECISION_CHOICES:
        raise ValueError(
            f"mixed_precision={mixed_precision!r} is not valid: choose one of {MIXED_PRECISION_CHOICES}, or None to "
            "take it from the Accelerate config."
        )
    if not isinstance(torch_compile, (bool, Mapping)):
        raise TypeError(
            f"torch_compile={torch_compile!r} is not valid: pass True, False, or a dict of torch.compile arguments "
            "such as {'mode': 'reduce-overhead'}."
        )


def validate_datasets(train_dataset: Any, eval_dataset: Any) -> None:
    """Check the datasets of ``Trainer.train`` before any work starts."""
    _validate_dataset("train_dataset", train_dataset)
    if eval_dataset is not None:
        _validate_dataset("eval_dataset", eval_dataset)


def validate_train_options(options: Any) -> None:
    """Check every option of ``Trainer.train`` (a ``TrainOptions``) before any work starts."""
    num_epochs, max_num_train_steps = options.num_epochs, options.max_num_train_steps
    _validate_positive_int("num_epochs", num_epochs, allow_none=True)
    _validate_positive_int("max_num_train_steps", max_num_train_steps, allow_none=True)
    if num_epochs is None and max_num_train_steps is None:
        raise ValueError(
            "num_epochs and max_num_train_steps are both None, so the run would never end: pass num_epochs, "
            "max_num_train_steps, or both (whichever comes first ends the run)."
        )
    _validate_positive_int("per_device_batch_size", options.per_device_batch_size)
    _validate_positive_int("gradient_accumulation_steps", options.gradient_accumulation_steps)
    _validate_positive_number("gradient_clip_value", options.gradient_clip_value)
    _validate_positive_number("gradient_clip_norm", options.gradient_clip_norm)
    _validate_scheduler_factory(options.create_scheduler_fn)
    _validate_dataloader_kwargs("train_dataloader_kwargs", options.train_dataloader_kwargs)
    _validate_dataloader_kwargs("eval_dataloader_kwargs", options.eval_dataloader_kwargs)


def validate_evaluate_arguments(dataset: Any, per_device_batch_size: int, dataloader_kwargs: Any) -> None:
    """Check every argument of ``Trainer.evaluate`` before any work starts."""
    if dataset is None:
        raise ValueError(
            "evaluate() received no dataset and the trainer has no eval_dataset from an earlier train(): pass "
            "evaluate(dataset=...)."
        )
    _validate_dataset("dataset", dataset)
    _validate_positive_int("per_device_batch_size", per_device_batch_size)
    _validate_dataloader_kwargs("dataloader_kwargs", dataloader_kwargs)


def validate_batch_output(batch_output: Any, hook_name: str) -> None:
    """Check what ``calculate_train_batch_loss`` / ``calculate_eval_batch_loss`` returned (no host sync)."""
    if not is_mapping(batch_output):
        raise TypeError(
            f"{hook_name} returned {type(batch_output).__name__}; it must return a dict with the keys 'loss', "
            "'model_outputs' and 'batch_size', e.g. {'loss': loss, 'model_outputs': outputs, 'batch_size': len(y)}."
        )
    missing = [key for key in ("loss", "batch_size") if key not in batch_output]
    if missing:
        raise ValueError(
            f"{hook_name} returned a dict with the keys {sorted(batch_output)}, missing {missing}; add them, e.g. "
            "{'loss': loss, 'model_outputs': outputs, 'batch_size': len(y)}."
        )
    loss = batch_output["loss"]
    if not isinstance(loss, torch.Tensor):
        raise TypeError(
            f"{hook_name} returned a loss of type {type(loss).__name__}; it must be a scalar torch.Tensor with "
            "gradients, as a loss function returns."
        )
    if loss.dim() != 0:
        raise ValueError(
            f"{hook_name} returned a loss of shape {tuple(loss.shape)}; the trainer needs a scalar. Reduce it first, "
            "e.g. loss.mean(), or use a loss function with reduction='mean'."
        )
