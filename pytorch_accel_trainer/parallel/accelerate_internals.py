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

:func:`missing_internals` lists what the installed Accelerate lacks, naming its version; the test suite asserts
that the list is empty on the tested releases, so that CI notices a rename before users do.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Optional

import accelerate
from accelerate import Accelerator, PartialState
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
