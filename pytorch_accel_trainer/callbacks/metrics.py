"""Compute torchmetrics metrics over each evaluation epoch and record them in the run history."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Callable, Optional, Union

import torch

from pytorch_accel_trainer.callbacks.base import TrainerCallback

if TYPE_CHECKING:  # torchmetrics takes seconds to import: only when the callback is created
    from torchmetrics import Metric, MetricCollection

    from pytorch_accel_trainer.trainer import Trainer


def get_model_outputs_and_targets(batch: Any, batch_output: dict) -> tuple:
    """Return ``(batch_output["model_outputs"], batch[1])``, or ``batch["labels"]`` for a dict batch: the predictions
    and targets of the default hooks. A model output with ``logits`` (Hugging Face) gives its logits."""
    outputs = batch_output["model_outputs"]
    outputs = outputs.logits if hasattr(outputs, "logits") else outputs
    return outputs, batch["labels"] if isinstance(batch, Mapping) else batch[1]


class MetricCollectionCallback(TrainerCallback):
    """Runs a torchmetrics ``MetricCollection`` over each evaluation epoch and records each metric.

    At the start of each evaluation epoch the metrics are moved to ``trainer.device`` and reset; after
    each evaluation batch they are updated with ``get_predictions_and_targets(batch, batch_output)``; at the
    end of the epoch they are computed and each is recorded in the run history under its name in the
    collection (a scalar as a float, any other tensor as a list). torchmetrics combines the states of
    every process when it computes, so the value is that of the whole evaluation set, the same on every
    process, and exact: the few samples Accelerate repeats to give every process a full last batch are left
    out (``trainer.eval_batch_real_rows``). In an intermediate or EMA evaluation, the run history's prefix applies:
    ``intermediate_accuracy``, ``ema_model_accuracy``.

    Place it before the callbacks that read the metrics at the end of an evaluation epoch
    (``LogMetricsCallback``, ``ModelEmaCallback``): ``callbacks=(MetricCollectionCallback(...), *DEFAULT_CALLBACKS)``.

    Args:
        metrics: a ``MetricCollection``, a ``Metric``, or a dict or list of them (made into a collection).
        get_predictions_and_targets: ``fn(batch, batch_output) -> (predictions, targets)``; by default the
            ``model_outputs`` of the batch output (their ``logits`` for a Hugging Face output) and ``batch[1]``
            (``batch["labels"]`` for a dict batch).

    Example::

        from torchmetrics.classification import MulticlassAccuracy

        metrics = MetricCollectionCallback({"accuracy": MulticlassAccuracy(num_classes=10)})
        trainer = Trainer(model, loss_func, optimizer, callbacks=(metrics, *DEFAULT_CALLBACKS))
    """

    def __init__(
        self,
        metrics: Union["MetricCollection", "Metric", dict, list],
        get_predictions_and_targets: Optional[Callable[[Any, dict], tuple]] = None,
    ):
        from torchmetrics import Metric, MetricCollection

        if not isinstance(metrics, (MetricCollection, Metric, dict, list, tuple)):
            raise TypeError(
                f"metrics is a {type(metrics).__name__}; pass a torchmetrics MetricCollection, a Metric, or a dict "
                "or list of Metrics, e.g. {'accuracy': MulticlassAccuracy(num_classes=10)}."
            )
        self.metrics = metrics if isinstance(metrics, MetricCollection) else MetricCollection(metrics)
        self.get_predictions_and_targets = get_predictions_and_targets or get_model_outputs_and_targets

    def on_eval_epoch_start(self, trainer: "Trainer", **kwargs):
        self.metrics.to(trainer.device)
        self.metrics.reset()

    def on_eval_step_end(self, trainer: "Trainer", batch: Any = None, batch_output: Optional[dict] = None, **kwargs):
        if batch_output is None:
            return  # called by hand without a batch output: nothing to measure
        predictions, targets = self.get_predictions_and_targets(batch, batch_output)
        real_rows = trainer.eval_batch_real_rows
        if real_rows is not None:  # the rest repeat samples only to give every process a full last batch
            predictions, targets = predictions[:real_rows], targets[:real_rows]
        self.metrics.update(predictions, targets)

    def on_eval_epoch_end(self, trainer: "Trainer", **kwargs):
        for name, value in self.metrics.compute().items():  # syncs over processes: once per epoch
            trainer.run_history.update_metric(name, _to_plain(value))
        self.metrics.reset()


def _to_plain(value: Any) -> Any:
    """A scalar tensor as a float, any other tensor as a list: values the run history can print and export."""
    if isinstance(value, torch.Tensor):
        return value.item() if value.numel() == 1 else value.tolist()
    return value
