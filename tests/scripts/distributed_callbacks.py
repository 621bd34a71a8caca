"""The deciding and gathering callbacks on 1 or 2 processes (a scenario of scenarios.py); the main process writes what
tests/test_callbacks_distributed.py compares."""

import json
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import TensorDataset
from torchmetrics import MeanSquaredError

from pytorch_accel_trainer import Trainer
from pytorch_accel_trainer.callbacks import (
    ConvertSyncBatchNormCallback,
    EarlyStoppingCallback,
    ExperimentTrackingCallback,
    MetricCollectionCallback,
    ProgressBarCallback,
)


def _data(num_samples, seed):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(num_samples, 4, generator=generator)
    return TensorDataset(x, (x**2).sum(dim=1, keepdim=True))


def stop_together(folder: Path, per_device_batch_size: int) -> None:
    """Train with early stopping, metrics and tracking into ``folder/runs``; write ``folder/result.json``."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    callbacks = [
        MetricCollectionCallback({"mse": MeanSquaredError()}),
        EarlyStoppingCallback(early_stopping_patience=1, early_stopping_threshold=0.3),
        ExperimentTrackingCallback(["csv"], logging_dir=folder / "runs", run_name="run", log_every_n_steps=2),
        ProgressBarCallback(refresh_every_n_steps=2),
    ]
    trainer = Trainer(model, nn.MSELoss(), torch.optim.SGD(model.parameters(), lr=0.02), callbacks=callbacks)
    trainer.train(
        _data(32, 0),
        num_epochs=30,
        eval_dataset=_data(16, 1),
        per_device_batch_size=per_device_batch_size,
        train_dataloader_kwargs={"shuffle": False},
    )
    epochs_run = len(trainer.run_history.get_metric_values("eval_loss_epoch"))
    epochs_by_rank = trainer.gather(torch.tensor([epochs_run])).tolist()

    torch.manual_seed(0)
    bn_model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 1))
    bn_trainer = Trainer(
        bn_model,
        nn.MSELoss(),
        torch.optim.SGD(bn_model.parameters(), lr=0.02),
        callbacks=[ConvertSyncBatchNormCallback],
    )
    try:
        bn_trainer.train(_data(32, 0), num_epochs=1, per_device_batch_size=per_device_batch_size)
        sync_batch_norm_error = None
    except ValueError as error:
        sync_batch_norm_error = str(error)

    if trainer.run_config.is_world_process_zero:
        result = {
            "num_processes": trainer.run_config.num_processes,
            "epochs_by_rank": epochs_by_rank,
            "eval_loss": trainer.run_history.get_metric_values("eval_loss_epoch"),
            "mse": trainer.run_history.get_metric_values("mse"),
            "sync_batch_norm_error": sync_batch_norm_error,
            "batch_norm_types": sorted(
                {type(m).__name__ for m in bn_trainer.model.modules() if "BatchNorm" in type(m).__name__}
            ),
        }
        (folder / "result.json").write_text(json.dumps(result))
