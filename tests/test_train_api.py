"""train() and evaluate() as scripts call them: what both return (the TrainResult, the dict of metrics), and train()'s
arguments in pytorch-accelerated's positional order."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import linear_dataset, load_module_from, make_linear, make_mlp, make_trainer, regression_dataset

from pytorch_accel_trainer.callbacks import EarlyStoppingCallback, TrainerCallback
from pytorch_accel_trainer.loop.run_state import TrainResult

# What train() and evaluate() return -----------------------------------------------------------------------------------


def test_train_returns_metrics_counts_speed():
    """train() returns the run's metrics, best value, counts and speed."""
    trainer = make_trainer(make_mlp(), callbacks=[EarlyStoppingCallback(early_stopping_patience=50)])
    result = trainer.train(
        regression_dataset(20), num_epochs=3, eval_dataset=regression_dataset(8), per_device_batch_size=4
    )
    assert isinstance(result, TrainResult)
    history = trainer.run_history
    assert result.metrics == {name: history.get_latest_metric(name) for name in ("eval_loss_epoch", "train_loss_epoch")}
    assert result.best_metric_name == "eval_loss_epoch"
    assert result.best_metric == min(history.get_metric_values("eval_loss_epoch"))
    assert (result.num_epochs, result.num_update_steps, result.num_samples) == (3, 15, 60)
    assert result.wall_time_seconds > 0 and result.samples_per_second == pytest.approx(60 / result.wall_time_seconds)
    assert not result.stopped_early


class WatchesTrainLoss(TrainerCallback):
    """A user's callback that watches a metric, declared through the protocol (no MonitorCallback)."""

    def __init__(self):
        self.best = None

    def on_train_epoch_end(self, trainer, **kwargs):
        loss = trainer.run_history.get_latest_metric("train_loss_epoch")
        self.best = loss if self.best is None else min(self.best, loss)

    def watched_metric(self):
        return "train_loss_epoch", self.best


def test_result_best_metric_is_the_first_watching_callbacks():
    """The best metric of the result is the first callback's that says it watches one, a user's as a built-in's; a
    callback that watches none (the default) or has no protocol method (a duck-typed one) is passed over."""

    class DuckTyped:
        def on_train_epoch_end(self, trainer, **kwargs):
            pass

    watcher = WatchesTrainLoss()
    trainer = make_trainer(make_mlp(), callbacks=[DuckTyped(), TrainerCallback(), watcher, EarlyStoppingCallback()])
    result = trainer.train(
        regression_dataset(20), num_epochs=2, eval_dataset=regression_dataset(8), per_device_batch_size=4
    )
    assert result.best_metric_name == "train_loss_epoch"
    assert result.best_metric == min(trainer.run_history.get_metric_values("train_loss_epoch")) == watcher.best
    assert make_trainer(make_mlp()).train(regression_dataset(8), num_epochs=1).best_metric_name is None


def test_result_of_a_stopped_run():
    """A run a callback stops says so, and counts only the epochs completed."""
    trainer = make_trainer(make_mlp(), lr=10.0, callbacks=[EarlyStoppingCallback(early_stopping_patience=1)])
    result = trainer.train(
        regression_dataset(20), num_epochs=30, eval_dataset=regression_dataset(8), per_device_batch_size=4
    )
    assert result.stopped_early and result.num_epochs < 30
    assert result.num_epochs == len(trainer.run_history.get_metric_values("train_loss_epoch"))  # the last one included
    assert (
        make_trainer(make_mlp()).train(regression_dataset(8), num_epochs=None, max_num_train_steps=3).stopped_early
        is False
    )


#: tests/scripts/distributed_callbacks.py: the stops of a 2-epoch run of 16 updates, on 1 or 2 processes.
STOPS_SCRIPT = Path(__file__).parent / "scripts" / "distributed_callbacks.py"


def _assert_stops_inside_the_last_epoch_are_early(results):
    """``stop_in_last_epoch``'s results, of one process: a stop inside the last epoch (after update 11 of 16) is an
    early stop, a stop as it ends is not."""
    stop_error, budget, at_end = results["stop_error"], results["time_budget"], results["last_epoch_end"]
    assert stop_error["stop_reason"].startswith("stopped after update 11")  # " (on process 1)" on 2 processes
    assert stop_error["stopped_early"] and stop_error["num_update_steps"] == 11
    assert budget["stop_reason"].startswith("Time budget max_time=3600")
    assert budget["stopped_early"] and 11 <= budget["num_update_steps"] < 16  # inside epoch 2
    assert budget["saved_updates"] == [budget["num_update_steps"]]  # the state to continue from, saved at the stop
    assert at_end["stop_reason"].startswith("stopped at the last epoch's end")
    assert not at_end["stopped_early"] and at_end["num_update_steps"] == 16


def test_a_stop_inside_the_last_epoch_is_early(tmp_path):
    """TrainResult.stopped_early is True for a callback's StopTrainingError or the time budget inside the last epoch
    (the cut-short epoch records its loss, yet the run did not end), False for a stop as that epoch ends."""
    load_module_from(STOPS_SCRIPT, "distributed_callbacks").stop_in_last_epoch(tmp_path, per_device_batch_size=4)
    _assert_stops_inside_the_last_epoch_are_early(json.loads((tmp_path / "result.rank0.json").read_text()))


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.scenarios("stop_in_last_epoch")
def test_a_stop_inside_the_last_epoch_is_early_on_every_process(two_process_scenarios):
    """On two processes, every process returns the same TrainResult for each stop, early inside the last epoch."""
    folder = two_process_scenarios.folder("stop_in_last_epoch")
    first, second = (json.loads((folder / f"result.rank{rank}.json").read_text()) for rank in range(2))
    assert first == second  # stopped_early, stop_reason, counts, samples and metrics agree
    _assert_stops_inside_the_last_epoch_are_early(first)


def test_a_resumed_run_returns_what_it_ran(tmp_path):
    first = make_trainer(make_mlp())
    first.train(regression_dataset(16), num_epochs=2, per_device_batch_size=4)
    first.save_training_state(tmp_path, name="end2")
    result = make_trainer(make_mlp()).train(
        regression_dataset(16), num_epochs=3, per_device_batch_size=4, resume_from=tmp_path / "end2"
    )
    assert (result.num_epochs, result.num_update_steps, result.num_samples) == (1, 12, 16)
    assert set(result.metrics) == {"train_loss_epoch"}


def test_evaluate_returns_only_what_it_recorded():
    trainer = make_trainer(make_mlp())
    trainer.train(regression_dataset(12), num_epochs=1, eval_dataset=regression_dataset(8))
    result = trainer.evaluate()
    assert result == {"evaluation_loss": trainer.run_history.get_latest_metric("evaluation_loss")}


# train()'s arguments in pytorch-accelerated's order -------------------------------------------------------------------


def test_positional_resume_from(tmp_path):
    """resume_from keeps its place in pytorch-accelerated 0.1.61's train(): the thirteenth argument."""
    trainer = make_trainer(make_linear())
    # pytorch-accelerated 0.1.61's order, resume_from thirteenth: a folder with no state yet starts a new run
    arguments = (linear_dataset(8), 1, None, 4, None, 1, None, None, None, None, True, None, tmp_path)
    trainer.train(*arguments)
    assert trainer.run_state.options.resume_from == tmp_path and trainer.run_state.options.gradient_clip_norm is None
