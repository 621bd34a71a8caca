"""The command line fails the way the library does: each user mistake is one `error:` line, exit status 2, before
any work and without an empty run folder left behind; config runs keep a bounded number of states (issue 24)."""

from __future__ import annotations

import pathlib
import re

import pytest
import yaml
from config_data.tiny import TINY_CONFIG

from pytorch_accel_trainer.callbacks import NonFiniteLossError
from pytorch_accel_trainer.cli import console_main, create_parser, main
from pytorch_accel_trainer.cli.config import ConfigError

TESTS = pathlib.Path(__file__).parent

CONFIG = {**TINY_CONFIG, "train": {"num_epochs": 1, "per_device_batch_size": 16}}


@pytest.fixture
def config_file(tmp_path, monkeypatch):
    monkeypatch.chdir(TESTS)  # import paths resolve from the current folder, as with `python -m`
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(CONFIG))
    return path


def test_config_runs_keep_three_states_by_default_and_resume_from_a_run_folder(config_file, tmp_path, capsys):
    runs = tmp_path / "runs"
    common = ["--config", str(config_file), "--output_dir", str(runs), "--save_training_states", "true"]
    main(["fit", *common, "--run_name", "first", "--train.num_epochs", "5"])
    states = runs / "first" / "training_states"
    assert sorted(path.name for path in states.iterdir()) == ["epoch_3", "epoch_4", "epoch_5", "latest"]
    result = main(["fit", *common, "--train.num_epochs", "6", "--train.resume_from", str(runs / "first")])
    assert f"from {states / 'epoch_5'} (after 20 optimizer updates), run " in capsys.readouterr().out
    assert result.num_update_steps == 24 and result.num_epochs == 1
    help_text = create_parser().command_parsers["fit"].format_help()
    assert "max_training_states" in help_text and "3 by default" in help_text


def test_a_key_given_twice_in_a_config_file_is_an_error_naming_it_and_its_lines(config_file, tmp_path):
    twice = tmp_path / "twice.yaml"
    twice.write_text(config_file.read_text() + "train:\n  gradient_clip_norm: 1.0\n")
    line = len(config_file.read_text().splitlines()) + 1
    with pytest.raises(
        ConfigError, match=rf"twice.yaml, line {line}: the key 'train' is given a second time \(first on"
    ):
        main(["fit", "--config", str(twice)])
    nested = tmp_path / "nested.yaml"
    nested.write_text("train:\n  num_epochs: 1\n  num_epochs: 2\n")
    with pytest.raises(
        ConfigError, match=r"line 3: the key 'train.num_epochs' is given a second time \(first on line 2"
    ):
        main(["fit", "--config", str(config_file), "--config", str(nested)])
    empty, listed = tmp_path / "empty.yaml", tmp_path / "list.yaml"
    empty.write_text("")
    listed.write_text("- model\n- train\n")
    with pytest.raises(ConfigError, match="empty.yaml is empty: a config file is a mapping of keys"):
        main(["fit", "--config", str(empty)])
    with pytest.raises(ConfigError, match="list.yaml holds a YAML seq, not a mapping of keys"):
        main(["fit", "--config", str(listed)])


def test_evaluate_needs_a_checkpoint_and_takes_a_run_folder(config_file, tmp_path):
    with pytest.raises(
        ConfigError, match=r"checkpoint is missing: `evaluate` would measure .*--evaluate_initial_weights"
    ):
        main(["evaluate", "--config", str(config_file)])
    main(["fit", "--config", str(config_file), "--output_dir", str(tmp_path / "runs"), "--run_name", "r"])
    from_folder = main(["evaluate", "--config", str(config_file), "--checkpoint", str(tmp_path / "runs" / "r")])
    from_file = main(
        ["evaluate", "--config", str(config_file), "--checkpoint", str(tmp_path / "runs/r/model.safetensors")]
    )
    assert from_folder == from_file
    initial = main(["evaluate", "--config", str(config_file), "--evaluate_initial_weights", "true"])
    assert initial["evaluation_loss"] > from_folder["evaluation_loss"]
    main(
        [
            "evaluate",
            "--config",
            str(config_file),
            "--checkpoint",
            str(tmp_path / "runs" / "r"),
            "--output_dir",
            str(tmp_path / "eval"),
        ]
    )
    assert not (tmp_path / "eval").exists() or not any((tmp_path / "eval").iterdir())  # no empty run folder


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
    ],
)
def test_each_user_mistake_is_one_error_line_with_exit_2_and_no_run_folder(
    config_file, tmp_path, capsys, flags, message
):
    stray = tmp_path / "stray"
    stray.mkdir()
    (stray / "notes.txt").write_text("not a state")
    (tmp_path / "afile.txt").write_text("a file")
    flags = [flag.replace("{stray}", str(stray)).replace("{file}", str(tmp_path / "afile.txt")) for flag in flags]
    runs = tmp_path / "runs"
    output = [] if "--output_dir" in flags else ["--output_dir", str(runs), "--save_training_states", "true"]
    assert console_main(["fit", "--config", str(config_file), *output, *flags]) == 2
    error = capsys.readouterr().err
    assert error.startswith("pytorch-accel-trainer: error: ") and "Traceback" not in error
    assert error.count("pytorch-accel-trainer: error:") == 1
    assert re.search(message, error, flags=re.DOTALL), error
    assert not runs.exists() or not any(runs.iterdir()), "a failing run left its run folder"


def test_a_run_stopped_by_non_finite_values_writes_no_nan_weights(config_file, tmp_path, capsys):
    flags = ["--optimizer.init_args.lr", "1e30", "--train.num_epochs", "2", "--default_callbacks", "true"]
    with pytest.raises(NonFiniteLossError):
        main(["fit", "--config", str(config_file), "--output_dir", str(tmp_path), "--run_name", "nan", *flags])
    assert not (tmp_path / "nan" / "model.safetensors").exists()
    assert (tmp_path / "nan" / "history.csv").exists()
    assert "model.safetensors was not written: the model's weights are NaN or infinite" in capsys.readouterr().out


def test_an_error_of_the_users_own_code_keeps_its_traceback(config_file):
    with pytest.raises(ValueError, match="a bug in the user's data function"):
        console_main(["fit", "--config", str(config_file), "--data.train", "config_data.tiny.broken"])
