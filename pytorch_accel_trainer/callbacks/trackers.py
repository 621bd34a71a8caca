"""Experiment tracking through Accelerate's tracker API: TensorBoard, CSV, JSON lines, and any Accelerate tracker."""

from __future__ import annotations

import csv
import json
import math
import numbers
import os
import secrets
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Optional, TextIO, Union

import torch
from accelerate.tracking import LOGGER_TYPE_TO_CLASS, GeneralTracker, get_available_trackers, on_main_process
from accelerate.utils import broadcast_object_list, gather_object

from pytorch_accel_trainer.callbacks.base import TrainerCallback, overrides
from pytorch_accel_trainer.callbacks.readback import HostCopy, RunningSum
from pytorch_accel_trainer.errors import validate_positive_int
from pytorch_accel_trainer.run_config import data_parallel_size, get_run_config
from pytorch_accel_trainer.state.storage import local_path
from pytorch_accel_trainer.tracking import BATCH_OUTPUT_KEYS, is_scalar_metric, metric_counts

if TYPE_CHECKING:
    from pytorch_accel_trainer.trainer import Trainer


class _FileTracker(GeneralTracker):
    """A tracker that appends one text record per ``log`` call to ``logging_dir/run_name/<file_name>``."""

    requires_logging_directory = True
    main_process_only = True
    file_name = ""

    def __init__(self, run_name: str, logging_dir: Union[str, os.PathLike] = "."):
        super().__init__()
        self.run_name = run_name
        self.run_dir = local_path(logging_dir) / run_name
        self.path = self.run_dir / self.file_name
        self._file: Optional[TextIO] = None

    @property
    def tracker(self):
        """The open file (``None`` before :meth:`start` and after :meth:`finish`)."""
        return self._file

    @on_main_process
    def start(self):
        """Create the run folder and open the file for appending."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        is_new = not self.path.exists() or self.path.stat().st_size == 0
        self._file = open(self.path, "a", newline="", encoding="utf-8")
        if is_new:
            self._write_header()

    def _write_header(self) -> None:
        """Write the first lines of a new file; nothing by default."""

    def _open_file(self) -> TextIO:
        """The file :meth:`start` opened."""
        if self._file is None:
            raise RuntimeError(
                f"{type(self).__name__} writes to {str(self.path)!r} only between start() and finish(): call start() "
                "first (the callback does, at the start of each run)."
            )
        return self._file

    @on_main_process
    def store_init_configuration(self, values: dict):
        """Write the run's configuration to ``config.json`` in the run folder."""
        (self.run_dir / "config.json").write_text(json.dumps(values, indent=2, default=str), encoding="utf-8")

    @on_main_process
    def finish(self):
        """Close the file."""
        if self._file is not None:
            self._file.close()
            self._file = None


class CSVTracker(_FileTracker):
    """Appends every logged value to ``logging_dir/run_name/metrics.csv``, one ``step,name,value`` row each.

    The long format takes any set of names at any step; ``pandas.read_csv(path).pivot(index="step",
    columns="name", values="value")`` gives one column per metric.

    Args:
        run_name: the folder of this run inside ``logging_dir``.
        logging_dir: where run folders are created.
    """

    name = "csv"
    file_name = "metrics.csv"

    def _write_header(self) -> None:
        csv.writer(self._open_file()).writerow(["step", "name", "value"])

    @on_main_process
    def log(self, values: dict, step: Optional[int] = None, **kwargs):
        """Append one row per value, flushed at once."""
        file = self._open_file()
        writer = csv.writer(file)
        for name, value in values.items():
            writer.writerow(["" if step is None else step, name, value])
        file.flush()


class JSONLinesTracker(_FileTracker):
    """Appends each ``log`` call to ``logging_dir/run_name/metrics.jsonl``, as one object ``{"step": ..., **values}``.

    Args:
        run_name: the folder of this run inside ``logging_dir``.
        logging_dir: where run folders are created.
    """

    name = "jsonl"
    file_name = "metrics.jsonl"

    @on_main_process
    def log(self, values: dict, step: Optional[int] = None, **kwargs):
        """Append one line, flushed at once."""
        file = self._open_file()
        file.write(json.dumps({"step": step, **values}) + "\n")
        file.flush()


#: The trackers of this package, by name; every name of ``accelerate.tracking.LOGGER_TYPE_TO_CLASS`` works too.
BUILTIN_TRACKERS = {"csv": CSVTracker, "jsonl": JSONLinesTracker}

#: The W&B project, MLflow experiment, ... of a callback given no ``project_name``.
DEFAULT_PROJECT_NAME = "pytorch_accel_trainer"

#: The keyword that names the run, for the Accelerate trackers that take one (the first argument of each of their
#: classes names the project). Others (Comet, ClearML, DVCLive) name the run their own way, or after the project.
_RUN_NAME_KEYWORDS = {"wandb": "name", "mlflow": "run_name", "trackio": "name", "swanlab": "experiment_name"}

#: The keyword that names the project in a tracker's own arguments: given in ``tracker_kwargs``, it wins over
#: ``project_name`` for that tracker (an MLflow experiment path with '/', say).
_PROJECT_KEYWORDS = {
    "wandb": "project",
    "mlflow": "experiment_name",
    "trackio": "project",
    "swanlab": "project",
    "comet_ml": "project_name",
    "clearml": "project_name",
}


def _create_run_name() -> str:
    """A new run name: the local time and six random hex digits, e.g. ``20250131-142501-3fa9c2``.

    The digits come from the operating system (:mod:`secrets`), never from ``random``, numpy or torch, which a seeded
    run resets: two runs started in the same second, or with the same seed, never share a name.
    """
    return f"{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(3)}"


def run_config_hyperparameters(run_config: Any) -> dict:
    """The fields of a ``TrainerRunConfig`` as ``run_config.<field>`` hyperparameters.

    See :func:`plain_hyperparameters`.
    """
    return plain_hyperparameters(run_config.to_dict(), "run_config.")


def plain_hyperparameters(values: Any, prefix: str = "") -> dict:
    """Nested ``values`` as one level of ``a.b.c`` keys, as every tracker can store hyperparameters: numbers, strings
    and booleans as they are, ``None`` as ``"null"``, functions and classes by import path (not by address), anything
    else as text."""
    if isinstance(values, dict):
        flat = {}
        for key, value in values.items():
            flat.update(plain_hyperparameters(value, f"{prefix}{key}."))
        return flat
    if values is None or isinstance(values, (bool, int, float, str)):
        plain = "null" if values is None else values
    elif callable(values):
        plain = f"{getattr(values, '__module__', '')}.{getattr(values, '__qualname__', type(values).__name__)}"
    else:
        plain = repr(values)
    return {prefix[:-1]: plain}


#: The step metrics a tracker's host buffer holds from the start of a run; more make it larger once.
STEP_METRIC_SLOTS = 16


class ExperimentTrackingCallback(TrainerCallback):
    """Logs a run to experiment trackers: step values every ``log_every_n_steps`` updates, metrics every epoch.

    Every ``log_every_n_steps`` optimizer updates it logs, at that step: ``train_loss_step``, the mean loss of
    the batches since the last log over every process; ``train_<name>_step`` for each step metric, the extra
    numbers ``calculate_train_batch_loss`` returns (``accuracy``, a regulariser: every key but ``loss``,
    ``model_outputs``, ``batch_size`` and ``num_items_in_batch`` whose value is a number or a 0-d tensor), the
    mean of the batches since the last log that returned it, over every process; ``lr_group_<i>``, the learning rate
    of each parameter group; ``gradient_norm``, the total norm of the last update's (unscaled, before clipping)
    gradients; and ``samples_per_second`` over all processes (counted from the ``batch_size`` of each
    batch output when it is an ``int``). After each evaluation epoch, at the end of each epoch and at the
    end of a run, it logs every run-history metric that has a new value (``train_loss_epoch``,
    ``eval_loss_epoch``, your metrics, ...), with ``epoch``, at the current update step. Every value is
    logged with ``step=trainer.num_update_steps_completed``, one increasing step, as W&B requires.

    The loss and the step metrics are summed on the device and copied to the host together without waiting for
    them (values arrive one interval late on CUDA, and are flushed at the end of each epoch): no host-device sync
    per step. Summing them over processes is one collective every ``log_every_n_steps`` updates, on every
    process (with a batch-loss hook of your own, the processes first agree on the metric names: one small gather
    per log); only the main process creates the trackers and writes.

    Names: ``project_name`` groups runs and ``run_name`` names this one. W&B gets ``wandb.init(project=project_name,
    name=run_name)``; MLflow the experiment ``project_name`` and the run ``run_name``; trackio and SwanLab likewise;
    the other trackers of Accelerate get ``project_name`` as ``Accelerator.init_trackers`` would give it. The trackers
    that write files (TensorBoard, CSV, JSON lines) write to :attr:`run_dir`, ``logging_dir/project_name/run_name/``,
    or ``logging_dir/run_name/`` when ``project_name`` is ``None``. A callback has one run name: a later ``train()``
    or ``evaluate()`` with it logs under the same name (file trackers append to the same files; W&B and MLflow start
    another run of that name); create a new callback for a new name.

    Args:
        trackers: names of trackers (``"csv"``, ``"jsonl"``, ``"tensorboard"``, or any other name Accelerate
            knows: ``"wandb"``, ``"mlflow"``, ...) or :class:`accelerate.tracking.GeneralTracker` instances, which are
            used as they are, names included.
        logging_dir: where trackers that write files put ``[<project_name>/]<run_name>/``.
        run_name: the name of this run: the W&B run name, the MLflow run name, the folder of its files. By default
            the time the callback is created and six random hex digits (``20250131-142501-3fa9c2``), drawn from the
            operating system, so that two runs never share a name, even with the same seed; in a run of several
            processes, the main process's from the start of the first run.
        log_every_n_steps: the optimizer updates between two step logs.
        config: hyperparameters to store with ``store_init_configuration`` at the start of each run, with the run
            config (``run_config.<field>``), which is always stored; the command line passes the whole configuration.
        tracker_kwargs: extra constructor arguments per tracker name, e.g. ``{"wandb": {"entity": "me"}}``. A
            project or run name given here (``{"mlflow": {"experiment_name": "/Users/me/exp"}}``) wins over
            ``project_name`` and ``run_name`` for that tracker.
        project_name: the project this run belongs to: the W&B project, the MLflow experiment, a folder between
            ``logging_dir`` and the run folders. When it is ``None``, there is no such folder and the trackers that
            take a project get ``"pytorch_accel_trainer"`` (MLflow's ``MLFLOW_EXPERIMENT_NAME`` wins over both).

    Attributes:
        run_name: the run's name, given or drawn.
        project_name: the ``project_name`` given.

    Example::

        tracking = ExperimentTrackingCallback(["tensorboard", "csv"], logging_dir="runs", project_name="digits")
        callbacks = (*DEFAULT_CALLBACKS, tracking)  # files in runs/digits/<tracking.run_name>/
    """

    def __init__(
        self,
        trackers: Iterable[Union[str, GeneralTracker]] = ("csv",),
        logging_dir: Union[str, os.PathLike] = "runs",
        run_name: Optional[str] = None,
        log_every_n_steps: int = 50,
        config: Optional[dict] = None,
        tracker_kwargs: Optional[dict] = None,
        project_name: Optional[str] = None,
    ):
        self.tracker_specs = [trackers] if isinstance(trackers, (str, GeneralTracker)) else list(trackers)
        _validate_trackers(self.tracker_specs)
        validate_positive_int("log_every_n_steps", log_every_n_steps, "optimizer updates", 50)
        _validate_name("run_name", run_name, "a new name (the time and random digits)")
        _validate_name("project_name", project_name, "no project folder, and the project 'pytorch_accel_trainer'")
        _validate_tracker_kwargs(tracker_kwargs, self.tracker_specs)
        self.logging_dir = logging_dir
        self.project_name = project_name
        self.run_name = run_name or _create_run_name()
        self._run_name_is_drawn = run_name is None  # each process drew its own: the main process's is shared
        self.log_every_n_steps = log_every_n_steps
        self.config = config
        self.tracker_kwargs = tracker_kwargs or {}
        self.trackers: list[GeneralTracker] = []
        self._is_writer = False
        self._loss = RunningSum()
        #: The step metrics since the last log, by name: tensors summed on the device, numbers on the host.
        self._metric_sums: dict[str, RunningSum] = {}
        self._metric_host_sums: dict[str, list] = {}
        self._host_copy: Optional[HostCopy] = None
        self._samples = 0
        self._interval_start = 0.0
        self._logged_counts: dict[str, int] = {}

    def use_run_name(self, run_name: str) -> None:
        """Name the run ``run_name`` unless a name was given to the constructor; the command line gives the name of
        the run's folder, so that the trackers' run and the folder match. Call it before ``train()``, with the same
        name on every process."""
        if self._run_name_is_drawn:
            _validate_name("run_name", run_name, "a new name (the time and random digits)")
            self.run_name, self._run_name_is_drawn = run_name, False

    @property
    def run_dir(self) -> Path:
        """The folder of this run's files (TensorBoard, CSV, JSON lines): ``logging_dir/[project_name/]run_name``."""
        return self._project_dir / self.run_name

    @property
    def _project_dir(self) -> Path:
        logging_dir = local_path(self.logging_dir)  # ~ and $VARIABLES expanded, as a shell would
        return logging_dir / self.project_name if self.project_name else logging_dir

    # ------------------------------------------------------------------------------------------------
    # Trackers
    # ------------------------------------------------------------------------------------------------

    def _start_trackers(self, trainer: "Trainer") -> None:
        self._share_drawn_run_name(trainer)
        run_config = get_run_config(trainer)
        self._is_writer = run_config.is_world_process_zero
        history = trainer.run_history
        self._logged_counts = metric_counts(history)
        if not self._is_writer or self.trackers:
            return
        self.trackers = [self._create_tracker(spec) for spec in self.tracker_specs]
        configuration = {**run_config_hyperparameters(run_config), **(self.config or {})}
        for tracker in self.trackers:
            tracker.start()
            tracker.store_init_configuration(configuration)

    def _share_drawn_run_name(self, trainer: "Trainer") -> None:
        """Give every process the main process's drawn run name, once: each drew its own with the callback."""
        if self._run_name_is_drawn and get_run_config(trainer).num_processes > 1:
            names = [self.run_name]
            broadcast_object_list(names)  # one collective, at the first run start, on every process
            self.run_name = names[0]
        self._run_name_is_drawn = False

    def _create_tracker(self, spec: Union[str, GeneralTracker]) -> GeneralTracker:
        if isinstance(spec, GeneralTracker):
            return spec  # named by whoever created it
        kwargs = dict(self.tracker_kwargs.get(spec, {}))
        tracker_class = BUILTIN_TRACKERS.get(spec) or LOGGER_TYPE_TO_CLASS[spec]
        if tracker_class.requires_logging_directory:  # files in <first argument>/ under the second, as Accelerate does
            return tracker_class(self.run_name, self._project_dir, **kwargs)
        project_name = self.project_name or DEFAULT_PROJECT_NAME
        if spec in _PROJECT_KEYWORDS:
            project_name = kwargs.pop(_PROJECT_KEYWORDS[spec], project_name)
        if spec in _RUN_NAME_KEYWORDS:
            kwargs.setdefault(_RUN_NAME_KEYWORDS[spec], self.run_name)
        return tracker_class(project_name, **kwargs)  # Accelerate's init_trackers(project_name) passes it first too

    def _log(self, values: dict, step: int) -> None:
        for tracker in self.trackers:
            tracker.log(values, step=step)

    def _finish_trackers(self) -> None:
        for tracker in self.trackers:
            tracker.finish()
        self.trackers = []

    # ------------------------------------------------------------------------------------------------
    # Events
    # ------------------------------------------------------------------------------------------------

    def on_training_run_start(self, trainer: "Trainer", **kwargs):
        self._start_trackers(trainer)
        trainer.track_gradient_norm = True  # the trainer keeps the norm of each update's gradients, on the device
        # the loss sum and count, gradient norm, and each step metric's sum and count: made here, not in a step
        self._host_copy = HostCopy(3 + 2 * STEP_METRIC_SLOTS, trainer.device) if self._is_writer else None
        self._reset_sums()

    def on_train_epoch_start(self, trainer: "Trainer", **kwargs):
        self._samples, self._interval_start = 0, time.perf_counter()  # evaluation time is not training time

    def on_train_step_end(self, trainer: "Trainer", batch: Any = None, batch_output: Optional[dict] = None, **kwargs):
        if batch_output is None:
            return  # called by hand without a batch output: no loss to add
        self._loss.add(batch_output["loss"])
        batch_size = batch_output.get("batch_size")
        if isinstance(batch_size, int):  # a tensor batch size would need a sync to read
            self._samples += batch_size
        for name, value in batch_output.items():
            if name not in BATCH_OUTPUT_KEYS and is_scalar_metric(value):
                self._add_step_metric(name, value)

    def _add_step_metric(self, name: str, value: Any) -> None:
        """Add one batch's value of a step metric: a tensor kept on its device, a number on the host (no sync)."""
        if isinstance(value, torch.Tensor):
            self._metric_sums.setdefault(name, RunningSum()).add(value)
        else:
            host_sum = self._metric_host_sums.setdefault(name, [0.0, 0])
            host_sum[0] += float(value)
            host_sum[1] += 1

    def on_optimizer_step_end(self, trainer: "Trainer", num_update_steps_completed: Optional[int] = None, **kwargs):
        if num_update_steps_completed is None:  # called by hand without it: the trainer's count
            num_update_steps_completed = trainer.num_update_steps_completed
        if num_update_steps_completed % self.log_every_n_steps == 0 and self._loss.count:
            self._start_step_log(trainer, num_update_steps_completed)

    def on_eval_epoch_end(self, trainer: "Trainer", **kwargs):
        self._log_new_metrics(trainer)

    def on_training_run_epoch_end(self, trainer: "Trainer", **kwargs):
        self._log_new_metrics(trainer)

    def on_training_run_end(self, trainer: "Trainer", **kwargs):
        self._log_new_metrics(trainer)
        self._finish_trackers()

    def on_evaluation_run_start(self, trainer: "Trainer", **kwargs):
        self._start_trackers(trainer)

    def on_evaluation_run_end(self, trainer: "Trainer", **kwargs):
        self._log_new_metrics(trainer)
        self._finish_trackers()

    # ------------------------------------------------------------------------------------------------
    # What is logged
    # ------------------------------------------------------------------------------------------------

    def _start_step_log(self, trainer: "Trainer", step: int) -> None:
        loss_total = self._loss.total
        if loss_total is None:
            return  # no loss since the last log: the caller logs only after one
        self._log_arrived_step_values()  # the previous copy, before its buffer is reused
        norm = trainer.last_gradient_norm  # computed by clipping by norm; the same on every process
        norm = loss_total.new_tensor(float("nan")) if norm is None else norm.detach().float().reshape(())
        num_processes = get_run_config(trainer).num_processes
        names = self._step_metric_names(trainer, num_processes)
        totals = torch.stack(
            [
                loss_total,
                loss_total.new_tensor(float(self._loss.count)),
                norm.to(loss_total.device),
                *self._step_metric_totals(names, loss_total),
            ]
        )
        if num_processes > 1:
            totals = trainer.accelerator.reduce(totals, "sum")  # a collective, not a host sync
        if self._is_writer:
            host_copy = self._host_copy_of(totals.numel(), trainer.device)
            param_groups = trainer.optimizer.param_groups if trainer.optimizer is not None else []  # train() needs one
            values = {f"lr_group_{index}": group["lr"] for index, group in enumerate(param_groups)}
            values = {name: value for name, value in values.items() if isinstance(value, numbers.Real)}
            elapsed = time.perf_counter() - self._interval_start
            if self._samples and elapsed > 0:
                values["samples_per_second"] = self._samples * data_parallel_size(trainer) / elapsed
            values["_num_processes"] = num_processes
            host_copy.start(totals, tag=(step, values, names))
        self._reset_sums()
        self._samples, self._interval_start = 0, time.perf_counter()
        self._log_arrived_step_values()  # complete at once on the CPU

    def _reset_sums(self) -> None:
        self._loss.reset()
        self._metric_sums, self._metric_host_sums = {}, {}

    def _step_metric_names(self, trainer: "Trainer", num_processes: int) -> list:
        """The step metrics to log now, sorted: this process's since the last log, or with several processes those of
        any process (one small gather per log, only where a hook of your own may return some)."""
        names = sorted({*self._metric_sums, *self._metric_host_sums})
        hooks_may_return_metrics = overrides(trainer, "calculate_train_batch_loss") or overrides(
            trainer, "_perform_forward_and_backward_passes"
        )
        if num_processes > 1 and hooks_may_return_metrics:  # the same decision on every process: the same class
            names = sorted(set().union(*gather_object([names])))
        return names

    def _step_metric_totals(self, names: list, like: torch.Tensor) -> list:
        """For each name, the sum of its values since the last log and how many there were, as 0-d float tensors on
        ``like``'s device (0 and 0 for a metric this process did not see)."""
        totals = []
        for name in names:
            device_sum = self._metric_sums.get(name)
            host_sum, host_count = self._metric_host_sums.get(name, (0.0, 0))
            device_total = None if device_sum is None else device_sum.total
            total = like.new_tensor(host_sum)
            if device_total is not None:
                total = total + device_total.to(like.device).float()
            count = host_count + (0 if device_sum is None else device_sum.count)
            totals += [total, like.new_tensor(float(count))]
        return totals

    def _host_copy_of(self, numel: int, device: torch.device) -> HostCopy:
        """The writer's host buffer, for ``numel`` values; made larger when a hook returns more than
        :data:`STEP_METRIC_SLOTS` step metrics (a pending copy is logged first, waiting for it)."""
        if self._host_copy is None or self._host_copy.numel < numel:
            self._log_arrived_step_values(wait=True)
            self._host_copy = HostCopy(2 * numel, device)
        return self._host_copy

    def _log_arrived_step_values(self, wait: bool = False) -> None:
        arrived = self._host_copy.get_values(wait=wait) if self._host_copy is not None else None
        if arrived is not None:
            (step, values, names), (loss_sum, count, gradient_norm, *metric_totals) = arrived
            values = dict(values)
            num_processes = values.pop("_num_processes")
            if not math.isnan(gradient_norm):
                values["gradient_norm"] = gradient_norm / num_processes  # summed over identical processes
            for index, name in enumerate(names):
                metric_sum, metric_count = metric_totals[2 * index], metric_totals[2 * index + 1]
                if metric_count:  # no process's batches returned it since the last log: nothing to log
                    values[f"train_{name}_step"] = metric_sum / metric_count
            self._log({"train_loss_step": loss_sum / count, **values}, step=step)

    def _log_new_metrics(self, trainer: "Trainer") -> None:
        """Log the latest value of every run-history metric recorded since the last call."""
        self._log_arrived_step_values(wait=True)  # steps come first, so that logged steps only increase
        history, new_values = trainer.run_history, {}
        for name in sorted(history.get_metric_names()):
            values = history.get_metric_values(name)
            if len(values) > self._logged_counts.get(name, 0):
                self._logged_counts[name] = len(values)
                if isinstance(values[-1], numbers.Real):  # lists (per-class values) and tensors are left out
                    new_values[name] = float(values[-1])
        if new_values and self._is_writer:
            self._log({**new_values, "epoch": history.current_epoch}, step=trainer.num_update_steps_completed)


def _validate_trackers(specs: list) -> None:
    choices = [*BUILTIN_TRACKERS, *LOGGER_TYPE_TO_CLASS]
    available = {str(logger_type) for logger_type in get_available_trackers()}
    for spec in specs:
        if isinstance(spec, GeneralTracker) or spec in BUILTIN_TRACKERS:
            continue
        if spec not in LOGGER_TYPE_TO_CLASS:
            raise ValueError(
                f"Unknown tracker {spec!r}: choose from {choices}, or pass an accelerate.tracking.GeneralTracker "
                "instance."
            )
        if spec not in available:
            package = '"pytorch-accel-trainer[tensorboard]"' if spec == "tensorboard" else spec
            raise ImportError(f"The tracker {spec!r} needs its package, which is not installed: pip install {package}.")


def _validate_name(argument: str, value: Any, default: str) -> None:
    if value is None:
        return
    if not isinstance(value, str):
        raise TypeError(f"{argument} is {value!r} ({type(value).__name__}); pass a string, or None for {default}.")
    if not value.strip() or value in (".", "..") or "/" in value or "\\" in value:
        hint = " (a project with '/' for MLflow goes in tracker_kwargs={'mlflow': {'experiment_name': ...}})"
        hint = hint if argument == "project_name" else ""
        raise ValueError(
            f"{argument} is {value!r}, which cannot name a folder under logging_dir: pass a non-empty name other than "
            f"'.' and '..', without '/' or '\\'{hint}, or None for {default}."
        )


def _validate_tracker_kwargs(tracker_kwargs: Any, specs: list) -> None:
    if tracker_kwargs is None:
        return
    if not isinstance(tracker_kwargs, dict) or not all(isinstance(kwargs, dict) for kwargs in tracker_kwargs.values()):
        raise TypeError(
            f"tracker_kwargs is {tracker_kwargs!r}; pass a dict of keyword arguments per tracker name, "
            "e.g. {'wandb': {'entity': 'me'}}."
        )
    names = [spec for spec in specs if isinstance(spec, str)]
    unused = [name for name in tracker_kwargs if name not in names]
    if unused:
        raise ValueError(
            f"tracker_kwargs has arguments for {unused}, which are not among the trackers {names}: add them to "
            "trackers, or leave their arguments out."
        )
