"""The frozen description of the current run, and the pure arithmetic that builds it."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from numbers import Number
from typing import Any, Optional


@dataclass(frozen=True)
class TrainerRunConfig:
    """An immutable record of how the current training or evaluation run is set up.

    The fields are those of pytorch-accelerated's ``TrainerRunConfig``, plus ``gradient_clip_norm`` and
    ``seed``. Step counts are optimizer updates; ``None`` means "unknown", as for a dataset without
    ``__len__``.
    """

    num_epochs: Optional[int]
    train_per_device_batch_size: Optional[int]
    train_dl_kwargs: Optional[dict]
    eval_per_device_batch_size: Optional[int]
    eval_dl_kwargs: Optional[dict]
    gradient_accumulation_steps: int
    train_total_batch_size: Optional[int]
    eval_total_batch_size: Optional[int]
    num_update_steps_per_epoch: Optional[int]
    num_local_update_steps_per_epoch: Optional[int]
    max_num_train_steps: Optional[int]
    is_local_process_zero: bool
    is_world_process_zero: bool
    is_distributed: bool
    mixed_precision: str
    num_processes: int
    gradient_clip_value: Optional[Number] = None
    gradient_clip_norm: Optional[Number] = None
    seed: Optional[int] = None

    def __getitem__(self, name: str) -> Any:
        """Allow ``run_config["num_epochs"]``, as older pytorch-accelerated code does."""
        return getattr(self, name)

    def to_dict(self) -> dict:
        """Return the fields as a plain dictionary."""
        return asdict(self)


def count_update_steps(num_batches: Optional[int], gradient_accumulation_steps: int) -> Optional[int]:
    """Return the optimizer updates in an epoch of ``num_batches`` micro-batches (a partial window counts)."""
    if num_batches is None:
        return None
    return math.ceil(num_batches / gradient_accumulation_steps)


def plan_run_length(
    num_epochs: Optional[int], max_num_train_steps: Optional[int], updates_per_epoch: Optional[int]
) -> tuple[Optional[int], Optional[int]]:
    """Return the ``(num_epochs, max_num_train_steps)`` the run will really make.

    Whichever limit comes first ends the run, so each is lowered to what the other allows when the
    number of updates per epoch is known.
    """
    if updates_per_epoch is None:
        return num_epochs, max_num_train_steps
    steps_in_epochs = None if num_epochs is None else num_epochs * updates_per_epoch
    if max_num_train_steps is None:
        return num_epochs, steps_in_epochs
    total_steps = max_num_train_steps if steps_in_epochs is None else min(max_num_train_steps, steps_in_epochs)
    return math.ceil(total_steps / max(updates_per_epoch, 1)), total_steps
