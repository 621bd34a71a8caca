"""Trains a model and an extra "critic" (``Trainer.add_model``) on 1 or 2 processes (a scenario of scenarios.py); the
main process saves what tests/test_extra_models.py compares."""

from pathlib import Path
from typing import Optional

import torch
from torch import nn
from torch.utils.data import TensorDataset

from pytorch_accel_trainer import Trainer
from pytorch_accel_trainer.callbacks import SaveTrainingStateCallback, TrainerCallback


class Crash(Exception):
    """Stands for the processes dying."""


class CrashAfter(TrainerCallback):
    def __init__(self, updates: int):
        self.updates = updates

    def on_optimizer_step_end(self, trainer, num_update_steps_completed, **kwargs):
        if num_update_steps_completed == self.updates:
            raise Crash(f"crashed after {self.updates} updates")


class CriticTrainer(Trainer):
    """Fits its model to the data, and updates the critic on every batch (steps on each call: no accumulation)."""

    def __init__(self, model, critic, critic_optimizer, **kwargs):
        super().__init__(model, nn.MSELoss(), torch.optim.SGD(model.parameters(), lr=0.05), **kwargs)
        self.add_model("critic", critic, critic_optimizer)
        self.seen_types = set()

    def calculate_train_batch_loss(self, batch):
        critic = self.extra_models["critic"]
        self.seen_types.add(type(critic).__name__)  # what the trainer prepared it into
        self.update_extra_model("critic", nn.functional.mse_loss(critic(batch[0]), batch[1]))
        return super().calculate_train_batch_loss(batch)


def train(folder: Path, batch_size: int, save_dir: Optional[str] = None, crash_after: Optional[int] = None) -> None:
    """Train 3 epochs with ``batch_size`` per process; the main process saves the result to ``folder/result.pt``.

    ``save_dir`` (a folder relative to ``folder``): save a training state after every update, and resume from the
    newest there. ``crash_after``: raise after that many updates, standing for the processes dying.
    """
    save_dir = None if save_dir is None else str((folder / save_dir).resolve())
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(32, 4, generator=generator)
    dataset = TensorDataset(x, (x**2).sum(dim=1, keepdim=True))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    critic = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    callbacks = []
    if save_dir:
        callbacks.append(SaveTrainingStateCallback(save_dir, save_every_n_steps=1))
    if crash_after:
        callbacks.append(CrashAfter(crash_after))
    critic_optimizer = torch.optim.SGD(critic.parameters(), lr=0.05, momentum=0.9)
    trainer = CriticTrainer(model, critic, critic_optimizer, callbacks=callbacks)
    trainer.train(
        dataset,
        num_epochs=3,
        per_device_batch_size=batch_size,
        gradient_clip_norm=0.5,
        train_dataloader_kwargs={"shuffle": False},
        resume_from=save_dir,
    )
    parameters = torch.cat([p.detach().flatten() for p in critic.parameters()])
    gathered = trainer.gather(parameters.unsqueeze(0))
    result = {
        "states": {
            "model": trainer.get_model().state_dict(),
            "optimizer": trainer.optimizer.state_dict(),
            "critic": trainer.get_extra_model("critic").state_dict(),
            "critic_optimizer": trainer.extra_optimizers["critic"].state_dict(),
        },
        "seen_types": sorted(trainer.seen_types),
        "after_run_is_the_module_passed": trainer.extra_models["critic"] is critic,
        "after_run_optimizer_is_the_one_passed": trainer.extra_optimizers["critic"] is critic_optimizer,
        "ranks_agree": bool((gathered == gathered[0]).all()),
        "num_processes": trainer.accelerator.num_processes,
    }
    if trainer.accelerator.is_main_process:
        torch.save(result, folder / "result.pt")
