"""Run history: the pytorch-accelerated API plus pandas and CSV export."""

from __future__ import annotations

import pandas
import pytest
import torch

from pytorch_accel_trainer.tracking import InMemoryRunHistory, LossTracker, RunHistory


def _history() -> InMemoryRunHistory:
    history = InMemoryRunHistory()
    history.update_metric("train_loss_epoch", 1.0)
    history.update_metric("eval_loss_epoch", 2.0)
    history._increment_epoch()
    history.update_metric("train_loss_epoch", 0.5)
    return history


def test_run_history_api():
    history = _history()
    assert isinstance(history, RunHistory)
    assert history.get_metric_names() == {"train_loss_epoch", "eval_loss_epoch"}
    assert history.get_metric_values("train_loss_epoch") == [1.0, 0.5]
    assert history.get_latest_metric("train_loss_epoch") == 0.5
    assert history.current_epoch == 2
    history.reset()
    assert history.get_metric_names() == set() and history.current_epoch == 1


def test_unknown_metric_lists_existing_ones():
    with pytest.raises(KeyError, match=r"No metric named 'eval_acc'.*\['eval_loss_epoch', 'train_loss_epoch'\]"):
        _history().get_latest_metric("eval_acc")


def test_dataframe_and_csv_hold_every_metric(tmp_path):
    frame = _history().to_dataframe()
    assert list(frame.index) == [1, 2] and frame.index.name == "epoch"
    assert frame.loc[2, "train_loss_epoch"] == 0.5 and pandas.isna(frame.loc[2, "eval_loss_epoch"])
    path = tmp_path / "history.csv"
    _history().to_csv(path)
    assert pandas.read_csv(path, index_col="epoch").equals(frame)


def test_prefix_and_delete():
    history = _history()
    history.set_metric_name_prefix("ema_")
    history.update_metric("eval_loss_epoch", 3.0)
    history.set_metric_name_prefix()
    assert history.get_latest_metric("ema_eval_loss_epoch") == 3.0
    history.delete_metric("ema_eval_loss_epoch")
    assert "ema_eval_loss_epoch" not in history.get_metric_names()


def test_loss_tracker_weights_by_batch_size():
    """LossTracker weights by batch size; a process with no batch reduces to None."""
    tracker = LossTracker()
    tracker.update(torch.tensor(1.0), 2)
    tracker.update(torch.tensor(4.0), 1)
    assert tracker.reduce_average(lambda t: t, torch.device("cpu")) == pytest.approx(2.0)
    tracker.reset()
    assert tracker.reduce_average(lambda t: t, torch.device("cpu")) is None
