"""The state of one training run, in one place: counters, epoch position, accumulation window, requests.

A :class:`RunState` is created by each ``train()`` (``trainer.run_state``) and stays readable after the run
(``trainer.num_update_steps_completed`` reads it). The trainer's loop is the only writer of its counters;
callbacks and the persistence functions read it, and queue requests on it (a save, a stop, a preemption).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

from pytorch_accel_trainer.errors import StopTrainingError
from pytorch_accel_trainer.state.training_state import ResumePlan, ResumePosition
from pytorch_accel_trainer.tracking import LossTracker, StepMetricsTracker

if TYPE_CHECKING:
    from pytorch_accel_trainer.loop.non_finite import NonFinitePolicy
    from pytorch_accel_trainer.run_config import TrainOptions
    from pytorch_accel_trainer.state.preemption import SignalCatcher


@dataclass
class RunState:
    """Everything a training run changes as it goes, initialised here and nowhere else.

    Attributes:
        options: the validated ``train()`` arguments of this run (``None`` before the first ``train()``).
        num_update_steps_completed: optimizer updates made in this run (continued from a resumed state).
        epoch: the epoch running, or next to run, as an index into the run's epochs from 0; the one epoch
            counter of the loop (``run_history.current_epoch`` is the history's, which may continue across runs).
        epoch_first_step: the first micro-batch of the current epoch: 0, or the batches already trained on when
            a resumed run continues an epoch.
        train_epoch_length: the micro-batches of a training epoch on this process, ``None`` when unknown.
        step_closes_window: whether the micro-batch being run closes an accumulation window (or the epoch), so
            that its backward pass synchronises gradients and an update follows.
        items_in_window: ``num_items_in_batch`` summed over the current accumulation window (0 when not given).
        train_loss_tracker: the running, weighted sum of this epoch's training losses, on the device.
        train_step_metrics: the same for the extra scalars ``calculate_train_batch_loss`` returns (``accuracy``, ...).
        in_training_run: between the start and the end of the epochs of ``train()``; saves then wait for the
            next point between two optimizer updates.
        stop_request: a ``StopTrainingError`` a callback raised, held until the processes agree to stop.
        save_requests: training states asked for during the run, by folder, taken at the next safe point.
        resume: what a resumed run still has to restore as it reaches the saved position (``None`` once done).
        preemption_signal: a signal received that asks the run to save and exit.
        preemption_save_dir: where a preempted run saves, while preemption is enabled.
        signal_catcher: the installed signal handlers, while preemption is enabled.
        non_finite_policy: what to do with non-finite gradients, if ``skip_non_finite_steps`` was called.
        samples_seen: the ``batch_size`` of every training step of this run on this process, summed (a device
            tensor if a hook returns tensor sizes: read once, for the :class:`TrainResult`).
        started_at: ``time.perf_counter()`` when the epochs of this run started.
        metric_counts_at_start: the values each run-history metric had then (see ``tracking.metric_counts``).
        first_epoch: ``epoch`` then: 0, or the epoch a resumed run continues.
    """

    options: Optional["TrainOptions"] = None
    num_update_steps_completed: int = 0
    epoch: int = 0
    epoch_first_step: int = 0
    train_epoch_length: Optional[int] = None
    step_closes_window: bool = False
    items_in_window: Any = 0
    train_loss_tracker: LossTracker = field(default_factory=LossTracker)
    train_step_metrics: StepMetricsTracker = field(default_factory=StepMetricsTracker)
    in_training_run: bool = False
    stop_request: Optional[StopTrainingError] = None
    save_requests: dict = field(default_factory=dict)
    resume: Optional[ResumePlan] = None
    preemption_signal: Optional[int] = None
    preemption_save_dir: Optional[Path] = None
    signal_catcher: Optional["SignalCatcher"] = None
    non_finite_policy: Optional["NonFinitePolicy"] = None
    samples_seen: Any = 0
    started_at: Optional[float] = None
    metric_counts_at_start: dict = field(default_factory=dict)
    first_epoch: int = 0

    def start_epochs(self, metric_counts: dict) -> None:
        """Note when and where the epochs of this run start, and what the run history held then."""
        self.started_at, self.first_epoch, self.metric_counts_at_start = time.perf_counter(), self.epoch, metric_counts

    def reached_max_steps(self) -> bool:
        """Whether the user's ``max_num_train_steps`` is reached (not run_config's planned total: a resume with
        another batch size changes the plan)."""
        limit = None if self.options is None else self.options.max_num_train_steps
        return limit is not None and self.num_update_steps_completed >= limit

    def position(self, step: Optional[int]) -> ResumePosition:
        """Where a state taken now resumes: before micro-batch ``step`` of this epoch, or (``step=None``) at the
        start of epoch ``self.epoch``, which the loop advances once an epoch is done."""
        if step is None:
            return ResumePosition(self.epoch, 0, "before_iterator")
        return ResumePosition(self.epoch, step, "after_iterator")

    def request_save(
        self,
        parent: Path,
        kinds,
        checkpoint_kwargs: Optional[dict],
        max_rolling: Optional[int],
        asynchronous: bool = False,
        name: Optional[str] = None,
    ) -> None:
        """Queue a training state under ``parent``; requests for one folder before a safe point merge into one
        (asynchronous only when each of them is; named as the first that gives a name)."""
        request = self.save_requests.setdefault(
            parent,
            {
                "kinds": set(),
                "checkpoint_kwargs": {},
                "max_rolling": max_rolling,
                "asynchronous": asynchronous,
                "name": name,
            },
        )
        request["name"] = request["name"] or name
        request["asynchronous"] = request["asynchronous"] and asynchronous
        request["kinds"].update(kinds)
        request["checkpoint_kwargs"].update(checkpoint_kwargs or {})

    def take_save_requests(self) -> dict:
        """Return the queued saves and clear the queue."""
        requests, self.save_requests = self.save_requests, {}
        return requests

    def hold_stop(self, error: StopTrainingError) -> None:
        """Keep the first ``StopTrainingError`` raised since the last agreement point."""
        self.stop_request = self.stop_request or error


@dataclass(frozen=True)
class TrainResult:
    """What ``Trainer.train()`` returns: a summary of the run; ``trainer.run_history`` holds every value.

    Attributes:
        metrics: the latest value of each metric this run recorded (``train_loss_epoch``, ``eval_loss_epoch``,
            the step metrics, what callbacks recorded).
        best_metric_name, best_metric: the metric the first monitoring callback (``EarlyStoppingCallback``,
            ``SaveBestModelCallback``, ...) watches, and its best value in this run; ``None`` without one.
        num_epochs: the training epochs run to their end in this call (a resumed run counts those it ran; an
            epoch after which a callback stopped the run counts).
        num_update_steps: the optimizer updates made so far, a resumed run's earlier ones included.
        num_samples: the training samples of this call, over every process (each process's ``batch_size``
            sum times the number of processes, which run the same steps).
        wall_time_seconds: from the first epoch's start to the end of the run.
        samples_per_second: ``num_samples / wall_time_seconds``, evaluation time included.
        stopped_early: whether a callback ended the run before its last epoch (reaching ``max_num_train_steps`` is
            the planned end, not an early one).
    """

    metrics: dict
    best_metric_name: Optional[str]
    best_metric: Optional[float]
    num_epochs: int
    num_update_steps: int
    num_samples: int
    wall_time_seconds: float
    samples_per_second: float
    stopped_early: bool
