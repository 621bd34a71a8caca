"""Fit y = 2x + 3 with one linear layer. Runs unchanged with `python` or `accelerate launch`."""

import torch
from torch import nn
from torch.utils.data import TensorDataset

from pytorch_accel_trainer import Trainer
from pytorch_accel_trainer.callbacks import TrainerCallback


class LineTrainer(Trainer):
    def train_epoch_end(self):  # a hook: runs at the end of each training epoch
        self.run_history.update_metric("weight", self.get_model().weight.item())
        self.run_history.update_metric("bias", self.get_model().bias.item())


class PrintLine(TrainerCallback):
    def on_training_run_epoch_end(self, trainer, **kwargs):  # an event: fires once each epoch is done
        history = trainer.run_history
        weight, bias = history.get_latest_metric("weight"), history.get_latest_metric("bias")
        trainer.print(f"epoch {history.current_epoch}: y = {weight:.3f}x + {bias:.3f}")


x = torch.linspace(-2, 2, 256).unsqueeze(1)
model = nn.Linear(1, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
trainer = LineTrainer(model, loss_func=nn.MSELoss(), optimizer=optimizer, callbacks=[PrintLine])
trainer.train(TensorDataset(x, 2 * x + 3), num_epochs=10, per_device_batch_size=32)
