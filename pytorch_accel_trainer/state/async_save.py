"""Training states saved in the background: the loop waits only while each process copies its part to host memory.

:func:`save_in_background` stages the state: every process copies its own shard of the tensors (under FSDP its
shard only; staged with torch's own helpers, as ``torch.distributed.checkpoint.async_save`` stages, into host buffers
kept from one save to the next: one staging copy at most) and its plain values into host memory, on the training
thread. A background thread per process then writes the copy with the protocol of a synchronous save (temporary
folder, each process its own files checksummed as written, the manifest last, rename, ``latest``, pruning), so a
crash at any point still leaves the last good state and no state that looks complete.

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
from typing import Any, Optional

import torch

from pytorch_accel_trainer.errors import CheckpointError
from pytorch_accel_trainer.state.files import unused_folder_name
from pytorch_accel_trainer.state.folder import write_training_state
from pytorch_accel_trainer.state.parts import Processes, StateContent


class HostBuffers:
    """Host copies of the tensors of a state, kept from one background save to the next of a run, as
    ``torch.distributed.checkpoint`` caches its staged state: the next save copies into them instead of allocating
    (and page-faulting) as much memory again. Reusing them is safe because a save first waits for the one before it.
    ``clear()`` frees them; the trainer does as its run ends."""

    def __init__(self) -> None:
        self._buffers: Optional[dict] = None
        self._layout: Optional[list] = None

    def stage(self, tensors: dict) -> dict:
        """Copies of ``tensors`` (flat names to tensors or DTensors: of a DTensor, this process's shard alone) in host
        memory (pinned when CUDA is used), in the buffers of the previous save when the tensors are the same."""
        layout = [(name, tuple(tensor.shape), tensor.dtype, type(tensor)) for name, tensor in tensors.items()]
        if self._buffers is None or layout != self._layout:
            self._buffers, self._layout = {name: _host_buffer(tensor) for name, tensor in tensors.items()}, layout
        for name, tensor in tensors.items():
            _local(self._buffers[name]).copy_(_local(tensor).detach(), non_blocking=True)
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()  # the copies are complete before training changes the originals
        return dict(self._buffers)

    def clear(self) -> None:
        self._buffers = self._layout = None


host_buffers = HostBuffers()


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


def stage(content: StateContent) -> StateContent:
    """``content`` in host memory: its tensors in :data:`host_buffers`, its plain values copied."""
    if content.tensors is None:
        content.split()
    return replace(
        content,
        tensors=host_buffers.stage(content.tensors or {}),
        plain=to_host(content.plain),
        shared=to_host(content.shared),
        own=to_host(content.own),
    )


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
    staged = stage(content)

    def write() -> Path:
        folder = write_training_state(
            parent, staged, fields, background, final.name, max_rolling, node_local=remote is not None
        )
        if remote is not None:
            remote.publish_collectively(folder, background)
        return folder

    saver.submit(write)
    return final


class BackgroundSaver:
    """Runs one save at a time on a background thread; :meth:`wait` returns when it is written."""

    def __init__(self) -> None:
        self._thread: Optional[threading.Thread] = None
        self._error: Optional[BaseException] = None
        self._folder: Optional[Path] = None

    @property
    def pending(self) -> bool:
        return self._thread is not None

    def submit(self, write) -> None:
        """Run ``write`` (which returns the state's folder) in the background, after the save under way (whose error,
        if any, is raised here)."""
        self.wait()
        self._thread = threading.Thread(target=self._write, args=(write,), name="training-state-save", daemon=False)
        self._thread.start()

    def _write(self, write) -> None:
        try:
            self._folder = write()
        except BaseException as error:  # kept for the main thread: raised at the next save or the end of the run
            self._error = error

    def wait(self) -> Optional[Path]:
        """Wait for the save under way; return its folder (``None`` when none was under way).

        Raises:
            CheckpointError: the background save failed; the previous states are left as they were.
        """
        if self._thread is None:
            return None
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
