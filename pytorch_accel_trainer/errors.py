"""The library's own errors and the validators shared by its modules: a leaf, importing nothing of the package.

Users import the errors from where they always have (``pytorch_accel_trainer.callbacks`` for
``StopTrainingError`` and ``NonFiniteGradientsError``, ``pytorch_accel_trainer.state.training_state`` for
``CheckpointError``); they are defined here so that low modules (``distributed``, ``run_state``, the loop's
non-finite policy) need not import the callbacks.
"""

from __future__ import annotations

from numbers import Real
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


def validate_positive_option(name: str, value: Any, allow_none: bool = False) -> None:
    """Refuse ``value`` for the option ``name`` of ``train()``, ``evaluate()``, ``predict()`` or ``lr_find()`` unless it
    is a positive whole number (or ``None``, with ``allow_none``)."""
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        expected = "a positive integer or None" if allow_none else "a positive integer"
        raise ValueError(f"{name}={value!r} is not valid: it must be {expected}. Pass e.g. {name}=1.")


def validate_positive_number(name: str, value: Any) -> None:
    """Refuse ``value`` for the option ``name`` unless it is a positive number or ``None`` (NaN is not positive)."""
    if value is None:
        return
    # numbers.Real promises < and <= (not >); value != value holds for NaN only, which is not positive either
    if isinstance(value, bool) or not isinstance(value, Real) or value <= 0 or value != value:
        raise ValueError(f"{name}={value!r} is not valid: it must be a positive number or None. Pass e.g. {name}=1.0.")


class TimeBudgetExceeded(StopTrainingError):
    """The ``StopTrainingError`` with which ``train(max_time=...)`` ends a run before its time budget is spent; its
    message says where the training state is and how to resume."""


class SharedFolderError(RuntimeError):
    """A folder a multi-node run must share (its training states, the state it resumes) that some node does not see
    as the main process does: raised on every process at the start of ``train()``, before any work."""


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
