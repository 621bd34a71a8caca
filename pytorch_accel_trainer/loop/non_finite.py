"""Skipping (or retrying) optimizer updates whose gradients are not finite."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Optional

import torch

from pytorch_accel_trainer.errors import StopTrainingError


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
        window_batches: the ``(batch, step)`` of each micro-batch of the current window, kept when retrying.
    """

    max_consecutive_skips: Optional[int] = None
    max_retries: int = 0
    consecutive_skips: int = 0
    skipped_in_epoch: int = 0
    skipped_in_run: int = 0
    loss_snapshot: Optional[dict] = field(default=None, repr=False)
    metrics_snapshot: dict = field(default_factory=dict, repr=False)
    window_batches: list = field(default_factory=list, repr=False)

    def remember_micro_batch(self, batch: Any, step: int, opens_window: bool) -> None:
        """Keep a micro-batch of the current window, to run it again if the window's gradients are not finite."""
        if not self.max_retries:
            return  # nothing will be retried: keep no batch alive
        if opens_window:
            self.window_batches = []
        self.window_batches.append((batch, step))

    def record_skip(self) -> None:
        self.consecutive_skips += 1
        self.skipped_in_epoch += 1
        self.skipped_in_run += 1

    def record_update(self) -> None:
        self.consecutive_skips = 0

    @property
    def must_stop(self) -> bool:
        return self.max_consecutive_skips is not None and self.consecutive_skips >= self.max_consecutive_skips


def gradients_are_finite(parameters: Iterable[torch.nn.Parameter]) -> bool:
    """Whether every gradient is finite: one fused norm on the device, then one read back to the host."""
    gradients = [parameter.grad for parameter in parameters if parameter.grad is not None]
    if not gradients:
        return True
    norms = torch._foreach_norm(gradients)
    return bool(torch.isfinite(torch.stack(norms)).all().item())  # the host read, once per optimizer update


def retry_or_skip_non_finite_update(
    state: Any, model: torch.nn.Module, optimizer: torch.optim.Optimizer, retry_window: Callable[[], None]
) -> bool:
    """Check the window's gradients under ``state.non_finite_policy``; while they are not finite, re-run the window
    (up to ``max_retries`` times) or give up. Return whether the update must be skipped.

    Each failed check discards the window: the gradients are zeroed, and the epoch's loss goes back to its value
    before the window (``policy.loss_snapshot``, taken at the safe point that opened it). A retry fires no event.
    One read back from the device per check.

    Args:
        state: the :class:`~pytorch_accel_trainer.loop.run_state.RunState` of the run.

    Raises:
        StopTrainingError: ``policy.max_consecutive_skips`` updates in a row were skipped.
    """
    policy, retries = state.non_finite_policy, 0
    while not gradients_are_finite(model.parameters()):
        state.train_loss_tracker.load_state_dict(policy.loss_snapshot)
        state.train_step_metrics.load_state_dict(policy.metrics_snapshot)
        optimizer.zero_grad(set_to_none=True)
        if retries < policy.max_retries:
            retries += 1
            retry_window()
            continue
        policy.record_skip()
        if policy.must_stop:
            raise StopTrainingError(
                f"Stopping training after {policy.consecutive_skips} consecutive updates with non-finite gradients"
            )
        return True
    policy.record_update()
    return False
