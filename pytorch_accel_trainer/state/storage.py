"""Object storage (``s3://``, ``gs://``, ``az://``, ``memory://``...) for training states and checkpoints, via fsspec.

A location is a local path or a URL; a URL is never taken as a path (``memory://bucket/states`` never becomes a local
folder named ``memory:``). fsspec and the store's package (s3fs, gcsfs, adlfs) are the user's choice, optional: a URL
whose package is missing is one ``ImportError`` naming it. Credentials and endpoints come from the store's usual
configuration (``AWS_*`` variables, ``~/.aws``, or fsspec's ``FSSPEC_S3_ENDPOINT_URL``-style variables).

Stores have no atomic rename, so a training state is made visible by writing its manifest last: each state is
written crash-safely to a node-local *mirror* folder (the same protocol as a local save, checksums computed as it
is written), uploaded file by file, the manifest after every other file, then ``latest``. A state whose manifest is
missing (an upload cut short) is never listed, so never resumed from nor pruned; older states are deleted only after
the new one is complete, their manifest first. The mirror keeps only the manifests once a state is uploaded, so that
naming and pruning work as on a local folder; it is synchronised with the store before the first save of a run.
Resuming downloads the chosen state's files once each into the mirror and verifies them there.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import shutil
import tempfile
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, NamedTuple, Optional, Union

from pytorch_accel_trainer.state import files as state_files
from pytorch_accel_trainer.state.files import LATEST_NAME, MANIFEST_NAME, WRITER_MARKER_PREFIX, temporary_folder

#: A local path, or the URL of a folder or file in object storage.
Location = Union[Path, str]

#: What a :class:`Destination` holds: training states a run resumes from (``train(resume_from=...)``).
TRAINING_STATES = "training states"
#: What a :class:`Destination` holds: files the run exports (checkpoints, weights), not resumed from.
CHECKPOINTS = "checkpoints"


class Destination(NamedTuple):
    """A folder (or object-storage URL) a run writes to, as a callback declares it
    (:meth:`~pytorch_accel_trainer.callbacks.base.TrainerCallback.writes_to`).

    Before the first batch the trainer checks every destination alike: it can be written (each process probes it),
    a local one is the same folder on every node, and one of ``TRAINING_STATES`` is no ``memory://`` store of one
    process when several run; the time budget saves its stop state in the first one of ``TRAINING_STATES``.

    Attributes:
        location: the folder or URL written to.
        holds: :data:`TRAINING_STATES` or :data:`CHECKPOINTS`.
        given_as: where the user gave it, for the messages, e.g. ``"SaveTrainingStateCallback(save_dir=...)"``.
    """

    location: Location
    holds: str
    given_as: str


def declared_destinations(callbacks: Any) -> list[Destination]:
    """What the callbacks declare they write (``TrainerCallback.writes_to``), in their order; a callback that does not
    derive from ``TrainerCallback`` and has no ``writes_to`` declares nothing."""
    return [destination for callback in callbacks for destination in (getattr(callback, "writes_to", None) or tuple)()]


_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")

#: The package that gives fsspec each protocol, for the error that names it.
_PACKAGES = {
    "s3": "s3fs",
    "s3a": "s3fs",
    "gs": "gcsfs",
    "gcs": "gcsfs",
    "az": "adlfs",
    "abfs": "adlfs",
    "abfss": "adlfs",
    "adl": "adlfs",
    "hf": "huggingface_hub",
}


#: A URL that lost a slash: ``str(Path("s3://bucket") / "states")`` is ``"s3:/bucket/states"``. One letter before
#: the colon is a Windows drive (``C:/runs``), not a store.
_URL_MISSING_SLASH = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]+):/+(?!/)")

#: What :func:`os.path.expandvars` leaves of a variable that is not set.
_UNSET_VARIABLE = re.compile(r"\$(\{[^}]*\}|[A-Za-z_][A-Za-z0-9_]*)")


def is_url(location: Any) -> bool:
    """Whether ``location`` is a URL of a store (``file://`` URLs are local paths)."""
    return isinstance(location, str) and bool(_URL.match(location)) and not location.startswith("file://")


def as_location(location: Any) -> Location:
    """A URL as it is (without a trailing ``/``), anything else as a :class:`Path` (``file://`` removed, ``~`` and
    environment variables expanded: see :func:`local_path`).

    Raises:
        ValueError: a URL that names no bucket (``"s3://"``), or a path that is not one (see :func:`local_path`).
    """
    if is_url(location):
        if not location.split("://", 1)[1].strip("/"):
            raise ValueError(
                f"{location!r} names a store but no bucket or folder in it: write the whole URL, e.g. "
                f"'{location.split('://', 1)[0]}://my-bucket/states'."
            )
        return location.rstrip("/")
    if isinstance(location, str) and location.startswith("file://"):
        return local_path(location[len("file://") :])
    return local_path(location)


def local_path(location: Any) -> Path:
    """``location`` as a local :class:`Path`, with ``~`` and ``$VARIABLE`` / ``${VARIABLE}`` expanded as a shell
    would (``output_dir: ~/runs`` in a config file is the home folder's ``runs``, never a folder named ``~``).

    Raises:
        ValueError: ``location`` names an environment variable that is not set, or is a URL that lost one of its
            slashes (``"s3:/bucket/states"``, what ``str(Path("s3://bucket") / "states")`` gives): either would
            otherwise become a local folder of that literal name.
    """
    text = os.fspath(location)
    missing_slash = _URL_MISSING_SLASH.match(text)
    if missing_slash:
        protocol = missing_slash.group(1)
        rest = text[missing_slash.end() :]
        raise ValueError(
            f"{text!r} looks like a URL of a {protocol}:// store that lost a slash (pathlib.Path joins URLs this way: "
            f"str(Path('{protocol}://bucket') / 'states') is '{protocol}:/bucket/states'). Write the URL as a string, "
            f"'{protocol}://{rest}' (join with '/', not Path), or give a local path."
        )
    expanded = os.path.expanduser(os.path.expandvars(text))
    unset = _UNSET_VARIABLE.search(expanded)
    if unset:
        raise ValueError(
            f"{text!r} names the environment variable {unset.group(0)}, which is not set: set it (export "
            f"{unset.group(1).strip('{}')}=...), or write the path out; a literal folder named {unset.group(0)!r} "
            "is not made."
        )
    return Path(expanded)


def validate_location(location: Any) -> None:
    """For a URL, check now that fsspec and the store's package are installed (the ``ImportError`` of
    :func:`filesystem`), so that a run never learns it after an epoch's work; a path needs nothing."""
    if is_url(location):
        filesystem(location)


def parent(location: Location) -> Location:
    """The folder of the file ``location``, for a path or a URL."""
    if isinstance(location, str):
        return location.rsplit("/", 1)[0] if location.split("://", 1)[1].count("/") else location
    return location.parent


def join(location: Location, name: str) -> Location:
    """``location / name``, for a path or a URL."""
    return f"{location}/{name}" if isinstance(location, str) else location / name


def filesystem(url: str) -> tuple[Any, str]:
    """The fsspec filesystem of ``url`` and the path on it.

    Raises:
        ImportError: fsspec, or the package of the URL's store, is not installed (naming it).
        ValueError: fsspec knows no store of that protocol.
    """
    protocol = url.split("://", 1)[0].lower()
    package = _PACKAGES.get(protocol)
    try:
        import fsspec
    except ImportError as error:
        packages = f"fsspec {package}" if package else "fsspec"
        raise ImportError(
            f"{url!r} is an object-storage URL, which needs {packages}: pip install {packages} (for S3, pip install "
            "'pytorch-accel-trainer[s3]')."
        ) from error
    try:
        fs, path = fsspec.core.url_to_fs(url)
    except ImportError as error:
        name = package or f"the package of fsspec's {protocol}:// store"
        raise ImportError(
            f"{url!r} needs {name} (fsspec's {protocol}:// store), which is not installed: pip install {name}."
        ) from error
    except ValueError as error:
        raise ValueError(
            f"{url!r}: fsspec knows no store {protocol}:// ({error}); pass a local path, or a URL of a store fsspec "
            "supports (s3://, gs://, az://, memory://...)."
        ) from error
    return fs, path.rstrip("/")


# ------------------------------------------------------------------------------------------------
# Destinations checked before a run's first batch
# ------------------------------------------------------------------------------------------------

#: The name of the files that probe a destination (hidden: never a training state, never listed).
_PROBE_PREFIX = ".pytorch_accel_trainer-probe-"
#: How much the probe that measures a destination's speed writes.
_PROBE_BYTES = 4 << 20


@dataclass(frozen=True)
class WriteSpeed:
    """How fast a destination took the probe's files: the cost of one file (its creation, flush and ``fsync``, or
    its request to a store) and of each byte."""

    seconds_per_file: float
    seconds_per_byte: float

    def seconds_for(self, num_files: int, num_bytes: int) -> float:
        return num_files * self.seconds_per_file + num_bytes * self.seconds_per_byte


def probe_destination(location: Any, use: str, measure: bool = False) -> Optional[WriteSpeed]:
    """Check now that the folder ``location`` (a path, or a store's URL) can be written, by writing a small hidden
    file there (or, for a folder not made yet, in its nearest existing parent) and removing it; with ``measure``, also
    write ``_PROBE_BYTES`` and return how fast it went. A run learns this before its first batch, not at its first
    save (or at its end, for the save of a time budget). ``memory://`` needs no check.

    Raises:
        OSError: the folder cannot be written (a file in the way, no permission, a read-only disk, a store's missing
            bucket or refused credentials), naming ``use``, the location and the cause.
    """
    target = as_location(location)
    if isinstance(target, str) and target.startswith("memory://"):
        return None
    try:
        return _probe_store(target, measure) if isinstance(target, str) else _probe_folder(target, measure)
    except ImportError:
        raise  # the store's package: its own error names it
    except Exception as error:  # whatever the disk or the store's client raises: one error that names the place
        cause = f"{type(error).__name__}: {error}"
        raise OSError(
            f"{str(target)!r} ({use}) cannot be written ({cause}). Nothing was trained: pass a folder this process can "
            "write (for a store: an existing bucket, with credentials that may write to it)."
        ) from error


def _probe_folder(folder: Path, measure: bool) -> Optional[WriteSpeed]:
    existing = next(parent for parent in (folder, *folder.absolute().parents) if os.path.lexists(parent))
    if not existing.is_dir():
        raise NotADirectoryError(f"{str(existing)!r} is a file, where a folder is needed")
    probe = existing / f"{_PROBE_PREFIX}{os.getpid()}"
    try:
        small = _timed_write(probe, b"")
        large = _timed_write(probe, bytes(_PROBE_BYTES)) if measure else None
    finally:
        probe.unlink(missing_ok=True)
    return None if large is None else WriteSpeed(small, max(large - small, 0.0) / _PROBE_BYTES)


def _timed_write(path: Path, data: bytes) -> float:
    started = time.monotonic()
    with open(path, "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())  # what a training state's files cost: each is synced to the disk
    return time.monotonic() - started


def _probe_store(url: str, measure: bool) -> Optional[WriteSpeed]:
    fs, path = filesystem(url)
    probe = f"{path}/{_PROBE_PREFIX}{os.getpid()}"
    try:
        started = time.monotonic()
        fs.pipe_file(probe, b"")
        small = time.monotonic() - started
        if not measure:
            return None
        started = time.monotonic()
        fs.pipe_file(probe, bytes(_PROBE_BYTES))
        large = time.monotonic() - started
        return WriteSpeed(small, max(large - small, 0.0) / _PROBE_BYTES)
    finally:
        with contextlib.suppress(FileNotFoundError):
            fs.rm_file(probe)


# ------------------------------------------------------------------------------------------------
# Single files: checkpoints and weights
# ------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def local_file_to_write(location: Any) -> Iterator[Path]:
    """A local path to write ``location`` at: the path itself, or for a URL a temporary file uploaded (one atomic
    object write) when the block ends without an error."""
    target = as_location(location)
    if isinstance(target, Path):
        yield target
        return
    fs, path = filesystem(target)
    with tempfile.TemporaryDirectory(prefix="pytorch_accel_trainer-upload-") as folder:
        local = Path(folder) / Path(path).name
        yield local
        fs.put_file(str(local), path)


def write_text(location: Any, text: str) -> None:
    """Write ``text`` to the file ``location`` (a path, or a URL: one object)."""
    with local_file_to_write(location) as path:
        path.write_text(text)


def exists(location: Any) -> bool:
    """Whether a file or folder is at ``location`` (in a store: an object, or objects under it as a prefix)."""
    target = as_location(location)
    if isinstance(target, Path):
        return target.exists()
    fs, path = filesystem(target)
    return bool(fs.exists(path))


@contextlib.contextmanager
def local_file_to_read(location: Any) -> Iterator[Path]:
    """A local path to read ``location`` from: the path itself, or for a URL a downloaded temporary copy.

    Raises:
        FileNotFoundError: the URL names no object.
    """
    source = as_location(location)
    if isinstance(source, Path):
        yield source
        return
    fs, path = filesystem(source)
    if not fs.isfile(path):
        raise FileNotFoundError(f"{source!r}: no such object in the store.")
    with tempfile.TemporaryDirectory(prefix="pytorch_accel_trainer-download-") as folder:
        local = Path(folder) / Path(path).name
        fs.get_file(path, str(local))
        yield local


# ------------------------------------------------------------------------------------------------
# A folder of training states in a store, through a node-local mirror
# ------------------------------------------------------------------------------------------------


#: Why several processes cannot share training states in ``memory://``.
TRAINING_STATES_IN_MEMORY = (
    "each would write its part of a training state into its own memory, and no process could read a whole state back",
    "Nothing was trained.",
)


def validate_store_reaches_every_process(
    url: str, num_processes: int, use: str, consequence: tuple[str, str] = TRAINING_STATES_IN_MEMORY
) -> None:
    """Refuse ``memory://`` where several processes share what is written (training states, by default):
    fsspec's in-memory store lives inside one process. ``consequence`` is what would go wrong, and what was not done.

    Raises:
        ValueError: naming the URL, where it was given, and what to use instead.
    """
    if num_processes > 1 and str(url).startswith("memory://"):
        problem, outcome = consequence
        raise ValueError(
            f"{url!r} ({use}) is fsspec's in-memory store, which lives inside one process: with {num_processes} "
            f"processes {problem}. Use a folder every process sees, or a store they share (s3://, gs://, az://...). "
            f"{outcome}"
        )


def mirror_folder(url: str) -> Path:
    """The node-local folder that stands for the store folder ``url``: the same for every process of a machine, and
    another for each machine (named by the launcher's node rank), even where machines share a temporary folder."""
    digest = hashlib.sha256(url.encode()).hexdigest()[:16]
    node = os.environ.get("GROUP_RANK", os.environ.get("NODE_RANK", "0"))
    if url.startswith("memory://"):  # fsspec's memory store is each process's own: so is its mirror
        node = f"{node}-process{os.getpid()}"
    return Path(tempfile.gettempdir()) / "pytorch_accel_trainer-mirror" / f"{digest}-node{node}"


class RemoteStates:
    """The training states under ``url``, written and read through :func:`mirror_folder` (see the module's text)."""

    def __init__(self, url: str):
        self.url = url.rstrip("/")
        self.fs, self.root = filesystem(self.url)
        self.mirror = mirror_folder(self.url)
        self._manifest, self._latest = MANIFEST_NAME, LATEST_NAME

    def remote_names(self) -> tuple[set, set]:
        """The state folders in the store: those with a manifest (complete), and all of them."""
        self.fs.invalidate_cache(self.root)  # s3fs keeps listings: another process may have written since
        try:
            entries = self.fs.ls(self.root, detail=True)
        except FileNotFoundError:
            return set(), set()  # no object under the prefix yet: an empty folder of states
        folders = {Path(entry["name"]).name for entry in entries if entry.get("type") == "directory"}
        complete = {Path(path).parent.name for path in self.fs.glob(f"{self.root}/*/{self._manifest}")}
        return complete, folders | complete

    def sync_mirror(self) -> None:
        """Make the mirror hold the manifest of each complete state in the store (and an empty folder for each other
        name taken there, so that no name is reused); drop what the store no longer holds. One listing and one small
        read per state; the main process of a node."""
        self.mirror.mkdir(parents=True, exist_ok=True)
        complete, taken = self.remote_names()
        for local in self.mirror.iterdir():
            if local.is_dir() and local.name not in taken:
                shutil.rmtree(local, ignore_errors=True)
        for name in sorted(taken):
            folder = self.mirror / name
            folder.mkdir(exist_ok=True)
            self.drop_downloads(name)  # a state downloaded to resume: the mirror needs its manifest only
            if name not in complete:  # an upload cut short: not a state, whatever this mirror holds
                (folder / self._manifest).unlink(missing_ok=True)
            else:  # read again each time: the store is the truth (a state deleted there and its name reused)
                self.fs.get_file(f"{self.root}/{name}/{self._manifest}", str(folder / self._manifest))

    def publish(self, folder: Path) -> None:
        """Upload the sealed state ``folder`` (its manifest last), then delete from the store the states pruned from
        the mirror: the new state is complete in the store before any older one goes. Main process only."""
        self.upload(folder)
        self.prune_like_mirror(keep=folder.name)

    def publish_collectively(self, folder: Path, processes) -> None:
        """Upload a state written by every process (``processes``, a ``content.Processes``; every one must call
        this): each other machine's files first, from its mirror, then the main process publishes (manifest last)."""
        if processes.is_local_main and not processes.is_main:  # another machine: its processes' files
            self.upload_machine_files(temporary_folder(folder), folder.name)
        processes.barrier()  # every file is in the store before the manifest
        if processes.is_main:
            self.publish(folder)
        processes.barrier()

    def upload(self, folder: Path) -> None:
        """Upload the sealed state ``folder`` of the mirror: every file, its manifest last, then ``latest``; then
        keep only its manifest in the mirror."""
        remote = f"{self.root}/{folder.name}"
        files = sorted(path for path in folder.iterdir() if path.is_file() and path.name != self._manifest)
        for path in files:
            state_files.crash_point(f"upload:{path.name}")
            self.fs.put_file(str(path), f"{remote}/{path.name}")
        state_files.crash_point(f"upload:{self._manifest}")
        self.fs.put_file(str(folder / self._manifest), f"{remote}/{self._manifest}")  # visible from here on
        self.fs.pipe_file(f"{self.root}/{self._latest}", f"{folder.name}\n".encode())
        for path in files:
            path.unlink()

    def upload_machine_files(self, temporary: Path, name: str) -> None:
        """On another machine than the main process's: upload the files its processes wrote for state ``name`` (in
        its mirror's ``temporary`` folder) into the state's folder in the store, then remove the folder. The main
        process uploads the manifest, which lists them, after every machine did this."""
        for path in sorted(temporary.iterdir()):
            if path.is_file() and not path.name.startswith(WRITER_MARKER_PREFIX):
                state_files.crash_point(f"upload:{path.name}")
                self.fs.put_file(str(path), f"{self.root}/{name}/{path.name}")
        shutil.rmtree(temporary, ignore_errors=True)

    def prune_like_mirror(self, keep: str) -> None:
        """Delete from the store the complete states the mirror no longer holds (pruned there), never ``keep``:
        each one's manifest first, so that a deletion cut short leaves no state that looks complete."""
        complete, _ = self.remote_names()
        for name in sorted(complete - {keep}):
            if (self.mirror / name / self._manifest).is_file():
                continue
            try:
                self.fs.rm_file(f"{self.root}/{name}/{self._manifest}")
                self.fs.rm(f"{self.root}/{name}", recursive=True)
            except OSError as error:
                warnings.warn(f"Could not prune the training state {self.url}/{name} ({error}).", stacklevel=2)

    def download(self, name: str, files: Any) -> Path:
        """Download the files ``files`` of state ``name`` into the mirror (each object read once); return it."""
        folder = self.mirror / name
        folder.mkdir(parents=True, exist_ok=True)
        for file_name in sorted(files):
            self.fs.get_file(f"{self.root}/{name}/{file_name}", str(folder / file_name))
        return folder

    def drop_downloads(self, name: str) -> None:
        """Remove the downloaded files of state ``name`` from the mirror, keeping its manifest."""
        folder = self.mirror / name
        for path in folder.iterdir() if folder.is_dir() else ():
            if path.is_file() and path.name != self._manifest:
                path.unlink()
