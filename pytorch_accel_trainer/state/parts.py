"""What a training state holds, as its owners hand it over, and how each process writes and reads its part.

The package is given what it saves, never the Trainer: a :class:`StateContent` of

- ``sharded``: objects with ``state_dict()`` / ``load_state_dict()`` (the :class:`Stateful` protocol that
  ``torch.distributed.checkpoint`` and torchtitan use) whose tensors are written one shard per process, in parallel,
  through DCP (``distcp.py``): the model, the optimizer, the extra models and optimizers. Their plain values (an
  optimizer's ``param_groups``) go to the shared file;
- ``shared``: plain values, the same on every process (position, counters, run history, scheduler, ...): written by
  the main process, to ``trainer_state.pt``;
- ``own``: this process's plain values (RNG states, loss sums, callbacks' states), to ``rank_<r>.pt``.

Which processes write together, and their collectives, is a :class:`Processes`: the run's (from its Accelerator) for
a save on the training thread, or a group of their own for a save in the background. Every file is checksummed by
the process that writes it, as it writes it; the checksums reach the main process, which writes the manifest last
(``folder.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Protocol

from pytorch_accel_trainer.errors import CheckpointError
from pytorch_accel_trainer.state import crash_points, distcp
from pytorch_accel_trainer.state.files import (
    TEMPORARY_PREFIX,
    TRAINER_FILE,
    DamagedStateError,
    StoredState,
    rank_file,
    save_tensors_file,
)


class Stateful(Protocol):
    """An object a training state saves and restores: a model, an optimizer, a scheduler... (torch's protocol)."""

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state_dict: dict) -> None: ...


@dataclass
class Processes:
    """The processes that write or read a state together: this one's rank, how many, which is the main process (of
    the run, of this machine), and the process group of their collectives (``None``: torch's default group)."""

    rank: int = 0
    count: int = 1
    is_main: bool = True
    is_local_main: bool = True
    group: Any = None

    @classmethod
    def of_accelerator(cls, accelerator, group: Any = None) -> "Processes":
        return cls(
            accelerator.process_index,
            accelerator.num_processes,
            accelerator.is_main_process,
            accelerator.is_local_main_process,
            group,
        )

    def barrier(self) -> None:
        if self.count > 1:
            import torch.distributed as dist

            dist.barrier(group=self.group)

    def all_gather(self, value: Any) -> list:
        """``value`` of every process, in rank order (small plain values: checksums, names)."""
        if self.count == 1:
            return [value]
        import torch.distributed as dist

        gathered: list = [None] * self.count
        dist.all_gather_object(gathered, value, group=self.group)
        return gathered

    def broadcast(self, value: Any) -> Any:
        """The main process's ``value``, on every process."""
        if self.count == 1:
            return value
        import torch.distributed as dist

        holder = [value]
        dist.broadcast_object_list(holder, src=0, group=self.group)
        return holder[0]


@dataclass
class StateContent:
    """A training state in memory: ``sharded`` parts (live objects, or their tensors split out by :meth:`split`),
    the ``shared`` plain values and this process's ``own``."""

    sharded: dict[str, Stateful]
    shared: dict
    own: dict
    #: the flat tensors of the sharded parts and their plain trees, once split (:meth:`split`)
    tensors: Optional[dict] = field(default=None, repr=False)
    plain: Optional[dict] = field(default=None, repr=False)

    def split(self) -> "StateContent":
        """Read each sharded part's ``state_dict()`` once: its tensors (live, not copied) and its plain tree."""
        tensors, plain = {}, {}
        for name, part in self.sharded.items():
            part_tensors, plain[name] = distcp.split_tensors(part.state_dict(), name)
            tensors.update(part_tensors)
        self.tensors, self.plain = tensors, plain
        return self


def write_content(content: StateContent, folder: Path, processes: Processes) -> dict[str, tuple[int, str]]:
    """Write this process's part of ``content`` into ``folder``: its shards (every process at once), its own file,
    and on the main process the shared file. Return the files this process wrote with their sizes and checksums."""
    if content.tensors is None:
        content.split()
    own_name = rank_file(processes.rank)

    def write_own() -> dict:
        crash_points.crash_point(f"write:{own_name}")
        return {own_name: save_tensors_file(content.own, folder / own_name)}

    # agreed before the shards: DCP's save is collective, and a process that failed here must not leave the others
    # waiting in it (DCP itself tells every process of a failure in its own steps)
    state_name = folder.name.removeprefix(TEMPORARY_PREFIX)
    checksums = agreed(processes, write_own, f"its part of the training state {state_name}")[processes.rank]
    crash_points.crash_point("write:shards")
    checksums.update(distcp.save_shards(content.tensors or {}, folder, processes.group))
    if processes.is_main:
        crash_points.crash_point(f"write:{TRAINER_FILE}")
        shared = {**content.shared, "plain_parts": content.plain}
        checksums[TRAINER_FILE] = save_tensors_file(shared, folder / TRAINER_FILE)
    return checksums


def agreed(processes: Processes, step, what: str) -> list:
    """Run ``step`` on every process and return the results of all of them, in rank order (small values: checksums);
    if it failed on any process, every process raises: its own error where it failed, elsewhere a ``CheckpointError``
    naming the process and ``what`` it could not write. One collective, whatever happened."""
    try:
        result, failure = step(), None
    except Exception as error:
        result, failure = None, error
    reports = processes.all_gather((result, None if failure is None else f"{type(failure).__name__}: {failure}"))
    if failure is not None:
        raise failure
    for rank, (_, report) in enumerate(reports):
        if report is not None:
            raise CheckpointError(f"Process {rank} could not write {what} ({report}).")
    return [result for result, _ in reports]


# ------------------------------------------------------------------------------------------------
# Reading
# ------------------------------------------------------------------------------------------------


def check_fit(stored: StoredState, shared: dict, parts: dict[str, Stateful]) -> StateContent:
    """Check that a verified state (``shared``: its trainer file) holds each of the sharded ``parts`` with tensors of
    the live ones' names and shapes; return the live parts, split (their tensors are what a load reads into).

    Raises:
        CheckpointError: the state holds other parts, or tensors of other names or shapes (naming them).
    """
    folder = stored.folder
    saved_plain = shared.get("plain_parts")
    if not isinstance(saved_plain, dict):
        raise CheckpointError(f"{folder / TRAINER_FILE}: it lists no sharded parts; it was altered.")
    missing = [name for name in parts if name not in saved_plain]
    if missing:
        raise CheckpointError(
            f"{folder} holds no {', '.join(missing)} (it holds {', '.join(sorted(saved_plain))}): resume with the "
            "models and optimizers the state was saved with."
        )
    live = StateContent(parts, {}, {}).split()
    try:
        metadata = distcp.read_metadata(folder)
    except DamagedStateError as error:
        raise CheckpointError(f"{error}; the state was damaged or altered.") from error
    saved_names = {name for name in metadata.state_dict_metadata if name.split(distcp.SEPARATOR, 1)[0] in parts}
    misfit = distcp.describe_misfit(_only(metadata, saved_names), live.tensors or {})
    if misfit is not None:
        raise CheckpointError(
            f"{folder} does not fit this run's {', '.join(parts)}: {misfit}. Resume with the model and optimizer the "
            "state was saved from (same parameters and shapes, same optimizer), or start a new run."
        )
    return live


def load_sharded(
    stored: StoredState,
    shared: dict,
    parts: dict[str, Stateful],
    processes: Processes,
    live: Optional[StateContent] = None,
) -> None:
    """Load the sharded ``parts`` from a verified state (``shared``: its trainer file), each process reading only the
    pieces of its own shard, whatever the number of processes that wrote them; every process must call this. Their
    fit is checked first (:func:`check_fit`; ``live``: what it returned, when the caller checked already).

    Raises:
        CheckpointError: see :func:`check_fit`; or a shard cannot be read.
    """
    folder = stored.folder
    live = live or check_fit(stored, shared, parts)
    live_tensors = live.tensors or {}
    try:
        distcp.load_shards(live_tensors, folder, processes.group, set(stored.manifest["files"]))
    except DamagedStateError as error:
        raise CheckpointError(f"{error}; the state was damaged or altered.") from error
    for name, part in parts.items():
        try:
            state = distcp.join_tensors(shared["plain_parts"][name], live_tensors, name)
        except DamagedStateError as error:
            raise CheckpointError(f"{folder}: {error}; the state was damaged or altered.") from error
        part.load_state_dict(state)


def _only(metadata, names: set):
    """``metadata`` restricted to the tensors ``names`` (the parts being loaded)."""
    from copy import copy

    restricted = copy(metadata)
    restricted.state_dict_metadata = {
        name: item for name, item in metadata.state_dict_metadata.items() if name in names
    }
    return restricted
