"""The data the trainer is given (datasets and DataLoaders): their lengths and batch sizes, and the checks that refuse,
before any work starts, data it could not train or evaluate on."""

from __future__ import annotations

import warnings
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch.utils.data import DataLoader, DistributedSampler, IterableDataset

#: ``per_device_batch_size`` when ``train()`` or ``evaluate()`` is given none.
DEFAULT_BATCH_SIZE = 8


def dataloader_length(dataloader: Any) -> int | None:
    """Return ``len(dataloader)``, or ``None`` when it has no length (an iterable or streaming dataset)."""
    if dataloader is None:
        return None
    try:
        return len(dataloader)
    except TypeError:
        return None


def dataloader_batch_size(dataloader: Any) -> int | None:
    """The batch size of a DataLoader, also when a batch sampler sets it; ``None`` when unknown."""
    return (
        dataloader.batch_size
        if dataloader.batch_size is not None
        else getattr(dataloader.batch_sampler, "batch_size", None)
    )


def dataset_length(dataset: Any) -> int | None:
    """Return ``len(dataset)``, or ``None`` when the dataset has no ``__len__``."""
    return dataloader_length(dataset)


def validate_datasets(train_dataset: Any, eval_dataset: Any) -> None:
    """Check the datasets of ``Trainer.train`` before any work starts."""
    validate_dataset("train_dataset", train_dataset)
    if eval_dataset is not None:
        validate_dataset("eval_dataset", eval_dataset)


def validate_dataset(name: str, dataset: Any) -> None:
    """Refuse a dataset the trainer cannot use: ``None``, an iterator spent after one epoch, an empty one, or tensors
    a DataLoader would take as samples."""
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


def validate_dataloader_kwargs(name: str, kwargs: Any) -> None:
    if kwargs is not None and not isinstance(kwargs, Mapping):
        raise TypeError(f"{name}={kwargs!r} is not valid: it must be a dict of DataLoader arguments or None.")


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


def validate_eval_batches_exist(dataloader: Any) -> None:
    """Refuse an evaluation DataLoader that yields no batch (fewer samples than a batch, with ``drop_last``): the
    evaluation after the first training epoch would fail, as if its data were empty. ``dataloader`` may be prepared by
    Accelerate (its ``base_dataloader`` is checked) or ``None``."""
    dataloader = getattr(dataloader, "base_dataloader", dataloader)
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
