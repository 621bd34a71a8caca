"""Extra scalars returned by the batch-loss hooks: averaged over each epoch like the loss, and recorded."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from pytorch_accel_trainer import Trainer
from pytorch_accel_trainer.callbacks import TrainerCallback
from pytorch_accel_trainer.callbacks.non_finite import SkipNonFiniteStepsCallback
from pytorch_accel_trainer.tracking import StepMetricsTracker, is_scalar_metric


def classification_dataset(num_samples: int = 30) -> TensorDataset:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(num_samples, 4, generator=generator)
    return TensorDataset(x, (x[:, 0] + x[:, 1] > 0).long())


class AccuracyTrainer(Trainer):
    """Returns the batch accuracy (a 0-d tensor), a plain number, and values that are not metrics."""

    def calculate_train_batch_loss(self, batch):
        output = super().calculate_train_batch_loss(batch)
        correct = (output["model_outputs"].argmax(dim=1) == batch[1]).float()
        return {**output, "accuracy": correct.mean(), "ones": 1, "flag": True, "per_sample": correct, "tag": "x"}

    def calculate_eval_batch_loss(self, batch):
        output = super().calculate_eval_batch_loss(batch)
        return {**output, "accuracy": (output["model_outputs"].argmax(dim=1) == batch[1]).float().mean()}


class BatchAccuracies(TrainerCallback):
    """Records each training batch's accuracy and size, to compute the expected epoch mean by hand."""

    def __init__(self):
        self.batches = []

    def on_train_epoch_start(self, trainer, **kwargs):
        self.batches.append([])

    def on_train_step_end(self, trainer, batch_output=None, **kwargs):
        self.batches[-1].append((batch_output["accuracy"].item(), batch_output["batch_size"]))


def make_trainer(callbacks=(), trainer_class=AccuracyTrainer, **kwargs) -> Trainer:
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    return trainer_class(
        model, nn.CrossEntropyLoss(), torch.optim.SGD(model.parameters(), lr=0.5), callbacks=callbacks, **kwargs
    )


def test_extra_scalars_are_epoch_means():
    """Extra scalars are recorded as the sample-weighted mean of each epoch."""
    batches = BatchAccuracies()
    trainer = make_trainer([batches])
    trainer.train(
        classification_dataset(30), num_epochs=2, eval_dataset=classification_dataset(30), per_device_batch_size=8
    )
    history = trainer.run_history
    expected = [sum(a * n for a, n in epoch) / sum(n for _, n in epoch) for epoch in batches.batches]
    assert [len(epoch) for epoch in batches.batches] == [4, 4]  # 8 + 8 + 8 + 6: weights differ
    assert history.get_metric_values("train_accuracy_epoch") == pytest.approx(expected, rel=1e-6)
    assert history.get_metric_values("train_ones_epoch") == [1.0, 1.0]
    assert len(history.get_metric_values("eval_accuracy_epoch")) == 2
    assert (
        not {"train_flag_epoch", "train_per_sample_epoch", "train_tag_epoch", "train_batch_size_epoch"}
        & history.get_metric_names()
    )
    assert history.get_metric_values("train_accuracy_epoch")[-1] > 0.7  # the model learns the rule


def test_evaluate_records_and_returns_metrics():
    """evaluate records evaluation metrics next to the evaluation loss, and returns them."""
    trainer = make_trainer()
    result = trainer.evaluate(classification_dataset(30), per_device_batch_size=7)
    model = trainer.model
    with torch.no_grad():
        x, y = classification_dataset(30).tensors
        accuracy = (model(x).argmax(dim=1) == y).float().mean().item()
    assert set(result) == {"evaluation_loss", "evaluation_accuracy"}
    assert result["evaluation_accuracy"] == pytest.approx(accuracy, rel=1e-6)
    assert trainer.run_history.get_latest_metric("evaluation_accuracy") == result["evaluation_accuracy"]


def test_step_metrics_under_accumulation():
    """Step metrics are the same with and without gradient accumulation."""
    runs = []
    for batch_size, accumulation in ((8, 1), (4, 2)):
        trainer = make_trainer()
        trainer.train(
            classification_dataset(32),
            num_epochs=1,
            per_device_batch_size=batch_size,
            gradient_accumulation_steps=accumulation,
            train_dataloader_kwargs={"shuffle": False},
        )
        runs.append(trainer.run_history.get_metric_values("train_ones_epoch"))
    assert runs[0] == runs[1] == [1.0]


def test_step_metric_resumes_mid_epoch(tmp_path):
    """A step metric resumes exactly from a state taken inside an epoch."""

    class SaveAtStep(TrainerCallback):
        def on_optimizer_step_end(self, trainer, num_update_steps_completed=0, **kwargs):
            if num_update_steps_completed == 3:
                trainer.save_training_state(tmp_path / "states", name="mid")

    full = make_trainer([SaveAtStep()])
    full.train(classification_dataset(40), num_epochs=2, per_device_batch_size=8)
    resumed = make_trainer()
    resumed.train(
        classification_dataset(40), num_epochs=2, per_device_batch_size=8, resume_from=tmp_path / "states" / "mid"
    )
    for name in ("train_accuracy_epoch", "train_loss_epoch"):
        assert resumed.run_history.get_metric_values(name) == full.run_history.get_metric_values(name)


def test_skipped_window_leaves_step_metrics():
    """A skipped non-finite window is taken out of the step metrics."""

    class NaNOnThirdBatch(AccuracyTrainer):
        calls = 0

        def calculate_train_batch_loss(self, batch):
            output = super().calculate_train_batch_loss(batch)
            self.calls += 1
            if self.calls == 3:
                output = {**output, "loss": output["loss"] * float("nan"), "ones": 1000}
            return output

    trainer = make_trainer([SkipNonFiniteStepsCallback()], trainer_class=NaNOnThirdBatch)
    trainer.train(classification_dataset(32), num_epochs=1, per_device_batch_size=8)
    assert trainer.run_history.get_metric_values("train_ones_epoch") == [1.0]  # not (3 * 8 + 1000 * 8) / 32


def test_tracker_takes_numbers_and_0d_tensors():
    assert is_scalar_metric(1) and is_scalar_metric(0.5) and is_scalar_metric(torch.tensor(2))
    assert not any(is_scalar_metric(v) for v in (True, torch.tensor([1.0]), "a", None, torch.tensor(1j)))
    tracker = StepMetricsTracker()
    tracker.update({"loss": torch.tensor(9.0), "batch_size": 2, "a": torch.tensor(1.0), "b": 3}, 2)
    tracker.update({"a": torch.tensor(4.0)}, 1)
    averages = tracker.reduce_averages(lambda t: t, torch.device("cpu"), ["a", "b", "c"])
    assert averages == {"a": pytest.approx(2.0), "b": 3.0}  # (1*2 + 4*1) / 3; c seen by no process: left out


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.scenarios("step_metrics")
def test_two_processes_mean_over_all_samples(two_process_scenarios):
    """Two processes record the mean over every sample, even of a metric one process lacks
    (tests/scripts/distributed_step_metrics.py)."""
    result = two_process_scenarios.read_json("step_metrics")
    assert result["train_index_epoch"] == pytest.approx([sum(range(24)) / 24])  # every sample once, over both processes
    assert result["train_rank1_only_epoch"] == [1.0]  # seen on process 1 only: no deadlock, its own mean
    assert result["eval_index_epoch"] == pytest.approx([sum(range(10)) / 10])  # 10 samples: one repeat dropped
