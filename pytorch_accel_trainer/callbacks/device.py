"""Callbacks that place the trainer's extra modules on the run's device."""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

from pytorch_accel_trainer.callbacks.base import TrainerCallback

if TYPE_CHECKING:
    from pytorch_accel_trainer.trainer import Trainer


class MoveModulesToDeviceCallback(TrainerCallback):
    """Moves every ``nn.Module`` attribute of the trainer, except ``model``, to ``trainer.device``.

    This places a loss function with weights, or torchmetrics metrics stored on a Trainer subclass, next
    to the model at the start of each training or evaluation run. The model itself is placed by
    Accelerate.
    """

    def _move_modules_to_device(self, trainer: "Trainer") -> None:
        for name, value in vars(trainer).items():
            if name != "model" and isinstance(value, nn.Module):
                value.to(trainer.device)

    def on_training_run_start(self, trainer: "Trainer", **kwargs):
        self._move_modules_to_device(trainer)

    def on_evaluation_run_start(self, trainer: "Trainer", **kwargs):
        self._move_modules_to_device(trainer)
