"""Where a run writes, checked before its first batch: the folders and URLs of ``max_time_save_dir`` and
``resume_from``, and those every callback declares it writes (``TrainerCallback.writes_to``: a user's callback is
asked as the built-in ones are, never by its class). Each can be written, a local one is the same folder on every
node, and a store of training states reaches every process.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Optional

from accelerate.utils import gather_object

from pytorch_accel_trainer.state import storage
from pytorch_accel_trainer.state.files import MANIFEST_NAME
from pytorch_accel_trainer.state.storage import (
    TRAINING_STATES,
    Location,
    as_location,
    declared_destinations,
    is_url,
    validate_store_reaches_every_process,
)

if TYPE_CHECKING:
    from pytorch_accel_trainer.run_config import TrainOptions


def train_locations(arguments: dict) -> dict[str, Optional[Location]]:
    """``train()``'s ``resume_from`` and ``max_time_save_dir`` as locations (:func:`~pytorch_accel_trainer.state.
    storage.as_location`: ``~`` and environment variables expanded, a URL kept, a URL that lost a slash refused),
    before any work."""
    return {
        name: None if arguments[name] is None else as_location(arguments[name])
        for name in ("resume_from", "max_time_save_dir")
    }


def folders_shared_by_nodes(callbacks: Iterable, options: "TrainOptions") -> dict[Location, str]:
    """The folders every node of a multi-node run must see as the main process does, each with what the run keeps
    there: those of its training states (as the callbacks declare them), and the one it resumes from (see
    ``parallel/shared_folders.py``)."""
    folders = {
        destination.location: f"training states of {destination.given_as}"
        for destination in declared_destinations(callbacks)
        if destination.holds == TRAINING_STATES and not is_url(destination.location)
    }
    if options.max_time_save_dir is not None and not is_url(options.max_time_save_dir):
        folders.setdefault(as_location(options.max_time_save_dir), "training states of train(max_time_save_dir=...)")
    if options.resume_from is not None and not is_url(options.resume_from):  # a store is shared by every node
        resume_from = Path(as_location(options.resume_from))  # a local path here
        holder = resume_from.parent if (resume_from / MANIFEST_NAME).is_file() else resume_from  # a state's folder
        if holder.is_dir():
            folders.setdefault(holder, "the training states of train(resume_from=...)")
    return folders


def validate_destinations_can_be_written(accelerator: Any, callbacks: Iterable, options: "TrainOptions") -> None:
    """Check, before the first batch, that every folder the run will write to can be written: those the callbacks
    declare (``TrainerCallback.writes_to``) and ``max_time_save_dir``. Each process probes its folders (a store: the
    main process, once); one small collective agrees on the outcome, so that every process raises the same
    ``OSError``, naming the folder, where it was given and the cause."""
    failure: Optional[str] = None
    for location, use in _destinations(callbacks, options).items():
        if is_url(location) and not accelerator.is_main_process:
            continue  # a store is the same for every process
        try:
            storage.probe_destination(location, use)
        except OSError as error:
            failure = str(error)
            break
    failures = [failure] if accelerator.num_processes == 1 else gather_object([failure])
    first = next(((index, text) for index, text in enumerate(failures) if text is not None), None)
    if first is not None:
        index, text = first
        raise OSError(text if accelerator.num_processes == 1 else f"{text} (on process {index})")


def _destinations(callbacks: Iterable, options: "TrainOptions") -> dict[Location, str]:
    destinations: dict[Location, str] = {}
    for destination in declared_destinations(callbacks):
        destinations.setdefault(destination.location, destination.given_as)
    if options.max_time_save_dir is not None:
        destinations.setdefault(options.max_time_save_dir, "train(max_time_save_dir=...)")
    return destinations


def validate_stores_reach_every_process(callbacks: Iterable, options: "TrainOptions", num_processes: int) -> None:
    """Refuse, before any work, a run of several processes whose training states would go to ``memory://``."""
    urls = {
        destination.location: destination.given_as
        for destination in declared_destinations(callbacks)
        if destination.holds == TRAINING_STATES and is_url(destination.location)
    }
    for value, use in ((options.max_time_save_dir, "max_time_save_dir"), (options.resume_from, "resume_from")):
        if value is not None and is_url(value):
            urls.setdefault(str(value), f"train({use}=...)")
    for url, use in urls.items():
        validate_store_reaches_every_process(str(url), num_processes, use)
