"""One training state's folder: written crash-safely, verified by its manifest, read back, pruned.

A training state is written to a temporary folder by every process at once, each its own files (the model's and
optimizers' state in one file when one process writes it, else its shard of the tensors through
``torch.distributed.checkpoint``; and its own plain values: ``parts.py``), flushed, given a manifest by the main process
(format version, position, world size, the layout of the sharded parts, every file of every process with its size and
XXH3-128 checksum, computed by its writer as it wrote it) and only then renamed into place; ``latest`` is updated after
that, and old states are pruned last. A crash at any point leaves either the previous states or the new one, never a
folder that loads with wrong or mixed contents: a loader trusts only a folder whose manifest checks out, and names the
file that does not. A temporary folder left by a killed save is removed by a later save once its writer is gone.

A state is input, and is read as such (``files.py``): the manifest's fields are checked for type and range, its file
names never leave the folder, no file is read through a symbolic link. Everything is read back without arbitrary
pickle: DCP's shards through ``shards.py`` (DCP's metadata rebuilt from its own classes only), every torch file with
``torch.load(weights_only=True)``. One format is read, the one written (:data:`~pytorch_accel_trainer.state.files.
FORMAT_VERSION`); a state of any other is refused with :class:`StateFormatError` before anything is loaded.
"""

from __future__ import annotations

import json
import os
import shutil
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Iterable, Optional

from pytorch_accel_trainer.errors import CheckpointError
from pytorch_accel_trainer.state import files as state_files
from pytorch_accel_trainer.state import parts as state_parts
from pytorch_accel_trainer.state.claims import keep_claim, release_claims
from pytorch_accel_trainer.state.files import (
    CHECKSUM,
    FORMAT_VERSION,
    LATEST_NAME,
    MANIFEST_NAME,
    ONE_FILE,
    PARTS_FILE,
    TEMPORARY_PREFIX,
    TRAINER_FILE,
    WRITER_MARKER_PREFIX,
    DamagedStateError,
    StoredState,
    file_digest,
    folder_writer,
    fsync_path,
    is_abandoned,
    is_real_directory,
    read_small_text,
    reporting_out_of_space,
    state_folders,
    temporary_folder,
    unused_folder_name,
    validate_manifest,
    write_text_atomically,
    writer_tag,
)
from pytorch_accel_trainer.state.parts import Processes, StateContent, agreed, load_tensors_file, write_content


class StateFormatError(CheckpointError):
    """A training state of another format version than the one this version reads (:data:`~pytorch_accel_trainer.
    state.files.FORMAT_VERSION`). Raised before anything is loaded."""


# ------------------------------------------------------------------------------------------------
# Writing
# ------------------------------------------------------------------------------------------------


def _is_abandoned_folder(temporary: Path) -> Optional[bool]:
    """Whether the writer of a temporary state folder is gone; ``None`` when no marker says who wrote it.

    This process's own temporary is abandoned too: saves are collective, one at a time, so none is under way.
    """
    writer = folder_writer(temporary)
    if writer is None:
        return None
    host, pid = writer
    return pid == os.getpid() or is_abandoned(host, pid)


def remove_abandoned_temporaries(parent: Path) -> list[Path]:
    """Delete the temporary state folders in ``parent`` whose writer (named by its marker) is gone; return them.

    A folder without a marker (its writer was killed between creating it and marking it) is left: nothing tells
    that its writer is gone; :func:`begin_save` removes it when the same state is saved again.
    """
    removed = []
    try:
        for path in parent.iterdir():
            if path.name.startswith(TEMPORARY_PREFIX) and is_real_directory(path):
                if _is_abandoned_folder(path):
                    shutil.rmtree(path, ignore_errors=True)
                    removed.append(path)
    except OSError:
        pass  # tidying up never fails a save: what is left is removed by a later one
    return removed


def begin_save(final_folder: Path) -> Path:
    """Create an empty temporary folder for ``final_folder``, marked with its writer (main process only), and
    return it; the temporaries of killed saves are removed first, a live writer's never.

    Raises:
        CheckpointError: a live process is writing the same state (two runs save into one folder).
    """
    remove_abandoned_temporaries(final_folder.parent)
    temporary = temporary_folder(final_folder)
    if is_real_directory(temporary):  # left by a killed save, or a live writer's
        if _is_abandoned_folder(temporary) is False:
            raise CheckpointError(
                f"{temporary} is being written by another live process: two runs save training states into "
                f"{final_folder.parent}. Give each run its own save_dir."
            )
        shutil.rmtree(temporary)
    elif os.path.lexists(temporary):
        os.unlink(temporary)  # a file or a link under the temporary's name: never followed
    temporary.mkdir(parents=True)
    (temporary / f"{WRITER_MARKER_PREFIX}{writer_tag()}").touch()
    return temporary


def finish_save(
    temporary: Path,
    final_folder: Path,
    manifest_fields: dict,
    checksums: Optional[dict] = None,
    elsewhere: Optional[dict] = None,
) -> None:
    """Seal a fully written temporary folder: manifest, rename into place, then ``latest`` (main process only).

    ``checksums`` maps the files whose size and checksum were computed as they were written (by every process) to
    them; a file of the folder not among them is read back once, from the page cache.
    ``elsewhere`` maps the files of the state that other machines write (to a store) to their size and checksum:
    listed in the manifest, not in this folder."""
    checksums, files = dict(checksums or {}), {}
    for name, (size, digest) in (elsewhere or {}).items():
        files[name] = {"size": size, CHECKSUM: digest}
    for path in sorted(temporary.iterdir()):
        if path.name.startswith(WRITER_MARKER_PREFIX):
            continue
        state_files.crash_point(f"hash:{path.name}")
        size, digest = checksums.get(path.name) or file_digest(path)
        files[path.name] = {"size": size, CHECKSUM: digest}
    manifest = {"format_version": FORMAT_VERSION, **manifest_fields, "files": files}
    state_files.crash_point("manifest")
    write_text_atomically(temporary / MANIFEST_NAME, json.dumps(manifest, indent=2, sort_keys=True))
    fsync_path(temporary)
    state_files.crash_point("rename")
    os.rename(temporary, final_folder)
    for marker in final_folder.glob(f"{WRITER_MARKER_PREFIX}*"):
        marker.unlink(missing_ok=True)  # left by a crash here, it is harmless: not in the manifest
    fsync_path(final_folder.parent)
    state_files.crash_point("latest")
    write_text_atomically(final_folder.parent / LATEST_NAME, final_folder.name + "\n")


def write_training_state(
    parent: Path,
    content: StateContent,
    fields: dict,
    processes: Processes,
    name: str,
    max_rolling: Optional[int] = None,
    node_local: bool = False,
) -> Path:
    """Write ``content`` as a new training state under ``parent`` (as ``name``; ``-2``... when taken) with the
    manifest ``fields``; every process of ``processes`` must call this, and each writes its own part in parallel
    (``parts.py``): no process gathers the others' tensors.

    The protocol: the main process makes the temporary folder; every process writes its files into it, each
    checksummed as written; the checksums reach the main process, which writes the manifest last, renames the folder
    into place, updates ``latest`` and prunes. A crash anywhere leaves the earlier states and no state that looks
    complete.

    ``node_local``: ``parent`` is a folder of each machine, not shared (the mirror of a store): each machine writes
    its processes' files into its own temporary folder, and the manifest lists the other machines' files by the size
    and checksum their processes report (they upload them; ``state/storage.py``).

    Returns:
        The folder of the new state.
    """
    # the main process chooses the name; each machine's folder is under its own parent (a mirror is per machine)
    final = parent / processes.broadcast(unused_folder_name(parent, name).name if processes.is_main else None)
    run_id = None if node_local else fields.get("run_id")  # a store's mirror has no claim: its prefix is the run's
    # every process learns whether the main process may write there (its claim: claims.py), and none waits for it
    (main_claimed_for_this_save, *_) = agreed(
        processes, lambda: _begin(parent, final, processes, node_local, run_id), f"the training state {final.name}"
    )
    temporary = temporary_folder(final)
    # looked up in its module: a test writes a sharded state on one process
    layout = state_parts.layout_of(processes, content)
    problem: Optional[Exception] = None
    try:
        with reporting_out_of_space(
            temporary, final, "the training state", f"the earlier states in {parent} are unchanged"
        ):
            reports = agreed(
                processes,
                lambda: write_content(content, temporary, processes, layout),
                f"its part of the training state {final.name}",
            )
            if processes.is_main:
                files = {file: pair for report in reports for file, pair in report.items()}
                here = {file: pair for file, pair in files.items() if (temporary / file).is_file()}
                elsewhere = {file: pair for file, pair in files.items() if file not in here}
                manifest_fields = {**fields, "world_size": processes.count, "layout": layout}
                _seal(temporary, final, manifest_fields, here, elsewhere, run_id)
                if max_rolling is not None or "best" in fields.get("kinds", ()):  # else no state became surplus
                    prune_states(parent, max_rolling, keep=[final], run_id=fields.get("run_id"))
    except Exception as error:
        problem = error
    finally:
        if processes.is_main and main_claimed_for_this_save:
            release_claims([parent])
    # every process learns whether the main process sealed the state: none waits for one that failed
    sealing = processes.broadcast(None if problem is None else _describe(problem))
    if problem is not None:
        raise problem
    if sealing is not None:
        raise CheckpointError(
            f"The main process could not finish the training state {final.name} ({sealing}); the earlier states in "
            f"{parent} are unchanged."
        )
    return final


def _begin(parent: Path, final: Path, processes: Processes, node_local: bool, run_id: Optional[str]) -> bool:
    """Make the temporary folder of ``final`` (the main process, and under ``node_local`` each machine's), once the
    main process has checked that it still holds the claim of ``parent`` for the run ``run_id`` (``None``: no claim);
    return whether the folder was claimed for this save alone (:func:`~pytorch_accel_trainer.state.claims.
    keep_claim`)."""
    claimed_for_this_save = False
    if processes.is_main or (node_local and processes.is_local_main):
        parent.mkdir(parents=True, exist_ok=True)
        if processes.is_main and run_id is not None:
            claimed_for_this_save = keep_claim(parent, run_id, final.name)
        try:
            begin_save(final)
        except BaseException:
            if claimed_for_this_save:
                release_claims([parent])
            raise
    return claimed_for_this_save


def _seal(temporary: Path, final: Path, fields: dict, here: dict, elsewhere: dict, run_id: Optional[str]) -> None:
    """:func:`finish_save`; a rename that fails because another job took the folder over (its state of the same
    name, its ``latest``) is that job's ``CheckpointError``, not a raw ``OSError``."""
    try:
        finish_save(temporary, final, fields, here, elsewhere)
    except OSError:
        if run_id is not None:
            keep_claim(final.parent, run_id, final.name)  # raises when the claim was taken over
        raise


def _describe(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"


# ------------------------------------------------------------------------------------------------
# Reading and verifying
# ------------------------------------------------------------------------------------------------


def read_manifest(folder: Path) -> dict:
    """Return the manifest of ``folder``, or raise :class:`CheckpointError` naming what is wrong.

    Raises:
        StateFormatError: the state is of another format version than :data:`FORMAT_VERSION` (the one read).
        CheckpointError: there is no manifest, or it is damaged.
    """
    path = folder / MANIFEST_NAME
    try:
        manifest = json.loads(read_small_text(path))
    except FileNotFoundError as error:
        raise CheckpointError(f"{folder}: no {MANIFEST_NAME}, so it is not a complete training state.") from error
    except DamagedStateError as error:
        raise CheckpointError(f"{error}: a damaged manifest.") from error
    except (OSError, ValueError, RecursionError) as error:
        raise CheckpointError(f"{path}: damaged manifest ({error}).") from error
    if not isinstance(manifest, dict):
        raise CheckpointError(f"{path}: damaged manifest: a JSON {type(manifest).__name__}, not an object.")
    _validate_format_version(folder, manifest.get("format_version"))
    try:
        validate_manifest(manifest)
    except DamagedStateError as error:
        raise CheckpointError(f"{path}: damaged manifest: {error}.") from error
    return manifest


def _validate_format_version(folder: Path, version: Any) -> None:
    """Refuse a state whose manifest names another format version than the one this version reads."""
    if type(version) is not int or version < 1:  # True is no version either
        raise CheckpointError(
            f"{folder / MANIFEST_NAME}: damaged manifest: format_version is {version!r}; it must be {FORMAT_VERSION}."
        )
    if version != FORMAT_VERSION:
        raise StateFormatError(
            f"{folder} is a training state of format version {version}; this version of pytorch_accel_trainer reads "
            f"format version {FORMAT_VERSION} only. Resume it with the version that wrote it, or start the run again "
            "without it (move the folder away, or pass another resume_from). Nothing was loaded from it."
        )


def verify_folder(folder: Path, processes: Optional[Processes] = None, read_parts: bool = False) -> StoredState:
    """Check every file of a training state against its manifest (size, then XXH3-128), never through a link; the
    files are hashed at once (the largest on the calling thread, the others on threads: xxhash releases the GIL),
    each mapped in memory a window at a time. With
    ``processes`` (every one of which must call this), each process hashes its share of the files (the largest
    first, dealt out in turn: under FSDP each its own shard) and the verdicts are gathered, so that every process
    raises the same error, or none.

    With ``read_parts`` (a state about to be loaded), a one-file state's parts file, when this process hashes it, is
    read into memory as it is hashed (:func:`~pytorch_accel_trainer.state.parts.read_parts_file_hashed`) and kept
    on the returned state (``parts``) for its load: the file is read once, and what is loaded is what was verified.

    Raises:
        StateFormatError: the state is of another format version than the one read.
        CheckpointError: naming the file that is missing, truncated, altered, or a link (the first in name order).
    """
    manifest = read_manifest(folder)
    files = manifest["files"]
    names = sorted(files, key=lambda name: (-files[name]["size"], name))
    if processes is not None and processes.count > 1:
        names = names[processes.rank :: processes.count]
    problem, read = None, {}

    def size_and_digest(name: str) -> tuple[int, str]:
        if read_parts and name == PARTS_FILE and manifest["layout"] == ONE_FILE:
            size, digest, read[name] = state_parts.read_parts_file_hashed(folder / name, files[name]["size"])
            return size, digest
        return file_digest(folder / name, files[name]["size"])

    with ThreadPoolExecutor(max_workers=min(32, os.cpu_count() or 1)) as pool:
        checks = {name: pool.submit(size_and_digest, name) for name in names[1:]}
        if names:  # the largest on this thread, while the pool hashes the others: no wait for a thread to wake
            checks[names[0]] = _run_now(size_and_digest, names[0])
        for name, check in sorted(checks.items()):  # in name order: the first damaged file is named
            try:
                _check_file(folder / name, files[name], check)
            except CheckpointError as error:
                problem = (name, str(error))
                break
    if processes is not None and processes.count > 1:
        problem = min((found for found in processes.all_gather(problem) if found is not None), default=None)
    if problem is not None:
        raise CheckpointError(problem[1])
    return StoredState(folder, manifest, parts=read.get(PARTS_FILE))


def _run_now(function, *arguments) -> Future:
    """``function(*arguments)`` run on this thread, as a completed future (its result, or its error)."""
    future: Future = Future()
    try:
        future.set_result(function(*arguments))
    except Exception as error:
        future.set_exception(error)
    return future


def _check_file(path: Path, expected: dict, check: Future) -> None:
    """Raise :class:`CheckpointError` when ``path`` does not match its manifest entry (its name is a plain one:
    read_manifest refused others); ``check`` is the future of its size and digest."""
    try:
        size, digest = check.result()
    except FileNotFoundError as error:
        raise CheckpointError(f"{path}: missing, although the manifest lists it.") from error
    except DamagedStateError as error:
        raise CheckpointError(f"{error}: the state is damaged or was altered.") from error
    except OSError as error:
        raise CheckpointError(f"{path}: cannot be read ({error.strerror}).") from error
    if size != expected["size"]:
        raise CheckpointError(f"{path}: {size} bytes, but the manifest says {expected['size']} (truncated or altered).")
    if digest != expected[CHECKSUM]:
        raise CheckpointError(f"{path}: its XXH3-128 does not match the manifest (the file is corrupted or altered).")


def list_complete_states(parent: Path) -> list[StoredState]:
    """Every training state under ``parent`` whose manifest is readable, oldest first (files not hashed; links to
    folders are left out: a state is read, and pruned, only inside ``parent``)."""
    states = []
    for folder in state_folders(parent):
        try:
            if is_real_directory(folder):
                states.append(StoredState(folder, read_manifest(folder)))
        except CheckpointError:
            continue
    return sorted(states, key=lambda state: state.order)


def load_trainer_file(stored: StoredState) -> dict:
    """The shared part of a state (``trainer_state.pt``), checked against the manifest it was verified by."""
    path = stored.folder / TRAINER_FILE
    shared = load_tensors_file(path)
    fields = (
        "position",
        "num_update_steps_completed",
        "run_history",
        "run_facts",
        "checkpoint_kwargs",
        "optimizer_class",
    )
    if not isinstance(shared, dict) or any(name not in shared for name in fields):
        raise CheckpointError(f"{path}: not a trainer state (it must hold {', '.join(fields)}); it was altered.")
    if (shared["position"], shared["num_update_steps_completed"]) != (
        stored.manifest["position"],
        stored.manifest["num_update_steps_completed"],
    ) or not (
        isinstance(shared["run_facts"], dict)
        and isinstance(shared["checkpoint_kwargs"], dict)
        and isinstance(shared["optimizer_class"], str)
    ):
        raise CheckpointError(
            f"{path}: its position, update count or settings disagree with {MANIFEST_NAME}; it was altered."
        )
    world_size = stored.manifest["world_size"]
    if shared["run_facts"].get("world_size", world_size) != world_size:  # a save outside train() records none
        raise CheckpointError(
            f"{path}: saved by {shared['run_facts']['world_size']!r} process(es), but {MANIFEST_NAME} says "
            f"{world_size!r}; it was altered."
        )
    return shared


def history_epoch(shared: dict, path: Path) -> int:
    """The run history's epoch of the saved position, checked."""
    epoch = shared.get("history_epoch")
    if type(epoch) is not int or epoch < 1:
        raise CheckpointError(f"{path}: history_epoch is {epoch!r}, not an epoch counted from 1; it was altered.")
    return epoch


# ------------------------------------------------------------------------------------------------
# Pruning
# ------------------------------------------------------------------------------------------------


def prune_states(
    parent: Path, max_rolling: Optional[int], keep: Iterable[Path] = (), run_id: Optional[str] = None
) -> list[Path]:
    """Delete the oldest ``rolling`` states beyond ``max_rolling``, and superseded ``best`` ones; return them.

    A state is deleted only when each of its kinds allows it: ``permanent`` states are never deleted, and
    only the newest ``best`` state is kept. States in ``keep`` are never deleted, nor is anything through a link.
    With ``run_id``, only that run's states are counted and deleted: another run's is never touched. Pruning never
    ends a run: a folder that cannot be deleted is left in place with a warning naming it. A save prunes only when a
    state may have become surplus: with ``max_rolling``, or as a new ``best`` state.
    """
    keep_names = {Path(path).name for path in keep}
    try:
        states = list_complete_states(parent)
    except OSError as error:
        warnings.warn(
            f"Could not list {parent} to prune its training states ({error}); none was deleted.", stacklevel=2
        )
        return []
    if run_id is not None:
        states = [state for state in states if state.run_id == run_id]
    rolling = [state for state in states if "rolling" in state.kinds]
    best = [state for state in states if "best" in state.kinds]
    surplus_rolling = set()
    if max_rolling is not None and len(rolling) > max_rolling:
        surplus_rolling = {state.folder for state in rolling[: len(rolling) - max_rolling]}
    superseded_best = {state.folder for state in best[:-1]}
    deleted = []
    for state in states:
        if state.folder.name in keep_names or "permanent" in state.kinds:
            continue
        removable = (("rolling" not in state.kinds) or state.folder in surplus_rolling) and (
            ("best" not in state.kinds) or state.folder in superseded_best
        )
        if removable:
            state_files.crash_point(f"prune:{state.folder.name}")
            try:
                shutil.rmtree(state.folder)  # refuses a link, and never follows one inside the folder
            except OSError as error:
                warnings.warn(
                    f"Could not prune the training state {state.folder} ({error}); it is left in place.", stacklevel=2
                )
                continue
            deleted.append(state.folder)
    return deleted
