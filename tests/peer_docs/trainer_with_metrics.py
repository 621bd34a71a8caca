# Copyright © 2021 Chris Hughes
# Vendored from pytorch-accelerated 0.1.61, docs/trainer.rst (the literal block at line 278), under the Apache License 2.0
# (https://www.apache.org/licenses/LICENSE-2.0). tests/test_peer_docs.py runs it after the names the snippet takes
# as given (tests/peer_docs/prelude.py). Changed here, nothing else: `pytorch_accelerated` is renamed to
# `pytorch_accel_trainer`, and trailing whitespace is dropped.
# fmt: off
# ruff: noqa
from torchmetrics import MetricCollection, Accuracy, Precision, Recall
from pytorch_accel_trainer import Trainer

class TrainerWithMetrics(Trainer):
    def __init__(self, num_classes, *args, **kwargs):
        super().__init__(*args, **kwargs)

        # this will be moved to the correct device automatically by the
        # MoveModulesToDeviceCallback callback, which is used by default
        self.metrics = MetricCollection(
            {
                "accuracy": Accuracy(num_classes=num_classes),
                "precision": Precision(num_classes=num_classes),
                "recall": Recall(num_classes=num_classes),
            }
        )

    def calculate_eval_batch_loss(self, batch):
        batch_output = super().calculate_eval_batch_loss(batch)
        preds = batch_output["model_outputs"].argmax(dim=-1)

        self.metrics.update(preds, batch[1])

        return batch_output

    def eval_epoch_end(self):
        metrics = self.metrics.compute()
        self.run_history.update_metric("accuracy", metrics["accuracy"].cpu())
        self.run_history.update_metric("precision", metrics["precision"].cpu())
        self.run_history.update_metric("recall", metrics["recall"].cpu())

        self.metrics.reset()
