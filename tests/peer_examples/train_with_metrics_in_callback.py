# Copyright © 2021 Chris Hughes
# Vendored from pytorch-accelerated 0.1.61, examples/core/train_with_metrics_in_callback.py, under the Apache License 2.0
# (https://www.apache.org/licenses/LICENSE-2.0). tests/test_peer_examples.py runs it. Changed here, nothing else:
#   - the imports of `pytorch_accelerated` are renamed to `pytorch_accel_trainer`;
#   - `transforms` and `MNIST` are imported from tiny_mnist (this folder), a local stand-in with MNIST's shapes,
#     instead of torchvision, so that the example runs without torchvision and without a download.
# ruff: noqa
########################################################################
# This example trains a model on the MNIST Dataset

# This example demonstrates how a callback can be used to track metrics
# to avoid having to override the default trainer class
#
# Note, this example requires installing the torchmetrics package
########################################################################

from pathlib import Path

from torch import nn, optim
from torch.utils.data import random_split
from torchmetrics import Accuracy, MetricCollection, Precision, Recall
from tiny_mnist import transforms
from tiny_mnist import MNIST

from pytorch_accel_trainer import Trainer
from pytorch_accel_trainer.callbacks import TrainerCallback
from pytorch_accel_trainer.trainer import DEFAULT_CALLBACKS


class MNISTModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.main = nn.Sequential(
            nn.Linear(in_features=784, out_features=128),
            nn.ReLU(),
            nn.Linear(in_features=128, out_features=64),
            nn.ReLU(),
            nn.Linear(in_features=64, out_features=10),
        )

    def forward(self, x):
        return self.main(x.view(x.shape[0], -1))


class ClassificationMetricsCallback(TrainerCallback):
    def __init__(self, num_classes):
        self.metrics = MetricCollection(
            {
                "accuracy": Accuracy(task="multiclass", num_classes=num_classes),
                "precision": Precision(
                    task="multiclass", num_classes=num_classes, average="macro"
                ),
                "recall": Recall(
                    task="multiclass", num_classes=num_classes, average="macro"
                ),
            }
        )

    def _move_to_device(self, trainer):
        self.metrics.to(trainer.device)

    def on_training_run_start(self, trainer, **kwargs):
        self._move_to_device(trainer)

    def on_evaluation_run_start(self, trainer, **kwargs):
        self._move_to_device(trainer)

    def on_eval_step_end(self, trainer, batch, batch_output, **kwargs):
        preds = batch_output["model_outputs"].argmax(dim=-1)
        self.metrics.update(preds, batch[1])

    def on_eval_epoch_end(self, trainer, **kwargs):
        metrics = self.metrics.compute()
        trainer.run_history.update_metric("accuracy", metrics["accuracy"].cpu())
        trainer.run_history.update_metric("precision", metrics["precision"].cpu())
        trainer.run_history.update_metric("recall", metrics["recall"].cpu())

        self.metrics.reset()


DATA_PATH = Path("/".join(Path(__file__).absolute().parts[:-2])) / "data"


def main():
    dataset = MNIST(DATA_PATH, download=True, transform=transforms.ToTensor())
    num_classes = len(dataset.class_to_idx)

    train_dataset, validation_dataset, test_dataset = random_split(
        dataset, [50000, 5000, 5000]
    )
    model = MNISTModel()
    optimizer = optim.SGD(model.parameters(), lr=0.001, momentum=0.9)
    loss_func = nn.CrossEntropyLoss()

    trainer = Trainer(
        model,
        loss_func=loss_func,
        optimizer=optimizer,
        callbacks=(
            ClassificationMetricsCallback(
                num_classes=num_classes,
            ),
            *DEFAULT_CALLBACKS,
        ),
    )

    trainer.train(
        train_dataset=train_dataset,
        eval_dataset=validation_dataset,
        num_epochs=2,
        per_device_batch_size=32,
    )

    trainer.evaluate(
        dataset=test_dataset,
        per_device_batch_size=64,
    )


if __name__ == "__main__":
    main()
