"""Callbacks that show a run's progress: messages, progress bars and metrics."""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

from tqdm.auto import tqdm

from pytorch_accel_trainer.callbacks.base import TrainerCallback
from pytorch_accel_trainer.utils import dataloader_length

if TYPE_CHECKING:
    from pytorch_accel_trainer.trainer import Trainer


class PrintProgressCallback(TrainerCallback):
    """Prints a line at the start and end of each run and at the start of each epoch, once per node."""

    def on_training_run_start(self, trainer: "Trainer", **kwargs):
        trainer.print("\nStarting training run")

    def on_train_epoch_start(self, trainer: "Trainer", **kwargs):
        trainer.print(f"\nStarting epoch {trainer.run_history.current_epoch}")

    def on_eval_epoch_start(self, trainer: "Trainer", **kwargs):
        trainer.print("\nStarting eval epoch")

    def on_training_run_end(self, trainer: "Trainer", **kwargs):
        trainer.print("Finishing training run")

    def on_evaluation_run_start(self, trainer: "Trainer", **kwargs):
        trainer.print("\nStarting evaluation run")

    def on_evaluation_run_end(self, trainer: "Trainer", **kwargs):
        trainer.print("Finishing evaluation run")


class ProgressBarCallback(TrainerCallback):
    """Shows a tqdm bar for each training and evaluation epoch, on the main process of each node.

    The bar counts batches only: it never reads the loss, so it never forces a host-device sync.
    """

    def __init__(self):
        self.pbar: Optional[tqdm] = None

    def _open(self, trainer: "Trainer", dataloader, description: str) -> None:
        self.pbar = tqdm(
            total=dataloader_length(dataloader),
            desc=description,
            unit="batch",
            disable=not trainer.run_config.is_local_process_zero,
            dynamic_ncols=True,
        )

    def _close(self) -> None:
        if self.pbar is not None:
            self.pbar.close()
            self.pbar = None

    def on_train_epoch_start(self, trainer: "Trainer", **kwargs):
        self._open(trainer, trainer._train_dataloader, f"epoch {trainer.run_history.current_epoch} train")

    def on_train_step_end(self, trainer: "Trainer", **kwargs):
        self.pbar.update(1)

    def on_train_epoch_end(self, trainer: "Trainer", **kwargs):
        self._close()

    def on_eval_epoch_start(self, trainer: "Trainer", **kwargs):
        self._open(trainer, trainer._eval_dataloader, "eval")

    def on_eval_step_end(self, trainer: "Trainer", **kwargs):
        self.pbar.update(1)

    def on_eval_epoch_end(self, trainer: "Trainer", **kwargs):
        self._close()

    def on_stop_training_error(self, trainer: "Trainer", **kwargs):
        self._close()


class LogMetricsCallback(TrainerCallback):
    """Logs the latest value of each metric in the run history, once per node.

    Metrics whose name contains ``train`` are logged at the end of each training epoch, the others at
    the end of each evaluation epoch. Override :meth:`log_metrics` to send them elsewhere.
    """

    def on_train_epoch_end(self, trainer: "Trainer", **kwargs):
        self._log_latest(trainer, lambda name: "train" in name)

    def on_eval_epoch_end(self, trainer: "Trainer", **kwargs):
        self._log_latest(trainer, lambda name: "train" not in name)

    def _log_latest(self, trainer: "Trainer", wanted) -> None:
        names = sorted(name for name in trainer.run_history.get_metric_names() if wanted(name))
        self.log_metrics(trainer, {name: trainer.run_history.get_latest_metric(name) for name in names})

    def log_metrics(self, trainer: "Trainer", metrics: dict) -> None:
        """Print each metric as ``name: value``; override to log somewhere else."""
        for name, value in metrics.items():
            trainer.print(f"\n{name}: {value}")


#: pytorch-accelerated's name for :class:`LogMetricsCallback`.
PrintMetricsCallback = LogMetricsCallback
