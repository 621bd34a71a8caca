"""One trial: a ``fit`` of the config with the trial's values, in a run folder of its own
(``<output_dir>/trials/trial-0003``), on every process; the callback that reports each epoch's metric to Optuna and
stops the run its pruner prunes; and what the study is told when the trial ends (complete, pruned, diverged or
failed).
"""

from __future__ import annotations

import difflib
import json
import math
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional, cast

from accelerate.utils import broadcast_object_list

from pytorch_accel_trainer.callbacks.base import TrainerCallback
from pytorch_accel_trainer.cli.config import ConfigError, TrainingConfig, run_training_config
from pytorch_accel_trainer.cli.parsing import parse_command
from pytorch_accel_trainer.cli.run_folder import RunFolderCallback
from pytorch_accel_trainer.cli.tune.folder import BASE_CONFIG_FILE, TRIALS_FOLDER, remove_created
from pytorch_accel_trainer.cli.tune.space import value_flags
from pytorch_accel_trainer.cli.tune.study import import_optuna
from pytorch_accel_trainer.errors import StopTrainingError

if TYPE_CHECKING:
    import optuna

    from pytorch_accel_trainer.trainer import Trainer


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


@dataclass(frozen=True)
class Search:
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


def run_trial(search: Search, study: Any, trial: Any, number: int, values: dict) -> None:
    """Run one trial on every process and, on the main one, tell the study how it ended."""
    optuna = import_optuna()
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


def _forget_trial(search: Search, study: Any, run_folder: Optional[Path]) -> str:
    """Remove the run folder of a trial whose metric was not recorded and, when this call started the study and this
    was its only trial, the study and every file this call wrote, so that the same command with the right
    ``--metric`` starts afresh; say what was removed."""
    if run_folder is not None:
        shutil.rmtree(run_folder, ignore_errors=True)
    if not search.study_created or len(study.get_trials(deepcopy=False)) > 1:
        return "The trial's run folder was removed; the trial is marked failed and does not count towards --n_trials."
    import_optuna().delete_study(study_name=search.study_name, storage=search.storage)
    remove_created(search.created)
    return "Nothing of this search was kept: the same command with the right --metric starts afresh."
