"""What a training state holds, as its owners hand it over, and how each process writes and reads its part: in one
torch file when one process writes it, through ``torch.distributed.checkpoint`` (DCP) when several do.

The package is given what it saves, never the Trainer: a :class:`StateContent` of

- ``sharded``: objects with ``state_dict()`` / ``load_state_dict()`` (the :class:`Stateful` protocol that
  ``torch.distributed.checkpoint`` and torchtitan use): the model, the optimizer, the extra models and optimizers.
  How a state holds them is its manifest's ``layout`` (:func:`layout_of`, below); their plain values (an optimizer's
  ``param_groups``) also go to the shared file, where the checks before a resume read them;
- ``shared``: plain values, the same on every process (position, counters, run history, scheduler, ...): written by
  the main process, to ``trainer_state.pt``;
- ``own``: this process's plain values (RNG states, loss sums, callbacks' states), to ``rank_<r>.pt``.

Which processes write together, and their collectives, is a :class:`Processes`: the run's (from its Accelerator) for
a save on the training thread, or a group of their own for a save in the background. Every file is checksummed by
the process that writes it, as it writes it (:func:`save_tensors_file`: its size and XXH3-128 computed as the bytes
pass, no second read); the checksums reach the main process, which writes the manifest last (``folder.py``).

The two layouts of the sharded parts:

- **One file** (``one_file``: a state written by one process, the most common run). The parts' full state dicts,
  tensors and plain values together as ``state_dict()`` returns them, by part name, in ``parts.pt``: one
  ``torch.save``, read back with ``torch.load(weights_only=True)`` (memory-mapped for the fit check, which reads the
  names and shapes alone). It resumes on any number of processes: each loads the full tensors into its part (under
  FSDP, its shard of them: a full state dict).
- **Sharded** (``sharded``: several processes). Each process writes the part of the tensors it holds (under FSDP its
  shard; under DDP DCP's planner spreads the replicated tensors over the processes), in parallel, straight from the
  live tensors, through DCP: no process gathers the full state. DCP's metadata (``.metadata``, written by the main
  process after every process wrote its files) records which piece of which tensor lies where, so that a state loads
  into any number of processes, each reading only the bytes of its own shard. What this module adds to DCP, which
  has no checksum and reads back with pickle: each file is checksummed as written (:class:`ChecksummedWriter`); the
  metadata is rebuilt with an unpickler that knows DCP's own few classes only (:func:`read_metadata`), and a "bytes"
  entry (which DCP would unpickle) is refused: only tensors are ever written there.

Either way, :func:`check_fit` names the tensors whose names or shapes differ from the live ones
(:func:`describe_misfit`), before anything is read into them.
"""

from __future__ import annotations

import copy
import io
import os
import pickle
import re
import threading
import warnings
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Iterator, Optional, Protocol, cast

import torch
import xxhash
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from pytorch_accel_trainer.errors import CheckpointError
from pytorch_accel_trainer.state import files as state_files
from pytorch_accel_trainer.state.checkpointing import describe_unreadable_torch_file, refused_by_weights_only
from pytorch_accel_trainer.state.files import (
    ONE_FILE,
    PARTS_FILE,
    SHARDED,
    SHARDS_METADATA_FILE,
    TEMPORARY_PREFIX,
    TRAINER_FILE,
    DamagedStateError,
    StoredState,
    rank_file,
)

#: The file DCP's main process writes last, naming where every piece of every tensor is.
METADATA_FILE = SHARDS_METADATA_FILE
#: The files of a process's shard: ``__<rank>_<n>.distcp``.
_SHARD_FILE = re.compile(r"__\d+_\d+\.distcp")
#: Separates the levels of a part's state in the flat names DCP stores (``model/encoder.weight``); never in an FQN.
SEPARATOR = "/"
#: Stands for a tensor in the plain (non-tensor) tree of a part's state: the tensor itself is in the DCP files.
TENSOR_MARK = "<tensor in the shards>"

# DCP warns on every save and load of a single process that it "assumes the intent" is one process, even when told
# so (no_dist=True): it is the intent here, so a run of one process is not given that warning at each save.
warnings.filterwarnings(
    "ignore", message=r"torch\.distributed is disabled, unavailable or uninitialized, assuming the intent is to"
)


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


class _HashingStream(io.RawIOBase):
    """A write-only binary stream over a file that computes the size and XXH3-128 of what passes through it, so a
    file's checksum costs no second read (DCP's files and the torch files of :func:`save_tensors_file`)."""

    def __init__(self, handle) -> None:
        super().__init__()
        self._handle, self._hasher, self.size = handle, xxhash.xxh3_128(), 0

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        self._hasher.update(view)
        self.size += len(view)
        self._handle.write(view)
        return len(view)

    def tell(self) -> int:
        return self.size

    def flush(self) -> None:
        self._handle.flush()

    def fileno(self) -> int:
        return self._handle.fileno()

    def close(self) -> None:  # DCP closes the streams it writes an item through; the file stays open for the next
        pass

    @property
    def digest(self) -> str:
        return self._hasher.hexdigest()


def save_tensors_file(obj: Any, path: Path) -> tuple[int, str]:
    """``torch.save`` to ``path``, flushed to disk; return its size and checksum, computed while writing."""
    with open(path, "wb") as handle:
        stream = _HashingStream(handle)
        torch.save(obj, cast(IO[bytes], stream))  # a binary stream: torch.save needs only write()
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


class _ChecksummedFileSystem(FileSystem):
    """DCP's local file system, whose written files are checksummed as they are written (see :class:`_HashingStream`),
    and whose renames carry the checksums along (DCP writes ``.metadata.tmp``, then renames it)."""

    def __init__(self) -> None:
        self.checksums: dict[str, tuple[int, str]] = {}
        self._lock = threading.Lock()  # DCP may write several files at once, on threads

    @contextmanager
    def create_stream(self, path, mode: str) -> Iterator[io.IOBase]:
        if "w" not in mode:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        with open(path, "wb") as handle:
            stream = _HashingStream(handle)
            yield stream
            handle.flush()
        with self._lock:
            self.checksums[Path(path).name] = (stream.size, stream.digest)

    def rename(self, path, new_path) -> None:
        super().rename(path, new_path)
        with self._lock:
            if Path(path).name in self.checksums:
                self.checksums[Path(new_path).name] = self.checksums.pop(Path(path).name)


class ChecksummedWriter(FileSystemWriter):
    """DCP's ``FileSystemWriter`` (one file per process, flushed to disk), computing each file's size and checksum as
    it writes it: :attr:`checksums` maps the files this process wrote to ``(size, xxh3_128)``."""

    def __init__(self, folder: Path, thread_count: int = 1) -> None:
        super().__init__(folder, single_file_per_rank=True, sync_files=True, thread_count=thread_count)
        self.fs = self._checksummed = _ChecksummedFileSystem()

    @property
    def checksums(self) -> dict[str, tuple[int, str]]:
        return dict(self._checksummed.checksums)


def save_shards(tensors: dict, folder: Path, process_group=None, thread_count: int = 1) -> dict[str, tuple[int, str]]:
    """Write this process's part of ``tensors`` (flat names to tensors or DTensors) into ``folder``; every process of
    ``process_group`` must call this (without a process group: one process). Return the files this process wrote,
    with their sizes and checksums."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    writer = ChecksummedWriter(folder, thread_count=thread_count)
    distributed = dist.is_available() and dist.is_initialized()
    try:
        dcp.save(tensors, storage_writer=writer, process_group=process_group, no_dist=not distributed)
    except CheckpointException as error:
        raise _unwrapped(error, process_group) from error
    return writer.checksums


def _unwrapped(error: CheckpointException, process_group=None) -> BaseException:
    """The error behind DCP's ``CheckpointException`` (a ``BaseException`` that ``except Exception`` misses): this
    process's own, else the first process's; an ``OSError`` as it is (a full disk is reported as one), anything
    else as a ``RuntimeError`` that names it."""
    import torch.distributed as dist

    rank = dist.get_rank(process_group) if dist.is_available() and dist.is_initialized() else 0
    failures = error.failures
    found = failures.get(rank) or next(iter(failures.values()), None)
    cause = found[0] if found is not None else None
    if isinstance(cause, (OSError, DamagedStateError)):
        return cause
    if isinstance(cause, pickle.UnpicklingError):  # torch.load(weights_only=True) refused a shard's content
        return DamagedStateError("a shard holds objects that only pickle can rebuild; refused, never run")
    first_line = str(cause).strip().splitlines()[0] if str(cause).strip() else ""
    return RuntimeError(f"torch.distributed.checkpoint failed: {type(cause).__name__}: {first_line}")


# ------------------------------------------------------------------------------------------------
# Reading: DCP's metadata without arbitrary pickle, tensors only
# ------------------------------------------------------------------------------------------------

#: The classes DCP's metadata is made of (torch 2.4 - 2.13): the only ones :func:`read_metadata` rebuilds.
_METADATA_CLASSES = {
    ("torch.distributed.checkpoint.metadata", name)
    for name in (
        "Metadata",
        "MetadataIndex",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "StorageMeta",
        "_MEM_FORMAT_ENCODING",
    )
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.distributed.checkpoint.filesystem", "_StoragePrefix"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "PureWindowsPath"),
    ("collections", "OrderedDict"),
}


class _MetadataUnpickler(pickle.Unpickler):
    """Rebuilds DCP's metadata, and nothing else: any other class (a planted payload) is refused, never called."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _METADATA_CLASSES:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)  # a dtype, e.g. torch.float32
        raise DamagedStateError(f"names {module}.{name}, which DCP's metadata never holds")


def read_metadata(folder: Path) -> Metadata:
    """The DCP metadata of a state's ``folder``, rebuilt by :class:`_MetadataUnpickler`.

    Raises:
        DamagedStateError: the file is not DCP metadata (or names a class DCP's metadata never holds).
    """
    path = folder / METADATA_FILE
    try:
        with open(path, "rb") as handle:
            metadata = _MetadataUnpickler(handle).load()
    except DamagedStateError as error:
        raise DamagedStateError(f"{path} {error}") from error
    except (pickle.UnpicklingError, EOFError, AttributeError, TypeError, ValueError, IndexError) as error:
        raise DamagedStateError(f"{path}: not DCP metadata ({error})") from error
    if not isinstance(metadata, Metadata) or not isinstance(metadata.state_dict_metadata, dict):
        raise DamagedStateError(f"{path}: not DCP metadata (a {type(metadata).__name__})")
    return metadata


class _NoFollowFileSystem(FileSystem):
    """DCP's local file system, opening no file through a symbolic link (``O_NOFOLLOW``)."""

    @contextmanager
    def create_stream(self, path, mode: str) -> Iterator[io.IOBase]:
        if "r" not in mode:
            raise ValueError(f"a state's shards are only read here, not opened with mode {mode!r}")
        descriptor = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_BINARY", 0))
        with os.fdopen(descriptor, "rb") as stream:
            yield cast(io.IOBase, stream)


class _SafeReader(FileSystemReader):
    """DCP's ``FileSystemReader``, reading its metadata with :func:`read_metadata`, and from it only the files
    ``allowed`` (the manifest's, verified: ``None`` allows any plain name), never through a link."""

    def __init__(self, folder: Path, allowed: Optional[set] = None) -> None:
        super().__init__(folder)
        self.fs = _NoFollowFileSystem()
        self._allowed = allowed

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        metadata = read_metadata(Path(self.path))
        validate_storage(
            Path(self.path), metadata, self._allowed
        )  # checked before (load_shards), and here again for DCP's reads
        from torch.distributed.checkpoint.metadata import StorageMeta

        storage_meta = getattr(metadata, "storage_meta", None) or StorageMeta()
        storage_meta.load_id = self.load_id
        metadata.storage_meta = storage_meta
        return metadata


def validate_storage(folder: Path, metadata: Metadata, allowed: Optional[set]) -> None:
    """Refuse DCP metadata that places a tensor in a file that is not a plain shard file name, or (``allowed``) not
    one the manifest lists: a state's files are never read outside its folder, nor unverified.

    Raises:
        DamagedStateError: naming the file.
    """
    for info in (metadata.storage_data or {}).values():
        name = getattr(info, "relative_path", None)
        if not is_shard_file(name) or (allowed is not None and name not in allowed):
            raise DamagedStateError(
                f"{folder / METADATA_FILE} places a tensor in {name!r}, which is not a shard file the manifest lists "
                "(a state's files are never read outside it)"
            )


class _TensorsOnlyPlanner(DefaultLoadPlanner):
    """DCP's load planner, refusing a "bytes" entry (which DCP would unpickle): a state's shards hold tensors only."""

    def load_bytes(self, read_item, value) -> None:
        raise DamagedStateError(
            f"the state's shards hold {read_item.dest_index.fqn!r} as pickled bytes; only tensors are ever written, "
            "and bytes are never unpickled"
        )


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


def saved_shapes(metadata: Metadata) -> dict[str, tuple]:
    """The flat names and global shapes of the tensors of a sharded state's DCP ``metadata``."""
    return {
        name: tuple(item.size)
        for name, item in metadata.state_dict_metadata.items()
        if isinstance(item, TensorStorageMetadata)
    }


def load_shards(tensors: dict, folder: Path, process_group=None, allowed: Optional[set] = None) -> None:
    """Read the saved values of ``tensors`` (flat names to the live tensors or DTensors, in place) from ``folder``,
    each process only the pieces of its own shard, whatever the number of processes that wrote them; every process of
    ``process_group`` must call this. Check the fit first with :func:`describe_misfit`. ``allowed``: the files the
    state's manifest lists (DCP's metadata may name no other)."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    validate_storage(folder, read_metadata(folder), allowed)
    distributed = dist.is_available() and dist.is_initialized()
    try:
        dcp.load(
            tensors,
            storage_reader=_SafeReader(folder, allowed),
            planner=_TensorsOnlyPlanner(),
            process_group=process_group,
            no_dist=not distributed,
        )
    except CheckpointException as error:
        raise _unreadable(folder, _unwrapped(error, process_group)) from error


def _unreadable(folder: Path, cause: BaseException) -> DamagedStateError:
    """What a shard that DCP could not read says: the state's folder, and why."""
    if isinstance(cause, DamagedStateError):
        return cause if str(folder) in str(cause) else DamagedStateError(f"{folder}: {cause}")
    return DamagedStateError(f"{folder}: its shards cannot be read ({cause})")


def read_full_tensors(folder: Path, prefix: str = "", allowed: Optional[set] = None) -> dict:
    """The tensors of ``folder``'s shards whose flat names start with ``prefix`` (all by default), whole, on this
    process's CPU: no process group needed (a state written by any number of processes, read on one machine:
    ``pytorch-accel-trainer consolidate``). ``allowed``: as for :func:`load_shards`."""
    import torch.distributed.checkpoint as dcp

    metadata = read_metadata(folder)
    validate_storage(folder, metadata, allowed)
    tensors = {
        name: torch.empty(tuple(item.size), dtype=item.properties.dtype)
        for name, item in metadata.state_dict_metadata.items()
        if isinstance(item, TensorStorageMetadata) and name.startswith(prefix)
    }
    try:
        dcp.load(tensors, storage_reader=_SafeReader(folder, allowed), planner=_TensorsOnlyPlanner(), no_dist=True)
    except CheckpointException as error:
        raise _unreadable(folder, _unwrapped(error)) from error
    return tensors


def is_shard_file(name: Any) -> bool:
    """Whether ``name`` is a plain name of a file DCP writes: a process's ``__<rank>_<n>.distcp``."""
    return isinstance(name, str) and _SHARD_FILE.fullmatch(name) is not None


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
            part_tensors, plain[name] = split_tensors(part.state_dict(), name)
            tensors.update(part_tensors)
        self.tensors, self.plain = tensors, plain
        return self


def layout_of(processes: Processes) -> str:
    """How a state written by ``processes`` holds its sharded parts: in one file (:data:`~pytorch_accel_trainer.
    state.files.ONE_FILE`) when one process writes it, else one shard per process through DCP
    (:data:`~pytorch_accel_trainer.state.files.SHARDED`)."""
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
    if layout == ONE_FILE:
        checksums[PARTS_FILE] = save_tensors_file(_full_state_dicts(content), folder / PARTS_FILE)
    else:
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
    if not isinstance(saved, dict) or not all(isinstance(state, dict) for state in saved.values()):
        raise CheckpointError(f"{path}: not the state dicts of a state's parts, by name; it was altered.")
    return saved


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
        saved = read_parts_file(folder, mmap=True)
        shapes = {
            name: tuple(tensor.shape)
            for part in parts
            for name, tensor in split_tensors(saved.get(part, {}), part)[0].items()
        }
    else:
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
        saved = read_parts_file(folder, mmap=True)  # the verified file's pages, read as they are copied
        for name, part in parts.items():
            if name not in saved:
                raise CheckpointError(
                    f"{folder / PARTS_FILE}: holds no {name}, which its trainer file lists; it was altered."
                )
            # a model copies what it is given; an optimizer keeps it, so it is given copies, never the mapped file
            part.load_state_dict(saved[name] if isinstance(part, ModelState) else copy.deepcopy(saved[name]))
        return
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
