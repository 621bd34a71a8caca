"""Hyperparameter search on Optuna: trials as run folders, pruning, a killed search resumed, a shared study, the best
config rerun."""

from __future__ import annotations

import json
import os
import pathlib
import re
import subprocess
import sys

import pytest
import yaml

optuna = pytest.importorskip("optuna")

from config_data.tiny import TINY_CONFIG  # noqa: E402
from conftest import CPU_PROCESSES_ENV, launcher  # noqa: E402

from pytorch_accel_trainer.cli import main  # noqa: E402
from pytorch_accel_trainer.cli.commands import console_main  # noqa: E402
from pytorch_accel_trainer.cli.config import ConfigError  # noqa: E402
from pytorch_accel_trainer.cli.tune import MetricNotRecordedError, TuneResult, load_search_space, tune  # noqa: E402

TESTS = pathlib.Path(__file__).parent

CONFIG = TINY_CONFIG
SPACE = {"optimizer.init_args.lr": {"low": 1e-3, "high": 0.3, "log": True}}
ONE_EPOCH = ["--train.num_epochs", "1"]  # a trial of a test that needs one, not its values


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
    assert isinstance(result, TuneResult)  # what main() returns for tune, as docs/config.md says
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
    command = [*launcher(1), "-m", "pytorch_accel_trainer", "tune", "--config", str(config), "--search", str(space)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(
        [*command, "--n_trials", str(n_trials), *options], cwd=TESTS, env=env, stdout=subprocess.PIPE, text=True
    )


@pytest.mark.slow
@pytest.mark.distributed
def test_a_trial_on_two_processes_and_a_refusal_that_ends_both(tmp_path):
    """Under ``accelerate launch`` each trial is one job of two processes; a search the main process refuses (another
    direction for the study) ends both processes at once, each naming the refusal: the main process with its error,
    the other with a ``RuntimeError`` that quotes it (as the process decorators of ``utils`` do)."""
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump({**CONFIG, "output_dir": str(tmp_path / "search")}))
    (tmp_path / "space.yaml").write_text(yaml.safe_dump(SPACE))
    command = [*launcher(2), "-m", "pytorch_accel_trainer", "tune", "--config", str(config)]
    command += ["--search", str(tmp_path / "space.yaml"), "--n_trials", "2", "--pruner", "none"]
    completed = subprocess.run(command, cwd=TESTS, env=CPU_PROCESSES_ENV, capture_output=True, text=True, timeout=240)
    assert completed.returncode == 0, completed.stderr[-3000:]
    trials = _study(tmp_path / "search").trials
    assert [trial.state for trial in trials] == [optuna.trial.TrialState.COMPLETE] * 2
    for trial in trials:
        run_config = json.loads(
            (tmp_path / "search" / "trials" / f"trial-{trial.number:04d}" / "run_config.json").read_text()
        )
        assert run_config["num_processes"] == 2
    refused = subprocess.run(
        [*command, "--direction", "maximize"],
        cwd=TESTS,
        env=CPU_PROCESSES_ENV,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert refused.returncode != 0
    assert refused.stderr.count("--direction maximize does not match the study 'tune'") == 2, refused.stderr[-3000:]
    assert "_open_search raised on the main process (ConfigError: --direction maximize" in refused.stderr
    assert len(_study(tmp_path / "search").trials) == 2


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
        ({"optimizer.init_args.lr": {"low": 1e-3, "high": 0.3, "log": "false"}}, "log='false' is not true or false"),
        ({"optimizer.init_args.lr": {"low": 0.001, "high": 0.3, "type": "int"}}, "Give whole bounds"),
        ({"optimizer.init_args.lr": {"low": 1e-3, "high": 0.3, "log": True, "step": 0.01}}, "cannot be combined"),
        ({"train.num_epochs": {"low": 1, "high": 5, "step": 0}}, "step=0 is not valid: give a positive whole"),
        ({"train.num_epochs": {"low": 1, "high": 5, "step": 1.5}}, "step=1.5 is not valid"),
        ({"optimizer.init_args.lr": {"low": 0.1, "high": 0.5, "step": -0.1}}, "step=-0.1 is not valid"),
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
    assert not (tmp_path / "no_eval").exists()  # nothing written: the corrected search starts afresh
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


def test_corrected_search_runs_after_a_refusal(in_tests, tmp_path):
    """Following a refusal's advice (add data.eval) runs the search: the refused one wrote nothing."""
    without_eval = {**CONFIG, "data": {"train": "config_data.tiny.train_dataset"}}
    with pytest.raises(ConfigError, match="set data.eval"):
        tune(without_eval, SPACE, n_trials=1, output_dir=tmp_path / "search", flags=ONE_EPOCH)
    result = tune(CONFIG, SPACE, n_trials=1, output_dir=tmp_path / "search", flags=ONE_EPOCH)
    assert [trial.state for trial in result.study.trials] == [optuna.trial.TrialState.COMPLETE]


@pytest.mark.parametrize(
    ("space", "message"),
    [
        ({"optimizer.init_args.lr": {"low": 1, "high": 10, "type": "int"}}, r"config value is a float \(0.05\)"),
        ({"optimizer.init_args.lr": {"low": 1, "high": 10}}, r"Give float bounds \(low: 1.0, high: 10.0\)"),
        ({"optimizer.init_args.weight_decay": {"low": 0, "high": 1}}, "config value is a float"),
        ({"train.num_epochs": {"low": 0, "high": 3}}, "train.num_epochs: 0 would be refused by Trainer.train()"),
        ({"train.num_epochs": {"choices": [2, 0]}}, "train.num_epochs: 0 would be refused"),
        ({"train.per_device_batch_size": {"low": 0, "high": 8}}, "train.per_device_batch_size: 0 would be refused"),
        ({"train.gradient_clip_norm": {"low": 0.0, "high": 1.0}}, "train.gradient_clip_norm: 0.0 would be refused"),
        ({"train.per_device_batch_size": {"low": 4.0, "high": 16.0}}, "train.per_device_batch_size"),
    ],
)
def test_search_values_the_trials_cannot_take_refused_before_any_trial(in_tests, tmp_path, space, message):
    """Each bound and choice is checked against the config (its value's type, what train() takes) before anything
    is written: an int range on a float key would train with whole learning rates, num_epochs 0 fails its trials."""
    with pytest.raises(ConfigError, match=message):
        tune(CONFIG, space, n_trials=1, output_dir=tmp_path / "search", pruner=optuna.pruners.NopPruner())
    assert not (tmp_path / "search").exists()


def test_metric_not_recorded_leaves_nothing_behind(in_tests, tmp_path):
    """A metric no run records stops the search at the first epoch, naming the recorded ones, and leaves nothing: the
    same command with the right metric starts afresh."""
    search = tmp_path / "search"
    with pytest.raises(MetricNotRecordedError, match=r"did you mean 'eval_loss_epoch'\?.*Nothing of this search"):
        tune(CONFIG, SPACE, n_trials=2, output_dir=search, metric="eval_los_epoch", flags=ONE_EPOCH)
    assert not search.exists()
    result = tune(CONFIG, SPACE, n_trials=1, output_dir=search, flags=ONE_EPOCH)
    (trial,) = result.study.trials
    assert trial.state == optuna.trial.TrialState.COMPLETE and trial.number == 0
    assert sorted(path.name for path in (search / "trials").iterdir()) == ["trial-0000"]


def test_rerun_with_another_direction_refused(in_tests, tmp_path):
    """Optuna keeps a study's direction: a rerun that asks for the other one is refused, naming the fix."""
    tune(CONFIG, SPACE, n_trials=1, output_dir=tmp_path, flags=ONE_EPOCH)
    with pytest.raises(ConfigError, match="--direction maximize does not match the study 'tune'.*--direction minimize"):
        tune(CONFIG, SPACE, n_trials=2, output_dir=tmp_path, direction="maximize", flags=ONE_EPOCH)
    assert len(_study(tmp_path).trials) == 1


def test_another_search_on_a_shared_storage_refused(in_tests, tmp_path):
    """A study belongs to one search: another config, search space or metric on its storage and name is refused
    before any trial (it would run no trial and copy the other search's best config); its own --study_name runs."""
    storage = f"journal:{tmp_path / 'study.log'}"
    tune(CONFIG, SPACE, n_trials=1, output_dir=tmp_path / "a", storage=storage, flags=ONE_EPOCH)
    other = {**CONFIG, "train": {"num_epochs": 3, "per_device_batch_size": 8}}
    others = [
        (other, SPACE, "eval_loss_epoch", r"config.train.per_device_batch_size: 8 here, 16 in the study"),
        (
            CONFIG,
            {"optimizer.init_args.lr": {"low": 1e-3, "high": 0.1, "log": True}},
            "eval_loss_epoch",
            "search_space",
        ),
        (CONFIG, SPACE, "train_loss_epoch", "metric: 'train_loss_epoch' here, 'eval_loss_epoch' in the study"),
    ]
    for config, space, metric, difference in others:
        with pytest.raises(ConfigError, match=f"belongs to another search.*{difference}.*its own --study_name"):
            tune(config, space, n_trials=1, output_dir=tmp_path / "b", storage=storage, metric=metric, flags=ONE_EPOCH)
        assert not (tmp_path / "b").exists()
    result = tune(other, SPACE, n_trials=1, output_dir=tmp_path / "b", storage=storage, study_name="b", flags=ONE_EPOCH)
    assert result.best_config == tmp_path / "b" / "best_config.yaml"
    assert yaml.safe_load(result.best_config.read_text())["train"]["per_device_batch_size"] == 8


@pytest.mark.parametrize(
    ("storage", "message"),
    [
        ("sqlite:///{tmp}/a_file/study.db", "the database cannot be opened .*unable to open database file"),
        ("foo://study", "is not a database URL that SQLAlchemy can read"),
        ("postgresql://user@host:no_port/study", "is not a database URL that SQLAlchemy can read"),
        ("mysql://localhost/study", "the database driver is not installed .*cannot import 'MySQLdb'"),
        ("journal:{tmp}/a_file/study.log", "the journal file cannot be opened"),
    ],
)
def test_storage_that_cannot_be_opened_is_one_error(in_tests, tmp_path, storage, message):
    """An unwritable, malformed or driverless --storage is one error naming the flag, the URL, the problem and the
    fix, before anything is written."""
    (tmp_path / "a_file").write_text("")  # a file where a folder is needed
    storage = storage.format(tmp=tmp_path)
    with pytest.raises(ConfigError, match=f"--storage {re.escape(repr(storage))}.*{message}"):
        tune(CONFIG, SPACE, n_trials=1, output_dir=tmp_path / "search", storage=storage)
    assert not (tmp_path / "search").exists()


def test_storage_error_on_the_command_line(in_tests, tmp_path, capsys):
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(CONFIG))
    (tmp_path / "space.yaml").write_text(yaml.safe_dump(SPACE))
    files = ["--config", str(tmp_path / "run.yaml"), "--search", str(tmp_path / "space.yaml")]
    assert console_main(["tune", *files, "--n_trials", "1", "--storage", "foo://study"]) == 2
    assert "error: --storage 'foo://study' is not a database URL" in capsys.readouterr().err


class FailingOnceSampler(optuna.samplers.RandomSampler):
    """A sampler whose first draw fails: an Optuna call that fails after its trial was asked for."""

    failed = False

    def sample_independent(self, study, trial, param_name, param_distribution):
        if not self.failed:
            self.failed = True
            raise RuntimeError("the sampler's own bug")
        return super().sample_independent(study, trial, param_name, param_distribution)


def test_failed_optuna_call_fails_its_trial_which_does_not_count(in_tests, tmp_path):
    """A trial whose values could not be drawn is failed, not left running (in a shared storage, for ever counted in
    n_trials); only finished trials count, so the rerun runs its trial."""
    options = {
        "n_trials": 1,
        "output_dir": tmp_path,
        "storage": f"journal:{tmp_path / 'study.log'}",
        "flags": ONE_EPOCH,
    }
    with pytest.raises(RuntimeError, match="the sampler's own bug"):
        tune(CONFIG, SPACE, sampler=FailingOnceSampler(seed=0), **options)
    result = tune(CONFIG, SPACE, **options)
    states = [trial.state for trial in result.study.trials]
    assert states == [optuna.trial.TrialState.FAIL, optuna.trial.TrialState.COMPLETE]


def test_tune_from_python_resolves_import_paths_from_the_current_folder(tmp_path, monkeypatch):
    """As on the command line (and as docs/config.md says), tune() called from a script imports the config's
    paths from the current folder."""
    (tmp_path / "tune_script_data.py").write_text((TESTS / "config_data" / "tiny.py").read_text())  # a user's module
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [path for path in sys.path if path not in ("", ".", str(tmp_path))])
    data = {"train": "tune_script_data.train_dataset", "eval": "tune_script_data.eval_dataset"}
    result = tune({**CONFIG, "data": data}, SPACE, n_trials=1, output_dir="search", flags=ONE_EPOCH)
    assert [trial.state for trial in result.study.trials] == [optuna.trial.TrialState.COMPLETE]


def test_docs_name_the_error_and_the_result_of_tune():
    """docs/config.md says which exception a tune refusal is and what main([... 'tune' ...]) returns."""
    text = (TESTS.parent / "docs" / "config.md").read_text()
    section = text.split("## Hyperparameter search: `tune`")[1].split("\n## ")[0]
    assert "`ConfigError`" in section and "`MetricNotRecordedError`" in section
    assert "returns the `TuneResult`" in section
