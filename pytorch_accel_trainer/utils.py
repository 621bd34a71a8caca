"""Leaf helpers with no knowledge of the trainer."""

from __future__ import annotations

import random
from collections.abc import Mapping
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


class DeferredSum:
    """A weighted sum of scalar tensors kept on their device, added up in batches.

    :meth:`add` only keeps a reference: the device work (one stack and one sum for up to ``fold_every``
    values) happens in :meth:`fold`, so a training step pays no device op for it, and nothing is ever read
    back to the host here. Values of one weight are summed together, then multiplied by it, so that no list
    of weights is ever copied to the device.
    """

    def __init__(self, fold_every: int = 256):
        self.fold_every = fold_every
        self.reset()

    def reset(self) -> None:
        self._total: Optional[torch.Tensor] = None
        self._pending: list = []
        self._pending_weight: Any = None
        self.weight_total: Any = 0

    def add(self, value: torch.Tensor, weight: Any = 1) -> None:
        """Add ``value * weight`` (``weight`` a number or a scalar tensor)."""
        if self._pending and (isinstance(weight, torch.Tensor) or weight != self._pending_weight):
            self.fold()
        self._pending.append(value.detach())
        self._pending_weight = weight
        self.weight_total = self.weight_total + weight
        if isinstance(weight, torch.Tensor) or len(self._pending) >= self.fold_every:
            self.fold()

    def fold(self) -> None:
        """Add the pending values into the total, on the device."""
        if not self._pending:
            return
        folded = torch.stack(self._pending).float().sum() * self._pending_weight
        self._total = folded if self._total is None else self._total + folded
        self._pending = []

    @property
    def total(self) -> Optional[torch.Tensor]:
        """The sum so far, as a device tensor (``None`` before the first value)."""
        self.fold()
        return self._total

    def state_dict(self) -> dict:
        """The exact state, pending values included, so that a restored sum adds up in the same order."""
        return {
            "total": self._total,
            "pending": torch.stack(self._pending) if self._pending else None,
            "pending_weight": self._pending_weight,
            "weight_total": self.weight_total,
        }

    def load_state_dict(self, state: dict) -> None:
        self._total, self._pending_weight, self.weight_total = state["total"], state["pending_weight"], state["weight_total"]
        self._pending = [] if state["pending"] is None else list(state["pending"].unbind())


def is_mapping(value: Any) -> bool:
    """``isinstance(value, Mapping)``, with the common cases first: the abstract-class check costs about 1 us, on
    every step."""
    if isinstance(value, dict):
        return True
    return not isinstance(value, (tuple, list, torch.Tensor)) and isinstance(value, Mapping)


def batch_size_of(batch: Any) -> int:
    """The number of samples in a batch of the default hooks: ``len(batch[1])``, or for a dict the first
    dimension of ``labels`` (else of its first tensor)."""
    if is_mapping(batch):
        tensor = batch.get("labels")
        if not isinstance(tensor, torch.Tensor):
            tensor = next((value for value in batch.values() if isinstance(value, torch.Tensor)), None)
        if tensor is None:
            raise TypeError(
                f"The batch is a dict with the keys {sorted(batch)} but no tensor, so its size is unknown; override "
                "calculate_train_batch_loss / calculate_eval_batch_loss to return 'batch_size' yourself."
            )
        return tensor.size(0)
    targets = batch[1]
    return targets.size(0) if isinstance(targets, torch.Tensor) else len(targets)


def model_output_loss(model_outputs: Any) -> torch.Tensor:
    """The ``loss`` a model returned with its output (a transformers ``ModelOutput``, a dict or an object)."""
    loss = model_outputs.get("loss") if isinstance(model_outputs, Mapping) else getattr(model_outputs, "loss", None)
    if loss is None:
        raise ValueError(
            f"loss_func is None and the model output (a {type(model_outputs).__name__}) has no 'loss'. Pass "
            "Trainer(loss_func=...), or return a loss from the model (transformers models do when the batch has "
            "'labels')."
        )
    return loss


def require_batches(batches: Iterable, error_message: str) -> Iterator:
    """Yield from ``batches``; raise ``ValueError(error_message)`` if there is none."""
    empty = True
    try:
        for item in batches:
            empty = False
            yield item
    except ValueError as error:  # Accelerate's dispatcher (iterable datasets) says it in its own words
        if not empty or "does not contain any data" not in str(error):
            raise
    if empty:
        raise ValueError(error_message)
