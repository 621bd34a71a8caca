"""What is done to the accumulated gradients before an update: a window's correction, and clipping.

The window's state and how each micro-batch's loss is scaled are the run state's (``RunState.scale_loss``,
``RunState.end_window``); the functions here run once per optimizer update, only where the run asks for them (a window
that needs a correction, clipping or a gradient norm), and never read a value back from the device.
``docs/inside_the_trainer.md`` explains the arithmetic ("Scaling the loss for accumulation").
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


def finish_window(step: int, state: RunState, accelerator: Accelerator, model: torch.nn.Module) -> None:
    """Before the update that closes the window at micro-batch ``step``, where ``state.window_needs_correction``:
    rescale the gradients of a partial last window of an epoch of unknown length, and divide those of item-weighted
    losses by the window's items (``RunState.scale_loss`` scaled each micro-batch's loss)."""
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
