"""Callbacks that stop a run, or shorten it."""

from __future__ import annotations

import math
import os
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch

from pytorch_accel_trainer.callbacks.base import TrainerCallback
from pytorch_accel_trainer.errors import StopTrainingError, validate_positive_int
from pytorch_accel_trainer.utils import LIMIT_BATCHES_ENV_VAR, DataLoaderSlice

if TYPE_CHECKING:
    from pytorch_accel_trainer.trainer import Trainer

#: The stages whose losses are checked apart, and the run-history metric of each (in a training run).
_STAGES = {"training": "train_loss_epoch", "validation": "eval_loss_epoch"}


class NonFiniteLossError(RuntimeError):
    """A loss became NaN or infinite: raised by :class:`TerminateOnNaNCallback` once the run it stopped has ended.

    Catch it to go on after a diverged run (``except NonFiniteLossError``); uncaught, the script exits with an
    error, as pytorch-accelerated's ``sys.exit`` did.

    Attributes:
        metric: the run-history metric the diverged losses are recorded under: ``"train_loss_epoch"``, the eval
            loss of a training run (``"eval_loss_epoch"``, with the run history's prefix in an intermediate or EMA
            evaluation) or ``"evaluation_loss"``.
        value: ``nan``, ``inf`` or ``-inf``: the sum of the losses checked together, over processes.
        epoch: the epoch of the run history in which it was seen (``None`` when unknown).
        steps: the first and last batch index (from 0, in the epoch) of the losses checked together; ``None`` when
            unknown.
    """

    def __init__(self, metric: str, value: float, epoch: int | None = None, steps: tuple | None = None):
        self.metric, self.value, self.epoch, self.steps = metric, value, epoch, steps
        where = "" if epoch is None else f" in epoch {epoch}"
        if steps is not None:
            where += f", at step {steps[0]}" if steps[0] == steps[1] else f", between steps {steps[0]} and {steps[1]}"
        super().__init__(
            f"The loss recorded as {metric!r} became {value}{where}, so TerminateOnNaNCallback stopped the run. "
            "Lower the learning rate, clip the gradients (train(..., gradient_clip_norm=1.0)), check the data for "
            "NaNs, or skip such updates with SkipNonFiniteStepsCallback; with "
            "TerminateOnNaNCallback(raise_on_nan=False), the run returns instead."
        )

    def __reduce__(self):
        return type(self), (self.metric, self.value, self.epoch, self.steps)  # pickles (e.g. between processes)


class TerminateOnNaNCallback(TrainerCallback):
    """Stops the run when a training or evaluation loss is NaN or infinite, then raises :class:`NonFiniteLossError`.

    It reads the trainer's own sums of the epoch's losses (kept on the device, so a step costs it nothing), and whether
    the sum is finite is read back (a host-device sync) only every ``check_every_n_steps`` training steps and at the
    end of each epoch, so ordinary steps never wait for the device. The sum is combined over processes before it is
    read, so every process takes the same decision at the same step. A non-finite loss stops the run with a
    ``StopTrainingError`` (``"Stopping training due to NaN loss in training step"``, as in pytorch-accelerated);
    once the run has ended, every ``on_training_run_end`` (or ``on_evaluation_run_end``) callback included, the
    error is raised from ``train()`` (or ``evaluate()``), where pytorch-accelerated calls ``sys.exit``.

    Args:
        check_every_n_steps: how often, in training batches, the sum is read; ``None`` reads it only at
            the end of each epoch.
        raise_on_nan: raise :class:`NonFiniteLossError` once a run it stopped has ended; ``False`` returns
            instead (``triggered`` is then ``True`` and ``error`` holds the error).

    Example::

        try:
            trainer.train(train_dataset, num_epochs=10)
        except NonFiniteLossError as error:
            print(f"diverged: {error.metric} became {error.value} in epoch {error.epoch}")
    """

    def __init__(self, check_every_n_steps: int | None = 100, raise_on_nan: bool = True):
        if check_every_n_steps is not None:
            validate_positive_int("check_every_n_steps", check_every_n_steps, "training batches", 100)
        self.check_every_n_steps = check_every_n_steps
        self.raise_on_nan = raise_on_nan
        self.triggered = False
        #: The error of the last run it stopped (raised at the run's end when ``raise_on_nan``), else ``None``.
        self.error: NonFiniteLossError | None = None
        # The first training step not checked yet. The checks read the trainer's own sums of the epoch's losses
        # (run_state's loss trackers: non-finite as soon as one of their terms is), so a step costs this callback
        # nothing; an evaluation, intermediate or not, has sums of its own, checked once at its end.
        self._first_unchecked_step = 0
        self._in_evaluation_run = False

    def check_for_nan_after_batch(self, batch_output: dict, step: str | None = None) -> None:
        """Stop now if ``batch_output["loss"]`` is NaN or infinite: pytorch-accelerated's per-batch check.

        A host-device sync each call, so the callback's own events use the deferred check instead; call it from a
        subclass to check one batch at once. ``step`` names the stage in the message: ``"training"`` or
        ``"validation"``.

        Raises:
            StopTrainingError: the loss is not finite.
        """
        loss = batch_output["loss"].detach().float()
        if not bool(torch.isfinite(loss).all()):  # host-device sync, by design
            self._stop("loss" if step is None else _STAGES.get(step, "loss"), float(loss.sum()), step)

    def _check(self, trainer: Trainer, stage: str, metric: str, steps: tuple[int, int]) -> None:
        """Stop if the epoch's loss sum of ``stage`` is not finite; ``steps``: the first and last step it adds since
        the last check."""
        if self.triggered:
            return  # the stop it asked for is held until the processes agree: the first non-finite sum stays the error
        if trainer.run_state.non_finite_policy is not None:
            return  # SkipNonFiniteStepsCallback handles non-finite steps instead
        state = trainer.run_state
        tracker = state.train_loss_tracker if stage == "training" else state.eval_loss_tracker
        total = tracker.peek_total_loss()  # the epoch's sum so far, on the device
        local = torch.zeros((), device=trainer.device) if total is None else torch.as_tensor(total).to(trainer.device)
        if trainer.accelerator.num_processes > 1:
            local = trainer.accelerator.reduce(local.float(), "sum")
        value = local.item()  # host-device sync, by design
        if not math.isfinite(value):
            self._stop(metric, value, stage, trainer.run_history.current_epoch, steps)

    def _stop(self, metric: str, value: float, stage: str | None, epoch=None, steps=None) -> None:
        self.triggered = True
        self.error = NonFiniteLossError(metric, value, epoch, steps)
        raise StopTrainingError(f"Stopping training due to NaN loss in {stage} step")

    def _eval_metric(self, trainer: Trainer) -> str:
        if self._in_evaluation_run:
            return "evaluation_loss"
        return f"{getattr(trainer.run_history, 'metric_name_prefix', '')}eval_loss_epoch"

    def _start_run(self, in_evaluation_run: bool) -> None:
        self.triggered, self.error, self._in_evaluation_run = False, None, in_evaluation_run
        self._first_unchecked_step = 0

    def on_training_run_start(self, trainer: Trainer, **kwargs):
        self._start_run(in_evaluation_run=False)

    def on_evaluation_run_start(self, trainer: Trainer, **kwargs):
        self._start_run(in_evaluation_run=True)

    def on_train_epoch_start(self, trainer: Trainer, **kwargs):
        self._first_unchecked_step = trainer.epoch_first_step  # a resumed epoch starts at its saved step

    def on_train_step_end(
        self, trainer: Trainer, batch: Any = None, batch_output: dict | None = None, step: int = 0, **kwargs
    ):
        if self.check_every_n_steps and (step + 1) % self.check_every_n_steps == 0:
            self._check_training(trainer, step)

    def on_train_epoch_end(self, trainer: Trainer, **kwargs):
        self._check_training(trainer, trainer.batch_idx if trainer.batch_idx is not None else -1)

    def on_eval_epoch_end(self, trainer: Trainer, **kwargs):
        last_step = trainer.batch_idx if trainer.batch_idx is not None else -1  # the epoch's last batch
        self._check(trainer, "validation", self._eval_metric(trainer), (0, last_step))

    def _check_training(self, trainer: Trainer, last_step: int) -> None:
        steps, self._first_unchecked_step = (self._first_unchecked_step, last_step), last_step + 1
        self._check(trainer, "training", "train_loss_epoch", steps)

    def on_training_run_end(self, trainer: Trainer, **kwargs):
        self._raise_if_stopped()

    def on_evaluation_run_end(self, trainer: Trainer, **kwargs):
        self._raise_if_stopped()

    def _raise_if_stopped(self) -> None:
        # Raised here, at the end: every callback's end-of-run event still runs (see CallbackHandler.call_event).
        if self.triggered and self.raise_on_nan and self.error is not None:
            raise self.error


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
        self._originals: tuple | None = None

    def on_training_run_start(self, trainer: Trainer, **kwargs):
        self._limit_dataloaders(trainer)

    def on_evaluation_run_start(self, trainer: Trainer, **kwargs):
        self._limit_dataloaders(trainer)

    def on_training_run_end(self, trainer: Trainer, **kwargs):
        self._restore_dataloaders(trainer)

    def on_evaluation_run_end(self, trainer: Trainer, **kwargs):
        self._restore_dataloaders(trainer)

    def _limit_dataloaders(self, trainer: Trainer) -> None:
        self._originals = (trainer.train_dataloader, trainer.eval_dataloader)
        trainer.train_dataloader, trainer.eval_dataloader = (
            None if dataloader is None else DataLoaderSlice(dataloader, self.num_batches)
            for dataloader in self._originals
        )

    def _restore_dataloaders(self, trainer: Trainer) -> None:
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
    return [
        LimitBatchesCallback(int(value)),
        *callbacks,
    ]  # first, as in pytorch-accelerated: it slices the data for the others
