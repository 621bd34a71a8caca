"""Asynchronous training-state saves: the loop waits only while the state is copied to host memory.

:func:`stage_training_state` copies everything a state holds (weights, optimizer, scheduler and scaler states,
the RNG states, the run history, the callbacks' states) into host memory on the calling thread: the training
loop stalls for this copy alone. :class:`BackgroundSaver` then writes the copy on a background thread with the
same protocol as a synchronous save (temporary folder, files flushed, manifest, rename, ``latest``, pruning),
so a crash at any point still leaves the last good state. One save is under way at a time: the next save, the
end of ``train()`` and the exit of the process wait for it, and an error it met is raised there, never lost.

Only a single process saves asynchronously: a state of several processes is sealed by barriers, which cannot
run on a background thread; :func:`validate_asynchronous_save` refuses it.
"""

from __future__ import annotations

import atexit
import threading
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from pytorch_accel_trainer.errors import CheckpointError
from pytorch_accel_trainer.state import crash_points, training_state
from pytorch_accel_trainer.state.checkpointing import reporting_out_of_space, validate_plain
from pytorch_accel_trainer.state.files import (
    MODEL_FILE,
    OPTIMIZER_FILE,
    SCALER_FILE,
    SCHEDULER_FILE,
    TRAINER_FILE,
    default_state_name,
    extra_model_file,
    extra_optimizer_classes,
    extra_optimizer_file,
    inner_optimizer,
    rank_file,
    save_tensors_file,
    unused_folder_name,
    write_bytes_file,
)
from pytorch_accel_trainer.state.rng import capture_rng_state


def validate_asynchronous_save(accelerator) -> None:
    """Refuse an asynchronous save where it is not safe: several processes, or sharded (FSDP) weights."""
    from pytorch_accel_trainer.parallel.sharded import is_fsdp

    if accelerator.num_processes > 1 or is_fsdp(accelerator):
        raise ValueError(
            f"asynchronous=True saves a training state of a single process, but this run has "
            f"{accelerator.num_processes} process(es){' under FSDP' if is_fsdp(accelerator) else ''}: a state of "
            "several processes is sealed by barriers, which cannot run in the background. Pass asynchronous=False."
        )


class HostBuffers:
    """Host copies of the large tensors of a state, kept from one asynchronous save to the next of a run, as
    ``torch.distributed.checkpoint`` caches its staged state: the next save copies into them instead of allocating
    (and page-faulting) as much memory again, which halves its stall. Reusing them is safe because a save first
    waits for the one before it. ``clear()`` frees them; the trainer does as its run ends."""

    def __init__(self) -> None:
        self._buffers: dict = {}

    def copy(self, key: str, tensor: torch.Tensor) -> torch.Tensor:
        buffer = self._buffers.get(key)
        if buffer is None or buffer.shape != tensor.shape or buffer.dtype != tensor.dtype:
            buffer = self._buffers[key] = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu")
        return buffer.copy_(tensor.detach())

    def clear(self) -> None:
        self._buffers.clear()


host_buffers = HostBuffers()


def to_host(value: Any, buffers: Optional[HostBuffers] = None, key: str = "") -> Any:
    """A copy of ``value`` whose tensors are detached copies in CPU memory (CPU tensors are copied too, so the
    training loop may change the originals while the copy is written); into ``buffers`` when given."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True) if buffers is None else buffers.copy(key, value)
    if isinstance(value, dict):
        return {name: to_host(item, buffers, f"{key}/{name}") for name, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(to_host(item, buffers, f"{key}/{index}") for index, item in enumerate(value))
    return value


@dataclass
class StagedState:
    """A training state in host memory, with where and how it is to be written."""

    final: Path
    files: dict  # file name -> object for torch.save, or SafetensorsContent (the model file)
    manifest_fields: dict
    max_rolling: Optional[int]
    #: called with the state's folder once it is written, on the background thread (an upload to a store)
    after_write: Optional[Callable[[Path], None]] = None


@dataclass
class SafetensorsContent:
    """The model's weights in host memory, serialized to safetensors on the background thread."""

    tensors: dict
    metadata: Optional[dict]

    def to_bytes(self) -> bytes:
        from safetensors.torch import save

        return save(self.tensors, metadata=self.metadata)


def _model_content(model: torch.nn.Module, file_name: str = MODEL_FILE) -> SafetensorsContent:
    """The model's weights, copied to host memory (tied weights stored once, as safetensors' ``save_model`` does)
    into the host buffers kept for ``file_name``."""
    from safetensors.torch import _remove_duplicate_names

    state_dict = model.state_dict()
    metadata: dict[str, str] = {}
    for kept_name, removed in _remove_duplicate_names(state_dict).items():
        for name in removed:
            metadata.setdefault(name, kept_name)
            del state_dict[name]
    host = to_host(state_dict, host_buffers, file_name)
    return SafetensorsContent({name: tensor.contiguous() for name, tensor in host.items()}, metadata or None)


def _extra_contents(trainer) -> dict:
    """The extra models of ``add_model`` and their optimizers' states, copied to host memory: a file each, named and
    written as a synchronous save writes them (``files.write_extra_files``)."""
    files = {}
    for name in trainer.extra_models:
        files[extra_model_file(name)] = _model_content(trainer.get_extra_model(name), extra_model_file(name))
    for name, optimizer in trainer.extra_optimizers.items():
        file_name = extra_optimizer_file(name)
        files[file_name] = to_host(inner_optimizer(optimizer).state_dict(), host_buffers, file_name)
    return files


def stage_training_state(
    trainer,
    parent: Path,
    position,
    run_facts: dict,
    kinds=("rolling",),
    checkpoint_kwargs: Optional[dict] = None,
    max_rolling: Optional[int] = None,
    name: Optional[str] = None,
) -> StagedState:
    """Copy the trainer's training state to host memory (a single process); the loop stalls only for this."""
    accelerator = trainer.accelerator
    validate_asynchronous_save(accelerator)
    checkpoint_kwargs = dict(checkpoint_kwargs or {})
    validate_plain(checkpoint_kwargs, "checkpoint_kwargs")
    files = {
        rank_file(0): to_host(
            {
                "rng": capture_rng_state(),
                "train_loss_tracker": trainer.run_state.train_loss_tracker.state_dict(),
                "train_step_metrics": trainer.run_state.train_step_metrics.state_dict(),
                "callbacks": training_state._callback_states(trainer.callback_handler),
            }
        ),
        MODEL_FILE: _model_content(trainer.get_model()),
        OPTIMIZER_FILE: to_host(trainer.optimizer.state_dict(), host_buffers, OPTIMIZER_FILE),
    }
    if trainer.scheduler is not None:
        files[SCHEDULER_FILE] = to_host(trainer.scheduler.state_dict())
        validate_plain(files[SCHEDULER_FILE], "scheduler.state_dict()")
    if accelerator.scaler is not None:
        files[SCALER_FILE] = to_host(accelerator.scaler.state_dict())
    files.update(_extra_contents(trainer))
    files[TRAINER_FILE] = to_host(
        {
            "position": asdict(position),
            "num_update_steps_completed": trainer.num_update_steps_completed,
            "run_history": trainer.run_history.state_dict(),
            "history_epoch": trainer.run_state.history_epoch(position),
            "run_facts": run_facts,
            "checkpoint_kwargs": checkpoint_kwargs,
            "optimizer_class": type(inner_optimizer(trainer.optimizer)).__qualname__,
            "extra_optimizer_classes": extra_optimizer_classes(trainer.extra_optimizers),
        }
    )
    fields = {
        "num_update_steps_completed": trainer.num_update_steps_completed,
        "position": asdict(position),
        "world_size": 1,
        "kinds": sorted(set(kinds)),
        "run_facts": run_facts,
        **training_state.run_identity_field(trainer),
    }
    final = unused_folder_name(Path(parent), name or default_state_name(trainer.num_update_steps_completed))
    return StagedState(final, files, fields, max_rolling)


def write_staged_state(staged: StagedState) -> Path:
    """Write a staged state with the crash-safe protocol of a synchronous save; return its folder."""
    final = staged.final
    final.parent.mkdir(parents=True, exist_ok=True)
    temporary = training_state.begin_save(final)
    checksums = {}
    with reporting_out_of_space(
        temporary, final, "the training state", f"the earlier states in {final.parent} are unchanged"
    ):
        for name, content in staged.files.items():  # the rank file first, the trainer file last, as a synchronous save
            crash_points.crash_point(f"write:{name}")
            if isinstance(content, SafetensorsContent):
                checksums[name] = write_bytes_file(content.to_bytes(), temporary / name)
            else:
                checksums[name] = save_tensors_file(content, temporary / name)
    training_state.finish_save(temporary, final, staged.manifest_fields, checksums)
    training_state.prune_states(
        final.parent, staged.max_rolling, keep=[final], run_id=staged.manifest_fields.get("run_id")
    )
    if staged.after_write is not None:
        staged.after_write(final)
    return final


class BackgroundSaver:
    """Writes one staged state at a time on a background thread; :meth:`wait` returns when it is written."""

    def __init__(self) -> None:
        self._thread: Optional[threading.Thread] = None
        self._error: Optional[BaseException] = None
        self._folder: Optional[Path] = None

    @property
    def pending(self) -> bool:
        return self._thread is not None

    def submit(self, staged: StagedState) -> None:
        """Write ``staged`` in the background, after the save under way (whose error, if any, is raised here)."""
        self.wait()
        self._thread = threading.Thread(target=self._write, args=(staged,), name="training-state-save", daemon=False)
        self._thread.start()

    def _write(self, staged: StagedState) -> None:
        try:
            self._folder = write_staged_state(staged)
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
