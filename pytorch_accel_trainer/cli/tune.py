"""Hyperparameter search on Optuna: ``pytorch-accel-trainer tune --config run.yaml --search space.yaml --n_trials 20``.

The search space names config keys, as flags name them (``optimizer.init_args.lr: {low: 1.0e-5, high: 0.1, log:
true}``, ``train.per_device_batch_size: {choices: [16, 32]}``, ints when ``low`` and ``high`` are ints). Each trial
is a ``fit`` of the config with the trial's values, in a run folder of its own (``<output_dir>/trials/trial-0003``,
holding its complete ``config.yaml``); the evaluation metric of each epoch is reported to Optuna, so that its pruner
stops bad trials early (as optuna-integration's pruning callbacks do), and the metric's last value is the trial's
value. The study is an embedded SQLite file (``<output_dir>/study.db``) by default, so a killed search resumes where
it stopped when the same command runs again; a storage URL (a database, or an Optuna journal file) lets several
processes or machines work on one study, Optuna's documented distributed mode. A trial may itself run on several
processes (``accelerate launch -m pytorch_accel_trainer tune ...``): the main process talks to Optuna and tells the
others the trial's values. At the end, ``<output_dir>/best_config.yaml`` is the best trial's complete config, ready to
rerun with ``pytorch-accel-trainer fit --config``. Optuna is an optional dependency:
``pip install "pytorch-accel-trainer[optuna]"``.
"""

from __future__ import annotations

import json
import math
import shutil
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional, Union, cast

import yaml
from accelerate.utils import broadcast_object_list

from pytorch_accel_trainer.callbacks.base import TrainerCallback
from pytorch_accel_trainer.cli.config import ConfigError, TrainingConfig, run_training_config
from pytorch_accel_trainer.cli.parsing import parse_command
from pytorch_accel_trainer.cli.run_folder import CONFIG_FILE, RunFolderCallback
from pytorch_accel_trainer.errors import StopTrainingError
from pytorch_accel_trainer.utils import _process_state, launched_world_size

if TYPE_CHECKING:
    import optuna

    from pytorch_accel_trainer.trainer import Trainer

#: The files of a search's folder: the config every trial starts from, the default study, the best trial's config.
BASE_CONFIG_FILE, STUDY_FILE, BEST_CONFIG_FILE, TRIALS_FOLDER = (
    "base_config.yaml",
    "study.db",
    "best_config.yaml",
    "trials",
)
_RANGE_KEYS = {"low", "high", "log", "step", "type"}


def _import_optuna() -> Any:
    try:
        import optuna
    except ImportError as error:
        raise ImportError(
            'tune needs Optuna, which is not installed: pip install "pytorch-accel-trainer[optuna]"'
        ) from error
    return optuna


# ------------------------------------------------------------------------------------------------
# The search space
# ------------------------------------------------------------------------------------------------


def load_search_space(space: Union[str, Path, Mapping]) -> dict:
    """The search space of a YAML file (or a dict), checked: ``{config key: {low, high[, log, step, type]} or
    {choices: [...]}}``.

    Raises:
        ConfigError: a key's range or choices cannot be searched; the message names the key and the fix.
    """
    if not isinstance(space, Mapping):
        path = Path(space)
        if not path.is_file():
            raise ConfigError(f"--search {str(space)!r} is not a file: give a YAML file of the search space.")
        space = yaml.safe_load(path.read_text()) or {}
    if not isinstance(space, Mapping) or not space:
        raise ConfigError(
            f"The search space {space!r} is empty or not a mapping: give one entry per config key, e.g. "
            "'optimizer.init_args.lr: {low: 1.0e-5, high: 0.1, log: true}'."
        )
    return {str(key): _checked_range(str(key), value) for key, value in space.items()}


def _number(key: str, name: str, value: Any) -> Union[int, float]:
    if isinstance(value, str):  # YAML 1.1 reads 1e-5 (no dot) as a string
        try:
            value = float(value)
        except ValueError:
            pass
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ConfigError(f"search space {key}: {name}={value!r} is not a number; give e.g. {name}: 0.001.")
    return value


def _checked_range(key: str, value: Any) -> dict:
    if not isinstance(value, Mapping):
        raise ConfigError(
            f"search space {key}: {value!r} is not a range or a list of choices; give {{low: ..., high: ...}} "
            "(with log: true for a log scale, step: for a grid) or {choices: [...]}."
        )
    if "choices" in value:
        if set(value) != {"choices"} or not isinstance(value["choices"], list) or not value["choices"]:
            raise ConfigError(
                f"search space {key}: {dict(value)!r}: give choices alone, as a non-empty list, e.g. "
                "{choices: [16, 32]}."
            )
        return {"choices": list(value["choices"])}
    unknown = set(value) - _RANGE_KEYS
    if unknown or "low" not in value or "high" not in value:
        raise ConfigError(
            f"search space {key}: {dict(value)!r} needs low and high (and may have log, step, type), or choices; "
            f"{'unknown: ' + str(sorted(unknown)) if unknown else 'low or high is missing'}."
        )
    low, high = _number(key, "low", value["low"]), _number(key, "high", value["high"])
    kind = value.get("type", "int" if isinstance(low, int) and isinstance(high, int) else "float")
    if kind not in ("int", "float"):
        raise ConfigError(f"search space {key}: type={kind!r} is not valid: choose int or float.")
    log = bool(value.get("log", False))
    if not low < high or (log and low <= 0):
        raise ConfigError(
            f"search space {key}: low={low!r}, high={high!r} is not a range{' on a log scale' if log else ''}: give "
            f"low < high{' and low > 0' if log else ''}."
        )
    step = value.get("step")
    checked = {"type": kind, "low": low, "high": high, "log": log}
    if step is not None:
        checked["step"] = _number(key, "step", step)
    return checked


def suggest_values(trial: optuna.Trial, space: dict) -> dict:
    """The trial's value of each key of ``space`` (``trial.suggest_*``)."""
    values = {}
    for key, spec in space.items():
        if "choices" in spec:
            values[key] = trial.suggest_categorical(key, spec["choices"])
        elif spec["type"] == "int":
            values[key] = trial.suggest_int(
                key, int(spec["low"]), int(spec["high"]), step=int(spec.get("step", 1)), log=spec["log"]
            )
        else:
            values[key] = trial.suggest_float(key, spec["low"], spec["high"], step=spec.get("step"), log=spec["log"])
    return values


def value_flags(values: Mapping) -> list:
    """``--key value`` for each config key, as the command line takes them (values written as YAML reads them)."""
    flags = []
    for key, value in values.items():
        flags += [f"--{key}", value if isinstance(value, str) else json.dumps(value)]
    return flags


# ------------------------------------------------------------------------------------------------
# Pruning: the metric of each epoch, reported
# ------------------------------------------------------------------------------------------------


class OptunaPruningCallback(TrainerCallback):
    """Reports ``metric`` to the Optuna trial after each epoch and stops the run when the pruner says so.

    On several processes, only the main one holds the trial (``trial=None`` on the others): it reports, asks the
    pruner and tells every process the decision (one small collective per epoch), so that all stop together.

    Args:
        trial: the trial of this run (``None`` on the processes that are not the main one).
        metric: the run-history metric reported, e.g. ``eval_loss_epoch``.

    Attributes:
        pruned_at: the epoch at which the run was pruned (``None`` while it was not).
        last_value: the metric's value at the last epoch.
    """

    def __init__(self, trial: Optional[optuna.Trial], metric: str):
        self.trial, self.metric = trial, metric
        self.pruned_at: Optional[int] = None
        self.last_value: Optional[float] = None

    def on_training_run_epoch_end(self, trainer: Trainer, **kwargs):
        history = trainer.run_history
        if self.metric not in history.get_metric_names():
            raise ConfigError(
                f"--metric {self.metric!r} is not recorded by this run; it records "
                f"{sorted(history.get_metric_names())}. Give one of them (an eval metric needs data.eval)."
            )
        epoch, self.last_value = history.current_epoch, float(history.get_latest_metric(self.metric))
        decision: list[Any] = [None]
        if self.trial is not None:
            self.trial.report(self.last_value, step=epoch)
            decision = [self.trial.should_prune()]
        if trainer.accelerator.num_processes > 1:
            broadcast_object_list(decision)  # the main process's pruner decides for every process
        if decision[0]:
            self.pruned_at = epoch
            raise StopTrainingError(
                f"Optuna pruned this trial after epoch {epoch} ({self.metric}={self.last_value:.4g})"
            )


# ------------------------------------------------------------------------------------------------
# The search
# ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TuneResult:
    """What :func:`tune` found.

    Attributes:
        study: the Optuna study (all its trials, of every process that worked on it).
        best_value: the best trial's value; ``best_params``: its values, by config key.
        best_config: the best trial's complete ``config.yaml``, copied to the search's folder (``None`` on the
            processes that are not the main one, and while no trial has completed).
    """

    study: Any
    best_value: Optional[float]
    best_params: dict
    best_config: Optional[Path]


def create_storage(storage: Optional[str], output_dir: Path) -> Any:
    """The study's storage: ``<output_dir>/study.db`` (SQLite) by default; a database URL as it is (``sqlite:///``,
    ``postgresql://``, ...); a path ending in ``.log`` or ``.jsonl``, or ``journal:<path>``, as an Optuna journal file
    (``JournalFileBackend``), which processes on one file system share without a database server."""
    optuna = _import_optuna()
    if storage is None:
        return f"sqlite:///{(output_dir / STUDY_FILE).resolve()}"
    if storage.startswith("journal:") or storage.endswith((".log", ".jsonl")):
        from optuna.storages.journal import JournalFileBackend, JournalStorage

        return JournalStorage(JournalFileBackend(storage.removeprefix("journal:")))
    if "://" not in storage:
        raise ConfigError(
            f"--storage {storage!r} is neither a database URL (sqlite:///study.db, postgresql://...) nor a journal "
            "file (journal:study.log, or a path ending in .log): give one of them."
        )
    return optuna.storages.RDBStorage(storage) if storage.startswith("sqlite") else storage


def create_pruner(name: str) -> Any:
    """The pruner of ``--pruner``: ``median`` (Optuna's ``MedianPruner``, its default: stop a trial whose metric at an
    epoch is worse than the median of the earlier trials' at that epoch), ``hyperband`` (``HyperbandPruner``) or
    ``none`` (``NopPruner``: every trial runs all its epochs)."""
    pruners = _import_optuna().pruners
    choices = {"median": pruners.MedianPruner, "hyperband": pruners.HyperbandPruner, "none": pruners.NopPruner}
    if name not in choices:
        raise ConfigError(f"--pruner {name!r} is not valid: choose {', '.join(choices)}.")
    return choices[name]()


def _fail_trials_left_running(study: Any) -> None:
    """Mark the trials a killed search left running as failed, and queue their values again (the default embedded
    study only: one search works on it, so a running trial at its start was killed)."""
    optuna = _import_optuna()
    for trial in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,)):
        study.tell(trial.number, state=optuna.trial.TrialState.FAIL)  # Optuna's public way to end a trial
        study.enqueue_trial(trial.params, user_attrs={"rerun_of": trial.number}, skip_if_exists=False)


def _trials_started(study: Any) -> int:
    """The trials that count towards ``n_trials``: complete, pruned, running, and failed for a metric that diverged
    (a trial a killed search left is failed too, but run again: it counts once, as its rerun)."""
    optuna = _import_optuna()
    states = (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.PRUNED, optuna.trial.TrialState.RUNNING)
    diverged = [
        trial
        for trial in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.FAIL,))
        if trial.user_attrs.get("diverged")
    ]
    return len(study.get_trials(deepcopy=False, states=states)) + len(diverged)


def _write_base_config(config: Union[str, Path, Mapping], output_dir: Path, state: Any) -> Path:
    """Write the config the trials start from to the search's folder, once (the main process, the others waiting for
    it); a resumed search must start from the same (a search is one experiment)."""
    if isinstance(config, Mapping):
        text = yaml.safe_dump(dict(config), sort_keys=False)
    else:
        text = Path(config).read_text()
    path = output_dir / BASE_CONFIG_FILE
    if state is None or state.is_main_process:
        if path.exists() and yaml.safe_load(path.read_text()) != yaml.safe_load(text):
            raise ConfigError(
                f"{path} holds another config than this search's: this folder belongs to another search. Give "
                "another --output_dir, or rerun with the config of that search to resume it."
            )
        if not path.exists():
            output_dir.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
    if state is not None:
        state.wait_for_everyone()  # the file is complete before another process reads it
    return path


def tune(
    config: Union[str, Path, Mapping],
    search_space: Union[str, Path, Mapping],
    n_trials: int,
    output_dir: Union[str, Path] = "tuning",
    metric: str = "eval_loss_epoch",
    direction: str = "minimize",
    storage: Optional[str] = None,
    study_name: str = "tune",
    sampler: Any = None,
    pruner: Any = None,
    flags: Sequence[str] = (),
) -> TuneResult:
    """Search the config keys of ``search_space`` with Optuna until the study has ``n_trials`` trials (completed,
    pruned, running, or failed for a metric that is not finite: several processes sharing a study reach ``n_trials``
    together); see this module's documentation.

    Args:
        config: the run's config: a YAML file of ``pytorch-accel-trainer fit``, or its content as a dict.
        search_space: a YAML file, or a dict, of ``{config key: {low: ..., high: ...[, log: true][, step: ...]}}`` or
            ``{config key: {choices: [...]}}``.
        n_trials: the trials the study must have.
        output_dir: the search's folder: ``base_config.yaml``, ``study.db``, ``trials/trial-NNNN/`` (a run folder per
            trial) and ``best_config.yaml``.
        metric: the run-history metric each epoch reports and whose last value is the trial's value.
        direction: ``"minimize"`` or ``"maximize"`` the metric.
        storage: where the study lives (see :func:`create_storage`); ``<output_dir>/study.db`` by default.
        study_name: the study's name in the storage; a study of that name is resumed.
        sampler: an Optuna sampler (TPE by default).
        pruner: an Optuna pruner (``MedianPruner()`` by default; ``optuna.pruners.NopPruner()`` prunes nothing).
        flags: more command-line flags for every trial (``["--train.num_epochs", "5"]``).

    Returns:
        A :class:`TuneResult`.

    Example::

        result = tune("run.yaml", {"optimizer.init_args.lr": {"low": 1e-4, "high": 1e-1, "log": True}}, n_trials=20)
        print(result.best_params, result.best_config)  # rerun: pytorch-accel-trainer fit --config <best_config>
    """
    optuna = _import_optuna()
    space = load_search_space(search_space)
    if isinstance(n_trials, bool) or not isinstance(n_trials, int) or n_trials < 1:
        raise ConfigError(f"--n_trials {n_trials!r} is not valid: give a positive number of trials, e.g. 20.")
    if direction not in ("minimize", "maximize"):
        raise ConfigError(f"--direction {direction!r} is not valid: choose minimize or maximize.")
    output_dir = Path(output_dir)
    state = _process_state() if launched_world_size() > 1 else None  # a trial on several processes: one job
    is_main = state is None or state.is_main_process
    base_config = _write_base_config(config, output_dir, state)
    _validate_flags(base_config, space, flags, metric)  # every key and value parses, before any trial runs
    study = None
    if is_main:
        study = optuna.create_study(
            storage=create_storage(storage, output_dir),
            study_name=study_name,
            direction=direction,
            sampler=sampler,
            pruner=pruner,
            load_if_exists=True,
        )
        if storage is None:
            _fail_trials_left_running(study)
    while True:
        trial, values = None, {}
        if study is not None and _trials_started(study) < n_trials:
            trial = study.ask()
            values = suggest_values(trial, space)
        shared = [None if trial is None else (trial.number, values)]
        if state is not None and state.num_processes > 1:
            broadcast_object_list(shared)
        if shared[0] is None:
            break  # the study has its trials
        number, values = shared[0]
        _run_trial(study, trial, number, values, base_config, output_dir, metric, flags)
    return _finish(study, output_dir)


def _validate_flags(base_config: Path, space: dict, flags: Sequence[str], metric: str) -> None:
    """Parse the command of a trial with the first value of each range (none runs), so that a key or value the
    config does not take is one error now, not a failed trial later."""
    first = {key: spec["choices"][0] if "choices" in spec else spec["low"] for key, spec in space.items()}
    parsed = parse_command(["fit", "--config", str(base_config), *flags, *value_flags(first)], instantiate=False)
    if metric.startswith("eval") and parsed.namespace.data.eval is None:
        raise ConfigError(
            f"--metric {metric!r} is an evaluation metric, but the config has no data.eval, so no trial would record "
            "it: set data.eval, or give a training metric (--metric train_loss_epoch)."
        )


def _run_trial(
    study: Any,
    trial: Any,
    number: int,
    values: dict,
    base_config: Path,
    output_dir: Path,
    metric: str,
    flags: Sequence[str],
) -> None:
    """Run one trial on every process and, on the main one, tell the study how it ended."""
    optuna = _import_optuna()
    argv = [
        "fit",
        "--config",
        str(base_config),
        *flags,
        *value_flags(values),
        "--output_dir",
        str(output_dir / TRIALS_FOLDER),
        "--run_name",
        f"trial-{number:04d}",
    ]
    pruning = OptunaPruningCallback(trial, metric)
    try:
        parsed = parse_command(argv)
        config = cast(TrainingConfig, parsed.config)
        trainer, _ = run_training_config(
            config, parsed.command, parsed.config_text, parsed.hyperparameters, extra_callbacks=[pruning]
        )
    except BaseException:
        if study is not None:
            study.tell(trial, state=optuna.trial.TrialState.FAIL)
        raise
    if study is None:
        return
    folder = next(callback.folder for callback in trainer.callback_handler if isinstance(callback, RunFolderCallback))
    folder = cast(Path, folder)  # chosen when the trainer was created
    trial.set_user_attr("run_folder", str(folder))
    if pruning.pruned_at is not None:
        study.tell(trial, state=optuna.trial.TrialState.PRUNED)
        outcome = f"pruned after epoch {pruning.pruned_at}"
    elif pruning.last_value is None or not math.isfinite(pruning.last_value):
        trial.set_user_attr("diverged", True)  # failed, and counted in n_trials: a space that always diverges ends
        study.tell(trial, state=optuna.trial.TrialState.FAIL)
        outcome = f"failed: {metric} {pruning.last_value}"
    else:
        study.tell(trial, pruning.last_value)
        outcome = f"{metric} {pruning.last_value:.4g}"
    print(f"{folder.name} · {outcome} · {json.dumps(values)}", flush=True)


def _finish(study: Any, output_dir: Path) -> TuneResult:
    """Copy the best trial's config to the search's folder (main process) and return the result."""
    optuna = _import_optuna()
    if study is None:
        return TuneResult(study=None, best_value=None, best_params={}, best_config=None)
    completed = study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,))
    if not completed:
        return TuneResult(study=study, best_value=None, best_params={}, best_config=None)
    best = study.best_trial
    best_config = output_dir / BEST_CONFIG_FILE
    shutil.copyfile(Path(best.user_attrs["run_folder"]) / CONFIG_FILE, best_config)
    print(
        f"best: trial {best.number} · {best.value:.4g} · {json.dumps(best.params)} · rerun: {best_config}", flush=True
    )
    return TuneResult(study=study, best_value=best.value, best_params=dict(best.params), best_config=best_config)
