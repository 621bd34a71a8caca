"""The accumulation window: how micro-batch losses are scaled, and what is done to the gradients before an update.

Each function runs once per micro-batch or once per optimizer update and never reads a value back from the
device. ``docs/inside_the_trainer.md`` explains the arithmetic ("Scaling the loss for accumulation").
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterable, Optional

import torch
from accelerate import Accelerator

from pytorch_accel_trainer.loop.run_state import RunState
from pytorch_accel_trainer.parallel.sharded import as_plain_tensor, clip_gradients_by_value, validate_gradients_visible
from pytorch_accel_trainer.run_config import OptionalNumber


def _gradients(parameters: Iterable[torch.nn.Parameter]) -> list:
    return [parameter.grad for parameter in parameters if parameter.grad is not None]


def is_window_start(step: int, accumulation: int) -> bool:
    """Whether micro-batch ``step`` opens an accumulation window: no gradient is pending before it."""
    return step % accumulation == 0


def micro_batches_in_window(step: int, accumulation: int, epoch_length: Optional[int]) -> int:
    """The number of micro-batches in the accumulation window of ``step``, where it is known."""
    if epoch_length is None:
        return accumulation  # corrected by complete_partial_window if the stream ends early
    window_start = step - step % accumulation
    return min(accumulation, epoch_length - window_start)


def scale_loss_for_accumulation(batch_output: dict, step: int, accumulation: int, state: RunState) -> torch.Tensor:
    """The loss to back-propagate: its gradients, added over the window, are those of one large batch."""
    loss = batch_output["loss"]
    if "num_items_in_batch" in batch_output:  # summed over items here, divided by the window's total at the update
        items = batch_output["num_items_in_batch"]
        state.add_window_items(items, opens_window=is_window_start(step, accumulation))
        return loss * items
    micro_batches = micro_batches_in_window(step, accumulation, state.train_epoch_length)  # also a partial window
    return loss if micro_batches == 1 else loss / micro_batches


def complete_partial_window(step: int, accumulation: int, epoch_length: Optional[int], model: torch.nn.Module) -> None:
    """Rescale the gradients of a partial last window of an epoch of unknown length (once per epoch)."""
    micro_batches = step % accumulation + 1
    if epoch_length is not None or micro_batches == accumulation:
        return
    torch._foreach_mul_(_gradients(model.parameters()), accumulation / micro_batches)


def normalise_by_items_in_window(items: Any, accelerator: Accelerator, model: torch.nn.Module) -> None:
    """Divide the gradients of a window of item-weighted losses by its ``items`` (the window's ``num_items_in_batch``
    sum on this process, ``RunState.take_window_items``), summed over every process.

    One small all-reduce per update in a multi-process run, kept on the device: no synchronisation. DDP has
    averaged the gradients over processes, hence the factor ``num_processes``.
    """
    if isinstance(items, int) and items == 0:
        return  # the losses of this window carry no num_items_in_batch
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


_SYNCING = contextlib.nullcontext()  # reusable: one for every step that syncs (or needs no sync)


def gradient_sync_context(accelerator: Accelerator, model: torch.nn.Module, is_update: bool, accumulation: int):
    """``no_sync`` inside an accumulation window, so that DDP all-reduces the gradients once, at its last
    micro-batch."""
    if is_update or accumulation == 1:
        return _SYNCING
    return accelerator.no_sync(model)
