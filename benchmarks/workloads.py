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
#: A language-model head: ``Embedding(vocab, width)`` then ``Linear(width, vocab)``, batches of ``batch_size``
#: sequences of ``sequence_length`` tokens: one step's float32 logits are batch × length × vocab × 4 bytes (250 MiB).
_LOGITS_MODEL = {
    "model": "lm",
    "vocab": 32000,
    "width": 64,
    "sequence_length": 256,
    "batch_size": 8,
    "lr": 0.5,
    "accumulation": 1,
    "scheduler": False,
    "progress": False,
    "paired": False,  # memory: one process cannot measure two peaks
    "repeats": 2,  # a peak of memory barely moves from one run to the next: 2 repeats are enough
}

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
    "overhead_long": {
        **_OVERHEAD_MODEL,
        "train_samples": 64000,
        "eval_samples": 0,
        "epochs": 5,
        "accumulation": 1,
        "scheduler": False,
        "progress": False,
        "paired": False,  # its point is the whole run of a fresh process; the overhead workload has the pairs
        "quick": {"train_samples": 2048, "epochs": 2},
        "about": (
            "The overhead model for 10,000 steps (5 epochs of 2,000): a run long enough that its whole time, set-up "
            "and warm-up epoch included, is the figure to read (whole-run columns)."
        ),
    },
    "logits_train": {
        **_LOGITS_MODEL,
        "phase": "train",
        "train_samples": 24,
        "eval_samples": 0,
        "epochs": 2,
        "quick": {"vocab": 2000, "sequence_length": 32, "train_samples": 16},
        "about": (
            "Memory: a language-model head (Embedding(32000, 64) -> Linear(64, 32000), cross-entropy, SGD), "
            "batches of 8 x 256 tokens: 250 MiB of float32 logits a step; `train()` against the hand-written loops."
        ),
    },
    "logits_eval": {
        **_LOGITS_MODEL,
        "phase": "evaluate",
        "train_samples": 0,
        "eval_samples": 48,
        "epochs": 1,
        "quick": {"vocab": 2000, "sequence_length": 32, "eval_samples": 16},
        "about": (
            "Memory: the logits_train model and batches, evaluated (no training): `evaluate()` against the "
            "hand-written evaluation loops (`torch.no_grad()`, the loss summed on the device)."
        ),
    },
}


def workload_spec(name: str, quick: bool = False) -> dict:
    """Return the settings of workload ``name``, with the ``--quick`` overrides applied if asked."""
    spec = {key: value for key, value in WORKLOADS[name].items() if key not in ("quick", "about")}
    if quick:
        spec.update(WORKLOADS[name]["quick"])
    spec["name"] = name
    spec.setdefault("model", "mlp")
    spec.setdefault("phase", "train")
    spec.setdefault("paired", True)
    if spec["phase"] == "evaluate":  # one evaluation, timed whole
        spec["steps_per_epoch"] = -(-spec["eval_samples"] // spec["batch_size"])
        spec["timed_steps"] = spec["steps_per_epoch"]
    else:  # the first epoch is warm-up
        spec["steps_per_epoch"] = -(-spec["train_samples"] // spec["batch_size"])
        spec["timed_steps"] = spec["steps_per_epoch"] * (spec["epochs"] - 1)
    spec["total_steps"] = spec["steps_per_epoch"] * spec["epochs"]
    if spec["model"] == "lm":
        spec["logits_mib"] = spec["batch_size"] * spec["sequence_length"] * spec["vocab"] * 4 / 2**20
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

    if spec["model"] == "lm":
        return _token_datasets(spec)
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


def _token_datasets(spec: dict):
    """Token sequences whose next token is a fixed function of the current one, so that the head can learn it."""
    import torch
    from torch.utils.data import TensorDataset

    generator = torch.Generator().manual_seed(DATA_SEED)
    vocab = spec["vocab"]
    datasets = []
    for samples in (spec["train_samples"], spec["eval_samples"]):
        tokens = torch.randint(vocab, (samples, spec["sequence_length"]), generator=generator)
        datasets.append(TensorDataset(tokens, (tokens * 7 + 3) % vocab) if samples else None)
    return tuple(datasets)


class FlatCrossEntropy:
    """Cross-entropy of ``(tokens, vocab)`` logits against ``(batch, length)`` targets (flattened: a view)."""

    def __call__(self, logits, targets):
        import torch.nn.functional as F

        return F.cross_entropy(logits, targets.reshape(-1))


def make_loss_func(spec: dict):
    """The workload's loss: mean squared error for the MLPs, cross-entropy for the language-model head."""
    import torch

    return FlatCrossEntropy() if spec["model"] == "lm" else torch.nn.MSELoss()


def make_model(spec: dict):
    """Return the workload's model, seeded the same for every row: the MLP (Linear layers with ReLU between them),
    or the language-model head, whose ``(batch, length, vocab)`` logits come out flattened to ``(tokens, vocab)``."""
    import torch
    from torch import nn

    torch.manual_seed(MODEL_SEED)
    if spec["model"] == "lm":
        vocab, width = spec["vocab"], spec["width"]
        return nn.Sequential(nn.Embedding(vocab, width), nn.Linear(width, vocab), nn.Flatten(0, 1))
    dims = spec["dims"]
    layers: list = []
    for index, (fan_in, fan_out) in enumerate(zip(dims[:-1], dims[1:])):
        if index:
            layers.append(nn.ReLU())
        layers.append(nn.Linear(fan_in, fan_out))
    return nn.Sequential(*layers)


def updates_per_epoch(spec: dict) -> int:
    return -(-spec["steps_per_epoch"] // spec["accumulation"])
