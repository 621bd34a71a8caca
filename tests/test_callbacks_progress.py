"""ProgressBarCallback (what the bar shows, when it refreshes, and that it never syncs) and LogMetricsCallback."""

from __future__ import annotations

import pytest
import torch
from conftest import linear_dataset, make_linear, make_trainer
from sync_counter import make_sync_counting_trainer

from pytorch_accel_trainer import Trainer
from pytorch_accel_trainer.callbacks import (
    LogMetricsCallback,
    ProgressBarCallback,
    StepBasedEvaluationCallback,
    TrainerCallback,
)


class PostfixProbe(TrainerCallback):
    """Placed after the bar: records each batch loss and the bar's postfix after each step."""

    def __init__(self, bar: ProgressBarCallback):
        self.bar, self.losses, self.postfixes = bar, [], []

    def on_train_step_end(self, trainer, batch_output, **kwargs):
        self.losses.append(batch_output["loss"].item())
        self.postfixes.append(dict(item.split("=") for item in self.bar.pbar.postfix.split(", ")) if self.bar.pbar.postfix else {})


def test_shows_the_interval_loss_learning_rate_and_throughput_every_n_steps(capsys):
    bar = ProgressBarCallback(refresh_every_n_steps=4)
    probe = PostfixProbe(bar)
    trainer = make_trainer(make_linear(), lr=0.1, callbacks=[bar, probe])
    trainer.train(linear_dataset(64), num_epochs=1, per_device_batch_size=4)

    assert probe.postfixes[:3] == [{}, {}, {}]  # nothing before the first refresh
    for refresh_step in (3, 7, 11, 15):
        shown = probe.postfixes[refresh_step]
        interval = probe.losses[refresh_step - 3 : refresh_step + 1]
        assert shown["loss"] == f"{sum(interval) / 4:.4g}"
        assert shown["lr"] == "0.1" and float(shown["samples/s"]) > 0
    assert probe.postfixes[5] == probe.postfixes[4]  # unchanged between refreshes
    final_loss = trainer.run_history.get_latest_metric("train_loss_epoch")
    assert f"loss={final_loss:.4g}" in capsys.readouterr().err  # the epoch's loss, once it ends


def test_shows_the_learning_rate_of_every_parameter_group():
    model = make_linear()
    optimizer = torch.optim.SGD([{"params": [model.weight]}, {"params": [model.bias], "lr": 0.01}], lr=0.1)
    bar = ProgressBarCallback(refresh_every_n_steps=2)
    probe = PostfixProbe(bar)
    Trainer(model, torch.nn.MSELoss(), optimizer, callbacks=[bar, probe]).train(linear_dataset(8), num_epochs=1, per_device_batch_size=4)
    assert probe.postfixes[-1]["lr"] == "0.1,0.01"


def test_refreshing_every_step_makes_no_host_device_sync(monkeypatch):
    trainer, reads = make_sync_counting_trainer(monkeypatch, make_linear(), callbacks=[ProgressBarCallback(refresh_every_n_steps=1)])
    trainer.train(linear_dataset(64), num_epochs=2, per_device_batch_size=4)
    assert trainer.num_update_steps_completed == 32 and reads == []


def test_an_intermediate_evaluation_gets_its_own_bar(capsys):
    trainer = make_trainer(make_linear(), callbacks=[StepBasedEvaluationCallback(3), ProgressBarCallback(refresh_every_n_steps=2)])
    trainer.train(linear_dataset(32), num_epochs=1, eval_dataset=linear_dataset(8), per_device_batch_size=4)
    err = capsys.readouterr().err
    assert "epoch 1 train: 100%" in err and "8/8" in err and err.count("eval: 100%") >= 3  # updates 3, 6, epoch end


def test_refresh_every_n_steps_must_be_positive():
    with pytest.raises(ValueError, match="refresh_every_n_steps is 0; pass a positive whole number of batches"):
        ProgressBarCallback(refresh_every_n_steps=0)


def _printed_metric_names(output: str) -> list:
    return [line.split(": ")[0] for line in output.splitlines() if ": " in line]


def test_log_metrics_prints_only_the_metrics_of_the_current_run(capsys):
    trainer = make_trainer(make_linear(), callbacks=[LogMetricsCallback])
    trainer.train(linear_dataset(8), num_epochs=1, eval_dataset=linear_dataset(4), per_device_batch_size=4)
    assert _printed_metric_names(capsys.readouterr().out) == ["train_loss_epoch", "eval_loss_epoch"]
    trainer.evaluate(linear_dataset(4), per_device_batch_size=4)
    assert _printed_metric_names(capsys.readouterr().out) == ["evaluation_loss"]  # not the training run's eval loss
    trainer.train(linear_dataset(8), num_epochs=1, eval_dataset=linear_dataset(4), per_device_batch_size=4)
    assert _printed_metric_names(capsys.readouterr().out) == ["train_loss_epoch", "eval_loss_epoch"]
