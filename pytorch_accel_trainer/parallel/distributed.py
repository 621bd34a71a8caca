"""How the processes of a run start together and agree: the Accelerator for the launch (and the checks of the options
it is created with, mixed precision among them), per-window agreement, and what the trainer asks of Accelerate's
engine between runs."""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import inspect
import os
import platform
import sys
import time
from collections.abc import Iterator, Mapping
from typing import Any, Optional, cast

import torch
from accelerate import Accelerator, DistributedType
from accelerate.state import AcceleratorState, PartialState, is_initialized
from accelerate.utils import InitProcessGroupKwargs, parse_flag_from_env

from pytorch_accel_trainer.errors import StopTrainingError, TimeBudgetExceeded
from pytorch_accel_trainer.parallel.accelerate_internals import (
    attach_parallelism_config,
    forget_prepared,
    process_state_is_set_up,
    switch_to_fsdp2,
    undo_failed_set_up,
)
from pytorch_accel_trainer.parallel.layout import (
    PARALLELISM_CONFIG_SWITCH,
    parallelism_config_from,
    validate_layout_on_cpu,
)
from pytorch_accel_trainer.parallel.processes import launched_world_size, needs_cpu_backend
from pytorch_accel_trainer.parallel.restarts import prepare_restarted_attempt

# Where Accelerate's optimizer wrapper and backward() only call torch (no gradient scaler, DeepSpeed, FSDP, XLA).
_PLAIN_TORCH_STEP_TYPES = (DistributedType.NO, DistributedType.MULTI_CPU, DistributedType.MULTI_GPU)


def already_set_up_error(accelerate_message: str, mixed_precision: Any) -> ValueError:
    """The error for an ``Accelerator`` that asks for what this process was already set up without: Accelerate
    fixes the device and the mixed precision once per process, and names the flag it refused in its message."""
    state = AcceleratorState()
    if "cpu=True" in accelerate_message:
        return ValueError(
            f"Trainer(cpu=True) asks for the CPU, but Accelerate already set this process up on {state.device}, "
            "and cannot change the device once set. Make the first Trainer (or Accelerator) of the process the one "
            "with cpu=True, or run the whole script on the CPU (`accelerate launch --cpu script.py`, or "
            "ACCELERATE_USE_CPU=1)."
        )
    return ValueError(
        f"Trainer(mixed_precision={mixed_precision!r}) differs from the mixed precision Accelerate was already set up "
        f"with in this process ({state.mixed_precision!r}); Accelerate cannot change it once set. Use one mixed "
        "precision per process, or set it for the whole run with `accelerate launch --mixed_precision ...` and leave "
        "mixed_precision=None."
    )


def create_accelerator(mixed_precision: Optional[str] = None, **kwargs) -> Accelerator:
    """Return an :class:`~accelerate.Accelerator` that runs every launched process as one job.

    A ``ParallelismConfig`` (``kwargs["parallelism_config"]``, or ``ACCELERATE_USE_PARALLELISM_CONFIG=true`` with
    the ``PARALLELISM_CONFIG_*`` sizes that ``accelerate launch --parallelism_config_*`` sets) goes to Accelerate
    unchanged on GPUs. On the CPU, where Accelerate refuses it, the Accelerator is created without it and the trainer
    attaches it: FSDP2 over ``dp_shard`` when ``dp_shard_size > 1``, and the device mesh (``docs/scaling.md``,
    "Layouts").

    Raises:
        RuntimeError: Accelerate was already set up in this process for a single process while the launcher
            started several (it can then no longer be changed), naming what to set.
        ValueError: another ``mixed_precision`` was already set up in this process, or the GPU when ``cpu=True``
            asks for the CPU, or ``"fp16"`` was asked for on the CPU (where Accelerate would silently train in
            float32), or a ParallelismConfig on the CPU whose sizes do not multiply to the number of processes or
            that asks for context parallelism (GPU only).
    """
    cpu = bool(kwargs.pop("cpu", False))
    if needs_cpu_backend() and not cpu and _deepspeed_asked(kwargs):  # DeepSpeed over gloo, not Accelerate's CPU DDP
        kwargs["kwargs_handlers"] = _with_gloo_backend(kwargs.get("kwargs_handlers"))
    else:
        cpu = cpu or needs_cpu_backend()  # asked for, or needed by a launch without GPUs
    already_set_up = process_state_is_set_up()
    precision_set_up = is_initialized()  # whether an Accelerator fixed the mixed precision of this process
    prepare_restarted_attempt(cpu, kwargs.get("kwargs_handlers"))  # torchrun --max-restarts: this attempt's own keys
    # on the CPU, Accelerate refuses a ParallelismConfig: the trainer attaches it itself once the processes are set up
    layout_on_cpu = parallelism_config_from(kwargs) if cpu else None
    if layout_on_cpu is not None:
        kwargs.pop("parallelism_config", None)
        if precision_set_up:  # an earlier Trainer's config, which Accelerator() would validate (and refuse) again
            AcceleratorState().parallelism_config, AcceleratorState().device_mesh = None, None
    try:
        with _parallelism_config_switch_off(layout_on_cpu is not None):
            accelerator = Accelerator(mixed_precision=mixed_precision, cpu=cpu, **kwargs)
        _validate_mixed_precision_device(accelerator, mixed_precision)
    except ValueError as error:
        if not precision_set_up:  # a failed set-up must not fix the precision of this process (Accelerate would)
            undo_failed_set_up()
        if "already been initialized" not in str(error):
            raise
        raise already_set_up_error(str(error), mixed_precision) from error
    if accelerator.num_processes > 1:
        wait_for_gloo_workers_at_exit()
    if accelerator.num_processes == 1 and launched_world_size() > 1:
        how = " before the trainer was created" if already_set_up else ""
        raise RuntimeError(
            f"The launcher started {launched_world_size()} processes, but Accelerate was set up{how} for "
            f"{accelerator.num_processes}, so each process would train on its own. Set ACCELERATE_USE_CPU=1 "
            "(no GPU) or pass --cpu to accelerate launch, and create the Trainer before any other Accelerator."
        )
    if layout_on_cpu is not None and layout_on_cpu.total_size > 1:  # sizes all 1: plain processes, as Accelerate
        _set_up_layout_on_cpu(accelerator, layout_on_cpu, kwargs.get("fsdp_plugin"))
    return accelerator


def _deepspeed_asked(kwargs: dict) -> bool:
    """Whether this Accelerator is to run DeepSpeed: a ``deepspeed_plugin``, or ``accelerate launch --use_deepspeed``
    (``ACCELERATE_USE_DEEPSPEED``), and not the CPU asked for by ``ACCELERATE_USE_CPU`` (where Accelerate runs DDP)."""
    asked = kwargs.get("deepspeed_plugin") is not None or parse_flag_from_env("ACCELERATE_USE_DEEPSPEED")
    return asked and not parse_flag_from_env("ACCELERATE_USE_CPU")


def _with_gloo_backend(handlers: Optional[list]) -> list:
    """``handlers`` with an ``InitProcessGroupKwargs(backend="gloo")`` unless they hold one: several DeepSpeed
    processes on a machine without an accelerator then form one gloo job (without it Accelerate sets each up as a
    single process, while DeepSpeed's group spans them all, and every process trains the same batches). One without
    a backend, or with its default ``nccl`` (which needs GPUs), gets gloo; another backend is kept."""
    handlers = [
        dataclasses.replace(handler, backend="gloo")
        if isinstance(handler, InitProcessGroupKwargs) and handler.backend in (None, "nccl")
        else handler
        for handler in handlers or []
    ]
    if not any(isinstance(handler, InitProcessGroupKwargs) for handler in handlers):
        handlers.append(InitProcessGroupKwargs(backend="gloo"))
    return handlers


@contextlib.contextmanager
def _parallelism_config_switch_off(off: bool) -> Iterator[None]:
    """Hide ``ACCELERATE_USE_PARALLELISM_CONFIG`` while ``off``: with it, ``Accelerator()`` would build and refuse
    the ParallelismConfig on the CPU itself."""
    saved = os.environ.pop(PARALLELISM_CONFIG_SWITCH, None) if off else None
    try:
        yield
    finally:
        if saved is not None:
            os.environ[PARALLELISM_CONFIG_SWITCH] = saved


def _set_up_layout_on_cpu(accelerator: Accelerator, config: Any, fsdp_plugin: Any) -> None:
    """Run ``config`` on the CPU processes (gloo) as Accelerate runs it on GPUs: FSDP2 over ``dp_shard`` (with the
    user's ``fsdp_plugin`` or FSDP2's defaults) when ``dp_shard_size > 1``, and the config's device mesh attached."""
    validate_layout_on_cpu(config, accelerator.num_processes)
    if config.dp_shard_size > 1:
        from accelerate.utils import FullyShardedDataParallelPlugin

        switch_to_fsdp2(accelerator, fsdp_plugin or FullyShardedDataParallelPlugin(fsdp_version=2))
    attach_parallelism_config(accelerator, config, accelerator.device.type)


def _validate_mixed_precision_device(accelerator: Accelerator, mixed_precision: Optional[str]) -> None:
    """Refuse fp16 on the CPU: Accelerate accepts it there but neither autocasts nor scales, so the run is float32."""
    if accelerator.mixed_precision != "fp16" or accelerator.device.type != "cpu":
        return
    source = "" if mixed_precision else " (from ACCELERATE_MIXED_PRECISION: accelerate launch or the environment)"
    raise ValueError(
        f"mixed_precision='fp16'{source} needs a GPU (or another accelerator), but this process runs on the CPU, where "
        "Accelerate would silently train in float32. Use mixed_precision='bf16' on the CPU, or 'no'."
    )


# ------------------------------------------------------------------------------------------------
# Exit: a finished multi-process job exits 0
# ------------------------------------------------------------------------------------------------

_GLOO_WORKER_THREAD = "pt_gloo_runloop"
_FUTEX_SYSCALLS = {"x86_64": "202", "aarch64": "98"}  # where /proc's wchan says nothing
_IDLE_OBSERVATIONS = 5  # consecutive, each after a pause that releases the GIL
_EXIT_WAIT_S = 5.0
_exit_wait_registered = False


def wait_for_gloo_workers_at_exit() -> None:
    """Make this process wait, at exit, until its gloo worker threads are idle; called once a multi-process run starts.

    Why: a gloo worker thread finishes a collective, wakes the main thread, and only then destroys its work object.
    If that drops the last reference to a tensor Python has seen, the worker needs the GIL; when the main thread is
    by then finalising the interpreter (a collective 1-2 ms before the end of the script: the trainer's last
    agreement or loss reduction, DDP's last all-reduce), Python ends the worker inside a ``noexcept`` destructor and
    the process aborts with "terminate called without an active exception" (SIGABRT) after a successful run: an
    upstream race. ``destroy_process_group()`` does not prevent it (DDP and Accelerate keep the group alive). The
    wait runs in an ``atexit`` handler, before finalisation, while the workers can still take the GIL.
    """
    global _exit_wait_registered
    if not _exit_wait_registered:
        atexit.register(_wait_until_gloo_workers_are_idle)
        _exit_wait_registered = True


def _gloo_worker_states() -> Optional[list[bool]]:
    """Whether each gloo worker thread of this process is idle (asleep on a futex: its work queue's condition
    variable); ``None`` where the threads cannot be observed (no ``/proc``)."""
    tasks = "/proc/self/task"
    if not os.path.isdir(tasks):
        return None
    states = []
    for tid in os.listdir(tasks):
        try:
            with open(f"{tasks}/{tid}/comm") as comm:
                if comm.read().strip() != _GLOO_WORKER_THREAD:
                    continue
            with open(f"{tasks}/{tid}/stat") as stat:
                state = stat.read().rsplit(")", 1)[1].split()[0]
            with open(f"{tasks}/{tid}/wchan") as wchan:
                waiting_in = wchan.read()
            if state == "S" and waiting_in in ("", "0"):  # a kernel that hides wchan: ask which system call
                with open(f"{tasks}/{tid}/syscall") as syscall:
                    waiting_in = "futex" if syscall.read().split()[0] == _FUTEX_SYSCALLS.get(platform.machine()) else ""
        except (OSError, IndexError):
            continue  # the thread ended while being read
        states.append(state == "S" and "futex" in waiting_in)
    return states


def _wait_until_gloo_workers_are_idle(timeout_s: float = _EXIT_WAIT_S) -> None:
    """The ``atexit`` handler of :func:`wait_for_gloo_workers_at_exit`: return once every gloo worker has been seen
    idle ``_IDLE_OBSERVATIONS`` times in a row (about a millisecond when they are: the usual case), or after
    ``timeout_s``. Each pause releases the GIL, so a worker waiting for it to free a tensor can finish."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return  # no group, or the script destroyed it: nothing of the run is left in flight
    deadline, idle_in_a_row = time.monotonic() + timeout_s, 0
    while idle_in_a_row < _IDLE_OBSERVATIONS and time.monotonic() < deadline:
        time.sleep(0.0002)
        states = _gloo_worker_states()
        if states is None:
            return  # cannot observe the threads here
        idle_in_a_row = idle_in_a_row + 1 if all(states) else 0


#: The attribute of an agreed stop that holds its reason, the same text on every process (see :func:`stop_reason`).
_AGREED_REASON = "_pytorch_accel_trainer_agreed_reason"


def print_on_node(
    *args: Any, sep: Optional[str] = " ", end: Optional[str] = "\n", file: Any = None, flush: bool = False
) -> None:
    """``print`` on the node's main process (as ``Accelerator.print``), the line written in one call.

    ``print`` writes each argument and the line's end separately; with unbuffered output (``PYTHONUNBUFFERED=1``,
    usual in containers) the other processes' output that share the terminal or log can land inside the line.
    """
    if not PartialState().is_local_main_process:
        return
    sep = " " if sep is None else sep
    end = "\n" if end is None else end
    stream = sys.stdout if file is None else file
    stream.write(sep.join(str(arg) for arg in args) + end)
    if flush:
        stream.flush()


def stop_reason(error: BaseException) -> str:
    """The ``stop_reason`` of a run ``error`` stopped: its message, and for a stop agreed between several processes,
    which process asked for it (``"... (on process 1)"``), the same on every process."""
    return getattr(error, _AGREED_REASON, None) or str(error)


class ProcessAgreement:
    """One small collective per agreement point, so that a decision taken on any process is taken on all.

    The flags travel on the host over gloo (the default group of a CPU run, else a gloo group made once),
    so agreeing never waits on a GPU stream: no host-device synchronisation.
    """

    def __init__(self):
        self._group = None

    def any_process(self, accelerator: Accelerator, *flags: int) -> list[int]:
        """The maximum of each flag over every process; every process must call it at the same point."""
        if accelerator.num_processes == 1:
            return list(flags)
        values = torch.tensor(flags, dtype=torch.int64)
        torch.distributed.all_reduce(values, op=torch.distributed.ReduceOp.MAX, group=self._host_group())
        return values.tolist()

    def agreed_exception(self, accelerator: Accelerator, exception: Optional[BaseException]) -> Optional[BaseException]:
        """The ``StopTrainingError`` any process holds (the one of the highest rank that holds one), on every process.

        One collective of one integer; the exception itself is sent only when some process holds one.
        """
        if accelerator.num_processes == 1:
            return exception
        (holder,) = self.any_process(accelerator, accelerator.process_index + 1 if exception is not None else 0)
        if not holder:
            return None
        # its message, and whether it is the time budget's (so that every process knows why it stopped)
        message = [(str(exception), isinstance(exception, TimeBudgetExceeded)) if exception is not None else None]
        torch.distributed.broadcast_object_list(message, src=holder - 1, group=self._host_group())
        text, by_time_budget = cast(tuple, message[0])
        reason = f"{text} (on process {holder - 1})"  # the same stop_reason on every process, the holder's too
        agreed = exception or (TimeBudgetExceeded if by_time_budget else StopTrainingError)(reason)
        setattr(agreed, _AGREED_REASON, reason)  # the holder keeps its own exception, its type and traceback
        return agreed

    def _host_group(self):
        if self._group is None:
            if torch.distributed.get_backend() == "gloo":
                self._group = torch.distributed.group.WORLD
            else:  # a collective itself: the first agreement point is the same on every process
                self._group = torch.distributed.new_group(backend="gloo")
        return self._group


def release_prepared(accelerator: Accelerator) -> None:
    """Drop Accelerate's references to what the last run prepared, so that nothing is kept or prepared twice.

    ``Accelerator.free_memory()`` does the same plus ``gc.collect()``, about 0.2 s a call (most of a small
    ``evaluate()``); it is needed only to destroy a DeepSpeed engine. Otherwise ``forget_prepared`` drops the
    references without collecting garbage (``accelerate_internals``: no public API does).
    """
    if getattr(accelerator, "deepspeed_engine_wrapped", None) is not None:
        accelerator.free_memory()
        return
    forget_prepared(accelerator)


def wrappers_only_call_torch(accelerator: Accelerator) -> bool:
    """Whether Accelerate's optimizer wrapper and ``backward()`` would add nothing but time here.

    Without a gradient scaler (fp16), DeepSpeed, FSDP, Megatron, XLA or a LOMO optimizer, the wrapper's
    ``step()`` and ``zero_grad()`` and ``Accelerator.backward`` only call torch, after checks that cost about
    100 us per step on a small model (two uncached package lookups, ``inspect.signature``, a division by 1;
    ``benchmarks/``). The trainer then calls torch directly; ``tests/test_accelerate_wrappers.py`` shows the result is
    bitwise identical. The optimizer state was already placed on the device by ``prepare``.
    """
    return (
        accelerator.scaler is None
        and accelerator.distributed_type in _PLAIN_TORCH_STEP_TYPES
        and not accelerator.has_lomo_optimizer
    )


MIXED_PRECISION_CHOICES = ("no", "bf16", "fp16", "fp8")


#: Aliases accepted for the same choices (``"full"``, ``"bf16-mixed"``, ...); docs/migration.md says whose they are.
MIXED_PRECISION_ALIASES = {
    "full": "no",
    "fp32": "no",
    "32": "no",
    "float32": "no",
    "32-true": "no",
    "bfloat16": "bf16",
    "bf16-mixed": "bf16",
    "float16": "fp16",
    "half": "fp16",
    "16": "fp16",
    "16-mixed": "fp16",
}
#: Accelerator arguments the Trainer sets from its own: refused in ``accelerator_kwargs``, with the argument to use.
TRAINER_ACCELERATOR_ARGUMENTS = {
    "mixed_precision": "Trainer(mixed_precision=...)",
    "cpu": "Trainer(cpu=True)",
    "gradient_accumulation_steps": "train(gradient_accumulation_steps=...)",
}


def mixed_precision_name(mixed_precision: Any) -> Any:
    """Accelerate's name for ``mixed_precision``: ``"full"`` is ``"no"``, ``"bf16-mixed"`` is ``"bf16"``, ..."""
    if isinstance(mixed_precision, str):
        return MIXED_PRECISION_ALIASES.get(mixed_precision.lower(), mixed_precision)
    return mixed_precision


def validate_accelerator_options(mixed_precision: Any, accelerator_kwargs: Any) -> None:
    """Check the ``Trainer`` options the trainer's ``Accelerator`` is created with: ``mixed_precision`` (a choice
    of :data:`MIXED_PRECISION_CHOICES`, an alias of one, or ``None``) and ``accelerator_kwargs`` (``Accelerator``
    arguments, none of those the trainer sets itself)."""
    if mixed_precision is not None and mixed_precision_name(mixed_precision) not in MIXED_PRECISION_CHOICES:
        raise ValueError(
            f"mixed_precision={mixed_precision!r} is not valid: choose one of {MIXED_PRECISION_CHOICES} (or a name "
            f"of another trainer for them: {sorted(MIXED_PRECISION_ALIASES)}), or None to take it from the "
            "Accelerate config."
        )
    if accelerator_kwargs is None:
        return
    if not isinstance(accelerator_kwargs, Mapping):
        raise TypeError(
            f"accelerator_kwargs={accelerator_kwargs!r} is not valid: pass a dict of Accelerator arguments or None."
        )
    for name in accelerator_kwargs:
        if name in TRAINER_ACCELERATOR_ARGUMENTS:
            raise ValueError(
                f"accelerator_kwargs sets {name!r}, which the trainer sets itself: "
                f"use {TRAINER_ACCELERATOR_ARGUMENTS[name]}."
            )
    accepted = set(inspect.signature(Accelerator).parameters)
    unknown = sorted(set(accelerator_kwargs) - accepted)
    if unknown:
        raise ValueError(
            f"accelerator_kwargs has {unknown}, which accelerate.Accelerator does not take; it takes "
            f"{sorted(accepted - set(TRAINER_ACCELERATOR_ARGUMENTS))}."
        )
