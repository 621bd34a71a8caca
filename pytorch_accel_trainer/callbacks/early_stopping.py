"""Stop a training run when a watched metric stops improving."""

from __future__ import annotations

import numbers
from typing import TYPE_CHECKING, Any

from pytorch_accel_trainer.callbacks.monitor import MonitorCallback
from pytorch_accel_trainer.errors import StopTrainingError, validate_positive_int

if TYPE_CHECKING:
    from pytorch_accel_trainer.trainer import Trainer


class EarlyStoppingCallback(MonitorCallback):
    """Stops training when ``watch_metric`` has not improved for ``early_stopping_patience`` epochs.

    At the end of each epoch (``on_training_run_epoch_end``), the latest value of ``watch_metric`` is
    compared with the best so far. A change in the right direction by more than
    ``early_stopping_threshold`` is an improvement and resets the counter; anything else adds one to it.
    When the counter reaches ``early_stopping_patience``, a :class:`StopTrainingError` ends the run. The
    metric is reduced over every process before it is recorded, so every process stops at the same epoch.

    Args:
        early_stopping_patience: epochs without improvement after which training stops.
        early_stopping_threshold: the smallest absolute change that counts as an improvement
            (``None`` counts any change).
        watch_metric: the run-history metric to watch; a name that is not in the run history raises a
            ``ValueError`` listing those that are.
        greater_is_better: whether a larger value of ``watch_metric`` is better.
        reset_on_train: forget the best value and the counter at the start of each ``train()``.

    Example::

        trainer = Trainer(model, loss_func, optimizer, callbacks=(*DEFAULT_CALLBACKS, EarlyStoppingCallback(2)))
        trainer.train(train_dataset, num_epochs=100, eval_dataset=eval_dataset)
    """

    def __init__(
        self,
        early_stopping_patience: int = 1,
        early_stopping_threshold: float | None = 0.01,
        watch_metric: str = "eval_loss_epoch",
        greater_is_better: bool = False,
        reset_on_train: bool = True,
    ):
        _validate_early_stopping_arguments(early_stopping_patience, early_stopping_threshold)
        super().__init__(watch_metric, greater_is_better, reset_on_train)
        self.early_stopping_patience = early_stopping_patience
        self.early_stopping_threshold = early_stopping_threshold or 0.0
        self.early_stopping_patience_counter = 0

    def _reset(self) -> None:
        super()._reset()
        self.early_stopping_patience_counter = 0

    def on_training_run_epoch_end(self, trainer: Trainer, **kwargs):
        value = self.get_watched_metric(trainer)
        if self.best_metric is None:
            self.best_metric = value  # the first epoch sets the reference
        elif self.is_improvement(value, min_delta=self.early_stopping_threshold):
            trainer.print(
                f"\nImprovement of {abs(value - self.best_metric)} in {self.watch_metric}, resetting counter."
            )
            self.best_metric = value
            self.early_stopping_patience_counter = 0
        else:
            self.early_stopping_patience_counter += 1
            trainer.print(
                f"\nNo improvement above threshold in {self.watch_metric}: early stopping counter "
                f"{self.early_stopping_patience_counter}/{self.early_stopping_patience}"
            )
        if self.early_stopping_patience_counter >= self.early_stopping_patience:
            raise StopTrainingError(
                f"Stopping training due to no improvement after {self.early_stopping_patience} epochs"
            )

    def state_dict(self) -> dict:
        """Return the best value and the counter, for the training-state checkpoint."""
        return {**super().state_dict(), "early_stopping_patience_counter": self.early_stopping_patience_counter}

    def load_state_dict(self, state: dict) -> None:
        """Restore a state returned by :meth:`state_dict`."""
        super().load_state_dict(state)
        self.early_stopping_patience_counter = int(state.get("early_stopping_patience_counter", 0))


def _validate_early_stopping_arguments(patience: Any, threshold: Any) -> None:
    validate_positive_int("early_stopping_patience", patience, "epochs without improvement", 3)
    if threshold is not None and (not isinstance(threshold, numbers.Real) or threshold < 0):
        raise ValueError(
            f"early_stopping_threshold is {threshold!r}; pass a non-negative number (the smallest change that counts "
            "as an improvement), or None to count any change."
        )
