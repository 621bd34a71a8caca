"""Where a stream is in its epoch: kept in a training state, so that a resumed run reads on from there.

A map-style dataset resumes by sampler offset at no cost (``loop/data_position.py``). A stream (an
``IterableDataset``) has no sampler to offset, and one of two things happens:

- **It can say where it is**: the dataset has ``state_dict`` and ``load_state_dict`` (torchdata's ``Stateful``
  protocol: Hugging Face datasets' ``IterableDataset`` has both), and each process reads its own stream (one process,
  or ``train(stream_split="dataset")``). The trainer then has Accelerate build the training dataloader as a
  ``StatefulDataLoader`` (``use_stateful_dataloader``), which keeps the stream's state, and each worker's with
  ``num_workers > 0``, as of each batch it hands out. :class:`StreamPositions` keeps the states of the last few
  batches the loop took (the loop looks one batch ahead, Accelerate another), and a training state holds, for each
  process, the state after the batches trained: a resume loads it and the stream goes on from there, bit for bit.
  Nothing trained on is produced again. With workers, at most one prefetch round (``num_workers * prefetch_factor``
  batches from the stream's start) is produced and thrown away: Accelerate asks the dataloader for its state as it
  builds it, which starts the workers once before the saved state replaces them.
- **It cannot** (a plain generator), or the main process reads it for every process (Accelerate's dispatching, the
  default on several processes, whose look-ahead a saved state could not be matched to): the batches already
  trained on are produced again and thrown away. The resume says so in one line, with how many and how to avoid it,
  and the skip shows its progress.
"""

from __future__ import annotations

import collections
import contextlib
import warnings
import zlib
from typing import Any, Iterable, Iterator, Mapping, Optional

import torch
from accelerate.data_loader import prepare_data_loader
from torch.utils.data import IterableDataset

from pytorch_accel_trainer.console import progress_bar_class
from pytorch_accel_trainer.errors import CheckpointError
from pytorch_accel_trainer.state.files import validate_plain

#: the batch states kept: the one trained up to, and those the loop's and Accelerate's look-ahead took since
_KEPT_STATES = 4


def _stateful(value: Any) -> bool:
    return callable(getattr(value, "state_dict", None)) and callable(getattr(value, "load_state_dict", None))


def is_stream(dataloader: Any) -> bool:
    """Whether ``dataloader`` reads an ``IterableDataset``."""
    return isinstance(getattr(dataloader, "dataset", None), IterableDataset)


def keeps_position(dataloader: Any) -> bool:
    """Whether ``dataloader`` reads a stream that can say where it is: its dataset has ``state_dict`` and
    ``load_state_dict`` (a ``StatefulDataLoader`` over any other stream would produce its batches again to skip them,
    as the trainer does, but without saying so)."""
    return is_stream(dataloader) and _stateful(dataloader.dataset)


def validate_stream_state(dataset: Any) -> None:
    """Refuse, as the run starts, a stream whose ``state_dict()`` a training state could not keep: one that returns
    no dict (a forgotten ``return`` gives ``None``, and the resumed stream would start over), or a dict holding a
    value that cannot be loaded back without pickle (which would fail only at the first save).

    Raises:
        TypeError: naming the value and what to return instead.
    """
    where = stream_state_name(dataset)
    state = dataset.state_dict()
    if not isinstance(state, dict):
        raise TypeError(
            f"{where} returned {state!r}, not a dict: a training state keeps it so that a resumed run reads on from "
            "where the stream was, through load_state_dict(). Return a dict of where the stream is (e.g. "
            "{'sample': 12}; a forgotten return gives None), or remove state_dict() and load_state_dict() to have a "
            "resume produce the stream again up to its position: see docs/training_state.md, 'Streams'."
        )
    validate_plain(state, where)


def stream_state_name(dataset: Any) -> str:
    """How errors name the state of the training stream ``dataset``."""
    return f"the training stream's state_dict() ({type(dataset).__name__})"


class StreamPositions:
    """The state of a prepared stateful dataloader after each of the last batches the loop took from it."""

    def __init__(self) -> None:
        self._states: collections.deque = collections.deque(maxlen=_KEPT_STATES)

    def follow(self, dataloader: Any, first_step: int) -> Iterator:
        """Yield the batches of ``dataloader`` (an epoch from micro-batch ``first_step``), keeping its state after
        each (Accelerate's snapshot: a new dict per batch, which nothing changes later)."""
        self._states.clear()
        taken = first_step
        for batch in dataloader:
            taken += 1
            self._states.append((taken, dataloader.state_dict()))
            yield batch

    def state_after(self, batches: int) -> Optional[dict]:
        """The stream's state after the epoch's first ``batches`` batches; ``None`` at the epoch's start (the stream
        starts it afresh) or when no longer kept (the resume then produces the batches again)."""
        for taken, state in self._states:
            if taken == batches:
                return state
        return None


def replay_batches(dataloader: Iterable, count: int, show_progress: bool) -> Iterator:
    """The batches of ``dataloader`` after its first ``count``, which are produced and thrown away (a stream that
    cannot say where it is), with a progress bar on the main process."""
    iterator = iter(dataloader)
    bar_class = progress_bar_class()
    with bar_class(total=count, desc="Replaying the stream", unit="batch", disable=not show_progress) as bar:
        for _ in range(count):
            if next(iterator, _END) is _END:
                return
            bar.update(1)
    yield from iterator


_END = object()


def replay_message(count: int, processes: int, samples_per_step: int, dataloader: Any) -> str:
    """The line a resume prints before it replays a stream, with how to avoid it."""
    samples = count * samples_per_step
    said = (
        f"its first {count} batches ({samples} samples over {processes} process{'es' if processes != 1 else ''}) are "
        "produced again and thrown away."
    )
    if keeps_position(dataloader):  # it can say where it is, but the main process reads it for every process
        return (
            f"Resuming inside an epoch of a stream that the main process reads for every process: {said} To resume "
            "without reading them again, have the stream split itself between the processes and pass "
            "train(stream_split='dataset'): see docs/training_state.md, 'Streams'."
        )
    return (
        f"Resuming inside an epoch of a stream that cannot say where it is: {said} To resume without reading them "
        "again, give the dataset state_dict() and load_state_dict() (torchdata's Stateful protocol; Hugging Face "
        "datasets' IterableDataset has them): see docs/training_state.md, 'Streams'."
    )


# ------------------------------------------------------------------------------------------------
# A stream that splits itself between the processes (train(stream_split="dataset"))
# ------------------------------------------------------------------------------------------------


def reads_own_part(dataloader: Any, stream_split: Optional[str], num_processes: int) -> bool:
    """Whether each process reads its own part of ``dataloader``'s stream, as ``train(stream_split="dataset")`` asks
    on several processes."""
    return stream_split == "dataset" and num_processes > 1 and is_stream(dataloader)


def prepare_own_part(accelerator: Any, dataloader: Any, stateful: bool) -> Any:
    """``dataloader`` prepared for this process alone: its batches placed on the device, its stream neither read by
    the main process for all (Accelerate's ``dispatch_batches``) nor read whole by each process to keep a slice
    (``IterableDatasetShard``): the stream splits itself."""
    return prepare_data_loader(
        dataloader,
        accelerator.device,
        num_processes=1,
        process_index=0,
        put_on_device=accelerator.device.type != "cpu",
        rng_types=None,
        dispatch_batches=False,
        non_blocking=accelerator.non_blocking,
        use_stateful_dataloader=stateful,
    )


def batches_every_process_has(batches: Iterable, agreement: Any, accelerator: Any) -> Iterator:
    """The batches of this process's part of a stream, for as long as every process still has one: parts of
    different lengths would leave the processes with more waiting in a collective for the others. One flag is
    agreed per batch, on the host (``ProcessAgreement``); the batches a longer part has left are not trained on
    (nor read), and a warning says so."""
    iterator = iter(batches)
    first = True
    while True:
        batch = next(iterator, _END)
        (ended,) = agreement.any_process(accelerator, int(batch is _END))
        if ended:
            break
        if first:
            _refuse_same_first_batch(batch, agreement, accelerator)
            first = False
        yield batch
    if batch is not _END:
        warnings.warn(
            f"Process {accelerator.process_index}'s part of the training stream still had batches when "
            "another process's part ended, and the epoch ended with the shortest part: those batches were not "
            "trained on. Give every process a part of the same length (e.g. a number of shards divisible by the "
            "number of processes).",
            stacklevel=2,
        )


def _refuse_same_first_batch(batch: Any, agreement: Any, accelerator: Any) -> None:
    """Refuse an epoch whose first batch is the same on every process: the stream does not split itself, and each
    process would train every sample. One checksum of the batch (copied to the host: a host-device sync, once an
    epoch) and one small collective; a batch with no tensor is not checked."""
    checksum = _checksum(batch)
    if checksum is None:
        return
    highest, lowest = agreement.any_process(accelerator, checksum, -checksum)
    if highest == -lowest:
        raise ValueError(
            f"train(stream_split='dataset') has each of the {accelerator.num_processes} processes read its own part "
            "of the training stream, but their first batches are the same: the stream does not split itself "
            "between the processes, and each would train on every sample. Split it in the dataset (datasets."
            "distributed.split_dataset_by_node, WebDataset's split_by_node, torch.distributed.get_rank() in "
            "__iter__), or leave stream_split at 'main_process' to have the main process read it for every "
            "process: see docs/training_state.md, 'Streams'."
        )


def _checksum(batch: Any) -> Optional[int]:
    """A CRC-32 of the bytes of every tensor in ``batch`` (nested in dicts, lists and tuples), or ``None``."""
    tensors: list = []
    _collect_tensors(batch, tensors)
    if not tensors:
        return None
    checksum = 0
    for tensor in tensors:
        checksum = zlib.crc32(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy(), checksum)
    return checksum


def _collect_tensors(value: Any, tensors: list) -> None:
    if isinstance(value, torch.Tensor):
        tensors.append(value)
    elif isinstance(value, Mapping):
        for item in value.values():
            _collect_tensors(item, tensors)
    elif isinstance(value, (list, tuple)):
        for item in value:
            _collect_tensors(item, tensors)


def validate_stream_split(dataloader: Any, stream_split: Optional[str], num_processes: int) -> None:
    """Refuse, as the run starts, a Hugging Face stream split by node (``datasets.distributed.split_dataset_by_node``)
    that the main process would read for every process (``stream_split="main_process"``): it would read its own part
    alone and send it to every process, and the other parts would never be trained on.

    Raises:
        ValueError: naming ``stream_split`` and the value to pass.
    """
    if num_processes == 1 or stream_split == "dataset" or not is_stream(dataloader):
        return
    dataset = dataloader.dataset
    split = getattr(dataset, "_distributed", None)  # datasets' DistributedConfig(rank, world_size), or None
    if type(dataset).__module__.split(".")[0] == "datasets" and split is not None:
        raise ValueError(
            f"The training stream is a Hugging Face IterableDataset split by node (split_dataset_by_node, "
            f"world_size={getattr(split, 'world_size', '?')}), but train(stream_split={stream_split!r}) has the main "
            "process read it for every process: the main process would read its own part alone and send it to every "
            "process, and the other parts would never be trained on. Pass train(..., stream_split='dataset'): see "
            "docs/training_state.md, 'Streams'."
        )


def stream_split_fact(dataloader: Any, stream_split: Optional[str], num_processes: int) -> Optional[str]:
    """Who reads the training stream, as a training state records it: ``"dataset"`` (each process its own part) or
    ``"main_process"`` (the main process for every process); ``None`` for one process or data that is no stream."""
    if num_processes == 1 or not is_stream(dataloader):
        return None
    return "dataset" if stream_split == "dataset" else "main_process"


def validate_stream_resume(plan: Any, dataloader: Any, facts: dict) -> None:
    """Refuse, before the first batch, to resume inside an epoch of a stream (``plan``, a ``ResumePlan``) where the
    stream cannot go on from its saved position: on another number of processes (each process's part of the stream,
    and its place in it, depend on how many there are), with another ``stream_split``, or, for a stream that keeps
    its position, with another number of dataloader workers (each worker keeps its place in its own share). A state
    taken between two epochs resumes any way: its stream starts the next epoch afresh.

    Raises:
        CheckpointError: naming the setting that changed and the value to resume with.
    """
    position = plan.position
    if not is_stream(dataloader) or not position.batches_seen:
        return
    saved = plan.saved_run_facts
    taken = f"{plan.folder} was taken {position.batches_seen} batches into an epoch of the training stream"
    between_epochs = "or resume from a state taken at an epoch's end (its stream starts the next epoch afresh)"
    if saved.get("world_size") != facts["world_size"]:
        raise CheckpointError(
            f"{taken} by {saved.get('world_size')} process(es), and this run has {facts['world_size']}: a stream "
            "cannot be split again between another number of processes (each process's part of it, and its place "
            f"there, depend on how many there are). Resume on {saved.get('world_size')} process(es), "
            f"{between_epochs}: see docs/training_state.md, 'Another number of processes'."
        )
    saved_split, split = saved.get("stream_split"), facts.get("stream_split")
    if saved_split is not None and saved_split != split:
        raise CheckpointError(
            f"{taken} with stream_split={saved_split!r}, and this run has stream_split={split!r}: the batches "
            "trained so far were read another way, so the rest of the epoch cannot be found. Pass "
            f"train(..., stream_split={saved_split!r}), {between_epochs}: see docs/training_state.md, 'Streams'."
        )
    workers = getattr(dataloader, "num_workers", 0)
    saved_workers = _workers_of(plan.stream_state)
    if not keeps_position(dataloader) or saved_workers is None:
        return  # a stream replayed up to its position
    if saved_workers != workers:
        raise CheckpointError(
            f"{taken} with num_workers={saved_workers}, and this run's training dataloader has num_workers={workers}: "
            "the state holds the place of each worker in its own share of the stream, which cannot be moved to "
            f"another number of workers. Pass train_dataloader_kwargs={{'num_workers': {saved_workers}}}, "
            f"{between_epochs}: see docs/training_state.md, 'Streams'."
        )
    buffer_size = _shuffle_buffer_size(dataloader.dataset)
    if buffer_size is not None:
        warnings.warn(
            f"{taken} of a Hugging Face IterableDataset shuffled with a buffer (buffer_size={buffer_size}), whose "
            "state_dict() does not hold the buffer's samples (datasets issue 7444): the resumed stream fills a new "
            f"buffer, and up to {buffer_size} samples the saved one held are not trained on in this epoch (on each "
            "process that reads the stream). The next epochs are whole. To resume without losing any, resume from a "
            "state taken at an epoch's end: see docs/training_state.md, 'Streams'.",
            stacklevel=2,
        )


def _shuffle_buffer_size(dataset: Any) -> Optional[int]:
    """The buffer size of a Hugging Face ``IterableDataset.shuffle(buffer_size=...)`` in ``dataset``'s chain of
    example iterables, else ``None``."""
    if type(dataset).__module__.split(".")[0] != "datasets":
        return None
    examples = getattr(dataset, "_ex_iterable", None)
    while examples is not None:
        if type(examples).__name__ == "BufferShuffledExamplesIterable":
            return getattr(examples, "buffer_size", None)
        examples = getattr(examples, "ex_iterable", None)
    return None


def _workers_of(stream_state: Optional[dict]) -> Optional[int]:
    """The dataloader workers a saved ``StatefulDataLoader`` state was taken with, ``None`` without a state (torchdata
    records ``_num_workers`` in the main process's snapshot of a dataloader with workers; one without has none)."""
    if not isinstance(stream_state, dict):
        return None
    snapshot = stream_state.get("_snapshot")
    main = snapshot.get("_main_snapshot") if isinstance(snapshot, dict) else None
    return int(main.get("_num_workers", 0)) if isinstance(main, dict) else 0


@contextlib.contextmanager
def stateful_dataloaders(accelerator: Any, stateful: bool) -> Iterator[None]:
    """While open, with ``stateful``, Accelerate prepares dataloaders as torchdata ``StatefulDataLoader`` (its
    ``use_stateful_dataloader``, set for this ``prepare`` alone: map-style data needs none)."""
    config = accelerator.dataloader_config
    if not stateful:
        yield
        return
    was_set, config.use_stateful_dataloader = config.use_stateful_dataloader, True
    try:
        with warnings.catch_warnings():  # torchdata 0.11 calls torch.set_vital, which torch 2.13 deprecates
            warnings.filterwarnings("ignore", message="'set_vital' is deprecated")
            yield
    finally:
        config.use_stateful_dataloader = was_set
