"""The library's own errors and the validators shared by its modules: a leaf, importing nothing of the package.

Users import the errors from where they always have (``pytorch_accel_trainer.callbacks`` for
``StopTrainingError``, ``pytorch_accel_trainer.state.training_state`` for ``CheckpointError``); they are defined
here so that low modules (``distributed``, ``run_state``) need not import the callbacks.
"""

from __future__ import annotations

from typing import Any


class StopTrainingError(Exception):
    """Raise this from a hook or callback that runs within an epoch to end the run there, cleanly.

    It is caught from ``train_epoch_start`` to ``on_training_run_epoch_end`` (and within the epoch of
    ``evaluate()``): the rest of the epoch is skipped (raised from ``on_train_step_end``, so is that step's
    backward pass), ``on_stop_training_error`` fires, then ``training_run_end`` and ``on_training_run_end``
    run as usual. Raised outside an epoch, it propagates to the caller of ``train()``.
    """


class CheckpointError(RuntimeError):
    """A training state that cannot be trusted, or that cannot be resumed as asked."""


def validate_positive_int(name: str, value: Any, unit: str, example: int) -> None:
    """Refuse ``value`` for the argument ``name`` unless it is a positive whole number (``True`` is not one)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} is {value!r}; pass a positive whole number of {unit}, e.g. {name}={example}.")


class TimeBudgetExceeded(StopTrainingError):
    """The ``StopTrainingError`` with which ``train(max_time=...)`` ends a run before its time budget is spent; its
    message says where the training state is and how to resume."""


class SharedFolderError(RuntimeError):
    """A folder a multi-node run must share (its training states, the state it resumes) that some node does not see
    as the main process does: raised on every process at the start of ``train()``, before any work."""
