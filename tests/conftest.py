"""Tiny real fixtures: y = 2x + 3 data, small models, and a callback that records every event."""

from __future__ import annotations

import os
import sys

import pytest
import torch
from torch import nn
from torch.utils.data import IterableDataset, TensorDataset

from pytorch_accel_trainer import Trainer
from pytorch_accel_trainer.callbacks import EVENTS, TrainerCallback


def pytest_report_header(config):
    """CI's log says which torch and accelerate the suite ran against (setup.cfg declares the tested range)."""
    import accelerate

    return f"pytorch_accel_trainer tested with torch {torch.__version__}, accelerate {accelerate.__version__}"


#: The environment of a multi-process test: gloo on the CPU, one thread per process (the machine has 2 cores).
CPU_PROCESSES_ENV = {**os.environ, "ACCELERATE_USE_CPU": "1", "OMP_NUM_THREADS": "1"}


def launcher(num_processes: int) -> list:
    """The start of a command that runs a script (appended, with its arguments) on ``num_processes`` processes:
    ``accelerate launch`` for several, plain ``python`` for one."""
    if num_processes == 1:
        return [sys.executable]
    return [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--multi_gpu",
        "--num_processes",
        str(num_processes),
        "--num_machines",
        "1",
        "--mixed_precision",
        "no",
        "--dynamo_backend",
        "no",
        "--main_process_port",
        "0",
    ]


def load_module_from(path, name: str):
    """The module of the Python file at ``path``, imported under ``name`` (a file outside any package: an example,
    a helper beside the data it serves)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def linear_dataset(num_samples: int = 64, seed: int = 0) -> TensorDataset:
    """Samples of y = 2x + 3 (exactly learnable by nn.Linear(1, 1))."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(num_samples, 1, generator=generator)
    return TensorDataset(x, 2 * x + 3)


def regression_dataset(num_samples: int = 20, num_features: int = 4, seed: int = 0) -> TensorDataset:
    """A small nonlinear regression problem for equivalence tests."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(num_samples, num_features, generator=generator)
    y = (x**2).sum(dim=1, keepdim=True) + torch.randn(num_samples, 1, generator=generator) * 0.1
    return TensorDataset(x, y)


def make_mlp(num_features: int = 4, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(num_features, 8), nn.Tanh(), nn.Linear(8, 1))


def make_linear(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Linear(1, 1)


class StreamDataset(IterableDataset):
    """The samples of a TensorDataset, streamed in order, with no __len__."""

    def __init__(self, dataset: TensorDataset):
        self.dataset = dataset

    def __iter__(self):
        for index in range(len(self.dataset)):
            yield self.dataset[index]


class RecordingCallback(TrainerCallback):
    """Records the name of every event it receives, in order."""

    def __init__(self):
        self.events: list[str] = []


def _recorder(event):
    def record(self, trainer, **kwargs):
        self.events.append(event)

    return record


for _event in EVENTS:
    setattr(RecordingCallback, _event, _recorder(_event))


def assert_bitwise_equal(a, b) -> None:
    """Tensors (and nested dicts/lists of them) equal bit for bit, dtypes included."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for key in a:
            assert_bitwise_equal(a[key], b[key])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_bitwise_equal(x, y)
    else:
        assert a == b


def make_trainer(model: nn.Module, lr: float = 0.1, callbacks=(), trainer_class=Trainer, **kwargs) -> Trainer:
    return trainer_class(
        model=model,
        loss_func=nn.MSELoss(),
        optimizer=torch.optim.SGD(model.parameters(), lr=lr),
        callbacks=callbacks,
        **kwargs,
    )


@pytest.fixture
def recorder() -> RecordingCallback:
    return RecordingCallback()
