"""Each tracker read back with its own reader after a real 2-epoch run: the same series, at the same steps, as the run.

TensorBoard through its ``EventAccumulator``, CSV and JSON lines parsed, W&B offline from its run file, MLflow from a
local file store through ``MlflowClient``. W&B and MLflow are skipped when they are not installed; nothing here
touches the network.
"""

from __future__ import annotations

import csv
import json
import pathlib
import random

import psutil
import pytest
import torch
import yaml
from conftest import linear_dataset, make_linear, make_trainer
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from pytorch_accel_trainer.callbacks import ExperimentTrackingCallback, TrainerCallback
from pytorch_accel_trainer.callbacks.trackers import run_config_hyperparameters

LOG_EVERY = 4
STEPS_PER_EPOCH = 16  # 64 samples in batches of 4
CONFIG = {"lr": 0.05, "model": "linear"}


class StepRecorder(TrainerCallback):
    """Records every batch loss and the gradient norm of every update, to compute what should have been logged."""

    def __init__(self):
        self.losses, self.gradient_norms = [], {}

    def on_train_step_end(self, trainer, batch_output, **kwargs):
        self.losses.append(batch_output["loss"].item())

    def on_optimizer_step_end(self, trainer, num_update_steps_completed, **kwargs):
        self.gradient_norms[num_update_steps_completed] = float(trainer.last_gradient_norm)


def train_tracked(trackers, logging_dir, **callback_kwargs):
    """Two epochs of y = 2x + 3, logged every 4 updates; returns the trainer, the recorder and the callback."""
    recorder = StepRecorder()
    tracking = ExperimentTrackingCallback(
        trackers, logging_dir=logging_dir, log_every_n_steps=LOG_EVERY, config=CONFIG, **callback_kwargs
    )
    trainer = make_trainer(make_linear(), lr=0.05, callbacks=[recorder, tracking])
    trainer.train(linear_dataset(64), num_epochs=2, eval_dataset=linear_dataset(16, seed=1), per_device_batch_size=4)
    return trainer, recorder, tracking


def expected_series(trainer, recorder) -> dict:
    """What every tracker must hold: ``{name: [(step, value), ...]}``, from the recorded losses and the run history."""
    log_steps = range(LOG_EVERY, 2 * STEPS_PER_EPOCH + 1, LOG_EVERY)
    epoch_steps = [STEPS_PER_EPOCH, 2 * STEPS_PER_EPOCH]
    history = trainer.run_history
    return {
        "train_loss_step": [(step, sum(recorder.losses[step - LOG_EVERY : step]) / LOG_EVERY) for step in log_steps],
        "lr_group_0": [(step, 0.05) for step in log_steps],
        "gradient_norm": [(step, recorder.gradient_norms[step]) for step in log_steps],
        "train_loss_epoch": list(zip(epoch_steps, history.get_metric_values("train_loss_epoch"))),
        "eval_loss_epoch": list(zip(epoch_steps, history.get_metric_values("eval_loss_epoch"))),
        "epoch": [(16, 1), (32, 2)],
    }


def assert_holds_the_run(series: dict, trainer, recorder) -> None:
    """``series`` (``{name: [(step, value), ...]}`` as read back) holds exactly the run's values at the run's steps."""
    expected = expected_series(trainer, recorder)
    assert set(series) == {*expected, "samples_per_second"}
    for name, points in expected.items():
        read = series[name]
        assert [step for step, _ in read] == [step for step, _ in points], name
        assert [value for _, value in read] == pytest.approx([value for _, value in points], rel=1e-6), name
    throughput = series["samples_per_second"]
    assert [step for step, _ in throughput] == [step for step, _ in expected["train_loss_step"]]
    assert all(value > 0 for _, value in throughput)


def expected_config(trainer) -> dict:
    return {**run_config_hyperparameters(trainer.run_config), **CONFIG}


def _series_of(points) -> dict:
    series = {}
    for step, name, value in points:
        series.setdefault(name, []).append((step, value))
    return series


@pytest.fixture
def no_child_process_left():
    """Fails a test that leaves a process of its own running (a W&B service, say)."""
    before = {child.pid for child in psutil.Process().children(recursive=True)}
    yield
    left = [child for child in psutil.Process().children(recursive=True) if child.pid not in before]
    assert left == [], f"left running: {[child.cmdline() for child in left]}"


# ----------------------------------------------------------------------------------------------------
# The trackers that write files
# ----------------------------------------------------------------------------------------------------


def test_tensorboard_holds_series_and_config(tmp_path):
    """TensorBoard's event files hold every series, and its hparams the config."""
    trainer, recorder, tracking = train_tracked(["tensorboard"], tmp_path, project_name="proj", run_name="run")
    assert tracking.run_dir == tmp_path / "proj" / "run"
    events = EventAccumulator(str(tracking.run_dir), size_guidance={"scalars": 0})  # 0: keep every point
    events.Reload()
    series = {tag: [(event.step, event.value) for event in events.Scalars(tag)] for tag in events.Tags()["scalars"]}
    assert_holds_the_run(series, trainer, recorder)
    (hparams,) = tracking.run_dir.glob("*/hparams.yml")  # Accelerate writes it next to the hparams event file
    assert yaml.safe_load(hparams.read_text()) == expected_config(trainer)


def test_csv_holds_series_and_config(tmp_path):
    """The CSV file holds every series, and config.json the config."""
    trainer, recorder, tracking = train_tracked(["csv"], tmp_path, project_name="proj", run_name="run")
    with open(tmp_path / "proj" / "run" / "metrics.csv", newline="") as handle:
        rows = list(csv.DictReader(handle))
    points = [(int(row["step"]), row["name"], float(row["value"])) for row in rows]
    assert_holds_the_run(_series_of(points), trainer, recorder)
    assert json.loads((tracking.run_dir / "config.json").read_text()) == expected_config(trainer)


def test_json_lines_hold_series_and_config(tmp_path):
    """The JSON lines file holds every series, and config.json the config."""
    trainer, recorder, tracking = train_tracked(["jsonl"], tmp_path, project_name="proj", run_name="run")
    records = [json.loads(line) for line in (tmp_path / "proj" / "run" / "metrics.jsonl").read_text().splitlines()]
    points = [(record["step"], name, value) for record in records for name, value in record.items() if name != "step"]
    assert_holds_the_run(_series_of(points), trainer, recorder)
    assert json.loads((tracking.run_dir / "config.json").read_text()) == expected_config(trainer)


def test_no_project_name_uses_logging_dir(tmp_path):
    """Without a project name the files go to logging_dir/<run name>."""
    _, _, tracking = train_tracked(["csv", "jsonl", "tensorboard"], tmp_path, run_name="run")
    assert tracking.run_dir == tmp_path / "run"
    assert {path.name for path in tmp_path.iterdir()} == {"run"}
    assert {"metrics.csv", "metrics.jsonl", "config.json"} <= {path.name for path in tracking.run_dir.iterdir()}
    assert list(tracking.run_dir.glob("events.out.tfevents.*"))


# ----------------------------------------------------------------------------------------------------
# Weights & Biases, offline
# ----------------------------------------------------------------------------------------------------


@pytest.fixture
def wandb_offline(tmp_path, monkeypatch, no_child_process_left):
    """W&B in offline mode, writing under ``tmp_path/wandb``; its service process is ended after the test."""
    wandb = pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_CONSOLE", "off")  # leave pytest's capture of stdout and stderr alone
    yield tmp_path / "wandb"
    wandb.teardown()  # finished runs leave the wandb-core service running until this, or the interpreter's exit


def read_wandb_run(wandb_dir: pathlib.Path) -> dict:
    """The project, run name, config and history of the one offline run under ``wandb_dir``, from its ``.wandb`` file.

    The file is a LevelDB log (32 KiB blocks of records, each with a 7-byte header: CRC, length, type) of
    ``wandb_internal_pb2.Record`` messages, after a 7-byte ``:W&B`` header. wandb 0.31 has no reader of its own.
    """
    import wandb
    from wandb.proto import wandb_internal_pb2

    wandb.teardown()  # wandb 0.31 may leave the file empty after run.finish(), until its service process stops
    (run_file,) = wandb_dir.glob("offline-run-*/run-*.wandb")
    data = run_file.read_bytes()
    assert data[:4] == b":W&B", f"{run_file} is not a W&B run file"
    run = {"project": None, "name": None, "config": {}, "history": []}
    block, header, offset, pending = 32768, 7, 7, b""
    while offset + header <= len(data):
        if block - offset % block < header:  # a block's last bytes are padding when no header fits
            offset += block - offset % block
            continue
        length, kind = int.from_bytes(data[offset + 4 : offset + 6], "little"), data[offset + 6]
        pending += data[offset + header : offset + header + length]
        offset += header + length
        if kind not in (1, 4):  # 1: a whole record, 4: the last piece of one; 2 and 3: first and middle pieces
            continue
        record = wandb_internal_pb2.Record()
        record.ParseFromString(pending)
        pending = b""
        if record.HasField("run"):
            run["project"], run["name"] = record.run.project, record.run.display_name
            run["config"].update({item.key: json.loads(item.value_json) for item in record.run.config.update})
        elif record.HasField("config"):
            run["config"].update({item.key: json.loads(item.value_json) for item in record.config.update})
        elif record.HasField("history"):
            items = {item.key or ".".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            run["history"].append(items)
    run["config"].pop("_wandb", None)
    return run


@pytest.mark.slow
def test_wandb_offline_gets_the_whole_run(wandb_offline, tmp_path):
    """W&B offline gets the project, the run name, the config and every series."""
    trainer, recorder, tracking = train_tracked(["wandb"], tmp_path / "runs", project_name="proj")
    run = read_wandb_run(wandb_offline)
    assert (run["project"], run["name"]) == ("proj", tracking.run_name)
    assert run["config"] == expected_config(trainer)
    points = [(row["_step"], name, value) for row in run["history"] for name, value in row.items() if name[0] != "_"]
    assert_holds_the_run(_series_of(points), trainer, recorder)
    assert not (tmp_path / "runs").exists()  # W&B writes its files under WANDB_DIR, not logging_dir


@pytest.mark.slow
def test_wandb_names_from_tracker_kwargs(wandb_offline):
    """W&B takes a project and a run name from tracker_kwargs."""
    names = {"wandb": {"project": "other", "name": "mine"}}
    tracking = ExperimentTrackingCallback(["wandb"], project_name="proj", tracker_kwargs=names)
    trainer = make_trainer(make_linear(), callbacks=[tracking])
    trainer.evaluate(linear_dataset(8), per_device_batch_size=4)
    run = read_wandb_run(wandb_offline)
    assert (run["project"], run["name"]) == ("other", "mine")
    (row,) = run["history"]
    assert row["evaluation_loss"] == pytest.approx(trainer.run_history.get_latest_metric("evaluation_loss"))


# ----------------------------------------------------------------------------------------------------
# MLflow, with a local file store
# ----------------------------------------------------------------------------------------------------


@pytest.fixture
def mlflow_client(tmp_path, monkeypatch, no_child_process_left):
    """An ``MlflowClient`` of a file store in ``tmp_path/mlruns``, which the trackers use too (by the environment)."""
    pytest.importorskip("mlflow")
    from mlflow import MlflowClient

    monkeypatch.setenv("MLFLOW_TRACKING_URI", (tmp_path / "mlruns").as_uri())
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 refuses a file store without it; sqlite needs
    # sqlalchemy, which mlflow-skinny leaves out
    monkeypatch.delenv("MLFLOW_EXPERIMENT_NAME", raising=False)  # it would win over project_name
    monkeypatch.delenv("MLFLOW_RUN_ID", raising=False)
    return MlflowClient()


def read_mlflow_run(client, tracking) -> tuple:
    """The run named ``tracking.run_name``: (experiment name, run name, params, ``{name: [(step, value), ...]}``)."""
    (run,) = client.search_runs(
        [experiment.experiment_id for experiment in client.search_experiments()],
        filter_string=f"attributes.run_name = '{tracking.run_name}'",
    )
    histories = {name: client.get_metric_history(run.info.run_id, name) for name in run.data.metrics}
    series = {name: sorted((metric.step, metric.value) for metric in metrics) for name, metrics in histories.items()}
    experiment = client.get_experiment(run.info.experiment_id)
    return experiment.name, run.info.run_name, run.data.params, series


@pytest.mark.slow
def test_mlflow_gets_the_whole_run(mlflow_client, tmp_path):
    """MLflow gets the experiment, the run name, the params and every series."""
    trainer, recorder, tracking = train_tracked(["mlflow"], tmp_path / "runs", project_name="proj")
    experiment_name, run_name, params, series = read_mlflow_run(mlflow_client, tracking)
    assert (experiment_name, run_name) == ("proj", tracking.run_name)
    assert params == {name: str(value) for name, value in expected_config(trainer).items()}  # MLflow keeps text
    assert_holds_the_run(series, trainer, recorder)


@pytest.mark.slow
def test_seeded_mlflow_runs_differ_in_name(mlflow_client, tmp_path):
    """Two seeded MLflow runs get different names in the default experiment."""
    callbacks = []
    for _ in range(2):  # in the same second, after the same seeds
        random.seed(0)
        torch.manual_seed(0)
        callbacks.append(ExperimentTrackingCallback(["mlflow"]))
    for tracking in callbacks:  # train() seeds random again before MLflow starts: MLflow's own names would repeat
        trainer = make_trainer(make_linear(), callbacks=[tracking], seed=0)
        trainer.train(linear_dataset(8), num_epochs=1, per_device_batch_size=4)
        experiment_name, run_name, _, series = read_mlflow_run(mlflow_client, tracking)
        assert (experiment_name, run_name) == ("pytorch_accel_trainer", tracking.run_name)
        assert [step for step, _ in series["train_loss_epoch"]] == [2]
    assert callbacks[0].run_name != callbacks[1].run_name
