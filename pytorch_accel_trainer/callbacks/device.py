"""Callbacks that fit the trainer's modules to the run's devices and processes."""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

from pytorch_accel_trainer.callbacks.base import TrainerCallback
from pytorch_accel_trainer.run_config import get_run_config

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


class ConvertSyncBatchNormCallback(TrainerCallback):
    """Converts every ``BatchNorm*d`` layer of the model to :class:`torch.nn.SyncBatchNorm` in distributed runs.

    At ``on_training_run_start`` of a run with several processes, the batch-norm layers are replaced by
    ``SyncBatchNorm`` layers that share their parameters and buffers, so the optimizer and the distributed
    wrapper keep working on the same tensors, and batch statistics are computed over the global batch.
    With one process it does nothing. The conversion stays after the run.

    PyTorch's ``SyncBatchNorm`` only runs on accelerators (CUDA, XPU, ...): on CPU processes the callback
    raises ``ValueError`` before the first step rather than letting the first forward pass fail.
    """

    def on_training_run_start(self, trainer: "Trainer", **kwargs):
        if not get_run_config(trainer).is_distributed:
            return  # one process: there is nothing to synchronise
        if trainer.device.type == "cpu":
            raise ValueError(
                f"ConvertSyncBatchNormCallback is in a distributed run on {trainer.device}, but torch's SyncBatchNorm "
                "only runs on accelerators (CUDA, XPU). Remove the callback for CPU runs."
            )
        trainer.model = nn.SyncBatchNorm.convert_sync_batchnorm(trainer.model)
