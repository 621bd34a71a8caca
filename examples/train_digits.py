"""Train a small MLP on scikit-learn's handwritten digits, with accuracy measured by torchmetrics.

The digits (1,797 8x8 images, bundled with scikit-learn, so nothing is downloaded) are standardised and
split into training and evaluation sets with a fixed seed. The run uses the default callbacks (a
progress bar per epoch and the metrics printed after each one), AdamW with a one-cycle learning-rate
schedule built from :class:`TrainerPlaceholderValues`, and a Trainer subclass that records the
evaluation accuracy in the run history. It takes a few seconds on two CPU cores.

Run it on one process, or on several with Accelerate::

    python examples/train_digits.py
    accelerate launch examples/train_digits.py --num-epochs 20

The same run, described by a config file (``examples/digits.yaml``) instead of this script::

    pytorch-accel-trainer fit --config examples/digits.yaml

It writes ``<output-dir>/model.pt`` (a checkpoint that ``Trainer.load_checkpoint`` reads back) and
``<output-dir>/history.csv`` (one row per epoch, one column per metric).
"""

from __future__ import annotations

import argparse
import os
from functools import partial
from typing import Optional, Sequence

import torch
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from sklearn.preprocessing import StandardScaler
from torch import nn
from torch.optim.lr_scheduler import OneCycleLR
from torch.utils.data import TensorDataset
from torchmetrics.classification import MulticlassAccuracy

from pytorch_accel_trainer import Trainer, TrainerPlaceholderValues

SEED = 42
NUM_CLASSES = 10
# 384 = 12 batches of 32, which split evenly over 1, 2, 3, 4, 6 or 12 processes. With an uneven split,
# Accelerate repeats a few samples to give every process full batches, and the accuracy would count them.
NUM_EVAL_SAMPLES = 384


class DigitsTrainer(Trainer):
    """A Trainer that also measures the classification accuracy of each evaluation epoch.

    The metric is an ``nn.Module`` attribute, so the default ``MoveModulesToDeviceCallback`` puts it on
    the run's device. It is updated for every evaluation batch and computed once per epoch, over the
    predictions of every process.
    """

    def __init__(self, *args, num_classes: int = NUM_CLASSES, **kwargs):
        super().__init__(*args, **kwargs)
        # validate_args=False skips input checks that copy values back to the host on every batch
        self.accuracy = MulticlassAccuracy(num_classes=num_classes, average="micro", validate_args=False)

    def calculate_eval_batch_loss(self, batch) -> dict:
        batch_output = super().calculate_eval_batch_loss(batch)
        self.accuracy.update(batch_output["model_outputs"], batch[1])
        return batch_output

    def eval_epoch_end(self) -> None:
        # compute() sums the counts of every process, so each process records the same accuracy
        self.run_history.update_metric("accuracy", self.accuracy.compute().item())
        self.accuracy.reset()


def create_datasets(seed: int = SEED) -> tuple[TensorDataset, TensorDataset]:
    """Return the standardised digits as ``(train_dataset, eval_dataset)``, split with ``seed``."""
    digits = load_digits()
    x_train, x_eval, y_train, y_eval = train_test_split(
        digits.data, digits.target, test_size=NUM_EVAL_SAMPLES, random_state=seed, stratify=digits.target
    )
    scaler = StandardScaler().fit(x_train)  # statistics of the training set only

    def to_dataset(features, labels) -> TensorDataset:
        features = torch.as_tensor(scaler.transform(features), dtype=torch.float32)
        return TensorDataset(features, torch.as_tensor(labels, dtype=torch.long))

    return to_dataset(x_train, y_train), to_dataset(x_eval, y_eval)


def train_dataset(seed: int = SEED) -> TensorDataset:
    """The training set of :func:`create_datasets` (what ``examples/digits.yaml`` names as ``data.train``)."""
    return create_datasets(seed)[0]


def eval_dataset(seed: int = SEED) -> TensorDataset:
    """The evaluation set of :func:`create_datasets` (``data.eval`` in ``examples/digits.yaml``)."""
    return create_datasets(seed)[1]


class DigitsClassifier(nn.Sequential):
    """The classifier: 64 pixels -> ``hidden_size`` hidden units -> 10 digit logits."""

    def __init__(self, hidden_size: int = 128, num_classes: int = NUM_CLASSES):
        super().__init__(nn.Linear(64, hidden_size), nn.ReLU(), nn.Linear(hidden_size, num_classes))


def create_model() -> nn.Module:
    """Return the classifier: 64 pixels -> 128 hidden units -> 10 digit logits."""
    return DigitsClassifier()


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-epochs", type=int, default=15, help="training epochs (default: 15)")
    parser.add_argument("--batch-size", type=int, default=32, help="batch size per device (default: 32)")
    parser.add_argument("--lr", type=float, default=1e-2, help="peak learning rate of the one-cycle schedule")
    parser.add_argument("--output-dir", default=os.path.join("runs", "digits"), help="where to write the results")
    return parser.parse_args(argv)


def main(argv: Optional[Sequence[str]] = None) -> float:
    """Train and evaluate the classifier, save the checkpoint and history, and return the final accuracy."""
    args = parse_args(argv)
    train_dataset, eval_dataset = create_datasets()
    torch.manual_seed(SEED)  # the same initial weights on every run (the trainer seeds only from train() on)
    model = create_model()
    trainer = DigitsTrainer(
        model,
        loss_func=nn.CrossEntropyLoss(),
        optimizer=torch.optim.AdamW(model.parameters(), lr=args.lr),
        num_classes=NUM_CLASSES,
        seed=SEED,
    )
    trainer.train(
        train_dataset=train_dataset,
        num_epochs=args.num_epochs,
        eval_dataset=eval_dataset,
        per_device_batch_size=args.batch_size,
        # resolved when training starts, once the dataloaders are sharded across the processes
        create_scheduler_fn=partial(
            OneCycleLR,
            max_lr=args.lr,
            epochs=TrainerPlaceholderValues.NUM_EPOCHS,
            steps_per_epoch=TrainerPlaceholderValues.NUM_UPDATE_STEPS_PER_EPOCH,
        ),
    )

    accuracy = trainer.run_history.get_latest_metric("accuracy")
    trainer.save_checkpoint(os.path.join(args.output_dir, "model.pt"), checkpoint_kwargs={"accuracy": accuracy})
    if trainer.run_config.is_world_process_zero:  # one writer, not one per process
        os.makedirs(args.output_dir, exist_ok=True)
        trainer.run_history.to_csv(os.path.join(args.output_dir, "history.csv"))
    trainer.print(f"\nFinal eval accuracy: {accuracy:.4f} (results in {args.output_dir})")
    return accuracy


if __name__ == "__main__":
    main()
