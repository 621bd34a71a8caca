"""Callbacks that stop a run."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Optional

import torch

from pytorch_accel_trainer.callbacks.base import StopTrainingError, TrainerCallback

if TYPE_CHECKING:
    from pytorch_accel_trainer.trainer import Trainer


class TerminateOnNaNCallback(TrainerCallback):
    """Stops the run when a training or evaluation loss is NaN or infinite.

    Whether a loss is finite is recorded on the device at every step, and read back (a host-device
    sync) only every ``check_every_n_steps`` training steps and at the end of each epoch, so ordinary
    steps never wait for the device. The flag is combined over processes before it is read, so every
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
        self._loss_sum: Optional[torch.Tensor] = None

    def _record(self, loss: torch.Tensor) -> None:
        # One device op per step: a sum is non-finite as soon as one of its terms is.
        loss = loss.detach().float()  # the trainer checks that the loss is a scalar
        self._loss_sum = loss if self._loss_sum is None else self._loss_sum + loss

    def _check(self, trainer: "Trainer", stage: str) -> None:
        seen = torch.zeros((), device=trainer.device)
        if self._loss_sum is not None:
            seen = (~torch.isfinite(self._loss_sum)).float().to(trainer.device)
        self._loss_sum = None
        if trainer._accelerator.reduce(seen, "sum").item() > 0:  # host-device sync, by design
            self.triggered = True
            raise StopTrainingError(f"Stopping training due to NaN loss in {stage} step")

    def on_training_run_start(self, trainer: "Trainer", **kwargs):
        self.triggered = False
        self._loss_sum = None

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
