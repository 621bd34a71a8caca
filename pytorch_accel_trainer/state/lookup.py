"""Which training state a resume continues: the lookup behind ``train(resume_from=...)`` and
``load_training_state``, beside the folder it reads (``folder.py``) and the store it may download from
(``storage.py``).

``resume_from`` may be one state's folder, a folder of states (the newest good one of the run saved last), a run
folder of the command line (its ``training_states``), or an object-storage URL of any of these. A folder that does not
exist, or an empty one, is a new run; a folder that holds files but no state is an error, never a new run. Every
process calls the lookup; the main process chooses, and a store's state is downloaded to each machine's mirror and
verified there. Knows nothing of the Trainer: it is given the processes (``content.Processes``).
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any, Iterable, Optional

from pytorch_accel_trainer.errors import CheckpointError
from pytorch_accel_trainer.state.files import (
    LATEST_NAME,
    MANIFEST_NAME,
    StoredState,
    is_real_directory,
    is_state_name,
    read_small_text,
    state_folders,
)
from pytorch_accel_trainer.state.folder import (
    StateFormatError,
    list_complete_states,
    load_trainer_file,
    read_manifest,
    verify_folder,
)
from pytorch_accel_trainer.state.parts import Processes
from pytorch_accel_trainer.state.storage import RemoteStates, as_location

#: Files of an Accelerate ``save_state`` folder, as pytorch-accelerated's training states are: not resumable here.
ACCELERATE_STATE_FILES = ("random_states_0.pkl", "optimizer.bin", "pytorch_model.bin", "model.safetensors")


#: The folder of a run folder that holds its training states (``<output_dir>/<run>/training_states``).
RUN_FOLDER_STATES = "training_states"


def find_state_to_resume(processes: Processes, location: Any) -> Optional[StoredState]:
    """``find_resumable_state`` for ``train(resume_from=location)`` (or, for an object-storage URL,
    :func:`find_remote_state`): ``None`` (start a new run) only for a folder that does not exist or is empty; a run
    folder means its ``training_states`` folder. Every process must call this.

    Raises:
        CheckpointError: ``location`` is a file, holds an Accelerate ``save_state`` (pytorch-accelerated's training
            states), or holds files but no training state: not a new run, but a wrong path.
    """
    location = as_location(location)
    if isinstance(location, str):
        return find_remote_state(processes, location)
    path = location
    if not path.exists():
        _refuse_a_missing_local_state(path)
        return None  # the auto-resume of a preemptible job's first start: the folder is made by its first save
    if path.is_dir() and _is_run_folder(path):
        return find_state_to_resume(processes, path / RUN_FOLDER_STATES)
    stored = find_resumable_state(path, processes)
    found = [name for name in ACCELERATE_STATE_FILES if (path / name).is_file()]
    if stored is None and not found:
        content = _visible_entries(path)
        if content:
            raise CheckpointError(
                f"resume_from={str(path)!r} holds {', '.join(content[:5])}{' ...' if len(content) > 5 else ''} but no "
                f"training state (no folder with a {MANIFEST_NAME}), so the run was not started over: pass the "
                "save_dir of SaveTrainingStateCallback, a run folder of the command line, or one state's folder; "
                "an absent or empty folder starts a new run."
            )
    if stored is None and found:
        raise CheckpointError(
            f"resume_from={str(path)!r} holds {found} but no training state of this trainer (no manifest.json), so "
            "the run was not restarted from scratch: an Accelerate save_state folder (pytorch-accelerated's training "
            "states) or a run folder cannot continue a run here. Load its weights (safetensors.torch.load_model(model, "
            "path)) and start a new run, or resume from a folder written by save_training_state / "
            "SaveTrainingStateCallback."
        )
    return stored


def _refuse_a_missing_local_state(path: Path) -> None:
    """Raise ``FileNotFoundError`` when ``path``, which does not exist, sits beside training states (a typo such as
    ``states/epoch_30`` where ``states/`` holds ``epoch_1``, ``epoch_2``; or a state pruned since) rather than start
    the run over: a folder of states holds states, not another folder of them to be made."""
    parent = path.parent
    if not parent.is_dir():
        return
    names = sorted(state.folder.name for state in list_complete_states(parent))
    if names:
        raise FileNotFoundError(
            f"resume_from={str(path)!r} does not exist, but {str(parent)!r} holds the training states {names}: pass "
            f"one of those, or {str(parent)!r} for the newest. The run was not started over."
        )


def _visible_entries(folder: Path) -> list[str]:
    """What ``folder`` holds, but for what a killed first save may leave (``latest``, hidden temporaries)."""
    return sorted(
        entry.name for entry in folder.iterdir() if entry.name != LATEST_NAME and not entry.name.startswith(".")
    )


def _is_run_folder(folder: Path) -> bool:
    """Whether ``folder`` is a run folder with a states folder, and no training state of its own."""
    return (
        is_real_directory(folder / RUN_FOLDER_STATES)
        and not os.path.lexists(folder / MANIFEST_NAME)
        and not any(is_state_name(entry.name) for entry in folder.iterdir())
    )


def find_remote_state(processes: Processes, url: str) -> Optional[StoredState]:
    """The training state to resume from the store folder ``url`` (or the one state at ``url``), downloaded to each
    node's mirror and verified there; ``None`` while the store holds none (a URL cannot be told apart from an empty
    folder). The main process chooses the newest complete state (a damaged one is skipped with a warning, as in a
    local folder); every process must call this.

    Raises:
        CheckpointError: the store holds states and none of them checks out.
    """
    remote, only = RemoteStates(url), None
    if remote.fs.isfile(f"{remote.root}/{MANIFEST_NAME}"):  # the URL of one state: its folder of states
        parent, only = url.rsplit("/", 1)
        remote = RemoteStates(parent)
    elif _is_remote_run_folder(remote):
        return find_remote_state(processes, f"{url}/{RUN_FOLDER_STATES}")
    chosen: tuple = (None, None)
    failure: Optional[Exception] = None
    if processes.is_main:
        try:
            remote.sync_mirror()
            chosen = (_download_newest(remote, only), None)
        except (CheckpointError, OSError) as error:  # every process raises it, none waits for the main one
            failure, chosen = error, (None, f"{type(error).__name__}: {error}")
    name, message = processes.broadcast(chosen)
    if failure is not None:
        raise failure
    if message is not None:
        raise CheckpointError(f"resume_from={url!r}: the main process could not read the state to resume ({message}).")
    if name is None:
        _refuse_a_missing_state(url)
        _refuse_a_folder_without_states(remote, url)
        return None
    folder = remote.mirror / name
    if processes.is_local_main and not processes.is_main:  # another node: its own mirror
        remote.sync_mirror()
        remote.download(name, read_manifest(folder)["files"])
        verify_folder(folder)
    processes.barrier()
    return StoredState(folder, read_manifest(folder), url=f"{remote.url}/{name}")


def _refuse_a_missing_state(url: str) -> None:
    """Raise ``FileNotFoundError`` when ``url``, which holds nothing, names a state beside others (a typo, or a state
    pruned since), rather than start the run over; a store cannot tell an empty folder from a missing one."""
    parent, name = url.rsplit("/", 1)
    if "://" not in parent or parent.endswith(":/"):
        return
    remote = RemoteStates(parent)
    complete, _ = remote.remote_names()
    if complete:
        raise FileNotFoundError(
            f"resume_from={url!r} holds no training state, but {parent!r} holds {sorted(complete)}: pass one of "
            f"those, or {parent!r} for the newest."
        )


def _is_remote_run_folder(remote: RemoteStates) -> bool:
    """Whether the store folder of ``remote`` is a run folder of the command line: it has a ``training_states``
    folder and no training state of its own (as :func:`_is_run_folder` on a disk)."""
    complete, taken = remote.remote_names()
    return RUN_FOLDER_STATES in taken and not complete and not any(is_state_name(name) for name in taken)


def _refuse_a_folder_without_states(remote: RemoteStates, url: str) -> None:
    """Raise ``CheckpointError`` when the store folder ``url`` holds objects but no training state, as for a local
    folder: a wrong URL, not a new run. What a first save cut short leaves (a state's folder without its manifest,
    ``latest``) is a new run's, as a missing folder is."""
    remote.fs.invalidate_cache(remote.root)
    try:
        entries = remote.fs.ls(remote.root, detail=False)
    except FileNotFoundError:
        return
    names = sorted(Path(str(entry)).name for entry in entries)
    content = [name for name in names if name != LATEST_NAME and not is_state_name(name) and not name.startswith(".")]
    if content:
        raise CheckpointError(
            f"resume_from={url!r} holds {', '.join(content[:5])}{' ...' if len(content) > 5 else ''} but no training "
            f"state (no folder with a {MANIFEST_NAME}), so the run was not started over: pass the save_dir of "
            "SaveTrainingStateCallback, a run folder of the command line, or one state's URL; a URL under which "
            "nothing is stored starts a new run."
        )


def _download_newest(remote: RemoteStates, only: Optional[str]) -> Optional[str]:
    """Download and verify the newest complete state of ``remote`` (or the state ``only``); return its name."""
    problems = []
    for listed in reversed(list_complete_states(remote.mirror)):
        name = listed.folder.name
        if only is not None and name != only:
            continue
        remote.download(name, listed.manifest["files"])
        try:
            verify_folder(listed.folder)
        except CheckpointError as error:
            problems.append(error)
            remote.drop_downloads(name)
            continue
        report_skipped_states(remote.url, f"{remote.url}/{name}", problems)
        return name
    report_skipped_states(remote.url, None, problems)
    return None


# ------------------------------------------------------------------------------------------------
# A local folder of states: the newest good one of the run saved last
# ------------------------------------------------------------------------------------------------


def find_resumable_state(path: Path, processes: Optional[Processes] = None) -> Optional[StoredState]:
    """Return the training state to resume from ``path``, or ``None`` for a folder with none yet.

    ``path`` is one training state (a folder with a manifest) or a folder of them, of which the newest
    complete one of one run is used: the run of the state saved last (named by ``latest``); the states of other runs
    are left alone, with a warning naming them. The states that cannot be used are skipped, each with a warning
    naming it and why (damaged, or of another format version): those newer than it, and those whose manifest cannot
    be read (so whose place in the run is unknown: a state of another format is one), or that are links. A state
    whose trainer file disagrees with its manifest (an edited manifest) is a damaged one.

    With ``processes`` (every one of which must call this), each state is verified by them together, each hashing
    its share of the files (:func:`verify_folder`).

    Raises:
        FileNotFoundError: ``path`` does not exist.
        StateFormatError: ``path`` is one training state, of another format version than the one read.
        CheckpointError: ``path`` is a file (e.g. an export checkpoint), or it holds training states but none
            of them checks out.
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(
            f"resume_from={str(path)!r} does not exist: pass a training-state folder or a folder of them "
            "(e.g. the save_dir of SaveTrainingStateCallback)."
        )
    if not path.is_dir():
        raise CheckpointError(
            f"resume_from={str(path)!r} is a file, not a training-state folder. A file written by save_checkpoint is "
            "an export checkpoint (weights, optimizer, scheduler; no position or RNG states), which cannot continue "
            "a run: load it with trainer.load_checkpoint(path) before train() to start from its weights. resume_from "
            "needs a training-state folder, or a folder of them (written by save_training_state or "
            "SaveTrainingStateCallback)."
        )
    if os.path.lexists(path / MANIFEST_NAME):
        return verify_folder(path, processes)
    readable = {folder: _readable_state(folder) for folder in state_folders(path)}
    run_id = _run_to_resume(path, [state for state in readable.values() if state is not None])
    other_runs = [state for state in readable.values() if state is not None and state.run_id != run_id]
    problems, stored = [], None
    for folder in sorted(readable, key=lambda folder: _order_or_lowest(readable[folder]), reverse=True):
        # newest first; then those whose manifest is unreadable (so whose run and place are unknown)
        known = readable[folder]
        if known is not None and (known.run_id != run_id or stored is not None):
            continue  # another run's, or older than the state chosen: left alone
        try:
            candidate = _verify_state_in(folder, processes)
        except CheckpointError as error:
            problems.append(error)
            continue
        stored = stored or candidate
    report_skipped_states(path, None if stored is None else stored.folder, problems)
    if stored is not None and other_runs:
        warnings.warn(
            f"{path} also holds the states of other runs ({describe_runs(other_runs)}); they were left alone: "
            f"resuming from {stored.folder}, the newest good state of the run saved last.",
            stacklevel=2,
        )
    return stored


def _verify_state_in(folder: Path, processes: Optional[Processes] = None) -> StoredState:
    """A state of a folder of states, verified down to its trainer file (whose position must be the manifest's: an
    edited manifest must not make an older state look like the newest, and then stop the resume)."""
    if not is_real_directory(folder):
        raise CheckpointError(f"{folder}: a symbolic link; states are read only from folders inside {folder.parent}.")
    stored = verify_folder(folder, processes)
    load_trainer_file(stored)
    return stored


def _readable_state(folder: Path) -> Optional[StoredState]:
    """The state in ``folder`` with its manifest (files not hashed), or ``None`` when its manifest cannot be read."""
    try:
        if is_real_directory(folder):
            return StoredState(folder, read_manifest(folder))
    except CheckpointError:
        pass
    return None


def _written_at(state: StoredState) -> int:
    try:
        return os.stat(state.folder / MANIFEST_NAME, follow_symlinks=False).st_mtime_ns
    except OSError:
        return 0


def _run_to_resume(parent: Path, states: list[StoredState]) -> Optional[str]:
    """The run whose states a resume from ``parent`` continues: the run of the state ``latest`` names (the last one
    saved), else that of the state written last; ``None`` when there is no state."""
    if not states:
        return None
    try:
        latest = read_small_text(parent / LATEST_NAME, 4096).strip()
    except (OSError, ValueError):  # absent, a link, damaged: the states' own times decide
        latest = None
    for state in states:
        if state.folder.name == latest:
            return state.run_id
    return max(states, key=_written_at).run_id


def report_skipped_states(location: Any, chosen: Any, problems: list) -> None:
    """Warn about each state of ``location`` skipped for the state ``chosen`` (``problems``: why each was); when
    none was chosen but some were skipped, raise :class:`CheckpointError` listing them rather than start over."""
    if chosen is not None:
        for problem in problems:
            damaged = not isinstance(problem, StateFormatError)
            kind = "damaged training state" if damaged else "training state of another format"
            warnings.warn(f"Skipped a {kind} (resuming from {chosen}): {problem}", stacklevel=3)
    elif problems:
        listed = "\n  ".join(map(str, problems))
        raise CheckpointError(
            f"{location} holds {len(problems)} training state(s) and none can be resumed, so the run was not "
            f"restarted from scratch:\n  {listed}\nMove those folders away to start over, or point resume_from at a "
            "good one."
        )


def describe_runs(states: Iterable[StoredState]) -> str:
    """``'epoch_1, final (run 3f2a...); checkpoint-8 (run 9c1d...)'``: the states, grouped by run."""
    by_run: dict[Optional[str], list[str]] = {}
    for state in states:
        by_run.setdefault(state.run_id, []).append(state.folder.name)
    return "; ".join(
        f"{', '.join(names[:4])}{f' and {len(names) - 4} more' if len(names) > 4 else ''} (run {run})"
        for run, names in by_run.items()
    )


def _order_or_lowest(state: Optional[StoredState]) -> tuple:
    return (0, ()) if state is None else (1, state.order)
