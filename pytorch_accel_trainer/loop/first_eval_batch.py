"""The check of the first evaluation batch, a step of ``train()`` before the first training batch
(``train(check_first_eval_batch=True)``, the default): one forward pass of the eval dataset's first samples, so that an
eval set that does not fit the model fails now, not after a whole training epoch."""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from accelerate.utils import send_to_device
from torch.utils.data import DataLoader, IterableDataset

from pytorch_accel_trainer.data import dataset_length
from pytorch_accel_trainer.loop.batches import is_mapping
from pytorch_accel_trainer.loop.training_modes import training_modes_kept


def check_first_eval_batch(trainer: Any) -> None:
    """Run the default ``calculate_eval_batch_loss`` on the first samples of the eval dataset before training
    starts, so that an eval set that does not fit the model fails now, not after a whole training epoch. It changes
    nothing the run depends on: the batch is built from the dataset and the dataloader's ``collate_fn`` without
    iterating the dataloader (no sampler, iterator or worker is touched), the model runs in eval mode under
    ``no_grad`` (each module's mode is put back), no event fires, and the RNG states of torch, numpy and ``random``
    are put back. Skipped for a stream (an iterable dataset may not be readable twice), for a dataloader that is not a
    torch ``DataLoader``; the Trainer does not call it when a subclass overrides ``calculate_eval_batch_loss``, which
    may keep state (metrics) that one extra batch would change, nor with ``train(check_first_eval_batch=False)``.

    Raises:
        ValueError: ``calculate_eval_batch_loss`` raised on the first batch; the message names the dataset, the
            batch's tensor shapes and the error.
    """
    dataloader = getattr(trainer.eval_dataloader, "base_dataloader", trainer.eval_dataloader)
    if not isinstance(dataloader, DataLoader):
        return  # a dataloader of your own: its first evaluation step is the check
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
