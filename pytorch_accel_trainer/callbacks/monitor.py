"""The base of callbacks that watch one run-history metric and keep its best value."""

from __future__ import annotations

import math
import numbers
from typing import TYPE_CHECKING, Any

from pytorch_accel_trainer.callbacks.base import TrainerCallback

if TYPE_CHECKING:
    from pytorch_accel_trainer.trainer import Trainer


class MonitorCallback(TrainerCallback):
    """Watches ``watch_metric`` in the run history and remembers its best value.

    Run-history metrics are reduced over every process before they are recorded, so every process reads
    the same value and takes the same decision: no process waits on another.

    Args:
        watch_metric: the run-history metric to watch, e.g. ``"eval_loss_epoch"``.
        greater_is_better: whether a larger value of ``watch_metric`` is better.
        reset_on_train: forget the best value at the start of each ``train()``, so that only the
            metrics of the current run are compared. A state restored with :meth:`load_state_dict`
            survives the next start.
    """

    def __init__(self, watch_metric: str, greater_is_better: bool, reset_on_train: bool):
        _validate_watch_metric_name(watch_metric)
        self.watch_metric = watch_metric
        self.greater_is_better = greater_is_better
        self.reset_on_train = reset_on_train
        self.best_metric: float | None = None
        self._state_was_restored = False

    def on_training_run_start(self, trainer: Trainer, **kwargs):
        validate_metric_can_be_recorded(trainer, self.watch_metric, type(self).__name__)
        if self.reset_on_train and not self._state_was_restored:
            self._reset()
        self._state_was_restored = False

    def on_training_run_end(self, trainer: Trainer, **kwargs):
        self._state_was_restored = False  # a state restored during the run counts for this run only

    def watched_metric(self) -> tuple[str, float | None]:
        """``(watch_metric, best_metric)``: what ``train()`` reports as the run's best metric."""
        return self.watch_metric, self.best_metric

    def _reset(self) -> None:
        """Forget what was watched so far; subclasses extend this with their own counters."""
        self.best_metric = None

    def get_watched_metric(self, trainer: Trainer) -> float:
        """Return the latest value of ``watch_metric``.

        Raises:
            ValueError: the run history has no metric of that name; the message lists those it has.
        """
        names = trainer.run_history.get_metric_names()
        if self.watch_metric not in names:
            raise ValueError(
                f"{type(self).__name__} watches {self.watch_metric!r}, which is not in the run history; the metrics "
                f"recorded are {sorted(names)}. Pass one of them as watch_metric (an eval metric needs an "
                "eval_dataset)."
            )
        return _as_float(trainer.run_history.get_latest_metric(self.watch_metric), self.watch_metric)

    def is_improvement(self, value: float, min_delta: float = 0.0) -> bool:
        """Whether ``value`` beats the best value so far by more than ``min_delta`` (always, for the first one).

        A NaN value is never an improvement.
        """
        if math.isnan(value):
            return False
        if self.best_metric is None:
            return True
        change = value - self.best_metric if self.greater_is_better else self.best_metric - value
        return change > 0 and abs(change) > min_delta

    def state_dict(self) -> dict:
        """Return the watched state as plain numbers, for the training-state checkpoint."""
        return {} if self.best_metric is None else {"best_metric": self.best_metric}

    def load_state_dict(self, state: dict) -> None:
        """Restore a state returned by :meth:`state_dict`; it survives the next ``on_training_run_start``."""
        self.best_metric = state.get("best_metric")
        self._state_was_restored = True


def _as_float(value: Any, name: str) -> float:
    if isinstance(value, numbers.Real):
        return float(value)
    if hasattr(value, "item") and getattr(value, "ndim", 0) == 0:  # a 0-dim tensor or numpy scalar
        return float(value.item())
    raise TypeError(
        f"The metric {name!r} holds {value!r} ({type(value).__name__}), which cannot be compared as a number. "
        "Record a plain number (e.g. tensor.item()) in the run history, or watch another metric."
    )


def _validate_watch_metric_name(watch_metric: Any) -> None:
    if not isinstance(watch_metric, str) or not watch_metric:
        raise TypeError(
            f"watch_metric is {watch_metric!r}; pass the name of a run-history metric as a string, "
            "e.g. watch_metric='eval_loss_epoch'."
        )


def validate_metric_can_be_recorded(trainer: Trainer, watch_metric: str, owner: str) -> None:
    """Refuse, as the run starts, to watch an evaluation metric of the trainer's (``eval_loss_epoch``,
    ``eval_<name>_epoch``) in a run without evaluation data: it would fail only after the first training epoch."""
    recorded_by_evaluation = watch_metric.startswith("eval_") and watch_metric.endswith("_epoch")
    if trainer.eval_dataloader is not None or not recorded_by_evaluation:
        return
    raise ValueError(
        f"{owner} watches {watch_metric!r}, which only an evaluation epoch records, but this run has no eval_dataset: "
        "pass train(..., eval_dataset=...) (data.eval in a config), or watch a training metric such as "
        "'train_loss_epoch'."
    )
