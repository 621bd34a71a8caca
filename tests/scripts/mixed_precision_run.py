"""Trains a tiny model with one mixed precision in a fresh process and writes what the test checks as JSON.

Accelerate keeps one mixed precision per process, so each precision the tests try runs this script on its own.

    python tests/scripts/mixed_precision_run.py OUTPUT.json PRECISION    # PRECISION: no, bf16, fp16, ... or none
"""

import json
import sys

import torch
from torch import nn
from torch.utils.data import TensorDataset

from pytorch_accel_trainer import Trainer
from pytorch_accel_trainer.callbacks import TrainerCallback


class RecordingMLP(nn.Module):
    """A small MLP that remembers the dtype its hidden layer computed in (bfloat16 under bf16 autocast)."""

    def __init__(self):
        super().__init__()
        self.hidden, self.output = nn.Linear(4, 16), nn.Linear(16, 1)
        self.hidden_dtypes: set = set()

    def forward(self, x):
        hidden = self.hidden(x)
        self.hidden_dtypes.add(str(hidden.dtype))
        return self.output(torch.tanh(hidden))


class RecordDtypes(TrainerCallback):
    def __init__(self):
        self.loss_dtypes: set = set()
        self.output_dtypes: set = set()

    def on_train_step_end(self, trainer, batch_output, **kwargs):
        self.loss_dtypes.add(str(batch_output["loss"].dtype))
        self.output_dtypes.add(str(batch_output["model_outputs"].dtype))


def regression_data(num_samples: int, seed: int) -> TensorDataset:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(num_samples, 4, generator=generator)
    return TensorDataset(x, x.sum(dim=1, keepdim=True) + 1)


def make_trainer(mixed_precision, callbacks=()) -> Trainer:
    torch.manual_seed(0)
    model = RecordingMLP()
    return Trainer(
        model,
        nn.MSELoss(),
        torch.optim.SGD(model.parameters(), lr=0.05),
        callbacks=callbacks,
        mixed_precision=mixed_precision,
    )


def train_and_describe(trainer: Trainer, recorder: RecordDtypes) -> dict:
    trainer.train(
        regression_data(64, seed=0), num_epochs=4, eval_dataset=regression_data(32, seed=1), per_device_batch_size=8
    )
    trainer.evaluate()
    history = trainer.run_history
    logged = {
        name: history.get_metric_values(name) for name in ("train_loss_epoch", "eval_loss_epoch", "evaluation_loss")
    }
    return {
        "mixed_precision": trainer.run_config.mixed_precision,
        "hidden_dtypes": sorted(trainer.get_model().hidden_dtypes),
        "loss_dtypes": sorted(recorder.loss_dtypes),
        "output_dtypes": sorted(recorder.output_dtypes),
        "logged": logged,
        "logged_types": sorted({type(value).__name__ for values in logged.values() for value in values}),
        "parameter_dtypes": sorted({str(p.dtype) for p in trainer.get_model().parameters()}),
    }


def main(output_path: str, precision: str) -> None:
    mixed_precision = None if precision == "none" else precision
    result: dict = {}
    recorder = RecordDtypes()
    try:
        trainer = make_trainer(mixed_precision, callbacks=[recorder])
    except ValueError as error:
        result["error"] = str(error)
        # the failed set-up must leave the process free to use another precision
        trainer, mixed_precision = make_trainer("bf16", callbacks=[recorder]), "bf16"
    result.update(train_and_describe(trainer, recorder))
    # a second trainer: None takes the process's precision, another precision is refused
    result["second_trainer_mixed_precision"] = make_trainer(None)._accelerator.mixed_precision
    other = "no" if result["mixed_precision"] != "no" else "bf16"
    try:
        make_trainer(other)
    except ValueError as error:
        result["change_error"] = str(error)
    with open(output_path, "w") as handle:
        json.dump(result, handle)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
