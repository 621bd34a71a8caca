"""Resume start-up cost against the step resumed from: skipping is by sampler offset, not by replay.

Run: python benchmarks/resume_startup.py
Saves a training state after 10 and after 10,000 optimizer updates of a 20,000-step epoch, then times
`train(resume_from=...)` from its call to the first resumed step (median of 5 fresh trainers each).
"""

import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import TensorDataset

from pytorch_accel_trainer import Trainer
from pytorch_accel_trainer.callbacks import SaveTrainingStateCallback, TrainerCallback


class _Stop(Exception):
    pass


class _StopAfter(TrainerCallback):
    def __init__(self, updates):
        self.updates = updates

    def on_train_step_start(self, trainer, **kwargs):
        if trainer.num_update_steps_completed == self.updates:
            raise _Stop()


class _FirstStep(TrainerCallback):
    def __init__(self):
        self.at = None

    def on_train_step_start(self, trainer, **kwargs):
        self.at = time.perf_counter()
        raise _Stop()


def _trainer(callbacks):
    torch.manual_seed(0)
    model = nn.Linear(8, 1)
    return Trainer(model, nn.MSELoss(), torch.optim.SGD(model.parameters(), lr=0.01), callbacks=callbacks)


def main():
    torch.set_num_threads(1)
    x = torch.randn(80_000, 8)
    dataset = TensorDataset(x, x.sum(dim=1, keepdim=True))
    root = Path(tempfile.mkdtemp())
    print("| resumed after (updates) | median ms from train() to the first resumed step |\n|---:|---:|")
    try:
        for updates in (10, 10_000):
            folder = root / str(updates)
            saver = SaveTrainingStateCallback(
                folder, save_every_n_steps=updates, save_every_n_epochs=None, save_at_end=False
            )
            try:
                _trainer([saver, _StopAfter(updates)]).train(dataset, 1, per_device_batch_size=4, resume_from=folder)
            except _Stop:
                pass
            timings = []
            for _ in range(5):
                first_step = _FirstStep()
                started = time.perf_counter()
                try:
                    _trainer([first_step]).train(dataset, 1, per_device_batch_size=4, resume_from=folder)
                except _Stop:
                    pass
                timings.append((first_step.at - started) * 1000)
            print(f"| {updates:,} | {statistics.median(timings):.0f} |")
    finally:
        shutil.rmtree(root)


if __name__ == "__main__":
    main()
