"""A sharded training state made whole, on one machine, without a process group: ``pytorch-accel-trainer consolidate``.

A training state holds the model's tensors in one file (written by one process), one shard per process of the run that
wrote it (``parts.py``), or DeepSpeed's partitions (``deepspeed_engine.py``: gathered by DeepSpeed's own reader, which
needs DeepSpeed installed but no process group). For an evaluation, an export or a serving job, :func:`consolidate`
verifies the state (every file against its manifest) and writes the model's full weights as one plain file: safetensors
(``.safetensors``), or a checkpoint that ``Trainer.load_checkpoint`` and ``torch.load(weights_only=True)`` read
(``.pt``, ``.pth``; the model's weights under ``model_state_dict``). Only a model is written (the model, or an extra
model of ``add_model``): an optimizer's state is no weights. The model's tensors alone are read into this process's
memory (the optimizer's state is not read): the machine needs as much host memory as the weights take.

Both paths follow the library's rules for every path it takes (``state/storage.py``): ``~`` and ``$VARIABLES``
expanded, an object-storage URL read or written through fsspec (never a local folder named ``s3:``). The output is
checked before any work: a new file, never one that exists, never inside a training state.
"""

from __future__ import annotations

import os
from pathlib import Path, PurePosixPath
from typing import Optional, Union

import torch

from pytorch_accel_trainer.errors import CheckpointError
from pytorch_accel_trainer.state import deepspeed_engine, storage
from pytorch_accel_trainer.state.files import DEEPSPEED, MANIFEST_NAME, ONE_FILE, DamagedStateError, StoredState
from pytorch_accel_trainer.state.manager import RUN_FOLDER_STATES, TrainingStates, find_resumable_state, is_run_folder
from pytorch_accel_trainer.state.parts import SEPARATOR, Processes, read_parts_file
from pytorch_accel_trainer.state.shards import read_full_tensors, read_metadata, saved_shapes
from pytorch_accel_trainer.state.storage import Location, RemoteStates, as_location, validate_location

#: The extensions of the outputs :func:`consolidate` writes, and what each one is.
OUTPUT_KINDS = {".safetensors": "safetensors weights", ".pt": "a checkpoint", ".pth": "a checkpoint"}

#: The prefix of the parts that are extra models of ``add_model`` (``extra_model:<name>``).
EXTRA_MODEL_PREFIX = "extra_model:"


def full_weights(state: Union[str, os.PathLike], part: str = "model") -> dict[str, torch.Tensor]:
    """The full weights of ``part`` (``"model"``, or ``"extra_model:<name>"``) of a training state, verified first;
    by the names of the plain model's ``state_dict()``.

    ``state`` is one training state, a folder of them (the newest good one is used), a run folder of the command line
    (its ``training_states``), or an object-storage URL of any of these (downloaded to a temporary copy); ``~`` and
    ``$VARIABLES`` are expanded.

    Raises:
        ValueError: ``part`` is not a model's (an optimizer's state is no weights), or ``state`` is no path (an
            environment variable that is not set, a URL that lost a slash).
        FileNotFoundError: ``state`` does not exist.
        CheckpointError: ``state`` is no folder (standard input, a file), holds no training state, a damaged one, or
            one without ``part``.
    """
    _validate_part(part)
    stored = _find_state(state)
    try:
        return _read_weights(stored, part)
    finally:
        if stored.url is not None:  # a store's state: its downloaded copy goes, as after a resume
            RemoteStates(str(storage.parent(stored.url))).drop_downloads(stored.folder.name)


def _read_weights(stored: StoredState, part: str) -> dict[str, torch.Tensor]:
    """The full weights of ``part`` of the verified state ``stored``: its state dict in a one-file state's parts
    file, its tensors gathered from every process's shard of a sharded one, or DeepSpeed's fp32 weights.

    Raises:
        CheckpointError: the state holds no ``part``, or a file of it cannot be read.
    """
    where = stored.url or stored.folder
    if stored.layout == DEEPSPEED:  # DeepSpeed's engine holds one model
        if part != "model":
            raise CheckpointError(f"{where} holds no {part!r}: a DeepSpeed state holds one model, 'model'.")
        return deepspeed_engine.full_weights(stored)
    if stored.layout == ONE_FILE:  # memory-mapped: the model's tensors alone are read, copied out of the file
        saved = read_parts_file(stored.folder, mmap=True)
        if part not in saved:
            raise CheckpointError(f"{where} holds no {part!r} (it holds {', '.join(sorted(saved))}).")
        weights = saved[part]
        if not all(isinstance(tensor, torch.Tensor) for tensor in weights.values()):
            raise CheckpointError(f"{where}: its {part!r} holds values that are no tensors; it was altered.")
        return {name: tensor.clone() for name, tensor in weights.items()}
    prefix = f"{part}{SEPARATOR}"
    try:
        names = saved_shapes(read_metadata(stored.folder))
        if not any(name.startswith(prefix) for name in names):
            parts = sorted({name.split(SEPARATOR, 1)[0] for name in names})
            raise CheckpointError(f"{where} holds no {part!r} (it holds {', '.join(parts)}).")
        tensors = read_full_tensors(stored.folder, prefix, set(stored.manifest["files"]))
    except DamagedStateError as error:
        raise CheckpointError(f"{error}; the state was damaged or altered.") from error
    return {name[len(prefix) :]: tensor for name, tensor in tensors.items()}


def consolidate(state: Union[str, os.PathLike], output: Union[str, os.PathLike], part: str = "model") -> Location:
    """Write the full weights of ``part`` of a training state (see :func:`full_weights`) to ``output``, atomically:
    a ``.safetensors`` file, or a ``.pt`` / ``.pth`` checkpoint (``model_state_dict``). Return the file written:
    ``output`` as a ``Path`` (``~`` and ``$VARIABLES`` expanded), or its URL in object storage.

    ``output`` is checked before the state is read: a new file (an existing one is never replaced), outside every
    training state.

    Raises:
        ValueError: ``output`` has another extension, exists (a file or a folder), lies inside a training state, or
            is no path; ``part`` is not a model's.
        CheckpointError, FileNotFoundError: see :func:`full_weights`.
    """
    _validate_part(part)
    target = _validate_output(output)
    weights = full_weights(state, part)
    with storage.local_file_to_write(target) as path:  # a URL: written here, then uploaded as one object
        _write_weights(weights, path)
    return target


def _validate_part(part: str) -> None:
    """Refuse a ``part`` that is not a model: ``"model"`` or ``"extra_model:<name>"``.

    Raises:
        ValueError: naming the part, and the parts that can be written.
    """
    if part != "model" and not (part.startswith(EXTRA_MODEL_PREFIX) and len(part) > len(EXTRA_MODEL_PREFIX)):
        raise ValueError(
            f"consolidate: --part {part!r} is not a model: consolidate writes a model's weights, 'model' or "
            f"'extra_model:NAME' (a model of add_model). An optimizer's state is no weights: it goes on with the run "
            "(train(resume_from=...)); nothing was written."
        )


def _validate_output(output: Union[str, os.PathLike]) -> Location:
    """``output`` as a location (``~`` and ``$VARIABLES`` expanded, a URL kept), refused before any work if it is
    no new file of one of :data:`OUTPUT_KINDS`, or lies inside a training state.

    Raises:
        ValueError: the extension, an existing file or folder, a training state that holds it, or no path (see
            :func:`~pytorch_accel_trainer.state.storage.as_location`).
        ImportError: a URL whose store's package is not installed.
    """
    target = as_location(output)
    suffix = PurePosixPath(str(target)).suffix
    if suffix not in OUTPUT_KINDS:
        kinds = ", ".join(f"{extension} ({kind})" for extension, kind in OUTPUT_KINDS.items())
        example = f"{str(target)[: len(str(target)) - len(suffix)]}.safetensors"
        raise ValueError(
            f"consolidate: {str(output)!r} is not a file name ending in one of {kinds}; pass one, e.g. {example!r}."
        )
    validate_location(target)
    state = _training_state_holding(target)
    if state is not None:
        raise ValueError(
            f"consolidate: {str(output)!r} is in the training state {str(state)!r}, which a new file would alter: "
            "write the weights outside it."
        )
    if isinstance(target, Path) and target.is_dir():
        raise ValueError(
            f"consolidate: {str(output)!r} is a folder: pass the name of a new file, e.g. "
            f"{str(target / f'model{suffix}')!r}."
        )
    if os.path.lexists(target) if isinstance(target, Path) else storage.exists(target):
        raise ValueError(
            f"consolidate: {str(output)!r} already exists: consolidate never overwrites a file. Pass a new name, or "
            "remove the file first."
        )
    return target


def _training_state_holding(target: Location) -> Optional[Location]:
    """The training state (a folder with a manifest) that is or holds ``target``, or ``None``."""
    if isinstance(target, Path):
        resolved = target.resolve()
        return next((folder for folder in (resolved, *resolved.parents) if (folder / MANIFEST_NAME).is_file()), None)
    folder: Location = ""
    above: Location = target
    while above != folder:  # up to the bucket: one small request per level
        folder, above = above, storage.parent(above)
        if storage.exists(storage.join(folder, MANIFEST_NAME)):
            return folder
    return None


def _find_state(state: Union[str, os.PathLike]) -> StoredState:
    """The verified training state of ``state`` (see :func:`full_weights`): in a store, through
    :meth:`~pytorch_accel_trainer.state.manager.TrainingStates.find` on this one process; on a disk, through
    :func:`~pytorch_accel_trainer.state.manager.find_resumable_state` (a run folder: its ``training_states``). A
    location without a state is an error here, not a new run.

    Raises:
        FileNotFoundError, CheckpointError, ValueError: see :func:`full_weights`.
    """
    location = as_location(state)
    if isinstance(location, str):
        validate_location(location)
        stored = TrainingStates(Processes()).find(location)
    else:
        _validate_local_state(location, str(state))
        stored = find_resumable_state(location / RUN_FOLDER_STATES if is_run_folder(location) else location)
    if stored is None:
        raise CheckpointError(
            f"consolidate: STATE {str(state)!r} holds no training state (no folder with a {MANIFEST_NAME}): pass a "
            "folder written by save_training_state (or SaveTrainingStateCallback), a folder of them, or a run folder."
        )
    return stored


def _validate_local_state(path: Path, given: str) -> None:
    """Refuse a local ``STATE`` that cannot hold a training state: standard input, a missing path, a file."""
    expected = "pass a training state's folder, a folder of them, or a run folder of the command line"
    if given == "-":
        raise CheckpointError(
            f"consolidate: STATE '-' is standard input, but a training state is a folder: {expected}."
        )
    if not path.exists():
        shown = given if str(path) == given else f"{given} (that is, {str(path)})"
        raise FileNotFoundError(f"consolidate: STATE {shown!r} does not exist: {expected}.")
    if not path.is_dir():
        kind = "a file (one written by save_checkpoint or save_weights already holds full weights)"
        raise CheckpointError(
            f"consolidate: STATE {given!r} is not a folder but {kind if path.is_file() else 'a device or a pipe'}: "
            f"{expected}."
        )


def _write_weights(weights: dict[str, torch.Tensor], output: Path) -> None:
    """Write ``weights`` to the local file ``output`` atomically, as its extension says."""
    from safetensors.torch import save_file

    from pytorch_accel_trainer.state.checkpointing import MODEL_KEY, save_checkpoint_file
    from pytorch_accel_trainer.state.files import follow_umask

    if output.suffix != ".safetensors":
        save_checkpoint_file({MODEL_KEY: weights}, output)
        return
    output.parent.mkdir(parents=True, exist_ok=True)
    temporary = output.with_name(f".{output.name}.tmp")
    try:
        save_file({name: tensor.contiguous() for name, tensor in weights.items()}, str(temporary))
        follow_umask(temporary)
        temporary.replace(output)
    finally:
        temporary.unlink(missing_ok=True)
