"""ExperimentTrackingCallback with the CSV, JSON-lines and TensorBoard trackers, on a tiny real run."""

from __future__ import annotations

import csv
import json
import os
import pathlib
import random
import re
import subprocess

import numpy as np
import pytest
import torch
from accelerate.tracking import LOGGER_TYPE_TO_CLASS, get_available_trackers
from conftest import CPU_PROCESSES_ENV, launcher, linear_dataset, make_linear, make_trainer
from sync_counter import make_sync_counting_trainer
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

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


def test_json_lines_hold_step_values_every_n_updates_and_every_epoch_metric(tracked_run):
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


def test_tensorboard_holds_the_expected_scalar_series(tracked_run):
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


def test_logging_makes_no_host_device_sync_during_steps(monkeypatch, tmp_path):
    tracking = ExperimentTrackingCallback(["jsonl"], logging_dir=tmp_path, run_name="run", log_every_n_steps=1)
    trainer, reads = make_sync_counting_trainer(monkeypatch, make_linear(), callbacks=[tracking])
    trainer.train(linear_dataset(64), num_epochs=1, per_device_batch_size=4)
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 17 and reads == []  # 16 step logs, one epoch log


def test_custom_tracker_instances_are_used_as_given(tmp_path):
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
def test_gradient_norm_is_logged_with_or_without_clipping(tmp_path, clip):
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


def test_default_run_names_differ_after_the_same_seeds_in_the_same_second():
    names = []
    for _ in range(2):
        random.seed(0)
        np.random.seed(0)
        torch.manual_seed(0)
        names.append(ExperimentTrackingCallback().run_name)
    assert names[0] != names[1]
    assert all(re.fullmatch(r"\d{8}-\d{6}-[0-9a-f]{6}", name) for name in names), names  # time, then 6 hex digits


def test_the_project_name_is_a_folder_between_logging_dir_and_the_run_folder(tmp_path):
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


DRAWN_NAME_SCRIPT = """
import json, sys
from conftest import linear_dataset, make_linear, make_trainer
from pytorch_accel_trainer.callbacks import ExperimentTrackingCallback

tracking = ExperimentTrackingCallback(["csv"], logging_dir=sys.argv[1])
trainer = make_trainer(make_linear(), callbacks=[tracking])
trainer.train(linear_dataset(16), num_epochs=1, per_device_batch_size=4)
with open(f"{sys.argv[1]}.rank{trainer.accelerator.process_index}", "w") as handle:
    json.dump(tracking.run_name, handle)
"""


@pytest.mark.distributed
@pytest.mark.slow
def test_on_two_processes_every_process_gets_the_main_process_drawn_run_name(tmp_path):
    script, logs = tmp_path / "drawn_name.py", tmp_path / "logs"
    script.write_text(DRAWN_NAME_SCRIPT)
    tests = str(pathlib.Path(__file__).parent)  # for conftest's tiny model and data
    env = {**CPU_PROCESSES_ENV, "PYTHONPATH": os.pathsep.join(filter(None, [tests, os.environ.get("PYTHONPATH")]))}
    command = [*launcher(2), str(script), str(logs)]
    completed = subprocess.run(command, check=False, env=env, capture_output=True, text=True, timeout=240)
    assert completed.returncode == 0, completed.stderr[-3000:]
    first, second = (json.loads(logs.with_suffix(f".rank{rank}").read_text()) for rank in range(2))
    assert first == second  # each process drew its own name when it created the callback
    assert [path.name for path in logs.iterdir()] == [first]  # the main process's folder, named as everyone knows it
