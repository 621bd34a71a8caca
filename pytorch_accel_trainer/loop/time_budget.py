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
from typing import TYPE_CHECKING, Any, Callable, Iterable, Optional

import torch

from pytorch_accel_trainer.errors import TimeBudgetExceeded
from pytorch_accel_trainer.run_config import max_time_seconds
from pytorch_accel_trainer.state.storage import (
    TRAINING_STATES,
    Location,
    WriteSpeed,
    as_location,
    declared_destinations,
    probe_destination,
    validate_location,
)

if TYPE_CHECKING:
    from pytorch_accel_trainer.run_config import TrainOptions


#: How much longer than the longest interval seen so far the next one is allowed to be, in the budget's estimate.
_HEADROOM = 1.2
#: The files of a training state a process writes and syncs (its shard, its rank file, the main process's trainer
#: file, DCP's metadata, the manifest) and the folders synced, for the estimate of a first save.
_FILES_PER_STATE = 8
#: How much longer than the probe's estimate a first save may take (pickling, checksums, a busier disk).
_SAVE_HEADROOM = 2.0


class TimeBudget:
    """A run's ``max_time``: when to stop, and what to say then.

    Args:
        seconds: the budget, from the start of ``train()``.
        max_time: the budget as the user gave it (for messages).
        save_dir: where the state of a run it stops is saved (``max_time_save_dir``, else the first folder of
            training states a callback declares, ``TrainerCallback.writes_to``: a ``SaveTrainingStateCallback``'s
            ``save_dir``); ``None`` when none is.
    """

    def __init__(
        self,
        seconds: float,
        max_time: Any,
        save_dir: Optional[Location],
        write_speed: Optional[WriteSpeed] = None,
        state_bytes: Optional[Callable[[], Optional[int]]] = None,
    ):
        self.seconds, self.max_time, self.save_dir = seconds, max_time, save_dir
        self.started_at = time.monotonic()
        self._last_check: Optional[tuple[str, float]] = None
        self._longest_after: dict[str, float] = {}  # by kind of point: the longest time from one to the next check
        self._longest_save = 0.0
        self._write_speed, self._state_bytes = write_speed, state_bytes
        self._save_estimate: Optional[float] = None

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
        return now - self.started_at + time_to_next_point + self._time_to_save() >= self.seconds

    def note_save(self, seconds: float) -> None:
        """Count a training state's save time (the state saved at a stop must fit in the budget too)."""
        self._longest_save = max(self._longest_save, seconds)

    def _time_to_save(self) -> float:
        """The time the save at a stop will take: the longest save of the run; before the first one, an estimate
        from the state's size and the speed the save folder showed as the run started (its probe), with headroom."""
        if self._longest_save > 0 or self.save_dir is None or self._write_speed is None:
            return self._longest_save
        if self._save_estimate is None and self._state_bytes is not None:
            num_bytes = self._state_bytes()  # None until the optimizer holds its state (after the first update)
            if num_bytes is not None:
                self._save_estimate = self._write_speed.seconds_for(_FILES_PER_STATE, num_bytes) * _SAVE_HEADROOM
        return self._save_estimate or 0.0

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


def create_time_budget(
    options: TrainOptions,
    callbacks: Iterable,
    measures: bool = True,
    state_bytes: Optional[Callable[[], Optional[int]]] = None,
) -> Optional[TimeBudget]:
    """The run's :class:`TimeBudget` (``None`` without ``max_time``), its clock started now.

    Where the run saves at a stop, and ``measures`` (the main process: any process's stop stops all), the save folder
    is probed first (a 4 MiB file written and synced, then removed: a fraction of a second) so that the budget keeps
    time for the first save before any save was timed; ``state_bytes`` gives the state's size.
    """
    started = time.monotonic()
    seconds = max_time_seconds(options.max_time)
    if seconds is None:
        return None
    validate_location(options.max_time_save_dir)
    save_dir = options.max_time_save_dir
    if save_dir is None:
        save_dir = next(  # the first folder of training states a callback declares it writes
            (
                destination.location
                for destination in declared_destinations(callbacks)
                if destination.holds == TRAINING_STATES
            ),
            None,
        )
    location = None if save_dir is None else as_location(save_dir)
    write_speed = None
    if location is not None and measures:
        write_speed = probe_destination(location, "where the time budget saves", measure=True)
    budget = TimeBudget(seconds, options.max_time, location, write_speed, state_bytes)
    budget.started_at -= time.monotonic() - started  # the probe counts against the budget
    return budget


def training_state_bytes(model: Any, optimizer: Any) -> int:
    """The bytes of this process's part of a training state's tensors (its parameters and buffers, under FSDP its
    shards, and its optimizer state), from the tensors' sizes on the host: no device work. Adam's moments exist only
    after the first update: count then."""

    def size(tensor: Any) -> int:
        local = getattr(tensor, "_local_tensor", tensor)  # a DTensor's shard on this process
        return local.numel() * local.element_size() if isinstance(local, torch.Tensor) else 0

    optimizer_state = {} if optimizer is None else optimizer.state
    optimizer_tensors = (value for state in optimizer_state.values() for value in state.values())
    return sum(size(tensor) for tensor in (*model.parameters(), *model.buffers(), *optimizer_tensors))
