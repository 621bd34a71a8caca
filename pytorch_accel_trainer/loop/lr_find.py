"""The learning-rate range test of ``Trainer.lr_find``: the sweep's schedule, its smoothed losses and stop, the
suggestion, and the snapshot that puts the trainer back exactly as it was.

The rule of the suggestion, as Lightning's ``lr_find`` and fastai's ``steep`` take it: the learning rate where the
smoothed loss falls fastest against the log of the learning rate (the most negative slope, by ``numpy.gradient`` over
the evenly spaced points of the exponential sweep), leaving out the first ``skip_start`` points (the moving average
is still settling there) and the last ``skip_end`` (where the sweep stopped, often diverging). It picks a learning
rate that still trains fast, below the one that gives the lowest loss, which is already close to diverging.
"""

from __future__ import annotations

import copy
import itertools
import math
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from numbers import Real
from typing import TYPE_CHECKING, Any, Optional, Union

import numpy as np
import torch
from accelerate.utils import broadcast_object_list

from pytorch_accel_trainer.errors import validate_positive_number, validate_positive_option
from pytorch_accel_trainer.loop.batches import require_batches
from pytorch_accel_trainer.loop.trainer_parts import capture_rng_state, restore_rng_state
from pytorch_accel_trainer.loop.training_modes import restore_training_modes, training_modes
from pytorch_accel_trainer.plotting import plot_lr_find

if TYPE_CHECKING:
    from matplotlib.figure import Figure

    from pytorch_accel_trainer.trainer import Trainer


@dataclass(frozen=True)
class LrFinderResult:
    """What ``Trainer.lr_find`` found.

    Attributes:
        lrs: the learning rate of each update of the sweep.
        losses: the loss of each update (the mean over processes).
        smoothed_losses: the losses' exponential moving average, corrected for its start (as Adam's), which the stop
            and the suggestion read.
        suggestion: the learning rate of the steepest descent of the smoothed loss (see this module's documentation);
            ``None`` when the sweep is too short to tell (fewer than ``skip_start + skip_end + 2`` points): the loss
            diverged at the sweep's second step, after one update at ``start_lr``, which is too large then.
        diverged: whether the sweep stopped early because the loss diverged.
        skip_start, skip_end: the points the suggestion left out at each end.
    """

    lrs: list = field(default_factory=list)
    losses: list = field(default_factory=list)
    smoothed_losses: list = field(default_factory=list)
    suggestion: Optional[float] = None
    diverged: bool = False
    skip_start: int = 10
    skip_end: int = 1

    def plot(self, save_path: Union[str, os.PathLike, None] = None) -> Figure:
        """Plot the smoothed loss against the learning rate (log scale), the suggestion marked; see
        :func:`~pytorch_accel_trainer.plotting.plot_lr_find`."""
        return plot_lr_find(self, save_path)


def suggest_lr(lrs: list, smoothed_losses: list, skip_start: int = 10, skip_end: int = 1) -> Optional[float]:
    """The learning rate where ``smoothed_losses`` fall fastest, leaving out ``skip_start`` and ``skip_end`` points;
    ``None`` when fewer than 2 points are left (see this module's documentation)."""
    end = len(lrs) - skip_end
    if end - skip_start < 2:
        return None
    losses = np.asarray(smoothed_losses[skip_start:end], dtype=np.float64)
    finite = np.isfinite(losses)
    if finite.sum() < 2:
        return None
    slopes = np.gradient(np.where(finite, losses, np.inf))
    slopes[~np.isfinite(slopes)] = np.inf  # a slope next to a non-finite loss is never the steepest
    return float(lrs[skip_start + int(np.argmin(slopes))])


#: The error of data with no batch (a stream that yields no sample, or one already consumed).
NO_BATCH_MESSAGE = (
    "lr_find() received data with no batch (a stream that yields no sample, or a generator already consumed): pass "
    "a dataset with at least one batch."
)


def validate_first_loss(loss: float, lr: float) -> None:
    """Refuse a sweep whose first loss is NaN or infinite: that loss is the model's as it was, computed before the
    first update, so no learning rate caused it and there is no divergence to find: the model or the data is broken.

    Raises:
        ValueError: naming the step, its learning rate and what to check.
    """
    if not math.isfinite(loss):
        raise ValueError(
            f"lr_find(): the loss of the first step (step 0, lr={lr:.3g}) is {loss}, computed before any update: no "
            "learning rate caused it, so the model or the data is broken, not diverging. Check the data for NaN or "
            "infinite values and the loss on one batch (trainer.calculate_train_batch_loss(batch)['loss']), e.g. a "
            "log of 0, or weights that are already NaN; then run lr_find() again. Nothing was changed."
        )


class LrSweep:
    """The sweep: the learning rate of each step, the losses recorded, the decision to stop."""

    def __init__(
        self, start_lr: float, end_lr: float, num_steps: int, smoothing: float, diverge_factor: Optional[float]
    ):
        self.start_lr, self.end_lr, self.num_steps = start_lr, end_lr, num_steps
        self.smoothing, self.diverge_factor = smoothing, diverge_factor
        self.lrs: list = []
        self.losses: list = []
        self.smoothed: list = []
        self.diverged = False
        self._average = 0.0

    def learning_rate(self, step: int) -> float:
        """The learning rate of ``step``: exponential from ``start_lr`` (step 0) to ``end_lr`` (the last step)."""
        return self.start_lr * (self.end_lr / self.start_lr) ** (step / (self.num_steps - 1))

    def set_learning_rate(self, optimizer: torch.optim.Optimizer, step: int) -> None:
        """Give every parameter group of ``optimizer`` the learning rate of ``step``."""
        lr = self.learning_rate(step)
        for group in optimizer.param_groups:
            group["lr"] = lr
        self.lrs.append(lr)

    def record(self, loss: float) -> bool:
        """Record the loss of the step just run; return whether the sweep must stop (the loss diverged).

        Raises:
            ValueError: the first step's loss is not finite (see :func:`validate_first_loss`).
        """
        if not self.losses:
            validate_first_loss(loss, self.lrs[0])
        self._average = self.smoothing * self._average + (1 - self.smoothing) * loss
        smoothed = self._average / (1 - self.smoothing ** (len(self.losses) + 1))
        self.losses.append(loss)
        self.smoothed.append(smoothed)
        if not math.isfinite(smoothed):
            self.diverged = True
        elif self.diverge_factor is not None and len(self.smoothed) > 1:
            self.diverged = smoothed > self.diverge_factor * min(self.smoothed)
        return self.diverged

    def result(self, accelerator: Any) -> LrFinderResult:
        """The result, the suggestion taken from the main process (one small collective when distributed)."""
        lrs = self.lrs[: len(self.losses)]
        skip_start = 10 if len(lrs) >= 20 else 0  # a short sweep: every point counts
        suggestion = [suggest_lr(lrs, self.smoothed, skip_start, 1)]
        if accelerator.num_processes > 1:
            broadcast_object_list(suggestion)  # the losses are means over processes: equal; the main one decides
        return LrFinderResult(
            lrs, list(self.losses), list(self.smoothed), suggestion[0], self.diverged, skip_start=skip_start
        )


def endless_batches(dataloader: Iterable) -> Iterator:
    """The batches of ``dataloader``, epoch after epoch (its epoch set, for a new shuffle order each time).

    Raises:
        ValueError: an epoch of no batch (a stream that yields nothing), in these words rather than Accelerate's.
    """
    for epoch in itertools.count():
        if hasattr(dataloader, "set_epoch"):
            dataloader.set_epoch(epoch)
        yield from require_batches(dataloader, NO_BATCH_MESSAGE)


def _cpu_copy(state: Any) -> Any:
    """A deep copy of ``state`` (dicts, lists, tuples, tensors, numbers) with every tensor copied to the CPU;
    ``load_state_dict`` puts the values back on their devices, bit for bit."""
    if isinstance(state, torch.Tensor):
        return state.detach().to("cpu", copy=True)
    if isinstance(state, dict):
        return type(state)((key, _cpu_copy(value)) for key, value in state.items())
    if isinstance(state, (list, tuple)):
        return type(state)(_cpu_copy(value) for value in state)
    return copy.deepcopy(state)


@dataclass
class TrainerSnapshot:
    """Copies of everything a sweep changes, to put back bit for bit: the model's weights, buffers and training
    modes, the optimizer's state and learning rates, the scheduler, the fp16 gradient scaler and the random
    generators of this process. Callbacks and the run history are not copied: the sweep fires no event and records
    nothing."""

    model_state: dict
    modes: list
    optimizer_state: dict
    scheduler_state: Optional[dict]
    scaler_state: Optional[dict]
    rng_state: dict

    @classmethod
    def take(cls, trainer: Trainer) -> TrainerSnapshot:
        model, optimizer, scheduler = trainer.model, trainer._training_optimizer, trainer.scheduler
        scaler = trainer.accelerator.scaler
        return cls(
            model_state=_cpu_copy(model.state_dict()),  # on the host: the device keeps its memory for the sweep
            modes=training_modes(model),
            optimizer_state=_cpu_copy(optimizer.state_dict()),
            scheduler_state=copy.deepcopy(scheduler.state_dict()) if hasattr(scheduler, "state_dict") else None,
            scaler_state=copy.deepcopy(scaler.state_dict()) if scaler is not None else None,
            rng_state=capture_rng_state(),
        )

    def restore(self, trainer: Trainer) -> None:
        """Put the trainer back as it was when the snapshot was taken (its model unwrapped first)."""
        trainer.model.load_state_dict(self.model_state)
        restore_training_modes(self.modes)
        trainer._training_optimizer.load_state_dict(self.optimizer_state)
        if self.scheduler_state is not None:
            trainer.scheduler.load_state_dict(self.scheduler_state)
        if self.scaler_state is not None and trainer.accelerator.scaler is not None:
            trainer.accelerator.scaler.load_state_dict(self.scaler_state)
        restore_rng_state(self.rng_state)


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
    validate_positive_option("num_steps", num_steps)
    if num_steps < 3:  # the suggestion compares slopes, leaving the last point out: 3 points at least
        raise ValueError(f"num_steps={num_steps!r} is too few for a suggestion: pass at least 3 (100 by default).")
    if isinstance(smoothing, bool) or not isinstance(smoothing, (int, float)) or not 0 <= smoothing < 1:
        raise ValueError(f"smoothing={smoothing!r} is not valid: it must be in [0, 1) (0.98 by default; 0: none).")
    if diverge_factor is not None:
        validate_positive_number("diverge_factor", diverge_factor)
        if diverge_factor <= 1:
            raise ValueError(
                f"diverge_factor={diverge_factor!r} would stop at once: it must be above 1 (4 by default), or None."
            )
