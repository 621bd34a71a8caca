"""The benchmark's workloads, rows and their shared data and models.

This module imports only the standard library at the top, so that the parent process (which never imports
torch) can read the workload table, and so that each worker times its own imports.
"""

from __future__ import annotations

import importlib.util

#: Rows that always run, in report order; ``torch_loop`` is the baseline of the ratio column.
CORE_ROWS = ("torch_loop", "accelerate_loop", "trainer_default", "trainer_no_callbacks")
#: Extra rows, run only when their package is importable (never a dependency of this project).
OPTIONAL_ROWS = {"pytorch_accelerated": "pytorch_accelerated", "lightning": "lightning"}
BASELINE_ROW = "torch_loop"

DATA_SEED = 0  # the data of every row
MODEL_SEED = 0  # the initial weights of every row
TRAIN_SEED = 42  # the shuffling of every row (the trainer's default seed, set at the start of train())

_OVERHEAD_MODEL = {"dims": (32, 64, 1), "batch_size": 32, "lr": 0.01}

#: Each workload: model and data sizes, number of epochs (the first one is warm-up and is not timed),
#: and the features it exercises. ``quick`` holds the overrides of ``--quick`` (a smoke run).
WORKLOADS: dict[str, dict] = {
    "overhead": {
        **_OVERHEAD_MODEL,
        "train_samples": 8192,
        "eval_samples": 0,
        "epochs": 4,
        "accumulation": 1,
        "scheduler": False,
        "progress": False,
        "quick": {"train_samples": 2048, "epochs": 2},
        "about": "MLP 32-64-1, SGD lr 0.01, MSE, in-memory data: mostly per-step framework and DataLoader overhead.",
    },
    "compute": {
        "dims": (512, 1024, 1024, 1),
        "batch_size": 256,
        "lr": 0.01,
        "train_samples": 3072,
        "eval_samples": 0,
        "epochs": 3,
        "accumulation": 1,
        "scheduler": False,
        "progress": False,
        "quick": {"train_samples": 1024, "epochs": 2},
        "about": "MLP 512-1024-1024-1 (about 20 ms a step on one core of the reference machine): overhead vs compute.",
    },
    "eval_heavy": {
        **_OVERHEAD_MODEL,
        "train_samples": 2048,
        "eval_samples": 8192,
        "epochs": 3,
        "accumulation": 1,
        "scheduler": False,
        "progress": False,
        "quick": {"train_samples": 512, "eval_samples": 2048, "epochs": 2},
        "about": (
            "The overhead model with an eval set 4x the train set, evaluated every epoch; "
            "µs/step = (train + eval time) / training steps."
        ),
    },
    "sched_accum_progress": {
        **_OVERHEAD_MODEL,
        "train_samples": 8192,
        "eval_samples": 0,
        "epochs": 3,
        "accumulation": 4,
        "scheduler": True,  # OneCycleLR(max_lr=0.05), stepped once per optimizer update
        "max_lr": 0.05,
        "progress": True,  # tqdm in the hand-written loops, the default callbacks in trainer_default
        "quick": {"train_samples": 2048, "epochs": 2},
        "about": (
            "The overhead model with OneCycleLR stepped per update, gradient accumulation 4 and a progress bar "
            "(tqdm in the hand loops; trainer_no_callbacks has no bar)."
        ),
    },
}


def workload_spec(name: str, quick: bool = False) -> dict:
    """Return the settings of workload ``name``, with the ``--quick`` overrides applied if asked."""
    spec = {key: value for key, value in WORKLOADS[name].items() if key not in ("quick", "about")}
    if quick:
        spec.update(WORKLOADS[name]["quick"])
    spec["name"] = name
    spec["steps_per_epoch"] = -(-spec["train_samples"] // spec["batch_size"])
    spec["timed_steps"] = spec["steps_per_epoch"] * (spec["epochs"] - 1)
    return spec


def available_rows() -> list[str]:
    """The core rows, then the optional rows whose package can be found (without importing it)."""
    optional = [row for row, module in OPTIONAL_ROWS.items() if importlib.util.find_spec(module) is not None]
    return [*CORE_ROWS, *optional]


# ----------------------------------------------------------------------------------------------------
# Data and models (torch is imported inside, by a worker that has already timed its imports)
# ----------------------------------------------------------------------------------------------------


def make_datasets(spec: dict):
    """Return ``(train_dataset, eval_dataset or None)``: the same tensors for every row."""
    import torch
    from torch.utils.data import TensorDataset

    generator = torch.Generator().manual_seed(DATA_SEED)
    num_features = spec["dims"][0]
    total = spec["train_samples"] + spec["eval_samples"]
    x = torch.randn(total, num_features, generator=generator)
    w = torch.randn(num_features, 1, generator=generator) / num_features**0.5
    y = 2 * torch.tanh(x @ w) + 0.1 * torch.randn(total, 1, generator=generator)
    n = spec["train_samples"]
    train = TensorDataset(x[:n].clone(), y[:n].clone())
    evaluation = TensorDataset(x[n:].clone(), y[n:].clone()) if spec["eval_samples"] else None
    return train, evaluation


def make_model(spec: dict):
    """Return the workload's MLP (Linear layers with ReLU between them), seeded the same for every row."""
    import torch
    from torch import nn

    torch.manual_seed(MODEL_SEED)
    dims = spec["dims"]
    layers: list = []
    for index, (fan_in, fan_out) in enumerate(zip(dims[:-1], dims[1:])):
        if index:
            layers.append(nn.ReLU())
        layers.append(nn.Linear(fan_in, fan_out))
    return nn.Sequential(*layers)


def updates_per_epoch(spec: dict) -> int:
    return -(-spec["steps_per_epoch"] // spec["accumulation"])
