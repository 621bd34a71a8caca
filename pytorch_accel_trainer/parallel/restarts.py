"""Jobs that torchrun restarts itself (``torchrun --max-restarts N``): a restarted attempt connects, and says so.

Why the trainer steps in: torchrun's agent keeps one TCPStore for the whole job, and the processes of every attempt
connect through it (``TORCHELASTIC_USE_AGENT_STORE=True``; the static rendezvous always does, the c10d one unless
``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``). ``init_process_group`` keys the default group's addresses the same way in
every attempt (``default_pg/0/...``), so a restarted process can read the address a process of the attempt before
left there, and dies connecting to it ("Gloo connectFullMesh failed ... Connection refused"; NCCL reads a stale
unique id) or waits for a peer that is gone (pytorch issue #135712). (``_create_c10d_store`` in
``torch/distributed/rendezvous.py`` counts on a new agent store at each retry; the agent keeps its first.)

What it does: on a restarted attempt whose processes were all started by one agent (so they read the same
``TORCHELASTIC_RESTART_COUNT``), the trainer connects through the agent's store under a prefix of the attempt's own:
it hands Accelerate that store, and Accelerate creates the process group with the backend it would choose anyway
(gloo on the CPU, NCCL on GPUs). Nothing changes on a first attempt, outside torchrun, or when each attempt has a
store of its own. Where it cannot tell the attempts apart the same way on every process (several agents, which count
their restarts each on its own: pytorch issue #108158), nor hand Accelerate a store (DeepSpeed, an ``init_method`` of
the script's own), a restarted attempt says what to set instead.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterable
from datetime import timedelta
from pathlib import Path
from typing import Any, Optional, Union

import torch
from accelerate import PartialState
from accelerate.utils import InitProcessGroupKwargs, parse_flag_from_env

from pytorch_accel_trainer.parallel.accelerate_internals import process_state_is_set_up
from pytorch_accel_trainer.parallel.processes import launched_world_size

#: the prefix, in the agent's store, of the keys of a restarted attempt's process group (followed by its number)
ATTEMPT_PREFIX = "pytorch_accel_trainer/restart_"

# What torchrun's agent sets for every process it starts (torch/distributed/elastic/agent/server/local_elastic_agent.py)
_RESTART_COUNT = "TORCHELASTIC_RESTART_COUNT"
_MAX_RESTARTS = "TORCHELASTIC_MAX_RESTARTS"
_USE_AGENT_STORE = "TORCHELASTIC_USE_AGENT_STORE"
_AGENTS = "GROUP_WORLD_SIZE"

#: the store's timeout when the script sets none: torch's for a group created from ``env://``
_DEFAULT_STORE_TIMEOUT = timedelta(minutes=30)


def get_restart_count() -> int:
    """The restarts torchrun's agent made before starting this process: 0 on the first attempt and without torchrun."""
    value = os.environ.get(_RESTART_COUNT, "0")
    return int(value) if value.isdigit() else 0


def get_max_restarts() -> Optional[int]:
    """torchrun's ``--max-restarts``, ``None`` without torchrun."""
    value = os.environ.get(_MAX_RESTARTS, "")
    return int(value) if value.isdigit() else None


def prepare_restarted_attempt(cpu: bool, kwargs_handlers: Optional[Iterable] = None) -> None:
    """Make a restarted attempt of a ``torchrun --max-restarts`` job connect through keys of its own; call it once,
    right before the first ``Accelerator`` of the process is created.

    On a restarted attempt that shares the agent's store, it sets up Accelerate's process state (``PartialState``)
    with that store under the prefix ``ATTEMPT_PREFIX<restart count>``: Accelerate then creates the process group
    as it would (its backend, the ``Accelerator``'s ``InitProcessGroupKwargs``), with keys no earlier attempt wrote.
    Where that cannot be done reliably, each node's first process warns (a ``RuntimeWarning``) why, and what to set
    (:func:`describe_connection_fix`). It does nothing, at no cost, on a first attempt, outside torchrun, on one
    process, when each attempt has a store of its own, and once the process group or Accelerate's process state
    exists (already connected).

    Args:
        cpu: whether the ``Accelerator`` about to be created runs on the CPU (``Accelerator(cpu=...)``); Accelerate's
            process state is set up with it, as the ``Accelerator`` would.
        kwargs_handlers: the ``Accelerator``'s ``kwargs_handlers``; an ``InitProcessGroupKwargs`` among them (a
            timeout, a backend) is applied as the ``Accelerator`` would apply it.
    """
    if not _shares_store_with_earlier_attempts() or _is_connected():
        return  # nothing another attempt left can be read, or it is too late (and not needed) to choose the keys
    init_kwargs = _init_process_group_kwargs(kwargs_handlers)
    cpu = cpu or parse_flag_from_env("ACCELERATE_USE_CPU")  # as AcceleratorState reads it, before PartialState
    obstacle = _why_keys_cannot_be_separated(cpu, init_kwargs)
    if obstacle is not None:
        if os.environ.get("LOCAL_RANK", "0") == "0":  # once per node
            warnings.warn(describe_connection_fix(obstacle), RuntimeWarning, stacklevel=3)
        return
    timeout = init_kwargs.get("timeout") or _DEFAULT_STORE_TIMEOUT
    # the store env:// makes (a client of the agent's), as init_process_group would make it, then this attempt's keys
    store, rank, world_size = next(torch.distributed.rendezvous("env://", timeout=timeout))
    attempt_store = torch.distributed.PrefixStore(f"{ATTEMPT_PREFIX}{get_restart_count()}", store)
    PartialState(cpu=cpu, store=attempt_store, rank=rank, world_size=world_size, **init_kwargs)


def describe_connection_fix(obstacle: str) -> str:
    """What a restarted attempt that the trainer cannot connect reliably says: why (``obstacle``) and what to set."""
    limit = get_max_restarts()
    return (
        f"Restart {get_restart_count()}{'' if limit is None else f' of at most {limit}'} (torchrun --max-restarts): "
        "the processes of every attempt connect through one store of torchrun's agent, where a restarted process can "
        "read the address of a process of the attempt before and fail to connect ('Gloo connectFullMesh failed', "
        "NCCL's 'Connection refused') or wait for it (pytorch issue #135712). The trainer keeps the attempts apart "
        f"when it can, but not here: {obstacle}. Give each attempt a store of its own: launch with "
        "`torchrun --rdzv-backend c10d --rdzv-endpoint HOST:PORT ...` (or `--standalone` on one machine) and "
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 set in torchrun's environment."
    )


def describe_restarted_attempt(
    resumed_from: Optional[Union[str, Path]], epoch: Optional[int] = None, num_update_steps: Optional[int] = None
) -> Optional[str]:
    """The line a restarted attempt of a ``torchrun --max-restarts`` job prints as its training starts; ``None`` on a
    first attempt and without torchrun, where there is nothing to say.

    Args:
        resumed_from: the training state the run resumes from, ``None`` when there is none yet (the attempt before
            ended before its first save: the run starts again from the beginning).
        epoch: the epoch the run continues, as the run history counts it (``run_history.current_epoch``).
        num_update_steps: the optimizer updates the state was taken after.

    Example::

        line = describe_restarted_attempt("states/step_6", epoch=2, num_update_steps=6)
        # restart 1 under `torchrun --max-restarts 2`: "Restart 1 of at most 2 (torchrun --max-restarts): resuming
        # from states/step_6, epoch 2, after 6 optimizer updates"; None on a first attempt
        if line is not None:
            trainer.print(line)
    """
    restarts = get_restart_count()
    if restarts == 0:
        return None
    limit = get_max_restarts()
    head = f"Restart {restarts}{'' if limit is None else f' of at most {limit}'} (torchrun --max-restarts)"
    if resumed_from is None:
        return f"{head}: no training state was saved before, so the run starts again from the beginning"
    return f"{head}: resuming from {resumed_from}, epoch {epoch}, after {num_update_steps} optimizer updates"


def _shares_store_with_earlier_attempts() -> bool:
    """Whether this process is a restarted attempt of a multi-process torchrun job that connects through the
    agent's store, which outlives the attempts (with ``TORCHELASTIC_USE_AGENT_STORE=False`` the first process of
    each attempt makes a new one)."""
    return get_restart_count() > 0 and os.environ.get(_USE_AGENT_STORE) == "True" and launched_world_size() > 1


def _is_connected() -> bool:
    """Whether the process group (or Accelerate's process state, which creates it) already exists in this process."""
    if not torch.distributed.is_available():
        return True  # no process group can be made here: nothing to prepare
    return torch.distributed.is_initialized() or process_state_is_set_up()


def _init_process_group_kwargs(kwargs_handlers: Optional[Iterable]) -> dict[str, Any]:
    """What the ``Accelerator`` would pass on to ``init_process_group``: its ``InitProcessGroupKwargs``' settings."""
    for handler in kwargs_handlers or ():
        if isinstance(handler, InitProcessGroupKwargs):
            return handler.to_kwargs()
    return {}


def _why_keys_cannot_be_separated(cpu: bool, init_kwargs: dict) -> Optional[str]:
    """Why this attempt's process group cannot be given keys of its own here, ``None`` when it can."""
    agents = os.environ.get(_AGENTS)
    if agents != "1":
        return (
            f"the job has {agents or 'several'} torchrun agents (nodes), each counting its restarts on its own, so "
            "their processes cannot agree on the attempt from TORCHELASTIC_RESTART_COUNT"
        )
    if not cpu and parse_flag_from_env("ACCELERATE_USE_DEEPSPEED"):
        return "DeepSpeed creates the process group itself and takes no store"
    if init_kwargs.get("init_method") is not None:
        return f"the script connects through init_method={init_kwargs['init_method']!r} (InitProcessGroupKwargs)"
    return None
