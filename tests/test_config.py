"""Runs described by a config file or flags: parsing, the run folder, reruns, trackers, and clear errors."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest
import torch
import yaml
from conftest import CPU_PROCESSES_ENV, launcher
from safetensors.torch import load_file

from pytorch_accel_trainer.callbacks.trackers import plain_hyperparameters
from pytorch_accel_trainer.cli import console_main, create_parser, main
from pytorch_accel_trainer.cli.config import ConfigError
from pytorch_accel_trainer.loop.run_state import TrainResult

TESTS = pathlib.Path(__file__).parent
ROOT = TESTS.parent

CONFIG = {
    "model": {"class_path": "torch.nn.Linear", "init_args": {"in_features": 3, "out_features": 1}},
    "optimizer": {"class_path": "torch.optim.SGD", "init_args": {"lr": 0.05}},
    "loss_func": "torch.nn.functional.mse_loss",
    "scheduler": {
        "import_path": "torch.optim.lr_scheduler.OneCycleLR",
        "arguments": {"max_lr": 0.1, "total_steps": "NUM_UPDATE_STEPS_PER_EPOCH * NUM_EPOCHS"},
    },
    "data": {"train": "config_data.tiny.train_dataset", "eval": "config_data.tiny.eval_dataset"},
    "train": {"num_epochs": 3, "per_device_batch_size": 8, "gradient_clip_norm": 1.0},
    "default_callbacks": False,
}


@pytest.fixture
def config_file(tmp_path, monkeypatch):
    monkeypatch.chdir(TESTS)  # import paths resolve from the current folder, as with `python -m`
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(CONFIG))
    return path


def test_a_config_file_with_flags_trains_and_flags_win(config_file):
    result = main(["fit", "--config", str(config_file), "--train.num_epochs", "2", "--optimizer.lr", "0.01"])
    assert isinstance(result, TrainResult)
    assert result.num_epochs == 2 and result.num_update_steps == 16
    assert result.metrics["eval_loss_epoch"] < result.metrics["train_loss_epoch"] * 10


def test_a_time_budget_from_the_command_line_stops_the_run_and_saves_where_it_says(config_file, tmp_path):
    budget = ["--train.max_time", "00:00:00:00", "--train.max_time_save_dir", str(tmp_path / "budget")]
    with pytest.raises(ValueError, match=r"max_time='00:00:00:00' is not a time budget longer than 0 s"):
        main(["fit", "--config", str(config_file), *budget])
    budget[1] = "0.001"  # seconds, as a YAML number or a flag
    result = main(["fit", "--config", str(config_file), *budget])
    assert result.stopped_early and result.stop_reason.startswith("Time budget max_time=0.001")
    assert (tmp_path / "budget" / "latest").is_file()


def test_the_run_folder_holds_what_reproduces_the_run_and_its_config_reruns_it_exactly(config_file, tmp_path):
    main(
        [
            "fit",
            "--config",
            str(config_file),
            "--output_dir",
            str(tmp_path / "runs"),
            "--run_name",
            "first",
            "--save_training_states",
            "true",
        ]
    )
    folder = tmp_path / "runs" / "first"
    assert {p.name for p in folder.iterdir()} >= {
        "config.yaml",
        "run_config.json",
        "history.csv",
        "history.png",
        "model.safetensors",
        "training_states",
    }
    assert json.loads((folder / "run_config.json").read_text())["num_epochs"] == 3
    assert sorted(path.name for path in (folder / "training_states").iterdir()) == [
        "epoch_1",
        "epoch_2",
        "epoch_3",
        "latest",
    ]  # one state per epoch, bounded (max_training_states: 3), no `final` that repeats the last one
    main(["fit", "--config", str(folder / "config.yaml")])  # the same run again, from its folder alone
    rerun = tmp_path / "runs" / "first-2"  # the name was taken: nothing of the first run is overwritten
    first_weights, rerun_weights = load_file(folder / "model.safetensors"), load_file(rerun / "model.safetensors")
    assert first_weights.keys() == rerun_weights.keys()
    assert all(torch.equal(first_weights[name], rerun_weights[name]) for name in first_weights)
    assert (folder / "history.csv").read_text() == (rerun / "history.csv").read_text()


def test_print_config_dumps_a_complete_config_that_reloads_to_the_same(config_file, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", str(config_file), "--train.gradient_clip_value", "2.5", "--print_config"])
    assert exit_info.value.code == 0
    dumped = capsys.readouterr().out
    assert "gradient_clip_norm: 1.0" in dumped and "gradient_clip_value: 2.5" in dumped  # Optional[float] dumps
    again = tmp_path / "again.yaml"
    again.write_text(dumped)
    with pytest.raises(SystemExit):
        main(["fit", "--config", str(again), "--print_config"])
    assert capsys.readouterr().out == dumped


def test_evaluate_loads_the_weights_of_a_run_folder_or_a_checkpoint_and_returns_the_metrics(config_file, tmp_path):
    trained = main(["fit", "--config", str(config_file), "--output_dir", str(tmp_path), "--run_name", "r"])
    weights = tmp_path / "r" / "model.safetensors"
    metrics = main(["evaluate", "--config", str(config_file), "--checkpoint", str(weights)])
    assert set(metrics) == {"evaluation_loss"}
    assert metrics["evaluation_loss"] == pytest.approx(trained.metrics["eval_loss_epoch"], rel=1e-5)
    from safetensors.torch import load_model

    from pytorch_accel_trainer import Trainer

    model = torch.nn.Linear(3, 1)
    load_model(model, weights)
    checkpoint = tmp_path / "model.pt"
    Trainer(model, None, None, callbacks=()).save_checkpoint(checkpoint, save_optimizer=False)
    assert main(["evaluate", "--config", str(config_file), "--checkpoint", str(checkpoint)]) == metrics
    untrained = main(["evaluate", "--config", str(config_file), "--evaluate_initial_weights", "true"])
    assert untrained["evaluation_loss"] > metrics["evaluation_loss"]  # the weights were loaded


def test_predict_writes_the_outputs_of_a_run_folder_s_weights_to_a_file_or_a_folder_of_chunks(config_file, tmp_path):
    from config_data.tiny import eval_dataset
    from safetensors.torch import load_model

    from pytorch_accel_trainer.predictions import load_predictions

    main(["fit", "--config", str(config_file), "--output_dir", str(tmp_path), "--run_name", "r"])
    predict = ["predict", "--config", str(config_file), "--checkpoint", str(tmp_path / "r")]  # the run folder
    written = main([*predict, "--output", str(tmp_path / "preds.pt")])
    model = torch.nn.Linear(3, 1)
    load_model(model, tmp_path / "r" / "model.safetensors")
    expected = model(eval_dataset().tensors[0]).detach()
    assert written == tmp_path / "preds.pt" and torch.allclose(torch.load(written), expected)
    folder = main([*predict, "--output", str(tmp_path / "chunks"), "--data.predict", "config_data.tiny.eval_dataset"])
    assert torch.equal(load_predictions(folder), torch.load(written))
    with pytest.raises(ConfigError, match="already exists"):
        main([*predict, "--output", str(tmp_path / "preds.pt")])
    with pytest.raises(ConfigError, match="checkpoint: .* is a folder without model.safetensors"):
        main(["predict", "--config", str(config_file), "--checkpoint", str(tmp_path), "--output", "p.pt"])


def test_trackers_receive_the_config_and_the_run_config(config_file, tmp_path):
    callback = {
        "class_path": "pytorch_accel_trainer.callbacks.ExperimentTrackingCallback",
        "init_args": {"trackers": ["jsonl"], "logging_dir": str(tmp_path / "logs"), "run_name": "tracked"},
    }
    main(["fit", "--config", str(config_file), "--callbacks", json.dumps([callback])])
    values = json.loads((tmp_path / "logs" / "tracked" / "config.json").read_text())
    assert values["train.num_epochs"] == 3 and values["model.class_path"] == "torch.nn.Linear"
    assert values["run_config.num_update_steps_per_epoch"] == 8  # the run config, from the trainer


def test_the_trackers_run_is_named_as_the_run_folder_unless_the_config_names_it(config_file, tmp_path):
    callback = {
        "class_path": "pytorch_accel_trainer.callbacks.ExperimentTrackingCallback",
        "init_args": {"trackers": ["csv"], "logging_dir": str(tmp_path / "logs")},
    }
    main(
        [
            "fit",
            "--config",
            str(config_file),
            "--callbacks",
            json.dumps([callback]),
            "--train.num_epochs",
            "1",
            "--output_dir",
            str(tmp_path / "runs"),
            "--run_name",
            "named",
        ]
    )
    assert (tmp_path / "logs" / "named" / "metrics.csv").is_file()


def test_a_trainer_subclass_and_its_own_arguments_are_given_by_import_path(config_file):
    import config_data.tiny as tiny

    tiny.TaggedTrainer.instances.clear()
    main(
        [
            "fit",
            "--config",
            str(config_file),
            "--trainer_class",
            "config_data.tiny.TaggedTrainer",
            "--trainer_arguments",
            '{"tag": "x"}',
            "--train.num_epochs",
            "1",
        ]
    )
    [trainer] = tiny.TaggedTrainer.instances  # the run's trainer was the subclass, built with its own argument
    assert trainer.tag == "x" and trainer.num_update_steps_completed == 8


def test_the_clip_options_of_train_serialise_in_a_parser_of_its_signature():
    from jsonargparse import ArgumentParser

    from pytorch_accel_trainer import Trainer

    parser = ArgumentParser(exit_on_error=False)
    parser.add_method_arguments(Trainer, "train", "train", skip={"train_dataset", "eval_dataset"})
    parsed = parser.parse_args(
        ["--train.num_epochs", "2", "--train.gradient_clip_norm", "1.0", "--train.gradient_clip_value", "3"]
    )
    assert "gradient_clip_norm: 1.0" in parser.dump(parsed) and "gradient_clip_value: 3" in parser.dump(parsed)


# Bad configs: one clear error each, before any work ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (
            ["--train.num_epoch", "3"],
            r"did you mean 'train.num_epochs'\?.*unrecognized arguments: --train.num_epoch 3.*--help",
        ),
        (["--train.num_epochs", "three"], r'Parser key "train.num_epochs".*Given value: three'),
        (["--model", "torch.nn.Linnear"], r"Parser key \"model\".*'torch.nn.Linnear'.*has no attribute 'Linnear'"),
        (["--data.train", "config_data.tiny.nope"], r'Parser key "data.train".*has no attribute \'nope\''),
        (
            ["--scheduler.import_path", "torch.optim.lr_scheduler.Nope"],
            r"scheduler.import_path: 'torch.optim.lr_scheduler.Nope' does not import",
        ),
        (
            ["--scheduler.arguments.max_lrr", "0.1"],
            r"scheduler.arguments: .* do not fit torch.optim.lr_scheduler.OneCycleLR "
            r".*unexpected keyword argument 'max_lrr'.*its arguments are \['max_lr'",
        ),
        (
            ["--scheduler.arguments.total_steps", "NUM_EPOCHS ** 2"],
            r"'NUM_EPOCHS \*\* 2' is not a placeholder expression",
        ),
        (
            ["--optimizer", "null"],
            r"optimizer is missing: `fit` needs it. Set it in the config file or with --optimizer",
        ),
        (["--train.num_epochs", "null"], r"train.num_epochs and train.max_num_train_steps are both null"),
        (
            ["--trainer_class", "torch.nn.Linear"],
            r'Parser key "trainer_class".*type\[pytorch_accel_trainer.trainer.Trainer\]',
        ),
    ],
)
def test_each_bad_config_is_one_error_naming_the_key_and_the_fix(config_file, flags, message):
    with pytest.raises(ConfigError, match=f"(?s){message}"):
        main(["fit", "--config", str(config_file), *flags])


def test_a_missing_required_value_and_an_unknown_key_in_the_file_are_named(config_file, tmp_path):
    partial = tmp_path / "partial.yaml"
    partial.write_text(
        yaml.safe_dump({**CONFIG, "model": {"class_path": "torch.nn.Linear", "init_args": {"in_features": 3}}})
    )
    with pytest.raises(ConfigError, match=r"(?s)Parser key \"model\".*required: out_features"):
        main(["fit", "--config", str(partial)])
    unknown = tmp_path / "unknown.yaml"
    unknown.write_text(yaml.safe_dump({**CONFIG, "modell": 3}))
    with pytest.raises(ConfigError, match=r"(?s)did you mean 'model'\?.*modell"):
        main(["fit", "--config", str(unknown)])
    with pytest.raises(ConfigError, match=r"data.eval is missing: `evaluate` needs it"):
        main(["evaluate", "--config", str(config_file), "--data.eval", "null"])


def test_the_console_script_prints_one_error_line_and_exits_2(config_file, capsys):
    assert console_main(["fit", "--config", str(config_file), "--train.num_epochs", "zero"]) == 2
    error = capsys.readouterr().err
    assert error.startswith("pytorch-accel-trainer: error: The configuration is not valid") and "Traceback" not in error


def test_the_config_reaches_trackers_as_plain_values():
    values = {"a": {"b": 1, "c": None}, "d": [1, 2], "e": "x", "f": plain_hyperparameters}
    assert plain_hyperparameters(values) == {
        "a.b": 1,
        "a.c": "null",
        "d": "[1, 2]",
        "e": "x",
        "f": "pytorch_accel_trainer.callbacks.trackers.plain_hyperparameters",
    }


def test_the_parser_has_fit_evaluate_predict_and_tune():
    assert set(create_parser().command_parsers) == {"fit", "evaluate", "predict", "tune"}


# The digits example from the command line --------------------------------------------------------------------------


def _digits_command(tmp_path, launcher_prefix):
    return [
        *launcher_prefix,
        "fit",
        "--config",
        "examples/digits.yaml",
        "--train.num_epochs",
        "2",
        "--output_dir",
        str(tmp_path),
        "--run_name",
        "digits",
    ]


@pytest.mark.slow
def test_the_digits_yaml_trains_from_the_console_script(tmp_path):
    script = pathlib.Path(sys.executable).parent / "pytorch-accel-trainer"
    completed = subprocess.run(
        _digits_command(tmp_path, [str(script)]), cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    history = (tmp_path / "digits" / "history.csv").read_text().splitlines()
    assert len(history) == 3 and "accuracy" in history[0]


@pytest.mark.distributed
@pytest.mark.slow
def test_the_digits_yaml_trains_under_a_2_process_launch(tmp_path):
    launch = [*launcher(2), "-m", "pytorch_accel_trainer"]
    completed = subprocess.run(
        _digits_command(tmp_path, launch), cwd=ROOT, env=CPU_PROCESSES_ENV, capture_output=True, text=True, timeout=300
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    assert [p.name for p in tmp_path.iterdir()] == ["digits"]  # one run folder, chosen by the main process
    run_config = json.loads((tmp_path / "digits" / "run_config.json").read_text())
    assert run_config["num_processes"] == 2


@pytest.mark.slow
def test_the_digits_config_is_the_python_example_run_bit_for_bit(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    main(
        [
            "fit",
            "--config",
            "examples/digits.yaml",
            "--train.num_epochs",
            "2",
            "--output_dir",
            str(tmp_path),
            "--run_name",
            "cli",
        ]
    )
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        import train_digits
    finally:
        sys.path.remove(str(ROOT / "examples"))
    train_digits.main(["--num-epochs", "2", "--output-dir", str(tmp_path / "python")])
    from_cli = load_file(tmp_path / "cli" / "model.safetensors")
    from_python = torch.load(tmp_path / "python" / "model.pt", weights_only=False)["model_state_dict"]
    assert from_cli.keys() == from_python.keys()
    assert all(torch.equal(from_cli[name], from_python[name]) for name in from_cli)
    assert (tmp_path / "cli" / "history.csv").read_text() == (tmp_path / "python" / "history.csv").read_text()
