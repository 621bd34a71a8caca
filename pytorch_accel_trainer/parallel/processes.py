"""The processes of a launch: how many the launcher started, whether they need Accelerate's CPU backend, the process
state as the trainer's ``Accelerator`` sets it up, and running a function on one process first (the process
decorators, pytorch-accelerated's, public in ``pytorch_accel_trainer.utils``).

The decorators follow pytorch-accelerated 0.1.61 (Apache-2.0, Copyright (C) 2021 Chris Hughes).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import Any, TypeVar, cast

import torch
from accelerate.state import PartialState
from accelerate.utils import DistributedType, gather_object, parse_flag_from_env, reduce
from accelerate.utils.constants import TORCH_DISTRIBUTED_OPERATION_TYPES

_Function = TypeVar("_Function", bound=Callable)

# Launchers set one of these for every process they start (torchrun, accelerate launch, mpirun, MVAPICH).
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


def process_state() -> PartialState:
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
        state = process_state()
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
