"""ExperimentTrackingCallback with the CSV, JSON-lines and TensorBoard trackers, on a tiny real run; the extra records
the batch-loss hooks return are logged every n updates, as mini.trainer logs its steps' records."""

from __future__ import annotations

import collections
import csv
import json
import random
import re

import numpy as np
import pytest
import torch
from accelerate.tracking import LOGGER_TYPE_TO_CLASS, get_available_trackers
from conftest import linear_dataset, make_linear, make_trainer
from sync_counter import make_sync_counting_trainer
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from pytorch_accel_trainer import Trainer
from pytorch_accel_trainer.callbacks import CSVTracker, ExperimentTrackingCallback, JSONLinesTracker, TrainerCallback


class LossRecorder(TrainerCallback):
    def __init__(self):
        self.losses = []

    def on_train_step_end(self, trainer, batch_output, **kwargs):
        self.losses.append(batch_output["loss"].item())


@pytest.fixture
def tracked_run(tmp_path):
    """Two epochs of 16 batches, logged every 4 updates to TensorBoard, CSV and JSON lines."""
    recorder = LossRecorder()
    tracking = ExperimentTrackingCallback(
        ["tensorboard", "csv", "jsonl"], logging_dir=tmp_path, run_name="run", log_every_n_steps=4, config={"lr": 0.05}
    )
    trainer = make_trainer(make_linear(), lr=0.05, callbacks=[recorder, tracking])
    trainer.train(linear_dataset(64), num_epochs=2, eval_dataset=linear_dataset(16, seed=1), per_device_batch_size=4)
    return trainer, recorder.losses, tmp_path / "run"


def test_json_lines_hold_steps_and_epochs(tracked_run):
    """JSON lines hold step values every n updates, and every epoch metric."""
    trainer, losses, run_dir = tracked_run
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    step_records = [r for r in records if "train_loss_step" in r]
    assert [r["step"] for r in step_records] == list(range(4, 33, 4))
    for record in step_records:
        interval = losses[record["step"] - 4 : record["step"]]
        assert record["train_loss_step"] == pytest.approx(sum(interval) / 4, rel=1e-6)
        assert record["lr_group_0"] == 0.05 and record["samples_per_second"] > 0
    epoch_records = [r for r in records if "epoch" in r]
    history = trainer.run_history
    assert [(r["step"], r["epoch"]) for r in epoch_records] == [(16, 1), (32, 2)]
    assert [r["train_loss_epoch"] for r in epoch_records] == pytest.approx(
        history.get_metric_values("train_loss_epoch")
    )
    assert [r["eval_loss_epoch"] for r in epoch_records] == pytest.approx(history.get_metric_values("eval_loss_epoch"))
    steps = [r["step"] for r in records]
    assert steps == sorted(steps)  # one increasing step, as W&B needs
    stored = json.loads((run_dir / "config.json").read_text())
    assert stored["lr"] == 0.05  # the callback's config, with the run config of every run
    assert stored["run_config.num_update_steps_per_epoch"] == trainer.run_config.num_update_steps_per_epoch
    assert stored["run_config.max_num_train_steps"] == trainer.run_config.max_num_train_steps
    assert (
        stored["run_config.train_dl_kwargs.worker_init_fn"] == "pytorch_accel_trainer.utils.seed_worker"
    )  # by name, not address


def test_the_csv_holds_one_row_per_value(tracked_run):
    trainer, _, run_dir = tracked_run
    with open(run_dir / "metrics.csv") as handle:
        rows = list(csv.DictReader(handle))
    epoch_losses = [float(row["value"]) for row in rows if row["name"] == "eval_loss_epoch"]
    assert epoch_losses == pytest.approx(trainer.run_history.get_metric_values("eval_loss_epoch"))
    assert sum(row["name"] == "train_loss_step" for row in rows) == 8


def test_tensorboard_holds_scalar_series(tracked_run):
    """TensorBoard holds the expected scalar series."""
    trainer, _, run_dir = tracked_run
    events = EventAccumulator(str(run_dir))
    events.Reload()
    assert {
        "train_loss_step",
        "lr_group_0",
        "samples_per_second",
        "train_loss_epoch",
        "eval_loss_epoch",
        "epoch",
    } <= set(events.Tags()["scalars"])
    epoch_losses = events.Scalars("eval_loss_epoch")
    assert [event.step for event in epoch_losses] == [16, 32]
    assert [event.value for event in epoch_losses] == pytest.approx(
        trainer.run_history.get_metric_values("eval_loss_epoch")
    )
    assert [event.step for event in events.Scalars("train_loss_step")] == list(range(4, 33, 4))


def test_an_evaluation_run_is_logged_too(tmp_path):
    tracking = ExperimentTrackingCallback(["jsonl"], logging_dir=tmp_path, run_name="eval")
    trainer = make_trainer(make_linear(), callbacks=[tracking])
    trainer.evaluate(linear_dataset(8), per_device_batch_size=4)
    (record,) = [json.loads(line) for line in (tmp_path / "eval" / "metrics.jsonl").read_text().splitlines()]
    assert record["evaluation_loss"] == pytest.approx(trainer.run_history.get_latest_metric("evaluation_loss"))


def test_logging_makes_no_sync_during_steps(monkeypatch, tmp_path):
    """Logging makes no host-device sync during steps."""
    tracking = ExperimentTrackingCallback(["jsonl"], logging_dir=tmp_path, run_name="run", log_every_n_steps=1)
    trainer, reads = make_sync_counting_trainer(monkeypatch, make_linear(), callbacks=[tracking])
    trainer.train(linear_dataset(64), num_epochs=1, per_device_batch_size=4)
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 17 and reads == []  # 16 step logs, one epoch log


def test_custom_trackers_used_as_given(tmp_path):
    """Custom tracker instances are used as given."""
    tracker = CSVTracker("mine", logging_dir=tmp_path)
    make_trainer(make_linear(), callbacks=[ExperimentTrackingCallback([tracker])]).train(
        linear_dataset(8), num_epochs=1, per_device_batch_size=4
    )
    assert (tmp_path / "mine" / "metrics.csv").read_text().startswith("step,name,value")
    assert JSONLinesTracker("x", tmp_path).name == "jsonl"


def test_unknown_and_missing_trackers_are_errors():
    with pytest.raises(ValueError, match=r"Unknown tracker 'tensorbord': choose from \['csv', 'jsonl', "):
        ExperimentTrackingCallback(["tensorbord"])
    available = {str(tracker) for tracker in get_available_trackers()}
    missing = next(name for name in LOGGER_TYPE_TO_CLASS if name not in available)
    with pytest.raises(
        ImportError, match=f"The tracker '{missing}' needs its package, which is not installed: pip install {missing}"
    ):
        ExperimentTrackingCallback([missing])
    with pytest.raises(ValueError, match="log_every_n_steps is 0; pass a positive whole number"):
        ExperimentTrackingCallback(log_every_n_steps=0)


@pytest.mark.parametrize("clip", [{"gradient_clip_norm": 100.0}, {}])
def test_gradient_norm_is_logged(tmp_path, clip):
    """The gradient norm is logged, with or without clipping."""
    norms = []

    class NormRecorder(TrainerCallback):
        def on_train_step_start(self, trainer, **kwargs):
            if trainer.last_gradient_norm is not None:
                norms.append((trainer.num_update_steps_completed, float(trainer.last_gradient_norm)))

    tracking = ExperimentTrackingCallback(["jsonl"], logging_dir=tmp_path, run_name="run", log_every_n_steps=2)
    trainer = make_trainer(make_linear(), lr=0.05, callbacks=[NormRecorder(), tracking])
    trainer.train(linear_dataset(16), num_epochs=1, per_device_batch_size=4, **clip)
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    logged = {r["step"]: r["gradient_norm"] for r in records if "gradient_norm" in r}
    assert logged[2] == pytest.approx(dict(norms)[2], rel=1e-6)  # the norm of the update that made step 2
    assert set(logged) == {2, 4}


def test_default_run_names_differ():
    """Default run names differ after the same seeds, in the same second."""
    names = []
    for _ in range(2):
        random.seed(0)
        np.random.seed(0)
        torch.manual_seed(0)
        names.append(ExperimentTrackingCallback().run_name)
    assert names[0] != names[1]
    assert all(re.fullmatch(r"\d{8}-\d{6}-[0-9a-f]{6}", name) for name in names), names  # time, then 6 hex digits


def test_project_name_is_a_folder(tmp_path):
    """The project name is a folder between logging_dir and the run folder."""
    grouped = ExperimentTrackingCallback(["jsonl"], logging_dir=tmp_path, project_name="proj", run_name="run")
    make_trainer(make_linear(), callbacks=[grouped]).evaluate(linear_dataset(8), per_device_batch_size=4)
    assert grouped.run_dir == tmp_path / "proj" / "run" and (grouped.run_dir / "metrics.jsonl").is_file()
    assert ExperimentTrackingCallback(logging_dir=tmp_path, run_name="run").run_dir == tmp_path / "run"


def test_bad_names_and_tracker_kwargs_are_errors():
    with pytest.raises(ValueError, match=r"run_name is 'a/b', which cannot name a folder under logging_dir: pass a"):
        ExperimentTrackingCallback(run_name="a/b")
    with pytest.raises(ValueError, match=r"project_name is '', .* tracker_kwargs=\{'mlflow': \{'experiment_name'"):
        ExperimentTrackingCallback(project_name="")
    with pytest.raises(ValueError, match=r"run_name is '\.\.', which cannot name a folder"):
        ExperimentTrackingCallback(run_name="..")
    with pytest.raises(TypeError, match=r"project_name is 3 \(int\); pass a string, or None for no project folder"):
        ExperimentTrackingCallback(project_name=3)
    with pytest.raises(TypeError, match=r"tracker_kwargs is \{'wandb': 'me'\}; pass a dict of keyword arguments per"):
        ExperimentTrackingCallback(tracker_kwargs={"wandb": "me"})
    with pytest.raises(ValueError, match=r"for \['tensorbord'\], which are not among the trackers \['csv'\]: add"):
        ExperimentTrackingCallback(["csv"], tracker_kwargs={"tensorbord": {"flush_secs": 1}})


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.scenarios("tracker_run_name")
def test_two_processes_share_the_run_name(two_process_scenarios):
    """On two processes, every process gets the run name the main process drew (scripts/distributed_trackers.py)."""
    first, second = (
        two_process_scenarios.read_json("tracker_run_name", f"run_name.rank{rank}.json") for rank in (0, 1)
    )
    assert first == second  # each process drew its own name when it created the callback
    logs = two_process_scenarios.folder("tracker_run_name") / "logs"
    assert [path.name for path in logs.iterdir()] == [first]  # the main process's folder, named as everyone knows it


# Records the batch-loss hooks return (mini.trainer's step records), logged every n updates ----------------------------


class RecordsTrainer(Trainer):
    """mini.trainer's ``forward`` returns ``(loss, records)``: here the records are the hook's extra keys, a tensor
    (kept on the device) and a number (mini.trainer's ``.item()``)."""

    def calculate_train_batch_loss(self, batch, batch_idx):
        inputs, targets = batch
        outputs = self.model(inputs)
        penalty = 0.01 * (self.model.weight**2).sum()
        return {
            "loss": self.loss_func(outputs, targets) + penalty,
            "regulariser": penalty.detach(),
            "batch_number": torch.tensor(float(batch_idx)),
            "epoch_number": float(self.run_state.epoch),
        }


def _csv_rows(path) -> dict:
    with open(path) as handle:
        rows = list(csv.DictReader(handle))
    series = collections.defaultdict(dict)
    for row in rows:
        series[row["name"]][int(row["step"])] = float(row["value"])
    return series


class Regularisers(TrainerCallback):
    def __init__(self):
        self.values = []

    def on_train_step_end(self, trainer, batch_output, **kwargs):
        self.values.append(batch_output["regulariser"].item())


def test_hook_records_logged_every_n_updates(tmp_path):
    """The CSV tracker logs the records a hook returns, as interval means, every log_every_n_steps updates."""
    regularisers = Regularisers()
    tracking = ExperimentTrackingCallback(["csv"], logging_dir=tmp_path, run_name="run", log_every_n_steps=2)
    trainer = make_trainer(make_linear(), callbacks=[regularisers, tracking], trainer_class=RecordsTrainer)
    trainer.train(linear_dataset(32), num_epochs=2, per_device_batch_size=4)  # 8 updates per epoch
    series = _csv_rows(tmp_path / "run" / "metrics.csv")
    steps = list(range(2, 17, 2))
    assert list(series["train_batch_number_step"]) == steps
    # the mean over the interval's two batches: indices (0, 1), (2, 3), ... in each epoch
    assert list(series["train_batch_number_step"].values()) == [0.5, 2.5, 4.5, 6.5] * 2
    assert list(series["train_epoch_number_step"].values()) == [0.0] * 4 + [1.0] * 4
    for step in steps:
        interval = regularisers.values[step - 2 : step]
        assert series["train_regulariser_step"][step] == pytest.approx(sum(interval) / 2, rel=1e-6)
    # the epoch means are still recorded, and logged at each epoch's end
    assert series["train_batch_number_epoch"] == {8: 3.5, 16: 3.5}
    assert list(series["train_loss_step"]) == steps


def test_logging_records_makes_no_sync(monkeypatch, tmp_path):
    """Logging the hooks' records reads nothing back from the device during steps."""
    tracking = ExperimentTrackingCallback(["csv"], logging_dir=tmp_path, run_name="run", log_every_n_steps=1)
    trainer, reads = make_sync_counting_trainer(
        monkeypatch, make_linear(), callbacks=[tracking], trainer_class=RecordsTrainer
    )
    trainer.train(linear_dataset(32), num_epochs=1, per_device_batch_size=4)
    assert len(_csv_rows(tmp_path / "run" / "metrics.csv")["train_regulariser_step"]) == 8 and reads == []


def test_partial_records_and_over_16_records(tmp_path):
    """A record only some batches return is the mean of those; more records than 16 slots fit too."""

    class Sometimes(Trainer):
        def calculate_train_batch_loss(self, batch, batch_idx):
            output = super().calculate_train_batch_loss(batch)
            extra = {f"metric_{index:02d}": torch.tensor(float(index)) for index in range(20)}  # more than 16 slots
            if batch_idx % 2 == 1:
                extra["odd_only"] = torch.tensor(float(batch_idx))
            return {**output, **extra}

    tracking = ExperimentTrackingCallback(["csv"], logging_dir=tmp_path, run_name="run", log_every_n_steps=4)
    trainer = make_trainer(make_linear(), callbacks=[tracking], trainer_class=Sometimes)
    trainer.train(linear_dataset(32), num_epochs=1, per_device_batch_size=4)
    series = _csv_rows(tmp_path / "run" / "metrics.csv")
    assert series["train_odd_only_step"] == {4: 2.0, 8: 6.0}  # (1 + 3) / 2 and (5 + 7) / 2
    assert series["train_metric_19_step"] == {4: 19.0, 8: 19.0}


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.scenarios("tracker_records")
def test_two_processes_average_records(two_process_scenarios):
    """On two processes the records are averaged over both; a record of one process alone is logged too
    (tests/scripts/distributed_trackers.py)."""
    series = _csv_rows(two_process_scenarios.folder("tracker_records") / "logs" / "run" / "metrics.csv")
    assert series["train_rank_step"] == {2: 0.5, 4: 0.5}  # 4 updates per process: the mean of ranks 0 and 1
    assert series["train_rank_one_only_step"] == {2: 7.0, 4: 7.0}
