"""The accumulation window: how micro-batch losses are scaled, and what is done to the gradients before an update.

Each function runs once per micro-batch or once per optimizer update and never reads a value back from the
device. ``docs/inside_the_trainer.md`` explains the arithmetic ("Scaling the loss for accumulation").
"""

from __future__ import annotations

from typing import Any, Iterable, Optional

import torch
from accelerate import Accelerator

from pytorch_accel_trainer.loop.run_state import RunState
from pytorch_accel_trainer.parallel.sharded import as_plain_tensor, clip_gradients_by_value, validate_gradients_visible
from pytorch_accel_trainer.run_config import OptionalNumber


def _gradients(parameters: Iterable[torch.nn.Parameter]) -> list:
    return [parameter.grad for parameter in parameters if parameter.grad is not None]


def scale_loss_for_accumulation(batch_output: dict, step: int, state: RunState) -> torch.Tensor:
    """The loss to back-propagate: its gradients, added over the window, are those of one large batch.

    The loss is divided by the micro-batches of its window (fewer in a partial last window of an epoch of known
    length), or, with ``num_items_in_batch``, multiplied by it (the window's total divides the gradients at the
    update, :func:`finish_window`).
    """
    loss, accumulation = batch_output["loss"], state.accumulation_steps
    if "num_items_in_batch" in batch_output:
        items = batch_output["num_items_in_batch"]
        state.add_window_items(items, opens_window=step % accumulation == 0)
        return loss * items
    if accumulation == 1:
        return loss
    window_start = step - step % accumulation
    epoch_length = state.train_epoch_length  # None: unknown, corrected by finish_window if the stream ends early
    micro_batches = accumulation if epoch_length is None else min(accumulation, epoch_length - window_start)
    return loss if micro_batches == 1 else loss / micro_batches


def finish_window(step: int, state: RunState, accelerator: Accelerator, model: torch.nn.Module) -> None:
    """Before the update that closes the window at micro-batch ``step``: rescale the gradients of a partial last
    window of an epoch of unknown length, and divide those of item-weighted losses by the window's items. A full
    window without ``num_items_in_batch`` (the common case) costs no tensor operation."""
    micro_batches, accumulation = step % state.accumulation_steps + 1, state.accumulation_steps
    if state.train_epoch_length is None and micro_batches != accumulation:  # the stream ended inside the window
        torch._foreach_mul_(_gradients(model.parameters()), accumulation / micro_batches)
    if not (isinstance(state.items_in_window, int) and state.items_in_window == 0):
        _normalise_by_items_in_window(state.take_window_items(), accelerator, model)


def _normalise_by_items_in_window(items: Any, accelerator: Accelerator, model: torch.nn.Module) -> None:
    """Divide the gradients of a window of item-weighted losses by its ``items`` (the window's ``num_items_in_batch``
    sum on this process), summed over every process.

    One small all-reduce per update in a multi-process run, kept on the device: no synchronisation. DDP has
    averaged the gradients over processes, hence the factor ``num_processes``.
    """
    validate_gradients_visible(accelerator, "num_items_in_batch")
    items = torch.as_tensor(items, device=accelerator.device, dtype=torch.float32)
    if accelerator.num_processes > 1:
        items = accelerator.reduce(items, "sum") / accelerator.num_processes
    torch._foreach_div_(_gradients(model.parameters()), items)


def clip_gradients(
    accelerator: Accelerator,
    model: torch.nn.Module,
    clip_norm: OptionalNumber,
    clip_value: OptionalNumber,
    track_norm: bool,
) -> Optional[torch.Tensor]:
    """Clip the accumulated gradients by norm and/or value; once per update. Return their total norm (before
    clipping) when clipping by norm or ``track_norm``, else ``None``.

    Under fp16 the gradients are unscaled once, first (a second unscale in one update is an error for
    GradScaler). The norm stays on the device: no host-device sync.
    """
    norm, unscaled = None, False
    if clip_norm is not None:
        norm = as_plain_tensor(accelerator.clip_grad_norm_(model.parameters(), max_norm=clip_norm))  # FSDP2: DTensor
        unscaled = True
    elif track_norm:
        accelerator.unscale_gradients()  # a no-op without an fp16 gradient scaler
        gradients = _gradients(model.parameters())
        norm = as_plain_tensor(torch.nn.utils.get_total_norm(gradients)) if gradients else None
        unscaled = True
    if clip_value is not None and unscaled:
        torch.nn.utils.clip_grad_value_(model.parameters(), clip_value=clip_value)
    elif clip_value is not None:
        clip_gradients_by_value(accelerator, model.parameters(), clip_value)
    return norm
