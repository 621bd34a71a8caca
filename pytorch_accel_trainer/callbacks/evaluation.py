"""Callbacks that change when and how much the trainer evaluates."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pytorch_accel_trainer.callbacks.base import TrainerCallback
from pytorch_accel_trainer.errors import validate_positive_int
from pytorch_accel_trainer.run_config import data_parallel_size
from pytorch_accel_trainer.utils import DataLoaderSlice

if TYPE_CHECKING:
    from pytorch_accel_trainer.trainer import Trainer

#: The prefix of the metrics recorded during an intermediate evaluation, e.g. ``intermediate_eval_loss_epoch``.
INTERMEDIATE_METRIC_PREFIX = "intermediate_"


class StepBasedEvaluationCallback(TrainerCallback):
    """Runs an extra evaluation epoch every ``eval_every_n_steps`` optimizer updates within training epochs.

    The evaluation runs after the update that completes each interval (noticed in ``on_optimizer_step_end``,
    run at the next ``on_train_step_start``), so it never falls inside an accumulation window; an interval that
    ends with the epoch is left to the epoch's own evaluation. It fires the usual evaluation events, and records its
    metrics with the prefix ``intermediate_`` (``intermediate_eval_loss_epoch``, and those of metric
    callbacks), so the epoch metrics (``eval_loss_epoch``, ...) are never overwritten. The training loss of
    the epoch is tracked apart and is not affected. The model's training mode is restored afterwards,
    module by module. As in pytorch-accelerated, its ``on_eval_epoch_start`` and ``on_eval_epoch_end`` events receive
    ``is_intermediate=True`` (``False`` in every other evaluation epoch); :func:`is_intermediate_evaluation` tells
    it from any other event.

    Unlike pytorch-accelerated, which counts the batches of the epoch, the interval counts optimizer
    updates over the whole run, so it does not depend on gradient accumulation or on the epoch length.

    Args:
        eval_every_n_steps: the optimizer updates between two intermediate evaluations.
    """

    def __init__(self, eval_every_n_steps: int):
        validate_positive_int("eval_every_n_steps", eval_every_n_steps, "optimizer updates", 500)
        self.eval_every_n_steps = eval_every_n_steps
        self.is_evaluating = False
        self._due_after: int | None = None  # the update count an evaluation is due after, until the next step

    def on_training_run_start(self, trainer: Trainer, **kwargs):
        validate_can_evaluate_during_training(trainer, type(self).__name__)
        self._due_after = None

    def on_optimizer_step_end(self, trainer: Trainer, num_update_steps_completed: int | None = None, **kwargs):
        if num_update_steps_completed is None:  # called by hand without it: the trainer's count
            num_update_steps_completed = trainer.num_update_steps_completed
        if num_update_steps_completed % self.eval_every_n_steps == 0:
            self._due_after = num_update_steps_completed  # run at the next step: the epoch's last update has none

    def on_train_step_start(self, trainer: Trainer, **kwargs):
        if self._due_after is not None:
            updates, self._due_after = self._due_after, None
            self._evaluate(trainer, updates)

    def on_train_step_end(
        self, trainer: Trainer, batch: Any = None, batch_output: dict | None = None, step: int = 0, **kwargs
    ):
        """Does nothing; takes pytorch-accelerated's arguments. The evaluation it runs here runs at the next
        ``on_train_step_start``, after the optimizer update that completes an interval."""

    def on_train_epoch_end(self, trainer: Trainer, **kwargs):
        self._due_after = None  # the epoch's own evaluation comes next

    def _evaluate(self, trainer: Trainer, updates: int) -> None:
        trainer.print(f"\nRunning evaluation after {updates} optimizer steps")
        self.is_evaluating = True
        try:
            with trainer.callback_handler.intermediate_evaluation():  # the epoch events get is_intermediate=True
                trainer.run_extra_eval_epoch(metric_name_prefix=INTERMEDIATE_METRIC_PREFIX)
        finally:
            self.is_evaluating = False


def is_intermediate_evaluation(trainer: Trainer) -> bool:
    """Whether the evaluation epoch running now is one of :class:`StepBasedEvaluationCallback`."""
    callbacks = trainer.callback_handler.callbacks
    return any(isinstance(callback, StepBasedEvaluationCallback) and callback.is_evaluating for callback in callbacks)


class LimitEvalStepsCallback(TrainerCallback):
    """Limits evaluation epochs to ``num_eval_steps`` batches in total over all processes.

    Each process evaluates ``num_eval_steps // num_processes`` batches (at least one). As in pytorch-accelerated, the
    limit is decided at ``on_eval_epoch_start`` from its ``is_intermediate`` argument and lifted at
    ``on_eval_epoch_end``; place it before :class:`StepBasedEvaluationCallback` and :class:`ProgressBarCallback` in
    the list of callbacks, so the bar sees the limited length.

    Args:
        num_eval_steps: the evaluation batches, summed over processes.
        limit_intermediate_only: limit only the evaluations of :class:`StepBasedEvaluationCallback`, and
            evaluate fully at the end of each epoch; ``False`` limits every evaluation epoch, those of
            ``evaluate()`` included.
    """

    def __init__(self, num_eval_steps: int, limit_intermediate_only: bool = True):
        validate_positive_int("num_eval_steps", num_eval_steps, "evaluation batches", 20)
        self.num_eval_steps = num_eval_steps
        self.limit_intermediate_only = limit_intermediate_only
        self._original_eval_dataloader: Any | None = None
        self._is_limiting = False  # set for each evaluation epoch, read by the slice when the epoch starts its pass

    def on_training_run_start(self, trainer: Trainer, **kwargs):
        self._wrap(trainer)

    def on_evaluation_run_start(self, trainer: Trainer, **kwargs):
        self._wrap(trainer)

    def on_eval_epoch_start(self, trainer: Trainer, is_intermediate: bool = False, **kwargs):
        self._is_limiting = is_intermediate or not self.limit_intermediate_only

    def on_eval_epoch_end(self, trainer: Trainer, is_intermediate: bool = False, **kwargs):
        self._is_limiting = False

    def on_training_run_end(self, trainer: Trainer, **kwargs):
        self._restore(trainer)

    def on_evaluation_run_end(self, trainer: Trainer, **kwargs):
        self._restore(trainer)

    def _wrap(self, trainer: Trainer) -> None:
        # The epoch iterates the dataloader it was given before on_eval_epoch_start, so the slice is put in place at
        # the start of the run, and switched on or off for each epoch (pytorch-accelerated swaps the dataloader then).
        if trainer.eval_dataloader is None:
            return
        steps_per_process = max(1, self.num_eval_steps // data_parallel_size(trainer))
        self._original_eval_dataloader = trainer.eval_dataloader
        trainer.eval_dataloader = DataLoaderSlice(trainer.eval_dataloader, steps_per_process, lambda: self._is_limiting)

    def _restore(self, trainer: Trainer) -> None:
        self._is_limiting = False
        if self._original_eval_dataloader is not None:
            trainer.eval_dataloader = self._original_eval_dataloader
            self._original_eval_dataloader = None


def validate_can_evaluate_during_training(trainer: Trainer, callback_name: str) -> None:
    """Refuse, before the first step, a run in which an extra evaluation could not run or be recorded apart."""
    if trainer.eval_dataloader is None:
        raise ValueError(
            f"{callback_name} evaluates during training, but train() was given no eval_dataset; pass one, or "
            f"remove {callback_name}."
        )
    if not hasattr(trainer.run_history, "set_metric_name_prefix"):
        raise TypeError(
            f"{callback_name} records its metrics under a prefix, but the run history is a "
            f"{type(trainer.run_history).__name__}, which has no set_metric_name_prefix(prefix) method; add one "
            "(see InMemoryRunHistory) or use the default InMemoryRunHistory."
        )
