"""ExperimentTrackingCallback on 2 processes (scenarios of scenarios.py, for tests/test_callbacks_trackers.py): the run
name every process gets, and the records of the batch-loss hooks averaged over both."""

import json
from pathlib import Path

import torch
from conftest import linear_dataset, make_linear, make_trainer

from pytorch_accel_trainer import Trainer
from pytorch_accel_trainer.callbacks import ExperimentTrackingCallback


def share_run_name(folder: Path) -> None:
    """Train with a drawn run name, logging into ``folder/logs``; process ``i`` writes its name to
    ``folder/run_name.rank<i>.json``."""
    tracking = ExperimentTrackingCallback(["csv"], logging_dir=folder / "logs")
    trainer = make_trainer(make_linear(), callbacks=[tracking])
    trainer.train(linear_dataset(16), num_epochs=1, per_device_batch_size=4)
    (folder / f"run_name.rank{trainer.accelerator.process_index}.json").write_text(json.dumps(tracking.run_name))


class RankRecords(Trainer):
    def calculate_train_batch_loss(self, batch, batch_idx):
        output = super().calculate_train_batch_loss(batch)
        rank = self.accelerator.process_index
        records = {"rank": torch.tensor(float(rank))}
        if rank == 1:
            records["rank_one_only"] = 7.0  # a record only one process returns: still logged
        return {**output, **records}


def average_records(folder: Path) -> None:
    """Train with records of each process's rank, logged to ``folder/logs/run/metrics.csv`` every 2 updates."""
    tracking = ExperimentTrackingCallback(["csv"], logging_dir=folder / "logs", run_name="run", log_every_n_steps=2)
    trainer = make_trainer(make_linear(), callbacks=[tracking], trainer_class=RankRecords)
    trainer.train(linear_dataset(32), num_epochs=1, per_device_batch_size=4)
