"""Callbacks that show a run's progress: messages, progress bars and metrics."""

from __future__ import annotations

import numbers
import time
from typing import TYPE_CHECKING

from tqdm.auto import tqdm

from pytorch_accel_trainer.callbacks.base import TrainerCallback, validate_positive_int
from pytorch_accel_trainer.callbacks.readback import HostCopy, RunningSum
from pytorch_accel_trainer.utils import dataloader_length

if TYPE_CHECKING:
    from pytorch_accel_trainer.trainer import Trainer


class PrintProgressCallback(TrainerCallback):
    """Prints a line at the start and end of each run and at the start of each epoch, once per node."""

    def on_training_run_start(self, trainer: Trainer, **kwargs):
        trainer.print("\nStarting training run")

    def on_train_epoch_start(self, trainer: Trainer, **kwargs):
        trainer.print(f"\nStarting epoch {trainer.run_history.current_epoch}")

    def on_eval_epoch_start(self, trainer: Trainer, **kwargs):
        trainer.print("\nStarting eval epoch")

    def on_training_run_end(self, trainer: Trainer, **kwargs):
        trainer.print("Finishing training run")

    def on_evaluation_run_start(self, trainer: Trainer, **kwargs):
        trainer.print("\nStarting evaluation run")

    def on_evaluation_run_end(self, trainer: Trainer, **kwargs):
        trainer.print("Finishing evaluation run")


class ProgressBarCallback(TrainerCallback):
    """Shows a tqdm bar for each training and evaluation epoch, on the main process of each node.

    The training bar shows the epoch, batches done out of the total, the time left, and, refreshed every
    ``refresh_every_n_steps`` batches: the mean loss over the last interval, the learning rate of each
    parameter group, and the throughput in samples per second (over all processes, counted from the
    ``batch_size`` of each batch output when it is an ``int``). At the end of the epoch, the loss shown
    is the epoch's ``train_loss_epoch``.

    The loss is summed on the device between refreshes and copied to the host without waiting for the
    device (on CUDA, into pinned memory, shown once the copy has arrived, at most one interval late),
    so the bar never adds a host-device sync. The loss shown is that of this process's batches. Other
    processes show nothing and do no work.

    Args:
        refresh_every_n_steps: the batches between two refreshes of the loss, learning rate and throughput.
    """

    def __init__(self, refresh_every_n_steps: int = 50):
        validate_positive_int("refresh_every_n_steps", refresh_every_n_steps, "batches", 50)
        self.refresh_every_n_steps = refresh_every_n_steps
        self.pbar: tqdm | None = None
        self.eval_pbar: tqdm | None = None
        self._is_shown = False
        self._loss = RunningSum()
        self._host_copy: HostCopy | None = None
        self._postfix: dict = {}
        self._samples = 0
        self._epoch_start_time = 0.0

    def _create_bar(self, trainer: Trainer, dataloader, description: str, initial: int = 0) -> tqdm:
        return tqdm(
            total=dataloader_length(dataloader),
            initial=initial,
            desc=description,
            unit="batch",
            disable=not trainer.run_config.is_local_process_zero,
            dynamic_ncols=True,
        )

    def on_training_run_start(self, trainer: Trainer, **kwargs):
        self._is_shown = trainer.run_config.is_local_process_zero
        # made once per run: its host buffer is allocated here, never during a step
        self._host_copy = HostCopy(1, trainer.device) if self._is_shown else None

    def on_train_epoch_start(self, trainer: Trainer, **kwargs):
        self.pbar = self._create_bar(
            trainer, trainer.train_dataloader, f"epoch {trainer.run_history.current_epoch} train",
            initial=trainer.epoch_first_step,  # a resumed epoch continues where it stopped
        )  # fmt: skip
        self._loss.reset()
        self._postfix, self._samples = {}, 0
        self._epoch_start_time = time.perf_counter()

    def on_train_step_end(self, trainer: Trainer, batch_output: dict | None = None, step: int = 0, **kwargs):
        self.pbar.update(1)
        if not self._is_shown or batch_output is None:
            return
        self._loss.add(batch_output["loss"])
        batch_size = batch_output.get("batch_size")
        if isinstance(batch_size, int):  # a tensor batch size would need a sync to read
            self._samples += batch_size
        if (step + 1) % self.refresh_every_n_steps == 0:
            self._refresh(trainer)

    def _refresh(self, trainer: Trainer) -> None:
        epoch = trainer.run_history.current_epoch
        self._show_arrived_loss(epoch)  # the previous interval's copy, before the buffer is reused
        self._host_copy.start(self._loss.total, tag=(epoch, self._loss.count))
        self._loss.reset()
        self._show_arrived_loss(epoch)  # complete at once on the CPU; on CUDA, usually at the next refresh
        learning_rates = [group["lr"] for group in trainer.optimizer.param_groups]
        if all(isinstance(lr, numbers.Real) for lr in learning_rates):  # a tensor lr would need a sync
            self._postfix["lr"] = ",".join(f"{lr:.3g}" for lr in learning_rates)
        elapsed = time.perf_counter() - self._epoch_start_time
        if self._samples and elapsed > 0:
            self._postfix["samples/s"] = f"{self._samples * trainer.run_config.num_processes / elapsed:.1f}"
        self.pbar.set_postfix(self._postfix, refresh=False)

    def _show_arrived_loss(self, epoch: int) -> None:
        arrived = self._host_copy.get_values()
        if arrived is not None:
            (copy_epoch, count), (total,) = arrived
            if copy_epoch == epoch and count:  # a copy left from the previous epoch is stale
                self._postfix["loss"] = f"{total / count:.4g}"

    def on_train_epoch_end(self, trainer: Trainer, **kwargs):
        if self._is_shown and "train_loss_epoch" in trainer.run_history.get_metric_names():
            self._postfix["loss"] = f"{trainer.run_history.get_latest_metric('train_loss_epoch'):.4g}"
            self.pbar.set_postfix(self._postfix, refresh=False)
        self._close_train_bar()

    def on_eval_epoch_start(self, trainer: Trainer, **kwargs):
        self.eval_pbar = self._create_bar(trainer, trainer.eval_dataloader, "eval")

    def on_eval_step_end(self, trainer: Trainer, **kwargs):
        self.eval_pbar.update(1)

    def on_eval_epoch_end(self, trainer: Trainer, **kwargs):
        self._close_eval_bar()

    def on_stop_training_error(self, trainer: Trainer, **kwargs):
        self._close_eval_bar()
        self._close_train_bar()

    def _close_train_bar(self) -> None:
        if self.pbar is not None:
            self.pbar.close()
            self.pbar = None

    def _close_eval_bar(self) -> None:
        if self.eval_pbar is not None:
            self.eval_pbar.close()
            self.eval_pbar = None


class LogMetricsCallback(TrainerCallback):
    """Logs the latest value of each metric recorded in the current run, once per node.

    Metrics whose name contains ``train`` are logged at the end of each training epoch, the others at
    the end of each evaluation epoch. Only the metrics the current ``train()`` or ``evaluate()`` recorded are
    logged: after ``evaluate()``, ``evaluation_loss`` without the ``eval_loss_epoch`` of an earlier training run,
    which the run history keeps. Override :meth:`log_metrics` to send them elsewhere.
    """

    #: The number of values of each metric when the current run started (``None``: outside a run, log them all).
    _value_counts_at_run_start: dict | None = None
    _run_config = None  # the run_config of the run those counts belong to: each train() / evaluate() makes a new one

    def on_training_run_start(self, trainer: Trainer, **kwargs):
        self._start_run(trainer)

    def on_evaluation_run_start(self, trainer: Trainer, **kwargs):
        self._start_run(trainer)

    def on_train_epoch_start(self, trainer: Trainer, **kwargs):
        self._start_run(trainer)  # in case a subclass overrides on_training_run_start without super()

    def on_eval_epoch_start(self, trainer: Trainer, **kwargs):
        self._start_run(trainer)

    def _start_run(self, trainer: Trainer) -> None:
        """Take the metric counts at the start of a run, once per run (the first event of the run that reaches here)."""
        if trainer.run_config is not self._run_config:
            self._run_config = trainer.run_config
            self._value_counts_at_run_start = _value_counts(trainer.run_history)

    def on_train_epoch_end(self, trainer: Trainer, **kwargs):
        self._log_latest(trainer, lambda name: "train" in name)

    def on_eval_epoch_end(self, trainer: Trainer, **kwargs):
        self._log_latest(trainer, lambda name: "train" not in name)

    def _log_latest(self, trainer: Trainer, wanted) -> None:
        history, counts_at_start = trainer.run_history, self._value_counts_at_run_start
        names = sorted(name for name in history.get_metric_names() if wanted(name))
        if counts_at_start is not None:  # the values of earlier runs are in the history too: leave them out
            names = [name for name in names if len(history.get_metric_values(name)) != counts_at_start.get(name, 0)]
        self.log_metrics(trainer, {name: history.get_latest_metric(name) for name in names})

    def log_metrics(self, trainer: Trainer, metrics: dict) -> None:
        """Print each metric as ``name: value``; override to log somewhere else."""
        for name, value in metrics.items():
            trainer.print(f"\n{name}: {value}")


def _value_counts(history) -> dict:
    return {name: len(history.get_metric_values(name)) for name in history.get_metric_names()}


#: pytorch-accelerated's name for :class:`LogMetricsCallback`.
PrintMetricsCallback = LogMetricsCallback
