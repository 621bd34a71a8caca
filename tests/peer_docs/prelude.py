"""What pytorch-accelerated's doc snippets take as given, kept apart from the snippets so that they stay unchanged.

The docs show code that assumes a reader already has a model, data, an optimizer, a ``trainer`` and the usual imports.
:func:`prelude` gives a snippet those names, small and local: a 10-class problem on 1x28x28 "images" (each class a
fixed pattern plus noise, so a linear model learns it in a few epochs), 64 training and 32 evaluation samples.

What is not installed here is replaced by a stand-in module put into ``sys.modules`` (the snippet's own import line
stays as the docs wrote it): :func:`torchvision_stand_in` (MNIST from ``tests/peer_examples/tiny_mnist.py``),
:func:`mlflow_stand_in` (records the calls), and :func:`torchmetrics_before_0_11` (the torchmetrics API the docs
were written for, where ``task`` was optional).
"""

from __future__ import annotations

import importlib.util
import os
import pathlib
import types
from functools import partial

import torch
import torchmetrics
from accelerate import notebook_launcher
from torch import nn
from torch.utils.data import TensorDataset

from pytorch_accel_trainer import Trainer
from pytorch_accel_trainer.callbacks import LogMetricsCallback, TrainerCallback

NUM_CLASSES = 10
BATCH_SIZE = 8
NUM_TRAIN_SAMPLES = 64
NUM_EVAL_SAMPLES = 32
#: More than the 5 warm-up and 5 cool-down epochs of the one snippet that reads it (trainer.rst's CosineLrScheduler).
NUM_EPOCHS = 12
LEARNING_RATE = 0.01

_TINY_MNIST = pathlib.Path(__file__).parents[1] / "peer_examples" / "tiny_mnist.py"


def image_dataset(num_samples: int, seed: int) -> TensorDataset:
    """``num_samples`` 1x28x28 images, labels cycling through the classes; each class one pattern plus noise."""
    patterns = torch.rand(NUM_CLASSES, 1, 28, 28, generator=torch.Generator().manual_seed(0))
    labels = torch.arange(num_samples) % NUM_CLASSES
    noise = 0.3 * torch.randn(num_samples, 1, 28, 28, generator=torch.Generator().manual_seed(seed))
    return TensorDataset(patterns[labels] + noise, labels)


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Flatten(), nn.Linear(28 * 28, NUM_CLASSES))


def prelude() -> dict:
    """A fresh namespace holding every name the vendored snippets use without defining or importing it."""
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=LEARNING_RATE)
    loss_func = nn.CrossEntropyLoss()
    train_dataset = image_dataset(NUM_TRAIN_SAMPLES, seed=1)
    return {
        "__name__": "__main__",  # the quickstart's `if __name__ == "__main__": main()` runs, as in a script
        # imports the snippets leave out
        "os": os,
        "Trainer": Trainer,
        "TrainerCallback": TrainerCallback,
        "LogMetricsCallback": LogMetricsCallback,
        "notebook_launcher": notebook_launcher,
        # the reader's own objects
        "num_gpus": 1,
        "model": model,
        "optimizer": optimizer,
        "loss_func": loss_func,
        "train_dataset": train_dataset,
        "dataset": train_dataset,
        "eval_dataset": image_dataset(NUM_EVAL_SAMPLES, seed=2),
        "num_epochs": NUM_EPOCHS,
        "batch_size": BATCH_SIZE,
        "trainer": Trainer(model, loss_func=loss_func, optimizer=optimizer),
    }


def torchvision_stand_in() -> dict:
    """``sys.modules`` entries for ``torchvision``, ``torchvision.datasets`` and ``torchvision.transforms``."""
    spec = importlib.util.spec_from_file_location("tiny_mnist", _TINY_MNIST)
    tiny_mnist = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tiny_mnist)
    datasets = types.ModuleType("torchvision.datasets")
    datasets.MNIST = tiny_mnist.MNIST
    transforms = types.ModuleType("torchvision.transforms")
    transforms.ToTensor = tiny_mnist.transforms.ToTensor
    torchvision = types.ModuleType("torchvision")
    torchvision.datasets, torchvision.transforms = datasets, transforms
    return {"torchvision": torchvision, "torchvision.datasets": datasets, "torchvision.transforms": transforms}


def mlflow_stand_in() -> types.ModuleType:
    """An ``mlflow`` module whose three functions the AzureML example calls record what they receive."""
    mlflow = types.ModuleType("mlflow")
    mlflow.tracking_uris, mlflow.tags, mlflow.logged_metrics = [], [], []
    mlflow.set_tracking_uri = mlflow.tracking_uris.append
    mlflow.set_tags = mlflow.tags.append
    mlflow.log_metrics = mlflow.logged_metrics.append
    return mlflow


def torchmetrics_before_0_11() -> types.ModuleType:
    """torchmetrics as the docs knew it: ``Accuracy(num_classes=10)`` meant multiclass, micro-averaged.

    torchmetrics 0.11 made ``task`` required; the real module here is otherwise unchanged.
    """
    legacy = types.ModuleType("torchmetrics")
    legacy.MetricCollection = torchmetrics.MetricCollection
    for name in ("Accuracy", "Precision", "Recall"):
        setattr(legacy, name, partial(getattr(torchmetrics, name), task="multiclass", average="micro"))
    return legacy
