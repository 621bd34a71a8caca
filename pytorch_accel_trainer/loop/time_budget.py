"""The time budget of a training run, ``train(max_time=...)``: every process stops at the same update, before it is
spent, for clusters that end a job at a wall-clock limit (SLURM's ``--time``).

Each process reads its own clock (``time.monotonic``: no device sync) at each point where the processes agree to stop
anyway (between two updates, as a window opens; after the training epoch; after the epoch's end). The budget counts
as spent there when the time used since ``train()`` started, plus 1.2 times the longest time seen so far from such a
point to the next one of the same kind (headroom for a busy machine), plus the longest save of the run, would pass
it. A process that finds it spent holds a :class:`~pytorch_accel_trainer.errors.TimeBudgetExceeded`; the agreement
made at that point (one small host-side collective per update window with several processes, none with one) stops
every process at that same update. The
budget adds no collective of its own.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Iterable, Optional

from pytorch_accel_trainer.callbacks.training_state import SaveTrainingStateCallback
from pytorch_accel_trainer.errors import TimeBudgetExceeded
from pytorch_accel_trainer.state.storage import Location, as_location, validate_location
from pytorch_accel_trainer.validation import max_time_seconds

if TYPE_CHECKING:
    from pytorch_accel_trainer.run_config import TrainOptions


#: How much longer than the longest interval seen so far the next one is allowed to be, in the budget's estimate.
_HEADROOM = 1.2


class TimeBudget:
    """A run's ``max_time``: when to stop, and what to say then.

    Args:
        seconds: the budget, from the start of ``train()``.
        max_time: the budget as the user gave it (for messages).
        save_dir: where the state of a run it stops is saved (``max_time_save_dir``, else the ``save_dir`` of the
            run's ``SaveTrainingStateCallback``); ``None`` when none is.
    """

    def __init__(self, seconds: float, max_time: Any, save_dir: Optional[Location]):
        self.seconds, self.max_time, self.save_dir = seconds, max_time, save_dir
        self.started_at = time.monotonic()
        self._last_check: Optional[tuple[str, float]] = None
        self._longest_after: dict[str, float] = {}  # by kind of point: the longest time from one to the next check
        self._longest_save = 0.0

    def is_spent(self, point: str) -> bool:
        """Whether the run must stop at this ``point`` (``"update"``, ``"epoch_trained"``, ``"epoch_end"``) to end
        before the budget is spent; called at every such point, it measures the time between them."""
        now = time.monotonic()
        if self._last_check is not None:
            last_point, last_time = self._last_check
            self._longest_after[last_point] = max(self._longest_after.get(last_point, 0.0), now - last_time)
        self._last_check = (point, now)
        # the longest interval seen, with headroom: the next one may run a little longer (a busy machine)
        time_to_next_point = self._longest_after.get(point, 0.0) * _HEADROOM
        return now - self.started_at + time_to_next_point + self._longest_save >= self.seconds

    def note_save(self, seconds: float) -> None:
        """Count a training state's save time (the state saved at a stop must fit in the budget too)."""
        self._longest_save = max(self._longest_save, seconds)

    def exceeded(self, num_update_steps_completed: int) -> TimeBudgetExceeded:
        """The stop, with the one line that says where the state is and how to resume."""
        used = time.monotonic() - self.started_at
        if self.save_dir is not None:
            resume = (
                f"the training state is saved in {str(self.save_dir)!r} as the run ends; to continue, run the same "
                f"train(...) with resume_from={str(self.save_dir)!r}"
            )
        else:
            resume = (
                "no training state is saved: attach a SaveTrainingStateCallback or pass max_time_save_dir to "
                "continue such a run later"
            )
        return TimeBudgetExceeded(
            f"Time budget max_time={self.max_time!r} ({self.seconds:g} s) nearly spent after {used:.1f} s: stopped "
            f"after {num_update_steps_completed} optimizer updates; {resume}."
        )


def create_time_budget(options: TrainOptions, callbacks: Iterable) -> Optional[TimeBudget]:
    """The run's :class:`TimeBudget` (``None`` without ``max_time``), its clock started now."""
    seconds = max_time_seconds(options.max_time)
    if seconds is None:
        return None
    validate_location(options.max_time_save_dir)
    save_dir = options.max_time_save_dir
    if save_dir is None:
        save_dir = next(
            (callback.save_dir for callback in callbacks if isinstance(callback, SaveTrainingStateCallback)), None
        )
    return TimeBudget(seconds, options.max_time, None if save_dir is None else as_location(save_dir))
