"""A stream trained three ways in one process group: uninterrupted; stopped after ``--stop-after`` updates (a training
state saved as the run stops, inside its first epoch); resumed from that state by a new trainer. Prints one JSON line
per process with what each run's stream produced, and saves the final weights of both complete runs.

Usage: ``stream_run.py OUT [--workers N] [--plain] [--split main_process|dataset] [--stop-after K] [--samples N]
[--epochs E]``, on 1 process (``python``) or several (``accelerate launch``, tests/conftest.py ``launcher``). With
``--split dataset`` the stream splits itself between the processes (each reads every ``world_size``-th sample;
``--unsplit`` keeps it whole on every process). ``--uneven N`` gives process 1 N samples fewer than the others.
``--memory-store`` only tries to train with training states in ``memory://`` and prints the error.

The resumed run may differ: ``--resume-workers N``, ``--resume-split S``, ``--allow-changes``. ``--modes`` runs some
of the three alone (``stopped``, then ``resumed`` from the states it left in OUT, e.g. on another number of
processes). A run that raises prints ``REFUSED`` with the error and the samples its stream produced, instead of
``REPORT``. ``--hf-split-by-node`` only tries to train a Hugging Face stream split by node with ``--split``.

``stream_run.py --runs JSON`` runs several command lines in the same processes, one after the other: ``JSON`` is a list
of ``[name, [OUT, option, ...]]``; each run's lines on standard output and error follow a line ``RUN name`` (written
once every process wrote all of the run before; what comes before the first such line is the first run's), and the
last with ``RUN end``.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import sys
import warnings

import torch
from torch.utils.data import IterableDataset

from pytorch_accel_trainer import Trainer
from pytorch_accel_trainer.callbacks import SaveTrainingStateCallback, TrainerCallback
from pytorch_accel_trainer.errors import CheckpointError, StopTrainingError

#: samples produced by the stream in this process and its workers (forked: the value is shared with them)
PRODUCED = multiprocessing.Value("q", 0)


def print_line(line: str) -> None:
    """Write ``line`` in one call, as ``Trainer.print`` does: with unbuffered output (``PYTHONUNBUFFERED=1``)
    ``print`` writes a line and its end separately, and another process's line can land between them."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


class Stream(IterableDataset):
    """Sample ``i`` is a seeded random vector and its target; each worker reads every ``num_workers``-th sample of its
    process's part, and (``split``) each process every ``world_size``-th sample. Its state is its place in the part."""

    def __init__(self, num_samples: int, split: bool, short_by: int = 0):
        self.num_samples, self.split, self.short_by, self.place = num_samples, split, short_by, 0

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        split = self.split and torch.distributed.is_initialized()
        world, rank = (torch.distributed.get_world_size(), torch.distributed.get_rank()) if split else (1, 0)
        end = self.num_samples - (self.short_by if rank == 1 else 0)
        while True:
            index = (self.place * workers + worker) * world + rank
            if index >= end:
                self.place = 0  # the next epoch reads the stream from its start
                return
            self.place += 1
            with PRODUCED.get_lock():
                PRODUCED.value += 1
            features = torch.randn(4, generator=torch.Generator().manual_seed(index))
            yield features, features.sum().reshape(1) * 0.5

    def state_dict(self) -> dict:
        return {"place": self.place}

    def load_state_dict(self, state: dict) -> None:
        self.place = state["place"]


class PlainStream(Stream):
    """The same stream, unable to say where it is."""

    state_dict = None  # type: ignore[assignment]
    load_state_dict = None  # type: ignore[assignment]


class Watch(TrainerCallback):
    """Stops the run after ``stop_after`` updates; notes the samples produced before the run's first update."""

    def __init__(self, stop_after=None):
        self.stop_after, self.before_first_update = stop_after, None

    def on_train_step_end(self, trainer, **kwargs):
        if self.before_first_update is None:
            self.before_first_update = PRODUCED.value
        if self.stop_after is not None and trainer.run_state.num_update_steps_completed >= self.stop_after:
            raise StopTrainingError("stopped by the test")


def run(args, mode: str) -> dict:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    watch = Watch(args.stop_after if mode == "stopped" else None)
    callbacks = [watch]
    if mode != "uninterrupted":
        callbacks.append(SaveTrainingStateCallback(os.path.join(args.out, "states"), save_on_signals=()))
    trainer = Trainer(
        model, torch.nn.MSELoss(), torch.optim.SGD(model.parameters(), lr=0.05), callbacks=callbacks, seed=1
    )
    stream_class = PlainStream if args.plain else Stream
    PRODUCED.value = 0
    resumed = mode == "resumed"
    split = args.resume_split if resumed and args.resume_split else args.split
    workers = args.resume_workers if resumed and args.resume_workers is not None else args.workers
    trainer.train(
        stream_class(args.samples, split == "dataset" and not args.unsplit, short_by=args.uneven),
        num_epochs=args.epochs,
        per_device_batch_size=4,
        train_dataloader_kwargs={"num_workers": workers},
        stream_split=split,
        resume_from=os.path.join(args.out, "states") if resumed else None,
        allow_resume_changes=args.allow_changes,
    )
    if mode != "stopped" and trainer.accelerator.is_main_process:
        torch.save(trainer.get_model().state_dict(), os.path.join(args.out, f"{mode}.pt"))
    return {
        "produced": PRODUCED.value,
        "before_first_update": watch.before_first_update,
        "updates": trainer.run_state.num_update_steps_completed,
    }


def hf_numbers(shards):
    """The samples of a Hugging Face stream, 8 a shard (a function of its own: datasets hashes it)."""
    for shard in shards:
        for index in range(8):
            yield {"x": [float(shard * 8 + index)] * 4, "y": [0.0]}


def refuse_hf_split_by_node(args) -> None:
    """Try to train a Hugging Face stream split by node (``split_dataset_by_node``) with ``--split``; print the
    refusal."""
    import datasets
    from datasets.distributed import split_dataset_by_node

    stream = datasets.IterableDataset.from_generator(hf_numbers, gen_kwargs={"shards": list(range(8))})
    split = split_dataset_by_node(stream, rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
    model = torch.nn.Linear(4, 1)
    trainer = Trainer(model, torch.nn.MSELoss(), torch.optim.SGD(model.parameters(), lr=0.05), callbacks=[])
    try:
        trainer.train(split, num_epochs=1, per_device_batch_size=4, stream_split=args.split)
    except ValueError as error:
        print_line(
            "REFUSED "
            + json.dumps({"error": str(error), "produced": PRODUCED.value, "rank": trainer.accelerator.process_index})
        )


def parse(argv: list) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--workers", type=int, default=0)
    parser.add_argument("--plain", action="store_true")
    parser.add_argument("--split", default="main_process")
    parser.add_argument("--stop-after", type=int, default=30)
    parser.add_argument("--samples", type=int, default=400)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--uneven", type=int, default=0)
    parser.add_argument("--unsplit", action="store_true")
    parser.add_argument("--hf-split-by-node", action="store_true", help="only try a split HF stream on the default")
    parser.add_argument("--memory-store", action="store_true", help="only try to save states to memory://")
    parser.add_argument("--resume-workers", type=int)
    parser.add_argument("--resume-split")
    parser.add_argument("--allow-changes", action="store_true")
    parser.add_argument("--modes", default="uninterrupted,stopped,resumed")
    return parser.parse_args(argv)


def run_all(args) -> None:
    """The runs of one command line: print their ``REPORT``, or the ``REFUSED`` of the first that raises."""
    PRODUCED.value = 0
    rank = int(os.environ.get("RANK", "0"))
    if args.hf_split_by_node:
        refuse_hf_split_by_node(args)
        return
    if args.memory_store:
        model = torch.nn.Linear(4, 1)
        store = SaveTrainingStateCallback("memory://bucket/states", save_on_signals=())
        trainer = Trainer(model, torch.nn.MSELoss(), torch.optim.SGD(model.parameters(), lr=0.05), callbacks=[store])
        try:
            trainer.train(Stream(args.samples, split=False), num_epochs=1, per_device_batch_size=4)
        except ValueError as error:
            print_line("REFUSED " + json.dumps({"error": str(error), "produced": PRODUCED.value, "rank": rank}))
        return
    try:
        report = {mode: run(args, mode) for mode in args.modes.split(",")}
    except (ValueError, TypeError, CheckpointError) as error:
        print_line("REFUSED " + json.dumps({"error": str(error), "produced": PRODUCED.value, "rank": rank}))
        return
    report["rank"] = rank
    print_line("REPORT " + json.dumps(report))


def separate(name: str) -> None:
    """Once every process wrote all it had, the main process starts the section ``name`` of both streams with the
    line ``RUN name``; then every process goes on. Before the first trainer has set up the process group, the
    processes cannot wait for each other: what they write before the first such line is the first run's."""
    sys.stdout.flush()
    sys.stderr.flush()
    connected = torch.distributed.is_initialized()
    if connected:
        torch.distributed.barrier()
    if int(os.environ.get("RANK", "0")) == 0:
        for stream in (sys.stdout, sys.stderr):
            stream.write(f"\nRUN {name}\n")  # on a line of its own, after a progress bar's last
            stream.flush()
    if connected:
        torch.distributed.barrier()


def main():
    if sys.argv[1] != "--runs":
        run_all(parse(sys.argv[1:]))
        return
    for name, argv in json.loads(sys.argv[2]):
        separate(name)
        with warnings.catch_warnings():  # each run's warnings shown as in a process of its own
            run_all(parse(argv))
    separate("end")


if __name__ == "__main__":
    main()
