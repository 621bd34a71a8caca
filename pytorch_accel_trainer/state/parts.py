"""What a training state holds, as its owners hand it over, and how each process writes and reads its part: in one
torch file when one process writes it, through ``torch.distributed.checkpoint`` (DCP) when several do.

The package is given what it saves, never the Trainer: a :class:`StateContent` of

- ``sharded``: objects with ``state_dict()`` / ``load_state_dict()`` (the :class:`Stateful` protocol that
  ``torch.distributed.checkpoint`` and torchtitan use): the model, the optimizer, the extra models and optimizers.
  How a state holds them is its manifest's ``layout`` (:func:`layout_of`, below); their plain values (an optimizer's
  ``param_groups``) also go to the shared file, where the checks before a resume read them;
- ``shared``: plain values, the same on every process (position, counters, run history, scheduler, ...): written by
  the main process, to ``trainer_state.pt``;
- ``own``: this process's plain values (RNG states, loss sums, callbacks' states), to ``rank_<r>.pt``;
- ``engine`` (DeepSpeed's, else ``None``): an :class:`EngineState` that writes the model and optimizer in its own
  format, each process its own files, in place of ``sharded`` parts (the manifest's layout ``deepspeed``).

Which processes write together, and their collectives, is a :class:`Processes`: the run's (from its Accelerator) for
a save on the training thread, or a group of their own for a save in the background. Every file is checksummed by
the process that writes it, as it writes it (:func:`save_tensors_file`: its size and XXH3-128 computed as the bytes
pass, no second read); the checksums reach the main process, which writes the manifest last (``folder.py``).

The two layouts of the sharded parts:

- **One file** (``one_file``: a state written by one process, the most common run). The parts' full state dicts,
  tensors and plain values together as ``state_dict()`` returns them, by part name, in ``parts.pt``: one
  ``torch.save``, read back with ``torch.load(weights_only=True)`` as a resume verifies it
  (:func:`read_parts_file_hashed`: the file read once), else memory-mapped from the verified file
  (:func:`read_parts_file`). It resumes on any number of processes: each loads the full tensors into its part (under
  FSDP, its shard of them: a full state dict).
- **Sharded** (``sharded``: several processes). Each process writes the part of the tensors it holds (under FSDP its
  shard; under DDP DCP's planner spreads the replicated tensors over the processes), in parallel, straight from the
  live tensors, through DCP: no process gathers the full state. DCP's metadata (``.metadata``, written by the main
  process after every process wrote its files) records which piece of which tensor lies where, so that a state loads
  into any number of processes, each reading only the bytes of its own shard. DCP's writer and reader, with the
  checksums and the pickle-free metadata this package adds to them, are ``shards.py`` (imported only then).

Either way, :func:`check_fit` names the tensors whose names or shapes differ from the live ones
(:func:`describe_misfit`), before anything is read into them.
"""

from __future__ import annotations

import copy
import os
import pickle
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Optional, Protocol, cast

import torch

from pytorch_accel_trainer.errors import CheckpointError
from pytorch_accel_trainer.state import files as state_files
from pytorch_accel_trainer.state.checkpointing import describe_unreadable_torch_file, refused_by_weights_only
from pytorch_accel_trainer.state.files import (
    DEEPSPEED,
    ONE_FILE,
    PARTS_FILE,
    SHARDED,
    TEMPORARY_PREFIX,
    TRAINER_FILE,
    DamagedStateError,
    HashingReader,
    HashingStream,
    StoredState,
    rank_file,
)

#: Separates the levels of a part's state in the flat names DCP stores (``model/encoder.weight``); never in an FQN.
SEPARATOR = "/"
#: Stands for a tensor in the plain (non-tensor) tree of a part's state: the tensor itself is in the DCP files.
TENSOR_MARK = "<tensor in the shards>"


# ------------------------------------------------------------------------------------------------
# A part's state: its tensors (to DCP) and its plain values (to a torch file), and back
# ------------------------------------------------------------------------------------------------


def split_tensors(tree: Any, prefix: str) -> tuple[dict, Any]:
    """Split a state (nested dicts and lists) into its tensors, by flat name (``prefix/key/...``), and the same tree
    with each tensor replaced by :data:`TENSOR_MARK`."""
    tensors: dict[str, Any] = {}

    def walk(value: Any, path: str) -> Any:
        if isinstance(value, torch.Tensor):
            tensors[path] = value
            return TENSOR_MARK
        if isinstance(value, dict):
            return {key: walk(item, f"{path}{SEPARATOR}{key}") for key, item in value.items()}
        if isinstance(value, (list, tuple)):
            return type(value)(walk(item, f"{path}{SEPARATOR}{index}") for index, item in enumerate(value))
        return value

    return tensors, walk(tree, prefix)


def join_tensors(plain: Any, tensors: dict, prefix: str) -> Any:
    """The inverse of :func:`split_tensors`: ``plain`` with each mark replaced by its tensor of ``tensors``.

    Raises:
        DamagedStateError: a mark names no tensor of ``tensors`` (the plain tree and the shards disagree).
    """

    def walk(value: Any, path: str) -> Any:
        if isinstance(value, str) and value == TENSOR_MARK:
            if path not in tensors:
                raise DamagedStateError(f"the state's shards hold no tensor {path!r}, which its plain part names")
            return tensors[path]
        if isinstance(value, dict):
            return {key: walk(item, f"{path}{SEPARATOR}{key}") for key, item in value.items()}
        if isinstance(value, (list, tuple)):
            return type(value)(walk(item, f"{path}{SEPARATOR}{index}") for index, item in enumerate(value))
        return value

    return walk(plain, prefix)


# ------------------------------------------------------------------------------------------------
# Writing: each process its own files, checksummed as written
# ------------------------------------------------------------------------------------------------


#: Held while a torch file is written without its zip records' CRC32 (:func:`save_tensors_file`), so that two saves
#: of the package never restore torch's option out of turn.
_CRC32_OPTION = threading.Lock()


def save_tensors_file(obj: Any, path: Path) -> tuple[int, str]:
    """``torch.save`` to ``path``, flushed to disk; return its size and checksum, computed while writing.

    The file's zip records carry no CRC32 (``torch.serialization.set_crc32_options(False)`` while it is written: a
    second pass over every byte, which the XXH3-128 of the manifest makes redundant); ``torch.load`` reads it as any
    other, and a zip tool would report the records' CRC32 as wrong. torch's option is global: a ``torch.save`` of
    another thread that starts meanwhile also writes none."""
    with open(path, "wb") as handle, _CRC32_OPTION:
        stream = HashingStream(handle)
        computed = torch.serialization.get_crc32_options()
        torch.serialization.set_crc32_options(False)
        try:
            torch.save(obj, cast(IO[bytes], stream))  # a binary stream: torch.save needs only write()
        finally:
            torch.serialization.set_crc32_options(computed)
        handle.flush()
        os.fsync(handle.fileno())
    return stream.size, stream.digest


def load_tensors_file(path: Path, mmap: bool = False) -> Any:
    """Load a file written by :func:`save_tensors_file`, never unpickling arbitrary objects; with ``mmap``, its
    tensors memory-mapped (read as they are used).

    Raises:
        CheckpointError: the file is no torch file, or holds objects that only pickle can rebuild.
    """
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as error:
        if not refused_by_weights_only(path):
            message = describe_unreadable_torch_file(path, error)
            raise CheckpointError(f"{message} The state was damaged or altered.") from error
        raise CheckpointError(f"{path}: holds objects that only pickle can rebuild; refused ({error}).") from error
    except (RuntimeError, EOFError, ValueError) as error:
        raise CheckpointError(
            f"{path}: not a readable torch file ({error}); the state was damaged or altered."
        ) from error


def _global_shape(tensor: torch.Tensor) -> tuple:
    return tuple(tensor.shape)  # a DTensor's shape is the global one


def describe_misfit(saved: dict, tensors: dict) -> Optional[str]:
    """Why the saved tensors (``saved``: flat names to shapes) do not fit the live ``tensors`` (flat names to
    tensors or DTensors, whose global shapes count), or ``None``."""
    missing = sorted(set(tensors) - set(saved))
    unexpected = sorted(set(saved) - set(tensors))
    shapes = sorted(
        f"{name}: saved {list(saved[name])}, now {list(_global_shape(tensors[name]))}"
        for name in set(saved) & set(tensors)
        if tuple(saved[name]) != _global_shape(tensors[name])
    )
    problems = []
    if shapes:
        problems.append(f"other shapes ({'; '.join(shapes[:5])}{' ...' if len(shapes) > 5 else ''})")
    if missing:
        problems.append(f"not in the state: {', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}")
    if unexpected:
        problems.append(f"not in this run: {', '.join(unexpected[:5])}{' ...' if len(unexpected) > 5 else ''}")
    return "; ".join(problems) or None


# ------------------------------------------------------------------------------------------------
# What a state holds, and how each process writes and reads its part
# ------------------------------------------------------------------------------------------------


class Stateful(Protocol):
    """An object a training state saves and restores: a model, an optimizer, a scheduler... (torch's protocol)."""

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state_dict: dict) -> None: ...


class ModelState:
    """A model as a sharded part of a training state: under FSDP its ``DTensor`` shards, else its tensors (each
    named by its FQN, wrappers such as DDP's left out), through ``torch.distributed.checkpoint.state_dict``."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module

    def state_dict(self) -> dict:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        return get_model_state_dict(self.module)

    def load_state_dict(self, state_dict: dict) -> None:
        """Load ``state_dict``: the live tensors read in place (a sharded state), or whole tensors (a one-file
        state), of which each process takes its shard."""
        from torch.distributed.checkpoint.state_dict import set_model_state_dict

        set_model_state_dict(self.module, state_dict, options=_load_options(self.module, state_dict))


class OptimizerState:
    """An optimizer as a sharded part of a training state: its per-parameter tensors keyed by the parameters' FQNs
    (so that a state loads whatever the sharding), and its ``param_groups`` (plain values)."""

    def __init__(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.module, self.optimizer = module, optimizer

    def state_dict(self) -> dict:
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        return get_optimizer_state_dict(self.module, self.optimizer)  # a fresh optimizer's state is made first

    def load_state_dict(self, state_dict: dict) -> None:
        """Load ``state_dict``, as :meth:`ModelState.load_state_dict` does."""
        from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

        options = _load_options(self.module, state_dict)
        set_optimizer_state_dict(self.module, self.optimizer, state_dict, options=options)


def _load_options(module: torch.nn.Module, state_dict: dict):
    """How ``torch.distributed.checkpoint.state_dict`` loads ``state_dict`` into ``module``'s part: strictly; and as
    a full state dict (each process takes its shard of each whole tensor) when the module is sharded (FSDP's DTensors)
    and ``state_dict`` holds whole tensors (a one-file state's) rather than the live DTensors read in place."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions
    from torch.distributed.tensor import DTensor

    saved = split_tensors(state_dict, "")[0].values()
    whole = any(tensor.dim() > 0 for tensor in saved) and not any(isinstance(tensor, DTensor) for tensor in saved)
    sharded = any(isinstance(parameter, DTensor) for parameter in module.parameters())
    return StateDictOptions(strict=True, full_state_dict=whole and sharded)


class EngineState(Protocol):
    """A training engine that writes its model and optimizer state itself (DeepSpeed's ``save_checkpoint``): every
    process writes its own files into the state's folder, as plain files of it, and reads them back after the folder
    was verified."""

    def save(self, folder: Path) -> dict[str, tuple[int, str]]:
        """Write this process's files into ``folder`` (every process calls this at once); return each file it wrote
        with its size and XXH3-128 checksum."""
        ...

    def load(self, folder: Path) -> None:
        """Load the engine's state from the verified ``folder`` (every process calls this at once)."""
        ...


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
    the ``shared`` plain values, this process's ``own``, and an ``engine`` that writes its own files (DeepSpeed's)."""

    sharded: dict[str, Stateful]
    shared: dict
    own: dict
    engine: Optional[EngineState] = None
    #: the flat tensors of the sharded parts and their plain trees, once split (:meth:`split`)
    tensors: Optional[dict] = field(default=None, repr=False)
    plain: Optional[dict] = field(default=None, repr=False)
    #: data pointers of the tensors that only an optimizer update changes (parameters, optimizer state), which an
    #: asynchronous save inside a run copies while the next step's forward and backward passes run (``async_save.py``)
    changed_by_updates_only: frozenset = field(default=frozenset(), repr=False)

    def split(self) -> "StateContent":
        """Read each sharded part's ``state_dict()`` once: its tensors (live, not copied) and its plain tree."""
        tensors, plain = {}, {}
        for name, part in self.sharded.items():
            part_tensors, plain[name] = split_tensors(part.state_dict(), name)
            tensors.update(part_tensors)
        self.tensors, self.plain = tensors, plain
        return self


def layout_of(processes: Processes, content: Optional[StateContent] = None) -> str:
    """How a state written by ``processes`` holds its sharded parts: the engine's own files
    (:data:`~pytorch_accel_trainer.state.files.DEEPSPEED`) when ``content`` has an engine; in one file
    (:data:`~pytorch_accel_trainer.state.files.ONE_FILE`) when one process writes it, else one shard per process
    through DCP (:data:`~pytorch_accel_trainer.state.files.SHARDED`)."""
    if content is not None and content.engine is not None:
        return DEEPSPEED
    return ONE_FILE if processes.count == 1 else SHARDED


def write_content(content: StateContent, folder: Path, processes: Processes, layout: str) -> dict[str, tuple[int, str]]:
    """Write this process's part of ``content`` into ``folder``: its sharded parts in ``layout``
    (:func:`layout_of`: one file, or its shard with every process at once), its own file, and on the main process the
    shared file. Return the files this process wrote with their sizes and checksums."""
    if content.tensors is None:
        content.split()
    own_name = rank_file(processes.rank)

    def write_own() -> dict:
        state_files.crash_point(f"write:{own_name}")
        return {own_name: save_tensors_file(content.own, folder / own_name)}

    # agreed before the shards: DCP's save is collective, and a process that failed here must not leave the others
    # waiting in it (DCP itself tells every process of a failure in its own steps)
    state_name = folder.name.removeprefix(TEMPORARY_PREFIX)
    checksums = agreed(processes, write_own, f"its part of the training state {state_name}")[processes.rank]
    state_files.crash_point("write:shards")
    if layout == DEEPSPEED:
        if content.engine is None:
            raise ValueError(f"A state of layout {DEEPSPEED!r} is written by an engine, but its content has none.")
        checksums.update(content.engine.save(folder))
    elif layout == ONE_FILE:
        checksums[PARTS_FILE] = save_tensors_file(_full_state_dicts(content), folder / PARTS_FILE)
    else:
        from pytorch_accel_trainer.state.shards import save_shards

        checksums.update(save_shards(content.tensors or {}, folder, processes.group))
    if processes.is_main:
        state_files.crash_point(f"write:{TRAINER_FILE}")
        shared = {**content.shared, "plain_parts": content.plain}
        checksums[TRAINER_FILE] = save_tensors_file(shared, folder / TRAINER_FILE)
    return checksums


def _full_state_dicts(content: StateContent) -> dict:
    """The state dicts of ``content``'s sharded parts, by part name, each whole: its plain tree with its tensors back
    (the live ones, or their staged copies), a DTensor as its full tensor (FSDP on one process: its only shard)."""
    from torch.distributed.tensor import DTensor

    tensors = {
        name: tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
        for name, tensor in (content.tensors or {}).items()
    }
    return {name: join_tensors(plain, tensors, name) for name, plain in (content.plain or {}).items()}


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


def read_parts_file(folder: Path, mmap: bool = False) -> dict:
    """The sharded parts of a verified one-file state in ``folder``: their full state dicts, by part name, read with
    ``torch.load(weights_only=True)``. With ``mmap``, memory-mapped: a tensor's bytes are read only as it is used
    (the fit check reads names and shapes alone), from the page cache the verification filled; such tensors must not
    outlive the read (an optimizer that kept them would keep the file mapped, and its disk space taken once the state
    is pruned).

    Raises:
        CheckpointError: the file is no torch file of plain values (see :func:`load_tensors_file`), or does not map
            part names to state dicts.
    """
    path = folder / PARTS_FILE
    saved = load_tensors_file(path, mmap=mmap)
    if not _holds_parts(saved):
        raise CheckpointError(f"{path}: not the state dicts of a state's parts, by name; it was altered.")
    return saved


def _holds_parts(saved: Any) -> bool:
    return isinstance(saved, dict) and all(isinstance(state, dict) for state in saved.values())


def read_parts_file_hashed(path: Path, expected_size: int) -> tuple[int, str, Optional[dict]]:
    """Read a one-file state's parts file ``path`` as :func:`read_parts_file` does, while computing its size and
    XXH3-128 from the very bytes read (:class:`~pytorch_accel_trainer.state.files.HashingReader`: each tensor's bytes
    hashed as they land in it, no second read); return the size, the digest (``""``, the file left unread, when its
    size is not ``expected_size``) and the parts, ``None`` when the file is no torch file of parts (a damaged one, whose
    digest tells; an intact one is refused, saying why, by :func:`read_parts_file` when the state is loaded). The
    parts are unverified until the digest matched the manifest: nothing may use them before.

    Raises:
        FileNotFoundError: there is no such file.
        DamagedStateError: ``path`` is a symbolic link or not a regular file.
    """
    with HashingReader(path) as reader:
        if reader.size != expected_size:
            return reader.size, "", None
        try:
            saved = torch.load(cast(IO[bytes], reader), map_location="cpu", weights_only=True)
        except Exception:  # unverified bytes: whatever torch raised, the digest (or read_parts_file) tells why
            saved = None
        size, digest = reader.finish()
    return size, digest, saved if _holds_parts(saved) else None


def check_fit(stored: StoredState, shared: dict, parts: dict[str, Stateful]) -> StateContent:
    """Check that a verified state (``shared``: its trainer file) holds each of the sharded ``parts`` with tensors of
    the live ones' names and shapes (read from its parts file, or its DCP metadata); return the live parts, split
    (their tensors are what a sharded state loads into).

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
    if stored.layout == ONE_FILE:
        saved = stored.parts if stored.parts is not None else read_parts_file(folder, mmap=True)
        shapes = {
            name: tuple(tensor.shape)
            for part in parts
            for name, tensor in split_tensors(saved.get(part, {}), part)[0].items()
        }
    else:
        from pytorch_accel_trainer.state.shards import read_metadata, saved_shapes

        try:
            shapes = saved_shapes(read_metadata(folder))
        except DamagedStateError as error:
            raise CheckpointError(f"{error}; the state was damaged or altered.") from error
    misfit = describe_misfit(
        {name: shape for name, shape in shapes.items() if name.split(SEPARATOR, 1)[0] in parts}, live.tensors or {}
    )
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
    """Load the sharded ``parts`` from a verified state (``shared``: its trainer file); every process must call this.
    A one-file state: each process loads the full state dicts into its parts (under FSDP, its shard of them); a
    sharded one: each process reads only the pieces of its own shard, whatever the number of processes that wrote
    them. Their fit is checked first (:func:`check_fit`; ``live``: what it returned, when the caller checked already).

    Raises:
        CheckpointError: see :func:`check_fit`; or a file cannot be read.
    """
    folder = stored.folder
    live = live or check_fit(stored, shared, parts)
    if stored.layout == ONE_FILE:
        # read as the file was verified (fresh tensors, handed over), else the verified file's pages, as they are copied
        verified = stored.take_parts()
        saved = verified if verified is not None else read_parts_file(folder, mmap=True)
        for name, part in parts.items():
            if name not in saved:
                raise CheckpointError(
                    f"{folder / PARTS_FILE}: holds no {name}, which its trainer file lists; it was altered."
                )
            # a model copies what it is given; an optimizer keeps it, so it is given copies, never the mapped file
            mapped = verified is None and not isinstance(part, ModelState)
            part.load_state_dict(copy.deepcopy(saved[name]) if mapped else saved[name])
        return
    from pytorch_accel_trainer.state.shards import load_shards

    live_tensors = live.tensors or {}
    try:
        load_shards(live_tensors, folder, processes.group, set(stored.manifest["files"]))
    except DamagedStateError as error:
        raise CheckpointError(f"{error}; the state was damaged or altered.") from error
    for name, part in parts.items():
        try:
            state = join_tensors(shared["plain_parts"][name], live_tensors, name)
        except DamagedStateError as error:
            raise CheckpointError(f"{folder}: {error}; the state was damaged or altered.") from error
        part.load_state_dict(state)
