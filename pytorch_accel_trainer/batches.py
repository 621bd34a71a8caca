"""Batches: the DataLoader arguments the trainer builds, and what a batch's loss counts for in an epoch's mean."""

from __future__ import annotations

from typing import Any, Optional

import torch
from accelerate.utils import find_batch_size
from torch.utils.data import IterableDataset

from pytorch_accel_trainer.utils import is_mapping, model_output_loss, seed_worker


def merge_dataloader_kwargs(defaults: dict, overrides: Optional[dict], dataset: Any) -> dict:
    """The DataLoader arguments: ``defaults`` updated with the user's ``overrides``, which win."""
    kwargs = dict(defaults)
    overrides = dict(overrides or {})
    if "sampler" in overrides or "batch_sampler" in overrides or isinstance(dataset, IterableDataset):
        kwargs.pop("shuffle", None)  # a sampler, or a stream, decides the order itself
    if "batch_sampler" in overrides:
        kwargs.pop("batch_size", None)
    kwargs.update(overrides)
    if kwargs.get("num_workers", 0) > 0:
        kwargs.setdefault("persistent_workers", True)  # workers start once, not every epoch
        kwargs.setdefault("worker_init_fn", seed_worker)
    # Data loading draws its seeds from a generator of its own, never from the global RNG, so the
    # model's randomness (dropout) does not depend on when dataloader iterators are created: with
    # persistent workers, or after a resume.
    kwargs.setdefault("generator", torch.Generator())
    return kwargs


def batches_need_placing(dataloader: Any, device: torch.device) -> bool:
    """Whether Accelerate should move each batch of ``dataloader`` to the device (``send_to_device``).

    On the CPU, batches of a map-style dataset are already where they go, and the per-batch call costs about
    5 us. Iterable datasets keep it: without it Accelerate would shard them differently (no dispatching).
    """
    return device.type != "cpu" or isinstance(getattr(dataloader, "dataset", None), IterableDataset)


def real_rows_in_batch(dataloader: Any, batch: Any, accelerator: Any) -> Optional[int]:
    """Rows of this process's batch that are real samples, or ``None`` when all are.

    To give every process the same steps, Accelerate fills the last batch of each process with samples from
    the start of the data; the real ones are the first ``remainder`` rows of all processes' batches in
    process order (what ``gather_for_metrics`` keeps). Reading it costs no collective.
    """
    if accelerator.num_processes == 1 or not getattr(dataloader, "end_of_dataloader", False):
        return None
    remainder = getattr(dataloader, "remainder", -1)
    if remainder <= 0:
        return None  # a whole number of global batches, or a dataloader that does not say
    rows = find_batch_size(batch)
    real_rows = min(max(remainder - accelerator.process_index * rows, 0), rows)
    return None if real_rows == rows else real_rows


def loss_weight(batch_output: dict, real_rows: Optional[int]) -> Any:
    """What a batch's loss counts for in the epoch's mean: its items if given, else its samples, of which at
    most the real ones in a last evaluation batch with repeated samples."""
    if "num_items_in_batch" in batch_output:
        return batch_output["num_items_in_batch"]
    if real_rows is not None:  # a hook that returned the whole batch's size
        return min(batch_output["batch_size"], real_rows)
    return batch_output["batch_size"]


def forward_batch(model: Any, batch: Any) -> Any:
    """The model's output for a batch of the default hooks: ``(inputs, targets, ...)`` or a dict of keyword arguments."""
    if is_mapping(batch):
        return model(**batch)
    return model(batch[0])


def batch_loss(loss_func: Any, model_outputs: Any, batch: Any) -> torch.Tensor:
    """``loss_func(outputs, targets)``, or without a ``loss_func`` the loss the model returned."""
    if loss_func is not None:
        return loss_func(model_outputs, batch["labels"] if is_mapping(batch) else batch[1])
    return model_output_loss(model_outputs)
