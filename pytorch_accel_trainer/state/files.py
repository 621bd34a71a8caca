"""The files of a training state on disk: their names, durable writes, the manifest's schema and reads that never
leave the state's folder. A leaf: it imports nothing of the package (``folder.py`` builds a state's folder on it).

A training state is input like any other: a manifest may have been edited, a file replaced by a link. So every
name the manifest lists must be a plain file name inside the folder, no file is opened through a symbolic link
(``O_NOFOLLOW``; the size and hash of a file are read from the very file that was opened), and every field the
manifest claims is checked for its type and range before anything is sized or looped over from it. A problem
raises :class:`DamagedStateError`, which ``folder.py`` turns into the library's ``CheckpointError``;
its message names only the folder and the file, and tells nothing of what lies outside the folder.
"""

from __future__ import annotations

import contextlib
import errno
import io
import mmap
import os
import re
import shutil
import socket
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch
import xxhash

#: The one format of training states, written and read: the sharded parts in the manifest's ``layout`` (one file
#: written by one process, or one shard per process through DCP), each file listed as ``{"size", "xxh3_128"}``; a
#: state of any other is refused (``folder.StateFormatError``).
FORMAT_VERSION = 5
#: The manifest's key for the checksum of each file: XXH3-128 (xxhash), which hashes at memory speed.
CHECKSUM = "xxh3_128"
_DIGEST = re.compile(r"[0-9a-f]{32}")  # an XXH3-128 digest in hex
MANIFEST_NAME = "manifest.json"
LATEST_NAME = "latest"
STATE_PREFIX = "checkpoint-"
TEMPORARY_PREFIX = ".tmp-"
TRAINER_FILE = "trainer_state.pt"
#: A one-file state's sharded parts: their full state dicts, by part name (``parts.py``)
PARTS_FILE = "parts.pt"
#: DCP's metadata: where each piece of each tensor of a sharded state lies (``shards.py``)
SHARDS_METADATA_FILE = ".metadata"
#: How a state holds its sharded parts (the manifest's ``layout``): ``one_file``, written by one process, holds
#: their full state dicts in :data:`PARTS_FILE`; ``sharded``, written by several, holds one shard per process (DCP);
#: ``deepspeed`` holds the files DeepSpeed's engine wrote itself (``save_checkpoint``: model, optimizer and ZeRO
#: partitions, each process its own), beside the trainer's own files.
ONE_FILE, SHARDED, DEEPSPEED = "one_file", "sharded", "deepspeed"
#: The files every state of each layout holds.
REQUIRED_FILES = {
    ONE_FILE: (PARTS_FILE, TRAINER_FILE),
    SHARDED: (SHARDS_METADATA_FILE, TRAINER_FILE),
    DEEPSPEED: (TRAINER_FILE,),
}
RESTORE_POINTS = ("before_iterator", "after_iterator")
KINDS = ("rolling", "permanent", "best")
#: A run's identity in a manifest: a uuid4 in hex, made as a new run starts and adopted by each resume of it.
RUN_ID = re.compile(r"[0-9a-f]{32}")
#: A file in a temporary state folder naming its writer, ``.writer-<host>-<pid>``; never part of the manifest.
WRITER_MARKER_PREFIX = ".writer-"

#: A manifest lists a few small entries per process: far below this even for thousands of processes.
MAX_MANIFEST_BYTES = 64 * 1024 * 1024
_RANK_FILE = re.compile(r"rank_\d{5,}\.pt")
# O_NOFOLLOW makes open() fail on a symbolic link (ELOOP) instead of reading what it points to; O_NONBLOCK keeps
# a FIFO planted under a file's name from blocking the open (it is then refused as not a regular file)
_OPEN_FLAGS = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0)


def crash_point(name: str) -> None:
    """Called by the writers of a state (``folder``, ``parts``, ``storage``) between the steps of a save, with the
    step's name (``"manifest"``, ``"write:trainer_state.pt"``, ``"upload:manifest.json"``, ...); does nothing. A
    test replaces it (``monkeypatch.setattr(files, "crash_point", crash)``) to stop a save at one point and check
    what a crash there leaves."""


class DamagedStateError(ValueError):
    """A training state, or one of its files, that cannot be trusted; the message names it and what is wrong."""


def rank_file(rank: int) -> str:
    """The name of the file holding one process's own state (RNG, loss sums, callback states)."""
    return f"rank_{rank:05d}.pt"


def is_real_directory(path: Path) -> bool:
    """Whether ``path`` is a directory itself, not a symbolic link to one."""
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except OSError:
        return False


#: The names the trainer gives states: ``checkpoint-<updates>`` (``save_training_state``), and ``epoch_<N>``,
#: ``step_<N>``, ``final`` (``SaveTrainingStateCallback``, as pytorch-accelerated names them); ``-<k>`` when taken.
_STATE_NAME = re.compile(r"(checkpoint-\d+|epoch_\d+|step_\d+|final)(-\d+)?")


def _save_rank(name: str) -> tuple:
    """Of states taken at one position, which came later: ``final`` after the others, ``-2`` after no suffix."""
    match = _STATE_NAME.fullmatch(name)
    if match is None:
        return (0, 0)
    return (match.group(1) == "final", int(match.group(2)[1:]) if match.group(2) else 1)


def is_state_name(name: str) -> bool:
    """Whether ``name`` is one the trainer gives a training-state folder."""
    return _STATE_NAME.fullmatch(name) is not None


def default_state_name(num_update_steps_completed: int) -> str:
    return f"{STATE_PREFIX}{num_update_steps_completed:08d}"


def validate_state_name(name: str) -> None:
    """Refuse a state folder name that is not one plain folder name, or that a folder of states keeps for itself:
    blank, a path, ``latest``, the manifest's name (a folder holding it is one state, not a folder of them), or a
    hidden name (its temporaries and writers' markers)."""
    if (
        not isinstance(name, str)
        or not name.strip()
        or Path(name).name != name
        or name in (LATEST_NAME, MANIFEST_NAME)
        or name.startswith(".")
    ):
        raise ValueError(
            f"name={name!r} is not a training-state folder name: pass one plain folder name (not blank, no '/', not "
            f"{LATEST_NAME!r} or {MANIFEST_NAME!r}, not starting with '.': a folder of states keeps those names for "
            "itself), e.g. 'epoch_5'; the folder is made under output_dir."
        )


def state_folders(parent: Path) -> list[Path]:
    """The folders of ``parent`` that are training states: named as the trainer names them, or holding a manifest
    (a state saved under a name of the user's); links to folders included (to report them)."""
    return sorted(
        path
        for path in parent.iterdir()
        if path.is_dir() and (is_state_name(path.name) or (path / MANIFEST_NAME).is_file())
    )


def temporary_folder(final_folder: Path) -> Path:
    """Where a state is written before it is renamed to ``final_folder``."""
    return final_folder.with_name(f"{TEMPORARY_PREFIX}{final_folder.name}")


def unused_folder_name(parent: Path, name: str) -> Path:
    """``parent / name``, or with a ``-2``, ``-3``... suffix when a state of that name exists: never overwrite."""
    candidate, counter = parent / name, 1
    while os.path.lexists(candidate):
        counter += 1
        candidate = parent / f"{name}-{counter}"
    return candidate


def folder_writer(temporary: Path) -> Optional[tuple[str, int]]:
    """The host and pid of the process writing a temporary state folder, from its marker; ``None`` without one."""
    for path in temporary.iterdir():
        if path.name.startswith(WRITER_MARKER_PREFIX):
            host, _, pid = path.name[len(WRITER_MARKER_PREFIX) :].rpartition("-")
            return (host, int(pid)) if pid.isdigit() else None
    return None


@dataclass
class StoredState:
    """A training-state folder and its manifest (checked for types and ranges by :func:`validate_manifest`)."""

    folder: Path
    manifest: dict = field(repr=False)
    #: The state's URL, for one downloaded from object storage (``folder`` is then its copy in the mirror).
    url: Optional[str] = field(default=None, compare=False)
    #: A one-file state's sharded parts, read as its parts file was verified (``folder.verify_folder(read_parts=
    #: True)``), for its load to take (:meth:`take_parts`): the file is read once.
    parts: Optional[dict] = field(default=None, repr=False, compare=False)

    def take_parts(self) -> Optional[dict]:
        """The parts read as the state was verified (``None``: not read), handed over: the state keeps none."""
        parts, self.parts = self.parts, None
        return parts

    @property
    def order(self) -> tuple:
        """Sort key: later positions in the run are newer."""
        position = self.manifest["position"]
        return (
            self.manifest["num_update_steps_completed"],
            position["loop_epoch"],
            position["batches_seen"],
            position["rng_restore_point"] == "after_iterator",
            _save_rank(self.folder.name),  # of two states at one position, the one saved later
            self.folder.name,
        )

    @property
    def layout(self) -> str:
        """How the state holds its sharded parts: :data:`ONE_FILE`, :data:`SHARDED` or :data:`DEEPSPEED`."""
        return self.manifest["layout"]

    @property
    def kinds(self) -> set:
        return set(self.manifest["kinds"])

    @property
    def run_id(self) -> str:
        """The identity of the run that wrote the state."""
        return self.manifest["run_id"]


# ------------------------------------------------------------------------------------------------
# Writing a file of a state, flushed to disk
# ------------------------------------------------------------------------------------------------


def fsync_path(path: Path) -> None:
    """Flush a written file, or a folder's entries (after a rename), to disk."""
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def current_umask() -> int:
    """The process's file-mode creation mask (read from ``/proc`` where it can be, so that no other thread ever sees
    a changed mask)."""
    try:
        with open("/proc/self/status") as handle:
            for line in handle:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def follow_umask(path: Path) -> None:
    """Give a file written by safetensors (which creates it with mode 0600) the mode of every other file the
    process writes, ``0666`` less the umask, so a teammate or a serving job can read the weights."""
    os.chmod(path, 0o666 & ~current_umask())


def write_text_atomically(path: Path, text: str) -> None:
    """Replace ``path`` with ``text`` at once: a crash leaves the old text or the new."""
    temporary = path.with_name(f"{TEMPORARY_PREFIX}{path.name}")
    with open(temporary, "w") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(temporary, path)


# ------------------------------------------------------------------------------------------------
# Reading a file of a state: never through a link, never outside the folder
# ------------------------------------------------------------------------------------------------


def validate_file_name(name) -> None:
    """Refuse a name that is not a plain file name (no separator, ``..``, absolute path or NUL)."""
    separators = {"/", "\\", os.sep, *([os.altsep] if os.altsep else [])}
    if (
        not isinstance(name, str)
        or name in ("", ".", "..")
        or "\x00" in name
        or any(separator in name for separator in separators)
    ):
        raise DamagedStateError(
            f"the manifest lists {name!r}, which is not a plain file name inside the state's folder (a state's files "
            "are never read through a path that leaves it)"
        )


def _open_regular_file(path: Path) -> tuple[int, os.stat_result]:
    """Open ``path`` for reading without following a link; return the descriptor and the opened file's status."""
    try:
        descriptor = os.open(path, _OPEN_FLAGS)
    except OSError as error:
        if os.path.islink(path):
            raise DamagedStateError(
                f"{path}: a symbolic link; a state's files must be regular files in its folder"
            ) from error
        raise
    status = os.fstat(descriptor)
    if not stat.S_ISREG(status.st_mode):
        os.close(descriptor)
        raise DamagedStateError(f"{path}: not a regular file")
    return descriptor, status


#: The part of a file mapped in memory at a time while it is hashed: what verifying a state adds to a process's
#: resident memory, whatever the state's size (the pages are the page cache's; unmapped as the hash moves on).
HASH_WINDOW = 64 * 1024 * 1024
#: The pieces in which :class:`HashingStream` and :class:`HashingReader` hash the bytes they pass: each is hashed
#: while it is in the CPU's cache, so that the checksum adds no pass over memory.
HASH_PIECE = 1024 * 1024


class HashingStream(io.RawIOBase):
    """A write-only binary stream over a file that computes the size and XXH3-128 of what passes through it, so a
    file's checksum costs no second read (the torch files of ``parts.py``, DCP's files of ``shards.py``)."""

    def __init__(self, handle) -> None:
        super().__init__()
        self._handle, self._hasher, self.size = handle, xxhash.xxh3_128(), 0

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        for start in range(0, len(view), HASH_PIECE):  # each piece written while the hash left it in the CPU's cache
            piece = view[start : start + HASH_PIECE]
            self._hasher.update(piece)
            self._handle.write(piece)
        self.size += len(view)
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


class HashingReader(io.RawIOBase):
    """A read-only binary stream over the regular file ``path`` (opened without following a link) that computes the
    file's size and XXH3-128 from the bytes read through it, as they land where they are read to: a reader that reads
    the file in order (``torch.load`` reads a torch file's records in the order ``torch.save`` wrote them) has it
    hashed with no second read. Bytes read ahead of what was hashed are left to be hashed when the hash reaches them
    (a gap of at most :data:`HASH_PIECE` is read for the hash at once: a torch file's record headers); :meth:`finish`
    reads and hashes whatever no read reached, and returns the size and digest, which the caller compares with the
    manifest before it uses anything read.

    Raises:
        FileNotFoundError: there is no such file.
        DamagedStateError: ``path`` is a symbolic link or not a regular file.
    """

    def __init__(self, path: Path) -> None:
        super().__init__()
        self._descriptor, status = _open_regular_file(path)
        self.size, self._position, self._hashed, self._hasher = status.st_size, 0, 0, xxhash.xxh3_128()

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        self._position = offset + {os.SEEK_SET: 0, os.SEEK_CUR: self._position, os.SEEK_END: self.size}[whence]
        return self._position

    def tell(self) -> int:
        return self._position

    def readinto(self, buffer) -> int:
        view = memoryview(buffer).cast("B")
        if self._hashed < self._position <= self._hashed + HASH_PIECE:
            self._hash_up_to(self._position)
        done = 0
        while done < len(view):
            start = self._position + done
            read = os.preadv(self._descriptor, [view[done : done + HASH_PIECE]], start)
            if read == 0:
                break
            if start <= self._hashed < start + read:  # the piece reaches past the hash: hashed while in the cache
                self._hasher.update(view[done + self._hashed - start : done + read])
                self._hashed = start + read
            done += read
        self._position += done
        return done

    def _hash_up_to(self, end: int) -> None:
        scratch = bytearray(HASH_PIECE)
        while self._hashed < end:
            read = os.preadv(
                self._descriptor, [memoryview(scratch)[: min(HASH_PIECE, end - self._hashed)]], self._hashed
            )
            if read == 0:
                break
            self._hasher.update(memoryview(scratch)[:read])
            self._hashed += read

    def finish(self) -> tuple[int, str]:
        """Hash what no read reached; return the file's size and XXH3-128 (``""`` if it ended before its size)."""
        self._hash_up_to(self.size)
        return self.size, self._hasher.hexdigest() if self._hashed == self.size else ""

    def close(self) -> None:
        if not self.closed:
            os.close(self._descriptor)
        super().close()


def file_digest(path: Path, expected_size: Optional[int] = None) -> tuple[int, str]:
    """The size and XXH3-128 digest (32 hex digits) of the regular file ``path``, read from the file opened (not
    through a link) and mapped in memory :data:`HASH_WINDOW` bytes at a time: no copy, at memory speed, and at most
    a window resident. The digest is ``""``, and the file not read, when its size is not ``expected_size``.

    Raises:
        FileNotFoundError: there is no such file.
        DamagedStateError: ``path`` is a symbolic link or not a regular file.
    """
    descriptor, status = _open_regular_file(path)
    try:
        if expected_size is not None and status.st_size != expected_size:
            return status.st_size, ""
        if status.st_size == 0:  # an empty file cannot be mapped
            return 0, xxhash.xxh3_128_hexdigest(b"")
        hasher = xxhash.xxh3_128()
        for offset in range(0, status.st_size, HASH_WINDOW):  # a multiple of mmap.ALLOCATIONGRANULARITY
            length = min(HASH_WINDOW, status.st_size - offset)
            with mmap.mmap(descriptor, length, access=mmap.ACCESS_READ, offset=offset) as mapped:
                hasher.update(mapped)
        return status.st_size, hasher.hexdigest()
    finally:
        os.close(descriptor)


def read_small_text(path: Path, limit: int = MAX_MANIFEST_BYTES) -> str:
    """The text of the regular file ``path`` (not through a link), refused beyond ``limit`` bytes."""
    descriptor, status = _open_regular_file(path)
    with os.fdopen(descriptor, "rb") as handle:
        if status.st_size > limit:
            raise DamagedStateError(f"{path}: {status.st_size} bytes, more than any manifest ({limit})")
        data = handle.read(limit + 1)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise DamagedStateError(f"{path}: not UTF-8 text ({error})") from error


# ------------------------------------------------------------------------------------------------
# The manifest's schema: types and ranges, checked before any value is used
# ------------------------------------------------------------------------------------------------


def _is_count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def validate_position(position) -> None:
    """Check a saved position for its fields' types and ranges; raise :class:`DamagedStateError`."""
    if not isinstance(position, dict) or set(position) != {
        "loop_epoch",
        "batches_seen",
        "epoch_samples",
        "rng_restore_point",
    }:
        raise DamagedStateError(
            f"position is {position!r}; it must be a dict of loop_epoch, batches_seen, epoch_samples and "
            "rng_restore_point"
        )
    for name in ("loop_epoch", "batches_seen", "epoch_samples"):
        if not _is_count(position[name]):
            raise DamagedStateError(f"position[{name!r}] is {position[name]!r}; it must be a whole number >= 0")
    if position["rng_restore_point"] not in RESTORE_POINTS:
        raise DamagedStateError(
            f"position['rng_restore_point'] is {position['rng_restore_point']!r}; it must be one of {RESTORE_POINTS}"
        )


def _validate_files(files, layout: str) -> None:
    if not isinstance(files, dict):
        raise DamagedStateError(
            f"files is a {type(files).__name__}; it must map each file name to its size and {CHECKSUM}"
        )
    for name, entry in files.items():
        validate_file_name(name)
        if (
            not isinstance(entry, dict)
            or not _is_count(entry.get("size"))
            or not isinstance(entry.get(CHECKSUM), str)
            or not _DIGEST.fullmatch(entry[CHECKSUM])
        ):
            raise DamagedStateError(
                f"files[{name!r}] is {entry!r}; it must be {{'size': a whole number >= 0, '{CHECKSUM}': 32 hex digits}}"
            )
    missing = [name for name in REQUIRED_FILES[layout] if name not in files]
    if missing:
        raise DamagedStateError(f"files lists no {missing[0]}, which every training state of layout {layout!r} holds")


def _validate_world_size(world_size, files: dict, run_facts: dict, layout: str) -> None:
    """A state holds one rank file per process that saved it, no more, no fewer; its run's settings name the same
    number (an edited ``world_size`` would have a process read another's file); a one-file state, one process's."""
    rank_files = sum(1 for name in files if _RANK_FILE.fullmatch(name))
    if not _is_count(world_size) or world_size != rank_files or world_size < 1:
        raise DamagedStateError(
            f"world_size is {world_size!r}; it must be the number of rank files listed ({rank_files})"
        )
    missing = [rank_file(rank) for rank in range(world_size) if rank_file(rank) not in files]
    if missing:
        raise DamagedStateError(f"the manifest lacks {missing[0]} for a world size of {world_size}")
    saved_by = run_facts.get("world_size", world_size)  # outside train(), a save records no run settings
    if saved_by != world_size:
        raise DamagedStateError(f"world_size is {world_size!r}, but its run_facts say {saved_by!r}")
    if layout == ONE_FILE and world_size != 1:
        raise DamagedStateError(f"world_size is {world_size!r}, but a state of layout {ONE_FILE!r} is one process's")


def validate_manifest(manifest: dict) -> None:
    """Check every field of a manifest (of the format :data:`FORMAT_VERSION`) for its type and range.

    Raises:
        DamagedStateError: naming the first field that is missing, of the wrong type or out of range.
    """
    updates = manifest.get("num_update_steps_completed")
    if not _is_count(updates):
        raise DamagedStateError(f"num_update_steps_completed is {updates!r}; it must be a whole number >= 0")
    validate_position(manifest.get("position"))
    kinds = manifest.get("kinds")
    if not isinstance(kinds, list) or not kinds or not all(isinstance(kind, str) and kind in KINDS for kind in kinds):
        raise DamagedStateError(f"kinds is {kinds!r}; it must be a non-empty list of {KINDS}")
    if not isinstance(manifest.get("run_facts"), dict):
        raise DamagedStateError(f"run_facts is {manifest.get('run_facts')!r}; it must be a dict")
    run_id = manifest.get("run_id")
    if not (isinstance(run_id, str) and RUN_ID.fullmatch(run_id)):
        raise DamagedStateError(f"run_id is {run_id!r}; it must be 32 hex digits")
    layout = manifest.get("layout")
    if not isinstance(layout, str) or layout not in REQUIRED_FILES:
        raise DamagedStateError(f"layout is {layout!r}; it must be one of {tuple(REQUIRED_FILES)}")
    _validate_files(manifest.get("files"), layout)
    _validate_world_size(manifest.get("world_size"), manifest["files"], manifest["run_facts"], layout)


# ------------------------------------------------------------------------------------------------
# Values a file may hold, and the writes killed or cut short (training states and export checkpoints alike)
# ------------------------------------------------------------------------------------------------

_PLAIN_TYPES = (str, int, float, bool, type(None), torch.Tensor, torch.dtype, torch.device, torch.Size)
_MAX_PID = 1 << 22  # Linux's highest pid_max; a larger number is no process id (and would overflow os.kill)


def validate_plain(value: Any, where: str) -> None:
    """Refuse a value that would need pickle to load back, naming where it is."""
    if isinstance(value, dict):
        for key, item in value.items():
            validate_plain(key, f"{where} key")
            validate_plain(item, f"{where}[{key!r}]")
    elif isinstance(value, (list, tuple, set)):
        for index, item in enumerate(value):
            validate_plain(item, f"{where}[{index}]")
    elif not isinstance(value, _PLAIN_TYPES):
        raise TypeError(
            f"{where} is a {type(value).__name__}, which cannot be loaded back without pickle (checkpoints load with "
            "weights_only=True, so that loading one never runs code). Store tensors, numbers, strings, lists or "
            "dicts of them instead, e.g. a state_dict()."
        )


def writer_tag() -> str:
    """``<host>-<pid>`` of this process: who writes a temporary (a pid alone means nothing on a shared disk)."""
    return f"{socket.gethostname()}-{os.getpid()}"


def is_abandoned(host: Optional[str], pid: int) -> bool:
    """Whether the process ``pid`` of ``host`` (``None``: this host) is gone, so that its temporaries are garbage.

    A process of another host cannot be checked from here: its temporaries are kept.
    """
    if (host is not None and host != socket.gethostname()) or not 0 < pid <= _MAX_PID:
        return False  # pid 0 would ask about our own process group
    try:
        os.kill(pid, 0)  # signal 0: only asks whether the process exists
    except ProcessLookupError:
        return True
    except PermissionError:
        return False  # it exists, under another user
    return False


def _is_out_of_space(error: BaseException, folder: Path) -> bool:
    """Whether a failed write ran out of disk space. torch's writer may report it without an errno ("enforce fail
    at inline_container.cc ... unexpected pos"), so an almost full disk counts as the cause too."""
    if isinstance(error, OSError) and error.errno == errno.ENOSPC:
        return True
    if "No space left" in str(error) or "ENOSPC" in str(error):
        return True
    try:
        return shutil.disk_usage(folder).free < 1 << 20
    except OSError:
        return False


@contextlib.contextmanager
def reporting_out_of_space(temporary: Path, target: Path, what: str, kept: str):
    """Turn a write into ``temporary`` that runs out of disk space into one ``OSError(ENOSPC)`` naming ``target``
    and ``what`` was not written, after removing the partial ``temporary`` (a file or a folder); ``kept`` says what
    is left unchanged."""
    try:
        yield
    except (OSError, RuntimeError) as error:
        if not _is_out_of_space(error, temporary.parent):
            raise
        # removed before the free space is measured: the partial files are not the user's to free
        if temporary.is_dir() and not temporary.is_symlink():
            shutil.rmtree(temporary, ignore_errors=True)
        else:
            temporary.unlink(missing_ok=True)
        raise OSError(
            errno.ENOSPC,
            f"no space left on {target}: {what} was not written ({_free_space(temporary.parent)} free after removing "
            f"the partial files; {type(error).__name__}: {error}). Free some space or save to another disk; {kept}",
        ) from error


def _free_space(folder: Path) -> str:
    try:
        return f"{shutil.disk_usage(folder).free} bytes"
    except OSError:
        return "unknown space"
