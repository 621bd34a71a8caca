"""Base classes of parameter schedulers stepped once per optimizer update, and their argument checks.

Ported from pytorch-accelerated 0.1.61 (``pytorch_accelerated/schedulers/scheduler_base.py``, Apache-2.0,
Copyright 2022 Chris Hughes, itself adapted from timm's ``scheduler.py``); see ``docs/schedulers.md`` for what
changed.
"""

from __future__ import annotations

import numbers
import warnings
from abc import ABC, abstractmethod
from collections.abc import Iterable
from typing import Any

import torch

from pytorch_accel_trainer.placeholders import PlaceholderExpression, TrainerPlaceholderValues


class SchedulerArgumentError(ValueError, AssertionError):
    """A scheduler argument out of its range, or of the wrong kind.

    A :class:`ValueError`; also an :class:`AssertionError`, because pytorch-accelerated checked these
    arguments with ``assert``, so code that caught ``AssertionError`` keeps working.
    """


def is_placeholder(value: Any) -> bool:
    """Whether ``value`` is a :class:`TrainerPlaceholderValues` member or an expression built from one."""
    return isinstance(value, (TrainerPlaceholderValues, PlaceholderExpression))


def validate_number(
    name: str,
    value: Any,
    minimum: float = 0,
    maximum: float | None = None,
    whole: bool = False,
    above_minimum: bool = False,
    allow_none: bool = False,
    allow_placeholder: bool = False,
) -> None:
    """Refuse ``value`` for the argument ``name`` unless it is a number in ``[minimum, maximum]``.

    Args:
        whole: the value must be a whole number (``True`` is not one).
        above_minimum: the value must be greater than ``minimum``, not equal to it.
        allow_none: ``None`` is accepted.
        allow_placeholder: a placeholder is accepted (it is checked once the trainer has resolved it).

    Raises:
        SchedulerArgumentError: the message names the argument, the value received and the fix.
    """
    if (value is None and allow_none) or (allow_placeholder and is_placeholder(value)):
        return
    if is_placeholder(value):
        raise SchedulerArgumentError(
            f"{name} is the placeholder {value!r}, which only a create_scheduler_fn(...) factory passed to "
            f"Trainer.train resolves; pass the number itself when creating a scheduler directly."
        )
    kind = "whole number" if whole else "number"
    is_number = isinstance(value, numbers.Integral if whole else numbers.Real) and not isinstance(value, bool)
    in_range = is_number and (value > minimum if above_minimum else value >= minimum)
    if not (in_range and (maximum is None or value <= maximum)):
        lowest = f"> {minimum}" if above_minimum else f">= {minimum}"
        bounds = lowest if maximum is None else f"{lowest} and <= {maximum}"
        none = " or None" if allow_none else ""
        raise SchedulerArgumentError(f"{name} is {value!r}; pass a {kind} {bounds}{none}.")


class SchedulerBase(ABC):
    """A scheduler of any field of an optimizer's parameter groups, given the number of updates made so far.

    The field is usually ``"lr"``. Unlike PyTorch's schedulers, which are stepped at different points of the
    loop, these are meant to be called after each optimizer update. This class keeps no count: pass the
    number of updates made to :meth:`step_update`::

        num_updates = 0
        for batch in train_dataloader:
            loss_func(model(batch[0]), batch[1]).backward()
            optimizer.step()
            optimizer.zero_grad()
            num_updates += 1
            scheduler.step_update(num_updates)  # the value for the next update

    Use it with the :class:`~pytorch_accel_trainer.trainer.Trainer` by overriding ``Trainer.scheduler_step``;
    :class:`StatefulSchedulerBase` keeps the count itself and needs nothing of the kind.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, param_group_field: str = "lr"):
        """Create a scheduler of ``param_group_field`` in each of ``optimizer``'s parameter groups.

        The field's current value in each group is stored once as ``initial_<field>`` (an existing
        ``initial_<field>`` is kept, as PyTorch's schedulers do) and is the group's base value.

        Args:
            optimizer: a PyTorch optimizer.
            param_group_field: the parameter-group field to schedule.

        Raises:
            KeyError: a parameter group has no ``param_group_field``.
        """
        self.optimizer = optimizer
        self.param_group_field = param_group_field
        self._initial_param_group_field = f"initial_{param_group_field}"
        self._store_initial_lrs()
        self.base_lr_values = [group[self._initial_param_group_field] for group in self.optimizer.param_groups]
        self._update_param_groups(self.base_lr_values)

    def _store_initial_lrs(self) -> None:
        """Store each group's current value as ``initial_<field>``, unless the group has one already."""
        for index, group in enumerate(self.optimizer.param_groups):
            if self.param_group_field not in group:
                raise KeyError(
                    f"{self.param_group_field!r} missing from param_groups[{index}] (its keys are "
                    f"{sorted(group)}); pass param_group_field= one of them."
                )
            group.setdefault(self._initial_param_group_field, group[self.param_group_field])

    @abstractmethod
    def get_updated_values(self, num_updates: int) -> None | numbers.Number | Iterable[numbers.Number]:
        """Return the value of the scheduled field after ``num_updates`` optimizer updates.

        Return one value for every group, a list with one value per group, or ``None`` to leave the groups
        unchanged.
        """

    def step_update(self, num_updates: int) -> None:
        """Set the scheduled field of every parameter group to its value after ``num_updates`` updates."""
        values = self.get_updated_values(num_updates)
        if values is not None:
            self._update_param_groups(values)

    def _update_param_groups(self, values) -> None:
        if not isinstance(values, (list, tuple)):
            values = [values] * len(self.optimizer.param_groups)
        for param_group, value in zip(self.optimizer.param_groups, values):
            param_group[self.param_group_field] = value

    def state_dict(self) -> dict:
        """Return every attribute but the optimizer (saved on its own)."""
        return {key: value for key, value in self.__dict__.items() if key != "optimizer"}

    def load_state_dict(self, state_dict: dict) -> None:
        """Set the attributes from a dictionary returned by :meth:`state_dict`."""
        self.__dict__.update(state_dict)


class StatefulSchedulerBase(SchedulerBase, ABC):
    """A scheduler that counts its own steps: call :meth:`step` once per optimizer update.

    The count starts at -1, and the ``k``-th call of :meth:`step` applies ``get_updated_values(k - 1)``, as in
    pytorch-accelerated. In a loop that steps *after* each update, step once right after creating the
    scheduler, as PyTorch's schedulers do in their constructor, so that update ``k`` uses the value for
    ``k - 1`` previous updates; the ``create_scheduler_fn`` factories of this package do that for you::

        scheduler = CosineLrScheduler(optimizer, total_num_epochs=10, num_update_steps_per_epoch=100)
        scheduler.step()  # applies the value for 0 previous updates, used by the first update
        for batch in train_dataloader:
            loss_func(model(batch[0]), batch[1]).backward()
            optimizer.step()
            optimizer.zero_grad()
            scheduler.step()  # the value for the next update

    Subclasses define :meth:`get_updated_values`; the default :meth:`state_dict` holds every attribute, the count
    (``self._num_updates``) included, so that a resumed run continues the schedule.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, param_group_field: str = "lr"):
        super().__init__(optimizer=optimizer, param_group_field=param_group_field)
        self._num_updates = -1

    def step(self) -> None:
        """Advance the count by one and apply the scheduled value for it."""
        self._num_updates += 1
        self.step_update(self._num_updates)

    def state_dict(self) -> dict:
        """Return the scheduler's state, the update count included: every attribute but the optimizer.

        Concrete here (abstract in pytorch-accelerated), so that the schedulers its documentation defines with
        ``get_updated_values`` alone can be created; override it for a state that needs more care.
        """
        return super().state_dict()

    def load_state_dict(self, scheduler_state_dict: dict) -> None:
        """Restore a state returned by :meth:`state_dict`."""
        super().load_state_dict(scheduler_state_dict)


def create_stepped_once(scheduler_class: type, optimizer: torch.optim.Optimizer, **kwargs) -> StatefulSchedulerBase:
    """Create ``scheduler_class(optimizer, **kwargs)`` and step it once, for a loop that steps after each update.

    The scheduler then holds the value for 0 updates, which the first update uses, and the trainer's step
    after update ``k`` applies the value for ``k`` updates: update ``k`` uses the value for ``k - 1``.
    Without this step, the first two updates would both use the value for 0 and every later one would come
    one update late (pytorch-accelerated's behaviour).
    """
    scheduler = scheduler_class(optimizer, **kwargs)
    scheduler.step()
    return scheduler


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
