"""Checks of user input, run before any work starts; each error names the value, the problem and the fix."""

from __future__ import annotations

import contextlib
import datetime
import inspect
import math
import random
import re
import warnings
from collections.abc import Mapping
from numbers import Real
from typing import Any, Iterator, Optional

import numpy as np
import torch
from accelerate import Accelerator
from accelerate.optimizer import AcceleratedOptimizer
from accelerate.utils import send_to_device
from torch.utils.data import DataLoader, DistributedSampler, IterableDataset

from pytorch_accel_trainer.utils import dataloader_batch_size, dataset_length, is_mapping, training_modes_kept

#: ``per_device_batch_size`` when ``train()`` or ``evaluate()`` is given none.
DEFAULT_BATCH_SIZE = 8


def _validate_positive_int(name: str, value: Any, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        expected = "a positive integer or None" if allow_none else "a positive integer"
        raise ValueError(f"{name}={value!r} is not valid: it must be {expected}. Pass e.g. {name}=1.")


def _validate_positive_number(name: str, value: Any) -> None:
    if value is None:
        return
    # numbers.Real promises < and <= (not >); value != value holds for NaN only, which is not positive either
    if isinstance(value, bool) or not isinstance(value, Real) or value <= 0 or value != value:
        raise ValueError(f"{name}={value!r} is not valid: it must be a positive number or None. Pass e.g. {name}=1.0.")


def _validate_dataset(name: str, dataset: Any, dataloader_kwargs_name: str) -> None:
    if dataset is None:
        raise ValueError(f"{name} is None: pass a dataset (a torch Dataset, or any object a DataLoader accepts).")
    if isinstance(dataset, DataLoader):
        dataset = dataset.dataset  # a DataLoader is used as it is: its dataset must not be empty either
    elif isinstance(dataset, Iterator) and not isinstance(dataset, IterableDataset):
        raise TypeError(
            f"{name} is an iterator ({type(dataset).__name__}), which the trainer cannot tell from a stream of samples "
            "and which is spent after one epoch: pass a Dataset, an IterableDataset whose __iter__ restarts, or a "
            "DataLoader; for any other iterable of batches, override create_train_dataloader to return it."
        )
    if dataset_length(dataset) == 0:
        raise ValueError(f"{name} is empty (len({name}) == 0): pass a dataset with at least one sample.")
    _refuse_tensors_as_dataset(name, dataset)


def _refuse_tensors_as_dataset(name: str, dataset: Any) -> None:
    """Refuse a dict of tensors, or a tuple of tensors with one length (``(inputs, targets)``): a DataLoader would
    take each tensor, not each row, as a sample, and the run would fail inside the model."""
    if isinstance(dataset, Mapping) and dataset and all(isinstance(value, torch.Tensor) for value in dataset.values()):
        what = f"a dict of tensors ({', '.join(map(str, list(dataset)[:4]))})"
    elif (
        isinstance(dataset, tuple)
        and len(dataset) >= 2
        and all(isinstance(item, torch.Tensor) and item.dim() >= 1 for item in dataset)
        and len({len(item) for item in dataset}) == 1
        and len(dataset[0]) != len(dataset)
    ):
        what = f"a tuple of {len(dataset)} tensors of {len(dataset[0])} rows"
    else:
        return
    raise TypeError(
        f"{name} is {what}, not a dataset: a DataLoader would take each tensor as one sample. Wrap the tensors in "
        "torch.utils.data.TensorDataset(inputs, targets) (rows become samples), or return a Dataset from the "
        "data function."
    )


def warn_if_endless(train_dataset: Any, max_num_train_steps: Any) -> None:
    """Warn, as a run starts, that a training set without a length (a stream) ends an epoch only when it is
    exhausted, so an infinite one runs forever without ``max_num_train_steps``."""
    if max_num_train_steps is None and dataset_length(train_dataset) is None:
        warnings.warn(
            f"train_dataset ({type(train_dataset).__name__}) has no length, and max_num_train_steps is None: each "
            "epoch ends only when the iterable is exhausted, so an infinite stream trains forever. Pass "
            "train(..., max_num_train_steps=N) (train.max_num_train_steps in a config) to end the run after N "
            "optimizer updates.",
            stacklevel=3,
        )


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
#: Aliases accepted for the same choices (``"full"``, ``"bf16-mixed"``, ...); docs/migration.md says whose they are.
MIXED_PRECISION_ALIASES = {
    "full": "no",
    "fp32": "no",
    "32": "no",
    "float32": "no",
    "32-true": "no",
    "bfloat16": "bf16",
    "bf16-mixed": "bf16",
    "float16": "fp16",
    "half": "fp16",
    "16": "fp16",
    "16-mixed": "fp16",
}
#: Accelerator arguments the Trainer sets from its own: refused in ``accelerator_kwargs``, with the argument to use.
TRAINER_ACCELERATOR_ARGUMENTS = {
    "mixed_precision": "Trainer(mixed_precision=...)",
    "cpu": "Trainer(cpu=True)",
    "gradient_accumulation_steps": "train(gradient_accumulation_steps=...)",
}


def mixed_precision_name(mixed_precision: Any) -> Any:
    """Accelerate's name for ``mixed_precision``: ``"full"`` is ``"no"``, ``"bf16-mixed"`` is ``"bf16"``, ..."""
    if isinstance(mixed_precision, str):
        return MIXED_PRECISION_ALIASES.get(mixed_precision.lower(), mixed_precision)
    return mixed_precision


def _validate_seed(seed: Any) -> None:
    if seed is None:
        return
    if isinstance(seed, bool) or not isinstance(seed, int):  # random.seed refuses numpy integers
        raise TypeError(
            f"seed={seed!r} is a {type(seed).__name__}, not an int: pass a whole number such as seed=42 (int(value) "
            "converts a numpy integer), or seed=None to leave the random state alone."
        )
    if not 0 <= seed < 2**32:
        raise ValueError(f"seed={seed} is out of range: numpy takes seeds from 0 to 2**32 - 1; pass e.g. seed=42.")


def _validate_loss_func(loss_func: Any) -> None:
    if loss_func is None:
        return
    if isinstance(loss_func, type):
        name = loss_func.__name__
        prefix = "nn." if loss_func.__module__.startswith("torch.nn") else ""
        raise TypeError(
            f"loss_func={prefix}{name} is a class, not a loss function: pass an instance, loss_func={prefix}{name}() "
            "(the trainer calls loss_func(model_outputs, targets))."
        )


def validate_model_and_loss(model: Any, loss_func: Any) -> None:
    """Check, where Accelerate prepares them, that the model is a module and the loss function callable.

    Not in ``Trainer.__init__``: as in pytorch-accelerated, a subclass that prepares its own components (or a test)
    may hold stand-ins until then.
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model is a {type(model).__name__}; pass a torch.nn.Module.")
    if loss_func is not None and not callable(loss_func):
        raise TypeError(
            f"loss_func={loss_func!r} is not callable: pass a function called as loss_func(model_outputs, targets), "
            "e.g. nn.MSELoss(), or None to use the loss the model returns."
        )


def validate_constructor_options(
    mixed_precision: Any, torch_compile: Any, seed: Any = None, loss_func: Any = None, accelerator_kwargs: Any = None
) -> None:
    """Check the ``Trainer`` options that are not the model, optimizer or callbacks."""
    _validate_seed(seed)
    _validate_loss_func(loss_func)
    if mixed_precision is not None and mixed_precision_name(mixed_precision) not in MIXED_PRECISION_CHOICES:
        raise ValueError(
            f"mixed_precision={mixed_precision!r} is not valid: choose one of {MIXED_PRECISION_CHOICES} (or a name "
            f"of another trainer for them: {sorted(MIXED_PRECISION_ALIASES)}), or None to take it from the "
            "Accelerate config."
        )
    _validate_accelerator_kwargs(accelerator_kwargs)
    if not isinstance(torch_compile, (bool, Mapping)):
        raise TypeError(
            f"torch_compile={torch_compile!r} is not valid: pass True, False, or a dict of torch.compile arguments "
            "such as {'mode': 'reduce-overhead'}."
        )


def _validate_accelerator_kwargs(accelerator_kwargs: Any) -> None:
    if accelerator_kwargs is None:
        return
    if not isinstance(accelerator_kwargs, Mapping):
        raise TypeError(
            f"accelerator_kwargs={accelerator_kwargs!r} is not valid: pass a dict of Accelerator arguments or None."
        )
    for name in accelerator_kwargs:
        if name in TRAINER_ACCELERATOR_ARGUMENTS:
            raise ValueError(
                f"accelerator_kwargs sets {name!r}, which the trainer sets itself: "
                f"use {TRAINER_ACCELERATOR_ARGUMENTS[name]}."
            )
    accepted = set(inspect.signature(Accelerator).parameters)
    unknown = sorted(set(accelerator_kwargs) - accepted)
    if unknown:
        raise ValueError(
            f"accelerator_kwargs has {unknown}, which accelerate.Accelerator does not take; it takes "
            f"{sorted(accepted - set(TRAINER_ACCELERATOR_ARGUMENTS))}."
        )


def validate_datasets(train_dataset: Any, eval_dataset: Any) -> None:
    """Check the datasets of ``Trainer.train`` before any work starts."""
    _validate_dataset("train_dataset", train_dataset, "train_dataloader_kwargs")
    if eval_dataset is not None:
        _validate_dataset("eval_dataset", eval_dataset, "eval_dataloader_kwargs")


def validate_given_dataloaders(
    data: tuple, names: tuple, per_device_batch_size: int, dataloader_kwargs: tuple, collate_fn: Any
) -> None:
    """Refuse the arguments a DataLoader passed where a dataset is expected would silently ignore.

    Args:
        data: the ``(train, eval)`` data given (``eval`` may be ``None``).
        names: their argument names, then the names of their dataloader arguments.
        dataloader_kwargs: the dataloader arguments given for each.
    """
    is_dataloader = [isinstance(item, DataLoader) for item in data]
    for item, name, kwargs_name, kwargs, given in zip(data, names[:2], names[2:], dataloader_kwargs, is_dataloader):
        if given and dataloader_batch_size(item) is None:
            raise ValueError(
                f"{name} is a DataLoader without a batch size (batch_size=None, or a batch sampler without one), which "
                "yields single samples: build it with batch_size=..., or pass its dataset and per_device_batch_size."
            )
        if given and isinstance(item.sampler, DistributedSampler):
            raise ValueError(
                f"{name} is a DataLoader with a DistributedSampler, which Accelerate would shard a second time "
                "(each process would see 1/N of its share): build it with shuffle=True or a plain sampler; "
                "the trainer shards it."
            )
        if given and kwargs is not None:
            raise ValueError(
                f"{name} is a DataLoader, which is used as it is, so {kwargs_name}={kwargs!r} would be ignored: "
                f"build the DataLoader with these arguments, or pass {name}=your_dataloader.dataset "
                "for the trainer to build one."
            )
    if collate_fn is not None and all(given or item is None for item, given in zip(data, is_dataloader)):
        raise ValueError(
            f"collate_fn={collate_fn!r} would be ignored: {' and '.join(n for n, g in zip(names, is_dataloader) if g)} "
            "is a DataLoader, used as it is. Build the DataLoader with collate_fn=..., or pass its dataset."
        )
    batch_size = dataloader_batch_size(data[0]) if is_dataloader[0] else None
    if is_dataloader[0] and per_device_batch_size not in (DEFAULT_BATCH_SIZE, batch_size):
        raise ValueError(
            f"{names[0]} is a DataLoader of batch size {batch_size}, "
            f"but per_device_batch_size={per_device_batch_size}: the DataLoader's batch size is used. "
            f"Leave per_device_batch_size out, or build the DataLoader with batch_size={per_device_batch_size}."
        )


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
    if options.scheduler_interval not in ("step", "epoch"):
        raise ValueError(
            f"scheduler_interval={options.scheduler_interval!r} is not valid: pass 'step' to step the scheduler after "
            "each optimizer update (the default), or 'epoch' to step it once at the end of each epoch."
        )
    if options.stream_split not in ("main_process", "dataset"):
        raise ValueError(
            f"stream_split={options.stream_split!r} is not valid: pass 'main_process' to have the main process read a "
            "training stream and send each process its batches (the default), or 'dataset' for a stream that splits "
            "itself between the processes, each reading its own part."
        )
    _validate_dataloader_kwargs("train_dataloader_kwargs", options.train_dataloader_kwargs)
    _validate_dataloader_kwargs("eval_dataloader_kwargs", options.eval_dataloader_kwargs)
    max_time_seconds(options.max_time)
    if options.max_time_save_dir is not None and options.max_time is None:
        raise ValueError(
            f"max_time_save_dir={str(options.max_time_save_dir)!r} is where a run stopped by its time budget saves, "
            "but max_time is None: pass max_time too (e.g. max_time='00:11:50:00'), or leave max_time_save_dir out."
        )
    if options.collate_fn is not None and not callable(options.collate_fn):
        raise TypeError(
            f"collate_fn={options.collate_fn!r} is not callable: pass a function that turns a list of samples into "
            "a batch, or None for torch's default_collate."
        )


def validate_evaluate_arguments(dataset: Any, per_device_batch_size: int, dataloader_kwargs: Any) -> None:
    """Check every argument of ``Trainer.evaluate`` before any work starts."""
    if dataset is None:
        raise ValueError(
            "evaluate() received no dataset and the trainer has no eval_dataset from an earlier train(): pass "
            "evaluate(dataset=...)."
        )
    _validate_dataset("dataset", dataset, "dataloader_kwargs")
    _validate_positive_int("per_device_batch_size", per_device_batch_size)
    _validate_dataloader_kwargs("dataloader_kwargs", dataloader_kwargs)


def validate_not_in_training_run(in_training_run: bool, method: str) -> None:
    """Refuse ``predict()`` or ``lr_find()`` called from inside a training run (a callback or a hook): each prepares
    the model again, which the run's prepared model and dataloaders cannot survive."""
    if in_training_run:
        raise RuntimeError(
            f"{method}() was called inside a training run (from a callback or a hook): it prepares the model anew, "
            f"which would break the run. Call {method}() before train() or after it returns; to measure during a "
            "run, use run_extra_eval_epoch()."
        )


def validate_predict_arguments(
    dataset: Any, per_device_batch_size: int, dataloader_kwargs: Any, chunk_size: Optional[int]
) -> None:
    """Check the arguments of ``Trainer.predict`` before any work starts."""
    _validate_dataset("dataset", dataset, "dataloader_kwargs")
    _validate_positive_int("per_device_batch_size", per_device_batch_size)
    _validate_dataloader_kwargs("dataloader_kwargs", dataloader_kwargs)
    _validate_positive_int("chunk_size", chunk_size, allow_none=True)


def validate_lr_find_arguments(start_lr: Any, end_lr: Any, num_steps: Any, smoothing: Any, diverge_factor: Any) -> None:
    """Check the arguments of ``Trainer.lr_find`` before any work starts."""
    for name, lr in (("start_lr", start_lr), ("end_lr", end_lr)):
        if isinstance(lr, bool) or not isinstance(lr, Real) or not 0 < float(lr) < math.inf:  # NaN fails both
            raise ValueError(
                f"{name}={lr!r} is not valid: lr_find() needs a finite, positive learning rate at each end of its "
                "sweep, e.g. start_lr=1e-7, end_lr=10."
            )
    if end_lr <= start_lr:
        raise ValueError(
            f"lr_find(start_lr={start_lr!r}, end_lr={end_lr!r}) sweeps nothing: end_lr must be larger than start_lr, "
            "e.g. start_lr=1e-7, end_lr=10."
        )
    _validate_positive_int("num_steps", num_steps)
    if num_steps < 3:  # the suggestion compares slopes, leaving the last point out: 3 points at least
        raise ValueError(f"num_steps={num_steps!r} is too few for a suggestion: pass at least 3 (100 by default).")
    if isinstance(smoothing, bool) or not isinstance(smoothing, (int, float)) or not 0 <= smoothing < 1:
        raise ValueError(f"smoothing={smoothing!r} is not valid: it must be in [0, 1) (0.98 by default; 0: none).")
    if diverge_factor is not None:
        _validate_positive_number("diverge_factor", diverge_factor)
        if diverge_factor <= 1:
            raise ValueError(
                f"diverge_factor={diverge_factor!r} would stop at once: it must be above 1 (4 by default), or None."
            )


def validate_batch_output(batch_output: Any, hook_name: str) -> None:
    """Check what ``calculate_train_batch_loss`` / ``calculate_eval_batch_loss`` returned (no host sync)."""
    if not is_mapping(batch_output):
        raise TypeError(
            f"{hook_name} returned {type(batch_output).__name__}; it must return a dict with the keys 'loss', "
            "'model_outputs' and 'batch_size', e.g. {'loss': loss, 'model_outputs': outputs, 'batch_size': len(y)}."
        )
    if "loss" not in batch_output:
        raise ValueError(
            f"{hook_name} returned a dict with the keys {sorted(batch_output)}, missing ['loss']; add it, e.g. "
            "{'loss': loss, 'model_outputs': outputs, 'batch_size': len(y)}."
        )
    if "batch_size" not in batch_output:  # the trainer found none in the batch either (loop/batches.py)
        raise ValueError(
            f"{hook_name} returned a dict with the keys {sorted(batch_output)}, without 'batch_size', and the batch "
            "holds no tensor to count its samples from (the trainer counts the targets of an (inputs, targets) tuple, "
            "a dict's 'labels' or a batch's first tensor). Return it: {'loss': loss, 'batch_size': len(y)}."
        )
    loss = batch_output["loss"]
    if not isinstance(loss, torch.Tensor):
        raise TypeError(
            f"{hook_name} returned a loss of type {type(loss).__name__}; it must be a scalar torch.Tensor with "
            "gradients, as a loss function returns."
        )
    if loss.numel() != 1:  # one element in any shape, as pytorch-accelerated takes it: (1,) is used as a scalar
        raise ValueError(
            f"{hook_name} returned a loss of shape {tuple(loss.shape)}; the trainer needs a scalar (or one element). "
            "Reduce it first, e.g. loss.mean(), or use a loss function with reduction='mean'."
        )


def validate_optimizer_parameters(optimizer: Any, model: torch.nn.Module) -> None:
    """Refuse an optimizer that lacks trainable parameters of ``model``: they would never be updated.

    A parameter with ``requires_grad=False`` need not be held (``GradualUnfreezingCallback`` adds the ones it
    unfreezes), and the optimizer may hold more than the model's (a second model a subclass updates with it; a
    second model with its own optimizer is registered with ``add_model``). An optimizer prepared by an earlier run is
    not checked again: DeepSpeed holds flattened copies of the parameters. Compares parameter identities on the host:
    no device work.
    """
    if isinstance(optimizer, AcceleratedOptimizer) or not hasattr(optimizer, "param_groups"):
        return  # prepared by an earlier run, when it was checked; or not a torch optimizer
    held = {id(parameter) for group in optimizer.param_groups for parameter in group["params"]}
    trainable = [(name, parameter) for name, parameter in model.named_parameters() if parameter.requires_grad]
    missing = [name for name, parameter in trainable if id(parameter) not in held]
    if not missing:
        return
    optimizer_name = type(optimizer).__name__
    if len(missing) == len(trainable):
        raise ValueError(
            f"optimizer={optimizer_name} holds 0 of the model's {len(trainable)} trainable parameters, so training "
            "would never change the model (the loss would stay flat). Build the optimizer from model.parameters() of "
            f"the model you pass to Trainer, e.g. {optimizer_name}(model.parameters(), ...), not from another model "
            "or a copy of it."
        )
    names = ", ".join(missing[:3]) + (", ..." if len(missing) > 3 else "")
    raise ValueError(
        f"optimizer={optimizer_name} holds {len(trainable) - len(missing)} of the model's {len(trainable)} trainable "
        f"parameters: {len(missing)} would get gradients but never be updated ({names}). Build the optimizer from "
        "model.parameters(), or freeze the parameters you do not want to train (parameter.requires_grad_(False), or "
        "pytorch_accel_trainer.finetuning.ModelFreezer) so that they need no gradient either."
    )


def validate_model_on_device(model: torch.nn.Module, device: torch.device, argument: str) -> None:
    """Refuse a module whose parameters are not on the run's ``device``: its forward pass over the run's batches
    would fail with torch's device-mismatch error, which names neither the module nor the fix."""

    def elsewhere(found: torch.device) -> bool:
        if found.type != device.type:
            return True
        return found.index is not None and device.index is not None and found.index != device.index

    wrong = sorted({str(parameter.device) for parameter in model.parameters() if elsewhere(parameter.device)})
    if wrong:
        raise ValueError(
            f"{argument} has parameters on {', '.join(wrong)}, but this run's batches are on {device}: move the "
            "module to the trainer's device first (module.to(trainer.device))."
        )


def validate_loss_requires_grad(loss: torch.Tensor, model: torch.nn.Module) -> None:
    """Refuse, before its backward pass, a training loss cut off from the model's graph (one attribute read: no
    host-device sync)."""
    if loss.requires_grad:
        return
    num_trainable = sum(1 for parameter in model.parameters() if parameter.requires_grad)
    if num_trainable == 0:
        raise ValueError(
            "calculate_train_batch_loss returned a loss that does not require gradients, and the model has no "
            "trainable parameter (each has requires_grad=False), so there is nothing to train: unfreeze some before "
            "train() (parameter.requires_grad_(True), or ModelFreezer.unfreeze())."
        )
    raise ValueError(
        "calculate_train_batch_loss returned a loss that does not require gradients (requires_grad=False), so the "
        f"backward pass cannot reach the model's {num_trainable} trainable parameters. It was cut off from the model "
        "outputs: compute the loss from them without .detach(), .item(), torch.tensor(...) or torch.no_grad(), and "
        "return that tensor."
    )


def validate_first_eval_batch(trainer: Any) -> None:
    """Run the default ``calculate_eval_batch_loss`` on the first samples of the eval dataset before training
    starts, so that an eval set that does not fit the model fails now, not after a whole training epoch. It changes
    nothing the run depends on: the batch is built from the dataset and the dataloader's ``collate_fn`` without
    iterating the dataloader (no sampler, iterator or worker is touched), the model runs in eval mode under
    ``no_grad`` (each module's mode is put back), no event fires, and the RNG states of torch, numpy and ``random``
    are put back. Skipped for a stream (an iterable dataset may not be readable twice), for a dataloader that is not a
    torch ``DataLoader``, and when a subclass overrides ``calculate_eval_batch_loss``, which may keep state (metrics)
    that one extra batch would change.
    """
    dataloader = getattr(trainer.eval_dataloader, "base_dataloader", trainer.eval_dataloader)
    _validate_eval_batches_exist(dataloader)
    if not isinstance(dataloader, DataLoader) or overrides(trainer, "calculate_eval_batch_loss"):
        return  # a dataloader of your own, or a hook of your own: its first evaluation step is the check
    dataset, length = dataloader.dataset, dataset_length(dataloader.dataset)
    if isinstance(dataset, IterableDataset) or not length:
        return  # a stream may not be readable twice
    with _leaving_no_trace(trainer.model, trainer.device):
        batch = send_to_device(_first_batch(dataloader, dataset, length), trainer.device)
        try:
            with torch.no_grad():
                trainer.calculate_eval_batch_loss(batch)
        except torch.OutOfMemoryError:
            raise  # not a mismatch: the evaluation epoch would need the same memory
        except Exception as error:
            raise ValueError(
                f"eval_dataset ({type(dataset).__name__} of {length} samples) does not fit the model: on its first "
                f"batch (tensor shapes {_describe_batch(batch)}), checked before training starts, "
                f"calculate_eval_batch_loss raised {type(error).__name__}: {error}. Pass an eval_dataset whose samples "
                "have the form and shapes of train_dataset's (or fix the model or loss_func for them)."
            ) from error


def _validate_eval_batches_exist(dataloader: Any) -> None:
    """Refuse an evaluation DataLoader that yields no batch (fewer samples than a batch, with ``drop_last``): the
    evaluation after the first training epoch would fail, as if its data were empty."""
    if not isinstance(dataloader, DataLoader) or isinstance(dataloader.dataset, IterableDataset):
        return
    length = dataset_length(dataloader.dataset)
    try:
        has_batches = len(dataloader) > 0
    except TypeError:  # a sampler without a length
        return
    if has_batches or not length:
        return  # an empty dataset is refused with its own message
    sampler = dataloader.batch_sampler  # Accelerate wraps the batch sampler that has the batch size
    while sampler is not None and getattr(sampler, "batch_size", None) is None:
        sampler = getattr(sampler, "batch_sampler", None)
    batch_size = getattr(sampler, "batch_size", "?")
    raise ValueError(
        f"eval_dataset has {length} samples, fewer than one batch ({batch_size}), and its DataLoader drops the last "
        "partial batch (drop_last=True), so evaluation would yield no batch. Pass "
        "eval_dataloader_kwargs={'drop_last': False} (the default), or a per_device_batch_size of at most "
        f"{length}."
    )


@contextlib.contextmanager
def _leaving_no_trace(model: torch.nn.Module, device: torch.device) -> Iterator[None]:
    """Run the block with ``model`` in eval mode, then put back each module's mode and the RNG states of torch (the
    host's, and a CUDA device's), numpy and ``random``."""
    host_states = random.getstate(), np.random.get_state()
    on_cuda = device.type == "cuda"
    cuda_devices = [device.index if device.index is not None else torch.cuda.current_device()] if on_cuda else []
    try:
        with training_modes_kept(model), torch.random.fork_rng(devices=cuda_devices, device_type="cuda"):
            model.eval()
            yield
    finally:
        random.setstate(host_states[0])
        np.random.set_state(host_states[1])


def overrides(trainer: Any, name: str) -> bool:
    """Whether ``name`` is overridden: set on the instance, or defined by more than one class of its MRO."""
    return name in vars(trainer) or sum(name in vars(cls) for cls in type(trainer).__mro__) > 1


def _first_batch(dataloader: DataLoader, dataset: Any, length: int) -> Any:
    """The dataloader's first batch, were its sampler sequential: the first samples, collated by its collate_fn."""
    if dataloader.batch_sampler is None:  # automatic batching off: each sample is a batch
        return dataloader.collate_fn(dataset[0])
    batch_size = getattr(dataloader.batch_sampler, "batch_size", None) or dataloader.batch_size or 1
    indices = list(range(min(batch_size, length)))
    get_items = getattr(dataset, "__getitems__", None)
    return dataloader.collate_fn(get_items(indices) if get_items else [dataset[index] for index in indices])


def _describe_batch(batch: Any) -> str:
    """The shapes of a batch's tensors, in the batch's structure, for an error message."""
    if isinstance(batch, torch.Tensor):
        return str(tuple(batch.shape))
    if is_mapping(batch):
        return "{" + ", ".join(f"{key!r}: {_describe_batch(value)}" for key, value in batch.items()) + "}"
    if isinstance(batch, (tuple, list)):
        return "[" + ", ".join(_describe_batch(value) for value in batch) + "]"
    return type(batch).__name__


def warn_if_schedule_is_in_epochs(scheduler: Any, run_config: Any, scheduler_interval: str) -> None:
    """Warn when a scheduler stepped per update looks written in epochs: ``CosineAnnealingLR(T_max=num_epochs)``
    would then end its cosine after ``num_epochs`` updates and climb back up for the rest of the run."""
    if scheduler_interval != "step" or not isinstance(scheduler, torch.optim.lr_scheduler.CosineAnnealingLR):
        return
    num_epochs, steps = run_config.num_epochs, run_config.max_num_train_steps
    if scheduler.T_max == num_epochs and steps is not None and steps > num_epochs:
        warnings.warn(
            f"CosineAnnealingLR(T_max={scheduler.T_max}) equals num_epochs, but the scheduler steps after each of the "
            f"run's {steps} optimizer updates, so its cosine ends after {scheduler.T_max} updates. Pass "
            "scheduler_interval='epoch' to train() to step it once per epoch, or give T_max in updates "
            "(TrainerPlaceholderValues.NUM_UPDATE_STEPS_PER_EPOCH * num_epochs).",
            stacklevel=3,
        )


#: ``train(max_time=...)`` as text: ``"DD:HH:MM:SS"``, or ``"HH:MM:SS"`` without the days.
_MAX_TIME_FIELDS = ("days", "hours", "minutes", "seconds")
#: The longest time budget taken: ``datetime.timedelta``'s (999999999 days); a longer one is a typo.
_MAX_TIME_LIMIT = datetime.timedelta.max


def max_time_seconds(max_time: Any) -> Optional[float]:
    """The time budget ``train(max_time=...)`` in seconds (``None``: no budget), from seconds, ``"DD:HH:MM:SS"`` or
    ``"HH:MM:SS"``, a ``datetime.timedelta`` or a dict of its arguments (``{"hours": 12}``). The command line and
    config files give it as the same text (see ``docs/config.md``).

    Raises:
        ValueError, TypeError: naming the value and the forms taken; ``ValueError`` also for a budget longer than
            999999999 days (``datetime.timedelta.max``).
    """
    if max_time is None:
        return None
    forms = (
        "pass seconds (max_time=3600), 'DD:HH:MM:SS' or 'HH:MM:SS' (max_time='00:11:50:00' or '11:50:00' for "
        "11 h 50 min), a datetime.timedelta, or a dict of its arguments (max_time={'hours': 11, 'minutes': 50})"
    )
    seconds: Any = None
    too_long = False
    try:
        if isinstance(max_time, str):
            parts = [part.strip() for part in max_time.strip().split(":")]
            if len(parts) in (3, 4) and all(re.fullmatch("[0-9]+", part) for part in parts):
                fields = dict(zip(_MAX_TIME_FIELDS[-len(parts) :], map(int, parts)))
                seconds = datetime.timedelta(**fields).total_seconds()
        elif isinstance(max_time, datetime.timedelta):
            seconds = max_time.total_seconds()
        elif isinstance(max_time, dict):
            try:
                seconds = datetime.timedelta(**max_time).total_seconds()
            except (TypeError, ValueError):  # an unknown name, a value that is not a number, NaN
                seconds = None
        elif isinstance(max_time, (int, float)) and not isinstance(max_time, bool):
            seconds = float(max_time)
        else:
            raise TypeError(f"max_time={max_time!r} is a {type(max_time).__name__}: {forms}.")
    except OverflowError:  # past timedelta's range
        too_long = True
    if too_long or (seconds is not None and math.isfinite(seconds) and seconds > _MAX_TIME_LIMIT.total_seconds()):
        raise ValueError(
            f"max_time={max_time!r} is longer than the longest time budget taken, {_MAX_TIME_LIMIT.days} days "
            "(datetime.timedelta.max): pass the job's real limit (e.g. max_time='00:11:50:00'), or max_time=None for "
            "no budget."
        )
    if seconds is None or not math.isfinite(seconds) or seconds <= 0:
        raise ValueError(f"max_time={max_time!r} is not a time budget longer than 0 s: {forms}.")
    return seconds
