"""Cosine annealing of the learning rate, with optional linear warmup and a cooldown at the minimum.

Ported from pytorch-accelerated 0.1.61 (``pytorch_accelerated/schedulers/cosine_scheduler.py``, Apache-2.0,
Copyright 2022 Chris Hughes, adapted from timm's ``cosine_lr.py``), with its warmup and cosine phases fixed;
see ``docs/schedulers.md``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import partial
from typing import Any

import torch

from pytorch_accel_trainer.placeholders import IntOrPlaceholder, TrainerPlaceholderValues
from pytorch_accel_trainer.schedulers.scheduler_base import (
    SchedulerArgumentError,
    StatefulSchedulerBase,
    create_stepped_once,
    validate_number,
)

#: The settings in :meth:`CosineLrScheduler.state_dict`, each an attribute of the same name.
_SETTING_KEYS = (
    "total_iterations",
    "lr_min_ratio",
    "lr_min",
    "warmup_iterations",
    "warmup_lr_init",
    "warmup_lr_ratio",
    "k_decay",
    "num_cooldown_iterations",
)
_STATE_KEYS = (*_SETTING_KEYS, "num_updates", "base_lr_values")


def _validate_cosine_arguments(allow_placeholder: bool, **arguments) -> None:
    """Check each argument of :class:`CosineLrScheduler` on its own (placeholders pass when allowed)."""
    for name in ("total_num_epochs", "num_update_steps_per_epoch"):
        validate_number(name, arguments[name], minimum=1, whole=True, allow_placeholder=allow_placeholder)
    validate_number("k_decay", arguments["k_decay"], above_minimum=True)
    validate_number("lr_min", arguments["lr_min"])
    validate_number("min_lr_ratio", arguments["min_lr_ratio"], maximum=1, allow_none=True)
    validate_number("num_warmup_epochs", arguments["num_warmup_epochs"])
    validate_number("warmup_starting_lr", arguments["warmup_starting_lr"])
    validate_number("warmup_starting_lr_ratio", arguments["warmup_starting_lr_ratio"], maximum=1, allow_none=True)
    validate_number("num_cooldown_epochs", arguments["num_cooldown_epochs"])


class CosineLrScheduler(StatefulSchedulerBase):
    """Cosine annealing of the learning rate (`SGDR <https://arxiv.org/abs/1608.03983>`_ without restarts).

    Over ``T = total_num_epochs * num_update_steps_per_epoch`` updates, with ``W`` warmup and ``C`` cooldown
    updates, the learning rate of each parameter group, whose base (maximum) value ``lr_max`` is its
    learning rate when the scheduler is created, is, after ``n`` updates:

    - ``n < W``: linear warmup from the starting lr to ``lr_max``;
    - ``W <= n < T - C``: ``lr_min + (lr_max - lr_min) * (1 + cos(pi * t**k / S**k)) / 2`` with ``t = n - W``,
      ``S = T - W - C`` and ``k = k_decay`` (`k-decay <https://arxiv.org/abs/2004.05909>`_: a larger ``k``
      holds a high learning rate longer);
    - ``n >= T - C``: ``lr_min``, also after the end of the schedule.

    Example::

        trainer.train(train_dataset, num_epochs=10, per_device_batch_size=32,
                      create_scheduler_fn=CosineLrScheduler.create_scheduler_fn(num_warmup_epochs=1))
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        total_num_epochs: int,
        num_update_steps_per_epoch: int,
        k_decay: float = 1.0,
        lr_min: float = 1e-6,
        min_lr_ratio: float | None = None,
        num_warmup_epochs: float = 0,
        warmup_starting_lr: float = 1e-6,
        warmup_starting_lr_ratio: float | None = None,
        num_cooldown_epochs: float = 0,
    ):
        """Create a cosine scheduler of ``optimizer``'s learning rates; it applies the value for 0 updates.

        Args:
            optimizer: a PyTorch optimizer with one or more parameter groups.
            total_num_epochs: the number of epochs of the schedule, warmup and cooldown included.
            num_update_steps_per_epoch: the optimizer updates in an epoch.
            k_decay: the k of k-decay; greater than 0, 1 is plain cosine annealing.
            lr_min: the learning rate that every group decays to and holds during the cooldown.
            min_lr_ratio: the minimum as a fraction of each group's base learning rate; wins over ``lr_min``.
            num_warmup_epochs: the epochs of linear warmup (a fraction of an epoch is allowed).
            warmup_starting_lr: the learning rate of every group at the start of the warmup.
            warmup_starting_lr_ratio: the starting learning rate as a fraction of each group's base learning
                rate; wins over ``warmup_starting_lr``.
            num_cooldown_epochs: the epochs held at the minimum at the end.

        Raises:
            SchedulerArgumentError: an argument is out of range, or the warmup and cooldown are longer than
                the schedule.
        """
        _validate_cosine_arguments(
            allow_placeholder=False,
            total_num_epochs=total_num_epochs,
            num_update_steps_per_epoch=num_update_steps_per_epoch,
            k_decay=k_decay,
            lr_min=lr_min,
            min_lr_ratio=min_lr_ratio,
            num_warmup_epochs=num_warmup_epochs,
            warmup_starting_lr=warmup_starting_lr,
            warmup_starting_lr_ratio=warmup_starting_lr_ratio,
            num_cooldown_epochs=num_cooldown_epochs,
        )
        if num_warmup_epochs + num_cooldown_epochs > total_num_epochs:
            raise SchedulerArgumentError(
                f"num_warmup_epochs={num_warmup_epochs} and num_cooldown_epochs={num_cooldown_epochs} are longer than "
                f"total_num_epochs={total_num_epochs}, which includes them; shorten the warmup or the cooldown."
            )
        super().__init__(optimizer)
        self.total_iterations = total_num_epochs * num_update_steps_per_epoch
        self.lr_min_ratio = min_lr_ratio
        self.lr_min = lr_min
        self.warmup_iterations = num_warmup_epochs * num_update_steps_per_epoch
        self.warmup_lr_init = warmup_starting_lr
        self.warmup_lr_ratio = warmup_starting_lr_ratio
        self.k_decay = k_decay
        self.num_cooldown_iterations = num_cooldown_epochs * num_update_steps_per_epoch
        self.step_update(0)  # the first update uses the value for 0 updates, whether or not step() runs first

    def get_updated_values(self, num_updates: int) -> list:
        """Return each parameter group's learning rate after ``num_updates`` updates (see the class)."""
        if num_updates < self.warmup_iterations:
            starts = [self._warmup_start(lr_max) for lr_max in self.base_lr_values]
            return [
                start + num_updates * ((lr_max - start) / self.warmup_iterations)
                for start, lr_max in zip(starts, self.base_lr_values)
            ]
        if num_updates < self.total_iterations - self.num_cooldown_iterations:
            cosine_updates = num_updates - self.warmup_iterations
            total_cosine_iterations = self.total_iterations - self.warmup_iterations - self.num_cooldown_iterations
            angle = math.pi * cosine_updates**self.k_decay / total_cosine_iterations**self.k_decay
            return [
                self._minimum(lr_max) + 0.5 * (lr_max - self._minimum(lr_max)) * (1 + math.cos(angle))
                for lr_max in self.base_lr_values
            ]
        return [self._minimum(lr_max) for lr_max in self.base_lr_values]

    def _warmup_start(self, lr_max: float) -> float:
        return self.warmup_lr_ratio * lr_max if self.warmup_lr_ratio is not None else self.warmup_lr_init

    def _minimum(self, lr_max: float) -> float:
        return self.lr_min_ratio * lr_max if self.lr_min_ratio is not None else self.lr_min

    @classmethod
    def create_scheduler_fn(
        cls,
        total_num_epochs: IntOrPlaceholder = TrainerPlaceholderValues.NUM_EPOCHS,
        num_update_steps_per_epoch: IntOrPlaceholder = TrainerPlaceholderValues.NUM_UPDATE_STEPS_PER_EPOCH,
        k_decay: float = 1.0,
        lr_min: float = 1e-6,
        min_lr_ratio: float | None = None,
        num_warmup_epochs: float = 0,
        warmup_starting_lr: float = 1e-6,
        warmup_starting_lr_ratio: float | None = None,
        num_cooldown_epochs: float = 0,
    ) -> Callable:
        """Return a factory ``fn(optimizer) -> CosineLrScheduler`` for ``Trainer.train(create_scheduler_fn=...)``.

        The number of epochs and of updates per epoch default to placeholders that the trainer replaces with
        the run's values. The scheduler is stepped once when created, so that update ``k`` of the run uses the
        learning rate for ``k - 1`` updates (see :func:`create_stepped_once`). The arguments are those of
        :meth:`__init__`; those that are not placeholders are checked here.

        Example::

            trainer.train(train_dataset, num_epochs=10, per_device_batch_size=32,
                          create_scheduler_fn=CosineLrScheduler.create_scheduler_fn(num_warmup_epochs=1))
        """
        arguments: dict[str, Any] = {
            "total_num_epochs": total_num_epochs,
            "num_update_steps_per_epoch": num_update_steps_per_epoch,
            "k_decay": k_decay,
            "lr_min": lr_min,
            "min_lr_ratio": min_lr_ratio,
            "num_warmup_epochs": num_warmup_epochs,
            "warmup_starting_lr": warmup_starting_lr,
            "warmup_starting_lr_ratio": warmup_starting_lr_ratio,
            "num_cooldown_epochs": num_cooldown_epochs,
        }
        _validate_cosine_arguments(allow_placeholder=True, **arguments)
        return partial(create_stepped_once, cls, **arguments)

    def state_dict(self) -> dict:
        """Return the schedule's settings, base learning rates and update count (plain Python values)."""
        state = {key: getattr(self, key) for key in _SETTING_KEYS}
        return {**state, "num_updates": self._num_updates, "base_lr_values": list(self.base_lr_values)}

    def load_state_dict(self, state_dict: dict) -> None:
        """Restore a state returned by :meth:`state_dict` and apply its learning rate to the optimizer.

        A key left out (``base_lr_values`` in pytorch-accelerated's states) keeps its current value.

        Raises:
            ValueError: the dictionary has keys that a cosine scheduler's state does not.
        """
        unknown = sorted(set(state_dict) - set(_STATE_KEYS))
        if unknown:
            raise ValueError(
                f"Not a CosineLrScheduler state: unexpected keys {unknown} (its keys are {list(_STATE_KEYS)}); "
                "load the state of the same kind of scheduler."
            )
        for key in _SETTING_KEYS:
            setattr(self, key, state_dict.get(key, getattr(self, key)))
        self._num_updates = state_dict.get("num_updates", self._num_updates)
        self.base_lr_values = list(state_dict.get("base_lr_values", self.base_lr_values))
        # the optimizer's state holds the same value; set it here too, for a scheduler loaded without it
        self.step_update(max(self._num_updates, 0))
