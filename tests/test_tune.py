"""Hyperparameter search on Optuna: trials as run folders, pruning, a killed search resumed, a shared study, the best
config rerun."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest
import yaml

optuna = pytest.importorskip("optuna")

from config_data.tiny import TINY_CONFIG  # noqa: E402

from pytorch_accel_trainer.cli import main  # noqa: E402
from pytorch_accel_trainer.cli.config import ConfigError  # noqa: E402
from pytorch_accel_trainer.cli.tune import load_search_space, tune  # noqa: E402

TESTS = pathlib.Path(__file__).parent

CONFIG = TINY_CONFIG
SPACE = {"optimizer.init_args.lr": {"low": 1e-3, "high": 0.3, "log": True}}


@pytest.fixture
def in_tests(monkeypatch):
    monkeypatch.chdir(TESTS)  # config_data.tiny imports from here, as with `python -m`


def _study(folder: pathlib.Path):
    return optuna.load_study(study_name="tune", storage=f"sqlite:///{folder / 'study.db'}")


@pytest.mark.slow
def test_tune_command_and_best_config_rerun(in_tests, tmp_path):
    """The tune command runs each trial in a run folder, and the best config reruns to its value."""
    (tmp_path / "run.yaml").write_text(yaml.safe_dump({**CONFIG, "output_dir": str(tmp_path / "search")}))
    (tmp_path / "space.yaml").write_text(
        "optimizer.init_args.lr: {low: 1e-3, high: 0.3, log: true}\ntrain.per_device_batch_size: {choices: [8, 16]}\n"
    )
    command = ["tune", "--config", str(tmp_path / "run.yaml"), "--search", str(tmp_path / "space.yaml")]
    result = main([*command, "--n_trials", "2", "--pruner", "none"])
    search = tmp_path / "search"
    trials = sorted(path.name for path in (search / "trials").iterdir())
    assert trials == ["trial-0000", "trial-0001"]
    for trial in result.study.trials:
        config = yaml.safe_load((search / "trials" / f"trial-{trial.number:04d}" / "config.yaml").read_text())
        assert config["optimizer"]["init_args"]["lr"] == trial.params["optimizer.init_args.lr"]  # the trial's values
        assert config["train"]["per_device_batch_size"] == trial.params["train.per_device_batch_size"]
    assert result.best_value == min(trial.value for trial in result.study.trials)
    rerun = main(["fit", "--config", str(result.best_config)])  # the best trial's complete config, as it is
    assert rerun.metrics["eval_loss_epoch"] == pytest.approx(result.best_value, rel=1e-6)
    again = main([*command, "--n_trials", "3"])  # the same command with more trials continues the study
    assert len(again.study.trials) == 3


def test_pruned_trial_stops_after_its_epoch(in_tests, tmp_path):
    """A pruned trial stops after the epoch the pruner stops."""
    pruner = optuna.pruners.ThresholdPruner(upper=0.0)  # every reported loss is above 0: pruned at the first report
    result = tune(CONFIG, SPACE, n_trials=1, output_dir=tmp_path, pruner=pruner)
    (trial,) = result.study.trials
    assert trial.state == optuna.trial.TrialState.PRUNED and list(trial.intermediate_values) == [1]
    history = (tmp_path / "trials" / "trial-0000" / "history.csv").read_text().splitlines()
    assert len(history) == 2  # a header and epoch 1 of 3
    assert result.best_config is None and result.best_value is None


def _tune_process(config: pathlib.Path, space: pathlib.Path, n_trials: int, *options: str) -> subprocess.Popen:
    command = [sys.executable, "-m", "pytorch_accel_trainer", "tune", "--config", str(config), "--search", str(space)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(
        [*command, "--n_trials", str(n_trials), *options], cwd=TESTS, env=env, stdout=subprocess.PIPE, text=True
    )


@pytest.mark.slow
def test_a_killed_search_resumes_where_it_stopped(in_tests, tmp_path):
    callback = {"class_path": "config_data.tiny.ExitOnceCallback", "init_args": {"marker": str(tmp_path / "killed")}}
    config = {**CONFIG, "callbacks": [callback], "output_dir": str(tmp_path / "search")}
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(config))
    (tmp_path / "space.yaml").write_text(yaml.safe_dump(SPACE))
    killed = _tune_process(tmp_path / "run.yaml", tmp_path / "space.yaml", 2)
    assert killed.wait(timeout=120) == 3  # killed in the first epoch of its first trial
    (left,) = _study(tmp_path / "search").trials
    assert left.state == optuna.trial.TrialState.RUNNING
    main(["tune", "--config", str(tmp_path / "run.yaml"), "--search", str(tmp_path / "space.yaml"), "--n_trials", "2"])
    states = [trial.state for trial in _study(tmp_path / "search").trials]
    assert states == [optuna.trial.TrialState.FAIL, *[optuna.trial.TrialState.COMPLETE] * 2]
    rerun = _study(tmp_path / "search").trials[1]
    assert rerun.params == left.params and rerun.user_attrs["rerun_of"] == 0  # the killed trial, run again


@pytest.mark.slow
def test_shared_study_has_no_duplicate_trial(tmp_path):
    """Two processes sharing one study complete its trials without a duplicate."""
    (tmp_path / "space.yaml").write_text(yaml.safe_dump(SPACE))
    workers = []
    for worker in ("a", "b"):
        config = tmp_path / f"{worker}.yaml"
        config.write_text(yaml.safe_dump({**CONFIG, "output_dir": str(tmp_path / worker)}))
        workers.append(_tune_process(config, tmp_path / "space.yaml", 4, "--storage", f"journal:{tmp_path}/study.log"))
    outputs = [worker.communicate(timeout=180)[0] for worker in workers]
    assert [worker.returncode for worker in workers] == [0, 0]
    storage = optuna.storages.journal.JournalStorage(
        optuna.storages.journal.JournalFileBackend(str(tmp_path / "study.log"))
    )
    trials = optuna.load_study(study_name="tune", storage=storage).trials
    complete = [trial for trial in trials if trial.state == optuna.trial.TrialState.COMPLETE]
    assert 4 <= len(complete) == len(trials) <= 5  # a worker that asks as the other's last trial starts adds one
    assert len({trial.params["optimizer.init_args.lr"] for trial in trials}) == len(trials)  # no trial twice
    ran = [sorted(path.name for path in (tmp_path / worker / "trials").iterdir()) for worker in ("a", "b")]
    assert all(ran) and not set(ran[0]) & set(ran[1])  # both worked, on trials of their own
    assert all("best: trial" in output for output in outputs)


@pytest.mark.parametrize(
    ("space", "message"),
    [
        ({"optimizer.init_args.lr": {"low": 0.1, "high": 0.01}}, "is not a range"),
        ({"optimizer.init_args.lr": {"low": 0, "high": 1, "log": True}}, "low > 0"),
        ({"optimizer.init_args.lr": {"low": 0.1}}, "low or high is missing"),
        ({"optimizer.init_args.lr": {"low": 0.1, "high": 1, "scale": 2}}, r"unknown: \['scale'\]"),
        ({"train.per_device_batch_size": {"choices": []}}, "non-empty list"),
        ({"train.per_device_batch_size": 8}, "is not a range or a list of choices"),
        ({}, "empty"),
    ],
)
def test_bad_search_space_names_the_key(space, message):
    with pytest.raises(ConfigError, match=message):
        load_search_space(space)


def test_unknown_key_refused_before_any_trial(in_tests, tmp_path):
    """A key the config does not have is refused before any trial."""
    with pytest.raises(ConfigError, match="optimizer.init_args.learning_rate|learning_rate"):
        tune(CONFIG, {"optimizer.init_args.learning_rate": {"low": 0.1, "high": 1.0}}, n_trials=1, output_dir=tmp_path)
    assert not (tmp_path / "trials").exists() and not (tmp_path / "study.db").exists()
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "base_config.yaml").write_text(yaml.safe_dump({**CONFIG, "default_callbacks": True}))
    with pytest.raises(ConfigError, match="belongs to another search"):  # nothing of that search is touched
        tune(CONFIG, SPACE, n_trials=1, output_dir=tmp_path / "other")
    without_eval = {**CONFIG, "data": {"train": "config_data.tiny.train_dataset"}}
    with pytest.raises(ConfigError, match="no data.eval"):
        tune(without_eval, SPACE, n_trials=1, output_dir=tmp_path / "no_eval")
    assert load_search_space({"lr": {"low": "1e-5", "high": 1}})["lr"]["low"] == 1e-5  # YAML's 1e-5 is a string
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(CONFIG))
    with pytest.raises(ConfigError, match="sometimes"):
        main(
            [
                "tune",
                "--config",
                str(tmp_path / "run.yaml"),
                "--search",
                "s.yaml",
                "--n_trials",
                "1",
                "--pruner",
                "sometimes",
            ]
        )


def test_all_diverging_trials_end_after_n(in_tests, tmp_path):
    """A space where every trial diverges ends after n_trials."""
    diverging = {"optimizer.init_args.lr": {"low": 1e4, "high": 1e5, "log": True}}  # SGD at these rates overflows
    result = tune(CONFIG, diverging, n_trials=2, output_dir=tmp_path, pruner=optuna.pruners.NopPruner())
    assert [trial.state for trial in result.study.trials] == [optuna.trial.TrialState.FAIL] * 2
    assert result.best_config is None
