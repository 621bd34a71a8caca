"""DataLoaders where datasets are expected, what train() and evaluate() return, and per-epoch schedules."""

from __future__ import annotations

import functools
import json
import math
import pathlib
import subprocess
import warnings

import pytest
import torch
from conftest import CPU_PROCESSES_ENV, assert_bitwise_equal, launcher, make_mlp, make_trainer, regression_dataset
from torch.utils.data import DataLoader

from pytorch_accel_trainer import TrainerPlaceholderValues
from pytorch_accel_trainer.callbacks import EarlyStoppingCallback, TrainerCallback
from pytorch_accel_trainer.loop.run_state import TrainResult

SCRIPT = pathlib.Path(__file__).parent / "scripts" / "distributed_dataloader.py"


# DataLoaders in ----------------------------------------------------------------------------------------------------


def test_a_dataloader_trains_exactly_as_its_dataset_with_the_same_arguments():
    by_dataset = make_trainer(make_mlp())
    by_dataset.train(regression_dataset(20), num_epochs=3, eval_dataset=regression_dataset(9), per_device_batch_size=4)
    by_loader = make_trainer(make_mlp())
    by_loader.train(
        DataLoader(regression_dataset(20), batch_size=4, shuffle=True),
        num_epochs=3,
        eval_dataset=DataLoader(regression_dataset(9), batch_size=4),
    )
    assert_bitwise_equal(by_loader.model.state_dict(), by_dataset.model.state_dict())  # same seeded shuffle order
    assert by_loader.run_history.get_metric_values("eval_loss_epoch") == by_dataset.run_history.get_metric_values(
        "eval_loss_epoch"
    )
    assert (
        by_loader.run_config.train_per_device_batch_size == 4 and by_loader.run_config.num_update_steps_per_epoch == 5
    )


def test_a_dataloader_keeps_its_own_collate_function_and_batch_size():
    sizes = []

    def collate(samples):
        sizes.append(len(samples))
        return torch.utils.data.default_collate(samples)

    trainer = make_trainer(make_mlp())
    trainer.train(DataLoader(regression_dataset(12), batch_size=5, collate_fn=collate), num_epochs=1)
    assert sizes == [5, 5, 2]
    result = trainer.evaluate(DataLoader(regression_dataset(6), batch_size=6, collate_fn=collate))
    assert sizes[-1] == 6 and set(result) == {"evaluation_loss"}
    assert trainer.evaluate() == result  # the evaluation DataLoader of the last evaluate() is the default


def test_a_run_on_a_dataloader_resumes_bitwise_from_a_state_inside_an_epoch(tmp_path):
    class SaveAtUpdate3(TrainerCallback):
        def on_optimizer_step_end(self, trainer, num_update_steps_completed=0, **kwargs):
            if num_update_steps_completed == 3:
                trainer.save_training_state(tmp_path, name="mid")

    def loader():
        return DataLoader(regression_dataset(20), batch_size=4, shuffle=True)

    full = make_trainer(make_mlp(), callbacks=[SaveAtUpdate3()])
    full.train(loader(), num_epochs=2)
    resumed = make_trainer(make_mlp(seed=5))
    resumed.train(loader(), num_epochs=2, resume_from=tmp_path / "mid")
    assert_bitwise_equal(resumed.model.state_dict(), full.model.state_dict())


@pytest.mark.distributed
@pytest.mark.slow
def test_two_processes_shard_a_dataloader_and_train_as_one_process_on_the_global_batch(tmp_path):
    outputs = []
    for num_processes, batch_size in ((1, 8), (2, 4)):
        output = tmp_path / f"run{num_processes}.json"
        command = [*launcher(num_processes), str(SCRIPT), str(output), str(batch_size)]
        completed = subprocess.run(command, env=CPU_PROCESSES_ENV, capture_output=True, text=True, timeout=300)
        assert completed.returncode == 0, completed.stderr[-3000:]
        outputs.append(json.loads(output.read_text()))
    single, double = outputs
    assert double["indices_seen"] == 16 and double["distinct_per_epoch"] == [16, 16]  # each sample once per epoch
    assert double["weights"] == pytest.approx(single["weights"], rel=1e-5, abs=1e-6)
    assert double["num_samples"] == single["num_samples"] == 32


# What train() and evaluate() return --------------------------------------------------------------------------------


def test_train_returns_the_runs_metrics_best_value_counts_and_speed():
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


def test_a_run_a_callback_stops_says_so_and_counts_only_the_epochs_completed():
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


# Schedules per epoch -----------------------------------------------------------------------------------------------


class LearningRates(TrainerCallback):
    def __init__(self):
        self.rates = []

    def on_train_epoch_start(self, trainer, **kwargs):
        self.rates.append(trainer.optimizer.param_groups[0]["lr"])


def _rates(scheduler_interval, factory, num_epochs=4):
    rates = LearningRates()
    trainer = make_trainer(make_mlp(), lr=1.0, callbacks=[rates])
    trainer.train(
        regression_dataset(20),
        num_epochs=num_epochs,
        per_device_batch_size=4,
        create_scheduler_fn=factory,
        scheduler_interval=scheduler_interval,
    )
    return rates.rates, trainer


def test_an_epoch_interval_steps_the_scheduler_once_per_epoch():
    rates, trainer = _rates("epoch", functools.partial(torch.optim.lr_scheduler.StepLR, step_size=1, gamma=0.5))
    assert rates == [1.0, 0.5, 0.25, 0.125]
    assert trainer.scheduler.last_epoch == 4
    rates, _ = _rates("step", functools.partial(torch.optim.lr_scheduler.StepLR, step_size=1, gamma=0.5))
    assert rates == [1.0, 0.5**5, 0.5**10, 0.5**15]  # the default: once per update, 5 updates per epoch


def test_a_cosine_over_num_epochs_stepped_per_update_warns_and_the_epoch_interval_follows_it():
    factory = functools.partial(torch.optim.lr_scheduler.CosineAnnealingLR, T_max=TrainerPlaceholderValues.NUM_EPOCHS)
    with pytest.warns(
        UserWarning,
        match=r"CosineAnnealingLR\(T_max=4\) equals num_epochs, but the scheduler steps after "
        r"each of the run's 20 optimizer updates.*scheduler_interval='epoch'",
    ):
        _rates("step", factory)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        rates, _ = _rates("epoch", factory)
    assert rates == pytest.approx(
        [(1 + math.cos(math.pi * epoch / 4)) / 2 for epoch in range(4)]
    )  # one cosine over the run


def test_a_bad_scheduler_interval_is_refused_with_the_choices():
    with pytest.raises(ValueError, match=r"scheduler_interval='epochs' is not valid: pass 'step' .* or 'epoch'"):
        make_trainer(make_mlp()).train(regression_dataset(8), num_epochs=1, scheduler_interval="epochs")
