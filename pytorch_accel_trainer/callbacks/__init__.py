"""Callbacks: the base protocol and the ready-made callbacks, one family per module."""

from pytorch_accel_trainer.callbacks.base import EVENTS, CallbackHandler, StopTrainingError, TrainerCallback
from pytorch_accel_trainer.callbacks.control import TerminateOnNaNCallback
from pytorch_accel_trainer.callbacks.device import MoveModulesToDeviceCallback
from pytorch_accel_trainer.callbacks.training_state import SaveTrainingStateCallback
from pytorch_accel_trainer.callbacks.progress import (
    LogMetricsCallback,
    PrintMetricsCallback,
    PrintProgressCallback,
    ProgressBarCallback,
)

__all__ = [
    "EVENTS",
    "CallbackHandler",
    "LogMetricsCallback",
    "MoveModulesToDeviceCallback",
    "PrintMetricsCallback",
    "PrintProgressCallback",
    "ProgressBarCallback",
    "SaveTrainingStateCallback",
    "StopTrainingError",
    "TerminateOnNaNCallback",
    "TrainerCallback",
]
