"""Trains the same tiny model on 1 or 2 processes; the main process writes what tests/test_distributed.py compares.

A scenario of scenarios.py (``train_into``), and a script of its own for the tests of the launch itself:

    accelerate launch tests/scripts/distributed_train.py OUTPUT.json PER_DEVICE_BATCH_SIZE ACCUMULATION [LOSS_KIND]
"""

import json
import sys
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import TensorDataset

from pytorch_accel_trainer import DEFAULT_CALLBACKS, Trainer


class TokenTrainer(Trainer):
    """A token-level loss: squared error summed over each sequence's real tokens, averaged over the tokens of the
    micro-batch. With ``num_items_in_batch`` the update is the mean over every token of the global batch."""

    with_items = True

    def calculate_train_batch_loss(self, batch):
        x, y, mask = batch
        errors = ((self.model(x) - y) ** 2).squeeze(-1) * mask
        tokens = mask.sum()
        output = {"loss": errors.sum() / tokens, "model_outputs": None, "batch_size": x.size(0)}
        if self.with_items:
            output["num_items_in_batch"] = tokens
        return output

    def calculate_eval_batch_loss(self, batch):
        with torch.no_grad():
            return self.calculate_train_batch_loss(batch)


def token_dataset():
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(32, 6, 4, generator=generator)
    y = (x**2).sum(dim=2, keepdim=True)
    lengths = torch.randint(1, 7, (32,), generator=generator)  # 1 to 6 real tokens per sequence
    mask = (torch.arange(6) < lengths.unsqueeze(1)).float()
    return TensorDataset(x, y, mask)


def main(output_path: str, per_device_batch_size: int, accumulation: int, loss_kind: str = "samples") -> None:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(32, 4, generator=generator)
    y = (x**2).sum(dim=1, keepdim=True)
    dataset = TensorDataset(x, y) if loss_kind == "samples" else token_dataset()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    trainer_class = Trainer if loss_kind == "samples" else TokenTrainer
    TokenTrainer.with_items = loss_kind == "tokens"  # "tokens_unweighted": the same loss without the key
    trainer = trainer_class(
        model, nn.MSELoss(), torch.optim.SGD(model.parameters(), lr=0.05), callbacks=DEFAULT_CALLBACKS
    )
    trainer.train(
        dataset,
        num_epochs=3,
        eval_dataset=dataset,
        per_device_batch_size=per_device_batch_size,
        gradient_accumulation_steps=accumulation,
        train_dataloader_kwargs={"shuffle": False},
    )
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


def train_into(folder: Path, per_device_batch_size: int, accumulation: int = 1, loss_kind: str = "samples") -> None:
    """The scenario: ``main`` writing ``folder/result.json`` and its checkpoint ``folder/result.json.pt``."""
    main(str(folder / "result.json"), per_device_batch_size, accumulation, loss_kind)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), *sys.argv[4:])
