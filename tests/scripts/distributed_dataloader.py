"""A DataLoader given to train() on 1 or 2 processes (a scenario of scenarios.py): which samples each process saw, and
the final weights, for tests/test_dataloaders.py."""

import json
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from pytorch_accel_trainer import Trainer
from pytorch_accel_trainer.callbacks import TrainerCallback


class SeenIndices(TrainerCallback):
    def __init__(self):
        self.epochs = []

    def on_train_epoch_start(self, trainer, **kwargs):
        self.epochs.append([])

    def on_train_step_end(self, trainer, batch=None, **kwargs):
        self.epochs[-1].append(trainer.gather(batch[2]))


class IndexedTrainer(Trainer):
    def calculate_train_batch_loss(self, batch):
        return super().calculate_train_batch_loss((batch[0], batch[1]))


def train(folder: Path, batch_size: int) -> None:
    """Train 2 epochs on a DataLoader of ``batch_size``; the main process writes ``folder/result.json``."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(16, 3, generator=generator)
    dataset = TensorDataset(x, x.sum(dim=1, keepdim=True), torch.arange(16))
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    seen = SeenIndices()
    trainer = IndexedTrainer(model, nn.MSELoss(), torch.optim.SGD(model.parameters(), lr=0.05), callbacks=[seen])
    result = trainer.train(DataLoader(dataset, batch_size=batch_size, shuffle=False), num_epochs=2)
    if trainer.accelerator.is_main_process:
        per_epoch = [torch.cat(batches).tolist() for batches in seen.epochs]
        report = {
            "indices_seen": len(per_epoch[0]),
            "distinct_per_epoch": [len(set(epoch)) for epoch in per_epoch],
            "weights": trainer.model.weight.flatten().tolist() + trainer.model.bias.tolist(),
            "num_samples": result.num_samples,
        }
        (folder / "result.json").write_text(json.dumps(report))
