"""A sharded training state made whole, on one machine, without a process group: ``pytorch-accel-trainer consolidate``.

A training state holds the model's tensors one shard per process of the run that wrote it (``parts.py``). For an
evaluation, an export or a serving job, :func:`consolidate` verifies the state (every file against its manifest)
and writes the model's full weights as one plain file: safetensors (``.safetensors``), or a checkpoint that
``Trainer.load_checkpoint`` and ``torch.load(weights_only=True)`` read (``.pt``, ``.pth``; the model's weights under
``model_state_dict``). The whole model is read into this process's memory (not the optimizer's state): the machine
needs as much host memory as the weights take.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Union

import torch

from pytorch_accel_trainer.errors import CheckpointError
from pytorch_accel_trainer.state.files import DamagedStateError
from pytorch_accel_trainer.state.parts import SEPARATOR, read_full_tensors, read_metadata

#: The extensions of the outputs :func:`consolidate` writes, and what each one is.
OUTPUT_KINDS = {".safetensors": "safetensors weights", ".pt": "a checkpoint", ".pth": "a checkpoint"}


def full_weights(state: Union[str, os.PathLike], part: str = "model") -> dict[str, torch.Tensor]:
    """The full weights of ``part`` (``"model"``, or ``"extra_model:<name>"``) of a training state, or of the newest
    good state in a folder of them, verified first; by the names of the plain model's ``state_dict()``.

    Raises:
        CheckpointError: no training state there, a damaged one, or one without ``part``.
    """
    from pytorch_accel_trainer.state.manager import find_resumable_state

    if not Path(state).exists():
        raise FileNotFoundError(
            f"consolidate: {str(state)!r} does not exist: pass a training state's folder, or a folder of them."
        )
    stored = find_resumable_state(Path(state))
    if stored is None:
        raise CheckpointError(f"{str(state)!r} holds no training state: pass a folder written by save_training_state.")
    try:
        metadata = read_metadata(stored.folder)
        prefix = f"{part}{SEPARATOR}"
        if not any(name.startswith(prefix) for name in metadata.state_dict_metadata):
            parts = sorted({name.split(SEPARATOR, 1)[0] for name in metadata.state_dict_metadata})
            raise CheckpointError(f"{stored.folder} holds no {part!r} (it holds {', '.join(parts)}).")
        tensors = read_full_tensors(stored.folder, prefix, set(stored.manifest["files"]))
    except DamagedStateError as error:
        raise CheckpointError(f"{error}; the state was damaged or altered.") from error
    return {name[len(prefix) :]: tensor for name, tensor in tensors.items()}


def consolidate(state: Union[str, os.PathLike], output: Union[str, os.PathLike], part: str = "model") -> Path:
    """Write the full weights of ``part`` of a training state (see :func:`full_weights`) to ``output``, atomically:
    a ``.safetensors`` file, or a ``.pt`` / ``.pth`` checkpoint (``model_state_dict``). Return ``output``.

    Raises:
        ValueError: ``output`` has another extension, or is a folder.
        CheckpointError: see :func:`full_weights`.
    """
    from safetensors.torch import save_file

    from pytorch_accel_trainer.state.checkpointing import MODEL_KEY, save_checkpoint_file
    from pytorch_accel_trainer.state.files import follow_umask

    output = Path(output)
    if output.suffix not in OUTPUT_KINDS or output.is_dir():
        kinds = ", ".join(f"{suffix} ({kind})" for suffix, kind in OUTPUT_KINDS.items())
        raise ValueError(
            f"consolidate: {str(output)!r} is not a file name ending in one of {kinds}; pass one, e.g. "
            f"{str(output.with_suffix('.safetensors'))!r}."
        )
    weights = full_weights(state, part)
    output.parent.mkdir(parents=True, exist_ok=True)
    if output.suffix == ".safetensors":
        temporary = output.with_name(f".{output.name}.tmp")
        try:
            save_file({name: tensor.contiguous() for name, tensor in weights.items()}, str(temporary))
            follow_umask(temporary)
            temporary.replace(output)
        finally:
            temporary.unlink(missing_ok=True)
    else:
        save_checkpoint_file({MODEL_KEY: weights}, output)
    return output
