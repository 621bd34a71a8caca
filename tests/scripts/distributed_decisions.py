"""A decision taken on one process only, under `accelerate launch`: every rank writes where it ended."""

import json
import sys

import torch
from accelerate import PartialState
from torch import nn
from torch.utils.data import TensorDataset

from pytorch_accel_trainer import Trainer
from pytorch_accel_trainer.callbacks import StopTrainingError, TerminateOnNaNCallback, TrainerCallback


class OnOneRank(TrainerCallback):
    """Acts on one rank only, once the run has made `after_updates` optimizer updates."""

    def __init__(self, mode, rank, after_updates):
        self.mode, self.rank, self.after_updates = mode, rank, after_updates

    def _due(self, trainer):
        return (
            trainer._accelerator.process_index == self.rank and trainer.num_update_steps_completed >= self.after_updates
        )

    def on_train_step_end(self, trainer, **kwargs):
        if self.mode == "stop_step" and self._due(trainer):
            raise StopTrainingError(f"stop asked on rank {self.rank}")
        if self.mode == "error" and self._due(trainer):
            raise RuntimeError(f"boom on rank {self.rank}")

    def on_train_epoch_end(self, trainer, **kwargs):
        if self.mode == "stop_epoch" and self._due(trainer):
            raise StopTrainingError(f"stop asked on rank {self.rank} at epoch end")


class NaNOnOneRank(Trainer):
    def calculate_train_batch_loss(self, batch):
        output = super().calculate_train_batch_loss(batch)
        if self._accelerator.process_index == 1 and self.num_update_steps_completed >= 5:
            output["loss"] = output["loss"] * float("nan")
        return output


def run(mode):
    generator = torch.Generator().manual_seed(0)
    size = 1 if mode == "tiny" else 32
    x = torch.randn(size, 4, generator=generator)
    y = (x**2).sum(dim=1, keepdim=True)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    callbacks = [OnOneRank(mode.split("_rank")[0], rank=1 if mode != "stop_epoch" else 0, after_updates=5)]
    if mode == "nan":
        callbacks = [TerminateOnNaNCallback(check_every_n_steps=2, raise_on_nan=False)]
    trainer_class = NaNOnOneRank if mode == "nan" else Trainer
    trainer = trainer_class(model, nn.MSELoss(), torch.optim.SGD(model.parameters(), lr=0.05), callbacks=callbacks)
    result = trainer.train(
        TensorDataset(x, y),
        num_epochs=3,
        eval_dataset=TensorDataset(x, y),
        per_device_batch_size=4,
        max_num_train_steps=7 if mode == "max_steps" else None,
        train_dataloader_kwargs={"shuffle": False},
    )
    parameters = torch.cat([p.detach().flatten() for p in trainer.get_model().parameters()])
    return {
        "num_processes": trainer.run_config.num_processes,
        "updates": trainer.num_update_steps_completed,
        "epochs": trainer.run_history.current_epoch,
        "eval_losses": trainer.run_history.get_metric_values("eval_loss_epoch"),
        "train_losses": trainer.run_history.get_metric_values("train_loss_epoch"),
        "stop_reason": result.stop_reason,
        "parameters": parameters.tolist(),
    }


def main(modes, output_path):
    results = {mode: run(mode) for mode in modes.split(",")}
    with open(f"{output_path}.rank{PartialState().process_index}", "w") as handle:
        json.dump(results, handle)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
