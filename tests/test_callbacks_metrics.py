"""MetricCollectionCallback: torchmetrics over each evaluation epoch, recorded in the run history."""

from __future__ import annotations

import pytest
import torch
from conftest import linear_dataset, make_linear, make_trainer
from torch import nn
from torchmetrics import MeanAbsoluteError, MeanSquaredError, MetricCollection
from torchmetrics.classification import MulticlassAccuracy

from pytorch_accel_trainer import DEFAULT_CALLBACKS, Trainer
from pytorch_accel_trainer.callbacks import MetricCollectionCallback, StepBasedEvaluationCallback


def test_mse_metric_equals_eval_loss(capsys):
    """The mean squared error equals the MSE eval loss of each epoch."""
    metrics = MetricCollectionCallback({"mse": MeanSquaredError(), "mae": MeanAbsoluteError()})
    trainer = make_trainer(make_linear(), callbacks=[metrics, *DEFAULT_CALLBACKS])
    trainer.train(linear_dataset(32), num_epochs=2, eval_dataset=linear_dataset(20, seed=1), per_device_batch_size=8)
    history = trainer.run_history
    assert history.get_metric_values("mse") == pytest.approx(history.get_metric_values("eval_loss_epoch"), rel=1e-6)
    x, y = linear_dataset(20, seed=1).tensors
    with torch.no_grad():
        assert history.get_latest_metric("mae") == pytest.approx((trainer.model(x) - y).abs().mean().item(), rel=1e-6)
    assert capsys.readouterr().out.count("mse: ") == 2  # placed first, so the default logger prints them


def test_evaluate_and_intermediate_record_it():
    """An evaluation run and intermediate evaluations record it too."""
    metrics = MetricCollectionCallback(MetricCollection([MeanSquaredError()], prefix="eval_"))
    trainer = make_trainer(make_linear(), callbacks=[metrics, StepBasedEvaluationCallback(2)])
    trainer.train(linear_dataset(32), num_epochs=1, eval_dataset=linear_dataset(8, seed=1), per_device_batch_size=8)
    trainer.evaluate(linear_dataset(8, seed=1), per_device_batch_size=8)
    history = trainer.run_history
    assert len(history.get_metric_values("intermediate_eval_MeanSquaredError")) == 1  # after update 2 of 4
    assert history.get_metric_values("eval_MeanSquaredError")[-1] == pytest.approx(
        history.get_latest_metric("evaluation_loss")
    )


def test_configurable_predictions_and_targets():
    """Predictions and targets come from a configurable function."""

    class Classify(Trainer):
        def calculate_eval_batch_loss(self, batch):
            output = super().calculate_eval_batch_loss(batch)
            return {**output, "labels": (batch[1] > 3).long().squeeze(1)}

    def labels(batch, batch_output):
        return (batch_output["model_outputs"] > 3).long().squeeze(1), batch_output["labels"]

    metrics = MetricCollectionCallback(MulticlassAccuracy(num_classes=2), get_predictions_and_targets=labels)
    model = make_linear()
    with torch.no_grad():
        model.weight.fill_(2.0)  # the exact line y = 2x + 3: every label is right
        model.bias.fill_(3.0)
    trainer = Classify(model, nn.MSELoss(), None, callbacks=[metrics])
    trainer.evaluate(linear_dataset(16), per_device_batch_size=4)
    assert trainer.run_history.get_latest_metric("MulticlassAccuracy") == 1.0


def test_metrics_must_be_torchmetrics():
    with pytest.raises(TypeError, match="metrics is a str; pass a torchmetrics MetricCollection"):
        MetricCollectionCallback("accuracy")
