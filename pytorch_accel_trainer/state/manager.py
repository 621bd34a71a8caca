"""The owner of a run's training states: :class:`TrainingStates` saves them, finds the one to resume, and prunes
them; the position a state was taken at (:class:`ResumePosition`) and what a resume still has to apply
(:class:`ResumePlan`); which run a folder of states belongs to (:func:`validate_save_dir`); and which state a resume
continues (:meth:`TrainingStates.find`, :func:`find_resumable_state`), the lookup behind ``train(resume_from=...)``
and ``load_training_state``.

Shaped like torchtitan's ``CheckpointManager``: it is given what it saves, never the Trainer: the processes that
save together (:class:`~pytorch_accel_trainer.state.parts.Processes`) and, at each save, a
:class:`~pytorch_accel_trainer.state.parts.StateContent` of ``Stateful`` parts (``state_dict()`` /
``load_state_dict()``) and plain values. Behind it: how one state's folder is written, verified and pruned
(``folder.py``: temporary folder, checksums, manifest last, rename, ``latest``), the save in the background
(``async_save.py``) and object storage (``storage.py``: a node-local mirror, uploaded manifest last).

``resume_from`` may be one state's folder, a folder of states (the newest good one of the run saved last), a run
folder of the command line (its ``training_states``), or an object-storage URL of any of these. A folder that does not
exist, or an empty one, is a new run; a folder that holds files but no state is an error, never a new run. Every
process calls the lookup; the main process chooses, and a store's state is downloaded to each machine's mirror and
verified there.
"""

from __future__ import annotations

import os
import sys
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Optional

from pytorch_accel_trainer.errors import CheckpointError
from pytorch_accel_trainer.state import async_save
from pytorch_accel_trainer.state.claims import take_claim
from pytorch_accel_trainer.state.deepspeed_engine import warn_background_save_is_synchronous
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
    write_training_state,
)
from pytorch_accel_trainer.state.parts import Processes, StateContent
from pytorch_accel_trainer.state.storage import (
    Location,
    RemoteStates,
    as_location,
    is_url,
    join,
    validate_store_reaches_every_process,
)


class TrainingStates:
    """The training states of the run of ``processes``: :meth:`save`, :meth:`find`, :meth:`wait`, pruned as each
    save asks (``max_rolling``). Every process of ``processes`` calls each method.

    Example::

        states = TrainingStates(Processes.of_accelerator(accelerator))
        folder = states.save("runs/states", content, fields, name="checkpoint-120", max_rolling=3)
        stored = states.find("runs/states")  # the newest good state of the run saved last
    """

    def __init__(self, processes: Processes):
        self.processes = processes

    def save(
        self,
        parent: Location,
        content: StateContent,
        fields: dict,
        name: str,
        max_rolling: Optional[int] = None,
        asynchronous: bool = False,
    ) -> Location:
        """Write ``content`` as a new state ``name`` under ``parent`` (``-2``, ``-3``... when taken) with the manifest
        ``fields``, then prune the oldest rolling states of its run beyond ``max_rolling``; return its folder (its
        URL in a store).

        A save under way in the background is waited for first (its error raised here). With ``asynchronous`` the
        tensors are copied to host memory and the state is written on a background thread; the folder it will have
        is returned (a content with an ``engine``, DeepSpeed's, is written at once, warned once). Under an
        object-storage URL the state is written to each machine's mirror and uploaded, its manifest last.
        """
        async_save.saver.wait()
        remote = self._remote_for_saving(parent) if isinstance(parent, str) else None
        local_parent = Path(parent) if remote is None else remote.mirror
        if asynchronous and content.engine is not None:
            warn_background_save_is_synchronous()  # DeepSpeed's engine writes its own files, on this thread
        if asynchronous and content.engine is None:
            folder = async_save.save_in_background(
                local_parent, content, fields, self.processes, name, max_rolling, remote
            )
        else:
            folder = write_training_state(
                local_parent, content, fields, self.processes, name, max_rolling, remote is not None
            )
            if remote is not None:
                remote.publish_collectively(folder, self.processes)
        return folder if remote is None else join(parent, folder.name)

    def _remote_for_saving(self, url: str) -> RemoteStates:
        """The store folder ``url``, its mirror synchronised on each machine."""
        validate_store_reaches_every_process(url, self.processes.count, "save_training_state")
        remote = RemoteStates(url)
        if self.processes.is_local_main:
            remote.sync_mirror()
        self.processes.barrier()
        return remote

    def find(self, location: Any) -> Optional[StoredState]:
        """The state to resume from ``location`` (one state, a folder of them, a run folder, or a URL of one of
        these), verified: :func:`find_resumable_state` (a one-file state's parts read as they are verified, for its
        load), or for an object-storage URL :func:`find_remote_state`; ``None`` (start a new run) only for a folder
        that does not exist or is empty; a run folder means its ``training_states`` folder. Every process must call
        this.

        Raises:
            CheckpointError: ``location`` is a file, holds an Accelerate ``save_state`` (pytorch-accelerated's
                training states), or holds files but no training state: not a new run, but a wrong path.
        """
        location = as_location(location)
        if isinstance(location, str):
            return find_remote_state(self.processes, location)
        path = location
        if not path.exists():
            _refuse_a_missing_local_state(path)
            return None  # the auto-resume of a preemptible job's first start: the folder is made by its first save
        if path.is_dir() and is_run_folder(path):
            return self.find(path / RUN_FOLDER_STATES)
        stored = find_resumable_state(path, self.processes, read_parts=True)  # to be loaded: read as verified
        found = [name for name in ACCELERATE_STATE_FILES if (path / name).is_file()]
        if stored is None and not found:
            content = _visible_entries(path)
            if content:
                raise CheckpointError(
                    f"resume_from={str(path)!r} holds {', '.join(content[:5])}{' ...' if len(content) > 5 else ''} "
                    f"but no training state (no folder with a {MANIFEST_NAME}), so the run was not started over: pass "
                    "the save_dir of SaveTrainingStateCallback, a run folder of the command line, or one state's "
                    "folder; an absent or empty folder starts a new run."
                )
        if stored is None and found:
            raise CheckpointError(
                f"resume_from={str(path)!r} holds {found} but no training state of this trainer (no manifest.json), "
                "so the run was not restarted from scratch: an Accelerate save_state folder (pytorch-accelerated's "
                "training states) or a run folder cannot continue a run here. Load its weights "
                "(safetensors.torch.load_model(model, path)) and start a new run, or resume from a folder written by "
                "save_training_state / SaveTrainingStateCallback."
            )
        return stored

    @staticmethod
    def wait() -> None:
        """Wait for a state being written in the background; raise its error unless another error is already on
        its way out (then it is warned about, so that neither is lost)."""
        already_failing = sys.exc_info()[1] is not None  # called from a finally: another error may be on its way out
        try:
            async_save.saver.wait()
        except CheckpointError as error:
            if not already_failing:
                raise
            warnings.warn(str(error), stacklevel=3)

    @classmethod
    def end_run(cls) -> None:
        """As a run ends: wait for a save in the background (see :meth:`wait`), and free the host copies kept for
        the run's next asynchronous save."""
        try:
            cls.wait()
        finally:
            async_save.host_buffers.clear()


@dataclass(frozen=True)
class ResumePosition:
    """Where in a training run a state was taken, always between two optimizer updates.

    Attributes:
        loop_epoch: the index, in the run's range of epochs, of the epoch to continue.
        batches_seen: the micro-batches of that epoch each process already trained on (skipped by sampler offset on
            resume).
        rng_restore_point: ``"before_iterator"`` for a state taken between epochs, ``"after_iterator"`` for one
            taken inside an epoch: where the resumed run puts the saved RNG states back.
    """

    loop_epoch: int
    batches_seen: int
    rng_restore_point: str
    #: the samples of that epoch trained before the position, by every process together: where a resume on another
    #: number of processes (or batch size) starts the epoch again
    epoch_samples: int = 0


@dataclass
class ResumePlan:
    """What a resumed run still has to apply as it reaches the saved position."""

    position: ResumePosition
    #: this process's saved RNG states; ``None`` for a process the saved run did not have (it keeps its own)
    rng_state: Optional[dict]
    train_loss_tracker: dict
    checkpoint_kwargs: dict
    folder: Path
    num_update_steps_completed: int = 0
    train_step_metrics: dict = field(default_factory=dict)
    run_id: Optional[str] = None
    #: the run history's epoch of the position's epoch: a resumed run continues an epoch a stop cut short under its
    #: own number, though the saved history moved past it.
    history_epoch: Optional[int] = None
    #: the saved run's settings (``run_facts``): its number of processes and batch size place the saved position
    saved_run_facts: dict = field(default_factory=dict)
    #: where this process's stream was at the position, if it can say (``loop/stream_position.py``); else ``None``
    stream_state: Optional[dict] = None


def validate_save_dir(
    parent: Any,
    run_state,
    allow_other_runs: bool = False,
    accepted: Iterable[str] = (),
    processes: Optional[Processes] = None,
) -> None:
    """Refuse to save the training states of the run of ``run_state`` (a ``RunState``: its ``run_id``,
    ``is_new_run``, ``in_training_run`` and ``checked_save_dirs``) into the local folder ``parent`` when it is a
    file, holds another run's states (unless ``allow_other_runs``; the runs of ``accepted`` are not other runs), or is
    claimed by another live job; checked once per folder and run, by every process of ``processes`` (``None``: this
    one alone). During the run the main process claims the folder for it (``claims.py``: released as the run ends),
    and every process raises its refusal together. A resumed run is not refused for the states the folder holds: its
    pruning, ``latest`` and later resumes keep to its own states. A folder in object storage (a URL) is not checked
    (see docs/training_state.md).

    Raises:
        CheckpointError: ``parent`` holds another run's states (see :func:`validate_no_other_runs`), or another live
            job of this host saves into it (:func:`~pytorch_accel_trainer.state.claims.take_claim`).
        NotADirectoryError: ``parent`` is a file.
    """
    if is_url(parent):
        return
    parent = Path(parent)
    if os.path.lexists(parent) and not parent.is_dir():
        raise NotADirectoryError(
            f"{str(parent)!r} is a file, not a folder of training states: pass a folder, e.g. "
            f"{str(parent.with_suffix('')) + '_states'!r}; each state is written as a folder inside it."
        )
    key = parent.absolute()
    if key in run_state.checked_save_dirs or run_state.run_id is None:
        return
    if run_state.is_new_run and not allow_other_runs:
        validate_no_other_runs(parent, run_state.run_id, accepted)
    if run_state.in_training_run:  # a save outside the run claims the folder for itself alone (folder.py)
        _claim_for_every_process(parent, run_state.run_id, processes or Processes())
    run_state.checked_save_dirs.add(key)


def _claim_for_every_process(parent: Path, run_id: str, processes: Processes) -> None:
    """The main process claims ``parent`` for the run; its refusal reaches every process (one small collective)."""
    problem: Optional[Exception] = None
    if processes.is_main:
        try:
            parent.mkdir(parents=True, exist_ok=True)
            take_claim(parent, run_id)
        except (CheckpointError, OSError) as error:
            problem = error
    refusal = processes.broadcast(None if problem is None else str(problem))
    if problem is not None:
        raise problem
    if refusal is not None:
        raise CheckpointError(refusal)


def validate_no_other_runs(parent: Path, run_id: str, accepted: Iterable[str] = ()) -> None:
    """Refuse to save the states of the new run ``run_id`` into ``parent`` when it holds another run's (but those
    of ``accepted``: the earlier ``train()`` calls of the same callback): they would mix, and a resume from
    ``parent`` would continue the other run.

    Raises:
        CheckpointError: naming the folder, the other run's states and the three ways out.
    """
    if not is_real_directory(parent):
        return
    accepted = {run_id, *accepted}
    others = [state for state in list_complete_states(parent) if state.run_id not in accepted]
    if not others:
        return
    raise CheckpointError(
        f"{parent} holds training states of another run ({describe_runs(others)}), and this run is a new run (no "
        "state resumed): its states would mix with them, and a resume could take the other run's. Either save this "
        "run's states in another folder (SaveTrainingStateCallback(save_dir=...), save_training_state(output_dir)), "
        f"continue that run with train(..., resume_from={str(parent)!r}), or pass allow_other_runs=True "
        "(SaveTrainingStateCallback, save_training_state) to write beside them: pruning, `latest` and a resume "
        "then keep to one run's states."
    )


# ------------------------------------------------------------------------------------------------
# Which state a resume continues
# ------------------------------------------------------------------------------------------------


#: Files of an Accelerate ``save_state`` folder, as pytorch-accelerated's training states are: not resumable here.
ACCELERATE_STATE_FILES = ("random_states_0.pkl", "optimizer.bin", "pytorch_model.bin", "model.safetensors")


#: The folder of a run folder that holds its training states (``<output_dir>/<run>/training_states``).
RUN_FOLDER_STATES = "training_states"


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


def is_run_folder(folder: Path) -> bool:
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
    folder and no training state of its own (as :func:`is_run_folder` on a disk)."""
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


def find_resumable_state(
    path: Path, processes: Optional[Processes] = None, read_parts: bool = False
) -> Optional[StoredState]:
    """Return the training state to resume from ``path``, or ``None`` for a folder with none yet.

    ``path`` is one training state (a folder with a manifest) or a folder of them, of which the newest
    complete one of one run is used: the run of the state saved last (named by ``latest``); the states of other runs
    are left alone, with a warning naming them. The states that cannot be used are skipped, each with a warning
    naming it and why (damaged, or of another format version): those newer than it, and those whose manifest cannot
    be read (so whose place in the run is unknown: a state of another format is one), or that are links. A state
    whose trainer file disagrees with its manifest (an edited manifest) is a damaged one.

    With ``processes`` (every one of which must call this), each state is verified by them together, each hashing
    its share of the files (:func:`verify_folder`). With ``read_parts`` (a state about to be loaded), the parts file
    of the one-file state returned is read as it is verified, and kept on it for its load (``StoredState.parts``):
    the load reads it no second time.

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
        return verify_folder(path, processes, read_parts)
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
            candidate = _verify_state_in(folder, processes, read_parts)
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


def _verify_state_in(folder: Path, processes: Optional[Processes] = None, read_parts: bool = False) -> StoredState:
    """A state of a folder of states, verified down to its trainer file (whose position must be the manifest's: an
    edited manifest must not make an older state look like the newest, and then stop the resume)."""
    if not is_real_directory(folder):
        raise CheckpointError(f"{folder}: a symbolic link; states are read only from folders inside {folder.parent}.")
    stored = verify_folder(folder, processes, read_parts)
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
