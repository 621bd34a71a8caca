"""A sharded training state's tensors: one shard per process, written and read through
``torch.distributed.checkpoint`` (DCP), when several processes write a state (one process writes one file:
``parts.py``).

Each process writes the part of the model's and optimizer's tensors it holds (under FSDP its shard; under DDP DCP's
planner spreads the replicated tensors over the processes), in parallel, straight from the live tensors: no process
gathers the full state. DCP's metadata (``.metadata``, written by the main process after every process wrote its
files) records which piece of which tensor lies where, so that a state loads into any number of processes, each
reading only the bytes of its own shard.

What this module adds to DCP, which has no checksum and reads back with pickle:

- **Checksums as written.** Every file a process writes goes through the checksum stream of ``files.py`` (its size
  and XXH3-128 computed as the bytes pass, no second read); the caller gathers them into the state's manifest, which
  is written last (``folder.py``).
- **No pickle on reading.** DCP pickles its metadata and would unpickle any "bytes" entry it finds; the reader here
  rebuilds the metadata with an unpickler that knows DCP's own few classes only (:func:`read_metadata`), and refuses
  a "bytes" entry (only tensors are ever written: the plain values of a state go to its torch files).

Imported when a state of several processes is written or read, never with the package: DCP costs about a second of
start-up that one-process runs do not need.
"""

from __future__ import annotations

import io
import os
import pickle
import re
import threading
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Optional, cast

import torch
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from pytorch_accel_trainer.state.files import SHARDS_METADATA_FILE, DamagedStateError, HashingStream

#: The file DCP's main process writes last, naming where every piece of every tensor is.
METADATA_FILE = SHARDS_METADATA_FILE
#: The files of a process's shard: ``__<rank>_<n>.distcp``.
_SHARD_FILE = re.compile(r"__\d+_\d+\.distcp")

# DCP warns on every save and load of a single process that it "assumes the intent" is one process, even when told
# so (no_dist=True): it is the intent here, so a run of one process is not given that warning at each save.
warnings.filterwarnings(
    "ignore", message=r"torch\.distributed is disabled, unavailable or uninitialized, assuming the intent is to"
)


class _ChecksummedFileSystem(FileSystem):
    """DCP's local file system, whose written files are checksummed as they are written (see :class:`HashingStream`),
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
            stream = HashingStream(handle)
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
