"""The Warmup-Stable-Decay (WSD) learning-rate schedule, with a decay before each of its checkpoints.

Ported from pytorch-accelerated 0.1.61 (``pytorch_accelerated/schedulers/wsd_scheduler.py``, Apache-2.0,
Copyright 2022 Chris Hughes), with its checkpoint spacing, saved state and continuation fixed; see
``docs/schedulers.md``.
"""

from __future__ import annotations

import math
import warnings
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

#: The settings that shape the schedule, each an attribute of the same name; a continuation keeps the saved ones.
_SHAPE_KEYS = (
    "num_warmup_steps",
    "decay_phase_ratio",
    "lr_min",
    "warmup_starting_lr",
    "use_inverse_sqrt_decay",
    "num_checkpoints",
    "base_lr_values",
    "param_group_field",
)
#: The keys of :meth:`WSDLrScheduler.state_dict` (``checkpoint_steps`` and ``checkpoint_decay_info`` are
#: recomputed from the settings when loaded).
_STATE_KEYS = (
    *_SHAPE_KEYS,
    "total_steps",
    "is_continuation_from_checkpoint",
    "previous_checkpoint_step",
    "checkpoint_steps",
    "checkpoint_decay_info",
    "num_updates",
)


def estimate_checkpoint_steps(total_steps: int, num_checkpoints: int = 3) -> list[int]:
    """Return ``num_checkpoints`` update counts, each twice the one before, the last ``total_steps``.

    The spacing is geometric, as the WSD paper's 50B -> 100B -> 200B tokens: ``[total_steps // 2**(n - 1 - i)]``,
    e.g. ``[50_000, 100_000]`` for 2 checkpoints of 100K steps and ``[25_000, 50_000, 100_000, 200_000]``
    for 4 of 200K.

    Raises:
        SchedulerArgumentError: an argument is not a positive whole number, or ``total_steps`` is too short to
            hold ``num_checkpoints`` distinct checkpoints.
    """
    validate_number("total_steps", total_steps, minimum=1, whole=True)
    validate_number("num_checkpoints", num_checkpoints, minimum=1, whole=True)
    if total_steps < 2 ** (num_checkpoints - 1):
        raise SchedulerArgumentError(
            f"num_checkpoints={num_checkpoints} needs at least {2 ** (num_checkpoints - 1)} steps (each checkpoint "
            f"doubles the one before), but total_steps is {total_steps}; use fewer checkpoints or more steps."
        )
    return [total_steps // 2 ** (num_checkpoints - 1 - index) for index in range(num_checkpoints)]


def _validate_wsd_arguments(allow_placeholder: bool, **arguments) -> None:
    """Check each argument of :class:`WSDLrScheduler` on its own (placeholders pass when allowed)."""
    for name in ("num_epochs", "num_update_steps_per_epoch", "total_steps", "num_warmup_steps", "num_warmup_epochs"):
        if name in arguments:
            minimum = 0 if name.startswith("num_warmup") else 1
            validate_number(
                name, arguments[name], minimum, whole=True, allow_none=True, allow_placeholder=allow_placeholder
            )
    validate_number("decay_phase_ratio", arguments["decay_phase_ratio"], maximum=1)
    validate_number("lr_min", arguments["lr_min"], maximum=1)
    validate_number("warmup_starting_lr", arguments["warmup_starting_lr"])
    validate_number("num_checkpoints", arguments["num_checkpoints"], minimum=1, whole=True)
    for name in ("use_inverse_sqrt_decay", "is_continuation_from_checkpoint"):
        if not isinstance(arguments[name], bool):
            raise SchedulerArgumentError(f"{name} is {arguments[name]!r}; pass True or False.")
    if not arguments["use_inverse_sqrt_decay"] and arguments["lr_min"] == 0:
        raise SchedulerArgumentError(
            "lr_min is 0 with use_inverse_sqrt_decay=False: the inverse-proportional decay divides by lr_min; "
            "pass a positive lr_min (e.g. 1e-6), or use_inverse_sqrt_decay=True."
        )


def _resolve_total_steps(
    num_epochs: int | None, num_update_steps_per_epoch: int | None, total_steps: int | None
) -> int:
    """Return the length of the schedule, given as ``total_steps`` or as epochs times updates per epoch."""
    per_epoch_given = num_epochs is not None or num_update_steps_per_epoch is not None
    if total_steps is not None and per_epoch_given:
        raise SchedulerArgumentError(
            f"total_steps={total_steps} was given with num_epochs={num_epochs} and num_update_steps_per_epoch="
            f"{num_update_steps_per_epoch}; pass either total_steps, or num_epochs and num_update_steps_per_epoch."
        )
    if total_steps is not None:
        return total_steps
    if num_epochs is None or num_update_steps_per_epoch is None:
        raise SchedulerArgumentError(
            f"The schedule's length is unknown (num_epochs={num_epochs}, num_update_steps_per_epoch="
            f"{num_update_steps_per_epoch}); pass total_steps, or both num_epochs and num_update_steps_per_epoch."
        )
    return num_epochs * num_update_steps_per_epoch


class WSDLrScheduler(StatefulSchedulerBase):
    """Warmup-Stable-Decay learning rates (`WSD-S <https://arxiv.org/abs/2410.05192>`_): warm up, hold, decay.

    The schedule runs ``total_steps`` updates split into periods that end at checkpoints: one checkpoint at
    the end, or ``num_checkpoints`` spaced geometrically (each twice the one before, see
    :func:`estimate_checkpoint_steps`). In each period of ``L`` updates the last ``D = int(L *
    decay_phase_ratio)`` updates decay the learning rate; the others hold each group's base learning rate.
    The first ``num_warmup_steps`` updates warm up linearly from ``warmup_starting_lr``. The decay, at a
    fraction ``t = i / D`` of it (``i`` from 0), scales the base learning rate by
    ``lr_min + (1 - lr_min) * (1 - sqrt(t))`` (``use_inverse_sqrt_decay=True``, the default) or by the paper's
    ``1 / (t * (1 / lr_min - 1) + 1)``. ``lr_min`` is a *fraction* of the base learning rate (0.1: a tenth),
    reached once the schedule has ended. After each intermediate checkpoint the learning rate goes back up
    to the base value.

    A run can continue from one of its checkpoints with ``is_continuation_from_checkpoint=True``: the new
    scheduler skips the warmup, holds the base learning rate over its own ``total_steps`` and decays before
    its own checkpoints; loading the state of the earlier run keeps its schedule's shape (decay ratio,
    ``lr_min``, number of checkpoints, decay formula, base learning rates). ``WSDCheckpointCallback``
    (``pytorch_accel_trainer.callbacks``) saves a training state before each decay and a model export after
    it, and can start a continuation from either.

    Example::

        trainer.train(train_dataset, num_epochs=10, per_device_batch_size=32,
                      create_scheduler_fn=WSDLrScheduler.create_scheduler_fn(num_warmup_epochs=1))
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        num_epochs: int | None = None,
        num_update_steps_per_epoch: int | None = None,
        total_steps: int | None = None,
        num_warmup_steps: int | None = 0,
        decay_phase_ratio: float = 0.1,
        lr_min: float = 1e-6,
        warmup_starting_lr: float = 1e-6,
        use_inverse_sqrt_decay: bool = True,
        num_checkpoints: int = 1,
        is_continuation_from_checkpoint: bool = False,
    ):
        """Create a WSD scheduler of ``optimizer``'s learning rates; it applies the value for 0 updates.

        Args:
            optimizer: a PyTorch optimizer with one or more parameter groups.
            num_epochs: the epochs of the schedule, with ``num_update_steps_per_epoch``; or give ``total_steps``.
            num_update_steps_per_epoch: the optimizer updates per epoch.
            total_steps: the optimizer updates of the schedule.
            num_warmup_steps: the updates of linear warmup; ``None`` for 1% of ``total_steps`` (rounded down).
            decay_phase_ratio: the fraction of each period spent decaying, from 0 to 1.
            lr_min: the fraction of the base learning rate that the decay tends to, from 0 to 1.
            warmup_starting_lr: the learning rate of every group at the start of the warmup; at most the
                largest base learning rate.
            use_inverse_sqrt_decay: decay by ``1 - sqrt(t)``; ``False`` for the paper's inverse-proportional decay.
            num_checkpoints: the number of periods, each ending with a decay.
            is_continuation_from_checkpoint: continue an earlier WSD run (no warmup; see the class).

        Raises:
            SchedulerArgumentError: an argument is out of range (the message says which and how to fix it).
        """
        _validate_wsd_arguments(
            allow_placeholder=False,
            num_epochs=num_epochs,
            num_update_steps_per_epoch=num_update_steps_per_epoch,
            total_steps=total_steps,
            num_warmup_steps=num_warmup_steps,
            decay_phase_ratio=decay_phase_ratio,
            lr_min=lr_min,
            warmup_starting_lr=warmup_starting_lr,
            use_inverse_sqrt_decay=use_inverse_sqrt_decay,
            num_checkpoints=num_checkpoints,
            is_continuation_from_checkpoint=is_continuation_from_checkpoint,
        )
        total_steps = _resolve_total_steps(num_epochs, num_update_steps_per_epoch, total_steps)
        if num_warmup_steps is None:
            num_warmup_steps = int(0.01 * total_steps)
        if num_warmup_steps > total_steps:
            raise SchedulerArgumentError(
                f"num_warmup_steps={num_warmup_steps} is longer than the schedule's {total_steps} steps; "
                "shorten the warmup or lengthen the schedule."
            )
        estimate_checkpoint_steps(total_steps, num_checkpoints)  # enough steps for the checkpoints
        largest_lr = max(group.get("initial_lr", group.get("lr", 0.0)) for group in optimizer.param_groups)
        if warmup_starting_lr > largest_lr:
            raise SchedulerArgumentError(
                f"warmup_starting_lr={warmup_starting_lr} is above the largest base learning rate {largest_lr}, so "
                "the warmup would lower it; pass a smaller warmup_starting_lr."
            )
        super().__init__(optimizer)  # the optimizer is changed only once every argument is known to be valid
        self.total_steps = total_steps
        self.num_warmup_steps = num_warmup_steps
        self.decay_phase_ratio = decay_phase_ratio
        self.lr_min = lr_min
        self.warmup_starting_lr = warmup_starting_lr
        self.use_inverse_sqrt_decay = use_inverse_sqrt_decay
        self.num_checkpoints = num_checkpoints
        self.is_continuation_from_checkpoint = is_continuation_from_checkpoint
        self.previous_checkpoint_step: int | None = None
        self._plan_checkpoints()
        self._apply_current_values()

    def _plan_checkpoints(self) -> None:
        """Place the checkpoints over ``total_steps`` and compute each period's decay."""
        self.checkpoint_steps = estimate_checkpoint_steps(self.total_steps, self.num_checkpoints)
        self.checkpoint_decay_info = []
        for index, period_end in enumerate(self.checkpoint_steps):
            period_start = 0 if index == 0 else self.checkpoint_steps[index - 1]
            decay_steps = int((period_end - period_start) * self.decay_phase_ratio)
            self.checkpoint_decay_info.append(
                {
                    "period_start": period_start,
                    "period_end": period_end,
                    "decay_steps": decay_steps,
                    "pre_decay_step": period_end - decay_steps,
                }
            )

    def _apply_current_values(self) -> None:
        """Set the optimizer's learning rates to the schedule's value at the current count (0 before a step)."""
        self._update_param_groups(self.get_updated_values(max(self._num_updates, 0)))

    def get_checkpoint_steps(self) -> list[int]:
        """Return the update counts at which the periods end (the checkpoints)."""
        return list(self.checkpoint_steps)

    def get_decay_info(self) -> list[dict]:
        """Return, for each period: ``period_start``, ``period_end`` (its checkpoint), ``decay_steps`` and
        ``pre_decay_step`` (the updates made when the decay starts)."""
        return [dict(info) for info in self.checkpoint_decay_info]

    def get_phase_info(self, num_updates: int) -> dict:
        """Return the decay information of the period that ``num_updates`` completed updates are in (a
        checkpoint's own count belongs to the period it ends; a count past the end, to the last period)."""
        for info in self.checkpoint_decay_info:
            if info["period_end"] >= num_updates:
                return dict(info)
        return dict(self.checkpoint_decay_info[-1])

    def get_current_step(self) -> int:
        """Return the scheduler's count: the updates completed when created by ``create_scheduler_fn``."""
        return self._num_updates

    def get_current_phase_info(self) -> dict:
        """Return :meth:`get_phase_info` at the scheduler's current count."""
        return self.get_phase_info(self._num_updates)

    def _get_checkpoint_info(self, num_updates: int) -> tuple:
        """Return ``(period_length, steps_into_period)`` of the period that holds update index ``num_updates``."""
        for info in self.checkpoint_decay_info:
            if num_updates < info["period_end"]:
                break  # a checkpoint's own count starts the next period; past the end, the last period goes on
        return info["period_end"] - info["period_start"], num_updates - info["period_start"]

    # pytorch-accelerated cached the lookup with functools.lru_cache on the method, which kept the last scheduler
    # (and through it the optimizer and the model) alive; it is a loop over a few periods, so nothing is cached
    # and cache_clear() is kept, doing nothing, for code that called it (set in the function's __dict__: type checkers
    # do not model attributes added to a function).
    _get_checkpoint_info.__dict__["cache_clear"] = lambda: None

    def get_updated_values(self, num_updates: int) -> list:
        """Return each parameter group's learning rate after ``num_updates`` updates (see the class)."""
        if not self.is_continuation_from_checkpoint and num_updates < self.num_warmup_steps:
            return [
                self.warmup_starting_lr + (num_updates / self.num_warmup_steps) * (base_lr - self.warmup_starting_lr)
                for base_lr in self.base_lr_values
            ]
        period_length, steps_into_period = self._get_checkpoint_info(num_updates)
        decay_steps = int(period_length * self.decay_phase_ratio)
        decay_start = period_length - decay_steps
        if steps_into_period < decay_start:
            return list(self.base_lr_values)  # the stable phase
        fraction = 1.0 if decay_steps == 0 else min((steps_into_period - decay_start) / decay_steps, 1.0)
        if self.use_inverse_sqrt_decay:
            scale = self.lr_min + (1 - self.lr_min) * (1 - math.sqrt(fraction))
            return [base_lr * scale for base_lr in self.base_lr_values]
        return [base_lr / (fraction * (1.0 / self.lr_min) + (1.0 - fraction) * 1.0) for base_lr in self.base_lr_values]

    def step_update(self, num_updates: int) -> None:
        """Apply the learning rate after ``num_updates`` updates; note the last update before a decay starts."""
        if num_updates >= self.num_warmup_steps or self.is_continuation_from_checkpoint:
            period_length, steps_into_period = self._get_checkpoint_info(num_updates)
            if steps_into_period == period_length - int(period_length * self.decay_phase_ratio) - 1:
                self.previous_checkpoint_step = num_updates
        super().step_update(num_updates)

    def state_dict(self) -> dict:
        """Return the schedule's settings and update count (plain Python values)."""
        state = {key: getattr(self, key) for key in _STATE_KEYS if key != "num_updates"}
        state["base_lr_values"] = list(self.base_lr_values)
        state["checkpoint_steps"], state["checkpoint_decay_info"] = self.get_checkpoint_steps(), self.get_decay_info()
        return {**state, "num_updates": self._num_updates}

    def load_state_dict(self, state_dict: dict) -> None:
        """Restore a state returned by :meth:`state_dict` and apply its learning rate to the optimizer.

        A scheduler created with ``is_continuation_from_checkpoint=True`` that is given the state of an
        ordinary WSD run *starts a continuation* from it (see :meth:`load_state_dict_for_continuation`).
        Any other state is restored exactly, count included, so that a resumed run (a continuation run too)
        goes on where it stopped. A key left out keeps its current value.

        Raises:
            ValueError: the dictionary has keys that a WSD scheduler's state does not.
        """
        _validate_state_keys(state_dict)
        if self.is_continuation_from_checkpoint and not state_dict.get("is_continuation_from_checkpoint", False):
            self.load_state_dict_for_continuation(state_dict)
            return
        for key in (*_SHAPE_KEYS, "total_steps", "is_continuation_from_checkpoint", "previous_checkpoint_step"):
            setattr(self, key, state_dict.get(key, getattr(self, key)))
        self.base_lr_values = list(self.base_lr_values)
        self._num_updates = state_dict.get("num_updates", self._num_updates)
        self._plan_checkpoints()
        self._apply_current_values()

    def load_state_dict_for_continuation(self, state_dict: dict) -> None:
        """Start a continuation from a saved state: keep its schedule's shape, start a new stable phase here.

        The decay ratio, ``lr_min``, number of checkpoints, decay formula and base learning rates come from
        ``state_dict`` (a warning names those that differ from this scheduler's arguments); the length
        (``total_steps``) and the count are this scheduler's, and there is no warmup. Use it directly to
        continue from a state that was itself written by a continuation run.

        Raises:
            ValueError: the dictionary has keys that a WSD scheduler's state does not.
        """
        _validate_state_keys(state_dict)
        differences = [
            f"{key}={state_dict[key]!r} (this scheduler was created with {getattr(self, key)!r})"
            for key in ("decay_phase_ratio", "lr_min", "num_checkpoints", "use_inverse_sqrt_decay", "base_lr_values")
            if key in state_dict and state_dict[key] != getattr(self, key)
        ]
        if differences:
            warnings.warn(
                f"The WSD continuation keeps the saved schedule's {', '.join(differences)}; only total_steps="
                f"{self.total_steps} is new. Start a new run (without the saved scheduler state) to change them.",
                stacklevel=2,
            )
        for key in _SHAPE_KEYS:
            setattr(self, key, state_dict.get(key, getattr(self, key)))
        self.base_lr_values = list(self.base_lr_values)
        self.is_continuation_from_checkpoint = True
        self.previous_checkpoint_step = None
        self._plan_checkpoints()
        self._apply_current_values()

    @classmethod
    def create_scheduler_fn(
        cls,
        total_num_epochs: IntOrPlaceholder = TrainerPlaceholderValues.NUM_EPOCHS,
        num_update_steps_per_epoch: IntOrPlaceholder = TrainerPlaceholderValues.PER_PROCESS_NUM_UPDATE_STEPS_PER_EPOCH,
        num_warmup_epochs: int | None = None,
        decay_phase_ratio: float = 0.1,
        lr_min: float = 1e-6,
        warmup_starting_lr: float = 1e-6,
        use_inverse_sqrt_decay: bool = True,
        num_checkpoints: int = 1,
        is_continuation_from_checkpoint: bool = False,
    ) -> Callable:
        """Return a factory ``fn(optimizer) -> WSDLrScheduler`` for ``Trainer.train(create_scheduler_fn=...)``.

        The number of epochs and of updates per epoch default to placeholders that the trainer replaces with
        the run's values; ``num_warmup_epochs=None`` warms up for 1% of the updates. The scheduler is stepped
        once when created, so that update ``k`` of the run uses the learning rate for ``k - 1`` updates (see
        :func:`create_stepped_once`). For a run limited by ``max_num_train_steps``, use
        ``functools.partial(create_stepped_once, WSDLrScheduler, total_steps=...)`` so that the decay ends
        with the run. The other arguments are those of :meth:`__init__`; those that are not placeholders are
        checked here.

        Example::

            trainer.train(train_dataset, num_epochs=10, per_device_batch_size=32,
                          create_scheduler_fn=WSDLrScheduler.create_scheduler_fn(num_warmup_epochs=1))
        """
        arguments: dict[str, Any] = {
            "num_epochs": total_num_epochs,
            "num_update_steps_per_epoch": num_update_steps_per_epoch,
            "decay_phase_ratio": decay_phase_ratio,
            "lr_min": lr_min,
            "warmup_starting_lr": warmup_starting_lr,
            "use_inverse_sqrt_decay": use_inverse_sqrt_decay,
            "num_checkpoints": num_checkpoints,
            "is_continuation_from_checkpoint": is_continuation_from_checkpoint,
        }
        _validate_wsd_arguments(allow_placeholder=True, num_warmup_epochs=num_warmup_epochs, **arguments)
        num_warmup_steps = None if num_warmup_epochs is None else num_update_steps_per_epoch * num_warmup_epochs
        return partial(create_stepped_once, cls, num_warmup_steps=num_warmup_steps, **arguments)


def _validate_state_keys(state_dict: dict) -> None:
    unknown = sorted(set(state_dict) - set(_STATE_KEYS))
    if unknown:
        raise ValueError(
            f"Not a WSDLrScheduler state: unexpected keys {unknown} (its keys are {list(_STATE_KEYS)}); load the "
            "state of the same kind of scheduler."
        )
