"""Trains with the default callbacks on 1 or 2 processes (a scenario of scenarios.py): tests/test_callbacks_progress.py
compares what 1 and 2 processes print."""

from pathlib import Path

import torch
from torch import nn
from torch.utils.data import TensorDataset

from pytorch_accel_trainer import Trainer


def train(folder: Path) -> None:
    """Train 2 epochs with the same global batch of 8 on any number of processes; prints only, writes nothing."""
    x = torch.randn(64, 1, generator=torch.Generator().manual_seed(0))
    torch.manual_seed(0)
    model = nn.Linear(1, 1)
    trainer = Trainer(model, nn.MSELoss(), torch.optim.SGD(model.parameters(), lr=0.1))
    batch_size = 8 // trainer.accelerator.num_processes  # the same global batch of 8
    trainer.train(
        TensorDataset(x, 2 * x + 3),
        num_epochs=2,
        eval_dataset=TensorDataset(x, 2 * x + 3),
        per_device_batch_size=batch_size,
    )
