"""The Optuna side of a search: Optuna imported (an optional dependency), the storage and the pruner of the
options, the study opened and checked to belong to this search (its direction, config, flags, search space and
metric), the trials a killed search left running failed and queued again, and the trials counted and asked for.

Only the main process talks to Optuna: :func:`~pytorch_accel_trainer.cli.tune.tune` calls these there, and tells
the other processes what they need.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Optional

from pytorch_accel_trainer.cli.config import ConfigError
from pytorch_accel_trainer.cli.tune.folder import STUDY_FILE
from pytorch_accel_trainer.cli.tune.space import suggest_values

#: The study's user attribute that holds the search it belongs to (see :func:`search_identity`).
_SEARCH_ATTRIBUTE = "search"


def import_optuna() -> Any:
    """Optuna, imported when a search needs it: it is an optional dependency, and a missing one is an error with the
    command that installs it."""
    try:
        import optuna
    except ImportError as error:
        raise ImportError(
            'tune needs Optuna, which is not installed: pip install "pytorch-accel-trainer[optuna]"'
        ) from error
    return optuna


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
        import_optuna()
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
    optuna = import_optuna()
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
    pruners = import_optuna().pruners
    choices = {"median": pruners.MedianPruner, "hyperband": pruners.HyperbandPruner, "none": pruners.NopPruner}
    if name not in choices:
        raise ConfigError(f"--pruner {name!r} is not valid: choose {', '.join(choices)}.")
    return choices[name]()


def _storage_name(storage: Optional[str], output_dir: Path) -> str:
    return str(output_dir / STUDY_FILE) if storage is None else f"--storage {storage!r}"


def search_identity(base: dict, space: dict, metric: str) -> dict:
    """What makes a search one experiment, stored with its study: the trials' config (but their folders: the workers
    of one search may write to folders of their own), the search space and the metric; as JSON reads it back."""
    config = {key: value for key, value in base.items() if key not in ("output_dir", "run_name")}
    return json.loads(json.dumps({"config": config, "search_space": space, "metric": metric}, default=str))


def _load_or_create_study(storage: Any, study_name: str, direction: str, sampler: Any, pruner: Any) -> tuple[Any, bool]:
    """The study of that name, and whether this call created it."""
    optuna = import_optuna()
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
    optuna = import_optuna()
    for trial in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,)):
        study.tell(trial.number, state=optuna.trial.TrialState.FAIL)  # Optuna's public way to end a trial
        study.enqueue_trial(trial.params, user_attrs={"rerun_of": trial.number}, skip_if_exists=False)


def trials_finished(study: Any) -> int:
    """The trials that count towards ``n_trials``: complete, pruned, and failed for a metric that diverged. Not a
    running one (in a shared storage, one whose worker was killed stays running for ever; several workers may then
    finish a trial or so more than ``n_trials`` together), nor one failed by an error (a killed trial is run again)."""
    optuna = import_optuna()
    states = (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.PRUNED)
    diverged = [
        trial
        for trial in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.FAIL,))
        if trial.user_attrs.get("diverged")
    ]
    return len(study.get_trials(deepcopy=False, states=states)) + len(diverged)


def ask_trial(study: Any, space: dict) -> tuple[Any, dict]:
    """A new trial and its values; a trial whose values could not be drawn (a sampler's error) is failed, not left
    running."""
    trial = study.ask()
    try:
        return trial, suggest_values(trial, space)
    except BaseException:
        study.tell(trial, state=import_optuna().trial.TrialState.FAIL)
        raise


def open_study(
    storage: Optional[str], output_dir: Path, study_name: str, direction: str, sampler: Any, pruner: Any, identity: dict
) -> tuple[Any, Any, bool]:
    """Open the storage and the study, check that the study belongs to this search (``identity``: see
    :func:`search_identity`) and, in the default embedded study, fail the trials a killed search left running; return
    the storage, the study and whether this call created it."""
    opened_storage = create_storage(storage, output_dir)
    study, study_created = _load_or_create_study(opened_storage, study_name, direction, sampler, pruner)
    _validate_study(study, _storage_name(storage, output_dir), direction, identity)
    if storage is None:
        _fail_trials_left_running(study)
    return opened_storage, study, study_created
