"""What the loop of ``trainer.py`` does around its hooks: the epochs and their batches, callback events and agreed
stops, clipping, non-finite retries, the epoch's recorded values and the run's result.

A mixin of :class:`~pytorch_accel_trainer.trainer.Trainer`, kept apart so that ``trainer.py`` holds the run's
skeleton and its named decisions. Each method runs once per event, update or epoch.
"""

from __future__ import annotations

import itertools
import time
from typing import Iterable

from accelerate.utils import gather_object

from pytorch_accel_trainer.callbacks.monitor import MonitorCallback
from pytorch_accel_trainer.errors import StopTrainingError
from pytorch_accel_trainer.loop import accumulation, persistence
from pytorch_accel_trainer.loop.batches import NO_TRAIN_BATCH
from pytorch_accel_trainer.loop.non_finite import retry_or_skip_non_finite_update
from pytorch_accel_trainer.loop.run_state import TrainResult
from pytorch_accel_trainer.tracking import LossTracker, StepMetricsTracker, metric_counts, metrics_recorded_since
from pytorch_accel_trainer.utils import require_batches, with_last_flag


class LoopSupportMixin:
    """Events, stops, clipping and the epoch's recorded values of a :class:`~pytorch_accel_trainer.trainer.Trainer`."""

    def _optimizer_step_was_skipped(self) -> bool:
        return self._accelerator.scaler is not None and self._accelerator.optimizer_step_was_skipped

    def _clip_gradients(self) -> None:
        """Clip by norm and/or value as set in ``train()``; keep the norm in ``last_gradient_norm`` (no sync)."""
        config = self.run_config
        clip_norm, clip_value, track_norm = (
            config.gradient_clip_norm,
            config.gradient_clip_value,
            self.track_gradient_norm,
        )
        if clip_norm is None and clip_value is None and not track_norm:
            return  # nothing asked for: the default run
        norm = accumulation.clip_gradients(self._accelerator, self.model, clip_norm, clip_value, track_norm)
        if clip_norm is not None or track_norm:
            self.last_gradient_norm = norm

    def _record_epoch_loss(self, tracker: LossTracker, metric_name: str) -> None:
        one_process = self._accelerator.num_processes == 1  # nothing to sum over
        average = tracker.reduce_average(
            lambda tensor: tensor if one_process else self._accelerator.reduce(tensor, "sum"), self.device
        )
        if average is not None:
            self.run_history.update_metric(metric_name, average)

    def _record_step_metrics(self, tracker: StepMetricsTracker, name_format: str) -> None:
        """Record the epoch's mean of each extra scalar of the batch-loss hook, as ``name_format.format(name)``."""
        names = sorted(tracker.trackers)
        if self._accelerator.num_processes > 1:  # a process may have seen a metric the others did not
            names = sorted(set().union(*gather_object([names])))  # one small collective per epoch
        one_process = self._accelerator.num_processes == 1
        averages = tracker.reduce_averages(
            lambda tensor: tensor if one_process else self._accelerator.reduce(tensor, "sum"), self.device, names
        )
        for name, average in averages.items():
            self.run_history.update_metric(name_format.format(name), average)

    def _stop_training(self, error: StopTrainingError) -> None:
        self.run_state.stop_request = None
        self.print(error)
        self.callback_handler.call_event("on_stop_training_error", self)

    def _call_event(self, event: str, **kwargs) -> None:
        """Call a callback event of the loop. A ``StopTrainingError`` it raises is taken at the next update
        boundary or the end of the epoch, on every process at the same point, so that no process is left waiting
        in a collective for one that stopped."""
        try:
            self.callback_handler.call_event(event, self, **kwargs)
        except StopTrainingError as error:
            self.run_state.hold_stop(error)

    def _raise_agreed_stop(self) -> None:
        """Raise the ``StopTrainingError`` a callback of any process asked for (one collective per call when
        distributed); every process must call this at the same point."""
        stop_request = self.run_state.stop_request
        if stop_request is None and self._accelerator.num_processes == 1:
            return  # nothing to agree on
        stop_request = self.process_agreement.agreed_exception(self._accelerator, stop_request)
        if stop_request is not None:
            raise stop_request

    def _create_train_result(self) -> TrainResult:
        """Return the summary of the training run that just ended (one host read if a hook gave tensor sizes)."""
        state, config = self.run_state, self.run_config
        wall_time = time.perf_counter() - state.started_at
        num_samples = int(state.samples_seen) * config.num_processes  # the processes run the same steps
        monitor = next((callback for callback in self.callback_handler if isinstance(callback, MonitorCallback)), None)
        epochs = metric_counts(self.run_history).get("train_loss_epoch", 0) - state.metric_counts_at_start.get(
            "train_loss_epoch", 0
        )
        finished = state.reached_max_steps() or (
            config.num_epochs is not None and state.first_epoch + epochs >= config.num_epochs
        )
        return TrainResult(
            metrics=metrics_recorded_since(self.run_history, state.metric_counts_at_start),
            best_metric_name=None if monitor is None else monitor.watch_metric,
            best_metric=None if monitor is None else monitor.best_metric,
            num_epochs=epochs,  # training epochs run to their end, a last one a callback stopped after included
            num_update_steps=state.num_update_steps_completed,
            num_samples=num_samples,
            wall_time_seconds=wall_time,
            samples_per_second=num_samples / wall_time if wall_time > 0 else 0.0,
            stopped_early=not finished,
        )

    def _retry_or_skip_non_finite_update(self, batch, step: int) -> bool:
        """Under a non-finite policy (``skip_non_finite_steps``), re-run the step while its gradients are not finite
        (as the policy allows) and return whether the update must be skipped; may raise ``StopTrainingError``."""
        if self.run_state.non_finite_policy is None:
            return False  # the default run checks nothing: no host read
        return retry_or_skip_non_finite_update(self.run_state, self.model, self.optimizer, self._rerun_window)

    def _rerun_window(self) -> None:
        """Run the forward and backward passes of every micro-batch of the current window again (a retry)."""
        state, window = self.run_state, self.run_state.non_finite_policy.window_batches
        for index, (batch, step) in enumerate(window):
            state.step_closes_window = index == len(window) - 1  # gradients sync at the window's last micro-batch only
            self._perform_forward_and_backward_passes(batch, step, is_retry=True)

    def _epochs(self) -> Iterable[int]:
        first = self.run_state.epoch  # 0, or the epoch a resumed run continues
        if self.run_config.num_epochs is None:
            return itertools.count(first)  # only max_num_train_steps ends this run
        return range(first, self.run_config.num_epochs)

    def _epoch_batches(self, train_dl: Iterable) -> tuple[int, Iterable]:
        """This epoch's first step and its batches, each with whether it is the last; resumed: from the saved step."""
        if hasattr(train_dl, "set_epoch"):
            train_dl.set_epoch(self.run_history.current_epoch - 1)  # the shuffle order depends on seed + epoch
        first_step, train_dl = persistence.skip_to_resume_position(self.run_state, train_dl)
        if self.run_state.train_epoch_length == 0:
            return first_step, with_last_flag(train_dl)  # a dataloader that says it is empty: warned at setup
        return first_step, require_batches(with_last_flag(train_dl), NO_TRAIN_BATCH)
