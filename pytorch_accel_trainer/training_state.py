"""Crash-safe training-state checkpoints: a folder per state, verified by a manifest.

A training state is written to a temporary folder, flushed, given a manifest (format version, position,
world size, every file with its size and SHA-256) and only then renamed into place; ``latest`` is
updated after that, and old states are pruned last. A crash at any point leaves either the previous
states or the new one, never a folder that loads with wrong or mixed contents: a loader trusts only a
folder whose manifest checks out, and names the file that does not.

Everything is read back without pickle: weights with safetensors, the rest with
``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterable, Optional

import numpy as np
import torch

from pytorch_accel_trainer.errors import CheckpointError  # re-exported: users import it here

FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"
LATEST_NAME = "latest"
STATE_PREFIX = "checkpoint-"
TEMPORARY_PREFIX = ".tmp-"
MODEL_FILE = "model.safetensors"
OPTIMIZER_FILE = "optimizer.pt"
SCHEDULER_FILE = "scheduler.pt"
SCALER_FILE = "scaler.pt"
TRAINER_FILE = "trainer_state.pt"


def rank_file(rank: int) -> str:
    """The name of the file holding one process's own state (RNG, loss sums, callback states)."""
    return f"rank_{rank:05d}.pt"




def _crash_point(name: str) -> None:
    """Called between the steps of a save; tests replace it to simulate a crash at ``name``."""


# ------------------------------------------------------------------------------------------------
# Random number generators, as plain tensors and numbers (no pickle needed to read them back)
# ------------------------------------------------------------------------------------------------


def capture_rng_state() -> dict:
    """Return the state of every RNG of this process: torch, CUDA, numpy and ``random``."""
    numpy_state = np.random.get_state()
    python_version, python_internal, python_gauss = random.getstate()
    state = {
        "torch": torch.random.get_rng_state(),
        "numpy": {
            "keys": torch.from_numpy(numpy_state[1].astype(np.int64)),
            "position": int(numpy_state[2]),
            "has_gauss": int(numpy_state[3]),
            "cached_gaussian": float(numpy_state[4]),
        },
        "python": {"version": python_version, "internal": list(python_internal), "gauss": python_gauss},
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict) -> None:
    """Restore what :func:`capture_rng_state` returned."""
    torch.random.set_rng_state(state["torch"])
    numpy_state = state["numpy"]
    np.random.set_state(
        (
            "MT19937",
            numpy_state["keys"].numpy().astype(np.uint32),
            numpy_state["position"],
            numpy_state["has_gauss"],
            numpy_state["cached_gaussian"],
        )
    )
    python_state = state["python"]
    random.setstate((python_state["version"], tuple(python_state["internal"]), python_state["gauss"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# ------------------------------------------------------------------------------------------------
# Writing
# ------------------------------------------------------------------------------------------------


def save_tensors_file(obj: Any, path: Path) -> None:
    """``torch.save`` to ``path``, flushed to disk."""
    with open(path, "wb") as handle:
        torch.save(obj, handle)
        handle.flush()
        os.fsync(handle.fileno())


def _fsync_directory(path: Path) -> None:
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _write_text_atomically(path: Path, text: str) -> None:
    temporary = path.with_name(f"{TEMPORARY_PREFIX}{path.name}")
    with open(temporary, "w") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(temporary, path)


def temporary_folder(final_folder: Path) -> Path:
    """Where a state is written before it is renamed to ``final_folder``."""
    return final_folder.with_name(f"{TEMPORARY_PREFIX}{final_folder.name}")


def begin_save(final_folder: Path) -> Path:
    """Create an empty temporary folder for ``final_folder`` (main process only) and return it."""
    temporary = temporary_folder(final_folder)
    shutil.rmtree(temporary, ignore_errors=True)  # left by a crash during an earlier save
    temporary.mkdir(parents=True)
    return temporary


def finish_save(temporary: Path, final_folder: Path, manifest_fields: dict) -> None:
    """Seal a fully written temporary folder: manifest, rename into place, then ``latest`` (main process only)."""
    files = {}
    for path in sorted(temporary.iterdir()):
        _crash_point(f"hash:{path.name}")
        files[path.name] = {"size": path.stat().st_size, "sha256": _sha256(path)}
    manifest = {"format_version": FORMAT_VERSION, **manifest_fields, "files": files}
    _crash_point("manifest")
    _write_text_atomically(temporary / MANIFEST_NAME, json.dumps(manifest, indent=2, sort_keys=True))
    _fsync_directory(temporary)
    _crash_point("rename")
    os.rename(temporary, final_folder)
    _fsync_directory(final_folder.parent)
    _crash_point("latest")
    _write_text_atomically(final_folder.parent / LATEST_NAME, final_folder.name + "\n")


def unused_folder_name(parent: Path, name: str) -> Path:
    """``parent / name``, or with a ``-2``, ``-3``... suffix when a state of that name exists: never overwrite."""
    candidate, counter = parent / name, 1
    while candidate.exists():
        counter += 1
        candidate = parent / f"{name}-{counter}"
    return candidate


# ------------------------------------------------------------------------------------------------
# Reading and verifying
# ------------------------------------------------------------------------------------------------


@dataclass
class StoredState:
    """A training-state folder and its manifest."""

    folder: Path
    manifest: dict = field(repr=False)

    @property
    def order(self) -> tuple:
        """Sort key: later positions in the run are newer."""
        position = self.manifest.get("position", {})
        return (
            self.manifest.get("num_update_steps_completed", -1),
            position.get("epoch", -1),
            position.get("batches_seen", -1),
            position.get("rng_restore_point") == "after_iterator",
            self.folder.name,
        )

    @property
    def kinds(self) -> set:
        return set(self.manifest.get("kinds", ["rolling"]))


def read_manifest(folder: Path) -> dict:
    """Return the manifest of ``folder``, or raise :class:`CheckpointError` naming what is wrong."""
    path = folder / MANIFEST_NAME
    if not path.is_file():
        raise CheckpointError(f"{folder}: no {MANIFEST_NAME}, so it is not a complete training state.")
    try:
        manifest = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as error:
        raise CheckpointError(f"{path}: damaged manifest ({error}).") from error
    if not isinstance(manifest, dict) or manifest.get("format_version") != FORMAT_VERSION:
        version = manifest.get("format_version") if isinstance(manifest, dict) else None
        raise CheckpointError(
            f"{path}: format version {version!r}, but this version of pytorch_accel_trainer reads version "
            f"{FORMAT_VERSION}."
        )
    return manifest


def verify_folder(folder: Path) -> StoredState:
    """Check every file of a training state against its manifest (size, then SHA-256).

    Raises:
        CheckpointError: naming the file that is missing, truncated or altered.
    """
    manifest = read_manifest(folder)
    files = manifest.get("files", {})
    for name, expected in sorted(files.items()):
        path = folder / name
        if not path.is_file():
            raise CheckpointError(f"{path}: missing, although the manifest lists it.")
        size = path.stat().st_size
        if size != expected["size"]:
            raise CheckpointError(f"{path}: {size} bytes, but the manifest says {expected['size']} (truncated or altered).")
        if _sha256(path) != expected["sha256"]:
            raise CheckpointError(f"{path}: its SHA-256 does not match the manifest (the file is corrupted or altered).")
    world_size = manifest.get("world_size", 1)
    missing_ranks = [rank_file(rank) for rank in range(world_size) if rank_file(rank) not in files]
    if missing_ranks:
        raise CheckpointError(f"{folder}: the manifest lacks {missing_ranks[0]} for a world size of {world_size}.")
    return StoredState(folder, manifest)


def _state_folders(parent: Path) -> list[Path]:
    return sorted(p for p in parent.iterdir() if p.is_dir() and p.name.startswith(STATE_PREFIX))


def list_complete_states(parent: Path) -> list[StoredState]:
    """Every training state under ``parent`` whose manifest is readable, oldest first (files not hashed)."""
    states = []
    for folder in _state_folders(parent):
        try:
            states.append(StoredState(folder, read_manifest(folder)))
        except CheckpointError:
            continue
    return sorted(states, key=lambda state: state.order)


def find_resumable_state(path: Path) -> Optional[StoredState]:
    """Return the training state to resume from ``path``, or ``None`` for a folder with none yet.

    ``path`` is one training state (a folder with a manifest) or a folder of them, of which the newest
    complete one is used.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        CheckpointError: ``path`` holds training states but none of them checks out.
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(
            f"resume_from={str(path)!r} does not exist: pass a training-state folder or a folder of them "
            "(e.g. the save_dir of SaveTrainingStateCallback)."
        )
    if (path / MANIFEST_NAME).exists():
        return verify_folder(path)
    candidates = _state_folders(path)
    problems = []
    ordered = sorted(
        candidates, key=lambda folder: _order_or_lowest(folder), reverse=True
    )  # newest first; unreadable manifests last
    for folder in ordered:
        try:
            return verify_folder(folder)
        except CheckpointError as error:
            problems.append(str(error))
    if problems:
        listed = "\n  ".join(problems)
        raise CheckpointError(
            f"{path} holds {len(problems)} training state(s) and none can be trusted, so the run was not restarted "
            f"from scratch:\n  {listed}\nRemove the damaged folders to start over, or point resume_from at a good one."
        )
    return None


def _order_or_lowest(folder: Path) -> tuple:
    try:
        return (1, StoredState(folder, read_manifest(folder)).order)
    except CheckpointError:
        return (0, (folder.name,))


def prune_states(parent: Path, max_rolling: Optional[int], keep: Iterable[Path] = ()) -> list[Path]:
    """Delete the oldest ``rolling`` states beyond ``max_rolling``, and superseded ``best`` ones; return them.

    A state is deleted only when each of its kinds allows it: ``permanent`` states are never deleted, and
    only the newest ``best`` state is kept. States in ``keep`` are never deleted.
    """
    keep = {Path(path).resolve() for path in keep}
    states = list_complete_states(parent)
    rolling = [state for state in states if "rolling" in state.kinds]
    best = [state for state in states if "best" in state.kinds]
    surplus_rolling = set()
    if max_rolling is not None and len(rolling) > max_rolling:
        surplus_rolling = {state.folder for state in rolling[: len(rolling) - max_rolling]}
    superseded_best = {state.folder for state in best[:-1]}
    deleted = []
    for state in states:
        if state.folder.resolve() in keep or "permanent" in state.kinds:
            continue
        removable = (("rolling" not in state.kinds) or state.folder in surplus_rolling) and (
            ("best" not in state.kinds) or state.folder in superseded_best
        )
        if removable:
            _crash_point(f"prune:{state.folder.name}")
            shutil.rmtree(state.folder)
            deleted.append(state.folder)
    return deleted


def load_tensors_file(path: Path) -> Any:
    """Load a file written by :func:`save_tensors_file`, never unpickling arbitrary objects."""
    import pickle

    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as error:
        raise CheckpointError(f"{path}: holds objects that only pickle can rebuild; refused ({error}).") from error


def describe_changes(saved: dict, current: dict) -> list[str]:
    """List each run setting that differs between a saved state and the current run."""
    return [
        f"{name}: saved {saved.get(name)!r}, now {current.get(name)!r}"
        for name in sorted(current)
        if saved.get(name) != current.get(name)
    ]



# ------------------------------------------------------------------------------------------------
# A trainer's training state: what is written, and what a resume restores
# ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ResumePosition:
    """Where in a training run a state was taken, always between two optimizer updates.

    Attributes:
        loop_epoch: the index, in the run's range of epochs, of the epoch to continue.
        batches_seen: the micro-batches of that epoch already trained on (skipped by sampler offset on resume).
        rng_restore_point: ``"before_iterator"`` for a state taken between epochs, ``"after_iterator"`` for one
            taken inside an epoch: where the resumed run puts the saved RNG states back.
    """

    loop_epoch: int
    batches_seen: int
    rng_restore_point: str


@dataclass
class ResumePlan:
    """What a resumed run still has to apply as it reaches the saved position."""

    position: ResumePosition
    rng_state: dict
    train_loss_tracker: dict
    checkpoint_kwargs: dict
    folder: Path
    num_update_steps_completed: int = 0


def _fsync_file(path: Path) -> None:
    with open(path, "rb+") as handle:
        os.fsync(handle.fileno())


def _callback_states(callbacks: Iterable) -> dict:
    from pytorch_accel_trainer.checkpointing import validate_plain

    states = {}
    for callback in callbacks:
        if callable(getattr(callback, "state_dict", None)):
            state = callback.state_dict()
            validate_plain(state, f"{type(callback).__name__}.state_dict()")
            states[type(callback).__name__] = state
    return states


def write_training_state(
    trainer, parent: Path, position: ResumePosition, run_facts: dict, kinds: Iterable[str] = ("rolling",),
    checkpoint_kwargs: Optional[dict] = None, max_rolling: Optional[int] = None,
) -> Path:  # fmt: skip
    """Write the trainer's full training state under ``parent``; every process must call this.

    Under FSDP the weights and optimizer state are gathered whole to the main process first, so the state loads
    into any world size; under DeepSpeed it is refused (see ``sharded.validate_training_state_supported``).

    Returns:
        The folder of the new state.
    """
    from safetensors.torch import save_file, save_model

    from pytorch_accel_trainer.checkpointing import validate_plain
    from pytorch_accel_trainer.sharded import (
        get_full_model_state_dict,
        get_full_optimizer_state_dict,
        is_fsdp,
        validate_training_state_supported,
    )

    accelerator = trainer.accelerator
    validate_training_state_supported(accelerator)
    gathered_model = gathered_optimizer = None
    if is_fsdp(accelerator):  # collectives: every process takes part, the main process receives
        gathered_model = get_full_model_state_dict(accelerator, trainer.model)
        gathered_optimizer = get_full_optimizer_state_dict(accelerator, trainer.model, trainer.optimizer)
    parent = Path(parent)
    checkpoint_kwargs = dict(checkpoint_kwargs or {})
    validate_plain(checkpoint_kwargs, "checkpoint_kwargs")
    rank_state = {
        "rng": capture_rng_state(),
        "train_loss_tracker": trainer.run_state.train_loss_tracker.state_dict(),
        "callbacks": _callback_states(trainer.callback_handler),
    }
    final = unused_folder_name(parent, f"{STATE_PREFIX}{trainer.num_update_steps_completed:08d}")
    accelerator.wait_for_everyone()  # every process has chosen the same name before any folder appears
    if accelerator.is_main_process:
        parent.mkdir(parents=True, exist_ok=True)
        begin_save(final)
    accelerator.wait_for_everyone()
    temporary = temporary_folder(final)
    _crash_point(f"write:{rank_file(accelerator.process_index)}")
    save_tensors_file(rank_state, temporary / rank_file(accelerator.process_index))
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        _crash_point(f"write:{MODEL_FILE}")
        if gathered_model is None:
            save_model(trainer.get_model(), str(temporary / MODEL_FILE))
        else:
            own_storage = {name: tensor.contiguous().clone() for name, tensor in gathered_model.items()}
            save_file(own_storage, str(temporary / MODEL_FILE))
        _fsync_file(temporary / MODEL_FILE)
        _crash_point(f"write:{OPTIMIZER_FILE}")
        optimizer_state = trainer.optimizer.state_dict() if gathered_optimizer is None else gathered_optimizer
        save_tensors_file(optimizer_state, temporary / OPTIMIZER_FILE)
        if trainer.scheduler is not None:
            _crash_point(f"write:{SCHEDULER_FILE}")
            scheduler_state = trainer.scheduler.state_dict()
            validate_plain(scheduler_state, "scheduler.state_dict()")
            save_tensors_file(scheduler_state, temporary / SCHEDULER_FILE)
        if accelerator.scaler is not None:
            save_tensors_file(accelerator.scaler.state_dict(), temporary / SCALER_FILE)
        _crash_point(f"write:{TRAINER_FILE}")
        save_tensors_file(
            {
                "position": asdict(position),
                "num_update_steps_completed": trainer.num_update_steps_completed,
                "run_history": trainer.run_history.state_dict(),
                "run_facts": run_facts,
                "checkpoint_kwargs": checkpoint_kwargs,
            },
            temporary / TRAINER_FILE,
        )
        finish_save(
            temporary,
            final,
            {
                "num_update_steps_completed": trainer.num_update_steps_completed,
                "position": asdict(position),
                "world_size": accelerator.num_processes,
                "kinds": sorted(set(kinds)),
                "run_facts": run_facts,
            },
        )
        prune_states(parent, max_rolling, keep=[final])
    accelerator.wait_for_everyone()
    return final


def read_training_state(trainer, stored: StoredState, run_facts: Optional[dict], allow_changes: bool) -> ResumePlan:
    """Load a verified training state into ``trainer`` (weights, optimizer, scheduler, history, callbacks); the
    rest (position, counters, RNG states) is returned as a :class:`ResumePlan` for the run state.

    Args:
        run_facts: the current run's settings, compared with the saved ones; ``None`` skips the comparison.
        allow_changes: resume even when a setting differs.
    """
    from safetensors.torch import load_file, load_model

    from pytorch_accel_trainer.sharded import (
        is_fsdp,
        load_full_model_state_dict,
        load_full_optimizer_state_dict,
        validate_training_state_supported,
    )

    accelerator = trainer.accelerator
    validate_training_state_supported(accelerator)
    folder = stored.folder
    shared = load_tensors_file(folder / TRAINER_FILE)
    if run_facts is not None and not allow_changes:
        changes = describe_changes(shared["run_facts"], run_facts)
        if changes:
            listed = "\n  ".join(changes)
            raise CheckpointError(
                f"{folder} was saved by a run set up differently, so resuming would not continue it exactly:\n  {listed}\n"
                "Restore those settings, or pass allow_resume_changes=True to train() to resume anyway."
            )
    rank = trainer.accelerator.process_index
    if not (folder / rank_file(rank)).is_file():
        raise CheckpointError(f"{folder} holds no state for process {rank} (saved with {stored.manifest.get('world_size')} processes).")
    try:
        if is_fsdp(accelerator):  # every process reads the full state; each keeps its shard
            load_full_model_state_dict(accelerator, trainer.model, load_file(str(folder / MODEL_FILE)))
        else:
            load_model(trainer.get_model(), str(folder / MODEL_FILE), strict=True)
    except RuntimeError as error:
        raise CheckpointError(
            f"{folder / MODEL_FILE} does not fit this model ({error}); resume with the model the state was saved from."
        ) from error
    optimizer_state = load_tensors_file(folder / OPTIMIZER_FILE)
    load_full_optimizer_state_dict(accelerator, trainer.model, trainer.optimizer, optimizer_state)
    has_scheduler_file = (folder / SCHEDULER_FILE).is_file()
    if run_facts is None and trainer.scheduler is None:
        has_scheduler_file = False  # a manual load before train(): the scheduler does not exist yet
    elif has_scheduler_file != (trainer.scheduler is not None):
        raise CheckpointError(
            f"{folder} {'holds' if has_scheduler_file else 'has no'} scheduler state, but this run "
            f"{'has no' if has_scheduler_file else 'has a'} scheduler: pass the same create_scheduler_fn as the saved run."
        )
    if has_scheduler_file:
        trainer.scheduler.load_state_dict(load_tensors_file(folder / SCHEDULER_FILE))
    if (folder / SCALER_FILE).is_file() and trainer.accelerator.scaler is not None:
        trainer.accelerator.scaler.load_state_dict(load_tensors_file(folder / SCALER_FILE))
    trainer.run_history.load_state_dict(shared["run_history"])
    rank_state = load_tensors_file(folder / rank_file(rank))
    for callback in trainer.callback_handler:
        state = rank_state["callbacks"].get(type(callback).__name__)
        if state is not None and callable(getattr(callback, "load_state_dict", None)):
            callback.load_state_dict(state)
    return ResumePlan(
        position=ResumePosition(**shared["position"]),
        rng_state=rank_state["rng"],
        train_loss_tracker=rank_state["train_loss_tracker"],
        checkpoint_kwargs=shared["checkpoint_kwargs"],
        folder=folder,
        num_update_steps_completed=shared["num_update_steps_completed"],
    )
