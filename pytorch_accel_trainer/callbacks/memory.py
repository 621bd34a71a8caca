"""Record the peak memory of each training epoch in the run history."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

import torch

from pytorch_accel_trainer.callbacks.base import TrainerCallback
from pytorch_accel_trainer.run_config import get_run_config

if TYPE_CHECKING:
    from pytorch_accel_trainer.trainer import Trainer

ACCELERATOR_MEMORY_METRIC = "train_peak_accelerator_memory_mib"
HOST_MEMORY_METRIC = "train_peak_host_memory_mib"


class PeakMemoryCallback(TrainerCallback):
    """Records the peak memory of each training epoch, the largest over all processes, in MiB.

    On a CUDA device, ``train_peak_accelerator_memory_mib`` is ``torch.cuda.max_memory_allocated``, whose
    peak is reset at the start of each training epoch. Otherwise, ``train_peak_host_memory_mib`` is the
    peak resident memory of the process (``resource.getrusage``), which only ever grows: the peak of the
    process so far. The value is recorded at the end of each training epoch, before ``on_train_epoch_end``
    listeners placed after this callback (such as ``LogMetricsCallback``) read it. Taking the largest
    over processes is one small collective per epoch, so every process records the same value.
    """

    def on_train_epoch_start(self, trainer: "Trainer", **kwargs):
        if trainer.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(trainer.device)

    def on_train_epoch_end(self, trainer: "Trainer", **kwargs):
        if trainer.device.type == "cuda":
            name, mebibytes = ACCELERATOR_MEMORY_METRIC, torch.cuda.max_memory_allocated(trainer.device) / 2**20
        else:
            name, mebibytes = HOST_MEMORY_METRIC, get_peak_host_memory_mib()
        peak = torch.tensor(mebibytes, dtype=torch.float32, device=trainer.device)
        if get_run_config(trainer).num_processes > 1:
            peak = trainer.accelerator.reduce(peak, "max")
        trainer.run_history.update_metric(name, peak.item())  # once per epoch, by design


def get_peak_host_memory_mib() -> float:
    """Return the peak resident memory of this process so far, in MiB (``resource.getrusage``)."""
    import resource  # Unix only: imported when a host peak is asked for

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**20 if sys.platform == "darwin" else peak / 2**10  # bytes on macOS, KiB on Linux
