"""Leaf helpers with no knowledge of the trainer."""

from __future__ import annotations

import random
from typing import Any, Iterable, Iterator, Optional

import numpy as np
import torch


def dataloader_length(dataloader: Any) -> Optional[int]:
    """Return ``len(dataloader)``, or ``None`` when it has no length (an iterable or streaming dataset)."""
    if dataloader is None:
        return None
    try:
        return len(dataloader)
    except TypeError:
        return None


def dataset_length(dataset: Any) -> Optional[int]:
    """Return ``len(dataset)``, or ``None`` when the dataset has no ``__len__``."""
    return dataloader_length(dataset)


def with_last_flag(iterable: Iterable) -> Iterator[tuple[Any, bool]]:
    """Yield ``(item, is_last)`` pairs, looking one item ahead.

    This tells the training loop which batch ends the epoch even for a dataset without ``__len__``, so a
    partial accumulation window can still synchronise and step on its last micro-batch.
    """
    iterator = iter(iterable)
    try:
        current = next(iterator)
    except StopIteration:
        return
    for following in iterator:
        yield current, False
        current = following
    yield current, True


def seed_worker(worker_id: int) -> None:
    """Seed numpy and ``random`` in a dataloader worker from the seed torch gave that worker.

    Torch seeds itself per worker, but not numpy, so without this every worker would draw the same
    numpy augmentations.
    """
    worker_seed = torch.initial_seed() % 2**32
    np.random.seed(worker_seed)
    random.seed(worker_seed)


def remove_padding(gathered: torch.Tensor, padding_value: Any) -> torch.Tensor:
    """Drop the rows of ``gathered`` made only of ``padding_value`` (added by padding across processes)."""
    is_padding = gathered == padding_value
    if gathered.dim() > 1:
        is_padding = is_padding.flatten(1).all(dim=1)
    return gathered[~is_padding]
