"""ConvertSyncBatchNormCallback on one process (two processes: tests/test_callbacks_distributed.py)."""

from __future__ import annotations

import torch
from conftest import make_trainer, regression_dataset
from torch import nn

from pytorch_accel_trainer.callbacks import ConvertSyncBatchNormCallback


def test_one_process_keeps_batch_norm():
    """One process keeps its batch norm layers, and trains as without the callback."""

    def train(callbacks):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 1))
        trainer = make_trainer(model, lr=0.05, callbacks=callbacks)
        trainer.train(regression_dataset(32), num_epochs=2, per_device_batch_size=8)
        return trainer.get_model()

    with_callback, without = train([ConvertSyncBatchNormCallback]), train([])
    assert type(with_callback[1]) is nn.BatchNorm1d  # nothing to synchronise with one process
    for converted, plain in zip(with_callback.state_dict().values(), without.state_dict().values()):
        assert torch.equal(converted, plain)
