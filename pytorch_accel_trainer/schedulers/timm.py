"""Stepping a timm scheduler (``step(epoch)`` and ``step_update(num_updates)``) from the trainer's loop.

:class:`~pytorch_accel_trainer.trainer.TrainerWithTimmScheduler` is pytorch-accelerated's trainer of the same
name, done correctly: the update count is the run's (so it is right with gradient accumulation and after a
resume), and the epoch-level step runs at the end of each training epoch, with or without evaluation data.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:  # the mixin comes before Trainer in TrainerWithTimmScheduler's bases: type-check it as one
    from pytorch_accel_trainer.trainer import Trainer as _TrainerBase
else:
    _TrainerBase = object


class TimmSchedulerMixin(_TrainerBase):
    """Steps ``self.scheduler`` the way timm's schedulers expect, in the trainer's ``scheduler_step`` and
    ``train_epoch_end`` hooks.

    - After each optimizer update: ``scheduler.step_update(num_updates=n)``, ``n`` counting the updates of the run
      (``num_update_steps_completed`` after the update; it continues across a resume).
    - After each training epoch: ``scheduler.step(epoch)``, ``epoch`` counting the finished training-run epochs
      from 1 (timm's ``step(epoch + 1)`` after the 0-based epoch ``epoch``).
    """

    @property
    def num_updates(self) -> Optional[int]:
        """The updates made so far in the run: what the last ``step_update`` was given (pytorch-accelerated's name)."""
        return self.num_update_steps_completed

    def scheduler_step(self) -> None:
        if self.scheduler is not None:  # called before the run's count takes this update in
            self.scheduler.step_update(num_updates=self.num_update_steps_completed + 1)

    def train_epoch_end(self) -> None:
        super().train_epoch_end()
        if self.scheduler is not None:
            self.scheduler.step(self.run_history.current_epoch)
