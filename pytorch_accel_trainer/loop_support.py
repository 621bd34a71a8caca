"""What the loop of ``trainer.py`` does around its hooks: callback events and agreed stops, clipping, recording.

A mixin of :class:`~pytorch_accel_trainer.trainer.Trainer`, kept apart so that ``trainer.py`` holds the run's
skeleton and its named decisions. Each method runs once per event, update or epoch.
"""

from __future__ import annotations

from pytorch_accel_trainer import accumulation
from pytorch_accel_trainer.errors import StopTrainingError
from pytorch_accel_trainer.tracking import LossTracker


class LoopSupportMixin:
    """Events, stops, clipping and the epoch's recorded values of a :class:`~pytorch_accel_trainer.trainer.Trainer`."""

    def _optimizer_step_was_skipped(self) -> bool:
        return self._accelerator.scaler is not None and self._accelerator.optimizer_step_was_skipped

    def _clip_gradients(self) -> None:
        """Clip by norm and/or value as set in ``train()``; keep the norm in ``last_gradient_norm`` (no sync)."""
        config = self.run_config
        clip_norm, clip_value, track_norm = config.gradient_clip_norm, config.gradient_clip_value, self.track_gradient_norm
        if clip_norm is None and clip_value is None and not track_norm:
            return  # nothing asked for: the default run
        norm = accumulation.clip_gradients(self._accelerator, self.model, clip_norm, clip_value, track_norm)
        if clip_norm is not None or track_norm:
            self.last_gradient_norm = norm

    def _record_epoch_loss(self, tracker: LossTracker, metric_name: str) -> None:
        one_process = self._accelerator.num_processes == 1  # nothing to sum over
        average = tracker.reduce_average(lambda tensor: tensor if one_process else self._accelerator.reduce(tensor, "sum"), self.device)
        if average is not None:
            self.run_history.update_metric(metric_name, average)

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
