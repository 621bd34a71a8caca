"""What the config tests import by path: datasets made here (nothing downloaded) and a Trainer subclass."""

import os

import torch
from torch.utils.data import TensorDataset

from pytorch_accel_trainer import Trainer
from pytorch_accel_trainer.callbacks import TrainerCallback

#: A run of a linear regression as a config (the content of a run.yaml): 3 epochs, a few batches, no console output.
TINY_CONFIG = {
    "model": {"class_path": "torch.nn.Linear", "init_args": {"in_features": 3, "out_features": 1}},
    "optimizer": {"class_path": "torch.optim.SGD", "init_args": {"lr": 0.05}},
    "loss_func": "torch.nn.functional.mse_loss",
    "data": {"train": "config_data.tiny.train_dataset", "eval": "config_data.tiny.eval_dataset"},
    "train": {"num_epochs": 3, "per_device_batch_size": 16},
    "default_callbacks": False,
}


def train_dataset(num_samples: int = 64) -> TensorDataset:
    x = torch.randn(num_samples, 3, generator=torch.Generator().manual_seed(0))
    return TensorDataset(x, x @ torch.tensor([[1.0], [-2.0], [0.5]]) + 1)


def eval_dataset(num_samples: int = 64) -> TensorDataset:
    return train_dataset(num_samples // 2)


def noisy_train_dataset(num_samples: int = 64, noise: float = 0.1) -> TensorDataset:
    """A training set with an argument ``eval_dataset`` does not take: ``data.arguments`` go to both."""
    x, y = train_dataset(num_samples).tensors
    return TensorDataset(x, y + noise * torch.randn(y.shape, generator=torch.Generator().manual_seed(1)))


class TaggedTrainer(Trainer):
    """A subclass with an argument of its own, given by ``trainer_arguments``; it keeps each instance, for the test."""

    instances: list = []

    def __init__(self, *args, tag: str = "none", **kwargs):
        super().__init__(*args, **kwargs)
        self.tag = tag
        TaggedTrainer.instances.append(self)


def tensors(num_samples: int = 64) -> tuple:
    """A data function that returns the tensors themselves, not a dataset: a user's mistake."""
    dataset = train_dataset(num_samples)
    return dataset.tensors


def broken(num_samples: int = 64):
    """A data function with a bug of its own: its error keeps its traceback."""
    raise ValueError("a bug in the user's data function")


class ExitOnceCallback(TrainerCallback):
    """Kills the process at the end of the first epoch of the first run that finds no ``marker`` file (writing it):
    a search killed in the middle of a trial, for the resume test."""

    def __init__(self, marker: str):
        self.marker = marker

    def on_training_run_epoch_end(self, trainer, **kwargs):
        if not os.path.exists(self.marker):
            open(self.marker, "w").close()
            os._exit(3)
