"""pytorch-accelerated's public ``utils`` names, and our public helpers of the same kind (``seed_worker``, the model
summaries). The process decorators are defined with the launch detection they need, in ``parallel/processes.py``.

``LimitBatches``, ``DataLoaderSlice``, the process decorators, ``ModelEma``, ``worker_init_fn`` and ``remove_padding``
follow pytorch-accelerated 0.1.61 (Apache-2.0, Copyright (C) 2021 Chris Hughes); its ``ModelEma`` adapts timm's.
"""

from __future__ import annotations

import copy
import numbers
import os
import random
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import numpy as np
import torch
from accelerate.data_loader import DataLoaderStateMixin
from accelerate.utils import extract_model_from_parallel
from torch import nn

from pytorch_accel_trainer.data import dataloader_length
from pytorch_accel_trainer.parallel.processes import (
    local_process_zero_first,
    local_process_zero_only,
    world_process_zero_only,
)

__all__ = [
    "LIMIT_BATCHES_ENV_VAR",
    "DataLoaderSlice",
    "LimitBatches",
    "ModelEma",
    "local_process_zero_first",
    "local_process_zero_only",
    "model_summary_line",
    "model_summary_table",
    "remove_padding",
    "seed_worker",
    "worker_init_fn",
    "world_process_zero_only",
]

#: Set this environment variable to a number of batches to add a ``LimitBatchesCallback`` to every trainer
#: created while it is set (a quick debugging run); :class:`LimitBatches` sets it for a block of code.
LIMIT_BATCHES_ENV_VAR = "PT_ACC_LIMIT_BATCHES"


def seed_worker(worker_id: int) -> None:
    """Seed numpy and ``random`` in a dataloader worker from the seed torch gave that worker.

    Torch seeds itself per worker, but not numpy, so without this every worker would draw the same
    numpy augmentations. The seeds follow from the run's seed, so a seeded run is repeatable.
    Also available as :func:`worker_init_fn`, pytorch-accelerated's name, which the trainer's dataloaders use
    (with workers) unless ``worker_init_fn`` is passed in their keyword arguments.

    Example::

        DataLoader(dataset, batch_size=8, num_workers=2, worker_init_fn=worker_init_fn)
    """
    worker_seed = torch.initial_seed() % 2**32
    np.random.seed(worker_seed)
    random.seed(worker_seed)


#: pytorch-accelerated's name of :func:`seed_worker` (the same function).
worker_init_fn = seed_worker


def remove_padding(padded_tensor: torch.Tensor, pad_value: Any) -> torch.Tensor:
    """Return ``padded_tensor`` without the rows (along dimension 0) made only of ``pad_value``.

    For a tensor gathered after ``trainer.gather(..., padding_value=pad_value)`` padded it to the same size
    on every process. A 1-dimensional tensor loses each element equal to ``pad_value``.

    Example::

        remove_padding(torch.tensor([[0, 1], [-1, -1]]), -1)  # tensor([[0, 1]])
    """
    is_padding = padded_tensor == pad_value
    if padded_tensor.dim() > 1:
        is_padding = is_padding.flatten(1).all(dim=1)
    return padded_tensor[~is_padding]


class LimitBatches:
    """A context manager: every ``Trainer`` created inside it gets a ``LimitBatchesCallback(num_batches)``.

    It sets the environment variable ``PT_ACC_LIMIT_BATCHES`` (:data:`LIMIT_BATCHES_ENV_VAR`), which the
    trainer reads when it is created, and on exit puts back the value the variable had before (or removes it),
    so blocks nest. A trainer created inside keeps its callback after the block; create a new trainer to train
    on full epochs.

    Args:
        num_batches: the most batches of each training and evaluation epoch, on each process.

    Example::

        with LimitBatches(2):
            trainer = Trainer(model, loss_func, optimizer)
        trainer.train(train_dataset, num_epochs=1)  # two batches: a quick check that the script runs
    """

    def __init__(self, num_batches: int):
        if isinstance(num_batches, bool) or not isinstance(num_batches, int) or num_batches < 1:
            raise ValueError(
                f"num_batches is {num_batches!r}; pass a positive whole number of batches, e.g. LimitBatches(2)."
            )
        self.num_batches = num_batches
        self._previous_values: list = []  # a stack, so that the same instance can be entered again inside itself

    def __enter__(self):
        self._previous_values.append(os.environ.get(LIMIT_BATCHES_ENV_VAR))
        os.environ[LIMIT_BATCHES_ENV_VAR] = str(self.num_batches)
        return self

    def __exit__(self, exc_type, exc_value, exc_traceback) -> None:
        previous = self._previous_values.pop()
        if previous is None:
            os.environ.pop(LIMIT_BATCHES_ENV_VAR, None)
        else:
            os.environ[LIMIT_BATCHES_ENV_VAR] = previous


class DataLoaderSlice:
    """The first ``slice_size`` batches of a dataloader, while ``is_active()`` says so; all of them otherwise.

    ``len()`` is ``min(slice_size, len(dl))``, and a ``TypeError`` when ``dl`` has no length (an iterable
    dataset), so that nothing mistakes ``slice_size`` for the length of a shorter iterable. Every other
    attribute (``sampler``, ``batch_size``, ``set_epoch``, ...) is the wrapped dataloader's: the trainer's
    per-epoch ``set_epoch`` still reaches the sampler, so each epoch's slice is drawn from a new shuffle. A
    pass that stops at ``slice_size`` closes the wrapped iterator at once (its worker prefetching stops) and
    ends an Accelerate dataloader's pass, as a full pass would.

    Args:
        dl: the dataloader to slice.
        slice_size: the most batches one pass yields.
        is_active: called at the start of each pass (and by ``len()``); ``None`` means always active.

    Example::

        first_batches = DataLoaderSlice(dataloader, 2)
    """

    def __init__(self, dl: Iterable, slice_size: int, is_active: Callable[[], bool] | None = None):
        self.dl = dl
        self.slice_size = slice_size
        self.is_active = is_active

    def _slicing(self) -> bool:
        return self.is_active is None or bool(self.is_active())

    def __iter__(self) -> Iterator:
        return self._first_batches() if self._slicing() else iter(self.dl)

    def _first_batches(self) -> Iterator:
        iterator = iter(self.dl)
        stopped_early = True
        try:
            for _ in range(self.slice_size):
                try:
                    batch = next(iterator)
                except StopIteration:
                    stopped_early = False
                    return
                yield batch
        finally:
            if stopped_early:
                _close(iterator, self.dl)

    def __len__(self) -> int:
        length = dataloader_length(self.dl)
        if length is None:
            raise TypeError("the wrapped dataloader has no __len__ (an iterable dataset), so its slice has none either")
        return min(length, self.slice_size) if self._slicing() else length

    def __getattr__(self, name: str) -> Any:
        if name == "dl":  # not set yet (e.g. during unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.dl, name)


def _close(iterator: Iterator, dataloader: Any) -> None:
    """Stop a pass over ``dataloader`` before its end: close its iterator (a generator), and tell an Accelerate
    dataloader that the pass is over (its ``end()``, which a full pass calls), so that it leaves the gradient state."""
    close = getattr(iterator, "close", None)
    if close is not None:
        close()
    if isinstance(dataloader, DataLoaderStateMixin):
        dataloader.end()


class ModelEma(nn.Module):
    """A copy of a model whose weights are an exponential moving average (EMA) of the model's.

    The copy (``module``) is made at creation, in eval mode and without gradients. Each :meth:`update`
    moves every floating-point parameter and buffer to ``decay * ema + (1 - decay) * weight``; other
    buffers (e.g. batch norm's ``num_batches_tracked``) are copied. Tensors are matched by name, on the model
    without its distributed or compiled wrapper, so ``model`` may be wrapped in
    ``DistributedDataParallel`` or ``torch.compile`` (at creation or update), or have its batch norms
    converted to ``SyncBatchNorm``. Weights are cast to the EMA's device and dtype, so the EMA can live on
    another device (``device=``) than the model. The update runs under ``torch.no_grad()`` as grouped
    ``torch._foreach`` operations, with no host-device sync. Calling it runs ``module``.

    Args:
        model: the model to follow (the one being trained).
        decay: the weight of the average at each update, from 0 to 1: typically 0.999 or 0.9999.
        device: where to keep the average; ``None`` keeps it where the model's weights are.

    Example::

        ema = ModelEma(model, decay=0.999)
        for batch in dataloader:
            ...  # loss.backward(), optimizer.step()
            ema.update(model)
        predictions = ema(inputs)  # ema.module(inputs)
    """

    def __init__(self, model: nn.Module, decay: float = 0.9999, device: str | torch.device | None = None):
        super().__init__()
        if isinstance(decay, bool) or not isinstance(decay, numbers.Real) or not 0 <= decay <= 1:
            raise ValueError(f"decay is {decay!r}; pass a number from 0 to 1, e.g. decay=0.9999.")
        self.module: nn.Module = copy.deepcopy(_unwrap_model(model))
        self.module.eval().requires_grad_(False)
        for parameter in self.module.parameters():
            parameter.grad = None  # deepcopy copies gradients: an average has none
        if device is not None:
            self.module.to(device)
        self.decay: float = decay

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def update_fn(self, ema_model_weights: torch.Tensor, updated_model_weights: torch.Tensor) -> torch.Tensor:
        """The new value of one floating-point tensor; override it for another rule (``update`` then calls it)."""
        return self.decay * ema_model_weights + (1.0 - self.decay) * updated_model_weights

    def update(self, model: nn.Module) -> None:
        """Move the average one step towards ``model``'s current weights."""
        self._update(model, None if type(self).update_fn is ModelEma.update_fn else self.update_fn)

    def set(self, model: nn.Module) -> None:
        """Copy ``model``'s current weights into the average."""
        self._update(model, lambda ema_weights, weights: weights)

    @torch.no_grad()
    def _update(self, model: nn.Module, update_fn: Callable | None) -> None:
        ema_floats, model_floats, ema_others, model_others = self._paired_tensors(model)
        if update_fn is None:
            torch._foreach_lerp_(ema_floats, model_floats, 1.0 - self.decay)
        elif ema_floats:
            torch._foreach_copy_(
                ema_floats, [update_fn(ema, weights) for ema, weights in zip(ema_floats, model_floats)]
            )
        if ema_others:
            torch._foreach_copy_(ema_others, model_others)

    def _paired_tensors(self, model: nn.Module) -> tuple[list, list, list, list]:
        """The EMA's tensors and the model's, matched by name, floating-point and others apart.

        Matching walks both modules (about 10 us a tensor), so the pairs are kept for the next update with the
        same ``model`` object, as long as every tensor is still in place: a ``.to()`` or ``.double()`` on
        either side (which replaces tensors) pairs them again. A check costs well under 1 us a tensor.
        """
        cached = self.__dict__.get("_pairing")
        if cached is not None and cached[0]() is model and all(store[key] is t for store, key, t in cached[1]):
            ema_floats, model_floats, ema_others, model_others = cached[2]
        else:
            ema_floats, model_floats, ema_others, model_others, watched = _pair_by_name(
                self.module, _unwrap_model(model)
            )
            self.__dict__["_pairing"] = (
                weakref.ref(model),
                watched,
                (ema_floats, model_floats, ema_others, model_others),
            )
        if any(e.device != m.device or e.dtype != m.dtype for e, m in zip(ema_floats, model_floats)):
            model_floats = [m.to(device=e.device, dtype=e.dtype) for e, m in zip(ema_floats, model_floats)]
        if any(e.device != m.device for e, m in zip(ema_others, model_others)):
            model_others = [m.to(device=e.device) for e, m in zip(ema_others, model_others)]
        return ema_floats, model_floats, ema_others, model_others

    def __getstate__(self) -> dict:
        return {key: value for key, value in self.__dict__.items() if key != "_pairing"}  # weak references: no pickle


def _unwrap_model(model: nn.Module) -> nn.Module:
    """``model`` without its ``DistributedDataParallel`` / ``torch.compile`` / DeepSpeed wrappers."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model is a {type(model).__name__}; pass the torch.nn.Module being trained.")
    return extract_model_from_parallel(model, keep_torch_compile=False)


def _tensor_slots(module: nn.Module) -> dict:
    """``{name: (store, key)}`` for each parameter and buffer once (tied weights are one), ``store[key]`` being it."""
    slots, seen = {}, set()
    for prefix, owner in module.named_modules():
        for store in (owner._parameters, owner._buffers):
            for key, tensor in store.items():
                if tensor is not None and id(tensor) not in seen:
                    seen.add(id(tensor))
                    slots[f"{prefix}.{key}" if prefix else key] = (store, key)
    return slots


def _pair_by_name(ema_module: nn.Module, model: nn.Module) -> tuple[list, list, list, list, list]:
    ema_slots, model_slots = _tensor_slots(ema_module), _tensor_slots(model)
    if ema_slots.keys() != model_slots.keys():
        missing, extra = sorted(ema_slots.keys() - model_slots.keys()), sorted(model_slots.keys() - ema_slots.keys())
        raise ValueError(
            f"The model does not have the tensors of the model the EMA was made from: it lacks {missing[:5]} and "
            f"has {extra[:5]} in addition. Update the EMA with the model it was created from."
        )
    ema_floats: list[torch.Tensor] = []
    model_floats: list[torch.Tensor] = []
    ema_others: list[torch.Tensor] = []
    model_others: list[torch.Tensor] = []
    watched: list[tuple] = []  # (store, key, tensor): a tensor replaced in its store means pairing again
    for name, (store, key) in ema_slots.items():
        model_store, model_key = model_slots[name]
        ema, weights = store[key], model_store[model_key]
        watched += [(store, key, ema), (model_store, model_key, weights)]
        (ema_floats if ema.is_floating_point() else ema_others).append(ema)
        (model_floats if ema.is_floating_point() else model_others).append(weights)
    return ema_floats, model_floats, ema_others, model_others, watched


def _count(number: int) -> str:
    """``number`` with a unit suffix, to one decimal: ``97``, ``1.2 K``, ``3.4 M``, ``7.0 B``."""
    for size, suffix in ((10**12, "T"), (10**9, "B"), (10**6, "M"), (10**3, "K")):
        if number >= size:
            return f"{number / size:.1f} {suffix}"
    return str(number)


def _parameter_counts(module: nn.Module) -> tuple[int, int, float]:
    """The parameters of ``module`` (each shared tensor once), the trainable ones, and the MiB of its parameters and
    buffers."""
    parameters = list(module.parameters())
    size = sum(tensor.numel() * tensor.element_size() for tensor in (*parameters, *module.buffers()))
    trainable = sum(parameter.numel() for parameter in parameters if parameter.requires_grad)
    return sum(parameter.numel() for parameter in parameters), trainable, size / 2**20


def model_summary_line(model: nn.Module, mixed_precision: str = "no") -> str:
    """One line that says what a model is: its class, its parameters (total and trainable), its size in MiB
    (parameters and buffers, as stored) and the precision it runs in; parts separated by `` · `` as the console's
    epoch lines are.

    Example::

        model_summary_line(nn.Linear(1000, 10), "bf16")
        # 'Model Linear · 10.0 K parameters, 10.0 K trainable · 0.038 MiB · bf16 mixed precision, float32 weights'
    """
    total, trainable, mebibytes = _parameter_counts(model)
    dtypes = sorted({str(parameter.dtype).removeprefix("torch.") for parameter in model.parameters()})
    weights = f"{'/'.join(dtypes) or 'no'} weights"
    precision = weights if mixed_precision in ("no", None) else f"{mixed_precision} mixed precision, {weights}"
    return (
        f"Model {type(model).__name__} · {_count(total)} parameters, {_count(trainable)} trainable · "
        f"{mebibytes:.3f} MiB · {precision}"
    )


def model_summary_table(model: nn.Module, max_depth: int = 1) -> str:
    """A table of ``model``'s modules down to ``max_depth`` levels (1: its children): name, class, parameters,
    trainable parameters and MiB of each, then the totals; what ``PrintProgressCallback(model_summary="full")``
    prints.

    Example::

        print(model_summary_table(model, max_depth=2))
    """
    rows = [("", "name", "type", "params", "trainable", "MiB")]
    for index, (name, module) in enumerate(
        (name, module) for name, module in model.named_modules() if name and name.count(".") < max_depth
    ):
        total, trainable, mebibytes = _parameter_counts(module)
        rows.append((str(index), name, type(module).__name__, _count(total), _count(trainable), f"{mebibytes:.3f}"))
    total, trainable, mebibytes = _parameter_counts(model)
    rows.append(("", "total", type(model).__name__, _count(total), _count(trainable), f"{mebibytes:.3f}"))
    widths = [max(len(row[column]) for row in rows) for column in range(len(rows[0]))]
    return "\n".join(
        "  ".join(
            cell.rjust(width) if column >= 3 else cell.ljust(width)
            for column, (cell, width) in enumerate(zip(row, widths))
        ).rstrip()
        for row in rows
    )
