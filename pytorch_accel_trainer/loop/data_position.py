"""Where a resumed epoch starts in its data: the batches already trained on skipped without reading them.

A training state records its place in the interrupted epoch twice: the micro-batches each process trained on
(``batches_seen``) and the samples all processes trained on together (``epoch_samples``). A run with the same number
of processes and batch size skips ``batches_seen`` batches by sampler offset (``accelerate.skip_first_batches``): the
same batches in the same order as an uninterrupted run, at the cost of none of them. A run with another number of
processes or batch size (``allow_resume_changes=True``) skips the epoch's first ``epoch_samples`` samples of the
sampler's order (the seedable sampler's: the same for any number of processes) and splits the rest between its
processes: every remaining sample of the epoch is trained once; their order is no longer the saved run's.
"""

from __future__ import annotations

import itertools
from typing import Any, Iterable, Iterator

from accelerate import skip_first_batches
from accelerate.data_loader import BatchSamplerShard, DataLoaderShard
from torch.utils.data import BatchSampler, Sampler

from pytorch_accel_trainer.errors import CheckpointError


def samples_per_step(train_dl: Any, per_device_batch_size: Any, num_processes: int) -> int:
    """The samples one micro-batch step of ``train_dl`` takes over every process (Accelerate's ``total_batch_size``
    of a prepared dataloader, else the run config's batch size times the processes)."""
    total = getattr(train_dl, "total_batch_size", None)
    if isinstance(total, int) and total > 0:
        return total
    return int(per_device_batch_size or 1) * num_processes


class _SkipFirstSamples(Sampler):
    """A sampler's order without its first ``count`` indices (each epoch's order is still set by ``set_epoch``)."""

    def __init__(self, sampler: Any, count: int) -> None:
        self.sampler, self.count = sampler, count

    def set_epoch(self, epoch: int) -> None:
        if hasattr(self.sampler, "set_epoch"):
            self.sampler.set_epoch(epoch)

    def __iter__(self) -> Iterator:
        return itertools.islice(iter(self.sampler), self.count, None)

    def __len__(self) -> int:
        return max(len(self.sampler) - self.count, 0)


def skip_first_samples(train_dl: Any, count: int) -> Iterable:
    """``train_dl`` (prepared by Accelerate) from the ``count``-th sample of its sampler's order on, the rest batched
    and split between the processes as Accelerate splits a whole epoch.

    Raises:
        CheckpointError: the dataloader has no sampler to skip in (an iterable dataset, a custom batch sampler).
    """
    batch_sampler = getattr(train_dl, "batch_sampler", None)
    shard = batch_sampler if isinstance(batch_sampler, BatchSamplerShard) else None
    inner = shard.batch_sampler if shard is not None else batch_sampler
    if not isinstance(train_dl, DataLoaderShard) or not isinstance(inner, BatchSampler):
        raise CheckpointError(
            "This resume changes the number of processes or the batch size, which needs the training data's sampler "
            f"to start the interrupted epoch after its first {count} samples, but the dataloader "
            f"({type(train_dl).__name__}) has none: a stream (IterableDataset) or a custom batch sampler cannot be "
            "split again. Resume with the saved number of processes and batch size."
        )
    batches: Any = BatchSampler(_SkipFirstSamples(inner.sampler, count), inner.batch_size, inner.drop_last)
    if shard is not None:
        batches = BatchSamplerShard(
            batches,
            num_processes=shard.num_processes,
            process_index=shard.process_index,
            split_batches=shard.split_batches,
            even_batches=shard.even_batches,
        )
    resumed = skip_first_batches(train_dl, 0)  # a copy of the prepared dataloader, whose batch sampler is replaced
    resumed.batch_sampler.batch_sampler = batches
    return resumed
