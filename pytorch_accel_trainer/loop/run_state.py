"""The state of one training run, in one place: counters, epoch position, accumulation window, trackers, requests.

A :class:`RunState` is created by each ``train()`` (``trainer.run_state``) and stays readable after the run
(``trainer.num_update_steps_completed`` reads it). Its fields change only through its own methods (the transitions
below) or in ``trainer.py``'s loop; callbacks and the safe points' functions (``safe_points.py``) read them, and
queue requests through the methods (a save, a stop, a preemption). ``tests/test_structure.py`` holds this.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional

import torch

from pytorch_accel_trainer.errors import StopTrainingError, TimeBudgetExceeded
from pytorch_accel_trainer.loop.batches import loss_weight
from pytorch_accel_trainer.parallel.distributed import stop_reason
from pytorch_accel_trainer.state.manager import ResumePlan, ResumePosition
from pytorch_accel_trainer.state.storage import Location, as_location
from pytorch_accel_trainer.tracking import BATCH_OUTPUT_KEYS, LossTracker, StepMetricsTracker

if TYPE_CHECKING:
    from pytorch_accel_trainer.loop.non_finite import NonFinitePolicy
    from pytorch_accel_trainer.loop.stream_position import StreamPositions
    from pytorch_accel_trainer.loop.time_budget import TimeBudget
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
        batch_idx: the index in its epoch of the batch being run, training or evaluation, from 0 (``None`` before the
            first); read as ``trainer.batch_idx``.
        closes_window: whether the training micro-batch being run closes its accumulation window (or the epoch): its
            backward pass syncs the gradients, and the update follows.
        retrying_window: while the micro-batches of a window run again for non-finite gradients (no event fires, no
            sample is counted again).
        items_in_window: ``num_items_in_batch`` summed over the current accumulation window (0 when not given).
        window_needs_correction: whether the gradients of the window that just closed need a correction before its
            update (:func:`~pytorch_accel_trainer.loop.accumulation.finish_window`): a partial last window of an epoch
            of unknown length, or losses weighted by ``num_items_in_batch``.
        train_loss_tracker: the running, weighted sum of this epoch's training losses, on the device.
        train_step_metrics: the same for the extra scalars ``calculate_train_batch_loss`` returns (``accuracy``, ...).
        eval_loss_tracker, eval_step_metrics: the same for the current evaluation epoch (of ``train()``,
            ``evaluate()`` or ``run_extra_eval_epoch``; an ``evaluate()`` uses the last run's state).
        eval_batch_real_rows: in an evaluation epoch, the rows of this process's batch that are real samples when
            the rest only repeat samples so that every process runs the same steps (the last batch of a
            multi-process run); else ``None``. Read as ``trainer.eval_batch_real_rows``.
        in_training_run: between the start and the end of the epochs of ``train()``; saves then wait for the
            next point between two optimizer updates.
        stop_request: a ``StopTrainingError`` a callback raised, held until the processes agree to stop.
        save_requests: training states asked for during the run, by folder, taken at the next safe point.
        resume: what a resumed run still has to restore as it reaches the saved position (``None`` once done).
        preemption_signal: a signal received that asks the run to save and exit.
        preemption_save_dir: where a preempted run saves, while preemption is enabled.
        signal_catcher: the installed signal handlers, while preemption is enabled.
        non_finite_policy: what to do with non-finite gradients, if ``skip_non_finite_steps`` was called.
        non_finite_updates_skipped: the updates that policy skipped in the run, kept when the run's epochs end.
        error_after_run: an error to raise once every callback has ended the run (the policy's
            ``NonFiniteGradientsError``, under ``on_exhausted="raise"``).
        stop_reason: the message of the ``StopTrainingError`` that ended the run, if one did.
        samples_seen: the ``batch_size`` of every training step of this run on this process, summed (a device
            tensor if a hook returns tensor sizes: read once, for the :class:`TrainResult`).
        started_at: ``time.perf_counter()`` when the epochs of this run started.
        metric_counts_at_start: the values each run-history metric had then (see ``tracking.metric_counts``).
        first_epoch: ``epoch`` then: 0, or the epoch a resumed run continues.
        nothing_left_to_train: whether a resumed run had already reached ``num_epochs`` or ``max_num_train_steps``
            then (a finished run resumed): it trains nothing.
        run_id: the run's identity, written in each training state's manifest: made as a new run starts, adopted
            from the state a resumed run continues (a new one for a state saved before runs had one).
        is_new_run: whether the run started afresh (no state resumed).
        run_facts: the settings a resumed run must share with the saved one to continue it exactly (world size,
            layout, batch size, accumulation, dataset length: ``loop/trainer_parts.py``'s ``run_facts``), taken once
            as the run starts and written in each of its training states.
        checked_save_dirs: the folders of training states checked to hold no other run's states.
        history_epoch_offset: the run history's epoch minus ``epoch`` as the epochs start (the history may count
            earlier runs' epochs too); the history's epoch of any position of the run is its epoch plus this.
        open_epoch_at: the micro-batches of the current epoch trained on as of its last update, while it has batches
            left: a stop (the step limit, a ``StopTrainingError``, the time budget) leaves it there, and a state taken
            then resumes at its next batch. ``None`` before the epoch's first update and once its last batch has run.
        epoch_trained: whether every batch of the current epoch has been trained on (its evaluation may still run);
            a state taken before the loop moves on then resumes at the next epoch.
        epochs_ended: the epochs of this run that reached their end (``on_training_run_epoch_end`` fired): once the
            last one has, the run ran to its planned end, whatever stops it there.
        epoch_samples_per_step: the samples one micro-batch step of the current epoch takes, over every process.
        epoch_sample_base: ``(samples, step)``: the epoch's samples trained before its micro-batch ``step``, where its
            dataloader started; ``(0, 0)`` but in an epoch a resume on another number of processes split again
            (``loop/data_position.py``). A state's position counts the epoch's samples from it.
        stream_positions: the states of the training stream after its last batches, when it can say where it is
            (``loop/stream_position.py``); ``None`` for map-style data and streams that cannot.
        time_budget: the run's ``max_time``, checked at each point where the processes agree to stop.
        stopped_by_time_budget: whether the time budget ended the run.
        accumulation_steps: the micro-batches of an accumulation window (``options.gradient_accumulation_steps``).
        scheduler_per_epoch: whether the scheduler steps once per epoch (``scheduler_interval="epoch"``), not after
            each update.
    """

    options: Optional[TrainOptions] = None
    num_update_steps_completed: int = 0
    epoch: int = 0
    epoch_first_step: int = 0
    train_epoch_length: Optional[int] = None
    batch_idx: Optional[int] = None
    closes_window: bool = False
    retrying_window: bool = False
    items_in_window: Any = 0
    window_needs_correction: bool = False
    train_loss_tracker: LossTracker = field(default_factory=LossTracker)
    train_step_metrics: StepMetricsTracker = field(default_factory=StepMetricsTracker)
    eval_loss_tracker: LossTracker = field(default_factory=LossTracker)
    eval_step_metrics: StepMetricsTracker = field(default_factory=StepMetricsTracker)
    eval_batch_real_rows: Optional[int] = None
    in_training_run: bool = False
    stop_request: Optional[StopTrainingError] = None
    save_requests: dict = field(default_factory=dict)
    resume: Optional[ResumePlan] = None
    preemption_signal: Optional[int] = None
    preemption_save_dir: Optional[Location] = None
    signal_catcher: Optional[SignalCatcher] = None
    non_finite_policy: Optional[NonFinitePolicy] = None
    non_finite_updates_skipped: int = 0
    error_after_run: Optional[Exception] = None
    stop_reason: Optional[str] = None
    samples_seen: Any = 0
    started_at: Optional[float] = None
    metric_counts_at_start: dict = field(default_factory=dict)
    first_epoch: int = 0
    nothing_left_to_train: bool = False
    run_id: Optional[str] = None
    is_new_run: bool = True
    run_facts: dict = field(default_factory=dict)
    checked_save_dirs: set = field(default_factory=set)
    history_epoch_offset: int = 0
    open_epoch_at: Optional[int] = None
    epoch_trained: bool = False
    epochs_ended: int = 0
    epoch_samples_per_step: int = 0
    epoch_sample_base: tuple = (0, 0)
    stream_positions: Optional[StreamPositions] = None
    time_budget: Optional[TimeBudget] = None
    stopped_by_time_budget: bool = False
    accumulation_steps: int = field(init=False, default=1)
    scheduler_per_epoch: bool = field(init=False, default=False)

    def __post_init__(self) -> None:
        if self.options is not None:  # what the step reads of the options, without an Optional to check each time
            self.accumulation_steps = self.options.gradient_accumulation_steps
            self.scheduler_per_epoch = self.options.scheduler_interval == "epoch"

    # ------------------------------------------------------------------------------------------------
    # The run and its epochs
    # ------------------------------------------------------------------------------------------------

    def begin_resume(self, plan: Optional[ResumePlan], run_id: str, run_facts: dict) -> None:
        """Continue from a loaded training state: its update count and epoch, and what is still to restore as the
        run reaches the saved position (nothing without one); ``run_id`` is the run's identity, ``run_facts`` its
        settings."""
        self.resume, self.run_id, self.is_new_run, self.run_facts = plan, run_id, plan is None, run_facts
        if plan is not None:
            self.num_update_steps_completed = plan.num_update_steps_completed
            self.epoch = plan.position.loop_epoch

    def end_resume_at(self, rng_restore_point: str) -> Optional[dict]:
        """Where the saved run took its RNG states (``"before_iterator"`` or ``"after_iterator"``): if that is
        ``rng_restore_point``, end the resume and return those states, to be put back now; else ``None``."""
        if self.resume is None or self.resume.position.rng_restore_point != rng_restore_point:
            return None
        rng_state, self.resume = self.resume.rng_state, None
        return rng_state

    def has_work_at_safe_point(self) -> bool:
        """Whether the next point between two updates has anything to do: finish a resume, take a save asked for, or
        look for a preemption signal (received here, or on another process when preemption is enabled)."""
        return (
            self.resume is not None
            or bool(self.save_requests)
            or self.preemption_signal is not None
            or self.preemption_save_dir is not None
        )

    def load_update_count(self, num_update_steps_completed: int) -> None:
        """Take the update count of a training state loaded outside a run (``load_training_state``)."""
        self.num_update_steps_completed = num_update_steps_completed

    def start_epochs(self, metric_counts: dict, history_epoch: int) -> None:
        """Enter the epochs of the run (saves now wait for a point between two updates); note when and where they
        start, what the run history held then, and the history's epoch (``history_epoch``) of the first one."""
        self.in_training_run = True
        self.started_at, self.first_epoch, self.metric_counts_at_start = time.perf_counter(), self.epoch, metric_counts
        self.history_epoch_offset = history_epoch - self.epoch
        num_epochs = None if self.options is None else self.options.num_epochs
        self.nothing_left_to_train = not self.is_new_run and (
            self.reached_max_steps() or (num_epochs is not None and self.epoch >= num_epochs)
        )

    def end_epoch(self) -> None:
        """Note that the current epoch reached its end (its evaluation and end hooks ran)."""
        self.epochs_ended += 1

    def next_epoch(self) -> None:
        """Move the loop on to the next epoch, from its first batch."""
        self.epoch += 1
        self.open_epoch_at, self.epoch_trained, self.epoch_sample_base = None, False, (0, 0)

    def reached_max_steps(self) -> bool:
        """Whether the user's ``max_num_train_steps`` is reached (not run_config's planned total: a resume with
        another batch size changes the plan)."""
        limit = None if self.options is None else self.options.max_num_train_steps
        return limit is not None and self.num_update_steps_completed >= limit

    def position(self, step: Optional[int]) -> ResumePosition:
        """Where a state taken now resumes: before micro-batch ``step`` of this epoch; or (``step=None``, between
        updates outside the loop's batches: between epochs, or as a run ends) at the next batch not trained on: after
        the last update of an epoch a stop cut short, at the start of the next epoch once every batch of this one
        ran, else at the start of ``self.epoch``."""
        if step is None and self.open_epoch_at is not None:
            step = self.open_epoch_at  # stopped inside the epoch: the rest of it is still to run
        if step is not None:
            base_samples, base_step = self.epoch_sample_base
            samples = base_samples + (step - base_step) * self.epoch_samples_per_step
            return ResumePosition(self.epoch, step, "after_iterator", samples)
        return ResumePosition(self.epoch + 1 if self.epoch_trained else self.epoch, 0, "before_iterator")

    def start_epoch_data(self, samples_per_step: int, resumed_at: Optional[tuple] = None) -> None:
        """Note how many samples a micro-batch step of this epoch takes over every process, and (``resumed_at``,
        ``(samples, step)``) where a resume split the epoch's data again (see ``epoch_sample_base``)."""
        self.epoch_samples_per_step, self.epoch_sample_base = samples_per_step, resumed_at or (0, 0)

    def history_epoch(self, position: ResumePosition) -> int:
        """The run history's epoch (``current_epoch``) of the epoch ``position`` is in: the one a resumed run
        continues (its shuffle order depends on it), even once the history moved past an epoch a stop cut short."""
        return position.loop_epoch + self.history_epoch_offset

    # ------------------------------------------------------------------------------------------------
    # A training epoch: its batches, the accumulation window, the updates
    # ------------------------------------------------------------------------------------------------

    def start_train_epoch(self, epoch_length: Optional[int]) -> None:
        """Start a training epoch of ``epoch_length`` micro-batches (``None``: unknown) with empty trackers."""
        self.train_loss_tracker.reset()
        self.train_step_metrics.reset()
        self.train_epoch_length = epoch_length

    def restore_train_trackers(self, loss_state: dict, metrics_state: dict) -> None:
        """Put the epoch's training trackers back to a state of theirs: a resumed epoch's, or a non-finite
        window's snapshot (:meth:`snapshot_train_trackers`)."""
        self.train_loss_tracker.load_state_dict(loss_state)
        self.train_step_metrics.load_state_dict(metrics_state)

    def snapshot_train_trackers(self) -> tuple[dict, dict]:
        """A copy of the epoch's training trackers (device tensors cloned, no sync), for
        :meth:`restore_train_trackers`."""
        loss_state = _cloned(self.train_loss_tracker.state_dict())
        metrics_state = {name: _cloned(state) for name, state in self.train_step_metrics.state_dict().items()}
        return loss_state, metrics_state

    def record_train_batch(self, batch_output: dict, first_try: bool = True) -> None:
        """Add a micro-batch's loss and step metrics to the epoch's (weighted by ``batches.loss_weight``); its
        samples count once, on its first try (not when a non-finite window is run again)."""
        weight = loss_weight(batch_output, None)
        self.train_loss_tracker.update(batch_output["loss"], weight)
        if not BATCH_OUTPUT_KEYS.issuperset(batch_output):  # accuracy etc.: averaged like the loss
            self.train_step_metrics.update(batch_output, weight)
        if first_try:
            self.samples_seen += batch_output["batch_size"]

    def scale_loss(self, batch_output: dict, step: int) -> torch.Tensor:
        """The loss of micro-batch ``step`` to back-propagate: its gradients, added over the window, are those of one
        large batch.

        The loss is divided by the micro-batches of its window (fewer in a partial last window of an epoch of known
        length), or, with ``num_items_in_batch``, multiplied by it (the window's total divides the gradients at the
        update: ``accumulation.finish_window``). A full window without it costs no tensor operation at the update.
        """
        loss, accumulation = batch_output["loss"], self.accumulation_steps
        if "num_items_in_batch" in batch_output:
            items = batch_output["num_items_in_batch"]
            opens_window = step % accumulation == 0
            self.items_in_window = items if opens_window else self.items_in_window + items
            return loss * items
        if accumulation == 1:
            return loss
        window_start = step - step % accumulation
        epoch_length = self.train_epoch_length  # None: unknown, corrected at the update if the stream ends early
        micro_batches = accumulation if epoch_length is None else min(accumulation, epoch_length - window_start)
        return loss if micro_batches == 1 else loss / micro_batches

    def take_window_items(self) -> Any:
        """Return the window's ``num_items_in_batch`` sum and start the next window at 0."""
        items, self.items_in_window = self.items_in_window, 0
        return items

    def end_window(self, step: int, is_last_batch: bool) -> None:
        """Note that the accumulation window closing at micro-batch ``step`` has run: a stop from here on leaves
        the epoch at its next batch, or (``is_last_batch``) after all of it; and whether its gradients need a
        correction before the update (see ``window_needs_correction``)."""
        self.open_epoch_at, self.epoch_trained = (None, True) if is_last_batch else (step + 1, False)
        stream_ended_early = self.train_epoch_length is None and (step + 1) % self.accumulation_steps != 0
        items_given = not (isinstance(self.items_in_window, int) and self.items_in_window == 0)
        self.window_needs_correction = stream_ended_early or items_given

    # ------------------------------------------------------------------------------------------------
    # An evaluation epoch
    # ------------------------------------------------------------------------------------------------

    def start_eval_epoch(self) -> None:
        """Start an evaluation epoch with empty trackers."""
        self.eval_loss_tracker.reset()
        self.eval_step_metrics.reset()

    def start_eval_batch(self, real_rows: Optional[int]) -> None:
        """Note how many rows of this evaluation batch are real samples (``None``: all; see
        ``batches.real_rows_in_batch``)."""
        self.eval_batch_real_rows = real_rows

    def record_eval_batch(self, batch_output: dict) -> None:
        """Add an evaluation batch's loss and step metrics to the epoch's, its real rows only."""
        weight = loss_weight(batch_output, self.eval_batch_real_rows)
        self.eval_loss_tracker.update(batch_output["loss"], weight)
        self.eval_step_metrics.update(batch_output, weight)

    def end_eval_epoch(self) -> None:
        """Leave the evaluation epoch's batches: no batch repeats samples any more."""
        self.eval_batch_real_rows = None

    # ------------------------------------------------------------------------------------------------
    # Requests: stops, saves, preemption, the non-finite policy
    # ------------------------------------------------------------------------------------------------

    def hold_stop(self, error: StopTrainingError) -> None:
        """Keep the first ``StopTrainingError`` raised since the last agreement point."""
        self.stop_request = self.stop_request or error

    def check_time_budget(self, point: str) -> None:
        """At an agreement ``point`` (see ``TimeBudget.is_spent``), hold a stop when the time budget would be spent
        before the next one; a clock read, no sync."""
        if self.time_budget is not None and self.time_budget.is_spent(point) and self.stop_request is None:
            self.hold_stop(self.time_budget.exceeded(self.num_update_steps_completed))

    def drop_stop(self, error: Optional[StopTrainingError] = None) -> None:
        """Forget the held stop: the run has stopped, for ``error`` (its message is the ``stop_reason``). A stop by
        the time budget queues a state in ``max_time_save_dir``, if given."""
        self.stop_request = None
        if error is None:
            return
        self.stop_reason = stop_reason(error)  # the same on every process
        self.stopped_by_time_budget = isinstance(error, TimeBudgetExceeded)
        save_dir = None if self.options is None else self.options.max_time_save_dir
        if self.stopped_by_time_budget and save_dir is not None:
            self.request_save(as_location(save_dir), ("rolling",), None, None)

    def request_save(
        self,
        parent: Location,
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

    def start_preemption(self, save_dir: Location, signal_catcher: SignalCatcher) -> None:
        """Hold the installed signal handlers and the folder a preempted run saves to."""
        self.preemption_save_dir, self.signal_catcher = save_dir, signal_catcher

    def end_preemption(self) -> None:
        """Put back the signal handlers that :meth:`start_preemption` holds, if any."""
        if self.signal_catcher is not None:
            self.signal_catcher.uninstall()
        self.signal_catcher, self.preemption_save_dir = None, None

    def receive_preemption_signal(self, signal_number: int) -> None:
        """Note a signal that asks the run to save and exit (safe in a signal handler)."""
        self.preemption_signal = signal_number

    def set_non_finite_policy(self, policy: Optional[NonFinitePolicy]) -> None:
        """Check each update's gradients under ``policy`` from now on (``None``: check nothing)."""
        self.non_finite_policy = policy

    def end_non_finite_policy(self) -> Optional[NonFinitePolicy]:
        """Check no gradient any more (the run's epochs are over); keep what the policy did for the run's result
        (its skips, the error it asks to raise) and return it."""
        policy, self.non_finite_policy = self.non_finite_policy, None
        if policy is not None:
            self.non_finite_updates_skipped = policy.skipped_in_run
            self.error_after_run = policy.error
        return policy

    def end_epochs(self) -> None:
        """Leave the epochs of the run: saves are taken at once from here on, and the time budget is no longer
        checked."""
        self.in_training_run = False
        self.time_budget = None


def _cloned(tracker_state: dict) -> dict:
    return {key: value.clone() if isinstance(value, torch.Tensor) else value for key, value in tracker_state.items()}


@dataclass(frozen=True)
class TrainResult:
    """What ``Trainer.train()`` returns: a summary of the run; ``trainer.run_history`` holds every value.

    Attributes:
        metrics: the latest value of each metric this run recorded (``train_loss_epoch``, ``eval_loss_epoch``,
            the step metrics, what callbacks recorded).
        best_metric_name, best_metric: the metric the first callback that watches one (``EarlyStoppingCallback``,
            ``SaveBestModelCallback``, ...: ``TrainerCallback.watched_metric``) watches, and its best value in this
            run; ``None`` without one.
        num_epochs: the training epochs of this call that recorded their ``train_loss_epoch`` (a resumed run counts
            those it ran): an epoch a stop or the step limit cut short counts.
        num_update_steps: the optimizer updates made so far, a resumed run's earlier ones included.
        num_samples: the training samples of this call, over every process (each process's ``batch_size``
            sum times the number of processes, which run the same steps).
        wall_time_seconds: from the first epoch's start to the end of the run.
        samples_per_second: ``num_samples / wall_time_seconds``, evaluation time included.
        stopped_early: whether a ``StopTrainingError`` (a callback's, the time budget's) ended the run before its last
            epoch's end, inside that epoch included (reaching ``max_num_train_steps``, or a stop as the last epoch
            ends, is the planned end, not an early one).
        stop_reason: why the run was stopped, when a ``StopTrainingError`` ended it (a callback's, or the non-finite
            policy's ``on_exhausted="stop"``): its message; else ``None``.
        non_finite_updates_skipped: the optimizer updates skipped for non-finite gradients
            (``SkipNonFiniteStepsCallback``, ``skip_non_finite_steps``); 0 without such a policy.
        nothing_left_to_train: whether the run resumed a state that had already reached ``num_epochs`` or
            ``max_num_train_steps`` (a finished run resumed, as a requeued job does after its last save), so it
            trained nothing; the state is loaded all the same.
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
    stop_reason: Optional[str] = None
    non_finite_updates_skipped: int = 0
    nothing_left_to_train: bool = False


def validate_not_in_training_run(in_training_run: bool, method: str) -> None:
    """Refuse ``predict()`` or ``lr_find()`` called from inside a training run (a callback or a hook): each prepares
    the model again, which the run's prepared model and dataloaders cannot survive."""
    if in_training_run:
        raise RuntimeError(
            f"{method}() was called inside a training run (from a callback or a hook): it prepares the model anew, "
            f"which would break the run. Call {method}() before train() or after it returns; to measure during a "
            "run, use run_extra_eval_epoch()."
        )
