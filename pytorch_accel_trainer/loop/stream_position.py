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
  Only the batches in flight are produced again: none without workers; with workers, the one round they prefetch
  when the dataloader is built (``num_workers * prefetch_factor`` batches).
- **It cannot** (a plain generator), or the main process reads it for every process (Accelerate's dispatching, the
  default on several processes, whose look-ahead a saved state could not be matched to): the batches already
  trained on are produced again and thrown away. The resume says so in one line, with how many and how to avoid it,
  and the skip shows its progress.
"""

from __future__ import annotations

import collections
import contextlib
import warnings
from typing import Any, Iterable, Iterator, Optional

from accelerate.data_loader import prepare_data_loader
from torch.utils.data import IterableDataset

from pytorch_accel_trainer.console import progress_bar_class

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
    while True:
        batch = next(iterator, _END)
        (ended,) = agreement.any_process(accelerator, int(batch is _END))
        if ended:
            break
        yield batch
    if batch is not _END:
        warnings.warn(
            f"Process {accelerator.process_index}'s part of the training stream still had batches when "
            "another process's part ended, and the epoch ended with the shortest part: those batches were not "
            "trained on. Give every process a part of the same length (e.g. a number of shards divisible by the "
            "number of processes).",
            stacklevel=2,
        )


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
