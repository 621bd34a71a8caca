"""Trains the same tiny model under `accelerate launch`; rank 0 writes what the test compares."""

import json
import sys

import torch
from accelerate import PartialState
from torch import nn
from torch.utils.data import TensorDataset

from pytorch_accel_trainer import DEFAULT_CALLBACKS, Trainer


def main(output_path: str, per_device_batch_size: int, accumulation: int) -> None:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(32, 4, generator=generator)
    y = (x**2).sum(dim=1, keepdim=True)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    trainer = Trainer(model, nn.MSELoss(), torch.optim.SGD(model.parameters(), lr=0.05), callbacks=DEFAULT_CALLBACKS)
    trainer.train(
        TensorDataset(x, y), num_epochs=3, eval_dataset=TensorDataset(x, y), per_device_batch_size=per_device_batch_size,
        gradient_accumulation_steps=accumulation, train_dataloader_kwargs={"shuffle": False},
    )  # fmt: skip
    trainer.save_checkpoint(output_path + ".pt")
    parameters = torch.cat([p.detach().flatten() for p in trainer.get_model().parameters()])
    gathered = trainer.gather(parameters.unsqueeze(0))
    result = {
        "num_processes": trainer.run_config.num_processes,
        "parameters": parameters.tolist(),
        "ranks_agree": bool((gathered == gathered[0]).all()),
        "train_loss": trainer.run_history.get_metric_values("train_loss_epoch"),
        "eval_loss": trainer.run_history.get_metric_values("eval_loss_epoch"),
        "updates": trainer.num_update_steps_completed,
    }
    if trainer.run_config.is_world_process_zero:
        with open(output_path, "w") as handle:
            json.dump(result, handle)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
    PartialState().destroy_process_group()  # a clean gloo shutdown: no abort at interpreter exit
