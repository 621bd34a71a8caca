"""Callbacks that show a run's progress: messages, progress bars and metrics.

By default a training run prints what the best tools print: one line when it starts, one line per epoch (a progress
bar while the epoch runs, replaced at its end by the epoch's summary: epoch k/n, time, samples per second, its losses
and metrics to 4 significant digits), and a short summary at the end; an evaluation run prints one line. Only the
main process prints. ``verbose=True`` on each callback gives the earlier, pytorch-accelerated output back (a line per
stage, a bar per training and evaluation epoch, a line per metric).
"""

from __future__ import annotations

import numbers
import time
from typing import TYPE_CHECKING, Any, Optional

from pytorch_accel_trainer.callbacks.base import TrainerCallback
from pytorch_accel_trainer.callbacks.readback import HostCopy, RunningSum
from pytorch_accel_trainer.console import progress_bar_class
from pytorch_accel_trainer.data import dataloader_length
from pytorch_accel_trainer.errors import validate_positive_int
from pytorch_accel_trainer.run_config import data_parallel_size, get_run_config
from pytorch_accel_trainer.tracking import metric_counts, metrics_recorded_since
from pytorch_accel_trainer.utils import model_summary_line, model_summary_table

if TYPE_CHECKING:
    from tqdm import tqdm

    from pytorch_accel_trainer.trainer import Trainer


def _plural(count: int, noun: str) -> str:
    """``1 epoch``, ``2 epochs``."""
    return f"{count} {noun}{'' if count == 1 else 's'}"


def format_value(value: Any) -> str:
    """A metric as printed: numbers to 4 significant digits, anything else as it is."""
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        return f"{value:.4g}"
    return str(value)


def format_metrics(metrics: dict) -> str:
    """``name: value`` pairs joined by `` · ``, values to 4 significant digits."""
    return " · ".join(f"{name}: {format_value(value)}" for name, value in metrics.items())


def epoch_label(trainer: Trainer) -> str:
    """``epoch k/n`` (``epoch k`` when only ``max_num_train_steps`` ends the run)."""
    epoch, num_epochs = trainer.run_history.current_epoch, get_run_config(trainer).num_epochs
    return f"epoch {epoch}" if num_epochs is None else f"epoch {epoch}/{num_epochs}"


def _print(trainer: Trainer, message: str) -> None:
    """Print on the main process of the whole run only: a multi-node run prints each line once."""
    if trainer.run_config is None or trainer.run_config.is_world_process_zero:
        trainer.print(message)


class PrintProgressCallback(TrainerCallback):
    """Prints two lines when a training run starts and a short summary when it ends, on the main process.

    The first line summarises the model (its parameters, total and trainable, its size in MiB and the precision it
    runs in: ``utils.model_summary_line``); the second says what will run (epochs, updates per epoch, the global
    batch); the end line says how long it took and the best value of the first callback that watches a metric
    (``EarlyStoppingCallback``, ...: ``TrainerCallback.watched_metric``), if there is one.

    Args:
        verbose: print pytorch-accelerated's messages instead: a line at the start and end of each run and at the
            start of each training and evaluation epoch.
        model_summary: ``"line"`` (the default): the model's one-line summary first; ``"full"``: then a table of its
            modules too (``utils.model_summary_table``, to ``model_summary_depth`` levels); ``None``: no summary.
        model_summary_depth: the levels of modules the full table shows (1: the model's children).
    """

    # class defaults too: a pytorch-accelerated subclass may define __init__ without calling this one
    verbose, _run_start, _epochs = False, 0.0, 0
    model_summary: Optional[str] = "line"
    model_summary_depth = 1

    def __init__(self, verbose: bool = False, model_summary: Optional[str] = "line", model_summary_depth: int = 1):
        if model_summary not in ("line", "full", None):
            raise ValueError(
                f"model_summary={model_summary!r} is not valid: choose 'line' (one line), 'full' (a line and a table "
                "of the modules) or None (no summary)."
            )
        validate_positive_int("model_summary_depth", model_summary_depth, "module levels", 2)
        self.verbose = verbose
        self.model_summary, self.model_summary_depth = model_summary, model_summary_depth
        self._run_start = 0.0
        self._epochs = 0

    def _summary(self, trainer: Trainer) -> list:
        """The model's summary lines; none for a model whose parameters cannot be counted (a stand-in such as a
        ``Mock``): a summary never stops a run."""
        model = trainer.get_model()
        try:
            lines = [model_summary_line(model, trainer.accelerator.mixed_precision)]
            if self.model_summary == "full":
                lines.append(model_summary_table(model, self.model_summary_depth))
        except (TypeError, AttributeError):
            return []
        return lines

    def on_training_run_start(self, trainer: Trainer, **kwargs):
        self._run_start, self._epochs = time.perf_counter(), 0
        if self.verbose:
            trainer.print("\nStarting training run")
            return
        config = get_run_config(trainer)
        epochs = "until max_num_train_steps" if config.num_epochs is None else _plural(config.num_epochs, "epoch")
        per_epoch = (
            "" if config.num_update_steps_per_epoch is None else f" of {config.num_update_steps_per_epoch} updates"
        )
        processes = f"{config.num_processes} processes" if config.num_processes > 1 else "1 process"
        if self.model_summary is not None:
            for line in self._summary(trainer):
                _print(trainer, line)
        _print(
            trainer,
            f"Training {epochs}{per_epoch}, batches of {config.train_total_batch_size} "
            f"({processes}, {trainer.device.type})",
        )

    def on_train_epoch_start(self, trainer: Trainer, **kwargs):
        if self.verbose:
            trainer.print(f"\nStarting epoch {trainer.run_history.current_epoch}")

    def on_training_run_epoch_end(self, trainer: Trainer, **kwargs):
        self._epochs += 1

    def on_eval_epoch_start(self, trainer: Trainer, **kwargs):
        if self.verbose:
            trainer.print("\nStarting eval epoch")

    def on_training_run_end(self, trainer: Trainer, **kwargs):
        if self.verbose:
            trainer.print("Finishing training run")
            return
        seconds = time.perf_counter() - self._run_start
        epochs = _plural(self._epochs, "epoch")
        summary = f"Finished {epochs} in {seconds:.3g}s ({trainer.num_update_steps_completed} updates)"
        name, best = trainer.callback_handler.watched_metric()
        if best is not None:
            summary += f" · best {name}: {format_value(best)}"
        _print(trainer, summary)

    def on_evaluation_run_start(self, trainer: Trainer, **kwargs):
        if self.verbose:
            trainer.print("\nStarting evaluation run")

    def on_evaluation_run_end(self, trainer: Trainer, **kwargs):
        if self.verbose:
            trainer.print("Finishing evaluation run")


class ProgressBarCallback(TrainerCallback):
    """Shows a tqdm bar while each epoch runs, on the main process.

    By default one bar covers an epoch's training and evaluation batches (``epoch k/n``) and disappears when the
    epoch ends, where :class:`LogMetricsCallback` prints the epoch's summary line. An evaluation run, a prediction run
    (``predict()``) and each intermediate evaluation of ``StepBasedEvaluationCallback`` get a bar of their own. While
    training, the bar shows the mean loss since the last refresh, the learning rate of each parameter group, and the
    throughput in samples per second (over all processes, from the trainer's count of samples,
    ``run_state.samples_seen``, when the batch sizes are ``int``). They are refreshed each time tqdm draws the bar
    again (at most every 0.1 s, tqdm's ``mininterval``; a value refreshed more often would never be seen), or every
    ``refresh_every_n_steps`` batches when given. A step then costs the bar a counter increment and one running-sum
    entry.

    The loss is summed on the device between refreshes and copied to the host without waiting for the device (on
    CUDA, into pinned memory, shown once the copy has arrived, at most one interval late), so the bar never adds a
    host-device sync. The loss shown is that of this process's batches. Other processes show nothing and do no work.
    In a notebook with ipywidgets the bar is a widget; without, a text bar (no "IProgress not found" warning).

    Args:
        refresh_every_n_steps: the batches between two refreshes of the loss, learning rate and throughput; by
            default (``None``) they are refreshed as the bar is drawn again.
        verbose: pytorch-accelerated's bars instead: one per training epoch and one per evaluation epoch, each left
            on screen, the training bar ending with the epoch's ``train_loss_epoch``.
    """

    def __init__(self, refresh_every_n_steps: Optional[int] = None, verbose: bool = False):
        if refresh_every_n_steps is not None:
            validate_positive_int("refresh_every_n_steps", refresh_every_n_steps, "batches", 50)
        self.refresh_every_n_steps = refresh_every_n_steps
        self.verbose = verbose
        self.pbar: tqdm | None = None
        self.eval_pbar: tqdm | None = None
        self._is_shown = False
        self._loss = RunningSum()
        self._host_copy: HostCopy | None = None
        self._postfix: dict = {}
        # the trainer's count of samples (run_state.samples_seen) at the epoch start
        self._samples_before_epoch: Any = 0
        self._epoch_start_time = 0.0

    def _create_bar(self, trainer: Trainer, total: Optional[int], description: str, initial: int = 0) -> tqdm:
        return progress_bar_class()(
            total=total,
            initial=initial,
            desc=description,
            unit="batch",
            disable=not self._is_shown,
            dynamic_ncols=True,
            leave=self.verbose,  # by default the summary line replaces the bar
        )

    def on_training_run_start(self, trainer: Trainer, **kwargs):
        self._is_shown = get_run_config(trainer).is_world_process_zero
        # made once per run: its host buffer is allocated here, never during a step
        self._host_copy = HostCopy(1, trainer.device) if self._is_shown else None

    def on_evaluation_run_start(self, trainer: Trainer, **kwargs):
        self._is_shown = get_run_config(trainer).is_world_process_zero

    def on_train_epoch_start(self, trainer: Trainer, **kwargs):
        train_batches = dataloader_length(trainer.train_dataloader)
        if self.verbose:
            total, description = train_batches, f"epoch {trainer.run_history.current_epoch} train"
        else:
            eval_batches = 0 if trainer.eval_dataloader is None else dataloader_length(trainer.eval_dataloader)
            total = None if train_batches is None or eval_batches is None else train_batches + eval_batches
            description = epoch_label(trainer)
        # a resumed epoch continues where it stopped
        self.pbar = self._create_bar(trainer, total, description, initial=trainer.epoch_first_step)
        self._loss.reset()
        self._postfix, self._samples_before_epoch = {}, trainer.run_state.samples_seen
        self._epoch_start_time = time.perf_counter()

    def on_train_step_end(
        self, trainer: Trainer, batch: Any = None, batch_output: dict | None = None, step: int = 0, **kwargs
    ):
        if self.pbar is None:  # made at the epoch start
            return
        drawn = self.pbar.update(1)  # True when the bar was drawn again (a hidden bar: None)
        if not self._is_shown or batch_output is None:
            return
        self._loss.add(batch_output["loss"])
        if self.refresh_every_n_steps is None:
            due = drawn  # as often as the bar is drawn: a value refreshed more often would never be seen
        else:
            due = (step + 1) % self.refresh_every_n_steps == 0
        if due:
            self._refresh(trainer)

    def _refresh(self, trainer: Trainer) -> None:
        loss_total, host_copy = self._loss.total, self._host_copy
        if loss_total is None or host_copy is None or self.pbar is None:
            return  # none is: a shown training run has its copy, an epoch its bar, and this step added a loss
        epoch = trainer.run_history.current_epoch
        self._show_arrived_loss(host_copy, epoch)  # the previous interval's copy, before the buffer is reused
        host_copy.start(loss_total, tag=(epoch, self._loss.count))
        self._loss.reset()
        self._show_arrived_loss(host_copy, epoch)  # complete at once on the CPU; on CUDA, usually at the next refresh
        param_groups = trainer.optimizer.param_groups if trainer.optimizer is not None else []  # train() needs one
        learning_rates = [group["lr"] for group in param_groups]
        if all(isinstance(lr, numbers.Real) for lr in learning_rates):  # a tensor lr would need a sync
            self._postfix["lr"] = ",".join(f"{lr:.3g}" for lr in learning_rates)
        elapsed = time.perf_counter() - self._epoch_start_time
        samples = trainer.run_state.samples_seen - self._samples_before_epoch
        if isinstance(samples, int) and samples and elapsed > 0:  # a tensor size (a hook's) would need a sync to read
            self._postfix["samples/s"] = f"{samples * data_parallel_size(trainer) / elapsed:.1f}"
        self.pbar.set_postfix(self._postfix, refresh=False)

    def _show_arrived_loss(self, host_copy: HostCopy, epoch: int) -> None:
        arrived = host_copy.get_values()
        if arrived is not None:
            (copy_epoch, count), (total,) = arrived
            if copy_epoch == epoch and count:  # a copy left from the previous epoch is stale
                self._postfix["loss"] = f"{total / count:.4g}"

    def on_train_epoch_end(self, trainer: Trainer, **kwargs):
        if self._is_shown and self.pbar is not None and "train_loss_epoch" in trainer.run_history.get_metric_names():
            self._postfix["loss"] = f"{trainer.run_history.get_latest_metric('train_loss_epoch'):.4g}"
            self.pbar.set_postfix(self._postfix, refresh=False)
        if self.verbose:
            self._close_train_bar()  # else at the end of the epoch's evaluation too

    def on_eval_epoch_start(self, trainer: Trainer, is_intermediate: bool = False, **kwargs):
        if self.verbose or is_intermediate or self.pbar is None:  # a bar of its own: verbose, mid-epoch, or evaluate()
            description = "eval" if self.verbose or is_intermediate else "evaluation"
            self.eval_pbar = self._create_bar(trainer, dataloader_length(trainer.eval_dataloader), description)

    def on_eval_step_end(self, trainer: Trainer, batch: Any = None, batch_output: dict | None = None, **kwargs):
        bar = self.eval_pbar or self.pbar
        if bar is not None:  # made at the epoch start
            bar.update(1)

    def on_eval_epoch_end(self, trainer: Trainer, **kwargs):
        self._close_eval_bar()

    def on_training_run_epoch_end(self, trainer: Trainer, **kwargs):
        self._close_train_bar()

    def on_predict_run_start(self, trainer: Trainer, **kwargs):
        self._is_shown = trainer.accelerator.is_main_process
        self.eval_pbar = self._create_bar(trainer, dataloader_length(trainer.predict_dataloader), "predict")

    def on_predict_step_end(self, trainer: Trainer, batch: Any = None, batch_output: Any = None, **kwargs):
        if self.eval_pbar is not None:  # made at the run start
            self.eval_pbar.update(1)

    def on_predict_run_end(self, trainer: Trainer, **kwargs):
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
    """Logs the latest value of each metric recorded in the current run, on the main process.

    By default it prints one line per epoch, once the epoch's training and evaluation are done::

        epoch 3/15 · 0.21s · 6543 samples/s · train_loss_epoch: 0.1532 · eval_loss_epoch: 0.1101 · accuracy: 0.9661

    (the time covers the epoch's training and evaluation; samples per second count the training samples of every
    process), and one line per evaluation run. Values have 4 significant digits.

    :meth:`log_metrics` is called as in pytorch-accelerated: at the end of each training epoch with the metrics whose
    name contains ``train``, and at the end of each evaluation epoch with the others; only the metrics the current
    ``train()`` or ``evaluate()`` recorded are passed (after ``evaluate()``, ``evaluation_loss`` without the
    ``eval_loss_epoch`` of an earlier training run, which the run history keeps). Override it to send them elsewhere.

    Args:
        verbose: print each metric on a line of its own after each training and evaluation epoch, with all its
            digits, as pytorch-accelerated does.
    """

    #: The number of values of each metric when the current run started (``None``: outside a run, log them all).
    _value_counts_at_run_start: dict | None = None
    _run_config = None  # the run_config of the run those counts belong to: each train() / evaluate() makes a new one

    # class defaults too: a pytorch-accelerated subclass (an AzureML logger, say) may define __init__ without super()
    verbose: bool = False
    _pending: dict | None = None
    _epoch_start: float = 0.0
    _samples_before_epoch: int = 0

    def __init__(self, verbose: bool = False):
        self.verbose = verbose
        self._pending = {}
        self._epoch_start = 0.0
        self._samples_before_epoch = 0  # the trainer's count of samples (run_state.samples_seen) when the epoch began

    def on_training_run_start(self, trainer: Trainer, **kwargs):
        self._start_run(trainer)

    def on_evaluation_run_start(self, trainer: Trainer, **kwargs):
        self._start_run(trainer)
        self._epoch_start = time.perf_counter()

    def on_train_epoch_start(self, trainer: Trainer, **kwargs):
        self._start_run(trainer)  # in case a subclass overrides on_training_run_start without super()
        self._pending, self._samples_before_epoch = {}, trainer.run_state.samples_seen
        self._epoch_start = time.perf_counter()

    def on_eval_epoch_start(self, trainer: Trainer, **kwargs):
        self._start_run(trainer)

    def _start_run(self, trainer: Trainer) -> None:
        """Take the metric counts at the start of a run, once per run (the first event of the run that reaches here)."""
        if trainer.run_config is not self._run_config:
            self._run_config = trainer.run_config
            self._value_counts_at_run_start = metric_counts(trainer.run_history)

    def on_train_epoch_end(self, trainer: Trainer, **kwargs):
        self._log_latest(trainer, lambda name: "train" in name)

    def on_eval_epoch_end(self, trainer: Trainer, **kwargs):
        self._log_latest(trainer, lambda name: "train" not in name)

    def on_training_run_epoch_end(self, trainer: Trainer, **kwargs):
        if self.verbose:
            return
        seconds = time.perf_counter() - self._epoch_start
        samples = trainer.run_state.samples_seen - self._samples_before_epoch
        speed = ""
        if isinstance(samples, int) and samples and seconds > 0:  # a tensor size (a hook's) would need a sync to read
            speed = f" · {samples * data_parallel_size(trainer) / seconds:.0f} samples/s"
        metrics = f" · {format_metrics(self._pending)}" if self._pending else ""
        _print(trainer, f"{epoch_label(trainer)} · {seconds:.2g}s{speed}{metrics}")
        self._pending = {}

    def on_evaluation_run_end(self, trainer: Trainer, **kwargs):
        if self.verbose:
            return
        seconds = time.perf_counter() - self._epoch_start
        metrics = f" · {format_metrics(self._pending)}" if self._pending else ""
        _print(trainer, f"evaluation · {seconds:.2g}s{metrics}")
        self._pending = {}

    def _log_latest(self, trainer: Trainer, wanted) -> None:
        # the values of earlier runs are in the history too: leave them out (outside a run, log them all)
        recorded = metrics_recorded_since(trainer.run_history, self._value_counts_at_run_start or {})
        self.log_metrics(trainer, {name: value for name, value in recorded.items() if wanted(name)})

    def log_metrics(self, trainer: Trainer, metrics: dict) -> None:
        """Print the metrics (``verbose``: each as ``name: value`` on a line of its own; by default in the epoch's
        summary line); override to log somewhere else."""
        if not self.verbose:
            self._pending = {**(self._pending or {}), **metrics}
            return
        for name, value in metrics.items():
            trainer.print(f"\n{name}: {value}")


#: pytorch-accelerated's name for :class:`LogMetricsCallback`.
PrintMetricsCallback = LogMetricsCallback
