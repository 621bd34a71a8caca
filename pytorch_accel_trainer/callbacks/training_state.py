"""Saving the training state during a run, so that it can be resumed exactly."""

from __future__ import annotations

import operator
from pathlib import Path
from typing import TYPE_CHECKING, Iterable, Optional, Union

from pytorch_accel_trainer.callbacks.base import TrainerCallback
from pytorch_accel_trainer.callbacks.monitor import validate_metric_can_be_recorded
from pytorch_accel_trainer.errors import validate_positive_int
from pytorch_accel_trainer.state.manager import validate_save_dir
from pytorch_accel_trainer.state.parts import Processes
from pytorch_accel_trainer.state.preemption import DEFAULT_PREEMPTION_SIGNALS
from pytorch_accel_trainer.state.storage import TRAINING_STATES, Destination, as_location, validate_location

if TYPE_CHECKING:
    from pytorch_accel_trainer.trainer import Trainer


class SaveTrainingStateCallback(TrainerCallback):
    """Saves the full training state under ``save_dir`` so that ``train(resume_from=save_dir)`` continues the run.

    Saves are taken between optimizer updates (``Trainer.save_training_state``), in folders named as
    pytorch-accelerated names them: ``epoch_<N>`` (N counts training-run epochs from 1), ``step_<N>`` (N counts
    optimizer updates) and ``final``. Both counts continue across a resume, and a name already taken gets a
    ``-2``, ``-3``... suffix (a second run's ``final`` is ``final-2``), so no state is ever overwritten. Pass
    ``save_dir`` to ``train(resume_from=...)`` to continue from the newest state, or one state's folder
    (``"training_states/epoch_5"``) to continue from it. On SIGTERM, SIGINT or SIGUSR1 (``save_on_signals``) the
    run finishes its current update, saves, and exits with code ``128 + signal``.

    Each state's manifest names its run (an identity made as a new run starts, kept by its resumes). A new run (one
    that resumed no state) whose ``save_dir`` holds another run's states refuses to start, before any step, unless
    ``allow_other_runs=True`` (the states of this callback's own earlier ``train()`` calls are not another run's);
    pruning and ``latest`` only ever touch this run's states. One job saves into ``save_dir`` at a time: as the run
    starts its main process claims the folder (``save_dir/.claim``, removed as the run ends), and a run whose folder
    another live job of this host holds is refused before any step (see "Run identity" in docs/training_state.md).

    Args:
        save_dir: the folder of training states, created if needed; pass the same folder to
            ``train(resume_from=...)``: it starts a new run while the folder is empty. An object-storage URL
            (``"s3://bucket/states"``, with fsspec and the store's package installed) works too: each state becomes
            visible there once its manifest, uploaded last, is (see docs/training_state.md).
        save_every_n_epochs: save after every N training-run epochs (``None``, the default: never by epoch).
        save_every_n_steps: save after every N optimizer updates (``None``, the default: never by step).
        save_at_end: save when the training run ends (the default, as in pytorch-accelerated: one state per run);
            a run stopped by its time budget (``train(max_time=...)``) is saved as it ends even when ``False``.
        max_checkpoints: keep only the newest N of these rolling states (``None``: keep all).
        keep_every_n_steps: keep the state after every N updates forever, whatever ``max_checkpoints`` says.
        watch_metric: keep, apart from the rolling states, the state of the epoch with the best value of this
            run-history metric.
        greater_is_better: whether a larger ``watch_metric`` is better.
        save_on_signals: the signals that save and exit; ``()`` to leave signals alone.
        asynchronous: stall training only while each state is copied to host memory (inside an epoch, the
            parameters and the optimizer's state beside the next forward and backward passes) and write it in the
            background (any number of processes; see ``Trainer.save_training_state``).
        allow_other_runs: write beside the states of other runs in ``save_dir`` instead of refusing to start; a
            resume from ``save_dir`` then continues the run saved last.

    Example::

        trainer = Trainer(model, loss_func, optimizer, callbacks=[*DEFAULT_CALLBACKS,
                          SaveTrainingStateCallback("checkpoints", save_every_n_steps=500, max_checkpoints=3)])
        trainer.train(dataset, num_epochs=10, resume_from="checkpoints")  # starts, or resumes after a crash
    """

    def __init__(
        self,
        save_dir: Union[str, Path] = "training_states",
        save_every_n_epochs: Optional[int] = None,
        save_every_n_steps: Optional[int] = None,
        save_at_end: bool = True,
        max_checkpoints: Optional[int] = None,
        keep_every_n_steps: Optional[int] = None,
        watch_metric: Optional[str] = None,
        greater_is_better: bool = False,
        save_on_signals: Iterable[int] = DEFAULT_PREEMPTION_SIGNALS,
        asynchronous: bool = False,
        allow_other_runs: bool = False,
    ):
        for name, value in (
            ("save_every_n_epochs", save_every_n_epochs),
            ("save_every_n_steps", save_every_n_steps),
            ("max_checkpoints", max_checkpoints),
            ("keep_every_n_steps", keep_every_n_steps),
        ):
            if value is not None:
                unit = "epochs" if "epochs" in name else "states" if name == "max_checkpoints" else "updates"
                validate_positive_int(name, value, unit, 3 if name == "max_checkpoints" else 100)
        validate_location(save_dir)  # an object-storage URL needs its package: said now, not after an epoch
        self.save_dir = as_location(save_dir)  # a URL of object storage stays one
        if isinstance(self.save_dir, Path):
            self.save_dir.mkdir(parents=True, exist_ok=True)  # so that train(resume_from=save_dir) starts a first run
        self.save_every_n_epochs = save_every_n_epochs
        self.save_every_n_steps = save_every_n_steps
        self.save_at_end = save_at_end
        self.max_checkpoints = max_checkpoints
        self.keep_every_n_steps = keep_every_n_steps
        self.watch_metric = watch_metric
        self.is_better = operator.gt if greater_is_better else operator.lt
        self.save_on_signals = tuple(save_on_signals)
        self.asynchronous = asynchronous
        self.allow_other_runs = allow_other_runs
        self.best_metric: Optional[float] = None
        self._last_saved_step: Optional[int] = None
        self._run_ids: set = set()  # the runs this callback has saved, over the train() calls of a script

    def writes_to(self) -> tuple[Destination, ...]:
        """``save_dir``, a folder (or URL) of training states."""
        return (Destination(self.save_dir, TRAINING_STATES, "SaveTrainingStateCallback(save_dir=...)"),)

    def state_dict(self) -> dict:
        return {"best_metric": self.best_metric, "last_saved_step": self._last_saved_step}

    def load_state_dict(self, state: dict) -> None:
        self.best_metric, self._last_saved_step = state["best_metric"], state["last_saved_step"]

    def on_training_run_start(self, trainer: "Trainer", **kwargs):
        # before any step; the states of this callback's earlier train() calls (say, before unfreezing) are no
        # other run's
        # and claimed for this job by its main process (released as the run ends)
        processes = Processes.of_accelerator(trainer.accelerator)
        validate_save_dir(self.save_dir, trainer.run_state, self.allow_other_runs, self._run_ids, processes)
        self._run_ids.add(trainer.run_state.run_id)
        if self.watch_metric is not None:
            validate_metric_can_be_recorded(trainer, self.watch_metric, type(self).__name__)
        if self.save_on_signals:
            trainer.enable_preemption(self.save_dir, self.save_on_signals)

    def on_optimizer_step_end(self, trainer: "Trainer", num_update_steps_completed: Optional[int] = None, **kwargs):
        if num_update_steps_completed is None:  # called by hand without it: the trainer's count
            num_update_steps_completed = trainer.num_update_steps_completed
        # taken at the next point between updates: before the next batch, or between epochs after the last one
        kinds = self._step_kinds(num_update_steps_completed)
        if kinds:
            self._save(trainer, kinds, f"step_{num_update_steps_completed}")

    def on_train_epoch_end(self, trainer: "Trainer", **kwargs):
        # asked for here, as pytorch-accelerated does; taken between epochs, after this epoch's evaluation
        epoch = trainer.run_history.current_epoch
        if self.save_every_n_epochs and epoch % self.save_every_n_epochs == 0:
            self._save(trainer, {"rolling"}, f"epoch_{epoch}")

    def on_training_run_epoch_end(self, trainer: "Trainer", **kwargs):
        # the evaluation metrics are recorded by now
        if self.watch_metric is not None and self._improved(trainer, self.watch_metric):
            self._save(trainer, {"best"}, f"epoch_{trainer.run_history.current_epoch}")

    def on_training_run_end(self, trainer: "Trainer", **kwargs):
        # even right after another save: scripts load "<save_dir>/final" as pytorch-accelerated's docs do; a run its
        # time budget (train(max_time=...)) stopped is saved even without save_at_end, so that it can be continued
        if self.save_at_end or trainer.run_state.stopped_by_time_budget:
            self._save(trainer, {"rolling"}, "final")

    def _step_kinds(self, done: int) -> set[str]:
        kinds: set[str] = set()
        if done == 0 or done == self._last_saved_step:
            return kinds
        if self.save_every_n_steps and done % self.save_every_n_steps == 0:
            kinds.add("rolling")
        if self.keep_every_n_steps and done % self.keep_every_n_steps == 0:
            kinds.add("permanent")
        return kinds

    def _improved(self, trainer: "Trainer", watch_metric: str) -> bool:
        names = trainer.run_history.get_metric_names()
        if watch_metric not in names:
            raise ValueError(
                f"SaveTrainingStateCallback(watch_metric={watch_metric!r}): no such metric in the run history; "
                f"the metrics are {sorted(names)}."
            )
        current = trainer.run_history.get_latest_metric(watch_metric)
        if self.best_metric is None or self.is_better(current, self.best_metric):
            self.best_metric = float(current)
            return True
        return False

    def _save(self, trainer: "Trainer", kinds: set, name: str) -> None:
        trainer.save_training_state(
            self.save_dir,
            kinds=kinds,
            max_checkpoints=self.max_checkpoints,
            asynchronous=self.asynchronous,
            name=name,
            allow_other_runs=self.allow_other_runs,
        )
        self._last_saved_step = trainer.num_update_steps_completed
