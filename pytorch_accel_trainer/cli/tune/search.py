"""The search: :func:`tune` checks everything, opens the study, and runs trials on every process until the study
has ``n_trials`` finished ones (the main process asks Optuna for each trial and tells the others its values), then
copies the best trial's config to the search's folder.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Union

import yaml
from accelerate.utils import broadcast_object_list

from pytorch_accel_trainer.cli.config import ConfigError
from pytorch_accel_trainer.cli.parsing import put_current_folder_on_import_path
from pytorch_accel_trainer.cli.run_folder import CONFIG_FILE
from pytorch_accel_trainer.cli.tune.folder import (
    BEST_CONFIG_FILE,
    paths_to_create,
    validate_folder_of_this_search,
    write_base_config,
)
from pytorch_accel_trainer.cli.tune.space import load_search_space, validated_trial_config
from pytorch_accel_trainer.cli.tune.study import ask_trial, import_optuna, open_study, search_identity, trials_finished
from pytorch_accel_trainer.cli.tune.trial import Search, run_trial
from pytorch_accel_trainer.parallel.processes import launched_world_size, process_state, world_process_zero_only
from pytorch_accel_trainer.state.storage import local_path


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
    ``n_trials`` together); see :mod:`pytorch_accel_trainer.cli.tune`.

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
        storage: where the study lives (see :func:`~pytorch_accel_trainer.cli.tune.create_storage`);
            ``<output_dir>/study.db`` by default.
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
    import_optuna()  # a missing Optuna is the first error
    space = load_search_space(search_space)
    _validate_search_options(n_trials, direction, metric)
    output_dir, flags = local_path(output_dir), tuple(flags)  # ~ and $VARIABLES expanded
    config_text = _config_text(config)
    validate_folder_of_this_search(output_dir, config_text)
    base = validated_trial_config(config, config_text, space, flags, metric)
    state = process_state() if launched_world_size() > 1 else None  # a trial on several processes: one job
    created = paths_to_create(output_dir, storage)
    identity = search_identity(base, space, metric)
    opened = _open_search(storage, output_dir, study_name, direction, sampler, pruner, identity, config_text)
    opened_storage, study, study_created = opened or (None, None, False)  # None: not the main process
    search = Search(output_dir, metric, flags, opened_storage, study_name, study_created, created)
    while (next_trial := _next_trial(study, space, n_trials, state)) is not None:
        run_trial(search, study, *next_trial)
    return _finish(study, output_dir)


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
    """On the main process, which talks to Optuna: open the study of this search (:func:`open_study`) and write the
    config the trials start from; return the storage, the study and whether this call created it."""
    opened = open_study(storage, output_dir, study_name, direction, sampler, pruner, identity)
    write_base_config(output_dir, config_text)
    return opened


def _next_trial(study: Any, space: dict, n_trials: int, state: Any) -> Optional[tuple[Any, int, dict]]:
    """The next trial, its number and its values, the same on every process: the main process asks the study and
    tells the others (the trial object itself is ``None`` there); ``None`` once the study has its trials."""
    trial: Any = None
    values: dict = {}
    if study is not None and trials_finished(study) < n_trials:
        trial, values = ask_trial(study, space)
    shared: list[Any] = [None if trial is None else (trial.number, values)]
    if state is not None and state.num_processes > 1:
        broadcast_object_list(shared)  # one small collective per trial
    return None if shared[0] is None else (trial, *shared[0])


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


def _finish(study: Any, output_dir: Path) -> TuneResult:
    """Copy the best trial's config to the search's folder (main process) and return the result."""
    optuna = import_optuna()
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
