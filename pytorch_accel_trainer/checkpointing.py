"""Export checkpoints: one portable file that loads with ``torch.load(weights_only=True)``."""

from __future__ import annotations

import os
import pickle
from pathlib import Path
from typing import Any, Optional, Union

import torch

MODEL_KEY = "model_state_dict"
OPTIMIZER_KEY = "optimizer_state_dict"
SCHEDULER_KEY = "scheduler_state_dict"
RESERVED_KEYS = (MODEL_KEY, OPTIMIZER_KEY, SCHEDULER_KEY)

_PLAIN_TYPES = (str, int, float, bool, type(None), torch.Tensor, torch.dtype, torch.device, torch.Size)


def build_checkpoint(
    model_state: dict,
    optimizer_state: Optional[dict] = None,
    scheduler_state: Optional[dict] = None,
    checkpoint_kwargs: Optional[dict] = None,
) -> dict:
    """Return the checkpoint dictionary, refusing extra values that would need pickle to load back."""
    checkpoint: dict[str, Any] = {MODEL_KEY: model_state}
    if optimizer_state is not None:
        checkpoint[OPTIMIZER_KEY] = optimizer_state
    if scheduler_state is not None:
        checkpoint[SCHEDULER_KEY] = scheduler_state
    for key, value in (checkpoint_kwargs or {}).items():
        if key in RESERVED_KEYS:
            raise ValueError(
                f"checkpoint_kwargs uses the key {key!r}, which the checkpoint keeps for its own state; rename it."
            )
        validate_plain(value, f"checkpoint_kwargs[{key!r}]")
        checkpoint[key] = value
    return checkpoint


def validate_plain(value: Any, where: str) -> None:
    """Refuse a value that would need pickle to load back, naming where it is."""
    if isinstance(value, dict):
        for key, item in value.items():
            validate_plain(key, f"{where} key")
            validate_plain(item, f"{where}[{key!r}]")
    elif isinstance(value, (list, tuple, set)):
        for index, item in enumerate(value):
            validate_plain(item, f"{where}[{index}]")
    elif not isinstance(value, _PLAIN_TYPES):
        raise TypeError(
            f"{where} is a {type(value).__name__}, which cannot be loaded back without pickle (checkpoints load with "
            "weights_only=True, so that loading one never runs code). Store tensors, numbers, strings, lists or "
            "dicts of them instead, e.g. a state_dict()."
        )


def save_checkpoint_file(checkpoint: dict, save_path: Union[str, os.PathLike]) -> None:
    """Write ``checkpoint`` to ``save_path`` atomically: a crash leaves the old file or the new one, never half."""
    path = Path(save_path)
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(temporary, "wb") as handle:
            torch.save(checkpoint, handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, path)
    finally:
        if temporary.exists():
            temporary.unlink()


def load_checkpoint_file(checkpoint_path: Union[str, os.PathLike]) -> dict:
    """Load a checkpoint on the CPU, without ever unpickling arbitrary objects."""
    path = Path(checkpoint_path)
    if not path.is_file():
        raise FileNotFoundError(f"No checkpoint file at {str(path)!r}: check the path (a file written by save_checkpoint).")
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as error:
        raise ValueError(
            f"{str(path)!r} holds objects that only pickle can rebuild, and checkpoints are loaded with "
            f"weights_only=True so that loading one never runs code ({error}). Re-save it with state_dicts and "
            "plain values only."
        ) from error
    if not isinstance(checkpoint, dict) or MODEL_KEY not in checkpoint:
        raise ValueError(
            f"{str(path)!r} is not a trainer checkpoint: it has no {MODEL_KEY!r} entry. Pass a file written by "
            "Trainer.save_checkpoint."
        )
    return checkpoint


def checkpoint_extras(checkpoint: dict) -> dict:
    """Return the entries of ``checkpoint`` that came from ``checkpoint_kwargs``."""
    return {key: value for key, value in checkpoint.items() if key not in RESERVED_KEYS}
