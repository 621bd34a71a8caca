"""Skipping (or retrying) optimizer updates whose gradients are not finite."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Optional

import torch


@dataclass
class NonFinitePolicy:
    """What the trainer does with an update whose gradients hold a NaN or an infinity.

    Attributes:
        max_consecutive_skips: stop the run (``StopTrainingError``) after this many skipped updates in a row;
            ``None`` never stops.
        max_retries: first run the step's forward and backward again this many times (only without gradient
            accumulation, where the step is a single batch): dropout draws new masks, so a transient overflow
            may pass.
    """

    max_consecutive_skips: Optional[int] = None
    max_retries: int = 0
    consecutive_skips: int = 0
    skipped_in_epoch: int = 0
    skipped_in_run: int = 0
    loss_snapshot: Optional[dict] = field(default=None, repr=False)

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
