"""The non-finite gradient policy: which updates to retry or skip, and what a skipped window gives back.

The whole policy is here. Under it, the trainer's loop makes two calls: :meth:`NonFinitePolicy.remember_micro_batch`
before each micro-batch's forward pass (the window's batches, and the epoch's trackers before the window), and
:meth:`NonFinitePolicy.skips_update` once per optimizer update, with the function that runs a window again. The
default run has no policy and calls neither.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Optional

import torch

from pytorch_accel_trainer.errors import NonFiniteGradientsError, StopTrainingError, validate_non_finite_policy
from pytorch_accel_trainer.loop.run_state import RunState

#: Runs the forward and backward passes of a window's micro-batches again: given their ``(batch, step)`` pairs.
ReplayWindow = Callable[[list], None]


@dataclass
class NonFinitePolicy:
    """What the trainer does with an update whose gradients hold a NaN or an infinity.

    Attributes:
        max_consecutive_skips: stop the run (``StopTrainingError``) after this many skipped updates in a row;
            ``None`` never stops.
        max_retries: first run the forward and backward passes of the update's accumulation window again this many
            times (every micro-batch of it): dropout draws new masks, so a transient overflow may pass. Under
            gradient accumulation the window's batches are kept until its update (``window_batches``), which holds
            up to ``gradient_accumulation_steps`` batches in memory.
        on_exhausted: what happens when the retries run out: ``"skip"`` the update and go on, ``"stop"`` the run
            there (``StopTrainingError``), or stop it and ``"raise"`` :class:`NonFiniteGradientsError` once the run
            has ended (the error is kept in ``error`` for the trainer).
        error: the :class:`NonFiniteGradientsError` to raise at the end of the run (``on_exhausted="raise"``).
        consecutive_skips, skipped_in_epoch, skipped_in_run: the skipped updates, in a row, in the epoch (the
            callback that records it resets it) and in the run.
        loss_snapshot, metrics_snapshot: the epoch's training trackers before the current window: what a skipped
            window gives back.
        window_batches: the ``(batch, step)`` of each micro-batch of the current window, kept when retrying.
    """

    max_consecutive_skips: Optional[int] = None
    max_retries: int = 0
    on_exhausted: str = "skip"
    error: Optional[NonFiniteGradientsError] = None
    consecutive_skips: int = 0
    skipped_in_epoch: int = 0
    skipped_in_run: int = 0
    loss_snapshot: dict = field(default_factory=dict, repr=False)
    metrics_snapshot: dict = field(default_factory=dict, repr=False)
    window_batches: list = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        validate_non_finite_policy(self.max_consecutive_skips, self.max_retries, self.on_exhausted)

    def remember_micro_batch(self, state: RunState, batch: Any, step: int, opens_window: bool) -> None:
        """Before a micro-batch's forward pass: at the window's first, take a snapshot of the epoch's trackers (what
        a skipped window goes back to; device copies, no sync); keep the batch if windows are retried."""
        if opens_window:
            self.loss_snapshot, self.metrics_snapshot = state.snapshot_train_trackers()
        if not self.max_retries:
            return  # nothing will be retried: keep no batch alive
        if opens_window:
            self.window_batches = []
        self.window_batches.append((batch, step))

    def skips_update(
        self, state: RunState, model: torch.nn.Module, optimizer: torch.optim.Optimizer, replay_window: ReplayWindow
    ) -> bool:
        """Check the window's gradients; while they are not finite, run the window again (up to ``max_retries``
        times, ``replay_window(window_batches)``) or give up. Return whether the update must be skipped.

        Each failed check discards the window: the gradients are zeroed, and the epoch's trackers go back to their
        snapshot from before the window. A retry fires no event. One read back from the device per check.

        Raises:
            StopTrainingError: ``max_consecutive_skips`` updates in a row were skipped, or the retries ran out under
                ``on_exhausted="stop"`` or ``"raise"``.
        """
        retries = 0
        while not gradients_are_finite(model.parameters()):
            state.restore_train_trackers(self.loss_snapshot, self.metrics_snapshot)
            optimizer.zero_grad(set_to_none=True)
            if retries < self.max_retries:
                retries += 1
                replay_window(self.window_batches)
                continue
            self.record_skip()
            if self.on_exhausted != "skip":
                self._stop_after_retries(state, retries)
            if self.must_stop:
                raise StopTrainingError(
                    f"Stopping training after {self.consecutive_skips} consecutive updates with non-finite gradients"
                )
            return True
        self.record_update()
        return False

    def _stop_after_retries(self, state: RunState, retries: int) -> None:
        """End the run at an update whose retries ran out (``on_exhausted="stop"`` or ``"raise"``); for ``"raise"``,
        keep the error the trainer raises once the run has ended."""
        update = state.num_update_steps_completed + 1
        message = (
            f"the gradients of optimizer update {update} (epoch {state.epoch + 1}, batch {state.batch_idx}) were not "
            f"finite after {retries} {'retry' if retries == 1 else 'retries'} (on_exhausted={self.on_exhausted!r}); "
            "the update was not applied"
        )
        if self.on_exhausted == "raise":
            self.error = NonFiniteGradientsError(
                f"Training stopped: {message}. Lower the learning rate, clip the gradients (gradient_clip_norm), check "
                "the data for NaN or infinite values, or pass on_exhausted='skip' to skip such updates."
            )
        raise StopTrainingError(f"Stopping training: {message}")

    def summary(self) -> str:
        """One line for the console: the updates skipped in the run."""
        return (
            f"Skipped {self.skipped_in_run} optimizer update{'s' if self.skipped_in_run != 1 else ''} whose gradients "
            f"were not finite (after {self.max_retries} retries each; on_exhausted={self.on_exhausted!r})."
        )

    def record_skip(self) -> None:
        """Count a skipped update."""
        self.consecutive_skips += 1
        self.skipped_in_epoch += 1
        self.skipped_in_run += 1

    def record_update(self) -> None:
        """Count an update made: the skips in a row start again from 0."""
        self.consecutive_skips = 0

    @property
    def must_stop(self) -> bool:
        """Whether ``max_consecutive_skips`` updates in a row were skipped."""
        return self.max_consecutive_skips is not None and self.consecutive_skips >= self.max_consecutive_skips


def gradients_are_finite(parameters: Iterable[torch.nn.Parameter]) -> bool:
    """Whether every gradient is finite: one fused norm on the device, then one read back to the host."""
    gradients = [parameter.grad for parameter in parameters if parameter.grad is not None]
    if not gradients:
        return True
    norms = torch._foreach_norm(gradients)
    return bool(torch.isfinite(torch.stack(norms)).all().item())  # the host read, once per optimizer update
