"""Hyperparameter search on Optuna: ``pytorch-accel-trainer tune --config run.yaml --search space.yaml --n_trials 20``.

The search space names config keys, as flags name them (``optimizer.init_args.lr: {low: 1.0e-5, high: 0.1, log:
true}``, ``train.per_device_batch_size: {choices: [16, 32]}``, ints when ``low`` and ``high`` are ints). Each trial
is a ``fit`` of the config with the trial's values, in a run folder of its own (``<output_dir>/trials/trial-0003``,
holding its complete ``config.yaml``); the evaluation metric of each epoch is reported to Optuna, so that its pruner
stops bad trials early (as optuna-integration's pruning callbacks do), and the metric's last value is the trial's
value. The study is an embedded SQLite file (``<output_dir>/study.db``) by default, so a killed search resumes where
it stopped when the same command runs again; a study keeps its direction and belongs to one search (its config,
flags, search space and metric are stored with it), and another search is refused before any trial. A storage URL
(a database, or an Optuna journal file) lets several processes or machines work on one study, Optuna's documented
distributed mode. A trial may itself run on several processes (``accelerate launch -m pytorch_accel_trainer tune
...``): the main process talks to Optuna and tells the others the trial's values. At the end,
``<output_dir>/best_config.yaml`` is the best trial's complete config, ready to rerun with ``pytorch-accel-trainer fit
--config``. Optuna is an optional dependency: ``pip install "pytorch-accel-trainer[optuna]"``.
"""

from __future__ import annotations

import difflib
import json
import math
import shutil
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional, Union, cast

import yaml
from accelerate.utils import broadcast_object_list

from pytorch_accel_trainer.callbacks.base import TrainerCallback
from pytorch_accel_trainer.cli.config import ConfigError, TrainingConfig, run_training_config
from pytorch_accel_trainer.cli.parsing import (
    describe_yaml_error,
    load_yaml,
    parse_command,
    put_current_folder_on_import_path,
)
from pytorch_accel_trainer.cli.run_folder import CONFIG_FILE, RunFolderCallback, remove_if_empty
from pytorch_accel_trainer.errors import StopTrainingError
from pytorch_accel_trainer.run_config import TrainOptions
from pytorch_accel_trainer.state.storage import local_path
from pytorch_accel_trainer.utils import _process_state, launched_world_size, world_process_zero_only

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
#: The study's user attribute that holds the search it belongs to (see :func:`_search_identity`).
_SEARCH_ATTRIBUTE = "search"


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
        path = local_path(space)  # ~ and $VARIABLES expanded
        if not path.is_file():
            raise ConfigError(f"--search {str(space)!r} is not a file: give a YAML file of the search space.")
        text = path.read_text()
        try:  # as a config file is read: never base-60, aliases bounded
            space = load_yaml(text, str(path)) or {}
        except yaml.YAMLError as error:
            raise ConfigError(f"--search: {describe_yaml_error(path, text, error)}") from None
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
    log = value.get("log", False)
    if not isinstance(log, bool):  # bool("false") is True: a quoted false would search a log scale
        raise ConfigError(
            f"search space {key}: log={log!r} is not true or false: write log: true or log: false, without quotes."
        )
    if kind == "int" and not (float(low).is_integer() and float(high).is_integer()):
        raise ConfigError(
            f"search space {key}: type: int with low={low!r}, high={high!r}: the trials would draw whole numbers "
            f"between {int(low)} and {int(high)}. Give whole bounds for an int key, or leave type: int out for a "
            "float key."
        )
    if not low < high or (log and low <= 0):
        raise ConfigError(
            f"search space {key}: low={low!r}, high={high!r} is not a range{' on a log scale' if log else ''}: give "
            f"low < high{' and low > 0' if log else ''}."
        )
    checked = {"type": kind, "low": int(low) if kind == "int" else low, "high": int(high) if kind == "int" else high}
    checked["log"] = log
    if value.get("step") is not None:
        checked["step"] = _checked_step(key, kind, log, _number(key, "step", value["step"]))
    return checked


def _checked_step(key: str, kind: str, log: bool, step: Union[int, float]) -> Union[int, float]:
    """A range's grid step: positive, whole for an int range, and not on a log scale (Optuna takes neither)."""
    if log:
        raise ConfigError(
            f"search space {key}: log: true and step: {step!r} cannot be combined (Optuna draws a log scale "
            "continuously, a grid in even steps): drop step, or drop log."
        )
    if step <= 0 or (kind == "int" and not float(step).is_integer()):
        example = "1" if kind == "int" else "0.1"
        raise ConfigError(
            f"search space {key}: step={step!r} is not valid: give a positive {'whole ' if kind == 'int' else ''}"
            f"number, e.g. step: {example}."
        )
    return int(step) if kind == "int" else step


def _candidate_values(spec: dict) -> list:
    """The values of a range or choices that a check must try: every choice, or both bounds."""
    return list(spec["choices"]) if "choices" in spec else [spec["low"], spec["high"]]


def suggest_values(trial: optuna.Trial, space: dict) -> dict:
    """The trial's value of each key of ``space`` (``trial.suggest_*``)."""
    values = {}
    for key, spec in space.items():
        if "choices" in spec:
            values[key] = trial.suggest_categorical(key, spec["choices"])
        elif spec["type"] == "int":
            values[key] = trial.suggest_int(key, spec["low"], spec["high"], step=spec.get("step", 1), log=spec["log"])
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


class MetricNotRecordedError(ConfigError):
    """``--metric`` names a metric that the trial's run does not record (found at the end of its first epoch)."""


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
        run_folder: the run's folder, once an epoch has ended.

    Raises:
        MetricNotRecordedError: at the end of an epoch that did not record ``metric``; the message lists the metrics
            it did record.
    """

    def __init__(self, trial: Optional[optuna.Trial], metric: str):
        self.trial, self.metric = trial, metric
        self.pruned_at: Optional[int] = None
        self.last_value: Optional[float] = None
        self.run_folder: Optional[Path] = None

    def on_training_run_epoch_end(self, trainer: Trainer, **kwargs):
        history = trainer.run_history
        self.run_folder = run_folder_of(trainer)
        _validate_metric_recorded(self.metric, history.get_metric_names())
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


def _validate_metric_recorded(metric: str, names: set) -> None:
    if metric in names:
        return
    close = difflib.get_close_matches(metric, sorted(names), n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    raise MetricNotRecordedError(
        f"--metric {metric!r} is not recorded by this run; it records {sorted(names)}{hint}. Give one of them (an "
        "eval metric needs data.eval)."
    )


def run_folder_of(trainer: Trainer) -> Optional[Path]:
    """The run folder of a trial's trainer (``None`` before its run has chosen one)."""
    folder = next(
        (callback.folder for callback in trainer.callback_handler if isinstance(callback, RunFolderCallback)), None
    )
    return folder if isinstance(folder, Path) else None


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


@dataclass(frozen=True)
class _Search:
    """One search, as its trials need it: where it writes, what each trial runs and reports, its study, and what this
    call created (removed again when the first trial shows that the metric is not recorded)."""

    output_dir: Path
    metric: str
    flags: tuple
    storage: Any
    study_name: str
    study_created: bool
    created: tuple

    @property
    def base_config(self) -> Path:
        return self.output_dir / BASE_CONFIG_FILE


def create_storage(storage: Optional[str], output_dir: Path) -> Any:
    """The study's storage, opened: ``<output_dir>/study.db`` (SQLite) by default; a database URL as it is
    (``sqlite:///``, ``postgresql://``, ...); a path ending in ``.log`` or ``.jsonl``, or ``journal:<path>``, as an
    Optuna journal file (``JournalFileBackend``), which processes on one file system share without a database server.

    Raises:
        ConfigError: the storage cannot be opened (not a URL, no driver, a folder that does not exist or cannot be
            written, a server that cannot be reached); the message names ``--storage``, the URL, the problem and the
            fix.
    """
    if storage is None:
        output_dir.mkdir(parents=True, exist_ok=True)
        study_file = output_dir / STUDY_FILE
        return _open_database(f"sqlite:///{study_file.resolve()}", f"The study file {str(study_file)!r}")
    if storage.startswith("journal:") or storage.endswith((".log", ".jsonl")):
        _import_optuna()
        from optuna.storages.journal import JournalFileBackend, JournalStorage

        try:
            return JournalStorage(JournalFileBackend(storage.removeprefix("journal:")))
        except OSError as error:
            raise ConfigError(
                f"--storage {storage!r}: the journal file cannot be opened ({error.strerror or error}). Create its "
                "folder, or give a journal file in a folder this process can write, e.g. --storage "
                "journal:/shared/study.log."
            ) from error
    if "://" not in storage:
        raise ConfigError(
            f"--storage {storage!r} is neither a database URL (sqlite:///study.db, postgresql://...) nor a journal "
            "file (journal:study.log, or a path ending in .log): give one of them."
        )
    return _open_database(storage, f"--storage {storage!r}")


def _open_database(url: str, name: str) -> Any:
    """Optuna's ``RDBStorage`` of ``url`` (it connects, and creates the tables of a new database)."""
    optuna = _import_optuna()
    from sqlalchemy.exc import ArgumentError, SQLAlchemyError

    try:
        return optuna.storages.RDBStorage(url)
    except ImportError as error:
        driver = getattr(error.__cause__, "name", None) or "its database driver"
        raise ConfigError(
            f"{name}: the database driver is not installed (Python cannot import {driver!r}). Install it, name an "
            "installed driver in the URL (e.g. postgresql+psycopg2://...), or use a journal file (--storage "
            "journal:study.log)."
        ) from error
    except (ArgumentError, ValueError) as error:
        raise ConfigError(
            f"{name} is not a database URL that SQLAlchemy can read ({error}). Give dialect://user:password@host:port/"
            "database, e.g. sqlite:////absolute/path/study.db or postgresql://user:password@host/study, or a journal "
            "file (--storage journal:study.log)."
        ) from error
    except SQLAlchemyError as error:
        reason = str(getattr(error, "orig", None) or error).splitlines()[0]
        raise ConfigError(
            f"{name}: the database cannot be opened ({reason}). For sqlite:///, its folder must exist and be "
            "writable; for a database server, check that it runs and that the URL's host, user, password and "
            "database are right."
        ) from error


def create_pruner(name: str) -> Any:
    """The pruner of ``--pruner``: ``median`` (Optuna's ``MedianPruner``, its default: stop a trial whose metric at an
    epoch is worse than the median of the earlier trials' at that epoch), ``hyperband`` (``HyperbandPruner``) or
    ``none`` (``NopPruner``: every trial runs all its epochs)."""
    pruners = _import_optuna().pruners
    choices = {"median": pruners.MedianPruner, "hyperband": pruners.HyperbandPruner, "none": pruners.NopPruner}
    if name not in choices:
        raise ConfigError(f"--pruner {name!r} is not valid: choose {', '.join(choices)}.")
    return choices[name]()


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
    """Search the config keys of ``search_space`` with Optuna until the study has ``n_trials`` finished trials
    (completed, pruned, or failed for a metric that is not finite; several processes sharing a study reach
    ``n_trials`` together); see this module's documentation.

    Everything is checked before anything is written or any trial runs: the search space, each of its bounds and
    choices against the config (as ``fit`` would parse them, and as ``Trainer.train()`` would take the ``train.*``
    ones), the storage, and the study (its direction, and the search it belongs to). Import paths of the config
    resolve from the current folder first, as on the command line.

    Args:
        config: the run's config: a YAML file of ``pytorch-accel-trainer fit``, or its content as a dict.
        search_space: a YAML file, or a dict, of ``{config key: {low: ..., high: ...[, log: true][, step: ...]}}`` or
            ``{config key: {choices: [...]}}``.
        n_trials: the finished trials the study must have.
        output_dir: the search's folder: ``base_config.yaml``, ``study.db``, ``trials/trial-NNNN/`` (a run folder per
            trial) and ``best_config.yaml``.
        metric: the run-history metric each epoch reports and whose last value is the trial's value.
        direction: ``"minimize"`` or ``"maximize"`` the metric; a study keeps the direction it was created with.
        storage: where the study lives (see :func:`create_storage`); ``<output_dir>/study.db`` by default.
        study_name: the study's name in the storage; a study of that name is resumed if it belongs to this search
            (the same config, flags, search space and metric).
        sampler: an Optuna sampler (TPE by default).
        pruner: an Optuna pruner (``MedianPruner()`` by default; ``optuna.pruners.NopPruner()`` prunes nothing).
        flags: more command-line flags for every trial (``["--train.num_epochs", "5"]``).

    Returns:
        A :class:`TuneResult`.

    Raises:
        ConfigError: the search cannot run as given, before any trial (the message names the option or key, the
            value and the fix); or, as :class:`MetricNotRecordedError` at the end of the first trial's first epoch,
            ``metric`` is not recorded (only a run shows what its callbacks record), and what this call had
            written is removed again.

    Example::

        result = tune("run.yaml", {"optimizer.init_args.lr": {"low": 1e-4, "high": 1e-1, "log": True}}, n_trials=20)
        print(result.best_params, result.best_config)  # rerun: pytorch-accel-trainer fit --config <best_config>
    """
    put_current_folder_on_import_path()
    _import_optuna()  # a missing Optuna is the first error
    space = load_search_space(search_space)
    _validate_search_options(n_trials, direction, metric)
    output_dir, flags = local_path(output_dir), tuple(flags)  # ~ and $VARIABLES expanded
    config_text = _config_text(config)
    _validate_folder_of_this_search(output_dir, config_text)
    base = _validated_trial_config(config, config_text, space, flags, metric)
    state = _process_state() if launched_world_size() > 1 else None  # a trial on several processes: one job
    files = (output_dir, *([output_dir / STUDY_FILE] if storage is None else []), output_dir / BASE_CONFIG_FILE)
    created = tuple(path for path in (*files, output_dir / TRIALS_FOLDER) if not path.exists())
    identity = _search_identity(base, space, metric)
    opened = _open_search(storage, output_dir, study_name, direction, sampler, pruner, identity, config_text)
    opened_storage, study, study_created = opened or (None, None, False)  # None: not the main process
    search = _Search(output_dir, metric, flags, opened_storage, study_name, study_created, created)
    while True:
        trial: Any = None
        values: dict = {}
        if study is not None and _trials_finished(study) < n_trials:
            trial, values = _ask(study, space)
        shared = [None if trial is None else (trial.number, values)]
        if state is not None and state.num_processes > 1:
            broadcast_object_list(shared)
        if shared[0] is None:
            break  # the study has its trials
        number, values = shared[0]
        _run_trial(search, study, trial, number, values)
    return _finish(study, output_dir)


def _validate_search_options(n_trials: Any, direction: Any, metric: Any) -> None:
    if isinstance(n_trials, bool) or not isinstance(n_trials, int) or n_trials < 1:
        raise ConfigError(f"--n_trials {n_trials!r} is not valid: give a positive number of trials, e.g. 20.")
    if direction not in ("minimize", "maximize"):
        raise ConfigError(f"--direction {direction!r} is not valid: choose minimize or maximize.")
    if not isinstance(metric, str) or not metric:
        raise ConfigError(
            f"--metric {metric!r} is not valid: give the name of a run-history metric, e.g. eval_loss_epoch."
        )


def _config_text(config: Union[str, Path, Mapping]) -> str:
    return (
        yaml.safe_dump(dict(config), sort_keys=False) if isinstance(config, Mapping) else local_path(config).read_text()
    )


def _validate_folder_of_this_search(output_dir: Path, config_text: str) -> None:
    """Refuse a search's folder whose ``base_config.yaml`` is another config: a resumed search must start from the
    same (a search is one experiment)."""
    path = output_dir / BASE_CONFIG_FILE
    if path.exists() and yaml.safe_load(path.read_text()) != yaml.safe_load(config_text):
        raise ConfigError(
            f"{path} holds another config than this search's: this folder belongs to another search. Give "
            "another --output_dir, or rerun with the config of that search to resume it."
        )


def _validated_trial_config(
    config: Union[str, Path, Mapping], config_text: str, space: dict, flags: tuple, metric: str
) -> dict:
    """:func:`_validate_trial_config` of the config file, or of a dict written to a file of its own for the parser."""
    if not isinstance(config, Mapping):
        return _validate_trial_config(Path(config), space, flags, metric)
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / BASE_CONFIG_FILE
        path.write_text(config_text)
        return _validate_trial_config(path, space, flags, metric)


def _validate_trial_config(config_file: Path, space: dict, flags: tuple, metric: str) -> dict:
    """Parse the command of the trials (none runs) with each bound and choice of the space, so that a key or value
    the config does not take is one error now, not a failed trial later; return the complete config of the trials
    (``flags`` applied) as it is before the space's values."""
    command = ["fit", "--config", str(config_file), *flags]
    base = yaml.safe_load(parse_command(command, instantiate=False).config_text)
    if metric.startswith("eval") and base["data"]["eval"] is None:
        raise ConfigError(
            f"--metric {metric!r} is an evaluation metric, but the config has no data.eval, so no trial would record "
            "it: set data.eval, or give a training metric (--metric train_loss_epoch)."
        )
    candidates = {key: _candidate_values(spec) for key, spec in space.items()}
    for index in range(max(len(values) for values in candidates.values())):  # each value once, in few parses
        values = {key: options[min(index, len(options) - 1)] for key, options in candidates.items()}
        parse_command([*command, *value_flags(values)], instantiate=False)
    for key, spec in space.items():
        _validate_range_type(key, spec, _config_value(base, key))
    _validate_train_values(base["train"], candidates)
    return base


def _config_value(config: dict, key: str) -> Any:
    """The value of a dotted key in the complete config (``None`` where the config has no such key)."""
    value: Any = config
    for part in key.split("."):
        if not isinstance(value, Mapping) or part not in value:
            return None
        value = value[part]
    return value


def _validate_range_type(key: str, spec: dict, config_value: Any) -> None:
    """Refuse an int range for a key whose config value is a float (``type: int``, or int bounds): every trial would
    get a whole number (a learning rate of 0 or 1)."""
    if spec.get("type") == "int" and isinstance(config_value, float):
        raise ConfigError(
            f"search space {key}: an int range (low={spec['low']}, high={spec['high']}) for a key whose config value "
            f"is a float ({config_value!r}): every trial would get a whole number. Give float bounds (low: "
            f"{float(spec['low'])}, high: {float(spec['high'])}) and no type: int."
        )


def _validate_train_values(train: dict, candidates: dict) -> None:
    """Refuse a bound or choice of a ``train.*`` key that ``Trainer.train()`` refuses (``train.num_epochs: {low: 0,
    ...}``), which would otherwise fail only the trials that draw it."""
    options = {field.name: train[field.name] for field in fields(TrainOptions) if field.name in train}
    options["collate_fn"] = None  # an import path here, which the parse has checked
    searched = {key[len("train.") :]: values for key, values in candidates.items() if key.startswith("train.")}
    searched = {name: values for name, values in searched.items() if name in options}
    first = {name: values[0] for name, values in searched.items()}
    for name, values in searched.items():
        for value in values:
            try:
                TrainOptions(**{**options, **first, name: value})
            except (ValueError, TypeError) as error:
                raise ConfigError(
                    f"search space train.{name}: {value!r} would be refused by Trainer.train(): {error} Give a range "
                    "or choices of values it takes."
                ) from None


def _storage_name(storage: Optional[str], output_dir: Path) -> str:
    return str(output_dir / STUDY_FILE) if storage is None else f"--storage {storage!r}"


def _search_identity(base: dict, space: dict, metric: str) -> dict:
    """What makes a search one experiment, stored with its study: the trials' config (but their folders: the workers
    of one search may write to folders of their own), the search space and the metric; as JSON reads it back."""
    config = {key: value for key, value in base.items() if key not in ("output_dir", "run_name")}
    return json.loads(json.dumps({"config": config, "search_space": space, "metric": metric}, default=str))


def _open_study(storage: Any, study_name: str, direction: str, sampler: Any, pruner: Any) -> tuple[Any, bool]:
    """The study of that name, and whether this call created it."""
    optuna = _import_optuna()
    try:
        return optuna.load_study(study_name=study_name, storage=storage, sampler=sampler, pruner=pruner), False
    except KeyError:  # no study of that name
        study = optuna.create_study(
            storage=storage,
            study_name=study_name,
            direction=direction,
            sampler=sampler,
            pruner=pruner,
            load_if_exists=True,  # another worker may create it at the same moment
        )
        return study, True


def _validate_study(study: Any, storage_name: str, direction: str, identity: dict) -> None:
    """Refuse a study created to optimise the other way (Optuna keeps a study's direction), or by another search (a
    different config, search space or metric: its trials' values would not compare); a study no search has claimed
    yet is claimed by this one."""
    stored_direction = study.direction.name.lower()
    if stored_direction != direction:
        raise ConfigError(
            f"--direction {direction} does not match the study {study.study_name!r} in {storage_name}, which was "
            f"created to {stored_direction} its metric, and Optuna keeps a study's direction. Rerun with --direction "
            f"{stored_direction} to continue it, or give this search its own --study_name (or --output_dir)."
        )
    stored = study.user_attrs.get(_SEARCH_ATTRIBUTE)
    if stored is None:
        study.set_user_attr(_SEARCH_ATTRIBUTE, identity)
        return
    differences = _differences(identity, stored)
    if differences:
        shown = "; ".join(differences[:3]) + (f"; and {len(differences) - 3} more" if len(differences) > 3 else "")
        raise ConfigError(
            f"The study {study.study_name!r} in {storage_name} belongs to another search ({shown}). Give this search "
            "its own --study_name, or rerun that search's config, flags, search space and --metric to continue it."
        )


def _differences(here: dict, stored: dict) -> list:
    flat_here, flat_stored = _flatten(here), _flatten(stored)
    keys = sorted(key for key in flat_here.keys() | flat_stored.keys() if flat_here.get(key) != flat_stored.get(key))
    return [f"{key}: {flat_here.get(key)!r} here, {flat_stored.get(key)!r} in the study" for key in keys]


def _flatten(value: Any, prefix: str = "") -> dict:
    if not isinstance(value, Mapping) or not value:
        return {prefix.rstrip("."): value}
    return {name: item for key, child in value.items() for name, item in _flatten(child, f"{prefix}{key}.").items()}


def _fail_trials_left_running(study: Any) -> None:
    """Mark the trials a killed search left running as failed, and queue their values again (the default embedded
    study only: one search works on it, so a running trial at its start was killed)."""
    optuna = _import_optuna()
    for trial in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,)):
        study.tell(trial.number, state=optuna.trial.TrialState.FAIL)  # Optuna's public way to end a trial
        study.enqueue_trial(trial.params, user_attrs={"rerun_of": trial.number}, skip_if_exists=False)


def _trials_finished(study: Any) -> int:
    """The trials that count towards ``n_trials``: complete, pruned, and failed for a metric that diverged. Not a
    running one (in a shared storage, one whose worker was killed stays running for ever; several workers may then
    finish a trial or so more than ``n_trials`` together), nor one failed by an error (a killed trial is run again)."""
    optuna = _import_optuna()
    states = (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.PRUNED)
    diverged = [
        trial
        for trial in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.FAIL,))
        if trial.user_attrs.get("diverged")
    ]
    return len(study.get_trials(deepcopy=False, states=states)) + len(diverged)


def _ask(study: Any, space: dict) -> tuple[Any, dict]:
    """A new trial and its values; a trial whose values could not be drawn (a sampler's error) is failed, not left
    running."""
    trial = study.ask()
    try:
        return trial, suggest_values(trial, space)
    except BaseException:
        study.tell(trial, state=_import_optuna().trial.TrialState.FAIL)
        raise


@world_process_zero_only  # the others wait for it, and raise an error naming its error if it raised
def _open_search(
    storage: Optional[str],
    output_dir: Path,
    study_name: str,
    direction: str,
    sampler: Any,
    pruner: Any,
    identity: dict,
    config_text: str,
) -> tuple[Any, Any, bool]:
    """On the main process, which talks to Optuna: open the storage and the study, check that the study belongs to
    this search, and write the config the trials start from; return the storage, the study and whether this call
    created it."""
    opened_storage = create_storage(storage, output_dir)
    study, study_created = _open_study(opened_storage, study_name, direction, sampler, pruner)
    _validate_study(study, _storage_name(storage, output_dir), direction, identity)
    if storage is None:
        _fail_trials_left_running(study)
    base_config = output_dir / BASE_CONFIG_FILE
    if not base_config.exists():
        output_dir.mkdir(parents=True, exist_ok=True)
        base_config.write_text(config_text)
    return opened_storage, study, study_created


def _run_trial(search: _Search, study: Any, trial: Any, number: int, values: dict) -> None:
    """Run one trial on every process and, on the main one, tell the study how it ended."""
    optuna = _import_optuna()
    argv = [
        "fit",
        "--config",
        str(search.base_config),
        *search.flags,
        *value_flags(values),
        "--output_dir",
        str(search.output_dir / TRIALS_FOLDER),
        "--run_name",
        f"trial-{number:04d}",
    ]
    pruning = OptunaPruningCallback(trial, search.metric)
    try:
        parsed = parse_command(argv)
        config = cast(TrainingConfig, parsed.config)
        trainer, _ = run_training_config(
            config, parsed.command, parsed.config_text, parsed.hyperparameters, extra_callbacks=[pruning]
        )
    except MetricNotRecordedError as error:
        if study is None:
            raise
        study.tell(trial, state=optuna.trial.TrialState.FAIL)  # not counted in n_trials
        raise MetricNotRecordedError(f"{error} {_forget_trial(search, study, pruning.run_folder)}") from None
    except BaseException:
        if study is not None:
            study.tell(trial, state=optuna.trial.TrialState.FAIL)
        raise
    if study is None:
        return
    folder = cast(Path, run_folder_of(trainer))  # chosen when the run started
    trial.set_user_attr("run_folder", str(folder))
    if pruning.pruned_at is not None:
        study.tell(trial, state=optuna.trial.TrialState.PRUNED)
        outcome = f"pruned after epoch {pruning.pruned_at}"
    elif pruning.last_value is None or not math.isfinite(pruning.last_value):
        trial.set_user_attr("diverged", True)  # failed, and counted in n_trials: a space that always diverges ends
        study.tell(trial, state=optuna.trial.TrialState.FAIL)
        outcome = f"failed: {search.metric} {pruning.last_value}"
    else:
        study.tell(trial, pruning.last_value)
        outcome = f"{search.metric} {pruning.last_value:.4g}"
    print(f"{folder.name} · {outcome} · {json.dumps(values)}", flush=True)


def _forget_trial(search: _Search, study: Any, run_folder: Optional[Path]) -> str:
    """Remove the run folder of a trial whose metric was not recorded and, when this call started the study and this
    was its only trial, the study and every file this call wrote, so that the same command with the right
    ``--metric`` starts afresh; say what was removed."""
    if run_folder is not None:
        shutil.rmtree(run_folder, ignore_errors=True)
    if not search.study_created or len(study.get_trials(deepcopy=False)) > 1:
        return "The trial's run folder was removed; the trial is marked failed and does not count towards --n_trials."
    _import_optuna().delete_study(study_name=search.study_name, storage=search.storage)
    for path in reversed(search.created):  # the files, then the folders that held them
        if path.is_dir():
            remove_if_empty(path)
        elif path.exists():
            path.unlink()
    return "Nothing of this search was kept: the same command with the right --metric starts afresh."


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
