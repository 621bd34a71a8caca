"""Export checkpoints: one portable file that loads with ``torch.load(weights_only=True)``.

Also the rules for the temporaries that every atomic write leaves behind when its process is killed: they are
named after the host and process that write them, and removed by the next save into the same folder once that
process is gone (a live process's temporary is never touched).
"""

from __future__ import annotations

import os
import pickle
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Union

import torch

from pytorch_accel_trainer.errors import CheckpointError
from pytorch_accel_trainer.state.files import is_abandoned, reporting_out_of_space, validate_plain, writer_tag

MODEL_KEY = "model_state_dict"
OPTIMIZER_KEY = "optimizer_state_dict"
SCHEDULER_KEY = "scheduler_state_dict"
#: The state dicts of the extra models and optimizers (``Trainer.add_model``), by name; only in the files of trainers
#: that have some.
EXTRA_MODELS_KEY = "extra_model_state_dicts"
EXTRA_OPTIMIZERS_KEY = "extra_optimizer_state_dicts"
#: Where ``load_checkpoint(path, strict=False)`` puts, in the checkpoint it returns, the :class:`SkippedWeights`.
SKIPPED_WEIGHTS_KEY = "skipped_weights"
RESERVED_KEYS = (MODEL_KEY, OPTIMIZER_KEY, SCHEDULER_KEY, EXTRA_MODELS_KEY, EXTRA_OPTIMIZERS_KEY, SKIPPED_WEIGHTS_KEY)


def build_checkpoint(
    model_state: dict,
    optimizer_state: Optional[dict] = None,
    scheduler_state: Optional[dict] = None,
    checkpoint_kwargs: Optional[dict] = None,
    extra_states: Optional[dict] = None,
) -> dict:
    """Return the checkpoint dictionary, refusing extra values that would need pickle to load back.

    ``extra_states`` holds the entries of the extra models and optimizers (``EXTRA_MODELS_KEY``,
    ``EXTRA_OPTIMIZERS_KEY``), when the trainer has some.
    """
    checkpoint: dict[str, Any] = {MODEL_KEY: model_state}
    if optimizer_state is not None:
        checkpoint[OPTIMIZER_KEY] = optimizer_state
    if scheduler_state is not None:
        checkpoint[SCHEDULER_KEY] = scheduler_state
    checkpoint.update(extra_states or {})
    for key, value in (checkpoint_kwargs or {}).items():
        if key in RESERVED_KEYS:
            raise ValueError(
                f"checkpoint_kwargs uses the key {key!r}, which the checkpoint keeps for its own state; rename it."
            )
        validate_plain(value, f"checkpoint_kwargs[{key!r}]")
        checkpoint[key] = value
    return checkpoint


# ------------------------------------------------------------------------------------------------
# Weights that do not fit the model: fine-tuning from a checkpoint with a new head
# ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SkippedWeights:
    """The entries of a checkpoint's model state that do not fit a model, found by :func:`compare_model_states`.

    ``load_checkpoint(path, strict=False)`` loads every other entry and returns this under ``"skipped_weights"``;
    with ``strict=True`` (the default) any of them is an error. It is true when anything was skipped.

    Attributes:
        mismatched_shapes: the names in both whose shapes differ (a new head), each with ``(shape in the file,
            shape in the model)``; the model keeps its own values.
        missing_keys: names of the model the file does not have; the model keeps its own values.
        unexpected_keys: names of the file the model does not have; ignored.
    """

    mismatched_shapes: dict = field(default_factory=dict)
    missing_keys: list = field(default_factory=list)
    unexpected_keys: list = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.mismatched_shapes or self.missing_keys or self.unexpected_keys)

    def describe(self) -> str:
        """One line per kind of entry skipped, e.g. ``"shapes differ: head.weight (file (10, 64), model (3, 64))"``."""
        parts = []
        if self.mismatched_shapes:
            shapes = ", ".join(
                f"{name} (file {tuple(in_file)}, model {tuple(in_model)})"
                for name, (in_file, in_model) in self.mismatched_shapes.items()
            )
            parts.append(f"shapes differ: {shapes}")
        if self.missing_keys:
            parts.append(f"not in the file (the model keeps its own): {', '.join(self.missing_keys)}")
        if self.unexpected_keys:
            parts.append(f"not in the model (ignored): {', '.join(self.unexpected_keys)}")
        return "; ".join(parts)


def compare_model_states(model_state: dict, file_state: dict) -> SkippedWeights:
    """What of ``file_state`` (a checkpoint's model state) does not fit ``model_state`` (the model's ``state_dict()``):
    names on one side only, and shapes that differ. Compares names and shapes on the host: no device work."""
    mismatched = {
        name: (tuple(value.shape), tuple(model_state[name].shape))
        for name, value in file_state.items()
        if name in model_state
        and isinstance(value, torch.Tensor)
        and isinstance(model_state[name], torch.Tensor)
        and value.shape != model_state[name].shape
    }
    return SkippedWeights(
        mismatched_shapes=mismatched,
        missing_keys=[name for name in model_state if name not in file_state],
        unexpected_keys=[name for name in file_state if name not in model_state],
    )


#: What wrappers put before every name of a model's state dict: DDP and DataParallel ``module.``, ``torch.compile``
#: ``_orig_mod.``. A checkpoint saved from a wrapped model by a hand-written loop has them.
WRAPPER_PREFIXES = ("module.", "_orig_mod.")


def without_wrapper_prefixes(model_state: dict, file_state: dict) -> dict:
    """``file_state`` without the wrapper prefixes (:data:`WRAPPER_PREFIXES`) that every one of its names has and no
    name of ``model_state`` has: ``module.layer.weight`` is the model's ``layer.weight``. Names are matched as they are
    otherwise (a prefix on some names only is a difference :func:`compare_model_states` reports)."""
    stripped = True
    while stripped and file_state:
        stripped = False
        for prefix in WRAPPER_PREFIXES:
            if all(name.startswith(prefix) for name in file_state) and not any(
                name.startswith(prefix) for name in model_state
            ):
                file_state = {name[len(prefix) :]: value for name, value in file_state.items()}
                stripped = True
    return file_state


def validate_some_weights_fit(model_state: dict, file_state: dict, skipped: SkippedWeights, checkpoint_path) -> None:
    """Refuse a checkpoint none of whose weights fit the model, whatever ``strict`` says: loading nothing would leave
    the model as it was, and a fine-tuning run would start from random weights while the user believes otherwise.

    Raises:
        CheckpointError: naming the file and a few names (and shapes) of each side.
    """
    fitting = [name for name in file_state if name in model_state and name not in skipped.mismatched_shapes]
    if fitting or not file_state:
        return

    def some(names) -> str:
        names = list(names)
        return ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")

    shared = [name for name in file_state if name in model_state]
    problem = (
        f"every one of its {len(shared)} shared names has another shape ({skipped.describe()})"
        if shared
        else f"none of its {len(file_state)} names is one of the model's (the file has {some(file_state)}; the model "
        f"has {some(model_state)})"
    )
    raise CheckpointError(
        f"{str(checkpoint_path)!r} has no weight that fits the model: {problem}. Nothing was loaded. It was saved from "
        "another model: load it into that model, or rename its entries (torch.load(path, weights_only=True)"
        "['model_state_dict']) to the model's names before loading."
    )


# ------------------------------------------------------------------------------------------------
# Temporaries of killed writes
# ------------------------------------------------------------------------------------------------

#: ``.<name>.tmp-<host>-<pid>``: an export's temporary, named by its writer
_TEMPORARY_FILE = re.compile(r"\.(?P<name>.+)\.tmp-(?P<host>.+)-(?P<pid>\d+)")


def temporary_file(path: Path) -> Path:
    """Where :func:`save_checkpoint_file` writes ``path`` before renaming it into place."""
    return path.with_name(f".{path.name}.tmp-{writer_tag()}")


def remove_abandoned_temporary_files(folder: Path) -> list[Path]:
    """Delete the export temporaries in ``folder`` left by processes of this host that are gone; return them.

    Only regular files named as :func:`temporary_file` names them are considered; links and folders are left.
    """
    removed = []
    try:
        for path in folder.iterdir():
            match = _TEMPORARY_FILE.fullmatch(path.name)
            if match is None or int(match["pid"]) == os.getpid() or not path.is_file() or path.is_symlink():
                continue  # not a temporary, or this process's own (overwritten by this save)
            if is_abandoned(match["host"], int(match["pid"])):
                path.unlink(missing_ok=True)  # missing: another save removed it first
                removed.append(path)
    except OSError:
        pass  # tidying up never fails a save: what is left is removed by a later one
    return removed


# ------------------------------------------------------------------------------------------------
# Writing and reading an export checkpoint
# ------------------------------------------------------------------------------------------------


def save_checkpoint_file(checkpoint: dict, save_path: Union[str, os.PathLike]) -> None:
    """Write ``checkpoint`` to ``save_path`` atomically: a crash leaves the old file or the new one, never half.

    Temporaries that killed saves left in the folder are removed first (see :func:`remove_abandoned_temporary_files`).

    Raises:
        OSError: with ``errno.ENOSPC``, naming ``save_path``, when the disk is full (the temporary is removed).
    """
    path = Path(save_path)
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_abandoned_temporary_files(path.parent)
    temporary = temporary_file(path)
    try:
        with reporting_out_of_space(temporary, path, "the checkpoint", "any earlier file at this path is unchanged"):
            with open(temporary, "wb") as handle:
                torch.save(checkpoint, handle)
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)


def _first_bytes(path: Path, count: int = 16) -> bytes:
    try:
        with open(path, "rb") as handle:
            return handle.read(count)
    except OSError:
        return b""


def refused_by_weights_only(path: Path) -> bool:
    """Whether a file torch could not load with ``weights_only=True`` is a pickle (or torch's zip of one), so holds
    objects that only pickle can rebuild, rather than no pickle at all (torch's message is the same for both)."""
    return _first_bytes(path, 4) in (b"PK\x03\x04",) or _first_bytes(path, 1) == b"\x80"


def describe_unreadable_torch_file(path: Path, error: Exception) -> str:
    """What a file that ``torch.load`` cannot read at all is likely to be, by its first bytes."""
    if is_safetensors_file(path):
        what = SAFETENSORS_FILE
    else:
        what = "not a file written by torch.save (random bytes, a truncated file, or another format)"
    return f"{str(path)!r} is {what} ({type(error).__name__}: {str(error).splitlines()[0][:200]})."


SAFETENSORS_FILE = "a safetensors file (weights only): load it with safetensors.torch.load_model(model, path)"


def is_safetensors_file(path: Path) -> bool:
    """Whether ``path`` starts as a safetensors file does: an 8-byte header length, then its JSON header."""
    head = _first_bytes(path)
    return len(head) >= 9 and head[8:9] == b"{"


def load_checkpoint_file(checkpoint_path: Union[str, os.PathLike]) -> dict:
    """Load a checkpoint on the CPU, without ever unpickling arbitrary objects."""
    path = Path(checkpoint_path)
    if path.is_dir():
        weights = ""
        if (path / "model.safetensors").is_file():
            weights = " (its model.safetensors holds the weights: load them with safetensors.torch.load_model)"
        raise IsADirectoryError(
            f"{str(path)!r} is a folder, not a checkpoint file{weights}: pass a file written by save_checkpoint."
        )
    if not path.is_file():
        raise FileNotFoundError(
            f"No checkpoint file at {str(path)!r}: check the path (a file written by save_checkpoint)."
        )
    if is_safetensors_file(path):
        raise ValueError(f"{str(path)!r} is {SAFETENSORS_FILE}. load_checkpoint takes a file of save_checkpoint.")
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as error:
        if not refused_by_weights_only(path):
            message = describe_unreadable_torch_file(path, error)
            raise ValueError(f"{message} Pass a file written by save_checkpoint.") from error
        raise ValueError(
            f"{str(path)!r} holds objects that only pickle can rebuild, and checkpoints are loaded with "
            f"weights_only=True so that loading one never runs code ({error}). Re-save it with state_dicts and "
            "plain values only."
        ) from error
    except (RuntimeError, EOFError) as error:  # not a torch file at all: truncated, or something else entirely
        raise ValueError(
            f"{str(path)!r} is not a readable checkpoint ({error}): pass a file written by Trainer.save_checkpoint."
        ) from error
    if not isinstance(checkpoint, dict) or MODEL_KEY not in checkpoint:
        raise ValueError(
            f"{str(path)!r} is not a trainer checkpoint: it has no {MODEL_KEY!r} entry. Pass a file written by "
            "Trainer.save_checkpoint."
        )
    return checkpoint
