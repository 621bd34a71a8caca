"""What a run records: each epoch's mean loss and step metrics over every process, and the run's summary.

Functions the trainer calls at the end of each epoch (one read back from the device per epoch) and as ``train()``
returns; they take what they need as arguments.
"""

from __future__ import annotations

import time

from accelerate import Accelerator
from accelerate.utils import gather_object

from pytorch_accel_trainer.loop.run_state import RunState, TrainResult
from pytorch_accel_trainer.run_config import TrainerRunConfig
from pytorch_accel_trainer.tracking import (
    LossTracker,
    RunHistory,
    StepMetricsTracker,
    metric_counts,
    metrics_recorded_since,
)


def record_epoch_values(
    run_history: RunHistory,
    accelerator: Accelerator,
    loss_tracker: LossTracker,
    step_metrics: StepMetricsTracker,
    loss_name: str,
    metric_name_format: str,
) -> None:
    """Record the epoch's mean loss as ``loss_name`` and the mean of each step metric (the extra scalars of the
    batch-loss hook) as ``metric_name_format.format(name)``, averaged over every process.

    One read back from the device for each; a process that saw a metric the others did not is handled by one small
    collective of the metric names. Nothing is recorded for a loss no process saw.
    """
    one_process = accelerator.num_processes == 1  # nothing to sum over

    def reduce_sum(tensor):
        return tensor if one_process else accelerator.reduce(tensor, "sum")

    device = accelerator.device
    average = loss_tracker.reduce_average(reduce_sum, device)
    if average is not None:
        run_history.update_metric(loss_name, average)
    names = sorted(step_metrics.trackers)
    if not one_process:  # a process may have seen a metric the others did not
        names = sorted(set().union(*gather_object([names])))  # one small collective per epoch
    for name, metric_average in step_metrics.reduce_averages(reduce_sum, device, names).items():
        run_history.update_metric(metric_name_format.format(name), metric_average)


def create_train_result(
    state: RunState, run_config: TrainerRunConfig, run_history: RunHistory, watched_metric: tuple
) -> TrainResult:
    """Return the summary of the training run that just ended (one host read if a hook gave tensor sizes); its best
    metric is ``watched_metric``, ``(name, best value)``: the callbacks' (``CallbackHandler.watched_metric``)."""
    wall_time = time.perf_counter() - (state.started_at or 0.0)
    # every data-parallel rank runs the same steps (the processes of a tensor-parallel group read the same batches)
    num_samples = int(state.samples_seen) * (run_config.data_parallel_size or run_config.num_processes)
    epochs = metric_counts(run_history).get("train_loss_epoch", 0) - state.metric_counts_at_start.get(
        "train_loss_epoch", 0
    )
    # the planned end: the step limit, or the end of the last epoch (a stop inside it, even one that records the
    # cut-short epoch's loss, or before its evaluation, is an early one)
    finished = state.reached_max_steps() or (
        run_config.num_epochs is not None and state.first_epoch + state.epochs_ended >= run_config.num_epochs
    )
    return TrainResult(
        metrics=metrics_recorded_since(run_history, state.metric_counts_at_start),
        best_metric_name=watched_metric[0],
        best_metric=watched_metric[1],
        num_epochs=epochs,  # the epochs that recorded their loss, a cut-short one included
        num_update_steps=state.num_update_steps_completed,
        num_samples=num_samples,
        wall_time_seconds=wall_time,
        samples_per_second=num_samples / wall_time if wall_time > 0 else 0.0,
        stopped_early=not finished,
        stop_reason=state.stop_reason,
        non_finite_updates_skipped=state.non_finite_updates_skipped,
        nothing_left_to_train=state.nothing_left_to_train,
    )
