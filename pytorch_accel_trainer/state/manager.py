"""The owner of a run's training states: :class:`TrainingStates` saves them, finds the one to resume, and prunes
them; the position a state was taken at (:class:`ResumePosition`) and what a resume still has to apply
(:class:`ResumePlan`); and which run a folder of states belongs to (:func:`validate_save_dir`).

Shaped like torchtitan's ``CheckpointManager``: it is given what it saves, never the Trainer: the processes that
save together (:class:`~pytorch_accel_trainer.state.parts.Processes`) and, at each save, a
:class:`~pytorch_accel_trainer.state.parts.StateContent` of ``Stateful`` parts (``state_dict()`` /
``load_state_dict()``) and plain values. Behind it: how one state's folder is written, verified and pruned
(``folder.py``: temporary folder, checksums, manifest last, rename, ``latest``), the save in the background
(``async_save.py``), object storage (``storage.py``: a node-local mirror, uploaded manifest last), and which state a
resume continues (``lookup.py``).
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
from pytorch_accel_trainer.state.files import StoredState, is_real_directory
from pytorch_accel_trainer.state.folder import list_complete_states, write_training_state
from pytorch_accel_trainer.state.lookup import describe_runs, find_state_to_resume
from pytorch_accel_trainer.state.parts import Processes, StateContent
from pytorch_accel_trainer.state.storage import (
    Location,
    RemoteStates,
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
        is returned. Under an object-storage URL the state is written to each machine's mirror and uploaded, its
        manifest last.
        """
        async_save.saver.wait()
        remote = self._remote_for_saving(parent) if isinstance(parent, str) else None
        local_parent = Path(parent) if remote is None else remote.mirror
        if asynchronous:
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
        these), verified; ``None`` for a new run (``lookup.py``)."""
        return find_state_to_resume(self.processes, location)

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


def validate_save_dir(parent: Any, run_state, allow_other_runs: bool = False, accepted: Iterable[str] = ()) -> None:
    """Refuse to save the training states of the run of ``run_state`` (a ``RunState``: its ``run_id``,
    ``is_new_run`` and ``checked_save_dirs``) into the local folder ``parent`` when it is a file, or holds another
    run's states (unless ``allow_other_runs``; the runs of ``accepted`` are not other runs); checked once per folder
    and run. A resumed run is not refused: its pruning, ``latest`` and later resumes keep to its own states. A folder
    in object storage (a URL) is not checked (see docs/training_state.md).

    Raises:
        CheckpointError: ``parent`` holds another run's states (see :func:`validate_no_other_runs`).
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
    run_state.checked_save_dirs.add(key)


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
