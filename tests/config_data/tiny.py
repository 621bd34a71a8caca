"""What the config tests import by path: datasets made here (nothing downloaded) and a Trainer subclass."""

import torch
from torch.utils.data import TensorDataset

from pytorch_accel_trainer import Trainer


def train_dataset(num_samples: int = 64) -> TensorDataset:
    x = torch.randn(num_samples, 3, generator=torch.Generator().manual_seed(0))
    return TensorDataset(x, x @ torch.tensor([[1.0], [-2.0], [0.5]]) + 1)


def eval_dataset(num_samples: int = 64) -> TensorDataset:
    return train_dataset(num_samples // 2)


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
