"""The command line: runs described by a config file or flags, the run folder, reruns, evaluate and predict, trackers;
each bad config or user mistake is one `error:` line with exit status 2, before any work and without an empty run
folder left behind."""

from __future__ import annotations

import json
import os
import pathlib
import re
import subprocess
import sys

import pytest
import torch
import yaml
from config_data.tiny import TINY_CONFIG
from conftest import CPU_PROCESSES_ENV, launcher
from safetensors.torch import load_file

from pytorch_accel_trainer.callbacks import NonFiniteLossError
from pytorch_accel_trainer.callbacks.trackers import plain_hyperparameters
from pytorch_accel_trainer.cli import console_main, create_parser, main
from pytorch_accel_trainer.cli.config import ConfigError
from pytorch_accel_trainer.cli.parsing import MAX_ALIAS_VALUES, parse_command
from pytorch_accel_trainer.loop.run_state import TrainResult
from pytorch_accel_trainer.run_config import max_time_seconds

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


#: The tiny config of config_data/tiny.py for one epoch of 4 batches: no scheduler, no clipping.
TINY_RUN = {**TINY_CONFIG, "train": {"num_epochs": 1, "per_device_batch_size": 16}}


@pytest.fixture
def tiny_config_file(tmp_path, monkeypatch):
    monkeypatch.chdir(TESTS)  # import paths resolve from the current folder, as with `python -m`
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(TINY_RUN))
    return path


def test_config_file_and_flags_flags_win(config_file):
    """A config file with flags trains; the flags win."""
    result = main(["fit", "--config", str(config_file), "--train.num_epochs", "2", "--optimizer.lr", "0.01"])
    assert isinstance(result, TrainResult)
    assert result.num_epochs == 2 and result.num_update_steps == 16
    assert result.metrics["eval_loss_epoch"] < result.metrics["train_loss_epoch"] * 10


def test_time_budget_from_the_command_line(config_file, tmp_path):
    """A time budget from the command line stops the run and saves where it says."""
    budget = ["--train.max_time", "00:00:00:00", "--train.max_time_save_dir", str(tmp_path / "budget")]
    with pytest.raises(ValueError, match=r"max_time='00:00:00:00' is not a time budget longer than 0 s"):
        main(["fit", "--config", str(config_file), *budget])
    budget[1] = "0.001"  # seconds, as a YAML number or a flag
    result = main(["fit", "--config", str(config_file), *budget])
    assert result.stopped_early and result.stop_reason.startswith("Time budget max_time=0.001")
    assert (tmp_path / "budget" / "latest").is_file()


@pytest.mark.parametrize(
    ("text", "seconds"), [("1:00:00:00", 86400.0), ("12:00:00", 43200.0), ("00:11:50:00", 42600.0), ("1:30:00", 5400.0)]
)
def test_max_time_text_is_read_the_same_everywhere(tiny_config_file, tmp_path, text, seconds):
    """A file, a flag and train(max_time=...) read the same `max_time` text the same way (`1:00:00:00` is one day,
    never YAML 1.1's base-60 integer 216000; `12:00:00` is 12 hours), and the run folder's config.yaml keeps it as
    text."""
    in_file = tmp_path / "budget.yaml"
    in_file.write_text(tiny_config_file.read_text() + f"  max_time: {text}\n")  # unquoted, under `train:`
    from_file = parse_command(["fit", "--config", str(in_file)])
    from_flag = parse_command(["fit", "--config", str(tiny_config_file), "--train.max_time", text])
    for parsed in (from_file, from_flag):
        assert parsed.config.train.max_time == text
        assert max_time_seconds(parsed.config.train.max_time) == max_time_seconds(text) == seconds
    written = tmp_path / "config.yaml"  # what the run folder's config.yaml holds: the text, quoted
    written.write_text(from_flag.config_text)
    assert parse_command(["fit", "--config", str(written)]).config.train.max_time == text
    assert main(["fit", "--config", str(in_file)]).stop_reason is None  # a run with it finishes


def test_base_60_looking_values_stay_text_in_every_key(tiny_config_file, tmp_path):
    """No key reads YAML 1.1's base-60 numbers (`12:30` is text, not 750); jsonargparse's other readings stay
    (`1e-3` is a float, a date is text)."""
    values = tmp_path / "values.yaml"
    values.write_text("trainer_arguments: {tag: 12:30, rate: 1e-3, day: 2024-01-01, count: 0x10}\nrun_name: 10:30\n")
    parsed = parse_command(["fit", "--config", str(tiny_config_file), "--config", str(values)])
    assert parsed.config.trainer_arguments == {"tag": "12:30", "rate": 0.001, "day": "2024-01-01", "count": 16}
    assert parsed.config.run_name == "10:30"
    flagged = parse_command(["fit", "--config", str(tiny_config_file), "--trainer_arguments", "{tag: 1:30:00}"])
    assert flagged.config.trainer_arguments == {"tag": "1:30:00"}


def test_an_integer_with_a_leading_zero_is_read_the_same_in_a_file_and_a_flag(tiny_config_file, tmp_path):
    """YAML 1.1 read ``num_epochs: 010`` in a file as octal 8, and the flag ``--train.num_epochs 010`` gave 10: both are
    10 now, as in YAML 1.2; octal is written ``0o10``, and the other bases and ``_`` stay."""
    values = tmp_path / "values.yaml"
    values.write_text("train: {num_epochs: 010}\ntrainer_arguments: {a: 0o17, b: -0x1f, c: 0b11, d: 1_000, e: +007}\n")
    parsed = parse_command(["fit", "--config", str(tiny_config_file), "--config", str(values)], instantiate=False)
    assert parsed.namespace.train.num_epochs == 10
    assert parsed.namespace.trainer_arguments == {"a": 15, "b": -31, "c": 3, "d": 1000, "e": 7}
    flagged = parse_command(["fit", "--config", str(tiny_config_file), "--train.num_epochs", "010"], instantiate=False)
    assert flagged.namespace.train.num_epochs == 10


def test_run_folder_reruns_the_run_exactly(config_file, tmp_path):
    """The run folder holds what reproduces the run; its config reruns it exactly."""
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


def test_three_states_kept_and_folder_resume(tiny_config_file, tmp_path, capsys):
    """Config runs keep three training states by default, and resume from a run folder."""
    runs = tmp_path / "runs"
    common = ["--config", str(tiny_config_file), "--output_dir", str(runs), "--save_training_states", "true"]
    main(["fit", *common, "--run_name", "first", "--train.num_epochs", "5"])
    states = runs / "first" / "training_states"
    assert sorted(path.name for path in states.iterdir()) == ["epoch_3", "epoch_4", "epoch_5", "latest"]
    result = main(["fit", *common, "--train.num_epochs", "6", "--train.resume_from", str(runs / "first")])
    assert (
        f"from {states / 'epoch_5'} (after 20 optimizer updates) at the start of epoch 6, run "
        in capsys.readouterr().out
    )
    assert result.num_update_steps == 24 and result.num_epochs == 1
    help_text = create_parser().command_parsers["fit"].format_help()
    assert "max_training_states" in help_text and "3 by default" in help_text


def test_paths_in_a_config_expand_home_and_variables(tiny_config_file, tmp_path, monkeypatch, capsys):
    """``output_dir: ~/runs`` and ``$HOME/runs`` are the home folder's ``runs`` (never a literal ``./~/runs`` or a
    folder named ``$HOME``), in the file, in a flag and in ``resume_from``; a variable that is not set is one error
    line."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    config = yaml.safe_load(tiny_config_file.read_text())
    tiny_config_file.write_text(yaml.safe_dump({**config, "output_dir": "~/runs"}))
    main(["fit", "--config", str(tiny_config_file), "--run_name", "first", "--save_training_states", "true"])
    first = tmp_path / "home" / "runs" / "first"
    assert (first / "model.safetensors").is_file() and (first / "training_states").is_dir()
    common = ["--config", str(tiny_config_file), "--output_dir", "$HOME/runs", "--train.num_epochs", "2"]
    main(["fit", *common, "--run_name", "second", "--train.resume_from", "~/runs/first"])
    assert f"Resuming from {first / 'training_states' / 'epoch_1'}" in capsys.readouterr().out
    assert (tmp_path / "home" / "runs" / "second" / "history.csv").is_file()
    assert not any(path.name in ("~", "$HOME") for path in pathlib.Path.cwd().iterdir())
    assert console_main(["fit", "--config", str(tiny_config_file), "--output_dir", "$NOT_SET/runs"]) == 2
    assert "'$NOT_SET/runs' names the environment variable $NOT_SET, which is not set" in capsys.readouterr().err


def test_nan_run_writes_no_weights(tiny_config_file, tmp_path, capsys):
    """A run stopped by non-finite values writes its history but no NaN weights."""
    flags = ["--optimizer.init_args.lr", "1e30", "--train.num_epochs", "2", "--default_callbacks", "true"]
    with pytest.raises(NonFiniteLossError):
        main(["fit", "--config", str(tiny_config_file), "--output_dir", str(tmp_path), "--run_name", "nan", *flags])
    assert not (tmp_path / "nan" / "model.safetensors").exists()
    assert (tmp_path / "nan" / "history.csv").exists()
    assert "model.safetensors was not written: the model's weights are NaN or infinite" in capsys.readouterr().out


def test_print_config_round_trips(config_file, tmp_path, capsys):
    """--print_config dumps a complete config that reloads to the same."""
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


def test_evaluate_loads_folder_or_checkpoint(config_file, tmp_path):
    """evaluate loads the weights of a run folder or a checkpoint, and returns the metrics."""
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


def test_evaluate_needs_a_checkpoint(tiny_config_file, tmp_path):
    """evaluate needs a checkpoint, takes a run folder, and leaves no empty run folder."""
    with pytest.raises(
        ConfigError, match=r"checkpoint is missing: `evaluate` would measure .*--evaluate_initial_weights"
    ):
        main(["evaluate", "--config", str(tiny_config_file)])
    main(["fit", "--config", str(tiny_config_file), "--output_dir", str(tmp_path / "runs"), "--run_name", "r"])
    from_folder = main(["evaluate", "--config", str(tiny_config_file), "--checkpoint", str(tmp_path / "runs" / "r")])
    from_file = main(
        ["evaluate", "--config", str(tiny_config_file), "--checkpoint", str(tmp_path / "runs/r/model.safetensors")]
    )
    assert from_folder == from_file
    initial = main(["evaluate", "--config", str(tiny_config_file), "--evaluate_initial_weights", "true"])
    assert initial["evaluation_loss"] > from_folder["evaluation_loss"]
    main(
        [
            "evaluate",
            "--config",
            str(tiny_config_file),
            "--checkpoint",
            str(tmp_path / "runs" / "r"),
            "--output_dir",
            str(tmp_path / "eval"),
        ]
    )
    assert not (tmp_path / "eval").exists() or not any((tmp_path / "eval").iterdir())  # no empty run folder


def test_predict_writes_a_file_or_chunks(config_file, tmp_path):
    """predict writes the outputs of a run folder's weights to a file, or a folder of chunks."""
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
    assert folder == tmp_path / "chunks"  # main returns where it wrote (docs/config.md, "From Python")
    assert torch.equal(load_predictions(folder), torch.load(written))
    with pytest.raises(ConfigError, match="already exists"):
        main([*predict, "--output", str(tmp_path / "preds.pt")])
    with pytest.raises(ConfigError, match="checkpoint: .* is a folder without model.safetensors"):
        main(["predict", "--config", str(config_file), "--checkpoint", str(tmp_path), "--output", "p.pt"])


def test_trackers_receive_both_configs(config_file, tmp_path):
    """Trackers receive the config and the run config."""
    callback = {
        "class_path": "pytorch_accel_trainer.callbacks.ExperimentTrackingCallback",
        "init_args": {"trackers": ["jsonl"], "logging_dir": str(tmp_path / "logs"), "run_name": "tracked"},
    }
    main(["fit", "--config", str(config_file), "--callbacks", json.dumps([callback])])
    values = json.loads((tmp_path / "logs" / "tracked" / "config.json").read_text())
    assert values["train.num_epochs"] == 3 and values["model.class_path"] == "torch.nn.Linear"
    assert values["run_config.num_update_steps_per_epoch"] == 8  # the run config, from the trainer


def test_tracker_run_named_as_run_folder(config_file, tmp_path):
    """The trackers' run is named as the run folder unless the config names it."""
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


def test_trainer_subclass_by_import_path(config_file):
    """A Trainer subclass and its own arguments are given by import path."""
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


def test_clip_options_serialise():
    """The clip options of train() serialise in a parser of its signature."""
    from jsonargparse import ArgumentParser

    from pytorch_accel_trainer import Trainer

    parser = ArgumentParser(exit_on_error=False)
    parser.add_method_arguments(Trainer, "train", "train", skip={"train_dataset", "eval_dataset"})
    parsed = parser.parse_args(
        ["--train.num_epochs", "2", "--train.gradient_clip_norm", "1.0", "--train.gradient_clip_value", "3"]
    )
    assert "gradient_clip_norm: 1.0" in parser.dump(parsed) and "gradient_clip_value: 3" in parser.dump(parsed)


def test_trackers_get_plain_config_values():
    values = {"a": {"b": 1, "c": None}, "d": [1, 2], "e": "x", "f": plain_hyperparameters}
    assert plain_hyperparameters(values) == {
        "a.b": 1,
        "a.c": "null",
        "d": "[1, 2]",
        "e": "x",
        "f": "pytorch_accel_trainer.callbacks.trackers.plain_hyperparameters",
    }


def test_parser_has_the_four_commands():
    """The parser has fit, evaluate, predict and tune."""
    assert set(create_parser().command_parsers) == {"fit", "evaluate", "predict", "tune"}


# Bad configs and user mistakes: one clear error each, before any work -------------------------------------------------


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
def test_bad_config_names_key_and_fix(config_file, flags, message):
    """Each bad config is one error naming the key and the fix."""
    with pytest.raises(ConfigError, match=f"(?s){message}"):
        main(["fit", "--config", str(config_file), *flags])


def test_missing_value_and_unknown_key(config_file, tmp_path):
    """A missing required value and an unknown key in the file are named."""
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


def test_console_script_error_exits_2(config_file, capsys):
    """The console script prints one error line and exits 2."""
    assert console_main(["fit", "--config", str(config_file), "--train.num_epochs", "zero"]) == 2
    error = capsys.readouterr().err
    assert error.startswith("pytorch-accel-trainer: error: The configuration is not valid") and "Traceback" not in error


def test_key_given_twice_names_its_lines(tiny_config_file, tmp_path):
    """A key given twice in a config file is an error naming it and its lines; so is an empty or a list file."""
    twice = tmp_path / "twice.yaml"
    twice.write_text(tiny_config_file.read_text() + "train:\n  gradient_clip_norm: 1.0\n")
    line = len(tiny_config_file.read_text().splitlines()) + 1
    with pytest.raises(
        ConfigError, match=rf"twice.yaml, line {line}: the key 'train' is given a second time \(first on"
    ):
        main(["fit", "--config", str(twice)])
    nested = tmp_path / "nested.yaml"
    nested.write_text("train:\n  num_epochs: 1\n  num_epochs: 2\n")
    with pytest.raises(
        ConfigError, match=r"line 3: the key 'train.num_epochs' is given a second time \(first on line 2"
    ):
        main(["fit", "--config", str(tiny_config_file), "--config", str(nested)])
    empty, listed = tmp_path / "empty.yaml", tmp_path / "list.yaml"
    empty.write_text("")
    listed.write_text("- model\n- train\n")
    with pytest.raises(ConfigError, match="empty.yaml is empty: a config file is a mapping of keys"):
        main(["fit", "--config", str(empty)])
    with pytest.raises(ConfigError, match="list.yaml holds a YAML seq, not a mapping of keys"):
        main(["fit", "--config", str(listed)])


EARLY_STOPPING = '[{"class_path": "pytorch_accel_trainer.callbacks.EarlyStoppingCallback"}]'


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--train.num_epochs", "0"], r"train.num_epochs=0 is not valid: it must be a positive integer"),
        (
            ["--optimizer.init_args.lr", "-0.1"],
            r"optimizer: the optimizer refused its arguments \(Invalid learning rate",
        ),
        (["--train.resume_from", "{stray}"], r"train.resume_from='.*stray' holds notes.txt but no training state"),
        (["--output_dir", "{file}"], r"output_dir: '.*afile.txt' cannot hold run folders: .* is a file"),
        (["--run_name", "../../escaped"], r"run_name is '../../escaped': it must be one plain folder name"),
        (["--max_training_states", "0"], r"max_training_states is 0: pass a positive number of states to keep"),
        (["--checkpoint", "{stray}"], r"checkpoint: '.*stray' is a folder without model.safetensors"),
        (["--data.train", "config_data.tiny.tensors"], r"train_dataset is a tuple of 2 tensors of 64 rows, not a"),
        (
            ["--data.eval", "null", "--callbacks", EARLY_STOPPING],
            r"EarlyStoppingCallback watches 'eval_loss_epoch', which only an evaluation epoch records",
        ),
        (
            ["--train.eval_dataloader_kwargs", '{"drop_last": true}', "--train.per_device_batch_size", "40"],
            r"eval_dataset has 32 samples, fewer than one batch \(40\).*drop_last=True",
        ),
        (
            [
                "--scheduler",
                '{"import_path": "torch.optim.lr_scheduler.StepLR", "arguments": {"step_size": "num_epochs"}}',
            ],
            r"scheduler.arguments.step_size: 'num_epochs' names no placeholder \(did you mean NUM_EPOCHS\?\)",
        ),
        (
            [
                "--scheduler",
                '{"import_path": "torch.optim.lr_scheduler.CosineAnnealingLR", "arguments": {"T_max": "NUM_EPOCH"}}',
            ],
            r"'NUM_EPOCH' names no placeholder \(did you mean NUM_EPOCHS\?\)",
        ),
        # each of these is a message naming the value, not a traceback (numpy's, a TypeError, an OverflowError)
        (["--trainer.seed", "-1"], r"trainer.seed is -1: a seed is a whole number from 0 to 2\*\*32 - 1"),
        (["--trainer.seed", str(2**32)], r"trainer.seed is 4294967296: .*--trainer.seed 42"),
        (
            ["--data.arguments", '{"nope": 3}'],
            r"data.arguments: \{'nope': 3\} do not fit data.train \(config_data.tiny.train_dataset\): got an "
            r"unexpected keyword argument 'nope'. It takes \['num_samples'\]",
        ),
        (
            ["--data.train", "config_data.tiny.noisy_train_dataset", "--data.arguments", '{"noise": 0.5}'],
            r"do not fit data.eval \(config_data.tiny.eval_dataset\).* data.arguments go to every data function",
        ),
        (
            ["--train.max_time", "99999999999:00:00:00"],
            r"train.max_time='99999999999:00:00:00' is longer than the longest time budget taken, 999999999 days",
        ),
        (["--train.max_time", "1e300"], r"train.max_time=1e\+300 is longer than the longest time budget taken"),
        (["--train.max_time", "12:00"], r"train.max_time='12:00' is not a time budget .*'HH:MM:SS'"),
    ],
)
def test_user_mistake_is_one_error_line(tiny_config_file, tmp_path, capsys, flags, message):
    """Each user mistake is one error line with exit status 2, and leaves no run folder."""
    stray = tmp_path / "stray"
    stray.mkdir()
    (stray / "notes.txt").write_text("not a state")
    (tmp_path / "afile.txt").write_text("a file")
    flags = [flag.replace("{stray}", str(stray)).replace("{file}", str(tmp_path / "afile.txt")) for flag in flags]
    runs = tmp_path / "runs"
    output = [] if "--output_dir" in flags else ["--output_dir", str(runs), "--save_training_states", "true"]
    assert console_main(["fit", "--config", str(tiny_config_file), *output, *flags]) == 2
    error = capsys.readouterr().err
    assert error.startswith("pytorch-accel-trainer: error: ") and "Traceback" not in error
    assert error.count("pytorch-accel-trainer: error:") == 1
    assert re.search(message, error, flags=re.DOTALL), error
    assert not runs.exists() or not any(runs.iterdir()), "a failing run left its run folder"


def test_data_arguments_are_checked_for_every_command(tiny_config_file, tmp_path):
    """evaluate and predict check data.arguments against the function they call, as fit does."""
    noise = ["--config", str(tiny_config_file), "--data.arguments", '{"noise": 0.5}']
    message = r"do not fit data.eval \(config_data.tiny.eval_dataset\).*It takes \['num_samples'\]"
    with pytest.raises(ConfigError, match=message):
        main(["evaluate", *noise, "--evaluate_initial_weights", "true"])
    with pytest.raises(ConfigError, match=message):  # predict falls back to data.eval
        main(["predict", *noise, "--output", str(tmp_path / "p.pt")])
    predict = ["--data.predict", "config_data.tiny.noisy_train_dataset", "--output", str(tmp_path / "p.pt")]
    assert main(["predict", *noise, *predict]) == tmp_path / "p.pt"  # a function that takes them


def test_yaml_error_names_the_file_and_line(tiny_config_file, tmp_path, capsys):
    """Every YAML error (a tab in a config file: "found character that cannot start any token") names the file, the
    line and the column, with the fix."""
    tabbed = tmp_path / "tabbed.yaml"
    tabbed.write_text(tiny_config_file.read_text().replace("\n  num_epochs", "\n\tnum_epochs"))
    line = tabbed.read_text().splitlines().index("\tnum_epochs: 1") + 1
    assert console_main(["fit", "--config", str(tabbed)]) == 2
    error = capsys.readouterr().err
    assert re.search(rf"tabbed.yaml, line {line}, column 1: not valid YAML .*never tabs", error), error
    assert "Traceback" not in error
    unclosed = tmp_path / "unclosed.yaml"
    unclosed.write_text("train:\n  num_epochs: 1\nmodel: {class_path: torch.nn.Linear\n")
    with pytest.raises(ConfigError, match=r"unclosed.yaml, line 4, column 1: not valid YAML \(.*Fix the file there"):
        main(["fit", "--config", str(tiny_config_file), "--config", str(unclosed)])
    unreadable = tmp_path / "latin1.yaml"
    unreadable.write_bytes("run_name: caf\xe9\n".encode("latin-1"))
    with pytest.raises(ConfigError, match=r"latin1.yaml cannot be read as a config file \(.*codec can't decode"):
        main(["fit", "--config", str(tiny_config_file), "--config", str(unreadable)])


def _nested_aliases(levels: int = 8, width: int = 9) -> str:
    """A "billion laughs": each level a list of `width` aliases of the level before, 9**8 values in about 500 bytes."""
    lines = [f"    l0: &l0 [{', '.join(['x'] * width)}]"]
    lines += [f"    l{level}: &l{level} [{', '.join([f'*l{level - 1}'] * width)}]" for level in range(1, levels + 1)]
    return "data:\n  arguments:\n" + "\n".join(lines) + "\n"


@pytest.mark.timeout(30)
def test_nested_aliases_are_refused_in_a_second(tiny_config_file, tmp_path, capsys):
    """A 600-byte file of nested aliases (minutes and gigabytes if the duplicate-key check walked every alias, or
    loading built them all) is refused at once, as a file or as a flag's value, and so is an alias inside itself."""
    import time

    laughs = tmp_path / "laughs.yaml"
    laughs.write_text(_nested_aliases())
    assert len(laughs.read_bytes()) < 600
    started = time.monotonic()
    assert console_main(["fit", "--config", str(tiny_config_file), "--config", str(laughs)]) == 2
    flow = "{" + ", ".join(line.strip() for line in _nested_aliases().splitlines()[2:]) + "}"
    with pytest.raises(ConfigError, match=r"(?s)data.arguments.*its aliases \(\*name\) expand to 490,329,\d{3} values"):
        main(["fit", "--config", str(tiny_config_file), "--data.arguments", flow])
    assert time.monotonic() - started < 5
    error = capsys.readouterr().err
    assert re.search(
        rf"laughs.yaml: its aliases \(\*name\) expand to 490,329,068 values \(the anchor on line 10 alone, "
        rf"48,427,561 values, appears 10 times\).*at most {MAX_ALIAS_VALUES:,} values",
        error,
    ), error
    looped = tmp_path / "looped.yaml"
    looped.write_text("trainer_arguments: &self {tag: x, again: *self}\n")
    with pytest.raises(ConfigError, match=r"looped.yaml, line 1: an alias refers to the value that contains it"):
        main(["fit", "--config", str(tiny_config_file), "--config", str(looped)])


def test_aliases_of_a_config_still_work(tiny_config_file, tmp_path):
    """Anchors, aliases and merge keys of an ordinary config are read as before."""
    shared = tmp_path / "shared.yaml"
    shared.write_text(
        "train: &train {num_epochs: 2, per_device_batch_size: 8}\n"
        "trainer_arguments: {first: *train, second: {<<: *train, per_device_batch_size: 16}}\n"
    )
    config = parse_command(["fit", "--config", str(tiny_config_file), "--config", str(shared)]).config
    assert config.train.num_epochs == 2 and config.train.per_device_batch_size == 8
    assert config.trainer_arguments == {
        "first": {"num_epochs": 2, "per_device_batch_size": 8},
        "second": {"num_epochs": 2, "per_device_batch_size": 16},
    }


def test_user_code_error_keeps_traceback(tiny_config_file):
    """An error of the user's own code keeps its traceback."""
    with pytest.raises(ValueError, match="a bug in the user's data function"):
        console_main(["fit", "--config", str(tiny_config_file), "--data.train", "config_data.tiny.broken"])


# The digits example from the command line -----------------------------------------------------------------------------


def _digits_command(tmp_path, launcher_prefix, run_name="digits"):
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
        run_name,
    ]


@pytest.mark.slow
def test_digits_yaml_from_console_script(tmp_path):
    """The digits YAML trains from the console script (the file pip writes for setup.cfg's entry point), run by the
    warm launcher: the script's interpreter is this one, and a new interpreter's import of the package is
    test_structure.py's."""
    script = pathlib.Path(sys.executable).parent / "pytorch-accel-trainer"
    completed = subprocess.run(
        _digits_command(tmp_path, [*launcher(1), str(script)]),
        cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1"},  # the warm launcher's (read as torch starts)
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    history = (tmp_path / "digits" / "history.csv").read_text().splitlines()
    assert len(history) == 3 and "accuracy" in history[0]


@pytest.mark.distributed
@pytest.mark.slow
def test_digits_yaml_on_two_processes(tmp_path):
    """The digits YAML trains under a 2-process launch."""
    launch = [*launcher(2), "-m", "pytorch_accel_trainer"]
    completed = subprocess.run(
        _digits_command(tmp_path, launch), cwd=ROOT, env=CPU_PROCESSES_ENV, capture_output=True, text=True, timeout=300
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    assert [p.name for p in tmp_path.iterdir()] == ["digits"]  # one run folder, chosen by the main process
    run_config = json.loads((tmp_path / "digits" / "run_config.json").read_text())
    assert run_config["num_processes"] == 2


@pytest.mark.slow
def test_digits_config_equals_python_example(tmp_path, monkeypatch):
    """The digits config is the Python example's run, bit for bit."""
    monkeypatch.chdir(ROOT)
    main(_digits_command(tmp_path, [], run_name="cli"))
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
