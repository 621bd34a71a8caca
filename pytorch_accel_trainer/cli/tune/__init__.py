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

Its modules, in the order a search runs them: ``search`` (:func:`tune`: the checks, then the trials on every
process until the study has enough, then the best config), ``space`` (the search space: read, checked against the
config, drawn for a trial), ``folder`` (the files of the search's folder), ``study`` (Optuna: the storage, the
pruner, the study and the search it belongs to) and ``trial`` (one trial's run, its pruning callback, and what the
study is told at its end).
"""

from pytorch_accel_trainer.cli.tune.folder import BASE_CONFIG_FILE, BEST_CONFIG_FILE, STUDY_FILE, TRIALS_FOLDER
from pytorch_accel_trainer.cli.tune.search import TuneResult, tune
from pytorch_accel_trainer.cli.tune.space import load_search_space, suggest_values, value_flags
from pytorch_accel_trainer.cli.tune.study import create_pruner, create_storage
from pytorch_accel_trainer.cli.tune.trial import MetricNotRecordedError, OptunaPruningCallback, run_folder_of

__all__ = [
    "BASE_CONFIG_FILE",
    "BEST_CONFIG_FILE",
    "STUDY_FILE",
    "TRIALS_FOLDER",
    "MetricNotRecordedError",
    "OptunaPruningCallback",
    "TuneResult",
    "create_pruner",
    "create_storage",
    "load_search_space",
    "run_folder_of",
    "suggest_values",
    "tune",
    "value_flags",
]
