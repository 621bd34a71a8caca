"""Callbacks that stop a run."""

from __future__ import annotations

import itertools
import os
import sys
from typing import TYPE_CHECKING, Any, Callable, Iterable, Optional

import torch

from pytorch_accel_trainer.callbacks.base import StopTrainingError, TrainerCallback, validate_positive_int
from pytorch_accel_trainer.utils import DeferredSum, dataloader_length

if TYPE_CHECKING:
    from pytorch_accel_trainer.trainer import Trainer


class TerminateOnNaNCallback(TrainerCallback):
    """Stops the run when a training or evaluation loss is NaN or infinite.

    The losses are summed on the device (in batches, so a step pays no device op), and whether the sum is
    finite is read back (a host-device sync) only every ``check_every_n_steps`` training steps and at the
    end of each epoch, so ordinary steps never wait for the device. The flag is combined over processes before it is read, so every
    process takes the same decision at the same step.

    Args:
        check_every_n_steps: how often, in training batches, the flag is read; ``None`` reads it only at
            the end of each epoch.
        exit_on_nan: after the run ends, exit the program with a message, as pytorch-accelerated does;
            ``False`` returns from ``train()`` instead (``triggered`` is then ``True``).
    """

    def __init__(self, check_every_n_steps: Optional[int] = 100, exit_on_nan: bool = True):
        self.check_every_n_steps = check_every_n_steps
        self.exit_on_nan = exit_on_nan
        self.triggered = False
        self._losses = DeferredSum()  # a sum is non-finite as soon as one of its terms is

    def _record(self, loss: torch.Tensor) -> None:
        self._losses.add(loss)  # no device op per step: the losses are added up in batches

    def _check(self, trainer: "Trainer", stage: str) -> None:
        total = self._losses.total
        self._losses.reset()
        if trainer.run_state.non_finite_policy is not None:
            return  # SkipNonFiniteStepsCallback handles non-finite steps instead
        seen = torch.zeros((), device=trainer.device)
        if total is not None:
            seen = (~torch.isfinite(total)).float().to(trainer.device)
        if trainer.accelerator.reduce(seen, "sum").item() > 0:  # host-device sync, by design
            self.triggered = True
            raise StopTrainingError(f"Stopping training due to NaN loss in {stage} step")

    def on_training_run_start(self, trainer: "Trainer", **kwargs):
        self.triggered = False
        self._losses.reset()

    def on_train_step_end(self, trainer: "Trainer", batch_output: dict, step: int = 0, **kwargs):
        self._record(batch_output["loss"])
        if self.check_every_n_steps and (step + 1) % self.check_every_n_steps == 0:
            self._check(trainer, "training")

    def on_train_epoch_end(self, trainer: "Trainer", **kwargs):
        self._check(trainer, "training")

    def on_eval_step_end(self, trainer: "Trainer", batch_output: dict, **kwargs):
        self._record(batch_output["loss"])

    def on_eval_epoch_end(self, trainer: "Trainer", **kwargs):
        self._check(trainer, "validation")

    def on_training_run_end(self, trainer: "Trainer", **kwargs):
        if self.triggered and self.exit_on_nan:
            sys.exit("Exiting due to NaN loss")


#: Set this environment variable to a number of batches to add a :class:`LimitBatchesCallback` to every
#: trainer created while it is set (a quick debugging run, as in pytorch-accelerated).
LIMIT_BATCHES_ENV_VAR = "PT_ACC_LIMIT_BATCHES"


class DataLoaderSlice:
    """The first ``num_batches`` batches of a dataloader, while ``is_active()`` says so; all of them otherwise.

    Every other attribute (``sampler``, ``batch_size``, ``set_epoch``, ...) is the wrapped dataloader's.

    Args:
        dataloader: the dataloader to slice.
        num_batches: the most batches one pass yields.
        is_active: called at the start of each pass (and by ``len()``); ``None`` means always active.
    """

    def __init__(self, dataloader: Iterable, num_batches: int, is_active: Optional[Callable[[], bool]] = None):
        self.dataloader = dataloader
        self.num_batches = num_batches
        self.is_active = is_active or (lambda: True)

    def __iter__(self):
        if self.is_active():
            return itertools.islice(self.dataloader, self.num_batches)
        return iter(self.dataloader)

    def __len__(self) -> int:
        length = dataloader_length(self.dataloader)
        if length is None:
            raise TypeError("the wrapped dataloader has no __len__ (an iterable dataset), so its slice has none either")
        return min(length, self.num_batches) if self.is_active() else length

    def __getattr__(self, name: str) -> Any:
        if name == "dataloader":  # not set yet (e.g. during unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.dataloader, name)


class LimitBatchesCallback(TrainerCallback):
    """Limits every training and evaluation epoch to its first ``num_batches`` batches on each process.

    For quick debugging runs. It is added to every trainer created while the environment variable
    ``PT_ACC_LIMIT_BATCHES`` holds a number of batches (see :func:`with_limit_batches_from_env`). The run
    config and the placeholders still describe the full dataloaders.

    Args:
        num_batches: the most batches per epoch and process.
    """

    def __init__(self, num_batches: int):
        validate_positive_int("num_batches", num_batches, "batches", 2)
        self.num_batches = num_batches
        self._originals: Optional[tuple] = None

    def on_training_run_start(self, trainer: "Trainer", **kwargs):
        self._limit_dataloaders(trainer)

    def on_evaluation_run_start(self, trainer: "Trainer", **kwargs):
        self._limit_dataloaders(trainer)

    def on_training_run_end(self, trainer: "Trainer", **kwargs):
        self._restore_dataloaders(trainer)

    def on_evaluation_run_end(self, trainer: "Trainer", **kwargs):
        self._restore_dataloaders(trainer)

    def _limit_dataloaders(self, trainer: "Trainer") -> None:
        self._originals = (trainer.train_dataloader, trainer.eval_dataloader)
        trainer.train_dataloader, trainer.eval_dataloader = (
            None if dataloader is None else DataLoaderSlice(dataloader, self.num_batches)
            for dataloader in self._originals
        )

    def _restore_dataloaders(self, trainer: "Trainer") -> None:
        if self._originals is not None:
            trainer.train_dataloader, trainer.eval_dataloader = self._originals
            self._originals = None


def with_limit_batches_from_env(callbacks: Iterable) -> list:
    """Return ``callbacks`` plus a :class:`LimitBatchesCallback` when ``PT_ACC_LIMIT_BATCHES`` is set.

    Nothing is added when the variable is unset or empty, or when ``callbacks`` already holds a
    ``LimitBatchesCallback`` (class or instance).

    Raises:
        ValueError: the variable is set to something other than a positive whole number.
    """
    callbacks = list(callbacks)
    value = os.environ.get(LIMIT_BATCHES_ENV_VAR, "").strip()
    has_limit = any(
        (isinstance(callback, type) and issubclass(callback, LimitBatchesCallback))
        or isinstance(callback, LimitBatchesCallback)
        for callback in callbacks
    )
    if not value or has_limit:
        return callbacks
    if not value.isdigit() or int(value) < 1:
        raise ValueError(
            f"The environment variable {LIMIT_BATCHES_ENV_VAR} is {value!r}, not a positive whole number of batches; "
            f"set it to e.g. {LIMIT_BATCHES_ENV_VAR}=2, or unset it for full epochs."
        )
    return [*callbacks, LimitBatchesCallback(int(value))]
