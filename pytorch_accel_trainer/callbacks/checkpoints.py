"""Save the best model of a training run, judged by a watched metric."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from pytorch_accel_trainer.callbacks.monitor import MonitorCallback
from pytorch_accel_trainer.state.storage import CHECKPOINTS, Destination, as_location, parent, validate_location

if TYPE_CHECKING:
    from pytorch_accel_trainer.trainer import Trainer


class SaveBestModelCallback(MonitorCallback):
    """Saves a checkpoint whenever ``watch_metric`` improves, and loads the best one when training ends.

    At the end of each epoch (``on_training_run_epoch_end``) the latest value of ``watch_metric`` is
    compared with the best so far; the first value, and every better one, is saved with
    ``trainer.save_checkpoint(save_path, checkpoint_kwargs={watch_metric: value, "epoch": epoch})``. The
    metric is reduced over every process, so every process takes the same decision and joins the save.
    At ``on_training_run_end``, the best checkpoint is loaded back into the model (and optimizer, scheduler)
    if one was saved.

    Args:
        save_path: the checkpoint file, e.g. ``"best_model.pt"``.
        watch_metric: the run-history metric that decides which model is best; a name that is not in the
            run history raises a ``ValueError`` listing those that are.
        greater_is_better: whether a larger value of ``watch_metric`` is better.
        reset_on_train: forget the best value at the start of each ``train()``; ``False`` compares with the
            best of earlier runs too.
        save_optimizer: include the optimizer state in the checkpoint.
        save_scheduler: include the scheduler state in the checkpoint.
        load_saved_checkpoint: load the best checkpoint at the end of the training run.

    Example::

        best = SaveBestModelCallback("best.pt", watch_metric="accuracy", greater_is_better=True)
        trainer = Trainer(model, loss_func, optimizer, callbacks=(*DEFAULT_CALLBACKS, best))
    """

    def __init__(
        self,
        save_path: str | os.PathLike = "best_model.pt",
        watch_metric: str = "eval_loss_epoch",
        greater_is_better: bool = False,
        reset_on_train: bool = True,
        save_optimizer: bool = True,
        save_scheduler: bool = True,
        load_saved_checkpoint: bool = True,
    ):
        super().__init__(watch_metric, greater_is_better, reset_on_train)
        validate_location(save_path)  # an object-storage URL needs its package: said now, not after an epoch
        self.save_path = save_path
        self.save_optimizer = save_optimizer
        self.save_scheduler = save_scheduler
        self.load_saved_checkpoint = load_saved_checkpoint
        self.best_metric_epoch: int | None = None

    def writes_to(self) -> tuple[Destination, ...]:
        """The folder of ``save_path``, where the checkpoint file is written."""
        return (
            Destination(
                parent(as_location(self.save_path)), CHECKPOINTS, "the folder of SaveBestModelCallback(save_path=...)"
            ),
        )

    def _reset(self) -> None:
        super()._reset()
        self.best_metric_epoch = None

    def on_training_run_epoch_end(self, trainer: Trainer, **kwargs):
        value = self.get_watched_metric(trainer)
        if self.is_improvement(value):
            self.best_metric = value
            self.best_metric_epoch = trainer.run_history.current_epoch
            self.save_model(trainer)

    def save_model(self, trainer: Trainer) -> None:
        """Write the checkpoint of the current model to ``save_path``; every process must call it."""
        trainer.save_checkpoint(
            save_path=self.save_path,
            checkpoint_kwargs={self.watch_metric: self.best_metric, "epoch": self.best_metric_epoch},
            save_optimizer=self.save_optimizer,
            save_scheduler=self.save_scheduler,
        )

    def on_training_run_end(self, trainer: Trainer, **kwargs):
        super().on_training_run_end(trainer)
        if not self.load_saved_checkpoint or self.best_metric_epoch is None:
            return  # nothing was saved, e.g. the run stopped before its first epoch ended
        trainer.print(
            f"Loading checkpoint with {self.watch_metric}: {self.best_metric} from epoch {self.best_metric_epoch}"
        )
        trainer.load_checkpoint(self.save_path)

    def state_dict(self) -> dict:
        """Return the best value and its epoch, for the training-state checkpoint."""
        state = super().state_dict()
        if self.best_metric_epoch is not None:
            state["best_metric_epoch"] = self.best_metric_epoch
        return state

    def load_state_dict(self, state: dict) -> None:
        """Restore a state returned by :meth:`state_dict`."""
        super().load_state_dict(state)
        self.best_metric_epoch = state.get("best_metric_epoch")
