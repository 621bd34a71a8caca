"""Leaf helpers with no knowledge of the trainer, and pytorch-accelerated's public ``utils`` names.

``LimitBatches``, ``DataLoaderSlice``, the process decorators, ``ModelEma``, ``worker_init_fn`` and
``remove_padding`` follow pytorch-accelerated 0.1.61 (Apache-2.0, Copyright (C) 2021 Chris Hughes), whose
``ModelEma`` is adapted from timm's ``utils/model_ema.py``.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import numbers
import os
import random
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, TypeVar, cast

import numpy as np
import torch
from accelerate.data_loader import DataLoaderStateMixin
from accelerate.state import PartialState
from accelerate.utils import DistributedType, extract_model_from_parallel, gather_object, parse_flag_from_env, reduce
from accelerate.utils.constants import TORCH_DISTRIBUTED_OPERATION_TYPES
from torch import nn

#: Set this environment variable to a number of batches to add a ``LimitBatchesCallback`` to every trainer
#: created while it is set (a quick debugging run); :class:`LimitBatches` sets it for a block of code.
LIMIT_BATCHES_ENV_VAR = "PT_ACC_LIMIT_BATCHES"

_Function = TypeVar("_Function", bound=Callable)


def dataloader_length(dataloader: Any) -> int | None:
    """Return ``len(dataloader)``, or ``None`` when it has no length (an iterable or streaming dataset)."""
    if dataloader is None:
        return None
    try:
        return len(dataloader)
    except TypeError:
        return None


def dataloader_batch_size(dataloader: Any) -> int | None:
    """The batch size of a DataLoader, also when a batch sampler sets it; ``None`` when unknown."""
    return (
        dataloader.batch_size
        if dataloader.batch_size is not None
        else getattr(dataloader.batch_sampler, "batch_size", None)
    )


def dataset_length(dataset: Any) -> int | None:
    """Return ``len(dataset)``, or ``None`` when the dataset has no ``__len__``."""
    return dataloader_length(dataset)


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


# ----------------------------------------------------------------------------------------------------
# Limiting the batches of a run
# ----------------------------------------------------------------------------------------------------


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


# ----------------------------------------------------------------------------------------------------
# Running a function on some processes
# ----------------------------------------------------------------------------------------------------


_WORLD_SIZE_VARIABLES = ("WORLD_SIZE", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE")


def launched_world_size() -> int:
    """The number of processes the launcher started, from its environment variables (1 without a launcher)."""
    for name in _WORLD_SIZE_VARIABLES:
        value = os.environ.get(name)
        if value and value.isdigit():
            return int(value)
    return 1


def needs_cpu_backend() -> bool:
    """Whether this is a multi-process launch on a machine with no accelerator (GPU, XPU, ...).

    Accelerate then runs each process as an independent single-process training unless told to use the
    CPU (``ACCELERATE_USE_CPU=1`` or ``--cpu``); the trainer tells it.
    """
    return launched_world_size() > 1 and not torch.accelerator.is_available()


def _process_state() -> PartialState:
    """Accelerate's process state, set up the way the trainer's ``Accelerator`` would set it up when nothing has yet:
    on the CPU backend (gloo) under ``ACCELERATE_USE_CPU=1``, or for a multi-process launch on a machine without
    an accelerator, so that the processes of one launch are one job and not independent ones."""
    # once set up, PartialState(...) returns the state as it is and ignores its arguments
    return PartialState(cpu=parse_flag_from_env("ACCELERATE_USE_CPU") or needs_cpu_backend())


def _wait_for_everyone_sharing(state: PartialState, failed: bool) -> bool:
    """Wait for every process, as ``wait_for_everyone()`` does, and return whether any of them ``failed``.

    The barrier is an all-reduce of one flag, so a process whose function raised still reaches it and the
    others learn of it, instead of waiting for it forever. A host-device sync, like any barrier.
    """
    if state.num_processes == 1:
        return failed
    if (
        state.distributed_type != DistributedType.XLA
        and state.distributed_type.value not in TORCH_DISTRIBUTED_OPERATION_TYPES
    ):
        state.wait_for_everyone()  # no collective to carry the flag: a plain barrier
        return failed
    flag = torch.tensor(float(failed), device=state.device)
    return bool(reduce(flag, "sum").item() > 0)


def _errors_of_every_process(state: PartialState, error: BaseException | None) -> list[str]:
    """Once :func:`_wait_for_everyone_sharing` has said that a process failed: the error of each process that did,
    as ``"Type: message"`` (``error`` is this process's, or ``None``). A collective that every process calls after
    that barrier; nothing where no torch.distributed collective carries objects (one process, XLA)."""
    if state.num_processes == 1 or state.distributed_type.value not in TORCH_DISTRIBUTED_OPERATION_TYPES:
        return []
    texts = gather_object([None if error is None else f"{type(error).__name__}: {error}"])
    return [text for text in texts if text is not None]


def _raise_if_another_failed(state: PartialState, anyone_failed: bool, func: Callable, where: str) -> None:
    if anyone_failed:
        errors = "; ".join(_errors_of_every_process(state, None))
        raise RuntimeError(
            f"{func.__qualname__} raised on {where}{f' ({errors})' if errors else ''}, so this process stops too "
            "instead of waiting for it: see that process's traceback for the error."
        )


def _call_then_wait(func: Callable, args: tuple, kwargs: dict, state: PartialState, where: str) -> Any:
    try:
        result = func(*args, **kwargs)
    except BaseException as error:
        if _wait_for_everyone_sharing(state, failed=True):
            _errors_of_every_process(state, error)  # the others name it in their own error
        raise
    _raise_if_another_failed(state, _wait_for_everyone_sharing(state, failed=False), func, where)
    return result


def _first_on_one_process(func: _Function, where: str, runs_first: Callable, others_run_it: bool) -> _Function:
    """``func`` run where ``runs_first(state)`` holds, then a barrier that says whether it failed; then, with
    ``others_run_it``, run by the other processes too (they return ``None`` otherwise)."""

    @functools.wraps(func)
    def wrapper(*args, **kwargs):
        state = _process_state()
        if runs_first(state):
            return _call_then_wait(func, args, kwargs, state, where)
        _raise_if_another_failed(state, _wait_for_everyone_sharing(state, failed=False), func, where)
        return func(*args, **kwargs) if others_run_it else None

    return cast(_Function, wrapper)  # functools.wraps keeps func's signature, which its typing cannot say


def local_process_zero_only(func: _Function) -> _Function:
    """Decorate ``func`` to run only on the main process of each node; every process then waits for the others.

    The other processes return ``None``. Call the decorated function on every process (a barrier follows it).
    If ``func`` raises, it raises there as usual and every other process raises a ``RuntimeError`` that
    names ``func`` and its error (``"ValueError: ..."``), rather than waiting at the barrier forever. With one
    process it is ``func`` itself.

    Example::

        @local_process_zero_only
        def download_weights():
            ...
    """

    return _first_on_one_process(func, "a node's main process", lambda state: state.local_process_index == 0, False)


def local_process_zero_first(func: _Function) -> _Function:
    """Decorate ``func`` to run on the main process of each node first, then on the other processes.

    For work whose result the others reuse, such as downloading or preprocessing a dataset into a cache:
    every process returns its own result. Call the decorated function on every process. If ``func`` raises
    on a node's main process, the other processes raise a ``RuntimeError`` that names it and its error, without
    running ``func``, rather than waiting forever.

    Example::

        @local_process_zero_first
        def load_dataset():
            return datasets.load_dataset("imdb")  # downloads once per node, then reads the cache
    """

    return _first_on_one_process(func, "a node's main process", lambda state: state.local_process_index == 0, True)


def world_process_zero_only(func: _Function) -> _Function:
    """Decorate ``func`` to run only on the main process of the whole job; every process then waits for it.

    The other processes return ``None``. Call the decorated function on every process (a barrier follows it).
    If ``func`` raises, it raises there as usual and every other process raises a ``RuntimeError`` that
    names ``func`` and its error (``"ValueError: ..."``), rather than waiting at the barrier forever. With one
    process it is ``func`` itself.

    Example::

        @world_process_zero_only
        def write_report(path):
            ...
    """

    return _first_on_one_process(func, "the main process", lambda state: state.process_index == 0, False)


# ----------------------------------------------------------------------------------------------------
# An exponential moving average of a model's weights
# ----------------------------------------------------------------------------------------------------


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


def is_mapping(value: Any) -> bool:
    """``isinstance(value, Mapping)``, with the common cases first: the abstract-class check costs about 1 us, on
    every step."""
    if isinstance(value, dict):
        return True
    return not isinstance(value, (tuple, list, torch.Tensor)) and isinstance(value, Mapping)


def model_output_loss(model_outputs: Any) -> torch.Tensor:
    """The ``loss`` a model returned with its output (a transformers ``ModelOutput``, a dict or an object)."""
    loss = model_outputs.get("loss") if isinstance(model_outputs, Mapping) else getattr(model_outputs, "loss", None)
    if loss is None:
        raise ValueError(
            f"loss_func is None and the model output (a {type(model_outputs).__name__}) has no 'loss'. Pass "
            "Trainer(loss_func=...), or return a loss from the model (transformers models do when the batch has "
            "'labels')."
        )
    return loss


def training_modes(module: torch.nn.Module) -> list[tuple[torch.nn.Module, bool]]:
    """The training mode of every submodule of ``module``, for :func:`restore_training_modes`."""
    return [(submodule, submodule.training) for submodule in module.modules()]


def restore_training_modes(modes: list[tuple[torch.nn.Module, bool]]) -> None:
    """Put back the modes :func:`training_modes` read, module by module (a frozen layer may be in evaluation mode on
    purpose, so one ``module.train()`` would not do)."""
    for submodule, training in modes:
        submodule.training = training


@contextlib.contextmanager
def training_modes_kept(module: torch.nn.Module) -> Iterator[None]:
    """Put back the training mode of every submodule of ``module`` on leaving the block (see
    :func:`restore_training_modes`)."""
    modes = training_modes(module)
    try:
        yield
    finally:
        restore_training_modes(modes)


#: What :func:`first_batch` returns for batches that hold none, when that is allowed.
NO_BATCH = object()


def first_batch(iterator: Iterator, error_message: str | None) -> Any:
    """The first batch of ``iterator``; when there is none, raise ``ValueError(error_message)`` (``None``: return
    :data:`NO_BATCH` instead). Accelerate's dispatcher (iterable datasets) says an empty dataset in its own words,
    which become ``error_message`` too."""
    try:
        return next(iterator)
    except StopIteration:
        if error_message is None:
            return NO_BATCH
        raise ValueError(error_message) from None
    except ValueError as error:
        if error_message is None or "does not contain any data" not in str(error):
            raise
        raise ValueError(error_message) from error


def require_batches(batches: Iterable, error_message: str) -> Iterator:
    """Yield from ``batches``; raise ``ValueError(error_message)`` if there is none."""
    iterator = iter(batches)
    yield first_batch(iterator, error_message)
    yield from iterator


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
