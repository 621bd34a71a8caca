"""Training states saved in the background: the loop waits only while each process copies its part to host memory,
and inside a run not even for most of that.

:func:`save_in_background` stages the state: every process copies its own shard of the tensors (under FSDP its
shard only; staged with torch's own helpers, as ``torch.distributed.checkpoint.async_save`` stages, into host buffers
kept from one save to the next: one staging copy at most) and its plain values into host memory. A background thread
per process then writes the copy with the protocol of a synchronous save (temporary folder, each process its own files
checksummed as written, the manifest last, rename, ``latest``, pruning), so a crash at any point still leaves the last
good state and no state that looks complete.

Inside a run, the tensors that only an optimizer update changes (the model's parameters, the optimizer's state:
``StateContent.changed_by_updates_only``) are copied by the background thread while the next step's forward and
backward passes run, as torchtitan stages asynchronously: the loop waits for that copy before its next optimizer
update (:meth:`BackgroundSaver.wait_for_staging`) and before firing any event but ``on_train_step_end``. Every other
tensor (buffers, which a forward pass may change) is copied before the loop goes on. A tensor changed in place between
the save and that wait (its autograd version counter moved) fails the save there, on every process, before anything is
written.

The background threads of the processes run the save's collectives (DCP's for a sharded state, the checksums' gather,
the barriers) in a process group of their own, over gloo, created once: they never meet training's collectives (NCCL's
or gloo's) on the default group. One save is under way at a time: the next save, the end of ``train()`` and the exit of
the process wait for it, and an error it met is raised there, never lost.
"""

from __future__ import annotations

import atexit
import threading
from dataclasses import replace
from pathlib import Path
from typing import Any, Collection, Iterable, Optional

import torch

from pytorch_accel_trainer.errors import CheckpointError
from pytorch_accel_trainer.state.files import unused_folder_name
from pytorch_accel_trainer.state.folder import write_training_state
from pytorch_accel_trainer.state.parts import Processes, StateContent, agreed


class HostBuffers:
    """Host copies of the tensors of a state, kept from one background save to the next of a run, as
    ``torch.distributed.checkpoint`` caches its staged state: the next save copies into them instead of allocating
    (and page-faulting) as much memory again. Reusing them is safe because a save first waits for the one before it.
    ``clear()`` frees them; the trainer does as its run ends."""

    def __init__(self) -> None:
        self._buffers: Optional[dict] = None
        self._layout: Optional[list] = None

    def stage(self, tensors: dict, later: Collection[int] = ()) -> tuple[dict, Optional["LaterCopy"]]:
        """Copies of ``tensors`` (flat names to tensors or DTensors: of a DTensor, this process's shard alone) in host
        memory (pinned when CUDA is used), in the buffers of the previous save when the tensors are the same.

        The tensors whose data pointer is in ``later`` are left to the returned :class:`LaterCopy` (``None`` when
        none is), for the background thread; the others are copied now."""
        layout = [(name, tuple(tensor.shape), tensor.dtype, type(tensor)) for name, tensor in tensors.items()]
        if self._buffers is None or layout != self._layout:
            self._buffers, self._layout = {name: _host_buffer(tensor) for name, tensor in tensors.items()}, layout
        buffers = dict(self._buffers)
        deferred = [name for name, tensor in tensors.items() if data_pointer(tensor) in later]
        now = [name for name in tensors if name not in set(deferred)]
        _copy(buffers, tensors, now)
        if now and torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()  # the copies are complete before training changes the originals
        return buffers, (LaterCopy(buffers, {name: tensors[name] for name in deferred}) if deferred else None)

    def clear(self) -> None:
        self._buffers = self._layout = None


host_buffers = HostBuffers()


def _copy(buffers: dict, tensors: dict, names: Iterable[str]) -> None:
    for name in names:
        _local(buffers[name]).copy_(_local(tensors[name]).detach(), non_blocking=True)


def data_pointer(tensor: torch.Tensor) -> int:
    """Where the tensor's (or DTensor's shard's) data starts; 0 for an empty one, never deferred."""
    local = _local(tensor)
    return local.data_ptr() if local.numel() else 0


class LaterCopy:
    """The copy, made on the background thread as the next step's forward and backward passes run, of the tensors
    that only an optimizer update changes. The loop holds its next update back until :meth:`judge` (called by
    :meth:`BackgroundSaver.wait_for_staging`) has found the copy made and no tensor changed; only then does the
    background thread write the state.

    Each tensor's autograd version counter is read as the save is taken and again by :meth:`judge`: a tensor changed
    in place between the two (by anything but the update the loop holds back) fails the save on every process,
    whether or not its copy came first, naming it. A change made through ``.data``, which bypasses the counter, is not
    seen."""

    def __init__(self, buffers: dict, tensors: dict) -> None:
        self.buffers, self.tensors = buffers, tensors
        self.versions = {name: _local(tensor)._version for name, tensor in tensors.items()}
        self.copied = threading.Event()  # set by the background thread, the copy made (or failed)
        self.judged = threading.Event()  # set by the training thread, the counters read again
        self.settled = threading.Event()  # set by the background thread, every process's verdict known
        self.spoilt: Optional[str] = None
        self.failed = False
        self._device = next((_local(t).device for t in tensors.values() if _local(t).device.type == "cuda"), None)
        self._ready = torch.cuda.Event() if self._device is not None else None
        if self._ready is not None:  # on CUDA: the training stream's work up to the save (the update that made them)
            self._ready.record(torch.cuda.current_stream(self._device))

    def copy_then_await_judgement(self) -> None:
        """Copy the tensors into their host buffers, then wait for :meth:`judge` (background thread).

        Raises:
            CheckpointError: a tensor was changed in place between the save and the judgement.
        """
        try:
            if self._ready is None:
                _copy(self.buffers, self.tensors, self.tensors)
            else:
                with torch.cuda.device(self._device):
                    stream = torch.cuda.Stream()
                    stream.wait_event(self._ready)  # ordered after the update that made the values, beside training
                    with torch.cuda.stream(stream):
                        _copy(self.buffers, self.tensors, self.tensors)
                    stream.synchronize()
        finally:
            self.copied.set()
        self.judged.wait()
        if self.spoilt is not None:
            raise CheckpointError(self.spoilt)

    def judge(self) -> None:
        """Wait for the copy, then read the version counters again (training thread, before the next update)."""
        self.copied.wait()
        changed = [name for name, tensor in self.tensors.items() if _local(tensor)._version != self.versions[name]]
        if changed:
            more = f" (and {len(changed) - 1} more)" if len(changed) > 1 else ""
            self.spoilt = (
                f"{changed[0]!r}{more} was changed in place between the asynchronous save and the next optimizer "
                "update, while the save copied it. Inside a run, the parameters and the optimizer's state are copied "
                "beside the next forward and backward passes: change them in optimizer_step() or after it (an "
                "on_optimizer_step_end callback), or save with asynchronous=False."
            )
        self.judged.set()


def _is_dtensor(tensor: torch.Tensor) -> bool:
    if not torch.distributed.is_available():
        return False
    from torch.distributed.tensor import DTensor

    return isinstance(tensor, DTensor)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor itself, or this process's shard of a DTensor."""
    return tensor._local_tensor if _is_dtensor(tensor) else tensor  # type: ignore[attr-defined]


def _host_buffer(tensor: torch.Tensor) -> torch.Tensor:
    """An empty host tensor for ``tensor``; for a DTensor, a DTensor of the same sharding whose shard is on the host
    (allocated once, at the shard's size: never a copy of the whole tensor), as DCP's own staging makes it."""
    pin = tensor.device.type == "cuda"
    buffer = torch.empty(_local(tensor).shape, dtype=tensor.dtype, device="cpu", pin_memory=pin)
    if not _is_dtensor(tensor):
        return buffer
    staged = tensor.detach()  # a new DTensor over the same shard (no copy), whose shard is then replaced
    staged._local_tensor = buffer  # type: ignore[attr-defined]
    return staged


def to_host(value: Any) -> Any:
    """A copy of ``value`` whose tensors are detached copies in CPU memory (CPU tensors are copied too, so the
    training loop may change the originals while the copy is written)."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {name: to_host(item) for name, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(to_host(item) for item in value)
    return value


def stage(content: StateContent) -> tuple[StateContent, Optional[LaterCopy]]:
    """``content`` in host memory: its tensors in :data:`host_buffers` (those of ``content.changed_by_updates_only``
    by the returned :class:`LaterCopy`, when it is not ``None``), its plain values copied."""
    if content.tensors is None:
        content.split()
    tensors, later = host_buffers.stage(content.tensors or {}, content.changed_by_updates_only)
    staged = replace(
        content,
        tensors=tensors,
        plain=to_host(content.plain),
        shared=to_host(content.shared),
        own=to_host(content.own),
        changed_by_updates_only=frozenset(),
    )
    return staged, later


_save_group: Any = None


def _background_processes(processes: Processes) -> Processes:
    """``processes`` with a gloo group of their own for the background save's collectives (created once, by every
    process at the same save: creating a group is itself a collective)."""
    global _save_group
    if processes.count == 1:
        return processes
    if _save_group is None:
        import torch.distributed as dist

        _save_group = dist.new_group(backend="gloo")
    return replace(processes, group=_save_group)


def save_in_background(
    parent: Path,
    content: StateContent,
    fields: dict,
    processes: Processes,
    name: str,
    max_rolling: Optional[int] = None,
    remote: Any = None,
) -> Path:
    """Stage ``content`` and write it as a new state under ``parent`` on a background thread of each process;
    every process must call this. Return the folder the state will have (``remote``: a ``storage.RemoteStates``
    whose mirror ``parent`` is; the state is uploaded once written)."""
    background = _background_processes(processes)
    chosen = unused_folder_name(parent, name).name if processes.is_main else None
    final = parent / background.broadcast(chosen)  # each machine's folder under its own parent
    staged, later = stage(content)

    def write() -> Path:
        if later is not None:
            try:  # every process learns of a copy that failed anywhere, before any file is written
                agreed(background, later.copy_then_await_judgement, f"its copy of the training state {final.name}")
            except BaseException:
                later.failed = True
                raise
            finally:
                later.settled.set()
        folder = write_training_state(
            parent, staged, fields, background, final.name, max_rolling, node_local=remote is not None
        )
        if remote is not None:
            remote.publish_collectively(folder, background)
        return folder

    saver.submit(write, later)
    return final


class BackgroundSaver:
    """Runs one save at a time on a background thread; :meth:`wait` returns when it is written."""

    def __init__(self) -> None:
        self._thread: Optional[threading.Thread] = None
        self._error: Optional[BaseException] = None
        self._folder: Optional[Path] = None
        #: the copy of the save under way that the background thread still makes (see :meth:`wait_for_staging`)
        self.staging: Optional[LaterCopy] = None

    @property
    def pending(self) -> bool:
        """A save was submitted and not yet waited for (it may be written already)."""
        return self._thread is not None

    @property
    def writing(self) -> bool:
        """A save is being written now."""
        return self._thread is not None and self._thread.is_alive()

    def submit(self, write, staging: Optional[LaterCopy] = None) -> None:
        """Run ``write`` (which returns the state's folder) in the background, after the save under way (whose error,
        if any, is raised here); ``staging``: the copy ``write`` makes first, waited for by :meth:`wait_for_staging`."""
        self.wait()
        self.staging = staging
        self._thread = threading.Thread(target=self._write, args=(write,), name="training-state-save", daemon=False)
        self._thread.start()

    def _write(self, write) -> None:
        try:
            self._folder = write()
        except BaseException as error:  # kept for the main thread: raised at the next save or the end of the run
            self._error = error

    def wait_for_staging(self) -> None:
        """Wait until the save under way has its copy of the tensors that only an optimizer update changes: the loop
        calls this before its next update and before the events that run users' code.

        Raises:
            CheckpointError: the copy failed (a tensor changed in place meanwhile): raised at once, before training
                goes on without the state it asked for.
        """
        staging, self.staging = self.staging, None
        if staging is None:
            return
        staging.judge()
        staging.settled.wait()
        if staging.failed:
            self.wait()

    def wait(self) -> Optional[Path]:
        """Wait for the save under way; return its folder (``None`` when none was under way).

        Raises:
            CheckpointError: the background save failed; the previous states are left as they were.
        """
        if self._thread is None:
            return None
        if self.staging is not None:
            self.wait_for_staging()  # the copy is judged, or the thread would wait for it
        self._thread.join()
        self._thread, folder, error = None, self._folder, self._error
        self._folder = self._error = None
        if error is not None:
            raise CheckpointError(
                f"The asynchronous save of a training state failed ({type(error).__name__}: {error}); the states "
                "saved before it are intact."
            ) from error
        return folder


#: The saves of this process: one at a time, whichever trainer asked for them.
saver = BackgroundSaver()


def _wait_at_exit() -> None:
    try:
        saver.wait()
    except CheckpointError as error:
        print(f"pytorch_accel_trainer: {error}")


atexit.register(_wait_at_exit)
