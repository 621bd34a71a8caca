"""Skipping optimizer updates whose gradients are not finite, and counting them."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

from pytorch_accel_trainer.callbacks.base import TrainerCallback
from pytorch_accel_trainer.errors import validate_positive_int

if TYPE_CHECKING:
    from pytorch_accel_trainer.loop.non_finite import NonFinitePolicy
    from pytorch_accel_trainer.trainer import Trainer

#: What the non-finite policy does with an update whose gradients are still not finite after its retries.
ON_EXHAUSTED_CHOICES = ("skip", "stop", "raise")


class NonFiniteGradientsError(RuntimeError):
    """The gradients of an update were not finite after every retry, under ``on_exhausted="raise"``.

    ``train()`` raises it once every callback has ended the run; the update was not applied.
    """


def validate_non_finite_policy(max_consecutive_skips: Any, max_retries: Any, on_exhausted: Any) -> None:
    """Refuse settings of the non-finite policy that are not valid, or that contradict each other."""
    if max_consecutive_skips is not None:
        validate_positive_int("max_consecutive_skips", max_consecutive_skips, "skipped updates", 10)
    if isinstance(max_retries, bool) or not isinstance(max_retries, int) or max_retries < 0:
        raise ValueError(f"max_retries={max_retries!r} is not valid: pass an integer >= 0.")
    if on_exhausted not in ON_EXHAUSTED_CHOICES:
        raise ValueError(
            f"on_exhausted={on_exhausted!r} is not valid: choose between 'skip' (skip the update and go on), 'stop' "
            "(end the run there, cleanly) and 'raise' (end the run, then raise NonFiniteGradientsError)."
        )
    if on_exhausted != "skip" and max_consecutive_skips is not None:
        raise ValueError(
            f"max_consecutive_skips={max_consecutive_skips} counts skipped updates in a row, but on_exhausted="
            f"{on_exhausted!r} ends the run at the first update whose retries run out, skipping none: leave "
            "max_consecutive_skips out, or pass on_exhausted='skip'."
        )


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
