"""The deciding and gathering callbacks on 1 or 2 processes (a scenario of scenarios.py); the main process writes what
tests/test_callbacks_distributed.py compares."""

import json
import time
import types
from pathlib import Path

import torch
from accelerate import PartialState
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
    StopTrainingError,
    TrainerCallback,
)
from pytorch_accel_trainer.loop import time_budget
from pytorch_accel_trainer.state.training_state import list_complete_states


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


#: The run of ``stop_in_last_epoch``: 2 epochs of 8 updates (32 samples, 4 a step over every process).
LAST_EPOCH_RUN = {"num_epochs": 2, "num_samples": 32, "total_batch_size": 4}


class StopAfterUpdate(TrainerCallback):
    """Raises a ``StopTrainingError`` after update ``update`` (on every process)."""

    def __init__(self, update):
        self.update = update

    def on_optimizer_step_end(self, trainer, num_update_steps_completed, **kwargs):
        if num_update_steps_completed == self.update:
            raise StopTrainingError(f"stopped after update {self.update}")


class ClockJumpsAfterUpdate(StopAfterUpdate):
    """After update ``update``, the time budget's clock reads two hours later on every process: a budget of an hour is
    spent at the next check, as a slow update would spend it, but at a known update, with no wall-clock race."""

    def on_optimizer_step_end(self, trainer, num_update_steps_completed, **kwargs):
        if num_update_steps_completed == self.update:
            time_budget.time = types.SimpleNamespace(monotonic=lambda: time.monotonic() + 7200)

    def on_training_run_end(self, trainer, **kwargs):
        time_budget.time = time


class StopAtLastEpochEnd(TrainerCallback):
    """Raises a ``StopTrainingError`` as the run's last epoch ends, after its evaluation (as early stopping may)."""

    def on_training_run_epoch_end(self, trainer, **kwargs):
        if trainer.run_state.epoch == LAST_EPOCH_RUN["num_epochs"] - 1:
            raise StopTrainingError("stopped at the last epoch's end")


def stop_in_last_epoch(folder: Path, per_device_batch_size: int) -> None:
    """Stop a 2-epoch run inside its last epoch (a callback's ``StopTrainingError`` after update 11, the time budget
    after update 11) and at its end; each process writes its ``TrainResult`` of each, and the update its saved state
    holds, to ``folder/result.rank<i>.json``."""
    stops = {
        "stop_error": ({}, StopAfterUpdate(11)),
        "time_budget": ({"max_time": 3600, "max_time_save_dir": folder / "budget"}, ClockJumpsAfterUpdate(11)),
        "last_epoch_end": ({}, StopAtLastEpochEnd()),
    }
    results = {}
    for case, (train_kwargs, stop) in stops.items():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
        trainer = Trainer(model, nn.MSELoss(), torch.optim.SGD(model.parameters(), lr=0.02), callbacks=[stop])
        result = trainer.train(
            _data(LAST_EPOCH_RUN["num_samples"], 0),
            num_epochs=LAST_EPOCH_RUN["num_epochs"],
            eval_dataset=_data(8, 1),
            per_device_batch_size=per_device_batch_size,
            **train_kwargs,
        )
        results[case] = {
            **{name: getattr(result, name) for name in ("stopped_early", "stop_reason", "num_epochs", "num_samples")},
            "num_update_steps": result.num_update_steps,
            "metrics": result.metrics,
        }
    saved = list_complete_states(folder / "budget")  # the time budget's state, saved as it stopped the run
    results["time_budget"]["saved_updates"] = [state.manifest["num_update_steps_completed"] for state in saved]
    (folder / f"result.rank{PartialState().process_index}.json").write_text(json.dumps(results))
