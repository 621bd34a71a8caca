"""The only place where the package touches Accelerate's private state, for the jobs its public API cannot do.

Everything else goes through Accelerate's public API, so that the package installs beside any Accelerate from the
lower bound in ``setup.cfg`` on (``docs/versions.md``). ``tests/test_accelerate_versions.py`` fails if code outside
this module uses an Accelerate attribute whose name starts with ``_``.

Each function checks that the private attribute is there before it uses it, so that an Accelerate release that
renames one never stops a run with an ``AttributeError`` from deep inside; it does what the public API can instead:

- :func:`forget_prepared` (``Accelerator._models``, ``_optimizers``, ``_schedulers``, ``_dataloaders``): calls
  ``Accelerator.free_memory()``, the same plus a ``gc.collect()``: about 0.2 s more at each ``train()`` and
  ``evaluate()``.
- :func:`process_state_is_set_up` (``PartialState._shared_state``): answers whether an ``Accelerator`` was created
  (a bare ``PartialState()`` then goes unseen: an error message is less precise).
- :func:`undo_failed_set_up` (``AcceleratorState._reset_state``): warns that the process keeps the mixed precision
  of the ``Accelerator`` that failed.
- :func:`switch_to_fsdp2` (``PartialState._shared_state``) and :func:`attach_parallelism_config`
  (``ParallelismConfig._validate_accelerator``): run FSDP2 and a ``ParallelismConfig`` on the CPU, which Accelerate
  selects only on GPUs; without them it raises, naming the Accelerate release (there is no public way).
- :func:`mark_prepared` (the ``_is_accelerate_prepared`` flag Accelerate sets on what it prepared): a release that
  reads another flag would wrap the model the trainer sharded itself once more, which
  ``sharded.prepare_components`` refuses with a ``RuntimeError`` naming the release.

:func:`missing_internals` lists what the installed Accelerate lacks, naming its version; the test suite asserts
that the list is empty on the tested releases, so that CI notices a rename before users do.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any, Optional, cast

import accelerate
import torch
from accelerate import Accelerator, DistributedType, PartialState
from accelerate.state import AcceleratorState, is_initialized

#: Where ``Accelerator.prepare`` lists what it prepared (``save_state``, ``clip_grad_norm_`` and
#: ``unscale_gradients`` go through them).
_PREPARED_LISTS = ("_models", "_optimizers", "_schedulers", "_dataloaders")


def missing_internals(accelerator: Accelerator) -> list[str]:
    """Return the private attributes this module uses that the installed Accelerate lacks, ``[]`` when none.

    Args:
        accelerator: any ``Accelerator`` (its ``__init__`` creates the lists of what it prepares).

    Returns:
        One ``"accelerate <version>: <Class>.<attribute>"`` per missing attribute.
    """
    missing = [] if _has_prepared_lists(accelerator) else [f"Accelerator.{name}" for name in _PREPARED_LISTS]
    if _process_shared_state() is None:
        missing.append("PartialState._shared_state")
    if not callable(getattr(AcceleratorState, "_reset_state", None)):
        missing.append("AcceleratorState._reset_state")
    if not callable(getattr(_parallelism_config_class(), "_validate_accelerator", None)):
        missing.append("ParallelismConfig._validate_accelerator")
    return [f"accelerate {accelerate.__version__}: {name}" for name in missing]


def _has_prepared_lists(accelerator: Accelerator) -> bool:
    return all(isinstance(getattr(accelerator, name, None), list) for name in _PREPARED_LISTS)


def _process_shared_state() -> Optional[Mapping]:
    shared = getattr(PartialState, "_shared_state", None)  # the dict every PartialState() shares; {} until set up
    return shared if isinstance(shared, Mapping) else None


def forget_prepared(accelerator: Accelerator) -> None:
    """Make ``accelerator`` forget the models, optimizers, schedulers and dataloaders it prepared, and reset its step.

    What ``Accelerator.free_memory()`` does, without the ``gc.collect()`` that makes it cost about 0.2 s a call (over
    the large heap that ``torch._dynamo`` and sympy leave), 70 times a small ``evaluate()``: the trainer calls this at
    the start of every ``train()`` and ``evaluate()``. Where the installed Accelerate keeps them elsewhere, it calls
    ``free_memory()``.
    """
    if not _has_prepared_lists(accelerator):
        accelerator.free_memory()  # public: the same, plus the garbage collection
        return
    for name in _PREPARED_LISTS:
        setattr(accelerator, name, [])
    accelerator.step = 0


def process_state_is_set_up() -> bool:
    """Whether Accelerate's process state (``PartialState``: the processes, backend and device) is already set up in
    this process, by an ``Accelerator`` or a bare ``PartialState()``; it cannot change once it is.

    Accelerate has no public way to ask without setting it up (``PartialState().initialized`` sets it up first).
    Where the installed Accelerate keeps it elsewhere, the answer is whether an ``Accelerator`` was created
    (``accelerate.state.is_initialized()``), which misses a bare ``PartialState()``.
    """
    shared = _process_shared_state()
    return is_initialized() if shared is None else len(shared) > 0


def undo_failed_set_up() -> None:
    """Forget the ``AcceleratorState`` (mixed precision, plugins) left behind by an ``Accelerator(...)`` that then
    raised, so that the next ``Accelerator`` of this process can be set up otherwise; the process state stays.

    Accelerate fixes the mixed precision of a process when its first ``Accelerator`` is created and has no public
    way to undo it. Where the installed Accelerate cannot, this warns that the process keeps it.
    """
    reset = getattr(AcceleratorState, "_reset_state", None)
    if callable(reset):
        reset()
        return
    warnings.warn(
        f"accelerate {accelerate.__version__} has no AcceleratorState._reset_state, so the mixed precision of the "
        "Accelerator that just failed stays set in this process: restart the process (in a notebook, its kernel) to "
        "use another one, or install an Accelerate release that docs/versions.md lists as tested.",
        stacklevel=3,
    )


def _parallelism_config_class() -> Any:
    from accelerate.parallelism_config import ParallelismConfig

    return ParallelismConfig


def _missing(name: str, purpose: str) -> RuntimeError:
    return RuntimeError(
        f"accelerate {accelerate.__version__} has no {name}, which {purpose} needs. Install an Accelerate release "
        "that docs/versions.md lists as tested, or launch on GPUs, where Accelerate selects it itself."
    )


def switch_to_fsdp2(accelerator: Accelerator, plugin: Any) -> None:
    """Make ``accelerator`` (created on the CPU, where Accelerate falls back to DDP) run FSDP2 with ``plugin``.

    Accelerate 1.15 selects FSDP only for GPU-like devices (``AcceleratorState.__init__``); the process state keeps
    the distributed type in ``PartialState._shared_state``, which ``AcceleratorState`` re-reads, so both are set.
    ``prepare``, ``backward``, clipping and the state-dict calls are then Accelerate's and torch's real FSDP2 code.

    Raises:
        RuntimeError: the installed Accelerate keeps the process state elsewhere.
    """
    shared = _process_shared_state()
    if shared is None:
        raise _missing("PartialState._shared_state", "FSDP2 on the CPU")
    accelerator.state.fsdp_plugin = plugin
    accelerator.state.distributed_type = DistributedType.FSDP
    cast(dict, shared)["distributed_type"] = DistributedType.FSDP  # AcceleratorState re-reads it


def attach_parallelism_config(accelerator: Accelerator, config: Any, device_type: str) -> None:
    """Give ``accelerator`` the ``ParallelismConfig`` ``config`` and its device mesh, as ``Accelerator.__init__``
    does on GPUs, then let Accelerate validate it where Accelerate runs that layout (FSDP2: ``dp_shard_size > 1``).

    Tensor parallelism alone stays a plain multi-process run, which Accelerate's check refuses off GPUs
    (``ParallelismConfig is only compatible DistributedType.FSDP (version 2) or ... MULTI_CPU``): it is attached
    without that check (the trainer checked the sizes).

    Raises:
        RuntimeError: the installed Accelerate has no ``ParallelismConfig._validate_accelerator``.
    """
    validate = getattr(config, "_validate_accelerator", None)
    if not callable(validate):
        raise _missing("ParallelismConfig._validate_accelerator", "a ParallelismConfig on the CPU")
    accelerator.state.parallelism_config = config
    accelerator.state.device_mesh = config.get_device_mesh(device_type)
    if accelerator.is_fsdp2:
        validate(accelerator)


def mark_prepared(model: torch.nn.Module) -> None:
    """Flag ``model`` as prepared (Accelerate's ``_is_accelerate_prepared``), so that ``Accelerator.prepare_model``
    registers it as it is: for a model the trainer sharded itself (tensor parallel x FSDP2)."""
    model._is_accelerate_prepared = True  # type: ignore[assignment]
