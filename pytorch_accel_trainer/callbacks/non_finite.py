"""Skipping optimizer updates whose gradients are not finite, and counting them."""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

from pytorch_accel_trainer.callbacks.base import TrainerCallback
from pytorch_accel_trainer.errors import (  # noqa: F401  (NonFiniteGradientsError: importable here)
    NonFiniteGradientsError,
    validate_non_finite_policy,
)

if TYPE_CHECKING:
    from pytorch_accel_trainer.loop.non_finite import NonFinitePolicy
    from pytorch_accel_trainer.trainer import Trainer


class SkipNonFiniteStepsCallback(TrainerCallback):
    """Skips each optimizer update whose gradients hold a NaN or an infinity, instead of applying it.

    The weights, optimizer and scheduler are left untouched by a skipped update, and its loss is left out
    of ``train_loss_epoch``. The number of skipped updates of each epoch is recorded in the run history as
    ``non_finite_steps_skipped``. Gradients are identical on every process after their all-reduce, so every
    process skips the same updates. While this callback is active, ``TerminateOnNaNCallback`` stands down.

    Args:
        max_consecutive_skips: stop the run (``StopTrainingError``) after this many skipped updates in a row
            (with ``on_exhausted="skip"`` only).
        max_retries: before skipping, re-run the forward and backward passes of the update's whole accumulation
            window this many times (its batches are kept until the update: up to ``gradient_accumulation_steps``
            batches in memory).
        on_exhausted: what happens to an update whose gradients are still not finite after its retries: ``"skip"``
            (the default) skips it and the run goes on; ``"stop"`` ends the run there, cleanly (``TrainResult``:
            ``stopped_early=True``, the reason in ``stop_reason``); ``"raise"`` ends it the same way, then ``train()``
            raises :class:`NonFiniteGradientsError`.

    Example::

        callbacks = (*DEFAULT_CALLBACKS, SkipNonFiniteStepsCallback(max_retries=3, on_exhausted="raise"))
    """

    def __init__(self, max_consecutive_skips: Optional[int] = None, max_retries: int = 0, on_exhausted: str = "skip"):
        validate_non_finite_policy(max_consecutive_skips, max_retries, on_exhausted)
        self.max_consecutive_skips = max_consecutive_skips
        self.max_retries = max_retries
        self.on_exhausted = on_exhausted
        self.policy: Optional[NonFinitePolicy] = None  # the trainer's, from the start of each run

    def on_training_run_start(self, trainer: "Trainer", **kwargs):
        self.policy = trainer.skip_non_finite_steps(self.max_consecutive_skips, self.max_retries, self.on_exhausted)

    def on_train_epoch_start(self, trainer: "Trainer", **kwargs):
        self._run_policy().skipped_in_epoch = 0

    def on_train_epoch_end(self, trainer: "Trainer", **kwargs):
        trainer.run_history.update_metric("non_finite_steps_skipped", self._run_policy().skipped_in_epoch)

    def _run_policy(self) -> NonFinitePolicy:
        if self.policy is None:
            raise RuntimeError(
                "SkipNonFiniteStepsCallback has no policy yet: it asks the trainer for one in on_training_run_start. "
                "A subclass that overrides on_training_run_start must call super().on_training_run_start(trainer)."
            )
        return self.policy
